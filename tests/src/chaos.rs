//! The chaos worker: after a proper handshake, a seeded random walk over what a worker can
//! send (right, wrong and half right), mixed with honest answers to what the parent sends, so
//! that the parent's machines are driven deep and then lied to. `poolipc-test-rogue` runs it
//! as the mode `chaos`; `tests/chaos.rs` runs many seeds beside an honest worker whose every
//! byte is checked.
//!
//! Each step takes in what arrived (answered honestly seven times in ten: a `StagingReady`
//! for the staging buffer, each chunk echoed, an arena chunk's or pool's release confirmed, an
//! extra pool declined) and then does one thing: a result request (sane or absurd shapes,
//! dtypes, byte lengths, counts), a DONE (its own recorded event, random bytes or a blob seen
//! before; the job's handles, a subset, duplicates or strangers; carves in or out of the
//! slice), an ACK, a job error or error with control characters, a heartbeat, a second
//! `HelloAck`, a `StagingReady` or chunk of the wrong size, a message only a parent sends, a
//! valid frame with one bit flipped or cut short, descriptors on a frame that carries none, an
//! honest finish of an open job, a pause, or (rarely) an exit. What it was given (jobs,
//! handles, slices, chunks) feeds what it sends, so most lies are about things that exist.
//!
//! The walk is the same for the same seed and the same arrivals; the parent's timing changes
//! the arrivals, so a failing seed is reproduced by running it again, not by replaying it.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::os::fd::AsRawFd as _;
use std::time::{Duration, Instant};

use anyhow::Result;
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use poolipc::advanced::contract::{
    Ack, AllocationGrant, ArenaRelease, CarvedResult, Chunk, Done, ErrorCode, ExtraPoolReply, Lend,
    Message, PoolRetire, ResultGrant, ResultRequest, ResultSpec,
};
use poolipc::advanced::driver::{Driver, OwnedEvent, StreamHandle};
use poolipc::advanced::transport::codec::{self, FrameLimits, HEADER_LEN};
use poolipc::advanced::transport::{Connection, Identity};
use poolipc::advanced::types::{DType, EventBlob, HandoffId, JobId};

/// xorshift64*, seeded: the walk's every choice.
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value; zero is moved off the fixed point).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn bits(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.bits() % n.max(1)
    }

    /// True `per_mille` times in a thousand.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    /// One of `items` (which must not be empty).
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// How many of its own DONE events a rogue keeps alive ([`DoneRing`]).
pub const DONE_RING: usize = 64;

/// A rogue's own DONE events, each recorded on the null stream when made, the last
/// [`DONE_RING`] kept alive: libcuda gives a new event the interprocess handle of one just
/// destroyed (measured on the H200: destroying each before the next made every DONE carry the
/// same blob), so a ring keeps the blobs distinct.
pub struct DoneRing<'a> {
    driver: &'a dyn Driver,
    live: VecDeque<OwnedEvent<&'a dyn Driver>>,
}

impl std::fmt::Debug for DoneRing<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DoneRing")
            .field("live", &self.live.len())
            .finish()
    }
}

