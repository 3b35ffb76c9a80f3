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

mod canary;
mod device;
mod failpoint;
mod frames;
mod job;
mod memory;
#[cfg(test)]
mod protocol_tests;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use poolipc_contract::{self as contract, AllocId, HandoffId, Timestamp};
use poolipc_driver::{
    DevicePtr, Driver, ExportBlob, OwnedEvent, OwnedStream, PoolAllocation, StreamHandle,
};
use poolipc_pool::{ArenaMapping, AttachedPool, ImportCache, VmmMappings, VmmShareStats};
use poolipc_transport::{
    Capabilities, Connection, EventBlob, HandshakeConfig, JobId, LentSlice, LentTensor, Message,
    ResultGrant,
};

pub use device::WorkerDevice;
#[cfg(feature = "testing")]
pub use failpoint::FAILPOINT_ENV;
pub(crate) use failpoint::failpoint;
use failpoint::{CanaryScope, failpoint_armed};
pub use job::{HeldJob, InputView, Job, ResultView};

use crate::error::Error;
use crate::staging::StagingChannel;
use device::place;

/// How long the worker waits for the parent's next frame: between jobs the parent may be
/// idle for long.
const IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long one send may take.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

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
    /// The simulated driver's race checker; `None` on the GPU.
    pub(crate) sim: Option<Arc<crate::check::Sim>>,
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
    /// hands, attaches the pool on the device `device` names: an ordinal (`0`, the parent's
    /// device as this process numbers it) or any [`WorkerDevice`].
    pub fn from_env(
        driver: Arc<dyn Driver>,
        device: impl Into<WorkerDevice>,
    ) -> Result<Worker, Error> {
        let conn = poolipc_transport::connection_from_env()?;
        Worker::connect(driver, device, conn)
    }

    /// Shakes hands over `conn` on the device `device` names (an ordinal or any
    /// [`WorkerDevice`]) and attaches the pool the parent sends.
    pub fn connect(
        driver: Arc<dyn Driver>,
        device: impl Into<WorkerDevice>,
        conn: Connection,
    ) -> Result<Worker, Error> {
        Worker::connect_to(driver, device.into(), conn)
    }

    /// [`connect`](Worker::connect) on exactly the ordinal `device`.
    fn connect_exactly(
        driver: Arc<dyn Driver>,
        device: u32,
        mut conn: Connection,
    ) -> Result<Worker, Error> {
        driver.use_device(device)?;
        let identity = crate::handshake::identity(
            &*driver,
            device,
            crate::settings::worker_capabilities(&*driver, device),
        )?;
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let (peer, pool_fd, _config) = poolipc_transport::worker_handshake_choosing(
            &mut conn,
            |parent| {
                let mut identity = identity;
                if !lends_pointers(parent) {
                    // An isolated worker: say so, as the parent offers nothing of the kind.
                    identity.capabilities = identity
                        .capabilities
                        .missing_from(crate::settings::PARENT_MEMORY_HANDLES);
                }
                Ok(HandshakeConfig {
                    identity,
                    required: Capabilities::NONE,
                })
            },
            deadline,
        )?;
        let pool_fd = lends_pointers(&peer.identity).then(|| pool_fd.as_fd());
        Worker::attach(driver, device, conn, pool_fd)
    }

    /// [`connect`](Worker::connect) on the device `choice` names.
    fn connect_to(
        driver: Arc<dyn Driver>,
        choice: WorkerDevice,
        mut conn: Connection,
    ) -> Result<Worker, Error> {
        let compute = match choice {
            WorkerDevice::Exactly(device) => return Worker::connect_exactly(driver, device, conn),
            WorkerDevice::Parent => None,
            WorkerDevice::Any(device) => Some(device),
        };
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let mut chosen = None;
        let (peer, pool_fd, _config) = poolipc_transport::worker_handshake_choosing(
            &mut conn,
            |parent| {
                let mut placed = place(&*driver, parent.device, compute)?;
                if !lends_pointers(parent) {
                    // An isolated worker: say so, as the parent offers nothing of the kind.
                    placed.identity.capabilities = placed
                        .identity
                        .capabilities
                        .missing_from(crate::settings::PARENT_MEMORY_HANDLES);
                }
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
        let pool_fd = lends_pointers(&peer.identity).then(|| pool_fd.as_fd());
        let mut worker = Worker::attach(driver, attach_on, conn, pool_fd)?;
        worker.device = placed.compute;
        Ok(worker)
    }

    fn attach(
        driver: Arc<dyn Driver>,
        device: u32,
        conn: Connection,
        pool_fd: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<Worker, Error> {
        // An isolated worker's Hello carries no pool (a sealed empty memfd stands in for it):
        // nothing to attach, and no pointer of the parent's will be lent.
        let pool = match pool_fd {
            Some(fd) => Ok(AttachedPool::attach(Arc::clone(&driver), fd, device)?),
            None => Err("the parent isolates this worker: it lends no pool".to_owned()),
        };
        let stream = OwnedStream::new(Arc::clone(&driver))?;
        let sim = crate::check::Sim::of(&driver, "this worker");
        if let Some(sim) = &sim {
            sim.name(std::os::unix::process::parent_id(), "the parent");
            sim.label_stream(stream.handle(), "the worker's job stream");
        }
        let done = OwnedEvent::new(Arc::clone(&driver), true)?;
        let done_blob = done.ipc_handle()?;
        let vmm = VmmMappings::new(Arc::clone(&driver), device);
        crate::warm::copies_if_asked(&driver, "worker", crate::settings::worker_warm_copies());
        Ok(Worker {
            device,
            pools: BTreeMap::from([(0, pool)]),
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
            spin: crate::settings::worker_spin(),
            last_frame: Instant::now(),
            stream,
            sim,
        })
    }

    /// Drops every mapping of the parent's VMM allocations (the VMM-handle rung) that no
    /// running job uses, after the work of finished jobs completed on this worker's stream:
    /// unmapped, address range freed, import released. Returns how many went.
    ///
    /// A cached mapping keeps the physical memory behind it alive, so VRAM the parent freed
    /// stays held here until this runs. It runs when the parent asks (its `ReleaseMappings`
    /// message, answered by the worker's loop): the parent keeps track of what each worker
    /// holds and sends the allocation again before naming it, which it does only after it
    /// told the worker to drop its mappings. Dropping mappings on the worker's own initiative
    /// would leave the parent naming allocations the worker no longer has (those jobs would
    /// fail), so this is not the user's to call.
    pub(crate) fn release_cached_mappings(&mut self) -> Result<usize, Error> {
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

    /// The driver (the facade's own code; callers reach it through
    /// [`RawDriver`](crate::advanced::RawDriver)).
    pub(crate) fn driver_ref(&self) -> &Arc<dyn Driver> {
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
                Ok(0) if spinning => crate::spin::pause(),
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
        if job.worker.sim.is_some() {
            let stream = job.worker.stream.handle();
            for (i, v) in job.inputs.iter().enumerate() {
                job.worker.driver.sim_lend(
                    id.0,
                    v.ptr,
                    v.byte_len,
                    stream,
                    v.read_only,
                    &format!("input {i} of job {}", id.0),
                );
            }
        }
        Ok(job)
    }
}

/// Whether the parent whose identity this is lends pool pointers (an isolated worker's parent
/// does not: its Hello's descriptor is no pool).
fn lends_pointers(parent: &poolipc_transport::Identity) -> bool {
    parent.capabilities.contains(Capabilities::POOL_POINTER)
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
        // On the simulated driver: every violation this process made that no one reported
        // yet (see `crate::check`), on stderr.
        if let Some(sim) = &self.sim {
            sim.summary(&[std::process::id()]);
        }
    }
}
