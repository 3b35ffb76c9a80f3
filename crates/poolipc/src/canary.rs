//! What the parent's canary battery (`parent::canary`) and a worker's answer to it share:
//! the job-id bits that mark a canary job, the words and patterns it writes and checks, and
//! the report. It imports neither side.

use poolipc_pool::ExportReuse;
use poolipc_transport::JobId;

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

pub(crate) use poolipc_driver::pattern::{fill_pattern, marker, verify_echo};
