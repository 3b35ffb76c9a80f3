//! The worker's side of the VMM-handle rung: the parent's VMM allocations (memory it made
//! with `cuMemCreate` + `cuMemMap`, such as ComfyUI's model weights), imported from the FD
//! the parent sent once and mapped once, kept across jobs under the id the parent gave. A
//! tensor lent read-only is viewed through a second, read-only mapping of the same handle
//! (made at the first such lend, kept with the first): lent by handle there is no copy
//! between the worker and the parent's memory, so a write must fault rather than land.
//!
//! A mapping keeps the physical memory alive: while this worker holds it, the VRAM stays
//! allocated even after the parent unmapped and released its own allocation. So the cache is
//! not a free lunch: [`VmmMappings::release_unused`] drops every mapping no running job
//! uses, and a share for a new allocation at an address where an older one was mapped
//! retires the older mapping as soon as no job uses it. The parent decides when to call
//! the first (its `Release` message); the worker never drops a mapping the parent still
//! believes it holds, or the parent's next lend of it would name nothing.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use poolipc_driver::{
    Access, DevicePtr, Driver, DriverError, Granularity, VmmAllocation, VmmHandle, VmmMapping,
    VmmReservation,
};
use poolipc_types::{AllocId, JobId};

/// What went wrong with a shared VMM allocation. Malformed input from the parent is a typed
/// error, never a panic; nothing is mapped or touched on an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VmmShareError {
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// A tensor named an allocation the parent never shared with this worker (or one this
    /// worker dropped when told to).
    #[error("VMM allocation {alloc:?} was never shared with this worker")]
    Unknown {
        /// The id named.
        alloc: AllocId,
    },
    /// A tensor's bytes do not lie inside the mapping.
    #[error(
        "a tensor of {len} bytes at offset {offset} lies outside VMM allocation {alloc:?} \
         ({mapped} bytes mapped)"
    )]
    OutOfBounds {
        /// The allocation.
        alloc: AllocId,
        /// The tensor's offset in it.
        offset: u64,
        /// The tensor's length.
        len: u64,
        /// The mapping's length.
        mapped: u64,
    },
    /// A share's length is 0 or not a multiple of the driver's granularity.
    #[error(
        "VMM allocation {alloc:?} shared with a length of {len} bytes, not a non-zero multiple \
         of the granularity ({granularity} bytes)"
    )]
    BadLen {
        /// The allocation.
        alloc: AllocId,
        /// The length sent.
        len: u64,
        /// The driver's granularity.
        granularity: u64,
    },
    /// The same id shared twice while its first mapping is in use by a job.
    #[error("VMM allocation {alloc:?} shared again while a job uses its mapping")]
    InUse {
        /// The allocation.
        alloc: AllocId,
    },
}

/// One import and its mappings. Dropped (or `unmap`ped), the read-only mapping goes first,
/// then the read-write one, then the handle: the fields' order.
#[derive(Debug)]
struct Mapped {
    /// A second mapping of the handle, read-only, made at the first read-only lend: a tensor
    /// lent read-only is viewed through it, so a write faults instead of changing the
    /// parent's memory (`cuMemMap` maps whole handles, so it cannot be a range of `ptr`).
    read_only: Option<VmmMapping>,
    mapping: VmmMapping,
    handle: VmmAllocation,
    len: u64,
    /// Where the parent has it: a later share at the same place replaces it.
    parent_base: u64,
    /// Jobs using it (started, DONE not yet recorded).
    users: u32,
    /// Replaced by a newer share at the same parent address: unmapped when unused.
    stale: bool,
}

/// How often the cache was used, for statistics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmmShareStats {
    /// Allocations imported and mapped (one per share received).
    pub mapped: u64,
    /// Tensors resolved through a mapping (first use and reuse alike).
    pub resolved: u64,
    /// Mappings dropped (released, stale, or replaced).
    pub unmapped: u64,
    /// Mappings held now.
    pub held: u64,
}

/// The parent's VMM allocations this worker mapped, by the id the parent gave them.
pub struct VmmMappings {
    driver: Arc<dyn Driver>,
    device: u32,
    maps: HashMap<AllocId, Mapped>,
    /// Ids each running job resolved, to give back when its DONE is recorded.
    jobs: HashMap<JobId, Vec<AllocId>>,
    stats: VmmShareStats,
}

