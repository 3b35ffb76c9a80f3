//! Which device a worker works on, worked out from the parent's `Hello`.

use poolipc_driver::Driver;
use poolipc_transport::{Capabilities, DeviceUuid, HandshakeError, Identity};

/// Which device a worker works on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerDevice {
    /// This ordinal, which must be the parent's device (else the handshake fails as a device
    /// mismatch).
    Exactly(u32),
    /// Whichever of this process's devices has the parent's device UUID: ordinals differ
    /// between processes whose `CUDA_VISIBLE_DEVICES` differ (`2,0` makes the parent's device
    /// 2 this worker's 0), the UUID does not. A worker that does not see that device refuses
    /// the handshake
    /// ([`HandshakeError::DeviceNotVisible`](poolipc_transport::HandshakeError), the parent
    /// gets the refusal) and lists what it does see.
    Parent,
    /// This ordinal, whatever device the parent's pool lives on, as long as this process sees
    /// that device too. Where the two devices can reach each other (`cuDeviceCanAccessPeer`),
    /// the pool is given access from this one (`cuMemPoolSetAccess`) and tensors go by pool
    /// pointer; otherwise the worker tells the parent it cannot take pool pointers, and every
    /// tensor goes by host staging.
    Any(u32),
}

/// An ordinal is [`WorkerDevice::Exactly`] that one.
impl From<u32> for WorkerDevice {
    fn from(device: u32) -> WorkerDevice {
        WorkerDevice::Exactly(device)
    }
}

/// Where a worker works, worked out from the parent's `Hello`.
#[derive(Clone, Debug)]
pub(super) struct Placement {
    pub(super) identity: Identity,
    pub(super) compute: u32,
    pub(super) pool_device: u32,
    /// The compute device can reach the pool's (or is it).
    pub(super) peer: bool,
}

/// Where the parent's pool is in this process, and where this worker works: `compute`, or
/// the pool's device when `None`.
pub(super) fn place(
    driver: &dyn Driver,
    parent: DeviceUuid,
    compute: Option<u32>,
) -> Result<Placement, HandshakeError> {
    let failed = |reason: String| HandshakeError::DeviceNotVisible {
        theirs: parent,
        reason,
    };
    let pool_device = find_device(driver, parent)?;
    let compute = compute.unwrap_or(pool_device);
    let peer = reaches(driver, compute, pool_device).map_err(failed)?;
    let mut capabilities = crate::settings::worker_capabilities(driver, compute);
    if !peer {
        capabilities = Capabilities(
            capabilities.0 & !(Capabilities::POOL_POINTER.0 | Capabilities::VMM_ARENA.0),
        );
    }
    let identity = crate::handshake::identity(driver, pool_device, capabilities)
        .map_err(|e| failed(format!("asking device {pool_device} failed: {e}")))?;
    Ok(Placement {
        identity,
        compute,
        pool_device,
        peer,
    })
}

/// Whether work on device `from` can use memory of device `to`: the same device, or a peer.
pub(super) fn reaches(driver: &dyn Driver, from: u32, to: u32) -> Result<bool, String> {
    if from == to {
        return Ok(true);
    }
    driver
        .device_can_access_peer(from, to)
        .map_err(|e| format!("asking whether device {from} reaches device {to} failed: {e}"))
}

/// This process's ordinal for the device with UUID `uuid`.
pub(super) fn find_device(driver: &dyn Driver, uuid: DeviceUuid) -> Result<u32, HandshakeError> {
    let listing = |e: poolipc_driver::DriverError| HandshakeError::DeviceNotVisible {
        theirs: uuid,
        reason: format!("listing this process's devices failed: {e}"),
    };
    let count = driver.device_count().map_err(listing)?;
    let mut seen = Vec::new();
    for ordinal in 0..count {
        let info = driver.device_info(ordinal).map_err(listing)?;
        if info.uuid.0 == uuid.0 {
            return Ok(ordinal);
        }
        seen.push(info.uuid.to_string());
    }
    Err(HandshakeError::DeviceNotVisible {
        theirs: uuid,
        reason: if seen.is_empty() {
            "this process sees no device (check CUDA_VISIBLE_DEVICES)".into()
        } else {
            format!(
                "this process sees {} ({}); check CUDA_VISIBLE_DEVICES",
                seen.len(),
                seen.join(", ")
            )
        },
    })
}
