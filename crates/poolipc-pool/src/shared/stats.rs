//! The pool's figures, summed over its live generations, and trimming its unused memory back to
//! the device.

use poolipc_driver::Driver;

use super::{PoolError, SharedPool};
use crate::stats::PoolStats;

impl<D: Driver + ?Sized> SharedPool<D> {
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

    /// Gives the pool's unused memory back to the device down to `keep` bytes reserved (per
    /// generation), without waiting for any GPU work: memory whose free is still queued on a
    /// stream stays until a later call. For a thread that must not block (the parent's IO
    /// thread, after a condemned worker's results were freed). Returns the bytes the pool
    /// held before and after.
    pub fn trim_to(&self, keep: u64) -> Result<(u64, u64), PoolError> {
        let before = self.stats()?.reserved_current;
        if before <= keep {
            return Ok((before, before));
        }
        self.exports.clear();
        for pool in self.handles() {
            self.driver.mem_pool_trim_to(pool, keep)?;
        }
        let after = self.stats()?.reserved_current;
        tracing::debug!(before, after, keep, "poolipc: pool trimmed");
        Ok((before, after))
    }
}
