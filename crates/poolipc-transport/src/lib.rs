//! poolipc's wire protocol over Unix sockets.
//!
//! - [`Message`] and its parts: one message per step of the ownership contract.
//! - [`codec`]: the hand-written little-endian frame format, with a hard size cap
//!   ([`FrameLimits`]); decoding never panics and allocates only in proportion to the frame.
//! - [`Connection`]: frames and file descriptors over one Unix stream socket (`SCM_RIGHTS`,
//!   `MSG_CMSG_CLOEXEC`, `MSG_NOSIGNAL`), every wait bounded by a deadline.
//! - [`spawn_worker`] / [`connection_from_env`]: a worker started by the parent inherits one
//!   end of a `socketpair`, named by [`FD_ENV`].
//! - [`PrivateListener`] / [`connect_private`]: for workers started by someone else, a socket in
//!   a private 0700 directory, with `SO_PEERCRED` checked on both sides. Never an abstract
//!   socket: [`PrivateListener`] says why.
//! - [`parent_handshake`] / [`worker_handshake`]: protocol version, device UUID, driver
//!   version, capabilities, and the pool FD, once. [`worker_handshake_choosing`] lets a worker
//!   pick its device by the UUID in the parent's `Hello`.
//!
//! # Who sends what
//!
//! | message | direction | FDs |
//! |---|---|---|
//! | `Hello` | parent → worker, first frame | exactly 1: the pool |
//! | `HelloAck` / `Refuse` | worker → parent, then parent → worker (confirming or refusing) | 0 |
//! | `Lend` | parent → worker | 0 |
//! | `ResultRequest` | worker → parent | 0 |
//! | `AllocationGrant` | parent → worker | 0 |
//! | `Done` | worker → parent | 0 |
//! | `Ack`, `Error`, `Heartbeat`, `Bye` | either | 0 |
//! | `Cancel` | parent → worker | 0 |
//! | `StagingBuffer` | parent → worker, once, before host staging | exactly 1: the buffer's memfd |
//! | `StagingReady` | worker → parent, the answer | 0 |
//! | `Chunk` | either: the data's sender, then the receiver's echo | 0 |
//! | `ExtraPool` | parent → worker, once per further pool (a pool per device) | exactly 1: that pool |
//! | `ExtraPoolReply` | worker → parent, the answer | 0 |
//! | `ArenaChunk` | parent → worker, once per arena chunk | exactly 1: the chunk |
//! | `VmmShare` | parent → worker, once per VMM allocation lent by handle (protocol 8) | exactly 1: the allocation |
//!
//! A frame that arrives with other FDs than its kind carries is an error, and every FD that
//! came with it is closed before the error is returned.
//!
//! Unsafe code lives in `scm` (the `recvmsg` control-message walk) and in taking or handing
//! on inherited descriptors; each block says why it holds.
#![warn(missing_docs)]

pub mod codec;
mod connection;
mod error;
mod handshake;
mod listener;
pub mod rendezvous;
// The vocabulary is the contract's: this crate encodes it and has none of its own.
use poolipc_contract::message;
mod scm;
mod spawn;

pub use codec::{
    DecodeError, EncodeError, FrameLimits, MAX_FRAME_LEN, PROTOCOL_VERSION, check_lend,
};
pub use connection::{
    Connection, Direction, PARTIAL_FD_SLACK, SendQueueLimits, TOKEN_LEN, TransportError,
};
pub use error::SetupError;
pub use handshake::{
    HandshakeConfig, HandshakeError, Peer, parent_handshake, worker_handshake,
    worker_handshake_choosing,
};
pub use listener::{
    PeerCred, PrivateListener, check_peer_uid, connect_private, ensure_private_dir,
};
pub use message::{
    Ack, AllocationGrant, ArenaChunk, ArenaLocation, ArenaRelease, Capabilities, CarvedResult,
    Chunk, DeviceEntry, Done, ErrorCode, ExtraPool, ExtraPoolReply, Identity, Lend, LentSlice,
    LentTensor, MAX_BATCH, MAX_DEVICES, MAX_DIMS, MAX_TEXT_LEN, Message, MessageKind, PoolRetire,
    ResultGrant, ResultRequest, ResultSpec, StagingBuffer, TensorMeta, VmmShare,
};
pub use poolipc_types::AllocId;
pub use poolipc_types::{
    DType, DeviceUuid, EventBlob, ExportBlob, HandoffId, JobId, Layout, LayoutError, Rung,
};
pub use spawn::{FD_ENV, connection_from_env, parse_fd_var, spawn_worker};

#[cfg(test)]
mod connection_tests;
#[cfg(test)]
mod incremental_tests;
#[cfg(test)]
mod setup_tests;
