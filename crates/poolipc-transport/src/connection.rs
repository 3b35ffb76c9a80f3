//! [`Connection`]: frames and file descriptors over one Unix stream socket, with deadlines.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

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
    /// More descriptors came with a frame not yet complete than that frame may carry (its
    /// kind's, and [`PARTIAL_FD_SLACK`] more): a peer dripping descriptors onto a slow frame.
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

/// Descriptors a frame not yet complete may hold beyond what its kind carries (see
/// [`TransportError::TooManyFds`]).
pub const PARTIAL_FD_SLACK: usize = 4;

/// How much [`Connection::enqueue`] keeps for a peer that does not read before it refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendQueueLimits {
    /// Frames queued at most.
    pub max_frames: usize,
    /// Bytes queued at most (at least one largest frame, or large frames are refused).
    pub max_bytes: usize,
}

impl Default for SendQueueLimits {
    /// 1024 frames, 16 MiB: far more than a worker that reads ever has queued (its frames
    /// are taken as they come), and little memory for one that does not.
    fn default() -> Self {
        Self {
            max_frames: 1024,
            max_bytes: 16 << 20,
        }
    }
}

/// A frame queued for sending, with the descriptors that go with its first byte.
struct Outgoing {
    bytes: Vec<u8>,
    sent: usize,
    fds: Vec<OwnedFd>,
    queued_at: Instant,
}

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
        // Frames queued before go first: the order on the wire is the order of the calls.
        self.flush_by(deadline)?;
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
        self.partial_since = if self.recv.len() > 0 {
            self.last_read
        } else {
            None
        };
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

    /// Returns a whole frame if one has arrived, reading (without waiting) what the socket
    /// holds first when none is buffered; `Ok(None)` when the frame at the front is not all
    /// here yet: its bytes and descriptors stay in the connection until it is. The rules of
    /// [`Connection::recv`] apply to the frame returned; a header that does not parse fails at
    /// once, and so do descriptors past what the partial frame may carry
    /// ([`TransportError::TooManyFds`]). The partial frame's deadline is the caller's
    /// ([`Connection::check_deadlines`]).
    pub fn poll_recv(&mut self) -> Result<Option<(Message, Vec<OwnedFd>)>, TransportError> {
        if let Some(reason) = &self.recv_broken {
            return Err(TransportError::Broken {
                direction: Direction::Recv,
                reason: reason.clone(),
            });
        }
        if !self.frame_buffered() {
            let need = match self.recv.header_at(self.recv.start, self.limits) {
                Ok(header) => HEADER_LEN + header.payload_len,
                Err(_) => HEADER_LEN,
            };
            match self.read_some(need) {
                Ok(_) => {}
                Err(e) => return Err(self.recv_failed(e)),
            }
            if !self.frame_buffered() {
                return Ok(None);
            }
        }
        // A whole frame (or a header that will not parse) is buffered: `recv` takes it
        // without a system call, so the deadline is never waited on.
        self.recv(Instant::now()).map(Some)
    }

    /// When the frame at the front of the receive buffer began to arrive, if one has begun
    /// and is not all here (for the frame deadline; [`Connection::check_deadlines`]).
    pub fn partial_frame_since(&self) -> Option<Instant> {
        if self.recv.len() == 0 || self.frame_buffered() {
            return None;
        }
        self.partial_since
    }

    /// The next instant at which [`Connection::check_deadlines`] fails, if a frame is on its
    /// way in either direction.
    pub fn next_deadline(&self, frame_timeout: Duration) -> Option<Instant> {
        let recv = self.partial_frame_since();
        let send = self.queue.front().map(|o| o.queued_at);
        [recv, send]
            .into_iter()
            .flatten()
            .min()
            .map(|t| t + frame_timeout)
    }

    /// Fails with [`TransportError::FrameTooSlow`] (breaking that direction and closing
    /// the descriptors held for it) when a frame began to arrive `frame_timeout` or longer
    /// before `now` and is not all here, or a frame queued that long ago is not all sent.
    pub fn check_deadlines(
        &mut self,
        now: Instant,
        frame_timeout: Duration,
    ) -> Result<(), TransportError> {
        if self.recv_broken.is_none()
            && self
                .partial_frame_since()
                .is_some_and(|t| now.saturating_duration_since(t) >= frame_timeout)
        {
            let e = TransportError::FrameTooSlow {
                direction: Direction::Recv,
                after: frame_timeout,
            };
            return Err(self.recv_failed(e));
        }
        if self.send_broken.is_none()
            && self
                .queue
                .front()
                .is_some_and(|o| now.saturating_duration_since(o.queued_at) >= frame_timeout)
        {
            let e = TransportError::FrameTooSlow {
                direction: Direction::Send,
                after: frame_timeout,
            };
            self.send_broken = Some(e.to_string());
            self.drop_queue();
            return Err(e);
        }
        Ok(())
    }

    /// Queues `msg` with exactly the descriptors it carries (duplicated: the caller's stay
    /// open) and writes what the socket takes now, without waiting; the rest goes out with
    /// [`Connection::flush`] when the socket is writable. Frames go out in the order queued,
    /// after any queued before, and before anything [`Connection::send`] sends later. Past
    /// the queue's bound ([`SendQueueLimits`]) the frame is refused and the connection's
    /// send direction is broken.
    pub fn enqueue(&mut self, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<(), TransportError> {
        if let Some(reason) = &self.send_broken {
            return Err(TransportError::Broken {
                direction: Direction::Send,
                reason: reason.clone(),
            });
        }
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
        if let Err(e) = codec::encode_into(msg, self.limits, &mut buf) {
            self.send_buf = buf;
            return Err(e.into());
        }
        // Nothing waits (the usual case): write now, and queue only what the socket does not
        // take, so a peer that reads costs no copy and no descriptor duplicate.
        let mut sent = 0;
        if self.queue.is_empty() {
            match scm::send(self.sock.as_fd(), &buf, fds) {
                Ok(n) => sent = n,
                Err(Errno::EAGAIN) => {}
                Err(errno) => {
                    self.send_buf = buf;
                    let e = if matches!(errno, Errno::EPIPE | Errno::ECONNRESET) {
                        TransportError::PeerGone { errno }
                    } else {
                        TransportError::Io {
                            op: "sendmsg",
                            errno,
                        }
                    };
                    self.send_broken = Some(e.to_string());
                    return Err(e);
                }
            }
        }
        let rest = buf.get(sent..).map(<[u8]>::to_vec).unwrap_or_default();
        self.send_buf = buf;
        if rest.is_empty() {
            trace!(?kind, len = sent, fds = fds.len(), "sent");
            return Ok(());
        }
        let frames = self.queue.len() + 1;
        let total = self.queued_bytes + rest.len();
        if frames > self.queue_limits.max_frames || total > self.queue_limits.max_bytes {
            let e = TransportError::SendQueueFull {
                frames,
                bytes: total,
                limits: self.queue_limits,
            };
            self.send_broken = Some(e.to_string());
            self.drop_queue();
            return Err(e);
        }
        // Descriptors go with the frame's first byte: queued (duplicated) only if it has not
        // gone yet.
        let fds = if sent == 0 {
            fds.iter()
                .map(|fd| {
                    fd.try_clone_to_owned().map_err(|e| TransportError::Io {
                        op: "fcntl(F_DUPFD_CLOEXEC)",
                        errno: Errno::from_raw(e.raw_os_error().unwrap_or(0)),
                    })
                })
                .collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        trace!(
            ?kind,
            sent,
            queued_len = rest.len(),
            fds = fds.len(),
            queued = frames,
            "enqueue"
        );
        self.queued_bytes = total;
        self.queue.push_back(Outgoing {
            bytes: rest,
            sent: 0,
            fds,
            queued_at: Instant::now(),
        });
        Ok(())
    }

    /// Whether frames wait in the send queue (the socket's writability is then of interest).
    pub fn send_queued(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Writes queued frames until the queue is empty or the socket takes no more, without
    /// waiting.
    pub fn flush(&mut self) -> Result<(), TransportError> {
        while let Some(head) = self.queue.front_mut() {
            let attach: Vec<BorrowedFd<'_>> = if head.sent == 0 {
                head.fds.iter().map(|f| f.as_fd()).collect()
            } else {
                Vec::new()
            };
            match scm::send(self.sock.as_fd(), &head.bytes[head.sent..], &attach) {
                Ok(n) => {
                    head.sent += n;
                    if head.sent == head.bytes.len() {
                        self.queued_bytes -= head.bytes.len();
                        // The descriptors are the peer's now: ours close here.
                        self.queue.pop_front();
                    }
                }
                Err(Errno::EAGAIN) => return Ok(()),
                Err(errno) => {
                    let e = if matches!(errno, Errno::EPIPE | Errno::ECONNRESET) {
                        TransportError::PeerGone { errno }
                    } else {
                        TransportError::Io {
                            op: "sendmsg",
                            errno,
                        }
                    };
                    self.send_broken = Some(e.to_string());
                    self.drop_queue();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Flushes the queue, waiting for the socket up to `deadline`.
    fn flush_by(&mut self, deadline: Instant) -> Result<(), TransportError> {
        loop {
            self.flush()?;
            if self.queue.is_empty() {
                return Ok(());
            }
            if let Err(e) = wait(self.sock.as_fd(), PollFlags::POLLOUT, deadline) {
                let partial = self.queue.front().is_some_and(|o| o.sent > 0);
                return Err(self.send_failed(e, partial));
            }
        }
    }

    fn drop_queue(&mut self) {
        self.queue.clear();
        self.queued_bytes = 0;
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
            if !self.read_some(need)? {
                match wait(self.sock.as_fd(), PollFlags::POLLIN, deadline) {
                    Ok(()) => {}
                    Err(TransportError::Timeout { direction, .. }) => {
                        return Err(TransportError::Timeout { direction, partial });
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// One read of what the socket holds, without waiting: `Ok(false)` when it holds
    /// nothing. Descriptors are filed under the frame they came with, and counted against
    /// what the frame not yet complete may carry.
    fn read_some(&mut self, need: usize) -> Result<bool, TransportError> {
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
                let now = Instant::now();
                self.last_read = Some(now);
                if !partial {
                    self.partial_since = Some(now);
                }
                self.recv.end += r.bytes;
                if !r.fds.is_empty() {
                    let last = self.recv.offset + (self.recv.end - self.recv.start) as u64 - 1;
                    let frame_at = self.recv.frame_containing(last, self.limits);
                    self.recv.fds.push((frame_at, r.fds));
                    self.check_partial_fds()?;
                }
                Ok(true)
            }
            Err(Errno::EAGAIN) => Ok(false),
            Err(Errno::ECONNRESET) => Err(TransportError::PeerGone {
                errno: Errno::ECONNRESET,
            }),
            Err(errno) => Err(TransportError::Io {
                op: "recvmsg",
                errno,
            }),
        }
    }

    /// Fails when the frame not yet complete holds more descriptors than its kind carries
    /// plus [`PARTIAL_FD_SLACK`] (a frame whose header is not here yet: the most any kind
    /// carries).
    fn check_partial_fds(&self) -> Result<(), TransportError> {
        let end = self.recv.offset + self.recv.len() as u64;
        let partial_at = self.recv.frame_containing(end, self.limits);
        let held: usize = self
            .recv
            .fds
            .iter()
            .filter(|(at, _)| *at >= partial_at)
            .map(|(_, fds)| fds.len())
            .sum();
        let pos = self.recv.start + (partial_at - self.recv.offset) as usize;
        let carries = self
            .recv
            .header_at(pos, self.limits)
            .ok()
            .and_then(|h| MessageKind::from_tag(h.tag))
            .map_or(MAX_FDS_OF_ANY_KIND, MessageKind::expected_fds);
        let bound = carries + PARTIAL_FD_SLACK;
        if held > bound {
            return Err(TransportError::TooManyFds { held, bound });
        }
        Ok(())
    }
}

/// The most descriptors any one frame carries ([`MessageKind::expected_fds`]).
const MAX_FDS_OF_ANY_KIND: usize = 1;

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
