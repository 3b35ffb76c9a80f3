//! `Arena`: the parent's chunks of VMM memory and the allocator over them.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use poolipc_driver::{DevicePtr, Driver, Granularity, OwnedEvent, VmmAllocation};

use super::alloc::{ALIGN, AllocError, AllocStats, ArenaAllocator, Block};
use super::budget::ArenaBudget;
use super::{ArenaError, MappedChunk, map_handle, unmap};

/// A block of the arena, as the parent hands it out: where it is in the arena (what goes on
/// the wire) and where it is in the parent's address space.
///
/// `len` is the reserved length: the request rounded up to [`ALIGN`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ArenaBlock {
    /// The chunk's index.
    pub chunk: u32,
    /// Bytes from the chunk's start, a multiple of [`ALIGN`].
    pub offset: u64,
    /// Bytes reserved, a multiple of [`ALIGN`].
    pub len: u64,
    /// The block's address in the parent.
    pub ptr: DevicePtr,
}

impl ArenaBlock {
    /// The allocator's view: chunk, offset, length.
    #[must_use]
    pub fn block(&self) -> Block {
        Block {
            chunk: self.chunk,
            offset: self.offset,
            len: self.len,
        }
    }
}

/// One chunk of the arena, as [`Arena::chunks`] lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkInfo {
    /// The chunk's index: what blocks and [`Arena::export_fd`] name it by.
    pub index: u32,
    /// Its length in bytes, a multiple of the driver's recommended granularity.
    pub len: u64,
    /// Its base address in the parent.
    pub ptr: DevicePtr,
}

#[derive(Debug)]
struct State<D: Driver + ?Sized> {
    alloc: ArenaAllocator,
    /// By chunk index (the allocator's indices: pushed together); `None` once released.
    chunks: Vec<Option<MappedChunk<D>>>,
    /// Chunks seen idle (no live block, no pending free) by [`Arena::release_idle`], since
    /// when; a chunk an allocation lands in leaves this map.
    idle_since: HashMap<u32, Instant>,
    /// Chunks released so far, and their bytes.
    released_chunks: u64,
    released_bytes: u64,
    /// Blocks given back with [`Arena::free_after`], live in the allocator until their event
    /// completed.
    pending: Vec<(ArenaBlock, OwnedEvent)>,
}

impl<D: Driver + ?Sized> Default for State<D> {
    fn default() -> Self {
        State {
            alloc: ArenaAllocator::default(),
            chunks: Vec::new(),
            idle_since: HashMap::new(),
            released_chunks: 0,
            released_bytes: 0,
            pending: Vec::new(),
        }
    }
}

/// The parent's result arena: chunks of device memory shareable by POSIX FD, mapped
/// read-write for one device, and a best-fit allocator over them.
///
/// Chunks are made on the thread that calls [`new`](Arena::new), [`grow`](Arena::grow) or
/// an [`alloc`](Arena::alloc) that grows: that thread must have made the device current
/// ([`Driver::use_device`]). [`free`](Arena::free) and [`free_after`](Arena::free_after)
/// make no driver call, so a block can be given back from any thread: share the arena with
/// `Arc<Arena<D>>`.
///
/// # Stream-ordered frees
///
/// A block whose last use is queued on a stream (the caller's kernels reading a result, the
/// stream's wait on the worker's DONE) is given back with
/// [`free_after`](Arena::free_after) and an event recorded on that stream after the last
/// use: it stays live until the event completed, and [`alloc`](Arena::alloc) (or
/// [`reclaim`](Arena::reclaim)) frees the completed ones first, so a block is handed out
/// again only once every earlier use of it finished on the GPU. That is why a block needs no
/// READY event when it is granted again.
///
/// Each chunk gets its own address range; a block never spans two chunks. When an `alloc`
/// finds no room it adds a chunk as large as the first one (or as large as the request, if
/// that is larger), never passing its [`ArenaBudget`]: the cap given to
/// [`with_max_bytes`](Arena::with_max_bytes), or one shared with other arenas
/// ([`with_budget`](Arena::with_budget)). A worker must map each new chunk (see [`ChunkInfo`] and [`export_fd`](Arena::export_fd))
/// before it is granted a block in it.
pub struct Arena<D: Driver + ?Sized> {
    driver: Arc<D>,
    device: u32,
    granularity: u64,
    /// The size of a chunk added by growth, unless the request needs more.
    growth: u64,
    /// The cap this arena's chunks count against, maybe with other arenas' chunks.
    budget: Arc<ArenaBudget>,
    state: Mutex<State<D>>,
}

