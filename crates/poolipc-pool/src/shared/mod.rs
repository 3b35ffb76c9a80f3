//! `SharedPool`: the shareable pool made the device's current pool (parent side), and
//! `AttachedPool`, the same pool imported by a worker.
//!
//! This module holds the types every room below shares (the pool, its generations' list, its
//! errors) and the plain accessors; each job on the pool is a room of its own:
//!
//! - `install`: installing the pool as the device's current pool, and uninstalling it;
//! - `alloc`: stream-ordered allocation and free;
//! - `export`: pointer export and the export cache in front of it;
//! - `reuse_check`: the startup check of export reuse at a recycled address;
//! - `stats`: the pool's figures and trimming;
//! - `generations`: rotation of the pool by generations and destroying retired ones;
//! - `attached`: the worker's import of the pool.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use poolipc_driver::{DevicePtr, Driver, DriverError, OwnedPool, PoolHandle};

use crate::export_cache::ExportCache;

mod alloc;
mod attached;
mod export;
mod generations;
mod install;
mod reuse_check;
mod stats;

pub use attached::AttachedPool;
#[cfg(test)] // the export cache's property test reads how a blob was served
pub(crate) use export::Served;
use generations::Generation;
pub use generations::Rotation;
pub use install::TORCH_POOL_ATTRIBUTES;
pub use reuse_check::ReuseCheck;

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
/// for it (docs/facts.md, "Other driver behaviour designed for"). So the pool has generations:
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

impl<D: Driver + ?Sized> SharedPool<D> {
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

    /// Whether `ptr` was allocated from a live generation of this pool.
    pub fn owns(&self, ptr: DevicePtr) -> Result<bool, PoolError> {
        let found = self.driver.pointer_get_mempool(ptr)?;
        Ok(self.is_generation(found))
    }

    /// Whether `pool` is a live generation of this pool (current or retired).
    pub fn is_generation(&self, pool: PoolHandle) -> bool {
        self.generations().iter().any(|g| g.pool == pool)
    }
}

#[cfg(test)]
mod export_property;
#[cfg(test)]
mod tests;

#[cfg(test)]
mod generation_tests;
