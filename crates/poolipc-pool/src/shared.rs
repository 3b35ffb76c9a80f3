//! `SharedPool`: the shareable pool made the device's current pool (parent side), and
//! `AttachedPool`, the same pool imported by a worker.

use std::collections::HashSet;
use std::ops::Deref;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use poolipc_driver::{
    Access, DevicePtr, Driver, DriverError, DriverKind, ExportBlob, OwnedPool, PoolAllocation,
    PoolAttribute, PoolCounter, PoolHandle, PoolSharing, StreamHandle,
};

use crate::export_cache::{
    DEFAULT_EXPORT_CACHE_ENTRIES, ExportCache, ExportCacheStats, ExportReuse, Lookup,
};
use crate::stats::PoolStats;

/// Errors of installing, attaching or using the shared pool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// Something else already made another pool current on this device: installing ours
    /// would silently take allocations away from it.
    #[error(
        "device {device}'s current memory pool is not its default pool: something else swapped it \
         already, so poolipc will not replace it"
    )]
    CurrentPoolNotDefault {
        /// The device ordinal.
        device: u32,
    },
    /// poolipc's pool is already installed on this device in this process.
    #[error("poolipc's shared pool is already installed on device {device} in this process")]
    AlreadyInstalled {
        /// The device ordinal.
        device: u32,
    },
    /// The device cannot share a pool by POSIX file descriptor.
    #[error("device {device} does not support {what}, which the shared pool needs")]
    Unsupported {
        /// The device ordinal.
        device: u32,
        /// What is missing.
        what: &'static str,
    },
    /// A pointer offered for export does not come from this pool.
    #[error("{ptr:?} was not allocated from poolipc's pool {pool:?} (it came from {found:?})")]
    ForeignPointer {
        /// The pointer.
        ptr: DevicePtr,
        /// Our pool.
        pool: PoolHandle,
        /// The pool it belongs to.
        found: PoolHandle,
    },
    /// A rotation found another pool current on the device: something swapped ours out, and
    /// poolipc will not swap it back over theirs.
    #[error(
        "device {device}'s current memory pool is {found:?}, not poolipc's {ours:?}: something \
         else made its own pool current, so poolipc will not rotate its pool over it"
    )]
    CurrentPoolChanged {
        /// The device ordinal.
        device: u32,
        /// The pool current now.
        found: PoolHandle,
        /// Our current generation.
        ours: PoolHandle,
    },
    /// The pool named is not a retired generation of this shared pool.
    #[error("{pool:?} is not a retired generation of poolipc's pool on device {device}")]
    NotRetired {
        /// The device ordinal.
        device: u32,
        /// The pool named.
        pool: PoolHandle,
    },
    /// Uninstalling while memory is still allocated from the pool.
    #[error("the shared pool still has {used} bytes in use; free them before uninstalling")]
    InUse {
        /// Bytes in use.
        used: u64,
    },
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
}

/// Pools this process installed, by (driver kind, device, pool), so that a second install
/// says "already installed" rather than "something else swapped the pool".
static INSTALLED: Mutex<Option<HashSet<InstallKey>>> = Mutex::new(None);

type InstallKey = (DriverKind, u32, PoolHandle);

fn installed() -> std::sync::MutexGuard<'static, Option<HashSet<InstallKey>>> {
    INSTALLED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The attributes torch gives its own pool (docs/facts.md): without the release threshold every
/// handoff re-maps its memory (2.5 ms/GiB) and torch loses its cache.
pub const TORCH_POOL_ATTRIBUTES: [PoolAttribute; 4] = [
    PoolAttribute::ReleaseThreshold(u64::MAX),
    PoolAttribute::ReuseFollowEventDependencies(true),
    PoolAttribute::ReuseAllowOpportunistic(true),
    PoolAttribute::ReuseAllowInternalDependencies(true),
];

/// The parent's shareable pool, installed as the device's current pool.
///
/// Once installed, every stream-ordered allocation on the device (torch's `cudaMallocAsync`
/// backend included) comes from it, and its pointers can be exported. The pool lives as long
/// as the process: dropping a `SharedPool` leaves it installed, because memory handed out
/// from it may still be in use by code that never heard of poolipc. [`uninstall`] undoes the
/// swap when nothing is allocated.
///
/// Pointer exports are cached while their allocation lives (see [`export`]). The cache sits
/// behind a lock held only for its bookkeeping, never across a driver call, so threads
/// sharing a `SharedPool` may all export from it.
///
/// # Generations
///
/// An allocation that was exported keeps its physical memory after its free until its pool
/// is destroyed (and every worker destroyed its import of the pool): trimming does nothing
/// for it (bench/results/2026-12-04-h200-export-limbo). So the pool has generations:
/// [`rotate`] makes a new pool with the same attributes the device's current one and keeps
/// the old one *retired* (its live allocations stay valid, are exported and freed as before;
/// it makes no new ones), and [`destroy_retired`] destroys a retired generation once nothing
/// of it is in use. [`handle`] is the current generation; [`owns`], [`export`],
/// [`stats`], [`trim`] and [`uninstall`] cover every live one.
///
/// [`uninstall`]: SharedPool::uninstall
/// [`export`]: SharedPool::export
/// [`rotate`]: SharedPool::rotate
/// [`destroy_retired`]: SharedPool::destroy_retired
/// [`handle`]: SharedPool::handle
/// [`owns`]: SharedPool::owns
/// [`stats`]: SharedPool::stats
/// [`trim`]: SharedPool::trim
#[derive(Debug)]
pub struct SharedPool<D: Driver + ?Sized> {
    driver: Arc<D>,
    device: u32,
    /// Live generations, oldest first; the last is current. Locked for bookkeeping only.
    generations: Mutex<Vec<Arc<Generation>>>,
    /// Held across a rotation or a retirement (driver calls included), so that two never
    /// interleave.
    rotating: Mutex<()>,
    exports: ExportCache,
    /// The pools of the live generations, owned: destroyed by
    /// [`destroy_retired`](SharedPool::destroy_retired) and
    /// [`uninstall`](SharedPool::uninstall) only. Dropped with the `SharedPool`, they are
    /// kept (the current one is the device's current pool, which torch allocates from).
    owned: Mutex<Vec<OwnedPool<Arc<D>>>>,
}

impl<D: Driver + ?Sized> Drop for SharedPool<D> {
    fn drop(&mut self) {
        let owned = self
            .owned
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for pool in owned.drain(..) {
            // Kept on purpose: memory torch allocated from it outlives this value.
            let _ = pool.into_raw();
        }
    }
}

