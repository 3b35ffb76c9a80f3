//! Operating-system plumbing of the simulation: memfds, shared mappings, the machine lock and
//! process liveness. Every `unsafe` of the simulation that touches memory lives here.

use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

use crate::error::{DriverError, Result};

pub(super) fn os(call: &'static str, e: nix::Error) -> DriverError {
    DriverError::Os {
        call,
        source: std::io::Error::from_raw_os_error(e as i32),
    }
}

/// A new sparse memfd of `len` bytes, close-on-exec.
pub(super) fn sparse_memfd(name: &str, len: u64) -> Result<OwnedFd> {
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC).map_err(|e| os("memfd_create", e))?;
    let len = libc::off_t::try_from(len).map_err(|_| DriverError::InvalidArgument {
        call: "memfd_create",
        reason: format!("{len} bytes do not fit off_t"),
    })?;
    nix::unistd::ftruncate(&fd, len).map_err(|e| os("ftruncate", e))?;
    Ok(fd)
}

/// Gives `[offset, offset + len)` of a memfd back to the kernel: later reads see zeros.
pub(super) fn punch_hole(fd: &OwnedFd, offset: u64, len: u64) {
    use nix::fcntl::{FallocateFlags, fallocate};
    let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return;
    };
    // Best effort: a kernel without hole punching on shmem only keeps the pages resident.
    let _ = fallocate(
        fd.as_fd(),
        FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE,
        off,
        len,
    );
}

/// A `MAP_SHARED` read-write mapping of part of a file, unmapped on drop.
#[derive(Debug)]
pub(super) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; every access through it goes
// through `read`/`write`/`fill`, which copy bytes, so moving or sharing it between threads is
// no different from sharing a `Vec<u8>` behind `&` (writers are serialised by the machine lock
// or, for device memory, by the simulated stream order the caller asks for).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` from `offset`.
    pub(super) fn new(fd: impl AsFd, offset: u64, len: u64) -> Result<Mapping> {
        let bad = |reason: String| DriverError::InvalidArgument {
            call: "mmap",
            reason,
        };
        let n = usize::try_from(len)
            .ok()
            .and_then(NonZeroUsize::new)
            .ok_or_else(|| bad(format!("cannot map {len} bytes")))?;
        let off =
            libc::off_t::try_from(offset).map_err(|_| bad(format!("offset {offset} too large")))?;
        // SAFETY: a fresh mapping chosen by the kernel (no address hint, no MAP_FIXED) cannot
        // alias any Rust object; the file outlives nothing we rely on, since a mapping keeps
        // its file alive by itself.
        let p = unsafe {
            mmap(
                None,
                n,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED | MapFlags::MAP_NORESERVE,
                fd,
                off,
            )
        }
        .map_err(|e| os("mmap", e))?;
        Ok(Mapping {
            ptr: p.cast(),
            len: n.get(),
        })
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The first byte, for the shared machine state (see `MachineMap`).
    pub(super) fn base(&self) -> NonNull<u8> {
        self.ptr
    }

    fn check(&self, offset: usize, n: usize) -> Option<()> {
        (offset.checked_add(n)? <= self.len).then_some(())
    }

    /// Copies `dst.len()` bytes from `offset`. Out of range: `false`, nothing copied.
    pub(super) fn read(&self, offset: usize, dst: &mut [u8]) -> bool {
        if self.check(offset, dst.len()).is_none() {
            return false;
        }
        // SAFETY: `[offset, offset + dst.len())` lies in the mapping (checked above), which is
        // readable; `dst` is a distinct Rust buffer, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        true
    }

    /// Copies `src` to `offset`. Out of range: `false`, nothing copied.
    pub(super) fn write(&self, offset: usize, src: &[u8]) -> bool {
        if self.check(offset, src.len()).is_none() {
            return false;
        }
        // SAFETY: `[offset, offset + src.len())` lies in the mapping (checked above), which is
        // writable; `copy` is a memmove, so it stays correct even if `src` were made from this
        // very mapping.
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        true
    }

    /// Fills `n` bytes at `offset` with `value`. Out of range: `false`.
    pub(super) fn fill(&self, offset: usize, value: u8, n: usize) -> bool {
        if self.check(offset, n).is_none() {
            return false;
        }
        // SAFETY: in range and writable (checked above).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), value, n) };
        true
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned and nothing borrows the mapping
        // any more (we are in drop).
        let _ = unsafe { munmap(self.ptr.cast::<c_void>(), self.len) };
    }
}

