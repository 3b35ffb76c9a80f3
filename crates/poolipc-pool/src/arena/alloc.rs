//! `ArenaAllocator`: best-fit byte ranges over a growing list of chunks. Pure: no IO, no
//! driver, no clock.
//!
//! Free space is kept twice: by position (`(chunk, offset) → len`), to merge a freed block
//! with its neighbours, and by size (`(len, chunk, offset)`), to find the smallest range that
//! fits. Live blocks are kept by position too, so a double free or a block this allocator
//! never handed out is an error rather than corruption. Every operation is O(log n) in the
//! number of free ranges and live blocks, except an alignment above [`ALIGN`], which may look
//! at several ranges of the fitting size class before one has room after its padding.

use std::collections::{BTreeMap, BTreeSet};

/// The alignment of every block's offset and length, in bytes: [`poolipc_types::ARENA_ALIGN`]
/// (which says why 512).
///
/// Chunk bases are VMM-granularity aligned (2 MiB and up), so an offset aligned to `ALIGN` is
/// a device address aligned to `ALIGN`.
pub const ALIGN: u64 = poolipc_types::ARENA_ALIGN;

/// A range the allocator handed out: `len` bytes at `offset` in chunk `chunk`.
///
/// `len` is the reserved length: the request rounded up to [`ALIGN`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Block {
    /// The chunk's index (as [`ArenaAllocator::add_chunk`] returned it).
    pub chunk: u32,
    /// Bytes from the chunk's start; a multiple of the requested alignment.
    pub offset: u64,
    /// Bytes reserved; a multiple of [`ALIGN`].
    pub len: u64,
}

impl Block {
    /// One past the last byte.
    #[must_use]
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// Why the allocator refused a request. Never a panic: every input gets an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// A request for 0 bytes. Refused rather than rounded up: an empty tensor needs no memory
    /// and should not travel through the arena at all, and a zero-length block would make
    /// "which block is at this offset" ambiguous.
    #[error("a zero-byte block was requested; empty tensors need no arena memory")]
    ZeroSize,
    /// An alignment that is not a power of two.
    #[error("alignment {align} is not a power of two")]
    BadAlignment {
        /// The alignment asked for.
        align: u64,
    },
    /// A request so large that rounding it up overflows.
    #[error("{bytes} bytes cannot be rounded up to the arena's alignment")]
    TooLarge {
        /// The bytes asked for.
        bytes: u64,
    },
    /// No free range is large enough; the caller may add a chunk and try again.
    #[error("no free range holds {len} bytes aligned to {align}")]
    NoSpace {
        /// The rounded length that did not fit.
        len: u64,
        /// The alignment asked for.
        align: u64,
    },
    /// A chunk length of 0 or not a multiple of [`ALIGN`].
    #[error("a chunk of {len} bytes: chunks must be a non-zero multiple of {ALIGN} bytes")]
    BadChunkLen {
        /// The length given.
        len: u64,
    },
    /// More chunks than a `u32` can number.
    #[error("the arena already has the most chunks it can number")]
    TooManyChunks,
    /// A block naming a chunk this allocator does not have.
    #[error("chunk {chunk} does not exist in this arena (never added, or released)")]
    UnknownChunk {
        /// The chunk named.
        chunk: u32,
    },
    /// A chunk asked to be removed still has live blocks (or free space split by them).
    #[error("chunk {chunk} cannot be released: {used} bytes of it are live")]
    ChunkInUse {
        /// The chunk named.
        chunk: u32,
        /// Its bytes in live blocks.
        used: u64,
    },
    /// A block that is not live here: freed already, or never handed out by this allocator.
    #[error(
        "block (chunk {chunk}, offset {offset}, len {len}) is not live: freed twice or never \
         allocated here"
    )]
    NotLive {
        /// The block's chunk.
        chunk: u32,
        /// The block's offset.
        offset: u64,
        /// The block's length.
        len: u64,
    },
    /// A split point that is not strictly inside the block or not a multiple of [`ALIGN`].
    #[error(
        "block (chunk {chunk}, offset {offset}, len {len}) cannot be split at {at}: the point \
         must be a multiple of {ALIGN} strictly inside the block"
    )]
    BadSplit {
        /// The block's chunk.
        chunk: u32,
        /// The block's offset.
        offset: u64,
        /// The block's length.
        len: u64,
        /// The split point asked for, in bytes from the block's start.
        at: u64,
    },
    /// A block whose offset is live but whose length is not the live block's.
    #[error("block (chunk {chunk}, offset {offset}) is live with {live_len} bytes, not {len}")]
    WrongLen {
        /// The block's chunk.
        chunk: u32,
        /// The block's offset.
        offset: u64,
        /// The length given.
        len: u64,
        /// The live block's length.
        live_len: u64,
    },
}

