//! The [`Driver`] trait on the simulation: each call is a function of the module for its kind
//! of resource (`device`, `pool`, `pointer`, `alloc`, `event`, `stream`, `copy`, `vmm`), as
//! `CudaDriver` calls its result layer.
//!
//! The simulation looks every handle and address up in its tables and answers an error for one
//! it does not know: its destroying calls are sound whatever they are given. They are `unsafe
//! fn`s because the trait's are, and go to the safe `_checked` methods, which the simulation's
//! own tests call directly.

mod alloc;
mod copy;
mod device;
mod event;
mod pointer;
mod pool;
mod stream;
mod vmm;

use std::os::fd::{BorrowedFd, OwnedFd};

use crate::api::Driver;
use crate::error::Result;
use crate::sim::SimDriver;
use crate::types::OwnerToken;
use crate::types::{
    Access, DeviceInfo, DevicePtr, DriverKind, EventBlob, EventHandle, ExportBlob, Granularity,
    PoolAttribute, PoolCounter, PoolHandle, PoolSharing, StreamHandle, VmmHandle,
};

impl SimDriver {
    /// An event of the simulation's own (the lend marker), kept for the process's life.
    pub(super) fn own_event(&self) -> Result<EventHandle> {
        event::create(self, false)
    }
}

impl Driver for SimDriver {
    fn kind(&self) -> DriverKind {
        DriverKind::Sim
    }

    fn sim_checker(&self) -> Option<crate::violation::Checker> {
        Some(self.checker())
    }

    fn label_stream(&self, stream: StreamHandle, label: &str) {
        if let Err(e) = SimDriver::label_stream(self, stream, label) {
            tracing::debug!(error = %e, label, "sim: stream not labelled");
        }
    }

    fn sim_lend(
        &self,
        job: u64,
        ptr: DevicePtr,
        len: u64,
        stream: StreamHandle,
        read_only: bool,
        label: &str,
    ) {
        if let Err(e) = SimDriver::lend(self, job, ptr, len, stream, read_only, label) {
            tracing::debug!(error = %e, label, "sim: memory not lent");
        }
    }

    fn sim_returned(&self, job: u64, stream: StreamHandle) {
        if let Err(e) = SimDriver::returned(self, job, stream) {
            tracing::debug!(error = %e, "sim: lent memory not returned");
        }
    }

    fn label_memory(&self, ptr: DevicePtr, label: &str) {
        SimDriver::label_memory(self, ptr, label);
    }

    fn driver_version(&self) -> Result<i32> {
        Ok(13000)
    }

    fn device_count(&self) -> Result<u32> {
        Ok(u32::try_from(self.visible.len()).unwrap_or(u32::MAX))
    }

    fn device_info(&self, ordinal: u32) -> Result<DeviceInfo> {
        device::info(self, ordinal)
    }

    fn device_can_access_peer(&self, ordinal: u32, peer: u32) -> Result<bool> {
        device::can_access_peer(self, ordinal, peer)
    }

    fn use_device(&self, ordinal: u32) -> Result<()> {
        device::use_device(self, ordinal)
    }

    /// The simulation has one current device per process, not a stack per thread: a push is
    /// `use_device`, a pop leaves it.
    fn push_device(&self, ordinal: u32) -> Result<()> {
        device::use_device(self, ordinal)
    }

    fn pop_device(&self) -> Result<()> {
        Ok(())
    }

    fn mem_get_info(&self) -> Result<(u64, u64)> {
        device::mem_get_info(self)
    }

    fn mem_pool_create(
        &self,
        ordinal: u32,
        sharing: PoolSharing,
        _: OwnerToken,
    ) -> Result<PoolHandle> {
        pool::create(self, ordinal, sharing)
    }

    unsafe fn mem_pool_destroy(&self, pool: PoolHandle) -> Result<()> {
        self.mem_pool_destroy_checked(pool)
    }

