//! [`Connection`]: frames and file descriptors over one Unix stream socket, with deadlines.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::Instant;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use tracing::trace;

use crate::codec::{self, DecodeError, EncodeError, FrameHeader, FrameLimits, HEADER_LEN};
use crate::message::{Message, MessageKind};
use crate::scm;

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

/// One end of a Unix stream socket that speaks the protocol.
///
/// `send` and `recv` take `&mut self`: one frame at a time in each direction. Every wait is
/// bounded by the deadline passed in.
pub struct Connection {
    sock: OwnedFd,
    limits: FrameLimits,
    send_buf: Vec<u8>,
    recv_broken: Option<String>,
    send_broken: Option<String>,
}

impl Connection {
    /// Wraps a connected Unix stream socket.
    pub fn new(sock: OwnedFd) -> Self {
        Self {
            sock,
            limits: FrameLimits::default(),
            send_buf: Vec::new(),
            recv_broken: None,
            send_broken: None,
        }
    }

    /// Two connected ends (`socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC)`).
    pub fn pair() -> Result<(Connection, Connection), TransportError> {
        let (a, b) = socketpair(
            AddressFamily::Unix,
            SockType::Stream,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|errno| TransportError::Io {
            op: "socketpair",
            errno,
        })?;
        Ok((Connection::new(a), Connection::new(b)))
    }

