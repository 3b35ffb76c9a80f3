//! The host-staging rung: a tensor's bytes move from device memory in one process to device
//! memory in the other through pinned shared host memory, chunk by chunk, never needing a
//! second device copy of the tensor.
//!
//! # Setup, once per connection
//!
//! The parent creates a [`SharedHostBuffer`] of two halves of `chunk` bytes, registers it, and
//! creates four interprocess events: `filled[0..2]` and `drained[0..2]`. It sends
//! [`Message::StagingBuffer`] with the buffer's memfd ([`StagingChannel::setup_parent`]); the
//! worker maps and registers the buffer, opens the events and answers
//! [`Message::StagingReady`] ([`StagingChannel::setup_worker`]).
//!
//! # One tensor
//!
//! The same engine serves both directions (inputs parent → worker, results worker →
//! parent); one transfer at a time per connection. Chunk `i` uses half `i % 2`:
//!
//! - the sender's stream copies chunk `i` into its half and records `filled[i % 2]`; the
//!   sender then sends [`Message::Chunk`] with `seq = i`;
//! - the receiver, on that message, makes its stream wait `filled[i % 2]`, copies the half
//!   into `dst + offset`, records `drained[i % 2]`, and echoes the message back (its ack);
//! - before reusing a half for chunk `i + 2`, the sender waits for the ack of chunk `i` (so
//!   the receiver's `drained` record is issued) and makes its stream wait `drained[i % 2]`.
//!
//! At its start a transfer's sender also waits the last `filled` and `drained` of both
//! halves, whichever side recorded them: that orders it after the previous transfer, in
//! either direction. [`StagingChannel::send_tensor`] returns once every chunk is acked; its
//! copies out of `src` are then issued on `stream` (free `src` stream-ordered after them).
//! [`StagingChannel::recv_tensor`] returns once every copy into `dst` is issued on its
//! stream: work on that stream sees the tensor.
//!
//! # Other frames meanwhile
//!
//! The peer may send other frames while a transfer (or the setup) waits for its own: a lend
//! of a later job, a cancel, a worker's Done. The channel does not fail on them: it keeps
//! them, in order, in a backlog that [`StagingChannel::take_backlog`] hands to the caller,
//! who handles them next. Heartbeats are dropped; a peer's `Error` ends the wait
//! ([`StagingError::Peer`]); a frame that came with FDs cannot wait in the backlog (they
//! would be lost) and fails the transfer. On the parent's side the backlog is bounded
//! ([`StagingConfig::max_backlog_frames`], [`StagingConfig::max_backlog_bytes`]): a frame
//! past either bound fails the wait ([`StagingError::BacklogFull`]) and the parent condemns
//! the worker. The worker's side trusts its parent and keeps what comes.
//!
//! `#![forbid(unsafe_code)]` holds here: the copies are [`SharedHostBuffer`]'s safe methods.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use poolipc_driver::host::SharedHostBuffer;
use poolipc_driver::{DevicePtr, Driver, DriverError, EventHandle, OwnedEvent, StreamHandle};
use poolipc_transport::{
    Chunk, Connection, ErrorCode, HandoffId, JobId, Message, MessageKind, StagingBuffer,
    TransportError,
};
use tracing::{debug, trace};

/// Bytes of one half of the buffer unless configured: 64 MiB (the buffer is twice that).
pub(crate) const DEFAULT_CHUNK: usize = 64 << 20;

/// Which wait to leave out, for the tests that prove the simulation catches a missing one.
#[cfg(test)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum SkipWait {
    /// Skip nothing (always, outside those tests).
    #[default]
    None,
    /// The receiver does not wait `filled` before copying a half out.
    Filled,
    /// The sender does not wait `drained` before reusing a half.
    Drained,
}

/// How host staging's channel (the shared buffer a tensor crosses in chunks) is set up and how
/// long it waits.
#[derive(Clone, Debug)]
pub struct StagingConfig {
    /// Bytes of each half of the shared buffer, i.e. of one chunk (the buffer is twice this).
    pub chunk: usize,
    /// How long each wait for the peer's next message may take.
    pub timeout: Duration,
    /// The parent's side: the most frames of the worker kept aside during one of the
    /// channel's waits (by default 256). One more is
    /// [`StagingError::BacklogFull`], which condemns the worker.
    pub max_backlog_frames: usize,
    /// The parent's side: the most bytes those frames may take, counted as the size of a
    /// message plus its frame's length on the wire (by default 4 MiB). One
    /// more frame past it is [`StagingError::BacklogFull`].
    pub max_backlog_bytes: usize,
    /// Leave out one of the waits: for the tests that prove the simulation catches it.
    #[cfg(test)]
    pub(crate) skip_wait: SkipWait,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            chunk: DEFAULT_CHUNK,
            timeout: Duration::from_secs(30),
            max_backlog_frames: DEFAULT_MAX_BACKLOG_FRAMES,
            max_backlog_bytes: DEFAULT_MAX_BACKLOG_BYTES,
            #[cfg(test)]
            skip_wait: SkipWait::None,
        }
    }
}

