//! Single behaviours of the two machines, step by step.

use std::time::Duration;

use crate::Layout;
use crate::message::{
    Ack, Done, ErrorCode, Lend, Message, ResultGrant, ResultRequest, ResultSpec, TensorMeta,
};
use crate::parent::{
    Bound, FailReason, InputLoan, JobOutcome, Parent, ParentAction, ParentConfig, ParentEvent,
};
use crate::types::{
    AllocId, DType, EventBlob, ExportBlob, HandoffId, JobId, Outcome, Purpose, RequestId, Rung,
    Span, Timestamp, WorkerId,
};
use crate::worker::{Worker, WorkerAction};
use crate::{ContractError, ImportLimit};

const W0: WorkerId = WorkerId(0);
const W1: WorkerId = WorkerId(1);
const JOB: JobId = JobId(1);
const T0: Timestamp = Timestamp(0);
const MS: u64 = 1_000_000;
const CHUNK: u64 = 32 << 20;

fn at(ms: u64) -> Timestamp {
    Timestamp(ms * MS)
}

fn parent() -> Parent {
    let mut p = Parent::new(ParentConfig {
        limit: ImportLimit::default(),
        handoff_timeout: Duration::from_millis(10),
        ..ParentConfig::default()
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

fn blob(tag: u8, n: u64) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[0] = tag;
    b[1..9].copy_from_slice(&n.to_le_bytes());
    b
}

fn ready(n: u64) -> EventBlob {
    EventBlob(blob(1, n))
}

fn done_event(n: u64) -> EventBlob {
    EventBlob(blob(2, n))
}

fn meta(bytes: u64) -> TensorMeta {
    TensorMeta {
        layout: Layout {
            dtype: DType::U8,
            shape: vec![bytes],
            strides: vec![1],
        },
        byte_offset: 0,
        byte_len: bytes,
    }
}

fn span_of(alloc: u64, bytes: u64) -> Span {
    Span {
        ptr: (alloc + 1) * 1024 * CHUNK,
        bytes,
    }
}

fn pointer(alloc: u64) -> InputLoan {
    InputLoan {
        alloc: AllocId(alloc),
        span: span_of(alloc, 4096),
        rung: Rung::PoolPointer,
        pool: 0,
        export: ExportBlob(blob(3, alloc)),
        meta: meta(4096),
        arena: None,
        read_only: false,
    }
}

fn staged(alloc: u64, bytes: u64) -> InputLoan {
    InputLoan {
        alloc: AllocId(alloc),
        span: span_of(alloc, bytes),
        rung: Rung::HostStaging,
        pool: 0,
        export: ExportBlob([0; 64]),
        meta: meta(bytes),
        arena: None,
        read_only: false,
    }
}

fn read_only(loan: InputLoan) -> InputLoan {
    InputLoan {
        read_only: true,
        ..loan
    }
}

/// 129 chunks: above the default limit.
fn huge(alloc: u64) -> InputLoan {
    InputLoan {
        span: span_of(alloc, 129 * CHUNK),
        meta: meta(129 * CHUNK),
        ..pointer(alloc)
    }
}

fn spec(elements: u64) -> ResultSpec {
    ResultSpec {
        dtype: DType::F32,
        shape: vec![elements],
        byte_len: elements * 4,
    }
}

fn received(worker: WorkerId, message: Message) -> ParentEvent {
    ParentEvent::Received { worker, message }
}

fn sent_messages(actions: &[ParentAction]) -> Vec<Message> {
    actions
        .iter()
        .filter_map(|a| match a {
            ParentAction::Send { message, .. } => Some(message.clone()),
            _ => None,
        })
        .collect()
}

fn lend_of(actions: &[ParentAction]) -> Lend {
    sent_messages(actions)
        .into_iter()
        .find_map(|m| match m {
            Message::Lend(l) => Some(l),
            _ => None,
        })
        .expect("a Lend")
}

fn job_finished(actions: &[ParentAction], job: JobId) -> JobOutcome {
    actions
        .iter()
        .find_map(|a| match a {
            ParentAction::JobFinished {
                job: j, outcome, ..
            } if *j == job => Some(outcome.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no JobFinished for {job} in {actions:#?}"))
}

fn kills(actions: &[ParentAction]) -> Vec<WorkerId> {
    actions
        .iter()
        .filter_map(|a| match a {
            ParentAction::KillWorker { worker } => Some(*worker),
            _ => None,
        })
        .collect()
}

fn releases(actions: &[ParentAction]) -> Vec<(HandoffId, Outcome)> {
    actions
        .iter()
        .filter_map(|a| match a {
            ParentAction::Release {
                handoff, outcome, ..
            } => Some((*handoff, *outcome)),
            _ => None,
        })
        .collect()
}

/// One parent and the worker machine of W0, wired by hand: the parent's messages go to the
/// worker, the worker's to the parent; result requests are answered at once with fresh
/// allocations on `result_rung`.
struct Pair {
    p: Parent,
    w: Worker,
    log: Vec<ParentAction>,
    wlog: Vec<WorkerAction>,
    next_alloc: u64,
    result_rung: Rung,
}

impl Pair {
    fn new() -> Pair {
        Pair {
            p: parent(),
            w: Worker::new(),
            log: Vec::new(),
            wlog: Vec::new(),
            next_alloc: 1000,
            result_rung: Rung::PoolPointer,
        }
    }

    /// Carries every action out until neither side has any left.
    fn pump(&mut self) {
        loop {
            let mut progressed = false;
            while let Some(a) = self.p.poll_action() {
                progressed = true;
                match &a {
                    ParentAction::Send {
                        worker: W0,
                        message,
                    } => {
                        self.w
                            .handle(message.clone(), T0)
                            .expect("the worker takes it");
                    }
                    ParentAction::AllocateResult {
                        worker,
                        request,
                        spec,
                        ..
                    } => {
                        let alloc = self.next_alloc;
                        self.next_alloc += 1;
                        let pointer = self.result_rung == Rung::PoolPointer;
                        let event = if self.result_rung == Rung::Arena {
                            ParentEvent::ResultAllocatedInArena {
                                worker: *worker,
                                request: *request,
                                alloc: AllocId(alloc),
                                span: span_of(alloc, spec.byte_len),
                                chunk: 1,
                                offset: 4096,
                            }
                        } else {
                            ParentEvent::ResultAllocated {
                                worker: *worker,
                                request: *request,
                                alloc: AllocId(alloc),
                                span: span_of(alloc, spec.byte_len),
                                rung: self.result_rung,
                                pool: 0,
                                export: if pointer {
                                    ExportBlob(blob(3, alloc))
                                } else {
                                    ExportBlob([0; 64])
                                },
                            }
                        };
                        self.p.handle(event, T0).expect("a pending request");
                    }
                    _ => {}
                }
                self.log.push(a);
            }
            while let Some(a) = self.w.poll_action() {
                progressed = true;
                if let WorkerAction::Send(m) = &a {
                    self.p
                        .handle(received(W0, m.clone()), T0)
                        .expect("W0 is known");
                }
                self.wlog.push(a);
            }
            if !progressed {
                break;
            }
        }
    }

    fn take_logs(&mut self) -> (Vec<ParentAction>, Vec<WorkerAction>) {
        (
            std::mem::take(&mut self.log),
            std::mem::take(&mut self.wlog),
        )
    }
}

// The parent: starting jobs.

#[test]
fn a_job_records_ready_then_sends_one_lend_then_pushes_its_staged_inputs() {
    let mut p = parent();
    let handles = p
        .start_job(
            W0,
            JOB,
            ready(1),
            vec![pointer(1), staged(2, 100), pointer(3), staged(4, 7)],
            T0,
        )
        .expect("start");
    let actions = drain_parent(&mut p);
    assert_eq!(
        actions[0],
        ParentAction::RecordReady {
            worker: W0,
            job: JOB
        }
    );
    let ParentAction::Send {
        worker: W0,
        message: Message::Lend(lend),
    } = &actions[1]
    else {
        panic!("a Lend second: {actions:#?}");
    };
    assert_eq!(lend.job, JOB);
    let sent: Vec<HandoffId> = lend.tensors.iter().map(|t| t.handle).collect();
    assert_eq!(sent, handles, "handles in input order");
    assert_eq!(lend.tensors[0].ready_event, ready(1));
    assert_eq!(lend.tensors[0].export, ExportBlob(blob(3, 1)));
    assert_eq!(lend.tensors[1].rung, Rung::HostStaging);
    assert_eq!(
        lend.tensors[1].ready_event,
        EventBlob([0; 64]),
        "no READY for staging"
    );
    assert_eq!(lend.tensors[1].export, ExportBlob([0; 64]));
    assert_eq!(
        actions[2..],
        [
            ParentAction::SendStaged {
                worker: W0,
                job: JOB,
                handoff: handles[1]
            },
            ParentAction::SendStaged {
                worker: W0,
                job: JOB,
                handoff: handles[3]
            },
        ]
    );
    assert_eq!(p.outstanding(), 4);
    assert_eq!(p.jobs_of(W0), vec![JOB]);
}

#[test]
fn a_job_without_inputs_sends_an_empty_lend_and_records_no_ready() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), Vec::new(), T0)
        .expect("start");
    let actions = drain_parent(&mut p);
    assert_eq!(
        actions,
        [ParentAction::Send {
            worker: W0,
            message: Message::Lend(Lend {
                job: JOB,
                tensors: Vec::new(),
                slice: None,
            }),
        }]
    );
}

#[test]
fn a_job_of_only_staged_inputs_records_no_ready() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), vec![staged(1, 10)], T0)
        .expect("start");
    let actions = drain_parent(&mut p);
    assert!(
        !actions
            .iter()
            .any(|a| matches!(a, ParentAction::RecordReady { .. }))
    );
}

