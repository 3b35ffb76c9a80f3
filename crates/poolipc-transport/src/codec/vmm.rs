//! VMM allocations lent by handle (protocol 8): `VmmShare` (an allocation, its FD beside the
//! frame) and `ReleaseMappings` / `MappingsReleased` (the worker's cached mappings dropped).

use poolipc_types::AllocId;

use super::wire::{Reader, Writer};
use super::{DecodeError, EncodeError};
use crate::message::VmmShare;

pub(super) fn encode_vmm_share(w: &mut Writer<'_>, v: &VmmShare) -> Result<(), EncodeError> {
    w.u64(v.alloc.0);
    w.u64(v.base);
    w.nonzero_u64("len", v.len)
}

pub(super) fn decode_vmm_share(r: &mut Reader<'_>) -> Result<VmmShare, DecodeError> {
    Ok(VmmShare {
        alloc: AllocId(r.u64("alloc")?),
        base: r.u64("base")?,
        len: r.nonzero_u64("len")?,
    })
}

/// `ReleaseMappings` has no payload; `MappingsReleased`: dropped u32.
pub(super) fn encode_mappings_released(w: &mut Writer<'_>, dropped: u32) {
    w.u32(dropped);
}

pub(super) fn decode_mappings_released(r: &mut Reader<'_>) -> Result<u32, DecodeError> {
    r.u32("dropped")
}
