//! The parent's IO loop: one thread per [`Parent`](crate::Parent) that polls every worker's
//! socket, feeds what arrives into the ownership contract's machine and carries out every
//! action the machine emits, matched exhaustively. What goes on the wire is what the contract
//! emitted; the loop adds nothing and drops nothing.
//!
//! Every fault (EOF, a broken or malformed frame, a protocol violation the contract names, a
//! deadline) takes the same path: the contract condemns the worker, the loop kills and reaps
//! it, the contract releases its loans and fails its jobs, and nothing of it touches another
//! worker.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io::Read as _;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Child, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll, ppoll};
use nix::sys::time::TimeSpec;
use poolipc_contract::{
    self as contract, ArenaLocation, CarvedResult, FailReason, InputLoan, JobOutcome, Message,
    Outcome, ParentAction, ParentEvent, Purpose, ResultGrant, ResultSpec, SliceLoan, Timestamp,
};
use poolipc_driver::{DevicePtr, Driver, EventHandle, OwnedEvent, StreamHandle};
use poolipc_pool::Arena;
use poolipc_transport::{
    ArenaChunk, ArenaRelease, Capabilities, Connection, ErrorCode, TransportError, VmmShare,
};
use poolipc_types::ARENA_ALIGN as ALIGN;
use poolipc_types::{
    AllocId, EventBlob, ExportBlob, HandoffId, JobId, RequestId, Rung, Span, WorkerId,
};

use crate::error::Error;
use crate::parent::{
    Answer, ArenaLease, EmptyCache, Input, JobOutput, ResultAllocator, ResultMemory, ResultTensor,
    Shared, Stats, lock,
};
use crate::staging::StagingChannel;
use crate::tensor::ResultShape;

/// Whether `e` is the worker overflowing the staging backlog (a bound, not a hang-up).
fn backlog_full(e: &Error) -> bool {
    matches!(
        e,
        Error::Staging(crate::staging::StagingError::BacklogFull { .. })
    )
}

mod done_events;
mod pool_rotation;

use done_events::{DoneEvents, Room};

/// What a caller's thread asks of the IO loop.
pub(crate) enum Command {
    /// A worker that shook hands: the loop owns its socket and process from now on.
    Adopt {
        worker: WorkerId,
        conn: Box<Connection>,
        child: Option<Child>,
        reply: Sender<Result<(), Error>>,
    },
    /// A job to run.
    Submit(Box<Submission>),
    /// `Parent::cancel` / `JobHandle::cancel`: a job still queued fails at once; one sent
    /// is cancelled in the contract (the worker is told and still finishes it; it then fails
    /// with `FailReason::Cancelled`). A job that ended already is left alone.
    Cancel { worker: WorkerId, job: JobId },
    /// Bye, a bounded wait, then SIGKILL; reply with the exit status once reaped.
    Stop {
        worker: WorkerId,
        reply: Sender<Result<Option<ExitStatus>, Error>>,
    },
    /// `Parent::empty_cache`: give every idle arena chunk back, tell the workers that mapped
    /// them, reply once they answered (or after `EMPTY_CACHE_WAIT`).
    ReleaseArena { reply: Sender<EmptyCache> },
    /// `Parent::empty_cache` rotated pool `pool`: offer its new generation `handle` to every
    /// live worker (an `ExtraPool` at a free index), reply once they answered.
    OfferPool {
        pool: usize,
        handle: poolipc_driver::PoolHandle,
        reply: Sender<EmptyCache>,
    },
    /// `Parent::empty_cache` found retired generation `handle` unused: every worker that has
    /// it destroys its import (`PoolRetire`), reply once they answered.
    RetirePool {
        handle: poolipc_driver::PoolHandle,
        reply: Sender<EmptyCache>,
    },
    /// The parent is dropped: stop every worker, fail every job, end the thread.
    Shutdown,
    /// Test-only ([`Parent::panic_io_thread`](crate::Parent::panic_io_thread)): the loop
    /// panics, as a bug of its own would.
    Panic,
}

impl Command {
    /// Answers the command with `e` without the loop (which cannot take it).
    pub(crate) fn refuse(self, e: Error) {
        match self {
            Command::Adopt { reply, child, .. } => {
                if let Some(mut c) = child {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                let _ = reply.send(Err(e));
            }
            Command::Submit(sub) => sub.done.complete(Err(e)),
            Command::Stop { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            // Its caller maps the closed channel to the loop's error.
            Command::ReleaseArena { reply }
            | Command::OfferPool { reply, .. }
            | Command::RetirePool { reply, .. } => drop(reply),
            Command::Cancel { .. } | Command::Shutdown | Command::Panic => {}
        }
    }
}

/// An `empty_cache` waiting for workers to unmap the chunks it released.
struct ReleaseWaiter {
    reply: Sender<EmptyCache>,
    report: EmptyCache,
    /// (worker, chunk) answers still awaited.
    awaited: HashSet<(WorkerId, u32)>,
    deadline: Instant,
}

/// The key of a `ReleaseMappings` answer among the awaited (worker, chunk) answers: no chunk
/// has this index (indices count up from 0 and a `u32` runs out long before).
const MAPPINGS_ACK: u32 = u32::MAX;

/// How often the IO thread looks for arena chunks idle long enough to give back.
const IDLE_RELEASE_CHECK: Duration = Duration::from_secs(1);

/// A job as submitted.
pub(crate) struct Submission {
    pub(crate) worker: WorkerId,
    pub(crate) job: JobId,
    pub(crate) inputs: Vec<Input>,
    pub(crate) stream: StreamHandle,
    /// `None`: the shared pool, and a failed job's results are freed by the loop.
    pub(crate) alloc: Option<ResultAllocator>,
    pub(crate) done: Answer,
    /// Set while a placed job waits for its worker's other jobs (a staged job runs alone).
    pub(crate) placed: Option<Placed>,
}

/// Starts the IO thread; returns once it made the device current (or failed to).
pub(crate) fn start(
    shared: Arc<Shared>,
    wake: UnixStream,
) -> Result<std::thread::JoinHandle<()>, Error> {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("poolipc-parent-io".into())
        .spawn(move || {
            // CUDA contexts are per thread: every driver call of the loop needs this one.
            if let Err(e) = shared.driver.use_device(shared.options.device) {
                let _ = tx.send(Err(Error::from(e)));
                return;
            }
            let _ = tx.send(Ok(()));
            let io = Arc::clone(&shared);
            // A panic here is a bug of the loop's; still, nobody may wait for ever on it:
            // unwinding drops the loop's jobs (each `Answer` answers its handle), its reply
            // channels (each caller maps the closed channel to the error) and its workers
            // (killed and reaped), and from now on every command is refused.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                Loop::new(io, wake).run();
            }));
            if let Err(payload) = ran {
                let detail = panic_text(payload.as_ref());
                tracing::error!(%detail, "the parent's IO thread panicked: every waiter gets an error");
                let inbox = {
                    let mut inbox = lock(&shared.inbox);
                    *lock(&shared.io_stopped) = Some(format!("it panicked: {detail}"));
                    std::mem::take(&mut *inbox)
                };
                for command in inbox {
                    command.refuse(shared.loop_gone());
                }
            }
        })
        .map_err(|source| Error::Os {
            call: "pthread_create",
            source,
        })?;
    match rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => {
            let _ = handle.join();
            Err(Error::Protocol(
                "the parent's IO thread ended at its start".into(),
            ))
        }
    }
}

/// A panic's message, where it carries one.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// A worker as the loop holds it.
struct Slot {
    conn: Connection,
    child: Option<Child>,
    /// READY events not in use by a job (a job takes one and gives it back when it ends: a
    /// worker's wait captures an event's latest record, so two jobs in flight never share one).
    ready_free: Vec<(OwnedEvent, EventBlob)>,
    /// The worker's DONE events, opened once each, at most
    /// `options.max_open_done_events` (least recently used closed first).
    done_events: DoneEvents,
    staging: Option<StagingChannel>,
    /// Frames that arrived while the loop waited for another (host staging's): handled next.
    backlog: VecDeque<Message>,
    takes_staging: bool,
    /// Whether it maps the parent's arena (results in the arena, inputs copied into it): an
    /// arena is enabled ([`ResultMemory::Arena`] or [`ParentOptions::arena_copy`]), it
    /// announced VMM, reaches the parent's device, and every chunk announced so far went
    /// out.
    ///
    /// [`ParentOptions::arena_copy`]: crate::ParentOptions::arena_copy
    maps_arena: bool,
    /// One past the highest arena chunk index sent to it: every chunk below was sent (or
    /// released before it could be).
    arena_chunks_sent: u32,
    /// Whether it takes VMM allocations by handle ([`Rung::VmmHandle`]): it announced
    /// [`Capabilities::VMM_HANDLE`] and reaches the parent's device.
    takes_vmm: bool,
    /// Set when the worker is being stopped: when to kill it if it has not exited.
    exit_deadline: Option<Instant>,
    stop_replies: Vec<Sender<Result<Option<ExitStatus>, Error>>>,
    /// Jobs waiting for this worker (staged jobs run alone on their worker).
    queued: VecDeque<Box<Submission>>,
    /// Jobs sent to it and not finished.
    in_flight: usize,
    /// Whether one of the jobs in flight takes host staging.
    staged_in_flight: bool,
    /// Why it was lost, for the jobs that fail with it.
    lost: Option<String>,
}

/// A job as the loop holds it, from its Lend to its JobFinished.
struct JobState {
    stream: StreamHandle,
    alloc: Option<ResultAllocator>,
    done: Answer,
    ready: Option<(OwnedEvent, EventBlob)>,
    input_rungs: Vec<Rung>,
    input_reasons: Vec<Option<String>>,
    /// Arena-copy inputs: their blocks, copied back into the caller's tensors (unless lent
    /// read-only) and given back (stream-ordered, on the job's stream) at the input's
    /// release, which comes once the host saw the worker's DONE complete or once the worker
    /// was reaped.
    arena_inputs: HashMap<HandoffId, ArenaInput>,
    /// The first copy-back that failed, for the job's error: a write of the worker's that
    /// could not reach the caller's tensor is never dropped silently.
    copy_back_error: Option<String>,
    staged: bool,
    /// Staged inputs: where their bytes are.
    staged_inputs: HashMap<HandoffId, (DevicePtr, u64)>,
    /// Results, by the contract's request id (increasing: the worker's order).
    results: BTreeMap<RequestId, ResultTensor>,
    requests_by_alloc: HashMap<AllocId, RequestId>,
    requests_by_handoff: HashMap<HandoffId, RequestId>,
    /// Result memory that will not be handed out: freed (default allocator) or returned.
    orphans: Vec<DevicePtr>,
    /// Input allocations lent by pointer: their entries in `Loop::lent` are dropped at release.
    lent_bases: Vec<u64>,
    /// The first result request the parent refused, for the job's error.
    refused: Option<crate::ResultRefusal>,
    /// The job's arena slice: given back whole when dropped, or split at its release into
    /// the carved results and the rest.
    slice: Option<ArenaLease>,
    /// Results carved out of the slice, by their place among the job's results.
    carved: BTreeMap<u32, ResultTensor>,
    /// Why the slice could not be split into its carves, for the job's error.
    slice_error: Option<String>,
    /// The worker's DONE could not be asked about (its event would not open, say):
    /// nothing orders the caller after the worker's writes, so the job fails whatever the
    /// contract concludes, and its results are not handed out.
    done_failed: Option<String>,
    /// Why the job fails when `done_failed` is set (a protocol violation unless a bound was
    /// passed).
    failed_as: Option<FailReason>,
}

impl JobState {
    /// A result that will not be handed out: an arena block goes back to the arena now
    /// (stream-ordered on the job's stream, by dropping it); other memory waits in `orphans`
    /// to be freed or returned.
    fn discard(&mut self, r: ResultTensor) {
        if !r.is_arena() {
            self.orphans.push(r.ptr);
        }
    }
}

/// A job whose worker acknowledged it while its DONE had not completed on the GPU yet: the
/// loop never makes a stream of its own wait on a worker's event (a worker that hangs on the
/// GPU, or means to, would block that stream for good, beyond its death:
/// docs/facts.md). It queries the DONE on the host until it completed and holds the
/// contract's later actions for the job (its releases, its JobFinished) until then. At the
/// deadline the worker is condemned and the job fails; its memory is then released as a lost
/// worker's, once the process is reaped.
struct DoneGate {
    /// The worker's DONE events still to complete (owned by its slot's `done_events`, or,
    /// once the worker is reaped, by `Loop::dead_events`).
    events: Vec<EventHandle>,
    /// The contract's actions for the job after the first incomplete DONE, in order.
    held: VecDeque<ParentAction>,
    deadline: Instant,
    /// Set at the deadline: the job's error.
    expired: Option<String>,
    /// When the job was first held.
    since: Instant,
    /// Set when the worker was reaped (why) before its DONE completed. A record the worker
    /// queued before it died may still complete as the driver tears its context down: the
    /// job waits for it until [`REAP_GRACE`] after the reaping, then fails.
    lost: Option<String>,
}

/// How long a job whose worker was reaped with its DONE not complete yet still waits for it.
const REAP_GRACE: Duration = Duration::from_secs(1);

struct Loop {
    shared: Arc<Shared>,
    wake: UnixStream,
    machine: contract::Parent,
    workers: BTreeMap<WorkerId, Slot>,
    jobs: HashMap<(WorkerId, JobId), JobState>,
    /// Input allocations currently lent by pointer: base address to (id, loans).
    lent: HashMap<u64, (AllocId, u32)>,
    /// VMM allocations lent by handle, by base address: their id and the workers that
    /// mapped them ([`Rung::VmmHandle`]).
    vmm_shared: HashMap<u64, VmmShared>,
    /// Exit statuses of workers being reaped, for the errors of their jobs.
    reaped: HashMap<WorkerId, String>,
    next_alloc: u64,
    epoch: Instant,
    shutting_down: bool,
    /// The last worker that failed or reported an error, and what it said: named when the
    /// process's context turns out lost (under MPS, a worker's GPU fault ends it).
    suspect: Option<(WorkerId, String)>,
    /// When a job last finished, a command last came or a worker last sent a frame: the
    /// loop keeps spinning for `options.spin` after it (`options.spin_in_flight` while jobs
    /// are in flight), so that the next frame or submit finds it awake.
    last_activity: Instant,
    /// `ArenaReleased` answers awaited, by (worker, chunk).
    release_acks: HashSet<(WorkerId, u32)>,
    release_waiters: Vec<ReleaseWaiter>,
    /// When the loop last looked for idle arena chunks.
    last_idle_check: Instant,
    /// Jobs acknowledged whose DONE has not completed on the GPU yet.
    gates: BTreeMap<(WorkerId, JobId), DoneGate>,
    /// Reaped workers' opened DONE events, kept while a job of theirs waits on one.
    dead_events: HashMap<WorkerId, DoneEvents>,
}

