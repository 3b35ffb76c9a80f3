//! `Lend`: a job's tensors (each with its rung, export, event, and on the arena-copy rung its
//! arena location) and the job's arena slice; with the bound on a `Lend` frame's size that
//! the parent checks before lending anything.

use poolipc_types::{AllocId, EventBlob, ExportBlob, HandoffId, JobId, Rung};

use super::wire::{Reader, Writer};
use super::{DecodeError, EncodeError, FrameLimits, HEADER_LEN};
use crate::Layout;
use crate::message::{
    ArenaLocation, Lend, LentSlice, LentTensor, MAX_BATCH, MAX_DIMS, MessageKind, TensorMeta,
};

/// The most bytes one tensor with `ndim` dimensions takes in a
/// [`Message::Lend`](crate::Message::Lend) frame (whatever its rung: the arena-copy rung's
/// location included).
#[must_use]
pub const fn lent_tensor_wire_max(ndim: usize) -> usize {
    // handle, alloc, rung, pool, read_only, export, ready event, arena location (chunk,
    // offset), dtype, ndim, byte_offset, byte_len; then a u64 size and an i64 stride a dim.
    8 + 8 + 1 + 1 + 1 + 64 + 64 + 4 + 8 + 1 + 1 + 8 + 8 + 16 * ndim
}

/// The most bytes of a [`Message::Lend`](crate::Message::Lend) frame besides its tensors:
/// the header, the job, the tensor count and the arena slice.
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

/// Wire bytes of the smallest lent tensor (no dims, no arena location), for the count check.
const MIN_TENSOR_WIRE: usize = 8 + 8 + 1 + 1 + 1 + 64 + 64 + 1 + 1 + 8 + 8;

pub(super) fn encode_lend(w: &mut Writer<'_>, lend: &Lend) -> Result<(), EncodeError> {
    w.u64(lend.job.0);
    w.count("tensors", lend.tensors.len())?;
    for t in &lend.tensors {
        encode_tensor(w, t)?;
        w.check()?;
    }
    match &lend.slice {
        None => w.u8(0),
        Some(slice) => {
            w.u8(1);
            w.u64(slice.handle.0);
            w.u64(slice.alloc.0);
            w.u32(slice.chunk);
            w.u64(slice.offset);
            w.u64(slice.bytes);
        }
    }
    Ok(())
}

pub(super) fn decode_lend(r: &mut Reader<'_>) -> Result<Lend, DecodeError> {
    let job = JobId(r.u64("job")?);
    let n = r.list_count("tensors", MIN_TENSOR_WIRE)?;
    let mut tensors = Vec::with_capacity(n);
    for _ in 0..n {
        tensors.push(decode_tensor(r)?);
    }
    let slice = if r.bool("slice")? {
        Some(LentSlice {
            handle: HandoffId(r.u64("slice.handle")?),
            alloc: AllocId(r.u64("slice.alloc")?),
            chunk: r.u32("slice.chunk")?,
            offset: r.u64("slice.offset")?,
            bytes: r.u64("slice.bytes")?,
        })
    } else {
        None
    };
    Ok(Lend {
        job,
        tensors,
        slice,
    })
}

fn encode_tensor(w: &mut Writer<'_>, t: &LentTensor) -> Result<(), EncodeError> {
    w.u64(t.handle.0);
    w.u64(t.alloc.0);
    w.u8(t.rung as u8);
    w.u8(t.pool);
    w.u8(u8::from(t.read_only));
    w.bytes(&t.export.0);
    w.bytes(&t.ready_event.0);
    match (t.rung == Rung::ArenaCopy, t.arena) {
        (true, Some(at)) => {
            w.u32(at.chunk);
            w.u64(at.offset);
        }
        (false, None) => {}
        (true, None) => {
            return Err(EncodeError::ArenaLocationMismatch {
                kind: w.kind,
                rung: t.rung,
                what: "lacks its arena location",
            });
        }
        (false, Some(_)) => {
            return Err(EncodeError::ArenaLocationMismatch {
                kind: w.kind,
                rung: t.rung,
                what: "carries an arena location",
            });
        }
    }
    let m = &t.meta;
    if m.layout.shape.len() != m.layout.strides.len() {
        return Err(EncodeError::StridesMismatch {
            kind: w.kind,
            shape: m.layout.shape.len(),
            strides: m.layout.strides.len(),
        });
    }
    w.u8(m.layout.dtype as u8);
    w.ndim(m.layout.shape.len())?;
    for d in &m.layout.shape {
        w.u64(*d);
    }
    for s in &m.layout.strides {
        w.i64(*s);
    }
    w.u64(m.byte_offset);
    w.u64(m.byte_len);
    Ok(())
}

fn decode_tensor(r: &mut Reader<'_>) -> Result<LentTensor, DecodeError> {
    let handle = HandoffId(r.u64("handle")?);
    let alloc = AllocId(r.u64("alloc")?);
    let rung = r.rung()?;
    let pool = r.u8("pool")?;
    let read_only = r.bool("read_only")?;
    let export = ExportBlob(r.take("export")?);
    let ready_event = EventBlob(r.take("ready_event")?);
    let arena = if rung == Rung::ArenaCopy {
        Some(ArenaLocation {
            chunk: r.u32("arena_chunk")?,
            offset: r.u64("arena_offset")?,
        })
    } else {
        None
    };
    let dtype = r.dtype()?;
    // Each dim is a shape entry and a stride entry.
    let n = r.ndim("shape", 16)?;
    let mut shape = Vec::with_capacity(n);
    for _ in 0..n {
        shape.push(r.u64("shape")?);
    }
    let mut strides = Vec::with_capacity(n);
    for _ in 0..n {
        strides.push(r.i64("strides")?);
    }
    Ok(LentTensor {
        handle,
        alloc,
        rung,
        pool,
        export,
        ready_event,
        meta: TensorMeta {
            layout: Layout {
                dtype,
                shape,
                strides,
            },
            byte_offset: r.u64("byte_offset")?,
            byte_len: r.u64("byte_len")?,
        },
        arena,
        read_only,
    })
}

#[cfg(test)]
mod tests {
    use super::super::encode;
    use super::*;
    use crate::message::Message;
    use poolipc_types::DType;

    fn worst_tensor(ndim: usize) -> LentTensor {
        LentTensor {
            handle: HandoffId(u64::MAX),
            alloc: AllocId(u64::MAX),
            rung: Rung::ArenaCopy,
            pool: 255,
            export: ExportBlob([0xFF; 64]),
            ready_event: EventBlob([0xFF; 64]),
            meta: TensorMeta {
                layout: Layout {
                    dtype: DType::F64,
                    shape: vec![u64::MAX; ndim],
                    strides: vec![i64::MAX; ndim],
                },
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
}
