//! Identifiers, time and the description of memory that both sides speak of.

use std::fmt;
use std::time::Duration;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        #[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}#{}", stringify!($name), self.0)
            }
        }
    };
}

id_type!(
    /// A worker process, as the parent numbers them. Never reused within one parent.
    WorkerId(u32)
);
id_type!(
    /// A job: the unit of work a worker does, grouping the tensors it reads and writes.
    JobId(u64)
);
id_type!(
    /// One handoff of one allocation to one worker. The parent numbers them, increasing,
    /// never reused.
    HandoffId(u64)
);
id_type!(
    /// One allocation of the parent's pool, unique for its lifetime *and* generation: memory
    /// the allocator recycles gets a new id. Two tensors that view the same allocation share it.
    AllocId(u64)
);
id_type!(
    /// A worker's shape-first result request, numbered by the worker, unique per worker.
    RequestId(u64)
);

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

/// An allocation's device address range `[ptr, ptr + bytes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Span {
    /// The allocation's start address.
    pub ptr: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

/// The element type of a tensor the worker asks for, as DLPack names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[non_exhaustive]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit IEEE float.
    F64,
    /// Unsigned byte.
    U8,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Boolean, one byte.
    Bool,
}

impl DType {
    /// Bytes per element.
    #[must_use]
    pub fn size(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::Bool => 1,
        }
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