impl<'a> DoneRing<'a> {
    /// An empty ring of `driver`'s events.
    pub fn new(driver: &'a dyn Driver) -> DoneRing<'a> {
        DoneRing {
            driver,
            live: VecDeque::new(),
        }
    }

    /// A new event, recorded now on the null stream; its blob. The oldest beyond the ring is
    /// destroyed.
    pub fn record(&mut self) -> Result<EventBlob> {
        let owned = OwnedEvent::new(self.driver, true)?;
        self.driver
            .event_record(owned.handle(), StreamHandle::NULL)?;
        let blob = self.driver.ipc_get_event_handle(owned.handle())?;
        self.live.push_back(owned);
        if self.live.len() > DONE_RING
            && let Some(old) = self.live.pop_front()
        {
            OwnedEvent::close(old)?;
        }
        Ok(blob)
    }
}

/// An honest worker's finish of `job`: DONE with `done_event` naming `handles`, then the ACK.
pub fn send_done_and_ack(
    conn: &mut Connection,
    job: JobId,
    done_event: EventBlob,
    handles: Vec<HandoffId>,
    deadline: Instant,
) -> Result<(), poolipc::advanced::transport::TransportError> {
    let done = Done {
        job,
        done_event,
        handles: handles.clone(),
        carved: Vec::new(),
    };
    conn.send(&Message::Done(done), &[], deadline)?;
    conn.send(&Message::Ack(Ack { job, handles }), &[], deadline)
}

/// A job as the walk knows it: what the `Lend` and the grants named.
#[derive(Debug)]
struct OpenJob {
    job: JobId,
    handles: Vec<HandoffId>,
    slice: Option<(HandoffId, u64)>,
    /// Results asked for (an honest worker asks once).
    requested: bool,
    /// Asked for and not yet granted: an honest worker finishes only after the grant.
    awaiting: bool,
}

/// What the walk was given, to lie about.
#[derive(Debug, Default)]
struct Seen {
    jobs: Vec<OpenJob>,
    /// Every job id seen, finished or not.
    job_ids: Vec<JobId>,
    staging_bytes: Option<u64>,
    chunks: Vec<Chunk>,
    events: Vec<EventBlob>,
    /// Every message the parent sent, for the parent-only kinds sent back.
    parent_sent: Vec<Message>,
}

/// The walk's state: the connection, its own events, what it saw.
struct Walk<'a> {
    conn: Connection,
    identity: Identity,
    rng: Rng,
    seen: Seen,
    /// Its own DONE events.
    events: DoneRing<'a>,
    sent: u64,
    /// How often a step lies, per thousand (from a worker with a rare
    /// bug to one that lies at every other step).
    lie_rate: u64,
}

/// Why the walk ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Ending {
    /// The parent closed the connection (condemned, or `Bye` taken).
    ParentClosed,
    /// All steps taken.
    StepsDone,
    /// The walk chose to exit.
    Exited,
}

/// Runs `steps` steps of the walk for `seed` on `conn` (after the handshake).
pub fn run(
    conn: Connection,
    driver: &dyn Driver,
    identity: Identity,
    seed: u64,
    steps: u64,
) -> Result<(Ending, u64)> {
    driver.use_device(0)?;
    let mut rng = Rng::new(seed);
    let lie_rate = rng.pick(&[3, 10, 30, 100, 300, 600]);
    let mut walk = Walk {
        conn,
        identity,
        rng,
        seen: Seen::default(),
        events: DoneRing::new(driver),
        sent: 0,
        lie_rate,
    };
    let ending = walk.steps(steps);
    Ok((ending?, walk.sent))
}

/// What a send or receive found: go on, or the parent is gone.
type Step = Result<Option<Ending>>;

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