/// [`StagingConfig::max_backlog_frames`]'s default: far more than a worker has reason to send
/// while the parent stages (its other jobs' frames).
pub(crate) const DEFAULT_MAX_BACKLOG_FRAMES: usize = 256;

/// [`StagingConfig::max_backlog_bytes`]'s default: 4 MiB.
pub(crate) const DEFAULT_MAX_BACKLOG_BYTES: usize = 4 << 20;

/// Why staging failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StagingError {
    /// A driver call failed (mapping, registration, events, copies).
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The connection failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The peer sent something the staging protocol does not allow here.
    #[error("host staging: {0}")]
    Protocol(String),
    /// The peer's `filled` or `drained` record did not complete on the GPU within the
    /// channel's timeout: its GPU work hangs.
    #[error(
        "host staging: the worker's `{which}` event did not complete on the GPU within the staging timeout ({timeout:?}): its GPU work hangs"
    )]
    PeerStuck {
        /// Which of the channel's events.
        which: &'static str,
        /// The timeout it had.
        timeout: Duration,
    },
    /// The worker sent more frames (or bytes of frames) than the parent keeps aside while a
    /// staging wait runs ([`StagingConfig::max_backlog_frames`],
    /// [`StagingConfig::max_backlog_bytes`]): a violation that condemns it.
    #[error(
        "host staging: the worker sent {frames} frames ({bytes} bytes) during one staging wait, past the backlog's bound ({max_frames} frames, {max_bytes} bytes)"
    )]
    BacklogFull {
        /// Frames kept when it overflowed, the one over included.
        frames: usize,
        /// Their bytes.
        bytes: usize,
        /// The bound on frames.
        max_frames: usize,
        /// The bound on bytes.
        max_bytes: usize,
    },
    /// The parent ended the transfer early (the worker was stopped, condemned or lost, or the
    /// parent dropped) while the channel waited on the host for the worker's GPU work.
    #[error("host staging: the transfer was aborted")]
    Aborted,
    /// The peer reported an error instead of going on.
    #[error("host staging: the peer failed: {message} ({code})")]
    Peer {
        /// Its code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
}

type Result<T, E = StagingError> = std::result::Result<T, E>;

/// One side of the host-staging rung over a connection. See the [module docs](self).
pub(crate) struct StagingChannel {
    driver: Arc<dyn Driver>,
    buffer: SharedHostBuffer,
    chunk: usize,
    filled: [EventHandle; 2],
    drained: [EventHandle; 2],
    /// The four events `filled` and `drained` name, owned: destroyed first when the channel
    /// is dropped.
    events: Vec<OwnedEvent>,
    config: StagingConfig,
    /// Frames of the peer that arrived while this channel waited for its own.
    backlog: VecDeque<Message>,
    /// Their bytes (see [`StagingConfig::max_backlog_bytes`]).
    backlog_bytes: usize,
    /// The parent's side: the peer's records (`filled` of what comes in, `drained` of what
    /// goes out) are waited for on the host, each against the channel's deadline, never by
    /// the stream: a worker's record behind a kernel that never ends would block a stream
    /// of the parent's for good (docs/facts.md).
    peer_on_host: bool,
    /// Set from another thread to end a host-side wait for the peer early
    /// ([`abort_flag`](Self::abort_flag)).
    abort: Arc<AtomicBool>,
}

impl std::fmt::Debug for StagingChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingChannel")
            .field("buffer", &self.buffer)
            .field("chunk", &self.chunk)
            .finish_non_exhaustive()
    }
}