impl Drop for Loop {
    /// Workers are left only when the loop unwinds from a panic: nothing can serve them any
    /// more, so they are killed and reaped (their jobs' handles are answered as the jobs drop),
    /// and the parent refuses every later command.
    fn drop(&mut self) {
        if std::thread::panicking() {
            // Before the jobs' `Answer`s drop (this runs before the fields do): a caller
            // woken by one finds every later call refused. The thread's catch names the panic.
            let _inbox = lock(&self.shared.inbox);
            lock(&self.shared.io_stopped)
                .get_or_insert_with(|| "it panicked (the log has the panic's message)".into());
        }
        for (id, slot) in &mut self.workers {
            if let Some(c) = slot.child.as_mut() {
                tracing::warn!(worker = %id, "the IO loop is gone: killing the worker");
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Under MPS, how long a failed job's context check keeps asking whether the failure ended
/// this process's context too (the server marks the other clients shortly after the fault).
const MPS_FAULT_GRACE: Duration = Duration::from_millis(250);

/// Whether a worker's error text names a GPU fault (a sticky CUDA error).
fn names_gpu_fault(message: &str) -> bool {
    [
        "ILLEGAL_ADDRESS",
        "ILLEGAL_INSTRUCTION",
        "MISALIGNED_ADDRESS",
        "INVALID_ADDRESS_SPACE",
        "INVALID_PC",
        "LAUNCH_FAILED",
        "HARDWARE_STACK_ERROR",
        "ECC_UNCORRECTABLE",
        "MPS_CLIENT_TERMINATED",
        "illegal memory access",
    ]
    .iter()
    .any(|needle| message.contains(needle))
}

/// Frames the loop takes from one worker before it looks at the others again.
const FRAMES_PER_TURN: usize = 64;
/// How long the loop sleeps when nothing is due: commands and frames wake it earlier.
const IDLE_POLL: Duration = Duration::from_millis(500);
/// While a worker is exiting, how often to look whether it has.
const EXIT_POLL: Duration = Duration::from_millis(2);
/// While a job's DONE is queried on the host and the loop does not spin, how often to ask at
/// least and at most.
const GATE_POLL: Duration = Duration::from_millis(1);
const GATE_POLL_MIN: Duration = Duration::from_micros(20);

impl Loop {
    fn new(shared: Arc<Shared>, wake: UnixStream) -> Loop {
        let limit = shared.options.limit;
        let machine = contract::Parent::new(contract::ParentConfig {
            limit,
            handoff_timeout: shared.options.handoff_timeout,
            max_results_per_job: shared.options.max_results_per_job,
            max_result_bytes_per_job: shared.options.max_result_bytes_per_job,
            max_result_bytes_per_worker: shared.options.max_result_bytes_per_worker,
            max_job_lifetime: shared.options.max_job_lifetime,
        });
        Loop {
            shared,
            wake,
            machine,
            workers: BTreeMap::new(),
            jobs: HashMap::new(),
            lent: HashMap::new(),
            vmm_shared: HashMap::new(),
            reaped: HashMap::new(),
            next_alloc: 1,
            epoch: Instant::now(),
            shutting_down: false,
            suspect: None,
            last_activity: Instant::now(),
            release_acks: HashSet::new(),
            release_waiters: Vec::new(),
            last_idle_check: Instant::now(),
            gates: BTreeMap::new(),
            dead_events: HashMap::new(),
        }
    }

    fn now(&self) -> Timestamp {
        Timestamp(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    fn run(mut self) {
        loop {
            for command in self.shared.take_commands() {
                self.command(command);
            }
            self.drain_backlogs();
            self.check_exits();
            self.drive();
            self.release_idle_arena();
            self.answer_release_waiters();
            if self.shutting_down && self.workers.is_empty() && self.gates.is_empty() {
                break;
            }
            self.wait_for_io();
            self.machine.handle_timeout(self.now());
            self.drive();
            self.check_gates();
        }
        self.fail_leftover_jobs();
    }

    /// Sleeps in `poll` until a worker's socket is readable, a command arrives, or the next
    /// deadline; reads one frame from each readable socket.
    fn wait_for_io(&mut self) {
        let mut timeout = IDLE_POLL;
        if let Some(t) = self.machine.poll_timeout() {
            let now = self.now();
            timeout = timeout.min(Duration::from_nanos(t.0.saturating_sub(now.0)));
        }
        if self.workers.values().any(|s| s.exit_deadline.is_some()) {
            timeout = timeout.min(EXIT_POLL);
        }
        if !self.release_waiters.is_empty() {
            timeout = timeout.min(EXIT_POLL);
        }
        let now = Instant::now();
        let frame_timeout = self.shared.options.frame_timeout;
        for s in self.workers.values().filter(|s| s.lost.is_none()) {
            if let Some(t) = s.conn.next_deadline(frame_timeout) {
                timeout = timeout.min(t.saturating_duration_since(now));
            }
        }
        for gate in self.gates.values() {
            // A DONE is queried on the host: look again soon (at once while the loop spins),
            // the sooner the younger the job's wait: a quarter of it, from 20 µs to 1 ms, so
            // a short wait costs little latency and a long one few wake-ups.
            let left = gate.deadline.saturating_duration_since(now);
            let next =
                (now.saturating_duration_since(gate.since) / 4).clamp(GATE_POLL_MIN, GATE_POLL);
            timeout = timeout.min(next).min(left);
        }
        let gate_events: Vec<Vec<EventHandle>> =
            self.gates.values().map(|g| g.events.clone()).collect();
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, s)| s.lost.is_none())
            .map(|(id, _)| *id)
            .collect();
        // Frames already read from a socket (behind another frame, or while a staged
        // transfer read the socket) wake no poll: take them first, without sleeping.
        let buffered: Vec<bool> = ids
            .iter()
            .map(|id| {
                self.workers
                    .get(id)
                    .is_some_and(|s| s.conn.frame_buffered())
            })
            .collect();
        let any_buffered = buffered.iter().any(|&b| b);
        let readable: Vec<(WorkerId, bool)> = {
            let mut fds = Vec::with_capacity(ids.len() + 1);
            fds.push(PollFd::new(self.wake.as_fd(), PollFlags::POLLIN));
            for id in &ids {
                if let Some(s) = self.workers.get(id) {
                    // Writability too while frames wait in its send queue.
                    let events = if s.conn.send_queued() {
                        PollFlags::POLLIN | PollFlags::POLLOUT
                    } else {
                        PollFlags::POLLIN
                    };
                    fds.push(PollFd::new(s.conn.as_fd(), events));
                }
            }
            let ms = u16::try_from(timeout.as_millis().max(1)).unwrap_or(u16::MAX);
            // While jobs are in flight a frame is due soon (≈ 330 µs without MPS, ≈ 50 µs
            // with), and just after one finished the caller's next submit often is: look
            // again without sleeping for up to `options.spin_in_flight` after the last
            // activity (`options.spin` when idle), which saves a wake-up per frame and per
            // submit.
            let options = &self.shared.options;
            let started = Instant::now();
            let busy = !self.jobs.is_empty();
            let window = if busy {
                options.spin_in_flight.max(options.spin)
            } else {
                options.spin
            };
            let spin_until = self
                .last_activity
                .checked_add(window)
                .filter(|&t| t > started);
            let pending = &self.shared.pending;
            let spinning_flag = &self.shared.io_spinning;
            if spin_until.is_some() {
                spinning_flag.store(true, Ordering::SeqCst);
            }
            let driver = &self.shared.driver;
            let polled = loop {
                let spinning = spin_until.is_some_and(|t| Instant::now() < t);
                if !spinning {
                    spinning_flag.store(false, Ordering::SeqCst);
                }
                if spinning
                    && gate_events.iter().any(|evs| {
                        evs.iter()
                            .all(|e| !matches!(driver.event_query(*e), Ok(false)))
                    })
                {
                    // A held job's DONE completed (or its query failed): see to it now.
                    spinning_flag.store(false, Ordering::SeqCst);
                    break Ok(0);
                }
                if pending.load(Ordering::SeqCst) {
                    // A command came (while spinning, without a wake-up byte): take it now.
                    spinning_flag.store(false, Ordering::SeqCst);
                    break Ok(0);
                }
                let polled = if spinning || any_buffered {
                    poll(&mut fds, PollTimeout::from(0u16))
                } else if timeout < Duration::from_millis(1) {
                    // `poll` counts in milliseconds: a held job's next look is sooner.
                    ppoll(&mut fds, Some(TimeSpec::from(timeout)), None)
                } else {
                    poll(&mut fds, PollTimeout::from(ms))
                };
                match polled {
                    Ok(0) if spinning && !any_buffered => std::hint::spin_loop(),
                    other => {
                        spinning_flag.store(false, Ordering::SeqCst);
                        break other;
                    }
                }
            };
            match polled {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => return,
                Err(e) => {
                    tracing::error!(error = %e, "poll failed");
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
            let woke = fds[0].revents().is_some_and(|r| !r.is_empty());
            if woke {
                let mut buf = [0u8; 256];
                while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
            }
            ids.iter()
                .zip(&fds[1..])
                .zip(&buffered)
                .map(|((id, fd), &b)| {
                    let revents = fd.revents().unwrap_or(PollFlags::empty());
                    // Readable, or hung up / in error (the read says which).
                    let readable = !(revents - PollFlags::POLLOUT).is_empty();
                    (*id, b || readable)
                })
                .collect()
        };
        self.flush_sends();
        for (id, ready) in readable {
            if ready {
                self.last_activity = Instant::now();
                self.read_one(id);
            }
        }
        self.check_frame_deadlines();
    }

    /// Reads what a readable worker socket holds, without waiting, and hands each whole frame
    /// to the contract (a worker's DONE and ACK come together), at most
    /// [`FRAMES_PER_TURN`] before the other workers get their turn. A frame not all here
    /// stays in the connection, with its descriptors, until it is (or its deadline passes:
    /// [`Loop::check_frame_deadlines`]).
    fn read_one(&mut self, worker: WorkerId) {
        for _ in 0..FRAMES_PER_TURN {
            let Some(slot) = self.workers.get_mut(&worker) else {
                return;
            };
            if slot.lost.is_some() {
                return;
            }
            match slot.conn.poll_recv() {
                Ok(Some((message, _fds))) => {
                    crate::probe::mark("io.recv");
                    self.received(worker, message);
                }
                Ok(None) => return,
                Err(e) => {
                    self.hung_up(worker, &e);
                    return;
                }
            }
        }
    }

    /// Writes what the socket of each worker with queued frames takes now.
    fn flush_sends(&mut self) {
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, s)| s.lost.is_none() && s.conn.send_queued())
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let Some(slot) = self.workers.get_mut(&id) else {
                continue;
            };
            if let Err(e) = slot.conn.flush() {
                self.hung_up(id, &e);
            }
        }
    }

    /// Condemns each worker whose frame began to arrive, or was queued for it, a frame
    /// timeout ago or more and is not all there.
    fn check_frame_deadlines(&mut self) {
        let now = Instant::now();
        let timeout = self.shared.options.frame_timeout;
        let late: Vec<(WorkerId, TransportError)> = self
            .workers
            .iter_mut()
            .filter(|(_, s)| s.lost.is_none())
            .filter_map(|(id, s)| s.conn.check_deadlines(now, timeout).err().map(|e| (*id, e)))
            .collect();
        for (id, e) in late {
            self.hung_up(id, &e);
        }
    }

    fn received(&mut self, worker: WorkerId, message: Message) {
        let span = tracing::debug_span!("received", %worker);
        let _in_span = span.enter();
        tracing::trace!(kind = ?message.kind(), "received");
        // What empty_cache asked, not the contract's: a chunk unmapped, cached mappings
        // dropped.
        let answered = match message {
            Message::ArenaReleased(r) => Some(r.index),
            Message::MappingsReleased { dropped } => {
                tracing::debug!(worker = %worker, dropped, "cached VMM mappings dropped");
                Some(MAPPINGS_ACK)
            }
            Message::ExtraPoolReply(ref r) => Some(self.pool_offer_answered(worker, r)),
            Message::PoolRetired(r) => Some(self.pool_retire_answered(worker, r.index)),
            _ => None,
        };
        if let Some(key) = answered {
            if !self.release_acks.remove(&(worker, key)) {
                tracing::debug!(worker = %worker, key, "a release answer not asked for");
            }
            return;
        }
        let now = self.now();
        if let Err(e) = self
            .machine
            .handle(ParentEvent::Received { worker, message }, now)
        {
            tracing::warn!(worker = %worker, error = %e, "the contract refused an event");
        }
        crate::probe::mark("io.contract");
        self.drive();
    }

    fn hung_up(&mut self, worker: WorkerId, e: &TransportError) {
        let why = if e.is_peer_gone() {
            format!("the worker closed its connection ({e})")
        } else {
            format!("the worker's connection broke: {e}")
        };
        self.lose(worker, &why);
        self.drive();
    }

    fn drain_backlogs(&mut self) {
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, s)| !s.backlog.is_empty())
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            while let Some(m) = self
                .workers
                .get_mut(&id)
                .and_then(|s| s.backlog.pop_front())
            {
                self.received(id, m);
            }
        }
    }

    fn command(&mut self, command: Command) {
        self.last_activity = Instant::now();
        match command {
            Command::Adopt {
                worker,
                conn,
                child,
                reply,
            } => {
                let r = self.adopt(worker, *conn, child);
                let _ = reply.send(r);
            }
            Command::Submit(sub) => {
                crate::probe::mark("io.cmd");
                self.submit(sub);
            }
            Command::Stop { worker, reply } => self.stop(worker, Some(reply)),
            Command::Cancel { worker, job } => self.cancel(worker, job),
            Command::ReleaseArena { reply } => self.release_arena_now(reply),
            Command::Panic => {
                // The test hook's whole point: stand in for a bug of the loop's.
                #[allow(clippy::panic)] // asked for by `Parent::panic_io_thread`, tests only
                {
                    panic!("Parent::panic_io_thread asked the IO thread to panic");
                }
            }
            Command::OfferPool {
                pool,
                handle,
                reply,
            } => self.offer_pool_now(pool, handle, reply),
            Command::RetirePool { handle, reply } => self.retire_pool_now(handle, reply),
            Command::Shutdown => {
                self.shutting_down = true;
                let ids: Vec<WorkerId> = self.workers.keys().copied().collect();
                for id in ids {
                    self.stop(id, None);
                }
            }
        }
    }

    fn adopt(
        &mut self,
        worker: WorkerId,
        conn: Connection,
        mut child: Option<Child>,
    ) -> Result<(), Error> {
        if self.shutting_down {
            if let Some(c) = child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            return Err(Error::Protocol("the parent is shutting down".into()));
        }
        if let Err(e) = self.machine.add_worker(worker) {
            if let Some(c) = child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            return Err(e.into());
        }
        let registered = self.shared.registered(worker);
        let takes_staging = registered.as_ref().is_some_and(|r| {
            r.info
                .identity
                .capabilities
                .contains(Capabilities::HOST_STAGING)
        });
        let maps_arena = (matches!(self.shared.options.results, ResultMemory::Arena { .. })
            || self.shared.options.arena_copy)
            && registered.as_ref().is_some_and(|r| {
                r.info
                    .identity
                    .capabilities
                    .contains(Capabilities::VMM_ARENA)
                    && r.reaches_first
            });
        let takes_vmm = registered.as_ref().is_some_and(|r| {
            r.info
                .identity
                .capabilities
                .contains(Capabilities::VMM_HANDLE)
                && r.reaches_first
        });
        let mut conn = conn;
        conn.set_queue_limits(self.shared.options.send_queue);
        self.workers.insert(
            worker,
            Slot {
                conn,
                child,
                ready_free: Vec::new(),
                done_events: DoneEvents::default(),
                staging: None,
                backlog: VecDeque::new(),
                takes_staging,
                maps_arena,
                arena_chunks_sent: 0,
                takes_vmm,
                exit_deadline: None,
                stop_replies: Vec::new(),
                queued: VecDeque::new(),
                in_flight: 0,
                staged_in_flight: false,
                lost: None,
            },
        );
        // The arena's chunks so far, before any grant can name one.
        self.announce_chunks(Some(worker));
        Ok(())
    }