#[test]
fn a_start_job_refused_above_the_limit_queues_nothing_and_the_next_job_goes_through() {
    let mut p = parent();
    let got = p.start_job(W0, JOB, ready(1), vec![pointer(1), huge(2)], T0);
    assert!(
        matches!(
            got,
            Err(ContractError::AboveImportLimit {
                alloc: AllocId(2),
                ..
            })
        ),
        "{got:?}"
    );
    assert_eq!(p.poll_action(), None, "nothing queued");
    assert_eq!(p.outstanding(), 0);
    assert!(p.jobs_of(W0).is_empty());
    // The same job, with the big tensor staged, and the worker is unharmed.
    p.start_job(
        W0,
        JOB,
        ready(1),
        vec![
            pointer(1),
            InputLoan {
                rung: Rung::HostStaging,
                export: ExportBlob([0; 64]),
                ..huge(2)
            },
        ],
        T0,
    )
    .expect("a staged input has no limit");
    assert!(p.is_live(W0));
    assert_eq!(p.outstanding(), 2);
}

#[test]
fn an_allocation_lent_with_another_range_is_refused() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    let other = InputLoan {
        span: span_of(1, 8192),
        ..pointer(1)
    };
    let got = p.start_job(W1, JobId(2), ready(2), vec![other], T0);
    assert_eq!(
        got,
        Err(ContractError::AllocationMismatch { alloc: AllocId(1) })
    );
    assert_eq!(p.poll_action(), None);
}

#[test]
fn a_job_id_open_on_the_worker_is_refused() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), Vec::new(), T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    assert_eq!(
        p.start_job(W0, JOB, ready(1), Vec::new(), T0),
        Err(ContractError::JobExists(JOB))
    );
    assert_eq!(p.poll_action(), None);
}

// The whole cycle, both machines.

#[test]
fn a_pointer_job_goes_lend_import_ready_request_grant_unimport_done_ack_and_release() {
    let mut pair = Pair::new();
    let handles = pair
        .p
        .start_job(
            W0,
            JOB,
            ready(1),
            vec![pointer(1), pointer(1), pointer(2)],
            T0,
        )
        .expect("start");
    pair.pump();
    let (_, wlog) = pair.take_logs();
    // One import per allocation, then one wait, then the job.
    assert!(
        matches!(wlog[0], WorkerAction::Import { alloc: AllocId(1), handoff, .. } if handoff == handles[0])
    );
    assert!(matches!(
        wlog[1],
        WorkerAction::Import {
            alloc: AllocId(2),
            ..
        }
    ));
    assert_eq!(
        wlog[2],
        WorkerAction::WaitReady {
            job: JOB,
            ready_event: ready(1)
        }
    );
    assert!(
        matches!(&wlog[3], WorkerAction::JobStarted { job: JOB, inputs, slice: None } if inputs.len() == 3)
    );
    assert_eq!(wlog.len(), 4);

    pair.w
        .request_results(JOB, vec![spec(16)])
        .expect("request");
    pair.pump();
    let (log, mut wlog) = pair.take_logs();
    assert!(matches!(
        wlog.remove(0),
        WorkerAction::Send(Message::ResultRequest(_))
    ));
    assert!(matches!(
        log[0],
        ParentAction::AllocateResult {
            request: RequestId(0),
            ..
        }
    ));
    assert_eq!(
        log[1],
        ParentAction::RecordReady {
            worker: W0,
            job: JOB
        }
    );
    let Some(Message::AllocationGrant(grant)) = sent_messages(&log).pop() else {
        panic!("a grant: {log:#?}");
    };
    let ResultGrant::Granted {
        handle: result,
        ready_event,
        rung,
        ..
    } = grant.results[0].clone()
    else {
        panic!("granted");
    };
    assert_eq!((ready_event, rung), (ready(1), Rung::PoolPointer));
    assert!(matches!(
        wlog[0],
        WorkerAction::Import {
            alloc: AllocId(1000),
            ..
        }
    ));
    assert_eq!(
        wlog[1],
        WorkerAction::WaitReady {
            job: JOB,
            ready_event: ready(1)
        }
    );
    assert!(matches!(
        wlog[2],
        WorkerAction::ResultsGranted { job: JOB, .. }
    ));

    pair.w.finish_job(JOB, done_event(1)).expect("finish");
    pair.pump();
    let (log, wlog) = pair.take_logs();
    let all = vec![handles[0], handles[1], handles[2], result];
    assert_eq!(
        wlog,
        [
            WorkerAction::Unimport { alloc: AllocId(1) },
            WorkerAction::Unimport { alloc: AllocId(2) },
            WorkerAction::Unimport {
                alloc: AllocId(1000)
            },
            WorkerAction::RecordDone { job: JOB },
            WorkerAction::Send(Message::Done(Done {
                job: JOB,
                done_event: done_event(1),
                handles: all.clone(),
                carved: Vec::new(),
            })),
            WorkerAction::Send(Message::Ack(Ack {
                job: JOB,
                handles: all.clone()
            })),
        ]
    );
    // Per handle: wait on DONE right before its release; then the job's end.
    let mut expected = Vec::new();
    for (i, h) in all.iter().enumerate() {
        expected.push(ParentAction::WaitDone {
            worker: W0,
            job: JOB,
            handoff: *h,
            done_event: done_event(1),
        });
        let (alloc, purpose) = match i {
            0 | 1 => (AllocId(1), Purpose::Input),
            2 => (AllocId(2), Purpose::Input),
            _ => (
                AllocId(1000),
                Purpose::Result {
                    request: RequestId(0),
                },
            ),
        };
        expected.push(ParentAction::Release {
            worker: W0,
            job: JOB,
            handoff: *h,
            alloc,
            purpose,
            rung: Rung::PoolPointer,
            outcome: Outcome::Completed,
        });
    }
    expected.push(ParentAction::JobFinished {
        worker: W0,
        job: JOB,
        outcome: JobOutcome::Completed,
    });
    assert_eq!(log, expected);
    assert_eq!(
        (
            pair.p.outstanding(),
            pair.w.held(),
            pair.w.imports().count()
        ),
        (0, 0, 0)
    );
}

#[test]
fn staged_inputs_and_results_are_ordinary_loans_moved_by_send_and_receive_staged() {
    let mut pair = Pair::new();
    pair.result_rung = Rung::HostStaging;
    // Read-only: its bytes do not come back (see the copy-back test below).
    let handles = pair
        .p
        .start_job(
            W0,
            JOB,
            ready(1),
            vec![read_only(staged(1, 64)), pointer(2)],
            T0,
        )
        .expect("start");
    pair.pump();
    let (log, wlog) = pair.take_logs();
    assert!(log.contains(&ParentAction::SendStaged {
        worker: W0,
        job: JOB,
        handoff: handles[0]
    }));
    // The pointer input's import and wait, the staged input's receive, then the job.
    assert!(matches!(
        wlog[0],
        WorkerAction::Import {
            alloc: AllocId(2),
            ..
        }
    ));
    assert!(matches!(wlog[1], WorkerAction::WaitReady { .. }));
    assert_eq!(
        wlog[2],
        WorkerAction::ReceiveStaged {
            job: JOB,
            handoff: handles[0],
            meta: meta(64)
        }
    );
    assert!(matches!(wlog[3], WorkerAction::JobStarted { .. }));

    pair.w
        .request_results(JOB, vec![spec(4), spec(8)])
        .expect("request");
    pair.pump();
    let (log, mut wlog) = pair.take_logs();
    assert!(matches!(
        wlog.remove(0),
        WorkerAction::Send(Message::ResultRequest(_))
    ));
    assert!(
        !log.iter()
            .any(|a| matches!(a, ParentAction::RecordReady { .. })),
        "no READY for staged results"
    );
    let WorkerAction::ResultsGranted { results, .. } = &wlog[0] else {
        panic!("granted without imports: {wlog:#?}");
    };
    let staged_results: Vec<HandoffId> = results
        .iter()
        .map(|g| match g {
            ResultGrant::Granted {
                handle,
                rung: Rung::HostStaging,
                ready_event,
                ..
            } => {
                assert_eq!(*ready_event, EventBlob([0; 64]));
                *handle
            }
            other => panic!("a staged grant, not {other:?}"),
        })
        .collect();

    pair.w.finish_job(JOB, done_event(1)).expect("finish");
    pair.pump();
    let (log, wlog) = pair.take_logs();
    let done_at = wlog
        .iter()
        .position(|a| matches!(a, WorkerAction::Send(Message::Done(_))))
        .expect("Done");
    assert_eq!(
        wlog[done_at + 1..done_at + 3],
        [
            WorkerAction::SendStaged {
                job: JOB,
                handoff: staged_results[0]
            },
            WorkerAction::SendStaged {
                job: JOB,
                handoff: staged_results[1]
            },
        ],
        "the staged results' bytes right after the Done"
    );
    assert!(matches!(
        wlog[done_at + 3],
        WorkerAction::Send(Message::Ack(_))
    ));
    assert_eq!(
        log[..2],
        [
            ParentAction::ReceiveStaged {
                worker: W0,
                job: JOB,
                handoff: staged_results[0]
            },
            ParentAction::ReceiveStaged {
                worker: W0,
                job: JOB,
                handoff: staged_results[1]
            },
        ]
    );
    // Only the pointer handoff waits on DONE.
    let waits: Vec<HandoffId> = log
        .iter()
        .filter_map(|a| match a {
            ParentAction::WaitDone { handoff, .. } => Some(*handoff),
            _ => None,
        })
        .collect();
    assert_eq!(waits, vec![handles[1]]);
    assert_eq!(releases(&log).len(), 4);
    assert_eq!(job_finished(&log, JOB), JobOutcome::Completed);
}

