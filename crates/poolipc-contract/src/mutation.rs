//! Deliberate bugs, one per invariant, that exist to prove the property test can fail.
//!
//! Only `cfg(test)` builds can switch one on (the machines' `mutation` field exists only
//! there); in every other build [`Mutation`] is never constructed and each check of it is a
//! constant `false`.

/// A mutated transition. Each breaks the invariant named in its doc.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))] // constructed by the mutation tests only
pub(crate) enum Mutation {
    /// Invariant 1: the parent answers a result request by granting memory it never
    /// allocated, instead of asking the facade to allocate.
    GrantBeforeAllocation,
    /// Invariant 2: the worker hands a job's memory to its code without waiting on READY.
    UseBeforeReady,
    /// Invariant 3: the worker frees its imports after the ACK instead of before DONE.
    AckBeforeUnimport,
    /// Invariant 4: the parent releases on the ACK without making its stream wait on DONE.
    ReleaseWithoutWaitingDone,
    /// Invariant 5: the parent releases a hung-up worker's handoffs before it is reaped,
    /// while the (still running) process may hold the imports.
    ReleaseAtHangUp,
    /// Invariant 6: the worker imports every pointer handoff, even of an allocation it holds
    /// already.
    ImportEveryOffer,
    /// Invariant 7: the parent lends and grants allocations above the import limit by
    /// pointer.
    IgnoreImportLimit,
    /// Invariant 8: on reaping, the parent forgets the dead worker's handoffs instead of
    /// releasing them.
    ForgetDeadWorkersLoans,
    /// Invariant 5, arena: the parent returns a hung-up worker's arena blocks at once ("no
    /// import to wait for") while the still running process may be writing into them.
    ReleaseArenaAtHangUp,
    /// Invariant 4, arena copy: the parent gives an arena-copy input's block back at the
    /// worker's ACK without making its stream wait on DONE ("the worker only reads a private
    /// copy"), while the worker's reads may still be queued on the GPU.
    ReturnArenaCopyBeforeDone,
    /// Invariant 4, arena slice: the parent gives a slice's unused tail (with the rest of the
    /// slice) back at the worker's ACK before making its stream wait on DONE, while the
    /// worker's writes into the slice may still be queued on the GPU.
    ReturnSliceTailBeforeDone,
}
