//! Owning handles: each destroys what it holds when dropped, and a failure to do so is logged
//! (`tracing::warn!`), never a panic (as cudarc's `CudaEvent` does). Where a caller needs the
//! error, a consuming `close` returns it instead.
//!
//! The trait's destroying calls are `unsafe fn`s; these types are how safe code destroys:
//! each is made by the driver call that creates the resource (so the handle is live and this
//! value its only owner) and destroys it once, in `Drop` or `close`. Pools, events and streams
//! are also created only here: the trait's creating calls take an [`OwnerToken`], which only
//! this module makes, so no handle of theirs exists without an owner (`into_raw` gives one
//! up on purpose).
//!
//! Each holds the driver it was made by as `R`: anything that dereferences to a
//! [`Driver`](crate::Driver) (`Arc<dyn Driver>`, the default, `Arc<SimDriver>`, or a
//! `&dyn Driver` for a value that lives within one function).

mod event;
mod memory;
mod pool;
mod vmm;

pub use event::{OwnedEvent, OwnedStream};
pub use memory::{DeviceAllocation, HostRegistration};
pub use pool::{ImportedPointer, OwnedPool, PoolAllocation};
pub use vmm::{VmmAllocation, VmmMapping, VmmReservation};

/// Logs a failed destroy in `Drop` (which must not panic) and carries on.
fn warn_failed<T: std::fmt::Debug>(what: &'static str, handle: T, r: crate::Result<()>) {
    if let Err(e) = r {
        tracing::warn!(?handle, error = %e, "destroying {what} failed");
    }
}
