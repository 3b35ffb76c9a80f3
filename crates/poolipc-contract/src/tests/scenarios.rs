//! Single behaviours of the two machines, step by step.

use std::time::Duration;

use crate::legacy::{Offer, Refusal, ToParent, ToWorker};
use crate::parent::{FailReason, Parent, ParentAction, ParentConfig, ParentEvent};
use crate::types::{
    AllocId, DType, HandoffId, JobId, Outcome, Purpose, RequestId, ResultSpec, Span, Timestamp,
    WorkerId,
};
use crate::worker::{Worker, WorkerAction, WorkerEvent};
use crate::{ContractError, ImportLimit};

const W0: WorkerId = WorkerId(0);
const W1: WorkerId = WorkerId(1);
const JOB: JobId = JobId(1);
const T0: Timestamp = Timestamp(0);
const SMALL: Span = Span {
    ptr: 1 << 30,
    bytes: 4096,
};

fn parent() -> Parent {
    let mut p = Parent::new(ParentConfig {
        limit: ImportLimit::default(),
        handoff_timeout: Duration::from_millis(10),
    });
    for w in [W0, W1] {
        p.add_worker(w).expect("fresh worker ids");
    }
    p
}

fn drain_parent(p: &mut Parent) -> Vec<ParentAction> {
    std::iter::from_fn(|| p.poll_action()).collect()
}

fn drain_worker(w: &mut Worker) -> Vec<WorkerAction> {
    std::iter::from_fn(|| w.poll_action()).collect()
}

fn offer_of(actions: &[ParentAction]) -> Offer {
    actions
        .iter()
        .find_map(|a| match a {
            ParentAction::Send {
                message: ToWorker::Offer(o),
                ..
            } => Some(o.clone()),
            _ => None,
        })
        .expect("an offer")
}

fn ack(handoff: HandoffId) -> ParentEvent {
    ParentEvent::Message {
        worker: W0,
        message: ToParent::Ack { handoff },
    }
}

#[test]
fn a_lent_input_goes_export_ready_offer_and_is_released_after_ack_and_done_wait() {
    let mut p = parent();
    let h = p.lend(W0, JOB, AllocId(9), SMALL, T0).expect("lend");
    let actions = drain_parent(&mut p);
    assert!(matches!(
        actions[0],
        ParentAction::Export {
            alloc: AllocId(9),
            ..
        }
    ));
    assert_eq!(actions[1], ParentAction::RecordReady { handoff: h });
    assert!(matches!(
        actions[2],
        ParentAction::Send {
            message: ToWorker::Offer(_),
            ..
        }
    ));
    assert_eq!(actions.len(), 3);

    p.handle(ack(h), T0).expect("ack");
    let actions = drain_parent(&mut p);
    assert_eq!(actions[0], ParentAction::WaitDone { handoff: h });
    assert!(matches!(
        actions[1],
        ParentAction::Release { handoff, outcome: Outcome::Completed, .. } if handoff == h
    ));
    assert_eq!(p.outstanding(), 0);
}

#[test]
fn an_allocation_above_the_import_limit_is_refused_for_pointer_import() {
    let mut p = parent();
    let big = Span {
        ptr: 4096,
        bytes: 128 * (32 << 20),
    };
    let got = p.lend(W0, JOB, AllocId(9), big, T0);
    assert!(matches!(got, Err(ContractError::AboveImportLimit { .. })));
    assert!(drain_parent(&mut p).is_empty());
}

#[test]
fn an_allocation_lent_twice_at_once_is_exported_once() {
    let mut p = parent();
    p.lend(W0, JOB, AllocId(9), SMALL, T0).expect("lend");
    p.lend(W1, JOB, AllocId(9), SMALL, T0).expect("lend");
    let exports = drain_parent(&mut p)
        .into_iter()
        .filter(|a| matches!(a, ParentAction::Export { .. }))
        .count();
    assert_eq!(exports, 1);
}

