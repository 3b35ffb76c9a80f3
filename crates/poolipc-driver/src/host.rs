//! [`SharedHostBuffer`]: host memory two processes share (a memfd mapped `MAP_SHARED` on both
//! sides), pinned with `cuMemHostRegister`, and stream-ordered copies between it and device
//! memory. The host-staging rung moves tensors through one of these.
//!
//! # The lifetime rule
//!
//! An asynchronous copy reads or writes the mapping after the call returned, until its stream
//! reaches it. The buffer therefore remembers every stream a copy was issued on, with a
//! private event recorded after each copy, and its `Drop` synchronizes those events before it
//! unregisters and unmaps the memory: a buffer dropped with copies in flight waits for them
//! instead of letting the device write into freed pages. Drop it on a thread where the device
//! is current (`Driver::use_device`), as for every other driver object.
//!
//! Ordering between the two processes is the caller's: copies into the buffer in one process
//! and out of it in the other must be ordered by interprocess events (the staging engine
//! records `filled` / `drained` events for that). The host accessors
//! ([`read_at`](SharedHostBuffer::read_at), [`write_at`](SharedHostBuffer::write_at)) are not
//! ordered with stream work at all: synchronize first.
//!
//! # Seals
//!
//! The creator seals the memfd at its size (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`)
//! before it maps it, and [`from_fd`](SharedHostBuffer::from_fd) refuses a file without the
//! shrink and grow seals. So the other process, however it behaves, cannot `ftruncate` the
//! file under a mapping (which would make every access past the new end a `SIGBUS` in the
//! process that reads it): the kernel refuses the call with `EPERM`.

use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

use crate::api::Driver;
use crate::error::{DriverError, Result};
use crate::owned::{HostRegistration, OwnedEvent};
use crate::types::{DevicePtr, StreamHandle};

fn os(call: &'static str, e: nix::Error) -> DriverError {
    DriverError::Os {
        call,
        source: std::io::Error::from_raw_os_error(e as i32),
    }
}

/// The seals the creator adds: the size is fixed and no further seal can be added or removed.
const SEALS: SealFlag = SealFlag::F_SEAL_SHRINK
    .union(SealFlag::F_SEAL_GROW)
    .union(SealFlag::F_SEAL_SEAL);

/// What the buffer tracks once registered.
struct Registration {
    /// The pages' registration (it holds the driver). Unregistered by `Drop` of the buffer
    /// once the events below completed, or leaked.
    host: HostRegistration,
    /// Each stream a copy was issued on, with an event recorded after its latest copy.
    streams: Vec<(StreamHandle, OwnedEvent)>,
}

/// A memfd of `len` bytes mapped read-write and shared; see the [module docs](self).
pub struct SharedHostBuffer {
    /// The memfd; `None` for a buffer of this process alone ([`private`](Self::private)).
    fd: Option<OwnedFd>,
    ptr: NonNull<u8>,
    len: usize,
    registration: Mutex<Option<Registration>>,
}

impl std::fmt::Debug for SharedHostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedHostBuffer")
            .field("fd", &self.fd)
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("registered", &self.lock().is_some())
            .finish()
    }
}

// SAFETY: the mapping is plain shared memory owned by this value; the host accessors copy
// bytes through bounds-checked raw copies, device copies go through the driver (which is
// `Send + Sync`), and the registration state sits behind a mutex. Nothing is tied to the
// creating thread.
unsafe impl Send for SharedHostBuffer {}
// SAFETY: as above; `&self` methods never hand out references into the mapping.
unsafe impl Sync for SharedHostBuffer {}

