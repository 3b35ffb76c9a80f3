//! The eight invariants of the ownership contract (docs/design.md, "The ownership contract"),
//! named so that code, tests and reports speak of the same thing.

use std::fmt;

/// One invariant of the ownership contract. The number is its place in docs/design.md's list.
///
/// `audit::Auditor` (feature `testing`) checks each of them on what the two state machines *do* (their
/// actions and the messages delivered), not on what they believe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Invariant {
    /// Invariant 1: The parent owns every allocation. A worker never allocates memory the parent keeps:
    /// every item of a `Lend` or `AllocationGrant`, every free and every delivered result
    /// names an allocation the parent made.
    ParentOwnsAllocations = 1,
    /// Invariant 2: The worker touches memory only after it waited (on its stream) for the parent's READY
    /// event, and the parent recorded that job's READY before it sent the `Lend` or
    /// `AllocationGrant` carrying it. (Host-staged handoffs are the worker's own copies: no
    /// READY.)
    ReadyBeforeAccess = 2,
    /// Invariant 3: After its last access to a job's memory the worker frees its imports (UNIMPORT,
    /// stream ordered), then records DONE (so the parent's wait on DONE covers the frees),
    /// then ACKs; it touches none of the job's memory afterwards.
    DoneThenUnimportThenAck = 3,
    /// Invariant 4: The parent releases only after the ACK, and makes its consumer streams wait on DONE
    /// first: the gate is GPU completion, never CPU receipt. Each handoff is released once;
    /// a host-staged result only after its bytes were received; a job finishes only when
    /// every handoff of it is released.
    ReleaseAfterAckAndDone = 4,
    /// Invariant 5: An import is freed before the exporter frees the allocation, in every path, faults
    /// included; nothing freed is imported. An arena block, which no import guards, is freed
    /// only after the parent's stream waited on its worker's DONE, or after the worker was
    /// reaped; a worker never touches a freed block.
    UnimportBeforeFree = 5,
    /// Invariant 6: One import per exported allocation per worker, refcounted: never a second driver
    /// import of the same allocation in one worker, never an unimport while a handoff uses it.
    OneImportPerAllocation = 6,
    /// Invariant 7: No allocation above the import limit is ever offered for pointer import (in a
    /// `Lend` or an `AllocationGrant`). Host-staged handoffs have no import and no limit.
    ImportLimit = 7,
    /// Invariant 8: A worker that dies mid-handoff fails its jobs only: once it is reaped the parent
    /// releases everything it had lent it, touches no other worker's handoffs, and keeps
    /// serving the others.
    DeathFailsOnlyItsJobs = 8,
}

impl Invariant {
    /// All eight, in docs/design.md's order.
    pub const ALL: [Invariant; 8] = [
        Invariant::ParentOwnsAllocations,
        Invariant::ReadyBeforeAccess,
        Invariant::DoneThenUnimportThenAck,
        Invariant::ReleaseAfterAckAndDone,
        Invariant::UnimportBeforeFree,
        Invariant::OneImportPerAllocation,
        Invariant::ImportLimit,
        Invariant::DeathFailsOnlyItsJobs,
    ];

    /// docs/design.md's number for it.
    #[must_use]
    pub fn number(self) -> u8 {
        self as u8
    }
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invariant {} ({:?})", self.number(), self)
    }
}

/// A broken invariant, with what was seen.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{invariant} violated: {detail}")]
pub struct Violation {
    /// The invariant.
    pub invariant: Invariant,
    /// What happened.
    pub detail: String,
}

impl Violation {
    pub(crate) fn new(invariant: Invariant, detail: impl Into<String>) -> Violation {
        Violation {
            invariant,
            detail: detail.into(),
        }
    }
}