/// What the allocator holds, in bytes and counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocStats {
    /// Bytes of all chunks.
    pub capacity: u64,
    /// Bytes in live blocks.
    pub used: u64,
    /// Bytes in free ranges (`capacity - used`).
    pub free: u64,
    /// The largest free range: the largest block that fits without growing (at [`ALIGN`]).
    pub largest_free: u64,
    /// Live blocks.
    pub live_blocks: usize,
    /// Free ranges (after coalescing: at least one per chunk with free space).
    pub free_ranges: usize,
    /// Chunks.
    pub chunks: usize,
}

/// Best-fit allocation of byte ranges across chunks, with coalescing on free.
#[derive(Clone, Debug, Default)]
pub struct ArenaAllocator {
    /// Length of each chunk, by index; 0 for a chunk removed ([`remove_chunk`]): indices
    /// are never reused, so a stale block can never name a later chunk.
    ///
    /// [`remove_chunk`]: ArenaAllocator::remove_chunk
    chunks: Vec<u64>,
    /// Free ranges by position: `(chunk, offset) → len`.
    free_by_pos: BTreeMap<(u32, u64), u64>,
    /// Free ranges by size: `(len, chunk, offset)`.
    free_by_size: BTreeSet<(u64, u32, u64)>,
    /// Live blocks by position: `(chunk, offset) → len`.
    live: BTreeMap<(u32, u64), u64>,
    used: u64,
    /// The mutant the property test must catch: frees without merging neighbours.
    #[cfg(test)]
    no_coalescing: bool,
}

impl ArenaAllocator {
    /// An allocator with no chunks.
    #[must_use]
    pub fn new() -> ArenaAllocator {
        ArenaAllocator::default()
    }

    /// Adds a chunk of `len` bytes (a non-zero multiple of [`ALIGN`]), all free; returns its
    /// index. Indices count up from 0 and are never reused.
    pub fn add_chunk(&mut self, len: u64) -> Result<u32, AllocError> {
        if len == 0 || !len.is_multiple_of(ALIGN) {
            return Err(AllocError::BadChunkLen { len });
        }
        let index = u32::try_from(self.chunks.len()).map_err(|_| AllocError::TooManyChunks)?;
        self.chunks.push(len);
        self.insert_free(index, 0, len);
        Ok(index)
    }

    /// Removes chunk `chunk`, which must be entirely free (no live block in it), and returns
    /// its length. Its index is never used again; blocks naming it are refused as
    /// [`AllocError::UnknownChunk`] from then on. Nothing changes on error.
    pub fn remove_chunk(&mut self, chunk: u32) -> Result<u64, AllocError> {
        let len = self
            .chunk_len(chunk)
            .ok_or(AllocError::UnknownChunk { chunk })?;
        if !self.is_idle(chunk) {
            let used = self
                .live
                .range((chunk, 0)..=(chunk, u64::MAX))
                .map(|(_, &l)| l)
                .sum();
            return Err(AllocError::ChunkInUse { chunk, used });
        }
        self.remove_free(chunk, 0, len);
        self.chunks[chunk as usize] = 0;
        tracing::trace!(chunk, len, "arena chunk removed");
        Ok(len)
    }

