//! The parent's side of the contract: lends inputs, allocates results, releases only after
//! the worker's ACK and a wait on DONE, and cleans up after dead workers once they are reaped.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use crate::error::ContractError;
use crate::legacy::{Offer, Refusal, ToParent, ToWorker};
use crate::types::{
    AllocId, HandoffId, JobId, Outcome, Purpose, RequestId, ResultSpec, Span, Timestamp, WorkerId,
};
use poolipc_types::ImportLimit;

/// How the parent side behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParentConfig {
    /// Which allocations may go by pool pointer.
    pub limit: ImportLimit,
    /// How long a worker may hold a handoff before the ACK. Past it, the worker is killed,
    /// its jobs fail, and what it held is released once it is reaped.
    pub handoff_timeout: Duration,
}

impl Default for ParentConfig {
    fn default() -> Self {
        ParentConfig {
            limit: ImportLimit::default(),
            handoff_timeout: Duration::from_secs(30),
        }
    }
}

/// Why a job failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailReason {
    /// A handoff of the worker missed its deadline; the worker is being killed.
    DeadlineExpired,
    /// The worker's connection closed.
    HungUp,
    /// The worker process was reaped.
    Reaped,
}

/// Something from outside for the parent machine.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParentEvent {
    /// A message from a worker.
    Message {
        /// The sender.
        worker: WorkerId,
        /// The message.
        message: ToParent,
    },
    /// The facade allocated the memory [`ParentAction::AllocateResult`] asked for.
    ResultAllocated {
        /// The worker that asked.
        worker: WorkerId,
        /// Its request.
        request: RequestId,
        /// The new allocation, a fresh id.
        alloc: AllocId,
        /// Its range.
        span: Span,
    },
    /// The facade could not or would not allocate it.
    ResultDeclined {
        /// The worker that asked.
        worker: WorkerId,
        /// Its request.
        request: RequestId,
    },
    /// The worker's connection closed (EOF or error). The process may still run and still
    /// hold imports: nothing is released until [`ParentEvent::WorkerReaped`].
    WorkerHungUp {
        /// The worker.
        worker: WorkerId,
    },
    /// The worker process has been reaped: the driver has dropped its imports.
    WorkerReaped {
        /// The worker.
        worker: WorkerId,
    },
}

