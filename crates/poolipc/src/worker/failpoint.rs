//! Failpoints (the `testing` feature): a worker that kills itself, or hangs, at the step
//! `POOLIPC_FAILPOINT` names, for tests of what the parent does then. Canary jobs pass them by.

thread_local! {
    /// Whether this thread is answering the parent's canary battery.
    static IN_CANARY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The environment variable naming a failpoint (the `testing` feature): the worker kills itself
/// with SIGKILL when it reaches that step. For tests of what the parent does when a worker dies
/// mid-handoff; unset, it costs one lookup per process. Without the `testing` feature no
/// failpoint exists and the variable means nothing.
///
/// The steps: `before-import`, `before-ready-wait`, `after-import`, `after-grant`,
/// `after-write`, `before-done`, `after-done`, `after-ack`, `before-extra-pool-reply`.
///
/// One value hangs instead of dying: `hang-before-done` launches a kernel that never ends
/// ([`Driver::launch_hang_kernel`](poolipc_driver::Driver::launch_hang_kernel)) on the job's
/// stream right before DONE is recorded, then goes on as usual (Done, Ack): the worker's DONE
/// never completes on the GPU, for tests of what the parent does about that.
/// `hang-before-staged-send` does the same before a host-staged tensor goes back: its
/// `filled` records never complete.
#[cfg(feature = "testing")]
pub const FAILPOINT_ENV: &str = "POOLIPC_FAILPOINT";

/// Whether `POOLIPC_FAILPOINT` names `step` (outside the canary battery); never without the
/// `testing` feature.
#[cfg(feature = "testing")]
pub(super) fn failpoint_armed(step: &str) -> bool {
    if IN_CANARY.with(std::cell::Cell::get) {
        return false;
    }
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    AT.get_or_init(|| std::env::var(FAILPOINT_ENV).ok())
        .as_deref()
        == Some(step)
}

/// Without the `testing` feature no failpoint is ever armed.
#[cfg(not(feature = "testing"))]
#[inline(always)]
pub(super) fn failpoint_armed(_step: &str) -> bool {
    false
}

/// Dies here (SIGKILL) if `POOLIPC_FAILPOINT` names `step` (the `testing` feature). Canary jobs
/// pass failpoints by.
pub(crate) fn failpoint(step: &str) {
    if failpoint_armed(step) {
        tracing::warn!(step, "failpoint reached: the worker kills itself");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
    }
}

/// While it lives, this thread works on a canary job: failpoints pass by.
pub(super) struct CanaryScope {
    before: bool,
}

impl CanaryScope {
    pub(super) fn enter() -> CanaryScope {
        CanaryScope {
            before: IN_CANARY.with(|c| c.replace(true)),
        }
    }
}

impl Drop for CanaryScope {
    fn drop(&mut self) {
        IN_CANARY.with(|c| c.set(self.before));
    }
}
