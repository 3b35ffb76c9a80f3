//! What the parent's API and its IO loop both hold: a job's data and its end ([`job`]), the
//! options ([`options`]), the counters ([`stats`]), the result arenas ([`arenas`]), the GPU
//! turns ([`turns`]) and a worker's trust ([`trust`]). It imports neither `parent` nor
//! `driver_loop`: both import it.

use std::sync::{Mutex, MutexGuard, PoisonError};

pub(crate) mod arenas;
pub(crate) mod job;
pub(crate) mod options;
pub(crate) mod stats;
pub(crate) mod trust;
pub(crate) mod turns;

pub(crate) use arenas::SharedArena;
pub(crate) use job::{Answer, AnyWake, ArenaLease, Completion};
pub use job::{Input, JobOutput, ResultAllocator, ResultTensor};
pub(crate) use options::EMPTY_CACHE_WAIT;
pub use options::{Limits, MemoryBound, ParentOptions, ResultMemory};
pub(crate) use stats::Stats;
pub use stats::{ArenaStats, EmptyCache, ParentStats, WorkerInfo};
pub use trust::Trust;

/// Locks a mutex, taking the data back if a thread panicked while holding it (the data of
/// these mutexes stays consistent at every unlock).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
