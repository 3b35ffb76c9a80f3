//! The regions of a process's simulated device address space: where its own pools, the pools
//! it imported and its VMM reservations start, and how much each pool spans. Below both the
//! address resolution ([`address`](super::address)) and the process's tables
//! ([`local`](super::local)), which both place things by them.

/// Where this process's own pools start.
pub(super) const OWN_BASE: u64 = 1 << 48;
/// Where the pools this process imported start.
pub(super) const IMPORT_BASE: u64 = 2 << 48;
/// Where VMM reservations start.
pub(super) const VMM_BASE: u64 = 3 << 48;
/// Address space per pool: the most memory a simulated device may have.
pub(super) const POOL_SPAN: u64 = 128 << 30;
/// The pool memfd's first page is its header; memory starts after it.
pub(super) const POOL_HEADER: u64 = 4096;
