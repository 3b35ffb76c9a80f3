//! The result arena: parent-owned device memory every worker maps once, so that handing a
//! result over is an offset, not a pointer export.
//!
//! # Why
//!
//! A result taken from the shared pool costs a `cuMemPoolExportPointer` in the parent (about
//! 0.43 ms/GiB, every time, recycled memory included) and an import in the worker. The arena
//! pays the sharing cost once: the parent creates VMM memory (`cuMemCreate`, shareable by
//! POSIX FD) in a few large chunks, exports each chunk's FD once, and each worker imports and
//! maps each chunk once (8 GiB as one chunk maps in about 0.38 ms on the H200, docs/facts.md).
//! After that, granting a result is choosing a [`Block`] and sending `(chunk, offset, len)`.
//! VMM memory also has no pointer-import size limit (the 128-chunk rule of the pool path).
//!
//! # Pieces
//!
//! - [`ArenaAllocator`]: best-fit byte ranges over chunks, pure (no driver), property-tested.
//! - [`Arena`]: the parent's side: chunks of VMM memory, their FDs, the allocator behind a
//!   mutex so that a block can be freed from any thread.
//! - [`ArenaBudget`]: a cap several arenas share (the facade keeps one arena per worker, so
//!   that a worker maps only chunks holding its own blocks, under one cap for the parent).
//! - [`ArenaMapping`]: a worker's side: the chunks it mapped, and bounds-checked resolution of
//!   `(chunk, offset, len)` from the wire into a device pointer.
//!
//! # Ownership
//!
//! **A block belongs to the parent.** The parent grants it to one worker for one job; the
//! worker writes into it only while that job is running, and never after it sent DONE (or
//! after the job was cancelled). The parent frees the block only after that worker's DONE for
//! the job (and after the parent is done with the result), or after the worker was reaped, so
//! a dead or late worker can never write into a block that was handed to someone else.
//! Chunks live as long as the [`Arena`]; a worker's mapping keeps the physical memory alive
//! until the worker unmaps it, so dropping the arena while a worker still maps a chunk is
//! safe for the worker (the memory goes away when the last mapping does).

mod alloc;
mod budget;
mod parent;
mod worker;

pub use alloc::{ALIGN, AllocError, AllocStats, ArenaAllocator, Block};
pub use budget::ArenaBudget;
pub use parent::{Arena, ArenaBlock, ChunkInfo};
pub use worker::ArenaMapping;

use std::sync::Arc;

use poolipc_driver::{DriverError, VmmAllocation, VmmMapping, VmmReservation};

/// Errors of the arena, on either side.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ArenaError {
    /// The allocator refused the request or the free (zero bytes, a bad alignment, a double
    /// free, a block of another arena).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// Growing to serve the request would pass the arena's cap.
    #[error(
        "the arena cannot hold {requested} more bytes: it has {capacity} bytes and may grow to \
         {max} at most"
    )]
    Exhausted {
        /// The bytes asked for.
        requested: u64,
        /// The bytes held now: the arena's, with those of every arena sharing its
        /// [`ArenaBudget`].
        capacity: u64,
        /// The cap.
        max: u64,
    },
    /// An arena of 0 bytes was asked for, or a size whose rounding up to the driver's
    /// granularity overflows.
    #[error("an arena chunk of {bytes} bytes cannot be made (granularity {granularity})")]
    BadSize {
        /// The bytes asked for.
        bytes: u64,
        /// The driver's granularity.
        granularity: u64,
    },
    /// A block whose pointer is not where this arena put it: a block of another arena.
    #[error("block (chunk {chunk}, offset {offset}) does not belong to this arena")]
    ForeignBlock {
        /// The block's chunk.
        chunk: u32,
        /// The block's offset.
        offset: u64,
    },
    /// A chunk index this side does not have (not created, or not mapped by this worker).
    #[error("arena chunk {chunk} is not mapped here")]
    UnknownChunk {
        /// The chunk named.
        chunk: u32,
    },
    /// A range that does not lie inside its chunk: a malformed offset or length from the
    /// wire. Nothing was touched.
    #[error(
        "arena range (chunk {chunk}, offset {offset}, len {len}) does not lie inside the \
         chunk's {chunk_len} bytes"
    )]
    OutOfBounds {
        /// The chunk named.
        chunk: u32,
        /// The offset given.
        offset: u64,
        /// The length given.
        len: u64,
        /// The chunk's length.
        chunk_len: u64,
    },
    /// A worker was asked to map a chunk index it has mapped already.
    #[error("arena chunk {chunk} is mapped already")]
    AlreadyMapped {
        /// The chunk named.
        chunk: u32,
    },
    /// A chunk length the driver cannot map: 0, or not a multiple of its granularity.
    #[error("arena chunk {chunk} of {len} bytes is not a non-zero multiple of {granularity}")]
    BadChunkLen {
        /// The chunk named.
        chunk: u32,
        /// The length given.
        len: u64,
        /// The driver's minimum granularity.
        granularity: u64,
    },
    /// A driver call failed (the call and its CUresult are in the message).
    #[error(transparent)]
    Driver(#[from] DriverError),
}

