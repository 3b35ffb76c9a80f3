//! One turn of a spin-wait (the IO loop's, a caller's on its job, a worker's on its next
//! frame): a CPU hint by default, or a yield to the scheduler where [`SPIN_YIELD_ENV`] says
//! so. With several workers each spinning thread (callers, IO threads, workers) wants a
//! core: a yielding spin lets a thread that has work run first on a machine with fewer cores
//! than spinners, and costs one system call a turn where it has more.

use std::sync::OnceLock;

/// The environment variable that makes every spin-wait yield to the scheduler at each turn
/// (`1`) instead of only hinting the CPU (`0`, the default).
pub const SPIN_YIELD_ENV: &str = "POOLIPC_SPIN_YIELD";

/// Whether this process's spin-waits yield ([`SPIN_YIELD_ENV`], read once per process; a value other than
/// a whole number is ignored with a warning, as the other spin settings are).
pub fn yields() -> bool {
    static YIELDS: OnceLock<bool> = OnceLock::new();
    *YIELDS.get_or_init(|| crate::parent::env_number::<u8>(SPIN_YIELD_ENV).is_some_and(|v| v != 0))
}

/// One turn of a spin-wait.
pub(crate) fn pause() {
    if yields() {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}
