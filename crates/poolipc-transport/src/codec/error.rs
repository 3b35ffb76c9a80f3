//! What can go wrong: bytes that are not a frame ([`DecodeError`]), a message that cannot be
//! one ([`EncodeError`]).

use poolipc_types::Rung;

use crate::message::MessageKind;

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
        /// [`PROTOCOL_VERSION`](super::PROTOCOL_VERSION).
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
