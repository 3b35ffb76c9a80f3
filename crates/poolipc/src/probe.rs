//! Timestamps along the handoff path, for finding where a round trip's microseconds go.
//!
//! Off unless `POOLIPC_PROBE=DIR` is set (read once per process): then every [`mark`] records
//! the monotonic clock (`CLOCK_MONOTONIC`, the same clock in every process of the machine)
//! with a static label, and [`dump`] (called when a [`Parent`](crate::Parent) or
//! [`Worker`](crate::Worker) is dropped) writes them to a new file `DIR/probe-<pid>-<n>.txt`
//! (`n` counts the dumps of this process), one
//! `<nanoseconds> <label> <thread id>` line each. Parent and worker files merge into one
//! timeline by time; `bench/probe_report.py DIR` prints the median of each step between
//! marks, and `--threads` where each thread's time goes (several workers at once, where one
//! timeline no longer reads as one round trip).
//!
//! Each file is created with `O_CREAT | O_EXCL | O_NOFOLLOW` (mode 0600): a file or symlink
//! already at that path is never followed nor written to; the marks are dropped with a
//! warning instead.
//!
//! Off, a mark costs one relaxed atomic load. On, about 50 ns (the clock and an uncontended
//! lock); at most 2^20 marks are kept per process, later ones are dropped and counted.

use std::cell::Cell;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Marks kept per process.
pub(crate) const CAPACITY: usize = 1 << 20;

const UNKNOWN: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
static MARKS: Mutex<Vec<(u64, &'static str, u32)>> = Mutex::new(Vec::new());
static DROPPED: AtomicU64 = AtomicU64::new(0);
static DUMPS: AtomicU64 = AtomicU64::new(0);

fn dir() -> Option<&'static PathBuf> {
    DIR.get_or_init(|| {
        let dir = std::env::var_os("POOLIPC_PROBE").filter(|d| !d.is_empty())?;
        Some(PathBuf::from(dir))
    })
    .as_ref()
}

/// Whether marks are recorded in this process.
#[must_use]
pub(crate) fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => {
            let on = dir().is_some();
            STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
            on
        }
    }
}

fn now_ns() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(t) => u64::try_from(t.tv_sec())
            .unwrap_or(0)
            .saturating_mul(1_000_000_000)
            .saturating_add(u64::try_from(t.tv_nsec()).unwrap_or(0)),
        Err(_) => 0,
    }
}

thread_local! {
    /// This thread's kernel id (`gettid`), read at its first mark: 0 until then.
    static TID: Cell<u32> = const { Cell::new(0) };
}

/// The calling thread's kernel thread id, asked of the kernel once per thread.
fn thread_id() -> u32 {
    TID.with(|tid| {
        if tid.get() == 0 {
            tid.set(u32::try_from(nix::unistd::gettid().as_raw()).unwrap_or(0));
        }
        tid.get()
    })
}

/// Records `label` at the current time, with the calling thread's id, when probing is on.
#[inline]
pub fn mark(label: &'static str) {
    if !enabled() {
        return;
    }
    let t = now_ns();
    let tid = thread_id();
    let mut marks = MARKS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if marks.len() < CAPACITY {
        marks.push((t, label, tid));
    } else {
        DROPPED.fetch_add(1, Ordering::Relaxed);
    }
}

/// Writes the marks recorded so far to a new `DIR/probe-<pid>-<n>.txt` and forgets them. Does nothing
/// when probing is off; a file that cannot be written is logged, never an error.
pub fn dump() {
    if !enabled() {
        return;
    }
    let Some(dir) = dir() else { return };
    let marks = std::mem::take(
        &mut *MARKS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    let dropped = DROPPED.swap(0, Ordering::Relaxed);
    if marks.is_empty() && dropped == 0 {
        return;
    }
    let n = DUMPS.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!("probe-{}-{n}.txt", std::process::id()));
    let written = std::fs::create_dir_all(dir).and_then(|()| {
        let file = open_new(&path)?;
        let mut out = std::io::BufWriter::new(file);
        for (t, label, tid) in &marks {
            writeln!(out, "{t} {label} {tid}")?;
        }
        if dropped > 0 {
            writeln!(out, "# dropped {dropped} marks past the capacity")?;
        }
        out.flush()
    });
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), error = %e, "writing the probe's marks failed");
    }
}

/// Creates `path` for writing, refusing anything already there, a symlink included.
fn open_new(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .mode(0o600)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_symlink_planted_at_the_probe_path_is_not_followed() {
        let dir = std::env::temp_dir().join(format!("poolipc-probe-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("target.txt");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.join("probe-link.txt");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = open_new(&link).expect_err("a symlink must not be opened");
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists, "{err}");
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        // A dangling symlink is not followed either (O_EXCL refuses it; no file appears).
        std::fs::remove_file(&target).unwrap();
        assert!(open_new(&link).is_err());
        assert!(!target.exists(), "the dangling link's target was created");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_fresh_probe_path_is_created() {
        let dir = std::env::temp_dir().join(format!("poolipc-probe-new-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("probe.txt");
        let _ = std::fs::remove_file(&path);
        drop(open_new(&path).unwrap());
        assert!(path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn each_thread_is_named_by_its_own_kernel_id() {
        let here = thread_id();
        assert_ne!(here, 0);
        assert_eq!(here, thread_id(), "asked once, kept");
        let there = std::thread::spawn(thread_id).join().unwrap();
        assert_ne!(there, 0);
        assert_ne!(here, there);
    }

    #[test]
    fn the_clock_moves_forward_in_nanoseconds() {
        let a = now_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = now_ns();
        assert!(a > 0);
        assert!(b - a >= 2_000_000, "{a} → {b}");
    }
}
