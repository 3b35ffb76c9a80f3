//! The startup check of export reuse: whether a recycled address of the same size may be lent
//! with its cached blob on this driver (see the crate's docs), begun by the facade's canary
//! battery and held as a [`ReuseCheck`] until its verdict.

use poolipc_driver::{DevicePtr, Driver, ExportBlob};

use crate::PoolError;

use super::SharedPool;
use crate::export_cache::ExportReuse;

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

    /// Makes the check without a worker, once [`trial`](ReuseCheck::trial) served `served`
    /// (the blob cached for an earlier allocation at `base`) to the new allocation there of the
    /// same size: exports `base` afresh and compares. The same 64 bytes prove reuse for the
    /// pool (importing the old blob is importing the new one); other bytes refute it for good.
    /// Returns the fresh export (lend that, not `served`: they differ where the check
    /// fails); a failed export leaves the check not made (`Err`).
    pub fn finish_by_identity(
        self,
        base: DevicePtr,
        served: &ExportBlob,
    ) -> Result<ExportBlob, PoolError> {
        let fresh = self.pool.export_uncached(base)?;
        let same = fresh == *served;
        tracing::debug!(
            ?base,
            same,
            "export reuse: a recycled address exported afresh"
        );
        self.finish(if same {
            Ok(())
        } else {
            Err(
                "a recycled address of the same size exported to other bytes than its first \
                 export"
                    .to_owned(),
            )
        });
        Ok(fresh)
    }

    /// Records the verdict: `Ok` proven (a recycled address of the same size reuses its blob
    /// from now on), `Err(why)` not proven (every new allocation is exported, for good).
    pub fn finish(mut self, verdict: Result<(), String>) {
        self.finished = true;
        match &verdict {
            Ok(()) => tracing::info!(
                pool = ?self.pool.handle(),
                "poolipc: export reuse proven on this driver (an old allocation's blob reaches \
                 the new allocation of the same size at its address); recycled addresses of \
                 the same size are not exported again"
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
}
