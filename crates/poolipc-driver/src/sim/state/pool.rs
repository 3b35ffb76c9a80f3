//! The pool allocator over the machine's tables: a pool's blocks (live, cached, holes, in
//! limbo), allocation by best fit, frees, releases down to a threshold, and pools that outlive
//! their owner while another process imports them.

use super::{
    BLOCK_CACHED, BLOCK_EMPTY, BLOCK_HOLE, BLOCK_LIMBO, BLOCK_LIVE, BlockRec, FREED_RING, GRANULE,
    MAX_POOLS, MemoryWork, POOL_DYING, POOL_FREE, POOL_IMPORTERS, POOL_LIMBO, POOL_LIVE, PoolRec,
    State, VmmHolder,
};
use crate::error::CuCode;

impl State {
    pub(in crate::sim) fn pool_create(
        &mut self,
        device: u32,
        shareable: bool,
        capacity: u64,
        agent: u64,
        pid: u32,
    ) -> Option<usize> {
        let slot = self.pools.iter().position(|p| p.state == POOL_FREE)?;
        let generation = self.next_id();
        self.pools[slot] = PoolRec {
            state: POOL_LIVE,
            device,
            shareable: u32::from(shareable),
            exported: 0,
            owner_pid: pid,
            reuse_follow: 1,
            reuse_opportunistic: 1,
            reuse_internal: 1,
            owner_agent: agent,
            generation,
            capacity,
            top: 0,
            release_threshold: 0,
            reserved: 0,
            reserved_high: 0,
            used: 0,
            used_high: 0,
            limbo: 0,
            importers: [VmmHolder { pid: 0, count: 0 }; POOL_IMPORTERS],
        };
        Some(slot)
    }

    fn free_block_slot(&self) -> Option<usize> {
        self.blocks.iter().position(|b| b.state == BLOCK_EMPTY)
    }

