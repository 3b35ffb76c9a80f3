//! The contract's actions carried out in order, each in a span naming its worker and job.

use std::sync::Arc;

use poolipc_contract::{Message, ParentAction};
use poolipc_types::{JobId, WorkerId};

use super::Loop;
use super::transfer::{Direction, Held, Transfer};
use crate::state::Stats;

impl Loop {
    /// Carries out every action the contract has queued, in order.
    pub(super) fn drive(&mut self) {
        while let Some(action) = self.machine.poll_action() {
            tracing::trace!(?action, "contract action");
            self.act(action);
        }
    }

    pub(super) fn act(&mut self, action: ParentAction) {
        // A worker whose staging transfer runs gets its actions in order once it ends.
        if let Some(worker) = worker_of(&action)
            && let Some(slot) = self.workers.get_mut(&worker)
            && slot.holds()
        {
            let kill = matches!(action, ParentAction::KillWorker { .. });
            slot.held.push_back(Held::Action(action));
            if kill {
                // Condemned: its transfer must not run on for its timeouts' length.
                self.abort_transfer(worker);
            }
            return;
        }
        self.act_now(action);
    }

    /// Carries `action` out now, unless its job waits for its DONE.
    pub(super) fn act_now(&mut self, action: ParentAction) {
        let Some(action) = self.gates.hold(job_of(&action), action) else {
            return;
        };
        let label = if crate::probe::enabled() {
            action_label(&action)
        } else {
            ""
        };
        let span = action_span(&action);
        let _in_span = span.enter();
        self.act_inner(action);
        if !label.is_empty() {
            crate::probe::mark(label);
        }
    }

    pub(super) fn act_inner(&mut self, action: ParentAction) {
        match action {
            ParentAction::RecordReady { worker, job } => {
                let driver = Arc::clone(&self.shared.driver);
                let Some(st) = self.jobs.get(&(worker, job)) else {
                    return;
                };
                let Some((ev, _)) = &st.ready else {
                    return;
                };
                // The caller's stream with nothing left to run: the inputs are complete, and
                // the record goes on the IO thread's copy-engine stream (`warm::aside_stream`:
                // without MPS, a record on a stream whose last work was a kernel costs a
                // context switch each way). A query that fails changes nothing: the caller's
                // stream, as always.
                let on = match &self.aside {
                    Some(aside) if matches!(driver.stream_query(st.stream), Ok(true)) => {
                        Stats::bump(&self.shared.stats.ready_recorded_aside);
                        aside.handle()
                    }
                    _ => st.stream,
                };
                if let Err(e) = driver.event_record(ev.handle(), on)
                    && !self.escalate("recording READY", &e.into())
                {
                    self.lose(worker, "recording READY failed");
                }
            }
            ParentAction::Send { worker, message } => self.send(worker, &message),
            ParentAction::SendStaged {
                worker,
                job,
                handoff,
            } => {
                let Some(st) = self.jobs.get(&(worker, job)) else {
                    return;
                };
                let Some(&(src, bytes)) = st.staged_inputs.get(&handoff) else {
                    return;
                };
                self.start_transfer(Transfer {
                    worker,
                    job,
                    handoff,
                    ptr: src,
                    bytes,
                    stream: st.stream,
                    direction: Direction::Send,
                });
            }
            ParentAction::AllocateResult {
                worker,
                job,
                request,
                spec,
            } => self.allocate_result(worker, job, request, &spec),
            ParentAction::ReceiveStaged {
                worker,
                job,
                handoff,
            } => {
                let Some(st) = self.jobs.get(&(worker, job)) else {
                    return;
                };
                // A staged result, or a writable staged input coming back into the caller's
                // tensor (copy-back): the bytes that went out, at the place they came from.
                let result = st.result_by_handoff(handoff).map(|r| (r.ptr, r.bytes));
                let (what, target) = match result {
                    Some(t) => ("a staged result", t),
                    None => match st.staged_inputs.get(&handoff) {
                        Some(&t) => ("a staged input's copy-back", t),
                        None => return,
                    },
                };
                let ((dst, bytes), stream) = (target, st.stream);
                self.start_transfer(Transfer {
                    worker,
                    job,
                    handoff,
                    ptr: dst,
                    bytes,
                    stream,
                    direction: Direction::Receive {
                        what,
                        copy_back: result.is_none(),
                    },
                });
            }
            ParentAction::WaitDone {
                worker,
                job,
                handoff: _,
                done_event,
            } => {
                if let Err(e) = self.wait_done(worker, job, done_event) {
                    let why = format!("waiting on the worker's DONE failed: {e}");
                    if let Some(st) = self.jobs.get_mut(&(worker, job)) {
                        st.done_failed = Some(why.clone());
                    }
                    if !self.escalate("waiting on DONE", &e) {
                        self.lose(worker, &why);
                    }
                }
            }
            ParentAction::Release {
                worker,
                job,
                handoff,
                alloc: _,
                purpose,
                rung,
                outcome,
            } => self.release(worker, job, handoff, purpose, rung, outcome),
            ParentAction::ReleaseSlice {
                worker,
                job,
                handoff: _,
                alloc: _,
                outcome,
                carved,
            } => self.release_slice(worker, job, outcome, carved),
            ParentAction::FreeResult {
                worker,
                job,
                request,
                alloc: _,
            } => {
                if let Some(st) = self.jobs.get_mut(&(worker, job))
                    && let Some(r) = st.results.remove(&request)
                {
                    st.discard(r);
                }
            }
            ParentAction::KillWorker { worker } => {
                let lost = self
                    .workers
                    .get(&worker)
                    .is_some_and(|s| s.exit_deadline.is_none());
                if lost {
                    Stats::bump(&self.shared.stats.workers_lost);
                }
                self.reap(worker, true);
            }
            ParentAction::JobFinished {
                worker,
                job,
                outcome,
            } => self.finish(worker, job, outcome),
            ParentAction::WorkerRemoved { worker } => {
                // The loop drops the slot itself once it reaped the process.
                tracing::debug!(worker = %worker, "the contract let the worker go");
            }
            ParentAction::ShutdownComplete => {}
        }
    }
}

