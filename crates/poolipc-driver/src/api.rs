//! The `Driver` trait: the slice of the CUDA driver API poolipc uses, nothing more.

use std::os::fd::{BorrowedFd, OwnedFd};

use crate::error::Result;
use crate::types::OwnerToken;
use crate::types::{
    Access, DeviceInfo, DevicePtr, DriverKind, EventBlob, EventHandle, ExportBlob, Granularity,
    PointerInfo, PoolAttribute, PoolCounter, PoolHandle, PoolSharing, StreamHandle, VmmHandle,
};

/// The CUDA driver calls poolipc makes, one method per call (or per tight group of calls).
///
/// Two implementations: [`CudaDriver`](crate::CudaDriver) on libcuda and
/// [`SimDriver`](crate::sim::SimDriver), a simulation that runs across real processes on
/// machines without a GPU. With the `mock` feature, `MockDriver` serves unit tests that need
/// exact call expectations.
///
/// Every method names the driver call it makes in its docs; errors name it too. Methods that
/// need a CUDA context use the one [`use_device`](Driver::use_device) made current on the
/// calling thread.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait Driver: Send + Sync {
    /// Which implementation this is.
    fn kind(&self) -> DriverKind;

    /// The race checker of the simulated driver behind this one (its violation log,
    /// machine-wide); `None` on every other driver, which checks nothing.
    fn sim_checker(&self) -> Option<crate::violation::Checker> {
        None
    }

    /// Names `stream` in the simulated driver's violation reports (`the worker's job
    /// stream`); does nothing on any other driver.
    fn label_stream(&self, stream: StreamHandle, label: &str) {
        let _ = (stream, label);
    }

    /// Tells the simulated driver's checker that `[ptr, ptr + len)` is lent to a job whose
    /// stream `stream` just waited for READY, job `job` of this process's (see `SimDriver::lend`); does nothing on any
    /// other driver.
    fn sim_lend(
        &self,
        job: u64,
        ptr: DevicePtr,
        len: u64,
        stream: StreamHandle,
        read_only: bool,
        label: &str,
    ) {
        let _ = (job, ptr, len, stream, read_only, label);
    }

    /// Tells the simulated driver's checker that job `job` records DONE on `stream` there now
    /// (see `SimDriver::returned`); does nothing on any other driver.
    fn sim_returned(&self, job: u64, stream: StreamHandle) {
        let _ = (job, stream);
    }

    /// Names the pool allocation or import holding `ptr` in the simulated driver's violation
    /// reports (`input 0 of job 3`), until it is freed; does nothing on any other driver.
    fn label_memory(&self, ptr: DevicePtr, label: &str) {
        let _ = (ptr, label);
    }

    // --- identity ----------------------------------------------------------------------

    /// `cuDriverGetVersion`: e.g. 13000 for a CUDA 13.0 driver.
    fn driver_version(&self) -> Result<i32>;
    /// `cuDeviceGetCount`.
    fn device_count(&self) -> Result<u32>;
    /// `cuDeviceGet`, `cuDeviceGetUuid`, `cuDeviceGetName`, `cuDeviceTotalMem`,
    /// `cuDeviceGetAttribute`.
    fn device_info(&self, ordinal: u32) -> Result<DeviceInfo>;
    /// `cuDeviceCanAccessPeer`.
    fn device_can_access_peer(&self, ordinal: u32, peer: u32) -> Result<bool>;
    /// `cuDevicePrimaryCtxRetain` (once per device) and `cuCtxSetCurrent` on this thread.
    fn use_device(&self, ordinal: u32) -> Result<()>;
    /// `cuDevicePrimaryCtxRetain` (once per device) and `cuCtxPushCurrent`: `ordinal`'s
    /// device is current on this thread until [`pop_device`](Driver::pop_device) makes the
    /// context current before it current again. For a call made on a thread that is not
    /// poolipc's (a Python caller's, whose torch may be on another device).
    fn push_device(&self, ordinal: u32) -> Result<()>;
    /// `cuCtxPopCurrent`: undoes this thread's last [`push_device`](Driver::push_device).
    fn pop_device(&self) -> Result<()>;
    /// `cuMemGetInfo` for the current device: (free, total) bytes.
    fn mem_get_info(&self) -> Result<(u64, u64)>;

    // --- pools -------------------------------------------------------------------------

    /// `cuMemPoolCreate` of a pinned device pool. Needs no current context. Callers create a
    /// pool with [`OwnedPool::create`](crate::OwnedPool::create), which destroys it on drop:
    /// only the owning types can make the [`OwnerToken`].
    fn mem_pool_create(
        &self,
        ordinal: u32,
        sharing: PoolSharing,
        token: OwnerToken,
    ) -> Result<PoolHandle>;
    /// `cuMemPoolDestroy`. Safe code destroys a pool by dropping its
    /// [`OwnedPool`](crate::OwnedPool).
    ///
    /// # Safety
    /// 1. `pool` was made by [`mem_pool_create`](Driver::mem_pool_create) or
    ///    [`mem_pool_import_fd`](Driver::mem_pool_import_fd) of this driver and is not
    ///    destroyed yet (the handle is the address of libcuda's object: a second destroy is a
    ///    use after free inside libcuda).
    /// 2. Nothing uses `pool` after this call (it is not the device's current pool either).
    unsafe fn mem_pool_destroy(&self, pool: PoolHandle) -> Result<()>;
    /// `cuMemPoolSetAttribute`.
    fn mem_pool_set_attribute(&self, pool: PoolHandle, attr: PoolAttribute) -> Result<()>;
    /// `cuMemPoolGetAttribute`.
    fn mem_pool_get_attribute(&self, pool: PoolHandle, counter: PoolCounter) -> Result<u64>;
    /// `cuMemPoolTrimTo`.
    fn mem_pool_trim_to(&self, pool: PoolHandle, keep_bytes: u64) -> Result<()>;
    /// `cuDeviceGetMemPool`: the pool stream-ordered allocations on that device come from.
    fn device_get_mem_pool(&self, ordinal: u32) -> Result<PoolHandle>;
    /// `cuDeviceGetDefaultMemPool`.
    fn device_get_default_mem_pool(&self, ordinal: u32) -> Result<PoolHandle>;
    /// `cuDeviceSetMemPool`.
    fn device_set_mem_pool(&self, ordinal: u32, pool: PoolHandle) -> Result<()>;
    /// `cuMemPoolExportToShareableHandle` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
    fn mem_pool_export_fd(&self, pool: PoolHandle) -> Result<OwnedFd>;
    /// `cuMemPoolImportFromShareableHandle` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
    /// The driver duplicates what it needs; the caller keeps `fd`.
    fn mem_pool_import_fd<'a>(&self, fd: BorrowedFd<'a>) -> Result<PoolHandle>;
    /// `cuMemPoolSetAccess` for one device.
    fn mem_pool_set_access(&self, pool: PoolHandle, ordinal: u32, access: Access) -> Result<()>;
    /// `cuMemPoolGetAccess` for one device.
    fn mem_pool_get_access(&self, pool: PoolHandle, ordinal: u32) -> Result<Access>;

    // --- pointers ----------------------------------------------------------------------

    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)`.
    fn pointer_get_mempool(&self, ptr: DevicePtr) -> Result<PoolHandle>;
    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_BUFFER_ID)`: the id of the allocation `ptr`
    /// lies in (an interior pointer gives its allocation's). Unique within this process: an
    /// address the pool hands out again has a new id (measured on the H200: 917, then 918 at
    /// the same address), so an unchanged id means the same live allocation. A freed or unknown
    /// pointer fails (`INVALID_VALUE`).
    fn pointer_get_buffer_id(&self, ptr: DevicePtr) -> Result<u64>;
    /// What a handoff needs to know of `ptr`, in one driver call where the driver allows
    /// (`cuPointerGetAttributes`: range start and size, memory pool, buffer id): under MPS a
    /// pointer query costs microseconds, and a lend asked three. `ptr` not device memory of
    /// this process: an error, as [`pointer_get_range`](Driver::pointer_get_range) gives.
    /// By default composed of the single queries.
    fn pointer_info(&self, ptr: DevicePtr) -> Result<PointerInfo> {
        let (base, size) = self.pointer_get_range(ptr)?;
        Ok(PointerInfo {
            base,
            size,
            pool: self.pointer_get_mempool(ptr).ok(),
            buffer_id: self.pointer_get_buffer_id(ptr).ok(),
            device: self.pointer_get_device(ptr).ok(),
        })
    }
    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)`, then
    /// `(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)`: the ordinal of the device whose memory `ptr`
    /// points into. Host memory (registered or not) fails with `INVALID_VALUE`, as does a
    /// pointer the driver does not know.
    fn pointer_get_device(&self, ptr: DevicePtr) -> Result<u32>;
    /// `cuMemGetAddressRange`: the allocation `ptr` lies in, as (base, size).
    fn pointer_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64)>;
    /// `cuMemAllocAsync`: from the device's current pool.
    fn mem_alloc_async(&self, bytes: u64, stream: StreamHandle) -> Result<DevicePtr>;
    /// `cuMemAllocFromPoolAsync`.
    fn mem_alloc_from_pool_async(
        &self,
        bytes: u64,
        pool: PoolHandle,
        stream: StreamHandle,
    ) -> Result<DevicePtr>;
    /// `cuMemAlloc_v2`: plain device memory on the current device, outside every pool (what
    /// torch's native allocator and many libraries use). Not exportable by pool pointer.
    fn mem_alloc(&self, bytes: u64) -> Result<DevicePtr>;
    /// `cuMemFree_v2` of memory from [`mem_alloc`](Driver::mem_alloc). Safe code frees it by
    /// dropping its [`DeviceAllocation`](crate::DeviceAllocation).
    ///
    /// # Safety
    /// 1. `ptr` is the start of memory [`mem_alloc`](Driver::mem_alloc) of this driver gave
    ///    out, not freed yet.
    /// 2. Nothing (no queued work either) uses the memory after this call.
    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()>;
    /// `cuMemFreeAsync` of an allocation this process made. Safe code frees one through its
    /// [`PoolAllocation`](crate::PoolAllocation).
    ///
    /// # Safety
    /// 1. `ptr` is the start of a live stream-ordered allocation of this process (from
    ///    [`mem_alloc_async`](Driver::mem_alloc_async),
    ///    [`mem_alloc_from_pool_async`](Driver::mem_alloc_from_pool_async), or torch's
    ///    allocator), not freed yet, and the caller owns it: no one else frees it.
    /// 2. The caller does not use `ptr` after this call. (Work that uses the memory must be
    ///    ordered before the free on `stream`, or it races the next owner on the device.)
    unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()>;
    /// `cuMemPoolExportPointer`.
    fn mem_pool_export_pointer(&self, ptr: DevicePtr) -> Result<ExportBlob>;
    /// `cuMemPoolImportPointer`. On real hardware an allocation spanning more than 128
    /// 32 MiB chunks kills the calling process; see `ImportLimit` in `poolipc-types`.
    fn mem_pool_import_pointer(&self, pool: PoolHandle, data: &ExportBlob) -> Result<DevicePtr>;
    /// `cuMemFreeAsync` of an imported pointer (the import, not the allocation). Safe code
    /// frees an import through its [`ImportedPointer`](crate::ImportedPointer).
    ///
    /// # Safety
    /// 1. `ptr` is a live import [`mem_pool_import_pointer`](Driver::mem_pool_import_pointer)
    ///    of this driver gave out, not freed yet (the first free of an alias unmaps both:
    ///    NVIDIA bug 5570902).
    /// 2. The caller does not use `ptr` after this call. (Work that uses the import must be
    ///    ordered before the free on `stream`.)
    unsafe fn mem_pool_free_import(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()>;

    // --- events and streams ------------------------------------------------------------

    /// `cuEventCreate`; `interprocess` adds `CU_EVENT_INTERPROCESS` (timing is always off).
    /// Callers create an event with [`OwnedEvent::new`](crate::OwnedEvent::new), which destroys
    /// it on drop: only the owning types can make the [`OwnerToken`].
    fn event_create(&self, interprocess: bool, token: OwnerToken) -> Result<EventHandle>;
    /// `cuEventDestroy`. Safe code destroys an event by dropping its
    /// [`OwnedEvent`](crate::OwnedEvent).
    ///
    /// # Safety
    /// 1. `event` was made by [`event_create`](Driver::event_create) or
    ///    [`ipc_open_event_handle`](Driver::ipc_open_event_handle) of this driver and is not
    ///    destroyed yet (the handle is the address of libcuda's object).
    /// 2. Nothing uses `event` after this call.
    unsafe fn event_destroy(&self, event: EventHandle) -> Result<()>;
    /// `cuIpcGetEventHandle`.
    fn ipc_get_event_handle(&self, event: EventHandle) -> Result<EventBlob>;
    /// `cuIpcOpenEventHandle`.
    fn ipc_open_event_handle(&self, handle: &EventBlob) -> Result<EventHandle>;
    /// `cuEventRecord`.
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()>;
    /// `cuEventQuery`: `true` when complete, `false` on `CUDA_ERROR_NOT_READY`.
    fn event_query(&self, event: EventHandle) -> Result<bool>;
    /// `cuEventSynchronize`.
    fn event_synchronize(&self, event: EventHandle) -> Result<()>;
    /// `cuStreamWaitEvent`.
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()>;
    /// `cuStreamQuery`: `true` when everything queued on `stream` completed (the host is
    /// then ordered after it, as after a synchronize), `false` on `CUDA_ERROR_NOT_READY`.
    fn stream_query(&self, stream: StreamHandle) -> Result<bool>;
    /// `cuStreamCreate` with `CU_STREAM_NON_BLOCKING`. Callers create a stream with
    /// [`OwnedStream::new`](crate::OwnedStream::new), which destroys it on drop: only the owning
    /// types can make the [`OwnerToken`].
    fn stream_create(&self, token: OwnerToken) -> Result<StreamHandle>;
    /// `cuStreamDestroy`. Safe code destroys a stream by dropping its
    /// [`OwnedStream`](crate::OwnedStream).
    ///
    /// # Safety
    /// 1. `stream` was made by [`stream_create`](Driver::stream_create) of this driver and is
    ///    not destroyed yet (the handle is the address of libcuda's object).
    /// 2. Nothing uses `stream` after this call (work already queued on it still runs).
    unsafe fn stream_destroy(&self, stream: StreamHandle) -> Result<()>;
    /// `cuStreamSynchronize`.
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()>;
    /// Whether `stream`, a handle from outside (a Python int, torch's `cuda_stream`), names a
    /// stream of this process: the legacy (0, 1) and per-thread (2) default streams do; any
    /// other handle must point at readable memory of this process and be a stream the driver
    /// answers for (`cuStreamQuery`). An error names what is wrong, before the handle reaches
    /// any other call.
    fn stream_check(&self, stream: StreamHandle) -> Result<()>;
    /// `cuCtxSynchronize`: waits for all work of this process's context, on every stream.
    fn ctx_synchronize(&self) -> Result<()>;

    // --- memset and copies -------------------------------------------------------------

    /// `cuMemsetD8Async`.
    fn memset_d8_async(
        &self,
        ptr: DevicePtr,
        value: u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()>;
    /// `cuMemsetD32Async`: `words` 32-bit words.
    fn memset_d32_async(
        &self,
        ptr: DevicePtr,
        value: u32,
        words: u64,
        stream: StreamHandle,
    ) -> Result<()>;
    /// A kernel of one thread that stores the 32-bit `value` at `address` (`st.global.u32`),
    /// launched on `stream`, then `cuStreamSynchronize(stream)`. Through an address the
    /// process cannot reach, that is a GPU fault: the synchronize fails with
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` and the process's context is lost (under MPS, every
    /// client's). For fault tests and checks; no handoff calls it.
    fn launch_store_kernel(
        &self,
        address: DevicePtr,
        value: u32,
        stream: StreamHandle,
    ) -> Result<()>;
    /// A kernel of one thread that does not end for 120 s (it spins reading the GPU's
    /// clock; SimDriver's never ends), launched on `stream` without waiting: everything
    /// queued on `stream` after it, an event recorded behind it included, waits for it, and
    /// the event never completes if the process is killed meanwhile (docs/facts.md). Bounded
    /// so that a process left behind does not spin on the GPU for ever; a process that exits
    /// normally waits for it at exit, a killed one's kernel goes at once. For tests of a
    /// worker that hangs on the GPU; no handoff calls it.
    fn launch_hang_kernel(&self, stream: StreamHandle) -> Result<()>;
    /// `cuMemcpyDtoH` (synchronous).
    fn memcpy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> Result<()>;
    /// `cuMemcpyHtoD` (synchronous).
    fn memcpy_htod(&self, dst: DevicePtr, src: &[u8]) -> Result<()>;
    /// Device to host **on `stream`**, then waits for the stream: the copy is ordered after
    /// everything queued on `stream` before it (a READY wait, the kernel that produced the
    /// bytes), which [`memcpy_dtoh`](Driver::memcpy_dtoh) on the legacy stream is not when
    /// `stream` is non-blocking. Use it wherever the bytes come from stream-ordered work.
    fn memcpy_dtoh_on(&self, dst: &mut [u8], src: DevicePtr, stream: StreamHandle) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is borrowed mutably for this whole call, and the call returns only
        // after the stream (so the copy) completed or failed: nothing else reads or writes it
        // meanwhile, and it stays valid until the copy is over.
        unsafe { self.memcpy_dtoh_async(dst.as_mut_ptr(), src, dst.len() as u64, stream)? };
        self.stream_synchronize(stream)
    }
    /// Host to device **on `stream`**, then waits for the stream: ordered after what was
    /// queued on `stream` before it, and complete (so `src` may be reused) when it returns.
    /// The write is on `stream`: work on other streams sees it once ordered after `stream`.
    fn memcpy_htod_on(&self, dst: DevicePtr, src: &[u8], stream: StreamHandle) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` is borrowed for this whole call, which returns only after the stream
        // (so the copy) completed or failed: it stays valid and unwritten until the copy is
        // over.
        unsafe { self.memcpy_htod_async(dst, src.as_ptr(), src.len() as u64, stream)? };
        self.stream_synchronize(stream)
    }
    /// `cuMemcpyDtoDAsync`.
    fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()>;
    /// `cuMemcpyDtoHAsync` into host memory the caller keeps alive until the stream passes.
    ///
    /// # Safety
    /// `dst` must be valid for `bytes` writes until the copy completed on `stream`, and
    /// nothing else may access it meanwhile.
    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()>;
    /// `cuMemcpyHtoDAsync` from host memory the caller keeps alive until the stream passes.
    ///
    /// # Safety
    /// `src` must be valid for `bytes` reads until the copy completed on `stream`, and
    /// nothing may write it meanwhile.
    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()>;

    // --- pinned host memory ------------------------------------------------------------

    /// `cuMemHostRegister` (portable, device-mapped).
    ///
    /// # Safety
    /// `ptr` must point to `bytes` of mapped host memory that stays mapped until
    /// [`host_unregister`](Driver::host_unregister).
    unsafe fn host_register(&self, ptr: *mut u8, bytes: usize) -> Result<()>;
    /// `cuMemHostUnregister`.
    ///
    /// # Safety
    /// `ptr` must have been registered with [`host_register`](Driver::host_register) and no
    /// copy may still be using it.
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()>;

    // --- virtual memory management (the arena) -----------------------------------------

    /// `cuMemGetAllocationGranularity` for pinned device memory shareable by POSIX FD.
    fn vmm_granularity(&self, ordinal: u32, which: Granularity) -> Result<u64>;
    /// `cuMemCreate` of pinned device memory shareable by POSIX FD.
    fn vmm_create(&self, ordinal: u32, bytes: u64) -> Result<VmmHandle>;
    /// `cuMemCreate` of pinned device memory with no shareable handle type
    /// (`requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE`): VMM memory that cannot be exported,
    /// as many libraries make it.
    fn vmm_create_unshared(&self, ordinal: u32, bytes: u64) -> Result<VmmHandle>;
    /// `cuMemRetainAllocationHandle`: a new reference to the VMM allocation mapped at `ptr`
    /// (any address inside the mapping), to be given back with
    /// [`vmm_release`](Driver::vmm_release). Memory that is not a VMM mapping (pool memory,
    /// `cuMemAlloc` memory) fails with `INVALID_VALUE` (measured on the H200 for pool memory).
    fn vmm_retain(&self, ptr: DevicePtr) -> Result<VmmHandle>;
    /// `cuMemGetAllocationPropertiesFromHandle`: whether the allocation was created with
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` among its `requestedHandleTypes`, so that
    /// [`vmm_export_fd`](Driver::vmm_export_fd) can share it.
    fn vmm_exports_fd(&self, handle: VmmHandle) -> Result<bool>;
    /// `cuMemExportToShareableHandle` (POSIX FD).
    fn vmm_export_fd(&self, handle: VmmHandle) -> Result<OwnedFd>;
    /// `cuMemImportFromShareableHandle` (POSIX FD). The caller keeps `fd`.
    fn vmm_import_fd<'a>(&self, fd: BorrowedFd<'a>) -> Result<VmmHandle>;
    /// `cuMemAddressReserve`.
    fn vmm_reserve(&self, bytes: u64, alignment: u64) -> Result<DevicePtr>;
    /// `cuMemMap` of a whole handle at `ptr`.
    fn vmm_map(&self, ptr: DevicePtr, bytes: u64, handle: VmmHandle) -> Result<()>;
    /// `cuMemSetAccess` for one device.
    fn vmm_set_access(
        &self,
        ptr: DevicePtr,
        bytes: u64,
        ordinal: u32,
        access: Access,
    ) -> Result<()>;
    /// `cuMemUnmap`. Safe code unmaps through a [`VmmMapping`](crate::VmmMapping).
    ///
    /// # Safety
    /// 1. `ptr..ptr + bytes` is a mapping [`vmm_map`](Driver::vmm_map) of this driver made,
    ///    not unmapped yet.
    /// 2. Nothing (no queued work either) uses the range after this call.
    unsafe fn vmm_unmap(&self, ptr: DevicePtr, bytes: u64) -> Result<()>;
    /// `cuMemAddressFree`. Safe code frees a range by dropping its
    /// [`VmmReservation`](crate::VmmReservation).
    ///
    /// # Safety
    /// 1. `ptr..ptr + bytes` is a range [`vmm_reserve`](Driver::vmm_reserve) of this driver
    ///    gave out, not freed yet, and nothing is mapped in it any more.
    /// 2. Nothing uses the range after this call.
    unsafe fn vmm_address_free(&self, ptr: DevicePtr, bytes: u64) -> Result<()>;
    /// `cuMemRelease`. Safe code releases a handle by dropping its
    /// [`VmmAllocation`](crate::VmmAllocation).
    ///
    /// # Safety
    /// 1. `handle` came from [`vmm_create`](Driver::vmm_create),
    ///    [`vmm_create_unshared`](Driver::vmm_create_unshared),
    ///    [`vmm_retain`](Driver::vmm_retain) or [`vmm_import_fd`](Driver::vmm_import_fd) of
    ///    this driver, and this reference is not released yet (each of those calls makes one
    ///    reference; the memory lives on while it is mapped).
    /// 2. Nothing uses `handle` after this call.
    unsafe fn vmm_release(&self, handle: VmmHandle) -> Result<()>;
}
