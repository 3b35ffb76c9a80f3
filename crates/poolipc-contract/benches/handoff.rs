//! What the contract costs on the CPU: the two machines taking a job of one tensor and of
//! 1000 from `start_job` to `JobFinished`: the `Lend`, imports, READY wait, the job's end
//! (frees, DONE, `Done`, `Ack`), the parent's waits on DONE and releases, messages passed
//! by hand. Everything the facade adds (driver calls, frames, sockets) comes on top.
//! Run: `cargo bench -p poolipc-contract --bench handoff`.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use poolipc_contract::Layout;
use poolipc_contract::{
    AllocId, DType, EventBlob, ExportBlob, ImportLimit, InputLoan, JobId, JobOutcome, Parent,
    ParentAction, ParentConfig, ParentEvent, Rung, Span, TensorMeta, Timestamp, Worker,
    WorkerAction, WorkerId,
};

const W: WorkerId = WorkerId(1);
const T0: Timestamp = Timestamp(0);
const READY: EventBlob = EventBlob([1; 64]);
const DONE: EventBlob = EventBlob([2; 64]);

fn inputs(n: u64) -> Vec<InputLoan> {
    (0..n)
        .map(|i| InputLoan {
            alloc: AllocId(i),
            span: Span {
                ptr: (1 << 40) + i * (1 << 21),
                bytes: 4096,
            },
            rung: Rung::PoolPointer,
            pool: 0,
            export: ExportBlob([3; 64]),
            meta: TensorMeta {
                layout: Layout {
                    dtype: DType::F32,
                    shape: vec![1024],
                    strides: vec![1],
                },
                byte_offset: 0,
                byte_len: 4096,
            },
            arena: None,
            read_only: false,
        })
        .collect()
}

/// One job of `n` tensors, each its own allocation, from `start_job` to `JobFinished`.
/// Returns how many handoffs were released.
fn job(p: &mut Parent, w: &mut Worker, job: u64, loans: Vec<InputLoan>) -> usize {
    let job = JobId(job);
    p.start_job(W, job, READY, loans, T0).expect("start_job");
    while let Some(a) = p.poll_action() {
        if let ParentAction::Send { message, .. } = a {
            w.handle(message, T0).expect("lend");
        }
    }
    let mut started = false;
    while let Some(a) = w.poll_action() {
        started |= matches!(a, WorkerAction::JobStarted { .. });
    }
    assert!(started);
    w.finish_job(job, DONE).expect("finish");
    while let Some(a) = w.poll_action() {
        if let WorkerAction::Send(message) = a {
            p.handle(ParentEvent::Received { worker: W, message }, T0)
                .expect("done and ack");
        }
    }
    let mut released = 0;
    let mut finished = false;
    while let Some(a) = p.poll_action() {
        match a {
            ParentAction::Release { .. } => released += 1,
            ParentAction::JobFinished { outcome, .. } => {
                finished = outcome == JobOutcome::Completed;
            }
            _ => {}
        }
    }
    assert!(finished);
    released
}

fn handoff(c: &mut Criterion) {
    let mut group = c.benchmark_group("job");
    for n in [1u64, 1000] {
        group.throughput(Throughput::Elements(n));
        group.bench_function(BenchmarkId::new("start_job to JobFinished", n), |b| {
            let mut p = Parent::new(ParentConfig {
                limit: ImportLimit::default(),
                handoff_timeout: Duration::from_secs(30),
                ..ParentConfig::default()
            });
            p.add_worker(W).expect("worker");
            let mut w = Worker::new();
            let loans = inputs(n);
            let mut next = 0;
            // Every tensor must come back: a benchmark of a broken cycle measures nothing.
            assert_eq!(job(&mut p, &mut w, next, loans.clone()), n as usize);
            b.iter_batched(
                || loans.clone(),
                |loans| {
                    next += 1;
                    black_box(job(&mut p, &mut w, next, loans))
                },
                criterion::BatchSize::SmallInput,
            );
        });
    }
    group.finish();
}

criterion_group!(benches, handoff);
criterion_main!(benches);