impl StagingChannel {
    /// Parent side: creates the buffer (two halves of `config.chunk` bytes) and the four
    /// events, sends [`Message::StagingBuffer`] with the memfd, and waits for the worker's
    /// [`Message::StagingReady`]. The device must be current on this thread.
    pub(crate) fn setup_parent(
        driver: Arc<dyn Driver>,
        conn: &mut Connection,
        config: StagingConfig,
    ) -> Result<StagingChannel> {
        let chunk = config.chunk;
        let bytes = chunk
            .checked_mul(2)
            .filter(|_| chunk > 0)
            .ok_or_else(|| StagingError::Protocol(format!("invalid chunk size {chunk}")))?;
        let buffer = SharedHostBuffer::create(bytes)?;
        buffer.register(&driver)?;
        // Events made so far are destroyed (dropped) when setup fails half-way.
        let mut events = Vec::with_capacity(4);
        let mut blobs = Vec::with_capacity(4);
        for _ in 0..4 {
            let e = OwnedEvent::new(Arc::clone(&driver), true)?;
            blobs.push(e.ipc_handle()?);
            events.push(e);
        }
        let mut channel = StagingChannel {
            filled: [events[0].handle(), events[1].handle()],
            drained: [events[2].handle(), events[3].handle()],
            events,
            driver,
            buffer,
            chunk,
            config,
            backlog: VecDeque::new(),
            backlog_bytes: 0,
            peer_on_host: true,
            abort: Arc::new(AtomicBool::new(false)),
        };
        let msg = Message::StagingBuffer(StagingBuffer {
            bytes: bytes as u64,
            chunk: chunk as u64,
            filled_event: [blobs[0], blobs[1]],
            drained_event: [blobs[2], blobs[3]],
        });
        let Some(fd) = channel.buffer.fd() else {
            // `create` made it, with its memfd.
            return Err(StagingError::Protocol(
                "the staging buffer has no descriptor to send".into(),
            ));
        };
        conn.send(&msg, &[fd], channel.deadline())?;
        let ready = channel.recv(conn, |m| matches!(m, Message::StagingReady { .. }))?;
        match ready {
            Message::StagingReady { bytes: b } if b == bytes as u64 => {}
            Message::StagingReady { bytes: b } => {
                return Err(StagingError::Protocol(format!(
                    "the worker mapped {b} bytes of a {bytes}-byte buffer"
                )));
            }
            other => return Err(unexpected(&other, "StagingReady")),
        }
        debug!(bytes, chunk, "host staging set up (parent)");
        Ok(channel)
    }

    /// Worker side, given the [`Message::StagingBuffer`] and its FD as
    /// [`Connection::recv`] returned them: maps and registers the buffer, opens the events,
    /// answers [`Message::StagingReady`]. The device must be current on this thread.
    pub(crate) fn setup_worker(
        driver: Arc<dyn Driver>,
        conn: &mut Connection,
        setup: &StagingBuffer,
        mut fds: Vec<OwnedFd>,
        config: StagingConfig,
    ) -> Result<StagingChannel> {
        let (Some(fd), true) = (fds.pop(), fds.is_empty()) else {
            return Err(StagingError::Protocol(
                "StagingBuffer must come with exactly one FD".into(),
            ));
        };
        let bytes = usize::try_from(setup.bytes).ok();
        let chunk = usize::try_from(setup.chunk).ok().filter(|c| *c > 0);
        let (Some(bytes), Some(chunk)) = (bytes, chunk) else {
            return Err(StagingError::Protocol(format!(
                "unusable staging buffer: {} bytes, chunk {}",
                setup.bytes, setup.chunk
            )));
        };
        if chunk.checked_mul(2) != Some(bytes) {
            return Err(StagingError::Protocol(format!(
                "a staging buffer of {bytes} bytes is not two chunks of {chunk}"
            )));
        }
        let buffer = SharedHostBuffer::from_fd(fd, bytes)?;
        buffer.register(&driver)?;
        // Events opened so far are destroyed (dropped) when setup fails half-way.
        let mut events = Vec::with_capacity(4);
        for blob in setup.filled_event.iter().chain(&setup.drained_event) {
            events.push(OwnedEvent::open_ipc(Arc::clone(&driver), blob)?);
        }
        let channel = StagingChannel {
            filled: [events[0].handle(), events[1].handle()],
            drained: [events[2].handle(), events[3].handle()],
            events,
            driver,
            buffer,
            chunk,
            config: StagingConfig { chunk, ..config },
            backlog: VecDeque::new(),
            backlog_bytes: 0,
            peer_on_host: false,
            abort: Arc::new(AtomicBool::new(false)),
        };
        conn.send(
            &Message::StagingReady {
                bytes: bytes as u64,
            },
            &[],
            channel.deadline(),
        )?;
        debug!(bytes, chunk, "host staging set up (worker)");
        Ok(channel)
    }

