//! Memory pools, their allocations and pointer imports.

use std::ops::Deref;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use crate::api::Driver;
use crate::error::{CuCode, DriverError, Result};
use crate::types::{DevicePtr, PoolHandle, PoolSharing, StreamHandle};
use poolipc_types::ExportBlob;

/// A memory pool this process created ([`OwnedPool::create`]) or imported from another
/// process's FD ([`OwnedPool::import_fd`]); destroyed on drop (`cuMemPoolDestroy`, which for
/// a pool with live allocations returns at once and lets the driver free it after them).
pub struct OwnedPool<R = Arc<dyn Driver>>
where
    R: Deref<Target: Driver>,
{
    driver: R,
    handle: PoolHandle,
    /// Cleared once destroyed (by `close`) or given up (by `into_raw`).
    live: bool,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for OwnedPool<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OwnedPool").field(&self.handle).finish()
    }
}

impl<R: Deref<Target: Driver>> OwnedPool<R> {
    /// `cuMemPoolCreate` of a pinned device pool on `ordinal`.
    pub fn create(driver: R, ordinal: u32, sharing: PoolSharing) -> Result<OwnedPool<R>> {
        let handle = driver.mem_pool_create(ordinal, sharing, crate::types::OwnerToken(()))?;
        Ok(OwnedPool {
            driver,
            handle,
            live: true,
        })
    }

    /// `cuMemPoolImportFromShareableHandle` of another process's pool FD (the caller keeps
    /// `fd`).
    pub fn import_fd(driver: R, fd: BorrowedFd<'_>) -> Result<OwnedPool<R>> {
        let handle = driver.mem_pool_import_fd(fd)?;
        Ok(OwnedPool {
            driver,
            handle,
            live: true,
        })
    }

    /// The raw handle, valid while `self` lives.
    pub fn handle(&self) -> PoolHandle {
        self.handle
    }

    /// The driver it was made by.
    pub fn driver(&self) -> &R {
        &self.driver
    }

    /// Destroys the pool now, returning the driver's error.
    pub fn close(mut self) -> Result<()> {
        self.live = false;
        // SAFETY: made by `mem_pool_create`/`mem_pool_import_fd` of this driver, destroyed
        // only here or in Drop (`live` is now false), and `self` is gone after this.
        unsafe { self.driver.mem_pool_destroy(self.handle) }
    }

    /// Gives the pool up without destroying it: it lives until the process exits (what a
    /// pool that is the device's current pool, which torch allocates from, needs).
    pub fn into_raw(mut self) -> PoolHandle {
        self.live = false;
        self.handle
    }
}

impl<R: Deref<Target: Driver>> Drop for OwnedPool<R> {
    fn drop(&mut self) {
        if self.live {
            // SAFETY: as in `close`, which did not run (`live`).
            let r = unsafe { self.driver.mem_pool_destroy(self.handle) };
            super::warn_failed("a memory pool", self.handle, r);
        }
    }
}

/// A stream-ordered allocation this process owns (`cuMemAllocAsync`,
/// `cuMemAllocFromPoolAsync`), freed by [`free`](PoolAllocation::free) on the stream the
/// caller names. Dropped without it, it is freed on the legacy default stream
/// ([`StreamHandle::NULL`]), which is ordered after that stream's work only: free it
/// explicitly wherever non-blocking streams used it.
pub struct PoolAllocation<R = Arc<dyn Driver>>
where
    R: Deref<Target: Driver>,
{
    driver: R,
    ptr: DevicePtr,
    /// Cleared once freed (by `free`) or given up (by `into_raw`).
    live: bool,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for PoolAllocation<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PoolAllocation").field(&self.ptr).finish()
    }
}

impl<R: Deref<Target: Driver>> PoolAllocation<R> {
    /// `cuMemAllocAsync`: `bytes` from the device's current pool, on `stream`.
    pub fn new(driver: R, bytes: u64, stream: StreamHandle) -> Result<PoolAllocation<R>> {
        let ptr = driver.mem_alloc_async(bytes, stream)?;
        Ok(PoolAllocation::owning(driver, ptr))
    }

    /// `cuMemAllocFromPoolAsync`: `bytes` from `pool`, on `stream`.
    pub fn from_pool(
        driver: R,
        bytes: u64,
        pool: PoolHandle,
        stream: StreamHandle,
    ) -> Result<PoolAllocation<R>> {
        let ptr = driver.mem_alloc_from_pool_async(bytes, pool, stream)?;
        Ok(PoolAllocation::owning(driver, ptr))
    }

