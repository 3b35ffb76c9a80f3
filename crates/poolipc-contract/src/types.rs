//! Time and outcomes that both sides speak of.
//!
//! The identifiers, [`Span`] and [`DType`] are `poolipc-types`' (re-exported at the crate
//! root); they are named here so that the modules of this crate find them in one place.

use std::time::Duration;

pub(crate) use poolipc_types::{
    AllocId, DType, EventBlob, ExportBlob, HandoffId, JobId, RequestId, Rung, Span, WorkerId,
};

/// A point in time in nanoseconds from an origin the caller chooses (for example a
/// `std::time::Instant` taken at startup). The contract never reads a clock: every input
/// carries `now`, which keeps it deterministic under test.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// The time `d` after `self`, saturating at the end of time.
    #[must_use]
    pub fn saturating_add(self, d: Duration) -> Timestamp {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Timestamp(self.0.saturating_add(nanos))
    }
}

/// The bytes a dense tensor of `shape` and `dtype` takes, or `None` on overflow: what a
/// [`crate::ResultSpec`]'s `byte_len` must equal.
#[must_use]
pub fn dense_bytes(dtype: DType, shape: &[u64]) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
}

/// The zero blob: what host-staged items carry where a pointer export or an event would be.
pub(crate) const ZERO_EXPORT: ExportBlob = ExportBlob([0; 64]);
/// The zero event blob.
pub(crate) const ZERO_EVENT: EventBlob = EventBlob([0; 64]);

/// Whether a rung hands memory over by pointer import (and so needs READY, DONE, the
/// import limit and an import on the worker). Every other rung moves bytes.
pub(crate) fn by_pointer(rung: Rung) -> bool {
    matches!(rung, Rung::PoolPointer)
}

/// Whether the worker must wait on the job's READY before it touches a handoff on this rung:
/// the parent queued work on the memory (the caller's writes to a pool-pointer input, the
/// parent's copy into an arena-copy block, the caller's writes to a VMM allocation) on the
/// job's stream. Arena result blocks need none: the arena hands a block out only once every
/// earlier use of it completed.
pub(crate) fn ready_gated(rung: Rung) -> bool {
    matches!(rung, Rung::PoolPointer | Rung::ArenaCopy | Rung::VmmHandle)
}

/// Whether the parent must make its stream wait on the worker's DONE before it releases a
/// handoff on this rung: the worker touched the parent's own memory (pool pointer, arena,
/// arena copy, VMM handle). Host-staged handoffs are the worker's copies, moved inside the
/// parent's own transfers.
pub(crate) fn done_gated(rung: Rung) -> bool {
    matches!(
        rung,
        Rung::PoolPointer | Rung::Arena | Rung::ArenaCopy | Rung::VmmHandle
    )
}

/// Whether a handoff on this rung is a block of the parent's result arena: no import
/// guards it, so only the worker's DONE or its reaping may return it.
pub(crate) fn in_arena(rung: Rung) -> bool {
    matches!(rung, Rung::Arena | Rung::ArenaCopy)
}

/// Whether a rung moves bytes through the host-staging buffer.
pub(crate) fn staged(rung: Rung) -> bool {
    matches!(rung, Rung::HostStaging)
}

/// How a handoff ended: the parent says it in [`crate::ParentAction::Release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The worker acknowledged after DONE: an input may be reused, a result is the caller's.
    Completed,
    /// The job was cancelled; the worker still acknowledged after DONE. A result is not the
    /// caller's: free it.
    Cancelled,
    /// The worker died or was killed and has been reaped: the driver dropped its imports.
    Failed,
}

/// Which way a handoff's bytes flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[non_exhaustive]
pub enum Purpose {
    /// An input the parent lends: the worker reads it.
    Input,
    /// A result the parent allocated on the worker's request: the worker writes it.
    Result {
        /// The request this allocation answers.
        request: RequestId,
    },
    /// A job's arena slice (protocol 6): a block of the result arena the worker may carve
    /// results out of. Released with [`crate::ParentAction::ReleaseSlice`], never
    /// [`crate::ParentAction::Release`].
    Slice,
}