    /// Worker side, receiving the [`Message::StagingBuffer`] itself first (for a worker that
    /// knows staging setup comes next). Frames before it wait in the
    /// [backlog](Self::take_backlog).
    #[cfg(test)]
    pub(crate) fn accept_worker(
        driver: Arc<dyn Driver>,
        conn: &mut Connection,
        config: StagingConfig,
    ) -> Result<StagingChannel> {
        let deadline = Instant::now() + config.timeout;
        let mut skipped = VecDeque::new();
        loop {
            let (msg, fds) = conn.recv(deadline)?;
            match msg {
                Message::StagingBuffer(setup) => {
                    let mut channel =
                        StagingChannel::setup_worker(driver, conn, &setup, fds, config)?;
                    skipped.append(&mut channel.backlog);
                    channel.backlog = skipped;
                    return Ok(channel);
                }
                other => keep(&mut skipped, other, &fds, None)?,
            }
        }
    }

    /// Whether this channel was configured to skip one of its waits (a test's mutation).
    #[cfg(test)]
    #[must_use]
    pub(crate) fn skips_a_wait(&self) -> bool {
        self.config.skip_wait != SkipWait::None
    }

    /// Whether the `filled` wait is left out (a test's mutation).
    fn skips_filled(&self) -> bool {
        #[cfg(test)]
        return self.config.skip_wait == SkipWait::Filled;
        #[cfg(not(test))]
        false
    }

    /// Whether the `drained` wait is left out (a test's mutation).
    fn skips_drained(&self) -> bool {
        #[cfg(test)]
        return self.config.skip_wait == SkipWait::Drained;
        #[cfg(not(test))]
        false
    }

    /// The frames of the peer that arrived while this channel waited for its own (setup,
    /// chunks, acks), in order; empty after. Call it after every call that may receive, and
    /// handle them next.
    pub(crate) fn take_backlog(&mut self) -> VecDeque<Message> {
        self.backlog_bytes = 0;
        std::mem::take(&mut self.backlog)
    }

