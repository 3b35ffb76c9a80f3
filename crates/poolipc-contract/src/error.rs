//! The errors the state machines return for inputs they reject. A rejected input changes
//! nothing: the machine's state is as before the call.

use crate::types::{AllocId, HandoffId, JobId, RequestId, Span, WorkerId};

/// An input the contract refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ContractError {
    /// No worker of that id was ever added.
    #[error("{0} is not a worker of this parent")]
    UnknownWorker(WorkerId),
    /// The worker id is taken (ids are never reused).
    #[error("{0} was added already")]
    WorkerExists(WorkerId),
    /// The worker hung up, missed a deadline, or was reaped: it takes no work and its messages
    /// no longer count (what it held is released when it is reaped).
    #[error("{0} is gone or condemned")]
    WorkerGone(WorkerId),
    /// The parent (or, on a worker, the parent's shutdown request) stops new work.
    #[error("shutting down: no new handoffs")]
    ShuttingDown,
    /// The job was cancelled: no new handoffs in it.
    #[error("{job} on {worker} was cancelled")]
    JobCancelled {
        /// The worker.
        worker: WorkerId,
        /// The job.
        job: JobId,
    },
    /// The allocation may not go by pool pointer: pick another rung.
    #[error(
        "{alloc} ({} bytes at {:#x}) is above the pointer import limit: use another rung",
        span.bytes,
        span.ptr
    )]
    AboveImportLimit {
        /// The allocation.
        alloc: AllocId,
        /// Its range.
        span: Span,
    },
    /// The allocation id is known with another range, or a fresh result allocation reuses a
    /// live id.
    #[error("{alloc} is known with another range or is still live")]
    AllocationMismatch {
        /// The allocation.
        alloc: AllocId,
    },
    /// No such handoff is outstanding (a duplicate or late message).
    #[error("{0} is not outstanding")]
    UnknownHandoff(HandoffId),
    /// A message about a handoff came from a worker that does not hold it.
    #[error("{handoff} does not belong to {worker}")]
    WrongWorker {
        /// The handoff.
        handoff: HandoffId,
        /// The sender.
        worker: WorkerId,
    },
    /// An offer older than one already seen: duplicated or reordered; never imported.
    #[error("{0} is not newer than an offer already seen")]
    StaleOffer(HandoffId),
    /// No such result request is pending.
    #[error("{request} is not pending")]
    UnknownRequest {
        /// The request.
        request: RequestId,
    },
    /// The request id was used before.
    #[error("{request} was used before")]
    DuplicateRequest {
        /// The request.
        request: RequestId,
    },
}