/// Work the parent machine asks of the facade, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[must_use]
pub enum ParentAction {
    /// Make sure an export of this allocation's pointer exists (a blob cached for the live
    /// allocation satisfies it).
    Export {
        /// The allocation.
        alloc: AllocId,
        /// Its range.
        span: Span,
    },
    /// Record this handoff's interprocess READY event on the producing stream.
    RecordReady {
        /// The handoff.
        handoff: HandoffId,
    },
    /// Send a message to a worker (an [`Offer`] goes with its export blob and READY handle).
    Send {
        /// The recipient.
        worker: WorkerId,
        /// The message.
        message: ToWorker,
    },
    /// Allocate memory for a worker's result (torch.empty or the arena), then answer with
    /// [`ParentEvent::ResultAllocated`] or [`ParentEvent::ResultDeclined`].
    AllocateResult {
        /// The worker asking.
        worker: WorkerId,
        /// The job.
        job: JobId,
        /// The request.
        request: RequestId,
        /// What it asked for.
        spec: ResultSpec,
    },
    /// Drop an allocation made for a request that can no longer be offered. It was never
    /// exported or offered, so no import of it exists.
    FreeResult {
        /// The worker that had asked.
        worker: WorkerId,
        /// Its request.
        request: RequestId,
        /// The allocation.
        alloc: AllocId,
    },
    /// Make the consumer streams wait on this handoff's DONE event. Always comes right
    /// before the [`ParentAction::Release`] of an acknowledged handoff.
    WaitDone {
        /// The handoff.
        handoff: HandoffId,
    },
    /// The handoff is over: drop the contract's reference. An input's memory may be reused
    /// once nothing else holds it; a [`Outcome::Completed`] result is the caller's tensor.
    Release {
        /// The worker it was lent to.
        worker: WorkerId,
        /// Its job.
        job: JobId,
        /// The handoff.
        handoff: HandoffId,
        /// The allocation.
        alloc: AllocId,
        /// Input or result.
        purpose: Purpose,
        /// How it ended.
        outcome: Outcome,
    },
    /// Kill the worker process (SIGKILL), then report [`ParentEvent::WorkerHungUp`] and,
    /// once waited for, [`ParentEvent::WorkerReaped`].
    KillWorker {
        /// The worker.
        worker: WorkerId,
    },
    /// The job failed; its handoffs are released when the worker is reaped.
    JobFailed {
        /// The worker.
        worker: WorkerId,
        /// The job.
        job: JobId,
        /// Why.
        reason: FailReason,
    },
    /// Shutdown requested and nothing is outstanding any more.
    ShutdownComplete,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Peer {
    Live { last_request: Option<RequestId> },
    Condemned,
    Reaped,
}

#[derive(Clone, Debug)]
struct Loan {
    worker: WorkerId,
    job: JobId,
    alloc: AllocId,
    purpose: Purpose,
    deadline: Timestamp,
    cancelled: bool,
}

#[derive(Clone, Copy, Debug)]
struct Lent {
    span: Span,
    loans: u32,
}

#[derive(Clone, Debug)]
struct Pending {
    job: JobId,
    spec: ResultSpec,
    abandoned: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shutdown {
    Running,
    Draining,
    Complete,
}

/// The parent's side of the ownership contract, for all of its workers.
///
/// Sans-IO: commands ([`Parent::lend`], [`Parent::cancel`], [`Parent::shutdown`]) and events
/// ([`Parent::handle`], [`Parent::handle_timeout`]) go in, [`ParentAction`]s come out of
/// [`Parent::poll_action`] in the order the facade must carry them out.
#[derive(Debug)]
pub struct Parent {
    config: ParentConfig,
    workers: BTreeMap<WorkerId, Peer>,
    loans: BTreeMap<HandoffId, Loan>,
    lent: BTreeMap<AllocId, Lent>,
    pending: BTreeMap<(WorkerId, RequestId), Pending>,
    cancelled: BTreeSet<(WorkerId, JobId)>,
    actions: VecDeque<ParentAction>,
    next_handoff: u64,
    shutdown: Shutdown,
    #[cfg(test)]
    pub(crate) mutation: Option<crate::mutation::Mutation>,
}

impl Parent {
    /// A parent with no workers.
    #[must_use]
    pub fn new(config: ParentConfig) -> Parent {
        Parent {
            config,
            workers: BTreeMap::new(),
            loans: BTreeMap::new(),
            lent: BTreeMap::new(),
            pending: BTreeMap::new(),
            cancelled: BTreeSet::new(),
            actions: VecDeque::new(),
            next_handoff: 0,
            shutdown: Shutdown::Running,
            #[cfg(test)]
            mutation: None,
        }
    }

    #[cfg(test)]
    fn mutated(&self, m: crate::mutation::Mutation) -> bool {
        self.mutation == Some(m)
    }

    #[cfg(not(test))]
    #[allow(clippy::unused_self)] // the test build reads `self`
    fn mutated(&self, _: crate::mutation::Mutation) -> bool {
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

    /// The earliest deadline of a live worker's handoff: call [`Parent::handle_timeout`] then.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.loans
            .values()
            .filter(|l| self.is_live(l.worker))
            .map(|l| l.deadline)
            .min()
    }

    /// Handoffs lent and not yet released.
    #[must_use]
    pub fn outstanding(&self) -> usize {
        self.loans.len()
    }

    /// Handoffs of `worker` not yet released.
    #[must_use]
    pub fn outstanding_for(&self, worker: WorkerId) -> usize {
        self.loans.values().filter(|l| l.worker == worker).count()
    }

