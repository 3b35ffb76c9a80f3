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
    recv: RecvBuf,
    recv_broken: Option<String>,
    send_broken: Option<String>,
}

/// What has been read from the socket and not yet returned as a frame.
///
/// A read takes whatever the socket holds (up to the buffer's room), so frames that arrive
/// together (a worker's DONE and ACK) cost one system call, and a frame's header and payload
/// one, not two. Descriptors (`SCM_RIGHTS`) need care then: Linux ends a `recvmsg` on a
/// stream socket right after the first message that carried descriptors
/// (`unix_stream_read_generic`), and a sender attaches them to a frame's first byte
/// ([`Connection::send`]), so the descriptors that come with a read belong to the frame its
/// last byte is part of. They are kept with that frame's stream offset until it is returned.
struct RecvBuf {
    buf: Vec<u8>,
    /// `buf[start..end]` is unread.
    start: usize,
    end: usize,
    /// The stream offset of `buf[start]`: bytes returned as frames so far.
    offset: u64,
    /// Descriptors that came, by the stream offset of the frame they came with.
    fds: Vec<(u64, Vec<OwnedFd>)>,
}

/// The least a read asks the socket for.
const RECV_CHUNK: usize = 64 * 1024;

impl RecvBuf {
    fn new() -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            end: 0,
            offset: 0,
            fds: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.end - self.start
    }

    /// The unread bytes at the front, and room behind them for `need` unread bytes in all
    /// and a read of [`RECV_CHUNK`]. The buffer so never holds more than the largest frame
    /// and a read, however long the stream.
    fn make_room(&mut self, need: usize) {
        if self.start > 0 {
            // At most the part of one frame read so far: usually a few bytes, or none.
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let want = need.max(self.end + RECV_CHUNK);
        if self.buf.len() < want {
            self.buf.resize(want, 0);
        }
    }

    /// The stream offset of the frame that the unread byte at stream offset `at` is part
    /// of, walking frame headers from `start`. A header not all here, or one that does not
    /// parse, ends the walk there: that frame is the one (its error comes when it is read).
    fn frame_containing(&self, at: u64, limits: FrameLimits) -> u64 {
        let mut pos = self.start;
        loop {
            let frame_at = self.offset + (pos - self.start) as u64;
            let Ok(header) = self.header_at(pos, limits) else {
                return frame_at;
            };
            let len = HEADER_LEN + header.payload_len;
            if frame_at + len as u64 > at {
                return frame_at;
            }
            pos += len;
        }
    }

    /// The frame header at `buf[pos..]`: `DecodeError::Truncated` when not all of it has
    /// been read yet, else what [`FrameHeader::parse`] makes of it.
    fn header_at(&self, pos: usize, limits: FrameLimits) -> Result<FrameHeader, DecodeError> {
        let bytes: [u8; HEADER_LEN] = self
            .buf
            .get(pos..pos + HEADER_LEN)
            .filter(|_| pos + HEADER_LEN <= self.end)
            .and_then(|b| b.try_into().ok())
            .ok_or(DecodeError::Truncated {
                needed: HEADER_LEN,
                available: self.end.saturating_sub(pos),
            })?;
        FrameHeader::parse(&bytes, limits)
    }

    /// Drops `n` unread bytes (a frame returned).
    fn consume(&mut self, n: usize) {
        self.start += n;
        self.offset += n as u64;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            // A frame far larger than usual left a large buffer: let it go.
            if self.buf.len() > 4 * RECV_CHUNK {
                self.buf = Vec::new();
            }
        }
    }

    /// The descriptors that came with the frame at stream offset `frame_at`, and any (sent
    /// out of step by a broken peer) that came with frames before it.
    fn take_fds(&mut self, frame_at: u64) -> Vec<OwnedFd> {
        let mut taken = Vec::new();
        self.fds.retain_mut(|(at, fds)| {
            if *at <= frame_at {
                taken.append(fds);
                false
            } else {
                true
            }
        });
        taken
    }
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
        self.send_frames(&[msg], fds, deadline)
    }

    /// Sends several messages that carry no file descriptors in one write (one system call
    /// where the socket takes them all), in order, by `deadline`. A message that must carry
    /// descriptors is refused before anything is sent.
    pub fn send_many(
        &mut self,
        msgs: &[&Message],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        if let Some(kind) = msgs
            .iter()
            .map(|m| m.kind())
            .find(|k| k.expected_fds() != 0)
        {
            return Err(TransportError::WrongFdCount {
                kind,
                expected: kind.expected_fds(),
                given: 0,
            });
        }
        self.send_frames(msgs, &[], deadline)
    }

    /// Encodes `msgs` one after the other and writes them at once, `fds` with the first byte.
    fn send_frames(
        &mut self,
        msgs: &[&Message],
        fds: &[BorrowedFd<'_>],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut buf = std::mem::take(&mut self.send_buf);
        buf.clear();
        let result = msgs
            .iter()
            .try_for_each(|m| codec::encode_into(m, self.limits, &mut buf))
            .map_err(TransportError::from)
            .and_then(|()| self.send_frame(&buf, fds, deadline));
        trace!(
            kind = ?msgs.first().map(|m| m.kind()),
            frames = msgs.len(),
            len = buf.len(),
            fds = fds.len(),
            ok = result.is_ok(),
            "send"
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
        if let Err(e) = self.fill(HEADER_LEN, deadline) {
            return Err(self.recv_failed(e));
        }
        let header = match self.recv.header_at(self.recv.start, self.limits) {
            Ok(h) => h,
            Err(e) => return Err(self.recv_failed(e.into())),
        };
        let len = HEADER_LEN + header.payload_len;
        if let Err(e) = self.fill(len, deadline) {
            return Err(self.recv_failed(e));
        }
        let at = self.recv.offset;
        let payload = &self.recv.buf[self.recv.start + HEADER_LEN..self.recv.start + len];
        let decoded = codec::decode_payload(header.tag, payload);
        self.recv.consume(len);
        // Taken (and so closed on every error below) whether or not the frame decodes.
        let fds = self.recv.take_fds(at);
        let msg = decoded?;
        let kind = msg.kind();
        let expected = kind.expected_fds();
        trace!(?kind, len, fds = fds.len(), "recv frame");
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
            // Nothing more will be read: close every descriptor that came.
            self.recv.fds.clear();
        }
        err
    }

    /// Reads until at least `need` unread bytes are buffered, taking whatever more the socket
    /// holds; descriptors are filed under the frame they came with (see [`RecvBuf`]).
    fn fill(&mut self, need: usize, deadline: Instant) -> Result<(), TransportError> {
        while self.recv.len() < need {
            // Bytes of the frame being read are here: an EOF or deadline now cuts it.
            let partial = self.recv.len() > 0;
            self.recv.make_room(need);
            let end = self.recv.end;
            match scm::recv(self.sock.as_fd(), &mut self.recv.buf[end..]) {
                Ok(r) => {
                    if r.truncated {
                        let received = r.fds.len();
                        return Err(TransportError::FdsTruncated { received });
                    }
                    if r.bytes == 0 {
                        return Err(TransportError::PeerClosed { mid_frame: partial });
                    }
                    self.recv.end += r.bytes;
                    if !r.fds.is_empty() {
                        let last = self.recv.offset + (self.recv.end - self.recv.start) as u64 - 1;
                        let frame_at = self.recv.frame_containing(last, self.limits);
                        self.recv.fds.push((frame_at, r.fds));
                    }
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
