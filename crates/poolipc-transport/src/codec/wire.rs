//! The field-level writer and reader every message is made of: little-endian integers,
//! texts, counts and shapes, each with the limit it is checked against. A message family's
//! file composes these; nothing here knows a message.

use poolipc_types::{DType, Rung};

use super::{DecodeError, EncodeError};
use crate::message::{MAX_BATCH, MAX_DIMS, MAX_TEXT_LEN, MessageKind};

/// Appends one frame's payload fields to `out`.
pub(super) struct Writer<'a> {
    pub(super) out: &'a mut Vec<u8>,
    /// The message being written (named in errors).
    pub(super) kind: MessageKind,
    /// Stop writing once past this length: the frame is over the cap anyway.
    pub(super) limit: usize,
}

impl Writer<'_> {
    /// Fails once the frame is past the cap: called after each item of a list.
    pub(super) fn check(&self) -> Result<(), EncodeError> {
        if self.out.len() > self.limit {
            return Err(EncodeError::TooLarge {
                kind: self.kind,
                len: self.out.len(),
                max: self.limit,
            });
        }
        Ok(())
    }
    pub(super) fn u8(&mut self, v: u8) {
        self.out.push(v);
    }
    pub(super) fn u16(&mut self, v: u16) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    /// A length that must not be 0 (an arena chunk's, a VMM mapping's).
    pub(super) fn nonzero_u64(&mut self, field: &'static str, v: u64) -> Result<(), EncodeError> {
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
    pub(super) fn i32(&mut self, v: i32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn i64(&mut self, v: i64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn bytes(&mut self, v: &[u8]) {
        self.out.extend_from_slice(v);
    }
    pub(super) fn too_long(&self, field: &'static str, len: usize, max: usize) -> EncodeError {
        EncodeError::FieldTooLong {
            kind: self.kind,
            field,
            len,
            max,
        }
    }
    pub(super) fn text(&mut self, field: &'static str, s: &str) -> Result<(), EncodeError> {
        if s.len() > MAX_TEXT_LEN {
            return Err(self.too_long(field, s.len(), MAX_TEXT_LEN));
        }
        // MAX_TEXT_LEN < u16::MAX.
        self.u16(s.len() as u16);
        self.bytes(s.as_bytes());
        Ok(())
    }
    pub(super) fn count(&mut self, field: &'static str, n: usize) -> Result<(), EncodeError> {
        if n > MAX_BATCH {
            return Err(self.too_long(field, n, MAX_BATCH));
        }
        // MAX_BATCH < u32::MAX.
        self.u32(n as u32);
        Ok(())
    }
    pub(super) fn ndim(&mut self, n: usize) -> Result<(), EncodeError> {
        if n > MAX_DIMS {
            return Err(self.too_long("shape", n, MAX_DIMS));
        }
        self.u8(n as u8);
        Ok(())
    }
    /// A shape without strides: `dims`, then a u64 a dim.
    pub(super) fn shape(&mut self, shape: &[u64]) -> Result<(), EncodeError> {
        self.ndim(shape.len())?;
        for d in shape {
            self.u64(*d);
        }
        Ok(())
    }
}

/// Takes one payload's fields from the front of `buf`.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    /// The message being read (named in errors).
    pub(super) kind: MessageKind,
}

impl Reader<'_> {
    pub(super) fn take<const N: usize>(
        &mut self,
        field: &'static str,
    ) -> Result<[u8; N], DecodeError> {
        let Some((head, rest)) = self.buf.split_first_chunk::<N>() else {
            return Err(DecodeError::PayloadTruncated {
                kind: self.kind,
                field,
            });
        };
        self.buf = rest;
        Ok(*head)
    }
    pub(super) fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take::<1>(field)?[0])
    }
    pub(super) fn u16(&mut self, field: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.take(field)?))
    }
    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take(field)?))
    }
    pub(super) fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take(field)?))
    }
    /// A length that must not be 0 (an arena chunk's, a VMM mapping's).
    pub(super) fn nonzero_u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
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
    pub(super) fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_le_bytes(self.take(field)?))
    }
    pub(super) fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.take(field)?))
    }

    /// Checks a count against its own limit and against the bytes left, before allocating.
    pub(super) fn check_count(
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
    pub(super) fn list_count(
        &mut self,
        field: &'static str,
        item_wire: usize,
    ) -> Result<usize, DecodeError> {
        let n = self.u32(field)? as usize;
        self.check_count(field, n, item_wire, MAX_BATCH)
    }
    pub(super) fn ndim(
        &mut self,
        field: &'static str,
        item_wire: usize,
    ) -> Result<usize, DecodeError> {
        let n = usize::from(self.u8(field)?);
        self.check_count(field, n, item_wire, MAX_DIMS)
    }
    pub(super) fn text(&mut self, field: &'static str) -> Result<String, DecodeError> {
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
    pub(super) fn dtype(&mut self) -> Result<DType, DecodeError> {
        let v = self.u8("dtype")?;
        DType::from_wire(v).ok_or(DecodeError::UnknownValue {
            kind: self.kind,
            field: "dtype",
            value: v,
        })
    }
    pub(super) fn rung(&mut self) -> Result<Rung, DecodeError> {
        let v = self.u8("rung")?;
        Rung::from_wire(v).ok_or(DecodeError::UnknownValue {
            kind: self.kind,
            field: "rung",
            value: v,
        })
    }
    pub(super) fn bool(&mut self, field: &'static str) -> Result<bool, DecodeError> {
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
    /// A shape without strides, as [`Writer::shape`] writes it.
    pub(super) fn shape(&mut self) -> Result<Vec<u64>, DecodeError> {
        let n = self.ndim("shape", 8)?;
        let mut shape = Vec::with_capacity(n);
        for _ in 0..n {
            shape.push(self.u64("shape")?);
        }
        Ok(shape)
    }
}
