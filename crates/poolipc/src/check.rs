//! The simulated GPU as a race checker for your program.
//!
//! On the simulated driver (`POOLIPC_DRIVER=sim`), every access to memory by any stream of any
//! process is checked against the happens-before order that streams, events and host
//! synchronizes give (see docs/checking.md). What the checker finds reaches you three ways:
//!
//! - **the job that made it fails**: [`JobHandle::wait`](crate::JobHandle::wait) returns
//!   [`Error::SimViolation`](crate::Error::SimViolation) when a violation was recorded while
//!   the job ran, by its worker or by the parent, naming both calls, their streams and their
//!   processes, and the seed that replays the run;
//! - **a summary when the [`Parent`](crate::Parent) or [`Worker`](crate::Worker) is dropped**,
//!   on stderr, of every violation not reported yet;
//! - **on request**: [`Parent::sim_report`](crate::Parent::sim_report) gives every violation
//!   so far as a [`RaceReport`].
//!
//! With [`STRICT_ENV`]`=1` the first violation the facade sees panics with the report (a test
//! fails, a program exits non-zero). With `POOLIPC_SIM_CHECK=report`, jobs are not failed: the
//! violations are only reported at drop and by `sim_report`. On the CUDA driver nothing of
//! this runs: [`Driver::sim_checker`] is `None` and no label is
//! set.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use poolipc_driver::sim::Checker;
pub use poolipc_driver::sim::{SEED_ENV, Violation, ViolationKind};
use poolipc_driver::{DevicePtr, Driver, StreamHandle};

/// `1`: the first violation the facade sees panics with its report.
pub const STRICT_ENV: &str = "POOLIPC_SIM_STRICT";
/// `report`: a violation does not fail its job; it is reported at drop and by
/// [`Parent::sim_report`](crate::Parent::sim_report) only. Unset or `jobs`: jobs fail.
pub(crate) const CHECK_ENV: &str = "POOLIPC_SIM_CHECK";

/// What the simulated GPU's race checker found: the violations, each process named, and the
/// seed that replays the run. Its `Display` is the report a user reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaceReport {
    /// The violations, oldest first.
    pub violations: Vec<Violation>,
    /// Every process involved, by pid, as the report names it (`the parent`, `worker 1`).
    pub processes: Vec<(u32, String)>,
    /// The seed of the parent's simulated engine: run again with `POOLIPC_SIM_SEED` set to it
    /// to replay the same choices of delays and stream order.
    pub seed: u64,
}

impl RaceReport {
    /// Whether nothing was found.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.violations.is_empty()
    }

    fn name(&self, pid: u32) -> String {
        self.processes
            .iter()
            .find(|(p, _)| *p == pid)
            .map_or_else(|| format!("process {pid}"), |(_, n)| n.clone())
    }

    /// Each violation in words, one sentence each.
    #[must_use]
    pub fn lines(&self) -> Vec<String> {
        self.violations
            .iter()
            .map(|v| v.describe(&|pid| self.name(pid)))
            .collect()
    }
}

impl fmt::Display for RaceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.violations.len();
        if n == 0 {
            return write!(
                f,
                "the simulated GPU's race checker found nothing ({SEED_ENV}={})",
                self.seed
            );
        }
        write!(
            f,
            "the simulated GPU's race checker found {n} violation{} (replay with {SEED_ENV}={}):",
            if n == 1 { "" } else { "s" },
            self.seed
        )?;
        for (i, line) in self.lines().iter().enumerate() {
            write!(f, "\n  {}. {line}", i + 1)?;
        }
        Ok(())
    }
}