#[test]
fn a_writable_staged_input_comes_back_after_the_done_before_the_staged_results() {
    let mut pair = Pair::new();
    pair.result_rung = Rung::HostStaging;
    let handles = pair
        .p
        .start_job(
            W0,
            JOB,
            ready(1),
            vec![staged(1, 64), read_only(staged(2, 64)), staged(3, 32)],
            T0,
        )
        .expect("start");
    pair.pump();
    let (_, wlog) = pair.take_logs();
    let Some(WorkerAction::JobStarted { inputs, .. }) = wlog
        .iter()
        .find(|a| matches!(a, WorkerAction::JobStarted { .. }))
    else {
        panic!("no JobStarted: {wlog:#?}");
    };
    let flags: Vec<bool> = inputs.iter().map(|t| t.read_only).collect();
    assert_eq!(
        flags,
        [false, true, false],
        "the Lend carries each input's flag"
    );
    pair.w.request_results(JOB, vec![spec(4)]).expect("request");
    pair.pump();
    let (_, wlog) = pair.take_logs();
    let Some(WorkerAction::ResultsGranted { results, .. }) = wlog
        .iter()
        .find(|a| matches!(a, WorkerAction::ResultsGranted { .. }))
    else {
        panic!("no grant: {wlog:#?}");
    };
    let ResultGrant::Granted { handle: result, .. } = results[0] else {
        panic!("a staged grant, not {:?}", results[0]);
    };

    pair.w.finish_job(JOB, done_event(1)).expect("finish");
    pair.pump();
    let (log, wlog) = pair.take_logs();
    let sent: Vec<HandoffId> = wlog
        .iter()
        .filter_map(|a| match a {
            WorkerAction::SendStaged { handoff, .. } => Some(*handoff),
            _ => None,
        })
        .collect();
    let pulled: Vec<HandoffId> = log
        .iter()
        .filter_map(|a| match a {
            ParentAction::ReceiveStaged { handoff, .. } => Some(*handoff),
            _ => None,
        })
        .collect();
    let expected = vec![handles[0], handles[2], result];
    assert_eq!(
        sent, expected,
        "writable inputs in Lend order, then the result"
    );
    assert_eq!(pulled, expected, "the parent pulls them in the same order");
    assert_eq!(job_finished(&log, JOB), JobOutcome::Completed);
}

#[test]
fn a_pointer_result_above_the_limit_is_refused_and_freed() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), Vec::new(), T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    p.handle(
        received(
            W0,
            Message::ResultRequest(ResultRequest {
                job: JOB,
                results: vec![spec(4)],
            }),
        ),
        T0,
    )
    .expect("request");
    let _ = drain_parent(&mut p);
    p.handle(
        ParentEvent::ResultAllocated {
            worker: W0,
            request: RequestId(0),
            alloc: AllocId(50),
            span: Span {
                ptr: 4096,
                bytes: 128 * CHUNK,
            },
            rung: Rung::PoolPointer,
            pool: 0,
            export: ExportBlob(blob(3, 50)),
        },
        T0,
    )
    .expect("answer");
    let actions = drain_parent(&mut p);
    assert_eq!(
        actions[0],
        ParentAction::FreeResult {
            worker: W0,
            job: JOB,
            request: RequestId(0),
            alloc: AllocId(50)
        }
    );
    let Some(Message::AllocationGrant(g)) = sent_messages(&actions).pop() else {
        panic!("a grant");
    };
    assert!(matches!(
        &g.results[0],
        ResultGrant::Refused {
            code: ErrorCode::OVER_IMPORT_LIMIT,
            ..
        }
    ));
    assert!(
        !actions
            .iter()
            .any(|a| matches!(a, ParentAction::RecordReady { .. }))
    );
    assert_eq!(p.outstanding(), 0);
}

#[test]
fn a_request_for_more_results_than_a_grant_can_carry_is_refused_whole_and_the_worker_lives() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), Vec::new(), T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    let n = crate::MAX_RESULTS_PER_REQUEST + 1;
    p.handle(
        received(
            W0,
            Message::ResultRequest(ResultRequest {
                job: JOB,
                results: vec![spec(4); n],
            }),
        ),
        T0,
    )
    .expect("request");
    let actions = drain_parent(&mut p);
    assert!(
        !actions.iter().any(|a| matches!(
            a,
            ParentAction::AllocateResult { .. } | ParentAction::KillWorker { .. }
        )),
        "nothing allocated, nobody killed"
    );
    let Some(Message::AllocationGrant(g)) = sent_messages(&actions).pop() else {
        panic!("a grant");
    };
    assert_eq!(g.results.len(), n);
    assert!(g.results.iter().all(|r| matches!(
        r,
        ResultGrant::Refused { code: ErrorCode::LIMIT, message } if message.contains("at most 4096")
    )));
    assert!(p.is_live(W0));
}

#[test]
fn a_long_refusal_text_is_cut_so_a_full_grant_fits_a_frame() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), Vec::new(), T0)
        .expect("start");
    p.handle(
        received(
            W0,
            Message::ResultRequest(ResultRequest {
                job: JOB,
                results: vec![spec(4)],
            }),
        ),
        T0,
    )
    .expect("request");
    let _ = drain_parent(&mut p);
    p.handle(
        ParentEvent::ResultDeclined {
            worker: W0,
            request: RequestId(0),
            code: ErrorCode::OUT_OF_MEMORY,
            message: "é".repeat(600),
        },
        T0,
    )
    .expect("answer");
    let actions = drain_parent(&mut p);
    let Some(Message::AllocationGrant(g)) = sent_messages(&actions).pop() else {
        panic!("a grant");
    };
    let ResultGrant::Refused { message, .. } = &g.results[0] else {
        panic!("a refusal");
    };
    assert_eq!(message.len(), crate::MAX_REFUSAL_TEXT_LEN);
}

#[test]
fn a_declined_result_is_refused_with_the_facades_code_in_request_order() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), Vec::new(), T0)
        .expect("start");
    p.handle(
        received(
            W0,
            Message::ResultRequest(ResultRequest {
                job: JOB,
                results: vec![spec(4), spec(2)],
            }),
        ),
        T0,
    )
    .expect("request");
    let _ = drain_parent(&mut p);
    // Answered out of order: the grant still lists them in request order.
    p.handle(
        ParentEvent::ResultAllocated {
            worker: W0,
            request: RequestId(1),
            alloc: AllocId(7),
            span: span_of(7, 8),
            rung: Rung::PoolPointer,
            pool: 0,
            export: ExportBlob(blob(3, 7)),
        },
        T0,
    )
    .expect("answer");
    assert_eq!(p.poll_action(), None, "the grant waits for every answer");
    p.handle(
        ParentEvent::ResultDeclined {
            worker: W0,
            request: RequestId(0),
            code: ErrorCode::OUT_OF_MEMORY,
            message: "full".into(),
        },
        T0,
    )
    .expect("answer");
    let actions = drain_parent(&mut p);
    assert_eq!(
        actions[0],
        ParentAction::RecordReady {
            worker: W0,
            job: JOB
        }
    );
    let Some(Message::AllocationGrant(g)) = sent_messages(&actions).pop() else {
        panic!("a grant");
    };
    assert_eq!(
        g.results[0],
        ResultGrant::Refused {
            code: ErrorCode::OUT_OF_MEMORY,
            message: "full".into()
        }
    );
    assert!(matches!(
        g.results[1],
        ResultGrant::Granted {
            alloc: AllocId(7),
            ..
        }
    ));
}

#[test]
fn an_answer_the_parent_did_not_ask_for_is_the_facades_error() {
    let mut p = parent();
    let got = p.handle(
        ParentEvent::ResultDeclined {
            worker: W0,
            request: RequestId(9),
            code: ErrorCode::OTHER,
            message: String::new(),
        },
        T0,
    );
    assert_eq!(
        got,
        Err(ContractError::UnknownRequest {
            request: RequestId(9)
        })
    );
    assert_eq!(
        p.handle(received(WorkerId(9), Message::Bye), T0),
        Err(ContractError::UnknownWorker(WorkerId(9)))
    );
}

// Violations.