    /// Whether chunk `chunk` exists and is one free range: no live block in it.
    #[must_use]
    pub fn is_idle(&self, chunk: u32) -> bool {
        self.chunk_len(chunk)
            .is_some_and(|len| self.free_by_pos.get(&(chunk, 0)) == Some(&len))
    }

    /// The indices of the chunks that exist (not removed), in order.
    pub fn chunk_indices(&self) -> impl Iterator<Item = u32> + '_ {
        self.chunks
            .iter()
            .enumerate()
            .filter(|(_, len)| **len > 0)
            // Indices fit: add_chunk numbers chunks with u32 and refuses more.
            .map(|(i, _)| u32::try_from(i).unwrap_or(u32::MAX))
    }

    /// The smallest free range that holds `bytes` (rounded up to [`ALIGN`]) at an offset
    /// aligned to `align` (a power of two; values below [`ALIGN`] mean [`ALIGN`]).
    ///
    /// [`AllocError::NoSpace`] means the request was valid and only room is missing.
    pub fn alloc(&mut self, bytes: u64, align: u64) -> Result<Block, AllocError> {
        if bytes == 0 {
            return Err(AllocError::ZeroSize);
        }
        if !align.is_power_of_two() {
            return Err(AllocError::BadAlignment { align });
        }
        let align = align.max(ALIGN);
        let len = bytes
            .checked_next_multiple_of(ALIGN)
            .ok_or(AllocError::TooLarge { bytes })?;
        // Best fit: the first range, in size order, with room for `len` after its padding.
        // At `align == ALIGN` every offset is aligned already, so that is the first range of
        // size >= len.
        let found = self
            .free_by_size
            .range((len, 0, 0)..)
            .find_map(|&(flen, chunk, off)| {
                let start = off.checked_next_multiple_of(align)?;
                let end = start.checked_add(len)?;
                (end <= off + flen).then_some((flen, chunk, off, start))
            });
        let Some((flen, chunk, off, start)) = found else {
            return Err(AllocError::NoSpace { len, align });
        };
        self.remove_free(chunk, off, flen);
        if start > off {
            self.insert_free(chunk, off, start - off);
        }
        let end = start + len;
        if end < off + flen {
            self.insert_free(chunk, end, off + flen - end);
        }
        self.live.insert((chunk, start), len);
        self.used += len;
        tracing::trace!(chunk, offset = start, len, "arena block allocated");
        Ok(Block {
            chunk,
            offset: start,
            len,
        })
    }

    /// Gives `block` back, merging it with free neighbours in its chunk.
    ///
    /// A block not live here (freed twice, from another allocator, or with another length)
    /// is refused and nothing changes.
    pub fn free(&mut self, block: Block) -> Result<(), AllocError> {
        let Block { chunk, offset, len } = block;
        if self.chunk_len(chunk).is_none() {
            return Err(AllocError::UnknownChunk { chunk });
        }
        match self.live.get(&(chunk, offset)) {
            None => return Err(AllocError::NotLive { chunk, offset, len }),
            Some(&live_len) if live_len != len => {
                return Err(AllocError::WrongLen {
                    chunk,
                    offset,
                    len,
                    live_len,
                });
            }
            Some(_) => {}
        }
        self.live.remove(&(chunk, offset));
        self.used -= len;
        tracing::trace!(chunk, offset, len, "arena block freed");
        #[cfg(test)]
        if self.no_coalescing {
            self.insert_free(chunk, offset, len);
            return Ok(());
        }
        let (mut start, mut end) = (offset, offset + len);
        // The free range just before, if it ends where this block starts.
        if let Some((&(c, prev), &plen)) = self.free_by_pos.range(..(chunk, offset)).next_back()
            && c == chunk
            && prev + plen == start
        {
            self.remove_free(chunk, prev, plen);
            start = prev;
        }
        // The free range just after, if it starts where this block ends.
        if let Some(&nlen) = self.free_by_pos.get(&(chunk, end)) {
            self.remove_free(chunk, end, nlen);
            end += nlen;
        }
        self.insert_free(chunk, start, end - start);
        Ok(())
    }

    /// Splits the live `block` in two at `at` bytes from its start: the first piece is
    /// `[offset, offset + at)`, the second `[offset + at, end)`. The allocator then keeps two
    /// live blocks where it kept one (live blocks are kept by position), and each piece is
    /// freed on its own; freeing both gives back exactly what freeing `block` would have.
    ///
    /// `at` must be a non-zero multiple of [`ALIGN`] below `block.len`
    /// ([`AllocError::BadSplit`]); a block not live here exactly as given is refused as
    /// [`free`](ArenaAllocator::free) refuses it. Nothing changes on error.
    pub fn split(&mut self, block: Block, at: u64) -> Result<(Block, Block), AllocError> {
        let Block { chunk, offset, len } = block;
        if self.chunk_len(chunk).is_none() {
            return Err(AllocError::UnknownChunk { chunk });
        }
        match self.live.get(&(chunk, offset)) {
            None => return Err(AllocError::NotLive { chunk, offset, len }),
            Some(&live_len) if live_len != len => {
                return Err(AllocError::WrongLen {
                    chunk,
                    offset,
                    len,
                    live_len,
                });
            }
            Some(_) => {}
        }
        if at == 0 || at >= len || !at.is_multiple_of(ALIGN) {
            return Err(AllocError::BadSplit {
                chunk,
                offset,
                len,
                at,
            });
        }
        let first = Block {
            chunk,
            offset,
            len: at,
        };
        let second = Block {
            chunk,
            offset: offset + at,
            len: len - at,
        };
        self.live.insert((chunk, offset), first.len);
        self.live.insert((chunk, second.offset), second.len);
        tracing::trace!(chunk, offset, len, at, "arena block split");
        Ok((first, second))
    }

    /// Whether `block` is live exactly as given.
    #[must_use]
    pub fn is_live(&self, block: &Block) -> bool {
        self.live.get(&(block.chunk, block.offset)) == Some(&block.len)
    }

    /// The length of chunk `chunk`, if it exists (not for a removed one).
    #[must_use]
    pub fn chunk_len(&self, chunk: u32) -> Option<u64> {
        self.chunks.get(chunk as usize).copied().filter(|&l| l > 0)
    }

    /// Bytes of all chunks.
    #[must_use]
    pub fn capacity(&self) -> u64 {
        self.chunks.iter().sum()
    }

    /// The current figures.
    #[must_use]
    pub fn stats(&self) -> AllocStats {
        let capacity = self.capacity();
        AllocStats {
            capacity,
            used: self.used,
            free: capacity - self.used,
            largest_free: self.free_by_size.last().map_or(0, |&(len, _, _)| len),
            live_blocks: self.live.len(),
            free_ranges: self.free_by_pos.len(),
            chunks: self.chunks.iter().filter(|&&l| l > 0).count(),
        }
    }

    /// The free ranges, in position order, as blocks.
    pub fn free_ranges(&self) -> impl Iterator<Item = Block> + '_ {
        self.free_by_pos
            .iter()
            .map(|(&(chunk, offset), &len)| Block { chunk, offset, len })
    }

    /// The live blocks, in position order.
    pub fn live_blocks(&self) -> impl Iterator<Item = Block> + '_ {
        self.live
            .iter()
            .map(|(&(chunk, offset), &len)| Block { chunk, offset, len })
    }

    fn insert_free(&mut self, chunk: u32, offset: u64, len: u64) {
        self.free_by_pos.insert((chunk, offset), len);
        self.free_by_size.insert((len, chunk, offset));
    }

    fn remove_free(&mut self, chunk: u32, offset: u64, len: u64) {
        self.free_by_pos.remove(&(chunk, offset));
        self.free_by_size.remove(&(len, chunk, offset));
    }

    /// The mutant: an allocator that never merges freed neighbours.
    #[cfg(test)]
    pub(crate) fn without_coalescing() -> ArenaAllocator {
        ArenaAllocator {
            no_coalescing: true,
            ..ArenaAllocator::default()
        }
    }
}

#[cfg(test)]
#[path = "alloc_tests.rs"]
mod tests;
