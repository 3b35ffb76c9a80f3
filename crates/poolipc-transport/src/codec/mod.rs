//! The binary codec: frames of little-endian fields, written and read by hand.
//!
//! # Frame layout
//!
//! ```text
//! offset size field
//!      0    4 payload length, u32 LE (header excluded)
//!      4    1 protocol version (PROTOCOL_VERSION)
//!      5    1 tag (MessageKind)
//!      6    2 reserved, must be 0
//!      8    n payload
//! ```
//!
//! Payload fields, in order, per message (all integers little-endian; `text` is a u16 length
//! followed by that many UTF-8 bytes, at most [`MAX_TEXT_LEN`](crate::MAX_TEXT_LEN);
//! `list<T>` is a u32 count (at most [`MAX_BATCH`](crate::MAX_BATCH)) followed by the items;
//! `dims` is a u8 count, at most [`MAX_DIMS`](crate::MAX_DIMS)):
//!
//! - `Hello`, `HelloAck`: device uuid `[16]`, driver version i32, capabilities u64,
//!   devices `u16 count × (uuid [16], ordinal u32)`.
//! - `Refuse`, `Error`: code u16, message text.
//! - `Lend`: job u64, `list<tensor>`; tensor: handle u64, alloc u64, rung u8, pool u8,
//!   read-only u8 (protocol 7: 0 or 1, anything else is an error), export `[64]`,
//!   ready event `[64]`, then on the arena-copy rung (4) only: arena chunk u32, arena offset
//!   u64; then dtype u8, ndim u8, shape `u64 × ndim`, strides `i64 × ndim`, byte offset u64,
//!   byte length u64; then (protocol 6) the job's arena slice: presence u8 (0 none, 1 one;
//!   anything else is an error), and if 1: handle u64, alloc u64, chunk u32, offset u64,
//!   bytes u64.
//! - `ResultRequest`: job u64, `list<spec>`; spec: dtype u8, ndim u8, shape `u64 × ndim`,
//!   byte length u64.
//! - `AllocationGrant`: job u64, `list<grant>`; grant: kind u8 (1 granted, 2 refused, 3
//!   arena); granted: handle u64, alloc u64, rung u8, pool u8, export `[64]`, ready event
//!   `[64]`; refused: code u16, text; arena: handle u64, alloc u64, chunk u32, offset u64,
//!   bytes u64.
//! - `Done`: job u64, done event `[64]`, `list<u64 handle>`, then (protocol 6)
//!   `list<carve>`; carve: index u32, offset u64, bytes u64, dtype u8, ndim u8,
//!   shape `u64 × ndim`.
//! - `Ack`: job u64, `list<u64 handle>`.
//! - `Cancel`: job u64. `Heartbeat`: seq u64. `Bye`: nothing. `JobError`: job u64, text.
//! - `StagingBuffer`: bytes u64, chunk u64, filled events `[64] × 2`, drained events
//!   `[64] × 2` (and one FD beside the frame). `StagingReady`: bytes u64.
//! - `Chunk`: job u64, handle u64, seq u64, offset u64, bytes u64.
//! - `ExtraPool`: index u8 (1..=255; 0 is an error), device uuid `[16]` (and one FD beside
//!   the frame).
//! - `ExtraPoolReply`: index u8, reachable u8 (0 false, 1 true; anything else is an error),
//!   reason text.
//! - `ArenaChunk`: index u32, len u64 (non-zero; and one FD beside the frame).
//! - `VmmShare` (protocol 8): alloc u64, base u64, len u64 (non-zero; and one FD beside the
//!   frame). A `Lend` tensor on the VMM-handle rung (5) names the allocation by `alloc`.
//! - `ArenaRelease`, `ArenaReleased`: index u32.
//! - `ReleaseMappings`: empty. `MappingsReleased`: dropped u32.
//! - `PoolRetire`, `PoolRetired`: index u8.
//!
//! A payload must be consumed exactly: trailing bytes are an error.
//!
//! # Decoding is total
//!
//! Every input gives `Ok` or a [`DecodeError`], never a panic. Counts are checked against the
//! bytes that remain *before* anything is allocated, so a frame of `n` bytes never makes the
//! decoder allocate more than a small multiple of `n`, and `n` is capped by [`FrameLimits`].
//!
//! # Where each message is
//!
//! This module holds the frame: its header, its limits, and the entry points that dispatch
//! on the tag. `wire` holds the field writer and reader every payload is made of, `error`
//! the two error types. Each message family has its own file, with each message's encoder
//! and decoder side by side: `handshake` (`Hello`, `HelloAck`), `control` (`Refuse`,
//! `Error`, `JobError`, `Cancel`, `Heartbeat`, `Bye`), `lend` (`Lend` and its size bound),
//! `results` (`ResultRequest`, `AllocationGrant`), `done` (`Done`, `Ack`), `staging`
//! (`StagingBuffer`, `StagingReady`, `Chunk`), `pool` (`ExtraPool`, `ExtraPoolReply`,
//! `PoolRetire`, `PoolRetired`), `arena` (`ArenaChunk`, `ArenaRelease`, `ArenaReleased`) and
//! `vmm` (`VmmShare`, `ReleaseMappings`, `MappingsReleased`).