/// Starts JOB on W0 with one pointer input and JobId(2) on W1, then lets `message` from W0
/// arrive. Returns the actions it caused.
fn after_violation(message: Message) -> (Parent, Vec<ParentAction>) {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    p.start_job(W1, JobId(2), ready(2), vec![pointer(2)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    p.handle(received(W0, message), T0)
        .expect("a violation is not an error");
    let actions = drain_parent(&mut p);
    (p, actions)
}

fn assert_condemned(p: &mut Parent, actions: &[ParentAction], fault: &str) {
    assert_eq!(
        actions,
        [ParentAction::KillWorker { worker: W0 }],
        "only the kill until reaped"
    );
    assert!(!p.is_live(W0));
    assert_eq!(p.outstanding_for(W0), 1, "nothing released before reaping");
    p.handle(
        ParentEvent::WorkerHungUp {
            worker: W0,
            why: "killed".into(),
        },
        T0,
    )
    .expect("hang-up");
    p.handle(ParentEvent::WorkerReaped { worker: W0 }, T0)
        .expect("reaped");
    let actions = drain_parent(p);
    assert!(matches!(
        actions[0],
        ParentAction::Release {
            worker: W0,
            outcome: Outcome::Failed,
            ..
        }
    ));
    let JobOutcome::Failed { reason, detail } = job_finished(&actions, JOB) else {
        panic!("failed");
    };
    assert_eq!(reason, FailReason::ProtocolViolation);
    assert!(detail.contains(fault), "{detail:?} should name {fault:?}");
    assert_eq!(
        actions.last(),
        Some(&ParentAction::WorkerRemoved { worker: W0 })
    );
    assert_eq!(actions.len(), 3);
}

#[test]
fn a_result_request_whose_byte_len_lies_condemns_the_worker() {
    let mut lying = spec(4);
    lying.byte_len = 17;
    let (mut p, actions) = after_violation(Message::ResultRequest(ResultRequest {
        job: JOB,
        results: vec![lying],
    }));
    assert_condemned(&mut p, &actions, "byte_len 17");
}

#[test]
fn a_result_request_whose_size_overflows_condemns_the_worker() {
    let overflow = ResultSpec {
        dtype: DType::F64,
        shape: vec![u64::MAX, 2],
        byte_len: 0,
    };
    let (mut p, actions) = after_violation(Message::ResultRequest(ResultRequest {
        job: JOB,
        results: vec![overflow],
    }));
    assert_condemned(&mut p, &actions, "overflows");
}

#[test]
fn a_done_of_another_job_condemns_the_worker() {
    let (mut p, actions) = after_violation(Message::Done(Done {
        job: JOB,
        done_event: done_event(1),
        handles: vec![HandoffId(1)], // W1's
        carved: Vec::new(),
    }));
    assert_condemned(&mut p, &actions, "another worker's");
}

#[test]
fn an_ack_before_done_condemns_the_worker() {
    let (mut p, actions) = after_violation(Message::Ack(Ack {
        job: JOB,
        handles: vec![HandoffId(0)],
    }));
    assert_condemned(&mut p, &actions, "before its Done");
}

#[test]
fn a_second_result_request_before_the_first_is_answered_condemns_the_worker() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let request = Message::ResultRequest(ResultRequest {
        job: JOB,
        results: vec![spec(4)],
    });
    p.handle(received(W0, request.clone()), T0).expect("first");
    let _ = drain_parent(&mut p);
    p.handle(received(W0, request), T0).expect("second");
    assert_eq!(
        drain_parent(&mut p),
        [ParentAction::KillWorker { worker: W0 }]
    );
    // The allocation answered after the kill is never offered: freed when reaped.
    p.handle(
        ParentEvent::ResultAllocated {
            worker: W0,
            request: RequestId(0),
            alloc: AllocId(9),
            span: span_of(9, 16),
            rung: Rung::PoolPointer,
            pool: 0,
            export: ExportBlob(blob(3, 9)),
        },
        T0,
    )
    .expect("answer");
    assert_eq!(p.poll_action(), None, "no grant to a condemned worker");
    p.handle(ParentEvent::WorkerReaped { worker: W0 }, T0)
        .expect("reaped");
    let actions = drain_parent(&mut p);
    assert!(matches!(
        actions[0],
        ParentAction::Release {
            outcome: Outcome::Failed,
            ..
        }
    ));
    assert_eq!(
        actions[1],
        ParentAction::FreeResult {
            worker: W0,
            job: JOB,
            request: RequestId(0),
            alloc: AllocId(9)
        }
    );
    let JobOutcome::Failed { detail, .. } = job_finished(&actions, JOB) else {
        panic!("failed");
    };
    assert!(detail.contains("second result request"), "{detail}");
}

#[test]
fn an_error_from_the_worker_condemns_it_and_says_what_it_reported() {
    let (mut p, actions) = after_violation(Message::Error {
        code: ErrorCode::INTERNAL,
        message: "oops".into(),
    });
    assert_condemned(
        &mut p,
        &actions,
        "the worker reported: internal: worker says: oops",
    );
}

#[test]
fn a_message_only_the_parent_sends_condemns_the_worker() {
    let (mut p, actions) = after_violation(Message::Bye);
    assert_condemned(&mut p, &actions, "unexpected Bye");
}

#[test]
fn a_violation_condemns_only_that_worker_and_another_workers_job_completes() {
    let mut pair = Pair::new();
    // W0 is the wired worker; W1 misbehaves by hand.
    pair.p
        .start_job(W1, JobId(7), ready(7), vec![pointer(1)], T0)
        .expect("W1's job");
    pair.p
        .start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("W0's job");
    let _ = pair.p.poll_action(); // W1's RecordReady
    let _ = pair.p.poll_action(); // W1's Lend, never delivered
    pair.p
        .handle(
            received(
                W1,
                Message::Ack(Ack {
                    job: JobId(99),
                    handles: Vec::new(),
                }),
            ),
            T0,
        )
        .expect("violation");
    pair.pump();
    let (log, _) = pair.take_logs();
    assert_eq!(kills(&log), vec![W1]);
    pair.p
        .handle(ParentEvent::WorkerReaped { worker: W1 }, T0)
        .expect("reaped");
    pair.w.finish_job(JOB, done_event(1)).expect("finish");
    pair.pump();
    let (log, _) = pair.take_logs();
    assert!(matches!(
        job_finished(&log, JobId(7)),
        JobOutcome::Failed {
            reason: FailReason::ProtocolViolation,
            ..
        }
    ));
    assert_eq!(job_finished(&log, JOB), JobOutcome::Completed);
    assert!(pair.p.is_live(W0));
    assert_eq!(pair.p.outstanding(), 0);
}

#[test]
fn messages_from_a_condemned_worker_are_ignored() {
    let (mut p, _) = after_violation(Message::Bye);
    p.handle(
        received(
            W0,
            Message::Done(Done {
                job: JOB,
                done_event: done_event(1),
                handles: vec![HandoffId(0)],
                carved: Vec::new(),
            }),
        ),
        T0,
    )
    .expect("ignored");
    p.handle(
        received(
            W0,
            Message::Ack(Ack {
                job: JOB,
                handles: vec![HandoffId(0)],
            }),
        ),
        T0,
    )
    .expect("ignored");
    assert_eq!(p.poll_action(), None);
    assert_eq!(p.outstanding_for(W0), 1);
}

// Job errors, stops, cancels, deadlines.

#[test]
fn a_job_error_then_ack_finishes_the_job_with_the_workers_error() {
    let mut pair = Pair::new();
    pair.p
        .start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    pair.pump();
    pair.w
        .fail_job(JOB, "division by zero".into())
        .expect("fail");
    pair.w.finish_job(JOB, done_event(1)).expect("finish");
    pair.pump();
    let (log, _) = pair.take_logs();
    assert_eq!(releases(&log), vec![(HandoffId(0), Outcome::Completed)]);
    assert_eq!(
        job_finished(&log, JOB),
        JobOutcome::WorkerError("worker says: division by zero".into())
    );
    assert!(pair.p.is_live(W0));
}

#[test]
fn stop_worker_says_bye_and_fails_its_open_jobs_as_stopped_after_reaping() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    p.stop_worker(W0).expect("stop");
    assert_eq!(
        drain_parent(&mut p),
        [ParentAction::Send {
            worker: W0,
            message: Message::Bye
        }]
    );
    assert!(!p.is_live(W0));
    assert_eq!(
        p.start_job(W0, JobId(2), ready(2), Vec::new(), T0),
        Err(ContractError::WorkerGone(W0))
    );
    p.handle(
        ParentEvent::WorkerHungUp {
            worker: W0,
            why: "EOF".into(),
        },
        T0,
    )
    .expect("EOF");
    let actions = drain_parent(&mut p);
    assert!(
        releases(&actions).is_empty(),
        "nothing released before reaping: {actions:?}"
    );
    p.handle(ParentEvent::WorkerReaped { worker: W0 }, T0)
        .expect("reaped");
    let actions = drain_parent(&mut p);
    assert_eq!(releases(&actions), vec![(HandoffId(0), Outcome::Failed)]);
    assert!(matches!(
        job_finished(&actions, JOB),
        JobOutcome::Failed {
            reason: FailReason::Stopped,
            ..
        }
    ));
    assert_eq!(
        actions.last(),
        Some(&ParentAction::WorkerRemoved { worker: W0 })
    );
}

