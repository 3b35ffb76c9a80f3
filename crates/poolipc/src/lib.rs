//! poolipc: hand CUDA tensors between a parent process and its workers without copying them,
//! while the parent keeps PyTorch's stream-ordered allocator.
//!
//! - [`Parent`] installs the shareable pool ([`SharedPool`](advanced::pool::SharedPool)),
//!   spawns workers over an inherited socketpair, shakes hands (the pool FD travels by
//!   SCM_RIGHTS) and runs jobs through an IO thread that drives the ownership contract for
//!   every worker at once (or
//!   [`io_threads`](Tuning::io_threads) of them, each for its share of the workers)
//!   ([`driver_loop`](crate#the-driver-loop)). `Parent` is `Send + Sync`: any thread
//!   [`submit`](Parent::submit)s and waits on its [`JobHandle`]. Memory is released only after
//!   the worker's ACK and once its DONE event completed, as the IO thread sees on the host (no
//!   stream of the parent's ever waits on a worker's event). Any fault of a worker (EOF, deadline,
//!   protocol violation) fails its jobs only: it is killed and reaped, its loans cancelled.
//! - [`Worker`] takes jobs: read views of the inputs after its stream waited on READY, write
//!   views of the results the parent allocated, DONE, UNIMPORT and ACK handled for the user.
//!
//! The ownership contract itself lives in [`advanced::contract`]: this crate drives its state
//! machines and does the IO they ask for, matching every action they emit; what goes on the
//! wire is what they emitted. Every tensor says which [`Rung`] it travelled on.
//!
//! # The driver loop
//!
//! One thread per [`Parent`] polls every worker's socket and a wake-up socket for callers'
//! commands. Each frame goes into the contract's parent machine; each action it emits is
//! carried out in order (record READY, send, push or pull host-staged bytes, allocate a
//! result, see DONE complete, release, kill and reap). Jobs on different workers run at the same
//! time and a worker may have several pool-pointer jobs in flight; a job with host-staged
//! tensors runs alone on its worker, since its bytes share the worker's socket. Staged inputs
//! are handed to the worker read-only: a write would change only the worker's copy.
//!
//! # Why `Arc<dyn Driver>`
//!
//! The facade holds the driver as `Arc<dyn Driver>`, not as a type parameter the way
//! wgpu-hal's `Api` is: the CUDA driver, the simulated driver, mockall's mock and the Python
//! binding then share one object (and one `Parent` type), and a driver call costs one indirect
//! call next to microseconds of CUDA. The choice is deliberate (docs/design.md, "The ownership
//! contract").
//!
//! # A parent and a worker
//!
//! One program, both parts: the parent opens the driver ([`driver`]: `POOLIPC_DRIVER` picks
//! `cuda`, `sim` or `auto`), spawns this same executable as its worker, lends it a tensor of
//! its shared pool and checks the result the worker wrote; the worker attaches to the
//! parent's driver with [`driver::open_worker`] (on the simulated driver, the machine whose
//! locator [`Parent::spawn_worker`] passed it). It runs as a doc test on the simulated driver
//! and is `cargo run -p poolipc --example handoff`. With the crate as a dependency
//! (`poolipc = { git = "https://github.com/poolipc/poolipc" }`, or a `path`), it is a whole
//! `main.rs`:
//!
#![doc = concat!("```rust,standalone_crate\n", include_str!("../examples/handoff.rs"), "```")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// The repository's README: its Rust block (a parent and a worker) compiles and runs as a doc
/// test, so the first example a reader sees is one that works.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
#[allow(dead_code)]
struct ReadmeDoctests;

pub mod advanced;
mod canary;
pub mod check;
pub mod driver;
mod driver_loop;
mod error;
mod handshake;
mod parent;
pub mod probe;
mod settings;
mod spin;
mod staging;
mod state;
mod tensor;
mod warm;
mod worker;
mod worker_env;

pub use canary::CanaryReport;
pub use error::{Error, ResultRefusal};
pub use parent::{
    ArenaStats, EmptyCache, Input, JobHandle, JobOutput, JobWatch, Limits, MemoryBound, Parent,
    ParentOptions, ParentStats, ResultAllocator, ResultMemory, ResultTensor, Trust, WorkerInfo,
};
pub use poolipc_contract::{Bound, FailReason, WorkerId};
pub use poolipc_driver::{DevicePtr, StreamHandle};
/// CUDA MPS for trusted workers: a private control daemon for one parent's process tree.
pub use poolipc_mps as mps;
pub use poolipc_pool::ExportReuse;
pub use poolipc_transport::{DType, JobId, SendQueueLimits};
pub use settings::{MAX_IO_THREADS, Tuning};
pub use staging::{StagingConfig, StagingError};
pub use tensor::{Layout, ResultShape, Rung};
#[cfg(feature = "testing")]
pub use worker::FAILPOINT_ENV;
pub use worker::{HeldJob, InputView, Job, NextJob, ResultView, Worker, WorkerDevice};
pub use worker_env::restrict_env;

/// Results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
