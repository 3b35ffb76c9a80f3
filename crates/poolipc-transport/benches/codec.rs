//! What the wire costs on the CPU: encoding and decoding a `Lend` of one tensor and of a batch
//! of 1000 (the batch target is 40 000 tensors/s end to end), beside a plain copy of the same
//! frame's bytes as the floor. Run: `cargo bench -p poolipc-transport --bench codec`.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use poolipc_transport::Layout;
use poolipc_transport::codec::{decode, encode};
use poolipc_transport::{
    AllocId, DType, EventBlob, ExportBlob, FrameLimits, HandoffId, JobId, Lend, LentTensor,
    Message, Rung, TensorMeta,
};

fn lend(n: u64) -> Message {
    Message::Lend(Lend {
        job: JobId(1),
        tensors: (0..n)
            .map(|i| LentTensor {
                handle: HandoffId(i),
                alloc: AllocId(i / 2),
                rung: Rung::PoolPointer,
                pool: 0,
                export: ExportBlob([i as u8; 64]),
                ready_event: EventBlob([!(i as u8); 64]),
                meta: TensorMeta {
                    layout: Layout {
                        dtype: DType::F32,
                        shape: vec![1, 4, 32, 32],
                        strides: vec![4096, 1024, 32, 1],
                    },
                    byte_offset: 0,
                    byte_len: 16_384,
                },
                read_only: false,
                arena: None,
            })
            .collect(),
        slice: None,
    })
}

fn codec(c: &mut Criterion) {
    let limits = FrameLimits::default();
    let mut group = c.benchmark_group("lend");
    for n in [1u64, 1000] {
        let msg = lend(n);
        let frame = encode(&msg, limits).expect("a lend encodes");
        group.throughput(Throughput::Elements(n));
        group.bench_with_input(BenchmarkId::new("encode", n), &msg, |b, msg| {
            b.iter(|| encode(black_box(msg), limits).expect("encodes"));
        });
        group.bench_with_input(BenchmarkId::new("decode", n), &frame, |b, frame| {
            b.iter(|| decode(black_box(frame), limits).expect("decodes"));
        });
        group.bench_with_input(BenchmarkId::new("copy floor", n), &frame, |b, frame| {
            b.iter(|| black_box(frame).clone());
        });
    }
    group.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
