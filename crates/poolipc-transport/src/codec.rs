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
//! followed by that many UTF-8 bytes, at most [`MAX_TEXT_LEN`]; `list<T>` is a u32 count
//! (at most [`MAX_BATCH`]) followed by the items; `dims` is a u8 count, at most [`MAX_DIMS`]):
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

use crate::message::{
    Ack, AllocationGrant, ArenaChunk, ArenaLocation, ArenaRelease, Capabilities, CarvedResult,
    Chunk, DeviceEntry, Done, ErrorCode, ExtraPool, ExtraPoolReply, Identity, Lend, LentSlice,
    LentTensor, MAX_BATCH, MAX_DEVICES, MAX_DIMS, MAX_TEXT_LEN, Message, MessageKind, PoolRetire,
    ResultGrant, ResultRequest, ResultSpec, StagingBuffer, TensorMeta, VmmShare,
};
use poolipc_types::{AllocId, DType, DeviceUuid, EventBlob, ExportBlob, HandoffId, JobId, Rung};

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

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The input ended inside the frame.
    #[error("truncated frame: {needed} bytes needed, {available} available")]
    Truncated {
        /// Bytes the frame says it has (or the field needs).
        needed: usize,
        /// Bytes there were.
        available: usize,
    },
    /// The length field exceeds the cap.
    #[error("frame of {len} bytes exceeds the cap of {max} bytes")]
    TooLarge {
        /// Header and payload, as the length field says.
        len: usize,
        /// The cap in force.
        max: usize,
    },
    /// The peer speaks another protocol version.
    #[error("unknown protocol version {found} (this side speaks {supported})")]
    UnknownVersion {
        /// The version in the frame.
        found: u8,
        /// [`PROTOCOL_VERSION`].
        supported: u8,
    },
    /// The tag names no message this version knows.
    #[error("unknown message tag {0}")]
    UnknownTag(u8),
    /// The reserved header bytes are not zero.
    #[error("reserved header bits set: {0:#06x}")]
    ReservedBits(u16),
    /// The payload has bytes after its last field.
    #[error("{kind} payload has {count} trailing bytes")]
    TrailingBytes {
        /// The message.
        kind: MessageKind,
        /// How many.
        count: usize,
    },
    /// A field of the payload runs past its end.
    #[error("{kind} payload truncated in field `{field}`")]
    PayloadTruncated {
        /// The message.
        kind: MessageKind,
        /// The field.
        field: &'static str,
    },
    /// A count cannot be right: its items would not fit in the bytes that remain, or it is
    /// over the field's limit.
    #[error("{kind} field `{field}` claims {count} items, at most {max} possible")]
    BadCount {
        /// The message.
        kind: MessageKind,
        /// The field.
        field: &'static str,
        /// The count on the wire.
        count: usize,
        /// The most that can be right here.
        max: usize,
    },
    /// An enum field has a value this version does not know.
    #[error("{kind} field `{field}` has unknown value {value}")]
    UnknownValue {
        /// The message.
        kind: MessageKind,
        /// The field.
        field: &'static str,
        /// The value.
        value: u8,
    },
    /// A text field is not UTF-8.
    #[error("{kind} field `{field}` is not valid UTF-8")]
    InvalidUtf8 {
        /// The message.
        kind: MessageKind,
        /// The field.
        field: &'static str,
    },
    /// A numeric field has a value its message does not allow (`ExtraPool`'s index 0, which
    /// names the pool that came with `Hello`).
    #[error("{kind} field `{field}` has value {value}, outside its range {min}..={max}")]
    OutOfRange {
        /// The message.
        kind: MessageKind,
        /// The field.
        field: &'static str,
        /// The value on the wire.
        value: u64,
        /// The smallest value allowed.
        min: u64,
        /// The largest value allowed.
        max: u64,
    },
}