impl std::fmt::Debug for VmmMappings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmMappings")
            .field("device", &self.device)
            .field("held", &self.maps.len())
            .finish_non_exhaustive()
    }
}

impl VmmMappings {
    /// No mappings yet, on `device`.
    pub fn new(driver: Arc<dyn Driver>, device: u32) -> VmmMappings {
        VmmMappings {
            driver,
            device,
            maps: HashMap::new(),
            jobs: HashMap::new(),
            stats: VmmShareStats::default(),
        }
    }

    /// Imports the allocation behind `fd` (`cuMemImportFromShareableHandle`), reserves and
    /// maps `len` bytes of it read-write for this worker's device, and keeps it as `alloc`.
    /// A mapping held for another id at the same `parent_base` is stale from now on (the
    /// parent's allocation there was replaced) and goes as soon as no job uses it. The same
    /// id shared again (after a release the parent asked for, or a replaced handle) replaces
    /// its mapping unless a job uses it.
    pub fn share(
        &mut self,
        alloc: AllocId,
        parent_base: u64,
        len: u64,
        fd: BorrowedFd<'_>,
    ) -> Result<DevicePtr, VmmShareError> {
        let granularity = self
            .driver
            .vmm_granularity(self.device, Granularity::Minimum)?;
        if len == 0 || granularity == 0 || !len.is_multiple_of(granularity) {
            return Err(VmmShareError::BadLen {
                alloc,
                len,
                granularity,
            });
        }
        if self.maps.get(&alloc).is_some_and(|m| m.users > 0) {
            return Err(VmmShareError::InUse { alloc });
        }
        if let Some(old) = self.maps.remove(&alloc) {
            self.unmap(old);
        }
        let handle = VmmAllocation::import_fd(Arc::clone(&self.driver), fd)?;
        // A failed mapping releases the import (dropped here, logged).
        let mapping = self.map(handle.handle(), len, Access::ReadWrite)?;
        let ptr = mapping.ptr();
        for m in self.maps.values_mut() {
            if m.parent_base == parent_base {
                m.stale = true;
            }
        }
        self.maps.insert(
            alloc,
            Mapped {
                read_only: None,
                mapping,
                handle,
                len,
                parent_base,
                users: 0,
                stale: false,
            },
        );
        self.stats.mapped += 1;
        self.drop_stale();
        tracing::debug!(?alloc, len, ?ptr, "VMM allocation of the parent mapped");
        Ok(ptr)
    }

    /// The address of `len` bytes at `offset` of `alloc`'s mapping (`read_only`: of its
    /// read-only mapping, made now if it is the first), used by `job` until
    /// [`job_done`](VmmMappings::job_done): the mapping stays while a job uses it.
    pub fn resolve(
        &mut self,
        job: JobId,
        alloc: AllocId,
        offset: u64,
        len: u64,
        read_only: bool,
    ) -> Result<DevicePtr, VmmShareError> {
        let (handle, mapped, has_ro) = self
            .maps
            .get(&alloc)
            .filter(|m| !m.stale)
            .map(|m| (m.handle.handle(), m.len, m.read_only.is_some()))
            .ok_or(VmmShareError::Unknown { alloc })?;
        match offset.checked_add(len) {
            Some(end) if end <= mapped => {}
            _ => {
                return Err(VmmShareError::OutOfBounds {
                    alloc,
                    offset,
                    len,
                    mapped,
                });
            }
        }
        let ro = match (read_only, has_ro) {
            (true, false) => Some(self.map(handle, mapped, Access::Read)?),
            _ => None,
        };
        let m = self
            .maps
            .get_mut(&alloc)
            .ok_or(VmmShareError::Unknown { alloc })?;
        if ro.is_some() {
            m.read_only = ro;
        }
        m.users += 1;
        let base = match (read_only, &m.read_only) {
            (true, Some(ro)) => ro.ptr(),
            _ => m.mapping.ptr(),
        };
        self.jobs.entry(job).or_default().push(alloc);
        self.stats.resolved += 1;
        Ok(base.offset(offset))
    }

