//! Sending: one frame by a deadline ([`Connection::send`]), or queued and written as the
//! socket takes them ([`Connection::enqueue`], [`Connection::flush`]), bounded for a peer that
//! does not read ([`SendQueueLimits`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Instant;

use nix::errno::Errno;
use nix::poll::PollFlags;
use tracing::trace;

use super::{Connection, Direction, TransportError, wait};
use crate::codec;
use crate::message::Message;
use crate::scm;

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
pub(super) struct Outgoing {
    bytes: Vec<u8>,
    sent: usize,
    fds: Vec<OwnedFd>,
    pub(super) queued_at: Instant,
}

impl Connection {
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

    pub(super) fn drop_queue(&mut self) {
        self.queue.clear();
        self.queued_bytes = 0;
    }
}
