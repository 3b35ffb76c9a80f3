//! `Hello`, `HelloAck`: who each side is (device, driver version, capabilities, devices).

use poolipc_types::DeviceUuid;

use super::wire::{Reader, Writer};
use super::{DecodeError, EncodeError};
use crate::message::{Capabilities, DeviceEntry, Identity, MAX_DEVICES};

/// Wire bytes of one device entry, for the count check.
const DEVICE_WIRE: usize = 16 + 4;

pub(super) fn encode_identity(w: &mut Writer<'_>, id: &Identity) -> Result<(), EncodeError> {
    w.bytes(&id.device.0);
    w.i32(id.driver_version);
    w.u64(id.capabilities.0);
    if id.devices.len() > MAX_DEVICES {
        return Err(w.too_long("devices", id.devices.len(), MAX_DEVICES));
    }
    w.u16(id.devices.len() as u16);
    for d in &id.devices {
        w.bytes(&d.uuid.0);
        w.u32(d.ordinal);
    }
    Ok(())
}

pub(super) fn decode_identity(r: &mut Reader<'_>) -> Result<Identity, DecodeError> {
    let device = DeviceUuid(r.take("device")?);
    let driver_version = r.i32("driver_version")?;
    let capabilities = Capabilities(r.u64("capabilities")?);
    let n = usize::from(r.u16("devices")?);
    let n = r.check_count("devices", n, DEVICE_WIRE, MAX_DEVICES)?;
    let mut devices = Vec::with_capacity(n);
    for _ in 0..n {
        devices.push(DeviceEntry {
            uuid: DeviceUuid(r.take("devices.uuid")?),
            ordinal: r.u32("devices.ordinal")?,
        });
    }
    Ok(Identity {
        device,
        driver_version,
        capabilities,
        devices,
    })
}