    /// The arena, created on this thread (the device is current here) at its first use:
    /// with the [`ResultMemory::Arena`] sizes, or (arena copies only) one chunk of
    /// `first_bytes` and no cap.
    fn ensure_arena(&self, first_bytes: u64) -> Result<Arc<Arena<dyn Driver>>, Error> {
        let mut slot = lock(&self.shared.arena);
        if let Some(a) = slot.as_ref() {
            return Ok(Arc::clone(a));
        }
        let (initial_bytes, max_bytes) = match self.shared.options.results {
            ResultMemory::Arena {
                initial_bytes,
                max_bytes,
            } => (initial_bytes, max_bytes),
            ResultMemory::Pool if self.shared.options.arena_copy => (first_bytes, None),
            ResultMemory::Pool => {
                return Err(Error::Config("the arena is not enabled".into()));
            }
        };
        // No cap given: a fraction of the device (ParentOptions::arena_cap_fraction).
        let max_bytes = match max_bytes {
            Some(m) => Some(m),
            None => {
                let (_, total) = self.shared.driver.mem_get_info()?;
                #[allow(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    clippy::cast_precision_loss
                )]
                let cap = (total as f64 * self.shared.options.arena_cap_fraction) as u64;
                Some(cap)
            }
        };
        let arena = Arc::new(Arena::with_max_bytes(
            Arc::clone(&self.shared.driver),
            self.shared.options.device,
            initial_bytes,
            max_bytes,
        )?);
        tracing::info!(
            device = self.shared.options.device,
            bytes = arena.capacity(),
            ?max_bytes,
            "result arena created"
        );
        *slot = Some(Arc::clone(&arena));
        Ok(arena)
    }

    /// Sends every arena chunk a worker that takes arena results has not been sent yet, in
    /// index order, one `ArenaChunk` (with the chunk's FD) each. A worker a chunk cannot be
    /// sent to takes no more arena results (a failed send loses it, as any send does).
    ///
    /// A worker with a host-staged job in flight is skipped unless it is `target` (whose
    /// result is being allocated: it waits for its grant, not inside a transfer): a frame
    /// with an FD cannot wait in a staging transfer's backlog. It catches up when that job
    /// finishes, and always before a grant names the chunk.
    fn announce_chunks(&mut self, target: Option<WorkerId>) {
        let Some(arena) = lock(&self.shared.arena).clone() else {
            return;
        };
        let chunks: Vec<_> = arena.chunks().collect();
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(id, s)| {
                s.maps_arena
                    && s.lost.is_none()
                    && (!s.staged_in_flight || target == Some(**id))
                    && chunks.iter().any(|c| c.index >= s.arena_chunks_sent)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let Some(slot) = self.workers.get_mut(&id) else {
                continue;
            };
            // Chunk indices only grow (a released one is never listed or used again).
            let from = slot.arena_chunks_sent;
            for c in chunks.iter().filter(|c| c.index >= from) {
                let fd = match arena.export_fd(c.index) {
                    Ok(fd) => fd,
                    Err(e) => {
                        tracing::warn!(worker = %id, chunk = c.index, error = %e, "exporting an arena chunk failed: the worker's results go to the pool");
                        slot.maps_arena = false;
                        break;
                    }
                };
                let message = Message::ArenaChunk(ArenaChunk {
                    index: c.index,
                    len: c.len,
                });
                if let Err(e) = slot.conn.enqueue(&message, &[fd.as_fd()]) {
                    slot.maps_arena = false;
                    self.lose(id, &format!("sending arena chunk {} failed: {e}", c.index));
                    break;
                }
                tracing::debug!(worker = %id, chunk = c.index, len = c.len, "arena chunk sent");
                slot.arena_chunks_sent = c.index + 1;
            }
        }
    }

    /// Gives back arena chunks idle for [`ParentOptions::arena_idle_release`], looking at
    /// most once per [`IDLE_RELEASE_CHECK`].
    ///
    /// [`ParentOptions::arena_idle_release`]: crate::ParentOptions::arena_idle_release
    fn release_idle_arena(&mut self) {
        let Some(idle) = self.shared.options.arena_idle_release else {
            return;
        };
        let now = Instant::now();
        if now.saturating_duration_since(self.last_idle_check) < IDLE_RELEASE_CHECK {
            return;
        }
        self.last_idle_check = now;
        let Some(arena) = lock(&self.shared.arena).clone() else {
            return;
        };
        let released = arena.release_idle(now, idle, 0);
        if !released.is_empty() {
            self.tell_released(&released);
        }
    }

    /// `empty_cache`: every idle chunk now; the reply waits for the workers' answers.
    fn release_arena_now(&mut self, reply: Sender<EmptyCache>) {
        let mut report = EmptyCache::default();
        let released = match lock(&self.shared.arena).clone() {
            Some(arena) => arena.release_idle(Instant::now(), Duration::ZERO, 0),
            None => Vec::new(),
        };
        report.arena_chunks = released.len() as u64;
        report.arena_bytes = released.iter().map(|c| c.len).sum();
        let mut awaited = self.tell_released(&released);
        // Workers drop the VMM mappings they cache (each keeps the memory behind it alive).
        let holders: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(id, s)| {
                s.lost.is_none() && self.vmm_shared.values().any(|e| e.sent_to.contains(id))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in holders {
            self.forget_vmm_shares(id);
            if self.send_awaiting(id, &Message::ReleaseMappings, MAPPINGS_ACK, &mut awaited) {
                report.vmm_workers += 1;
            }
        }
        self.wait_for_answers(reply, report, awaited);
    }

    /// Sends `message` to `worker` and, if the worker is still there after, awaits its
    /// answer under `key` ([`await_answer`](Loop::await_answer)). Returns whether it does.
    fn send_awaiting(
        &mut self,
        worker: WorkerId,
        message: &Message,
        key: u32,
        awaited: &mut HashSet<(WorkerId, u32)>,
    ) -> bool {
        self.send(worker, message);
        self.await_answer(worker, key, awaited)
    }

    /// Records that `worker`'s answer under `key` is awaited (in `awaited`, for one
    /// `empty_cache`, and in the loop's set, which `received` clears). A worker lost meanwhile
    /// never answers and is not waited for: `false`.
    fn await_answer(
        &mut self,
        worker: WorkerId,
        key: u32,
        awaited: &mut HashSet<(WorkerId, u32)>,
    ) -> bool {
        if self.workers.get(&worker).is_none_or(|s| s.lost.is_some()) {
            return false;
        }
        awaited.insert((worker, key));
        self.release_acks.insert((worker, key));
        true
    }

    /// Replies `report` to an `empty_cache` once the `awaited` answers came (or as
    /// [`answer_release_waiters`](Loop::answer_release_waiters) decides otherwise).
    fn wait_for_answers(
        &mut self,
        reply: Sender<EmptyCache>,
        report: EmptyCache,
        awaited: HashSet<(WorkerId, u32)>,
    ) {
        self.release_waiters.push(ReleaseWaiter {
            reply,
            report,
            awaited,
            deadline: Instant::now() + crate::parent::EMPTY_CACHE_WAIT,
        });
        self.answer_release_waiters();
    }

    /// Tells every worker that was sent one of `chunks` to unmap it; returns the answers
    /// now awaited. A worker lost meanwhile never answers and is not waited for.
    fn tell_released(
        &mut self,
        chunks: &[poolipc_pool::arena::ChunkInfo],
    ) -> HashSet<(WorkerId, u32)> {
        let mut awaited = HashSet::new();
        let ids: Vec<WorkerId> = self.workers.keys().copied().collect();
        for id in ids {
            for c in chunks {
                let sent = self
                    .workers
                    .get(&id)
                    .is_some_and(|s| s.lost.is_none() && s.arena_chunks_sent > c.index);
                if !sent {
                    continue;
                }
                let message = Message::ArenaRelease(ArenaRelease { index: c.index });
                self.send_awaiting(id, &message, c.index, &mut awaited);
            }
        }
        awaited
    }

    /// Replies to each `empty_cache` whose workers all answered, or whose wait is over.
    fn answer_release_waiters(&mut self) {
        if self.release_waiters.is_empty() {
            return;
        }
        let now = Instant::now();
        let acks = &self.release_acks;
        let workers = &self.workers;
        let mut keep = Vec::with_capacity(self.release_waiters.len());
        for mut w in std::mem::take(&mut self.release_waiters) {
            // Answered, or the worker is gone (its mapping went with it).
            w.awaited.retain(|k| {
                acks.contains(k) && workers.get(&k.0).is_some_and(|s| s.lost.is_none())
            });
            // A worker in the middle of a job (a custom node running for seconds) reads its
            // socket only after it: it answers then, and what it held comes back then. Not
            // waited for, so that an empty_cache (torch calls it often) never stalls on it.
            let all_busy = w
                .awaited
                .iter()
                .all(|k| workers.get(&k.0).is_some_and(|s| s.in_flight > 0));
            if w.awaited.is_empty() || all_busy || now >= w.deadline {
                let mut missing: Vec<WorkerId> = w.awaited.iter().map(|k| k.0).collect();
                missing.sort_unstable();
                missing.dedup();
                w.report.workers_not_answered = missing.len();
                if !missing.is_empty() {
                    tracing::debug!(
                        ?missing,
                        "workers busy or slow did not answer empty_cache yet: what they hold comes back when they do"
                    );
                }
                let _ = w.reply.send(w.report);
            } else {
                keep.push(w);
            }
        }
        self.release_waiters = keep;
    }

    fn stop(&mut self, worker: WorkerId, reply: Option<Sender<Result<Option<ExitStatus>, Error>>>) {
        let Some(slot) = self.workers.get_mut(&worker) else {
            if let Some(r) = reply {
                let _ = r.send(Err(Error::UnknownWorker(worker)));
            }
            return;
        };
        slot.stop_replies.extend(reply);
        if slot.exit_deadline.is_some() {
            return;
        }
        slot.exit_deadline = Some(Instant::now() + self.shared.options.stop_timeout);
        // Jobs not yet sent fail at once; jobs in flight fail when it is reaped.
        let queued: Vec<Box<Submission>> = slot.queued.drain(..).collect();
        for sub in queued {
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(Error::JobFailed {
                worker,
                reason: FailReason::Stopped,
                detail: "the worker was stopped before the job was sent".into(),
                results: Vec::new(),
            }));
        }
        if let Err(e) = self.machine.stop_worker(worker) {
            tracing::debug!(worker = %worker, error = %e, "stopping a worker the contract has let go");
        }
        self.drive();
    }

    /// A job the caller cancelled: failed at once while still queued; else the contract
    /// sends the worker `Cancel` and fails the job once the worker finished it (nothing of
    /// it is reused before the worker's DONE, or its death).
    fn cancel(&mut self, worker: WorkerId, job: JobId) {
        if let Some(slot) = self.workers.get_mut(&worker)
            && let Some(at) = slot.queued.iter().position(|s| s.job == job)
            && let Some(sub) = slot.queued.remove(at)
        {
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(Error::JobFailed {
                worker,
                reason: FailReason::Cancelled,
                detail: format!("{job} was cancelled before it was sent to {worker}"),
                results: Vec::new(),
            }));
            return;
        }
        if !self.jobs.contains_key(&(worker, job)) {
            return;
        }
        if let Err(e) = self.machine.cancel(worker, job) {
            // Its worker is gone or the job ended meanwhile: it fails or ended on its own.
            tracing::debug!(worker = %worker, job = job.0, error = %e, "cancel after the fact");
        }
        self.drive();
    }

    /// Workers being stopped: reaped once they exit, killed at their deadline.
    fn check_exits(&mut self) {
        let now = Instant::now();
        let due: Vec<(WorkerId, bool)> = self
            .workers
            .iter_mut()
            .filter_map(|(id, s)| {
                let deadline = s.exit_deadline?;
                let exited = match s.child.as_mut() {
                    Some(c) => matches!(c.try_wait(), Ok(Some(_))),
                    // Not ours to reap: its closing the socket is its exit.
                    None => s.lost.is_some(),
                };
                (exited || now >= deadline).then_some((*id, exited))
            })
            .collect();
        for (id, exited) in due {
            if !exited {
                tracing::warn!(worker = %id, "the worker did not exit after Bye in time: killing it");
                Stats::bump(&self.shared.stats.workers_lost);
            }
            self.reap(id, !exited);
        }
    }

    /// Kills (if asked) and waits for the worker, closes everything the loop held of it
    /// (socket, events, staging buffer), then tells the contract, which releases what the
    /// worker held and fails its jobs. The jobs end after the slot is gone, so a caller that
    /// sees its job fail finds nothing of the worker left open.
    fn reap(&mut self, worker: WorkerId, kill: bool) {
        self.release_acks.retain(|k| k.0 != worker);
        let Some(mut slot) = self.workers.remove(&worker) else {
            return;
        };
        let status = match slot.child.as_mut() {
            Some(c) => {
                if kill {
                    let _ = c.kill();
                }
                match c.wait() {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::error!(worker = %worker, error = %e, "waitpid failed");
                        None
                    }
                }
            }
            None => None,
        };
        let text = status.map_or_else(|| "not ours to reap".into(), |s| s.to_string());
        tracing::info!(worker = %worker, status = %text, "worker reaped");
        let why = slot
            .lost
            .clone()
            .unwrap_or_else(|| "the worker was stopped".into());
        let queued: Vec<Box<Submission>> = slot.queued.drain(..).collect();
        let replies: Vec<_> = slot.stop_replies.drain(..).collect();
        let held = self.outlive_worker(worker, &mut slot, &why);
        drop(slot);
        self.forget_vmm_shares(worker);
        self.reaped.insert(worker, text);
        // Reaped, it leaves the registry: `Parent::workers` lists the living only, and a
        // parent whose workers come and go keeps no trace of each.
        lock(&self.shared.registry).remove(&worker);
        let now = self.now();
        // The contract learns that the connection is gone (if it has not yet), then that the
        // process is: only now may what the worker imported be reused.
        if let Err(e) = self.machine.handle(
            ParentEvent::WorkerHungUp {
                worker,
                why: why.clone(),
            },
            now,
        ) {
            tracing::debug!(worker = %worker, error = %e, "hang-up of a worker the contract let go");
        }
        if let Err(e) = self
            .machine
            .handle(ParentEvent::WorkerReaped { worker }, now)
        {
            tracing::warn!(worker = %worker, error = %e, "the contract refused a reaping");
        }
        self.drive();
        for (key, gate) in held {
            self.fail_gate(key, gate, &why);
        }
        self.forget_dead_events();
        for q in queued {
            Stats::bump(&self.shared.stats.jobs_failed);
            q.done.complete(Err(Error::JobFailed {
                worker,
                reason: FailReason::HungUp,
                detail: format!("the worker was lost before the job was sent ({why})"),
                results: Vec::new(),
            }));
        }
        // Jobs the contract has not finished (it finishes them after an allocation answer it
        // still waits for, which this loop gives at once) fail here rather than hang.
        // (Jobs held for their DONE are not: they end with it, or at their grace's end.)
        let orphaned: Vec<JobId> = self
            .jobs
            .keys()
            .filter(|k| k.0 == worker && !self.gates.contains_key(k))
            .map(|(_, j)| *j)
            .collect();
        for job in orphaned {
            tracing::error!(worker = %worker, job = job.0, "a job outlived its worker's reaping");
            self.finish(
                worker,
                job,
                JobOutcome::Failed {
                    reason: FailReason::HungUp,
                    detail: why.clone(),
                },
            );
        }
        self.reaped.remove(&worker);
        for r in replies {
            let _ = r.send(Ok(status));
        }
    }

    /// A submitted job: placed and lent now, or queued behind the worker's jobs in flight.
    fn submit(&mut self, sub: Box<Submission>) {
        let worker = sub.worker;
        if let Err(e) = self.shared.check_context() {
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(e));
            return;
        }
        let Some(slot) = self.workers.get_mut(&worker) else {
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(Error::UnknownWorker(worker)));
            return;
        };
        if slot.exit_deadline.is_some() || slot.lost.is_some() {
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(Error::UnknownWorker(worker)));
            return;
        }
        slot.queued.push_back(sub);
        self.dispatch(worker);
    }

    /// Sends the worker's queued jobs that may go now. Host staging shares the worker's socket
    /// with its frames, so a job that stages runs alone on its worker.
    fn dispatch(&mut self, worker: WorkerId) {
        loop {
            let Some(slot) = self.workers.get_mut(&worker) else {
                return;
            };
            if slot.staged_in_flight || slot.lost.is_some() || slot.exit_deadline.is_some() {
                return;
            }
            let Some(mut sub) = slot.queued.pop_front() else {
                return;
            };
            let placement = match sub.placed.take() {
                Some(placed) => Ok(placed),
                None => self.place(&sub),
            };
            crate::probe::mark("io.placed");
            match placement {
                Ok(placed) => {
                    let slot = match self.workers.get_mut(&worker) {
                        Some(s) => s,
                        None => return,
                    };
                    if placed.staged && slot.in_flight > 0 {
                        // Wait until the worker's other jobs are done, keeping the placement
                        // (its exports are made).
                        sub.placed = Some(placed);
                        slot.queued.push_front(sub);
                        return;
                    }
                    self.lend(*sub, placed);
                }
                Err(e) => {
                    // Nothing was sent: the worker's session is untouched.
                    tracing::warn!(worker = %worker, job = sub.job.0, error = %e, "job refused");
                    Stats::bump(&self.shared.stats.jobs_failed);
                    if self.escalate("placing a job's inputs", &e) {
                        sub.done.complete(Err(self.context_error()));
                        self.drive();
                        return;
                    }
                    sub.done.complete(Err(e));
                }
            }
        }
    }

    /// Chooses each input's rung and exports what goes by pointer. Fails (sending nothing)
    /// on a tensor that cannot be lent.
    fn place(&mut self, sub: &Submission) -> Result<Placed, Error> {
        let pointer_pools = self
            .shared
            .pointer_pools(sub.worker)
            .ok_or(Error::UnknownWorker(sub.worker))?;
        let takes_staging = self
            .workers
            .get(&sub.worker)
            .is_some_and(|s| s.takes_staging);
        let limit = self.shared.limit();
        let driver = Arc::clone(&self.shared.driver);
        let mut placed = Placed::default();
        for (i, input) in sub.inputs.iter().enumerate() {
            let extent = input
                .desc
                .extent_bytes()
                .map_err(|e| Error::InvalidTensor(format!("input {i}: {e}")))?;
            // One query for the range, the pool and the buffer id (each costs microseconds
            // under MPS).
            let info = driver.pointer_info(input.ptr).map_err(|e| {
                Error::InvalidTensor(format!(
                    "input {i} at {:?} is not device memory this process can see: {e}",
                    input.ptr
                ))
            })?;
            let (base, size) = (info.base, info.size);
            let offset = input.ptr.0 - base.0;
            if offset.saturating_add(extent) > size {
                return Err(Error::InvalidTensor(format!(
                    "input {i} at {:?} runs {} bytes past its allocation",
                    input.ptr,
                    offset + extent - size
                )));
            }
            let pool = info.pool.and_then(|h| self.shared.pool_of(h));
            // The worker's index of the pointer's pool (generation), if it takes pointers of it.
            let wire = info.pool.and_then(|h| {
                pointer_pools
                    .iter()
                    .find(|(ph, _)| *ph == h)
                    .map(|(_, i)| *i)
            });
            let by_pointer = wire.is_some() && limit.allows(base.0, size);
            if let (true, Some(p), Some(wire)) = (by_pointer, pool, wire) {
                let export = self.shared.pools[p].export_known(base, size, info.buffer_id)?;
                let alloc = match self.lent.get(&base.0) {
                    Some((a, _)) => *a,
                    None => {
                        let a = AllocId(self.next_alloc);
                        self.next_alloc += 1;
                        a
                    }
                };
                placed.loans.push(InputLoan {
                    alloc,
                    span: Span {
                        ptr: base.0,
                        bytes: size,
                    },
                    rung: Rung::PoolPointer,
                    pool: wire,
                    export,
                    meta: input.desc.meta(offset, extent),
                    arena: None,
                    read_only: input.read_only,
                });
                placed.rungs.push(Rung::PoolPointer);
                placed.reasons.push(None);
                placed.copies.push(None);
                continue;
            }
            let mut why_not = why_not_pointer(
                &self.shared,
                sub.worker,
                pool.zip(info.pool),
                limit.check(base.0, size).err(),
            );
            // Memory of no pool of ours on the parent's device may be a VMM allocation whose
            // handle can be lent: no copy.
            if pool.is_none() && info.device == Some(self.shared.options.device) {
                match self.vmm_handle(sub, base, size, info.buffer_id) {
                    Ok((alloc, how)) => {
                        let reason = format!("input {i}: {why_not}: vmm handle ({how})");
                        tracing::debug!(worker = %sub.worker, job = sub.job.0, input = i, bytes = extent, "{reason}");
                        placed.loans.push(InputLoan {
                            alloc,
                            span: Span {
                                ptr: base.0,
                                bytes: size,
                            },
                            rung: Rung::VmmHandle,
                            pool: 0,
                            export: ExportBlob([0; 64]),
                            meta: input.desc.meta(offset, extent),
                            arena: None,
                            read_only: input.read_only,
                        });
                        placed.rungs.push(Rung::VmmHandle);
                        placed.reasons.push(Some(reason));
                        placed.copies.push(None);
                        continue;
                    }
                    Err(NoCopy::Failed(e)) => return Err(e),
                    Err(NoCopy::Declined(why)) => {
                        why_not = format!("{why_not}, and no VMM handle to lend ({why})");
                    }
                }
            }
            let no_copy = match self.arena_copy(sub, pool, info.device, input.ptr, extent) {
                Ok(copy) => {
                    let reason = format!("input {i}: {why_not}: arena copy ({})", copy.why);
                    tracing::debug!(worker = %sub.worker, job = sub.job.0, input = i, bytes = extent, "{reason}");
                    let alloc = AllocId(self.next_alloc);
                    self.next_alloc += 1;
                    placed.loans.push(InputLoan {
                        alloc,
                        span: copy.span,
                        rung: Rung::ArenaCopy,
                        pool: 0,
                        export: ExportBlob([0; 64]),
                        meta: input.desc.meta(0, extent),
                        arena: Some(copy.location),
                        read_only: input.read_only,
                    });
                    placed.rungs.push(Rung::ArenaCopy);
                    placed.reasons.push(Some(reason));
                    placed.copies.push(Some(copy.lease));
                    continue;
                }
                Err(NoCopy::Failed(e)) => return Err(e),
                Err(NoCopy::Declined(why)) => why,
            };
            if !takes_staging {
                return Err(Error::NoRung(format!(
                    "input {i} cannot go by pool pointer ({why_not}), no arena copy ({no_copy}), \
                     and {} has no host staging",
                    sub.worker
                )));
            }
            let reason = format!("input {i}: {why_not}: host staging: {no_copy}");
            tracing::debug!(worker = %sub.worker, job = sub.job.0, input = i, bytes = extent, "{reason}");
            let alloc = AllocId(self.next_alloc);
            self.next_alloc += 1;
            placed.loans.push(InputLoan {
                alloc,
                span: Span {
                    ptr: input.ptr.0,
                    bytes: extent,
                },
                rung: Rung::HostStaging,
                pool: 0,
                export: ExportBlob([0; 64]),
                meta: input.desc.meta(0, extent),
                arena: None,
                read_only: input.read_only,
            });
            placed.rungs.push(Rung::HostStaging);
            placed.reasons.push(Some(reason));
            placed.copies.push(None);
            placed.staged = true;
        }
        Ok(placed)
    }

    /// Lends the VMM allocation `[base, base + size)` by handle to the job's worker, when
    /// the rung may carry it: the option is on, the worker takes VMM handles, the driver
    /// gives the allocation a buffer id (how a later lend knows it is the same allocation,
    /// not a new one at the same address), and the allocation is a VMM mapping made with the
    /// POSIX FD handle type. A worker that mapped this allocation already (same address,
    /// size and buffer id) gets nothing: no driver call, no frame. Otherwise the handle is
    /// retained (`cuMemRetainAllocationHandle`), exported as an FD, released again, and the
    /// FD sent in a `VmmShare` frame ahead of the job's `Lend`. Returns the allocation's id
    /// and how, or why not (the input then takes the arena copy); a lost send fails the job.
    fn vmm_handle(
        &mut self,
        sub: &Submission,
        base: DevicePtr,
        size: u64,
        buffer_id: Option<u64>,
    ) -> Result<(AllocId, String), NoCopy> {
        if !self.shared.options.vmm_handles {
            return Err(NoCopy::Declined(
                "lending by VMM handle is off (ParentOptions::vmm_handles)".into(),
            ));
        }
        if !self.workers.get(&sub.worker).is_some_and(|s| s.takes_vmm) {
            return Err(NoCopy::Declined(format!(
                "{} takes no VMM handles (no VMM by POSIX FD, or not on the parent's device)",
                sub.worker
            )));
        }
        let Some(buffer_id) = buffer_id else {
            return Err(NoCopy::Declined(
                "the driver gives it no buffer id, so a worker's mapping could not be told \
                 from a new allocation at its address"
                    .into(),
            ));
        };
        let same = |e: &VmmShared| e.size == size && e.buffer_id == buffer_id;
        if let Some(e) = self.vmm_shared.get(&base.0)
            && same(e)
            && e.sent_to.contains(&sub.worker)
        {
            return Ok((e.alloc, "mapped by the worker already".into()));
        }
        let fd = self.export_vmm(base)?;
        let alloc = match self.vmm_shared.get(&base.0) {
            Some(e) if same(e) => e.alloc,
            _ => {
                // A new allocation at this address (or the first): a new id, so that no
                // worker's mapping of the old one is taken for it.
                let alloc = AllocId(self.next_alloc);
                self.next_alloc += 1;
                self.vmm_shared.insert(
                    base.0,
                    VmmShared {
                        alloc,
                        size,
                        buffer_id,
                        sent_to: HashSet::new(),
                    },
                );
                alloc
            }
        };
        let Some(slot) = self.workers.get_mut(&sub.worker) else {
            return Err(NoCopy::Failed(Error::UnknownWorker(sub.worker)));
        };
        let message = Message::VmmShare(VmmShare {
            alloc,
            base: base.0,
            len: size,
        });
        if let Err(e) = slot.conn.enqueue(&message, &[fd.as_fd()]) {
            let why = format!("sending a VMM handle failed: {e}");
            self.lose(sub.worker, &why);
            return Err(NoCopy::Failed(Error::JobFailed {
                worker: sub.worker,
                reason: FailReason::HungUp,
                detail: why,
                results: Vec::new(),
            }));
        }
        Stats::bump(&self.shared.stats.vmm_handles_shared);
        if let Some(e) = self.vmm_shared.get_mut(&base.0) {
            e.sent_to.insert(sub.worker);
        }
        tracing::debug!(worker = %sub.worker, ?alloc, size, "VMM handle sent");
        Ok((alloc, "handle sent".into()))
    }

    /// The POSIX FD of the VMM allocation mapped at `base`: its handle retained, checked for
    /// the POSIX FD handle type, exported, and released again (the FD and the worker's import
    /// keep what they need). Memory that is no VMM mapping, or one made without that handle
    /// type, is declined with the reason; a lost context fails the job.
    fn export_vmm(&self, base: DevicePtr) -> Result<OwnedFd, NoCopy> {
        let d = &*self.shared.driver;
        let declined = |what: &str, e: poolipc_driver::DriverError| {
            if e.is_context_lost() {
                NoCopy::Failed(e.into())
            } else {
                NoCopy::Declined(format!("{what}: {e}"))
            }
        };
        // The retained reference only serves the export: released when dropped below.
        let retained = poolipc_driver::VmmAllocation::retain(d, base)
            .map_err(|e| declined("not a VMM allocation", e))?;
        let handle = retained.handle();
        let fd = match d.vmm_exports_fd(handle) {
            Ok(true) => d
                .vmm_export_fd(handle)
                .map_err(|e| declined("its handle could not be exported", e)),
            Ok(false) => Err(NoCopy::Declined(
                "a VMM allocation made without the POSIX FD handle type, which cannot be shared"
                    .into(),
            )),
            Err(e) => Err(declined("its handle's properties could not be read", e)),
        };
        if let Err(e) = retained.close() {
            tracing::warn!(error = %e, "releasing a retained VMM handle failed");
        }
        fd
    }

    /// Forgets which VMM allocations `worker` mapped: it was reaped, or it was told to drop
    /// its cached mappings (`Worker::release_cached_mappings`). An allocation lent to it
    /// again is sent again first. Whoever sends the worker that order calls this at the
    /// same time.
    pub(crate) fn forget_vmm_shares(&mut self, worker: WorkerId) {
        self.vmm_shared.retain(|_, e| {
            e.sent_to.remove(&worker);
            !e.sent_to.is_empty()
        });
    }

    /// Copies an input (`bytes` from element 0 at `src`) into a block of the arena, queued on
    /// the job's stream now, before the job's READY is recorded, when the arena-copy rung may
    /// carry it: the option is on, the memory is device memory of the parent's device (its
    /// shared pool's, or any other kind the pointer's attributes place there: `cuMemAlloc`,
    /// another pool, a VMM mapping), the worker maps the arena, the arena has room (or VRAM is free for
    /// more, with the margin to spare) and the chunk reached the worker. Otherwise says why
    /// not, and the input takes host staging; a driver call that fails on the way fails the
    /// job.
    fn arena_copy(
        &mut self,
        sub: &Submission,
        pool: Option<usize>,
        device: Option<u32>,
        src: DevicePtr,
        bytes: u64,
    ) -> Result<ArenaCopy, NoCopy> {
        let options = &self.shared.options;
        if !self.shared.arena_copy_on.load(Ordering::Relaxed) {
            return Err(NoCopy::Declined(
                "arena copy is off (ParentOptions::arena_copy)".into(),
            ));
        }
        if bytes == 0 {
            return Err(NoCopy::Declined("an empty tensor needs no copy".into()));
        }
        // Pool 0 is the parent's device's; another of the parent's pools is another device's.
        // Memory of no pool of ours is copied when its attributes place it on the parent's
        // device: the copy is then device-to-device on one GPU.
        let on_parent_device = match pool {
            Some(p) => p == 0,
            None => device == Some(options.device),
        };
        if !on_parent_device {
            let found = match (pool, device) {
                (Some(p), _) => format!("memory of the parent's pool {p}"),
                (None, Some(d)) => format!("device memory of device {d}"),
                (None, None) => "not device memory (host or managed memory)".to_owned(),
            };
            return Err(NoCopy::Declined(format!(
                "only device memory of the parent's device {} is copied into the arena, this \
                 is {found}",
                options.device
            )));
        }
        if !self.workers.get(&sub.worker).is_some_and(|s| s.maps_arena) {
            return Err(NoCopy::Declined(format!(
                "{} does not map the arena (no VMM by POSIX FD, or not on the parent's device)",
                sub.worker
            )));
        }
        let room = lock(&self.shared.arena).clone().is_some_and(|a| {
            // Blocks given back whose work completed count as free.
            a.reclaim();
            a.stats().largest_free >= bytes
        });
        let why = if room {
            "room in the arena".to_owned()
        } else {
            let (free, _) = self
                .shared
                .driver
                .mem_get_info()
                .map_err(|e| NoCopy::Failed(e.into()))?;
            let margin = options.arena_copy_vram_margin;
            if free < bytes.saturating_add(margin) {
                return Err(NoCopy::Declined(format!(
                    "only {} of VRAM free, the copy needs {} and {} to spare",
                    human_bytes(free),
                    human_bytes(bytes),
                    human_bytes(margin)
                )));
            }
            format!("VRAM free {}", human_bytes(free))
        };
        let arena = self
            .ensure_arena(bytes)
            .map_err(|e| NoCopy::Declined(format!("the arena could not be made: {e}")))?;
        let block = arena
            .alloc(bytes)
            .map_err(|e| NoCopy::Declined(format!("no arena block for it: {e}")))?;
        // Owned from here: dropped on any path below, the block goes back stream-ordered.
        let lease = ArenaLease::new(Arc::clone(&arena), block, sub.stream);
        self.announce_chunks(Some(sub.worker));
        let sent = self
            .workers
            .get(&sub.worker)
            .is_some_and(|s| s.maps_arena && s.arena_chunks_sent > block.chunk);
        if !sent {
            return Err(NoCopy::Declined(format!(
                "arena chunk {} could not be sent to {}",
                block.chunk, sub.worker
            )));
        }
        self.shared
            .driver
            .memcpy_dtod_async(block.ptr, src, bytes, sub.stream)
            .map_err(|e| NoCopy::Failed(e.into()))?;
        tracing::trace!(worker = %sub.worker, job = sub.job.0, ?block, bytes, "input copied into the arena");
        Ok(ArenaCopy {
            lease,
            location: ArenaLocation {
                chunk: block.chunk,
                offset: block.offset,
            },
            span: Span {
                ptr: block.ptr.0,
                bytes: block.len,
            },
            why,
        })
    }

    /// Starts a placed job in the contract and carries out what it asks.
    fn lend(&mut self, sub: Submission, placed: Placed) {
        let worker = sub.worker;
        let job = sub.job;
        if placed.staged
            && let Err(e) = self.ensure_staging(worker)
        {
            let detail = format!("setting host staging up failed: {e}");
            let reason = if backlog_full(&e) {
                let bound = contract::Bound::StagingBacklog;
                tracing::warn!(worker = %worker, job = job.0, %bound, "{detail}");
                if let Err(c) = self.machine.condemn_for(worker, bound, detail.clone()) {
                    tracing::debug!(worker = %worker, error = %c, "condemning a worker the contract has let go");
                }
                FailReason::BoundExceeded(bound)
            } else {
                self.lose(worker, &detail);
                FailReason::HungUp
            };
            // The kill and the reaping first: a caller that sees its job fail finds nothing
            // of the worker left.
            self.drive();
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(Error::JobFailed {
                worker,
                reason,
                detail,
                results: Vec::new(),
            }));
            return;
        }
        let ready = match self.take_ready(worker) {
            Ok(r) => r,
            Err(e) => {
                Stats::bump(&self.shared.stats.jobs_failed);
                let lost = self.escalate("making a READY event", &e);
                sub.done
                    .complete(Err(if lost { self.context_error() } else { e }));
                if lost {
                    self.drive();
                }
                return;
            }
        };
        crate::probe::mark("io.ready_taken");
        let slice = self.make_slice(&sub);
        let now = self.now();
        let started = self.machine.start_job_with_slice(
            worker,
            job,
            ready.1,
            placed.loans.clone(),
            slice.as_ref().map(|(loan, _)| *loan),
            now,
        );
        let handoffs = match started {
            Ok((h, _)) => h,
            Err(e) => {
                self.give_ready(worker, ready);
                Stats::bump(&self.shared.stats.jobs_failed);
                sub.done.complete(Err(e.into()));
                return;
            }
        };
        crate::probe::mark("io.started");
        let mut staged_inputs = HashMap::new();
        let mut lent_bases = Vec::new();
        let mut arena_inputs = HashMap::new();
        let Placed {
            loans,
            rungs,
            reasons,
            copies,
            staged,
        } = placed;
        for (((h, loan), input), copy) in handoffs.iter().zip(&loans).zip(&sub.inputs).zip(copies) {
            match loan.rung {
                Rung::HostStaging => {
                    staged_inputs.insert(*h, (input.ptr, loan.span.bytes));
                    Stats::bump(&self.shared.stats.host_staged_tensors);
                }
                Rung::ArenaCopy => {
                    if let Some(lease) = copy {
                        arena_inputs.insert(
                            *h,
                            ArenaInput {
                                lease,
                                block: DevicePtr(loan.span.ptr),
                                src: input.ptr,
                                bytes: loan.meta.byte_len,
                                read_only: loan.read_only,
                            },
                        );
                    }
                    Stats::bump(&self.shared.stats.arena_copied_inputs);
                }
                Rung::VmmHandle => {
                    // The caller's memory, mapped by the worker: nothing to give back.
                    Stats::bump(&self.shared.stats.vmm_handle_tensors);
                }
                Rung::PoolPointer => {
                    self.lent.entry(loan.span.ptr).or_insert((loan.alloc, 0)).1 += 1;
                    lent_bases.push(loan.span.ptr);
                    Stats::bump(&self.shared.stats.pool_pointer_tensors);
                }
                // Results only: the contract refuses it for an input before this point.
                Rung::Arena => {}
            }
        }
        if let Some(s) = self.workers.get_mut(&worker) {
            s.in_flight += 1;
            s.staged_in_flight |= staged;
        }
        let Submission {
            stream,
            alloc,
            done,
            ..
        } = sub;
        self.jobs.insert(
            (worker, job),
            JobState {
                stream,
                alloc,
                done,
                ready: Some(ready),
                input_rungs: rungs,
                input_reasons: reasons,
                arena_inputs,
                copy_back_error: None,
                staged,
                staged_inputs,
                results: BTreeMap::new(),
                requests_by_alloc: HashMap::new(),
                requests_by_handoff: HashMap::new(),
                orphans: Vec::new(),
                lent_bases,
                refused: None,
                slice: slice.map(|(loan, lease)| {
                    Stats::bump(&self.shared.stats.arena_slices_lent);
                    tracing::trace!(worker = %worker, job = job.0, bytes = loan.span.bytes, "arena slice lent");
                    lease
                }),
                carved: BTreeMap::new(),
                slice_error: None,
                done_failed: None,
                failed_as: None,
            },
        );
        self.drive();
    }

    /// The job's arena slice ([`crate::ParentOptions::arena_slice_bytes`]), when slices are
    /// on, the job's results go to the arena (the default allocator,
    /// [`ResultMemory::Arena`]), the worker maps the arena, the arena has a free range that
    /// large without growing, and the chunk reached the worker. Otherwise none, silently: the
    /// worker asks for its results as it always could.
    fn make_slice(&mut self, sub: &Submission) -> Option<(SliceLoan, ArenaLease)> {
        let bytes = self.shared.arena_slice_bytes.load(Ordering::Relaxed);
        if bytes == 0
            || sub.alloc.is_some()
            || !matches!(self.shared.options.results, ResultMemory::Arena { .. })
            || !self.workers.get(&sub.worker).is_some_and(|s| s.maps_arena)
        {
            return None;
        }
        let arena = match self.ensure_arena(bytes) {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(worker = %sub.worker, job = sub.job.0, error = %e, "no arena slice: no arena");
                return None;
            }
        };
        // Blocks given back whose work completed count as free; a slice never grows the arena.
        arena.reclaim();
        let len = bytes.checked_next_multiple_of(ALIGN)?;
        if arena.stats().largest_free < len {
            tracing::trace!(worker = %sub.worker, job = sub.job.0, bytes, "no arena slice: no room");
            return None;
        }
        let block = arena.alloc(bytes).ok()?;
        // Owned from here: dropped on any path below, the block goes back stream-ordered.
        let lease = ArenaLease::new(Arc::clone(&arena), block, sub.stream);
        self.announce_chunks(Some(sub.worker));
        let sent = self
            .workers
            .get(&sub.worker)
            .is_some_and(|s| s.maps_arena && s.arena_chunks_sent > block.chunk);
        if !sent {
            return None;
        }
        let alloc = AllocId(self.next_alloc);
        self.next_alloc += 1;
        let loan = SliceLoan {
            alloc,
            span: Span {
                ptr: block.ptr.0,
                bytes: block.len,
            },
            chunk: block.chunk,
            offset: block.offset,
        };
        Some((loan, lease))
    }

    /// The contract released the job's slice (once the host saw DONE complete, or once the
    /// worker was reaped): on completion each carve becomes a result owning its part of the
    /// slice; everything else goes back to the arena, stream-ordered on the job's stream.
    fn release_slice(
        &mut self,
        worker: WorkerId,
        job: JobId,
        outcome: Outcome,
        mut carved: Vec<CarvedResult>,
    ) {
        let Some(st) = self.jobs.get_mut(&(worker, job)) else {
            return;
        };
        let Some(mut lease) = st.slice.take() else {
            return;
        };
        if outcome != Outcome::Completed || carved.is_empty() {
            // The whole slice goes back (dropping the lease), ordered after the DONE wait.
            return;
        }
        let Some((arena, whole)) = lease.take() else {
            return;
        };
        let stream = st.stream;
        let count = carved.len();
        carved.sort_unstable_by_key(|c| c.offset);
        // What of the slice is not handed out yet: from `rest.offset` to its end.
        let mut rest = Some(whole);
        for c in carved {
            let Some(block) = rest.take() else {
                break;
            };
            let split = |b: poolipc_pool::arena::ArenaBlock, at: u64| {
                if at == 0 {
                    Ok((None, Some(b)))
                } else if at >= b.len {
                    Ok((Some(b), None))
                } else {
                    arena.split(b, at).map(|(x, y)| (Some(x), Some(y)))
                }
            };
            let gap = (whole.offset + c.offset).saturating_sub(block.offset);
            let len = c.bytes.checked_next_multiple_of(ALIGN).unwrap_or(u64::MAX);
            let pieces = split(block, gap).and_then(|(gap, after)| match after {
                Some(after) => split(after, len).map(|(piece, tail)| (gap, piece, tail)),
                None => Ok((gap, None, None)),
            });
            match pieces {
                Ok((gap, Some(piece), tail)) => {
                    drop(gap.map(|g| ArenaLease::new(Arc::clone(&arena), g, stream)));
                    let shape = ResultShape {
                        dtype: c.dtype,
                        shape: c.shape,
                    };
                    let result =
                        ResultTensor::in_arena(Arc::clone(&arena), piece, c.bytes, shape, stream);
                    st.carved.insert(c.index, result);
                    rest = tail;
                }
                Ok((gap, None, _)) => {
                    drop(gap.map(|g| ArenaLease::new(Arc::clone(&arena), g, stream)));
                    st.slice_error.get_or_insert_with(|| {
                        format!("carve {} of {} bytes lies past its slice", c.index, c.bytes)
                    });
                }
                Err(e) => {
                    // The block is unchanged by a refused split: it goes back whole below.
                    rest = Some(block);
                    st.slice_error
                        .get_or_insert_with(|| format!("splitting the job's slice failed: {e}"));
                    break;
                }
            }
        }
        drop(rest.map(|r| ArenaLease::new(Arc::clone(&arena), r, stream)));
        for _ in 0..count {
            Stats::bump(&self.shared.stats.arena_results_carved);
            Stats::bump(&self.shared.stats.arena_results);
        }
    }

    fn take_ready(&mut self, worker: WorkerId) -> Result<(OwnedEvent, EventBlob), Error> {
        if let Some(r) = self
            .workers
            .get_mut(&worker)
            .and_then(|s| s.ready_free.pop())
        {
            return Ok(r);
        }
        let event = OwnedEvent::new(Arc::clone(&self.shared.driver), true)?;
        let blob = event.ipc_handle()?;
        Ok((event, blob))
    }

    fn give_ready(&mut self, worker: WorkerId, ready: (OwnedEvent, EventBlob)) {
        if let Some(s) = self.workers.get_mut(&worker) {
            s.ready_free.push(ready);
        }
    }

    /// Sets host staging up with `worker` the first time one of its tensors needs it.
    fn ensure_staging(&mut self, worker: WorkerId) -> Result<(), Error> {
        let driver = Arc::clone(&self.shared.driver);
        let config = self.shared.options.staging.clone();
        let slot = self
            .workers
            .get_mut(&worker)
            .ok_or(Error::UnknownWorker(worker))?;
        if slot.staging.is_none() {
            let mut ch = StagingChannel::setup_parent(driver, &mut slot.conn, config)?;
            slot.backlog.extend(ch.take_backlog());
            slot.staging = Some(ch);
        }
        Ok(())
    }

    /// A driver error in the loop: if it says this process's CUDA context is lost, nothing
    /// on the GPU can be trusted any more. Then the parent records why (naming MPS and the
    /// worker most likely at fault), condemns every worker, and refuses all later work;
    /// returns whether that happened. The actions it queues run at the next `drive`.
    fn escalate(&mut self, what: &str, e: &Error) -> bool {
        let e = match self.lost_context(e) {
            Some(e) => e,
            None => return false,
        };
        if self.shared.check_context().is_ok() {
            let suspect = match &self.suspect {
                Some((w, said)) => format!(" The worker most likely at fault: {w} ({said})."),
                None => {
                    let busy: Vec<String> = self
                        .workers
                        .iter()
                        .filter(|(_, s)| s.in_flight > 0)
                        .map(|(w, _)| w.to_string())
                        .collect();
                    if busy.is_empty() {
                        String::new()
                    } else {
                        format!(" Workers with jobs on the GPU then: {}.", busy.join(", "))
                    }
                }
            };
            let cause = match self.shared.mps_client {
                Some(true) => format!(
                    "this process is an MPS client, and under MPS a GPU fault in any client (a worker's kernel) ends every client's context.{suspect}"
                ),
                _ => format!(
                    "a GPU fault in this process (a kernel of its own), or the GPU itself; a worker's fault does not reach the parent without MPS.{suspect}"
                ),
            };
            let detail = format!(
                "the GPU context of this process is lost ({what}: {e}): {cause} Every later CUDA call here fails and nothing computed since can be trusted, so this parent refuses all further work; restart the process{}",
                if self.shared.mps_client == Some(true) {
                    ", and run workers you do not trust without MPS."
                } else {
                    "."
                }
            );
            tracing::error!("{detail}");
            *crate::parent::lock(&self.shared.context_lost) = Some(detail.clone());
            let workers: Vec<WorkerId> = self.workers.keys().copied().collect();
            for w in workers {
                self.lose(w, "the parent's GPU context is lost");
            }
            // Jobs still waiting for a worker will never run.
            let queued: Vec<Box<Submission>> = self
                .workers
                .values_mut()
                .flat_map(|s| s.queued.drain(..))
                .collect();
            for sub in queued {
                Stats::bump(&self.shared.stats.jobs_failed);
                sub.done.complete(Err(Error::ContextLost {
                    detail: detail.clone(),
                }));
            }
        }
        true
    }

    /// Whether `e` means the context is lost, and the error that says so. Under MPS, calls on
    /// handles made before another client's fault fail with `CUDA_ERROR_INVALID_HANDLE`
    /// while new work fails with the sticky code (H200, driver 580): so after any driver
    /// error, one event creation asks the context itself.
    fn lost_context(&self, e: &Error) -> Option<String> {
        if e.is_context_lost() {
            return Some(e.to_string());
        }
        if !matches!(
            e,
            Error::Driver(_) | Error::Pool(_) | Error::Import(_) | Error::Staging(_)
        ) {
            return None;
        }
        match poolipc_driver::OwnedEvent::new(&*self.shared.driver, false) {
            Ok(ev) => {
                if let Err(d) = ev.close() {
                    tracing::debug!(error = %d, "destroying the probe event");
                }
                None
            }
            Err(p) if p.is_context_lost() => Some(format!("{e}; then {p}")),
            Err(_) => None,
        }
    }

    /// The error every job gets once the context is lost.
    fn context_error(&self) -> Error {
        match self.shared.check_context() {
            Err(e) => e,
            Ok(()) => Error::ContextLost {
                detail: "the GPU context of this process is lost".into(),
            },
        }
    }

    /// The worker is lost outside the contract's view (a send failed, staging broke): tell the
    /// contract it hung up; it condemns the worker, and the actions do the rest.
    fn lose(&mut self, worker: WorkerId, why: &str) {
        if let Some(s) = self.workers.get_mut(&worker) {
            if s.lost.is_some() {
                return;
            }
            s.lost = Some(why.to_owned());
            if s.exit_deadline.is_some() {
                // Bye was sent: the worker closing is how it says goodbye. Its exit (or its
                // stop deadline) reaps it.
                return;
            }
        }
        tracing::warn!(worker = %worker, "{why}");
        if self.shared.check_context().is_ok() {
            self.suspect = Some((worker, why.to_owned()));
        }
        let now = self.now();
        if let Err(e) = self.machine.handle(
            ParentEvent::WorkerHungUp {
                worker,
                why: why.to_owned(),
            },
            now,
        ) {
            tracing::warn!(worker = %worker, error = %e, "the contract refused a hang-up");
        }
    }

    /// Carries out every action the contract has queued, in order.
    fn drive(&mut self) {
        while let Some(action) = self.machine.poll_action() {
            tracing::trace!(?action, "contract action");
            self.act(action);
        }
    }

    fn act(&mut self, action: ParentAction) {
        if let Some(key) = job_of(&action)
            && let Some(gate) = self.gates.get_mut(&key)
        {
            gate.held.push_back(action);
            return;
        }
        let label = if crate::probe::enabled() {
            action_label(&action)
        } else {
            ""
        };
        let span = action_span(&action);
        let _in_span = span.enter();
        self.act_inner(action);
        if !label.is_empty() {
            crate::probe::mark(label);
        }
    }

    fn act_inner(&mut self, action: ParentAction) {
        match action {
            ParentAction::RecordReady { worker, job } => {
                let driver = Arc::clone(&self.shared.driver);
                if let Some(st) = self.jobs.get(&(worker, job))
                    && let Some((ev, _)) = &st.ready
                    && let Err(e) = driver.event_record(ev.handle(), st.stream)
                    && !self.escalate("recording READY", &e.into())
                {
                    self.lose(worker, "recording READY failed");
                }
            }
            ParentAction::Send { worker, message } => self.send(worker, &message),
            ParentAction::SendStaged {
                worker,
                job,
                handoff,
            } => {
                let Some(st) = self.jobs.get(&(worker, job)) else {
                    return;
                };
                let Some(&(src, bytes)) = st.staged_inputs.get(&handoff) else {
                    return;
                };
                let stream = st.stream;
                let r = self.with_staging(worker, |ch, conn| {
                    ch.send_tensor(conn, job, handoff, src, bytes, stream)
                });
                if let Err(e) = r {
                    let why = format!("sending a staged input failed: {e}");
                    if backlog_full(&e) {
                        self.condemn_for_bound(worker, job, contract::Bound::StagingBacklog, why);
                    } else if !self.escalate("sending a staged input", &e) {
                        self.lose(worker, &why);
                    }
                }
            }
            ParentAction::AllocateResult {
                worker,
                job,
                request,
                spec,
            } => self.allocate_result(worker, job, request, &spec),
            ParentAction::ReceiveStaged {
                worker,
                job,
                handoff,
            } => {
                let Some(st) = self.jobs.get(&(worker, job)) else {
                    return;
                };
                // A staged result, or a writable staged input coming back into the caller's
                // tensor (copy-back): the bytes that went out, at the place they came from.
                let result = st
                    .requests_by_handoff
                    .get(&handoff)
                    .and_then(|req| st.results.get(req))
                    .map(|r| (r.ptr, r.bytes));
                let (what, target) = match result {
                    Some(t) => ("a staged result", t),
                    None => match st.staged_inputs.get(&handoff) {
                        Some(&t) => ("a staged input's copy-back", t),
                        None => return,
                    },
                };
                let ((dst, bytes), stream) = (target, st.stream);
                let r = self.with_staging(worker, |ch, conn| {
                    ch.recv_tensor(conn, job, handoff, dst, bytes, stream)
                });
                match r {
                    Ok(()) if result.is_none() => {
                        Stats::bump(&self.shared.stats.inputs_copied_back);
                    }
                    Ok(()) => {}
                    Err(e) if backlog_full(&e) => {
                        let why = format!("receiving {what} failed: {e}");
                        self.condemn_for_bound(worker, job, contract::Bound::StagingBacklog, why);
                    }
                    Err(e) if !self.escalate(&format!("receiving {what}"), &e) => {
                        self.lose(worker, &format!("receiving {what} failed: {e}"));
                    }
                    Err(_) => {}
                }
            }
            ParentAction::WaitDone {
                worker,
                job,
                handoff: _,
                done_event,
            } => {
                if let Err(e) = self.wait_done(worker, job, done_event) {
                    let why = format!("waiting on the worker's DONE failed: {e}");
                    if let Some(st) = self.jobs.get_mut(&(worker, job)) {
                        st.done_failed = Some(why.clone());
                    }
                    if !self.escalate("waiting on DONE", &e) {
                        self.lose(worker, &why);
                    }
                }
            }
            ParentAction::Release {
                worker,
                job,
                handoff,
                alloc: _,
                purpose,
                rung,
                outcome,
            } => self.release(worker, job, handoff, purpose, rung, outcome),
            ParentAction::ReleaseSlice {
                worker,
                job,
                handoff: _,
                alloc: _,
                outcome,
                carved,
            } => self.release_slice(worker, job, outcome, carved),
            ParentAction::FreeResult {
                worker,
                job,
                request,
                alloc: _,
            } => {
                if let Some(st) = self.jobs.get_mut(&(worker, job))
                    && let Some(r) = st.results.remove(&request)
                {
                    st.discard(r);
                }
            }
            ParentAction::KillWorker { worker } => {
                let lost = self
                    .workers
                    .get(&worker)
                    .is_some_and(|s| s.exit_deadline.is_none());
                if lost {
                    Stats::bump(&self.shared.stats.workers_lost);
                }
                self.reap(worker, true);
            }
            ParentAction::JobFinished {
                worker,
                job,
                outcome,
            } => self.finish(worker, job, outcome),
            ParentAction::WorkerRemoved { worker } => {
                // The loop drops the slot itself once it reaped the process.
                tracing::debug!(worker = %worker, "the contract let the worker go");
            }
            ParentAction::ShutdownComplete => {}
        }
    }

    /// Sends what the contract emitted, unchanged; notes result grants for later.
    fn send(&mut self, worker: WorkerId, message: &Message) {
        if let Message::AllocationGrant(g) = message
            && let Some(st) = self.jobs.get_mut(&(worker, g.job))
        {
            for grant in &g.results {
                if let ResultGrant::Granted { handle, alloc, .. }
                | ResultGrant::Arena { handle, alloc, .. } = grant
                    && let Some(&req) = st.requests_by_alloc.get(alloc)
                {
                    st.requests_by_handoff.insert(*handle, req);
                }
            }
        }
        let Some(slot) = self.workers.get_mut(&worker) else {
            return;
        };
        if slot.lost.is_some() {
            return;
        }
        // Queued, written as the socket takes it: a worker that does not read blocks no one
        // (its queue's bound and the frame deadline condemn it).
        if let Err(e) = slot.conn.enqueue(message, &[]) {
            if matches!(message, Message::Bye) {
                // A worker that already left needs no goodbye.
                slot.lost = Some(format!("sending Bye failed: {e}"));
                return;
            }
            self.lose(worker, &format!("sending {} failed: {e}", message.kind()));
        }
    }

    fn with_staging(
        &mut self,
        worker: WorkerId,
        f: impl FnOnce(&mut StagingChannel, &mut Connection) -> Result<(), crate::staging::StagingError>,
    ) -> Result<(), Error> {
        let slot = self
            .workers
            .get_mut(&worker)
            .ok_or(Error::UnknownWorker(worker))?;
        let Slot {
            staging,
            conn,
            backlog,
            ..
        } = slot;
        let ch = staging
            .as_mut()
            .ok_or_else(|| Error::Protocol("host staging is not set up".into()))?;
        let r = f(ch, conn);
        backlog.extend(ch.take_backlog());
        Ok(r?)
    }

    /// The worker's DONE of `job`: complete already (the usual case under MPS: it completes
    /// before its frame arrives), or the job is held ([`DoneGate`]) until it is.
    fn wait_done(&mut self, worker: WorkerId, job: JobId, blob: EventBlob) -> Result<(), Error> {
        let driver = Arc::clone(&self.shared.driver);
        if !self.jobs.contains_key(&(worker, job)) {
            return Err(Error::Protocol(
                "DONE for a job the loop does not hold".into(),
            ));
        }
        let max = self.shared.options.max_open_done_events;
        let gates = &self.gates;
        let slot = self
            .workers
            .get_mut(&worker)
            .ok_or(Error::UnknownWorker(worker))?;
        let event = match slot.done_events.use_open(&blob) {
            Some(e) => e,
            None => {
                let held = |e: EventHandle| {
                    gates
                        .iter()
                        .any(|(k, g)| k.0 == worker && g.events.contains(&e))
                };
                if slot.done_events.make_room(&blob, max, held) == Room::Full {
                    let why = format!(
                        "{worker} sent a new DONE event for {job} while all {max} of its open DONE events are waited on by its held jobs"
                    );
                    self.condemn_for_bound(worker, job, contract::Bound::OpenDoneEvents, why);
                    return Ok(());
                }
                let e = OwnedEvent::open_ipc(Arc::clone(&driver), &blob)?;
                let handle = slot.done_events.insert(blob, e);
                self.count_done_events();
                handle
            }
        };
        // Never `cuStreamWaitEvent(stream, DONE)`: the host learns that the worker's work
        // completed, and only then does the loop queue anything more of the job on `stream`
        // (copy-backs, returns, frees) or hand the job's results to the caller: all of it,
        // and all the caller queues later, comes after the worker's writes.
        if driver.event_query(event)? {
            return Ok(());
        }
        let deadline = Instant::now() + self.shared.options.handoff_timeout;
        tracing::trace!(worker = %worker, job = job.0, "DONE not complete yet: held until it is");
        let stats = &self.shared.stats;
        self.gates
            .entry((worker, job))
            .or_insert_with(|| {
                Stats::bump(&stats.jobs_held_for_done);
                DoneGate {
                    events: Vec::new(),
                    held: VecDeque::new(),
                    deadline,
                    expired: None,
                    lost: None,
                    since: Instant::now(),
                }
            })
            .events
            .push(event);
        Ok(())
    }

    /// Held jobs: those whose DONE completed go on (their held actions run, in order); a
    /// failed query fails the job as a failed DONE wait did; one past its deadline condemns
    /// its worker (the job fails at the reaping, see [`reap`](Self::reap)).
    fn check_gates(&mut self) {
        if self.gates.is_empty() {
            return;
        }
        let driver = Arc::clone(&self.shared.driver);
        let now = Instant::now();
        let keys: Vec<(WorkerId, JobId)> = self.gates.keys().copied().collect();
        for key in keys {
            let (worker, job) = key;
            let Some(gate) = self.gates.get_mut(&key) else {
                continue;
            };
            if gate.expired.is_some() {
                continue;
            }
            let mut failed = None;
            gate.events.retain(|e| match driver.event_query(*e) {
                Ok(done) => !done,
                Err(err) => {
                    failed.get_or_insert(err);
                    false
                }
            });
            if let Some(e) = failed {
                let e = Error::from(e);
                let why = format!("querying the worker's DONE failed: {e}");
                if let Some(st) = self.jobs.get_mut(&key) {
                    st.done_failed = Some(why.clone());
                }
                self.open_gate(key);
                self.forget_dead_events();
                if !self.escalate("querying DONE", &e) {
                    self.lose(worker, &why);
                }
                self.drive();
                continue;
            }
            if gate.events.is_empty() {
                self.last_activity = Instant::now();
                self.open_gate(key);
                self.forget_dead_events();
                continue;
            }
            if now >= gate.deadline
                && let Some(why) = gate.lost.clone()
            {
                if let Some(gate) = self.gates.remove(&key) {
                    self.fail_gate(key, gate, &why);
                }
                self.forget_dead_events();
                continue;
            }
            if now >= gate.deadline {
                let timeout = self.shared.options.handoff_timeout;
                let why = format!(
                    "{worker}'s DONE for {job} did not complete on the GPU within the handoff timeout ({timeout:?}): its GPU work hangs"
                );
                gate.expired = Some(why.clone());
                match self.workers.get_mut(&worker) {
                    // Being stopped: kill it now rather than at its stop deadline.
                    Some(slot) if slot.exit_deadline.is_some() => {
                        slot.lost.get_or_insert_with(|| why.clone());
                        slot.exit_deadline = Some(now);
                    }
                    _ => self.lose(worker, &why),
                }
                self.drive();
            }
        }
    }

    /// A held job whose worker was reaped before its DONE completed: the job fails (naming
    /// the deadline if that was why), and its held releases run as a lost worker's do, now
    /// that the process is gone: nothing is copied back, no result is handed out.
    fn fail_gate(&mut self, key: (WorkerId, JobId), gate: DoneGate, why: &str) {
        let (reason, detail) = match gate.expired {
            Some(d) => (FailReason::DeadlineExpired, d),
            None => (
                FailReason::HungUp,
                format!("the worker was lost before its DONE completed on the GPU ({why})"),
            ),
        };
        if let Some(st) = self.jobs.get_mut(&key) {
            st.done_failed.get_or_insert_with(|| detail.clone());
        }
        for action in gate.held {
            let action = match action {
                ParentAction::WaitDone { .. } => continue,
                ParentAction::Release {
                    worker,
                    job,
                    handoff,
                    alloc,
                    purpose,
                    rung,
                    outcome: _,
                } => ParentAction::Release {
                    worker,
                    job,
                    handoff,
                    alloc,
                    purpose,
                    rung,
                    outcome: Outcome::Failed,
                },
                ParentAction::ReleaseSlice {
                    worker,
                    job,
                    handoff,
                    alloc,
                    outcome: _,
                    carved: _,
                } => ParentAction::ReleaseSlice {
                    worker,
                    job,
                    handoff,
                    alloc,
                    outcome: Outcome::Failed,
                    carved: Vec::new(),
                },
                ParentAction::JobFinished { worker, job, .. } => ParentAction::JobFinished {
                    worker,
                    job,
                    outcome: JobOutcome::Failed {
                        reason,
                        detail: detail.clone(),
                    },
                },
                other => other,
            };
            self.act(action);
        }
    }

    /// The worker is being reaped (its slot about to close) with jobs held for their DONE.
    /// Those past their deadline are returned, to fail now. The others wait on for
    /// [`REAP_GRACE`]: their held `WaitDone`s become events of the gate, and the worker's
    /// opened events move to `dead_events` so that they stay open meanwhile.
    fn outlive_worker(
        &mut self,
        worker: WorkerId,
        slot: &mut Slot,
        why: &str,
    ) -> Vec<((WorkerId, JobId), DoneGate)> {
        let keys: Vec<_> = self
            .gates
            .keys()
            .filter(|k| k.0 == worker)
            .copied()
            .collect();
        let mut fail_now = Vec::new();
        let grace_end = Instant::now() + REAP_GRACE;
        for key in keys {
            let Some(mut gate) = self.gates.remove(&key) else {
                continue;
            };
            let mut known = gate.expired.is_none();
            let mut rest = VecDeque::with_capacity(gate.held.len());
            for action in gate.held.drain(..) {
                if let ParentAction::WaitDone { done_event, .. } = &action {
                    match slot.done_events.get(done_event) {
                        Some(e) if !gate.events.contains(&e.handle()) => {
                            gate.events.push(e.handle());
                        }
                        Some(_) => {}
                        // Never opened: nothing can tell whether it completed.
                        None => known = false,
                    }
                    continue;
                }
                rest.push_back(action);
            }
            gate.held = rest;
            if known {
                gate.lost = Some(why.to_owned());
                gate.deadline = gate.deadline.min(grace_end);
                self.gates.insert(key, gate);
            } else {
                fail_now.push((key, gate));
            }
        }
        if self.gates.keys().any(|k| k.0 == worker) {
            self.dead_events
                .insert(worker, std::mem::take(&mut slot.done_events));
        }
        fail_now
    }

    /// Closes the DONE events of reaped workers no held job waits on any more.
    fn forget_dead_events(&mut self) {
        let gates = &self.gates;
        self.dead_events
            .retain(|w, _| gates.keys().any(|k| k.0 == *w));
        self.count_done_events();
    }

    /// `ParentStats::done_events_open`: the DONE events the parent holds open now.
    fn count_done_events(&self) {
        let open: usize = self
            .workers
            .values()
            .map(|s| s.done_events.len())
            .chain(self.dead_events.values().map(DoneEvents::len))
            .sum();
        self.shared
            .stats
            .done_events_open
            .store(u64::try_from(open).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// `worker` went past `bound` while the loop carried out `job`'s actions: the contract
    /// condemns it (kills it; its jobs fail naming the bound), and `job`, whose later
    /// actions may already be queued as a success, fails too.
    fn condemn_for_bound(
        &mut self,
        worker: WorkerId,
        job: JobId,
        bound: contract::Bound,
        why: String,
    ) {
        tracing::warn!(worker = %worker, job = job.0, %bound, "{why}");
        if let Some(st) = self.jobs.get_mut(&(worker, job)) {
            st.done_failed.get_or_insert_with(|| why.clone());
            st.failed_as.get_or_insert(FailReason::BoundExceeded(bound));
        }
        if let Err(e) = self.machine.condemn_for(worker, bound, why) {
            tracing::debug!(worker = %worker, error = %e, "condemning a worker the contract has let go");
        }
    }

    /// The job's DONE completed (or will never be waited on): its held actions run now.
    fn open_gate(&mut self, key: (WorkerId, JobId)) {
        let Some(gate) = self.gates.remove(&key) else {
            return;
        };
        for action in gate.held {
            self.act(action);
        }
    }

    fn allocate_result(
        &mut self,
        worker: WorkerId,
        job: JobId,
        request: RequestId,
        spec: &ResultSpec,
    ) {
        let now = self.now();
        let event = match self.make_result(worker, job, request, spec) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(worker = %worker, job = job.0, error = %e, "result allocation failed");
                if backlog_full(&e) {
                    let why = format!("setting host staging up for a result failed: {e}");
                    self.condemn_for_bound(worker, job, contract::Bound::StagingBacklog, why);
                }
                if let Some(st) = self.jobs.get_mut(&(worker, job)) {
                    st.refused
                        .get_or_insert_with(|| crate::ResultRefusal::of(&e));
                }
                ParentEvent::ResultDeclined {
                    worker,
                    request,
                    code: ErrorCode::OUT_OF_MEMORY,
                    message: format!("the parent could not allocate {} bytes: {e}", spec.byte_len),
                }
            }
        };
        if let Err(e) = self.machine.handle(event, now) {
            tracing::warn!(worker = %worker, error = %e, "the contract refused a result allocation");
        }
    }

    /// Allocates a result and chooses its rung: pool pointer for memory of a pool the worker
    /// takes pointers from, within the limit; host staging otherwise.
    fn make_result(
        &mut self,
        worker: WorkerId,
        job: JobId,
        request: RequestId,
        spec: &ResultSpec,
    ) -> Result<ParentEvent, Error> {
        let pointer_pools = self
            .shared
            .pointer_pools(worker)
            .ok_or(Error::UnknownWorker(worker))?;
        let takes_staging = self.workers.get(&worker).is_some_and(|s| s.takes_staging);
        let shape = ResultShape {
            dtype: spec.dtype,
            shape: spec.shape.clone(),
        };
        let bytes = spec.byte_len;
        let to_arena = bytes > 0
            && matches!(self.shared.options.results, ResultMemory::Arena { .. })
            && self.workers.get(&worker).is_some_and(|s| s.maps_arena)
            && self
                .jobs
                .get(&(worker, job))
                .is_some_and(|st| st.alloc.is_none());
        if to_arena {
            return self.make_arena_result(worker, job, request, shape, bytes);
        }
        let st = self.jobs.get_mut(&(worker, job)).ok_or_else(|| {
            Error::Protocol(format!("a result for job {} the loop does not hold", job.0))
        })?;
        let stream = st.stream;
        let ptr = match st.alloc.as_mut() {
            Some(f) => {
                let ptr = f(&shape, bytes, stream)?;
                // The caller's allocator is trusted with the memory, not with its size: a
                // result smaller than asked would let the worker write past it.
                let room = self
                    .shared
                    .driver
                    .pointer_info(ptr)
                    .ok()
                    .and_then(|i| (i.base.0 + i.size).checked_sub(ptr.0));
                if room.is_none_or(|r| r < bytes) {
                    st.orphans.push(ptr);
                    return Err(Error::InvalidTensor(format!(
                        "the job's result allocator returned {:#x}, which has {} of the {bytes} \
                         bytes asked for result {} of its allocation",
                        ptr.0,
                        room.map_or_else(|| "none".to_owned(), |r| format!("{r} bytes")),
                        request.0,
                    )));
                }
                ptr
            }
            None => self.shared.pools[0].alloc(bytes, stream)?,
        };
        let alloc = AllocId(self.next_alloc);
        self.next_alloc += 1;
        let handle = self.shared.driver.pointer_get_mempool(ptr).ok();
        let pool = handle.and_then(|h| self.shared.pool_of(h));
        // The worker's index of the result's pool (generation), if it takes pointers of it.
        let wire = handle.and_then(|h| {
            pointer_pools
                .iter()
                .find(|(ph, _)| *ph == h)
                .map(|(_, i)| *i)
        });
        let limit = self.shared.limit();
        let by_pointer = pool.is_some() && wire.is_some() && limit.allows(ptr.0, bytes);
        let rung = if by_pointer {
            Rung::PoolPointer
        } else if takes_staging {
            Rung::HostStaging
        } else {
            // Not lendable and no staging: give the memory back at once.
            st.orphans.push(ptr);
            return Err(Error::NoRung(format!(
                "a result of {bytes} bytes cannot go by pool pointer and {worker} has no host staging"
            )));
        };
        let export = match (rung, pool) {
            (Rung::PoolPointer, Some(p)) => match self.shared.pools[p].export(ptr) {
                Ok(e) => e,
                Err(e) => {
                    st.orphans.push(ptr);
                    return Err(e.into());
                }
            },
            _ => ExportBlob([0; 64]),
        };
        st.results
            .insert(request, ResultTensor::new(ptr, bytes, shape, rung));
        st.requests_by_alloc.insert(alloc, request);
        // The rungs a result allocated here can take (the arena's go through
        // make_arena_result; VMM handles and arena copies are for inputs).
        let counter = match rung {
            Rung::HostStaging => &self.shared.stats.host_staged_tensors,
            Rung::PoolPointer | Rung::Arena | Rung::ArenaCopy | Rung::VmmHandle => {
                &self.shared.stats.pool_pointer_tensors
            }
        };
        Stats::bump(counter);
        if rung == Rung::HostStaging {
            // Set up before the grant goes out: the worker sends the bytes after its Done.
            self.ensure_staging(worker)?;
            if let Some(s) = self.workers.get_mut(&worker) {
                s.staged_in_flight = true;
            }
            if let Some(st) = self.jobs.get_mut(&(worker, job)) {
                st.staged = true;
            }
        }
        Ok(ParentEvent::ResultAllocated {
            worker,
            request,
            alloc,
            span: Span { ptr: ptr.0, bytes },
            rung,
            pool: if rung == Rung::PoolPointer {
                wire.unwrap_or(0)
            } else {
                0
            },
            export,
        })
    }

    /// A result in a block of the arena: the chunk it lies in is sent to every worker that
    /// has not got it (to this one before its grant), then the contract hears where it is.
    fn make_arena_result(
        &mut self,
        worker: WorkerId,
        job: JobId,
        request: RequestId,
        shape: ResultShape,
        bytes: u64,
    ) -> Result<ParentEvent, Error> {
        let arena = self.ensure_arena(bytes)?;
        let stream = self
            .jobs
            .get(&(worker, job))
            .map(|st| st.stream)
            .ok_or_else(|| {
                Error::Protocol(format!("a result for job {} the loop does not hold", job.0))
            })?;
        let block = arena.alloc(bytes)?;
        // Owned from here: dropped on any path below, the block goes back (stream-ordered).
        let result = ResultTensor::in_arena(Arc::clone(&arena), block, bytes, shape, stream);
        self.announce_chunks(Some(worker));
        let sent = self
            .workers
            .get(&worker)
            .is_some_and(|s| s.maps_arena && s.arena_chunks_sent > block.chunk);
        if !sent {
            return Err(Error::Protocol(format!(
                "arena chunk {} could not be sent to {worker}",
                block.chunk
            )));
        }
        let st = self.jobs.get_mut(&(worker, job)).ok_or_else(|| {
            Error::Protocol(format!("a result for job {} the loop does not hold", job.0))
        })?;
        let alloc = AllocId(self.next_alloc);
        self.next_alloc += 1;
        st.results.insert(request, result);
        st.requests_by_alloc.insert(alloc, request);
        Stats::bump(&self.shared.stats.arena_results);
        tracing::trace!(worker = %worker, job = job.0, ?block, "result in the arena");
        Ok(ParentEvent::ResultAllocatedInArena {
            worker,
            request,
            alloc,
            span: Span {
                ptr: block.ptr.0,
                bytes: block.len,
            },
            chunk: block.chunk,
            offset: block.offset,
        })
    }

    fn release(
        &mut self,
        worker: WorkerId,
        job: JobId,
        handoff: HandoffId,
        purpose: Purpose,
        rung: Rung,
        outcome: Outcome,
    ) {
        let Some(st) = self.jobs.get_mut(&(worker, job)) else {
            return;
        };
        if purpose == Purpose::Input && rung == Rung::ArenaCopy {
            // The contract releases it once the host saw the worker's DONE complete (the loop
            // holds the release until then), or once the worker was reaped: the block goes
            // back ordered after both.
            let Some(input) = st.arena_inputs.remove(&handoff) else {
                return;
            };
            // Copy-back: what the worker wrote into the block reaches the caller's tensor,
            // on the job's stream after DONE completed and before the block goes back (the
            // lease's return is recorded after it). The worker acknowledged after DONE
            // (completed or cancelled); a worker reaped before that leaves the tensor as it
            // was, since nothing orders its writes.
            // Not after a DONE wait that failed: nothing orders the copy after the worker.
            let acked = matches!(outcome, Outcome::Completed | Outcome::Cancelled)
                && st.done_failed.is_none();
            if acked && !input.read_only {
                let copied = self.shared.driver.memcpy_dtod_async(
                    input.src,
                    input.block,
                    input.bytes,
                    st.stream,
                );
                match copied {
                    Ok(()) => {
                        Stats::bump(&self.shared.stats.inputs_copied_back);
                        tracing::trace!(worker = %worker, job = job.0, bytes = input.bytes, "arena-copy input copied back");
                    }
                    Err(e) => {
                        tracing::warn!(worker = %worker, job = job.0, error = %e, "copying an arena-copy input back failed");
                        st.copy_back_error.get_or_insert(format!(
                            "copying the worker's writes to an input back from the arena failed: {e}"
                        ));
                    }
                }
            }
            drop(input.lease);
            return;
        }
        // Inputs stay the caller's; a result that did not complete goes back.
        if let Purpose::Result { request } = purpose
            && outcome != Outcome::Completed
            && let Some(r) = st.results.remove(&request)
        {
            // Nothing imports it any more: the worker acknowledged (and the stream waited on
            // its DONE) or was reaped.
            st.discard(r);
        }
    }

    /// The contract's last word on a job: its handle gets the results or the error.
    fn finish(&mut self, worker: WorkerId, job: JobId, outcome: JobOutcome) {
        self.last_activity = Instant::now();
        let Some(mut st) = self.jobs.remove(&(worker, job)) else {
            return;
        };
        for base in st.lent_bases.drain(..) {
            if let Some(e) = self.lent.get_mut(&base) {
                e.1 -= 1;
                if e.1 == 0 {
                    self.lent.remove(&base);
                }
            }
        }
        if !matches!(outcome, JobOutcome::Completed) {
            if let JobOutcome::WorkerError(m) = &outcome {
                self.suspect = Some((worker, format!("it reported: {m}")));
            }
            // A worker that failed may have faulted on the GPU: under MPS that ends our
            // context too. Ask now rather than at the next job. The MPS server marks the
            // other clients a little after the faulting one sees its error (on the H200 the
            // parent's first query sometimes still succeeded), so under MPS, for a failure
            // that looks like a crash or a GPU fault, ask again for up to MPS_FAULT_GRACE.
            let crash_like = match &outcome {
                JobOutcome::Failed { reason, .. } => {
                    matches!(reason, FailReason::HungUp | FailReason::ProtocolViolation)
                }
                JobOutcome::WorkerError(m) => names_gpu_fault(m),
                JobOutcome::Completed => false,
            };
            let grace = if crash_like && self.shared.mps_client == Some(true) {
                MPS_FAULT_GRACE
            } else {
                Duration::ZERO
            };
            let started = Instant::now();
            while self.shared.check_context().is_ok() {
                let probe = poolipc_driver::OwnedEvent::new(&*self.shared.driver, false)
                    .and_then(poolipc_driver::OwnedEvent::close);
                match probe {
                    Err(e) => {
                        self.escalate("checking the context after a failed job", &e.into());
                        break;
                    }
                    Ok(()) if started.elapsed() < grace => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Ok(()) => break,
                }
            }
        }
        if let Some(ready) = st.ready.take() {
            self.give_ready(worker, ready);
        }
        if let Some(s) = self.workers.get_mut(&worker) {
            s.in_flight = s.in_flight.saturating_sub(1);
            if st.staged {
                s.staged_in_flight = false;
            }
        }
        if st.staged {
            // Chunks held back while its staging transfer ran.
            self.announce_chunks(None);
        }
        let result = match outcome {
            JobOutcome::Completed
                if st.done_failed.is_some()
                    || st.slice_error.is_some()
                    || st.copy_back_error.is_some() =>
            {
                let why = st
                    .done_failed
                    .take()
                    .or_else(|| st.slice_error.take())
                    .or_else(|| st.copy_back_error.take())
                    .unwrap_or_default();
                let results = self.give_back_results(&mut st);
                Err(Error::JobFailed {
                    worker,
                    reason: st.failed_as.take().unwrap_or(FailReason::ProtocolViolation),
                    detail: why,
                    results,
                })
            }
            JobOutcome::Completed => {
                self.free_orphans(&mut st);
                // Carved results at their places, granted ones in request order in the others.
                let mut granted = std::mem::take(&mut st.results).into_values();
                let mut carved = std::mem::take(&mut st.carved);
                let total = carved.len() + granted.len();
                let mut results = Vec::with_capacity(total);
                for place in 0..total {
                    let carve = u32::try_from(place).ok().and_then(|p| carved.remove(&p));
                    results.extend(carve.or_else(|| granted.next()));
                }
                Ok(JobOutput {
                    results,
                    input_rungs: std::mem::take(&mut st.input_rungs),
                    input_reasons: std::mem::take(&mut st.input_reasons),
                })
            }
            JobOutcome::WorkerError(message) => {
                let results = self.give_back_results(&mut st);
                Err(Error::Worker {
                    message,
                    results,
                    refused: st.refused.take(),
                })
            }
            JobOutcome::Failed { reason, detail } => {
                let results = self.give_back_results(&mut st);
                let status = self.reaped.get(&worker).cloned().unwrap_or_default();
                let detail = if status.is_empty() {
                    detail
                } else {
                    format!("{detail}; worker {status}")
                };
                // A worker that went away after the parent refused its results most likely
                // died of the refusal: name it, it is the cause the caller can act on.
                let detail = match st.refused.take() {
                    Some(r) => format!("{detail}; before that the parent refused its results: {r}"),
                    None => detail,
                };
                Err(Error::JobFailed {
                    worker,
                    reason,
                    detail,
                    results,
                })
            }
        };
        let result = match result {
            Err(_) if self.shared.check_context().is_err() => Err(self.context_error()),
            r => r,
        };
        let counter = if matches!(
            result,
            Err(Error::JobFailed { .. } | Error::ContextLost { .. })
        ) {
            &self.shared.stats.jobs_failed
        } else {
            &self.shared.stats.jobs_completed
        };
        Stats::bump(counter);
        st.done.complete(result);
        self.dispatch(worker);
    }

    /// A failed job's result memory: freed here for the default allocator (arena blocks go
    /// back to the arena, stream-ordered), else returned.
    fn give_back_results(&mut self, st: &mut JobState) -> Vec<DevicePtr> {
        for r in std::mem::take(&mut st.results).into_values() {
            st.discard(r);
        }
        // Carved results and an unreleased slice: arena blocks, back stream-ordered.
        st.carved.clear();
        drop(st.slice.take());
        let all = std::mem::take(&mut st.orphans);
        if st.alloc.is_none() {
            st.orphans = all;
            self.free_orphans(st);
            Vec::new()
        } else {
            all
        }
    }

    /// Frees the result memory of the default allocator that was not handed out. Memory of
    /// a caller's allocator is the caller's: left alone (and said so).
    fn free_orphans(&mut self, st: &mut JobState) {
        if st.alloc.is_some() {
            if !st.orphans.is_empty() {
                tracing::warn!(
                    count = st.orphans.len(),
                    "result memory of the job's allocator was not handed out: the caller's to free"
                );
            }
            st.orphans.clear();
            return;
        }
        for ptr in st.orphans.drain(..) {
            if let Err(e) = self.shared.pools[0].free(ptr, st.stream) {
                tracing::warn!(error = %e, ?ptr, "freeing a result that was not handed out failed");
            }
        }
    }

    /// At the end of the thread: whatever job is left fails.
    fn fail_leftover_jobs(&mut self) {
        self.gates.clear();
        self.dead_events.clear();
        for ((worker, _), mut st) in std::mem::take(&mut self.jobs) {
            let results = self.give_back_results(&mut st);
            st.done.complete(Err(Error::JobFailed {
                worker,
                reason: FailReason::Stopped,
                detail: "the parent shut down".into(),
                results,
            }));
        }
    }
}

