//! The pools beyond the first: `ExtraPool` (another pool, its FD beside the frame),
//! `ExtraPoolReply` (whether the worker reached it), `PoolRetire` / `PoolRetired` (a rotated
//! pool's retired generation given back).

use poolipc_types::DeviceUuid;

use super::wire::{Reader, Writer};
use super::{DecodeError, EncodeError};
use crate::message::{ExtraPool, ExtraPoolReply, PoolRetire};

/// `ExtraPool::index` 0 is the pool that came with `Hello`: an extra pool is 1 or more.
const EXTRA_POOL_MIN_INDEX: u8 = 1;

pub(super) fn encode_extra_pool(w: &mut Writer<'_>, ep: &ExtraPool) -> Result<(), EncodeError> {
    if ep.index < EXTRA_POOL_MIN_INDEX {
        return Err(EncodeError::OutOfRange {
            kind: w.kind,
            field: "index",
            value: u64::from(ep.index),
            min: u64::from(EXTRA_POOL_MIN_INDEX),
            max: u64::from(u8::MAX),
        });
    }
    w.u8(ep.index);
    w.bytes(&ep.device.0);
    Ok(())
}

pub(super) fn decode_extra_pool(r: &mut Reader<'_>) -> Result<ExtraPool, DecodeError> {
    let index = r.u8("index")?;
    if index < EXTRA_POOL_MIN_INDEX {
        return Err(DecodeError::OutOfRange {
            kind: r.kind,
            field: "index",
            value: u64::from(index),
            min: u64::from(EXTRA_POOL_MIN_INDEX),
            max: u64::from(u8::MAX),
        });
    }
    Ok(ExtraPool {
        index,
        device: DeviceUuid(r.take("device")?),
    })
}

pub(super) fn encode_extra_pool_reply(
    w: &mut Writer<'_>,
    reply: &ExtraPoolReply,
) -> Result<(), EncodeError> {
    w.u8(reply.index);
    w.u8(u8::from(reply.reachable));
    w.text("reason", &reply.reason)
}

pub(super) fn decode_extra_pool_reply(r: &mut Reader<'_>) -> Result<ExtraPoolReply, DecodeError> {
    Ok(ExtraPoolReply {
        index: r.u8("index")?,
        reachable: r.bool("reachable")?,
        reason: r.text("reason")?,
    })
}

/// `PoolRetire`, `PoolRetired`: index u8.
pub(super) fn encode_pool_retire(w: &mut Writer<'_>, retire: &PoolRetire) {
    w.u8(retire.index);
}

pub(super) fn decode_pool_retire(r: &mut Reader<'_>) -> Result<PoolRetire, DecodeError> {
    Ok(PoolRetire {
        index: r.u8("index")?,
    })
}
