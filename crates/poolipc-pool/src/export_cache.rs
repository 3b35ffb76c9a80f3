//! `ExportCache`: the parent's pointer exports, kept while their allocation lives.
//!
//! `cuMemPoolExportPointer` costs about 0.43 ms/GiB every time, also for an allocation it
//! exported before; the driver caches nothing (docs/facts.md). The 64-byte blob of a live
//! allocation does not change, so it can be kept. What can change is the allocation behind an
//! address: torch frees through `cudaFreeAsync` without telling us, and the pool hands the
//! address out again. `CU_POINTER_ATTRIBUTE_BUFFER_ID` tells the two apart: it is new for
//! every allocation, the same for every query of a live one. So an entry is the allocation's
//! base address with the buffer id it had when exported, and one buffer-id query validates it.
//!
//! The cache only keeps and checks entries; [`SharedPool::export`](crate::SharedPool::export)
//! makes the driver calls, outside the lock.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use poolipc_driver::ExportBlob;

/// How many exports a [`SharedPool`](crate::SharedPool) keeps unless told otherwise
/// ([`SharedPool::set_export_cache_capacity`](crate::SharedPool::set_export_cache_capacity)).
pub const DEFAULT_EXPORT_CACHE_ENTRIES: usize = 4096;

/// What the export cache has done so far, from
/// [`SharedPool::export_cache_stats`](crate::SharedPool::export_cache_stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExportCacheStats {
    /// Exports served from the cache: the allocation's buffer id was the cached one.
    pub hits: u64,
    /// Exports of an address the cache held nothing for.
    pub misses: u64,
    /// Exports of an address whose cached entry belonged to an earlier allocation there (the
    /// buffer id had changed): exported again, and the entry replaced.
    pub stale: u64,
    /// Entries dropped to stay within the capacity, least recently used first.
    pub evictions: u64,
    /// Exports made without the cache because the buffer-id query failed.
    pub uncached: u64,
    /// Bytes of allocations whose export a hit saved (the sum of their sizes).
    pub bytes_saved: u64,
    /// Entries held now.
    pub entries: usize,
    /// The most entries held at once.
    pub capacity: usize,
}

impl fmt::Display for ExportCacheStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MIB: f64 = (1u64 << 20) as f64;
        write!(
            f,
            "export cache: {} hits ({:.1} MiB not exported again), {} misses, {} stale, \
             {} evictions, {} uncached; {} of {} entries",
            self.hits,
            self.bytes_saved as f64 / MIB,
            self.misses,
            self.stale,
            self.evictions,
            self.uncached,
            self.entries,
            self.capacity
        )
    }
}

/// What [`ExportCache::lookup`] found for an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// The cached export of this very allocation.
    Hit(ExportBlob),
    /// Nothing cached at this address.
    Miss,
    /// The entry was an earlier allocation's; it is gone now.
    Stale,
}

#[derive(Debug)]
struct Entry {
    buffer_id: u64,
    blob: ExportBlob,
    bytes: u64,
    /// When it was last used; matches its newest pair in `Inner::order`.
    stamp: u64,
}

#[derive(Debug)]
struct Inner {
    capacity: usize,
    entries: HashMap<u64, Entry>,
    /// (base, stamp) at each use, oldest first. A pair whose stamp is no longer its entry's
    /// is a leftover of a later use or of a removal, skipped at eviction and dropped when the
    /// queue is compacted: eviction and use stay O(1) amortized.
    order: VecDeque<(u64, u64)>,
    last_stamp: u64,
    stats: ExportCacheStats,
    /// The mutation switch of the property test: serve an entry whatever the buffer id.
    #[cfg(test)]
    skip_id_check: bool,
}

/// Pointer exports by allocation base, each with the buffer id of the allocation it belongs
/// to; bounded, least recently used out first, safe to share between threads.
#[derive(Debug)]
pub(crate) struct ExportCache {
    inner: Mutex<Inner>,
}