/// One generation of the shared pool: a pool made with torch's attributes and its FD.
#[derive(Debug)]
struct Generation {
    pool: PoolHandle,
    fd: Arc<OwnedFd>,
    /// Whether a pointer of this generation was exported since it was made.
    exported: AtomicBool,
}

/// What [`SharedPool::rotate`] did: the generation it retired and the one current now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotation {
    /// The generation retired (still valid for its live allocations).
    pub retired: PoolHandle,
    /// The new current generation.
    pub current: PoolHandle,
}

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

/// The startup check of export reuse, begun with
/// [`SharedPool::begin_export_reuse_check`]: while it is held, the one address and size
/// given to [`trial`](ReuseCheck::trial) may reuse its cached blob. Dropped without
/// [`finish`](ReuseCheck::finish), the check counts as not made (a later one may run).
#[derive(Debug)]
#[must_use = "a dropped check counts as not made"]
pub struct ReuseCheck<'p, D: Driver + ?Sized> {
    pool: &'p SharedPool<D>,
    finished: bool,
}

impl<D: Driver + ?Sized> ReuseCheck<'_, D> {
    /// Lets the allocation of `bytes` at `base` reuse its cached blob. Set it once the
    /// checker's own new allocation holds `base`, so that nothing else is lent on trial;
    /// free the earlier allocation there as torch does (not through
    /// [`SharedPool::free`], which drops the entry of an address that may not reuse it).
    pub fn trial(&self, base: DevicePtr, bytes: u64) {
        self.pool.exports.set_trial(base.0, bytes);
    }

    /// Whether an export since [`trial`](ReuseCheck::trial) reused the cached blob (if not,
    /// the check has tested nothing: the entry was evicted, or the export cache is off).
    #[must_use]
    pub fn trial_used(&self) -> bool {
        self.pool.exports.trial_used()
    }

    /// Records the verdict: `Ok` proven (a recycled address of the same size reuses its blob
    /// from now on), `Err(why)` not proven (every new allocation is exported, for good).
    pub fn finish(mut self, verdict: Result<(), String>) {
        self.finished = true;
        match &verdict {
            Ok(()) => tracing::info!(
                pool = ?self.pool.handle(),
                "poolipc: export reuse proven on this driver: a worker imported an old \
                 allocation's blob and reached the new allocation of the same size at its \
                 address; recycled addresses of the same size are not exported again"
            ),
            Err(why) => tracing::warn!(
                pool = ?self.pool.handle(),
                %why,
                "poolipc: export reuse not proven on this driver; every new allocation is \
                 exported (cuMemPoolExportPointer, about 0.4 ms/GiB)"
            ),
        }
        self.pool.exports.end_check(Some(verdict));
    }
}

impl<D: Driver + ?Sized> Drop for ReuseCheck<'_, D> {
    fn drop(&mut self) {
        if !self.finished {
            tracing::debug!("poolipc: the export reuse check was not made; it may run again");
            self.pool.exports.end_check(None);
        }
    }
}

impl<D: Driver + ?Sized> SharedPool<D> {
    /// Create the POSIX-FD pool, give it torch's attributes, make it `device`'s current pool
    /// and export its FD once (which is what unlocks pointer export).
    pub fn install(driver: Arc<D>, device: u32) -> Result<SharedPool<D>, PoolError> {
        let info = driver.device_info(device)?;
        if !info.memory_pools {
            return Err(PoolError::Unsupported {
                device,
                what: "stream-ordered memory pools",
            });
        }
        if !info.pool_posix_fd {
            return Err(PoolError::Unsupported {
                device,
                what: "pool export by POSIX FD",
            });
        }
        let current = driver.device_get_mem_pool(device)?;
        let default = driver.device_get_default_mem_pool(device)?;
        if current != default {
            let ours = installed()
                .as_ref()
                .is_some_and(|s| s.contains(&(driver.kind(), device, current)));
            return Err(if ours {
                PoolError::AlreadyInstalled { device }
            } else {
                PoolError::CurrentPoolNotDefault { device }
            });
        }
        let owned = OwnedPool::create(Arc::clone(&driver), device, PoolSharing::PosixFd)?;
        let pool = owned.handle();
        let fd = match Self::configure(&*driver, device, pool) {
            Ok(fd) => fd,
            Err(e) => {
                // Put the device back as we found it (before the pool goes: it may be
                // current); report the first error. The pool is destroyed when dropped here.
                let _ = driver.device_set_mem_pool(device, default);
                drop(owned);
                return Err(e);
            }
        };
        installed()
            .get_or_insert_with(HashSet::new)
            .insert((driver.kind(), device, pool));
        tracing::info!(
            device,
            uuid = %info.uuid,
            ?pool,
            "poolipc: installed a shareable memory pool as device {device}'s current pool; \
             its statistics (PoolStats) hold the true figures of what is allocated from it"
        );
        Ok(SharedPool {
            driver,
            device,
            generations: Mutex::new(vec![Arc::new(Generation {
                pool,
                fd: Arc::new(fd),
                exported: AtomicBool::new(false),
            })]),
            rotating: Mutex::new(()),
            exports: ExportCache::new(DEFAULT_EXPORT_CACHE_ENTRIES),
            owned: Mutex::new(vec![owned]),
        })
    }

    fn owned_pools(&self) -> std::sync::MutexGuard<'_, Vec<OwnedPool<Arc<D>>>> {
        self.owned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The owning value of live generation `pool`, taken out of the pool's keeping.
    fn take_owned(&self, pool: PoolHandle) -> Option<OwnedPool<Arc<D>>> {
        let mut owned = self.owned_pools();
        let i = owned.iter().position(|o| o.handle() == pool)?;
        Some(owned.swap_remove(i))
    }

