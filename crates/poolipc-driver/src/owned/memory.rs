//! Plain device memory (`cuMemAlloc`) and pinned host registrations.

use std::ops::Deref;
use std::sync::Arc;

use crate::api::Driver;
use crate::error::Result;
use crate::types::DevicePtr;

/// Device memory from `cuMemAlloc_v2`, outside every pool; freed on drop (`cuMemFree_v2`).
pub struct DeviceAllocation<R = Arc<dyn Driver>>
where
    R: Deref<Target: Driver>,
{
    driver: R,
    ptr: DevicePtr,
    /// Cleared once freed (by `close`).
    live: bool,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for DeviceAllocation<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DeviceAllocation").field(&self.ptr).finish()
    }
}

impl<R: Deref<Target: Driver>> DeviceAllocation<R> {
    /// `cuMemAlloc_v2` of `bytes` on the current device.
    pub fn new(driver: R, bytes: u64) -> Result<DeviceAllocation<R>> {
        let ptr = driver.mem_alloc(bytes)?;
        Ok(DeviceAllocation {
            driver,
            ptr,
            live: true,
        })
    }

    /// The memory's first byte, valid while `self` lives.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Frees the memory now (`cuMemFree_v2`, which waits for the device), returning the
    /// driver's error.
    pub fn close(mut self) -> Result<()> {
        self.live = false;
        // SAFETY: (1) `ptr` is what `mem_alloc` of this driver gave this value, freed only
        // here or in Drop (`live` is now false); (2) `self`, the only owner, is gone after
        // this.
        unsafe { self.driver.mem_free(self.ptr) }
    }
}

impl<R: Deref<Target: Driver>> Drop for DeviceAllocation<R> {
    fn drop(&mut self) {
        if self.live {
            // SAFETY: as in `close`, which did not run (`live`).
            let r = unsafe { self.driver.mem_free(self.ptr) };
            super::warn_failed("device memory", self.ptr, r);
        }
    }
}

/// Host memory pinned with `cuMemHostRegister` (portable, device-mapped); unregistered on
/// drop (`cuMemHostUnregister`).
pub struct HostRegistration<R = Arc<dyn Driver>>
where
    R: Deref<Target: Driver>,
{
    driver: R,
    ptr: *mut u8,
    /// Cleared once unregistered (by `close`) or given up (by `leak`).
    live: bool,
}

// SAFETY: `ptr` is only a key the driver looks the registration up by; this value never
// reads or writes through it, so moving it to another thread hands over no access to the
// memory. The driver is `Send + Sync`.
unsafe impl<R: Deref<Target: Driver> + Send> Send for HostRegistration<R> {}
// SAFETY: as above; `&self` methods do not touch the memory.
unsafe impl<R: Deref<Target: Driver> + Sync> Sync for HostRegistration<R> {}

impl<R: Deref<Target: Driver>> std::fmt::Debug for HostRegistration<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("HostRegistration").field(&self.ptr).finish()
    }
}

impl<R: Deref<Target: Driver>> HostRegistration<R> {
    /// `cuMemHostRegister` of `bytes` at `ptr`.
    ///
    /// # Safety
    /// 1. `ptr` points to `bytes` of mapped host memory that stays mapped until this value
    ///    unregisters it (drop or [`close`](HostRegistration::close)) or is
    ///    [leaked](HostRegistration::leak).
    /// 2. No asynchronous copy through the registration is in flight when it is unregistered.
    pub unsafe fn new(driver: R, ptr: *mut u8, bytes: usize) -> Result<HostRegistration<R>> {
        // SAFETY: the caller promises (1), which is `host_register`'s condition.
        unsafe { driver.host_register(ptr, bytes) }?;
        Ok(HostRegistration {
            driver,
            ptr,
            live: true,
        })
    }

    /// The driver it was made by.
    pub fn driver(&self) -> &R {
        &self.driver
    }

    /// Unregisters now, returning the driver's error.
    pub fn close(mut self) -> Result<()> {
        self.live = false;
        // SAFETY: registered by `new` with this pointer, unregistered only here or in Drop
        // (`live` is now false); `new`'s caller promised no copy is in flight by now.
        unsafe { self.driver.host_unregister(self.ptr) }
    }

    /// Gives the registration up without unregistering it: the pages stay pinned until the
    /// process exits (the safe failure when copies may still be in flight).
    pub fn leak(mut self) {
        self.live = false;
    }
}

impl<R: Deref<Target: Driver>> Drop for HostRegistration<R> {
    fn drop(&mut self) {
        if self.live {
            // SAFETY: as in `close`, which did not run (`live`).
            let r = unsafe { self.driver.host_unregister(self.ptr) };
            super::warn_failed("a host registration", self.ptr, r);
        }
    }
}