    /// The channel's abort flag: set (from any thread), every wait of the parent's side for
    /// the peer's GPU work (polled on the host) that runs or comes next fails with
    /// [`StagingError::Aborted`] at its next poll instead of at the channel's timeout. It
    /// stays set: the channel is done with. Socket reads and writes do not look at it (shut
    /// the socket down to end those).
    pub(crate) fn abort_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.abort)
    }

    /// Bytes of one chunk (one half of the buffer).
    pub(crate) fn chunk(&self) -> usize {
        self.chunk
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.config.timeout
    }

    /// The next frame `wanted` accepts; others wait in the backlog (see [`keep`]). One
    /// deadline for the whole wait.
    fn recv(
        &mut self,
        conn: &mut Connection,
        wanted: impl Fn(&Message) -> bool,
    ) -> Result<Message> {
        let deadline = self.deadline();
        loop {
            let (msg, fds) = conn.recv(deadline)?;
            if wanted(&msg) && fds.is_empty() {
                return Ok(msg);
            }
            let bound = self.peer_on_host.then_some(Bound {
                bytes: &mut self.backlog_bytes,
                max_frames: self.config.max_backlog_frames,
                max_bytes: self.config.max_backlog_bytes,
            });
            keep(&mut self.backlog, msg, &fds, bound)?;
        }
    }

    /// Orders what this side queues on `stream` next after the peer's latest record of
    /// `event`. The worker's side: `stream` waits on it (the parent's events end). The
    /// parent's side ([`peer_on_host`](Self::peer_on_host)): the host queries it until it
    /// completed, for up to the channel's timeout, and then queues the rest; past the
    /// timeout it fails with [`StagingError::PeerStuck`], and once the
    /// [abort flag](Self::abort_flag) is set with [`StagingError::Aborted`].
    fn wait_peer(
        &self,
        stream: StreamHandle,
        event: EventHandle,
        which: &'static str,
    ) -> Result<()> {
        if !self.peer_on_host {
            return Ok(self.driver.stream_wait_event(stream, event)?);
        }
        let deadline = self.deadline();
        let mut spins = 0u32;
        while !self.driver.event_query(event)? {
            if self.abort.load(Ordering::Relaxed) {
                return Err(StagingError::Aborted);
            }
            if Instant::now() >= deadline {
                return Err(StagingError::PeerStuck {
                    which,
                    timeout: self.config.timeout,
                });
            }
            // A copy of a chunk takes microseconds to milliseconds: spin a little, then nap.
            if spins < 1000 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Ok(())
    }

    /// The chunk `seq` of a tensor of `bytes`: (offset, length).
    fn span(&self, seq: usize, bytes: usize) -> (usize, usize) {
        let off = seq * self.chunk;
        (off, self.chunk.min(bytes - off))
    }

    fn half(&self, seq: usize) -> usize {
        (seq % 2) * self.chunk
    }

    /// Sends `[src, src + bytes)` of this process's device memory to the peer's
    /// [`recv_tensor`](Self::recv_tensor) of the same `job`, `handle` and `bytes`. `src` must
    /// be ready on `stream` (or ordered before it by the caller). Returns once the peer acked
    /// every chunk; the copies out of `src` are issued on `stream`.
    pub(crate) fn send_tensor(
        &mut self,
        conn: &mut Connection,
        job: JobId,
        handle: HandoffId,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let bytes = self.tensor_len(bytes)?;
        let n = bytes.div_ceil(self.chunk);
        let d = Arc::clone(&self.driver);
        // Either side may have recorded these last (the peer, if it sent or received last).
        for h in 0..2 {
            self.wait_peer(stream, self.filled[h], "filled")?;
            self.wait_peer(stream, self.drained[h], "drained")?;
        }
        let mut acked = 0;
        for seq in 0..n {
            let (off, len) = self.span(seq, bytes);
            if seq >= 2 {
                while acked <= seq - 2 {
                    self.expect_chunk(conn, job, handle, acked, bytes, "ack")?;
                    acked += 1;
                }
                if !self.skips_drained() {
                    self.wait_peer(stream, self.drained[seq % 2], "drained")?;
                }
            }
            self.buffer
                .copy_from_device(self.half(seq), src.offset(off as u64), len, stream)?;
            d.event_record(self.filled[seq % 2], stream)?;
            conn.send(
                &Message::Chunk(chunk_msg(job, handle, seq, off, len)),
                &[],
                self.deadline(),
            )?;
            trace!(seq, off, len, "host staging: chunk sent");
        }
        while acked < n {
            self.expect_chunk(conn, job, handle, acked, bytes, "ack")?;
            acked += 1;
        }
        debug!(
            ?job,
            ?handle,
            bytes,
            chunks = n,
            "host staging: tensor sent"
        );
        Ok(())
    }

    /// Receives the peer's [`send_tensor`](Self::send_tensor) of the same `job`, `handle` and
    /// `bytes` into `[dst, dst + bytes)` of this process's device memory. Returns once every
    /// copy into `dst` is issued on `stream`: later work on `stream` sees the tensor.
    pub(crate) fn recv_tensor(
        &mut self,
        conn: &mut Connection,
        job: JobId,
        handle: HandoffId,
        dst: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let bytes = self.tensor_len(bytes)?;
        let n = bytes.div_ceil(self.chunk);
        let d = Arc::clone(&self.driver);
        for seq in 0..n {
            let c = self.expect_chunk(conn, job, handle, seq, bytes, "chunk")?;
            let (off, len) = self.span(seq, bytes);
            if !self.skips_filled() {
                self.wait_peer(stream, self.filled[seq % 2], "filled")?;
            }
            self.buffer
                .copy_to_device(self.half(seq), dst.offset(off as u64), len, stream)?;
            d.event_record(self.drained[seq % 2], stream)?;
            conn.send(&Message::Chunk(c), &[], self.deadline())?;
            trace!(seq, off, len, "host staging: chunk received");
        }
        debug!(
            ?job,
            ?handle,
            bytes,
            chunks = n,
            "host staging: tensor received"
        );
        Ok(())
    }

    fn tensor_len(&self, bytes: u64) -> Result<usize> {
        usize::try_from(bytes)
            .map_err(|_| StagingError::Protocol(format!("{bytes} bytes do not fit usize")))
    }

    /// Receives the `Chunk` for `seq` and checks every field.
    fn expect_chunk(
        &mut self,
        conn: &mut Connection,
        job: JobId,
        handle: HandoffId,
        seq: usize,
        bytes: usize,
        what: &str,
    ) -> Result<Chunk> {
        let (off, len) = self.span(seq, bytes);
        let want = chunk_msg(job, handle, seq, off, len);
        match self.recv(conn, |m| matches!(m, Message::Chunk(_)))? {
            Message::Chunk(c) if c == want => Ok(c),
            Message::Chunk(c) => Err(StagingError::Protocol(format!(
                "expected {what} {want:?}, got {c:?}"
            ))),
            other => Err(unexpected(&other, "Chunk")),
        }
    }
}

