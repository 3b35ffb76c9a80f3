//! The parent's side of the contract, at job granularity: starts jobs with one `Lend`,
//! answers shape-first result requests through the facade's allocator, releases a job's
//! handoffs only after the worker's `Ack` (and a wait on its DONE event for pointer
//! handoffs), condemns a worker at its first misbehaviour, and releases a condemned or dead
//! worker's handoffs once it is reaped.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::Duration;

use crate::error::ContractError;
use crate::message::{
    Ack, AllocationGrant, ArenaLocation, CarvedResult, Done, ErrorCode, Lend, LentSlice,
    LentTensor, MAX_BATCH, MAX_REFUSAL_TEXT_LEN, MAX_RESULTS_PER_REQUEST, Message, ResultGrant,
    ResultRequest, ResultSpec, TensorMeta,
};
use crate::mutation::Mutation;
use crate::types::{
    AllocId, EventBlob, ExportBlob, HandoffId, JobId, Outcome, Purpose, RequestId, Rung, Span,
    Timestamp, WorkerId, ZERO_EVENT, ZERO_EXPORT, by_pointer, dense_bytes, done_gated, in_arena,
    ready_gated, staged,
};
use poolipc_types::{ARENA_ALIGN, ImportLimit};

/// How the parent side behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParentConfig {
    /// Which allocations may go by pool pointer.
    pub limit: ImportLimit,
    /// How long a job may go without a word from its worker (a message about the job). Past
    /// it, the worker is killed, its jobs fail, and what it held is released once it is
    /// reaped.
    pub handoff_timeout: Duration,
    /// The most results one job may ask for, over all its result requests (those a request
    /// over [`MAX_RESULTS_PER_REQUEST`] asks for are refused and not counted). Past it the
    /// worker is condemned: [`FailReason::BoundExceeded`] with [`Bound::ResultsPerJob`].
    pub max_results_per_job: u64,
    /// The most result bytes one job may ask for, over all its result requests (counted as
    /// asked, whether the facade then allocates or refuses them). Past it the worker is
    /// condemned ([`Bound::ResultBytesPerJob`]).
    pub max_result_bytes_per_job: u64,
    /// The most result bytes a worker may have asked for in its open jobs together: a job's
    /// results count until the job finished (its results handed to the caller, or freed).
    /// Past it the worker is condemned ([`Bound::ResultBytesPerWorker`]).
    pub max_result_bytes_per_worker: u64,
    /// The longest a job may stay open from its start, however busy its worker keeps it
    /// (every message about a job restarts its `handoff_timeout`, not this). Past it the
    /// worker is condemned ([`Bound::JobLifetime`]) and killed.
    pub max_job_lifetime: Duration,
}

/// [`ParentConfig::max_results_per_job`]'s default: as many as a `Lend` may carry inputs
/// ([`MAX_BATCH`]), so that a worker answering each input with a result fits.
pub const DEFAULT_MAX_RESULTS_PER_JOB: u64 = MAX_BATCH as u64;
/// [`ParentConfig::max_result_bytes_per_job`]'s default: 32 GiB.
pub const DEFAULT_MAX_RESULT_BYTES_PER_JOB: u64 = 32 << 30;
/// [`ParentConfig::max_result_bytes_per_worker`]'s default: 48 GiB.
pub const DEFAULT_MAX_RESULT_BYTES_PER_WORKER: u64 = 48 << 30;
/// [`ParentConfig::max_job_lifetime`]'s default: 4 hours.
pub const DEFAULT_MAX_JOB_LIFETIME: Duration = Duration::from_secs(4 * 3600);

impl Default for ParentConfig {
    fn default() -> Self {
        ParentConfig {
            limit: ImportLimit::default(),
            handoff_timeout: Duration::from_secs(30),
            max_results_per_job: DEFAULT_MAX_RESULTS_PER_JOB,
            max_result_bytes_per_job: DEFAULT_MAX_RESULT_BYTES_PER_JOB,
            max_result_bytes_per_worker: DEFAULT_MAX_RESULT_BYTES_PER_WORKER,
            max_job_lifetime: DEFAULT_MAX_JOB_LIFETIME,
        }
    }
}

/// A bound on what one worker may make the parent hold ([`FailReason::BoundExceeded`]).
/// Exceeding one condemns that worker alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Bound {
    /// [`ParentConfig::max_results_per_job`].
    ResultsPerJob,
    /// [`ParentConfig::max_result_bytes_per_job`].
    ResultBytesPerJob,
    /// [`ParentConfig::max_result_bytes_per_worker`].
    ResultBytesPerWorker,
    /// [`ParentConfig::max_job_lifetime`].
    JobLifetime,
    /// The facade's bound on DONE events a worker holds open (its own, enforced outside the
    /// contract: [`Parent::condemn_for`]).
    OpenDoneEvents,
    /// The facade's bound on the frames it keeps aside while host staging waits (enforced
    /// outside the contract: [`Parent::condemn_for`]).
    StagingBacklog,
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Bound::ResultsPerJob => "results per job",
            Bound::ResultBytesPerJob => "result bytes per job",
            Bound::ResultBytesPerWorker => "result bytes per worker",
            Bound::JobLifetime => "job lifetime",
            Bound::OpenDoneEvents => "open DONE events per worker",
            Bound::StagingBacklog => "staging backlog",
        })
    }
}

/// One input of a job, as the facade placed it on a rung.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputLoan {
    /// The allocation the tensor lives in (pool pointer), the id the facade gave the source
    /// (host staging), or the id it gave the arena block holding the copy (arena copy).
    pub alloc: AllocId,
    /// The allocation's range (pool pointer: checked against the import limit), the
    /// source's (host staging), or the arena block's (arena copy).
    pub span: Span,
    /// The rung it travels on.
    pub rung: Rung,
    /// Which of the parent's pools the allocation comes from (0 on host staging).
    pub pool: u8,
    /// The pointer export; zero for host staging.
    pub export: ExportBlob,
    /// The tensor's layout over the allocation (arena copy: over the block).
    pub meta: TensorMeta,
    /// [`Rung::ArenaCopy`] only: where the block the facade copied the tensor into lies. The
    /// facade queued the copy on the job's stream before the job's READY is recorded, and
    /// gives the block back only at the input's [`ParentAction::Release`] (after a
    /// [`ParentAction::WaitDone`] on the worker's DONE, or once the worker was reaped).
    pub arena: Option<ArenaLocation>,
    /// The caller said the worker only reads it (carried in the `Lend`). When false and the
    /// input crossed by a copy, its bytes come back: host staging by a
    /// [`ParentAction::ReceiveStaged`] after the worker's `Done`; arena copy by the facade's
    /// copy out of the block at the input's [`ParentAction::Release`] with
    /// [`Outcome::Completed`] or [`Outcome::Cancelled`].
    pub read_only: bool,
}

/// A job's arena slice, as the facade allocated it (protocol 6): a block of the result arena
/// the worker may carve results out of without asking. See [`Parent::start_job_with_slice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceLoan {
    /// A fresh id for the block.
    pub alloc: AllocId,
    /// The block in the parent's address space: `[ptr, ptr + bytes)`; `bytes` non-zero.
    pub span: Span,
    /// The arena chunk's index (announced to the worker before the `Lend` goes out).
    pub chunk: u32,
    /// Bytes from the chunk's start.
    pub offset: u64,
}

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
    /// The job was cancelled ([`Parent::cancel`]); the worker finished it (Done, Ack), so
    /// what it held is released as [`Outcome::Cancelled`].
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
        })
    }
}