#[test]
fn a_stopped_worker_may_finish_its_open_job_before_it_exits() {
    let mut pair = Pair::new();
    pair.p
        .start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    pair.pump();
    let _ = pair.take_logs();
    pair.p.stop_worker(W0).expect("stop");
    pair.pump();
    let (_, wlog) = pair.take_logs();
    assert_eq!(wlog, [WorkerAction::Stop]);
    pair.w.finish_job(JOB, done_event(1)).expect("finish");
    pair.pump();
    let (log, _) = pair.take_logs();
    assert_eq!(job_finished(&log, JOB), JobOutcome::Completed);
    pair.p
        .handle(
            ParentEvent::WorkerHungUp {
                worker: W0,
                why: "EOF".into(),
            },
            T0,
        )
        .expect("EOF");
    assert_eq!(
        pair.p.poll_action(),
        None,
        "a goodbye with nothing open needs no kill"
    );
    pair.p
        .handle(ParentEvent::WorkerReaped { worker: W0 }, T0)
        .expect("reaped");
    assert_eq!(
        drain_parent(&mut pair.p),
        [ParentAction::WorkerRemoved { worker: W0 }]
    );
}

#[test]
fn a_cancelled_job_declines_its_pending_request_and_releases_as_cancelled() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    p.handle(
        received(
            W0,
            Message::ResultRequest(ResultRequest {
                job: JOB,
                results: vec![spec(4)],
            }),
        ),
        T0,
    )
    .expect("request");
    let _ = drain_parent(&mut p);
    p.cancel(W0, JOB, T0).expect("cancel");
    assert_eq!(
        drain_parent(&mut p),
        [ParentAction::Send {
            worker: W0,
            message: Message::Cancel { job: JOB }
        }]
    );
    p.handle(
        ParentEvent::ResultAllocated {
            worker: W0,
            request: RequestId(0),
            alloc: AllocId(9),
            span: span_of(9, 16),
            rung: Rung::PoolPointer,
            pool: 0,
            export: ExportBlob(blob(3, 9)),
        },
        T0,
    )
    .expect("answer");
    let actions = drain_parent(&mut p);
    assert_eq!(
        actions[0],
        ParentAction::FreeResult {
            worker: W0,
            job: JOB,
            request: RequestId(0),
            alloc: AllocId(9)
        }
    );
    let Some(Message::AllocationGrant(g)) = sent_messages(&actions).pop() else {
        panic!("a grant");
    };
    assert!(matches!(
        g.results[0],
        ResultGrant::Refused {
            code: ErrorCode::CANCELLED,
            ..
        }
    ));
    p.handle(
        received(
            W0,
            Message::Done(Done {
                job: JOB,
                done_event: done_event(1),
                handles: vec![HandoffId(0)],
                carved: Vec::new(),
            }),
        ),
        T0,
    )
    .expect("done");
    p.handle(
        received(
            W0,
            Message::Ack(Ack {
                job: JOB,
                handles: vec![HandoffId(0)],
            }),
        ),
        T0,
    )
    .expect("ack");
    let actions = drain_parent(&mut p);
    assert!(matches!(actions[0], ParentAction::WaitDone { .. }));
    assert_eq!(releases(&actions), vec![(HandoffId(0), Outcome::Cancelled)]);
    assert!(matches!(
        job_finished(&actions, JOB),
        JobOutcome::Failed {
            reason: FailReason::Cancelled,
            ..
        }
    ));
}

#[test]
fn the_deadline_is_refreshed_by_messages_about_the_job() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    assert_eq!(p.poll_timeout(), Some(at(10)));
    p.handle(
        received(
            W0,
            Message::JobError {
                job: JOB,
                message: "x".into(),
            },
        ),
        at(8),
    )
    .expect("word");
    assert_eq!(p.poll_timeout(), Some(at(18)));
    p.handle(received(W0, Message::Heartbeat { seq: 1 }), at(15))
        .expect("heartbeat");
    assert_eq!(
        p.poll_timeout(),
        Some(at(18)),
        "a heartbeat is about no job"
    );
    p.handle_timeout(at(15));
    assert_eq!(p.poll_action(), None);
    assert!(p.is_live(W0));
    p.handle_timeout(at(18));
    assert_eq!(
        drain_parent(&mut p),
        [ParentAction::KillWorker { worker: W0 }]
    );
    assert_eq!(p.poll_timeout(), None);
    // The ACK arriving late is ignored; release waits for the reaping.
    p.handle(
        received(
            W0,
            Message::Ack(Ack {
                job: JOB,
                handles: vec![HandoffId(0)],
            }),
        ),
        at(19),
    )
    .expect("late");
    assert_eq!(p.poll_action(), None);
    p.handle(ParentEvent::WorkerReaped { worker: W0 }, at(20))
        .expect("reaped");
    let actions = drain_parent(&mut p);
    assert!(matches!(
        job_finished(&actions, JOB),
        JobOutcome::Failed {
            reason: FailReason::DeadlineExpired,
            ..
        }
    ));
}

#[test]
fn a_hang_up_releases_nothing_until_the_worker_is_reaped() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    p.handle(
        ParentEvent::WorkerHungUp {
            worker: W0,
            why: "EOF".into(),
        },
        T0,
    )
    .expect("EOF");
    assert_eq!(
        drain_parent(&mut p),
        [ParentAction::KillWorker { worker: W0 }]
    );
    assert_eq!(p.outstanding_for(W0), 1);
    p.handle(ParentEvent::WorkerReaped { worker: W0 }, T0)
        .expect("reaped");
    let actions = drain_parent(&mut p);
    assert!(matches!(
        job_finished(&actions, JOB),
        JobOutcome::Failed {
            reason: FailReason::HungUp,
            ..
        }
    ));
}

#[test]
fn a_reaped_workers_job_waits_for_its_unanswered_request_then_finishes() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), Vec::new(), T0)
        .expect("start");
    p.handle(
        received(
            W0,
            Message::ResultRequest(ResultRequest {
                job: JOB,
                results: vec![spec(4)],
            }),
        ),
        T0,
    )
    .expect("request");
    let _ = drain_parent(&mut p);
    p.handle(ParentEvent::WorkerReaped { worker: W0 }, T0)
        .expect("reaped");
    assert_eq!(
        p.poll_action(),
        None,
        "the job waits for the allocator's answer"
    );
    assert_eq!(p.jobs_of(W0), vec![JOB]);
    p.handle(
        ParentEvent::ResultAllocated {
            worker: W0,
            request: RequestId(0),
            alloc: AllocId(9),
            span: span_of(9, 16),
            rung: Rung::HostStaging,
            pool: 0,
            export: ExportBlob([0; 64]),
        },
        T0,
    )
    .expect("answer");
    let actions = drain_parent(&mut p);
    assert_eq!(
        actions[0],
        ParentAction::FreeResult {
            worker: W0,
            job: JOB,
            request: RequestId(0),
            alloc: AllocId(9)
        }
    );
    assert!(matches!(
        job_finished(&actions, JOB),
        JobOutcome::Failed { .. }
    ));
    assert_eq!(
        actions.last(),
        Some(&ParentAction::WorkerRemoved { worker: W0 })
    );
}

#[test]
fn shutdown_says_bye_to_every_worker_and_completes_when_no_job_is_open() {
    let mut pair = Pair::new();
    pair.p
        .start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    pair.pump();
    pair.p.shutdown();
    pair.pump();
    let (log, _) = pair.take_logs();
    let byes: Vec<WorkerId> = log
        .iter()
        .filter_map(|a| match a {
            ParentAction::Send {
                worker,
                message: Message::Bye,
            } => Some(*worker),
            _ => None,
        })
        .collect();
    assert_eq!(byes, vec![W0, W1]);
    assert!(!pair.p.is_shut_down());
    assert_eq!(
        pair.p.add_worker(WorkerId(5)),
        Err(ContractError::ShuttingDown)
    );
    pair.w.finish_job(JOB, done_event(1)).expect("finish");
    pair.pump();
    let (log, _) = pair.take_logs();
    assert_eq!(log.last(), Some(&ParentAction::ShutdownComplete));
    assert!(pair.p.is_shut_down());
}