#[derive(Default)]
pub(crate) struct Placed {
    loans: Vec<InputLoan>,
    rungs: Vec<Rung>,
    /// Per input: why it did not go by pool pointer.
    reasons: Vec<Option<String>>,
    /// Per input: the arena block holding its copy (arena copy). Dropped before the job is
    /// lent (a later input refused), a block goes back stream-ordered after its copy.
    copies: Vec<Option<ArenaLease>>,
    staged: bool,
}

/// An arena-copy input of a job in flight: the block holding the copy and where to copy it
/// back.
struct ArenaInput {
    /// The block: given back (stream-ordered) when dropped.
    lease: ArenaLease,
    /// The block in this process.
    block: DevicePtr,
    /// The caller's tensor (element 0).
    src: DevicePtr,
    /// Bytes copied in, from element 0 to the end of the last element: copied back as many.
    bytes: u64,
    /// Lent read-only: nothing is copied back.
    read_only: bool,
}

/// An input copied into the arena, its copy queued on the job's stream.
struct ArenaCopy {
    lease: ArenaLease,
    location: ArenaLocation,
    /// The block in this process.
    span: Span,
    /// What made the copy possible, for the reason (free VRAM, or room in the arena).
    why: String,
}

/// A VMM allocation of the caller's lent by handle ([`Rung::VmmHandle`]), as the parent
/// knows it: kept while some worker holds a mapping of it.
struct VmmShared {
    /// The id lent tensors name it by.
    alloc: AllocId,
    /// Its size and `CU_POINTER_ATTRIBUTE_BUFFER_ID` when it was shared: an allocation at
    /// the same address with another of either is another allocation.
    size: u64,
    buffer_id: u64,
    /// The workers it was sent to that have not dropped their mappings.
    sent_to: HashSet<WorkerId>,
}