mod arena;
mod control;
mod done;
mod error;
mod handshake;
mod lend;
mod pool;
mod results;
mod staging;
mod vmm;
mod wire;

pub use error::{DecodeError, EncodeError};
pub use lend::{LEND_FIXED_WIRE_MAX, check_lend, lent_tensor_wire_max};

use crate::message::{Message, MessageKind};
use wire::{Reader, Writer};

/// The protocol version this crate speaks. Bumped on any change of the wire format; the golden
/// frames in `fixtures/frames/` pin the current one.
///
/// 4: the result arena (`ArenaChunk`, and the arena grant form of `AllocationGrant`).
/// 5: the arena-copy rung (a `Lend` tensor on rung 4 carries its arena chunk and offset).
/// 6: arena slices (a `Lend` may carry the job's slice of the arena; a `Done` names the
/// results carved out of it).
/// 7: a `Lend` tensor says whether it is read-only; a writable host-staged input's bytes
/// come back after the worker's `Done`, like a staged result's.
/// 8: the VMM-handle rung (5) and `VmmShare`, which hands a VMM allocation's FD over once;
/// arena chunks are given back (`ArenaRelease`, answered by `ArenaReleased`); a rotated
/// pool's retired generation is given back (`PoolRetire`, answered by `PoolRetired`), and an
/// `ExtraPool` may come at any time, at any free index.
pub const PROTOCOL_VERSION: u8 = 8;

/// Bytes of a frame header.
pub const HEADER_LEN: usize = 8;

/// The hard cap on a frame (header and payload): 1 MiB. [`FrameLimits`] may lower it, never
/// raise it.
pub const MAX_FRAME_LEN: usize = 1 << 20;

/// The smallest cap [`FrameLimits`] accepts: a handshake with a few devices must fit.
pub const MIN_FRAME_LEN: usize = 4096;

/// How large a frame may be, on this side. Both directions use the same limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    max_frame_len: usize,
}

impl Default for FrameLimits {
    fn default() -> Self {
        Self {
            max_frame_len: MAX_FRAME_LEN,
        }
    }
}

impl FrameLimits {
    /// A cap of `max_frame_len` bytes, clamped into [`MIN_FRAME_LEN`]..=[`MAX_FRAME_LEN`].
    pub fn new(max_frame_len: usize) -> Self {
        Self {
            max_frame_len: max_frame_len.clamp(MIN_FRAME_LEN, MAX_FRAME_LEN),
        }
    }

    /// The cap, header included.
    pub fn max_frame_len(self) -> usize {
        self.max_frame_len
    }

    /// The largest payload allowed.
    pub fn max_payload_len(self) -> usize {
        self.max_frame_len - HEADER_LEN
    }
}

/// A parsed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Bytes of payload that follow.
    pub payload_len: usize,
    /// The raw tag (checked when the payload is decoded).
    pub tag: u8,
}