#[test]
fn two_jobs_in_flight_on_one_worker_each_carry_their_own_ready_event() {
    let mut pair = Pair::new();
    pair.p
        .start_job(W0, JobId(1), ready(1), vec![pointer(1)], T0)
        .expect("job 1");
    pair.pump();
    let _ = pair.take_logs();
    pair.w
        .request_results(JobId(1), vec![spec(4)])
        .expect("request");
    // Job 2 is lent while job 1 waits for its grant (here it gets it at once; the order of
    // the worker's actions is what matters).
    pair.p
        .start_job(W0, JobId(2), ready(2), vec![pointer(1), pointer(2)], T0)
        .expect("job 2");
    pair.pump();
    let (log, wlog) = pair.take_logs();
    let lend2 = lend_of(&log);
    assert!(lend2.tensors.iter().all(|t| t.ready_event == ready(2)));
    let grant = sent_messages(&log)
        .into_iter()
        .find_map(|m| match m {
            Message::AllocationGrant(g) => Some(g),
            _ => None,
        })
        .expect("a grant");
    assert!(
        matches!(grant.results[0], ResultGrant::Granted { ready_event, .. } if ready_event == ready(1))
    );
    let waits: Vec<(JobId, EventBlob)> = wlog
        .iter()
        .filter_map(|a| match a {
            WorkerAction::WaitReady { job, ready_event } => Some((*job, *ready_event)),
            _ => None,
        })
        .collect();
    assert!(
        waits.contains(&(JobId(1), ready(1))) && waits.contains(&(JobId(2), ready(2))),
        "{waits:?}"
    );
    // Allocation 1 is shared by both jobs: imported once, freed after the second.
    let imports_of_1 = wlog
        .iter()
        .filter(|a| {
            matches!(
                a,
                WorkerAction::Import {
                    alloc: AllocId(1),
                    ..
                }
            )
        })
        .count();
    assert_eq!(imports_of_1, 0, "job 1's import is shared by job 2");
    pair.w
        .finish_job(JobId(1), done_event(1))
        .expect("finish 1");
    pair.pump();
    let (_, wlog) = pair.take_logs();
    assert!(
        !wlog.contains(&WorkerAction::Unimport { alloc: AllocId(1) }),
        "job 2 still uses it"
    );
    pair.w
        .finish_job(JobId(2), done_event(2))
        .expect("finish 2");
    pair.pump();
    let (log, wlog) = pair.take_logs();
    assert_eq!(wlog[0], WorkerAction::Unimport { alloc: AllocId(1) });
    assert_eq!(job_finished(&log, JobId(2)), JobOutcome::Completed);
    assert_eq!(pair.p.outstanding(), 0);
}

// The worker alone.

fn lend(job: u64, tensors: Vec<(u64, u64, Rung)>) -> Message {
    Message::Lend(Lend {
        job: JobId(job),
        tensors: tensors
            .into_iter()
            .map(|(handle, alloc, rung)| crate::message::LentTensor {
                handle: HandoffId(handle),
                alloc: AllocId(alloc),
                rung,
                pool: 0,
                export: ExportBlob(blob(3, alloc)),
                ready_event: ready(job),
                meta: meta(16),
                arena: None,
                read_only: false,
            })
            .collect(),
        slice: None,
    })
}

#[test]
fn a_duplicated_or_reordered_lend_is_refused_and_never_imported() {
    let mut w = Worker::new();
    w.handle(lend(1, vec![(5, 1, Rung::PoolPointer)]), T0)
        .expect("first");
    let _ = drain_worker(&mut w);
    assert_eq!(
        w.handle(lend(2, vec![(5, 2, Rung::PoolPointer)]), T0),
        Err(ContractError::StaleHandle(HandoffId(5)))
    );
    assert_eq!(
        w.handle(lend(1, vec![(9, 1, Rung::PoolPointer)]), T0),
        Err(ContractError::JobExists(JobId(1)))
    );
    assert_eq!(w.poll_action(), None);
    assert_eq!(w.held(), 1);
}

#[test]
fn the_worker_refuses_messages_the_parent_does_not_send() {
    let mut w = Worker::new();
    let done = Message::Done(Done {
        job: JOB,
        done_event: done_event(1),
        handles: Vec::new(),
        carved: Vec::new(),
    });
    assert_eq!(
        w.handle(done, T0),
        Err(ContractError::Unexpected(crate::MessageKind::Done))
    );
    let grant = Message::AllocationGrant(crate::message::AllocationGrant {
        job: JOB,
        results: Vec::new(),
    });
    assert_eq!(w.handle(grant, T0), Err(ContractError::GrantMismatch(JOB)));
}

#[test]
fn the_worker_cannot_finish_a_job_whose_request_is_unanswered() {
    let mut w = Worker::new();
    w.handle(lend(1, Vec::new()), T0).expect("lend");
    w.request_results(JobId(1), vec![spec(4)]).expect("request");
    assert_eq!(
        w.request_results(JobId(1), vec![spec(4)]),
        Err(ContractError::RequestPending(JobId(1)))
    );
    assert_eq!(
        w.finish_job(JobId(1), done_event(1)),
        Err(ContractError::RequestPending(JobId(1)))
    );
    let mut lying = spec(4);
    lying.byte_len = 3;
    w.handle(lend(2, Vec::new()), T0).expect("lend");
    assert!(matches!(
        w.request_results(JobId(2), vec![lying]),
        Err(ContractError::MalformedResult { index: 0, .. })
    ));
}

#[test]
fn bye_asks_the_worker_to_stop_once_and_cancel_names_the_job() {
    let mut w = Worker::new();
    w.handle(lend(1, Vec::new()), T0).expect("lend");
    w.handle(Message::Cancel { job: JobId(1) }, T0)
        .expect("cancel");
    w.handle(Message::Cancel { job: JobId(1) }, T0)
        .expect("again");
    w.handle(Message::Bye, T0).expect("bye");
    w.handle(Message::Bye, T0).expect("bye again");
    assert_eq!(
        drain_worker(&mut w)[1..],
        [
            WorkerAction::Cancelled { job: JobId(1) },
            WorkerAction::Stop
        ]
    );
}

#[test]
fn a_job_error_text_is_cut_to_the_wire_limit() {
    let mut w = Worker::new();
    w.handle(lend(1, Vec::new()), T0).expect("lend");
    let _ = drain_worker(&mut w);
    w.fail_job(JobId(1), "é".repeat(2000)).expect("fail");
    let Some(WorkerAction::Send(Message::JobError { message, .. })) = w.poll_action() else {
        panic!("a JobError");
    };
    assert!(message.len() <= crate::MAX_TEXT_LEN && !message.is_empty());
}

#[test]
fn a_worker_heartbeat_names_an_open_job_and_counts_up() {
    let mut w = Worker::new();
    assert!(matches!(
        w.heartbeat(JobId(1)),
        Err(ContractError::UnknownJob(JobId(1)))
    ));
    assert_eq!(w.poll_action(), None, "nothing sent for a job not open");
    w.handle(lend(1, Vec::new()), T0).expect("lend");
    let _ = drain_worker(&mut w);
    w.heartbeat(JobId(1)).expect("beat");
    w.heartbeat(JobId(1)).expect("beat");
    assert_eq!(
        drain_worker(&mut w),
        [
            WorkerAction::Send(Message::Heartbeat { seq: 1 }),
            WorkerAction::Send(Message::Heartbeat { seq: 2 })
        ]
    );
}

// The result arena.

/// A job with no inputs whose worker asks for one result, answered in the arena.
fn arena_pair() -> (Pair, HandoffId) {
    let mut pair = Pair::new();
    pair.result_rung = Rung::Arena;
    pair.p
        .start_job(W0, JOB, ready(1), Vec::new(), T0)
        .expect("start");
    pair.pump();
    pair.w
        .request_results(JOB, vec![spec(16)])
        .expect("request");
    pair.pump();
    let (log, wlog) = pair.take_logs();
    assert!(
        !log.iter()
            .any(|a| matches!(a, ParentAction::RecordReady { .. })),
        "an arena grant needs no READY: {log:?}"
    );
    let grant = sent_messages(&log)
        .into_iter()
        .find_map(|m| match m {
            Message::AllocationGrant(g) => Some(g),
            _ => None,
        })
        .expect("a grant");
    let [
        ResultGrant::Arena {
            handle,
            chunk: 1,
            offset: 4096,
            bytes: 64,
            ..
        },
    ] = grant.results[..]
    else {
        panic!("not an arena grant: {grant:?}");
    };
    assert!(
        !wlog.iter().any(|a| matches!(
            a,
            WorkerAction::Import { .. } | WorkerAction::WaitReady { .. }
        )),
        "the worker imports nothing for an arena block: {wlog:?}"
    );
    assert!(
        wlog.iter()
            .any(|a| matches!(a, WorkerAction::ResultsGranted { .. })),
        "{wlog:?}"
    );
    (pair, handle)
}

#[test]
fn an_arena_result_is_granted_by_location_and_released_only_after_a_wait_on_done() {
    let (mut pair, handle) = arena_pair();
    pair.w.finish_job(JOB, done_event(1)).expect("finish");
    pair.pump();
    let (log, wlog) = pair.take_logs();
    assert!(
        !wlog.iter().any(|a| matches!(
            a,
            WorkerAction::Unimport { .. } | WorkerAction::SendStaged { .. }
        )),
        "nothing to unimport or send for an arena block: {wlog:?}"
    );
    let wait = log
        .iter()
        .position(|a| matches!(a, ParentAction::WaitDone { handoff, .. } if *handoff == handle))
        .expect("a wait on DONE");
    let release = log
        .iter()
        .position(|a| {
            matches!(a, ParentAction::Release { handoff, rung: Rung::Arena, outcome: Outcome::Completed, .. } if *handoff == handle)
        })
        .expect("a release");
    assert!(wait < release, "{log:?}");
    assert!(
        !log.iter()
            .any(|a| matches!(a, ParentAction::ReceiveStaged { .. }))
    );
    assert_eq!(job_finished(&log, JOB), JobOutcome::Completed);
}