/// Why an input is not copied into the arena (or lent by VMM handle).
enum NoCopy {
    /// Not for this input, worker or machine, in words: it takes host staging.
    Declined(String),
    /// A driver call failed on the way: the job fails.
    Failed(Error),
}

/// The job an action is about, where it names one.
fn job_of(action: &ParentAction) -> Option<(WorkerId, JobId)> {
    match action {
        ParentAction::RecordReady { worker, job }
        | ParentAction::SendStaged { worker, job, .. }
        | ParentAction::AllocateResult { worker, job, .. }
        | ParentAction::ReceiveStaged { worker, job, .. }
        | ParentAction::WaitDone { worker, job, .. }
        | ParentAction::Release { worker, job, .. }
        | ParentAction::ReleaseSlice { worker, job, .. }
        | ParentAction::FreeResult { worker, job, .. }
        | ParentAction::JobFinished { worker, job, .. } => Some((*worker, *job)),
        ParentAction::Send { .. }
        | ParentAction::KillWorker { .. }
        | ParentAction::WorkerRemoved { .. }
        | ParentAction::ShutdownComplete => None,
    }
}

/// The span an action is carried out in, named for its worker and job: with a subscriber at
/// debug, every event logged while carrying it out says which worker and job it was for.
/// Without one, a span costs a check of a cached interest.
fn action_span(action: &ParentAction) -> tracing::Span {
    if let Some((worker, job)) = job_of(action) {
        return tracing::debug_span!("job", %worker, %job);
    }
    match action {
        ParentAction::Send { worker, .. }
        | ParentAction::KillWorker { worker }
        | ParentAction::WorkerRemoved { worker } => tracing::debug_span!("worker", %worker),
        ParentAction::RecordReady { .. }
        | ParentAction::SendStaged { .. }
        | ParentAction::AllocateResult { .. }
        | ParentAction::ReceiveStaged { .. }
        | ParentAction::WaitDone { .. }
        | ParentAction::Release { .. }
        | ParentAction::ReleaseSlice { .. }
        | ParentAction::FreeResult { .. }
        | ParentAction::JobFinished { .. }
        | ParentAction::ShutdownComplete => tracing::Span::none(),
    }
}