#[test]
fn the_worker_imports_an_allocation_once_and_unimports_after_its_last_handoff() {
    let mut w = Worker::new();
    let offer = |h| {
        WorkerEvent::Message(ToWorker::Offer(Offer {
            handoff: HandoffId(h),
            job: JOB,
            alloc: AllocId(9),
            span: SMALL,
            purpose: Purpose::Input,
        }))
    };
    w.handle(offer(1), T0).expect("first");
    w.handle(offer(2), T0).expect("second");
    let imports = drain_worker(&mut w)
        .into_iter()
        .filter(|a| matches!(a, WorkerAction::Import { .. }))
        .count();
    assert_eq!(imports, 1);

    w.finish(HandoffId(1)).expect("finish");
    let first = drain_worker(&mut w);
    assert!(
        !first
            .iter()
            .any(|a| matches!(a, WorkerAction::Unimport { .. }))
    );

    w.finish(HandoffId(2)).expect("finish");
    assert_eq!(
        drain_worker(&mut w),
        vec![
            WorkerAction::RecordDone {
                handoff: HandoffId(2)
            },
            WorkerAction::Unimport { alloc: AllocId(9) },
            WorkerAction::Send(ToParent::Ack {
                handoff: HandoffId(2)
            }),
        ]
    );
}

#[test]
fn the_worker_waits_on_ready_before_the_memory_is_usable() {
    let mut w = Worker::new();
    let o = Offer {
        handoff: HandoffId(1),
        job: JOB,
        alloc: AllocId(9),
        span: SMALL,
        purpose: Purpose::Input,
    };
    w.handle(WorkerEvent::Message(ToWorker::Offer(o)), T0)
        .expect("offer");
    let actions = drain_worker(&mut w);
    let wait = actions
        .iter()
        .position(|a| matches!(a, WorkerAction::WaitReady { .. }));
    let usable = actions
        .iter()
        .position(|a| matches!(a, WorkerAction::Usable { .. }));
    assert!(wait.is_some() && wait < usable);
}

#[test]
fn a_duplicated_or_reordered_offer_is_never_imported() {
    let mut w = Worker::new();
    let o = |h| Offer {
        handoff: HandoffId(h),
        job: JOB,
        alloc: AllocId(h),
        span: SMALL,
        purpose: Purpose::Input,
    };
    w.handle(WorkerEvent::Message(ToWorker::Offer(o(5))), T0)
        .expect("offer");
    drain_worker(&mut w);
    let got = w.handle(WorkerEvent::Message(ToWorker::Offer(o(4))), T0);
    assert_eq!(got, Err(ContractError::StaleOffer(HandoffId(4))));
    assert!(drain_worker(&mut w).is_empty());
}

#[test]
fn a_result_is_allocated_by_the_parent_offered_for_writing_and_delivered_after_ack() {
    let mut p = parent();
    let spec = ResultSpec {
        shape: vec![2, 8],
        dtype: DType::F32,
        bytes: 64,
    };
    let request = ToParent::ResultRequest {
        job: JOB,
        request: RequestId(0),
        spec: spec.clone(),
    };
    p.handle(
        ParentEvent::Message {
            worker: W0,
            message: request,
        },
        T0,
    )
    .expect("request");
    assert_eq!(
        drain_parent(&mut p),
        vec![ParentAction::AllocateResult {
            worker: W0,
            job: JOB,
            request: RequestId(0),
            spec
        }]
    );
    let allocated = ParentEvent::ResultAllocated {
        worker: W0,
        request: RequestId(0),
        alloc: AllocId(77),
        span: SMALL,
    };
    p.handle(allocated, T0).expect("allocated");
    let offer = offer_of(&drain_parent(&mut p));
    assert_eq!(
        offer.purpose,
        Purpose::Result {
            request: RequestId(0)
        }
    );
    assert_eq!(offer.alloc, AllocId(77));

    p.handle(ack(offer.handoff), T0).expect("ack");
    assert!(drain_parent(&mut p).iter().any(|a| matches!(
        a,
        ParentAction::Release {
            outcome: Outcome::Completed,
            purpose: Purpose::Result { .. },
            ..
        }
    )));
}

#[test]
fn a_result_allocation_above_the_limit_is_freed_and_refused() {
    let mut p = parent();
    let spec = ResultSpec {
        shape: vec![1],
        dtype: DType::U8,
        bytes: 1,
    };
    let request = ToParent::ResultRequest {
        job: JOB,
        request: RequestId(0),
        spec,
    };
    p.handle(
        ParentEvent::Message {
            worker: W0,
            message: request,
        },
        T0,
    )
    .expect("request");
    drain_parent(&mut p);
    let huge = Span {
        ptr: 0,
        bytes: 1 << 40,
    };
    let allocated = ParentEvent::ResultAllocated {
        worker: W0,
        request: RequestId(0),
        alloc: AllocId(5),
        span: huge,
    };
    p.handle(allocated, T0).expect("allocated");
    let actions = drain_parent(&mut p);
    assert!(matches!(
        actions[0],
        ParentAction::FreeResult {
            alloc: AllocId(5),
            ..
        }
    ));
    assert!(matches!(
        actions[1],
        ParentAction::Send {
            message: ToWorker::ResultRefused {
                reason: Refusal::AboveImportLimit,
                ..
            },
            ..
        }
    ));
}