    /// `job` recorded its DONE: every access it made through a mapping is ordered before it,
    /// so its mappings are free to go (when released, or stale).
    pub fn job_done(&mut self, job: JobId) {
        for alloc in self.jobs.remove(&job).unwrap_or_default() {
            if let Some(m) = self.maps.get_mut(&alloc) {
                m.users = m.users.saturating_sub(1);
            }
        }
        self.drop_stale();
    }

    /// Drops every mapping no running job uses (unmap, free the address range, release the
    /// import), so the VRAM behind the parent's freed allocations goes back. The caller
    /// makes sure the GPU work of finished jobs completed first (their DONE was recorded on
    /// the stream it synchronizes). Returns how many mappings were dropped.
    pub fn release_unused(&mut self) -> usize {
        let unused: Vec<AllocId> = self
            .maps
            .iter()
            .filter(|(_, m)| m.users == 0)
            .map(|(a, _)| *a)
            .collect();
        for alloc in &unused {
            if let Some(m) = self.maps.remove(alloc) {
                self.unmap(m);
            }
        }
        unused.len()
    }

    /// The counters.
    pub fn stats(&self) -> VmmShareStats {
        VmmShareStats {
            held: self.maps.len() as u64,
            ..self.stats
        }
    }

    fn drop_stale(&mut self) {
        let stale: Vec<AllocId> = self
            .maps
            .iter()
            .filter(|(_, m)| m.stale && m.users == 0)
            .map(|(a, _)| *a)
            .collect();
        for alloc in stale {
            if let Some(m) = self.maps.remove(&alloc) {
                self.unmap(m);
            }
        }
    }

    /// Reserves `len` bytes, maps `handle` there and grants this worker's device `access`.
    /// On failure the range is unmapped and freed again (the owning types' drops, which log
    /// what fails).
    fn map(&self, handle: VmmHandle, len: u64, access: Access) -> Result<VmmMapping, DriverError> {
        let range = VmmReservation::reserve(Arc::clone(&self.driver), len, 0)?;
        let mapping = VmmMapping::map(range, handle)?;
        mapping.set_access(self.device, access)?;
        Ok(mapping)
    }

    /// Unmaps (the read-only mapping first), frees the address ranges, releases the import:
    /// each step tried (a range only once unmapped), failures logged, never a panic.
    fn unmap(&mut self, m: Mapped) {
        let Mapped {
            read_only,
            mapping,
            handle,
            ..
        } = m;
        if let Some(ro) = read_only
            && let Err(e) = ro.close()
        {
            tracing::warn!(error = %e, "unmapping a read-only VMM mapping failed");
        }
        if let Err(e) = mapping.close() {
            tracing::warn!(error = %e, "unmapping a VMM allocation of the parent failed");
        }
        if let Err(e) = handle.close() {
            tracing::warn!(error = %e, "releasing a VMM import failed");
        }
        self.stats.unmapped += 1;
    }
}