    /// Whether `worker` takes work: added, not hung up, not condemned, not reaped.
    #[must_use]
    pub fn is_live(&self, worker: WorkerId) -> bool {
        matches!(self.workers.get(&worker), Some(Peer::Live { .. }))
    }

    /// Whether the shutdown has finished.
    #[must_use]
    pub fn is_shut_down(&self) -> bool {
        self.shutdown == Shutdown::Complete
    }

    /// A new worker, after its handshake.
    ///
    /// # Errors
    /// [`ContractError::WorkerExists`] if the id was used before; [`ContractError::ShuttingDown`].
    pub fn add_worker(&mut self, worker: WorkerId) -> Result<(), ContractError> {
        if self.shutdown != Shutdown::Running {
            return Err(ContractError::ShuttingDown);
        }
        if self.workers.contains_key(&worker) {
            return Err(ContractError::WorkerExists(worker));
        }
        self.workers
            .insert(worker, Peer::Live { last_request: None });
        Ok(())
    }

    fn check_live(&self, worker: WorkerId) -> Result<(), ContractError> {
        match self.workers.get(&worker) {
            None => Err(ContractError::UnknownWorker(worker)),
            Some(Peer::Live { .. }) => Ok(()),
            Some(_) => Err(ContractError::WorkerGone(worker)),
        }
    }

    /// Lend an input: the allocation `alloc` (covering `span`) to `worker` for `job`, by pool
    /// pointer. Queues EXPORT (first loan of the allocation), RECORD READY and the offer.
    ///
    /// This is the rung decision's input: an allocation above the pointer limit is refused
    /// here ([`crate::Invariant::ImportLimit`]); the facade then takes the next rung.
    ///
    /// # Errors
    /// The worker is unknown or gone, the parent is shutting down, the job was cancelled,
    /// the allocation is above the limit or known with another range. Nothing is queued then.
    pub fn lend(
        &mut self,
        worker: WorkerId,
        job: JobId,
        alloc: AllocId,
        span: Span,
        now: Timestamp,
    ) -> Result<HandoffId, ContractError> {
        self.check_live(worker)?;
        if self.shutdown != Shutdown::Running {
            return Err(ContractError::ShuttingDown);
        }
        if self.cancelled.contains(&(worker, job)) {
            return Err(ContractError::JobCancelled { worker, job });
        }
        if !self.config.limit.admits(span)
            && !self.mutated(crate::mutation::Mutation::IgnoreImportLimit)
        {
            return Err(ContractError::AboveImportLimit { alloc, span });
        }
        if self.lent.get(&alloc).is_some_and(|l| l.span != span) {
            return Err(ContractError::AllocationMismatch { alloc });
        }
        Ok(self.open_loan(worker, job, alloc, span, Purpose::Input, now))
    }

    fn open_loan(
        &mut self,
        worker: WorkerId,
        job: JobId,
        alloc: AllocId,
        span: Span,
        purpose: Purpose,
        now: Timestamp,
    ) -> HandoffId {
        let handoff = HandoffId(self.next_handoff);
        self.next_handoff += 1;
        let entry = self.lent.entry(alloc).or_insert(Lent { span, loans: 0 });
        if entry.loans == 0 {
            self.actions.push_back(ParentAction::Export { alloc, span });
        }
        entry.loans += 1;
        self.loans.insert(
            handoff,
            Loan {
                worker,
                job,
                alloc,
                purpose,
                deadline: now.saturating_add(self.config.handoff_timeout),
                cancelled: false,
            },
        );
        self.actions
            .push_back(ParentAction::RecordReady { handoff });
        self.actions.push_back(ParentAction::Send {
            worker,
            message: ToWorker::Offer(Offer {
                handoff,
                job,
                alloc,
                span,
                purpose,
            }),
        });
        handoff
    }

