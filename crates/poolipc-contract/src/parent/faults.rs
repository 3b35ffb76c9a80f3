//! Deaths and faults: why a job failed ([`FailReason`]); deadlines and job lifetimes;
//! condemning a worker at its first misbehaviour or past a bound; hang-ups, and releasing
//! everything a worker held once it is reaped.

use std::collections::BTreeMap;
use std::fmt;

use crate::error::ContractError;
use crate::mutation::Mutation;
use crate::types::{JobId, Outcome, Timestamp, WorkerId, in_arena};

use super::ledger::PeerState;
use super::{Bound, JobOutcome, Parent, ParentAction};

/// Why a job failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailReason {
    /// The worker sent no word about a job of it within the deadline; it was killed.
    DeadlineExpired,
    /// The worker's connection closed, or its process exited, without being stopped.
    HungUp,
    /// The worker broke the protocol (the detail says how); it was killed.
    ProtocolViolation,
    /// The worker was stopped ([`Parent::stop_worker`], [`Parent::shutdown`]) with the job
    /// still open.
    Stopped,
    /// The job was cancelled ([`Parent::cancel`]): the worker finished it (Done, Ack), so
    /// what it held is released as [`Outcome::Cancelled`]; or it did not within
    /// [`ParentConfig::cancel_grace`](super::ParentConfig::cancel_grace), so it was killed and
    /// what it held is released once it is reaped.
    Cancelled,
    /// The worker went past a bound (the detail says by how much); it was killed.
    BoundExceeded(Bound),
}

impl fmt::Display for FailReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FailReason::DeadlineExpired => "deadline expired",
            FailReason::HungUp => "the worker hung up",
            FailReason::ProtocolViolation => "protocol violation",
            FailReason::Stopped => "the worker was stopped",
            FailReason::Cancelled => "cancelled",
            FailReason::BoundExceeded(Bound::ResultsPerJob) => "bound exceeded: results per job",
            FailReason::BoundExceeded(Bound::ResultBytesPerJob) => {
                "bound exceeded: result bytes per job"
            }
            FailReason::BoundExceeded(Bound::ResultBytesPerWorker) => {
                "bound exceeded: result bytes per worker"
            }
            FailReason::BoundExceeded(Bound::JobLifetime) => "bound exceeded: job lifetime",
            FailReason::BoundExceeded(Bound::OpenDoneEvents) => {
                "bound exceeded: open DONE events per worker"
            }
            FailReason::BoundExceeded(Bound::StagingBacklog) => "bound exceeded: staging backlog",
            FailReason::BoundExceeded(Bound::IdleMessages) => {
                "bound exceeded: messages without progress per job"
            }
        })
    }
}

impl Parent {
    /// Deadlines: every live worker with a job past its deadline is condemned
    /// ([`FailReason::DeadlineExpired`], [`ParentAction::KillWorker`]).
    pub fn handle_timeout(&mut self, now: Timestamp) {
        let expired: BTreeMap<WorkerId, JobId> = self
            .ledger
            .jobs()
            .filter(|(w, _, j)| j.expires <= now && self.connected(*w))
            .map(|(w, job, _)| (w, job))
            .collect();
        let lifetime = self.config.max_job_lifetime;
        for (worker, job) in expired {
            self.condemn(
                worker,
                FailReason::BoundExceeded(Bound::JobLifetime),
                format!("{job} on {worker} was still open at its lifetime ({lifetime:?})"),
                true,
            );
        }
        let unanswered: BTreeMap<WorkerId, JobId> = self
            .ledger
            .jobs()
            .filter(|(w, _, j)| j.cancel_by.is_some_and(|c| c <= now) && self.connected(*w))
            .map(|(w, job, _)| (w, job))
            .collect();
        let grace = self.config.cancel_grace;
        for (worker, job) in unanswered {
            self.condemn(
                worker,
                FailReason::Cancelled,
                format!(
                    "{job} on {worker} was cancelled and the worker did not finish it within \
                     the cancel grace ({grace:?}): killed"
                ),
                true,
            );
        }
        let late: BTreeMap<WorkerId, JobId> = self
            .ledger
            .jobs()
            .filter(|(w, _, j)| j.batch().is_none() && j.deadline <= now && self.connected(*w))
            .map(|(w, job, _)| (w, job))
            .collect();
        let timeout = self.config.handoff_timeout;
        for (worker, job) in late {
            self.condemn(
                worker,
                FailReason::DeadlineExpired,
                format!(
                    "{worker} made no progress on {job} within {timeout:?}{}",
                    match self.ledger.job(worker, job).map_or(0, |j| j.idle_messages) {
                        0 => String::new(),
                        n => format!(
                            " ({n} messages about it were not progress: only a granted result \
                             request, a Done that completes handoffs, the first JobError or a \
                             declared long job's heartbeat extend a job)"
                        ),
                    }
                ),
                true,
            );
        }
        self.check_shutdown_complete();
        self.check_in_tests();
    }

