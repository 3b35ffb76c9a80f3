//! The poolipc ownership contract as a sans-IO state machine, and the wire messages it
//! speaks.
//!
//! ```text
//! EXPORT -> READY-event -> IMPORT -> WRITE -> UNIMPORT -> DONE-event -> ACK -> RELEASE
//! ```
//!
//! Two machines, one per side, in the manner of `quinn-proto`: no IO, no clock, no unsafe.
//! Inputs go in ([`Parent::start_job`], [`Parent::handle`], [`Worker::handle`],
//! [`Worker::finish_job`], ...), with the time passed in as a [`Timestamp`]; the work to do
//! comes out of [`Parent::poll_action`] and [`Worker::poll_action`], in the order it must be
//! done. What the machines send is a [`Message`] of [`message`]: the transport encodes it
//! and nothing else, so the protocol these tests prove is the one that runs.
//!
//! - [`Parent`] starts a job with one `Lend` (checking pool-pointer inputs against the
//!   [`ImportLimit`]; host-staged inputs are ordinary loans whose bytes the facade pushes),
//!   answers shape-first result requests through the facade's allocator, releases a job's
//!   handoffs only after the worker's `Ack` and a wait on its DONE event, condemns a worker
//!   at its first misbehaviour or missed deadline, and releases a dead worker's handoffs once
//!   it is reaped.
//! - [`Worker`] imports each allocation once and refcounts it, waits on READY before a job
//!   is usable, and on [`Worker::finish_job`] frees its imports, records DONE, sends `Done`
//!   and then `Ack`.
//! - [`Invariant`] names docs/design.md's eight invariants.
//!
//! # Feature `testing`
//!
//! Off by default: the scaffolding of the crate's own tests and of the fuzz target. `typestate`
//! gives handles whose methods consume `self`, so the order of one handoff is checked by the
//! compiler; `audit::Auditor` checks the eight invariants on what the machines do;
//! `sim::World` is the simulated world the property tests and the fuzz target drive.
//!
//! # Wiring a facade
//!
//! The parent's facade owns one [`Parent`]. After every call into it, it drains
//! [`Parent::poll_action`] and carries out each [`ParentAction`] in order, matching every
//! variant: record READY, send the message unchanged, push or pull staged bytes, allocate a
//! result (answered with [`ParentEvent::ResultAllocated`] or [`ParentEvent::ResultDeclined`]),
//! wait on DONE then release, free an unoffered result, kill a worker, finish a job, drop a
//! worker's slot. It feeds back every message the worker sends ([`ParentEvent::Received`]),
//! hang-ups and reaping, and calls [`Parent::handle_timeout`] when [`Parent::poll_timeout`]
//! comes due.
//!
//! The worker's facade owns one [`Worker`] and does the same with [`WorkerAction`]s: import,
//! wait on READY, receive staged inputs, run the job on [`WorkerAction::JobStarted`], ask for
//! results ([`Worker::request_results`]), and call [`Worker::finish_job`] once its last
//! access is queued.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(any(test, feature = "testing"))]
pub mod audit;
mod error;
mod invariant;
pub mod message;
mod mutation;
mod parent;
#[cfg(any(test, feature = "testing"))]
pub mod sim;
pub mod text;
mod types;
#[cfg(any(test, feature = "testing"))]
pub mod typestate;
mod worker;

#[cfg(test)]
mod tests;

pub use error::ContractError;
pub use invariant::{Invariant, Violation};
pub use message::{
    Ack, AllocationGrant, ArenaChunk, ArenaLocation, ArenaRelease, Capabilities, CarvedResult,
    Chunk, DeviceEntry, Done, ErrorCode, ExtraPool, ExtraPoolReply, Identity, Lend, LentSlice,
    LentTensor, MAX_BATCH, MAX_DEVICES, MAX_DIMS, MAX_REFUSAL_TEXT_LEN, MAX_RESULTS_PER_REQUEST,
    MAX_TEXT_LEN, Message, MessageKind, PoolRetire, ResultGrant, ResultRequest, ResultSpec,
    StagingBuffer, TensorMeta, VmmShare,
};
pub use parent::{
    Bound, DEFAULT_CANCEL_GRACE, DEFAULT_MAX_IDLE_MESSAGES, DEFAULT_MAX_JOB_LIFETIME,
    DEFAULT_MAX_RESULT_BYTES_PER_JOB, DEFAULT_MAX_RESULT_BYTES_PER_WORKER,
    DEFAULT_MAX_RESULTS_PER_JOB, FailReason, InputLoan, JobOutcome, Parent, ParentAction,
    ParentConfig, ParentEvent, SliceLoan,
};
pub use poolipc_types::{
    ARENA_ALIGN, AllocId, CHUNK_BYTES, DType, DeviceUuid, EventBlob, ExportBlob, HandoffId,
    ImportLimit, JobId, Layout, LayoutError, MAX_CHUNKS, RequestId, Rung, Span, WorkerId,
};
pub use text::worker_text;
pub use types::{Outcome, Purpose, Timestamp, dense_bytes};
pub use worker::{Worker, WorkerAction};
