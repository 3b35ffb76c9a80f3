//! One turn of a spin-wait (the IO loop's, a caller's on its job, a worker's on its next
//! frame): a yield to the scheduler by default, or only a CPU hint where `POOLIPC_SPIN_YIELD=0`
//! says so ([`Tuning::spin_yields`]). With several workers each spinning thread (callers, IO threads, workers) wants a
//! core: a yielding spin lets a thread that has work run first on a machine with fewer cores
//! than spinners, and costs one system call a turn where it has more. Measured on an H100
//! under MPS (2026-12-05, one pair, `bench --workers 8 --io-threads 4`, 16 cores): 8 workers
//! 122.9k / 111.9k jobs/s (4 KiB / 64 MiB) yielding against 95.8k / 76.2k hinting; 1 to 4
//! workers within 5 % of each other.

use crate::settings::Tuning;

/// One turn of a spin-wait.
pub(crate) fn pause() {
    if Tuning::spin_yields() {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}
