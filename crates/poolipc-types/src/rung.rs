//! The rungs of the ladder: how a tensor crosses the process boundary.

use std::fmt;

/// Which rung of the ladder a tensor travels on. Reported for every tensor, never silent.
///
/// The numbers are wire values; unknown values are a decode error, so a newer peer cannot
/// slip a rung past an older one. Rungs that need file descriptors do not carry them per
/// tensor: host staging sets its buffer up once per connection (the transport's
/// `StagingBuffer` message, one FD), and the tensors that travel on it only name the rung.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
    /// An input the parent copied device-to-device into a block of its result arena (on the
    /// job's stream, before READY), for device memory of the parent's device that cannot go
    /// by pool pointer (over the import limit, a pool the worker cannot import, or memory of
    /// no pool of the parent's: `cuMemAlloc`, another library's pool, a VMM mapping). Named on
    /// the wire by `(chunk, offset)` and the tensor's layout; the worker waits on READY and
    /// reads the copy through its arena mapping: no export, no import, nothing to free. The
    /// block goes back to the arena only after the worker's DONE (stream-ordered) or after the
    /// worker was reaped. Costs one device-to-device copy (hundreds of GB/s) where host
    /// staging costs two trips over PCIe.
    ArenaCopy = 4,
    /// A VMM allocation of the parent's device (`cuMemCreate` + `cuMemMap`, as ComfyUI maps
    /// its model weights) made with the POSIX FD handle type, lent by its handle: no copy.
    /// The parent retains the handle (`cuMemRetainAllocationHandle`), exports its FD and
    /// sends it once per worker in a `VmmShare` frame naming the allocation by an id it
    /// assigns (the `alloc` of the lent tensor, tied to the allocation's address, size and
    /// buffer id); the worker imports, maps and keeps the mapping across jobs until the
    /// parent says to drop it (a tensor lent read-only: through a read-only mapping). The tensor is named on the wire by that id and its layout over
    /// the allocation. READY before the worker touches it, DONE before the parent reuses it,
    /// as for a pool pointer; nothing to free per job.
    VmmHandle = 5,
}

impl Rung {
    /// Every rung, in wire order.
    pub const ALL: [Rung; 5] = [
        Rung::PoolPointer,
        Rung::HostStaging,
        Rung::Arena,
        Rung::ArenaCopy,
        Rung::VmmHandle,
    ];

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
            Rung::ArenaCopy => "arena copy",
            Rung::VmmHandle => "vmm handle",
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
        assert_eq!(Rung::from_wire(6), None);
    }

    #[test]
    fn rungs_display_for_a_person() {
        assert_eq!(Rung::PoolPointer.to_string(), "pool pointer");
        assert_eq!(Rung::HostStaging.to_string(), "host staging");
        assert_eq!(Rung::Arena.to_string(), "arena");
        assert_eq!(Rung::ArenaCopy.to_string(), "arena copy");
        assert_eq!(Rung::VmmHandle.to_string(), "vmm handle");
    }
}
