//! Installing the shared pool as the device's current pool (with torch's attributes and its
//! FD exported once), uninstalling it, and the process-wide record of what was installed.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use poolipc_driver::{
    Driver, DriverKind, OwnedPool, PoolAttribute, PoolCounter, PoolHandle, PoolSharing,
};

use super::{Generation, PoolError, SharedPool};
use crate::export_cache::{DEFAULT_EXPORT_CACHE_ENTRIES, ExportCache};

/// Pools this process installed, by (driver kind, device, pool), so that a second install
/// says "already installed" rather than "something else swapped the pool".
static INSTALLED: Mutex<Option<HashSet<InstallKey>>> = Mutex::new(None);

pub(super) type InstallKey = (DriverKind, u32, PoolHandle);

pub(super) fn installed() -> std::sync::MutexGuard<'static, Option<HashSet<InstallKey>>> {
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

    pub(super) fn configure(
        driver: &D,
        device: u32,
        pool: PoolHandle,
    ) -> Result<OwnedFd, PoolError> {
        for attr in TORCH_POOL_ATTRIBUTES {
            driver.mem_pool_set_attribute(pool, attr)?;
        }
        driver.device_set_mem_pool(device, pool)?;
        // Export the FD once: cuMemPoolExportPointer fails with INVALID_VALUE until then.
        Ok(driver.mem_pool_export_fd(pool)?)
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