impl SharedHostBuffer {
    /// A new memfd (`MFD_CLOEXEC`) of `len` bytes, mapped `MAP_SHARED`.
    pub fn create(len: usize) -> Result<SharedHostBuffer> {
        let n = Self::nonzero("memfd_create", len)?;
        let fd = memfd_create(
            "poolipc-staging",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(|e| os("memfd_create", e))?;
        let size = libc::off_t::try_from(len).map_err(|_| DriverError::InvalidArgument {
            call: "ftruncate",
            reason: format!("{len} bytes do not fit off_t"),
        })?;
        nix::unistd::ftruncate(&fd, size).map_err(|e| os("ftruncate", e))?;
        fcntl(&fd, FcntlArg::F_ADD_SEALS(SEALS)).map_err(|e| os("fcntl(F_ADD_SEALS)", e))?;
        Self::map(fd, n)
    }

    /// `len` bytes of anonymous memory of this process alone (no file, no descriptor held),
    /// for copies through the host within one process: [`fd`](Self::fd) is `None`.
    pub fn private(len: usize) -> Result<SharedHostBuffer> {
        let n = Self::nonzero("mmap", len)?;
        // SAFETY: a fresh anonymous mapping chosen by the kernel (no address hint, no
        // MAP_FIXED) cannot alias any Rust object.
        let p = unsafe {
            nix::sys::mman::mmap_anonymous(
                None,
                n,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .map_err(|e| os("mmap", e))?;
        Ok(SharedHostBuffer {
            fd: None,
            ptr: p.cast(),
            len: n.get(),
            registration: Mutex::new(None),
        })
    }

    /// Maps a buffer another process created, from its FD (received by `SCM_RIGHTS` or
    /// inherited). `len` must be the file's size exactly (checked with `fstat`), and the file
    /// must be sealed against shrinking and growing (checked with `F_GET_SEALS`): see
    /// [Seals](self#seals).
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<SharedHostBuffer> {
        let n = Self::nonzero("mmap", len)?;
        let seals = fcntl(&fd, FcntlArg::F_GET_SEALS).map_err(|e| os("fcntl(F_GET_SEALS)", e))?;
        let needed = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW;
        if !SealFlag::from_bits_truncate(seals).contains(needed) {
            return Err(DriverError::InvalidArgument {
                call: "SharedHostBuffer::from_fd",
                reason: format!(
                    "the file is not sealed against resizing (seals {seals:#x}; \
                     F_SEAL_SHRINK | F_SEAL_GROW needed)"
                ),
            });
        }
        let st = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| os("fstat", e))?;
        if u64::try_from(st.st_size).ok() != Some(len as u64) {
            return Err(DriverError::InvalidArgument {
                call: "SharedHostBuffer::from_fd",
                reason: format!("the file has {} bytes, {len} expected", st.st_size),
            });
        }
        Self::map(fd, n)
    }

    fn nonzero(call: &'static str, len: usize) -> Result<NonZeroUsize> {
        NonZeroUsize::new(len).ok_or_else(|| DriverError::InvalidArgument {
            call,
            reason: "a shared host buffer cannot be empty".into(),
        })
    }

    fn map(fd: OwnedFd, n: NonZeroUsize) -> Result<SharedHostBuffer> {
        // SAFETY: a fresh mapping chosen by the kernel (no address hint, no MAP_FIXED) cannot
        // alias any Rust object; the size was checked against the file, so every mapped page
        // is backed.
        let p = unsafe {
            mmap(
                None,
                n,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| os("mmap", e))?;
        Ok(SharedHostBuffer {
            fd: Some(fd),
            ptr: p.cast(),
            len: n.get(),
            registration: Mutex::new(None),
        })
    }

    /// The memfd, to send to the other process; `None` for a [`private`](Self::private)
    /// buffer.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(AsFd::as_fd)
    }

    /// Bytes of the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: an empty buffer cannot be created.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn lock(&self) -> MutexGuard<'_, Option<Registration>> {
        self.registration
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Pins the buffer for `driver` (`cuMemHostRegister`, portable and device-mapped); `Drop`
    /// unregisters it. Copies need this first. Registering twice fails.
    pub fn register(&self, driver: &Arc<dyn Driver>) -> Result<()> {
        let mut reg = self.lock();
        if reg.is_some() {
            return Err(DriverError::InvalidArgument {
                call: "cuMemHostRegister_v2",
                reason: "the shared host buffer is already registered".into(),
            });
        }
        // SAFETY: (1) `ptr` points to `len` mapped bytes that stay mapped until `Drop`, which
        // unregisters (or leaks the registration) before it unmaps; (2) `Drop` unregisters
        // only once every copy's event completed.
        let host =
            unsafe { HostRegistration::new(Arc::clone(driver), self.ptr.as_ptr(), self.len) }?;
        *reg = Some(Registration {
            host,
            streams: Vec::new(),
        });
        Ok(())
    }

    /// Whether [`register`](Self::register) succeeded.
    pub fn is_registered(&self) -> bool {
        self.lock().is_some()
    }

    fn check(&self, call: &'static str, off: usize, n: usize) -> Result<()> {
        match off.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(DriverError::OutOfBounds {
                call,
                offset: off as u64,
                bytes: n as u64,
                len: self.len as u64,
            }),
        }
    }

    /// Copies `dst.len()` bytes from offset `off` into `dst`. Not ordered with stream work.
    pub fn read_at(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        self.check("SharedHostBuffer::read_at", off, dst.len())?;
        // SAFETY: `[off, off + dst.len())` lies in the mapping (checked above), which is
        // readable; `dst` is a distinct Rust buffer, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// Copies `src` to offset `off`. Not ordered with stream work.
    pub fn write_at(&self, off: usize, src: &[u8]) -> Result<()> {
        self.check("SharedHostBuffer::write_at", off, src.len())?;
        // SAFETY: `[off, off + src.len())` lies in the mapping (checked above), which is
        // writable; `copy` is a memmove, so it is correct even if `src` came from this mapping.
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.as_ptr().add(off), src.len()) };
        Ok(())
    }