impl<D: Driver + ?Sized> std::fmt::Debug for Arena<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("device", &self.device)
            .field("granularity", &self.granularity)
            .field("budget", &self.budget)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl<D: Driver + ?Sized> Arena<D> {
    /// An arena of one chunk of at least `initial_bytes` (rounded up to the driver's
    /// recommended granularity) on `device`, with no cap on growth.
    pub fn new(driver: Arc<D>, device: u32, initial_bytes: u64) -> Result<Arena<D>, ArenaError> {
        Arena::with_max_bytes(driver, device, initial_bytes, None)
    }

    /// Like [`new`](Arena::new), never growing past `max_bytes` in total (when given).
    pub fn with_max_bytes(
        driver: Arc<D>,
        device: u32,
        initial_bytes: u64,
        max_bytes: Option<u64>,
    ) -> Result<Arena<D>, ArenaError> {
        let budget = Arc::new(ArenaBudget::new(max_bytes));
        let arena = Arena::with_budget(driver, device, initial_bytes, budget)?;
        {
            let mut st = arena.lock();
            arena.add_chunk(&mut st, initial_bytes, arena.growth)?;
        }
        tracing::debug!(device, bytes = arena.growth, "arena created");
        Ok(arena)
    }

    /// An arena with no chunk yet on `device`, whose chunks count against `budget` (a cap
    /// shared with every other arena made with it). It grows at its first
    /// [`alloc`](Arena::alloc) (or [`grow`](Arena::grow)) by chunks of `chunk_bytes` (rounded
    /// up to the driver's recommended granularity), or of the request if larger, or only of
    /// what the request needs when the budget has no room for more. Makes no chunk, so the
    /// calling thread needs no current device; one that grows it does.
    pub fn with_budget(
        driver: Arc<D>,
        device: u32,
        chunk_bytes: u64,
        budget: Arc<ArenaBudget>,
    ) -> Result<Arena<D>, ArenaError> {
        let granularity = driver.vmm_granularity(device, Granularity::Recommended)?;
        let growth = round_up(chunk_bytes, granularity)?;
        Ok(Arena {
            driver,
            device,
            granularity,
            growth,
            budget,
            state: Mutex::new(State::default()),
        })
    }

    /// Adds a chunk of at least `min_bytes` (rounded up to the granularity) and returns its
    /// index. Refused with [`ArenaError::Exhausted`] when it would pass the cap.
    pub fn grow(&self, min_bytes: u64) -> Result<u32, ArenaError> {
        let len = round_up(min_bytes, self.granularity)?;
        let mut st = self.lock();
        self.add_chunk(&mut st, min_bytes, len)
    }

    /// A block of at least `bytes` (rounded up to [`ALIGN`]), growing the arena when no free
    /// range holds it.
    ///
    /// Zero bytes are refused ([`AllocError::ZeroSize`]): an empty tensor needs no memory.
    /// Past the cap the answer is [`ArenaError::Exhausted`].
    ///
    /// Blocks given back with [`free_after`](Arena::free_after) whose event completed are
    /// freed first.
    pub fn alloc(&self, bytes: u64) -> Result<ArenaBlock, ArenaError> {
        let mut st = self.lock();
        self.reclaim_locked(&mut st);
        let block = match st.alloc.alloc(bytes, ALIGN) {
            Ok(b) => b,
            Err(AllocError::NoSpace { len, .. }) => {
                let needed = round_up(len, self.granularity)?;
                let room = self.budget.room();
                // A chunk of the usual size if the cap leaves room for it, else just enough.
                let chunk_len = if needed.max(self.growth) <= room {
                    needed.max(self.growth)
                } else {
                    needed
                };
                self.add_chunk(&mut st, bytes, chunk_len)?;
                st.alloc.alloc(bytes, ALIGN)?
            }
            Err(e) => return Err(e.into()),
        };
        st.idle_since.remove(&block.chunk);
        let Some(Some(chunk)) = st.chunks.get(block.chunk as usize) else {
            // The allocator hands out blocks only in chunks that exist, pushed together.
            return Err(AllocError::UnknownChunk { chunk: block.chunk }.into());
        };
        let ptr = chunk.base().offset(block.offset);
        Ok(ArenaBlock {
            chunk: block.chunk,
            offset: block.offset,
            len: block.len,
            ptr,
        })
    }

    /// Gives `block` back. Makes no driver call: any thread may free.
    ///
    /// Only after the worker it was granted to sent DONE for its job, or was reaped (see the
    /// module's ownership rule). A block freed twice, or of another arena, is an error and
    /// changes nothing.
    pub fn free(&self, block: ArenaBlock) -> Result<(), ArenaError> {
        let mut st = self.lock();
        let Some(Some(chunk)) = st.chunks.get(block.chunk as usize) else {
            return Err(AllocError::UnknownChunk { chunk: block.chunk }.into());
        };
        if chunk.base().offset(block.offset) != block.ptr {
            return Err(ArenaError::ForeignBlock {
                chunk: block.chunk,
                offset: block.offset,
            });
        }
        st.alloc.free(block.block())?;
        Ok(())
    }

    /// Splits the live `block` at `at` bytes from its start into two blocks that are given
    /// back independently (an arena slice whose carved results and unused tail go separate
    /// ways). `at` must be a non-zero multiple of [`ALIGN`] below `block.len`. Makes no
    /// driver call.
    ///
    /// A block that is not live here exactly as given, of another arena, or already given
    /// back with [`free_after`](Arena::free_after) is refused and nothing changes.
    pub fn split(
        &self,
        block: ArenaBlock,
        at: u64,
    ) -> Result<(ArenaBlock, ArenaBlock), ArenaError> {
        let mut st = self.lock();
        let Some(Some(chunk)) = st.chunks.get(block.chunk as usize) else {
            return Err(AllocError::UnknownChunk { chunk: block.chunk }.into());
        };
        if chunk.base().offset(block.offset) != block.ptr {
            return Err(ArenaError::ForeignBlock {
                chunk: block.chunk,
                offset: block.offset,
            });
        }
        let b = block.block();
        if st.pending.iter().any(|(p, _)| *p == block) {
            return Err(AllocError::NotLive {
                chunk: b.chunk,
                offset: b.offset,
                len: b.len,
            }
            .into());
        }
        let (x, y) = st.alloc.split(b, at)?;
        let piece = |p: Block| ArenaBlock {
            chunk: p.chunk,
            offset: p.offset,
            len: p.len,
            ptr: block.ptr.offset(p.offset - b.offset),
        };
        Ok((piece(x), piece(y)))
    }

    /// Gives `block` back once `event` completed: the caller recorded `event` on the stream
    /// of the block's last use (after it). Makes no driver call: any thread may call it.
    /// The block stays live (and counted as used) until a later [`alloc`](Arena::alloc) or
    /// [`reclaim`](Arena::reclaim) finds the event complete; the event is destroyed then.
    ///
    /// A block that is not live here, or that is pending already, is an error and changes
    /// nothing (`event` is dropped).
    pub fn free_after(&self, block: ArenaBlock, event: OwnedEvent) -> Result<(), ArenaError> {
        let mut st = self.lock();
        let Some(Some(chunk)) = st.chunks.get(block.chunk as usize) else {
            return Err(AllocError::UnknownChunk { chunk: block.chunk }.into());
        };
        if chunk.base().offset(block.offset) != block.ptr {
            return Err(ArenaError::ForeignBlock {
                chunk: block.chunk,
                offset: block.offset,
            });
        }
        let b = block.block();
        if !st.alloc.is_live(&b) || st.pending.iter().any(|(p, _)| *p == block) {
            return Err(AllocError::NotLive {
                chunk: b.chunk,
                offset: b.offset,
                len: b.len,
            }
            .into());
        }
        st.pending.push((block, event));
        tracing::trace!(
            chunk = b.chunk,
            offset = b.offset,
            "arena block returned, stream-ordered"
        );
        Ok(())
    }

    /// Frees every block given back with [`free_after`](Arena::free_after) whose event
    /// completed; returns how many. One `cuEventQuery` per pending block: call it on a thread
    /// with the device's context current. An event whose query fails keeps its block (the
    /// failure is logged): it is never reused on a guess.
    pub fn reclaim(&self) -> usize {
        let mut st = self.lock();
        self.reclaim_locked(&mut st)
    }

    /// Blocks given back with [`free_after`](Arena::free_after) and not reclaimed yet.
    #[must_use]
    pub fn pending_frees(&self) -> usize {
        self.lock().pending.len()
    }

    fn reclaim_locked(&self, st: &mut State<D>) -> usize {
        if st.pending.is_empty() {
            return 0;
        }
        let mut freed = 0;
        let mut keep = Vec::with_capacity(st.pending.len());
        for (block, event) in std::mem::take(&mut st.pending) {
            match self.driver.event_query(event.handle()) {
                Ok(true) => {
                    if let Err(e) = st.alloc.free(block.block()) {
                        tracing::error!(error = %e, ?block, "a pending arena block was not live");
                    }
                    freed += 1;
                }
                Ok(false) => keep.push((block, event)),
                Err(e) => {
                    tracing::warn!(error = %e, ?block, "querying an arena block's free event failed; the block stays out");
                    keep.push((block, event));
                }
            }
        }
        st.pending = keep;
        freed
    }

    /// The chunks, in index order (a snapshot: growth after the call is not seen). Released
    /// chunks are not listed; their indices are never used again.
    pub fn chunks(&self) -> impl Iterator<Item = ChunkInfo> + use<D> {
        let st = self.lock();
        let list: Vec<ChunkInfo> = st
            .chunks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                c.as_ref().map(|c| ChunkInfo {
                    // Indices fit: the allocator numbers chunks with u32 and refuses more.
                    index: u32::try_from(i).unwrap_or(u32::MAX),
                    len: c.len(),
                    ptr: c.base(),
                })
            })
            .collect();
        list.into_iter()
    }

    /// A new FD for chunk `index` (`cuMemExportToShareableHandle`), to send to a worker by
    /// SCM_RIGHTS. Each call makes a new descriptor; the caller owns it.
    pub fn export_fd(&self, index: u32) -> Result<OwnedFd, ArenaError> {
        let handle = {
            let st = self.lock();
            st.chunks
                .get(index as usize)
                .and_then(Option::as_ref)
                .ok_or(ArenaError::UnknownChunk { chunk: index })?
                .handle
                .handle()
        };
        Ok(self.driver.vmm_export_fd(handle)?)
    }

    /// Gives idle chunks back to the device: every chunk with no live block and no block
    /// waiting for its free event, seen idle by an earlier call at least `min_idle` ago (at
    /// once for `Duration::ZERO`), while the arena keeps at least `keep_bytes` (its floor).
    /// Frees the completed pending blocks first (one `cuEventQuery` each) and makes driver
    /// calls (unmap, address free, release): call it on a thread with the device current.
    ///
    /// A chunk with a live block, or with a block given back whose event has not completed,
    /// is never released. The parent's mapping goes at once; the memory goes back to the
    /// device when the last worker that mapped the chunk unmapped it too: tell each one
    /// (the returned chunks). Their indices are never used again.
    pub fn release_idle(
        &self,
        now: Instant,
        min_idle: Duration,
        keep_bytes: u64,
    ) -> Vec<ChunkInfo> {
        let mut st = self.lock();
        self.reclaim_locked(&mut st);
        let pending: Vec<u32> = st.pending.iter().map(|(b, _)| b.chunk).collect();
        let indices: Vec<u32> = st.alloc.chunk_indices().collect();
        let mut released = Vec::new();
        for index in indices {
            if !st.alloc.is_idle(index) || pending.contains(&index) {
                st.idle_since.remove(&index);
                continue;
            }
            let since = *st.idle_since.entry(index).or_insert(now);
            let len = st.alloc.chunk_len(index).unwrap_or(0);
            if now.saturating_duration_since(since) < min_idle
                || st.alloc.capacity().saturating_sub(len) < keep_bytes
            {
                continue;
            }
            let Some(chunk) = st.chunks.get_mut(index as usize).and_then(Option::take) else {
                continue;
            };
            if let Err(e) = st.alloc.remove_chunk(index) {
                // Checked idle above, under the same lock: cannot happen; keep the chunk.
                tracing::error!(error = %e, index, "an idle arena chunk could not be removed");
                st.chunks[index as usize] = Some(chunk);
                continue;
            }
            st.idle_since.remove(&index);
            let info = ChunkInfo {
                index,
                len: chunk.len(),
                ptr: chunk.base(),
            };
            // Failures are logged inside; the chunk is gone from the arena either way.
            let _ = unmap(chunk);
            self.budget.give(info.len);
            st.released_chunks += 1;
            st.released_bytes += info.len;
            tracing::debug!(
                device = self.device,
                index,
                len = info.len,
                capacity = st.alloc.capacity(),
                "arena chunk released"
            );
            released.push(info);
        }
        released
    }

    /// Chunks released by [`release_idle`](Arena::release_idle) so far, and their bytes.
    #[must_use]
    pub fn released(&self) -> (u64, u64) {
        let st = self.lock();
        (st.released_chunks, st.released_bytes)
    }

    /// The allocator's figures: capacity, use, the largest free range, live blocks.
    #[must_use]
    pub fn stats(&self) -> AllocStats {
        self.lock().alloc.stats()
    }

    /// Bytes of all chunks.
    #[must_use]
    pub fn capacity(&self) -> u64 {
        self.lock().alloc.capacity()
    }

    /// The cap on [`capacity`](Arena::capacity), if any: its budget's, which counts the
    /// chunks of every arena sharing it.
    #[must_use]
    pub fn max_bytes(&self) -> Option<u64> {
        self.budget.max_bytes()
    }

    /// The budget its chunks count against.
    #[must_use]
    pub fn budget(&self) -> &Arc<ArenaBudget> {
        &self.budget
    }

    /// The driver's recommended granularity: every chunk's length is a multiple of it.
    #[must_use]
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// The device the memory lives on and is mapped for.
    #[must_use]
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The driver.
    #[must_use]
    pub fn driver(&self) -> &Arc<D> {
        &self.driver
    }

    fn lock(&self) -> MutexGuard<'_, State<D>> {
        // The state is consistent between statements that can panic (none do on input).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Creates, maps and registers a chunk of `len` bytes (a granularity multiple) for a
    /// request of `requested` bytes, within the budget.
    fn add_chunk(&self, st: &mut State<D>, requested: u64, len: u64) -> Result<u32, ArenaError> {
        let capacity = st.alloc.capacity();
        self.budget
            .take(len)
            .map_err(|(held, max)| ArenaError::Exhausted {
                requested,
                capacity: held,
                max,
            })?;
        let made = VmmAllocation::create(Arc::clone(&self.driver), self.device, len)
            // A failed mapping releases the handle (dropped inside, logged).
            .and_then(|handle| map_handle(&self.driver, self.device, handle, len));
        let chunk = match made {
            Ok(c) => c,
            Err(e) => {
                self.budget.give(len);
                return Err(e.into());
            }
        };
        let base = chunk.base();
        let index = match st.alloc.add_chunk(len) {
            Ok(i) => i,
            Err(e) => {
                let _ = unmap(chunk);
                self.budget.give(len);
                return Err(e.into());
            }
        };
        st.chunks.push(Some(chunk));
        tracing::debug!(
            device = self.device,
            index,
            len,
            ?base,
            capacity = capacity + len,
            "arena chunk added"
        );
        Ok(index)
    }
}