    /// Cancel `job` on `worker`: the worker is told; handoffs still end with ACK (or reaping),
    /// pending result requests of the job are refused.
    ///
    /// # Errors
    /// The worker is unknown or gone.
    pub fn cancel(&mut self, worker: WorkerId, job: JobId) -> Result<(), ContractError> {
        self.check_live(worker)?;
        if !self.cancelled.insert((worker, job)) {
            return Ok(());
        }
        self.actions.push_back(ParentAction::Send {
            worker,
            message: ToWorker::Cancel { job },
        });
        for loan in self.loans.values_mut() {
            if loan.worker == worker && loan.job == job {
                loan.cancelled = true;
            }
        }
        let refused: Vec<RequestId> = self
            .pending
            .iter()
            .filter(|((w, _), p)| *w == worker && p.job == job && !p.abandoned)
            .map(|((_, r), _)| *r)
            .collect();
        for request in refused {
            self.refuse_pending(worker, request, Refusal::Cancelled);
        }
        Ok(())
    }

    fn refuse_pending(&mut self, worker: WorkerId, request: RequestId, reason: Refusal) {
        if let Some(p) = self.pending.get_mut(&(worker, request)) {
            p.abandoned = true;
            let job = p.job;
            self.actions.push_back(ParentAction::Send {
                worker,
                message: ToWorker::ResultRefused {
                    job,
                    request,
                    reason,
                },
            });
        }
    }

    /// Stop taking work: workers are told, pending result requests refused; outstanding
    /// handoffs end as usual (ACK, or deadline then reaping). [`ParentAction::ShutdownComplete`]
    /// follows once nothing is outstanding.
    pub fn shutdown(&mut self) {
        if self.shutdown != Shutdown::Running {
            return;
        }
        self.shutdown = Shutdown::Draining;
        let live: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, p)| matches!(p, Peer::Live { .. }))
            .map(|(w, _)| *w)
            .collect();
        for worker in live {
            self.actions.push_back(ParentAction::Send {
                worker,
                message: ToWorker::Shutdown,
            });
        }
        let refused: Vec<(WorkerId, RequestId)> = self
            .pending
            .iter()
            .filter(|(_, p)| !p.abandoned)
            .map(|(k, _)| *k)
            .collect();
        for (worker, request) in refused {
            if self.is_live(worker) {
                self.refuse_pending(worker, request, Refusal::ShuttingDown);
            }
        }
        self.check_shutdown_complete();
    }

    fn check_shutdown_complete(&mut self) {
        if self.shutdown == Shutdown::Draining && self.loans.is_empty() && self.pending.is_empty() {
            self.shutdown = Shutdown::Complete;
            self.actions.push_back(ParentAction::ShutdownComplete);
        }
    }

    /// Deadlines: every live worker holding a handoff past its deadline is condemned
    /// (killed; its jobs fail; its handoffs are released when it is reaped).
    pub fn handle_timeout(&mut self, now: Timestamp) {
        let late: BTreeSet<WorkerId> = self
            .loans
            .values()
            .filter(|l| l.deadline <= now && self.is_live(l.worker))
            .map(|l| l.worker)
            .collect();
        for worker in late {
            self.condemn(worker, FailReason::DeadlineExpired, true);
        }
    }

    fn jobs_of(&self, worker: WorkerId) -> BTreeSet<JobId> {
        self.loans
            .values()
            .filter(|l| l.worker == worker)
            .map(|l| l.job)
            .chain(
                self.pending
                    .iter()
                    .filter(|((w, _), p)| *w == worker && !p.abandoned)
                    .map(|(_, p)| p.job),
            )
            .collect()
    }

    fn condemn(&mut self, worker: WorkerId, reason: FailReason, kill: bool) {
        for job in self.jobs_of(worker) {
            self.actions.push_back(ParentAction::JobFailed {
                worker,
                job,
                reason,
            });
        }
        for (_, p) in self.pending.iter_mut().filter(|((w, _), _)| *w == worker) {
            p.abandoned = true;
        }
        if kill {
            self.actions.push_back(ParentAction::KillWorker { worker });
        }
        self.workers.insert(worker, Peer::Condemned);
    }

