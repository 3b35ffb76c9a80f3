//! The virtual memory management API: physical allocations, address ranges, mappings.
//!
//! Teardown goes in this order, and the types keep it where one holds the other: unmap
//! ([`VmmMapping`]), then free the address range ([`VmmReservation`], which a mapping owns),
//! release the handle ([`VmmAllocation`]) at any point (the memory lives while mapped).

use std::ops::Deref;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use crate::api::Driver;
use crate::error::Result;
use crate::types::{Access, DevicePtr, VmmHandle};

/// A reference to a physical VMM allocation (`cuMemCreate`, `cuMemRetainAllocationHandle`,
/// `cuMemImportFromShareableHandle`); released on drop (`cuMemRelease`).
pub struct VmmAllocation<R = Arc<dyn Driver>>
where
    R: Deref<Target: Driver>,
{
    driver: R,
    handle: VmmHandle,
    /// Cleared once released (by `close`).
    live: bool,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for VmmAllocation<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("VmmAllocation").field(&self.handle).finish()
    }
}

impl<R: Deref<Target: Driver>> VmmAllocation<R> {
    fn owning(driver: R, handle: VmmHandle) -> VmmAllocation<R> {
        VmmAllocation {
            driver,
            handle,
            live: true,
        }
    }

    /// `cuMemCreate` of pinned device memory shareable by POSIX FD.
    pub fn create(driver: R, ordinal: u32, bytes: u64) -> Result<VmmAllocation<R>> {
        let handle = driver.vmm_create(ordinal, bytes)?;
        Ok(VmmAllocation::owning(driver, handle))
    }

    /// `cuMemCreate` of pinned device memory with no shareable handle type.
    pub fn create_unshared(driver: R, ordinal: u32, bytes: u64) -> Result<VmmAllocation<R>> {
        let handle = driver.vmm_create_unshared(ordinal, bytes)?;
        Ok(VmmAllocation::owning(driver, handle))
    }

    /// `cuMemRetainAllocationHandle`: a new reference to the allocation mapped at `ptr`.
    pub fn retain(driver: R, ptr: DevicePtr) -> Result<VmmAllocation<R>> {
        let handle = driver.vmm_retain(ptr)?;
        Ok(VmmAllocation::owning(driver, handle))
    }

    /// `cuMemImportFromShareableHandle` of another process's FD (the caller keeps `fd`).
    pub fn import_fd(driver: R, fd: BorrowedFd<'_>) -> Result<VmmAllocation<R>> {
        let handle = driver.vmm_import_fd(fd)?;
        Ok(VmmAllocation::owning(driver, handle))
    }

    /// The raw handle, valid while `self` lives.
    pub fn handle(&self) -> VmmHandle {
        self.handle
    }

    /// Releases this reference now, returning the driver's error.
    pub fn close(mut self) -> Result<()> {
        self.live = false;
        // SAFETY: (1) one reference a creating call of this driver gave this value, released
        // only here or in Drop (`live` is now false); (2) `self` is gone after this.
        unsafe { self.driver.vmm_release(self.handle) }
    }
}

impl<R: Deref<Target: Driver>> Drop for VmmAllocation<R> {
    fn drop(&mut self) {
        if self.live {
            // SAFETY: as in `close`, which did not run (`live`).
            let r = unsafe { self.driver.vmm_release(self.handle) };
            super::warn_failed("a VMM handle", self.handle, r);
        }
    }
}

