//! Stream-ordered allocation from the current generation, and the free that also drops the
//! allocation's cached export.

use poolipc_driver::{DevicePtr, Driver, PoolAllocation, StreamHandle};

use super::{PoolError, SharedPool};

impl<D: Driver + ?Sized> SharedPool<D> {
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
}