/// A chunk of VMM memory mapped into this process: the handle and its mapping.
///
/// Made by `map_handle`, torn down by `unmap` (or dropped); both sides hold these. The
/// fields' order is the teardown's when dropped: unmap (and free the range) first, then
/// release the handle.
struct MappedChunk<D: poolipc_driver::Driver + ?Sized> {
    mapping: VmmMapping<Arc<D>>,
    handle: VmmAllocation<Arc<D>>,
}

impl<D: poolipc_driver::Driver + ?Sized> std::fmt::Debug for MappedChunk<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedChunk")
            .field("mapping", &self.mapping)
            .field("handle", &self.handle)
            .finish()
    }
}

impl<D: poolipc_driver::Driver + ?Sized> MappedChunk<D> {
    fn base(&self) -> poolipc_driver::DevicePtr {
        self.mapping.ptr()
    }

    fn len(&self) -> u64 {
        self.mapping.len()
    }
}

/// Reserves address space for `handle` (`len` bytes), maps it and grants `device` read-write
/// access. On failure, undoes what it did (and logs what could not be undone), the handle's
/// release included.
fn map_handle<D: poolipc_driver::Driver + ?Sized>(
    driver: &Arc<D>,
    device: u32,
    handle: VmmAllocation<Arc<D>>,
    len: u64,
) -> Result<MappedChunk<D>, DriverError> {
    let mapping = map_handle_with(
        driver,
        device,
        handle.handle(),
        len,
        poolipc_driver::Access::ReadWrite,
    )?;
    Ok(MappedChunk { mapping, handle })
}

/// [`map_handle`] of a handle the caller keeps, with the access `device` gets: the worker's
/// read-only alias of a chunk (`cuMemMap`'s offset must be 0, so a read-only view of one
/// block is a second mapping of the whole chunk, granted
/// [`Access::Read`](poolipc_driver::Access::Read)). On failure the range is unmapped and
/// freed again (the owning types' drops, which log what fails).
fn map_handle_with<D: poolipc_driver::Driver + ?Sized>(
    driver: &Arc<D>,
    device: u32,
    handle: poolipc_driver::VmmHandle,
    len: u64,
    access: poolipc_driver::Access,
) -> Result<VmmMapping<Arc<D>>, DriverError> {
    let range = VmmReservation::reserve(Arc::clone(driver), len, 0)?;
    let mapping = VmmMapping::map(range, handle)?;
    mapping.set_access(device, access)?;
    Ok(mapping)
}

/// Unmaps a chunk, frees its address range and releases its handle. Every step is tried
/// (the address range only once unmapped); failures are logged, never a panic, and the first
/// one is returned.
fn unmap<D: poolipc_driver::Driver + ?Sized>(chunk: MappedChunk<D>) -> Result<(), DriverError> {
    let MappedChunk { mapping, handle } = chunk;
    // An address range that is still mapped cannot be freed: `close` frees it only after the
    // unmap, and the handle goes after both.
    let unmapped = logged("cuMemUnmap", mapping.close());
    let released = logged("cuMemRelease", handle.close());
    unmapped.and(released)
}

/// Unmaps a second mapping of a chunk (a read-only alias) and frees its address range; the
/// handle stays the chunk's. Failures are logged; the first one is returned.
fn unmap_alias<D: poolipc_driver::Driver + ?Sized>(
    alias: VmmMapping<Arc<D>>,
) -> Result<(), DriverError> {
    logged("cuMemUnmap", alias.close())
}

fn logged(call: &'static str, r: Result<(), DriverError>) -> Result<(), DriverError> {
    if let Err(e) = &r {
        tracing::warn!(call, error = %e, "arena teardown step failed");
    }
    r
}
