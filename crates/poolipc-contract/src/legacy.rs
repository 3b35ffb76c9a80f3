//! The messages the contract exchanges between parent and worker. The transport frames them;
//! the facade attaches what only it has (the export blob, the READY event handle).

use crate::types::{AllocId, HandoffId, JobId, Purpose, RequestId, ResultSpec, Span};

/// The parent's offer of one allocation to one worker, for reading or for writing in place.
/// On the wire it travels with the pointer's export data and the READY event's handle.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Offer {
    /// The handoff this offer opens.
    pub handoff: HandoffId,
    /// The job the memory belongs to.
    pub job: JobId,
    /// The exported allocation: the worker imports it once and refcounts it
    /// ([`crate::Invariant::OneImportPerAllocation`]).
    pub alloc: AllocId,
    /// The allocation's range.
    pub span: Span,
    /// Input to read, or result to write.
    pub purpose: Purpose,
}

/// Why the parent will not give a worker memory for a result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[non_exhaustive]
pub enum Refusal {
    /// The parent's allocator declined (out of memory, or the facade chose another rung).
    Declined,
    /// The allocation made would exceed the pointer import limit: use another rung.
    AboveImportLimit,
    /// The allocation made is smaller than the bytes announced.
    TooSmall,
    /// The announced bytes do not cover the shape and dtype.
    Malformed,
    /// The job was cancelled.
    Cancelled,
    /// The parent is shutting down.
    ShuttingDown,
}

/// Parent to worker.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[non_exhaustive]
pub enum ToWorker {
    /// Import this allocation, wait on READY, use it, then DONE, UNIMPORT, ACK.
    Offer(Offer),
    /// No memory for this result request.
    ResultRefused {
        /// The job of the request.
        job: JobId,
        /// The request refused.
        request: RequestId,
        /// Why.
        reason: Refusal,
    },
    /// Stop working on this job; finish (DONE, UNIMPORT, ACK) what it holds.
    Cancel {
        /// The job cancelled.
        job: JobId,
    },
    /// The parent is shutting down: take no more work, finish what is held.
    Shutdown,
}

/// Worker to parent.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[non_exhaustive]
pub enum ToParent {
    /// Shape first: the worker asks for result memory.
    ResultRequest {
        /// The job the result belongs to.
        job: JobId,
        /// The worker's number for this request, increasing.
        request: RequestId,
        /// Shape, dtype and bytes.
        spec: ResultSpec,
    },
    /// DONE is recorded after the last access and the import reference is dropped
    /// (unimported if it was the last): the parent may release once its streams wait on DONE.
    Ack {
        /// The handoff finished.
        handoff: HandoffId,
    },
}
