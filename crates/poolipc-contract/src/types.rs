//! Time, results and outcomes that both sides speak of.
//!
//! The identifiers, [`Span`] and [`DType`] are `poolipc-types`' (re-exported at the crate
//! root); they are named here so that the modules of this crate find them in one place.

use std::time::Duration;

pub(crate) use poolipc_types::{AllocId, DType, HandoffId, JobId, RequestId, Span, WorkerId};

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

/// What a worker announces before it writes a result: the parent allocates from it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct ResultSpec {
    /// The tensor's shape.
    pub shape: Vec<u64>,
    /// The tensor's element type.
    pub dtype: DType,
    /// The bytes the worker will write (at least shape × element size for a dense tensor).
    pub bytes: u64,
}

impl ResultSpec {
    /// The bytes a dense tensor of this shape and dtype takes, or `None` on overflow.
    #[must_use]
    pub fn dense_bytes(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(self.dtype.size(), |acc, &d| acc.checked_mul(d))
    }
}

/// Why a handoff's memory may change owner: the parent says it in [`crate::ParentAction::Release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The worker acknowledged after DONE: an input may be reused, a result is the caller's.
    Completed,
    /// The job was cancelled; the worker still acknowledged after DONE.
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
    /// A result the parent allocated on the worker's request: the worker writes it in place.
    Result {
        /// The request this allocation answers.
        request: RequestId,
    },
}