/// How a job ended: [`ParentAction::JobFinished`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobOutcome {
    /// The worker finished it: results delivered ([`Outcome::Completed`] releases).
    Completed,
    /// The worker finished it but its code failed: the text of its `JobError`.
    WorkerError(String),
    /// The job failed; every handoff of it was released ([`Outcome::Failed`] after the
    /// worker was reaped, or [`Outcome::Cancelled`]).
    Failed {
        /// Why.
        reason: FailReason,
        /// What was seen, for a person (names the fault of a protocol violation).
        detail: String,
    },
}

/// Something from outside for the parent machine.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParentEvent {
    /// Any message the worker sent after the handshake (the facade passes every one, except
    /// the host-staging frames it consumes inside [`ParentAction::SendStaged`] and
    /// [`ParentAction::ReceiveStaged`]).
    Received {
        /// The sender.
        worker: WorkerId,
        /// The message.
        message: Message,
    },
    /// The answer to [`ParentAction::AllocateResult`]: allocated.
    ResultAllocated {
        /// The worker that asked.
        worker: WorkerId,
        /// The request answered.
        request: RequestId,
        /// The new allocation, a fresh id.
        alloc: AllocId,
        /// The allocation: `[ptr, ptr + bytes)`.
        span: Span,
        /// The rung the facade chose for it.
        rung: Rung,
        /// Which of the parent's pools it comes from (0 on host staging).
        pool: u8,
        /// Pool pointer: the allocation's export. Host staging: zero.
        export: ExportBlob,
    },
    /// The answer to [`ParentAction::AllocateResult`]: allocated as a block of the result
    /// arena (the [`Rung::Arena`] rung). The grant names the block by `(chunk, offset,
    /// span.bytes)`; there is no export, no import and no import limit. The block is
    /// released ([`ParentAction::Release`]) only after a [`ParentAction::WaitDone`] on the
    /// worker's DONE for the job, or once the worker was reaped: only then may the facade
    /// reuse it.
    ResultAllocatedInArena {
        /// The worker that asked.
        worker: WorkerId,
        /// The request answered.
        request: RequestId,
        /// A fresh id for the block.
        alloc: AllocId,
        /// The block in the parent's address space: `[ptr, ptr + bytes)`.
        span: Span,
        /// The arena chunk's index (announced to the worker before the grant goes out).
        chunk: u32,
        /// Bytes from the chunk's start.
        offset: u64,
    },
    /// The answer to [`ParentAction::AllocateResult`]: not allocated.
    ResultDeclined {
        /// The worker that asked.
        worker: WorkerId,
        /// The request answered.
        request: RequestId,
        /// Why, for the worker's code.
        code: ErrorCode,
        /// Why, for a person.
        message: String,
    },
    /// EOF or a broken connection (`why` says which). The process may still run and hold
    /// imports: nothing is released until [`ParentEvent::WorkerReaped`].
    WorkerHungUp {
        /// The worker.
        worker: WorkerId,
        /// What was seen.
        why: String,
    },
    /// The process has been waited for: the driver dropped its imports.
    WorkerReaped {
        /// The worker.
        worker: WorkerId,
    },
}

/// Work the parent machine asks of the facade, in the order it must be done.
///
/// Not `#[non_exhaustive]`: the facade matches every variant, so a new one is a compile
/// error there rather than a silently ignored action.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum ParentAction {
    /// Record the worker's READY event for this job on the job's stream (before the `Lend`
    /// or `AllocationGrant` that follows: it carries the event's blob).
    RecordReady {
        /// The worker.
        worker: WorkerId,
        /// The job.
        job: JobId,
    },
    /// Send this message to the worker, unchanged.
    Send {
        /// The recipient.
        worker: WorkerId,
        /// The message.
        message: Message,
    },
    /// Push this host-staged input's bytes to the worker now (after its `Lend`).
    SendStaged {
        /// The worker.
        worker: WorkerId,
        /// The job.
        job: JobId,
        /// The staged input.
        handoff: HandoffId,
    },
    /// Allocate memory for a worker's result and pick its rung, then answer with
    /// [`ParentEvent::ResultAllocated`] or [`ParentEvent::ResultDeclined`] (synchronously
    /// or later).
    AllocateResult {
        /// The worker asking.
        worker: WorkerId,
        /// The job.
        job: JobId,
        /// The request, numbered by the parent.
        request: RequestId,
        /// What it asked for.
        spec: ResultSpec,
    },
    /// A host-staged result named in the worker's `Done`, or a host-staged input lent
    /// writable (copy-back, protocol 7): its bytes follow the `Done` on the wire, in the
    /// `Done`'s order; pull them now (an input's into the caller's tensor).
    ReceiveStaged {
        /// The worker.
        worker: WorkerId,
        /// The job.
        job: JobId,
        /// The staged result or writable staged input.
        handoff: HandoffId,
    },
    /// Order the job's consumers after the worker's DONE event (the facade learns on the host
    /// that it completed, and holds the actions after this one until then). Comes right before the
    /// [`ParentAction::Release`] of each acknowledged pool-pointer or arena handoff.
    WaitDone {
        /// The worker.
        worker: WorkerId,
        /// The job.
        job: JobId,
        /// The handoff about to be released.
        handoff: HandoffId,
        /// The DONE event the worker recorded.
        done_event: EventBlob,
    },
    /// The handoff is over: an input's memory may be reused once nothing else holds it; a
    /// [`Outcome::Completed`] result is the caller's; any other result is the caller's to
    /// free.
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
        /// The rung it travelled on.
        rung: Rung,
        /// How it ended.
        outcome: Outcome,
    },
    /// The job's arena slice is over (after a [`ParentAction::WaitDone`] on the worker's
    /// DONE, or once the worker was reaped). On [`Outcome::Completed`] each entry of
    /// `carved` is a result of the job, the caller's: `bytes` at `offset` in the slice, at
    /// place `index` among the job's results (granted results fill the other places, in
    /// request order); the contract checked every carve (inside the slice, aligned to
    /// [`ARENA_ALIGN`], no overlap, the dense size of its shape). Everything of the slice
    /// not carved goes back to the arena, ordered after the stream's wait on DONE. On any
    /// other outcome `carved` is empty and the whole slice goes back.
    ReleaseSlice {
        /// The worker it was lent to.
        worker: WorkerId,
        /// Its job.
        job: JobId,
        /// The slice's handoff.
        handoff: HandoffId,
        /// The block.
        alloc: AllocId,
        /// How it ended.
        outcome: Outcome,
        /// The results carved out of it, in the worker's carve order.
        carved: Vec<CarvedResult>,
    },
    /// An allocation made for a request and never offered to the worker (declined by the
    /// contract, over the limit, job cancelled or failed): the caller's to free. No import
    /// of it exists.
    FreeResult {
        /// The worker that had asked.
        worker: WorkerId,
        /// The job.
        job: JobId,
        /// The request.
        request: RequestId,
        /// The allocation.
        alloc: AllocId,
    },
    /// Kill the worker process (SIGKILL), reap it, then report
    /// [`ParentEvent::WorkerReaped`].
    KillWorker {
        /// The worker.
        worker: WorkerId,
    },
    /// Every handoff of the job is released: the last action about the job.
    JobFinished {
        /// The worker.
        worker: WorkerId,
        /// The job.
        job: JobId,
        /// How it ended.
        outcome: JobOutcome,
    },
    /// The worker is reaped and nothing of it is left in the contract: drop its slot.
    WorkerRemoved {
        /// The worker.
        worker: WorkerId,
    },
    /// [`Parent::shutdown`] was called and nothing is outstanding any more.
    ShutdownComplete,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerState {
    /// Connected and in good standing (maybe stopping).
    Live,
    /// Hung up, killed or past a deadline: its messages are ignored; its jobs fail and its
    /// loans are released when it is reaped.
    Condemned,
    /// Waited for: its imports are gone.
    Reaped,
}