    /// An input from outside.
    ///
    /// # Errors
    /// A message from an unknown, gone or wrong worker, about an unknown handoff or request,
    /// a duplicate request, a result allocation that reuses a live id. Nothing changes then.
    pub fn handle(&mut self, event: ParentEvent, now: Timestamp) -> Result<(), ContractError> {
        match event {
            ParentEvent::Message { worker, message } => match message {
                ToParent::Ack { handoff } => self.on_ack(worker, handoff),
                ToParent::ResultRequest { job, request, spec } => {
                    self.on_result_request(worker, job, request, spec, now)
                }
            },
            ParentEvent::ResultAllocated {
                worker,
                request,
                alloc,
                span,
            } => self.on_result_allocated(worker, request, alloc, span, now),
            ParentEvent::ResultDeclined { worker, request } => {
                let Some(p) = self.pending.remove(&(worker, request)) else {
                    return Err(ContractError::UnknownRequest { request });
                };
                if !p.abandoned {
                    self.actions.push_back(ParentAction::Send {
                        worker,
                        message: ToWorker::ResultRefused {
                            job: p.job,
                            request,
                            reason: Refusal::Declined,
                        },
                    });
                }
                self.check_shutdown_complete();
                Ok(())
            }
            ParentEvent::WorkerHungUp { worker } => self.on_hung_up(worker),
            ParentEvent::WorkerReaped { worker } => self.on_reaped(worker),
        }
    }

    fn on_ack(&mut self, worker: WorkerId, handoff: HandoffId) -> Result<(), ContractError> {
        self.check_live(worker)?;
        let Some(loan) = self.loans.get(&handoff) else {
            return Err(ContractError::UnknownHandoff(handoff));
        };
        if loan.worker != worker {
            return Err(ContractError::WrongWorker { handoff, worker });
        }
        let outcome = if loan.cancelled {
            Outcome::Cancelled
        } else {
            Outcome::Completed
        };
        if !self.mutated(crate::mutation::Mutation::ReleaseWithoutWaitingDone) {
            self.actions.push_back(ParentAction::WaitDone { handoff });
        }
        self.release(handoff, outcome);
        self.check_shutdown_complete();
        Ok(())
    }

    fn release(&mut self, handoff: HandoffId, outcome: Outcome) {
        let Some(loan) = self.loans.remove(&handoff) else {
            return;
        };
        if let Some(entry) = self.lent.get_mut(&loan.alloc) {
            entry.loans = entry.loans.saturating_sub(1);
            if entry.loans == 0 {
                self.lent.remove(&loan.alloc);
            }
        }
        self.actions.push_back(ParentAction::Release {
            worker: loan.worker,
            job: loan.job,
            handoff,
            alloc: loan.alloc,
            purpose: loan.purpose,
            outcome,
        });
    }

    fn on_result_request(
        &mut self,
        worker: WorkerId,
        job: JobId,
        request: RequestId,
        spec: ResultSpec,
        now: Timestamp,
    ) -> Result<(), ContractError> {
        self.check_live(worker)?;
        let Some(Peer::Live { last_request }) = self.workers.get_mut(&worker) else {
            return Err(ContractError::WorkerGone(worker));
        };
        if last_request.is_some_and(|last| request <= last) {
            return Err(ContractError::DuplicateRequest { request });
        }
        *last_request = Some(request);
        let refusal = if self.shutdown != Shutdown::Running {
            Some(Refusal::ShuttingDown)
        } else if self.cancelled.contains(&(worker, job)) {
            Some(Refusal::Cancelled)
        } else if spec.dense_bytes().is_none_or(|dense| spec.bytes < dense) {
            Some(Refusal::Malformed)
        } else {
            None
        };
        if let Some(reason) = refusal {
            self.actions.push_back(ParentAction::Send {
                worker,
                message: ToWorker::ResultRefused {
                    job,
                    request,
                    reason,
                },
            });
            return Ok(());
        }
        if self.mutated(crate::mutation::Mutation::GrantBeforeAllocation) {
            // Test-only bug: offer memory nobody allocated.
            let span = Span {
                ptr: 0,
                bytes: spec.bytes,
            };
            let alloc = AllocId(u64::MAX - request.0);
            self.open_loan(worker, job, alloc, span, Purpose::Result { request }, now);
            return Ok(());
        }
        self.pending.insert(
            (worker, request),
            Pending {
                job,
                spec: spec.clone(),
                abandoned: false,
            },
        );
        self.actions.push_back(ParentAction::AllocateResult {
            worker,
            job,
            request,
            spec,
        });
        Ok(())
    }

