//! Identifiers both sides and the wire speak of.

use std::fmt;

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
    /// never reused. On the wire it is the handle naming a handed-over allocation within a
    /// connection.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_display_their_kind_and_number() {
        assert_eq!(JobId(7).to_string(), "JobId#7");
        assert_eq!(HandoffId(3).to_string(), "HandoffId#3");
        assert_eq!(WorkerId(1).to_string(), "WorkerId#1");
    }
}
