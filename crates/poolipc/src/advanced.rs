//! Below the facade: the layers [`Parent`](crate::Parent) and [`Worker`](crate::Worker) are
//! built on, for programs that need more than lending tensors.
//!
//! **Not part of the stable surface.** What this module re-exports follows the crates below the
//! facade and may change between minor versions of `poolipc`; the rest of the crate follows
//! semver. Reach for it when the facade does not say what you need: calling the driver
//! directly (streams, events, copies and memsets on memory you lend), owning driver objects,
//! attaching to a shared pool by hand, speaking the wire protocol or the rendezvous helpers
//! yourself (the Python module and the `poolipc` command do all of these).
//!
//! - [`driver`]: the [`Driver`](driver::Driver) trait (one method per CUDA driver call),
//!   [`CudaDriver`](driver::CudaDriver),
//!   the simulated driver ([`driver::sim`]), the handle types and the owning types
//!   ([`OwnedStream`](driver::OwnedStream), [`OwnedEvent`](driver::OwnedEvent),
//!   [`OwnedPool`](driver::OwnedPool), [`PoolAllocation`](driver::PoolAllocation), ...). Create
//!   streams, events and pools through the owning types: they destroy what they own on drop.
//! - [`pool`]: [`SharedPool`](pool::SharedPool) (the pool [`Parent::pool`](crate::Parent::pool) returns), the
//!   import limit, the import and export caches, the arena.
//! - [`contract`]: the ownership contract as sans-IO state machines.
//! - [`transport`]: frames and messages, the handshake, spawning and connecting workers, and
//!   the [`transport::rendezvous`] helpers (abstract sockets, FDs by `SCM_RIGHTS`).
//! - [`types`]: the dependency-free types everything above shares.
//!
//! [`RawDriver`], implemented by [`Parent`](crate::Parent), [`Worker`](crate::Worker) and
//! [`Job`](crate::Job), hands out the driver as an `Arc<dyn `[`Driver`](driver::Driver)`>`;
//! [`identity`] is the handshake identity a side presents (for a hand-written peer).

pub use poolipc_contract as contract;
pub use poolipc_driver as driver;
pub use poolipc_pool as pool;
pub use poolipc_transport as transport;
pub use poolipc_types as types;

pub use crate::handshake::identity;

use std::sync::Arc;

mod sealed {
    /// Keeps [`RawDriver`](super::RawDriver) implemented by the facade's types only.
    pub trait Sealed {}
    impl Sealed for crate::Parent {}
    impl Sealed for crate::Worker {}
    impl Sealed for crate::Job<'_> {}
}

/// The way below the facade: the driver a [`Parent`](crate::Parent), a
/// [`Worker`](crate::Worker) or a [`Job`](crate::Job) works with, as an
/// `Arc<dyn `[`Driver`](driver::Driver)`>` (one method per CUDA driver call: memsets, copies,
/// events on memory you lend or write; its methods need no import).
///
/// What the driver does is yours to keep right: streams, events and memory you create this
/// way are not tracked by the parent. Create streams, events and pools through the owning
/// types ([`OwnedStream`](driver::OwnedStream), [`OwnedEvent`](driver::OwnedEvent),
/// [`OwnedPool`](driver::OwnedPool)), which destroy what they own on drop. Not part of the
/// stable surface (see the [module](self)); implemented by the facade's types only.
///
/// ```no_run
/// use poolipc::advanced::RawDriver;
/// use poolipc::advanced::driver::OwnedStream;
///
/// # fn f(parent: &poolipc::Parent) -> Result<(), Box<dyn std::error::Error>> {
/// let stream = OwnedStream::new(parent.driver().clone())?; // cuStreamDestroy on drop
/// # Ok(()) }
/// ```
pub trait RawDriver: sealed::Sealed {
    /// The driver, below the facade.
    fn driver(&self) -> &Arc<dyn driver::Driver>;
}

impl RawDriver for crate::Parent {
    fn driver(&self) -> &Arc<dyn driver::Driver> {
        self.driver_ref()
    }
}

impl RawDriver for crate::Worker {
    fn driver(&self) -> &Arc<dyn driver::Driver> {
        self.driver_ref()
    }
}

impl RawDriver for crate::Job<'_> {
    fn driver(&self) -> &Arc<dyn driver::Driver> {
        self.driver_ref()
    }
}
