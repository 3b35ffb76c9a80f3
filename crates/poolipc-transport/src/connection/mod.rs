//! [`Connection`]: frames and file descriptors over one Unix stream socket, with deadlines.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::Instant;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};

use crate::codec::{DecodeError, FrameLimits, HEADER_LEN};
use crate::scm;

mod error;
mod recv;
mod send;

pub use error::{Direction, TransportError};
pub use recv::PARTIAL_FD_SLACK;
use recv::RecvBuf;
use send::Outgoing;
pub use send::SendQueueLimits;

/// One end of a Unix stream socket that speaks the protocol.
///
/// `send` and `recv` take `&mut self`: one frame at a time in each direction. Every wait is
/// bounded by the deadline passed in. Beside them, for a loop that serves many peers and
/// waits on none: [`Connection::poll_recv`] (reads what is there, returns whole frames only)
/// and [`Connection::enqueue`] / [`Connection::flush`] (frames queued and written as the
/// socket takes them), with [`Connection::check_deadlines`] for the frame deadline.
pub struct Connection {
    sock: OwnedFd,
    limits: FrameLimits,
    send_buf: Vec<u8>,
    recv: RecvBuf,
    recv_broken: Option<String>,
    send_broken: Option<String>,
    /// When the first byte of the frame at the front of `recv` arrived (none: nothing
    /// unread). A read that finds the buffer empty sets it; a frame returned with bytes
    /// left behind it sets it to the last read's time (those bytes came by then).
    partial_since: Option<Instant>,
    last_read: Option<Instant>,
    queue: VecDeque<Outgoing>,
    queued_bytes: usize,
    queue_limits: SendQueueLimits,
}

impl Connection {
    /// Wraps a connected Unix stream socket.
    pub fn new(sock: OwnedFd) -> Self {
        Self {
            sock,
            limits: FrameLimits::default(),
            send_buf: Vec::new(),
            recv: RecvBuf::new(),
            recv_broken: None,
            send_broken: None,
            partial_since: None,
            last_read: None,
            queue: VecDeque::new(),
            queued_bytes: 0,
            queue_limits: SendQueueLimits::default(),
        }
    }

    /// Sets the bound on frames queued by [`Connection::enqueue`].
    pub fn with_queue_limits(mut self, limits: SendQueueLimits) -> Self {
        self.queue_limits = limits;
        self
    }

    /// Sets the bound on frames queued by [`Connection::enqueue`] (a connection already
    /// made).
    pub fn set_queue_limits(&mut self, limits: SendQueueLimits) {
        self.queue_limits = limits;
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

    /// Shuts both directions of the socket down: the peer reads end-of-stream at once, as
    /// if this process had exited, while the descriptor stays open. For a side that can no
    /// longer keep its word on this connection (a worker whose GPU context is lost).
    pub fn hang_up(&self) {
        // A socket already shut down or reset answers with an error: nothing more to do.
        let _ = nix::sys::socket::shutdown(self.sock.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }

    /// The socket. Bytes already read from it and not yet returned as a frame (see
    /// [`Connection::buffered`]) are lost with the connection: to read on after the
    /// frames, take them with [`Connection::into_parts`].
    pub fn into_fd(self) -> OwnedFd {
        self.sock
    }

    /// The socket, and the bytes already read from it that no frame returned (they come
    /// before anything read from the socket from now on).
    pub fn into_parts(self) -> (OwnedFd, Vec<u8>) {
        let unread = self.recv.buf[self.recv.start..self.recv.end].to_vec();
        (self.sock, unread)
    }

    /// Whether bytes have been read from the socket that no frame returned yet: a wait for
    /// the socket to become readable would then miss them. [`Connection::frame_buffered`]
    /// says whether a whole frame is among them.
    pub fn buffered(&self) -> bool {
        self.recv.len() > 0
    }

    /// How many bytes the receive buffer holds room for (tests: it stays bounded).
    #[cfg(test)]
    pub(crate) fn recv_capacity(&self) -> usize {
        self.recv.buf.len()
    }

    /// Whether a whole frame (or a header that will not parse) has been read from the
    /// socket already: [`Connection::recv`] returns it without a system call. Someone who
    /// polls the socket for frames reads these first.
    pub fn frame_buffered(&self) -> bool {
        match self.recv.header_at(self.recv.start, self.limits) {
            Ok(header) => self.recv.len() >= HEADER_LEN + header.payload_len,
            Err(DecodeError::Truncated { .. }) => false,
            Err(_) => true,
        }
    }
}

/// Bytes of a connect token: what a worker connecting to a listener that demands one sends,
/// raw, before anything else ([`Connection::send_token`], [`Connection::expect_token`]).
pub const TOKEN_LEN: usize = 32;

impl Connection {
    /// Connecting side, before the handshake: sends the listener's token, raw, by
    /// `deadline`. Nothing may have been sent on the connection before.
    pub fn send_token(
        &mut self,
        token: &[u8; TOKEN_LEN],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut sent = 0;
        while sent < TOKEN_LEN {
            match scm::send(self.sock.as_fd(), &token[sent..], &[]) {
                Ok(n) => sent += n,
                Err(Errno::EAGAIN) => wait(self.sock.as_fd(), PollFlags::POLLOUT, deadline)?,
                Err(errno @ (Errno::EPIPE | Errno::ECONNRESET)) => {
                    return Err(TransportError::PeerGone { errno });
                }
                Err(errno) => {
                    return Err(TransportError::Io {
                        op: "sendmsg",
                        errno,
                    });
                }
            }
        }
        Ok(())
    }

    /// Listening side, before anything is sent: reads exactly [`TOKEN_LEN`] raw bytes by
    /// `deadline` (never more: what follows is the handshake's) and compares them with
    /// `expected` in constant time. A peer that sends descriptors, closes, is late or sends
    /// another token is refused ([`TransportError::WrongToken`] for the last); the caller then
    /// drops the connection, having sent nothing.
    pub fn expect_token(
        &mut self,
        expected: &[u8; TOKEN_LEN],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut got = [0u8; TOKEN_LEN];
        let mut have = 0;
        while have < TOKEN_LEN {
            match scm::recv(self.sock.as_fd(), &mut got[have..]) {
                Ok(r) if r.truncated || !r.fds.is_empty() => {
                    // The descriptors drop (close) here.
                    return Err(TransportError::FdsTruncated {
                        received: r.fds.len(),
                    });
                }
                Ok(r) if r.bytes == 0 => {
                    return Err(TransportError::PeerClosed {
                        mid_frame: have > 0,
                    });
                }
                Ok(r) => have += r.bytes,
                Err(Errno::EAGAIN) => wait(self.sock.as_fd(), PollFlags::POLLIN, deadline)?,
                Err(errno @ Errno::ECONNRESET) => return Err(TransportError::PeerGone { errno }),
                Err(errno) => {
                    return Err(TransportError::Io {
                        op: "recvmsg",
                        errno,
                    });
                }
            }
        }
        let diff = got
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff != 0 {
            return Err(TransportError::WrongToken);
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
