//! One turn of a spin-wait (the IO loop's, a caller's on its job, a worker's on its next
//! frame): a yield to the scheduler by default, or only a CPU hint where [`SPIN_YIELD_ENV`]
//! says so. With several workers each spinning thread (callers, IO threads, workers) wants a
//! core: a yielding spin lets a thread that has work run first on a machine with fewer cores
//! than spinners, and costs one system call a turn where it has more. Measured on an H100
//! under MPS (2026-12-05, one pair, `bench --workers 8 --io-threads 4`, 16 cores): 8 workers
//! 122.9k / 111.9k jobs/s (4 KiB / 64 MiB) yielding against 95.8k / 76.2k hinting; 1 to 4
//! workers within 5 % of each other.

use std::sync::OnceLock;

/// The environment variable that makes every spin-wait yield to the scheduler at each turn
/// (`1`, the default) or only hint the CPU (`0`).
pub const SPIN_YIELD_ENV: &str = "POOLIPC_SPIN_YIELD";

/// Whether this process's spin-waits yield ([`SPIN_YIELD_ENV`], read once per process; a
/// value other than a whole number is ignored with a warning, as the other spin settings
/// are).
pub fn yields() -> bool {
    static YIELDS: OnceLock<bool> = OnceLock::new();
    *YIELDS.get_or_init(|| crate::settings::env_number::<u8>(SPIN_YIELD_ENV).is_none_or(|v| v != 0))
}

/// One turn of a spin-wait.
pub(crate) fn pause() {
    if yields() {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}