    /// `cuMemcpyDtoHAsync` of `bytes` from `src` into the buffer at `off`, on `stream`.
    ///
    /// Safe: the range is bounds-checked and the buffer outlives the copy (its `Drop` waits
    /// for every stream it was used on). Needs [`register`](Self::register) first.
    pub fn copy_from_device(
        &self,
        off: usize,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const CALL: &str = "cuMemcpyDtoHAsync";
        self.check(CALL, off, bytes)?;
        self.issue(CALL, stream, |driver| {
            // SAFETY: `[off, off + bytes)` lies in the mapping (checked above), which stays
            // mapped until the copy completed: `Drop` synchronizes the event `issue` records
            // after it. Other accesses to those bytes are the caller's to order (module docs).
            unsafe {
                driver.memcpy_dtoh_async(self.ptr.as_ptr().add(off), src, bytes as u64, stream)
            }
        })
    }

    /// `cuMemcpyHtoDAsync` of `bytes` from the buffer at `off` to `dst`, on `stream`.
    ///
    /// Safe for the same reasons as [`copy_from_device`](Self::copy_from_device).
    pub fn copy_to_device(
        &self,
        off: usize,
        dst: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const CALL: &str = "cuMemcpyHtoDAsync";
        self.check(CALL, off, bytes)?;
        self.issue(CALL, stream, |driver| {
            // SAFETY: as in `copy_from_device`: in bounds, mapped until the copy completed.
            unsafe {
                driver.memcpy_htod_async(dst, self.ptr.as_ptr().add(off), bytes as u64, stream)
            }
        })
    }

    /// Copies `bytes` from `src` to `dst` through the buffer at `off`, on `stream`:
    /// `cuMemcpyDtoHAsync` into the buffer, then `cuMemcpyHtoDAsync` out of it, ordered by
    /// the stream like one device-to-device copy, with one tracking record after both. The
    /// two copies run on copy engines, where a device-to-device copy runs on the compute
    /// engine (docs/facts.md).
    ///
    /// Safe for the same reasons as [`copy_from_device`](Self::copy_from_device). The
    /// buffer's bytes at `[off, off + bytes)` are the copy's until it completed: another
    /// copy through them must wait for [`idle`](Self::idle).
    pub fn copy_through(
        &self,
        off: usize,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const CALL: &str = "cuMemcpyDtoHAsync";
        self.check(CALL, off, bytes)?;
        self.issue(CALL, stream, |driver| {
            // SAFETY: `[off, off + bytes)` lies in the mapping (checked above), which stays
            // mapped until both copies completed: `Drop` synchronizes the event `issue`
            // records after them. The second copy reads what the first wrote, after it on the
            // same stream.
            unsafe {
                let host = self.ptr.as_ptr().add(off);
                driver.memcpy_dtoh_async(host, src, bytes as u64, stream)?;
                driver.memcpy_htod_async(dst, host, bytes as u64, stream)
            }
        })
    }

