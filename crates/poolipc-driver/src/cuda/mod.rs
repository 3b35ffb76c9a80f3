//! `CudaDriver`: the [`Driver`] trait on libcuda, through cudarc's `driver::sys` with dynamic
//! loading. Driver API only.
//!
//! Two layers, as cudarc has them: [`result`] holds one thin wrapper per driver call, which
//! turns its `CUresult` into a [`Result`] naming the call (an `unsafe fn` where the caller must
//! vouch for a handle or host memory); this module implements the trait on top, converting
//! the trait's types to libcuda's and back. [`load`] loads and checks libcuda before anything
//! is called; [`kernels`] holds the test kernels.
//!
//! # Handles, and what the safety comments rest on
//!
//! A [`PoolHandle`], [`StreamHandle`], [`EventHandle`] or [`VmmHandle`] carries what libcuda
//! gave out, for the host-side ones the address of its object in this process, which libcuda
//! dereferences without checking. The handle types make passing one sound (*the handle
//! contract*): a handle is made by this driver, or by `from_raw`, whose caller vouches that
//! it is live; destroying one is an `unsafe fn` whose caller promises it is not used after,
//! and safe code destroys only through the owning types (`OwnedPool`, ...), which hand the
//! handle out while they live. A device address ([`DevicePtr`]) is different: libcuda looks
//! it up in its own tables, and a wrong one is an error or a fault on the device, never an
//! access to host memory.

mod kernels;
mod load;
mod result;
mod stream_check;

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Mutex;

use cudarc::driver::sys;

use crate::api::Driver;
use crate::error::{CuCode, DriverError, Result};
use crate::types::OwnerToken;
use crate::types::{
    Access, DeviceInfo, DevicePtr, DeviceUuid, DriverKind, EventBlob, EventHandle, ExportBlob,
    Granularity, PointerInfo, PoolAttribute, PoolCounter, PoolHandle, PoolSharing, StreamHandle,
    VmmHandle,
};
use kernels::{HANG_KERNEL_PTX, Kernels, STORE_KERNEL_PTX};
use result::device_location;

fn size(call: &'static str, bytes: u64) -> Result<usize> {
    usize::try_from(bytes).map_err(|_| DriverError::InvalidArgument {
        call,
        reason: format!("{bytes} bytes does not fit in usize"),
    })
}

fn pool_raw(pool: PoolHandle) -> sys::CUmemoryPool {
    std::ptr::with_exposed_provenance_mut(pool.0 as usize)
}

fn pool_handle(pool: sys::CUmemoryPool) -> PoolHandle {
    PoolHandle(pool.expose_provenance() as u64)
}

fn stream_raw(stream: StreamHandle) -> sys::CUstream {
    std::ptr::with_exposed_provenance_mut(stream.0 as usize)
}

fn event_raw(event: EventHandle) -> sys::CUevent {
    std::ptr::with_exposed_provenance_mut(event.0 as usize)
}

