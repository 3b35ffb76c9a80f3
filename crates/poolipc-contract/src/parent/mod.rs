//! The parent's side of the contract, at job granularity: starts jobs with one `Lend`,
//! answers shape-first result requests through the facade's allocator, releases a job's
//! handoffs only after the worker's `Ack` (and a wait on its DONE event for pointer
//! handoffs), condemns a worker at its first misbehaviour, and releases a condemned or dead
//! worker's handoffs once it is reaped.
//!
//! One room per job: [`config`] (how it behaves, the bounds), [`events`] (what comes in, and
//! where each event goes), [`actions`] (what goes out), [`lend`] (starting and cancelling
//! jobs), [`results`] (result requests and grants), [`release`] (`Done`, `Ack` and release),
//! [`faults`] (deadlines, violations, hang-ups and reaping). What the parent holds lives in
//! the [`ledger`], which the handlers change only through its operations.

mod actions;
mod config;
mod events;
mod faults;
mod ledger;
mod lend;
mod release;
mod results;

use std::collections::VecDeque;

use crate::error::ContractError;
use crate::message::Message;
use crate::mutation::Mutation;
use crate::types::{JobId, Timestamp, WorkerId};

pub use actions::{JobOutcome, ParentAction};
pub use config::{
    Bound, DEFAULT_CANCEL_GRACE, DEFAULT_MAX_IDLE_MESSAGES, DEFAULT_MAX_JOB_LIFETIME,
    DEFAULT_MAX_RESULT_BYTES_PER_JOB, DEFAULT_MAX_RESULT_BYTES_PER_WORKER,
    DEFAULT_MAX_RESULTS_PER_JOB, ParentConfig,
};
pub use events::ParentEvent;
pub use faults::FailReason;
pub use lend::{InputLoan, SliceLoan};

use ledger::{Ledger, PeerState};

#[cfg(doc)]
use crate::types::Outcome;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shutdown {
    Running,
    Draining,
    Complete,
}

/// The parent's side of the ownership contract, for all of its workers.
///
/// Sans-IO: commands ([`Parent::start_job`], [`Parent::cancel`], [`Parent::stop_worker`],
/// [`Parent::shutdown`]) and events ([`Parent::handle`], [`Parent::handle_timeout`]) go in;
/// [`ParentAction`]s come out of [`Parent::poll_action`] in the order the facade must carry
/// them out.
///
/// A worker's misbehaviour (a message the protocol does not allow at that point, an
/// `Error` from it) condemns that worker and no other: [`ParentAction::KillWorker`], its
/// jobs fail with [`FailReason::ProtocolViolation`] and a detail naming the fault, and once
/// it is reaped every handoff of it is released ([`Outcome::Failed`]), then
/// [`ParentAction::JobFinished`] per job, then [`ParentAction::WorkerRemoved`]. `handle`
/// still returns `Ok`: an `Err` is the facade's own mistake.
#[derive(Debug)]
pub struct Parent {
    config: ParentConfig,
    /// Workers, jobs, loans and result requests, kept consistent ([`ledger`]).
    ledger: Ledger,
    actions: VecDeque<ParentAction>,
    shutdown: Shutdown,
    #[cfg(test)]
    pub(crate) mutation: Option<Mutation>,
}

impl Parent {
    /// A parent with no workers.
    #[must_use]
    pub fn new(config: ParentConfig) -> Parent {
        Parent {
            config,
            ledger: Ledger::default(),
            actions: VecDeque::new(),
            shutdown: Shutdown::Running,
            #[cfg(test)]
            mutation: None,
        }
    }

    #[cfg(test)]
    fn mutated(&self, m: Mutation) -> bool {
        self.mutation == Some(m)
    }

    #[cfg(not(test))]
    #[allow(clippy::unused_self)] // the test build reads `self`
    fn mutated(&self, _: Mutation) -> bool {
        false
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &ParentConfig {
        &self.config
    }

    /// The next action to carry out, if any.
    pub fn poll_action(&mut self) -> Option<ParentAction> {
        self.actions.pop_front()
    }

    /// The earliest deadline of a job of a live worker: call [`Parent::handle_timeout`]
    /// then. A job waiting for the facade's answer to its result request has no handoff
    /// deadline, but its lifetime still ends.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.ledger
            .jobs()
            .filter(|(w, _, _)| self.connected(*w))
            .map(|(_, _, j)| {
                let due = match j.batch() {
                    None => j.deadline.min(j.expires),
                    Some(_) => j.expires,
                };
                j.cancel_by.map_or(due, |c| due.min(c))
            })
            .min()
    }

    /// `worker` declared long jobs (a worker's own choice, told in its handshake): each
    /// `Heartbeat` it sends is progress for its open jobs that are not cancelled, starting
    /// their [`ParentConfig::handoff_timeout`] again. Its jobs still end at
    /// [`ParentConfig::max_job_lifetime`].
    ///
    /// # Errors
    /// The worker is unknown.
    pub fn allow_long_jobs(&mut self, worker: WorkerId) -> Result<(), ContractError> {
        if self.ledger.peer(worker).is_none() {
            return Err(ContractError::UnknownWorker(worker));
        }
        self.ledger.allow_long_jobs(worker);
        Ok(())
    }

    /// Progress on `job`: its handoff deadline starts again.
    fn progress(&mut self, worker: WorkerId, job: JobId, now: Timestamp) {
        let timeout = self.config.handoff_timeout;
        if let Some(j) = self.ledger.job_mut(worker, job) {
            j.deadline = now.saturating_add(timeout);
        }
    }