/// The probe's name for an action, marked when it was carried out.
fn action_label(action: &ParentAction) -> &'static str {
    match action {
        ParentAction::RecordReady { .. } => "io.record_ready",
        ParentAction::Send { message, .. } => match message {
            Message::Lend(_) => "io.send_lend",
            Message::Ack(_) => "io.send_ack",
            _ => "io.send",
        },
        ParentAction::SendStaged { .. } => "io.send_staged",
        ParentAction::AllocateResult { .. } => "io.allocate_result",
        ParentAction::ReceiveStaged { .. } => "io.receive_staged",
        ParentAction::WaitDone { .. } => "io.wait_done",
        ParentAction::Release { .. } => "io.release",
        ParentAction::ReleaseSlice { .. } => "io.release_slice",
        ParentAction::FreeResult { .. } => "io.free_result",
        ParentAction::KillWorker { .. } => "io.kill",
        ParentAction::JobFinished { .. } => "io.finished",
        ParentAction::WorkerRemoved { .. } => "io.removed",
        ParentAction::ShutdownComplete => "io.shutdown",
    }
}

/// `bytes` for a person: `16 GiB`, `3.5 GiB`, `64 MiB`, `12 KiB`, `100 bytes`.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if bytes >= unit {
            return if bytes.is_multiple_of(unit) {
                format!("{} {name}", bytes / unit)
            } else {
                // One decimal, rounded down: enough to tell sizes apart in a log line.
                format!("{}.{} {name}", bytes / unit, bytes % unit * 10 / unit)
            };
        }
    }
    format!("{bytes} bytes")
}

