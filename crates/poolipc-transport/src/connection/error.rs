//! What can go wrong on a connection, and which way it was going.

use std::time::Duration;

use nix::errno::Errno;

use super::SendQueueLimits;
use crate::codec::{DecodeError, EncodeError};
use crate::message::MessageKind;

/// Which way a timed-out operation was going.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Direction {
    /// Sending a frame.
    Send,
    /// Receiving a frame.
    Recv,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Direction::Send => "send",
            Direction::Recv => "receive",
        })
    }
}

/// Why a frame could not be sent or received.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The deadline passed. `partial` says a frame was half sent or half received: the
    /// connection is then unusable in that direction (see [`TransportError::Broken`]).
    #[error("{direction} deadline passed{}", if *partial { " in the middle of a frame" } else { "" })]
    Timeout {
        /// Which way.
        direction: Direction,
        /// Whether part of a frame had moved.
        partial: bool,
    },
    /// The peer closed its end (EOF). `mid_frame`: it did so inside a frame.
    #[error("peer closed the connection{}", if *mid_frame { " in the middle of a frame" } else { "" })]
    PeerClosed {
        /// Whether part of a frame had arrived.
        mid_frame: bool,
    },
    /// A peer of a listener that demands a token sent another one.
    #[error("the peer presented the wrong connect token")]
    WrongToken,
    /// The peer is gone (`EPIPE`, `ECONNRESET`): it died or closed while we wrote.
    #[error("peer is gone ({errno})")]
    PeerGone {
        /// What the kernel said.
        errno: Errno,
    },
    /// The frame arrived but is not valid.
    #[error("malformed frame: {0}")]
    Decode(#[from] DecodeError),
    /// The message cannot be encoded.
    #[error("cannot encode: {0}")]
    Encode(#[from] EncodeError),
    /// File descriptors came with a frame that carries fewer (or none). All were closed.
    #[error("{kind} frame carries {expected} file descriptors, {received} arrived; all closed")]
    UnexpectedFds {
        /// The message.
        kind: MessageKind,
        /// How many it carries.
        expected: usize,
        /// How many came.
        received: usize,
    },
    /// A frame that carries file descriptors came with too few. Those that came were closed.
    #[error("{kind} frame carries {expected} file descriptors, only {received} arrived")]
    MissingFds {
        /// The message.
        kind: MessageKind,
        /// How many it carries.
        expected: usize,
        /// How many came.
        received: usize,
    },
    /// More file descriptors were sent than one frame may carry; the kernel truncated them
    /// (`MSG_CTRUNC`). The {received} that arrived were closed.
    #[error(
        "too many file descriptors for one frame (MSG_CTRUNC); the {received} that arrived were closed"
    )]
    FdsTruncated {
        /// How many arrived before the truncation.
        received: usize,
    },
    /// The caller passed the wrong number of file descriptors for the message.
    #[error("{kind} carries {expected} file descriptors, {given} given")]
    WrongFdCount {
        /// The message.
        kind: MessageKind,
        /// How many it carries.
        expected: usize,
        /// How many were given.
        given: usize,
    },
    /// An earlier failure left this direction of the stream out of step; nothing more can be
    /// read (or written) on it.
    #[error("connection broken ({direction}): {reason}")]
    Broken {
        /// Which way is broken.
        direction: Direction,
        /// What broke it.
        reason: String,
    },
    /// More descriptors came with a frame not yet complete than that frame may carry (its
    /// kind's, and [`PARTIAL_FD_SLACK`](super::PARTIAL_FD_SLACK) more): a peer dripping descriptors onto a slow frame.
    /// All that came were closed; nothing more is read.
    #[error(
        "{held} file descriptors came with a frame not yet complete, more than the {bound} it may carry; all closed"
    )]
    TooManyFds {
        /// How many were held.
        held: usize,
        /// How many the frame may carry with the slack.
        bound: usize,
    },
    /// A frame did not move to its end within the frame deadline, counted from its first
    /// byte (receiving) or from when it was queued (sending): a peer that sends a frame
    /// slowly, or does not read. Nothing more moves that way.
    #[error("{direction} of a frame not done within {after:?} of its start")]
    FrameTooSlow {
        /// Which way.
        direction: Direction,
        /// The frame deadline.
        after: Duration,
    },
    /// The frames queued for a peer that does not read passed the queue's bound
    /// ([`SendQueueLimits`]). Nothing more is sent.
    #[error(
        "the send queue is full: {frames} frames and {bytes} bytes queued, at most {} frames and {} bytes allowed",
        limits.max_frames, limits.max_bytes
    )]
    SendQueueFull {
        /// Frames queued, the refused one included.
        frames: usize,
        /// Bytes queued, the refused frame included.
        bytes: usize,
        /// The bound.
        limits: SendQueueLimits,
    },
    /// A system call failed.
    #[error("{op} failed: {errno}")]
    Io {
        /// The call.
        op: &'static str,
        /// What the kernel said.
        errno: Errno,
    },
}

impl TransportError {
    /// Whether this error means the peer is no longer there.
    pub fn is_peer_gone(&self) -> bool {
        matches!(
            self,
            TransportError::PeerClosed { .. } | TransportError::PeerGone { .. }
        )
    }
}
