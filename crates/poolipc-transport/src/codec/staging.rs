//! Host staging: `StagingBuffer` (the shared buffer's size, chunk and events; its memfd beside
//! the frame), `StagingReady` (the worker mapped it), `Chunk` (one chunk of a tensor's bytes
//! in the buffer, and its echo).

use poolipc_types::{EventBlob, HandoffId, JobId};

use super::DecodeError;
use super::wire::{Reader, Writer};
use crate::message::{Chunk, StagingBuffer};

pub(super) fn encode_staging_buffer(w: &mut Writer<'_>, sb: &StagingBuffer) {
    w.u64(sb.bytes);
    w.u64(sb.chunk);
    for e in sb.filled_event.iter().chain(&sb.drained_event) {
        w.bytes(&e.0);
    }
}

pub(super) fn decode_staging_buffer(r: &mut Reader<'_>) -> Result<StagingBuffer, DecodeError> {
    Ok(StagingBuffer {
        bytes: r.u64("bytes")?,
        chunk: r.u64("chunk")?,
        filled_event: [
            EventBlob(r.take("filled_event")?),
            EventBlob(r.take("filled_event")?),
        ],
        drained_event: [
            EventBlob(r.take("drained_event")?),
            EventBlob(r.take("drained_event")?),
        ],
    })
}

/// `StagingReady`: bytes u64.
pub(super) fn encode_staging_ready(w: &mut Writer<'_>, bytes: u64) {
    w.u64(bytes);
}

pub(super) fn decode_staging_ready(r: &mut Reader<'_>) -> Result<u64, DecodeError> {
    r.u64("bytes")
}

pub(super) fn encode_chunk(w: &mut Writer<'_>, c: &Chunk) {
    w.u64(c.job.0);
    w.u64(c.handle.0);
    w.u64(c.seq);
    w.u64(c.offset);
    w.u64(c.bytes);
}

pub(super) fn decode_chunk(r: &mut Reader<'_>) -> Result<Chunk, DecodeError> {
    Ok(Chunk {
        job: JobId(r.u64("job")?),
        handle: HandoffId(r.u64("handle")?),
        seq: r.u64("seq")?,
        offset: r.u64("offset")?,
        bytes: r.u64("bytes")?,
    })
}
