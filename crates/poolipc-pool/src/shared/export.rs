//! Pointer export for workers, through the export cache (see the crate's docs: a hit costs one
//! attribute query instead of `cuMemPoolExportPointer`), and the cache's settings and figures.

use poolipc_driver::{DevicePtr, Driver, ExportBlob};

use super::{PoolError, SharedPool};
use crate::export_cache::{ExportCacheStats, Lookup};

/// How [`SharedPool::export_traced`] got its blob (tests check what the cache served).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Served {
    /// From the cache, for the allocation of this buffer id.
    Cached { buffer_id: u64 },
    /// From the cache, the blob of an earlier allocation at this address of the same size,
    /// reused for the allocation of this buffer id (reuse proven or on trial).
    Reused { buffer_id: u64 },
    /// From `cuMemPoolExportPointer`.
    Exported,
}

impl<D: Driver + ?Sized> SharedPool<D> {
    /// Export `ptr` for import by a worker, refusing pointers of other pools.
    ///
    /// `cuMemPoolExportPointer` costs about 0.43 ms/GiB each time, so the export of an
    /// allocation's base is cached while that allocation lives: one
    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_BUFFER_ID)` tells whether the address still
    /// holds the allocation the cached blob was made for (a hit: nothing else is called) or a
    /// later one the pool handed out there (the export is made again and replaces the entry).
    /// Only exports of this pool's allocations are cached, so a hit needs no pool check. When
    /// the buffer id cannot be read, the export is made as without a cache.
    ///
    /// Once [export reuse](SharedPool::export_reuse) is proven, a new allocation at a cached
    /// address whose size is the cached one reuses the cached blob: the driver's blob of an
    /// address maps that range, whatever lives there now (see the export cache's module
    /// docs). A different size is exported again.
    pub fn export(&self, ptr: DevicePtr) -> Result<ExportBlob, PoolError> {
        self.export_traced(ptr).map(|(blob, _)| blob)
    }

    /// [`export`](SharedPool::export), saying whether the blob came from the cache.
    pub(crate) fn export_traced(&self, ptr: DevicePtr) -> Result<(ExportBlob, Served), PoolError> {
        let buffer_id = match self.driver.pointer_get_buffer_id(ptr) {
            Ok(id) => id,
            Err(e) => {
                tracing::debug!(?ptr, error = %e, "no buffer id: exporting without the cache");
                self.exports.count_uncached();
                return Ok((self.export_uncached(ptr)?, Served::Exported));
            }
        };
        // The live allocation's size, for a reuse: only where one may happen (one query
        // more), and only for an allocation's base in this pool.
        let bytes = if self.exports.may_reuse() {
            match (
                self.driver.pointer_get_range(ptr),
                self.driver.pointer_get_mempool(ptr),
            ) {
                (Ok((base, bytes)), Ok(pool)) if base == ptr && self.is_generation(pool) => {
                    Some(bytes)
                }
                _ => None,
            }
        } else {
            None
        };
        match self.exports.lookup(ptr.0, buffer_id, bytes) {
            Lookup::Hit(blob) => {
                tracing::trace!(?ptr, buffer_id, "export cache hit");
                return Ok((blob, Served::Cached { buffer_id }));
            }
            Lookup::Reused(blob) => {
                tracing::trace!(
                    ?ptr,
                    buffer_id,
                    ?bytes,
                    "export cache: a recycled address of the same size reuses its blob"
                );
                return Ok((blob, Served::Reused { buffer_id }));
            }
            Lookup::Stale => {
                tracing::trace!(
                    ?ptr,
                    buffer_id,
                    "export cache: the address holds a new allocation"
                );
            }
            Lookup::Miss => tracing::trace!(?ptr, buffer_id, "export cache miss"),
        }
        let blob = self.export_uncached(ptr)?;
        // Keep the blob only if it is the export of an allocation's base, and that allocation
        // is still the one whose id we read before exporting (another thread may have freed
        // it, and the pool handed the address out again, meanwhile).
        let after = self.driver.pointer_get_buffer_id(ptr);
        let range = self.driver.pointer_get_range(ptr);
        match (after, range) {
            (Ok(after), Ok((base, bytes))) if after == buffer_id && base == ptr => {
                self.exports.insert(ptr.0, buffer_id, blob, bytes);
            }
            (after, range) => tracing::debug!(
                ?ptr,
                buffer_id,
                ?after,
                ?range,
                "export not cached: not an allocation's base, or the allocation changed"
            ),
        }
        Ok((blob, Served::Exported))
    }

    /// The export without the cache: the pool check, then `cuMemPoolExportPointer`.
    /// [`export`](SharedPool::export) of an allocation of this pool whose base, size and
    /// buffer id the caller has just read in one query (`Driver::pointer_info`): a cache hit
    /// then costs no driver call at all, a miss only the export. An entry is keyed by the
    /// buffer id read before the export, so even if the allocation died meanwhile (the
    /// caller's misuse), the entry can only be found by that id again, which no later
    /// allocation has; or, once reuse is proven, by a later allocation of the same `size`
    /// there, which the blob reaches (the pool check is the caller's: `base` is this pool's).
    pub fn export_known(
        &self,
        base: DevicePtr,
        size: u64,
        buffer_id: Option<u64>,
    ) -> Result<ExportBlob, PoolError> {
        let Some(id) = buffer_id else {
            self.exports.count_uncached();
            return self.export_noted(base);
        };
        match self.exports.lookup(base.0, id, Some(size)) {
            Lookup::Hit(blob) => {
                tracing::trace!(?base, buffer_id = id, "export cache hit");
                return Ok(blob);
            }
            Lookup::Reused(blob) => {
                tracing::trace!(
                    ?base,
                    buffer_id = id,
                    size,
                    "export cache: a recycled address of the same size reuses its blob"
                );
                return Ok(blob);
            }
            Lookup::Miss | Lookup::Stale => {}
        }
        let blob = self.export_noted(base)?;
        self.exports.insert(base.0, id, blob, size);
        Ok(blob)
    }

    /// `cuMemPoolExportPointer` of a pointer the caller knows is ours, noting the export on
    /// its generation: while the current generation has exported nothing, one query says
    /// whether the pointer is the current generation's (a retired one's export does not make
    /// the current one worth rotating).
    fn export_noted(&self, ptr: DevicePtr) -> Result<ExportBlob, PoolError> {
        if self.current_unexported() {
            let pool = self.driver.pointer_get_mempool(ptr)?;
            self.note_export(pool);
        }
        Ok(self.driver.mem_pool_export_pointer(ptr)?)
    }

    pub(crate) fn export_uncached(&self, ptr: DevicePtr) -> Result<ExportBlob, PoolError> {
        let found = self.driver.pointer_get_mempool(ptr)?;
        if !self.is_generation(found) {
            return Err(PoolError::ForeignPointer {
                ptr,
                pool: self.handle(),
                found,
            });
        }
        self.note_export(found);
        Ok(self.driver.mem_pool_export_pointer(ptr)?)
    }

    /// What the export cache has done: hits, misses, stale entries replaced, evictions, and
    /// the bytes whose export hits saved.
    pub fn export_cache_stats(&self) -> ExportCacheStats {
        self.exports.stats()
    }

    /// Keep at most `entries` exports from now on (default
    /// [`DEFAULT_EXPORT_CACHE_ENTRIES`](crate::DEFAULT_EXPORT_CACHE_ENTRIES)); the least
    /// recently used go first. 0 turns the cache off.
    pub fn set_export_cache_capacity(&self, entries: usize) {
        self.exports.set_capacity(entries);
    }

    /// The export cache, for the tests' mutation switch.
    #[cfg(test)]
    pub(crate) fn export_cache(&self) -> &crate::export_cache::ExportCache {
        &self.exports
    }
}