    /// Whether every copy issued through the buffer completed (each stream's event, queried):
    /// true for a buffer never copied through or not registered. Once it is, the pages may
    /// be copied through again on any stream without waiting for the earlier copies.
    pub fn idle(&self) -> Result<bool> {
        let guard = self.lock();
        let Some(reg) = guard.as_ref() else {
            return Ok(true);
        };
        for (_, event) in &reg.streams {
            if !reg.host.driver().event_query(event.handle())? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Runs `copy` with the registered driver, then records the stream's tracking event.
    fn issue(
        &self,
        call: &'static str,
        stream: StreamHandle,
        copy: impl FnOnce(&dyn Driver) -> Result<()>,
    ) -> Result<()> {
        let mut guard = self.lock();
        let Some(reg) = guard.as_mut() else {
            return Err(DriverError::InvalidArgument {
                call,
                reason: "the shared host buffer is not registered".into(),
            });
        };
        let driver = Arc::clone(reg.host.driver());
        let event = match reg.streams.iter().find(|(s, _)| *s == stream) {
            Some((_, e)) => e.handle(),
            None => {
                // A stream met for the first time: the entries of streams whose copies all
                // completed go first, so that a buffer copied through on many streams in
                // turn (a caller's stream each job) keeps as many events as it has copies in
                // flight, not one per stream it ever saw.
                reg.streams
                    .retain(|(_, e)| !matches!(driver.event_query(e.handle()), Ok(true)));
                let e = OwnedEvent::new(Arc::clone(&driver), false)?;
                let handle = e.handle();
                reg.streams.push((stream, e));
                handle
            }
        };
        // Record even when the copy failed part-way: whatever it issued is then covered.
        let copied = copy(driver.as_ref());
        let recorded = driver.event_record(event, stream);
        copied.and(recorded)
    }
}

impl Drop for SharedHostBuffer {
    /// Waits for every copy issued through this buffer, unregisters it, unmaps it. Errors are
    /// logged, never raised.
    fn drop(&mut self) {
        let reg = self
            .registration
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(reg) = reg {
            let mut in_flight = false;
            let Registration { host, streams } = reg;
            for (stream, event) in streams {
                if let Err(e) = host.driver().event_synchronize(event.handle()) {
                    tracing::error!(?stream, error = %e, "shared host buffer: waiting for copies failed");
                    in_flight = true;
                }
                if let Err(e) = event.close() {
                    tracing::warn!(?stream, error = %e, "shared host buffer: event destroy failed");
                }
            }
            if in_flight {
                // A copy may still use the pages: leaking the mapping (and keeping it
                // registered) is the safe failure.
                host.leak();
                tracing::error!(
                    len = self.len,
                    "shared host buffer leaked: copies may still be in flight"
                );
                return;
            }
            // Every copy through the registration completed (the events above were
            // synchronized): `HostRegistration`'s condition for unregistering holds.
            if let Err(e) = host.close() {
                tracing::warn!(error = %e, "shared host buffer: cuMemHostUnregister failed");
            }
        }
        // SAFETY: `ptr`/`len` are what mmap returned; no copy uses the pages any more (above)
        // and nothing borrows them (we are in drop).
        if let Err(e) = unsafe { munmap(self.ptr.cast::<c_void>(), self.len) } {
            tracing::warn!(error = %e, "shared host buffer: munmap failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accessors_refuse_ranges_past_the_end() {
        let b = SharedHostBuffer::create(4096).expect("create");
        let mut buf = [0u8; 16];
        assert!(matches!(
            b.read_at(4090, &mut buf),
            Err(DriverError::OutOfBounds {
                offset: 4090,
                bytes: 16,
                len: 4096,
                ..
            })
        ));
        assert!(matches!(
            b.write_at(usize::MAX, &buf),
            Err(DriverError::OutOfBounds { .. })
        ));
        b.write_at(4080, &buf).expect("last 16 bytes are in range");
    }

    #[test]
    fn written_bytes_read_back() {
        let b = SharedHostBuffer::create(8192).expect("create");
        b.write_at(100, b"staging").expect("write");
        let mut out = [0u8; 7];
        b.read_at(100, &mut out).expect("read");
        assert_eq!(&out, b"staging");
    }

    #[test]
    fn idle_once_the_copies_completed_and_finished_streams_are_let_go() {
        use crate::owned::{DeviceAllocation, OwnedStream};
        use crate::sim::{SimConfig, SimDriver};
        let d: Arc<dyn Driver> = Arc::new(SimDriver::new(SimConfig::default()).expect("sim"));
        d.use_device(0).expect("device");
        let b = SharedHostBuffer::create(4096).expect("create");
        assert!(
            b.idle().expect("idle"),
            "a buffer never copied through is idle"
        );
        b.register(&d).expect("register");
        let mem = DeviceAllocation::new(Arc::clone(&d), 4096).expect("alloc");
        let mut streams = Vec::new();
        for _ in 0..20 {
            let s = OwnedStream::new(Arc::clone(&d)).expect("stream");
            b.copy_from_device(0, mem.ptr(), 4096, s.handle())
                .expect("d2h");
            b.copy_to_device(0, mem.ptr(), 4096, s.handle())
                .expect("h2d");
            d.stream_synchronize(s.handle()).expect("sync");
            assert!(b.idle().expect("idle"), "every copy completed");
            streams.push(s);
        }
        // Twenty streams met in turn, each done before the next: one entry left, not twenty.
        let kept = b.lock().as_ref().map_or(0, |r| r.streams.len());
        assert_eq!(kept, 1);
        drop(b);
        drop(mem);
    }

    #[test]
    fn an_empty_buffer_is_refused() {
        assert!(SharedHostBuffer::create(0).is_err());
    }
}
