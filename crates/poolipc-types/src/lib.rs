//! The plain types every poolipc crate speaks in, defined once.
//!
//! - Ids: [`WorkerId`], [`JobId`], [`HandoffId`] (the wire's handle), [`AllocId`],
//!   [`RequestId`].
//! - [`Span`]: an allocation's device address range.
//! - [`DType`]: a tensor's element type, with its wire number.
//! - [`DeviceUuid`]: a GPU's stable identity.
//! - [`ExportBlob`] and [`EventBlob`]: the 64 opaque bytes of a pointer export and of an
//!   interprocess event handle.
//! - [`Rung`]: how a tensor crosses the process boundary, with its wire number.
//! - [`ImportLimit`]: the chunk rule deciding which allocations may go by pool pointer.
//! - [`ARENA_ALIGN`]: the alignment of every block of the result arena (and of every carve of
//!   an arena slice).
//!
//! No dependencies (the optional `arbitrary` feature aside), no IO, no unsafe: the driver,
//! the contract and the transport all sit on top of this crate.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod blob;
mod device;
mod dtype;
mod id;
mod layout;
mod limit;
mod rung;
mod span;

pub use blob::{EventBlob, ExportBlob};
pub use device::DeviceUuid;
pub use dtype::DType;
pub use id::{AllocId, HandoffId, JobId, RequestId, WorkerId};
pub use layout::{Layout, LayoutError};
pub use limit::{CHUNK_BYTES, ImportLimit, LimitExceeded, MAX_CHUNKS};
pub use rung::Rung;
pub use span::Span;

/// The alignment of every block of the parent's result arena, and of every result a worker
/// carves out of an arena slice, in bytes: offsets and reserved lengths are multiples of it.
///
/// CUDA's allocators hand out 256-byte aligned pointers and torch assumes at least that (its
/// vectorised kernels want 16 bytes, cuBLAS/cuDNN 256 for their fast paths). 512 keeps a
/// margin for anything that assumes "more than cudaMalloc's documented 256" and costs at most
/// 511 bytes per block. Defined here so that the arena's allocator (`poolipc-pool`) and the
/// contract's check of a worker's carves (`poolipc-contract`) agree on it.
pub const ARENA_ALIGN: u64 = 512;