    /// A message about `job` that moved nothing (`what` says which): counted; past
    /// [`ParentConfig::max_idle_messages`] the worker is condemned.
    fn idle(&mut self, worker: WorkerId, job: JobId, what: &str) {
        let most = self.config.max_idle_messages;
        let Some(j) = self.ledger.job_mut(worker, job) else {
            return;
        };
        j.idle_messages = j.idle_messages.saturating_add(1);
        if j.idle_messages > most {
            let n = j.idle_messages;
            self.condemn(
                worker,
                FailReason::BoundExceeded(Bound::IdleMessages),
                format!(
                    "{worker} sent {n} messages about {job} that were not progress (at most \
                     {most} allowed; the last: {what}): only a granted result request, a Done \
                     that completes handoffs, the first JobError or a declared long job's \
                     heartbeat extend a job"
                ),
                true,
            );
        }
    }

    /// Handoffs lent and not yet released.
    #[must_use]
    pub fn outstanding(&self) -> usize {
        self.ledger.outstanding()
    }

    /// Handoffs of `worker` not yet released.
    #[must_use]
    pub fn outstanding_for(&self, worker: WorkerId) -> usize {
        self.ledger
            .loans()
            .filter(|(_, l)| l.worker == worker)
            .count()
    }

    /// The open jobs of `worker` (started, not finished), in id order.
    #[must_use]
    pub fn jobs_of(&self, worker: WorkerId) -> Vec<JobId> {
        self.ledger
            .peer(worker)
            .map(|p| p.jobs.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Whether `worker` takes new jobs: added, not stopping, not condemned, not reaped.
    #[must_use]
    pub fn is_live(&self, worker: WorkerId) -> bool {
        self.ledger
            .peer(worker)
            .is_some_and(|p| p.state == PeerState::Live && !p.stopping)
    }

    /// Whether the shutdown has finished.
    #[must_use]
    pub fn is_shut_down(&self) -> bool {
        self.shutdown == Shutdown::Complete
    }

    fn connected(&self, worker: WorkerId) -> bool {
        self.ledger
            .peer(worker)
            .is_some_and(|p| p.state == PeerState::Live)
    }

    /// A new worker, after its handshake.
    ///
    /// # Errors
    /// [`ContractError::WorkerExists`] if the id was used before; [`ContractError::ShuttingDown`].
    pub fn add_worker(&mut self, worker: WorkerId) -> Result<(), ContractError> {
        if self.shutdown != Shutdown::Running {
            return Err(ContractError::ShuttingDown);
        }
        if self.ledger.peer(worker).is_some() {
            return Err(ContractError::WorkerExists(worker));
        }
        self.ledger.add_worker(worker);
        self.check_in_tests();
        Ok(())
    }

    fn check_takes_work(&self, worker: WorkerId) -> Result<(), ContractError> {
        match self.ledger.peer(worker) {
            None => Err(ContractError::UnknownWorker(worker)),
            Some(_) if !self.is_live(worker) => Err(ContractError::WorkerGone(worker)),
            Some(_) if self.shutdown != Shutdown::Running => Err(ContractError::ShuttingDown),
            Some(_) => Ok(()),
        }
    }

    /// Stops one worker: `Send(Bye)`; it takes no new job. Its open jobs may still finish;
    /// those open when it is reaped fail with [`FailReason::Stopped`]. The facade waits a
    /// bounded time for EOF, then kills, reaps and reports both. Stopping twice is a no-op.
    ///
    /// # Errors
    /// The worker is unknown, or not connected.
    pub fn stop_worker(&mut self, worker: WorkerId) -> Result<(), ContractError> {
        let Some(peer) = self.ledger.peer(worker) else {
            return Err(ContractError::UnknownWorker(worker));
        };
        if peer.state != PeerState::Live {
            return Err(ContractError::WorkerGone(worker));
        }
        if !peer.stopping {
            self.ledger.stop(worker);
            self.actions.push_back(ParentAction::Send {
                worker,
                message: Message::Bye,
            });
        }
        self.check_in_tests();
        Ok(())
    }

    /// Stops taking work: `Bye` to every live worker (as [`Parent::stop_worker`]); open
    /// jobs end as usual. [`ParentAction::ShutdownComplete`] follows once no job is open and
    /// no result request waits for an answer.
    pub fn shutdown(&mut self) {
        if self.shutdown != Shutdown::Running {
            return;
        }
        self.shutdown = Shutdown::Draining;
        let live: Vec<WorkerId> = self
            .ledger
            .peers()
            .map(|(w, _)| w)
            .filter(|w| self.is_live(*w))
            .collect();
        for worker in live {
            let _ = self.stop_worker(worker);
        }
        self.check_shutdown_complete();
        self.check_in_tests();
    }

    fn check_shutdown_complete(&mut self) {
        if self.shutdown == Shutdown::Draining && self.ledger.is_idle() {
            self.shutdown = Shutdown::Complete;
            self.actions.push_back(ParentAction::ShutdownComplete);
        }
    }

    /// In the crate's own tests, panics if the ledger broke one of its rules: every public
    /// call that changes the parent ends with it. Not in other builds, debug ones included:
    /// the check walks every map, so a facade answering a request of 4096 results one by one
    /// would pay for it 4096 times over.
    fn check_in_tests(&self) {
        if cfg!(test)
            && let Err(violation) = self.ledger.check()
        {
            panic!("the parent's ledger is inconsistent: {violation}");
        }
    }

    /// Whether the ledger keeps its invariants (see [`ledger`]): what the simulation checks
    /// after every step, in every build.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn check_ledger(&self) -> Result<(), crate::invariant::Violation> {
        self.ledger.check()
    }
}
