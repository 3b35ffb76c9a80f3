//! The result arena's chunks: `ArenaChunk` (a chunk, its FD beside the frame) and
//! `ArenaRelease` / `ArenaReleased` (a chunk given back, and the worker's answer).

use super::wire::{Reader, Writer};
use super::{DecodeError, EncodeError};
use crate::message::{ArenaChunk, ArenaRelease};

pub(super) fn encode_arena_chunk(w: &mut Writer<'_>, c: &ArenaChunk) -> Result<(), EncodeError> {
    w.u32(c.index);
    w.nonzero_u64("len", c.len)
}

pub(super) fn decode_arena_chunk(r: &mut Reader<'_>) -> Result<ArenaChunk, DecodeError> {
    Ok(ArenaChunk {
        index: r.u32("index")?,
        len: r.nonzero_u64("len")?,
    })
}

/// `ArenaRelease`, `ArenaReleased`: index u32.
pub(super) fn encode_arena_release(w: &mut Writer<'_>, release: &ArenaRelease) {
    w.u32(release.index);
}

pub(super) fn decode_arena_release(r: &mut Reader<'_>) -> Result<ArenaRelease, DecodeError> {
    Ok(ArenaRelease {
        index: r.u32("index")?,
    })
}