#[test]
fn a_late_ack_after_the_deadline_is_refused_and_release_waits_for_reaping() {
    let mut p = parent();
    let h = p.lend(W0, JOB, AllocId(9), SMALL, T0).expect("lend");
    drain_parent(&mut p);
    let late = Timestamp(20_000_000);
    assert!(p.poll_timeout().is_some_and(|t| t <= late));
    p.handle_timeout(late);
    let actions = drain_parent(&mut p);
    assert!(actions.contains(&ParentAction::JobFailed {
        worker: W0,
        job: JOB,
        reason: FailReason::DeadlineExpired
    }));
    assert!(actions.contains(&ParentAction::KillWorker { worker: W0 }));

    assert_eq!(p.handle(ack(h), late), Err(ContractError::WorkerGone(W0)));
    assert!(drain_parent(&mut p).is_empty());

    p.handle(ParentEvent::WorkerReaped { worker: W0 }, late)
        .expect("reaped");
    assert!(drain_parent(&mut p).iter().any(|a| matches!(
        a,
        ParentAction::Release { outcome: Outcome::Failed, handoff, .. } if *handoff == h
    )));
}

#[test]
fn a_dead_worker_fails_only_its_own_jobs_and_the_others_keep_working() {
    let mut p = parent();
    p.lend(W0, JOB, AllocId(1), SMALL, T0).expect("lend");
    let other = p.lend(W1, JOB, AllocId(2), SMALL, T0).expect("lend");
    drain_parent(&mut p);

    p.handle(ParentEvent::WorkerHungUp { worker: W0 }, T0)
        .expect("hung up");
    let on_hang_up = drain_parent(&mut p);
    assert!(
        !on_hang_up
            .iter()
            .any(|a| matches!(a, ParentAction::Release { .. }))
    );

    p.handle(ParentEvent::WorkerReaped { worker: W0 }, T0)
        .expect("reaped");
    for a in drain_parent(&mut p) {
        if let ParentAction::Release { worker, .. } | ParentAction::JobFailed { worker, .. } = a {
            assert_eq!(worker, W0);
        }
    }
    assert_eq!(p.outstanding_for(W1), 1);
    p.lend(W1, JobId(2), AllocId(3), SMALL, T0)
        .expect("the other worker still takes work");
    assert!(
        p.handle(
            ParentEvent::Message {
                worker: W1,
                message: ToParent::Ack { handoff: other }
            },
            T0
        )
        .is_ok()
    );
}

#[test]
fn shutdown_refuses_new_work_and_completes_when_nothing_is_outstanding() {
    let mut p = parent();
    let h = p.lend(W0, JOB, AllocId(9), SMALL, T0).expect("lend");
    drain_parent(&mut p);
    p.shutdown();
    assert!(drain_parent(&mut p).iter().all(|a| matches!(
        a,
        ParentAction::Send {
            message: ToWorker::Shutdown,
            ..
        }
    )));
    assert_eq!(
        p.lend(W1, JOB, AllocId(1), SMALL, T0),
        Err(ContractError::ShuttingDown)
    );
    assert!(!p.is_shut_down());
    p.handle(ack(h), T0).expect("ack");
    assert_eq!(
        drain_parent(&mut p).last(),
        Some(&ParentAction::ShutdownComplete)
    );
    assert!(p.is_shut_down());
}

#[test]
fn a_cancelled_job_still_ends_with_ack_and_is_released_as_cancelled() {
    let mut p = parent();
    let h = p.lend(W0, JOB, AllocId(9), SMALL, T0).expect("lend");
    drain_parent(&mut p);
    p.cancel(W0, JOB).expect("cancel");
    assert_eq!(
        drain_parent(&mut p),
        vec![ParentAction::Send {
            worker: W0,
            message: ToWorker::Cancel { job: JOB }
        }]
    );
    assert_eq!(
        p.lend(W0, JOB, AllocId(1), SMALL, T0),
        Err(ContractError::JobCancelled {
            worker: W0,
            job: JOB
        })
    );
    p.handle(ack(h), T0).expect("ack");
    assert!(drain_parent(&mut p).iter().any(|a| matches!(
        a,
        ParentAction::Release {
            outcome: Outcome::Cancelled,
            ..
        }
    )));
}
