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
//! # A recycled address: the blob reused, once proven
//!
//! On driver 580 (`reuse_blob.py`, docs/facts.md, measured 2026-12-04) the export of an
//! address is the same 64 bytes every time, and a worker importing an old allocation's blob
//! reaches the allocation that lives at that address *now*: it reads the new bytes, its writes
//! reach the parent. The import maps the range the blob was made for (its size), whatever
//! lives there now. So a new allocation at a cached address **with the cached size** needs no
//! `cuMemPoolExportPointer`: the cached blob maps exactly its range. This is undocumented, so
//! it is used only once [`ExportReuse::Proven`]: a startup check (the canary battery's, see
//! `poolipc::canary`) exported an allocation, freed it, got a new allocation of the same size
//! at the same address, and had a real worker import the old blob, read the new bytes and
//! write into it. Until then, and for good if the check fails or cannot be made
//! ([`ExportReuse::NotProven`]), a changed buffer id means a new export, as before. A
//! different size never reuses a blob, proven or not: the worker's mapping would not be the
//! live allocation's range (larger: it would reach past it).
//!
//! Ordering is unchanged by reuse: the blob names an address range, and the contract orders
//! every access to it (the parent frees the old allocation only after the worker's ACK, behind
//! its DONE; the pool hands the address out again after that free; the worker touches the new
//! allocation only after the READY recorded after it was written). The worker's side of this,
//! and why its import cache keyed by blob stays sound, is written down at its `Import` action
//! (`poolipc`'s `worker.rs`).
//!
//! Security: nothing new. A worker holding the pool's FD and any blob of the pool reaches that
//! range of the pool, whatever lives there now, with or without this cache: the pool FD is a
//! capability to the pool, not to one tensor (docs/facts.md). Reusing blobs hands a worker no
//! blob it could not have kept from an earlier job. Workers that must not see each other's
//! memory are the hostile-worker issue's to handle, not this cache's.
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

/// Whether a new allocation at a cached address, of the cached size, may reuse the cached
/// blob instead of being exported: what the startup check found (see the crate docs,
/// *Export reuse at a recycled address*).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExportReuse {
    /// Not checked yet: every new allocation is exported.
    #[default]
    Unchecked,
    /// The check is running now (it lets one address of one size reuse its blob, on trial).
    Checking,
    /// The check proved it on this driver: a recycled address of the same size reuses its
    /// blob.
    Proven,
    /// The check failed or could not be made: every new allocation is exported, as without
    /// reuse.
    NotProven,
}

impl fmt::Display for ExportReuse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExportReuse::Unchecked => "not checked (exported every time)",
            ExportReuse::Checking => "being checked",
            ExportReuse::Proven => "proven (a recycled address of the same size reuses its blob)",
            ExportReuse::NotProven => "not proven (exported every time)",
        })
    }
}

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
    /// Exports of a new allocation at a cached address, of the cached size, served with the
    /// cached blob because reuse is [proven](ExportReuse::Proven) (or on trial): no
    /// `cuMemPoolExportPointer`. Counted apart from `hits` and `stale`.
    pub reused: u64,
    /// Bytes of allocations whose export a reuse saved (the sum of their sizes).
    pub reused_bytes: u64,
    /// Whether a recycled address may reuse its blob.
    pub reuse: ExportReuse,
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
            "export cache: {} hits ({:.1} MiB not exported again), {} reused at a recycled \
             address ({:.1} MiB), {} misses, {} stale, {} evictions, {} uncached; {} of {} \
             entries; reuse {}",
            self.hits,
            self.bytes_saved as f64 / MIB,
            self.reused,
            self.reused_bytes as f64 / MIB,
            self.misses,
            self.stale,
            self.evictions,
            self.uncached,
            self.entries,
            self.capacity,
            self.reuse
        )
    }
}

/// What [`ExportCache::lookup`] found for an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// The cached export of this very allocation.
    Hit(ExportBlob),
    /// The cached export of an earlier allocation at this address of the same size, served
    /// for the new one because reuse is proven (or on trial for this address); the entry now
    /// belongs to the new allocation.
    Reused(ExportBlob),
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
    /// While the reuse check runs: the one address and size that may reuse its blob, and
    /// whether a lookup did.
    trial: Option<Trial>,
    /// Why reuse is not proven, once the check said so.
    reuse_note: Option<String>,
    /// The mutation switch of the property test: serve an entry whatever the buffer id.
    #[cfg(test)]
    skip_id_check: bool,
    /// The mutation switch of the property test: reuse a blob whatever the sizes.
    #[cfg(test)]
    skip_size_check: bool,
}

