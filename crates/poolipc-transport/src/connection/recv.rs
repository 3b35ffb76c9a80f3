//! Receiving: whole frames with the descriptors that came with them, by a deadline
//! ([`Connection::recv`]) or without waiting ([`Connection::poll_recv`]), and the frame deadline
//! of a frame that is not complete yet.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::PollFlags;
use tracing::trace;

use super::{Connection, Direction, TransportError, wait};
use crate::codec::{self, DecodeError, FrameHeader, FrameLimits, HEADER_LEN};
use crate::message::{Message, MessageKind};
use crate::scm;

/// The most descriptors any one frame carries ([`MessageKind::expected_fds`]).
const MAX_FDS_OF_ANY_KIND: usize = 1;

/// Descriptors a frame not yet complete may hold beyond what its kind carries (see
/// [`TransportError::TooManyFds`]).
pub const PARTIAL_FD_SLACK: usize = 4;

/// What has been read from the socket and not yet returned as a frame.
///
/// A read takes whatever the socket holds (up to the buffer's room), so frames that arrive
/// together (a worker's DONE and ACK) cost one system call, and a frame's header and payload
/// one, not two. Descriptors (`SCM_RIGHTS`) need care then: Linux ends a `recvmsg` on a
/// stream socket right after the first message that carried descriptors
/// (`unix_stream_read_generic`), and a sender attaches them to a frame's first byte
/// ([`Connection::send`]), so the descriptors that come with a read belong to the frame its
/// last byte is part of. They are kept with that frame's stream offset until it is returned.
pub(super) struct RecvBuf {
    pub(super) buf: Vec<u8>,
    /// `buf[start..end]` is unread.
    pub(super) start: usize,
    pub(super) end: usize,
    /// The stream offset of `buf[start]`: bytes returned as frames so far.
    pub(super) offset: u64,
    /// Descriptors that came, by the stream offset of the frame they came with.
    pub(super) fds: Vec<(u64, Vec<OwnedFd>)>,
}

/// The least a read asks the socket for.
const RECV_CHUNK: usize = 64 * 1024;

impl RecvBuf {
    pub(super) fn new() -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            end: 0,
            offset: 0,
            fds: Vec::new(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.end - self.start
    }

    /// The unread bytes at the front, and room behind them for `need` unread bytes in all
    /// and a read of [`RECV_CHUNK`]. The buffer so never holds more than the largest frame
    /// and a read, however long the stream.
    pub(super) fn make_room(&mut self, need: usize) {
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
    pub(super) fn frame_containing(&self, at: u64, limits: FrameLimits) -> u64 {
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
    pub(super) fn header_at(
        &self,
        pos: usize,
        limits: FrameLimits,
    ) -> Result<FrameHeader, DecodeError> {
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
    pub(super) fn consume(&mut self, n: usize) {
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
    pub(super) fn take_fds(&mut self, frame_at: u64) -> Vec<OwnedFd> {
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