impl Drop for VmmMappings {
    fn drop(&mut self) {
        let all: Vec<AllocId> = self.maps.keys().copied().collect();
        for alloc in all {
            if let Some(m) = self.maps.remove(&alloc) {
                self.unmap(m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use std::os::fd::{AsFd, OwnedFd};

    use poolipc_driver::sim::{SimConfig, SimDriver};

    use super::*;

    /// A simulated process with a VMM allocation (POSIX FD) of one granule, mapped, and the
    /// FD the parent would send.
    fn setup() -> (Arc<SimDriver>, u64, DevicePtr, OwnedFd) {
        let d = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
        d.use_device(0).unwrap();
        let g = d.vmm_granularity(0, Granularity::Minimum).unwrap();
        let h = d.vmm_create(0, g).unwrap();
        let va = d.vmm_reserve(g, 0).unwrap();
        d.vmm_map(va, g, h).unwrap();
        d.vmm_set_access(va, g, 0, Access::ReadWrite).unwrap();
        let fd = d.vmm_export_fd(h).unwrap();
        (d, g, va, fd)
    }

    #[test]
    fn a_mapping_serves_every_job_and_goes_only_when_released_unused() {
        let (d, g, va, fd) = setup();
        let mut m = VmmMappings::new(Arc::clone(&d) as Arc<dyn Driver>, 0);
        let p = m.share(AllocId(1), va.0, g, fd.as_fd()).unwrap();
        assert_eq!(
            m.resolve(JobId(1), AllocId(1), 16, 64, false).unwrap(),
            p.offset(16)
        );
        assert_eq!(m.resolve(JobId(2), AllocId(1), 0, g, false).unwrap(), p);
        // Job 1 still runs: its mapping stays.
        m.job_done(JobId(2));
        assert_eq!(m.release_unused(), 0);
        m.job_done(JobId(1));
        assert_eq!(m.release_unused(), 1);
        let s = m.stats();
        assert_eq!((s.mapped, s.resolved, s.unmapped, s.held), (1, 2, 1, 0));
        assert!(matches!(
            m.resolve(JobId(3), AllocId(1), 0, 64, false),
            Err(VmmShareError::Unknown { .. })
        ));
    }

    #[test]
    fn a_new_share_at_the_same_parent_address_retires_the_old_mapping_once_unused() {
        let (d, g, va, fd) = setup();
        let mut m = VmmMappings::new(Arc::clone(&d) as Arc<dyn Driver>, 0);
        m.share(AllocId(1), va.0, g, fd.as_fd()).unwrap();
        m.resolve(JobId(1), AllocId(1), 0, 64, false).unwrap();
        // The parent's allocation at `va` was replaced: a new id for the same address.
        m.share(AllocId(2), va.0, g, fd.as_fd()).unwrap();
        assert!(
            m.resolve(JobId(2), AllocId(1), 0, 64, false).is_err(),
            "a stale mapping serves no new job"
        );
        assert_eq!(m.stats().held, 2, "job 1 still uses the old one");
        m.job_done(JobId(1));
        let s = m.stats();
        assert_eq!((s.held, s.unmapped), (1, 1));
        m.resolve(JobId(2), AllocId(2), 0, 64, false).unwrap();
    }

    #[test]
    fn malformed_shares_and_tensors_are_typed_errors_and_touch_nothing() {
        let (d, g, va, fd) = setup();
        let mut m = VmmMappings::new(Arc::clone(&d) as Arc<dyn Driver>, 0);
        for len in [0, g - 1, g + 1] {
            assert!(matches!(
                m.share(AllocId(1), va.0, len, fd.as_fd()),
                Err(VmmShareError::BadLen { .. })
            ));
        }
        assert_eq!(m.stats().mapped, 0);
        m.share(AllocId(1), va.0, g, fd.as_fd()).unwrap();
        for (offset, len) in [(g, 1), (g - 8, 16), (u64::MAX, 2)] {
            assert!(matches!(
                m.resolve(JobId(1), AllocId(1), offset, len, false),
                Err(VmmShareError::OutOfBounds { .. })
            ));
        }
        m.resolve(JobId(1), AllocId(1), 0, 8, false).unwrap();
        assert!(matches!(
            m.share(AllocId(1), va.0, g, fd.as_fd()),
            Err(VmmShareError::InUse { .. })
        ));
        // Nothing held is lost by the refusals: the mapping still serves.
        m.resolve(JobId(2), AllocId(1), 8, 8, false).unwrap();
    }

    #[test]
    fn a_tensor_lent_read_only_is_viewed_through_a_read_only_mapping_made_once() {
        let (d, g, va, fd) = setup();
        let mut m = VmmMappings::new(Arc::clone(&d) as Arc<dyn Driver>, 0);
        let rw = m.share(AllocId(1), va.0, g, fd.as_fd()).unwrap();
        let ro = m.resolve(JobId(1), AllocId(1), 64, 64, true).unwrap();
        assert_ne!(ro, rw.offset(64), "a second mapping");
        let base = DevicePtr(ro.0 - 64);
        assert_eq!(
            m.resolve(JobId(2), AllocId(1), 0, 64, true).unwrap(),
            base,
            "made once"
        );
        assert_eq!(m.resolve(JobId(3), AllocId(1), 0, 64, false).unwrap(), rw);
        // Through it, a write is refused (the simulation records it, as the GPU faults).
        let before = d.violation_count();
        let _ = d.memset_d8_async(ro, 1, 4, poolipc_driver::StreamHandle::NULL);
        assert!(
            d.violation_count() > before,
            "a write through the read-only mapping"
        );
        for job in 1..=3 {
            m.job_done(JobId(job));
        }
        assert_eq!(m.release_unused(), 1);
    }
}
