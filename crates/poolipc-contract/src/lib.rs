//! The poolipc ownership contract as a sans-IO state machine.
//!
//! ```text
//! EXPORT -> READY-event -> IMPORT -> WRITE -> DONE-event -> UNIMPORT -> ACK -> RELEASE
//! ```
//!
//! Two machines, one per side, in the manner of `quinn-proto`: no IO, no clock, no unsafe.
//! Inputs go in ([`Parent::lend`], [`Parent::handle`], [`Worker::handle`], [`Worker::finish`],
//! ...), with the time passed in as a [`Timestamp`]; the work to do comes out of
//! [`Parent::poll_action`] and [`Worker::poll_action`], in the order it must be done.
//!
//! - [`Parent`] lends inputs (refusing allocations above the [`ImportLimit`], the rung
//!   decision's input), answers shape-first result requests through the facade's allocator,
//!   releases a handoff only after the worker's ACK and a wait on its DONE event, enforces
//!   deadlines by killing the worker, and releases a dead worker's handoffs once it is reaped.
//! - [`Worker`] imports each allocation once and refcounts it, waits on READY before the
//!   memory is usable, and on [`Worker::finish`] records DONE, unimports, then ACKs.
//! - [`typestate`] gives the facade handles whose methods consume `self`, so the order is
//!   checked by the compiler where it can be.
//! - [`Invariant`] names DESIGN.md's eight invariants; [`audit::Auditor`] checks them on what
//!   the machines do; [`sim::World`] is the simulated world the property tests and the fuzz
//!   target drive.
//!
//! # Wiring a facade
//!
//! The parent's facade owns one [`Parent`]. After every call into it, it drains
//! [`Parent::poll_action`] and carries each action out in order: [`ParentAction::Export`]
//! (or its cached blob), [`ParentAction::RecordReady`], [`ParentAction::Send`] over the
//! worker's socket, [`ParentAction::AllocateResult`] (answered later with
//! [`ParentEvent::ResultAllocated`] or [`ParentEvent::ResultDeclined`]),
//! [`ParentAction::WaitDone`] then [`ParentAction::Release`], [`ParentAction::KillWorker`].
//! It feeds back every message ([`ParentEvent::Message`]), hang-up and reaping, and calls
//! [`Parent::handle_timeout`] when [`Parent::poll_timeout`] comes due. Before lending, the
//! facade picks the rung: [`ImportLimit::admits`] says whether the pool pointer rung is
//! allowed at all, and [`Parent::lend`] refuses what it does not admit.
//!
//! The worker's facade owns one [`Worker`] and does the same with [`WorkerAction`]s:
//! import, wait on READY, hand the memory to the user on [`WorkerAction::Usable`], and call
//! [`Worker::finish`] after the last access is queued.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod audit;
mod error;
mod invariant;
mod legacy;
pub mod message;
mod mutation;
mod parent;
pub mod sim;
mod types;
pub mod typestate;
mod worker;

#[cfg(test)]
mod tests;

pub use error::ContractError;
pub use invariant::{Invariant, Violation};
pub use legacy::{Offer, Refusal, ToParent, ToWorker};
pub use message::{
    Ack, AllocationGrant, Capabilities, Chunk, DeviceEntry, Done, ErrorCode, ExtraPool,
    ExtraPoolReply, Identity, Lend, LentTensor, MAX_BATCH, MAX_DEVICES, MAX_DIMS, MAX_TEXT_LEN,
    Message, MessageKind, ResultGrant, ResultRequest, StagingBuffer, TensorMeta,
};
pub use poolipc_types::{DeviceUuid, EventBlob, ExportBlob, Rung};
pub use parent::{FailReason, Parent, ParentAction, ParentConfig, ParentEvent};
pub use poolipc_types::{
    AllocId, CHUNK_BYTES, DType, HandoffId, ImportLimit, JobId, MAX_CHUNKS, RequestId, Span,
    WorkerId,
};
pub use types::{Outcome, Purpose, ResultSpec, Timestamp};
pub use worker::{Worker, WorkerAction, WorkerEvent};
