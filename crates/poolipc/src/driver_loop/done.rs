//! DONE gates: the parent learns on the host that a worker's DONE completed (never a stream
//! wait on a worker's event) before it releases the job's memory; a DONE that never
//! completes condemns its worker at the deadline.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use poolipc_contract::{self as contract, FailReason, JobOutcome, Outcome, ParentAction};
use poolipc_driver::{EventHandle, OwnedEvent};
use poolipc_types::{EventBlob, JobId, WorkerId};

use super::{DoneGate, Loop, Room};
use crate::error::Error;
use crate::state::Stats;

impl Loop {
    /// The worker's DONE of `job`: complete already (the usual case under MPS: it completes
    /// before its frame arrives), or the job is held ([`DoneGate`]) until it is.
    pub(super) fn wait_done(
        &mut self,
        worker: WorkerId,
        job: JobId,
        blob: EventBlob,
    ) -> Result<(), Error> {
        let driver = Arc::clone(&self.shared.driver);
        if !self.jobs.contains_key(&(worker, job)) {
            return Err(Error::Protocol(
                "DONE for a job the loop does not hold".into(),
            ));
        }
        let max = self.shared.options.max_open_done_events;
        let gates = &self.gates;
        let slot = self
            .workers
            .get_mut(&worker)
            .ok_or(Error::UnknownWorker(worker))?;
        let event = match slot.done_events.use_open(&blob) {
            Some(e) => e,
            None => {
                let held = |e: EventHandle| gates.waits_on(worker, e);
                if slot.done_events.make_room(&blob, max, held) == Room::Full {
                    let why = format!(
                        "{worker} sent a new DONE event for {job} while all {max} of its open DONE events are waited on by its held jobs"
                    );
                    self.condemn_for_bound(worker, job, contract::Bound::OpenDoneEvents, why);
                    return Ok(());
                }
                let e = OwnedEvent::open_ipc(Arc::clone(&driver), &blob)?;
                let handle = slot.done_events.insert(blob, e);
                self.count_done_events();
                handle
            }
        };
        // Never `cuStreamWaitEvent(stream, DONE)`: the host learns that the worker's work
        // completed, and only then does the loop queue anything more of the job on `stream`
        // (copy-backs, returns, frees) or hand the job's results to the caller: all of it,
        // and all the caller queues later, comes after the worker's writes.
        if driver.event_query(event)? {
            return Ok(());
        }
        let deadline = Instant::now() + self.shared.options.handoff_timeout;
        tracing::trace!(worker = %worker, job = job.0, "DONE not complete yet: held until it is");
        if self
            .gates
            .add((worker, job), event, deadline, Instant::now())
        {
            Stats::bump(&self.shared.stats.jobs_held_for_done);
        }
        Ok(())
    }

    /// Held jobs: those whose DONE completed go on (their held actions run, in order); a
    /// failed query fails the job as a failed DONE wait did; one past its deadline condemns
    /// its worker (the job fails at the reaping, see [`reap`](Self::reap)).
    pub(super) fn check_gates(&mut self) {
        if self.gates.is_empty() {
            return;
        }
        let driver = Arc::clone(&self.shared.driver);
        let now = Instant::now();
        let keys = self.gates.keys();
        for key in keys {
            let (worker, job) = key;
            let Some(gate) = self.gates.get_mut(key) else {
                continue;
            };
            if gate.expired.is_some() {
                continue;
            }
            let mut failed = None;
            gate.events.retain(|e| match driver.event_query(*e) {
                Ok(done) => !done,
                Err(err) => {
                    failed.get_or_insert(err);
                    false
                }
            });
            if let Some(e) = failed {
                let e = Error::from(e);
                let why = format!("querying the worker's DONE failed: {e}");
                if let Some(st) = self.jobs.get_mut(&key) {
                    st.done_failed = Some(why.clone());
                }
                self.open_gate(key);
                self.forget_dead_events();
                if !self.escalate("querying DONE", &e) {
                    self.lose(worker, &why);
                }
                self.drive();
                continue;
            }
            if gate.events.is_empty() {
                self.pace.active(Instant::now());
                self.open_gate(key);
                self.forget_dead_events();
                continue;
            }
            if now >= gate.deadline
                && let Some(why) = gate.lost.clone()
            {
                if let Some(gate) = self.gates.remove(key) {
                    self.fail_gate(key, gate, &why);
                }
                self.forget_dead_events();
                continue;
            }
            if now >= gate.deadline {
                let timeout = self.shared.options.handoff_timeout;
                let why = format!(
                    "{worker}'s DONE for {job} did not complete on the GPU within the handoff timeout ({timeout:?}): its GPU work hangs"
                );
                gate.expired = Some(why.clone());
                match self.workers.get_mut(&worker) {
                    // Being stopped: kill it now rather than at its stop deadline.
                    Some(slot) if slot.exit_deadline.is_some() => {
                        slot.lost.get_or_insert_with(|| why.clone());
                        slot.exit_deadline = Some(now);
                    }
                    _ => self.lose(worker, &why),
                }
                self.drive();
            }
        }
    }

    /// A held job whose worker was reaped before its DONE completed: the job fails (naming
    /// the deadline if that was why), and its held releases run as a lost worker's do, now
    /// that the process is gone: nothing is copied back, no result is handed out.
    pub(super) fn fail_gate(&mut self, key: (WorkerId, JobId), gate: DoneGate, why: &str) {
        let (reason, detail) = match gate.expired {
            Some(d) => (FailReason::DeadlineExpired, d),
            None => (
                FailReason::HungUp,
                format!("the worker was lost before its DONE completed on the GPU ({why})"),
            ),
        };
        if let Some(st) = self.jobs.get_mut(&key) {
            st.done_failed.get_or_insert_with(|| detail.clone());
        }
        for action in gate.held {
            let action = match action {
                ParentAction::WaitDone { .. } => continue,
                ParentAction::Release {
                    worker,
                    job,
                    handoff,
                    alloc,
                    purpose,
                    rung,
                    outcome: _,
                } => ParentAction::Release {
                    worker,
                    job,
                    handoff,
                    alloc,
                    purpose,
                    rung,
                    outcome: Outcome::Failed,
                },
                ParentAction::ReleaseSlice {
                    worker,
                    job,
                    handoff,
                    alloc,
                    outcome: _,
                    carved: _,
                } => ParentAction::ReleaseSlice {
                    worker,
                    job,
                    handoff,
                    alloc,
                    outcome: Outcome::Failed,
                    carved: Vec::new(),
                },
                ParentAction::JobFinished { worker, job, .. } => ParentAction::JobFinished {
                    worker,
                    job,
                    outcome: JobOutcome::Failed {
                        reason,
                        detail: detail.clone(),
                    },
                },
                other => other,
            };
            self.act(action);
        }
    }

    /// Closes the DONE events of reaped workers no held job waits on any more.
    pub(super) fn forget_dead_events(&mut self) {
        self.gates.forget_dead();
        self.count_done_events();
    }

    /// `ParentStats::done_events_open`: the DONE events the parent holds open now.
    pub(super) fn count_done_events(&self) {
        let open: usize = self
            .workers
            .values()
            .map(|s| s.done_events.len())
            .sum::<usize>()
            + self.gates.dead_open();
        self.shared.rooms[self.room]
            .done_events_open
            .store(u64::try_from(open).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// The job's DONE completed (or will never be waited on): its held actions run now.
    pub(super) fn open_gate(&mut self, key: (WorkerId, JobId)) {
        let Some(gate) = self.gates.remove(key) else {
            return;
        };
        for action in gate.held {
            self.act(action);
        }
    }
}
