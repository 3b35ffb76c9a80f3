//! The arena copy's device-to-device copies through pinned host memory, on copy engines.
//!
//! Without MPS a device-to-device copy in the parent runs on the compute engine, and the GPU
//! then changes from the parent's context to the worker's for the worker's first work and
//! back for the parent's next: about 250 µs a 4 KiB job against 30 µs for the same job lent
//! by pool pointer, whichever call makes the copy (`cuMemcpyDtoDAsync` on any stream, or
//! `cuMemcpyBatchAsync` asked to prefer a copy engine). The same bytes copied to pinned host
//! memory and back go on copy engines, and the job then costs what a pool-pointer job costs
//! plus the copies: 46 µs read-only and 51 µs copied back at 4 KiB, 54 and 106 µs at 1 MiB,
//! against 288 and 325 µs (H100, driver 580, `bench/probes/arena_copy.c`). Under MPS there is
//! no such change and the device-to-device copy is the cheaper one; above a few MiB the host
//! copies cost more than the change saves.
//!
//! [`Bounce`] owns a few pinned buffers and lends one to a copy whose earlier copies all
//! completed ([`SharedHostBuffer::idle`]): two copies on one stream, device to host then
//! host to device, so the stream orders them and everything queued after them.

use std::sync::Arc;

use poolipc_driver::host::SharedHostBuffer;
use poolipc_driver::{DevicePtr, Driver, StreamHandle};

/// The arena copy's copy of `bytes` from `src` to `dst` on `stream`: through the host where
/// `bounce` takes it (counted in `shared`'s stats), else device to device. A function of the
/// loop's two parts, not a method of the loop, so that a caller may hold a job of the loop's
/// meanwhile.
pub(super) fn copy_on_device(
    bounce: &mut Bounce,
    shared: &super::Shared,
    dst: DevicePtr,
    src: DevicePtr,
    bytes: u64,
    stream: StreamHandle,
) -> poolipc_driver::Result<()> {
    if bounce.copy(dst, src, bytes, stream)? {
        crate::state::Stats::bump(&shared.stats.copies_through_host);
        return Ok(());
    }
    shared.driver.memcpy_dtod_async(dst, src, bytes, stream)
}

/// The most a copy through the host may be: each buffer is this long at most, and a room
/// keeps [`SLOTS`] of them pinned. A larger bound is lowered to it (logged).
pub(super) const MAX_THROUGH_HOST: u64 = 64 << 20;

/// How many buffers a room keeps at most: as many copies in flight at once go through the
/// host; one more goes device to device.
const SLOTS: usize = 4;

/// The room's pinned buffers for copies of up to `max` bytes; see the [module docs](self).
pub(super) struct Bounce {
    driver: Arc<dyn Driver>,
    /// The largest copy that goes through the host; 0: none does.
    max: u64,
    slots: Vec<SharedHostBuffer>,
    /// Making a buffer failed: every copy goes device to device from then on.
    broken: bool,
}

impl Bounce {
    /// Copies of up to `max` bytes go through the host (none where `max` is 0), at most
    /// [`MAX_THROUGH_HOST`].
    pub(super) fn new(driver: Arc<dyn Driver>, max: u64) -> Bounce {
        if max > MAX_THROUGH_HOST {
            tracing::warn!(
                asked = max,
                bytes = MAX_THROUGH_HOST,
                "Tuning::copy_through_host is above what a copy through the host may be: lowered"
            );
        }
        Bounce {
            driver,
            max: max.min(MAX_THROUGH_HOST),
            slots: Vec::new(),
            broken: false,
        }
    }