impl<D: Driver + ?Sized> Drop for Arena<D> {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        // Blocks given back stream-ordered may still be in use on the GPU: wait before the
        // memory goes away.
        for (block, event) in st.pending.drain(..) {
            if let Err(e) = self.driver.event_synchronize(event.handle()) {
                tracing::warn!(error = %e, ?block, "waiting on an arena block's free event failed");
            }
            let _ = st.alloc.free(block.block());
        }
        let live = st.alloc.stats().live_blocks;
        if live > 0 {
            tracing::warn!(
                live,
                "arena dropped with live blocks; workers' mappings keep the memory until they \
                 unmap it"
            );
        }
        for chunk in st.chunks.drain(..).flatten() {
            let len = chunk.len();
            // Failures are logged inside; a destructor has no one to return them to.
            let _ = unmap(chunk);
            self.budget.give(len);
        }
    }
}

/// `bytes` rounded up to a multiple of `granularity`; 0 and overflow are errors.
fn round_up(bytes: u64, granularity: u64) -> Result<u64, ArenaError> {
    let bad = ArenaError::BadSize { bytes, granularity };
    if bytes == 0 || granularity == 0 {
        return Err(bad);
    }
    bytes.checked_next_multiple_of(granularity).ok_or(bad)
}

#[cfg(test)]
#[path = "parent_tests.rs"]
mod tests;
