//! The worker's side: the parent's pool imported from its FD, with read-write access.

use std::ops::Deref;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use poolipc_driver::{Access, Driver, OwnedPool, PoolAttribute, PoolCounter};

use super::PoolError;

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
