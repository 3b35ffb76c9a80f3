//! What the parent machine asks of the facade ([`ParentAction`]), and how a job ended
//! ([`JobOutcome`]).

use crate::message::{CarvedResult, Message, ResultSpec};
use crate::types::{
    AllocId, EventBlob, HandoffId, JobId, Outcome, Purpose, RequestId, Rung, WorkerId,
};

use super::FailReason;

#[cfg(doc)]
use {
    super::{Parent, ParentEvent},
    poolipc_types::ARENA_ALIGN,
};

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
