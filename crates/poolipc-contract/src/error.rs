//! The errors the state machines return for calls they reject. A rejected call changes
//! nothing: the machine's state is as before it, and nothing is queued.
//!
//! A worker's misbehaviour is never one of these: the parent machine condemns the worker
//! instead (see [`crate::Parent::handle`]). These are for the facade's own mistakes (an unknown
//! worker id, a job started twice, an input above the pointer limit) and, on the worker's
//! side, for messages from the parent it cannot take.

use crate::message::MessageKind;
use crate::types::{AllocId, HandoffId, JobId, RequestId, Rung, Span, WorkerId};

/// A call the contract refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ContractError {
    /// No worker of that id was ever added.
    #[error("{0} is not a worker of this parent")]
    UnknownWorker(WorkerId),
    /// The worker id is taken (ids are never reused).
    #[error("{0} was added already")]
    WorkerExists(WorkerId),
    /// The worker hung up, was condemned, stopped, or was reaped: it takes no new work.
    #[error("{0} is gone, stopping or condemned")]
    WorkerGone(WorkerId),
    /// The parent is shutting down: no new work.
    #[error("shutting down: no new jobs")]
    ShuttingDown,
    /// A job of this id is open already.
    #[error("{0} is open already")]
    JobExists(JobId),
    /// No such job is open.
    #[error("{0} is not open")]
    UnknownJob(JobId),
    /// An allocation may not go by pool pointer: pick another rung.
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
    /// No such result request is waiting for an allocation.
    #[error("{request} is not pending")]
    UnknownRequest {
        /// The request.
        request: RequestId,
    },
    /// A result request of the job is not answered yet.
    #[error("a result request of {0} is not answered yet")]
    RequestPending(JobId),
    /// A result's `byte_len` is not the dense size of its shape and dtype.
    #[error("result {index} of {job}: byte_len {byte_len} is not the dense size of its shape")]
    MalformedResult {
        /// The job.
        job: JobId,
        /// Which result of the request.
        index: usize,
        /// What it said.
        byte_len: u64,
    },
    /// Worker: a handle not newer than one already seen (a duplicated or reordered message),
    /// or named twice. Nothing of the message is imported.
    #[error("{0} is not newer than a handle already seen")]
    StaleHandle(HandoffId),
    /// Worker: an allocation grant that does not answer the job's pending request.
    #[error("an allocation grant for {0} answers no pending request, or not all of it")]
    GrantMismatch(JobId),
    /// A handoff on a rung that cannot carry it there: an input on the arena rung (the arena
    /// holds results), a pool-style grant or allocation answer naming the arena rung (arena
    /// results carry a location instead: [`crate::ParentEvent::ResultAllocatedInArena`],
    /// [`crate::ResultGrant::Arena`]), a result on the arena-copy rung (inputs only), an
    /// arena-copy input without its arena location or another input with one.
    #[error("{what} on the {rung} rung, which cannot carry it")]
    RungNotAllowed {
        /// The rung named.
        rung: Rung,
        /// What named it.
        what: &'static str,
    },
    /// Worker: a message the parent does not send after the handshake, or one the facade
    /// consumes itself.
    #[error("unexpected {0} from the parent")]
    Unexpected(MessageKind),
}
