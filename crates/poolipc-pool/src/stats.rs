//! `PoolStats`: the figures torch's statistics stop showing once its pool is swapped.

use poolipc_driver::{Driver, DriverError, PoolAttribute, PoolCounter, PoolHandle};

/// Used and reserved bytes of a pool, current and high-water.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes handed out and not yet freed.
    pub used_current: u64,
    /// The most bytes ever in use at once.
    pub used_high: u64,
    /// Bytes of device memory the pool holds (used, plus freed-but-kept).
    pub reserved_current: u64,
    /// The most bytes ever reserved at once.
    pub reserved_high: u64,
}

impl PoolStats {
    /// Read the four counters of `pool`.
    pub fn read<D: Driver + ?Sized>(
        driver: &D,
        pool: PoolHandle,
    ) -> Result<PoolStats, DriverError> {
        Ok(PoolStats {
            used_current: driver.mem_pool_get_attribute(pool, PoolCounter::UsedCurrent)?,
            used_high: driver.mem_pool_get_attribute(pool, PoolCounter::UsedHigh)?,
            reserved_current: driver.mem_pool_get_attribute(pool, PoolCounter::ReservedCurrent)?,
            reserved_high: driver.mem_pool_get_attribute(pool, PoolCounter::ReservedHigh)?,
        })
    }

    /// Restart both high-water marks of `pool` from the current figures: each HIGH attribute
    /// set to 0, the only value the driver takes (what torch's `resetPeakStats` does to its
    /// own pool, `c10/cuda/CUDAMallocAsyncAllocator.cpp`).
    pub fn reset_high<D: Driver + ?Sized>(driver: &D, pool: PoolHandle) -> Result<(), DriverError> {
        driver.mem_pool_set_attribute(pool, PoolAttribute::ResetReservedHigh)?;
        driver.mem_pool_set_attribute(pool, PoolAttribute::ResetUsedHigh)
    }
}

impl std::fmt::Display for PoolStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const MIB: f64 = (1u64 << 20) as f64;
        write!(
            f,
            "used {:.1} MiB (high {:.1} MiB), reserved {:.1} MiB (high {:.1} MiB)",
            self.used_current as f64 / MIB,
            self.used_high as f64 / MIB,
            self.reserved_current as f64 / MIB,
            self.reserved_high as f64 / MIB
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use poolipc_driver::MockDriver;

    #[test]
    fn reset_high_sets_both_high_marks_of_that_pool_and_nothing_else() {
        let mut d = MockDriver::new();
        let mut seq = mockall::Sequence::new();
        for attr in [
            PoolAttribute::ResetReservedHigh,
            PoolAttribute::ResetUsedHigh,
        ] {
            d.expect_mem_pool_set_attribute()
                .withf(move |p, a| *p == PoolHandle::mock(0x77) && *a == attr)
                .times(1)
                .in_sequence(&mut seq)
                .returning(|_, _| Ok(()));
        }
        PoolStats::reset_high(&d, PoolHandle::mock(0x77)).unwrap();
    }
}
