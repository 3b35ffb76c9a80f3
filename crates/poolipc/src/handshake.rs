//! What a side says of itself in the handshake.

use poolipc_driver::Driver;
use poolipc_transport::{Capabilities, Identity};

use crate::error::Error;

/// The handshake identity of a side using `device` through `driver`: the device's UUID (stable
/// across processes, unlike its ordinal), the driver version, and `capabilities`.
pub fn identity(
    driver: &dyn Driver,
    device: u32,
    capabilities: Capabilities,
) -> Result<Identity, Error> {
    let info = driver.device_info(device)?;
    Ok(Identity {
        device: info.uuid,
        driver_version: driver.driver_version()?,
        capabilities,
        devices: Vec::new(),
    })
}
