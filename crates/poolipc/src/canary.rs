//! What the parent's canary battery (`parent::canary`) and a worker's answer to it share:
//! the job-id bits that mark a canary job, the words and patterns it writes and checks, and
//! the report. It imports neither side.

use poolipc_driver::{DevicePtr, Driver, StreamHandle};
use poolipc_pool::ExportReuse;
use poolipc_transport::JobId;

use crate::error::Error;

/// Job ids with this bit set are canary jobs.
pub(crate) const CANARY_BIT: u64 = 1 << 63;

/// A canary job whose id also has this bit: the worker writes
/// [`marker`]`(i)` into the first word of each writable pool-pointer input `i` after
/// its echo, for the parent to read back (the export reuse check's write through an old
/// blob).
pub(crate) const CANARY_IN_PLACE_BIT: u64 = 1 << 62;

/// The size the export reuse check recycles: two 32 MiB chunks (64 MiB was measured on the
/// H200, with 1 GiB and 4 GiB).
pub(crate) const REUSE_CHECK_BYTES: u64 = 64 * MIB;

/// How many allocations of [`REUSE_CHECK_BYTES`] the check makes, each held, before it stops
/// waiting for the pool to hand the freed address back.
pub(crate) const REUSE_CHECK_TRIES: usize = 8;

/// Whether a job is part of the canary battery.
#[must_use]
pub(crate) fn is_canary(job: JobId) -> bool {
    job.0 & CANARY_BIT != 0
}

/// What the battery found on one worker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CanaryReport {
    /// Checks that passed.
    pub passed: Vec<&'static str>,
    /// Checks that failed, with why.
    pub failed: Vec<(&'static str, String)>,
    /// Checks not run because their tensor is over this parent's import limit (it would
    /// take another rung).
    pub skipped: Vec<&'static str>,
    /// The pool's export reuse verdict after this battery (this battery's check, or an
    /// earlier worker's), and why not proven where the check said so. Not a canary: a
    /// verdict other than proven demotes nobody, it only keeps every export.
    pub export_reuse: (ExportReuse, Option<String>),
}

impl CanaryReport {
    /// Whether every check passed.
    #[must_use]
    pub fn ok(&self) -> bool {
        self.failed.is_empty()
    }
}

impl std::fmt::Display for CanaryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} canaries passed",
            self.passed.len(),
            self.passed.len() + self.failed.len()
        )?;
        if !self.skipped.is_empty() {
            write!(f, " ({} over the import limit skipped)", self.skipped.len())?;
        }
        for (name, why) in &self.failed {
            write!(f, "; {name}: {why}")?;
        }
        write!(f, "; export reuse {}", self.export_reuse.0)?;
        if let Some(why) = &self.export_reuse.1 {
            write!(f, ": {why}")?;
        }
        Ok(())
    }
}

/// A mebibyte.
pub(crate) const MIB: u64 = 1 << 20;

/// The word a worker's answer to a canary job writes at the start of result `i` (the echo
/// worker's too).
#[must_use]
pub(crate) fn marker(i: usize) -> u32 {
    0xEC40_0000 | (i as u32 & 0xFFFF)
}

/// Fills `[ptr, ptr + bytes)` with the repeating little-endian bytes of `pattern` on
/// `stream`, byte `k` being `pattern.to_le_bytes()[k % 4]`, never touching a byte beyond (the
/// driver refuses a memset past the allocation's size). `ptr` must be 4-byte aligned.
pub(crate) fn fill_pattern(
    driver: &dyn Driver,
    ptr: DevicePtr,
    bytes: u64,
    pattern: u32,
    stream: StreamHandle,
) -> Result<(), Error> {
    let words = bytes / 4;
    if words > 0 {
        driver.memset_d32_async(ptr, pattern, words, stream)?;
    }
    let tail = pattern.to_le_bytes();
    for k in words * 4..bytes {
        driver.memset_d8_async(ptr.offset(k), tail[(k % 4) as usize], 1, stream)?;
    }
    Ok(())
}

/// Checks that `[ptr, ptr + bytes)` holds what a worker's answer to a canary job makes of input `i` when that input
/// was filled by [`fill_pattern`] with `pattern` starting `offset` bytes into its allocation:
/// the marker first, the pattern after, sampled (64 KiB) at both ends.
pub(crate) fn verify_echo(
    driver: &dyn Driver,
    ptr: DevicePtr,
    bytes: u64,
    i: usize,
    pattern: u32,
    offset: u64,
) -> Result<(), String> {
    let sample = bytes.min(64 * 1024) as usize;
    let pat = pattern.to_le_bytes();
    for start in [0, bytes - sample as u64] {
        let mut buf = vec![0u8; sample];
        driver
            .memcpy_dtoh(&mut buf, ptr.offset(start))
            .map_err(|e| e.to_string())?;
        for (k, b) in buf.iter().enumerate() {
            let at = start + k as u64;
            let want = if at < 4 {
                marker(i).to_le_bytes()[at as usize]
            } else {
                pat[((at + offset) % 4) as usize]
            };
            if *b != want {
                return Err(format!(
                    "byte {at} of result {i} is {b:#04x}, expected {want:#04x}"
                ));
            }
        }
    }
    Ok(())
}