fn access_flags(access: Access) -> sys::CUmemAccess_flags {
    match access {
        Access::None => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
        Access::Read => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// A primary context this driver retained, kept as an address so the map is `Send`.
#[derive(Debug, Clone, Copy)]
struct Retained {
    device: sys::CUdevice,
    context: usize,
}

/// The real CUDA driver: libcuda loaded at run time, driver API only.
///
/// [`CudaDriver::new`] fails with a clear [`DriverError`] (never a panic) when libcuda is
/// missing or lacks a symbol, when there is no device, under WSL2, or when the driver is
/// older than [`MIN_DRIVER_VERSION`](crate::MIN_DRIVER_VERSION).
#[derive(Debug)]
pub struct CudaDriver {
    retained: Mutex<HashMap<u32, Retained>>,
    /// The test kernels, loaded in each context the first time they run there.
    kernels: Kernels,
}

impl CudaDriver {
    /// `ordinal`'s primary context, retained the first time (released when the driver is
    /// dropped).
    fn primary_context(&self, ordinal: u32) -> Result<sys::CUcontext> {
        let mut map = self
            .retained
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let r = match map.get(&ordinal) {
            Some(r) => *r,
            None => {
                let device = self.device(ordinal)?;
                // Released in Drop.
                let ctx = result::device::primary_ctx_retain(device)?;
                let r = Retained {
                    device,
                    context: ctx.expose_provenance(),
                };
                map.insert(ordinal, r);
                r
            }
        };
        drop(map);
        Ok(std::ptr::with_exposed_provenance_mut(r.context))
    }

    /// Load libcuda, check it, and initialise the driver API.
    pub fn new() -> Result<CudaDriver> {
        load::load()?;
        let driver = CudaDriver {
            retained: Mutex::new(HashMap::new()),
            kernels: Kernels::default(),
        };
        if driver.device_count()? == 0 {
            return Err(DriverError::NoDevice);
        }
        Ok(driver)
    }

    /// Whether libcuda can be loaded at all (no initialisation, no device query).
    #[must_use]
    pub fn library_present() -> bool {
        load::library_present()
    }

    fn device(&self, ordinal: u32) -> Result<sys::CUdevice> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(DriverError::DeviceOutOfRange { ordinal, count });
        }
        result::device::get(ordinal as c_int)
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        let retained = match self.retained.get_mut() {
            Ok(map) => std::mem::take(map),
            Err(poisoned) => std::mem::take(poisoned.into_inner()),
        };
        for (ordinal, r) in retained {
            // SAFETY: we retained this primary context once in `use_device` and give that
            // retain back once here (the map is emptied); this driver, whose handles live in
            // the context, is going away.
            let res = unsafe { result::device::primary_ctx_release(r.device) };
            if let Err(e) = res {
                tracing::warn!(ordinal, error = %e, "releasing the primary context failed");
            }
        }
    }
}

impl Driver for CudaDriver {
    fn kind(&self) -> DriverKind {
        DriverKind::Cuda
    }

    fn driver_version(&self) -> Result<i32> {
        result::device::driver_version()
    }

    fn device_count(&self) -> Result<u32> {
        Ok(u32::try_from(result::device::count()?).unwrap_or(0))
    }

