//! An allocation above the pool-pointer import limit crosses as a copy: the sender copies the
//! shared range on the sharing stream into a VMM allocation of its own (`cuMemCreate` with a
//! POSIX FD: no import limit), keeps it while the share lives, and serves its FD to
//! receivers; a receiver maps it whole. Writes after the share are not seen across (the
//! two sides hold different memory), which the docs say; one copy is made per share.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};

use poolipc::advanced::driver::Driver;
use poolipc::advanced::driver::{
    Access, Granularity, OwnedEvent, VmmAllocation, VmmMapping, VmmReservation,
};
use poolipc::{DevicePtr, StreamHandle};

use crate::state::OnDevice;

/// The sender's copy: the VMM allocation, its mapping here, and the event recorded after
/// the copy (waited for before the mapping goes, so that no copy runs into unmapped memory).
pub(super) struct VmmCopy {
    pub(super) bytes: u64,
    device: u32,
    driver: Arc<dyn Driver>,
    done: Mutex<Option<OwnedEvent<Arc<dyn Driver>>>>,
    mapping: Mutex<Option<VmmMapping<Arc<dyn Driver>>>>,
    alloc: VmmAllocation<Arc<dyn Driver>>,
}

impl VmmCopy {
    /// Copies `nbytes` at `src` on `device` into a new VMM allocation, on `stream` (the
    /// sharer's current stream: the copy is ordered after its writes, and the interprocess
    /// event the sharer records next orders the receiver after the copy). The caller has
    /// `device` current.
    pub(super) fn make(
        driver: &Arc<dyn Driver>,
        device: u32,
        src: DevicePtr,
        nbytes: u64,
        stream: StreamHandle,
    ) -> Result<VmmCopy, String> {
        let gran = driver
            .vmm_granularity(device, Granularity::Recommended)
            .map_err(|e| format!("the VMM granularity: {e}"))?
            .max(1);
        let bytes = nbytes.div_ceil(gran).saturating_mul(gran);
        let alloc = VmmAllocation::create(Arc::clone(driver), device, bytes)
            .map_err(|e| format!("a VMM allocation of {} MiB for the copy: {e}", bytes >> 20))?;
        let range = VmmReservation::reserve(Arc::clone(driver), bytes, gran)
            .map_err(|e| format!("an address range for the copy: {e}"))?;
        let mapping =
            VmmMapping::map(range, alloc.handle()).map_err(|e| format!("mapping the copy: {e}"))?;
        mapping
            .set_access(device, Access::ReadWrite)
            .map_err(|e| format!("access to the copy: {e}"))?;
        driver
            .memcpy_dtod_async(mapping.ptr(), src, nbytes, stream)
            .map_err(|e| format!("copying {} MiB: {e}", nbytes >> 20))?;
        let done = OwnedEvent::new(Arc::clone(driver), false)
            .and_then(|ev| driver.event_record(ev.handle(), stream).map(|()| ev))
            .map_err(|e| format!("an event after the copy: {e}"))?;
        Ok(VmmCopy {
            bytes,
            device,
            driver: Arc::clone(driver),
            done: Mutex::new(Some(done)),
            mapping: Mutex::new(Some(mapping)),
            alloc,
        })
    }

    /// The allocation's FD, for a receiver.
    pub(super) fn fd(&self) -> Result<OwnedFd, String> {
        self.driver
            .vmm_export_fd(self.alloc.handle())
            .map_err(|e| e.to_string())
    }
}

impl Drop for VmmCopy {
    fn drop(&mut self) {
        let Ok(_on) = OnDevice::push(&*self.driver, self.device) else {
            tracing::warn!("a copy for sharing: its device cannot be made current; leaking it");
            if let Some(m) = crate::state::lock(&self.mapping).take() {
                std::mem::forget(m);
            }
            return;
        };
        if let Some(ev) = crate::state::lock(&self.done).take() {
            if let Err(e) = self.driver.event_synchronize(ev.handle()) {
                tracing::warn!(error = %e, "a copy for sharing: waiting for the copy failed");
            }
            drop(ev);
        }
        drop(crate::state::lock(&self.mapping).take());
        // The allocation goes with `self.alloc`: a receiver that still maps it keeps the
        // physical memory until it unmaps.
    }
}

/// A receiver's mapping of a sender's copy.
pub(super) struct CopyMapping {
    device: u32,
    driver: Arc<dyn Driver>,
    mapping: Option<VmmMapping<Arc<dyn Driver>>>,
    _alloc: VmmAllocation<Arc<dyn Driver>>,
}

impl CopyMapping {
    /// Maps the copy `fd` names (`bytes` long) on `device`, which the caller has current.
    pub(super) fn map(
        driver: &Arc<dyn Driver>,
        device: u32,
        fd: &OwnedFd,
        bytes: u64,
    ) -> Result<CopyMapping, String> {
        let alloc = VmmAllocation::import_fd(Arc::clone(driver), fd.as_fd())
            .map_err(|e| format!("importing the copy's FD: {e}"))?;
        let gran = driver
            .vmm_granularity(device, Granularity::Recommended)
            .map_err(|e| format!("the VMM granularity: {e}"))?
            .max(1);
        let range = VmmReservation::reserve(Arc::clone(driver), bytes, gran)
            .map_err(|e| format!("an address range for the copy: {e}"))?;
        let mapping = VmmMapping::map(range, alloc.handle())
            .map_err(|e| format!("mapping the copy ({} MiB): {e}", bytes >> 20))?;
        mapping
            .set_access(device, Access::ReadWrite)
            .map_err(|e| format!("access to the copy: {e}"))?;
        Ok(CopyMapping {
            device,
            driver: Arc::clone(driver),
            mapping: Some(mapping),
            _alloc: alloc,
        })
    }

    pub(super) fn ptr(&self) -> DevicePtr {
        self.mapping.as_ref().map_or(DevicePtr(0), VmmMapping::ptr)
    }
}

impl Drop for CopyMapping {
    fn drop(&mut self) {
        // Unmapping does not wait for kernels that may still use the range: wait for this
        // process's work on the legacy stream (and the blocking streams it orders) first.
        let on = OnDevice::push(&*self.driver, self.device);
        match &on {
            Ok(_) => {
                if let Err(e) = self.driver.stream_synchronize(StreamHandle::NULL) {
                    tracing::warn!(error = %e, "unmapping a received copy: waiting for the GPU failed");
                }
            }
            Err(e) => tracing::warn!(error = %e, "unmapping a received copy: no device"),
        }
        drop(self.mapping.take());
        drop(on);
    }
}