impl<'a> Walk<'a> {
    fn steps(&mut self, steps: u64) -> Result<Ending> {
        // The first job first (a second at most), so the lies have something to be about.
        let until = Instant::now() + Duration::from_secs(1);
        while self.seen.jobs.is_empty() && Instant::now() < until {
            if let Some(end) = self.take_in()? {
                return Ok(end);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        for _ in 0..steps {
            if let Some(end) = self.take_in()? {
                return Ok(end);
            }
            if let Some(end) = self.act()? {
                return Ok(end);
            }
        }
        Ok(Ending::StepsDone)
    }

    /// Takes in every frame that arrived, answering some honestly.
    fn take_in(&mut self) -> Step {
        loop {
            let (msg, _fds) = match self.conn.poll_recv() {
                Ok(Some(m)) => m,
                Ok(None) => return Ok(None),
                Err(_) => return Ok(Some(Ending::ParentClosed)),
            };
            let honest = self.rng.chance(700);
            let answer = match &msg {
                Message::Lend(l) => {
                    self.learn_lend(l);
                    None
                }
                Message::AllocationGrant(g) => {
                    self.learn_grant(g);
                    None
                }
                Message::StagingBuffer(b) => {
                    self.seen.staging_bytes = Some(b.bytes);
                    self.seen.events.extend(b.filled_event);
                    self.seen.events.extend(b.drained_event);
                    honest.then_some(Message::StagingReady { bytes: b.bytes })
                }
                Message::Chunk(c) => {
                    self.seen.chunks.push(*c);
                    honest.then_some(Message::Chunk(*c))
                }
                Message::ArenaRelease(r) => honest.then_some(Message::ArenaReleased(*r)),
                Message::ReleaseMappings => {
                    honest.then_some(Message::MappingsReleased { dropped: 0 })
                }
                Message::PoolRetire(r) => honest.then_some(Message::PoolRetired(*r)),
                Message::ExtraPool(e) => {
                    honest.then_some(Message::ExtraPoolReply(ExtraPoolReply {
                        index: e.index,
                        reachable: false,
                        reason: "chaos declines".into(),
                    }))
                }
                Message::Cancel { job } if honest => {
                    let job = *job;
                    if let Some(end) = self.finish(job)? {
                        return Ok(Some(end));
                    }
                    None
                }
                Message::Heartbeat { seq } => honest.then_some(Message::Heartbeat { seq: *seq }),
                Message::Bye if honest => return Ok(Some(Ending::ParentClosed)),
                _ => None,
            };
            if self.seen.parent_sent.len() < 64 {
                self.seen.parent_sent.push(msg);
            }
            if let Some(a) = answer
                && let Some(end) = self.send(&a)?
            {
                return Ok(Some(end));
            }
        }
    }

    fn learn_lend(&mut self, l: &Lend) {
        let mut handles: Vec<HandoffId> = l.tensors.iter().map(|t| t.handle).collect();
        for t in &l.tensors {
            self.seen.events.push(t.ready_event);
        }
        if let Some(s) = l.slice {
            handles.push(s.handle);
        }
        self.seen.job_ids.push(l.job);
        self.seen.jobs.push(OpenJob {
            job: l.job,
            handles,
            slice: l.slice.map(|s| (s.handle, s.bytes)),
            requested: false,
            awaiting: false,
        });
    }

    fn learn_grant(&mut self, g: &AllocationGrant) {
        let Some(open) = self.seen.jobs.iter_mut().find(|j| j.job == g.job) else {
            return;
        };
        open.awaiting = false;
        for r in &g.results {
            match r {
                ResultGrant::Granted {
                    handle,
                    ready_event,
                    ..
                } => {
                    open.handles.push(*handle);
                    self.seen.events.push(*ready_event);
                }
                ResultGrant::Arena { handle, .. } => open.handles.push(*handle),
                ResultGrant::Refused { .. } => {}
            }
        }
    }

    fn send(&mut self, msg: &Message) -> Step {
        match self.conn.send(msg, &[], deadline()) {
            Ok(()) => {
                self.sent += 1;
                Ok(None)
            }
            // Too large to encode: the walk's own doing, not the parent's; skip it.
            Err(poolipc::advanced::transport::TransportError::Encode(_)) => Ok(None),
            Err(_) => Ok(Some(Ending::ParentClosed)),
        }
    }

    /// Writes `bytes` raw on the socket, with `fds` descriptors of `/dev/null` on them.
    fn send_raw(&mut self, bytes: &[u8], fds: usize) -> Step {
        let null: Vec<std::fs::File> = (0..fds)
            .map(|_| std::fs::File::open("/dev/null"))
            .collect::<std::io::Result<_>>()?;
        let raw: Vec<i32> = null.iter().map(|f| f.as_raw_fd()).collect();
        let cmsg = [ControlMessage::ScmRights(&raw)];
        let cmsg: &[ControlMessage<'_>] = if fds == 0 { &[] } else { &cmsg };
        let mut at = 0;
        while at < bytes.len() {
            let iov = [IoSlice::new(&bytes[at..])];
            let cm = if at == 0 { cmsg } else { &[] };
            match sendmsg::<()>(
                self.conn.as_raw_fd(),
                &iov,
                cm,
                MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Ok(n) => at += n,
                Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => return Ok(Some(Ending::ParentClosed)),
            }
        }
        self.sent += 1;
        Ok(None)
    }

    /// What an honest worker would do next: ask for a job's results once, finish a job
    /// whose grant came, or wait a little for the parent.
    fn honest_move(&mut self) -> Step {
        let ready: Vec<usize> = (0..self.seen.jobs.len())
            .filter(|&i| !self.seen.jobs[i].awaiting)
            .collect();
        if ready.is_empty() {
            std::thread::sleep(Duration::from_millis(self.rng.below(3)));
            return Ok(None);
        }
        let i = ready[self.rng.below(ready.len() as u64) as usize];
        if !self.seen.jobs[i].requested && self.rng.chance(500) {
            let n = 1 + self.rng.below(2);
            let results = (0..n)
                .map(|_| {
                    let elems = 1 + self.rng.below(16 * 1024);
                    ResultSpec {
                        dtype: DType::F32,
                        shape: vec![elems],
                        byte_len: elems * 4,
                    }
                })
                .collect();
            let open = &mut self.seen.jobs[i];
            open.requested = true;
            open.awaiting = true;
            let msg = Message::ResultRequest(ResultRequest {
                job: open.job,
                results,
            });
            return self.send(&msg);
        }
        let job = self.seen.jobs[i].job;
        self.finish(job)
    }

    /// One thing: honest most of the time, lying at the walk's rate.
    fn act(&mut self) -> Step {
        if !self.rng.chance(self.lie_rate) {
            return self.honest_move();
        }
        let choice = self.rng.below(100);
        let msg = match choice {
            0..=14 => self.result_request(),
            15..=26 => self.done(),
            27..=34 => self.ack(),
            35..=39 => Message::JobError {
                job: self.job(),
                message: self.text(),
            },
            40..=42 => Message::Error {
                code: ErrorCode(self.rng.below(16) as u16),
                message: self.text(),
            },
            43..=47 => Message::Heartbeat {
                seq: self.rng.bits(),
            },
            48 => Message::HelloAck(self.identity.clone()),
            49..=51 => Message::StagingReady {
                bytes: match self.seen.staging_bytes {
                    Some(b) if self.rng.chance(500) => b,
                    _ => self.size(),
                },
            },
            52..=55 => Message::Chunk(self.chunk()),
            56..=57 => self.reply(),
            58..=60 => match self.seen.parent_sent.len() as u64 {
                0 => Message::Bye,
                n => self.seen.parent_sent[self.rng.below(n) as usize].clone(),
            },
            61..=65 => return self.corrupt(),
            66..=67 => {
                let frame = codec::encode(&Message::Heartbeat { seq: 1 }, FrameLimits::default())?;
                let fds = 1 + self.rng.below(3) as usize;
                return self.send_raw(&frame, fds);
            }
            68..=85 => {
                let Some(job) = self.open_job() else {
                    return Ok(None);
                };
                return self.finish(job);
            }
            86..=98 => {
                std::thread::sleep(Duration::from_millis(self.rng.below(20)));
                return Ok(None);
            }
            _ => {
                if self.rng.chance(200) {
                    return Ok(Some(Ending::Exited));
                }
                return Ok(None);
            }
        };
        self.send(&msg)
    }

    /// A job id: most often one it was given.
    fn job(&mut self) -> JobId {
        if !self.seen.job_ids.is_empty() && self.rng.chance(850) {
            let n = self.seen.job_ids.len() as u64;
            return self.seen.job_ids[self.rng.below(n) as usize];
        }
        JobId(self.pick_wild())
    }

    fn open_job(&mut self) -> Option<JobId> {
        let n = self.seen.jobs.len() as u64;
        (n > 0).then(|| self.seen.jobs[self.rng.below(n) as usize].job)
    }

    /// A value from the edges: 0, 1, small, a power of two, the top of a range.
    fn pick_wild(&mut self) -> u64 {
        match self.rng.below(8) {
            0 => 0,
            1 => 1,
            2 => self.rng.below(64),
            3 => 1 << self.rng.below(64),
            4 => u64::MAX - self.rng.below(2),
            5 => i64::MAX as u64 + self.rng.below(2),
            6 => u64::from(u32::MAX) + self.rng.below(2),
            _ => self.rng.bits(),
        }
    }

    /// A byte size: mostly plausible, sometimes absurd.
    fn size(&mut self) -> u64 {
        if self.rng.chance(700) {
            let bits = 1 + self.rng.below(24);
            1 + self.rng.below(1 << bits)
        } else {
            self.pick_wild()
        }
    }

    fn dtype(&mut self) -> DType {
        self.rng.pick(&DType::ALL)
    }

    fn shape(&mut self) -> Vec<u64> {
        let dims = match self.rng.below(20) {
            0 => 33 + self.rng.below(4),
            1 => 0,
            _ => 1 + self.rng.below(4),
        };
        (0..dims)
            .map(|_| {
                if self.rng.chance(800) {
                    1 + self.rng.below(64)
                } else {
                    self.pick_wild()
                }
            })
            .collect()
    }

    fn spec(&mut self) -> ResultSpec {
        let dtype = self.dtype();
        let shape = self.shape();
        let byte_len = if self.rng.chance(700) {
            shape
                .iter()
                .try_fold(dtype.size_bytes() as u64, |a, &d| a.checked_mul(d))
                .unwrap_or(u64::MAX)
        } else {
            self.pick_wild()
        };
        ResultSpec {
            dtype,
            shape,
            byte_len,
        }
    }

    fn result_request(&mut self) -> Message {
        let n = match self.rng.below(40) {
            0 => 4096,
            1 => 5000,
            2 => 0,
            _ => 1 + self.rng.below(4),
        };
        Message::ResultRequest(ResultRequest {
            job: self.job(),
            results: (0..n).map(|_| self.spec()).collect(),
        })
    }

    /// An event blob: its own (recorded now), one it was sent, random bytes or zeros.
    fn event(&mut self) -> Result<EventBlob> {
        Ok(match self.rng.below(10) {
            0..=4 => self.events.record()?,
            5..=6 if !self.seen.events.is_empty() => {
                let n = self.seen.events.len() as u64;
                self.seen.events[self.rng.below(n) as usize]
            }
            7 => EventBlob([0; 64]),
            _ => {
                let mut b = [0u8; 64];
                for x in b.iter_mut() {
                    *x = self.rng.bits() as u8;
                }
                EventBlob(b)
            }
        })
    }

    /// Handles for `job`: its own, a subset, doubled, with strangers, none or many.
    fn handles(&mut self, job: JobId) -> Vec<HandoffId> {
        let own: Vec<HandoffId> = self
            .seen
            .jobs
            .iter()
            .find(|j| j.job == job)
            .map(|j| j.handles.clone())
            .unwrap_or_default();
        match self.rng.below(10) {
            0..=4 => own,
            5 => own.into_iter().skip(1).collect(),
            6 => own.iter().chain(own.iter()).copied().collect(),
            7 => {
                let mut h = own;
                h.push(HandoffId(self.pick_wild()));
                h
            }
            8 => Vec::new(),
            _ => (0..self.rng.below(9000))
                .map(|i| HandoffId(i + self.rng.below(4)))
                .collect(),
        }
    }

    fn carved(&mut self, job: JobId) -> Vec<CarvedResult> {
        let slice = self
            .seen
            .jobs
            .iter()
            .find(|j| j.job == job)
            .and_then(|j| j.slice);
        let n = match self.rng.below(10) {
            0..=5 => 0,
            6..=8 => 1 + self.rng.below(3),
            _ => 1 + self.rng.below(300),
        };
        (0..n)
            .map(|i| {
                let (offset, bytes) = match slice {
                    Some((_, len)) if self.rng.chance(600) => {
                        let offset = self.rng.below(len / 512 + 1) * 512;
                        (
                            offset,
                            1 + self.rng.below(len.saturating_sub(offset).max(1)),
                        )
                    }
                    _ => (self.pick_wild(), self.size()),
                };
                let dtype = self.dtype();
                CarvedResult {
                    index: if self.rng.chance(900) {
                        i as u32
                    } else {
                        self.rng.bits() as u32
                    },
                    offset,
                    bytes,
                    dtype,
                    shape: if self.rng.chance(700) {
                        vec![bytes / dtype.size_bytes() as u64]
                    } else {
                        self.shape()
                    },
                }
            })
            .collect()
    }

    fn done(&mut self) -> Message {
        let job = self.job();
        let done_event = self.event().unwrap_or(EventBlob([9; 64]));
        let handles = self.handles(job);
        let carved = self.carved(job);
        Message::Done(Done {
            job,
            done_event,
            handles,
            carved,
        })
    }

    fn ack(&mut self) -> Message {
        let job = self.job();
        let handles = self.handles(job);
        Message::Ack(Ack { job, handles })
    }

    fn text(&mut self) -> String {
        let len = match self.rng.below(10) {
            0 => 2000 + self.rng.below(100_000),
            _ => self.rng.below(200),
        };
        (0..len)
            .map(|_| match self.rng.below(6) {
                0 => char::from(self.rng.below(32) as u8),
                1 => '\u{1b}',
                2 => char::from_u32(0x80 + self.rng.below(0x2000) as u32).unwrap_or('?'),
                _ => char::from(b'a' + self.rng.below(26) as u8),
            })
            .collect()
    }

    fn chunk(&mut self) -> Chunk {
        if !self.seen.chunks.is_empty() && self.rng.chance(600) {
            let n = self.seen.chunks.len() as u64;
            let mut c = self.seen.chunks[self.rng.below(n) as usize];
            match self.rng.below(4) {
                0 => c.bytes = self.size(),
                1 => c.offset = self.pick_wild(),
                2 => c.seq = c.seq.wrapping_add(1),
                _ => {}
            }
            return c;
        }
        Chunk {
            job: self.job(),
            handle: HandoffId(self.pick_wild()),
            seq: self.pick_wild(),
            offset: self.pick_wild(),
            bytes: self.size(),
        }
    }

    /// One of the worker's answers, about nothing it was asked.
    fn reply(&mut self) -> Message {
        let index = self.rng.bits() as u8;
        match self.rng.below(4) {
            0 => Message::ExtraPoolReply(ExtraPoolReply {
                index,
                reachable: self.rng.chance(500),
                reason: self.text(),
            }),
            1 => Message::ArenaReleased(ArenaRelease {
                index: self.rng.bits() as u32,
            }),
            2 => Message::MappingsReleased {
                dropped: self.rng.bits() as u32,
            },
            _ => Message::PoolRetired(PoolRetire { index }),
        }
    }

    /// A valid frame with one bit flipped, or cut short and the rest never sent.
    fn corrupt(&mut self) -> Step {
        let msg = match self.rng.below(3) {
            0 => self.done(),
            1 => self.result_request(),
            _ => self.ack(),
        };
        let Ok(mut frame) = codec::encode(&msg, FrameLimits::default()) else {
            return Ok(None);
        };
        if self.rng.chance(800) {
            // Mostly in the payload, where a flip may still decode.
            let at = if frame.len() > HEADER_LEN && self.rng.chance(850) {
                HEADER_LEN + self.rng.below((frame.len() - HEADER_LEN) as u64) as usize
            } else {
                self.rng.below(frame.len() as u64) as usize
            };
            frame[at] ^= 1 << self.rng.below(8);
        } else {
            let keep = self.rng.below(frame.len() as u64) as usize;
            frame.truncate(keep);
        }
        self.send_raw(&frame, 0)
    }

    /// Finishes `job` as an honest worker would: DONE after its own recorded event, naming
    /// the job's handles, then the ACK.
    fn finish(&mut self, job: JobId) -> Step {
        let Some(at) = self.seen.jobs.iter().position(|j| j.job == job) else {
            return Ok(None);
        };
        let open = self.seen.jobs.swap_remove(at);
        let done_event = self.events.record()?;
        let done = Message::Done(Done {
            job,
            done_event,
            handles: open.handles.clone(),
            carved: Vec::new(),
        });
        if let Some(end) = self.send(&done)? {
            return Ok(Some(end));
        }
        self.send(&Message::Ack(Ack {
            job,
            handles: open.handles,
        }))
    }
}

/// The handshake, lied through as `seed` says, after the parent's `Hello` came: a `HelloAck`
/// with a random identity (device, driver version, capabilities, a device list up to past its
/// bound), another message, bytes that are no frame, a refusal with random text, silence past
/// the parent's deadline, or an exit; or the honest `HelloAck`. Returns the connection where
/// the parent accepted (the walk goes on), `None` where the handshake ended here.
pub fn hello(
    mut conn: Connection,
    identity: &Identity,
    seed: u64,
) -> Result<Option<(Connection, Identity)>> {
    let mut rng = Rng::new(seed ^ 0x4E11_0000);
    let Ok((Message::Hello(_), _fds)) = conn.recv(Instant::now() + Duration::from_secs(30)) else {
        return Ok(None);
    };
    let mut ours = identity.clone();
    let reply = match rng.below(10) {
        0 => {
            ours.device =
                poolipc::advanced::types::DeviceUuid(std::array::from_fn(|_| rng.bits() as u8));
            Some(Message::HelloAck(ours.clone()))
        }
        1 => {
            ours.driver_version = rng.bits() as i32;
            Some(Message::HelloAck(ours.clone()))
        }
        2 => {
            ours.capabilities = poolipc::advanced::transport::Capabilities(rng.bits());
            Some(Message::HelloAck(ours.clone()))
        }
        3 => {
            let n = rng.below(poolipc::advanced::contract::MAX_DEVICES as u64 + 8);
            ours.devices = (0..n)
                .map(|i| poolipc::advanced::contract::DeviceEntry {
                    uuid: poolipc::advanced::types::DeviceUuid(std::array::from_fn(|_| {
                        rng.bits() as u8
                    })),
                    ordinal: if rng.chance(500) {
                        i as u32
                    } else {
                        rng.bits() as u32
                    },
                })
                .collect();
            Some(Message::HelloAck(ours.clone()))
        }
        4 => Some(Message::Heartbeat { seq: rng.bits() }),
        5 => Some(Message::Refuse {
            code: ErrorCode(rng.bits() as u16),
            message: (0..rng.below(400))
                .map(|_| char::from(rng.below(128) as u8))
                .collect(),
        }),
        6 => {
            let raw: Vec<u8> = (0..1 + rng.below(64)).map(|_| rng.bits() as u8).collect();
            let _ = nix::unistd::write(&conn, &raw);
            std::thread::sleep(Duration::from_secs(5));
            return Ok(None);
        }
        7 => {
            // Silent past any deadline a test sets; the parent must give up on its own.
            std::thread::sleep(Duration::from_secs(5));
            return Ok(None);
        }
        8 => return Ok(None),
        _ => Some(Message::HelloAck(ours.clone())),
    };
    if let Some(m) = reply
        && conn
            .send(&m, &[], Instant::now() + Duration::from_secs(5))
            .is_err()
    {
        return Ok(None);
    }
    match conn.recv(Instant::now() + Duration::from_secs(10)) {
        Ok((Message::HelloAck(_), _)) => Ok(Some((conn, ours))),
        _ => Ok(None),
    }
}
