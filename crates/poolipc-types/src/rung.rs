//! The rungs of the ladder: how a tensor crosses the process boundary.

use std::fmt;

/// Which rung of the ladder a tensor travels on. Reported for every tensor, never silent.
///
/// The numbers are wire values; unknown values are a decode error, so a newer peer cannot
/// slip a rung past an older one. Rungs that need file descriptors do not carry them per
/// tensor: host staging sets its buffer up once per connection (the transport's
/// `StagingBuffer` message, one FD), and the tensors that travel on it only name the rung.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum Rung {
    /// A pointer export from the shared pool, imported by the worker: no copy. The export
    /// blob names the allocation.
    PoolPointer = 1,
    /// Copied through pinned shared host memory, chunk by chunk, into the worker's own
    /// device memory: for tensors over the import limit, and workers whose canary failed.
    /// The export blob is unused (zero).
    HostStaging = 2,
    /// A block of the parent's result arena: VMM memory the parent owns and every worker
    /// mapped once (its chunk's FD came by SCM_RIGHTS), named on the wire by `(chunk, offset,
    /// bytes)`. No export, no import, no import limit; the parent reuses the block only after
    /// the worker's DONE (stream-ordered) or after the worker was reaped.
    Arena = 3,
}

impl Rung {
    /// Every rung, in wire order.
    pub const ALL: [Rung; 3] = [Rung::PoolPointer, Rung::HostStaging, Rung::Arena];

    /// The rung with this wire value.
    pub fn from_wire(v: u8) -> Option<Self> {
        Self::ALL.iter().copied().find(|r| *r as u8 == v)
    }
}

impl fmt::Display for Rung {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rung::PoolPointer => "pool pointer",
            Rung::HostStaging => "host staging",
            Rung::Arena => "arena",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rung_round_trips_through_its_wire_number() {
        for r in Rung::ALL {
            assert_eq!(Rung::from_wire(r as u8), Some(r));
        }
        assert_eq!(Rung::from_wire(0), None);
        assert_eq!(Rung::from_wire(4), None);
    }

    #[test]
    fn rungs_display_for_a_person() {
        assert_eq!(Rung::PoolPointer.to_string(), "pool pointer");
        assert_eq!(Rung::HostStaging.to_string(), "host staging");
        assert_eq!(Rung::Arena.to_string(), "arena");
    }
}