    /// A block of at least `size` in `pool`, in state `state`, best fit.
    fn best_fit(&self, pool: usize, state: u32, size: u64) -> Option<usize> {
        self.blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.state == state && b.pool as usize == pool && b.size >= size)
            .min_by_key(|(_, b)| (b.size, b.offset))
            .map(|(i, _)| i)
    }

    /// Splits `size` off the front of block `i`; the rest stays in the block's state.
    fn split(&mut self, i: usize, size: u64) -> Result<(), CuCode> {
        let b = &self.blocks[i];
        if b.size == size {
            return Ok(());
        }
        let rest = self.free_block_slot().ok_or(CuCode::OUT_OF_MEMORY)?;
        let (state, pool, offset, total, exported) =
            (b.state, b.pool, b.offset, b.size, b.exported);
        self.blocks[rest] = BlockRec {
            state,
            pool,
            exported,
            offset: offset + size,
            size: total - size,
            ..empty_block()
        };
        self.blocks[i].size = size;
        Ok(())
    }

    fn reserve(&mut self, pool: usize, size: u64) -> Result<(), CuCode> {
        let dev = self.pools[pool].device as usize;
        let d = &mut self.devices[dev];
        if d.reserved.saturating_add(size) > d.total {
            return Err(CuCode::OUT_OF_MEMORY);
        }
        d.reserved += size;
        let p = &mut self.pools[pool];
        p.reserved += size;
        p.reserved_high = p.reserved_high.max(p.reserved);
        Ok(())
    }

    /// `cuMemAllocFromPoolAsync`: the block index of a new live allocation.
    pub(in crate::sim) fn alloc(
        &mut self,
        pool: usize,
        bytes: u64,
        work: &mut MemoryWork,
    ) -> Result<usize, CuCode> {
        let size = bytes
            .max(1)
            .checked_next_multiple_of(GRANULE)
            .ok_or(CuCode::OUT_OF_MEMORY)?;
        let i = if let Some(i) = self.best_fit(pool, BLOCK_CACHED, size) {
            self.split(i, size)?;
            i
        } else if let Some(i) = self.best_fit(pool, BLOCK_LIMBO, size) {
            // Memory the device still holds for this pool: the pool reserves it again.
            self.split(i, size)?;
            let p = &mut self.pools[pool];
            p.limbo = p.limbo.saturating_sub(size);
            p.reserved += size;
            p.reserved_high = p.reserved_high.max(p.reserved);
            i
        } else {
            if self.reserve(pool, size).is_err() {
                // Out of device memory: give back what this pool holds unused, then retry,
                // as the real pool does before it fails.
                self.release_cached(pool, 0, work);
                self.reserve(pool, size)?;
            }
            let found = if let Some(i) = self.best_fit(pool, BLOCK_HOLE, size) {
                self.split(i, size).map(|()| i)
            } else {
                let p = &self.pools[pool];
                if p.top.saturating_add(size) > p.capacity {
                    Err(CuCode::OUT_OF_MEMORY)
                } else {
                    let offset = p.top;
                    self.free_block_slot()
                        .ok_or(CuCode::OUT_OF_MEMORY)
                        .inspect(|&i| {
                            self.blocks[i] = BlockRec {
                                state: BLOCK_HOLE,
                                pool: pool as u32,
                                offset,
                                size,
                                ..empty_block()
                            };
                            self.pools[pool].top += size;
                        })
                }
            };
            match found {
                Ok(i) => i,
                Err(e) => {
                    self.unreserve(pool, size);
                    return Err(e);
                }
            }
        };
        let generation = self.next_id();
        let b = &mut self.blocks[i];
        b.state = BLOCK_LIVE;
        b.bytes = bytes;
        b.generation = generation;
        b.label = [0; super::LABEL_BYTES];
        let p = &mut self.pools[pool];
        p.used += size;
        p.used_high = p.used_high.max(p.used);
        Ok(i)
    }

    fn unreserve(&mut self, pool: usize, size: u64) {
        let dev = self.pools[pool].device as usize;
        self.devices[dev].reserved = self.devices[dev].reserved.saturating_sub(size);
        self.pools[pool].reserved = self.pools[pool].reserved.saturating_sub(size);
    }

    /// The live block of `pool` at exactly `offset`.
    pub(in crate::sim) fn live_block_at(&self, pool: usize, offset: u64) -> Option<usize> {
        self.blocks
            .iter()
            .position(|b| b.state == BLOCK_LIVE && b.pool as usize == pool && b.offset == offset)
    }

    /// The block of `pool` whose range holds `offset`, whatever its state.
    pub(in crate::sim) fn block_containing(&self, pool: usize, offset: u64) -> Option<usize> {
        self.blocks.iter().position(|b| {
            b.state != BLOCK_EMPTY
                && b.pool as usize == pool
                && b.offset <= offset
                && offset < b.offset + b.size
        })
    }

    /// Whether the free of allocation `generation` has run.
    pub(in crate::sim) fn freed_ran(&self, generation: u64) -> bool {
        generation != 0 && self.freed.contains(&generation)
    }

    /// Notes that the free of allocation `generation` ran.
    pub(in crate::sim) fn note_freed(&mut self, generation: u64) {
        let i = (self.freed_cursor % FREED_RING as u64) as usize;
        self.freed[i] = generation;
        self.freed_cursor = self.freed_cursor.wrapping_add(1);
    }

    /// Frees live block `i`: it stays reserved, poisoned.
    pub(in crate::sim) fn free(&mut self, i: usize, work: &mut MemoryWork) {
        let pool = self.blocks[i].pool as usize;
        let b = &mut self.blocks[i];
        b.state = BLOCK_CACHED;
        let (offset, size) = (b.offset, b.size);
        self.pools[pool].used = self.pools[pool].used.saturating_sub(size);
        work.poison.push((offset, size));
        self.coalesce(i);
        if self.pools[pool].state == POOL_DYING && self.pools[pool].used == 0 {
            self.pool_drop(pool, work);
        }
    }

    /// Merges block `i` with free neighbours in the same state.
    fn coalesce(&mut self, i: usize) {
        let (pool, state, exported) = (
            self.blocks[i].pool,
            self.blocks[i].state,
            self.blocks[i].exported,
        );
        let same = |b: &BlockRec| b.state == state && b.pool == pool && b.exported == exported;
        loop {
            let (off, end) = (
                self.blocks[i].offset,
                self.blocks[i].offset + self.blocks[i].size,
            );
            let next = self.blocks.iter().position(|b| same(b) && b.offset == end);
            let prev = self
                .blocks
                .iter()
                .position(|b| same(b) && b.offset + b.size == off);
            if let Some(n) = next {
                self.blocks[i].size += self.blocks[n].size;
                self.blocks[n] = empty_block();
            } else if let Some(p) = prev {
                self.blocks[p].size += self.blocks[i].size;
                self.blocks[i] = empty_block();
                return self.coalesce(p);
            } else {
                return;
            }
        }
    }

    /// Releases cached memory of `pool` until at most `keep` bytes stay reserved.
    pub(in crate::sim) fn release_cached(&mut self, pool: usize, keep: u64, work: &mut MemoryWork) {
        while self.pools[pool].reserved > keep {
            // Highest addresses first, as a pool shrinks from its top.
            let Some(i) = self
                .blocks
                .iter()
                .enumerate()
                .filter(|(_, b)| b.state == BLOCK_CACHED && b.pool as usize == pool)
                .max_by_key(|(_, b)| b.offset)
                .map(|(i, _)| i)
            else {
                return;
            };
            let (offset, size) = (self.blocks[i].offset, self.blocks[i].size);
            if self.blocks[i].exported == 1 {
                // Exported once: the pool lets go of it, the device does not.
                self.blocks[i].state = BLOCK_LIMBO;
                let p = &mut self.pools[pool];
                p.reserved = p.reserved.saturating_sub(size);
                p.limbo += size;
            } else {
                self.blocks[i].state = BLOCK_HOLE;
                self.unreserve(pool, size);
                work.release.push((offset, size));
            }
            self.coalesce(i);
        }
    }

    /// Forgets pool `slot` and its blocks; its reserved memory goes back to the device, its
    /// memory in limbo once no live process holds an import of it ([`State::pool_sweep`]).
    pub(in crate::sim) fn pool_drop(&mut self, pool: usize, work: &mut MemoryWork) {
        let reserved = self.pools[pool].reserved;
        self.unreserve(pool, reserved);
        for b in self
            .blocks
            .iter_mut()
            .filter(|b| b.pool as usize == pool && b.state != BLOCK_EMPTY)
        {
            work.release.push((b.offset, b.size));
            *b = empty_block();
        }
        let p = &mut self.pools[pool];
        p.reserved = 0;
        p.used = 0;
        p.state = if p.limbo > 0 { POOL_LIMBO } else { POOL_FREE };
    }

    /// `pid` imported (`up`) or destroyed its import of pool `slot`.
    pub(in crate::sim) fn pool_hold(&mut self, slot: usize, pid: u32, up: bool) {
        let r = &mut self.pools[slot];
        if let Some(h) = r.importers.iter_mut().find(|h| h.count > 0 && h.pid == pid) {
            h.count = if up { h.count + 1 } else { h.count - 1 };
        } else if up && let Some(h) = r.importers.iter_mut().find(|h| h.count == 0) {
            *h = VmmHolder { pid, count: 1 };
        }
    }

    /// Gives back the memory in limbo of every destroyed pool no live process holds an
    /// import of.
    pub(in crate::sim) fn pool_sweep(&mut self, alive: impl Fn(u32) -> bool) {
        for i in 0..MAX_POOLS {
            let r = &mut self.pools[i];
            if r.state != POOL_LIMBO || r.importers.iter().any(|h| h.count > 0 && alive(h.pid)) {
                continue;
            }
            let (device, limbo) = (r.device as usize, r.limbo);
            r.limbo = 0;
            r.state = POOL_FREE;
            if let Some(d) = self.devices.get_mut(device) {
                d.reserved = d.reserved.saturating_sub(limbo);
            }
        }
    }

    /// Live imports of block `i` at `generation`, after dropping those of dead processes.
    pub(in crate::sim) fn live_importers(
        &mut self,
        i: usize,
        generation: u64,
        alive: impl Fn(u32) -> bool,
    ) -> Vec<u32> {
        let mut pids = Vec::new();
        for imp in self.imports.iter_mut() {
            if imp.live == 1 && imp.block == i as u64 && imp.generation == generation {
                if alive(imp.pid) {
                    pids.push(imp.pid);
                } else {
                    // The real driver dropped the dead process's imports at its exit.
                    imp.live = 0;
                }
            }
        }
        pids
    }
}

fn empty_block() -> BlockRec {
    BlockRec {
        state: BLOCK_EMPTY,
        pool: 0,
        exported: 0,
        _pad: 0,
        offset: 0,
        size: 0,
        bytes: 0,
        generation: 0,
        label: [0; super::LABEL_BYTES],
    }
}