    /// Marks `worker` condemned: its messages are ignored from now on, its jobs fail with
    /// `reason` when it is reaped.
    pub(super) fn condemn(
        &mut self,
        worker: WorkerId,
        reason: FailReason,
        detail: String,
        kill: bool,
    ) {
        if self.ledger.condemn(worker, reason, detail) && kill {
            self.actions.push_back(ParentAction::KillWorker { worker });
        }
    }

    /// Condemns `worker` for going past a bound the facade enforces itself
    /// ([`Bound::OpenDoneEvents`], [`Bound::StagingBacklog`]): [`ParentAction::KillWorker`],
    /// its jobs fail with [`FailReason::BoundExceeded`] and `detail` once it is reaped. A
    /// worker condemned already keeps its first reason.
    ///
    /// # Errors
    /// The worker is unknown.
    pub fn condemn_for(
        &mut self,
        worker: WorkerId,
        bound: Bound,
        detail: String,
    ) -> Result<(), ContractError> {
        if self.ledger.peer(worker).is_none() {
            return Err(ContractError::UnknownWorker(worker));
        }
        self.condemn(worker, FailReason::BoundExceeded(bound), detail, true);
        self.check_in_tests();
        Ok(())
    }

    /// Condemns `worker` for a protocol violation; `detail` says what it did.
    pub(super) fn violation(&mut self, worker: WorkerId, detail: String) {
        self.condemn(
            worker,
            FailReason::ProtocolViolation,
            format!("protocol violation by {worker}: {detail}"),
            true,
        );
    }

    pub(super) fn on_hung_up(&mut self, worker: WorkerId, why: &str) -> Result<(), ContractError> {
        let Some(peer) = self.ledger.peer(worker) else {
            return Err(ContractError::UnknownWorker(worker));
        };
        if peer.state != PeerState::Live {
            return Ok(());
        }
        // A stopped worker closing its end with nothing open is its goodbye: the facade
        // reaps it. Anything else is a lost worker: kill it to be sure it is gone.
        let (reason, kill) = match (peer.stopping, peer.jobs.is_empty()) {
            (true, true) => (FailReason::Stopped, false),
            (true, false) => (FailReason::Stopped, true),
            (false, _) => (FailReason::HungUp, true),
        };
        self.condemn(worker, reason, format!("{worker} hung up: {why}"), kill);
        if self.mutated(Mutation::ReleaseAtHangUp) {
            // Test-only bug: release before the process is reaped.
            for handoff in self.ledger.loans_of(worker) {
                self.release(handoff, Outcome::Failed);
            }
        }
        if self.mutated(Mutation::ReleaseArenaAtHangUp) {
            // Test-only bug: arena blocks have no import, so "nothing to wait for".
            for handoff in self.ledger.loans_of(worker) {
                if self.ledger.loan(handoff).is_some_and(|l| in_arena(l.rung)) {
                    self.release(handoff, Outcome::Failed);
                }
            }
        }
        Ok(())
    }

    pub(super) fn on_reaped(&mut self, worker: WorkerId) -> Result<(), ContractError> {
        let Some(peer) = self.ledger.peer(worker) else {
            return Err(ContractError::UnknownWorker(worker));
        };
        match peer.state {
            PeerState::Reaped => return Ok(()),
            PeerState::Live => {
                let reason = if peer.stopping {
                    FailReason::Stopped
                } else {
                    FailReason::HungUp
                };
                self.condemn(worker, reason, format!("{worker}'s process exited"), false);
            }
            PeerState::Condemned => {}
        }
        let jobs = self.ledger.reap(worker);
        // Every loan, released: the driver dropped the process's imports.
        for handoff in self.ledger.loans_of(worker) {
            if self.mutated(Mutation::ForgetDeadWorkersLoans) {
                // Test-only bug: drop the bookkeeping without releasing.
                let _ = self.ledger.release(handoff);
            } else {
                self.release(handoff, Outcome::Failed);
            }
        }
        // Allocations answered and never offered: the caller's to free.
        for &job in &jobs {
            self.refuse_answered(worker, job);
        }
        if jobs.is_empty() {
            self.actions
                .push_back(ParentAction::WorkerRemoved { worker });
        }
        for job in jobs {
            self.finish_abandoned(worker, job);
        }
        Ok(())
    }

    /// A reaped worker's job: finished once no request of it waits for the facade's answer;
    /// the worker removed once it has no job left.
    pub(super) fn finish_abandoned(&mut self, worker: WorkerId, job: JobId) {
        let Some(j) = self.ledger.job(worker, job) else {
            return;
        };
        if j.awaiting_answer() {
            return;
        }
        self.ledger.close_job(worker, job);
        let Some(peer) = self.ledger.peer(worker) else {
            return;
        };
        let (reason, detail) = peer
            .failure
            .clone()
            .unwrap_or((FailReason::HungUp, format!("{worker} was reaped")));
        let empty = peer.jobs.is_empty();
        self.actions.push_back(ParentAction::JobFinished {
            worker,
            job,
            outcome: JobOutcome::Failed { reason, detail },
        });
        if empty {
            self.actions
                .push_back(ParentAction::WorkerRemoved { worker });
        }
    }
}