    fn on_result_allocated(
        &mut self,
        worker: WorkerId,
        request: RequestId,
        alloc: AllocId,
        span: Span,
        now: Timestamp,
    ) -> Result<(), ContractError> {
        if !self.pending.contains_key(&(worker, request)) {
            return Err(ContractError::UnknownRequest { request });
        }
        if self.lent.contains_key(&alloc) {
            return Err(ContractError::AllocationMismatch { alloc });
        }
        let Some(p) = self.pending.remove(&(worker, request)) else {
            return Err(ContractError::UnknownRequest { request });
        };
        let refusal = if p.abandoned || !self.is_live(worker) {
            None
        } else if !self.config.limit.admits(span)
            && !self.mutated(crate::mutation::Mutation::IgnoreImportLimit)
        {
            Some(Refusal::AboveImportLimit)
        } else if span.bytes < p.spec.bytes {
            Some(Refusal::TooSmall)
        } else {
            self.open_loan(worker, p.job, alloc, span, Purpose::Result { request }, now);
            return Ok(());
        };
        self.actions.push_back(ParentAction::FreeResult {
            worker,
            request,
            alloc,
        });
        if let Some(reason) = refusal {
            self.actions.push_back(ParentAction::Send {
                worker,
                message: ToWorker::ResultRefused {
                    job: p.job,
                    request,
                    reason,
                },
            });
        }
        self.check_shutdown_complete();
        Ok(())
    }

    fn on_hung_up(&mut self, worker: WorkerId) -> Result<(), ContractError> {
        match self.workers.get(&worker) {
            None => Err(ContractError::UnknownWorker(worker)),
            Some(Peer::Reaped) => Err(ContractError::WorkerGone(worker)),
            Some(Peer::Condemned) => Ok(()),
            Some(Peer::Live { .. }) => {
                self.condemn(worker, FailReason::HungUp, true);
                if self.mutated(crate::mutation::Mutation::ReleaseAtHangUp) {
                    // Test-only bug: release before the process is reaped.
                    for handoff in self.handoffs_of(worker) {
                        self.release(handoff, Outcome::Failed);
                    }
                }
                Ok(())
            }
        }
    }

    fn handoffs_of(&self, worker: WorkerId) -> Vec<HandoffId> {
        self.loans
            .iter()
            .filter(|(_, l)| l.worker == worker)
            .map(|(h, _)| *h)
            .collect()
    }

    fn on_reaped(&mut self, worker: WorkerId) -> Result<(), ContractError> {
        match self.workers.get(&worker) {
            None => return Err(ContractError::UnknownWorker(worker)),
            Some(Peer::Reaped) => return Err(ContractError::WorkerGone(worker)),
            Some(Peer::Live { .. }) => self.condemn(worker, FailReason::Reaped, false),
            Some(Peer::Condemned) => {}
        }
        self.workers.insert(worker, Peer::Reaped);
        for handoff in self.handoffs_of(worker) {
            if self.mutated(crate::mutation::Mutation::ForgetDeadWorkersLoans) {
                // Test-only bug: drop the bookkeeping without releasing.
                self.loans.remove(&handoff);
            } else {
                self.release(handoff, Outcome::Failed);
            }
        }
        self.cancelled.retain(|(w, _)| *w != worker);
        self.check_shutdown_complete();
        Ok(())
    }
}