impl ExportCache {
    /// An empty cache of at most `capacity` entries (0: it keeps nothing).
    pub(crate) fn new(capacity: usize) -> ExportCache {
        ExportCache {
            inner: Mutex::new(Inner {
                capacity,
                entries: HashMap::new(),
                order: VecDeque::new(),
                last_stamp: 0,
                stats: ExportCacheStats {
                    capacity,
                    ..ExportCacheStats::default()
                },
                #[cfg(test)]
                skip_id_check: false,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The lock guards plain bookkeeping that is consistent between statements.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached export at `base` if it belongs to the allocation whose buffer id is
    /// `buffer_id` now. A stale entry is dropped.
    pub(crate) fn lookup(&self, base: u64, buffer_id: u64) -> Lookup {
        let mut g = self.lock();
        let inner = &mut *g;
        let Some(e) = inner.entries.get_mut(&base) else {
            inner.stats.misses += 1;
            return Lookup::Miss;
        };
        #[cfg(not(test))]
        let same = e.buffer_id == buffer_id;
        #[cfg(test)]
        let same = e.buffer_id == buffer_id || inner.skip_id_check;
        if !same {
            inner.entries.remove(&base);
            inner.stats.stale += 1;
            return Lookup::Stale;
        }
        inner.last_stamp += 1;
        e.stamp = inner.last_stamp;
        inner.stats.hits += 1;
        inner.stats.bytes_saved = inner.stats.bytes_saved.saturating_add(e.bytes);
        let blob = e.blob;
        inner.order.push_back((base, inner.last_stamp));
        inner.compact();
        Lookup::Hit(blob)
    }

    /// Keeps `blob`, the export of the allocation of `bytes` at `base` whose buffer id is
    /// `buffer_id`, replacing what was cached there. Evicts the least recently used entry when
    /// full.
    pub(crate) fn insert(&self, base: u64, buffer_id: u64, blob: ExportBlob, bytes: u64) {
        let mut g = self.lock();
        let inner = &mut *g;
        if inner.capacity == 0 {
            return;
        }
        if !inner.entries.contains_key(&base) && inner.entries.len() >= inner.capacity {
            inner.evict_one();
        }
        inner.last_stamp += 1;
        let stamp = inner.last_stamp;
        inner.entries.insert(
            base,
            Entry {
                buffer_id,
                blob,
                bytes,
                stamp,
            },
        );
        inner.order.push_back((base, stamp));
        inner.compact();
    }

    /// Drops the entry at `base`, if any (its allocation was freed through the pool).
    pub(crate) fn forget(&self, base: u64) {
        self.lock().entries.remove(&base);
    }

    /// Counts an export made without the cache.
    pub(crate) fn count_uncached(&self) {
        self.lock().stats.uncached += 1;
    }

    /// Keeps at most `capacity` entries from now on, evicting the least recently used.
    pub(crate) fn set_capacity(&self, capacity: usize) {
        let mut g = self.lock();
        g.capacity = capacity;
        g.stats.capacity = capacity;
        while g.entries.len() > capacity {
            g.evict_one();
        }
        g.compact();
    }

    /// The counters, and the entries held now.
    pub(crate) fn stats(&self) -> ExportCacheStats {
        let g = self.lock();
        ExportCacheStats {
            entries: g.entries.len(),
            ..g.stats
        }
    }

    /// The mutation switch: with it on, an entry is served without comparing buffer ids.
    #[cfg(test)]
    pub(crate) fn set_skip_id_check(&self, on: bool) {
        self.lock().skip_id_check = on;
    }
}

impl Inner {
    fn evict_one(&mut self) {
        while let Some((base, stamp)) = self.order.pop_front() {
            if self.entries.get(&base).is_some_and(|e| e.stamp == stamp) {
                self.entries.remove(&base);
                self.stats.evictions += 1;
                return;
            }
        }
    }

    /// Drops leftover pairs once they outnumber the live ones: O(n) every n uses at least.
    fn compact(&mut self) {
        if self.order.len() > 2 * self.entries.len() + 64 {
            let entries = &self.entries;
            self.order
                .retain(|(base, stamp)| entries.get(base).is_some_and(|e| e.stamp == *stamp));
        }
    }
}

#[cfg(test)]
mod property;

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(n: u8) -> ExportBlob {
        ExportBlob([n; 64])
    }

    #[test]
    fn an_entry_is_served_only_for_the_buffer_id_it_was_cached_with() {
        let c = ExportCache::new(4);
        assert_eq!(c.lookup(0x1000, 7), Lookup::Miss);
        c.insert(0x1000, 7, blob(1), 100);
        assert_eq!(c.lookup(0x1000, 7), Lookup::Hit(blob(1)));
        assert_eq!(c.lookup(0x1000, 8), Lookup::Stale);
        // The stale entry is gone: the next look finds nothing.
        assert_eq!(c.lookup(0x1000, 7), Lookup::Miss);
    }

    #[test]
    fn the_stats_count_hits_misses_stale_entries_and_the_bytes_hits_saved() {
        let c = ExportCache::new(4);
        c.lookup(0x1000, 1);
        c.insert(0x1000, 1, blob(1), 300);
        c.lookup(0x1000, 1);
        c.lookup(0x1000, 1);
        c.lookup(0x1000, 2);
        c.count_uncached();
        let s = c.stats();
        assert_eq!(
            (s.hits, s.misses, s.stale, s.evictions, s.uncached),
            (2, 1, 1, 0, 1)
        );
        assert_eq!((s.bytes_saved, s.entries, s.capacity), (600, 0, 4));
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used_entry() {
        let c = ExportCache::new(2);
        c.insert(0xa, 1, blob(1), 1);
        c.insert(0xb, 2, blob(2), 1);
        // Using 0xa makes 0xb the least recently used.
        assert_eq!(c.lookup(0xa, 1), Lookup::Hit(blob(1)));
        c.insert(0xc, 3, blob(3), 1);
        assert_eq!(c.lookup(0xb, 2), Lookup::Miss);
        assert_eq!(c.lookup(0xa, 1), Lookup::Hit(blob(1)));
        assert_eq!(c.lookup(0xc, 3), Lookup::Hit(blob(3)));
        let s = c.stats();
        assert_eq!((s.entries, s.evictions), (2, 1));
    }

    #[test]
    fn replacing_an_entry_does_not_evict() {
        let c = ExportCache::new(1);
        c.insert(0xa, 1, blob(1), 1);
        c.insert(0xa, 2, blob(2), 1);
        assert_eq!(c.lookup(0xa, 2), Lookup::Hit(blob(2)));
        assert_eq!(c.stats().evictions, 0);
    }

    #[test]
    fn the_cache_never_holds_more_than_its_capacity() {
        let c = ExportCache::new(8);
        for i in 0..1000u64 {
            c.insert(i % 37, i, blob(1), 1);
            c.lookup((i * 7) % 37, i);
            assert!(c.stats().entries <= 8);
        }
        let g = c.lock();
        assert!(
            g.order.len() <= 2 * g.entries.len() + 64 + 1,
            "the use queue is compacted: {} pairs",
            g.order.len()
        );
    }

    #[test]
    fn lowering_the_capacity_evicts_down_to_it_and_zero_keeps_nothing() {
        let c = ExportCache::new(4);
        for i in 0..4 {
            c.insert(i, i, blob(1), 1);
        }
        c.set_capacity(1);
        assert_eq!(c.stats().entries, 1);
        assert_eq!(c.lookup(3, 3), Lookup::Hit(blob(1)), "the newest stays");
        c.set_capacity(0);
        c.insert(9, 9, blob(1), 1);
        assert_eq!(c.stats().entries, 0);
        assert_eq!(c.stats().evictions, 4);
    }

    #[test]
    fn a_forgotten_entry_is_a_miss() {
        let c = ExportCache::new(4);
        c.insert(0xa, 1, blob(1), 1);
        c.forget(0xa);
        assert_eq!(c.lookup(0xa, 1), Lookup::Miss);
    }

    #[test]
    fn the_stats_display_names_every_counter() {
        let s = ExportCacheStats {
            hits: 3,
            misses: 2,
            stale: 1,
            evictions: 4,
            uncached: 5,
            bytes_saved: 3 << 20,
            entries: 6,
            capacity: 4096,
        };
        assert_eq!(
            s.to_string(),
            "export cache: 3 hits (3.0 MiB not exported again), 2 misses, 1 stale, 4 evictions, \
             5 uncached; 6 of 4096 entries"
        );
    }
}