fn chunk_msg(job: JobId, handle: HandoffId, seq: usize, off: usize, len: usize) -> Chunk {
    Chunk {
        job,
        handle,
        seq: seq as u64,
        offset: off as u64,
        bytes: len as u64,
    }
}

/// The parent's bound on a channel's backlog, and the bytes it holds.
struct Bound<'a> {
    bytes: &'a mut usize,
    max_frames: usize,
    max_bytes: usize,
}

/// What a kept frame counts against [`StagingConfig::max_backlog_bytes`]: the message's size
/// plus its frame's length on the wire (what its heap parts take, roughly).
fn backlog_bytes(msg: &Message) -> usize {
    let wire =
        poolipc_transport::codec::encode(msg, poolipc_transport::codec::FrameLimits::default())
            .map_or(poolipc_transport::codec::MAX_FRAME_LEN, |f| f.len());
    std::mem::size_of::<Message>().saturating_add(wire)
}

/// Keeps a frame that is not the one waited for: heartbeats are dropped, a peer's error ends
/// the wait, a frame with FDs fails it (its FDs cannot wait), one past `bound` fails it
/// ([`StagingError::BacklogFull`]), any other goes to `backlog`.
fn keep(
    backlog: &mut VecDeque<Message>,
    msg: Message,
    fds: &[OwnedFd],
    bound: Option<Bound<'_>>,
) -> Result<()> {
    match msg {
        Message::Heartbeat { .. } => Ok(()),
        // On the parent's side (the bounded one) the peer is a worker: its words are marked
        // as its own and made safe to print before they reach an error.
        Message::Error { code, message } => Err(StagingError::Peer {
            code,
            message: if bound.is_some() {
                poolipc_contract::worker_text(&message)
            } else {
                message
            },
        }),
        other if !fds.is_empty() => Err(StagingError::Protocol(format!(
            "a {} with {} FDs arrived during host staging",
            other.kind(),
            fds.len()
        ))),
        other => {
            if let Some(b) = bound {
                let bytes = b.bytes.saturating_add(backlog_bytes(&other));
                let frames = backlog.len().saturating_add(1);
                if frames > b.max_frames || bytes > b.max_bytes {
                    return Err(StagingError::BacklogFull {
                        frames,
                        bytes,
                        max_frames: b.max_frames,
                        max_bytes: b.max_bytes,
                    });
                }
                *b.bytes = bytes;
            }
            trace!(kind = %other.kind(), "host staging: a frame kept for later");
            backlog.push_back(other);
            Ok(())
        }
    }
}

fn unexpected(msg: &Message, wanted: &str) -> StagingError {
    let kind: MessageKind = msg.kind();
    StagingError::Protocol(format!("expected {wanted}, got {kind}"))
}

impl Drop for StagingChannel {
    /// Destroys the four events; the buffer then waits for its copies, unregisters, unmaps.
    fn drop(&mut self) {
        // Failures are logged by `OwnedEvent`'s drop.
        self.events.clear();
    }
}

#[cfg(test)]
mod channel_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker's error during host staging reaches the parent's error marked as the worker's
    /// and without its control characters; the worker's side keeps its parent's words as
    /// they are.
    #[test]
    fn a_workers_error_during_staging_is_shown_safely_on_the_parents_side() {
        let raw = "\u{1b}[2Jwiped\rforged\u{202e}";
        let error = || Message::Error {
            code: ErrorCode::OTHER,
            message: raw.into(),
        };
        let mut backlog = VecDeque::new();
        let mut bytes = 0;
        let bound = Bound {
            bytes: &mut bytes,
            max_frames: 8,
            max_bytes: 1 << 20,
        };
        let parent_side = keep(&mut backlog, error(), &[], Some(bound));
        let Err(StagingError::Peer { message, .. }) = parent_side else {
            panic!("expected the peer's error, got {parent_side:?}");
        };
        assert!(
            message.starts_with(poolipc_contract::text::WORKER_SAYS),
            "{message:?}"
        );
        assert!(
            !message.chars().any(poolipc_contract::text::is_unsafe_char),
            "{message:?}"
        );
        let worker_side = keep(&mut backlog, error(), &[], None);
        let Err(StagingError::Peer { message, .. }) = worker_side else {
            panic!("expected the peer's error, got {worker_side:?}");
        };
        assert_eq!(message, raw);
    }
}
