//! The parent's arenas: one per worker, so that the chunks a worker maps hold its own blocks
//! and nothing of another worker's, all drawing on one cap.
//!
//! Every chunk of an arena is sent to its worker alone, read-write: one arena for every
//! worker would let a worker read another's arena-copied input and overwrite its result
//! after its DONE. A worker's arena is made on the IO thread at its first need (an arena
//! result, an arena copy, an arena slice), with the [`ResultMemory::Arena`] sizes; every
//! arena counts its chunks against one [`ArenaBudget`], the parent's cap. When the worker is
//! reaped its arena is retired: no block of it is granted again, its chunks go back to the
//! device as they empty (a result the caller holds keeps its chunk until dropped), and once
//! it holds none the arena is forgotten.
//!
//! [`ResultMemory::Arena`]: crate::ResultMemory::Arena

use std::collections::BTreeMap;
use std::sync::Arc;

use poolipc_driver::Driver;
use poolipc_pool::Arena;
use poolipc_pool::arena::{AllocStats, ArenaBudget};
use poolipc_types::WorkerId;

use super::ArenaStats;

/// An arena of the parent's, shared with the blocks it lent.
pub(crate) type SharedArena = Arc<Arena<dyn Driver>>;

/// Every arena of the parent, by the worker it serves.
#[derive(Default)]
pub(crate) struct Arenas {
    /// The cap every arena draws on: made with the first arena.
    budget: Option<Arc<ArenaBudget>>,
    /// Each live worker's arena.
    live: BTreeMap<WorkerId, SharedArena>,
    /// Arenas of reaped workers that still hold chunks.
    retired: BTreeMap<WorkerId, SharedArena>,
    /// Chunks and bytes released by arenas forgotten since, for the totals.
    forgotten_released: (u64, u64),
}

impl Arenas {
    /// The budget, once the first arena was made.
    pub(crate) fn budget(&self) -> Option<Arc<ArenaBudget>> {
        self.budget.clone()
    }

    /// `worker`'s arena while the worker lives.
    pub(crate) fn live(&self, worker: WorkerId) -> Option<SharedArena> {
        self.live.get(&worker).cloned()
    }

    /// `worker`'s arena, live or retired.
    pub(crate) fn of(&self, worker: WorkerId) -> Option<SharedArena> {
        self.live(worker)
            .or_else(|| self.retired.get(&worker).cloned())
    }

    /// Every live worker's arena.
    pub(crate) fn live_arenas(&self) -> Vec<(WorkerId, SharedArena)> {
        self.live.iter().map(|(w, a)| (*w, Arc::clone(a))).collect()
    }

    /// Every retired arena.
    pub(crate) fn retired_arenas(&self) -> Vec<SharedArena> {
        self.retired.values().cloned().collect()
    }

    /// Records `worker`'s new arena, made with `budget` (the first arena's sets it).
    pub(crate) fn insert(
        &mut self,
        worker: WorkerId,
        budget: Arc<ArenaBudget>,
        arena: SharedArena,
    ) {
        self.budget.get_or_insert(budget);
        self.live.insert(worker, arena);
    }

    /// `worker` was reaped: its arena, if any, grants nothing more and empties.
    pub(crate) fn retire(&mut self, worker: WorkerId) {
        if let Some(a) = self.live.remove(&worker) {
            self.retired.insert(worker, a);
        }
    }

    /// Forgets the retired arenas that hold no chunk any more.
    pub(crate) fn forget_empty(&mut self) {
        let empty: Vec<WorkerId> = self
            .retired
            .iter()
            .filter(|(_, a)| a.capacity() == 0)
            .map(|(w, _)| *w)
            .collect();
        for w in empty {
            if let Some(a) = self.retired.remove(&w) {
                let (chunks, bytes) = a.released();
                self.forgotten_released.0 += chunks;
                self.forgotten_released.1 += bytes;
                tracing::debug!(worker = %w, "a reaped worker's arena is empty: forgotten");
            }
        }
    }

    /// Every arena, live and retired.
    fn all(&self) -> impl Iterator<Item = &SharedArena> {
        self.live.values().chain(self.retired.values())
    }

    /// Frees the blocks given back whose event completed, in every arena; returns how many.
    pub(crate) fn reclaim(&self) -> usize {
        self.all().map(|a| a.reclaim()).sum()
    }

    /// The figures of every arena together (`None` before the first one was made).
    pub(crate) fn stats(&self) -> Option<ArenaStats> {
        let budget = self.budget.as_ref()?;
        let mut total = ArenaStats {
            max_bytes: budget.max_bytes(),
            released_chunks: self.forgotten_released.0,
            released_bytes: self.forgotten_released.1,
            ..ArenaStats::default()
        };
        for a in self.all() {
            total.add(&ArenaStats::of(a));
        }
        Some(total)
    }
}

impl ArenaStats {
    /// One arena's figures.
    pub(crate) fn of(a: &Arena<dyn Driver>) -> ArenaStats {
        let (released_chunks, released_bytes) = a.released();
        ArenaStats {
            alloc: a.stats(),
            pending_frees: a.pending_frees(),
            max_bytes: a.max_bytes(),
            released_chunks,
            released_bytes,
            arenas: 1,
        }
    }

    /// Adds `other`'s figures to these (the cap is the shared one: kept).
    fn add(&mut self, other: &ArenaStats) {
        let (a, b) = (&mut self.alloc, &other.alloc);
        *a = AllocStats {
            capacity: a.capacity + b.capacity,
            used: a.used + b.used,
            free: a.free + b.free,
            largest_free: a.largest_free.max(b.largest_free),
            live_blocks: a.live_blocks + b.live_blocks,
            free_ranges: a.free_ranges + b.free_ranges,
            chunks: a.chunks + b.chunks,
        };
        self.pending_frees += other.pending_frees;
        self.released_chunks += other.released_chunks;
        self.released_bytes += other.released_bytes;
        self.arenas += other.arenas;
    }
}