#[derive(Clone, Copy, Debug)]
struct Trial {
    base: u64,
    bytes: u64,
    used: bool,
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
                trial: None,
                reuse_note: None,
                #[cfg(test)]
                skip_id_check: false,
                #[cfg(test)]
                skip_size_check: false,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The lock guards plain bookkeeping that is consistent between statements.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached export at `base` if it belongs to the allocation whose buffer id is
    /// `buffer_id` now, or, when reuse is proven (or on trial for `base`), if it belongs to an
    /// earlier allocation there of the same size as the live one (`bytes`, as
    /// `cuMemGetAddressRange` gives it; `None` when unknown: no reuse). Any other entry is
    /// stale and dropped.
    pub(crate) fn lookup(&self, base: u64, buffer_id: u64, bytes: Option<u64>) -> Lookup {
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
            #[cfg(not(test))]
            let same_size = bytes == Some(e.bytes);
            #[cfg(test)]
            let same_size = bytes == Some(e.bytes) || (bytes.is_some() && inner.skip_size_check);
            let trial = inner
                .trial
                .as_mut()
                .filter(|t| t.base == base && Some(t.bytes) == bytes);
            let allowed = inner.stats.reuse == ExportReuse::Proven || trial.is_some();
            if same_size && allowed {
                if let Some(t) = trial {
                    t.used = true;
                }
                // The entry is the new allocation's now: the same blob, its buffer id.
                e.buffer_id = buffer_id;
                inner.last_stamp += 1;
                e.stamp = inner.last_stamp;
                inner.stats.reused += 1;
                inner.stats.reused_bytes = inner.stats.reused_bytes.saturating_add(e.bytes);
                let blob = e.blob;
                inner.order.push_back((base, inner.last_stamp));
                inner.compact();
                return Lookup::Reused(blob);
            }
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
    #[cfg(test)]
    pub(crate) fn forget(&self, base: u64) {
        self.lock().entries.remove(&base);
    }

    /// Drops the entry at `base` (its allocation was freed through the pool) unless a later
    /// allocation there of the same size may reuse it (reuse proven, or on trial there).
    pub(crate) fn forget_unless_reusable(&self, base: u64) {
        let mut g = self.lock();
        let keep = g.stats.reuse == ExportReuse::Proven || g.trial.is_some_and(|t| t.base == base);
        if !keep {
            g.entries.remove(&base);
        }
    }

    /// Drops every entry (the pool gave its memory back: a later allocation at a cached
    /// address is new memory, which the check did not prove reuse for).
    pub(crate) fn clear(&self) {
        let mut g = self.lock();
        g.entries.clear();
        g.order.clear();
    }

    /// Counts an export made without the cache.
    pub(crate) fn count_uncached(&self) {
        self.lock().stats.uncached += 1;
    }

    /// Whether a recycled address may reuse its blob now (proven, or a check on trial).
    pub(crate) fn may_reuse(&self) -> bool {
        let g = self.lock();
        g.stats.reuse == ExportReuse::Proven || g.trial.is_some()
    }

    /// What the check found so far, and why not, where it said so.
    pub(crate) fn reuse(&self) -> (ExportReuse, Option<String>) {
        let g = self.lock();
        (g.stats.reuse, g.reuse_note.clone())
    }

    /// Starts the reuse check if nothing checked yet: `false` when it ran or runs already.
    pub(crate) fn begin_check(&self) -> bool {
        let mut g = self.lock();
        if g.stats.reuse != ExportReuse::Unchecked {
            return false;
        }
        g.stats.reuse = ExportReuse::Checking;
        true
    }

    /// Lets the allocation of `bytes` at `base` reuse its cached blob while the check runs.
    pub(crate) fn set_trial(&self, base: u64, bytes: u64) {
        self.lock().trial = Some(Trial {
            base,
            bytes,
            used: false,
        });
    }

    /// Whether a lookup reused the trial's blob.
    pub(crate) fn trial_used(&self) -> bool {
        self.lock().trial.is_some_and(|t| t.used)
    }

    /// Ends the check: `Some(Ok)` proven, `Some(Err(why))` not proven, `None` inconclusive
    /// (unchecked again, for a later check). The trial's entry is dropped either way if the
    /// trial served it: unless proven, it may hold a blob that does not reach its allocation.
    pub(crate) fn end_check(&self, verdict: Option<Result<(), String>>) {
        let mut g = self.lock();
        // An entry the trial served may hold a blob that does not reach its allocation; one
        // it did not serve is an export like any other.
        if let Some(t) = g.trial.take().filter(|t| t.used) {
            g.entries.remove(&t.base);
        }
        let (reuse, note) = match verdict {
            Some(Ok(())) => (ExportReuse::Proven, None),
            Some(Err(why)) => (ExportReuse::NotProven, Some(why)),
            None => (ExportReuse::Unchecked, None),
        };
        g.stats.reuse = reuse;
        g.reuse_note = note;
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

    /// The mutation switch: with it on, a blob is reused whatever the sizes.
    #[cfg(test)]
    pub(crate) fn set_skip_size_check(&self, on: bool) {
        self.lock().skip_size_check = on;
    }

    /// Sets what the check found, for tests that need reuse without a worker.
    #[cfg(test)]
    pub(crate) fn set_reuse(&self, reuse: ExportReuse) {
        self.lock().stats.reuse = reuse;
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
mod tests {
    use super::*;

    fn blob(n: u8) -> ExportBlob {
        ExportBlob([n; 64])
    }

    #[test]
    fn an_entry_is_served_only_for_the_buffer_id_it_was_cached_with() {
        let c = ExportCache::new(4);
        assert_eq!(c.lookup(0x1000, 7, None), Lookup::Miss);
        c.insert(0x1000, 7, blob(1), 100);
        assert_eq!(c.lookup(0x1000, 7, None), Lookup::Hit(blob(1)));
        assert_eq!(c.lookup(0x1000, 8, None), Lookup::Stale);
        // The stale entry is gone: the next look finds nothing.
        assert_eq!(c.lookup(0x1000, 7, None), Lookup::Miss);
    }

    #[test]
    fn the_stats_count_hits_misses_stale_entries_and_the_bytes_hits_saved() {
        let c = ExportCache::new(4);
        c.lookup(0x1000, 1, None);
        c.insert(0x1000, 1, blob(1), 300);
        c.lookup(0x1000, 1, None);
        c.lookup(0x1000, 1, None);
        c.lookup(0x1000, 2, None);
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
        assert_eq!(c.lookup(0xa, 1, None), Lookup::Hit(blob(1)));
        c.insert(0xc, 3, blob(3), 1);
        assert_eq!(c.lookup(0xb, 2, None), Lookup::Miss);
        assert_eq!(c.lookup(0xa, 1, None), Lookup::Hit(blob(1)));
        assert_eq!(c.lookup(0xc, 3, None), Lookup::Hit(blob(3)));
        let s = c.stats();
        assert_eq!((s.entries, s.evictions), (2, 1));
    }

    #[test]
    fn replacing_an_entry_does_not_evict() {
        let c = ExportCache::new(1);
        c.insert(0xa, 1, blob(1), 1);
        c.insert(0xa, 2, blob(2), 1);
        assert_eq!(c.lookup(0xa, 2, None), Lookup::Hit(blob(2)));
        assert_eq!(c.stats().evictions, 0);
    }

    #[test]
    fn the_cache_never_holds_more_than_its_capacity() {
        let c = ExportCache::new(8);
        for i in 0..1000u64 {
            c.insert(i % 37, i, blob(1), 1);
            c.lookup((i * 7) % 37, i, None);
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
        assert_eq!(
            c.lookup(3, 3, None),
            Lookup::Hit(blob(1)),
            "the newest stays"
        );
        c.set_capacity(0);
        c.insert(9, 9, blob(1), 1);
        assert_eq!(c.stats().entries, 0);
        assert_eq!(c.stats().evictions, 4);
    }

    #[test]
    fn cleared_entries_are_misses_and_a_reusable_entry_outlives_a_free_only_once_proven() {
        let c = ExportCache::new(4);
        c.insert(0xa, 1, blob(1), 1);
        c.forget_unless_reusable(0xa);
        assert_eq!(c.lookup(0xa, 1, None), Lookup::Miss, "unproven: dropped");
        c.set_reuse(ExportReuse::Proven);
        c.insert(0xa, 1, blob(1), 1);
        c.forget_unless_reusable(0xa);
        assert_eq!(
            c.lookup(0xa, 2, Some(1)),
            Lookup::Reused(blob(1)),
            "proven: kept"
        );
        c.clear();
        assert_eq!(c.lookup(0xa, 2, Some(1)), Lookup::Miss);
        assert_eq!(c.stats().entries, 0);
    }

    #[test]
    fn a_forgotten_entry_is_a_miss() {
        let c = ExportCache::new(4);
        c.insert(0xa, 1, blob(1), 1);
        c.forget(0xa);
        assert_eq!(c.lookup(0xa, 1, None), Lookup::Miss);
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
            reused: 7,
            reused_bytes: 7 << 30,
            reuse: ExportReuse::Proven,
            entries: 6,
            capacity: 4096,
        };
        assert_eq!(
            s.to_string(),
            "export cache: 3 hits (3.0 MiB not exported again), 7 reused at a recycled address \
             (7168.0 MiB), 2 misses, 1 stale, 4 evictions, 5 uncached; 6 of 4096 entries; reuse \
             proven (a recycled address of the same size reuses its blob)"
        );
    }

    #[test]
    fn a_recycled_address_of_the_same_size_reuses_its_blob_once_proven() {
        let c = ExportCache::new(4);
        c.set_reuse(ExportReuse::Proven);
        c.insert(0x1000, 7, blob(1), 100);
        assert_eq!(c.lookup(0x1000, 8, Some(100)), Lookup::Reused(blob(1)));
        // The entry is the new allocation's now: a hit for it.
        assert_eq!(c.lookup(0x1000, 8, None), Lookup::Hit(blob(1)));
        let s = c.stats();
        assert_eq!((s.reused, s.reused_bytes, s.hits, s.stale), (1, 100, 1, 0));
    }

    #[test]
    fn a_recycled_address_of_another_size_never_reuses_its_blob() {
        let c = ExportCache::new(4);
        c.set_reuse(ExportReuse::Proven);
        c.insert(0x1000, 7, blob(1), 100);
        assert_eq!(c.lookup(0x1000, 8, Some(50)), Lookup::Stale);
        c.insert(0x1000, 8, blob(2), 50);
        assert_eq!(c.lookup(0x1000, 9, Some(100)), Lookup::Stale);
        c.insert(0x1000, 9, blob(3), 100);
        assert_eq!(c.lookup(0x1000, 10, None), Lookup::Stale, "size unknown");
        assert_eq!(c.stats().reused, 0);
    }

    #[test]
    fn unless_proven_a_recycled_address_is_exported_again() {
        for reuse in [
            ExportReuse::Unchecked,
            ExportReuse::Checking,
            ExportReuse::NotProven,
        ] {
            let c = ExportCache::new(4);
            c.set_reuse(reuse);
            c.insert(0x1000, 7, blob(1), 100);
            assert_eq!(c.lookup(0x1000, 8, Some(100)), Lookup::Stale, "{reuse:?}");
        }
    }

    #[test]
    fn the_check_s_trial_reuses_only_its_address_and_size_and_its_entry_goes_after() {
        let c = ExportCache::new(4);
        assert!(c.begin_check());
        assert!(!c.begin_check(), "one check at a time");
        c.insert(0x1000, 1, blob(1), 100);
        c.insert(0x2000, 2, blob(2), 100);
        c.set_trial(0x1000, 100);
        assert!(!c.trial_used());
        assert_eq!(c.lookup(0x2000, 3, Some(100)), Lookup::Stale);
        assert_eq!(c.lookup(0x1000, 4, Some(100)), Lookup::Reused(blob(1)));
        assert!(c.trial_used());
        c.end_check(Some(Err("the worker read the old bytes".into())));
        assert_eq!(c.lookup(0x1000, 4, Some(100)), Lookup::Miss);
        assert_eq!(
            c.reuse(),
            (
                ExportReuse::NotProven,
                Some("the worker read the old bytes".into())
            )
        );
        assert!(!c.begin_check(), "not proven stays");
    }

    #[test]
    fn an_inconclusive_check_can_be_made_again_and_a_proven_one_reuses_everywhere() {
        let c = ExportCache::new(4);
        assert!(c.begin_check());
        c.end_check(None);
        assert_eq!(c.reuse().0, ExportReuse::Unchecked);
        assert!(c.begin_check());
        c.end_check(Some(Ok(())));
        assert!(c.may_reuse());
        c.insert(0x2000, 2, blob(2), 100);
        assert_eq!(c.lookup(0x2000, 3, Some(100)), Lookup::Reused(blob(2)));
    }
}
