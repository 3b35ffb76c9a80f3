//! `Done` (the worker's job is over: its event, the handles it gives back, the results it
//! carved out of the job's arena slice) and `Ack` (the handles the parent took back).

use poolipc_types::{EventBlob, HandoffId, JobId};

use super::wire::{Reader, Writer};
use super::{DecodeError, EncodeError};
use crate::message::{Ack, CarvedResult, Done};

/// Wire bytes of the smallest carved result (no dims), for the count check.
const MIN_CARVE_WIRE: usize = 4 + 8 + 8 + 1 + 1;

pub(super) fn encode_done(w: &mut Writer<'_>, done: &Done) -> Result<(), EncodeError> {
    w.u64(done.job.0);
    w.bytes(&done.done_event.0);
    encode_handles(w, &done.handles)?;
    w.count("carved", done.carved.len())?;
    for c in &done.carved {
        w.u32(c.index);
        w.u64(c.offset);
        w.u64(c.bytes);
        w.u8(c.dtype as u8);
        w.shape(&c.shape)?;
        w.check()?;
    }
    Ok(())
}

pub(super) fn decode_done(r: &mut Reader<'_>) -> Result<Done, DecodeError> {
    Ok(Done {
        job: JobId(r.u64("job")?),
        done_event: EventBlob(r.take("done_event")?),
        handles: decode_handles(r)?,
        carved: decode_carved(r)?,
    })
}

fn decode_carved(r: &mut Reader<'_>) -> Result<Vec<CarvedResult>, DecodeError> {
    let n = r.list_count("carved", MIN_CARVE_WIRE)?;
    let mut carved = Vec::with_capacity(n);
    for _ in 0..n {
        carved.push(CarvedResult {
            index: r.u32("carved.index")?,
            offset: r.u64("carved.offset")?,
            bytes: r.u64("carved.bytes")?,
            dtype: r.dtype()?,
            shape: r.shape()?,
        });
    }
    Ok(carved)
}

pub(super) fn encode_ack(w: &mut Writer<'_>, ack: &Ack) -> Result<(), EncodeError> {
    w.u64(ack.job.0);
    encode_handles(w, &ack.handles)
}

pub(super) fn decode_ack(r: &mut Reader<'_>) -> Result<Ack, DecodeError> {
    Ok(Ack {
        job: JobId(r.u64("job")?),
        handles: decode_handles(r)?,
    })
}

/// `list<u64 handle>`, in `Done` and `Ack`.
fn encode_handles(w: &mut Writer<'_>, handles: &[HandoffId]) -> Result<(), EncodeError> {
    w.count("handles", handles.len())?;
    for h in handles {
        w.u64(h.0);
        w.check()?;
    }
    Ok(())
}

fn decode_handles(r: &mut Reader<'_>) -> Result<Vec<HandoffId>, DecodeError> {
    let n = r.list_count("handles", 8)?;
    let mut handles = Vec::with_capacity(n);
    for _ in 0..n {
        handles.push(HandoffId(r.u64("handles")?));
    }
    Ok(handles)
}