    fn device_info(&self, ordinal: u32) -> Result<DeviceInfo> {
        use result::device::attribute;
        use sys::CUdevice_attribute as A;
        let dev = self.device(ordinal)?;
        let uuid = result::device::uuid(dev)?;
        let name = result::device::name(dev)?;
        let total = result::device::total_mem(dev)?;
        let posix_fd = POSIX_FD.0 as i32;
        let pool_types = attribute(dev, A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)?;
        Ok(DeviceInfo {
            ordinal,
            uuid: DeviceUuid(uuid.bytes.map(|c| c as u8)),
            name: String::from_utf8_lossy(&name).into_owned(),
            total_memory: total as u64,
            memory_pools: attribute(dev, A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0,
            pool_posix_fd: pool_types & posix_fd != 0,
            vmm: attribute(
                dev,
                A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            )? != 0,
            vmm_posix_fd: attribute(
                dev,
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )? != 0,
            mps_client: attribute(dev, A::CU_DEVICE_ATTRIBUTE_MPS_ENABLED)
                .ok()
                .map(|v| v != 0),
        })
    }

    fn device_can_access_peer(&self, ordinal: u32, peer: u32) -> Result<bool> {
        let (a, b) = (self.device(ordinal)?, self.device(peer)?);
        Ok(result::device::can_access_peer(a, b)? != 0)
    }

    fn use_device(&self, ordinal: u32) -> Result<()> {
        let ctx = self.primary_context(ordinal)?;
        // SAFETY: the context is retained (once per device) and released only when this
        // driver is dropped, so it is live for as long as the driver lives.
        unsafe { result::device::ctx_set_current(ctx) }
    }

    fn push_device(&self, ordinal: u32) -> Result<()> {
        let ctx = self.primary_context(ordinal)?;
        // SAFETY: as in `use_device`: retained until this driver is dropped.
        unsafe { result::device::ctx_push_current(ctx) }
    }

    fn pop_device(&self) -> Result<()> {
        result::device::ctx_pop_current()
    }

    fn mem_get_info(&self) -> Result<(u64, u64)> {
        let (free, total) = result::device::mem_get_info()?;
        Ok((free as u64, total as u64))
    }

    fn mem_pool_create(
        &self,
        ordinal: u32,
        sharing: PoolSharing,
        _: OwnerToken,
    ) -> Result<PoolHandle> {
        self.device(ordinal)?;
        let handle_types = match sharing {
            PoolSharing::None => sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            PoolSharing::PosixFd => POSIX_FD,
        };
        let pool = result::pool::create(device_location(ordinal), handle_types)?;
        Ok(pool_handle(pool))
    }

    unsafe fn mem_pool_destroy(&self, pool: PoolHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `pool` is a live pool of
        // this driver, destroyed once, and not used after.
        unsafe { result::pool::destroy(pool_raw(pool)) }
    }

    fn mem_pool_set_attribute(&self, pool: PoolHandle, attr: PoolAttribute) -> Result<()> {
        use sys::CUmemPool_attribute as A;
        // The threshold is a cuuint64_t, the reuse flags are ints (CUDA's documentation).
        let (which, wide, narrow, is_wide) = match attr {
            PoolAttribute::ReleaseThreshold(v) => {
                (A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, v, 0, true)
            }
            PoolAttribute::ReuseFollowEventDependencies(b) => (
                A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
                0,
                c_int::from(b),
                false,
            ),
            PoolAttribute::ReuseAllowOpportunistic(b) => (
                A::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
                0,
                c_int::from(b),
                false,
            ),
            PoolAttribute::ReuseAllowInternalDependencies(b) => (
                A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                0,
                c_int::from(b),
                false,
            ),
            // The high-water marks are cuuint64_t and take 0 only: the driver restarts them
            // from the current figure (what torch's resetPeakStats does to its own pool).
            PoolAttribute::ResetReservedHigh => (A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0, 0, true),
            PoolAttribute::ResetUsedHigh => (A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0, 0, true),
        };
        if is_wide {
            // SAFETY: `pool` is live (the handle contract, module docs); `which` is one of
            // the attributes above that take a cuuint64_t.
            unsafe { result::pool::set_attribute_u64(pool_raw(pool), which, wide) }
        } else {
            // SAFETY: `pool` is live (the handle contract, module docs); `which` is one of
            // the reuse flags above, which take an int.
            unsafe { result::pool::set_attribute_int(pool_raw(pool), which, narrow) }
        }
    }

    fn mem_pool_get_attribute(&self, pool: PoolHandle, counter: PoolCounter) -> Result<u64> {
        use sys::CUmemPool_attribute as A;
        let (which, is_wide) = match counter {
            PoolCounter::ReleaseThreshold => (A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, true),
            PoolCounter::ReservedCurrent => (A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, true),
            PoolCounter::ReservedHigh => (A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, true),
            PoolCounter::UsedCurrent => (A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, true),
            PoolCounter::UsedHigh => (A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, true),
            PoolCounter::ReuseFollowEventDependencies => {
                (A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, false)
            }
            PoolCounter::ReuseAllowOpportunistic => {
                (A::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, false)
            }
            PoolCounter::ReuseAllowInternalDependencies => {
                (A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, false)
            }
        };
        if is_wide {
            // SAFETY: `pool` is live (the handle contract, module docs); `which` is one of
            // the attributes above that write a cuuint64_t.
            unsafe { result::pool::get_attribute_u64(pool_raw(pool), which) }
        } else {
            // SAFETY: `pool` is live (the handle contract, module docs); `which` is one of
            // the reuse flags above, which write an int.
            let narrow = unsafe { result::pool::get_attribute_int(pool_raw(pool), which)? };
            Ok(u64::from(narrow != 0))
        }
    }

    fn mem_pool_trim_to(&self, pool: PoolHandle, keep_bytes: u64) -> Result<()> {
        let keep = size("cuMemPoolTrimTo", keep_bytes)?;
        // SAFETY: `pool` is live (the handle contract, module docs).
        unsafe { result::pool::trim_to(pool_raw(pool), keep) }
    }

    fn device_get_mem_pool(&self, ordinal: u32) -> Result<PoolHandle> {
        let dev = self.device(ordinal)?;
        Ok(pool_handle(result::pool::current(dev)?))
    }

    fn device_get_default_mem_pool(&self, ordinal: u32) -> Result<PoolHandle> {
        let dev = self.device(ordinal)?;
        Ok(pool_handle(result::pool::default(dev)?))
    }

    fn device_set_mem_pool(&self, ordinal: u32, pool: PoolHandle) -> Result<()> {
        let dev = self.device(ordinal)?;
        // SAFETY: `pool` is live (the handle contract, module docs); `dev` came from
        // cuDeviceGet.
        unsafe { result::pool::set_current(dev, pool_raw(pool)) }
    }

    fn mem_pool_export_fd(&self, pool: PoolHandle) -> Result<OwnedFd> {
        // SAFETY: `pool` is live (the handle contract, module docs).
        unsafe { result::pool::export_fd(pool_raw(pool)) }
    }

    fn mem_pool_import_fd(&self, fd: BorrowedFd<'_>) -> Result<PoolHandle> {
        Ok(pool_handle(result::pool::import_fd(fd)?))
    }

    fn mem_pool_set_access(&self, pool: PoolHandle, ordinal: u32, access: Access) -> Result<()> {
        let (location, flags) = (device_location(ordinal), access_flags(access));
        // SAFETY: `pool` is live (the handle contract, module docs).
        unsafe { result::pool::set_access(pool_raw(pool), location, flags) }
    }

    fn mem_pool_get_access(&self, pool: PoolHandle, ordinal: u32) -> Result<Access> {
        // SAFETY: `pool` is live (the handle contract, module docs).
        let flags = unsafe { result::pool::get_access(pool_raw(pool), device_location(ordinal))? };
        Ok(match flags {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ => Access::Read,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE => Access::ReadWrite,
            _ => Access::None,
        })
    }

    fn pointer_info(&self, ptr: DevicePtr) -> Result<PointerInfo> {
        let a = result::pointer::attributes(ptr.0)?;
        // Not a pointer of this process: the driver answers with zeros rather than an error.
        if a.size == 0 || a.base == 0 {
            return Err(DriverError::Call {
                call: "cuPointerGetAttributes",
                code: CuCode::INVALID_VALUE,
            });
        }
        let device_memory = a.memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
        Ok(PointerInfo {
            base: DevicePtr(a.base),
            size: a.size as u64,
            pool: (!a.pool.is_null()).then(|| pool_handle(a.pool)),
            buffer_id: (a.buffer_id != 0).then_some(a.buffer_id),
            device: u32::try_from(a.ordinal).ok().filter(|_| device_memory),
        })
    }

    fn pointer_get_device(&self, ptr: DevicePtr) -> Result<u32> {
        let invalid = || DriverError::Call {
            call: "cuPointerGetAttribute",
            code: CuCode::INVALID_VALUE,
        };
        if result::pointer::memory_type(ptr.0)? != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(invalid());
        }
        u32::try_from(result::pointer::device_ordinal(ptr.0)?).map_err(|_| invalid())
    }

