//! The handshake: the first three frames of every connection.
//!
//! ```text
//! parent                                   worker
//!   Hello(identity) + pool FD   ─────────▶   checks version, device, driver, capabilities
//!                               ◀─────────   HelloAck(identity)  or  Refuse(code, reason)
//!   checks the same the other way
//!   HelloAck(identity)          ─────────▶   (or Refuse(code, reason))
//! ```
//!
//! A side that finds a mismatch sends `Refuse` with the reason before it returns its error, so
//! both sides end with a typed error that names the problem: the refusing side the specific
//! mismatch, the refused side [`HandshakeError::Refused`] with the peer's code and reason. The
//! third frame exists so that the worker, too, learns of a refusal by the parent before it
//! believes the connection is up.
//!
//! The protocol version travels in every frame header. A frame of another version fails to
//! decode ([`crate::DecodeError::UnknownVersion`]), which the handshake turns into a refusal
//! and [`HandshakeError::VersionMismatch`].

use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Instant;

use crate::codec::{DecodeError, PROTOCOL_VERSION};
use crate::connection::{Connection, TransportError};
use crate::message::{Capabilities, ErrorCode, Identity, Message, MessageKind};
use poolipc_types::DeviceUuid;

/// What this side is, and what it requires of the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandshakeConfig {
    /// Sent to the peer as is.
    pub identity: Identity,
    /// Capabilities the peer must have.
    pub required: Capabilities,
}

/// What the handshake established about the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// What the peer said about itself.
    pub identity: Identity,
    /// Capabilities both sides have.
    pub capabilities: Capabilities,
}

/// Why the handshake failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The connection failed (timeout, peer gone, malformed frame, wrong FDs).
    #[error("handshake transport failure: {0}")]
    Transport(#[from] TransportError),
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: this side speaks {ours}, the peer {theirs}")]
    VersionMismatch {
        /// [`PROTOCOL_VERSION`].
        ours: u8,
        /// The peer's.
        theirs: u8,
    },
    /// The peer's pool lives on another GPU.
    #[error("device mismatch: this side uses {ours}, the peer {theirs}")]
    DeviceMismatch {
        /// Our device.
        ours: DeviceUuid,
        /// The peer's.
        theirs: DeviceUuid,
    },
    /// This side cannot use the device the peer's pool lives on: it does not see it (another
    /// `CUDA_VISIBLE_DEVICES`), or could not ask.
    #[error("the peer's device {theirs} is not usable here: {reason}")]
    DeviceNotVisible {
        /// The peer's device.
        theirs: DeviceUuid,
        /// What this side sees, or why it could not tell.
        reason: String,
    },
    /// The peer loaded another driver version.
    #[error("driver version mismatch: this side has {ours}, the peer {theirs}")]
    DriverMismatch {
        /// Ours.
        ours: i32,
        /// The peer's.
        theirs: i32,
    },
    /// The peer lacks capabilities this side requires.
    #[error("peer lacks required capabilities {missing:?}")]
    MissingCapabilities {
        /// The bits it lacks.
        missing: Capabilities,
    },
    /// The peer refused the handshake.
    #[error("peer refused the handshake ({code}): {message}")]
    Refused {
        /// Its reason, as a code.
        code: ErrorCode,
        /// Its reason, for a person.
        message: String,
    },
    /// The peer sent something other than the next handshake frame.
    #[error("expected {expected} during the handshake, got {got}")]
    UnexpectedMessage {
        /// What was expected.
        expected: &'static str,
        /// What came.
        got: MessageKind,
    },
}

impl HandshakeError {
    /// The code a refusal frame carries for this error, if this side should send one.
    fn refusal_code(&self) -> Option<ErrorCode> {
        Some(match self {
            HandshakeError::VersionMismatch { .. } => ErrorCode::VERSION_MISMATCH,
            HandshakeError::DeviceMismatch { .. } | HandshakeError::DeviceNotVisible { .. } => {
                ErrorCode::DEVICE_MISMATCH
            }
            HandshakeError::DriverMismatch { .. } => ErrorCode::DRIVER_MISMATCH,
            HandshakeError::MissingCapabilities { .. } => ErrorCode::MISSING_CAPABILITY,
            HandshakeError::UnexpectedMessage { .. } => ErrorCode::UNEXPECTED_MESSAGE,
            HandshakeError::Transport(TransportError::Decode(_))
            | HandshakeError::Transport(TransportError::UnexpectedFds { .. })
            | HandshakeError::Transport(TransportError::MissingFds { .. })
            | HandshakeError::Transport(TransportError::FdsTruncated { .. }) => {
                ErrorCode::MALFORMED_FRAME
            }
            _ => return None,
        })
    }
}

/// Checks the peer's identity against ours.
fn check_peer(local: &HandshakeConfig, theirs: &Identity) -> Result<Peer, HandshakeError> {
    let ours = &local.identity;
    if theirs.device != ours.device {
        return Err(HandshakeError::DeviceMismatch {
            ours: ours.device,
            theirs: theirs.device,
        });
    }
    if theirs.driver_version != ours.driver_version {
        return Err(HandshakeError::DriverMismatch {
            ours: ours.driver_version,
            theirs: theirs.driver_version,
        });
    }
    let missing = local.required.missing_from(theirs.capabilities);
    if missing != Capabilities::NONE {
        return Err(HandshakeError::MissingCapabilities { missing });
    }
    Ok(Peer {
        identity: theirs.clone(),
        capabilities: ours.capabilities.intersection(theirs.capabilities),
    })
}