#[test]
fn an_arena_block_of_a_hung_up_worker_is_released_only_once_it_is_reaped() {
    let (mut pair, handle) = arena_pair();
    pair.p
        .handle(
            ParentEvent::WorkerHungUp {
                worker: W0,
                why: "EOF".into(),
            },
            T0,
        )
        .expect("EOF");
    let actions = drain_parent(&mut pair.p);
    assert!(releases(&actions).is_empty(), "{actions:?}");
    assert_eq!(pair.p.outstanding_for(W0), 1);
    pair.p
        .handle(ParentEvent::WorkerReaped { worker: W0 }, T0)
        .expect("reaped");
    let actions = drain_parent(&mut pair.p);
    assert_eq!(releases(&actions), [(handle, Outcome::Failed)]);
}

#[test]
fn an_arena_rung_without_a_location_is_refused_on_both_sides() {
    let mut p = parent();
    p.start_job(W0, JOB, ready(1), Vec::new(), T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    p.handle(
        received(
            W0,
            Message::ResultRequest(ResultRequest {
                job: JOB,
                results: vec![spec(4)],
            }),
        ),
        T0,
    )
    .expect("request");
    let request = drain_parent(&mut p)
        .into_iter()
        .find_map(|a| match a {
            ParentAction::AllocateResult { request, .. } => Some(request),
            _ => None,
        })
        .expect("an allocation asked for");
    let got = p.handle(
        ParentEvent::ResultAllocated {
            worker: W0,
            request,
            alloc: AllocId(9),
            span: span_of(9, 16),
            rung: Rung::Arena,
            pool: 0,
            export: ExportBlob([0; 64]),
        },
        T0,
    );
    assert!(
        matches!(
            got,
            Err(ContractError::RungNotAllowed {
                rung: Rung::Arena,
                ..
            })
        ),
        "{got:?}"
    );
    assert!(drain_parent(&mut p).is_empty());

    let mut w = Worker::new();
    let got = w.handle(lend(1, vec![(1, 1, Rung::Arena)]), T0);
    assert!(
        matches!(
            got,
            Err(ContractError::RungNotAllowed {
                rung: Rung::Arena,
                ..
            })
        ),
        "{got:?}"
    );
    assert!(drain_worker(&mut w).is_empty());
}

// Inputs copied into the arena (the arena-copy rung).

/// An input the facade copied into arena block `alloc` (129 chunks: above the limit, which
/// does not matter on this rung).
fn arena_copy(alloc: u64) -> InputLoan {
    InputLoan {
        rung: Rung::ArenaCopy,
        export: ExportBlob([0; 64]),
        arena: Some(crate::ArenaLocation {
            chunk: 2,
            offset: 8192,
        }),
        ..huge(alloc)
    }
}

#[test]
fn an_arena_copy_input_is_lent_by_location_after_ready_and_the_worker_imports_nothing() {
    let mut pair = Pair::new();
    pair.p
        .start_job(W0, JOB, ready(1), vec![arena_copy(1)], T0)
        .expect("an arena copy has no import limit");
    pair.pump();
    let (log, wlog) = pair.take_logs();
    let record = log
        .iter()
        .position(|a| matches!(a, ParentAction::RecordReady { .. }))
        .expect("READY is recorded: the copy is queued before it");
    let lend = log
        .iter()
        .position(|a| {
            matches!(
                a,
                ParentAction::Send {
                    message: Message::Lend(_),
                    ..
                }
            )
        })
        .expect("a Lend");
    assert!(record < lend, "{log:?}");
    let Some(Message::Lend(l)) = sent_messages(&log).into_iter().next() else {
        panic!("no Lend: {log:?}");
    };
    let t = &l.tensors[0];
    assert_eq!(
        (t.rung, t.ready_event, t.pool),
        (Rung::ArenaCopy, ready(1), 0)
    );
    assert_eq!(t.export, ExportBlob([0; 64]));
    assert_eq!(
        t.arena,
        Some(crate::ArenaLocation {
            chunk: 2,
            offset: 8192
        })
    );
    assert!(
        !wlog
            .iter()
            .any(|a| matches!(a, WorkerAction::Import { .. })),
        "{wlog:?}"
    );
    assert!(
        wlog.iter().any(
            |a| matches!(a, WorkerAction::WaitReady { ready_event, .. } if *ready_event == ready(1))
        ),
        "the worker waits on READY before it reads the copy: {wlog:?}"
    );
    assert!(
        !log.iter()
            .any(|a| matches!(a, ParentAction::SendStaged { .. })),
        "nothing is staged: {log:?}"
    );
}

#[test]
fn an_arena_copy_block_is_released_only_after_a_wait_on_the_workers_done() {
    let mut pair = Pair::new();
    let handles = pair
        .p
        .start_job(W0, JOB, ready(1), vec![arena_copy(1)], T0)
        .expect("start");
    pair.pump();
    let _ = pair.take_logs();
    pair.w.finish_job(JOB, done_event(1)).expect("finish");
    pair.pump();
    let (log, wlog) = pair.take_logs();
    assert!(
        !wlog
            .iter()
            .any(|a| matches!(a, WorkerAction::Unimport { .. })),
        "nothing to unimport for a copy in the arena: {wlog:?}"
    );
    let wait = log
        .iter()
        .position(|a| matches!(a, ParentAction::WaitDone { handoff, .. } if *handoff == handles[0]))
        .expect("a wait on DONE");
    let release = log
        .iter()
        .position(|a| {
            matches!(a, ParentAction::Release { handoff, rung: Rung::ArenaCopy, outcome: Outcome::Completed, .. } if *handoff == handles[0])
        })
        .expect("a release");
    assert!(wait < release, "{log:?}");
    assert_eq!(job_finished(&log, JOB), JobOutcome::Completed);
}

#[test]
fn an_arena_copy_block_of_a_hung_up_worker_is_released_only_once_it_is_reaped() {
    let mut p = parent();
    let handles = p
        .start_job(W0, JOB, ready(1), vec![arena_copy(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    p.handle(
        ParentEvent::WorkerHungUp {
            worker: W0,
            why: "EOF".into(),
        },
        T0,
    )
    .expect("EOF");
    let actions = drain_parent(&mut p);
    assert!(releases(&actions).is_empty(), "{actions:?}");
    p.handle(ParentEvent::WorkerReaped { worker: W0 }, T0)
        .expect("reaped");
    let actions = drain_parent(&mut p);
    assert_eq!(releases(&actions), [(handles[0], Outcome::Failed)]);
}

#[test]
fn an_arena_copy_input_must_name_its_block_and_no_other_input_may() {
    let mut p = parent();
    let without = InputLoan {
        arena: None,
        ..arena_copy(1)
    };
    assert!(matches!(
        p.start_job(W0, JOB, ready(1), vec![without], T0),
        Err(ContractError::RungNotAllowed {
            rung: Rung::ArenaCopy,
            ..
        })
    ));
    let with = InputLoan {
        arena: Some(crate::ArenaLocation {
            chunk: 0,
            offset: 0,
        }),
        ..pointer(2)
    };
    assert!(matches!(
        p.start_job(W0, JOB, ready(1), vec![with], T0),
        Err(ContractError::RungNotAllowed { .. })
    ));
    assert!(
        drain_parent(&mut p).is_empty(),
        "a refused job queues nothing"
    );
}

#[test]
fn a_worker_refuses_an_arena_copy_without_its_location() {
    let mut w = Worker::new();
    let got = w.handle(lend(1, vec![(1, 1, Rung::ArenaCopy)]), T0);
    assert!(
        matches!(
            got,
            Err(ContractError::RungNotAllowed {
                rung: Rung::ArenaCopy,
                ..
            })
        ),
        "{got:?}"
    );
    assert!(w.poll_action().is_none());
}

fn bounded_parent(tweak: impl FnOnce(&mut ParentConfig)) -> Parent {
    let mut config = ParentConfig {
        handoff_timeout: Duration::from_millis(10),
        ..ParentConfig::default()
    };
    tweak(&mut config);
    let mut p = Parent::new(config);
    for w in [W0, W1] {
        p.add_worker(w).expect("fresh worker ids");
    }
    p
}

/// Asks for `specs` in one request of `job` on `worker`, and declines every allocation the
/// parent asks the facade for (what is asked is counted either way).
fn ask_and_decline(
    p: &mut Parent,
    worker: WorkerId,
    job: JobId,
    specs: Vec<ResultSpec>,
    now: Timestamp,
) -> Vec<ParentAction> {
    p.handle(
        received(
            worker,
            Message::ResultRequest(ResultRequest {
                job,
                results: specs,
            }),
        ),
        now,
    )
    .expect("request");
    let actions = drain_parent(p);
    for a in &actions {
        if let ParentAction::AllocateResult {
            worker, request, ..
        } = a
        {
            p.handle(
                ParentEvent::ResultDeclined {
                    worker: *worker,
                    request: *request,
                    code: ErrorCode::OUT_OF_MEMORY,
                    message: "declined".into(),
                },
                now,
            )
            .expect("declined");
        }
    }
    actions.into_iter().chain(drain_parent(p)).collect()
}

fn failed_with(p: &mut Parent, worker: WorkerId, job: JobId, now: Timestamp) -> FailReason {
    p.handle(ParentEvent::WorkerReaped { worker }, now)
        .expect("reaped");
    match job_finished(&drain_parent(p), job) {
        JobOutcome::Failed { reason, .. } => reason,
        other => panic!("the job ended {other:?}"),
    }
}

#[test]
fn a_job_asking_past_its_results_per_job_bound_condemns_only_its_worker() {
    let mut p = bounded_parent(|c| c.max_results_per_job = 3);
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    p.start_job(W1, JobId(2), ready(2), vec![pointer(2)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    let first = ask_and_decline(&mut p, W0, JOB, vec![spec(1), spec(1)], T0);
    assert!(!first.contains(&ParentAction::KillWorker { worker: W0 }));
    let second = ask_and_decline(&mut p, W0, JOB, vec![spec(1), spec(1)], T0);
    assert!(
        second.contains(&ParentAction::KillWorker { worker: W0 }),
        "{second:?}"
    );
    assert!(
        !second
            .iter()
            .any(|a| matches!(a, ParentAction::AllocateResult { .. }))
    );
    assert!(p.is_live(W1));
    assert_eq!(
        failed_with(&mut p, W0, JOB, at(1)),
        FailReason::BoundExceeded(Bound::ResultsPerJob)
    );
}

#[test]
fn a_single_request_past_the_result_bytes_per_job_bound_is_never_allocated() {
    let mut p = bounded_parent(|c| c.max_result_bytes_per_job = 1 << 20);
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    let actions = ask_and_decline(&mut p, W0, JOB, vec![spec((1 << 18) + 1)], T0);
    assert_eq!(actions, [ParentAction::KillWorker { worker: W0 }]);
    assert_eq!(
        failed_with(&mut p, W0, JOB, at(1)),
        FailReason::BoundExceeded(Bound::ResultBytesPerJob)
    );
}

#[test]
fn the_result_bytes_of_a_workers_open_jobs_together_are_bounded() {
    let mut p = bounded_parent(|c| {
        c.max_result_bytes_per_job = 80;
        c.max_result_bytes_per_worker = 100;
    });
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    p.start_job(W0, JobId(2), ready(2), vec![pointer(2)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    let first = ask_and_decline(&mut p, W0, JOB, vec![spec(15)], T0);
    assert!(!first.contains(&ParentAction::KillWorker { worker: W0 }));
    let second = ask_and_decline(&mut p, W0, JobId(2), vec![spec(15)], T0);
    assert_eq!(second, [ParentAction::KillWorker { worker: W0 }]);
    assert_eq!(
        failed_with(&mut p, W0, JOB, at(1)),
        FailReason::BoundExceeded(Bound::ResultBytesPerWorker)
    );
}

#[test]
fn a_job_kept_busy_still_ends_at_its_lifetime() {
    let mut p = bounded_parent(|c| c.max_job_lifetime = Duration::from_millis(25));
    p.allow_long_jobs(W0).expect("known worker");
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    // A declared long job's heartbeat every 5 ms: the handoff deadline (10 ms) never passes.
    for ms in (5..25).step_by(5) {
        p.handle(received(W0, Message::Heartbeat { seq: ms }), at(ms))
            .expect("heartbeat");
        p.handle_timeout(at(ms));
        assert!(p.is_live(W0), "condemned at {ms} ms");
    }
    assert_eq!(p.poll_timeout(), Some(at(25)));
    p.handle_timeout(at(25));
    assert_eq!(
        drain_parent(&mut p),
        [ParentAction::KillWorker { worker: W0 }]
    );
    assert_eq!(
        failed_with(&mut p, W0, JOB, at(26)),
        FailReason::BoundExceeded(Bound::JobLifetime)
    );
}

/// A job kept open by `word` (sent every 2 ms, each at `at(ms)`) still fails at its
/// handoff deadline (10 ms from its start): `word` is not progress.
fn chatter_ends_at_the_deadline(word: impl Fn(&mut Parent, u64)) {
    let mut p = bounded_parent(|c| c.max_idle_messages = 1000);
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    // One JobError first: the first is progress (at 1 ms: the deadline is 11 ms).
    p.handle(
        received(
            W0,
            Message::JobError {
                job: JOB,
                message: "first".into(),
            },
        ),
        at(1),
    )
    .expect("word");
    // And the word itself once (a first Done is progress too: the deadline stays 11 ms).
    word(&mut p, 1);
    for ms in (2..11).step_by(2) {
        word(&mut p, ms);
        p.handle_timeout(at(ms));
        assert!(p.is_live(W0), "condemned at {ms} ms");
    }
    assert_eq!(p.poll_timeout(), Some(at(11)), "chatter moved the deadline");
    p.handle_timeout(at(11));
    assert_eq!(kills(&drain_parent(&mut p)), [W0]);
    assert_eq!(
        failed_with(&mut p, W0, JOB, at(12)),
        FailReason::DeadlineExpired
    );
}

#[test]
fn empty_result_requests_do_not_move_a_jobs_deadline() {
    chatter_ends_at_the_deadline(|p, ms| {
        let _ = ask_and_decline(p, W0, JOB, Vec::new(), at(ms));
    });
}

#[test]
fn refused_result_requests_do_not_move_a_jobs_deadline() {
    chatter_ends_at_the_deadline(|p, ms| {
        let _ = ask_and_decline(p, W0, JOB, vec![spec(1)], at(ms));
    });
}

#[test]
fn repeated_job_errors_do_not_move_a_jobs_deadline() {
    chatter_ends_at_the_deadline(|p, ms| {
        p.handle(
            received(
                W0,
                Message::JobError {
                    job: JOB,
                    message: "again".into(),
                },
            ),
            at(ms),
        )
        .expect("word");
    });
}

#[test]
fn empty_dones_after_the_first_do_not_move_a_jobs_deadline() {
    chatter_ends_at_the_deadline(|p, ms| {
        p.handle(
            received(
                W0,
                Message::Done(Done {
                    job: JOB,
                    done_event: done_event(1),
                    handles: Vec::new(),
                    carved: Vec::new(),
                }),
            ),
            at(ms),
        )
        .expect("word");
    });
}

#[test]
fn heartbeats_move_no_deadline_unless_the_worker_declared_long_jobs() {
    chatter_ends_at_the_deadline(|p, ms| {
        p.handle(received(W0, Message::Heartbeat { seq: ms }), at(ms))
            .expect("word");
    });
}

#[test]
fn messages_without_progress_past_their_bound_condemn_only_that_worker() {
    let mut p = bounded_parent(|c| c.max_idle_messages = 3);
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    p.start_job(W1, JobId(2), ready(2), vec![pointer(2)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    for _ in 0..3 {
        let actions = ask_and_decline(&mut p, W0, JOB, Vec::new(), T0);
        assert!(kills(&actions).is_empty(), "condemned within the bound");
    }
    let actions = ask_and_decline(&mut p, W0, JOB, Vec::new(), T0);
    assert_eq!(kills(&actions), [W0]);
    assert!(p.is_live(W1));
    assert_eq!(
        failed_with(&mut p, W0, JOB, at(1)),
        FailReason::BoundExceeded(Bound::IdleMessages)
    );
}

#[test]
fn a_granted_result_request_is_progress() {
    let mut p = bounded_parent(|_| {});
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    p.handle(
        received(
            W0,
            Message::ResultRequest(ResultRequest {
                job: JOB,
                results: vec![spec(1)],
            }),
        ),
        at(8),
    )
    .expect("request");
    let request = drain_parent(&mut p)
        .into_iter()
        .find_map(|a| match a {
            ParentAction::AllocateResult { request, .. } => Some(request),
            _ => None,
        })
        .expect("an allocation asked for");
    p.handle(
        ParentEvent::ResultAllocated {
            worker: W0,
            request,
            alloc: AllocId(50),
            span: span_of(50, 4),
            rung: Rung::PoolPointer,
            pool: 0,
            export: ExportBlob([5; 64]),
        },
        at(9),
    )
    .expect("answer");
    assert_eq!(p.poll_timeout(), Some(at(19)));
}

#[test]
fn a_cancelled_job_its_worker_ignores_fails_as_cancelled_at_the_grace() {
    let mut p = bounded_parent(|c| {
        c.cancel_grace = Duration::from_millis(5);
        c.handoff_timeout = Duration::from_millis(100);
    });
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    p.cancel(W0, JOB, at(1)).expect("cancel");
    let _ = drain_parent(&mut p);
    assert_eq!(p.poll_timeout(), Some(at(6)));
    let _ = ask_and_decline(&mut p, W0, JOB, vec![spec(1)], at(3));
    p.handle_timeout(at(5));
    assert!(p.is_live(W0));
    p.handle_timeout(at(6));
    assert_eq!(kills(&drain_parent(&mut p)), [W0]);
    assert_eq!(failed_with(&mut p, W0, JOB, at(7)), FailReason::Cancelled);
}

#[test]
fn a_job_waiting_for_the_facades_answer_still_meets_its_lifetime() {
    let mut p = bounded_parent(|c| c.max_job_lifetime = Duration::from_millis(25));
    p.start_job(W0, JOB, ready(1), vec![pointer(1)], T0)
        .expect("start");
    let _ = drain_parent(&mut p);
    p.handle(
        received(
            W0,
            Message::ResultRequest(ResultRequest {
                job: JOB,
                results: vec![spec(1)],
            }),
        ),
        T0,
    )
    .expect("request");
    let _ = drain_parent(&mut p);
    assert_eq!(p.poll_timeout(), Some(at(25)));
    p.handle_timeout(at(25));
    assert_eq!(
        drain_parent(&mut p),
        [ParentAction::KillWorker { worker: W0 }]
    );
}