/// Why an input does not go by pool pointer, in words (for the log and the error).
fn why_not_pointer(
    shared: &Shared,
    worker: WorkerId,
    pool: Option<(usize, poolipc_driver::PoolHandle)>,
    limit: Option<poolipc_types::LimitExceeded>,
) -> String {
    if let Some(e) = limit {
        return format!(
            "{} over the import limit (it touches {} chunks of {}, pointer import allows at most \
             {})",
            human_bytes(e.bytes),
            e.chunks,
            human_bytes(e.chunk_bytes),
            e.max_chunks
        );
    }
    // The worker's table entry of the pool's generation: (reachable, being retired).
    let entry = |h: poolipc_driver::PoolHandle| {
        lock(&shared.registry).get(&worker).and_then(|r| {
            r.pools
                .values()
                .find(|p| p.handle == h)
                .map(|p| (p.reachable, p.retiring))
        })
    };
    match pool {
        None => "it is not memory of this parent's pools".into(),
        Some((p, h)) => match entry(h) {
            None => format!(
                "{worker} has not been given this generation of the parent's pool {p} (it was \
                 made by a rotation after the worker started, or was offered and refused)"
            ),
            Some((false, true)) | Some((true, true)) => {
                format!("this generation of the parent's pool {p} is being retired")
            }
            Some((false, false)) => {
                format!(
                    "{worker} cannot reach the parent's pool {p} from its device (or has not answered its offer yet)"
                )
            }
            Some((true, false)) => format!("{worker} was demoted by its canary battery"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::{human_bytes, names_gpu_fault};

    #[test]
    fn a_worker_error_naming_a_sticky_cuda_error_counts_as_a_gpu_fault() {
        assert!(names_gpu_fault(
            "the job's kernel faulted: cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)"
        ));
        assert!(names_gpu_fault(
            "RuntimeError: CUDA error: an illegal memory access was encountered"
        ));
        assert!(!names_gpu_fault("ValueError: shapes (3,) and (4,) differ"));
        assert!(!names_gpu_fault("CUDA_ERROR_OUT_OF_MEMORY"));
    }

    #[test]
    fn sizes_read_in_the_largest_unit_with_one_decimal_at_most() {
        assert_eq!(human_bytes(16 << 30), "16 GiB");
        assert_eq!(human_bytes((7 << 29) + 5), "3.5 GiB");
        assert_eq!(human_bytes(64 << 20), "64 MiB");
        assert_eq!(human_bytes((1 << 20) + 3), "1.0 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(100), "100 bytes");
        assert_eq!(human_bytes(u64::MAX), "17179869183.9 GiB");
    }
}
