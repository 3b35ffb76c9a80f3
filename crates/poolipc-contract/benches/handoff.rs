//! What the contract costs on the CPU: the two machines taking a job of one tensor and of
//! 1000 through EXPORT, READY, IMPORT, DONE, UNIMPORT, ACK and RELEASE, messages passed by
//! hand. Everything the facade adds (driver calls, frames, sockets) comes on top.
//! Run: `cargo bench -p poolipc-contract --bench handoff`.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use poolipc_contract::{
    AllocId, ImportLimit, JobId, Parent, ParentAction, ParentConfig, ParentEvent, Span, Timestamp,
    Worker, WorkerAction, WorkerEvent, WorkerId,
};

const W: WorkerId = WorkerId(1);
const T0: Timestamp = Timestamp(0);

/// One job of `n` tensors, each its own allocation, from lend to release. Returns how many
/// handoffs were released.
fn job(p: &mut Parent, w: &mut Worker, job: u64, n: u64) -> usize {
    for i in 0..n {
        let span = Span {
            ptr: (1 << 40) + i * (1 << 21),
            bytes: 4096,
        };
        p.lend(W, JobId(job), AllocId(i), span, T0).expect("lend");
    }
    while let Some(a) = p.poll_action() {
        if let ParentAction::Send { message, .. } = a {
            w.handle(WorkerEvent::Message(message), T0).expect("offer");
        }
    }
    let mut usable = Vec::new();
    while let Some(a) = w.poll_action() {
        if let WorkerAction::Usable { handoff, .. } = a {
            usable.push(handoff);
        }
    }
    for h in usable {
        w.finish(h).expect("finish");
    }
    while let Some(a) = w.poll_action() {
        if let WorkerAction::Send(message) = a {
            p.handle(ParentEvent::Message { worker: W, message }, T0)
                .expect("done and ack");
        }
    }
    let mut released = 0;
    while let Some(a) = p.poll_action() {
        if matches!(a, ParentAction::Release { .. }) {
            released += 1;
        }
    }
    released
}

fn handoff(c: &mut Criterion) {
    let mut group = c.benchmark_group("job");
    for n in [1u64, 1000] {
        group.throughput(Throughput::Elements(n));
        group.bench_function(BenchmarkId::new("lend to release", n), |b| {
            let mut p = Parent::new(ParentConfig {
                limit: ImportLimit::default(),
                handoff_timeout: Duration::from_secs(30),
            });
            p.add_worker(W).expect("worker");
            let mut w = Worker::new();
            let mut next = 0;
            // Every tensor must come back: a benchmark of a broken cycle measures nothing.
            assert_eq!(job(&mut p, &mut w, next, n), n as usize);
            b.iter(|| {
                next += 1;
                black_box(job(&mut p, &mut w, next, n))
            });
        });
    }
    group.finish();
}

criterion_group!(benches, handoff);
criterion_main!(benches);