impl FrameHeader {
    /// Parses and checks a header: version, reserved bits, length under the cap.
    pub fn parse(bytes: &[u8; HEADER_LEN], limits: FrameLimits) -> Result<Self, DecodeError> {
        let [l0, l1, l2, l3, version, tag, r0, r1] = *bytes;
        if version != PROTOCOL_VERSION {
            return Err(DecodeError::UnknownVersion {
                found: version,
                supported: PROTOCOL_VERSION,
            });
        }
        let reserved = u16::from_le_bytes([r0, r1]);
        if reserved != 0 {
            return Err(DecodeError::ReservedBits(reserved));
        }
        // u32 always fits usize on the 64-bit Linux targets this crate builds for.
        let payload_len = u32::from_le_bytes([l0, l1, l2, l3]) as usize;
        let len = payload_len.saturating_add(HEADER_LEN);
        if len > limits.max_frame_len() {
            return Err(DecodeError::TooLarge {
                len,
                max: limits.max_frame_len(),
            });
        }
        Ok(Self { payload_len, tag })
    }
}

/// Encodes `msg` as one frame appended to `out`. On error `out` is left as it was.
pub fn encode_into(
    msg: &Message,
    limits: FrameLimits,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    let start = out.len();
    let result = encode_inner(msg, limits, out, start);
    if result.is_err() {
        out.truncate(start);
    }
    result
}

/// Encodes `msg` as one frame.
pub fn encode(msg: &Message, limits: FrameLimits) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(128);
    encode_into(msg, limits, &mut out)?;
    Ok(out)
}

fn encode_inner(
    msg: &Message,
    limits: FrameLimits,
    out: &mut Vec<u8>,
    start: usize,
) -> Result<(), EncodeError> {
    let kind = msg.kind();
    out.extend_from_slice(&[0, 0, 0, 0, PROTOCOL_VERSION, kind as u8, 0, 0]);
    let mut w = Writer {
        out,
        kind,
        limit: start + limits.max_frame_len(),
    };
    encode_payload(&mut w, msg)?;
    let len = w.out.len() - start;
    if len > limits.max_frame_len() {
        return Err(EncodeError::TooLarge {
            kind,
            len,
            max: limits.max_frame_len(),
        });
    }
    let payload_len = u32::try_from(len - HEADER_LEN).map_err(|_| EncodeError::TooLarge {
        kind,
        len,
        max: limits.max_frame_len(),
    })?;
    out[start..start + 4].copy_from_slice(&payload_len.to_le_bytes());
    Ok(())
}

/// Writes `msg`'s payload: the dispatch on its kind to its family's encoder.
fn encode_payload(w: &mut Writer<'_>, msg: &Message) -> Result<(), EncodeError> {
    match msg {
        Message::Hello(id) | Message::HelloAck(id) => handshake::encode_identity(w, id)?,
        Message::Refuse { code, message } | Message::Error { code, message } => {
            control::encode_coded(w, *code, message)?;
        }
        Message::Lend(lend) => lend::encode_lend(w, lend)?,
        Message::ResultRequest(req) => results::encode_result_request(w, req)?,
        Message::AllocationGrant(grant) => results::encode_allocation_grant(w, grant)?,
        Message::Done(done) => done::encode_done(w, done)?,
        Message::Ack(ack) => done::encode_ack(w, ack)?,
        Message::Cancel { job } => control::encode_cancel(w, *job),
        Message::JobError { job, message } => control::encode_job_error(w, *job, message)?,
        Message::Heartbeat { seq } => control::encode_heartbeat(w, *seq),
        Message::Bye => {}
        Message::StagingBuffer(sb) => staging::encode_staging_buffer(w, sb),
        Message::StagingReady { bytes } => staging::encode_staging_ready(w, *bytes),
        Message::Chunk(c) => staging::encode_chunk(w, c),
        Message::ExtraPool(ep) => pool::encode_extra_pool(w, ep)?,
        Message::ExtraPoolReply(reply) => pool::encode_extra_pool_reply(w, reply)?,
        Message::ArenaChunk(c) => arena::encode_arena_chunk(w, c)?,
        Message::VmmShare(v) => vmm::encode_vmm_share(w, v)?,
        Message::ArenaRelease(r) | Message::ArenaReleased(r) => {
            arena::encode_arena_release(w, r);
        }
        Message::ReleaseMappings => {}
        Message::MappingsReleased { dropped } => vmm::encode_mappings_released(w, *dropped),
        Message::PoolRetire(r) | Message::PoolRetired(r) => pool::encode_pool_retire(w, r),
    }
    Ok(())
}