/// Liveness of a process, as the driver judges whether its imports still exist: this one, or
/// one that [`alive`] finds running.
pub(super) fn process_alive(pid: u32) -> bool {
    pid == my_pid() || alive(pid)
}

/// Whether process (or thread) `id` still runs. A zombie does not: the kernel already closed
/// its files, which is when the real driver drops what the process held.
pub(super) fn alive(id: u32) -> bool {
    let Ok(raw) = i32::try_from(id) else {
        return false;
    };
    if raw <= 0 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{raw}/stat")) {
        Ok(stat) => {
            // "pid (comm) S ...": the state follows the last ')'.
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].trim_start().chars().next());
            !matches!(state, Some('Z' | 'X' | 'x'))
        }
        Err(_) => {
            // No procfs: fall back to kill(pid, 0), which cannot see zombies.
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None).is_ok()
        }
    }
}

pub(super) fn my_pid() -> u32 {
    nix::unistd::getpid().as_raw().unsigned_abs()
}

fn my_tid() -> u32 {
    nix::unistd::gettid().as_raw().unsigned_abs()
}

/// The machine-wide lock: a word in shared memory holding the owning thread's id (0: free).
///
/// A thread that dies holding it (its process was killed) is detected by [`alive`] and the
/// lock is taken over, so a SIGKILL mid-operation never deadlocks the other processes. What
/// the dead thread left half-done stays half-done: each operation is a handful of stores.
pub(super) struct MachineLock<'a> {
    word: &'a AtomicU32,
}

impl<'a> MachineLock<'a> {
    pub(super) fn acquire(word: &'a AtomicU32) -> MachineLock<'a> {
        let me = my_tid();
        let mut spins: u32 = 0;
        let mut last_check = Instant::now();
        loop {
            match word.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return MachineLock { word },
                Err(0) => continue,
                Err(owner) => {
                    if last_check.elapsed() > Duration::from_millis(2) {
                        last_check = Instant::now();
                        if owner != me && !alive(owner) {
                            tracing::warn!(
                                owner,
                                "sim: taking over the machine lock of a dead thread"
                            );
                            if word
                                .compare_exchange(owner, me, Ordering::Acquire, Ordering::Relaxed)
                                .is_ok()
                            {
                                return MachineLock { word };
                            }
                        }
                    }
                    spins = spins.saturating_add(1);
                    if spins < 64 {
                        std::hint::spin_loop();
                    } else if spins < 1024 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
            }
        }
    }
}

impl Drop for MachineLock<'_> {
    fn drop(&mut self) {
        self.word.store(0, Ordering::Release);
    }
}

/// Raises SIGSEGV with the default action, as libcuda's stack overflow ends: the process dies
/// by the signal (a Rust SIGSEGV handler, e.g. std's stack guard, is removed first).
pub(super) fn die_by_sigsegv() -> ! {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, SigmaskHow, Signal};
    let dfl = SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty());
    // SAFETY: installing the default disposition runs no Rust code in signal context.
    let _ = unsafe { nix::sys::signal::sigaction(Signal::SIGSEGV, &dfl) };
    let mut set = SigSet::empty();
    set.add(Signal::SIGSEGV);
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_UNBLOCK, Some(&set), None);
    let _ = nix::sys::signal::raise(Signal::SIGSEGV);
    std::process::abort()
}

/// The file behind host address `ptr`, if `[ptr, ptr + len)` lies in one file-backed mapping
/// of this process: (device, inode, offset of `ptr` in the file), from `/proc/self/maps`.
/// Anonymous memory, or a range over several mappings, gives `None`.
pub(super) fn backing_file(ptr: usize, len: usize) -> Option<(u64, u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let end = ptr.checked_add(len)?;
    for line in maps.lines() {
        // "start-end perms offset major:minor inode path"
        let mut f = line.split_ascii_whitespace();
        let (range, _perms, offset, dev, inode) =
            (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
        let (a, b) = range.split_once('-')?;
        let (a, b) = (
            usize::from_str_radix(a, 16).ok()?,
            usize::from_str_radix(b, 16).ok()?,
        );
        if ptr < a || ptr >= b {
            continue;
        }
        if end > b {
            return None;
        }
        let inode: u64 = inode.parse().ok()?;
        if inode == 0 {
            return None;
        }
        let (major, minor) = dev.split_once(':')?;
        let dev =
            (u64::from_str_radix(major, 16).ok()? << 32) | u64::from_str_radix(minor, 16).ok()?;
        let offset = u64::from_str_radix(offset, 16).ok()?;
        return Some((dev, inode, offset + (ptr - a) as u64));
    }
    None
}
