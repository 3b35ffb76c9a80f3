//! The slice of the CUDA driver API poolipc uses.
//!
//! - [`Driver`]: the trait, one method per driver call.
//! - [`CudaDriver`]: libcuda through cudarc's `driver::sys`, loaded at run time. Driver API
//!   only, never cudart (torch links its own copy statically).
//! - `sim::SimDriver`: a simulation for machines without a GPU, chosen explicitly, never a
//!   silent fallback.
//! - `MockDriver` (feature `mock`): mockall's mock of the trait.
//! - Owning types ([`OwnedPool`], [`PoolAllocation`], [`ImportedPointer`], [`OwnedEvent`],
//!   [`OwnedStream`], [`DeviceAllocation`], [`VmmAllocation`], [`VmmReservation`],
//!   [`VmmMapping`], [`HostRegistration`]): the only way safe code destroys what the driver
//!   made; the trait's destroying calls are `unsafe fn`s. Pools, events and streams are
//!   created only through them: the trait's creating calls take an [`OwnerToken`] that only
//!   the owning types can make.
//! - [`host::SharedHostBuffer`]: pinned host memory two processes share, for host staging.
//!
//! Raw FFI lives here and in the transport's FD handling, nowhere else in the workspace.
#![warn(missing_docs)]

mod api;
mod cuda;
mod error;
pub mod host;
pub mod mps_env;
mod owned;
pub mod pattern;
pub mod platform;
pub mod sim;
mod types;
mod violation;

pub use api::Driver;
#[cfg(any(test, feature = "mock"))]
pub use api::MockDriver;
pub use cuda::CudaDriver;
pub use error::{CuCode, DriverError, Result};
pub use owned::{
    DeviceAllocation, HostRegistration, ImportedPointer, OwnedEvent, OwnedPool, OwnedStream,
    PoolAllocation, VmmAllocation, VmmMapping, VmmReservation,
};
pub use poolipc_types::{DeviceUuid, EventBlob, ExportBlob};
pub use types::{
    Access, DeviceInfo, DevicePtr, DriverKind, EventHandle, Granularity, OwnerToken, PointerInfo,
    PoolAttribute, PoolCounter, PoolHandle, PoolSharing, StreamHandle, VmmHandle,
};

/// The oldest driver API version poolipc accepts: 12.0 (`cuDriverGetVersion` == 12000).
///
/// Memory pool IPC exists since 11.2, but the bindings are generated for 12.x and the
/// pointer export ordering we depend on was measured on 12.x and 13.0 drivers only.
pub const MIN_DRIVER_VERSION: i32 = 12000;