    fn pointer_get_mempool(&self, ptr: DevicePtr) -> Result<PoolHandle> {
        Ok(pool_handle(result::pointer::mempool(ptr.0)?))
    }

    fn pointer_get_buffer_id(&self, ptr: DevicePtr) -> Result<u64> {
        result::pointer::buffer_id(ptr.0)
    }

    fn pointer_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64)> {
        let (base, len) = result::pointer::address_range(ptr.0)?;
        Ok((DevicePtr(base), len as u64))
    }

    fn mem_alloc(&self, bytes: u64) -> Result<DevicePtr> {
        let n = size("cuMemAlloc_v2", bytes)?;
        Ok(DevicePtr(result::memory::alloc(n)?))
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `ptr` is memory of
        // cuMemAlloc it owns, freed once and not used after.
        unsafe { result::memory::free(ptr.0) }
    }

    fn mem_alloc_async(&self, bytes: u64, stream: StreamHandle) -> Result<DevicePtr> {
        let n = size("cuMemAllocAsync", bytes)?;
        // SAFETY: `stream` is live (the handle contract, module docs).
        Ok(DevicePtr(unsafe {
            result::memory::alloc_async(n, stream_raw(stream))?
        }))
    }

    fn mem_alloc_from_pool_async(
        &self,
        bytes: u64,
        pool: PoolHandle,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        let n = size("cuMemAllocFromPoolAsync", bytes)?;
        // SAFETY: `pool` and `stream` are live (the handle contract, module docs).
        Ok(DevicePtr(unsafe {
            result::memory::alloc_from_pool_async(n, pool_raw(pool), stream_raw(stream))?
        }))
    }

    unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `ptr` is a live allocation
        // it owns, freed once and not used after; `stream` is live (the handle contract).
        unsafe { result::memory::free_async(ptr.0, stream_raw(stream)) }
    }

    fn mem_pool_export_pointer(&self, ptr: DevicePtr) -> Result<ExportBlob> {
        Ok(ExportBlob(result::pointer::export(ptr.0)?.reserved))
    }

    fn mem_pool_import_pointer(&self, pool: PoolHandle, data: &ExportBlob) -> Result<DevicePtr> {
        let share = sys::CUmemPoolPtrExportData { reserved: data.0 };
        // SAFETY: `pool` is live (the handle contract, module docs).
        Ok(DevicePtr(unsafe {
            result::pointer::import(pool_raw(pool), share)?
        }))
    }

    unsafe fn mem_pool_free_import(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `ptr` is a live import,
        // freed once and not used after; `stream` is live (the handle contract). Imports are
        // freed with cuMemFreeAsync like allocations.
        unsafe { result::memory::free_async(ptr.0, stream_raw(stream)) }
    }

    fn event_create(&self, interprocess: bool, _: OwnerToken) -> Result<EventHandle> {
        let mut flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        if interprocess {
            flags |= sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        }
        let ev = result::event::create(flags)?;
        Ok(EventHandle(ev.expose_provenance() as u64))
    }

    unsafe fn event_destroy(&self, event: EventHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `event` is a live event of
        // this driver, destroyed once, and not used after.
        unsafe { result::event::destroy(event_raw(event)) }
    }

    fn ipc_get_event_handle(&self, event: EventHandle) -> Result<EventBlob> {
        // SAFETY: `event` is live (the handle contract, module docs).
        let h = unsafe { result::event::ipc_get_handle(event_raw(event))? };
        Ok(EventBlob(h.reserved.map(|c| c as u8)))
    }

    fn ipc_open_event_handle(&self, handle: &EventBlob) -> Result<EventHandle> {
        let h = sys::CUipcEventHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let ev = result::event::ipc_open_handle(h)?;
        Ok(EventHandle(ev.expose_provenance() as u64))
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        // SAFETY: `event` and `stream` are live (the handle contract, module docs).
        unsafe { result::event::record(event_raw(event), stream_raw(stream)) }
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        // SAFETY: `event` is live (the handle contract, module docs).
        unsafe { result::event::query(event_raw(event)) }
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        // SAFETY: `event` is live (the handle contract, module docs).
        unsafe { result::event::synchronize(event_raw(event)) }
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        // SAFETY: `event` and `stream` are live (the handle contract, module docs).
        unsafe { result::stream::wait_event(stream_raw(stream), event_raw(event)) }
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        // SAFETY: `stream` is live (the handle contract, module docs).
        unsafe { result::stream::query(stream_raw(stream)) }
    }

    fn stream_create(&self, _: OwnerToken) -> Result<StreamHandle> {
        let s = result::stream::create(sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)?;
        Ok(StreamHandle(s.expose_provenance() as u64))
    }

    unsafe fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `stream` is a live stream
        // of this driver, destroyed once, and not used after.
        unsafe { result::stream::destroy(stream_raw(stream)) }
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: `stream` is live (the handle contract, module docs).
        unsafe { result::stream::synchronize(stream_raw(stream)) }
    }

    fn ctx_synchronize(&self) -> Result<()> {
        result::device::ctx_synchronize()
    }

    fn stream_check(&self, stream: StreamHandle) -> Result<()> {
        stream_check::check(stream)
    }

    fn memset_d8_async(
        &self,
        ptr: DevicePtr,
        value: u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let n = size("cuMemsetD8Async", bytes)?;
        // SAFETY: `stream` is live (the handle contract, module docs).
        unsafe { result::memory::memset_d8_async(ptr.0, value, n, stream_raw(stream)) }
    }

    fn memset_d32_async(
        &self,
        ptr: DevicePtr,
        value: u32,
        words: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let n = size("cuMemsetD32Async", words)?;
        // SAFETY: `stream` is live (the handle contract, module docs).
        unsafe { result::memory::memset_d32_async(ptr.0, value, n, stream_raw(stream)) }
    }

    fn launch_store_kernel(
        &self,
        address: DevicePtr,
        value: u32,
        stream: StreamHandle,
    ) -> Result<()> {
        let function = self.kernels.get(STORE_KERNEL_PTX, c"poolipc_store")?;
        let mut p = address.0;
        let mut v = value;
        let mut params = [(&raw mut p).cast::<c_void>(), (&raw mut v).cast::<c_void>()];
        // SAFETY: `function` is `poolipc_store(u64, u32)`, loaded in the context current on
        // this thread (the cache is keyed by context); `stream` is live (the handle contract);
        // `params` holds one pointer per parameter, each to a live local of the parameter's
        // type.
        unsafe { result::module::launch_one_thread(function, stream_raw(stream), &mut params)? };
        self.stream_synchronize(stream)
    }

    fn launch_hang_kernel(&self, stream: StreamHandle) -> Result<()> {
        let function = self.kernels.get(HANG_KERNEL_PTX, c"poolipc_hang")?;
        // SAFETY: `function` is `poolipc_hang()`, loaded in the context current on this
        // thread (the cache is keyed by context); `stream` is live (the handle contract); the
        // kernel takes no parameters, and none are passed.
        unsafe { result::module::launch_one_thread(function, stream_raw(stream), &mut []) }
    }

    fn memcpy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        result::memory::memcpy_dtoh(dst, src.0)
    }

    fn memcpy_htod(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        result::memory::memcpy_htod(dst.0, src)
    }

    fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let n = size("cuMemcpyDtoDAsync_v2", bytes)?;
        // SAFETY: `stream` is live (the handle contract, module docs).
        unsafe { result::memory::memcpy_dtod_async(dst.0, src.0, n, stream_raw(stream)) }
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let n = size("cuMemcpyDtoHAsync_v2", bytes)?;
        // SAFETY: the caller promises (the trait's `# Safety`) that `dst` stays valid for
        // `bytes` writes, untouched by anything else, until the stream passes; `stream` is
        // live (the handle contract).
        unsafe { result::memory::memcpy_dtoh_async(dst, src.0, n, stream_raw(stream)) }
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let n = size("cuMemcpyHtoDAsync_v2", bytes)?;
        // SAFETY: the caller promises (the trait's `# Safety`) that `src` stays valid for
        // `bytes` reads, unwritten, until the stream passes; `stream` is live (the handle
        // contract).
        unsafe { result::memory::memcpy_htod_async(dst.0, src, n, stream_raw(stream)) }
    }

    unsafe fn host_register(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `ptr..ptr+bytes` is mapped
        // until unregistered.
        unsafe { result::memory::host_register(ptr, bytes) }
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `ptr` was registered and
        // no copy uses it.
        unsafe { result::memory::host_unregister(ptr) }
    }

    fn vmm_granularity(&self, ordinal: u32, which: Granularity) -> Result<u64> {
        use sys::CUmemAllocationGranularity_flags as G;
        let option = match which {
            Granularity::Minimum => G::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            Granularity::Recommended => G::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        };
        let g = result::vmm::granularity(device_location(ordinal), POSIX_FD, option)?;
        Ok(g as u64)
    }

    fn vmm_create(&self, ordinal: u32, bytes: u64) -> Result<VmmHandle> {
        let n = size("cuMemCreate", bytes)?;
        Ok(VmmHandle(result::vmm::create(
            n,
            device_location(ordinal),
            POSIX_FD,
        )?))
    }

    fn vmm_create_unshared(&self, ordinal: u32, bytes: u64) -> Result<VmmHandle> {
        let n = size("cuMemCreate", bytes)?;
        let none = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        Ok(VmmHandle(result::vmm::create(
            n,
            device_location(ordinal),
            none,
        )?))
    }

    fn vmm_retain(&self, ptr: DevicePtr) -> Result<VmmHandle> {
        Ok(VmmHandle(result::vmm::retain(ptr.0)?))
    }

    fn vmm_exports_fd(&self, handle: VmmHandle) -> Result<bool> {
        // SAFETY: `handle` is live (the handle contract, module docs).
        let types = unsafe { result::vmm::requested_handle_types(handle.0)? };
        Ok(types.0 & POSIX_FD.0 == POSIX_FD.0)
    }

    fn vmm_export_fd(&self, handle: VmmHandle) -> Result<OwnedFd> {
        // SAFETY: `handle` is live (the handle contract, module docs).
        unsafe { result::vmm::export_fd(handle.0) }
    }

    fn vmm_import_fd(&self, fd: BorrowedFd<'_>) -> Result<VmmHandle> {
        Ok(VmmHandle(result::vmm::import_fd(fd)?))
    }

    fn vmm_reserve(&self, bytes: u64, alignment: u64) -> Result<DevicePtr> {
        let n = size("cuMemAddressReserve", bytes)?;
        let a = size("cuMemAddressReserve", alignment)?;
        Ok(DevicePtr(result::vmm::address_reserve(n, a)?))
    }

    fn vmm_map(&self, ptr: DevicePtr, bytes: u64, handle: VmmHandle) -> Result<()> {
        let n = size("cuMemMap", bytes)?;
        // SAFETY: `handle` is live (the handle contract, module docs).
        unsafe { result::vmm::map(ptr.0, n, handle.0) }
    }

    fn vmm_set_access(
        &self,
        ptr: DevicePtr,
        bytes: u64,
        ordinal: u32,
        access: Access,
    ) -> Result<()> {
        let n = size("cuMemSetAccess", bytes)?;
        result::vmm::set_access(ptr.0, n, device_location(ordinal), access_flags(access))
    }

    unsafe fn vmm_unmap(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        let n = size("cuMemUnmap", bytes)?;
        // SAFETY: the caller promises (the trait's `# Safety`) that the range is a mapping of
        // this driver, unmapped once and not used after.
        unsafe { result::vmm::unmap(ptr.0, n) }
    }

    unsafe fn vmm_address_free(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        let n = size("cuMemAddressFree", bytes)?;
        // SAFETY: the caller promises (the trait's `# Safety`) that the range is an unmapped
        // reservation of this driver, freed once and not used after.
        unsafe { result::vmm::address_free(ptr.0, n) }
    }

    unsafe fn vmm_release(&self, handle: VmmHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `handle` is a reference of
        // this driver, released once and not used after.
        unsafe { result::vmm::release(handle.0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_without_a_gpu_fails_cleanly() {
        // On a machine with a GPU this succeeds; without one it must be a typed error.
        match CudaDriver::new() {
            Ok(d) => assert_eq!(d.kind(), DriverKind::Cuda),
            Err(e) => assert!(
                matches!(
                    e,
                    DriverError::LibraryNotFound { .. }
                        | DriverError::NoDevice
                        | DriverError::Wsl2
                        | DriverError::DriverTooOld { .. }
                ),
                "unexpected error: {e}"
            ),
        }
    }
}
