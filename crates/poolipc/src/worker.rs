//! The worker: the driver of the contract's worker machine ([`poolipc_contract::Worker`]).
//!
//! Every frame from the parent goes into the machine, except the setup frames this side
//! consumes itself (`StagingBuffer` sets host staging up, `ExtraPool` attaches another pool,
//! `ArenaChunk` maps a chunk of the parent's result arena, `Chunk`s belong to the staging
//! transfer that reads them). An arena result is an offset into a mapped chunk: no import,
//! nothing to free. Every action the machine emits
//! is carried out in order, matched exhaustively, and what goes on the wire is exactly what
//! it emitted. The machine imports once per allocation and refcounts it; this side keeps the
//! import cache (one driver import per export blob) under it.
//!
//! The worker runs one job at a time, but the parent may lend later jobs while a job waits
//! for its results' grant: their imports are made as the machine asks, and
//! [`Worker::next_job`] hands them out in order. An input is read-only
//! ([`InputView::read_only`]) when the parent lent it so; otherwise a write reaches the
//! parent's tensor on every rung (copies come back after the job).
//!
//! Nothing here synchronizes with the host: a synchronize after freeing an import unmaps it
//! (docs/facts.md), and the contract orders everything on the GPU timeline through READY and DONE.

mod device;
mod job;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use poolipc_contract::{self as contract, AllocId, HandoffId, Timestamp, WorkerAction};
use poolipc_driver::{
    DevicePtr, Driver, ExportBlob, OwnedEvent, OwnedStream, PoolAllocation, StreamHandle,
};
use poolipc_pool::{
    ArenaError, ArenaMapping, AttachedPool, ImportCache, VmmMappings, VmmShareStats,
};
use poolipc_transport::{
    ArenaChunk, ArenaRelease, Capabilities, Connection, EventBlob, ExtraPool, ExtraPoolReply,
    HandshakeConfig, JobId, LentSlice, LentTensor, Message, PoolRetire, ResultGrant,
    TransportError,
};

pub use device::WorkerDevice;
pub use job::{HeldJob, InputView, Job, ResultView};

use crate::error::Error;
use crate::staging::{StagingChannel, StagingConfig};
use crate::tensor::{Rung, TensorDesc};
use device::{find_device, place, reaches};

/// How long the worker waits for the parent's next frame: between jobs the parent may be
/// idle for long.
const IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long one send may take.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

/// The environment variable naming a failpoint (the `testing` feature): the worker kills itself
/// with SIGKILL when it reaches that step. For tests of what the parent does when a worker dies
/// mid-handoff; unset, it costs one lookup per process. Without the `testing` feature no
/// failpoint exists and the variable means nothing.
///
/// The steps: `before-import`, `before-ready-wait`, `after-import`, `after-grant`,
/// `after-write`, `before-done`, `after-done`, `after-ack`, `before-extra-pool-reply`.
///
/// One value hangs instead of dying: `hang-before-done` launches a kernel that never ends
/// ([`Driver::launch_hang_kernel`](poolipc_driver::Driver::launch_hang_kernel)) on the job's
/// stream right before DONE is recorded, then goes on as usual (Done, Ack): the worker's DONE
/// never completes on the GPU, for tests of what the parent does about that.
/// `hang-before-staged-send` does the same before a host-staged tensor goes back: its
/// `filled` records never complete.
#[cfg(feature = "testing")]
pub const FAILPOINT_ENV: &str = "POOLIPC_FAILPOINT";

/// Whether [`FAILPOINT_ENV`] names `step` (outside the canary battery); never without the
/// `testing` feature.
#[cfg(feature = "testing")]
fn failpoint_armed(step: &str) -> bool {
    if IN_CANARY.with(std::cell::Cell::get) {
        return false;
    }
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    AT.get_or_init(|| std::env::var(FAILPOINT_ENV).ok())
        .as_deref()
        == Some(step)
}

/// Without the `testing` feature no failpoint is ever armed.
#[cfg(not(feature = "testing"))]
#[inline(always)]
fn failpoint_armed(_step: &str) -> bool {
    false
}

/// Dies here (SIGKILL) if [`FAILPOINT_ENV`] names `step` (the `testing` feature). Canary jobs
/// pass failpoints by.
pub(crate) fn failpoint(step: &str) {
    if failpoint_armed(step) {
        tracing::warn!(step, "failpoint reached: the worker kills itself");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
    }
}

/// The environment variable that sets how long a worker looks for its next frame without
/// sleeping after its last one ([`Worker::set_spin`]), in microseconds.
pub const WORKER_SPIN_ENV: &str = "POOLIPC_WORKER_SPIN_US";