/// Decodes exactly one frame that fills `bytes`.
pub fn decode(bytes: &[u8], limits: FrameLimits) -> Result<Message, DecodeError> {
    let Some((header, payload)) = bytes.split_first_chunk::<HEADER_LEN>() else {
        return Err(DecodeError::Truncated {
            needed: HEADER_LEN,
            available: bytes.len(),
        });
    };
    let header = FrameHeader::parse(header, limits)?;
    let needed = HEADER_LEN + header.payload_len;
    if bytes.len() < needed {
        return Err(DecodeError::Truncated {
            needed,
            available: bytes.len(),
        });
    }
    if bytes.len() > needed {
        let kind = MessageKind::from_tag(header.tag).ok_or(DecodeError::UnknownTag(header.tag))?;
        return Err(DecodeError::TrailingBytes {
            kind,
            count: bytes.len() - needed,
        });
    }
    decode_payload(header.tag, payload)
}

/// Decodes a payload whose header said `tag`.
pub fn decode_payload(tag: u8, payload: &[u8]) -> Result<Message, DecodeError> {
    let kind = MessageKind::from_tag(tag).ok_or(DecodeError::UnknownTag(tag))?;
    let mut r = Reader { buf: payload, kind };
    let msg = decode_message(&mut r)?;
    if !r.buf.is_empty() {
        return Err(DecodeError::TrailingBytes {
            kind,
            count: r.buf.len(),
        });
    }
    Ok(msg)
}

/// Reads a payload of `r.kind`: the dispatch on the kind to its family's decoder.
fn decode_message(r: &mut Reader<'_>) -> Result<Message, DecodeError> {
    Ok(match r.kind {
        MessageKind::Hello => Message::Hello(handshake::decode_identity(r)?),
        MessageKind::HelloAck => Message::HelloAck(handshake::decode_identity(r)?),
        MessageKind::Refuse => {
            let (code, message) = control::decode_coded(r)?;
            Message::Refuse { code, message }
        }
        MessageKind::Error => {
            let (code, message) = control::decode_coded(r)?;
            Message::Error { code, message }
        }
        MessageKind::JobError => {
            let (job, message) = control::decode_job_error(r)?;
            Message::JobError { job, message }
        }
        MessageKind::Lend => Message::Lend(lend::decode_lend(r)?),
        MessageKind::ResultRequest => Message::ResultRequest(results::decode_result_request(r)?),
        MessageKind::AllocationGrant => {
            Message::AllocationGrant(results::decode_allocation_grant(r)?)
        }
        MessageKind::Done => Message::Done(done::decode_done(r)?),
        MessageKind::Ack => Message::Ack(done::decode_ack(r)?),
        MessageKind::Cancel => Message::Cancel {
            job: control::decode_cancel(r)?,
        },
        MessageKind::Heartbeat => Message::Heartbeat {
            seq: control::decode_heartbeat(r)?,
        },
        MessageKind::Bye => Message::Bye,
        MessageKind::StagingBuffer => Message::StagingBuffer(staging::decode_staging_buffer(r)?),
        MessageKind::StagingReady => Message::StagingReady {
            bytes: staging::decode_staging_ready(r)?,
        },
        MessageKind::Chunk => Message::Chunk(staging::decode_chunk(r)?),
        MessageKind::ExtraPool => Message::ExtraPool(pool::decode_extra_pool(r)?),
        MessageKind::ArenaChunk => Message::ArenaChunk(arena::decode_arena_chunk(r)?),
        MessageKind::VmmShare => Message::VmmShare(vmm::decode_vmm_share(r)?),
        MessageKind::ArenaRelease => Message::ArenaRelease(arena::decode_arena_release(r)?),
        MessageKind::ArenaReleased => Message::ArenaReleased(arena::decode_arena_release(r)?),
        MessageKind::ReleaseMappings => Message::ReleaseMappings,
        MessageKind::MappingsReleased => Message::MappingsReleased {
            dropped: vmm::decode_mappings_released(r)?,
        },
        MessageKind::PoolRetire => Message::PoolRetire(pool::decode_pool_retire(r)?),
        MessageKind::PoolRetired => Message::PoolRetired(pool::decode_pool_retire(r)?),
        MessageKind::ExtraPoolReply => Message::ExtraPoolReply(pool::decode_extra_pool_reply(r)?),
    })
}
