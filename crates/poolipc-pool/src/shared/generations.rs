//! The pool's generations: an exported allocation keeps its memory after its free until its
//! pool is destroyed, so the pool rotates to a new generation and destroys retired ones once
//! idle (see [`SharedPool`]'s docs). Also which generation exported what.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use poolipc_driver::{Driver, OwnedPool, PoolCounter, PoolHandle, PoolSharing};

use super::install::installed;
use super::{PoolError, SharedPool};

/// One generation of the shared pool: a pool made with torch's attributes and its FD.
#[derive(Debug)]
pub(super) struct Generation {
    pub(super) pool: PoolHandle,
    pub(super) fd: Arc<OwnedFd>,
    /// Whether a pointer of this generation was exported since it was made.
    pub(super) exported: AtomicBool,
}

/// What [`SharedPool::rotate`] did: the generation it retired and the one current now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotation {
    /// The generation retired (still valid for its live allocations).
    pub retired: PoolHandle,
    /// The new current generation.
    pub current: PoolHandle,
}

impl<D: Driver + ?Sized> SharedPool<D> {
    /// Notes that a pointer of `pool` was exported (what makes its generation worth rotating).
    pub(super) fn note_export(&self, pool: PoolHandle) {
        if let Some(g) = self.generations().iter().find(|g| g.pool == pool) {
            g.exported.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the current generation exported nothing yet (so the miss path must ask which
    /// pool an exported pointer belongs to).
    pub(super) fn current_unexported(&self) -> bool {
        !self.current().exported.load(Ordering::Relaxed)
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
    /// worker that imported it destroyed its import (or exited) too: tell them after.
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
}