    /// Takes charge of memory this process allocated from a pool and handed on as an address
    /// (a job's result, a tensor of torch's allocator): checked with the driver
    /// (`cuPointerGetAttributes`) to be the start of a live allocation of a memory pool, else
    /// an error naming the call (`INVALID_VALUE`), and nothing is freed.
    ///
    /// What the driver cannot tell is whether another owner still uses it: the caller
    /// answers for that, as for any write through an address. Freeing memory someone else
    /// uses is a use after free on the device (the harm a memset through a wrong address
    /// does), never one of host memory: the driver looks the address up in its own tables.
    pub fn claim(driver: R, ptr: DevicePtr) -> Result<PoolAllocation<R>> {
        const CALL: &str = "cuPointerGetAttributes";
        let info = driver.pointer_info(ptr)?;
        if info.base != ptr || info.pool.is_none() {
            return Err(DriverError::Call {
                call: CALL,
                code: CuCode::INVALID_VALUE,
            });
        }
        Ok(PoolAllocation::owning(driver, ptr))
    }

    fn owning(driver: R, ptr: DevicePtr) -> PoolAllocation<R> {
        PoolAllocation {
            driver,
            ptr,
            live: true,
        }
    }

    /// The allocation's first byte, valid while `self` lives.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// `cuMemFreeAsync` on `stream`: the memory goes back to its pool once the work queued
    /// on `stream` before it ran. Order every use of the memory before the free on `stream`.
    pub fn free(mut self, stream: StreamHandle) -> Result<()> {
        self.live = false;
        // SAFETY: (1) `ptr` is the start of a live allocation this value owns (made by the
        // allocating call or checked by `claim`), freed only here or in Drop; (2) `self`, the
        // only owner, is gone after this.
        unsafe { self.driver.mem_free_async(self.ptr, stream) }
    }

    /// Gives the allocation up without freeing it (whoever gets the address frees it).
    pub fn into_raw(mut self) -> DevicePtr {
        self.live = false;
        self.ptr
    }
}

impl<R: Deref<Target: Driver>> Drop for PoolAllocation<R> {
    fn drop(&mut self) {
        if self.live {
            // SAFETY: as in `free`, which did not run (`live`).
            let r = unsafe { self.driver.mem_free_async(self.ptr, StreamHandle::NULL) };
            super::warn_failed("a pool allocation", self.ptr, r);
        }
    }
}

/// Another process's pool allocation imported into this one (`cuMemPoolImportPointer`),
/// freed (the import, not the allocation) by [`free`](ImportedPointer::free) on the stream
/// the caller names; dropped without it, on the legacy default stream
/// ([`StreamHandle::NULL`]).
///
/// Import each exported allocation once per process: a second import is an alias whose
/// first free unmaps both (NVIDIA bug 5570902).
pub struct ImportedPointer<R = Arc<dyn Driver>>
where
    R: Deref<Target: Driver>,
{
    driver: R,
    ptr: DevicePtr,
    /// Cleared once freed (by `free`).
    live: bool,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for ImportedPointer<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ImportedPointer").field(&self.ptr).finish()
    }
}

impl<R: Deref<Target: Driver>> ImportedPointer<R> {
    /// `cuMemPoolImportPointer` of `data` from the imported `pool`.
    pub fn import(driver: R, pool: PoolHandle, data: &ExportBlob) -> Result<ImportedPointer<R>> {
        let ptr = driver.mem_pool_import_pointer(pool, data)?;
        Ok(ImportedPointer {
            driver,
            ptr,
            live: true,
        })
    }

    /// Where the import is mapped in this process, valid while `self` lives.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// `cuMemFreeAsync` of the import on `stream`. Order every use of the import before the
    /// free on `stream`.
    pub fn free(mut self, stream: StreamHandle) -> Result<()> {
        self.live = false;
        // SAFETY: (1) `ptr` is the live import `mem_pool_import_pointer` of this driver gave
        // this value, freed only here or in Drop; (2) `self`, the only owner, is gone after
        // this.
        unsafe { self.driver.mem_pool_free_import(self.ptr, stream) }
    }
}

impl<R: Deref<Target: Driver>> Drop for ImportedPointer<R> {
    fn drop(&mut self) {
        if self.live {
            // SAFETY: as in `free`, which did not run (`live`).
            let r = unsafe {
                self.driver
                    .mem_pool_free_import(self.ptr, StreamHandle::NULL)
            };
            super::warn_failed("a pointer import", self.ptr, r);
        }
    }
}
