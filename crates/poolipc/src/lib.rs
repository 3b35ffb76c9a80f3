//! poolipc: hand CUDA tensors between a parent process and its workers without copying them,
//! while the parent keeps PyTorch's stream-ordered allocator.
//!
//! - [`Parent`] installs the shareable pool ([`poolipc_pool::SharedPool`]), spawns workers over
//!   an inherited socketpair, shakes hands (the pool FD travels by SCM_RIGHTS), lends inputs
//!   and serves the workers' shape-first result requests, and releases memory only after the
//!   worker's ACK and a wait on its DONE event. A worker that dies fails its job only.
//! - [`Worker`] takes jobs: read views of the inputs after its stream waited on READY, write
//!   views of the results the parent allocated, DONE, UNIMPORT and ACK handled for the user.
//!
//! The ownership contract itself lives in [`poolipc_contract`]: this crate drives its state
//! machines and does the IO they ask for. Every tensor says which [`Rung`] it travelled on.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod canary;
pub mod echo;
mod error;
mod handshake;
mod parent;
pub mod staging;
mod tensor;
mod worker;

pub use canary::CanaryReport;
pub use error::Error;
pub use handshake::identity;
pub use parent::{Input, JobOutput, Parent, ParentOptions, ResultTensor, WorkerInfo};
pub use poolipc_contract::WorkerId;
pub use poolipc_driver::{DevicePtr, Driver, StreamHandle};
pub use poolipc_transport::{DType, JobId};
pub use tensor::{ResultShape, Rung, TensorDesc};
pub use worker::{FAILPOINT_ENV, InputView, Job, ResultView, Worker, WorkerDevice, failpoint};

/// Results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