    /// Lowers the frame cap for both directions (see [`FrameLimits`]).
    pub fn with_limits(mut self, limits: FrameLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The frame cap in force.
    pub fn limits(&self) -> FrameLimits {
        self.limits
    }

    /// The socket.
    pub fn into_fd(self) -> OwnedFd {
        self.sock
    }

    /// Sends `msg` with exactly the file descriptors it carries ([`Message::expected_fds`]),
    /// by `deadline`. The descriptors are duplicated into the peer; ours stay open.
    pub fn send(
        &mut self,
        msg: &Message,
        fds: &[BorrowedFd<'_>],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let kind = msg.kind();
        if fds.len() != kind.expected_fds() {
            return Err(TransportError::WrongFdCount {
                kind,
                expected: kind.expected_fds(),
                given: fds.len(),
            });
        }
        let mut buf = std::mem::take(&mut self.send_buf);
        buf.clear();
        let result = codec::encode_into(msg, self.limits, &mut buf)
            .map_err(TransportError::from)
            .and_then(|()| self.send_frame(&buf, fds, deadline));
        trace!(
            ?kind,
            len = buf.len(),
            fds = fds.len(),
            ok = result.is_ok(),
            "send frame"
        );
        self.send_buf = buf;
        result
    }

    /// Writes an encoded frame. The FDs go with its first byte.
    pub(crate) fn send_frame(
        &mut self,
        frame: &[u8],
        fds: &[BorrowedFd<'_>],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        if let Some(reason) = &self.send_broken {
            return Err(TransportError::Broken {
                direction: Direction::Send,
                reason: reason.clone(),
            });
        }
        let mut sent = 0;
        while sent < frame.len() {
            let attach = if sent == 0 { fds } else { &[] };
            match scm::send(self.sock.as_fd(), &frame[sent..], attach) {
                Ok(n) => sent += n,
                Err(Errno::EAGAIN) => {
                    if let Err(e) = wait(self.sock.as_fd(), PollFlags::POLLOUT, deadline) {
                        return Err(self.send_failed(e, sent > 0));
                    }
                }
                Err(errno @ (Errno::EPIPE | Errno::ECONNRESET)) => {
                    return Err(self.send_failed(TransportError::PeerGone { errno }, sent > 0));
                }
                Err(errno) => {
                    return Err(self.send_failed(
                        TransportError::Io {
                            op: "sendmsg",
                            errno,
                        },
                        sent > 0,
                    ));
                }
            }
        }
        Ok(())
    }

    fn send_failed(&mut self, err: TransportError, partial: bool) -> TransportError {
        let err = match err {
            TransportError::Timeout { direction, .. } => {
                TransportError::Timeout { direction, partial }
            }
            e => e,
        };
        if partial {
            self.send_broken = Some(err.to_string());
        }
        err
    }

    /// Receives one frame by `deadline`, with the file descriptors that came with it.
    ///
    /// Descriptors are accepted only on frames that carry them, exactly as many as
    /// [`MessageKind::expected_fds`] says; otherwise all that came are closed and the error
    /// says what happened. A frame that is decoded but invalid leaves the stream usable; a
    /// broken frame (over the cap, unknown version, cut off by EOF or the deadline) does not.
    pub fn recv(&mut self, deadline: Instant) -> Result<(Message, Vec<OwnedFd>), TransportError> {
        if let Some(reason) = &self.recv_broken {
            return Err(TransportError::Broken {
                direction: Direction::Recv,
                reason: reason.clone(),
            });
        }
        let mut fds = Vec::new();
        let mut header = [0u8; HEADER_LEN];
        if let Err(e) = self.read_exact(&mut header, &mut fds, deadline, false) {
            return Err(self.recv_failed(e));
        }
        let header = match FrameHeader::parse(&header, self.limits) {
            Ok(h) => h,
            Err(e) => return Err(self.recv_failed(e.into())),
        };
        let mut payload = vec![0u8; header.payload_len];
        if let Err(e) = self.read_exact(&mut payload, &mut fds, deadline, true) {
            return Err(self.recv_failed(e));
        }
        let msg = codec::decode_payload(header.tag, &payload)?;
        let kind = msg.kind();
        let expected = kind.expected_fds();
        trace!(
            ?kind,
            len = HEADER_LEN + payload.len(),
            fds = fds.len(),
            "recv frame"
        );
        if fds.len() > expected {
            return Err(TransportError::UnexpectedFds {
                kind,
                expected,
                received: fds.len(),
            });
        }
        if fds.len() < expected {
            return Err(TransportError::MissingFds {
                kind,
                expected,
                received: fds.len(),
            });
        }
        Ok((msg, fds))
    }

    fn recv_failed(&mut self, err: TransportError) -> TransportError {
        let breaks = match &err {
            TransportError::Timeout { partial, .. } => *partial,
            TransportError::PeerClosed { .. } => false,
            _ => true,
        };
        if breaks {
            self.recv_broken = Some(err.to_string());
        }
        err
    }

    /// Fills `buf`, collecting descriptors. `in_frame`: bytes of this frame were read before.
    fn read_exact(
        &mut self,
        buf: &mut [u8],
        fds: &mut Vec<OwnedFd>,
        deadline: Instant,
        in_frame: bool,
    ) -> Result<(), TransportError> {
        let mut got = 0;
        while got < buf.len() {
            let partial = in_frame || got > 0;
            match scm::recv(self.sock.as_fd(), &mut buf[got..]) {
                Ok(r) => {
                    fds.extend(r.fds);
                    if r.truncated {
                        let received = fds.len();
                        fds.clear();
                        return Err(TransportError::FdsTruncated { received });
                    }
                    if r.bytes == 0 {
                        return Err(TransportError::PeerClosed { mid_frame: partial });
                    }
                    got += r.bytes;
                }
                Err(Errno::EAGAIN) => match wait(self.sock.as_fd(), PollFlags::POLLIN, deadline) {
                    Ok(()) => {}
                    Err(TransportError::Timeout { direction, .. }) => {
                        return Err(TransportError::Timeout { direction, partial });
                    }
                    Err(e) => return Err(e),
                },
                Err(Errno::ECONNRESET) => {
                    return Err(TransportError::PeerGone {
                        errno: Errno::ECONNRESET,
                    });
                }
                Err(errno) => {
                    return Err(TransportError::Io {
                        op: "recvmsg",
                        errno,
                    });
                }
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("fd", &self.sock.as_raw_fd())
            .field("limits", &self.limits)
            .field("recv_broken", &self.recv_broken)
            .field("send_broken", &self.send_broken)
            .finish()
    }
}

impl AsFd for Connection {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

impl AsRawFd for Connection {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.sock.as_raw_fd()
    }
}

/// Waits until `fd` is ready for `events` or `deadline` passes.
pub(crate) fn wait(
    fd: BorrowedFd<'_>,
    events: PollFlags,
    deadline: Instant,
) -> Result<(), TransportError> {
    let direction = if events.contains(PollFlags::POLLOUT) {
        Direction::Send
    } else {
        Direction::Recv
    };
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(TransportError::Timeout {
                direction,
                partial: false,
            });
        }
        // Round up so a sub-millisecond remainder does not spin with a zero timeout.
        let left = deadline - now;
        let ms = left.as_micros().div_ceil(1000).max(1);
        let timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX);
        let mut pfd = [PollFd::new(fd, events)];
        match poll(&mut pfd, timeout) {
            Ok(0) => continue,
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => continue,
            Err(errno) => return Err(TransportError::Io { op: "poll", errno }),
        }
    }
}
