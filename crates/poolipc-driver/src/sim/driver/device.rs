//! Devices and the current device: `cuDeviceGet*`, `cuCtxSetCurrent`, `cuMemGetInfo`.

use crate::error::Result;
use crate::sim::SimDriver;
use crate::sim::shm::process_alive;
use crate::sim::state;
use crate::types::DeviceInfo;

/// `cuDeviceGet` and the attributes: a simulated device as [`DeviceInfo`] tells it.
pub(super) fn info(d: &SimDriver, ordinal: u32) -> Result<DeviceInfo> {
    let index = d.device_check("cuDeviceGet", ordinal)?;
    Ok(DeviceInfo {
        ordinal,
        uuid: d.uuid(index),
        name: format!("poolipc simulated device {index}"),
        total_memory: d.machine.memory,
        memory_pools: true,
        pool_posix_fd: true,
        vmm: true,
        vmm_posix_fd: true,
        mps_client: Some(d.machine.with(|st| st.mps & state::MPS_ON != 0)),
    })
}

/// `cuDeviceCanAccessPeer`: distinct devices, on a machine with peer access.
pub(super) fn can_access_peer(d: &SimDriver, ordinal: u32, peer: u32) -> Result<bool> {
    let index = d.device_check("cuDeviceGet", ordinal)?;
    let peer = d.device_check("cuDeviceGet", peer)?;
    Ok(index != peer && d.machine.peer_access)
}

/// `cuDevicePrimaryCtxRetain` and `cuCtxSetCurrent`: the device this process's calls use.
pub(super) fn use_device(d: &SimDriver, ordinal: u32) -> Result<()> {
    let ordinal = d.device_check("cuDeviceGet", ordinal)?;
    d.local().device = Some(ordinal);
    Ok(())
}

/// `cuMemGetInfo`: (free, total) bytes of the current device, after the machine gave back what
/// no live process holds.
pub(super) fn mem_get_info(d: &SimDriver) -> Result<(u64, u64)> {
    let dev = SimDriver::context(&d.local(), "cuMemGetInfo_v2")?;
    Ok(d.machine.with(|st| {
        // VMM memory of processes that ended without releasing it.
        st.vmm_sweep(process_alive);
        // Exported pool memory of destroyed pools nobody imports any more.
        st.pool_sweep(process_alive);
        let device = &st.devices[dev as usize];
        (device.total.saturating_sub(device.reserved), device.total)
    }))
}