/// Why a message cannot be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The encoded frame would exceed the cap.
    #[error("{kind} frame of {len} bytes exceeds the cap of {max} bytes")]
    TooLarge {
        /// The message.
        kind: MessageKind,
        /// Its encoded length.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// A field exceeds its own limit (dims, text, devices).
    #[error("{kind} field `{field}` has {len} items, at most {max} allowed")]
    FieldTooLong {
        /// The message.
        kind: MessageKind,
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A numeric field has a value its message does not allow (`ExtraPool`'s index 0): the
    /// peer would refuse the frame.
    #[error("{kind} field `{field}` has value {value}, outside its range {min}..={max}")]
    OutOfRange {
        /// The message.
        kind: MessageKind,
        /// The field.
        field: &'static str,
        /// The value.
        value: u64,
        /// The smallest value allowed.
        min: u64,
        /// The largest value allowed.
        max: u64,
    },
    /// A tensor's shape and strides differ in length.
    #[error("{kind}: shape has {shape} dims but strides has {strides}")]
    StridesMismatch {
        /// The message.
        kind: MessageKind,
        /// Dims in the shape.
        shape: usize,
        /// Dims in the strides.
        strides: usize,
    },
    /// A lent tensor's arena location does not go with its rung: an arena copy without one,
    /// or another rung with one. The wire carries a location exactly on the arena-copy rung.
    #[error("{kind}: a tensor on the {rung} rung {what}")]
    ArenaLocationMismatch {
        /// The message.
        kind: MessageKind,
        /// The tensor's rung.
        rung: Rung,
        /// What is wrong ("lacks its arena location", "carries an arena location").
        what: &'static str,
    },
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

/// The most bytes one tensor with `ndim` dimensions takes in a [`Message::Lend`] frame
/// (whatever its rung: the arena-copy rung's location included).
#[must_use]
pub const fn lent_tensor_wire_max(ndim: usize) -> usize {
    // handle, alloc, rung, pool, read_only, export, ready event, arena location (chunk,
    // offset), dtype, ndim, byte_offset, byte_len; then a u64 size and an i64 stride a dim.
    8 + 8 + 1 + 1 + 1 + 64 + 64 + 4 + 8 + 1 + 1 + 8 + 8 + 16 * ndim
}

/// The most bytes of a [`Message::Lend`] frame besides its tensors: the header, the job, the
/// tensor count and the arena slice.
pub const LEND_FIXED_WIRE_MAX: usize = HEADER_LEN + 8 + 4 + 1 + 8 + 8 + 4 + 8 + 8;

/// Whether a `Lend` of tensors with these numbers of dimensions can be encoded under
/// `limits`, checked before anything is lent (so that a caller's job too large for one frame
/// fails at its submission, not at the send, where it would cost the worker): at most
/// [`MAX_BATCH`] tensors, at most [`MAX_DIMS`] dimensions each, and a frame within the cap
/// (bounded with [`lent_tensor_wire_max`], which the encoder's tests hold it to).
pub fn check_lend(
    ndims: impl ExactSizeIterator<Item = usize>,
    limits: FrameLimits,
) -> Result<(), EncodeError> {
    let kind = MessageKind::Lend;
    let n = ndims.len();
    if n > MAX_BATCH {
        return Err(EncodeError::FieldTooLong {
            kind,
            field: "tensors",
            len: n,
            max: MAX_BATCH,
        });
    }
    let mut len = LEND_FIXED_WIRE_MAX;
    for ndim in ndims {
        if ndim > MAX_DIMS {
            return Err(EncodeError::FieldTooLong {
                kind,
                field: "shape",
                len: ndim,
                max: MAX_DIMS,
            });
        }
        len = len.saturating_add(lent_tensor_wire_max(ndim));
    }
    if len > limits.max_frame_len() {
        return Err(EncodeError::TooLarge {
            kind,
            len,
            max: limits.max_frame_len(),
        });
    }
    Ok(())
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
    w.payload(msg)?;
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

struct Writer<'a> {
    out: &'a mut Vec<u8>,
    kind: MessageKind,
    /// Stop writing once past this length: the frame is over the cap anyway.
    limit: usize,
}

impl Writer<'_> {
    fn check(&self) -> Result<(), EncodeError> {
        if self.out.len() > self.limit {
            return Err(EncodeError::TooLarge {
                kind: self.kind,
                len: self.out.len(),
                max: self.limit,
            });
        }
        Ok(())
    }
    fn u8(&mut self, v: u8) {
        self.out.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    /// A length that must not be 0 (an arena chunk's, a VMM mapping's).
    fn nonzero_u64(&mut self, field: &'static str, v: u64) -> Result<(), EncodeError> {
        if v == 0 {
            return Err(EncodeError::OutOfRange {
                kind: self.kind,
                field,
                value: 0,
                min: 1,
                max: u64::MAX,
            });
        }
        self.u64(v);
        Ok(())
    }
    fn i32(&mut self, v: i32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.out.extend_from_slice(v);
    }
    fn too_long(&self, field: &'static str, len: usize, max: usize) -> EncodeError {
        EncodeError::FieldTooLong {
            kind: self.kind,
            field,
            len,
            max,
        }
    }
    fn text(&mut self, field: &'static str, s: &str) -> Result<(), EncodeError> {
        if s.len() > MAX_TEXT_LEN {
            return Err(self.too_long(field, s.len(), MAX_TEXT_LEN));
        }
        // MAX_TEXT_LEN < u16::MAX.
        self.u16(s.len() as u16);
        self.bytes(s.as_bytes());
        Ok(())
    }
    fn count(&mut self, field: &'static str, n: usize) -> Result<(), EncodeError> {
        if n > MAX_BATCH {
            return Err(self.too_long(field, n, MAX_BATCH));
        }
        // MAX_BATCH < u32::MAX.
        self.u32(n as u32);
        Ok(())
    }
    fn ndim(&mut self, n: usize) -> Result<(), EncodeError> {
        if n > MAX_DIMS {
            return Err(self.too_long("shape", n, MAX_DIMS));
        }
        self.u8(n as u8);
        Ok(())
    }
    fn identity(&mut self, id: &Identity) -> Result<(), EncodeError> {
        self.bytes(&id.device.0);
        self.i32(id.driver_version);
        self.u64(id.capabilities.0);
        if id.devices.len() > MAX_DEVICES {
            return Err(self.too_long("devices", id.devices.len(), MAX_DEVICES));
        }
        self.u16(id.devices.len() as u16);
        for d in &id.devices {
            self.bytes(&d.uuid.0);
            self.u32(d.ordinal);
        }
        Ok(())
    }
    fn handles(&mut self, handles: &[HandoffId]) -> Result<(), EncodeError> {
        self.count("handles", handles.len())?;
        for h in handles {
            self.u64(h.0);
            self.check()?;
        }
        Ok(())
    }

    fn payload(&mut self, msg: &Message) -> Result<(), EncodeError> {
        match msg {
            Message::Hello(id) | Message::HelloAck(id) => self.identity(id)?,
            Message::Refuse { code, message } | Message::Error { code, message } => {
                self.u16(code.0);
                self.text("message", message)?;
            }
            Message::Lend(lend) => {
                self.u64(lend.job.0);
                self.count("tensors", lend.tensors.len())?;
                for t in &lend.tensors {
                    self.u64(t.handle.0);
                    self.u64(t.alloc.0);
                    self.u8(t.rung as u8);
                    self.u8(t.pool);
                    self.u8(u8::from(t.read_only));
                    self.bytes(&t.export.0);
                    self.bytes(&t.ready_event.0);
                    match (t.rung == Rung::ArenaCopy, t.arena) {
                        (true, Some(at)) => {
                            self.u32(at.chunk);
                            self.u64(at.offset);
                        }
                        (false, None) => {}
                        (true, None) => {
                            return Err(EncodeError::ArenaLocationMismatch {
                                kind: self.kind,
                                rung: t.rung,
                                what: "lacks its arena location",
                            });
                        }
                        (false, Some(_)) => {
                            return Err(EncodeError::ArenaLocationMismatch {
                                kind: self.kind,
                                rung: t.rung,
                                what: "carries an arena location",
                            });
                        }
                    }
                    let m = &t.meta;
                    if m.shape.len() != m.strides.len() {
                        return Err(EncodeError::StridesMismatch {
                            kind: self.kind,
                            shape: m.shape.len(),
                            strides: m.strides.len(),
                        });
                    }
                    self.u8(m.dtype as u8);
                    self.ndim(m.shape.len())?;
                    for d in &m.shape {
                        self.u64(*d);
                    }
                    for s in &m.strides {
                        self.i64(*s);
                    }
                    self.u64(m.byte_offset);
                    self.u64(m.byte_len);
                    self.check()?;
                }
                match &lend.slice {
                    None => self.u8(0),
                    Some(slice) => {
                        self.u8(1);
                        self.u64(slice.handle.0);
                        self.u64(slice.alloc.0);
                        self.u32(slice.chunk);
                        self.u64(slice.offset);
                        self.u64(slice.bytes);
                    }
                }
            }
            Message::ResultRequest(req) => {
                self.u64(req.job.0);
                self.count("results", req.results.len())?;
                for r in &req.results {
                    self.u8(r.dtype as u8);
                    self.ndim(r.shape.len())?;
                    for d in &r.shape {
                        self.u64(*d);
                    }
                    self.u64(r.byte_len);
                    self.check()?;
                }
            }
            Message::AllocationGrant(grant) => {
                self.u64(grant.job.0);
                self.count("results", grant.results.len())?;
                for g in &grant.results {
                    match g {
                        ResultGrant::Granted {
                            handle,
                            alloc,
                            rung,
                            pool,
                            export,
                            ready_event,
                        } => {
                            self.u8(GRANT_GRANTED);
                            self.u64(handle.0);
                            self.u64(alloc.0);
                            self.u8(*rung as u8);
                            self.u8(*pool);
                            self.bytes(&export.0);
                            self.bytes(&ready_event.0);
                        }
                        ResultGrant::Arena {
                            handle,
                            alloc,
                            chunk,
                            offset,
                            bytes,
                        } => {
                            self.u8(GRANT_ARENA);
                            self.u64(handle.0);
                            self.u64(alloc.0);
                            self.u32(*chunk);
                            self.u64(*offset);
                            self.u64(*bytes);
                        }
                        ResultGrant::Refused { code, message } => {
                            self.u8(GRANT_REFUSED);
                            self.u16(code.0);
                            self.text("message", message)?;
                        }
                    }
                    self.check()?;
                }
            }
            Message::Done(done) => {
                self.u64(done.job.0);
                self.bytes(&done.done_event.0);
                self.handles(&done.handles)?;
                self.count("carved", done.carved.len())?;
                for c in &done.carved {
                    self.u32(c.index);
                    self.u64(c.offset);
                    self.u64(c.bytes);
                    self.u8(c.dtype as u8);
                    self.ndim(c.shape.len())?;
                    for d in &c.shape {
                        self.u64(*d);
                    }
                    self.check()?;
                }
            }
            Message::Ack(ack) => {
                self.u64(ack.job.0);
                self.handles(&ack.handles)?;
            }
            Message::Cancel { job } => self.u64(job.0),
            Message::JobError { job, message } => {
                self.u64(job.0);
                self.text("message", message)?;
            }
            Message::Heartbeat { seq } => self.u64(*seq),
            Message::Bye => {}
            Message::StagingBuffer(sb) => {
                self.u64(sb.bytes);
                self.u64(sb.chunk);
                for e in sb.filled_event.iter().chain(&sb.drained_event) {
                    self.bytes(&e.0);
                }
            }
            Message::StagingReady { bytes } => self.u64(*bytes),
            Message::Chunk(c) => {
                self.u64(c.job.0);
                self.u64(c.handle.0);
                self.u64(c.seq);
                self.u64(c.offset);
                self.u64(c.bytes);
            }
            Message::ExtraPool(ep) => {
                if ep.index < EXTRA_POOL_MIN_INDEX {
                    return Err(EncodeError::OutOfRange {
                        kind: self.kind,
                        field: "index",
                        value: u64::from(ep.index),
                        min: u64::from(EXTRA_POOL_MIN_INDEX),
                        max: u64::from(u8::MAX),
                    });
                }
                self.u8(ep.index);
                self.bytes(&ep.device.0);
            }
            Message::ExtraPoolReply(reply) => {
                self.u8(reply.index);
                self.u8(u8::from(reply.reachable));
                self.text("reason", &reply.reason)?;
            }
            Message::ArenaChunk(c) => {
                self.u32(c.index);
                self.nonzero_u64("len", c.len)?;
            }
            Message::VmmShare(v) => {
                self.u64(v.alloc.0);
                self.u64(v.base);
                self.nonzero_u64("len", v.len)?;
            }
            Message::ArenaRelease(r) | Message::ArenaReleased(r) => self.u32(r.index),
            Message::ReleaseMappings => {}
            Message::MappingsReleased { dropped } => self.u32(*dropped),
            Message::PoolRetire(r) | Message::PoolRetired(r) => self.u8(r.index),
        }
        Ok(())
    }
}

const GRANT_GRANTED: u8 = 1;
const GRANT_REFUSED: u8 = 2;
const GRANT_ARENA: u8 = 3;

/// `ExtraPool::index` 0 is the pool that came with `Hello`: an extra pool is 1 or more.
const EXTRA_POOL_MIN_INDEX: u8 = 1;

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
    let msg = r.message()?;
    if !r.buf.is_empty() {
        return Err(DecodeError::TrailingBytes {
            kind,
            count: r.buf.len(),
        });
    }
    Ok(msg)
}

struct Reader<'a> {
    buf: &'a [u8],
    kind: MessageKind,
}

/// Wire bytes of the smallest item of each list, for the count check.
const MIN_TENSOR_WIRE: usize = 8 + 8 + 1 + 1 + 1 + 64 + 64 + 1 + 1 + 8 + 8;
const MIN_SPEC_WIRE: usize = 1 + 1 + 8;
const MIN_GRANT_WIRE: usize = 1 + 2 + 2;
const MIN_CARVE_WIRE: usize = 4 + 8 + 8 + 1 + 1;
const DEVICE_WIRE: usize = 16 + 4;

impl Reader<'_> {
    fn take<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let Some((head, rest)) = self.buf.split_first_chunk::<N>() else {
            return Err(DecodeError::PayloadTruncated {
                kind: self.kind,
                field,
            });
        };
        self.buf = rest;
        Ok(*head)
    }
    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take::<1>(field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.take(field)?))
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take(field)?))
    }
    /// A length that must not be 0 (an arena chunk's, a VMM mapping's).
    fn nonzero_u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        let v = self.u64(field)?;
        if v == 0 {
            return Err(DecodeError::OutOfRange {
                kind: self.kind,
                field,
                value: 0,
                min: 1,
                max: u64::MAX,
            });
        }
        Ok(v)
    }
    fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_le_bytes(self.take(field)?))
    }
    fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.take(field)?))
    }

    /// Checks a count against its own limit and against the bytes left, before allocating.
    fn check_count(
        &self,
        field: &'static str,
        count: usize,
        item_wire: usize,
        limit: usize,
    ) -> Result<usize, DecodeError> {
        let fit = self.buf.len() / item_wire.max(1);
        let max = fit.min(limit);
        if count > max {
            return Err(DecodeError::BadCount {
                kind: self.kind,
                field,
                count,
                max,
            });
        }
        Ok(count)
    }
    fn list_count(&mut self, field: &'static str, item_wire: usize) -> Result<usize, DecodeError> {
        let n = self.u32(field)? as usize;
        self.check_count(field, n, item_wire, MAX_BATCH)
    }
    fn ndim(&mut self, field: &'static str, item_wire: usize) -> Result<usize, DecodeError> {
        let n = usize::from(self.u8(field)?);
        self.check_count(field, n, item_wire, MAX_DIMS)
    }
    fn text(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let n = usize::from(self.u16(field)?);
        let n = self.check_count(field, n, 1, MAX_TEXT_LEN)?;
        let (bytes, rest) = self.buf.split_at(n);
        self.buf = rest;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(DecodeError::InvalidUtf8 {
                kind: self.kind,
                field,
            }),
        }
    }
    fn dtype(&mut self) -> Result<DType, DecodeError> {
        let v = self.u8("dtype")?;
        DType::from_wire(v).ok_or(DecodeError::UnknownValue {
            kind: self.kind,
            field: "dtype",
            value: v,
        })
    }
    fn rung(&mut self) -> Result<Rung, DecodeError> {
        let v = self.u8("rung")?;
        Rung::from_wire(v).ok_or(DecodeError::UnknownValue {
            kind: self.kind,
            field: "rung",
            value: v,
        })
    }
    fn bool(&mut self, field: &'static str) -> Result<bool, DecodeError> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(DecodeError::UnknownValue {
                kind: self.kind,
                field,
                value,
            }),
        }
    }
    fn shape(&mut self) -> Result<Vec<u64>, DecodeError> {
        let n = self.ndim("shape", 8)?;
        let mut shape = Vec::with_capacity(n);
        for _ in 0..n {
            shape.push(self.u64("shape")?);
        }
        Ok(shape)
    }
    fn identity(&mut self) -> Result<Identity, DecodeError> {
        let device = DeviceUuid(self.take("device")?);
        let driver_version = self.i32("driver_version")?;
        let capabilities = Capabilities(self.u64("capabilities")?);
        let n = usize::from(self.u16("devices")?);
        let n = self.check_count("devices", n, DEVICE_WIRE, MAX_DEVICES)?;
        let mut devices = Vec::with_capacity(n);
        for _ in 0..n {
            devices.push(DeviceEntry {
                uuid: DeviceUuid(self.take("devices.uuid")?),
                ordinal: self.u32("devices.ordinal")?,
            });
        }
        Ok(Identity {
            device,
            driver_version,
            capabilities,
            devices,
        })
    }
    fn handles(&mut self) -> Result<Vec<HandoffId>, DecodeError> {
        let n = self.list_count("handles", 8)?;
        let mut handles = Vec::with_capacity(n);
        for _ in 0..n {
            handles.push(HandoffId(self.u64("handles")?));
        }
        Ok(handles)
    }
    fn carved(&mut self) -> Result<Vec<CarvedResult>, DecodeError> {
        let n = self.list_count("carved", MIN_CARVE_WIRE)?;
        let mut carved = Vec::with_capacity(n);
        for _ in 0..n {
            carved.push(CarvedResult {
                index: self.u32("carved.index")?,
                offset: self.u64("carved.offset")?,
                bytes: self.u64("carved.bytes")?,
                dtype: self.dtype()?,
                shape: self.shape()?,
            });
        }
        Ok(carved)
    }
    fn tensor(&mut self) -> Result<LentTensor, DecodeError> {
        let handle = HandoffId(self.u64("handle")?);
        let alloc = AllocId(self.u64("alloc")?);
        let rung = self.rung()?;
        let pool = self.u8("pool")?;
        let read_only = self.bool("read_only")?;
        let export = ExportBlob(self.take("export")?);
        let ready_event = EventBlob(self.take("ready_event")?);
        let arena = if rung == Rung::ArenaCopy {
            Some(ArenaLocation {
                chunk: self.u32("arena_chunk")?,
                offset: self.u64("arena_offset")?,
            })
        } else {
            None
        };
        let dtype = self.dtype()?;
        // Each dim is a shape entry and a stride entry.
        let n = self.ndim("shape", 16)?;
        let mut shape = Vec::with_capacity(n);
        for _ in 0..n {
            shape.push(self.u64("shape")?);
        }
        let mut strides = Vec::with_capacity(n);
        for _ in 0..n {
            strides.push(self.i64("strides")?);
        }
        Ok(LentTensor {
            handle,
            alloc,
            rung,
            pool,
            export,
            ready_event,
            meta: TensorMeta {
                dtype,
                shape,
                strides,
                byte_offset: self.u64("byte_offset")?,
                byte_len: self.u64("byte_len")?,
            },
            arena,
            read_only,
        })
    }
    fn grant(&mut self) -> Result<ResultGrant, DecodeError> {
        match self.u8("grant")? {
            GRANT_GRANTED => Ok(ResultGrant::Granted {
                handle: HandoffId(self.u64("handle")?),
                alloc: AllocId(self.u64("alloc")?),
                rung: self.rung()?,
                pool: self.u8("pool")?,
                export: ExportBlob(self.take("export")?),
                ready_event: EventBlob(self.take("ready_event")?),
            }),
            GRANT_ARENA => Ok(ResultGrant::Arena {
                handle: HandoffId(self.u64("handle")?),
                alloc: AllocId(self.u64("alloc")?),
                chunk: self.u32("chunk")?,
                offset: self.u64("offset")?,
                bytes: self.u64("bytes")?,
            }),
            GRANT_REFUSED => Ok(ResultGrant::Refused {
                code: ErrorCode(self.u16("code")?),
                message: self.text("message")?,
            }),
            value => Err(DecodeError::UnknownValue {
                kind: self.kind,
                field: "grant",
                value,
            }),
        }
    }

    fn message(&mut self) -> Result<Message, DecodeError> {
        Ok(match self.kind {
            MessageKind::Hello => Message::Hello(self.identity()?),
            MessageKind::HelloAck => Message::HelloAck(self.identity()?),
            MessageKind::Refuse => Message::Refuse {
                code: ErrorCode(self.u16("code")?),
                message: self.text("message")?,
            },
            MessageKind::Error => Message::Error {
                code: ErrorCode(self.u16("code")?),
                message: self.text("message")?,
            },
            MessageKind::JobError => Message::JobError {
                job: JobId(self.u64("job")?),
                message: self.text("message")?,
            },
            MessageKind::Lend => {
                let job = JobId(self.u64("job")?);
                let n = self.list_count("tensors", MIN_TENSOR_WIRE)?;
                let mut tensors = Vec::with_capacity(n);
                for _ in 0..n {
                    tensors.push(self.tensor()?);
                }
                let slice = if self.bool("slice")? {
                    Some(LentSlice {
                        handle: HandoffId(self.u64("slice.handle")?),
                        alloc: AllocId(self.u64("slice.alloc")?),
                        chunk: self.u32("slice.chunk")?,
                        offset: self.u64("slice.offset")?,
                        bytes: self.u64("slice.bytes")?,
                    })
                } else {
                    None
                };
                Message::Lend(Lend {
                    job,
                    tensors,
                    slice,
                })
            }
            MessageKind::ResultRequest => {
                let job = JobId(self.u64("job")?);
                let n = self.list_count("results", MIN_SPEC_WIRE)?;
                let mut results = Vec::with_capacity(n);
                for _ in 0..n {
                    results.push(ResultSpec {
                        dtype: self.dtype()?,
                        shape: self.shape()?,
                        byte_len: self.u64("byte_len")?,
                    });
                }
                Message::ResultRequest(ResultRequest { job, results })
            }
            MessageKind::AllocationGrant => {
                let job = JobId(self.u64("job")?);
                let n = self.list_count("results", MIN_GRANT_WIRE)?;
                let mut results = Vec::with_capacity(n);
                for _ in 0..n {
                    results.push(self.grant()?);
                }
                Message::AllocationGrant(AllocationGrant { job, results })
            }
            MessageKind::Done => Message::Done(Done {
                job: JobId(self.u64("job")?),
                done_event: EventBlob(self.take("done_event")?),
                handles: self.handles()?,
                carved: self.carved()?,
            }),
            MessageKind::Ack => Message::Ack(Ack {
                job: JobId(self.u64("job")?),
                handles: self.handles()?,
            }),
            MessageKind::Cancel => Message::Cancel {
                job: JobId(self.u64("job")?),
            },
            MessageKind::Heartbeat => Message::Heartbeat {
                seq: self.u64("seq")?,
            },
            MessageKind::Bye => Message::Bye,
            MessageKind::StagingBuffer => Message::StagingBuffer(StagingBuffer {
                bytes: self.u64("bytes")?,
                chunk: self.u64("chunk")?,
                filled_event: [
                    EventBlob(self.take("filled_event")?),
                    EventBlob(self.take("filled_event")?),
                ],
                drained_event: [
                    EventBlob(self.take("drained_event")?),
                    EventBlob(self.take("drained_event")?),
                ],
            }),
            MessageKind::StagingReady => Message::StagingReady {
                bytes: self.u64("bytes")?,
            },
            MessageKind::Chunk => Message::Chunk(Chunk {
                job: JobId(self.u64("job")?),
                handle: HandoffId(self.u64("handle")?),
                seq: self.u64("seq")?,
                offset: self.u64("offset")?,
                bytes: self.u64("bytes")?,
            }),
            MessageKind::ExtraPool => {
                let index = self.u8("index")?;
                if index < EXTRA_POOL_MIN_INDEX {
                    return Err(DecodeError::OutOfRange {
                        kind: self.kind,
                        field: "index",
                        value: u64::from(index),
                        min: u64::from(EXTRA_POOL_MIN_INDEX),
                        max: u64::from(u8::MAX),
                    });
                }
                Message::ExtraPool(ExtraPool {
                    index,
                    device: DeviceUuid(self.take("device")?),
                })
            }
            MessageKind::ArenaChunk => Message::ArenaChunk(ArenaChunk {
                index: self.u32("index")?,
                len: self.nonzero_u64("len")?,
            }),
            MessageKind::VmmShare => Message::VmmShare(VmmShare {
                alloc: AllocId(self.u64("alloc")?),
                base: self.u64("base")?,
                len: self.nonzero_u64("len")?,
            }),
            MessageKind::ArenaRelease => Message::ArenaRelease(ArenaRelease {
                index: self.u32("index")?,
            }),
            MessageKind::ArenaReleased => Message::ArenaReleased(ArenaRelease {
                index: self.u32("index")?,
            }),
            MessageKind::ReleaseMappings => Message::ReleaseMappings,
            MessageKind::MappingsReleased => Message::MappingsReleased {
                dropped: self.u32("dropped")?,
            },
            MessageKind::PoolRetire => Message::PoolRetire(PoolRetire {
                index: self.u8("index")?,
            }),
            MessageKind::PoolRetired => Message::PoolRetired(PoolRetire {
                index: self.u8("index")?,
            }),
            MessageKind::ExtraPoolReply => Message::ExtraPoolReply(ExtraPoolReply {
                index: self.u8("index")?,
                reachable: self.bool("reachable")?,
                reason: self.text("reason")?,
            }),
        })
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;
    use poolipc_contract::{
        AllocationGrant, ArenaLocation, ErrorCode, Lend, LentSlice, LentTensor,
        MAX_REFUSAL_TEXT_LEN, MAX_RESULTS_PER_REQUEST, TensorMeta,
    };
    use poolipc_types::{AllocId, DType, EventBlob, ExportBlob, HandoffId, JobId, Rung};

    fn worst_tensor(ndim: usize) -> LentTensor {
        LentTensor {
            handle: HandoffId(u64::MAX),
            alloc: AllocId(u64::MAX),
            rung: Rung::ArenaCopy,
            pool: 255,
            export: ExportBlob([0xFF; 64]),
            ready_event: EventBlob([0xFF; 64]),
            meta: TensorMeta {
                dtype: DType::F64,
                shape: vec![u64::MAX; ndim],
                strides: vec![i64::MAX; ndim],
                byte_offset: u64::MAX,
                byte_len: u64::MAX,
            },
            arena: Some(ArenaLocation {
                chunk: u32::MAX,
                offset: u64::MAX,
            }),
            read_only: true,
        }
    }

    #[test]
    fn the_lend_bound_is_the_encoded_size_of_the_largest_lend() {
        for ndims in [vec![], vec![0], vec![3, 0, MAX_DIMS], vec![MAX_DIMS; 17]] {
            let lend = Message::Lend(Lend {
                job: JobId(u64::MAX),
                tensors: ndims.iter().map(|&d| worst_tensor(d)).collect(),
                slice: Some(LentSlice {
                    handle: HandoffId(1),
                    alloc: AllocId(2),
                    chunk: 3,
                    offset: 4,
                    bytes: 5,
                }),
            });
            let len = encode(&lend, FrameLimits::default())
                .expect("encodes")
                .len();
            let bound = LEND_FIXED_WIRE_MAX
                + ndims
                    .iter()
                    .map(|&d| lent_tensor_wire_max(d))
                    .sum::<usize>();
            assert_eq!(len, bound, "{ndims:?}");
            check_lend(ndims.iter().copied(), FrameLimits::default()).expect("fits");
        }
    }

    #[test]
    fn a_lend_too_large_for_a_frame_is_refused_by_the_check() {
        let err = check_lend(std::iter::repeat_n(2, 7000), FrameLimits::default()).unwrap_err();
        assert!(matches!(err, EncodeError::TooLarge { .. }), "{err}");
        let err = check_lend([MAX_DIMS + 1].into_iter(), FrameLimits::default()).unwrap_err();
        assert!(
            matches!(err, EncodeError::FieldTooLong { field: "shape", .. }),
            "{err}"
        );
        let err = check_lend(
            std::iter::repeat_n(0, MAX_BATCH + 1),
            FrameLimits::default(),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                EncodeError::FieldTooLong {
                    field: "tensors",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_grant_of_the_most_results_a_request_may_ask_fits_a_frame() {
        let refused = ResultGrant::Refused {
            code: ErrorCode::LIMIT,
            message: "x".repeat(MAX_REFUSAL_TEXT_LEN),
        };
        let granted = ResultGrant::Granted {
            handle: HandoffId(u64::MAX),
            alloc: AllocId(u64::MAX),
            rung: Rung::PoolPointer,
            pool: 255,
            export: ExportBlob([0xFF; 64]),
            ready_event: EventBlob([0xFF; 64]),
        };
        for entry in [refused, granted] {
            let grant = Message::AllocationGrant(AllocationGrant {
                job: JobId(u64::MAX),
                results: vec![entry; MAX_RESULTS_PER_REQUEST],
            });
            encode(&grant, FrameLimits::default()).expect("a full grant fits one frame");
        }
    }
}