    fn mem_pool_set_attribute(&self, pool: PoolHandle, attr: PoolAttribute) -> Result<()> {
        pool::set_attribute(self, pool, attr)
    }

    fn mem_pool_get_attribute(&self, pool: PoolHandle, counter: PoolCounter) -> Result<u64> {
        pool::get_attribute(self, pool, counter)
    }

    fn mem_pool_trim_to(&self, pool: PoolHandle, keep_bytes: u64) -> Result<()> {
        pool::trim_to(self, pool, keep_bytes)
    }

    fn device_get_mem_pool(&self, ordinal: u32) -> Result<PoolHandle> {
        pool::current(self, ordinal)
    }

    fn device_get_default_mem_pool(&self, ordinal: u32) -> Result<PoolHandle> {
        pool::default(self, ordinal)
    }

    fn device_set_mem_pool(&self, ordinal: u32, pool: PoolHandle) -> Result<()> {
        pool::set_current(self, ordinal, pool)
    }

    fn mem_pool_export_fd(&self, pool: PoolHandle) -> Result<OwnedFd> {
        pool::export_fd(self, pool)
    }

    fn mem_pool_import_fd(&self, fd: BorrowedFd<'_>) -> Result<PoolHandle> {
        pool::import_fd(self, fd)
    }

    fn mem_pool_set_access(&self, pool: PoolHandle, ordinal: u32, access: Access) -> Result<()> {
        pool::set_access(self, pool, ordinal, access)
    }

    fn mem_pool_get_access(&self, pool: PoolHandle, ordinal: u32) -> Result<Access> {
        pool::get_access(self, pool, ordinal)
    }

    fn pointer_get_mempool(&self, ptr: DevicePtr) -> Result<PoolHandle> {
        pointer::mempool(self, ptr)
    }

    fn pointer_get_buffer_id(&self, ptr: DevicePtr) -> Result<u64> {
        pointer::buffer_id(self, ptr)
    }

    fn pointer_get_device(&self, ptr: DevicePtr) -> Result<u32> {
        pointer::device(self, ptr)
    }

