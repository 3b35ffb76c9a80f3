//! The shareable CUDA memory pool, and the rules around importing from it.
//!
//! - [`SharedPool`]: the parent's pool: created shareable by POSIX FD, given torch's
//!   attributes, made the device's current pool, its FD exported once.
//! - [`AttachedPool`]: the same pool imported by a worker.
//! - [`ImportLimit`]: which allocations may go by pointer import at all (the 128-chunk rule),
//!   defined in `poolipc-types` and re-exported here.
//! - [`ImportCache`]: the worker's one-import-per-allocation cache.
//! - [`PoolStats`]: the pool's true figures.
//! - [`ExportCacheStats`]: what the parent's export cache did.
//! - [`arena`]: the result arena: parent-owned VMM memory each worker maps once, so that a
//!   result handoff is an offset ([`Arena`], [`ArenaMapping`], [`ArenaAllocator`]).
//!
//! # The export cache
//!
//! `cuMemPoolExportPointer` costs about 0.43 ms/GiB every time, on an allocation it exported
//! before too (docs/facts.md). [`SharedPool::export`] therefore keeps each allocation's blob, keyed
//! by its base address with its `CU_POINTER_ATTRIBUTE_BUFFER_ID`, which the driver makes new for
//! every allocation: an address the pool hands out again (torch freed and reallocated, without
//! telling us) has a new id, so its old blob is not served for it as a hit. A repeated export
//! costs one attribute query instead of the export. The cache is bounded
//! ([`DEFAULT_EXPORT_CACHE_ENTRIES`], least recently used out first,
//! [`SharedPool::set_export_cache_capacity`]) and counts its hits, misses, stale entries,
//! evictions and the bytes it saved ([`SharedPool::export_cache_stats`]).
//!
//! # Export reuse at a recycled address
//!
//! On driver 580 the blob of an address is the same every time, and an import of an old blob
//! maps the blob's range at that address, whatever allocation lives there now (docs/facts.md,
//! 2026-12-04). So a new allocation at a cached address **with the cached size** may be lent
//! with the cached blob, saving the export (0.35–0.43 ms/GiB). Undocumented, so only once a
//! startup check with a real worker proved it on this driver ([`ExportReuse`],
//! [`SharedPool::begin_export_reuse_check`], run by the facade's canary battery); otherwise,
//! and always for a different size, the allocation is exported again. Security: a worker
//! holding the pool FD and any blob reaches that range of the pool whatever lives there, with
//! or without reuse; the pool FD is a capability to the whole pool (the hostile-worker issue
//! handles that).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod arena;
mod cache;
mod export_cache;
mod shared;
mod stats;
mod vmm_share;

pub use arena::{Arena, ArenaAllocator, ArenaBlock, ArenaError, ArenaMapping};
pub use cache::{CacheError, ImportCache, Released};
pub use export_cache::{DEFAULT_EXPORT_CACHE_ENTRIES, ExportCacheStats, ExportReuse};
pub use poolipc_types::{CHUNK_BYTES, ImportLimit, LimitExceeded, MAX_CHUNKS};
pub use shared::{
    AttachedPool, PoolError, ReuseCheck, Rotation, SharedPool, TORCH_POOL_ATTRIBUTES,
};
pub use stats::PoolStats;
pub use vmm_share::{VmmMappings, VmmShareError, VmmShareStats};