    /// Copies `bytes` from `src` to `dst` on `stream` through a pinned buffer, ordered on
    /// `stream` like one device-to-device copy. `Ok(false)`: it did not (larger than the
    /// bound, none wanted, every buffer busy, or no buffer could be made), and the caller
    /// copies device to device. A copy that failed to queue is the driver's error.
    pub(super) fn copy(
        &mut self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> poolipc_driver::Result<bool> {
        if bytes == 0 || bytes > self.max || self.broken {
            return Ok(false);
        }
        let Some(slot) = self.free_slot()? else {
            return Ok(false);
        };
        // `bytes <= max`, which fits a buffer (made `max` long), so fits `usize` too.
        let n = usize::try_from(bytes).unwrap_or(usize::MAX);
        self.slots[slot].copy_through(0, dst, src, n, stream)?;
        Ok(true)
    }

    /// A buffer whose copies all completed, made if there are fewer than [`SLOTS`]; `None`
    /// when all are busy or making one failed.
    fn free_slot(&mut self) -> poolipc_driver::Result<Option<usize>> {
        for (i, b) in self.slots.iter().enumerate() {
            if b.idle()? {
                return Ok(Some(i));
            }
        }
        if self.slots.len() >= SLOTS {
            return Ok(None);
        }
        let len = usize::try_from(self.max).unwrap_or(usize::MAX);
        let made =
            SharedHostBuffer::private(len).and_then(|b| b.register(&self.driver).map(|()| b));
        match made {
            Ok(b) => {
                self.slots.push(b);
                Ok(Some(self.slots.len() - 1))
            }
            Err(e) => {
                tracing::warn!(error = %e, bytes = self.max, "no pinned buffer for the arena copy: its copies go device to device");
                self.broken = true;
                Ok(None)
            }
        }
    }

    /// The pinned buffers made so far.
    #[cfg(test)]
    pub(super) fn buffers(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use poolipc_driver::sim::{SimConfig, SimDriver};
    use poolipc_driver::{DeviceAllocation, OwnedStream};

    fn sim() -> Arc<dyn Driver> {
        let d: Arc<dyn Driver> = Arc::new(SimDriver::new(SimConfig::default()).expect("sim"));
        d.use_device(0).expect("device");
        d
    }

    fn filled(d: &Arc<dyn Driver>, bytes: usize, byte: u8) -> DeviceAllocation {
        let m = DeviceAllocation::new(Arc::clone(d), bytes as u64).expect("alloc");
        d.memcpy_htod(m.ptr(), &vec![byte; bytes]).expect("fill");
        m
    }

    #[test]
    fn a_copy_through_the_host_arrives_in_stream_order() {
        let d = sim();
        let mut b = Bounce::new(Arc::clone(&d), 1 << 20);
        let (src, dst) = (filled(&d, 65536, 7), filled(&d, 65536, 0));
        let s = OwnedStream::new(Arc::clone(&d)).expect("stream");
        assert!(
            b.copy(dst.ptr(), src.ptr(), 65536, s.handle())
                .expect("copy")
        );
        // The host reads on the stream, after the copy: the bytes are there.
        let mut got = vec![0u8; 65536];
        d.memcpy_dtoh_on(&mut got, dst.ptr(), s.handle())
            .expect("read");
        assert!(got.iter().all(|&x| x == 7));
        assert_eq!(d.sim_checker().map_or(0, |c| c.count()), 0, "no race");
    }

    #[test]
    fn a_bound_above_the_most_is_lowered_to_it() {
        let b = Bounce::new(sim(), u64::MAX);
        assert_eq!(b.max, MAX_THROUGH_HOST);
    }

    #[test]
    fn too_large_or_off_goes_device_to_device() {
        let d = sim();
        let (src, dst) = (filled(&d, 8192, 1), filled(&d, 8192, 0));
        let s = OwnedStream::new(Arc::clone(&d)).expect("stream");
        let mut small = Bounce::new(Arc::clone(&d), 4096);
        assert!(
            !small
                .copy(dst.ptr(), src.ptr(), 8192, s.handle())
                .expect("copy")
        );
        let mut off = Bounce::new(Arc::clone(&d), 0);
        assert!(!off.copy(dst.ptr(), src.ptr(), 1, s.handle()).expect("copy"));
        assert_eq!(
            small.buffers() + off.buffers(),
            0,
            "nothing pinned for them"
        );
    }

    #[test]
    fn a_busy_buffer_is_not_lent_again() {
        let d = sim();
        let mut b = Bounce::new(Arc::clone(&d), 4096);
        let (src, dst) = (filled(&d, 4096, 3), filled(&d, 4096, 0));
        let s = OwnedStream::new(Arc::clone(&d)).expect("stream");
        // A kernel that never ends holds the stream: every copy queued behind it stays in
        // flight.
        d.launch_hang_kernel(s.handle()).expect("hang");
        for _ in 0..SLOTS {
            assert!(
                b.copy(dst.ptr(), src.ptr(), 4096, s.handle())
                    .expect("copy")
            );
        }
        assert_eq!(b.buffers(), SLOTS);
        assert!(
            !b.copy(dst.ptr(), src.ptr(), 4096, s.handle())
                .expect("copy"),
            "every buffer is busy: device to device"
        );
        // Dropped, the buffers would wait for copies that never run (as they must).
        std::mem::forget(b);
        std::mem::forget(s);
    }

    #[test]
    fn a_buffer_whose_copies_completed_is_lent_again() {
        let d = sim();
        let mut b = Bounce::new(Arc::clone(&d), 4096);
        let (src, dst) = (filled(&d, 4096, 3), filled(&d, 4096, 0));
        for _ in 0..10 {
            let s = OwnedStream::new(Arc::clone(&d)).expect("stream");
            assert!(
                b.copy(dst.ptr(), src.ptr(), 4096, s.handle())
                    .expect("copy")
            );
            d.stream_synchronize(s.handle()).expect("sync");
        }
        assert_eq!(b.buffers(), 1, "one buffer, lent again each time");
    }
}