/// Whether [`STRICT_ENV`] asks to panic at the first violation.
#[must_use]
pub(crate) fn strict() -> bool {
    std::env::var(STRICT_ENV).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Whether a violation fails its job ([`CHECK_ENV`]).
fn fail_jobs() -> bool {
    std::env::var(CHECK_ENV).map_or(true, |v| v != "report")
}

/// One side's view of the simulated machine's violation log: how far it reported, and what
/// it calls each process.
pub(crate) struct Sim {
    checker: Checker,
    driver: Arc<dyn Driver>,
    names: Mutex<HashMap<u32, String>>,
    fail_jobs: bool,
    strict: bool,
}

impl Sim {
    /// The checker of `driver`, if it is the simulated one; `me` is what this process is
    /// called in reports.
    pub(crate) fn of(driver: &Arc<dyn Driver>, me: &str) -> Option<Arc<Sim>> {
        let checker = driver.sim_checker()?;
        let mut names = HashMap::new();
        names.insert(
            std::process::id(),
            format!("{me} (pid {})", std::process::id()),
        );
        Some(Arc::new(Sim {
            checker,
            driver: Arc::clone(driver),
            names: Mutex::new(names),
            fail_jobs: fail_jobs(),
            strict: strict(),
        }))
    }

    /// Names `pid` in reports (`worker 1`).
    pub(crate) fn name(&self, pid: u32, name: &str) {
        self.names
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(pid, format!("{name} (pid {pid})"));
    }

    /// Names a stream in reports.
    pub(crate) fn label_stream(&self, stream: StreamHandle, label: &str) {
        self.driver.label_stream(stream, label);
    }

    /// Names memory in reports.
    pub(crate) fn label_memory(&self, ptr: DevicePtr, label: &str) {
        self.driver.label_memory(ptr, label);
    }

    /// How many violations the machine recorded so far (where a job starts watching).
    pub(crate) fn count(&self) -> u64 {
        self.checker.count()
    }

    fn report(&self, violations: Vec<Violation>) -> RaceReport {
        let names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
        let mut processes: Vec<(u32, String)> = Vec::new();
        for v in &violations {
            for pid in std::iter::once(v.pid).chain(v.other_pid) {
                if !processes.iter().any(|(p, _)| *p == pid) {
                    let name = names
                        .get(&pid)
                        .cloned()
                        .unwrap_or_else(|| format!("process {pid}"));
                    processes.push((pid, name));
                }
            }
        }
        RaceReport {
            violations,
            processes,
            seed: self.checker.seed(),
        }
    }

    fn mark_reported(&self, upto: u64) {
        self.checker.mark_reported(upto);
    }

    /// Every violation recorded on the machine so far (marked reported).
    pub(crate) fn everything(&self) -> RaceReport {
        let upto = self.checker.count();
        let r = self.report(self.checker.since(0));
        self.mark_reported(upto);
        self.strict_check(&r);
        r
    }

    /// The violations recorded since `from` that involve one of `pids`, if any: what a job
    /// that started at `from` made. Marked reported.
    pub(crate) fn job(&self, from: u64, pids: &[u32]) -> Option<RaceReport> {
        if self.checker.count() <= from {
            return None;
        }
        let upto = self.checker.count();
        let found: Vec<Violation> = self
            .checker
            .since(from)
            .into_iter()
            .filter(|v| pids.contains(&v.pid) || v.other_pid.is_some_and(|p| pids.contains(&p)))
            .collect();
        if found.is_empty() {
            return None;
        }
        let r = self.report(found);
        self.mark_reported(upto);
        self.strict_check(&r);
        self.fail_jobs.then_some(r)
    }

    /// How many violations the machine has reported so far.
    pub(crate) fn reported(&self) -> u64 {
        self.checker.reported()
    }

    /// Panics with `r` in strict mode when it holds anything.
    fn strict_check(&self, r: &RaceReport) {
        if self.strict && !r.is_empty() && !std::thread::panicking() {
            panic!("{STRICT_ENV}=1: {r}");
        }
    }

    /// In strict mode, a panic with every violation this process made that no one reported
    /// yet; nothing otherwise (the parent fails the job).
    pub(crate) fn strict_own(&self) {
        if !self.strict {
            return;
        }
        let me = std::process::id();
        let found: Vec<Violation> = self
            .checker
            .since(self.checker.reported())
            .into_iter()
            .filter(|v| v.pid == me)
            .collect();
        self.strict_check(&self.report(found));
    }

    /// At drop: every violation not reported yet that involves one of `pids` (all of them when
    /// `pids` is empty), on stderr; in strict mode, a panic.
    pub(crate) fn summary(&self, pids: &[u32]) {
        let from = self.checker.reported();
        if self.checker.count() <= from {
            return;
        }
        let found: Vec<Violation> = self
            .checker
            .since(from)
            .into_iter()
            .filter(|v| {
                pids.is_empty()
                    || pids.contains(&v.pid)
                    || v.other_pid.is_some_and(|p| pids.contains(&p))
            })
            .collect();
        if found.is_empty() {
            return;
        }
        let r = self.report(found);
        self.mark_reported(self.checker.count());
        eprintln!("poolipc: {r}");
        self.strict_check(&r);
    }
}
