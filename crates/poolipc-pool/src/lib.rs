//! The shareable CUDA memory pool, and the rules around importing from it.
//!
//! - [`SharedPool`]: the parent's pool: created shareable by POSIX FD, given torch's
//!   attributes, made the device's current pool, its FD exported once.
//! - [`AttachedPool`]: the same pool imported by a worker.
//! - [`ImportLimit`]: which allocations may go by pointer import at all (the 128-chunk rule),
//!   defined in `poolipc-types` and re-exported here.
//! - [`ImportCache`]: the worker's one-import-per-allocation cache.
//! - [`PoolStats`]: the pool's true figures.
//! - [`arena`]: the result arena: parent-owned VMM memory each worker maps once, so that a
//!   result handoff is an offset ([`Arena`], [`ArenaMapping`], [`ArenaAllocator`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod arena;
mod cache;
mod shared;
mod stats;

pub use arena::{Arena, ArenaAllocator, ArenaBlock, ArenaError, ArenaMapping};
pub use cache::{CacheError, ImportCache, Released};
pub use poolipc_types::{CHUNK_BYTES, ImportLimit, LimitExceeded, MAX_CHUNKS};
pub use shared::{AttachedPool, PoolError, SharedPool, TORCH_POOL_ATTRIBUTES};
pub use stats::PoolStats;