#[derive(Clone, Debug)]
struct Peer {
    state: PeerState,
    /// `Bye` sent: no new jobs.
    stopping: bool,
    /// Why its jobs fail, once it is condemned.
    failure: Option<(FailReason, String)>,
    /// Its open jobs.
    jobs: BTreeSet<JobId>,
}

/// An answer to one result request, held until every request of its message is answered.
#[derive(Clone, Debug)]
enum Answer {
    Allocated {
        alloc: AllocId,
        span: Span,
        rung: Rung,
        pool: u8,
        export: ExportBlob,
        /// `(chunk, offset)` of an arena block (`rung` is then [`Rung::Arena`]).
        arena: Option<(u32, u64)>,
    },
    Refused {
        code: ErrorCode,
        message: String,
    },
}

/// The requests of one `ResultRequest` message.
#[derive(Clone, Debug)]
struct Batch {
    requests: Vec<RequestId>,
    answers: Vec<Option<Answer>>,
}

impl Batch {
    fn answered(&self) -> bool {
        self.answers.iter().all(Option::is_some)
    }
}

#[derive(Clone, Debug)]
struct Job {
    ready_event: EventBlob,
    /// Inputs in `Lend` order, then results in grant order.
    handoffs: Vec<HandoffId>,
    deadline: Timestamp,
    /// Its start plus [`ParentConfig::max_job_lifetime`].
    expires: Timestamp,
    /// Results asked for so far (counted against [`ParentConfig::max_results_per_job`]).
    results_asked: u64,
    /// Result bytes asked for so far.
    result_bytes: u64,
    cancelled: bool,
    done_seen: bool,
    error: Option<String>,
    batch: Option<Batch>,
    /// The job's arena slice: its handoff and length.
    slice: Option<(HandoffId, u64)>,
}

#[derive(Clone, Debug)]
struct Loan {
    worker: WorkerId,
    job: JobId,
    alloc: AllocId,
    rung: Rung,
    purpose: Purpose,
    done: Option<EventBlob>,
    /// A slice's carves, checked, from the worker's `Done`.
    carved: Vec<CarvedResult>,
    /// An input the caller lent read-only: a staged one's bytes do not come back.
    read_only: bool,
}