/// The job an action is about, where it names one.
pub(super) fn job_of(action: &ParentAction) -> Option<(WorkerId, JobId)> {
    match action {
        ParentAction::RecordReady { worker, job }
        | ParentAction::SendStaged { worker, job, .. }
        | ParentAction::AllocateResult { worker, job, .. }
        | ParentAction::ReceiveStaged { worker, job, .. }
        | ParentAction::WaitDone { worker, job, .. }
        | ParentAction::Release { worker, job, .. }
        | ParentAction::ReleaseSlice { worker, job, .. }
        | ParentAction::FreeResult { worker, job, .. }
        | ParentAction::JobFinished { worker, job, .. } => Some((*worker, *job)),
        ParentAction::Send { .. }
        | ParentAction::KillWorker { .. }
        | ParentAction::WorkerRemoved { .. }
        | ParentAction::ShutdownComplete => None,
    }
}

/// The worker an action is about, where it names one.
pub(super) fn worker_of(action: &ParentAction) -> Option<WorkerId> {
    match action {
        ParentAction::Send { worker, .. }
        | ParentAction::KillWorker { worker }
        | ParentAction::WorkerRemoved { worker } => Some(*worker),
        ParentAction::RecordReady { worker, .. }
        | ParentAction::SendStaged { worker, .. }
        | ParentAction::AllocateResult { worker, .. }
        | ParentAction::ReceiveStaged { worker, .. }
        | ParentAction::WaitDone { worker, .. }
        | ParentAction::Release { worker, .. }
        | ParentAction::ReleaseSlice { worker, .. }
        | ParentAction::FreeResult { worker, .. }
        | ParentAction::JobFinished { worker, .. } => Some(*worker),
        ParentAction::ShutdownComplete => None,
    }
}

/// The span an action is carried out in, named for its worker and job: with a subscriber at
/// debug, every event logged while carrying it out says which worker and job it was for.
/// Without one, a span costs a check of a cached interest.
pub(super) fn action_span(action: &ParentAction) -> tracing::Span {
    match (job_of(action), worker_of(action)) {
        (Some((worker, job)), _) => tracing::debug_span!("job", %worker, %job),
        (None, Some(worker)) => tracing::debug_span!("worker", %worker),
        (None, None) => tracing::Span::none(),
    }
}

/// The probe's name for an action, marked when it was carried out.
pub(super) fn action_label(action: &ParentAction) -> &'static str {
    match action {
        ParentAction::RecordReady { .. } => "io.record_ready",
        ParentAction::Send { message, .. } => match message {
            Message::Lend(_) => "io.send_lend",
            Message::Ack(_) => "io.send_ack",
            _ => "io.send",
        },
        ParentAction::SendStaged { .. } => "io.send_staged",
        ParentAction::AllocateResult { .. } => "io.allocate_result",
        ParentAction::ReceiveStaged { .. } => "io.receive_staged",
        ParentAction::WaitDone { .. } => "io.wait_done",
        ParentAction::Release { .. } => "io.release",
        ParentAction::ReleaseSlice { .. } => "io.release_slice",
        ParentAction::FreeResult { .. } => "io.free_result",
        ParentAction::KillWorker { .. } => "io.kill",
        ParentAction::JobFinished { .. } => "io.finished",
        ParentAction::WorkerRemoved { .. } => "io.removed",
        ParentAction::ShutdownComplete => "io.shutdown",
    }
}