/// A worker's spin unless [`WORKER_SPIN_ENV`] says otherwise: 400 µs where the machine has
/// four or more CPUs, none otherwise (the parent's [`crate::ParentOptions::spin`] rule).
fn default_worker_spin() -> Duration {
    if let Some(us) = std::env::var(WORKER_SPIN_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
    {
        return Duration::from_micros(us);
    }
    match std::thread::available_parallelism() {
        Ok(n) if n.get() >= 4 => Duration::from_micros(400),
        _ => Duration::ZERO,
    }
}

thread_local! {
    /// Whether this thread is answering the parent's canary battery.
    static IN_CANARY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While it lives, this thread works on a canary job: failpoints pass by.
struct CanaryScope {
    before: bool,
}

impl CanaryScope {
    fn enter() -> CanaryScope {
        CanaryScope {
            before: IN_CANARY.with(|c| c.replace(true)),
        }
    }
}

impl Drop for CanaryScope {
    fn drop(&mut self) {
        IN_CANARY.with(|c| c.set(self.before));
    }
}

/// A live import: its address here, and the export blob the cache knows it by.
#[derive(Debug)]
struct Import {
    ptr: DevicePtr,
    export: ExportBlob,
}

/// This process's copy of a host-staged tensor: an input received, or a result to send.
#[derive(Debug)]
struct StagedCopy {
    job: JobId,
    alloc: PoolAllocation,
    bytes: u64,
}

impl StagedCopy {
    fn ptr(&self) -> DevicePtr {
        self.alloc.ptr()
    }
}

/// A job the machine started (its inputs usable), not yet handed out.
#[derive(Debug)]
struct Started {
    job: JobId,
    inputs: Vec<LentTensor>,
    slice: Option<LentSlice>,
}

/// What [`Worker::next_job_within`] found.
#[derive(Debug)]
pub enum NextJob<'w> {
    /// A job.
    Job(Job<'w>),
    /// Nothing began to arrive in the time given: ask again.
    Idle,
    /// The parent said goodbye (after the jobs it lent before that) or went away.
    Gone,
}

/// The worker side of poolipc.
///
/// Dropping it frees what it holds: imports still live, its copies of staged tensors, the
/// events it opened or created, the staging buffer, and last its stream.
pub struct Worker {
    driver: Arc<dyn Driver>,
    /// The device this worker works on (see [`Worker::device`]).
    device: u32,
    /// The parent's pools by wire index: 0 the Hello pool, the others by `ExtraPool` (at
    /// spawn, or a new generation after the parent rotated its pool): attached, or why not.
    /// `PoolRetire` takes an entry out (its index may come again).
    pools: BTreeMap<u8, Result<AttachedPool, String>>,
    conn: Connection,
    machine: contract::Worker,
    cache: ImportCache,
    /// Live imports by allocation, as the machine asked for them.
    imports: HashMap<AllocId, Import>,
    /// Imports of canary jobs the driver refused, by allocation, with why: the job fails
    /// with that reason instead of the worker (the export reuse check lends an old blob on
    /// purpose, and a driver that does not map it must not cost the worker).
    failed_imports: HashMap<AllocId, String>,
    /// This process's copies of host-staged tensors, by handoff.
    staged: HashMap<HandoffId, StagedCopy>,
    /// READY events opened, by blob (the parent has a small ring of them per worker).
    ready_events: HashMap<EventBlob, OwnedEvent>,
    done: OwnedEvent,
    done_blob: EventBlob,
    staging: Option<StagingChannel>,
    /// The parent's result arena chunks, mapped as they are announced.
    arena: Option<ArenaMapping<dyn Driver>>,
    /// The parent's VMM allocations lent by handle, mapped once each and kept across jobs
    /// until the parent says to drop them ([`Worker::release_cached_mappings`]).
    vmm: VmmMappings,
    /// Frames that arrived while a staging transfer waited for its chunks: handled before
    /// the socket is read again.
    backlog: VecDeque<Message>,
    /// Jobs started by the machine, not yet handed out, in order.
    started: VecDeque<Started>,
    /// Grants passed by the machine, not yet taken by their job.
    granted: HashMap<JobId, Vec<ResultGrant>>,
    /// Jobs the parent cancelled, until they finish.
    cancelled: HashSet<JobId>,
    /// The parent said Bye: hand out what was started, then no more jobs.
    stopping: bool,
    epoch: Instant,
    /// How long after its last frame (sent or received) the worker polls for the next
    /// without sleeping ([`Worker::set_spin`]).
    spin: Duration,
    /// When the last frame was sent or received.
    last_frame: Instant,
    /// Last, so it is destroyed after everything queued on it.
    stream: OwnedStream,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("driver", &self.driver.kind())
            .field("device", &self.device)
            .field("imports", &self.cache.len())
            .field("queued_jobs", &self.started.len())
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// In a worker the parent spawned: takes the inherited socket (`POOLIPC_FD`), shakes
    /// hands, attaches the pool on `device`.
    pub fn from_env(driver: Arc<dyn Driver>, device: u32) -> Result<Worker, Error> {
        let conn = poolipc_transport::connection_from_env()?;
        Worker::connect(driver, device, conn)
    }

    /// Like [`from_env`](Worker::from_env), on whichever of this process's devices is the
    /// parent's: see [`connect_on_parent_device`](Worker::connect_on_parent_device).
    pub fn from_env_on_parent_device(driver: Arc<dyn Driver>) -> Result<Worker, Error> {
        let conn = poolipc_transport::connection_from_env()?;
        Worker::connect_on_parent_device(driver, conn)
    }

    /// In a worker the parent spawned, on the device `choice` names.
    pub fn from_env_with(driver: Arc<dyn Driver>, choice: WorkerDevice) -> Result<Worker, Error> {
        let conn = poolipc_transport::connection_from_env()?;
        Worker::connect_with(driver, choice, conn)
    }

    /// Shakes hands over `conn` and attaches the pool the parent sends.
    pub fn connect(
        driver: Arc<dyn Driver>,
        device: u32,
        mut conn: Connection,
    ) -> Result<Worker, Error> {
        driver.use_device(device)?;
        let identity = crate::identity(
            &*driver,
            device,
            crate::parent::capabilities(&*driver, device),
        )?;
        let config = HandshakeConfig {
            identity,
            required: Capabilities::NONE,
        };
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let (_peer, pool_fd) = poolipc_transport::worker_handshake(&mut conn, &config, deadline)?;
        Worker::attach(driver, device, conn, pool_fd.as_fd())
    }

    /// Shakes hands over `conn` on the device the parent's pool lives on, found by its UUID
    /// among this process's devices: ordinals differ between processes whose
    /// `CUDA_VISIBLE_DEVICES` differ (`2,0` makes the parent's device 2 this worker's 0), the
    /// UUID does not. A worker that does not see that device refuses the handshake
    /// ([`HandshakeError::DeviceNotVisible`](poolipc_transport::HandshakeError), the parent
    /// gets the refusal) and lists what it does see.
    pub fn connect_on_parent_device(
        driver: Arc<dyn Driver>,
        conn: Connection,
    ) -> Result<Worker, Error> {
        Worker::connect_with(driver, WorkerDevice::Parent, conn)
    }

    /// Shakes hands over `conn` on the device `choice` names. See [`WorkerDevice`].
    pub fn connect_with(
        driver: Arc<dyn Driver>,
        choice: WorkerDevice,
        mut conn: Connection,
    ) -> Result<Worker, Error> {
        let compute = match choice {
            WorkerDevice::Exactly(device) => return Worker::connect(driver, device, conn),
            WorkerDevice::Parent => None,
            WorkerDevice::Any(device) => Some(device),
        };
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let mut chosen = None;
        let (_peer, pool_fd, _config) = poolipc_transport::worker_handshake_choosing(
            &mut conn,
            |parent| {
                let placed = place(&*driver, parent.device, compute)?;
                let identity = placed.identity.clone();
                chosen = Some(placed);
                Ok(HandshakeConfig {
                    identity,
                    required: Capabilities::NONE,
                })
            },
            deadline,
        )?;
        let placed = chosen.ok_or_else(|| {
            Error::Protocol("the handshake succeeded without choosing a device".into())
        })?;
        if placed.compute != placed.pool_device && !placed.peer {
            tracing::warn!(
                device = placed.compute,
                pool_device = placed.pool_device,
                "this device cannot reach the parent's first pool: its tensors take host staging"
            );
        } else {
            tracing::info!(
                device = placed.compute,
                pool_device = placed.pool_device,
                "worker placed"
            );
        }
        driver.use_device(placed.compute)?;
        // Without a peer path the pool is attached on its own device and never touched: the
        // parent sends its tensors by host staging (our capabilities said so).
        let attach_on = if placed.peer {
            placed.compute
        } else {
            placed.pool_device
        };
        let mut worker = Worker::attach(driver, attach_on, conn, pool_fd.as_fd())?;
        worker.device = placed.compute;
        Ok(worker)
    }

    fn attach(
        driver: Arc<dyn Driver>,
        device: u32,
        conn: Connection,
        pool_fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<Worker, Error> {
        let pool = AttachedPool::attach(Arc::clone(&driver), pool_fd, device)?;
        let stream = OwnedStream::new(Arc::clone(&driver))?;
        let done = OwnedEvent::new(Arc::clone(&driver), true)?;
        let done_blob = done.ipc_handle()?;
        let vmm = VmmMappings::new(Arc::clone(&driver), device);
        Ok(Worker {
            device,
            pools: BTreeMap::from([(0, Ok(pool))]),
            driver,
            conn,
            machine: contract::Worker::new(),
            cache: ImportCache::new(),
            imports: HashMap::new(),
            failed_imports: HashMap::new(),
            staged: HashMap::new(),
            ready_events: HashMap::new(),
            done,
            done_blob,
            staging: None,
            arena: None,
            vmm,
            backlog: VecDeque::new(),
            started: VecDeque::new(),
            granted: HashMap::new(),
            cancelled: HashSet::new(),
            stopping: false,
            epoch: Instant::now(),
            spin: default_worker_spin(),
            last_frame: Instant::now(),
            stream,
        })
    }

    /// Drops every mapping of the parent's VMM allocations (the VMM-handle rung) that no
    /// running job uses, after the work of finished jobs completed on this worker's stream:
    /// unmapped, address range freed, import released. Returns how many went.
    ///
    /// A cached mapping keeps the physical memory behind it alive, so VRAM the parent freed
    /// stays held here until this runs. Call it when the parent asks (its `Release`
    /// message): the parent keeps track of what each worker holds and sends the allocation
    /// again before naming it, which it does only after it told the worker to drop its
    /// mappings. Dropping mappings on the worker's own initiative would leave the parent
    /// naming allocations the worker no longer has (those jobs would fail).
    pub fn release_cached_mappings(&mut self) -> Result<usize, Error> {
        self.driver.stream_synchronize(self.stream.handle())?;
        let n = self.vmm.release_unused();
        tracing::debug!(dropped = n, "cached VMM mappings released");
        Ok(n)
    }

    /// How often the parent's VMM allocations were mapped and reused here (the VMM-handle
    /// rung), and how many mappings are held now.
    pub fn vmm_share_stats(&self) -> VmmShareStats {
        self.vmm.stats()
    }

    /// How long, after each frame it sent or received, the worker looks for the parent's
    /// next frame without sleeping (zero: it sleeps at once). A sleeping worker pays a
    /// wake-up when the next job comes (≈ 5–7 µs on the H200's host, a tenth of a handoff
    /// under MPS); spinning costs at most this much CPU after each job. By default
    /// `POOLIPC_WORKER_SPIN_US` if set, else 400 µs where the machine has four or more CPUs,
    /// else zero.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// See [`Worker::set_spin`].
    pub fn spin(&self) -> Duration {
        self.spin
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// This process's ordinal of the device it works on: its stream, events and host-staged
    /// copies live there.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The stream jobs run on.
    pub fn stream(&self) -> StreamHandle {
        self.stream.handle()
    }

    fn now(&self) -> Timestamp {
        Timestamp(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// Waits for the next job. `None` when the parent said goodbye (after the jobs it lent
    /// before that) or went away: the worker should exit.
    ///
    /// The parent's canary jobs are answered in here; user code never sees them. A job the
    /// parent cancelled before it was handed out is finished at once, untouched.
    pub fn next_job(&mut self) -> Result<Option<Job<'_>>, Error> {
        match self.next_job_by(None)? {
            NextJob::Job(job) => Ok(Some(job)),
            NextJob::Idle | NextJob::Gone => Ok(None),
        }
    }

    /// Like [`next_job`](Worker::next_job), waiting at most `wait` for the parent's next
    /// frame: [`NextJob::Idle`] when none began to arrive by then. A frame that began to
    /// arrive is read whole (its own deadline bounds it), so nothing is cut off. For a worker
    /// whose thread has other things to do between jobs (the Python binding's, which serves
    /// the commands of jobs it holds open while it looks for the next one).
    pub fn next_job_within(&mut self, wait: Duration) -> Result<NextJob<'_>, Error> {
        self.next_job_by(Some(Instant::now() + wait))
    }

    fn next_job_by(&mut self, idle_by: Option<Instant>) -> Result<NextJob<'_>, Error> {
        loop {
            if let Some(started) = self.started.pop_front() {
                if self.cancelled.contains(&started.job) {
                    tracing::debug!(job = started.job.0, "cancelled before it started");
                    self.finish_job(started.job)?;
                    continue;
                }
                if crate::canary::is_canary(started.job) {
                    self.answer_canary(started)?;
                    continue;
                }
                let job = self.job(started).map(NextJob::Job);
                crate::probe::mark("w.job");
                return job;
            }
            if self.stopping {
                return Ok(NextJob::Gone);
            }
            if let Some(by) = idle_by
                && self.backlog.is_empty()
                && !self.readable_by(by)?
            {
                return Ok(NextJob::Idle);
            }
            match self.next_frame() {
                Ok((message, fds)) => {
                    crate::probe::mark("w.recv");
                    self.take(message, fds)?;
                }
                Err(e) if e.is_peer_gone() => return Ok(NextJob::Gone),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Whether the parent's socket has something to read (or hung up) by `by`.
    ///
    /// Bytes the connection read already count (a poll would not see them); within the
    /// worker's [spin](Worker::set_spin) it polls without sleeping.
    fn readable_by(&self, by: Instant) -> Result<bool, Error> {
        if self.conn.buffered() {
            return Ok(true);
        }
        let spin_until = (self.last_frame + self.spin).min(by);
        loop {
            let now = Instant::now();
            let spinning = now < spin_until;
            let ms =
                u16::try_from(by.saturating_duration_since(now).as_millis()).unwrap_or(u16::MAX);
            let timeout = if spinning {
                PollTimeout::ZERO
            } else {
                PollTimeout::from(ms)
            };
            let mut pfd = [PollFd::new(self.conn.as_fd(), PollFlags::POLLIN)];
            match poll(&mut pfd, timeout) {
                Ok(0) if spinning => std::hint::spin_loop(),
                Ok(0) if Instant::now() < by => continue,
                Ok(0) => return Ok(false),
                Ok(_) => return Ok(true),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(errno) => {
                    return Err(Error::Protocol(format!(
                        "poll on the parent's socket failed: {errno}"
                    )));
                }
            }
        }
    }

    /// Answers one job of the parent's canary battery as the echo worker does; a job whose
    /// id carries [`CANARY_IN_PLACE_BIT`](crate::canary::CANARY_IN_PLACE_BIT) also writes
    /// [`echo::marker`](crate::echo::marker)`(i)` into the first word of each writable
    /// pool-pointer input `i`, after the copy, for the parent to read back. A job whose
    /// tensors cannot be viewed (an import the driver refused) was failed with the reason
    /// already: the worker goes on.
    fn answer_canary(&mut self, started: Started) -> Result<(), Error> {
        let _canary = CanaryScope::enter();
        let in_place = started.job.0 & crate::canary::CANARY_IN_PLACE_BIT != 0;
        let mut job = match self.job(started) {
            Ok(job) => job,
            Err(e) => {
                tracing::warn!(error = %e, "a canary job failed before it started");
                return Ok(());
            }
        };
        let answered = crate::echo::answer(&mut job, None).and_then(|()| {
            if !in_place {
                return Ok(());
            }
            let (driver, stream) = (job.driver().clone(), job.stream());
            for (i, input) in job.inputs().iter().enumerate() {
                if input.rung() == Rung::PoolPointer && !input.read_only() && input.byte_len() >= 4
                {
                    driver.memset_d32_async(input.ptr(), crate::echo::marker(i), 1, stream)?;
                }
            }
            Ok(())
        });
        match answered {
            Ok(()) => job.finish(),
            Err(e) => job.fail(&e.to_string()),
        }
    }

    /// The job as user code sees it. Should a view fail to build, the job is reported failed
    /// with the reason and finished (what it holds is given back), and the error returned.
    fn job(&mut self, started: Started) -> Result<Job<'_>, Error> {
        let Started {
            job: id,
            inputs,
            slice,
        } = started;
        // The slice's address here; one this worker cannot resolve is left alone (its
        // results are asked for instead), never an error: a slice is an optimisation.
        let slice_base = slice.and_then(|s| {
            self.arena_memory(s.chunk, s.offset, s.bytes, s.bytes)
                .inspect_err(|e| {
                    tracing::debug!(job = id.0, error = %e, "the job's arena slice is not usable here");
                })
                .ok()
        });
        let mut job = Job {
            worker: self,
            id,
            inputs: Vec::with_capacity(inputs.len()),
            results: Vec::new(),
            slice: slice_base,
            finished: false,
        };
        for t in inputs {
            match job.worker.input_view(id, t) {
                Ok(view) => job.inputs.push(view),
                Err(e) => {
                    let why = format!("a tensor of the job could not be viewed: {e}");
                    if let Err(f) = job.fail(&why) {
                        tracing::warn!(job = id.0, error = %f, "failing a job failed");
                    }
                    return Err(e);
                }
            }
        }
        Ok(job)
    }

    /// The view of one lent tensor: the import at its offset (pool pointer), the parent's
    /// copy in the arena through this worker's mapping (arena copy, read-only), or this
    /// process's copy (host staging, read-only).
    fn input_view(&mut self, job: contract::JobId, t: LentTensor) -> Result<InputView, Error> {
        let ptr = match t.rung {
            Rung::PoolPointer => match self.imports.get(&t.alloc) {
                Some(i) => i.ptr.offset(t.meta.byte_offset),
                None => {
                    return Err(match self.failed_imports.get(&t.alloc) {
                        Some(why) => Error::InvalidTensor(format!(
                            "input {:?}: the import of allocation {:?} failed: {why}",
                            t.handle, t.alloc
                        )),
                        None => Error::Protocol(format!(
                            "input {:?}: allocation {:?} is not imported",
                            t.handle, t.alloc
                        )),
                    });
                }
            },
            Rung::HostStaging => {
                self.staged
                    .get(&t.handle)
                    .map(StagedCopy::ptr)
                    .ok_or_else(|| {
                        Error::Protocol(format!("staged input {:?} was never received", t.handle))
                    })?
            }
            Rung::ArenaCopy => {
                let Some(at) = t.arena else {
                    return Err(Error::Protocol(format!(
                        "arena-copy input {:?} without its arena location",
                        t.handle
                    )));
                };
                // The block holds the tensor's bytes from its byte offset on: all of it must
                // lie inside a chunk this worker mapped.
                let len = t
                    .meta
                    .byte_offset
                    .checked_add(t.meta.byte_len)
                    .ok_or_else(|| {
                        Error::Protocol(format!(
                            "arena-copy input {:?}: byte offset {} and length {} overflow",
                            t.handle, t.meta.byte_offset, t.meta.byte_len
                        ))
                    })?;
                let mapping = self
                    .arena
                    .as_mut()
                    .ok_or(Error::Arena(ArenaError::UnknownChunk { chunk: at.chunk }))?;
                // Lent read-only: through the chunk's read-only mapping, so a write faults.
                let block = if t.read_only {
                    mapping.resolve_read_only(at.chunk, at.offset, len)?
                } else {
                    mapping.resolve(at.chunk, at.offset, len)?
                };
                block.offset(t.meta.byte_offset)
            }
            // The parent's VMM allocation through the mapping its share made (once, or long
            // ago): held for this job until its DONE is recorded.
            Rung::VmmHandle => self.vmm.resolve(
                job,
                t.alloc,
                t.meta.byte_offset,
                t.meta.byte_len,
                t.read_only,
            )?,
            other => {
                return Err(Error::Protocol(format!(
                    "input {:?} on rung {other}, which this worker does not take",
                    t.handle
                )));
            }
        };
        Ok(InputView {
            ptr,
            desc: TensorDesc::from_meta(&t.meta),
            byte_len: t.meta.byte_len,
            rung: t.rung,
            read_only: t.read_only,
        })
    }

    /// The memory of one granted result: the import (pool pointer), or memory of this
    /// process sent to the parent when the job finishes (host staging).
    fn result_memory(
        &mut self,
        job: JobId,
        handle: HandoffId,
        alloc: AllocId,
        rung: Rung,
        bytes: u64,
    ) -> Result<DevicePtr, Error> {
        match rung {
            Rung::PoolPointer => self.imports.get(&alloc).map(|i| i.ptr).ok_or_else(|| {
                Error::Protocol(format!(
                    "result {handle:?} of job {}: allocation {alloc:?} is not imported",
                    job.0
                ))
            }),
            Rung::HostStaging => {
                let alloc = PoolAllocation::new(
                    Arc::clone(&self.driver),
                    bytes.max(1),
                    self.stream.handle(),
                )?;
                let ptr = alloc.ptr();
                self.staged.insert(handle, StagedCopy { job, alloc, bytes });
                Ok(ptr)
            }
            other => Err(Error::Protocol(format!(
                "result {handle:?} on rung {other}, which this worker does not take"
            ))),
        }
    }

    /// The address of an arena result: `bytes` at `offset` of chunk `chunk`, which must lie
    /// inside a chunk this worker mapped and hold the `needed` bytes asked for. Anything
    /// else is malformed input: a typed error, nothing touched.
    fn arena_memory(
        &self,
        chunk: u32,
        offset: u64,
        bytes: u64,
        needed: u64,
    ) -> Result<DevicePtr, Error> {
        let mapping = self
            .arena
            .as_ref()
            .ok_or(Error::Arena(ArenaError::UnknownChunk { chunk }))?;
        let ptr = mapping.resolve(chunk, offset, bytes)?;
        if bytes < needed {
            return Err(Error::Protocol(format!(
                "an arena grant of {bytes} bytes (chunk {chunk}, offset {offset}) for a result \
                 of {needed}"
            )));
        }
        Ok(ptr)
    }

    /// Maps a chunk of the parent's result arena from the FD that came with its frame.
    fn take_arena_chunk(&mut self, c: ArenaChunk, fds: Vec<OwnedFd>) -> Result<(), Error> {
        let Some(fd) = fds.into_iter().next() else {
            return Err(Error::Protocol("an ArenaChunk without its FD".into()));
        };
        let (driver, device) = (Arc::clone(&self.driver), self.device);
        let mapping = self
            .arena
            .get_or_insert_with(|| ArenaMapping::new(driver, device));
        let base = mapping.map_chunk(c.index, c.len, fd.as_fd())?;
        tracing::debug!(chunk = c.index, len = c.len, ?base, "arena chunk mapped");
        Ok(())
    }

    /// Unmaps a chunk of the parent's arena that the parent gave back to the device, and says
    /// so. No block in it is lent or granted (the parent releases only idle chunks), so no
    /// work of this worker's can still reach it. A chunk never mapped here is answered too.
    fn release_arena_chunk(&mut self, r: ArenaRelease) -> Result<(), Error> {
        match self.arena.as_mut().map(|m| m.unmap_chunk(r.index)) {
            Some(Ok(())) => tracing::debug!(chunk = r.index, "arena chunk unmapped"),
            None | Some(Err(ArenaError::UnknownChunk { .. })) => {
                tracing::debug!(
                    chunk = r.index,
                    "a released arena chunk that was not mapped here"
                );
            }
            // The chunk is forgotten either way; what could not be undone is logged inside.
            Some(Err(e)) => {
                tracing::warn!(chunk = r.index, error = %e, "unmapping a released arena chunk failed")
            }
        }
        self.conn.send(
            &Message::ArenaReleased(r),
            &[],
            Instant::now() + SEND_TIMEOUT,
        )?;
        self.last_frame = Instant::now();
        Ok(())
    }

    /// The next frame from the parent: the backlog first, then the socket.
    fn next_frame(&mut self) -> Result<(Message, Vec<OwnedFd>), TransportError> {
        if let Some(message) = self.backlog.pop_front() {
            return Ok((message, Vec::new()));
        }
        self.spin_for_frame();
        let frame = self.conn.recv(Instant::now() + IDLE_TIMEOUT);
        self.last_frame = Instant::now();
        frame
    }

    /// Polls the socket without sleeping until a frame begins to arrive or
    /// [`spin`](Worker::set_spin) has passed since the last frame; the blocking read then
    /// finds the frame there instead of paying a wake-up.
    fn spin_for_frame(&self) {
        let until = self.last_frame + self.spin;
        if Instant::now() < until {
            // A poll error shows again in the read, which says what it is.
            let _ = self.readable_by(until);
        }
    }

    /// Handles one frame from the parent: setup frames here, every other one through the
    /// machine, whose actions are then carried out.
    fn take(&mut self, message: Message, fds: Vec<OwnedFd>) -> Result<(), Error> {
        match message {
            Message::StagingBuffer(setup) => {
                let mut ch = StagingChannel::setup_worker(
                    Arc::clone(&self.driver),
                    &mut self.conn,
                    &setup,
                    fds,
                    StagingConfig::default(),
                )?;
                self.backlog.extend(ch.take_backlog());
                tracing::debug!(chunk = ch.chunk(), "host staging set up");
                self.staging = Some(ch);
                Ok(())
            }
            Message::ExtraPool(offer) => {
                let Some(fd) = fds.into_iter().next() else {
                    return Err(Error::Protocol("an ExtraPool without its FD".into()));
                };
                self.take_extra_pool(offer, fd)
            }
            Message::ArenaChunk(c) => self.take_arena_chunk(c, fds),
            Message::ArenaRelease(r) => self.release_arena_chunk(r),
            Message::PoolRetire(r) => self.retire_pool(r),
            Message::ReleaseMappings => {
                let dropped = self.release_cached_mappings()?;
                self.conn.send(
                    &Message::MappingsReleased {
                        dropped: u32::try_from(dropped).unwrap_or(u32::MAX),
                    },
                    &[],
                    Instant::now() + SEND_TIMEOUT,
                )?;
                self.last_frame = Instant::now();
                Ok(())
            }
            Message::VmmShare(s) => {
                let Some(fd) = fds.into_iter().next() else {
                    return Err(Error::Protocol("a VmmShare without its FD".into()));
                };
                // A share that cannot be mapped fails the jobs that name it, not the worker.
                if let Err(e) = self.vmm.share(s.alloc, s.base, s.len, fd.as_fd()) {
                    let e = Error::from(e);
                    if e.is_context_lost() {
                        return Err(e);
                    }
                    tracing::warn!(alloc = ?s.alloc, len = s.len, error = %e, "a VMM allocation of the parent could not be mapped");
                }
                Ok(())
            }
            Message::Chunk(c) => Err(Error::Protocol(format!(
                "a Chunk of job {} outside a host-staging transfer",
                c.job.0
            ))),
            Message::StagingReady { .. } => {
                Err(Error::Protocol("a StagingReady from the parent".into()))
            }
            message => {
                // A canary's lend imports and waits here, before its job is answered.
                let canary =
                    matches!(&message, Message::Lend(l) if crate::canary::is_canary(l.job));
                let _canary = canary.then(CanaryScope::enter);
                let now = self.now();
                self.machine.handle(message, now)?;
                crate::probe::mark("w.contract");
                self.drain()
            }
        }
    }

    /// Carries out every action the machine has queued, in order.
    fn drain(&mut self) -> Result<(), Error> {
        while let Some(action) = self.machine.poll_action() {
            tracing::trace!(?action, "contract action");
            let label = if crate::probe::enabled() {
                action_label(&action)
            } else {
                ""
            };
            self.act(action)?;
            if !label.is_empty() {
                crate::probe::mark(label);
            }
        }
        Ok(())
    }

    fn act(&mut self, action: WorkerAction) -> Result<(), Error> {
        let span = action_span(&action);
        let _in_span = span.enter();
        let stream = self.stream.handle();
        match action {
            WorkerAction::Import {
                job,
                handoff,
                alloc,
                pool,
                export,
            } => {
                failpoint("before-import");
                if self.imports.contains_key(&alloc) {
                    return Err(Error::Protocol(format!(
                        "the contract imported allocation {alloc:?} twice"
                    )));
                }
                let pool = self.pool_handle(pool)?;
                // The cache is keyed by blob, and since export reuse a blob may name a new
                // allocation at an old one's address: the parent lends a recycled address
                // of the same size with the blob it exported for the earlier allocation (the
                // driver's blob of an address and size is the same bytes anyway). That is
                // sound here: an entry lives only while a handoff of this worker uses it
                // (freed at the last Unimport, before DONE), so a blob found in the cache
                // names the allocation lent now, whose range it maps, and nothing here ties
                // a blob to one allocation beyond that. Ordering is unchanged: the parent
                // frees the old allocation only after our ACK, its consumer stream waiting
                // on our DONE first; the pool hands the address out again only after that
                // free (stream order on that stream, the free's completion or its event
                // dependency on another); the parent records READY after it allocated and
                // wrote the new one; we touch it only after waiting on that READY. So even
                // with the old allocation's DONE not yet complete on the GPU when the
                // address is reused, every access of ours through the old blob is ordered
                // after it.
                let ptr = match self.cache.acquire(Arc::clone(&self.driver), pool, &export) {
                    Ok(ptr) => ptr,
                    Err(e) if crate::canary::is_canary(job) => {
                        tracing::warn!(job = job.0, ?alloc, error = %e, "a canary's import failed");
                        self.failed_imports.insert(alloc, e.to_string());
                        return Ok(());
                    }
                    Err(e) => return Err(e.into()),
                };
                tracing::trace!(job = job.0, ?handoff, ?alloc, ?ptr, "imported");
                self.imports.insert(alloc, Import { ptr, export });
            }
            WorkerAction::WaitReady { job, ready_event } => {
                failpoint("before-ready-wait");
                let event = match self.ready_events.get(&ready_event) {
                    Some(e) => e.handle(),
                    None => {
                        let e = OwnedEvent::open_ipc(Arc::clone(&self.driver), &ready_event)?;
                        let h = e.handle();
                        self.ready_events.insert(ready_event, e);
                        h
                    }
                };
                tracing::trace!(job = job.0, "waiting on READY");
                self.driver.stream_wait_event(stream, event)?;
            }
            WorkerAction::ReceiveStaged { job, handoff, meta } => {
                let bytes = meta.byte_len;
                let alloc = PoolAllocation::new(Arc::clone(&self.driver), bytes.max(1), stream)?;
                let dst = alloc.ptr();
                self.staged
                    .insert(handoff, StagedCopy { job, alloc, bytes });
                let ch = self.staging.as_mut().ok_or_else(|| {
                    Error::Protocol("a staged input before host staging was set up".into())
                })?;
                let received = ch.recv_tensor(&mut self.conn, job, handoff, dst, bytes, stream);
                self.backlog.extend(ch.take_backlog());
                received?;
            }
            WorkerAction::JobStarted { job, inputs, slice } => {
                self.started.push_back(Started { job, inputs, slice });
            }
            WorkerAction::ResultsGranted { job, results } => {
                if self.granted.insert(job, results).is_some() {
                    return Err(Error::Protocol(format!(
                        "two grants for job {} before it took one",
                        job.0
                    )));
                }
            }
            WorkerAction::Unimport { alloc } => {
                if self.failed_imports.remove(&alloc).is_some() {
                    return Ok(());
                }
                let Some(import) = self.imports.remove(&alloc) else {
                    return Err(Error::Protocol(format!(
                        "the contract freed allocation {alloc:?}, which is not imported"
                    )));
                };
                self.cache.release(&import.export, stream)?;
            }
            WorkerAction::RecordDone { job } => {
                failpoint("before-done");
                if failpoint_armed("hang-before-done") {
                    tracing::warn!(
                        job = job.0,
                        "failpoint reached: DONE goes behind a kernel that never ends"
                    );
                    self.driver.launch_hang_kernel(stream)?;
                }
                tracing::trace!(job = job.0, "recording DONE");
                if let Err(e) = self.driver.event_record(self.done.handle(), stream) {
                    // Without DONE the parent can never be ordered after this job's work:
                    // the context is most likely lost (a GPU fault, a write into read-only
                    // memory). Hang up so the parent fails the job now, as a lost worker's,
                    // rather than at its deadline.
                    tracing::error!(job = job.0, error = %e, "DONE cannot be recorded: hanging up");
                    self.conn.hang_up();
                    return Err(e.into());
                }
                // Its accesses through the parent's VMM allocations are ordered before DONE.
                self.vmm.job_done(job);
            }
            WorkerAction::Send(message) => {
                // DONE and the ACK right behind it (nothing staged between) go in one write:
                // one system call here, one wake-up and read at the parent. Not with the
                // failpoint between them armed, which must die with only DONE sent.
                let ack = match (&message, self.machine.peek_action()) {
                    (Message::Done(_), Some(WorkerAction::Send(Message::Ack(_))))
                        if !failpoint_armed("after-done") =>
                    {
                        self.machine.poll_action()
                    }
                    _ => None,
                };
                let deadline = Instant::now() + SEND_TIMEOUT;
                match &ack {
                    Some(WorkerAction::Send(ack)) => {
                        self.conn.send_many(&[&message, ack], deadline)?;
                    }
                    _ => self.conn.send(&message, &[], deadline)?,
                }
                self.last_frame = Instant::now();
                if let Message::Done(_) = message {
                    failpoint("after-done");
                }
                if ack.is_some() || matches!(message, Message::Ack(_)) {
                    failpoint("after-ack");
                }
            }
            WorkerAction::SendStaged { job, handoff } => {
                let Some(copy) = self.staged.remove(&handoff) else {
                    return Err(Error::Protocol(format!(
                        "staged tensor {handoff:?} of job {} has no memory here",
                        job.0
                    )));
                };
                if failpoint_armed("hang-before-staged-send") {
                    tracing::warn!(
                        job = job.0,
                        "failpoint reached: the staged send goes behind a kernel that never ends"
                    );
                    self.driver.launch_hang_kernel(stream)?;
                }
                let ch = self.staging.as_mut().ok_or_else(|| {
                    Error::Protocol("a staged result without host staging".into())
                })?;
                let sent =
                    ch.send_tensor(&mut self.conn, job, handoff, copy.ptr(), copy.bytes, stream);
                self.backlog.extend(ch.take_backlog());
                // Stream-ordered after the copies out of it.
                self.free_copy(copy);
                sent?;
            }
            WorkerAction::Cancelled { job } => {
                tracing::debug!(job = job.0, "the parent cancelled the job");
                self.cancelled.insert(job);
            }
            WorkerAction::Stop => {
                tracing::debug!("the parent said goodbye");
                self.stopping = true;
            }
        }
        Ok(())
    }

    /// Waits until the machine passed the grants of `job`'s result request, handling every
    /// frame that comes first (lends of later jobs are queued).
    fn wait_for_grants(&mut self, job: JobId) -> Result<Vec<ResultGrant>, Error> {
        loop {
            if let Some(grants) = self.granted.remove(&job) {
                return Ok(grants);
            }
            let (message, fds) = self.next_frame()?;
            self.take(message, fds)?;
        }
    }

    /// The job's last access is queued: the machine's finish (unimports, DONE, Done, staged
    /// results, Ack), then this process's copies of its staged tensors are freed.
    fn finish_job(&mut self, job: JobId) -> Result<(), Error> {
        crate::probe::mark("w.finish");
        let finished = self
            .machine
            .finish_job(job, self.done_blob)
            .map_err(Error::from)
            .and_then(|()| self.drain());
        let copies: Vec<HandoffId> = self
            .staged
            .iter()
            .filter(|(_, c)| c.job == job)
            .map(|(h, _)| *h)
            .collect();
        for h in copies {
            if let Some(copy) = self.staged.remove(&h) {
                self.free_copy(copy);
            }
        }
        self.cancelled.remove(&job);
        self.granted.remove(&job);
        finished
    }

    /// Frees a staged copy, stream-ordered; a failure is logged (the memory is ours).
    fn free_copy(&self, copy: StagedCopy) {
        let (job, ptr) = (copy.job, copy.ptr());
        if let Err(e) = copy.alloc.free(self.stream.handle()) {
            tracing::warn!(job = job.0, ?ptr, error = %e, "freeing a staged copy failed");
        }
    }

    /// Attaches another of the parent's pools if this worker's device can use it, and says so.
    fn take_extra_pool(&mut self, offer: ExtraPool, fd: OwnedFd) -> Result<(), Error> {
        if offer.index == 0 || self.pools.contains_key(&offer.index) {
            return Err(Error::Protocol(format!(
                "ExtraPool {} where that index is taken (free indices are 1..=255 not in use)",
                offer.index
            )));
        }
        failpoint("before-extra-pool-reply");
        let attached = self.attach_extra_pool(offer.device, &fd);
        let reply = ExtraPoolReply {
            index: offer.index,
            reachable: attached.is_ok(),
            reason: attached.as_ref().err().cloned().unwrap_or_default(),
        };
        match &attached {
            Ok(_) => tracing::debug!(
                index = offer.index,
                "attached another of the parent's pools"
            ),
            Err(why) => {
                tracing::info!(index = offer.index, %why, "cannot use one of the parent's pools")
            }
        }
        self.pools.insert(offer.index, attached);
        self.conn.send(
            &Message::ExtraPoolReply(reply),
            &[],
            Instant::now() + SEND_TIMEOUT,
        )?;
        Ok(())
    }

    fn attach_extra_pool(
        &self,
        uuid: poolipc_transport::DeviceUuid,
        fd: &OwnedFd,
    ) -> Result<AttachedPool, String> {
        let d = &*self.driver;
        let pool_device = find_device(d, uuid).map_err(|e| e.to_string())?;
        if !reaches(d, self.device, pool_device)? {
            return Err(format!(
                "device {} cannot reach device {pool_device} ({uuid}): no peer path",
                self.device
            ));
        }
        // Access from the device this worker works on (a peer grant when it is another).
        AttachedPool::attach(Arc::clone(&self.driver), fd.as_fd(), self.device)
            .map_err(|e| e.to_string())
    }

    /// The imported handle of the parent's pool `index`.
    fn pool_handle(&self, index: u8) -> Result<poolipc_driver::PoolHandle, Error> {
        match self.pools.get(&index) {
            Some(Ok(p)) => Ok(p.pool.handle()),
            Some(Err(why)) => Err(Error::Protocol(format!(
                "a tensor by pointer from the parent's pool {index}, which this worker cannot use ({why})"
            ))),
            None => Err(Error::Protocol(format!(
                "a tensor by pointer from the parent's pool {index}, never offered (or retired)"
            ))),
        }
    }

    /// Destroys this worker's import of the parent's pool `index`, which the parent retired
    /// (nothing of it is in use: no import of it can be live here), and says so. An index not
    /// in the table is answered too. The pool's exported memory goes back to the device once
    /// the parent and every worker that imported it destroyed theirs.
    fn retire_pool(&mut self, r: PoolRetire) -> Result<(), Error> {
        match self.pools.remove(&r.index) {
            Some(Ok(p)) => {
                if let Err(e) = p.pool.close() {
                    let e = Error::from(e);
                    if e.is_context_lost() {
                        return Err(e);
                    }
                    tracing::warn!(index = r.index, error = %e, "destroying a retired pool's import failed");
                } else {
                    tracing::debug!(index = r.index, "retired pool's import destroyed");
                }
            }
            Some(Err(_)) | None => {
                tracing::debug!(index = r.index, "a retired pool that was not attached here");
            }
        }
        self.conn
            .send(&Message::PoolRetired(r), &[], Instant::now() + SEND_TIMEOUT)?;
        self.last_frame = Instant::now();
        Ok(())
    }
}

impl Drop for Worker {
    /// Frees what is still held, stream-ordered and without synchronizing: imports (a
    /// worker dropped mid-job, or one whose parent vanished), copies of staged tensors. The
    /// events, the staging buffer and the stream go with the fields, the stream last.
    fn drop(&mut self) {
        crate::probe::dump();
        let stream = self.stream.handle();
        if let Some(mapping) = self.arena.take() {
            // Unmapping under work still queued on the chunks would fault it: let the
            // stream's work finish first.
            if !mapping.is_empty()
                && let Err(e) = self.driver.stream_synchronize(stream)
            {
                tracing::warn!(error = %e, "synchronizing before unmapping the arena failed");
            }
            drop(mapping);
        }
        for (_, copy) in self.staged.drain() {
            let ptr = copy.ptr();
            if let Err(e) = copy.alloc.free(stream) {
                tracing::warn!(?ptr, error = %e, "freeing a staged copy failed");
            }
        }
        self.imports.clear();
        let freed = self.cache.free_all(stream);
        if freed > 0 {
            tracing::debug!(
                freed,
                "imports still live when the worker was dropped: freed"
            );
        }
    }
}

/// The span an action is carried out in, named for its job: with a subscriber at debug, every
/// event logged while carrying it out says which job it was for.
fn action_span(action: &WorkerAction) -> tracing::Span {
    match action {
        WorkerAction::Import { job, .. }
        | WorkerAction::WaitReady { job, .. }
        | WorkerAction::ReceiveStaged { job, .. }
        | WorkerAction::JobStarted { job, .. }
        | WorkerAction::ResultsGranted { job, .. }
        | WorkerAction::RecordDone { job }
        | WorkerAction::SendStaged { job, .. }
        | WorkerAction::Cancelled { job } => tracing::debug_span!("job", %job),
        WorkerAction::Unimport { .. } | WorkerAction::Send(_) | WorkerAction::Stop => {
            tracing::Span::none()
        }
    }
}

/// The probe's name for a worker action, marked when it was carried out.
fn action_label(action: &WorkerAction) -> &'static str {
    match action {
        WorkerAction::Import { .. } => "w.import",
        WorkerAction::WaitReady { .. } => "w.wait_ready",
        WorkerAction::ReceiveStaged { .. } => "w.receive_staged",
        WorkerAction::JobStarted { .. } => "w.started",
        WorkerAction::ResultsGranted { .. } => "w.granted",
        WorkerAction::Unimport { .. } => "w.unimport",
        WorkerAction::RecordDone { .. } => "w.record_done",
        WorkerAction::Send(Message::Done(_)) => "w.send_done",
        WorkerAction::Send(_) => "w.send",
        WorkerAction::SendStaged { .. } => "w.send_staged",
        WorkerAction::Cancelled { .. } => "w.cancelled",
        WorkerAction::Stop => "w.stop",
    }
}