#[derive(Clone, Debug)]
struct Pending {
    worker: WorkerId,
    job: JobId,
    index: usize,
    byte_len: u64,
}

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
    workers: BTreeMap<WorkerId, Peer>,
    jobs: BTreeMap<(WorkerId, JobId), Job>,
    loans: BTreeMap<HandoffId, Loan>,
    /// Allocations with open loans: their range and how many.
    lent: BTreeMap<AllocId, (Span, u32)>,
    /// Result allocations answered and not yet granted.
    unoffered: BTreeSet<AllocId>,
    /// Result requests waiting for the facade's answer.
    requests: BTreeMap<RequestId, Pending>,
    actions: VecDeque<ParentAction>,
    next_handoff: u64,
    next_request: u64,
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
            workers: BTreeMap::new(),
            jobs: BTreeMap::new(),
            loans: BTreeMap::new(),
            lent: BTreeMap::new(),
            unoffered: BTreeSet::new(),
            requests: BTreeMap::new(),
            actions: VecDeque::new(),
            next_handoff: 0,
            next_request: 0,
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
        self.jobs
            .iter()
            .filter(|((w, _), _)| self.connected(*w))
            .map(|(_, j)| match j.batch {
                None => j.deadline.min(j.expires),
                Some(_) => j.expires,
            })
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

    /// The open jobs of `worker` (started, not finished), in id order.
    #[must_use]
    pub fn jobs_of(&self, worker: WorkerId) -> Vec<JobId> {
        self.workers
            .get(&worker)
            .map(|p| p.jobs.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Whether `worker` takes new jobs: added, not stopping, not condemned, not reaped.
    #[must_use]
    pub fn is_live(&self, worker: WorkerId) -> bool {
        self.workers
            .get(&worker)
            .is_some_and(|p| p.state == PeerState::Live && !p.stopping)
    }

    /// Whether the shutdown has finished.
    #[must_use]
    pub fn is_shut_down(&self) -> bool {
        self.shutdown == Shutdown::Complete
    }

    fn connected(&self, worker: WorkerId) -> bool {
        self.workers
            .get(&worker)
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
        if self.workers.contains_key(&worker) {
            return Err(ContractError::WorkerExists(worker));
        }
        self.workers.insert(
            worker,
            Peer {
                state: PeerState::Live,
                stopping: false,
                failure: None,
                jobs: BTreeSet::new(),
            },
        );
        Ok(())
    }

    fn check_takes_work(&self, worker: WorkerId) -> Result<(), ContractError> {
        match self.workers.get(&worker) {
            None => Err(ContractError::UnknownWorker(worker)),
            Some(_) if !self.is_live(worker) => Err(ContractError::WorkerGone(worker)),
            Some(_) if self.shutdown != Shutdown::Running => Err(ContractError::ShuttingDown),
            Some(_) => Ok(()),
        }
    }

    fn fresh_handoff(&mut self) -> HandoffId {
        let h = HandoffId(self.next_handoff);
        self.next_handoff += 1;
        h
    }

    fn open_loan(&mut self, handoff: HandoffId, span: Span, loan: Loan) {
        self.lent.entry(loan.alloc).or_insert((span, 0)).1 += 1;
        self.loans.insert(handoff, loan);
    }

    /// Starts `job` on `worker`: one `Lend` with every input, in order.
    ///
    /// All-or-nothing: every input is checked first (a pool-pointer input must be admitted
    /// by the import limit; an arena-copy input must name its block, and only it may; an
    /// allocation already lent must have the same range); on error nothing is queued and
    /// nothing changes. Then queues [`ParentAction::RecordReady`] (only if some input goes by
    /// pool pointer or arena copy), `Send(Lend)` (fresh handles in input order; `ready_event`
    /// on pool-pointer and arena-copy items, zero blobs on staged ones), then
    /// [`ParentAction::SendStaged`] for each host-staged input, in order. A job with no
    /// inputs still sends its (empty) `Lend`.
    ///
    /// `ready_event` is the blob of the READY event the facade records for THIS job: two
    /// jobs in flight on one worker must not share one, since the worker's wait captures
    /// the event's latest record. Every pool-pointer item of the job's `Lend` and of its
    /// `AllocationGrant`s carries it.
    ///
    /// Returns the handles of the inputs, in order.
    ///
    /// # Errors
    /// The worker is unknown ([`ContractError::UnknownWorker`]), gone or stopping
    /// ([`ContractError::WorkerGone`]); the parent is shutting down; the job is open
    /// already ([`ContractError::JobExists`]); an input is above the limit
    /// ([`ContractError::AboveImportLimit`]), on a rung that cannot carry an input or
    /// without the arena location its rung needs ([`ContractError::RungNotAllowed`]), or
    /// known with another range ([`ContractError::AllocationMismatch`]).
    pub fn start_job(
        &mut self,
        worker: WorkerId,
        job: JobId,
        ready_event: EventBlob,
        inputs: Vec<InputLoan>,
        now: Timestamp,
    ) -> Result<Vec<HandoffId>, ContractError> {
        self.start_job_with_slice(worker, job, ready_event, inputs, None, now)
            .map(|(inputs, _)| inputs)
    }

    /// [`Parent::start_job`], with the job's arena slice (protocol 6) when `slice` is given:
    /// one more handoff, after the inputs, carried in the `Lend`'s `slice`. Like an arena
    /// result it needs no READY and is DONE-gated: it comes back with
    /// [`ParentAction::ReleaseSlice`] after the job's `Ack` and a wait on its DONE, or once
    /// the worker was reaped. The worker names what it carved in its `Done`; a carve outside
    /// the slice, not aligned to [`ARENA_ALIGN`], overlapping another, of zero bytes or not
    /// the dense size of its shape, or one whose place among the results is out of range or
    /// taken, condemns that worker (a protocol violation), like a lying `ResultSpec`.
    ///
    /// Returns the handles of the inputs, in order, and the slice's.
    ///
    /// # Errors
    /// Those of [`Parent::start_job`]; and [`ContractError::AllocationMismatch`] for a slice
    /// of zero bytes or whose allocation id is in use (lent, or an input of this job).
    pub fn start_job_with_slice(
        &mut self,
        worker: WorkerId,
        job: JobId,
        ready_event: EventBlob,
        inputs: Vec<InputLoan>,
        slice: Option<SliceLoan>,
        now: Timestamp,
    ) -> Result<(Vec<HandoffId>, Option<HandoffId>), ContractError> {
        self.check_takes_work(worker)?;
        if self.jobs.contains_key(&(worker, job)) {
            return Err(ContractError::JobExists(job));
        }
        let mut spans: BTreeMap<AllocId, Span> = BTreeMap::new();
        for input in &inputs {
            let (alloc, span) = (input.alloc, input.span);
            if input.rung == Rung::Arena {
                return Err(ContractError::RungNotAllowed {
                    rung: input.rung,
                    what: "a lent input",
                });
            }
            if (input.rung == Rung::ArenaCopy) != input.arena.is_some() {
                return Err(ContractError::RungNotAllowed {
                    rung: input.rung,
                    what: if input.arena.is_some() {
                        "an input with an arena location"
                    } else {
                        "an input without its arena location"
                    },
                });
            }
            if by_pointer(input.rung)
                && !self.config.limit.admits(span)
                && !self.mutated(Mutation::IgnoreImportLimit)
            {
                return Err(ContractError::AboveImportLimit { alloc, span });
            }
            let known = self
                .lent
                .get(&alloc)
                .map(|(s, _)| *s)
                .or_else(|| spans.get(&alloc).copied());
            if known.is_some_and(|s| s != span) || self.unoffered.contains(&alloc) {
                return Err(ContractError::AllocationMismatch { alloc });
            }
            spans.insert(alloc, span);
        }
        if let Some(sl) = &slice
            && (sl.span.bytes == 0
                || self.lent.contains_key(&sl.alloc)
                || self.unoffered.contains(&sl.alloc)
                || spans.contains_key(&sl.alloc))
        {
            return Err(ContractError::AllocationMismatch { alloc: sl.alloc });
        }
        let mut handoffs = Vec::with_capacity(inputs.len());
        let mut tensors = Vec::with_capacity(inputs.len());
        let mut staged_inputs = Vec::new();
        let mut any_ready = false;
        for input in inputs {
            let handle = self.fresh_handoff();
            let pointer = by_pointer(input.rung);
            let ready = ready_gated(input.rung);
            any_ready |= ready;
            self.open_loan(
                handle,
                input.span,
                Loan {
                    worker,
                    job,
                    alloc: input.alloc,
                    rung: input.rung,
                    purpose: Purpose::Input,
                    done: None,
                    carved: Vec::new(),
                    read_only: input.read_only,
                },
            );
            if staged(input.rung) {
                staged_inputs.push(handle);
            }
            handoffs.push(handle);
            tensors.push(LentTensor {
                handle,
                alloc: input.alloc,
                rung: input.rung,
                pool: if pointer { input.pool } else { 0 },
                export: if pointer { input.export } else { ZERO_EXPORT },
                ready_event: if ready { ready_event } else { ZERO_EVENT },
                meta: input.meta,
                arena: input.arena,
                read_only: input.read_only,
            });
        }
        let inputs_handles = handoffs.clone();
        let lent_slice = slice.map(|sl| {
            let handle = self.fresh_handoff();
            // No READY: like an arena result, the facade hands out a block only once every
            // earlier use of it completed on the GPU.
            self.open_loan(
                handle,
                sl.span,
                Loan {
                    worker,
                    job,
                    alloc: sl.alloc,
                    rung: Rung::Arena,
                    purpose: Purpose::Slice,
                    done: None,
                    carved: Vec::new(),
                    read_only: false,
                },
            );
            handoffs.push(handle);
            LentSlice {
                handle,
                alloc: sl.alloc,
                chunk: sl.chunk,
                offset: sl.offset,
                bytes: sl.span.bytes,
            }
        });
        self.jobs.insert(
            (worker, job),
            Job {
                ready_event,
                handoffs,
                deadline: now.saturating_add(self.config.handoff_timeout),
                expires: now.saturating_add(self.config.max_job_lifetime),
                results_asked: 0,
                result_bytes: 0,
                cancelled: false,
                done_seen: false,
                error: None,
                batch: None,
                slice: lent_slice.map(|s| (s.handle, s.bytes)),
            },
        );
        if let Some(peer) = self.workers.get_mut(&worker) {
            peer.jobs.insert(job);
        }
        if any_ready {
            self.actions
                .push_back(ParentAction::RecordReady { worker, job });
        }
        self.actions.push_back(ParentAction::Send {
            worker,
            message: Message::Lend(Lend {
                job,
                tensors,
                slice: lent_slice,
            }),
        });
        for handoff in staged_inputs {
            self.actions.push_back(ParentAction::SendStaged {
                worker,
                job,
                handoff,
            });
        }
        Ok((inputs_handles, lent_slice.map(|s| s.handle)))
    }

    /// The answers already given to `job`'s pending result request become cancelled
    /// refusals; what was allocated for them is the caller's to free (never offered).
    fn refuse_answered(&mut self, worker: WorkerId, job: JobId) {
        let Some(batch) = self
            .jobs
            .get_mut(&(worker, job))
            .and_then(|j| j.batch.as_mut())
        else {
            return;
        };
        let mut freed = Vec::new();
        for (request, answer) in batch.requests.iter().zip(batch.answers.iter_mut()) {
            if let Some(a) = answer {
                if let Answer::Allocated { alloc, .. } = a {
                    freed.push((*request, *alloc));
                }
                *a = cancelled_refusal();
            }
        }
        for (request, alloc) in freed {
            self.unoffered.remove(&alloc);
            self.actions.push_back(ParentAction::FreeResult {
                worker,
                job,
                request,
                alloc,
            });
        }
    }

    /// Cancels `job` on `worker`: `Send(Cancel)`. The worker still finishes the job (Done,
    /// Ack); its handoffs are released as [`Outcome::Cancelled`] and it ends
    /// [`JobOutcome::Failed`] with [`FailReason::Cancelled`]. Result requests of the job are
    /// declined: those not answered yet become `Refused { CANCELLED }` when answered, those
    /// answered and not granted are freed now. Cancelling twice is a no-op.
    ///
    /// # Errors
    /// The worker is unknown or not connected, or the job is not open on it.
    pub fn cancel(&mut self, worker: WorkerId, job: JobId) -> Result<(), ContractError> {
        if !self.workers.contains_key(&worker) {
            return Err(ContractError::UnknownWorker(worker));
        }
        if !self.connected(worker) {
            return Err(ContractError::WorkerGone(worker));
        }
        let Some(j) = self.jobs.get_mut(&(worker, job)) else {
            return Err(ContractError::UnknownJob(job));
        };
        if j.cancelled {
            return Ok(());
        }
        j.cancelled = true;
        self.actions.push_back(ParentAction::Send {
            worker,
            message: Message::Cancel { job },
        });
        self.refuse_answered(worker, job);
        Ok(())
    }

    /// Stops one worker: `Send(Bye)`; it takes no new job. Its open jobs may still finish;
    /// those open when it is reaped fail with [`FailReason::Stopped`]. The facade waits a
    /// bounded time for EOF, then kills, reaps and reports both. Stopping twice is a no-op.
    ///
    /// # Errors
    /// The worker is unknown, or not connected.
    pub fn stop_worker(&mut self, worker: WorkerId) -> Result<(), ContractError> {
        let Some(peer) = self.workers.get_mut(&worker) else {
            return Err(ContractError::UnknownWorker(worker));
        };
        if peer.state != PeerState::Live {
            return Err(ContractError::WorkerGone(worker));
        }
        if !peer.stopping {
            peer.stopping = true;
            self.actions.push_back(ParentAction::Send {
                worker,
                message: Message::Bye,
            });
        }
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
            .workers
            .keys()
            .copied()
            .filter(|w| self.is_live(*w))
            .collect();
        for worker in live {
            let _ = self.stop_worker(worker);
        }
        self.check_shutdown_complete();
    }

    fn check_shutdown_complete(&mut self) {
        if self.shutdown == Shutdown::Draining && self.jobs.is_empty() && self.requests.is_empty() {
            self.shutdown = Shutdown::Complete;
            self.actions.push_back(ParentAction::ShutdownComplete);
        }
    }

    /// Deadlines: every live worker with a job past its deadline is condemned
    /// ([`FailReason::DeadlineExpired`], [`ParentAction::KillWorker`]).
    pub fn handle_timeout(&mut self, now: Timestamp) {
        let expired: BTreeMap<WorkerId, JobId> = self
            .jobs
            .iter()
            .filter(|((w, _), j)| j.expires <= now && self.connected(*w))
            .map(|((w, job), _)| (*w, *job))
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
        let late: BTreeMap<WorkerId, JobId> = self
            .jobs
            .iter()
            .filter(|((w, _), j)| j.batch.is_none() && j.deadline <= now && self.connected(*w))
            .map(|((w, job), _)| (*w, *job))
            .collect();
        let timeout = self.config.handoff_timeout;
        for (worker, job) in late {
            self.condemn(
                worker,
                FailReason::DeadlineExpired,
                format!("{worker} sent no word about {job} within {timeout:?}"),
                true,
            );
        }
        self.check_shutdown_complete();
    }

    /// Marks `worker` condemned: its messages are ignored from now on, its jobs fail with
    /// `reason` when it is reaped.
    fn condemn(&mut self, worker: WorkerId, reason: FailReason, detail: String, kill: bool) {
        let Some(peer) = self.workers.get_mut(&worker) else {
            return;
        };
        if peer.state != PeerState::Live {
            return;
        }
        peer.state = PeerState::Condemned;
        peer.failure = Some((reason, detail));
        if kill {
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
        if !self.workers.contains_key(&worker) {
            return Err(ContractError::UnknownWorker(worker));
        }
        self.condemn(worker, FailReason::BoundExceeded(bound), detail, true);
        Ok(())
    }

    fn violation(&mut self, worker: WorkerId, detail: String) {
        self.condemn(
            worker,
            FailReason::ProtocolViolation,
            format!("protocol violation by {worker}: {detail}"),
            true,
        );
    }

    /// An input from outside.
    ///
    /// A worker's misbehaviour is not an error: it condemns the worker (see [`Parent`]).
    /// Messages from a condemned or reaped worker are ignored.
    ///
    /// # Errors
    /// The facade's own mistakes: an unknown worker; an answer to a request that is not
    /// pending ([`ContractError::UnknownRequest`]) or with an allocation id that is live
    /// ([`ContractError::AllocationMismatch`]). Nothing changes then.
    pub fn handle(&mut self, event: ParentEvent, now: Timestamp) -> Result<(), ContractError> {
        let handled = match event {
            ParentEvent::Received { worker, message } => self.on_message(worker, message, now),
            ParentEvent::ResultAllocated { rung, .. } if rung == Rung::Arena => {
                Err(ContractError::RungNotAllowed {
                    rung,
                    what: "a result allocation without its arena location",
                })
            }
            ParentEvent::ResultAllocated { rung, .. } if rung == Rung::ArenaCopy => {
                Err(ContractError::RungNotAllowed {
                    rung,
                    what: "a result allocation",
                })
            }
            ParentEvent::ResultAllocated {
                worker,
                request,
                alloc,
                span,
                rung,
                pool,
                export,
            } => self.on_answer(
                worker,
                request,
                Answer::Allocated {
                    alloc,
                    span,
                    rung,
                    pool,
                    export,
                    arena: None,
                },
                now,
            ),
            ParentEvent::ResultAllocatedInArena {
                worker,
                request,
                alloc,
                span,
                chunk,
                offset,
            } => self.on_answer(
                worker,
                request,
                Answer::Allocated {
                    alloc,
                    span,
                    rung: Rung::Arena,
                    pool: 0,
                    export: ZERO_EXPORT,
                    arena: Some((chunk, offset)),
                },
                now,
            ),
            ParentEvent::ResultDeclined {
                worker,
                request,
                code,
                message,
            } => self.on_answer(worker, request, Answer::Refused { code, message }, now),
            ParentEvent::WorkerHungUp { worker, why } => self.on_hung_up(worker, &why),
            ParentEvent::WorkerReaped { worker } => self.on_reaped(worker),
        };
        self.check_shutdown_complete();
        handled
    }

    fn on_message(
        &mut self,
        worker: WorkerId,
        message: Message,
        now: Timestamp,
    ) -> Result<(), ContractError> {
        if !self.workers.contains_key(&worker) {
            return Err(ContractError::UnknownWorker(worker));
        }
        if !self.connected(worker) {
            return Ok(());
        }
        match message {
            Message::ResultRequest(r) => self.on_result_request(worker, r, now),
            Message::Done(d) => self.on_done(worker, d, now),
            Message::Ack(a) => self.on_ack(worker, a),
            Message::JobError { job, message } => match self.jobs.get_mut(&(worker, job)) {
                Some(j) => {
                    j.error
                        .get_or_insert_with(|| crate::text::worker_text(&message));
                    j.deadline = now.saturating_add(self.config.handoff_timeout);
                }
                None => self.violation(worker, format!("a JobError for {job}, which is not open")),
            },
            Message::Heartbeat { .. } => {}
            Message::Error { code, message } => {
                let message = crate::text::worker_text(&message);
                self.violation(worker, format!("the worker reported: {code}: {message}"));
            }
            other => {
                self.violation(
                    worker,
                    format!("unexpected {} from the worker", other.kind()),
                );
            }
        }
        Ok(())
    }

    fn on_result_request(&mut self, worker: WorkerId, request: ResultRequest, now: Timestamp) {
        let ResultRequest { job, results } = request;
        let Some(j) = self.jobs.get(&(worker, job)) else {
            return self.violation(
                worker,
                format!("a result request for {job}, which is not open"),
            );
        };
        if j.batch.is_some() {
            return self.violation(
                worker,
                format!("a second result request for {job} before the first was answered"),
            );
        }
        for (i, spec) in results.iter().enumerate() {
            match dense_bytes(spec.dtype, &spec.shape) {
                Some(dense) if dense == spec.byte_len => {}
                Some(dense) => {
                    return self.violation(
                        worker,
                        format!(
                            "result {i} of the request for {job} says byte_len {} but {:?} of {:?} \
                             takes {dense}",
                            spec.byte_len, spec.shape, spec.dtype
                        ),
                    );
                }
                None => {
                    return self.violation(
                        worker,
                        format!(
                            "result {i} of the request for {job}: the size of {:?} of {:?} \
                             overflows",
                            spec.shape, spec.dtype
                        ),
                    );
                }
            }
        }
        let cancelled = j.cancelled;
        if results.len() <= MAX_RESULTS_PER_REQUEST
            && let Some((bound, detail)) = self.over_result_bounds(worker, j, &results)
        {
            return self.condemn(
                worker,
                FailReason::BoundExceeded(bound),
                format!("{worker}'s result request for {job} goes past the {bound}: {detail}"),
                true,
            );
        }
        let asked = u64::try_from(results.len()).unwrap_or(u64::MAX);
        let bytes = results
            .iter()
            .fold(0u64, |acc, r| acc.saturating_add(r.byte_len));
        if results.len() <= MAX_RESULTS_PER_REQUEST
            && let Some(j) = self.jobs.get_mut(&(worker, job))
        {
            j.results_asked = j.results_asked.saturating_add(asked);
            j.result_bytes = j.result_bytes.saturating_add(bytes);
        }
        // A grant for more results than this would not fit a frame: refuse them all (the
        // refusals are short), and the worker goes on.
        let too_many = (results.len() > MAX_RESULTS_PER_REQUEST).then(|| Answer::Refused {
            code: ErrorCode::LIMIT,
            message: format!(
                "a request may ask for at most {MAX_RESULTS_PER_REQUEST} results; this one asked \
                 for {}",
                results.len()
            ),
        });
        let mut batch = Batch {
            requests: Vec::with_capacity(results.len()),
            answers: vec![None; results.len()],
        };
        for (index, spec) in results.into_iter().enumerate() {
            let request = RequestId(self.next_request);
            self.next_request += 1;
            batch.requests.push(request);
            if cancelled {
                batch.answers[index] = Some(cancelled_refusal());
            } else if let Some(refusal) = &too_many {
                batch.answers[index] = Some(refusal.clone());
            } else if self.mutated(Mutation::GrantBeforeAllocation) {
                // Test-only bug: grant memory nobody allocated.
                batch.answers[index] = Some(Answer::Allocated {
                    alloc: AllocId(u64::MAX - request.0),
                    span: Span {
                        ptr: 0,
                        bytes: spec.byte_len,
                    },
                    rung: Rung::PoolPointer,
                    pool: 0,
                    export: ZERO_EXPORT,
                    arena: None,
                });
            } else {
                self.requests.insert(
                    request,
                    Pending {
                        worker,
                        job,
                        index,
                        byte_len: spec.byte_len,
                    },
                );
                self.actions.push_back(ParentAction::AllocateResult {
                    worker,
                    job,
                    request,
                    spec,
                });
            }
        }
        if let Some(j) = self.jobs.get_mut(&(worker, job)) {
            j.deadline = now.saturating_add(self.config.handoff_timeout);
            j.batch = Some(batch);
        }
        self.grant_if_answered(worker, job, now);
    }

    /// Which result bound `job` (of `worker`) would pass by asking for `results` as well,
    /// and by how much.
    fn over_result_bounds(
        &self,
        worker: WorkerId,
        job: &Job,
        results: &[ResultSpec],
    ) -> Option<(Bound, String)> {
        let asked = u64::try_from(results.len()).unwrap_or(u64::MAX);
        let bytes = results
            .iter()
            .fold(0u64, |acc, r| acc.saturating_add(r.byte_len));
        let count = job.results_asked.saturating_add(asked);
        if count > self.config.max_results_per_job {
            return Some((
                Bound::ResultsPerJob,
                format!(
                    "{count} results asked for, at most {} allowed",
                    self.config.max_results_per_job
                ),
            ));
        }
        let job_bytes = job.result_bytes.saturating_add(bytes);
        if job_bytes > self.config.max_result_bytes_per_job {
            return Some((
                Bound::ResultBytesPerJob,
                format!(
                    "{job_bytes} bytes asked for, at most {} allowed",
                    self.config.max_result_bytes_per_job
                ),
            ));
        }
        let open: u64 = self.workers.get(&worker).map_or(0, |peer| {
            peer.jobs
                .iter()
                .filter_map(|j| self.jobs.get(&(worker, *j)))
                .fold(0u64, |acc, j| acc.saturating_add(j.result_bytes))
        });
        let worker_bytes = open.saturating_add(bytes);
        if worker_bytes > self.config.max_result_bytes_per_worker {
            return Some((
                Bound::ResultBytesPerWorker,
                format!(
                    "{worker_bytes} bytes asked for in its open jobs, at most {} allowed",
                    self.config.max_result_bytes_per_worker
                ),
            ));
        }
        None
    }

    fn on_answer(
        &mut self,
        worker: WorkerId,
        request: RequestId,
        answer: Answer,
        now: Timestamp,
    ) -> Result<(), ContractError> {
        if !self.workers.contains_key(&worker) {
            return Err(ContractError::UnknownWorker(worker));
        }
        if self
            .requests
            .get(&request)
            .is_none_or(|p| p.worker != worker)
        {
            return Err(ContractError::UnknownRequest { request });
        }
        if let Answer::Allocated { alloc, .. } = &answer
            && (self.lent.contains_key(alloc) || self.unoffered.contains(alloc))
        {
            return Err(ContractError::AllocationMismatch { alloc: *alloc });
        }
        let Some(p) = self.requests.remove(&request) else {
            return Err(ContractError::UnknownRequest { request });
        };
        let job = p.job;
        let Some(j) = self.jobs.get(&(worker, job)) else {
            return Ok(());
        };
        let reaped = self
            .workers
            .get(&worker)
            .is_some_and(|peer| peer.state == PeerState::Reaped);
        let answer = match answer {
            Answer::Allocated { alloc, .. } if reaped || j.cancelled => {
                self.actions.push_back(ParentAction::FreeResult {
                    worker,
                    job,
                    request,
                    alloc,
                });
                cancelled_refusal()
            }
            Answer::Allocated {
                alloc, span, rung, ..
            } if by_pointer(rung)
                && !self.config.limit.admits(span)
                && !self.mutated(Mutation::IgnoreImportLimit) =>
            {
                self.actions.push_back(ParentAction::FreeResult {
                    worker,
                    job,
                    request,
                    alloc,
                });
                Answer::Refused {
                    code: ErrorCode::OVER_IMPORT_LIMIT,
                    message: format!(
                        "the allocation of {} bytes at {:#x} is above the pointer import limit",
                        span.bytes, span.ptr
                    ),
                }
            }
            Answer::Allocated { alloc, span, .. } if span.bytes < p.byte_len => {
                self.actions.push_back(ParentAction::FreeResult {
                    worker,
                    job,
                    request,
                    alloc,
                });
                Answer::Refused {
                    code: ErrorCode::INTERNAL,
                    message: format!(
                        "the parent allocated {} bytes for a result of {}",
                        span.bytes, p.byte_len
                    ),
                }
            }
            Answer::Allocated { alloc, .. } => {
                self.unoffered.insert(alloc);
                answer
            }
            Answer::Refused { .. } if j.cancelled => cancelled_refusal(),
            refused @ Answer::Refused { .. } => refused,
        };
        if let Some(slot) = self
            .jobs
            .get_mut(&(worker, job))
            .and_then(|j| j.batch.as_mut())
            .and_then(|b| b.answers.get_mut(p.index))
        {
            *slot = Some(answer);
        }
        if reaped {
            self.finish_abandoned(worker, job);
        } else {
            self.grant_if_answered(worker, job, now);
        }
        Ok(())
    }

    /// Once every request of the job's pending message is answered, and the worker is
    /// connected: RECORD READY (if a pointer is granted), then the `AllocationGrant`.
    fn grant_if_answered(&mut self, worker: WorkerId, job: JobId, now: Timestamp) {
        if !self.connected(worker) {
            return;
        }
        let Some(j) = self.jobs.get_mut(&(worker, job)) else {
            return;
        };
        if !j.batch.as_ref().is_some_and(Batch::answered) {
            return;
        }
        let Some(batch) = j.batch.take() else {
            return;
        };
        j.deadline = now.saturating_add(self.config.handoff_timeout);
        let ready_event = j.ready_event;
        let mut results = Vec::with_capacity(batch.requests.len());
        let mut any_pointer = false;
        for (request, answer) in batch.requests.into_iter().zip(batch.answers) {
            match answer {
                Some(Answer::Allocated {
                    alloc,
                    span,
                    rung,
                    pool,
                    export,
                    arena,
                }) => {
                    let handle = self.fresh_handoff();
                    let pointer = by_pointer(rung);
                    any_pointer |= pointer;
                    self.unoffered.remove(&alloc);
                    self.open_loan(
                        handle,
                        span,
                        Loan {
                            worker,
                            job,
                            alloc,
                            rung,
                            purpose: Purpose::Result { request },
                            done: None,
                            carved: Vec::new(),
                            read_only: false,
                        },
                    );
                    if let Some(j) = self.jobs.get_mut(&(worker, job)) {
                        j.handoffs.push(handle);
                    }
                    results.push(match arena {
                        // No READY: the facade hands out a block only once every earlier use
                        // of it completed on the GPU (its return waited on an event).
                        Some((chunk, offset)) => ResultGrant::Arena {
                            handle,
                            alloc,
                            chunk,
                            offset,
                            bytes: span.bytes,
                        },
                        None => ResultGrant::Granted {
                            handle,
                            alloc,
                            rung,
                            pool: if pointer { pool } else { 0 },
                            export: if pointer { export } else { ZERO_EXPORT },
                            ready_event: if pointer { ready_event } else { ZERO_EVENT },
                        },
                    });
                }
                Some(Answer::Refused { code, mut message }) => {
                    cut_text(&mut message, MAX_REFUSAL_TEXT_LEN);
                    results.push(ResultGrant::Refused { code, message });
                }
                None => {}
            }
        }
        if any_pointer {
            self.actions
                .push_back(ParentAction::RecordReady { worker, job });
        }
        self.actions.push_back(ParentAction::Send {
            worker,
            message: Message::AllocationGrant(AllocationGrant { job, results }),
        });
    }

    fn on_done(&mut self, worker: WorkerId, done: Done, now: Timestamp) {
        let Done {
            job,
            done_event,
            handles,
            carved,
        } = done;
        let Some(j) = self.jobs.get(&(worker, job)) else {
            return self.violation(worker, format!("a Done for {job}, which is not open"));
        };
        let slice = j.slice;
        let mut seen = BTreeSet::new();
        for h in &handles {
            if let Err(fault) = self.check_handle(worker, job, *h) {
                return self.violation(worker, format!("the Done for {job} names {fault}"));
            }
            if self.loans.get(h).is_some_and(|l| l.done.is_some()) || !seen.insert(*h) {
                return self.violation(
                    worker,
                    format!("the Done for {job} names {h}, which is DONE already"),
                );
            }
        }
        if !carved.is_empty() {
            let granted = self
                .loans
                .values()
                .filter(|l| {
                    l.worker == worker
                        && l.job == job
                        && matches!(l.purpose, Purpose::Result { .. })
                })
                .count();
            let checked = match slice {
                None => Err("carves, but the job has no slice".to_owned()),
                Some((handle, _)) if !seen.contains(&handle) => {
                    Err(format!("carves, but not its slice {handle}"))
                }
                Some((_, bytes)) => check_carves(&carved, bytes, granted),
            };
            if let Err(fault) = checked {
                return self.violation(worker, format!("the Done for {job} names {fault}"));
            }
            if let Some(loan) = slice.and_then(|(h, _)| self.loans.get_mut(&h)) {
                loan.carved = carved;
            }
        }
        if let Some(j) = self.jobs.get_mut(&(worker, job)) {
            j.done_seen = true;
            j.deadline = now.saturating_add(self.config.handoff_timeout);
        }
        for h in handles {
            let Some(loan) = self.loans.get_mut(&h) else {
                continue;
            };
            loan.done = Some(done_event);
            // A staged result's bytes, and a writable staged input's (copy-back), follow.
            let comes_back = match loan.purpose {
                Purpose::Result { .. } => true,
                Purpose::Input => !loan.read_only,
                Purpose::Slice => false,
            };
            if comes_back && staged(loan.rung) {
                self.actions.push_back(ParentAction::ReceiveStaged {
                    worker,
                    job,
                    handoff: h,
                });
            }
        }
    }

    /// Whether `h` is an open handoff of `worker` and `job`; if not, what it is.
    fn check_handle(&self, worker: WorkerId, job: JobId, h: HandoffId) -> Result<(), String> {
        match self.loans.get(&h) {
            None => Err(format!("{h}, which is not an open handoff")),
            Some(l) if l.worker != worker => Err(format!("{h}, which is another worker's")),
            Some(l) if l.job != job => Err(format!("{h}, which belongs to {}", l.job)),
            Some(_) => Ok(()),
        }
    }

    fn on_ack(&mut self, worker: WorkerId, ack: Ack) {
        let Ack { job, handles } = ack;
        let Some(j) = self.jobs.get(&(worker, job)) else {
            return self.violation(worker, format!("an Ack for {job}, which is not open"));
        };
        if !j.done_seen {
            return self.violation(worker, format!("an Ack for {job} before its Done"));
        }
        if j.batch.is_some() {
            return self.violation(
                worker,
                format!("an Ack for {job} while its result request is not answered"),
            );
        }
        let mut seen = BTreeSet::new();
        for h in &handles {
            if let Err(fault) = self.check_handle(worker, job, *h) {
                return self.violation(worker, format!("the Ack for {job} names {fault}"));
            }
            if !seen.insert(*h) {
                return self.violation(worker, format!("the Ack for {job} names {h} twice"));
            }
            if self.loans.get(h).is_some_and(|l| l.done.is_none()) {
                return self.violation(
                    worker,
                    format!("the Ack for {job} names {h}, which is not DONE"),
                );
            }
        }
        if let Some(open) = j.handoffs.iter().find(|h| !seen.contains(h)) {
            return self.violation(worker, format!("the Ack for {job} leaves {open} open"));
        }
        let Some(j) = self.jobs.remove(&(worker, job)) else {
            return;
        };
        if let Some(peer) = self.workers.get_mut(&worker) {
            peer.jobs.remove(&job);
        }
        let outcome = if j.cancelled {
            Outcome::Cancelled
        } else {
            Outcome::Completed
        };
        for h in handles {
            let Some(loan) = self.loans.get(&h) else {
                continue;
            };
            let tail_first =
                loan.purpose == Purpose::Slice && self.mutated(Mutation::ReturnSliceTailBeforeDone);
            if tail_first {
                // Test-only bug: the slice's unused tail (and the rest) goes back at the ACK,
                // before the stream waits on the worker's DONE.
                let done = loan.done;
                self.release(h, outcome);
                if let Some(done_event) = done {
                    self.actions.push_back(ParentAction::WaitDone {
                        worker,
                        job,
                        handoff: h,
                        done_event,
                    });
                }
                continue;
            }
            if done_gated(loan.rung)
                && let Some(done_event) = loan.done
                && !self.mutated(Mutation::ReleaseWithoutWaitingDone)
                && !(loan.rung == Rung::ArenaCopy
                    && self.mutated(Mutation::ReturnArenaCopyBeforeDone))
            {
                self.actions.push_back(ParentAction::WaitDone {
                    worker,
                    job,
                    handoff: h,
                    done_event,
                });
            }
            self.release(h, outcome);
        }
        let outcome = if j.cancelled {
            JobOutcome::Failed {
                reason: FailReason::Cancelled,
                detail: format!("{job} was cancelled"),
            }
        } else if let Some(message) = j.error {
            JobOutcome::WorkerError(message)
        } else {
            JobOutcome::Completed
        };
        self.actions.push_back(ParentAction::JobFinished {
            worker,
            job,
            outcome,
        });
    }

    fn release(&mut self, handoff: HandoffId, outcome: Outcome) {
        let Some(loan) = self.loans.remove(&handoff) else {
            return;
        };
        if let Some(entry) = self.lent.get_mut(&loan.alloc) {
            entry.1 = entry.1.saturating_sub(1);
            if entry.1 == 0 {
                self.lent.remove(&loan.alloc);
            }
        }
        if loan.purpose == Purpose::Slice {
            self.actions.push_back(ParentAction::ReleaseSlice {
                worker: loan.worker,
                job: loan.job,
                handoff,
                alloc: loan.alloc,
                outcome,
                carved: if outcome == Outcome::Completed {
                    loan.carved
                } else {
                    Vec::new()
                },
            });
            return;
        }
        self.actions.push_back(ParentAction::Release {
            worker: loan.worker,
            job: loan.job,
            handoff,
            alloc: loan.alloc,
            purpose: loan.purpose,
            rung: loan.rung,
            outcome,
        });
    }

    fn handoffs_of(&self, worker: WorkerId) -> Vec<HandoffId> {
        self.loans
            .iter()
            .filter(|(_, l)| l.worker == worker)
            .map(|(h, _)| *h)
            .collect()
    }

    fn on_hung_up(&mut self, worker: WorkerId, why: &str) -> Result<(), ContractError> {
        let Some(peer) = self.workers.get(&worker) else {
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
            for handoff in self.handoffs_of(worker) {
                self.release(handoff, Outcome::Failed);
            }
        }
        if self.mutated(Mutation::ReleaseArenaAtHangUp) {
            // Test-only bug: arena blocks have no import, so "nothing to wait for".
            for handoff in self.handoffs_of(worker) {
                if self.loans.get(&handoff).is_some_and(|l| in_arena(l.rung)) {
                    self.release(handoff, Outcome::Failed);
                }
            }
        }
        Ok(())
    }

    fn on_reaped(&mut self, worker: WorkerId) -> Result<(), ContractError> {
        let Some(peer) = self.workers.get(&worker) else {
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
        let Some(peer) = self.workers.get_mut(&worker) else {
            return Ok(());
        };
        peer.state = PeerState::Reaped;
        let jobs: Vec<JobId> = peer.jobs.iter().copied().collect();
        // Every loan, released: the driver dropped the process's imports.
        for handoff in self.handoffs_of(worker) {
            if self.mutated(Mutation::ForgetDeadWorkersLoans) {
                // Test-only bug: drop the bookkeeping without releasing.
                self.loans.remove(&handoff);
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
    fn finish_abandoned(&mut self, worker: WorkerId, job: JobId) {
        let Some(j) = self.jobs.get(&(worker, job)) else {
            return;
        };
        if j.batch.as_ref().is_some_and(|b| !b.answered()) {
            return;
        }
        self.jobs.remove(&(worker, job));
        let Some(peer) = self.workers.get_mut(&worker) else {
            return;
        };
        peer.jobs.remove(&job);
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

/// Cuts `text` to at most `max` bytes, on a character boundary.
fn cut_text(text: &mut String, max: usize) {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

fn cancelled_refusal() -> Answer {
    Answer::Refused {
        code: ErrorCode::CANCELLED,
        message: "the job was cancelled".into(),
    }
}

/// Checks a worker's carves out of a slice of `slice_bytes`, for a job with `granted` granted
/// results: each non-empty, the dense size of its shape, at an offset aligned to
/// [`ARENA_ALIGN`], inside the slice, overlapping no other, at a place among the job's
/// results that is in range and not taken. Returns what is wrong, for the violation.
fn check_carves(carved: &[CarvedResult], slice_bytes: u64, granted: usize) -> Result<(), String> {
    let places = carved.len().saturating_add(granted);
    let mut taken = BTreeSet::new();
    let mut ranges = Vec::with_capacity(carved.len());
    for (i, c) in carved.iter().enumerate() {
        match dense_bytes(c.dtype, &c.shape) {
            Some(dense) if dense == c.bytes => {}
            Some(dense) => {
                return Err(format!(
                    "carve {i} of {} bytes, but {:?} of {:?} takes {dense}",
                    c.bytes, c.shape, c.dtype
                ));
            }
            None => {
                return Err(format!(
                    "carve {i}: the size of {:?} of {:?} overflows",
                    c.shape, c.dtype
                ));
            }
        }
        if c.bytes == 0 {
            return Err(format!(
                "carve {i} of 0 bytes (an empty result needs no memory)"
            ));
        }
        if !c.offset.is_multiple_of(ARENA_ALIGN) {
            return Err(format!(
                "carve {i} at offset {}, not a multiple of {ARENA_ALIGN}",
                c.offset
            ));
        }
        let end = c.offset.checked_add(c.bytes).filter(|e| *e <= slice_bytes);
        let Some(end) = end else {
            return Err(format!(
                "carve {i} of {} bytes at offset {}, past the slice's {slice_bytes} bytes",
                c.bytes, c.offset
            ));
        };
        if usize::try_from(c.index).map_or(true, |x| x >= places) {
            return Err(format!(
                "carve {i} at place {} among {places} results",
                c.index
            ));
        }
        if !taken.insert(c.index) {
            return Err(format!("carve {i} at place {}, which is taken", c.index));
        }
        ranges.push((c.offset, end, i));
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        if let [(_, end, a), (start, _, b)] = pair
            && start < end
        {
            return Err(format!("carves {a} and {b}, which overlap"));
        }
    }
    Ok(())
}