/// Turns a receive error into the handshake's, noticing a version mismatch.
fn recv_error(e: TransportError) -> HandshakeError {
    match e {
        TransportError::Decode(DecodeError::UnknownVersion { found, supported }) => {
            HandshakeError::VersionMismatch {
                ours: supported,
                theirs: found,
            }
        }
        e => HandshakeError::Transport(e),
    }
}

/// Sends a refusal for `err` if it calls for one, then returns `err`. A failure to send the
/// refusal is logged, not returned: the peer may already be gone, and `err` is the news.
fn refuse(conn: &mut Connection, err: HandshakeError, deadline: Instant) -> HandshakeError {
    if let Some(code) = err.refusal_code() {
        let mut message = err.to_string();
        if message.len() > crate::message::MAX_TEXT_LEN {
            let mut cut = crate::message::MAX_TEXT_LEN;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        if let Err(send_err) = conn.send(&Message::Refuse { code, message }, &[], deadline) {
            tracing::debug!(%send_err, "could not send the handshake refusal");
        }
    }
    tracing::warn!(%err, "handshake failed");
    err
}

/// Parent side: sends `Hello` with the pool FD, waits for the worker's answer by `deadline`,
/// checks it, and confirms with `HelloAck` (or refuses). Returns what was learnt about the
/// worker.
pub fn parent_handshake(
    conn: &mut Connection,
    local: &HandshakeConfig,
    pool_fd: BorrowedFd<'_>,
    deadline: Instant,
) -> Result<Peer, HandshakeError> {
    conn.send(
        &Message::Hello(local.identity.clone()),
        &[pool_fd],
        deadline,
    )?;
    let answer = match conn.recv(deadline) {
        Ok((msg, _no_fds)) => msg,
        Err(e) => return Err(refuse(conn, recv_error(e), deadline)),
    };
    match answer {
        Message::HelloAck(theirs) => {
            let peer = check_peer(local, &theirs).map_err(|e| refuse(conn, e, deadline))?;
            conn.send(&Message::HelloAck(local.identity.clone()), &[], deadline)?;
            Ok(peer)
        }
        // The worker's words: marked as such and made safe to print.
        Message::Refuse { code, message } => Err(HandshakeError::Refused {
            code,
            message: poolipc_contract::worker_text(&message),
        }),
        other => Err(refuse(
            conn,
            HandshakeError::UnexpectedMessage {
                expected: "HelloAck or Refuse",
                got: other.kind(),
            },
            deadline,
        )),
    }
}

/// Worker side: waits for the parent's `Hello` by `deadline`, checks it, answers `HelloAck`
/// (or `Refuse`), and waits for the parent's confirming `HelloAck`. Returns what was learnt
/// about the parent and the pool FD.
pub fn worker_handshake(
    conn: &mut Connection,
    local: &HandshakeConfig,
    deadline: Instant,
) -> Result<(Peer, OwnedFd), HandshakeError> {
    worker_handshake_choosing(conn, |_| Ok(local.clone()), deadline).map(|(peer, fd, _)| (peer, fd))
}

/// Worker side, for a worker that settles what it is once it has read the parent's identity,
/// such as which of its devices is the parent's (ordinals differ across
/// `CUDA_VISIBLE_DEVICES`; UUIDs do not). `choose` gets the parent's identity from its `Hello`
/// and returns this side's configuration; an error from it is sent to the parent as a refusal
/// and returned. Otherwise as [`worker_handshake`], and the chosen configuration is returned
/// too.
pub fn worker_handshake_choosing(
    conn: &mut Connection,
    choose: impl FnOnce(&Identity) -> Result<HandshakeConfig, HandshakeError>,
    deadline: Instant,
) -> Result<(Peer, OwnedFd, HandshakeConfig), HandshakeError> {
    let (hello, mut fds) = match conn.recv(deadline) {
        Ok(got) => got,
        Err(e) => return Err(refuse(conn, recv_error(e), deadline)),
    };
    let theirs = match hello {
        Message::Hello(theirs) => theirs,
        Message::Refuse { code, message } => return Err(HandshakeError::Refused { code, message }),
        other => {
            return Err(refuse(
                conn,
                HandshakeError::UnexpectedMessage {
                    expected: "Hello",
                    got: other.kind(),
                },
                deadline,
            ));
        }
    };
    let local = choose(&theirs).map_err(|e| refuse(conn, e, deadline))?;
    let peer = check_peer(&local, &theirs).map_err(|e| refuse(conn, e, deadline))?;
    // `recv` guarantees a Hello comes with exactly one FD.
    let Some(pool_fd) = fds.pop() else {
        return Err(HandshakeError::Transport(TransportError::MissingFds {
            kind: MessageKind::Hello,
            expected: 1,
            received: 0,
        }));
    };
    conn.send(&Message::HelloAck(local.identity.clone()), &[], deadline)?;
    match conn.recv(deadline) {
        Ok((Message::HelloAck(_), _)) => {}
        Ok((Message::Refuse { code, message }, _)) => {
            return Err(HandshakeError::Refused { code, message });
        }
        Ok((other, _)) => {
            return Err(refuse(
                conn,
                HandshakeError::UnexpectedMessage {
                    expected: "HelloAck or Refuse",
                    got: other.kind(),
                },
                deadline,
            ));
        }
        Err(e) => return Err(refuse(conn, recv_error(e), deadline)),
    }
    tracing::debug!(parent_device = %theirs.device, version = PROTOCOL_VERSION, "handshake done");
    Ok((peer, pool_fd, local))
}