    fn generations(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Generation>>> {
        self.generations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn current(&self) -> Arc<Generation> {
        let g = self.generations();
        // Never empty: install makes the first, rotate adds before it retires, and only
        // retired (never the last) generations are removed.
        Arc::clone(&g[g.len() - 1])
    }

    /// Notes that a pointer of `pool` was exported (what makes its generation worth rotating).
    fn note_export(&self, pool: PoolHandle) {
        if let Some(g) = self.generations().iter().find(|g| g.pool == pool) {
            g.exported.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the current generation exported nothing yet (so the miss path must ask which
    /// pool an exported pointer belongs to).
    fn current_unexported(&self) -> bool {
        !self.current().exported.load(Ordering::Relaxed)
    }

    fn configure(driver: &D, device: u32, pool: PoolHandle) -> Result<OwnedFd, PoolError> {
        for attr in TORCH_POOL_ATTRIBUTES {
            driver.mem_pool_set_attribute(pool, attr)?;
        }
        driver.device_set_mem_pool(device, pool)?;
        // Export the FD once: cuMemPoolExportPointer fails with INVALID_VALUE until then.
        Ok(driver.mem_pool_export_fd(pool)?)
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<D> {
        &self.driver
    }

    /// The device ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The current generation's pool handle (the device's current pool).
    pub fn handle(&self) -> PoolHandle {
        self.current().pool
    }

    /// Every live generation's pool handle, oldest first, the current one last.
    pub fn handles(&self) -> Vec<PoolHandle> {
        self.generations().iter().map(|g| g.pool).collect()
    }

    /// The current generation's FD, to send to workers (SCM_RIGHTS duplicates it in transit).
    pub fn fd(&self) -> Arc<OwnedFd> {
        Arc::clone(&self.current().fd)
    }

    /// The FD of live generation `pool`, if it is one.
    pub fn fd_of(&self, pool: PoolHandle) -> Option<Arc<OwnedFd>> {
        self.generations()
            .iter()
            .find(|g| g.pool == pool)
            .map(|g| Arc::clone(&g.fd))
    }

    /// A stream-ordered allocation from the current generation; give it back with
    /// [`free`](SharedPool::free) (or hand its address on: whoever frees it next).
    pub fn alloc(&self, bytes: u64, stream: StreamHandle) -> Result<DevicePtr, PoolError> {
        Ok(self
            .driver
            .mem_alloc_from_pool_async(bytes, self.handle(), stream)?)
    }

    /// Free an allocation of this pool, stream-ordered, and drop its cached export (kept
    /// when reuse is proven: a later allocation of the same size there reuses it).
    ///
    /// `ptr` is checked with the driver first ([`PoolAllocation::claim`]: the start of a live
    /// pool allocation, else an error and nothing freed); the caller answers for owning it.
    pub fn free(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<(), PoolError> {
        PoolAllocation::claim(&*self.driver, ptr)?.free(stream)?;
        self.exports.forget_unless_reusable(ptr.0);
        Ok(())
    }

    /// Whether `ptr` was allocated from a live generation of this pool.
    pub fn owns(&self, ptr: DevicePtr) -> Result<bool, PoolError> {
        let found = self.driver.pointer_get_mempool(ptr)?;
        Ok(self.is_generation(found))
    }

    /// Whether `pool` is a live generation of this pool (current or retired).
    pub fn is_generation(&self, pool: PoolHandle) -> bool {
        self.generations().iter().any(|g| g.pool == pool)
    }

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

    fn export_uncached(&self, ptr: DevicePtr) -> Result<ExportBlob, PoolError> {
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

    /// Whether a new allocation at a recycled address, of the same size, reuses the cached
    /// blob (proven by the startup check), and why not where the check said so.
    pub fn export_reuse(&self) -> (ExportReuse, Option<String>) {
        self.exports.reuse()
    }

    /// Begins the startup check of export reuse (the canary battery's), unless one ran or
    /// runs already (then `None`). See [`ReuseCheck`].
    pub fn begin_export_reuse_check(&self) -> Option<ReuseCheck<'_, D>> {
        // Built only when begun: a check dropped unfinished resets the verdict.
        self.exports.begin_check().then(|| ReuseCheck {
            pool: self,
            finished: false,
        })
    }

    /// Keep at most `entries` exports from now on (default
    /// [`DEFAULT_EXPORT_CACHE_ENTRIES`](crate::DEFAULT_EXPORT_CACHE_ENTRIES)); the least
    /// recently used go first. 0 turns the cache off.
    pub fn set_export_cache_capacity(&self, entries: usize) {
        self.exports.set_capacity(entries);
    }

    /// The export cache, for the tests' mutation switch.
    #[cfg(test)]
    pub(crate) fn export_cache(&self) -> &ExportCache {
        &self.exports
    }

    /// Used and reserved bytes of this pool, current and high, summed over its live
    /// generations (the high marks are the sum of each generation's: an upper bound of the
    /// whole pool's).
    pub fn stats(&self) -> Result<PoolStats, PoolError> {
        let mut sum = PoolStats::default();
        for pool in self.handles() {
            let s = PoolStats::read(&*self.driver, pool)?;
            sum.used_current += s.used_current;
            sum.used_high += s.used_high;
            sum.reserved_current += s.reserved_current;
            sum.reserved_high += s.reserved_high;
        }
        Ok(sum)
    }

    /// Restarts the high-water marks of every live generation from the current figures
    /// ([`PoolStats::reset_high`]).
    pub fn reset_high(&self) -> Result<(), PoolError> {
        for pool in self.handles() {
            PoolStats::reset_high(&*self.driver, pool)?;
        }
        Ok(())
    }

    /// Whether the current generation exported a pointer since it was made (what
    /// [`rotate`](SharedPool::rotate) needs to act).
    pub fn current_exported(&self) -> bool {
        !self.current_unexported()
    }

    /// Makes a new generation the device's current pool and retires the current one, if the
    /// current one exported anything since it was made (`None`: nothing to do).
    ///
    /// The new pool gets torch's attributes and its FD exported once, as at
    /// [`install`](SharedPool::install). The retired one stays valid for its live
    /// allocations: they are exported and freed as before (`cudaFreeAsync` finds their pool
    /// by itself), and no new allocation comes from it. The export cache is cleared (its
    /// entries are the old generation's); a proven reuse verdict carries over (same driver).
    ///
    /// Refused with [`PoolError::CurrentPoolChanged`] when the device's current pool is not
    /// ours any more. Workers must learn the new generation (its [`fd`](SharedPool::fd))
    /// before any lend names it.
    pub fn rotate(&self) -> Result<Option<Rotation>, PoolError> {
        let _rotating = self
            .rotating
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let old = self.current();
        if !old.exported.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let found = self.driver.device_get_mem_pool(self.device)?;
        if found != old.pool {
            return Err(PoolError::CurrentPoolChanged {
                device: self.device,
                found,
                ours: old.pool,
            });
        }
        let owned = OwnedPool::create(Arc::clone(&self.driver), self.device, PoolSharing::PosixFd)?;
        let pool = owned.handle();
        let fd = match Self::configure(&*self.driver, self.device, pool) {
            Ok(fd) => fd,
            Err(e) => {
                // Put our old generation back as the current pool (before the new one goes:
                // it may be current); report the first error. The new pool is destroyed when
                // dropped here.
                let _ = self.driver.device_set_mem_pool(self.device, old.pool);
                drop(owned);
                return Err(e);
            }
        };
        self.owned_pools().push(owned);
        installed().get_or_insert_with(HashSet::new).insert((
            self.driver.kind(),
            self.device,
            pool,
        ));
        self.generations().push(Arc::new(Generation {
            pool,
            fd: Arc::new(fd),
            exported: AtomicBool::new(false),
        }));
        self.exports.clear();
        tracing::info!(
            device = self.device,
            retired = ?old.pool,
            current = ?pool,
            "poolipc: rotated the shared pool: a new generation is the device's current pool; \
             the old one is retired until its allocations are freed"
        );
        Ok(Some(Rotation {
            retired: old.pool,
            current: pool,
        }))
    }

    /// Retired generations with no bytes in use (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT` 0; the
    /// caller synchronizes first, as [`trim`](SharedPool::trim) does, so that queued frees
    /// have run): those [`destroy_retired`](SharedPool::destroy_retired) may destroy.
    pub fn idle_retired(&self) -> Result<Vec<PoolHandle>, PoolError> {
        let handles = self.handles();
        let mut idle = Vec::new();
        for &pool in &handles[..handles.len().saturating_sub(1)] {
            if self
                .driver
                .mem_pool_get_attribute(pool, PoolCounter::UsedCurrent)?
                == 0
            {
                idle.push(pool);
            }
        }
        Ok(idle)
    }

    /// Destroys retired generation `pool` and drops its FD. Refused for the current
    /// generation or an unknown pool ([`PoolError::NotRetired`]) and while bytes of it are in
    /// use ([`PoolError::InUse`]). Its exported memory goes back to the device once every
    /// worker that imported it destroyed its import (or exited): tell them first.
    pub fn destroy_retired(&self, pool: PoolHandle) -> Result<(), PoolError> {
        let _rotating = self
            .rotating
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let retired = {
            let g = self.generations();
            g.iter()
                .take(g.len().saturating_sub(1))
                .any(|g| g.pool == pool)
        };
        if !retired {
            return Err(PoolError::NotRetired {
                device: self.device,
                pool,
            });
        }
        let used = self
            .driver
            .mem_pool_get_attribute(pool, PoolCounter::UsedCurrent)?;
        if used > 0 {
            return Err(PoolError::InUse { used });
        }
        // Taken out before the destroy: a pool the driver refused to destroy is not
        // destroyed twice (a later call drops the generation).
        if let Some(owned) = self.take_owned(pool) {
            owned.close()?;
        }
        self.generations().retain(|g| g.pool != pool);
        if let Some(s) = installed().as_mut() {
            s.remove(&(self.driver.kind(), self.device, pool));
        }
        // Its addresses may come back in a new pool: no cached blob of them may be served.
        self.exports.clear();
        tracing::info!(
            device = self.device,
            ?pool,
            "poolipc: destroyed a retired generation of the shared pool"
        );
        Ok(())
    }

    /// Gives the pool's unused memory back to the device, as `torch.cuda.empty_cache()` does
    /// for torch's own pool: waits for all of this process's GPU work (so that frees queued on
    /// any stream have run), then `cuMemPoolTrimTo(pool, 0)`. Returns the bytes the pool
    /// held before and after. What it costs: the synchronize, and the next allocations map
    /// memory again instead of reusing the pool's.
    pub fn trim(&self) -> Result<(u64, u64), PoolError> {
        self.driver.use_device(self.device)?;
        self.driver.ctx_synchronize()?;
        let before = self.stats()?.reserved_current;
        // Memory given back and mapped again later is not what the reuse check proved.
        self.exports.clear();
        for pool in self.handles() {
            self.driver.mem_pool_trim_to(pool, 0)?;
        }
        let after = self.stats()?.reserved_current;
        tracing::debug!(before, after, "poolipc: pool trimmed");
        Ok((before, after))
    }

    /// Put the default pool back and destroy ours, every generation. Refused while bytes are
    /// in use.
    pub fn uninstall(self) -> Result<(), PoolError> {
        let handles = self.handles();
        let mut used = 0;
        for &pool in &handles {
            used += self
                .driver
                .mem_pool_get_attribute(pool, PoolCounter::UsedCurrent)?;
        }
        if used > 0 {
            return Err(PoolError::InUse { used });
        }
        let default = self.driver.device_get_default_mem_pool(self.device)?;
        self.driver.device_set_mem_pool(self.device, default)?;
        for &pool in &handles {
            if let Some(owned) = self.take_owned(pool) {
                owned.close()?;
            }
            if let Some(s) = installed().as_mut() {
                s.remove(&(self.driver.kind(), self.device, pool));
            }
        }
        tracing::info!(device = self.device, "poolipc: uninstalled the shared pool");
        Ok(())
    }
}

/// The parent's pool as a worker sees it: imported from the FD, with read-write access.
/// Dropped, the import is destroyed (`cuMemPoolDestroy`).
pub struct AttachedPool<R: Deref<Target: Driver> = Arc<dyn Driver>> {
    /// The imported pool in this process.
    pub pool: OwnedPool<R>,
    /// The device the worker uses it from.
    pub device: u32,
    /// The access the import had before we set it.
    pub initial_access: Access,
    /// The imported pool's release threshold before we raised it, where the driver tells.
    pub initial_release_threshold: Option<u64>,
    /// Whether the imported pool keeps freed imports mapped across synchronizes (release
    /// threshold raised to UINT64_MAX). When false, every import of recycled memory maps it
    /// again (about 1 ms/GiB).
    pub keeps_mappings: bool,
}

impl<R: Deref<Target: Driver>> std::fmt::Debug for AttachedPool<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttachedPool")
            .field("pool", &self.pool)
            .field("device", &self.device)
            .field("initial_access", &self.initial_access)
            .field("initial_release_threshold", &self.initial_release_threshold)
            .field("keeps_mappings", &self.keeps_mappings)
            .finish()
    }
}

impl<R: Deref<Target: Driver>> AttachedPool<R> {
    /// Import the parent's pool FD, make sure `device` may read and write it, and try to raise
    /// the imported pool's release threshold as the parent's is (driver 580 refuses that on an
    /// imported pool; [`AttachedPool::keeps_mappings`] says what happened). On failure the
    /// import is destroyed again.
    pub fn attach(
        driver: R,
        fd: BorrowedFd<'_>,
        device: u32,
    ) -> Result<AttachedPool<R>, PoolError> {
        let owned = OwnedPool::import_fd(driver, fd)?;
        let pool = owned.handle();
        let driver = &**owned.driver();
        let initial_access = driver.mem_pool_get_access(pool, device)?;
        if initial_access != Access::ReadWrite {
            driver.mem_pool_set_access(pool, device, Access::ReadWrite)?;
        }
        // The imported pool's attributes: cuMemPoolGetAttribute on an imported pool is
        // INVALID_VALUE on driver 580 (measured on the H200), so both are best effort.
        let initial_release_threshold = driver
            .mem_pool_get_attribute(pool, PoolCounter::ReleaseThreshold)
            .ok();
        let keeps_mappings =
            match driver.mem_pool_set_attribute(pool, PoolAttribute::ReleaseThreshold(u64::MAX)) {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!(
                        error = %e,
                        "the imported pool's release threshold cannot be raised from this side"
                    );
                    false
                }
            };
        tracing::debug!(
            ?pool,
            device,
            ?initial_access,
            initial_release_threshold,
            keeps_mappings,
            "attached the parent's pool"
        );
        Ok(AttachedPool {
            pool: owned,
            device,
            initial_access,
            initial_release_threshold,
            keeps_mappings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mockall::Sequence;
    use poolipc_driver::{CuCode, DeviceInfo, DeviceUuid, DriverKind, MockDriver};
    use std::os::fd::{AsFd, OwnedFd};

    const DEFAULT: PoolHandle = PoolHandle::mock(0xd0);
    const OURS: PoolHandle = PoolHandle::mock(0xa1);

    fn info(pool_fd: bool) -> DeviceInfo {
        DeviceInfo {
            ordinal: 0,
            uuid: DeviceUuid([7; 16]),
            name: "mock".into(),
            total_memory: 1 << 30,
            memory_pools: true,
            pool_posix_fd: pool_fd,
            vmm: true,
            vmm_posix_fd: true,
            mps_client: None,
        }
    }

    fn some_fd() -> OwnedFd {
        OwnedFd::from(std::fs::File::open("/dev/null").unwrap())
    }

    /// A driver that expects the install sequence in order, then whatever `then` adds.
    fn installing(seq: &mut Sequence) -> MockDriver {
        let mut d = MockDriver::new();
        d.expect_kind().return_const(DriverKind::Mock);
        d.expect_device_info().returning(|_| Ok(info(true)));
        d.expect_device_get_mem_pool()
            .times(1)
            .in_sequence(seq)
            .returning(|_| Ok(DEFAULT));
        d.expect_device_get_default_mem_pool()
            .times(1)
            .in_sequence(seq)
            .returning(|_| Ok(DEFAULT));
        d.expect_mem_pool_create()
            .withf(|dev, s| *dev == 0 && *s == PoolSharing::PosixFd)
            .times(1)
            .in_sequence(seq)
            .returning(|_, _| Ok(OURS));
        for attr in TORCH_POOL_ATTRIBUTES {
            d.expect_mem_pool_set_attribute()
                .withf(move |p, a| *p == OURS && *a == attr)
                .times(1)
                .in_sequence(seq)
                .returning(|_, _| Ok(()));
        }
        d.expect_device_set_mem_pool()
            .withf(|dev, p| *dev == 0 && *p == OURS)
            .times(1)
            .in_sequence(seq)
            .returning(|_, _| Ok(()));
        d.expect_mem_pool_export_fd()
            .withf(|p| *p == OURS)
            .times(1)
            .in_sequence(seq)
            .returning(|_| Ok(some_fd()));
        d
    }

    #[test]
    fn install_sets_torchs_attributes_before_making_the_pool_current_then_exports_the_fd() {
        let mut seq = Sequence::new();
        let d = Arc::new(installing(&mut seq));
        let pool = SharedPool::install(d, 0).unwrap();
        assert_eq!(pool.handle(), OURS);
    }

    #[test]
    fn the_fd_is_exported_before_any_pointer_export() {
        let mut seq = Sequence::new();
        let mut d = installing(&mut seq);
        d.expect_pointer_get_buffer_id().returning(|_| Ok(7));
        d.expect_pointer_get_mempool()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_| Ok(OURS));
        d.expect_mem_pool_export_pointer()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_| Ok(ExportBlob([1; 64])));
        d.expect_pointer_get_range().returning(|p| Ok((p, 4096)));
        let pool = SharedPool::install(Arc::new(d), 0).unwrap();
        assert_eq!(pool.export(DevicePtr(0x1000)).unwrap(), ExportBlob([1; 64]));
    }

    #[test]
    fn a_pointer_of_another_pool_is_not_exported() {
        let mut seq = Sequence::new();
        let mut d = installing(&mut seq);
        d.expect_pointer_get_buffer_id().returning(|_| Ok(9));
        d.expect_pointer_get_mempool().returning(|_| Ok(DEFAULT));
        d.expect_mem_pool_export_pointer().never();
        let pool = SharedPool::install(Arc::new(d), 0).unwrap();
        let e = pool.export(DevicePtr(0x1000)).unwrap_err();
        assert!(matches!(e, PoolError::ForeignPointer { .. }), "{e}");
    }

    /// An installed pool whose driver exports `ptr`'s allocation (`bytes` long) with blob
    /// `[n; 64]` at the n-th `cuMemPoolExportPointer`, and reports the buffer ids `ids`
    /// gives, one per query.
    fn exporting(
        bytes: u64,
        exports: usize,
        ids: impl FnMut(DevicePtr) -> Result<u64, DriverError> + Send + 'static,
    ) -> SharedPool<MockDriver> {
        let mut seq = Sequence::new();
        let mut d = installing(&mut seq);
        d.expect_pointer_get_buffer_id().returning(ids);
        d.expect_pointer_get_mempool().returning(|_| Ok(OURS));
        let mut n = 0u8;
        d.expect_mem_pool_export_pointer()
            .times(exports)
            .returning(move |_| {
                n += 1;
                Ok(ExportBlob([n; 64]))
            });
        d.expect_pointer_get_range()
            .returning(move |p| Ok((DevicePtr(p.0 & !0xfff), bytes)));
        SharedPool::install(Arc::new(d), 0).unwrap()
    }

    #[test]
    fn a_second_export_of_a_live_allocation_reuses_the_blob() {
        let pool = exporting(1 << 30, 1, |_| Ok(917));
        let first = pool.export(DevicePtr(0x1000)).unwrap();
        assert_eq!(pool.export(DevicePtr(0x1000)).unwrap(), first);
        let s = pool.export_cache_stats();
        assert_eq!(
            (s.hits, s.misses, s.stale, s.bytes_saved),
            (1, 1, 0, 1 << 30)
        );
    }

    #[test]
    fn an_address_holding_a_new_allocation_is_exported_again() {
        // Two queries per miss (before and after the export), then the recycled address.
        let mut ids = [917, 917, 918, 918, 918].into_iter();
        let pool = exporting(4096, 2, move |_| Ok(ids.next().unwrap_or(0)));
        let first = pool.export(DevicePtr(0x1000)).unwrap();
        let second = pool.export(DevicePtr(0x1000)).unwrap();
        assert_ne!(first, second);
        assert_eq!(pool.export(DevicePtr(0x1000)).unwrap(), second);
        let s = pool.export_cache_stats();
        assert_eq!((s.hits, s.misses, s.stale, s.entries), (1, 1, 1, 1));
    }

    #[test]
    fn a_second_reuse_check_is_refused_and_leaves_the_first_running() {
        let pool = exporting(4096, 0, |_| Ok(1));
        let first = pool.begin_export_reuse_check().expect("the first check");
        assert!(pool.begin_export_reuse_check().is_none());
        assert_eq!(pool.export_reuse().0, ExportReuse::Checking);
        first.finish(Ok(()));
        assert!(pool.begin_export_reuse_check().is_none());
        assert_eq!(pool.export_reuse(), (ExportReuse::Proven, None));
        assert_eq!(pool.export_cache_stats().reuse, ExportReuse::Proven);
    }

    #[test]
    fn a_reuse_check_dropped_unfinished_can_be_made_again() {
        let pool = exporting(4096, 0, |_| Ok(1));
        drop(pool.begin_export_reuse_check());
        assert_eq!(pool.export_reuse().0, ExportReuse::Unchecked);
        pool.begin_export_reuse_check()
            .expect("a second try")
            .finish(Err("no".into()));
        assert_eq!(
            pool.export_reuse(),
            (ExportReuse::NotProven, Some("no".into()))
        );
    }

    #[test]
    fn once_proven_a_recycled_address_of_the_same_size_is_not_exported_again() {
        let gib = 1u64 << 30;
        let pool = exporting(gib, 2, |_| Ok(0));
        pool.begin_export_reuse_check()
            .expect("check")
            .finish(Ok(()));
        let base = DevicePtr(0x1000);
        let first = pool.export_known(base, gib, Some(917)).unwrap();
        // A new allocation there (buffer id 918), same size: the cached blob, no export.
        assert_eq!(pool.export_known(base, gib, Some(918)).unwrap(), first);
        // Another size there: exported (the driver's second blob).
        assert_ne!(pool.export_known(base, gib / 2, Some(919)).unwrap(), first);
        let s = pool.export_cache_stats();
        assert_eq!(
            (s.reused, s.reused_bytes, s.misses, s.stale),
            (1, gib, 1, 1)
        );
    }

    #[test]
    fn unproven_a_recycled_address_of_the_same_size_is_exported_again() {
        let pool = exporting(4096, 2, |_| Ok(0));
        let base = DevicePtr(0x1000);
        pool.export_known(base, 4096, Some(1)).unwrap();
        pool.export_known(base, 4096, Some(2)).unwrap();
        let s = pool.export_cache_stats();
        assert_eq!((s.reused, s.stale), (0, 1));
    }

    #[test]
    fn without_a_buffer_id_every_export_goes_to_the_driver() {
        let pool = exporting(4096, 2, |_| {
            Err(DriverError::Call {
                call: "cuPointerGetAttribute",
                code: CuCode::NOT_SUPPORTED,
            })
        });
        pool.export(DevicePtr(0x1000)).unwrap();
        pool.export(DevicePtr(0x1000)).unwrap();
        let s = pool.export_cache_stats();
        assert_eq!((s.hits, s.uncached, s.entries), (0, 2, 0));
    }

    #[test]
    fn the_export_of_an_interior_pointer_is_not_cached() {
        let pool = exporting(4096, 2, |_| Ok(5));
        pool.export(DevicePtr(0x1010)).unwrap();
        pool.export(DevicePtr(0x1010)).unwrap();
        assert_eq!(pool.export_cache_stats().entries, 0);
    }

    #[test]
    fn an_export_whose_allocation_changed_meanwhile_is_not_cached() {
        let mut ids = [1, 2, 2, 2].into_iter();
        let pool = exporting(4096, 2, move |_| Ok(ids.next().unwrap_or(0)));
        pool.export(DevicePtr(0x1000)).unwrap();
        assert_eq!(pool.export_cache_stats().entries, 0);
        pool.export(DevicePtr(0x1000)).unwrap();
        assert_eq!(pool.export_cache_stats().entries, 1);
    }

    #[test]
    fn a_free_through_the_pool_drops_the_cached_export() {
        let mut seq = Sequence::new();
        let mut d = installing(&mut seq);
        d.expect_pointer_get_buffer_id().returning(|_| Ok(3));
        d.expect_pointer_get_mempool().returning(|_| Ok(OURS));
        d.expect_mem_pool_export_pointer()
            .times(1)
            .returning(|_| Ok(ExportBlob([1; 64])));
        d.expect_pointer_get_range().returning(|p| Ok((p, 4096)));
        // The free checks that the address starts a live pool allocation first.
        d.expect_pointer_info().returning(|p| {
            Ok(poolipc_driver::PointerInfo {
                base: p,
                size: 4096,
                pool: Some(OURS),
                buffer_id: Some(3),
                device: Some(0),
            })
        });
        d.expect_mem_free_async().times(1).returning(|_, _| Ok(()));
        let pool = SharedPool::install(Arc::new(d), 0).unwrap();
        pool.export(DevicePtr(0x1000)).unwrap();
        pool.free(DevicePtr(0x1000), StreamHandle::NULL).unwrap();
        assert_eq!(pool.export_cache_stats().entries, 0);
    }

    #[test]
    fn install_refuses_when_the_current_pool_was_already_swapped() {
        let mut d = MockDriver::new();
        d.expect_kind().return_const(DriverKind::Mock);
        d.expect_device_info().returning(|_| Ok(info(true)));
        d.expect_device_get_mem_pool()
            .returning(|_| Ok(PoolHandle::mock(0xbeef)));
        d.expect_device_get_default_mem_pool()
            .returning(|_| Ok(DEFAULT));
        d.expect_mem_pool_create().never();
        let e = SharedPool::install(Arc::new(d), 0).unwrap_err();
        assert!(
            matches!(e, PoolError::CurrentPoolNotDefault { device: 0 }),
            "{e}"
        );
        assert!(e.to_string().contains("not its default pool"));
    }

    #[test]
    fn install_twice_on_one_device_is_refused() {
        let mut seq = Sequence::new();
        let mut d = installing(&mut seq);
        // The second look at the device finds our pool current.
        d.expect_device_get_mem_pool().returning(|_| Ok(OURS));
        d.expect_device_get_default_mem_pool()
            .returning(|_| Ok(DEFAULT));
        let d = Arc::new(d);
        let _pool = SharedPool::install(Arc::clone(&d), 0).unwrap();
        let e = SharedPool::install(d, 0).unwrap_err();
        assert!(
            matches!(e, PoolError::AlreadyInstalled { device: 0 }),
            "{e}"
        );
    }

    #[test]
    fn a_device_without_posix_fd_pools_is_refused() {
        let mut d = MockDriver::new();
        d.expect_device_info().returning(|_| Ok(info(false)));
        d.expect_mem_pool_create().never();
        let e = SharedPool::install(Arc::new(d), 0).unwrap_err();
        assert!(matches!(e, PoolError::Unsupported { .. }), "{e}");
    }

    #[test]
    fn a_failed_export_puts_the_default_pool_back() {
        let mut d = MockDriver::new();
        d.expect_kind().return_const(DriverKind::Mock);
        d.expect_device_info().returning(|_| Ok(info(true)));
        d.expect_device_get_mem_pool().returning(|_| Ok(DEFAULT));
        d.expect_device_get_default_mem_pool()
            .returning(|_| Ok(DEFAULT));
        d.expect_mem_pool_create().returning(|_, _| Ok(OURS));
        d.expect_mem_pool_set_attribute().returning(|_, _| Ok(()));
        d.expect_device_set_mem_pool()
            .withf(|_, p| *p == OURS)
            .times(1)
            .returning(|_, _| Ok(()));
        d.expect_mem_pool_export_fd().returning(|_| {
            Err(DriverError::Call {
                call: "cuMemPoolExportToShareableHandle",
                code: CuCode::NOT_SUPPORTED,
            })
        });
        d.expect_device_set_mem_pool()
            .withf(|_, p| *p == DEFAULT)
            .times(1)
            .returning(|_, _| Ok(()));
        d.expect_mem_pool_destroy()
            .withf(|p| *p == OURS)
            .times(1)
            .returning(|_| Ok(()));
        let e = SharedPool::install(Arc::new(d), 0).unwrap_err();
        assert!(
            e.to_string().contains("cuMemPoolExportToShareableHandle"),
            "{e}"
        );
    }

    #[test]
    fn attach_grants_read_write_when_the_import_lacks_it() {
        let mut d = MockDriver::new();
        d.expect_mem_pool_import_fd()
            .returning(|_| Ok(PoolHandle::mock(0x55)));
        // Dropped, the attached pool destroys its import.
        d.expect_mem_pool_destroy()
            .withf(|p| *p == PoolHandle::mock(0x55))
            .times(1)
            .returning(|_| Ok(()));
        d.expect_mem_pool_get_access()
            .returning(|_, _| Ok(Access::None));
        d.expect_mem_pool_get_attribute().returning(|_, _| Ok(0));
        d.expect_mem_pool_set_attribute()
            .withf(|p, a| {
                *p == PoolHandle::mock(0x55) && *a == PoolAttribute::ReleaseThreshold(u64::MAX)
            })
            .times(1)
            .returning(|_, _| Ok(()));
        d.expect_mem_pool_set_access()
            .withf(|p, dev, a| *p == PoolHandle::mock(0x55) && *dev == 0 && *a == Access::ReadWrite)
            .times(1)
            .returning(|_, _, _| Ok(()));
        let fd = some_fd();
        let a = AttachedPool::attach(&d, fd.as_fd(), 0).unwrap();
        assert_eq!(a.initial_access, Access::None);
    }

    #[test]
    fn attach_leaves_read_write_access_alone() {
        let mut d = MockDriver::new();
        d.expect_mem_pool_import_fd()
            .returning(|_| Ok(PoolHandle::mock(0x55)));
        // Dropped, the attached pool destroys its import.
        d.expect_mem_pool_destroy()
            .withf(|p| *p == PoolHandle::mock(0x55))
            .times(1)
            .returning(|_| Ok(()));
        d.expect_mem_pool_get_access()
            .returning(|_, _| Ok(Access::ReadWrite));
        d.expect_mem_pool_get_attribute()
            .returning(|_, _| Ok(u64::MAX));
        d.expect_mem_pool_set_attribute().returning(|_, _| Ok(()));
        d.expect_mem_pool_set_access().never();
        let fd = some_fd();
        AttachedPool::attach(&d, fd.as_fd(), 0).unwrap();
    }

    #[test]
    fn attach_tries_to_raise_the_imported_pools_release_threshold_and_says_if_it_could_not() {
        let mut d = MockDriver::new();
        d.expect_mem_pool_import_fd()
            .returning(|_| Ok(PoolHandle::mock(0x55)));
        // Dropped, the attached pool destroys its import.
        d.expect_mem_pool_destroy()
            .withf(|p| *p == PoolHandle::mock(0x55))
            .times(1)
            .returning(|_| Ok(()));
        d.expect_mem_pool_get_access()
            .returning(|_, _| Ok(Access::ReadWrite));
        d.expect_mem_pool_get_attribute().returning(|_, _| Ok(0));
        d.expect_mem_pool_set_attribute().returning(|_, _| {
            Err(DriverError::Call {
                call: "cuMemPoolSetAttribute",
                code: CuCode::NOT_SUPPORTED,
            })
        });
        let fd = some_fd();
        let a = AttachedPool::attach(&d, fd.as_fd(), 0).unwrap();
        assert!(!a.keeps_mappings);
        assert_eq!(a.initial_release_threshold, Some(0));
    }

    #[test]
    fn stats_come_from_our_pool() {
        let mut seq = Sequence::new();
        let mut d = installing(&mut seq);
        d.expect_mem_pool_get_attribute()
            .withf(|p, _| *p == OURS)
            .returning(|_, c| {
                Ok(match c {
                    PoolCounter::UsedCurrent => 1,
                    PoolCounter::UsedHigh => 2,
                    PoolCounter::ReservedCurrent => 3,
                    PoolCounter::ReservedHigh => 4,
                    _ => 0,
                })
            });
        let pool = SharedPool::install(Arc::new(d), 0).unwrap();
        let s = pool.stats().unwrap();
        assert_eq!(
            (
                s.used_current,
                s.used_high,
                s.reserved_current,
                s.reserved_high
            ),
            (1, 2, 3, 4)
        );
    }
}

#[cfg(test)]
mod generation_tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use std::os::fd::AsFd;

    use poolipc_driver::sim::{SimConfig, SimDriver};

    use super::*;

    const MIB: u64 = 1 << 20;
    const S: StreamHandle = StreamHandle::NULL;

    fn installed_sim() -> SharedPool<SimDriver> {
        let d = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
        d.use_device(0).unwrap();
        SharedPool::install(d, 0).unwrap()
    }

    fn held(pool: &SharedPool<SimDriver>) -> u64 {
        let (free, total) = pool.driver().mem_get_info().unwrap();
        total - free
    }

    #[test]
    fn a_pool_that_exported_nothing_does_not_rotate() {
        let pool = installed_sim();
        let p = pool.alloc(4 * MIB, S).unwrap();
        pool.free(p, S).unwrap();
        assert_eq!(pool.rotate().unwrap(), None);
        assert_eq!(pool.handles().len(), 1);
    }

    #[test]
    fn a_rotation_makes_a_new_current_pool_and_keeps_the_old_one_for_its_live_allocations() {
        let pool = installed_sim();
        let old = pool.handle();
        let live = pool.alloc(4 * MIB, S).unwrap();
        pool.export(live).unwrap();
        let r = pool.rotate().unwrap().expect("exported: rotates");
        assert_eq!(r.retired, old);
        assert_eq!(pool.handle(), r.current);
        assert_eq!(
            pool.driver().device_get_mem_pool(0).unwrap(),
            r.current,
            "the new generation is the device's current pool"
        );
        for attr in [
            PoolCounter::ReleaseThreshold,
            PoolCounter::ReuseAllowOpportunistic,
        ] {
            assert_eq!(
                pool.driver()
                    .mem_pool_get_attribute(r.current, attr)
                    .unwrap(),
                pool.driver().mem_pool_get_attribute(old, attr).unwrap()
            );
        }
        // New allocations come from the new generation; the old one's pointer is still ours.
        let fresh = pool.driver().mem_alloc_async(2 * MIB, S).unwrap();
        assert_eq!(pool.driver().pointer_get_mempool(fresh).unwrap(), r.current);
        assert!(pool.owns(live).unwrap() && pool.owns(fresh).unwrap());
        pool.export(live).unwrap();
        pool.export(fresh).unwrap();
        assert_eq!(pool.stats().unwrap().used_current, 6 * MIB);
        // In use: not destroyed.
        assert_eq!(pool.idle_retired().unwrap(), Vec::<PoolHandle>::new());
        assert!(matches!(
            pool.destroy_retired(old),
            Err(PoolError::InUse { .. })
        ));
        pool.free(live, S).unwrap();
        pool.driver().ctx_synchronize().unwrap();
        assert_eq!(pool.idle_retired().unwrap(), vec![old]);
        pool.destroy_retired(old).unwrap();
        assert_eq!(pool.handles(), vec![r.current]);
        assert!(matches!(
            pool.destroy_retired(r.current),
            Err(PoolError::NotRetired { .. })
        ));
        pool.free(fresh, S).unwrap();
    }

    #[test]
    fn the_current_generation_rotates_only_for_its_own_exports() {
        let pool = installed_sim();
        let old_live = pool.alloc(4 * MIB, S).unwrap();
        pool.export(old_live).unwrap();
        pool.rotate().unwrap().unwrap();
        // Exporting the retired generation's allocation again: the new one exported nothing.
        pool.export(old_live).unwrap();
        assert!(!pool.current_exported());
        assert_eq!(pool.rotate().unwrap(), None);
        pool.free(old_live, S).unwrap();
    }

    #[test]
    fn destroying_the_retired_generation_gives_exported_freed_memory_back() {
        let pool = installed_sim();
        let start = held(&pool);
        let p = pool.alloc(64 * MIB, S).unwrap();
        pool.export(p).unwrap();
        pool.free(p, S).unwrap();
        pool.trim().unwrap();
        assert_eq!(held(&pool), start + 64 * MIB, "trim does not give it back");
        let r = pool.rotate().unwrap().unwrap();
        pool.trim().unwrap();
        assert_eq!(pool.idle_retired().unwrap(), vec![r.retired]);
        pool.destroy_retired(r.retired).unwrap();
        assert_eq!(held(&pool), start);
    }

    #[test]
    fn a_rotation_refuses_when_something_else_made_its_pool_current() {
        let pool = installed_sim();
        let p = pool.alloc(4 * MIB, S).unwrap();
        pool.export(p).unwrap();
        let default = pool.driver().device_get_default_mem_pool(0).unwrap();
        pool.driver().device_set_mem_pool(0, default).unwrap();
        let e = pool.rotate().unwrap_err();
        assert!(matches!(e, PoolError::CurrentPoolChanged { .. }), "{e}");
        assert_eq!(pool.handles().len(), 1);
        pool.free(p, S).unwrap();
    }

    #[test]
    fn the_export_cache_serves_no_blob_across_a_rotation() {
        let pool = installed_sim();
        let p = pool.alloc(4 * MIB, S).unwrap();
        pool.export(p).unwrap();
        assert_eq!(pool.export_cache_stats().entries, 1);
        pool.rotate().unwrap().unwrap();
        assert_eq!(pool.export_cache_stats().entries, 0);
        pool.free(p, S).unwrap();
    }

    #[test]
    fn each_generation_has_its_own_fd() {
        let pool = installed_sim();
        let first = pool.fd();
        let p = pool.alloc(4 * MIB, S).unwrap();
        pool.export(p).unwrap();
        let r = pool.rotate().unwrap().unwrap();
        let second = pool.fd();
        assert_ne!(ino(first.as_fd()), ino(second.as_fd()));
        assert!(pool.fd_of(r.retired).is_some());
        pool.free(p, S).unwrap();
    }

    fn ino(fd: BorrowedFd<'_>) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::File::from(fd.try_clone_to_owned().unwrap())
            .metadata()
            .unwrap()
            .ino()
    }
}