/// A range of device addresses (`cuMemAddressReserve`); freed on drop (`cuMemAddressFree`).
/// Map memory into it with [`VmmMapping::map`], which owns it from then on.
pub struct VmmReservation<R = Arc<dyn Driver>>
where
    R: Deref<Target: Driver>,
{
    driver: R,
    ptr: DevicePtr,
    len: u64,
    /// Cleared once freed (by `close`) or given up (by `leak`).
    live: bool,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for VmmReservation<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmReservation")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl<R: Deref<Target: Driver>> VmmReservation<R> {
    /// `cuMemAddressReserve` of `bytes` aligned to `alignment` (0: the driver's default).
    pub fn reserve(driver: R, bytes: u64, alignment: u64) -> Result<VmmReservation<R>> {
        let ptr = driver.vmm_reserve(bytes, alignment)?;
        Ok(VmmReservation {
            driver,
            ptr,
            len: bytes,
            live: true,
        })
    }

    /// The range's first address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The range's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the range is empty (never, for one the driver reserved).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Frees the range now, returning the driver's error.
    pub fn close(mut self) -> Result<()> {
        self.live = false;
        // SAFETY: (1) the range `vmm_reserve` of this driver gave this value, freed only here
        // or in Drop (`live` is now false); nothing is mapped in it: a `VmmMapping` that
        // owned it gives it back (or leaks it) only once unmapped; (2) `self` is gone after
        // this.
        unsafe { self.driver.vmm_address_free(self.ptr, self.len) }
    }

    /// Gives the range up without freeing it (what a range whose unmap failed needs: a
    /// mapped range cannot be freed).
    pub fn leak(mut self) {
        self.live = false;
    }
}

impl<R: Deref<Target: Driver>> Drop for VmmReservation<R> {
    fn drop(&mut self) {
        if self.live {
            // SAFETY: as in `close`, which did not run (`live`).
            let r = unsafe { self.driver.vmm_address_free(self.ptr, self.len) };
            super::warn_failed("a VMM address range", self.ptr, r);
        }
    }
}

/// A whole VMM allocation mapped over a [`VmmReservation`] (`cuMemMap`); unmapped on drop
/// (`cuMemUnmap`), then its range freed, or, when the unmap failed, left reserved (a mapped
/// range cannot be freed), each failure logged.
pub struct VmmMapping<R = Arc<dyn Driver>>
where
    R: Deref<Target: Driver>,
{
    /// `None` once unmapped (by `close`).
    range: Option<VmmReservation<R>>,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for VmmMapping<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("VmmMapping").field(&self.range).finish()
    }
}

impl<R: Deref<Target: Driver>> VmmMapping<R> {
    /// `cuMemMap` of the allocation `handle` over all of `range`. On failure the range is
    /// freed (dropped) and the error returned.
    pub fn map(range: VmmReservation<R>, handle: VmmHandle) -> Result<VmmMapping<R>> {
        range.driver.vmm_map(range.ptr, range.len, handle)?;
        Ok(VmmMapping { range: Some(range) })
    }

    fn range(&self) -> &VmmReservation<R> {
        match &self.range {
            Some(r) => r,
            // `range` is taken only by `close`, which consumes `self`.
            None => unreachable!("a VmmMapping is used after close"),
        }
    }

    /// The mapping's first address.
    pub fn ptr(&self) -> DevicePtr {
        self.range().ptr
    }

    /// The mapping's length in bytes.
    pub fn len(&self) -> u64 {
        self.range().len
    }

    /// Whether the mapping is empty (never, for one the driver made).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `cuMemSetAccess` of the whole mapping for device `ordinal`.
    pub fn set_access(&self, ordinal: u32, access: Access) -> Result<()> {
        let r = self.range();
        r.driver.vmm_set_access(r.ptr, r.len, ordinal, access)
    }

    /// Unmaps now, then frees the range; returns the first error. When the unmap fails the
    /// range is left reserved (a mapped range cannot be freed).
    pub fn close(mut self) -> Result<()> {
        match self.range.take() {
            Some(range) => unmap(range),
            None => Ok(()),
        }
    }
}

/// Unmaps `range` (mapped whole by `VmmMapping::map`), then frees it; leaks it when the unmap
/// fails.
fn unmap<R: Deref<Target: Driver>>(range: VmmReservation<R>) -> Result<()> {
    // SAFETY: (1) `VmmMapping::map` mapped all of this range and only `close` or Drop,
    // which take the range out first, unmap it; (2) the range leaves the mapping here.
    let unmapped = unsafe { range.driver.vmm_unmap(range.ptr, range.len) };
    match unmapped {
        Ok(()) => range.close(),
        Err(e) => {
            range.leak();
            Err(e)
        }
    }
}

impl<R: Deref<Target: Driver>> Drop for VmmMapping<R> {
    fn drop(&mut self) {
        if let Some(range) = self.range.take() {
            let ptr = range.ptr;
            super::warn_failed("a VMM mapping", ptr, unmap(range));
        }
    }
}