    fn pointer_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64)> {
        pointer::range(self, ptr)
    }

    fn mem_alloc(&self, bytes: u64) -> Result<DevicePtr> {
        alloc::plain(self, bytes)
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        self.mem_free_checked(ptr)
    }

    fn mem_alloc_async(&self, bytes: u64, stream: StreamHandle) -> Result<DevicePtr> {
        alloc::from_current_pool(self, bytes, stream)
    }

    fn mem_alloc_from_pool_async(
        &self,
        bytes: u64,
        pool: PoolHandle,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        alloc::from_pool(self, bytes, pool, stream)
    }

    unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        self.mem_free_async_checked(ptr, stream)
    }

    fn mem_pool_export_pointer(&self, ptr: DevicePtr) -> Result<ExportBlob> {
        pointer::export(self, ptr)
    }

    fn mem_pool_import_pointer(&self, pool: PoolHandle, data: &ExportBlob) -> Result<DevicePtr> {
        pointer::import(self, pool, data)
    }

    unsafe fn mem_pool_free_import(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        self.mem_pool_free_import_checked(ptr, stream)
    }

    fn event_create(&self, interprocess: bool, _: OwnerToken) -> Result<EventHandle> {
        event::create(self, interprocess)
    }

    unsafe fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.event_destroy_checked(event)
    }

    fn ipc_get_event_handle(&self, event: EventHandle) -> Result<EventBlob> {
        event::ipc_get_handle(self, event)
    }

    fn ipc_open_event_handle(&self, handle: &EventBlob) -> Result<EventHandle> {
        event::ipc_open_handle(self, handle)
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        event::record(self, event, stream)
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        event::query(self, event)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        event::synchronize(self, event)
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        stream::wait_event(self, stream, event)
    }

    fn stream_create(&self, _: OwnerToken) -> Result<StreamHandle> {
        stream::create(self)
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        stream::query(self, stream)
    }

    unsafe fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.stream_destroy_checked(stream)
    }

    fn ctx_synchronize(&self) -> Result<()> {
        stream::ctx_synchronize(self)
    }

    fn stream_check(&self, stream: StreamHandle) -> Result<()> {
        stream::check(self, stream)
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        stream::synchronize(self, stream)
    }

    fn memset_d8_async(
        &self,
        ptr: DevicePtr,
        value: u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        copy::memset_d8(self, ptr, value, bytes, stream)
    }

    fn memset_d32_async(
        &self,
        ptr: DevicePtr,
        value: u32,
        words: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        copy::memset_d32(self, ptr, value, words, stream)
    }

    fn launch_hang_kernel(&self, stream: StreamHandle) -> Result<()> {
        copy::launch_hang_kernel(self, stream)
    }

    fn launch_store_kernel(
        &self,
        address: DevicePtr,
        value: u32,
        stream: StreamHandle,
    ) -> Result<()> {
        copy::launch_store_kernel(self, address, value, stream)
    }

    fn memcpy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        copy::dtoh(self, dst, src)
    }

    fn memcpy_htod(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        copy::htod(self, dst, src)
    }

    fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        copy::dtod_async(self, dst, src, bytes, stream)
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `dst` stays valid for
        // `bytes` writes, untouched by anything else, until the copy completed.
        unsafe { copy::dtoh_async(self, dst, src, bytes, stream) }
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `src` stays valid for
        // `bytes` reads, unwritten, until the copy completed.
        unsafe { copy::htod_async(self, dst, src, bytes, stream) }
    }

    unsafe fn host_register(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        copy::host_register(self, ptr, bytes)
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        copy::host_unregister(self, ptr)
    }

    fn vmm_granularity(&self, ordinal: u32, _which: Granularity) -> Result<u64> {
        // Every granularity is the simulated pool's: 2 MiB.
        vmm::granularity(self, ordinal)
    }

    fn vmm_create(&self, ordinal: u32, bytes: u64) -> Result<VmmHandle> {
        vmm::create(self, ordinal, bytes)
    }

    fn vmm_create_unshared(&self, ordinal: u32, bytes: u64) -> Result<VmmHandle> {
        vmm::create_unshared(self, ordinal, bytes)
    }

    fn vmm_retain(&self, ptr: DevicePtr) -> Result<VmmHandle> {
        vmm::retain(self, ptr)
    }

    fn vmm_exports_fd(&self, handle: VmmHandle) -> Result<bool> {
        vmm::exports_fd(self, handle)
    }

    fn vmm_export_fd(&self, handle: VmmHandle) -> Result<OwnedFd> {
        vmm::export_fd(self, handle)
    }

    fn vmm_import_fd(&self, fd: BorrowedFd<'_>) -> Result<VmmHandle> {
        vmm::import_fd(self, fd)
    }

    fn vmm_reserve(&self, bytes: u64, alignment: u64) -> Result<DevicePtr> {
        vmm::reserve(self, bytes, alignment)
    }

    fn vmm_map(&self, ptr: DevicePtr, bytes: u64, handle: VmmHandle) -> Result<()> {
        vmm::map(self, ptr, bytes, handle)
    }

    fn vmm_set_access(
        &self,
        ptr: DevicePtr,
        bytes: u64,
        ordinal: u32,
        access: Access,
    ) -> Result<()> {
        vmm::set_access(self, ptr, bytes, ordinal, access)
    }

    unsafe fn vmm_unmap(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        self.vmm_unmap_checked(ptr, bytes)
    }

    unsafe fn vmm_address_free(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        self.vmm_address_free_checked(ptr, bytes)
    }

    unsafe fn vmm_release(&self, handle: VmmHandle) -> Result<()> {
        self.vmm_release_checked(handle)
    }
}
