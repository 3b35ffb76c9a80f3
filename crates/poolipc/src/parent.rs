//! The parent: owns the shared pool, spawns workers, lends inputs, allocates results.

use std::collections::{BTreeMap, HashMap};
use std::process::{Child, Command, ExitStatus};
use std::sync::Arc;
use std::time::{Duration, Instant};

use poolipc_contract::{
    self as contract, AllocId, FailReason, HandoffId, Outcome, ParentAction, ParentEvent, Purpose,
    RequestId, Span, Timestamp, ToParent, ToWorker, WorkerId,
};
use poolipc_driver::{DevicePtr, Driver, EventHandle, StreamHandle};
use poolipc_pool::{ImportLimit, SharedPool};
use poolipc_transport::{
    AllocationGrant, Capabilities, Connection, ErrorCode, EventBlob, ExportBlob, ExtraPool,
    HandshakeConfig, Identity, JobId, Lend, LentTensor, Message, ResultGrant, Rung as WireRung,
};

use crate::canary::CanaryReport;
use crate::error::Error;
use crate::staging::{StagingChannel, StagingConfig};
use crate::tensor::{ResultShape, Rung, TensorDesc};

/// How a [`Parent`] behaves.
#[derive(Clone, Debug)]
pub struct ParentOptions {
    /// The device whose pool is shared.
    pub device: u32,
    /// More devices to share a pool of, one each (empty by default). A worker is offered them
    /// after the handshake and says which it can use from its own device; tensors from a pool
    /// it cannot use go to it by host staging.
    pub more_devices: Vec<u32>,
    /// Which allocations may go by pool pointer (the 128-chunk rule by default).
    pub limit: ImportLimit,
    /// How long a worker may hold a handoff before the parent kills it.
    pub handoff_timeout: Duration,
    /// How long a worker may take to start and shake hands.
    pub handshake_timeout: Duration,
    /// Run the canary battery on each new worker before it takes jobs.
    pub canary: bool,
    /// The host-staging rung's buffer and waits.
    pub staging: StagingConfig,
}

impl Default for ParentOptions {
    fn default() -> Self {
        ParentOptions {
            device: 0,
            more_devices: Vec::new(),
            limit: ImportLimit::default(),
            handoff_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(60),
            canary: true,
            staging: StagingConfig::default(),
        }
    }
}

/// An input tensor to lend: where its first element is, and its layout. Its memory must come
/// from the shared pool (torch's allocations do, once the pool is installed) and stay alive
/// until the job returns.
#[derive(Clone, Debug)]
pub struct Input {
    /// The address of element 0.
    pub ptr: DevicePtr,
    /// The layout.
    pub desc: TensorDesc,
}

/// A result the worker wrote, in memory the parent allocated: the caller's to keep and free.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResultTensor {
    /// The allocation (from the caller's allocator, the shared pool by default).
    pub ptr: DevicePtr,
    /// Its size.
    pub bytes: u64,
    /// The shape the worker announced.
    pub shape: ResultShape,
    /// How it crossed.
    pub rung: Rung,
}

/// What a job gave back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobOutput {
    /// The results, in the order the worker requested them.
    pub results: Vec<ResultTensor>,
    /// The rung each input took, in argument order.
    pub input_rungs: Vec<Rung>,
}

/// What the parent knows of a worker.
#[derive(Clone, Debug)]
pub struct WorkerInfo {
    /// Its id.
    pub id: WorkerId,
    /// Its process id, if the parent spawned it.
    pub pid: Option<u32>,
    /// What it said in the handshake.
    pub identity: Identity,
}

type Allocator<'a> = dyn FnMut(&ResultShape, u64) -> Result<DevicePtr, Error> + 'a;

struct Slot {
    child: Option<Child>,
    conn: Connection,
    info: WorkerInfo,
    ready: EventHandle,
    ready_blob: EventBlob,
    done_events: HashMap<[u8; 64], EventHandle>,
    next_request: u64,
    dead: bool,
    canary: Option<CanaryReport>,
    staging: Option<StagingChannel>,
    /// For each of the parent's pools after the first, whether the worker can use it.
    more_pools: Vec<bool>,
}

impl Slot {
    /// Whether the worker said it can import from the pool (a worker on a device without a
    /// peer path to the pool's says it cannot).
    fn reaches_pool(&self) -> bool {
        self.info
            .identity
            .capabilities
            .contains(Capabilities::POOL_POINTER)
    }

    /// Whether tensors of the first pool may go to it by pool pointer: it reaches the pool
    /// and no canary failed.
    fn takes_pointers(&self) -> bool {
        self.reaches_pool() && self.canary_ok()
    }

    /// No canary battery failed (none ran, or all passed).
    fn canary_ok(&self) -> bool {
        self.canary.as_ref().is_none_or(CanaryReport::ok)
    }

    /// Whether memory of the parent's pool `index` may go to it by pool pointer.
    fn takes_pointers_from(&self, index: u8) -> bool {
        match usize::from(index).checked_sub(1) {
            None => self.takes_pointers(),
            Some(i) => self.canary_ok() && self.more_pools.get(i) == Some(&true),
        }
    }
}

/// The state of one job while it runs.
#[derive(Default)]
struct JobState {
    job: Option<contract::JobId>,
    lend: Vec<LentTensor>,
    grants: Vec<ResultGrant>,
    record_ready: bool,
    exports: HashMap<AllocId, ExportBlob>,
    done: HashMap<HandoffId, EventHandle>,
    requested: Vec<(RequestId, ResultShape)>,
    results: BTreeMap<RequestId, ResultTensor>,
    result_allocs: HashMap<AllocId, (DevicePtr, RequestId)>,
    failed: Option<(FailReason, String)>,
    /// Inputs on the host-staging rung: (wire handle, element 0, bytes), in argument order.
    staged: Vec<(HandoffId, DevicePtr, u64)>,
    /// Results on the host-staging rung, by wire handle: (the parent's allocation, bytes).
    staged_results: HashMap<HandoffId, (DevicePtr, u64)>,
    /// Result memory that will not be handed out: the caller's to free.
    orphans: Vec<DevicePtr>,
    /// Result allocations made before the contract asked for them, by request.
    preallocated: HashMap<RequestId, DevicePtr>,
    worker_error: Option<String>,
    open_handoffs: usize,
    acked_all: bool,
}

/// The parent side: the shared pool, the workers, the jobs.
pub struct Parent {
    driver: Arc<dyn Driver>,
    pool: SharedPool<dyn Driver>,
    /// The pools of `options.more_devices`, in that order: pool index 1, 2, ...
    more_pools: Vec<SharedPool<dyn Driver>>,
    options: ParentOptions,
    machine: contract::Parent,
    workers: BTreeMap<WorkerId, Slot>,
    next_worker: u32,
    next_job: u64,
    next_alloc: u64,
    epoch: Instant,
    /// The limit the parent was made with.
    ceiling: ImportLimit,
}

impl std::fmt::Debug for Parent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parent")
            .field("driver", &self.driver.kind())
            .field("device", &self.options.device)
            .field("workers", &self.workers.len())
            .finish_non_exhaustive()
    }
}

/// What the facade's sides can do, said in the handshake.
pub(crate) const CAPABILITIES: Capabilities = Capabilities(
    Capabilities::POOL_POINTER.0 | Capabilities::IPC_EVENTS.0 | Capabilities::HOST_STAGING.0,
);

/// Wire handles of staged inputs have this bit set; the contract's handoff ids never do.
const STAGED_HANDLE: u64 = 1 << 62;
/// With [`STAGED_HANDLE`]: a staged result rather than an input.
const RESULT_HANDLE: u64 = 1 << 61;

fn blob64(b: &[u8; 64]) -> ExportBlob {
    ExportBlob(*b)
}

impl Parent {
    /// Installs the shared pool on `options.device` (see [`SharedPool::install`]).
    pub fn new(driver: Arc<dyn Driver>, options: ParentOptions) -> Result<Parent, Error> {
        let mut devices = vec![options.device];
        for &d in &options.more_devices {
            if devices.contains(&d) {
                return Err(Error::Config(format!(
                    "device {d} is listed twice (device {}, more devices {:?})",
                    options.device, options.more_devices
                )));
            }
            devices.push(d);
        }
        if options.more_devices.len() > usize::from(u8::MAX) {
            return Err(Error::Config(format!(
                "{} more devices: at most {} pools are named on the wire",
                options.more_devices.len(),
                u8::MAX
            )));
        }
        let mut more_pools = Vec::with_capacity(options.more_devices.len());
        for &d in &options.more_devices {
            driver.use_device(d)?;
            more_pools.push(SharedPool::install(Arc::clone(&driver), d)?);
        }
        driver.use_device(options.device)?;
        let ceiling = options.limit;
        let pool = SharedPool::install(Arc::clone(&driver), options.device)?;
        let limit = ImportLimit::new(options.limit.chunk_bytes(), options.limit.max_chunks())
            .ok_or_else(|| Error::Protocol("an import limit with zero-byte chunks".into()))?;
        let machine = contract::Parent::new(contract::ParentConfig {
            limit,
            handoff_timeout: options.handoff_timeout,
        });
        Ok(Parent {
            driver,
            pool,
            more_pools,
            options,
            machine,
            workers: BTreeMap::new(),
            next_worker: 1,
            next_job: 1,
            next_alloc: 1,
            epoch: Instant::now(),
            ceiling,
        })
    }

    /// Sets the import limit from here on (tensors over it take host staging), at most the
    /// limit the parent was made with: the contract keeps that one.
    pub fn lower_import_limit(&mut self, limit: ImportLimit) -> Result<(), Error> {
        let cur = self.ceiling;
        if limit.chunk_bytes() != cur.chunk_bytes() || limit.max_chunks() > cur.max_chunks() {
            return Err(Error::Protocol(format!(
                "the import limit can only be lowered: {} chunks of {} bytes is not within {} of {}",
                limit.max_chunks(),
                limit.chunk_bytes(),
                cur.max_chunks(),
                cur.chunk_bytes()
            )));
        }
        self.options.limit = limit;
        Ok(())
    }

    /// The options it was made with.
    pub fn options(&self) -> &ParentOptions {
        &self.options
    }

    /// The shared pool (on `options.device`).
    pub fn pool(&self) -> &SharedPool<dyn Driver> {
        &self.pool
    }

    /// The shared pool on `device`: the first one's, or one of `options.more_devices`.
    pub fn pool_on(&self, device: u32) -> Option<&SharedPool<dyn Driver>> {
        self.pools().find(|p| p.device() == device)
    }

    /// Every shared pool, by pool index: the first, then `options.more_devices`' in order.
    fn pools(&self) -> impl Iterator<Item = &SharedPool<dyn Driver>> {
        std::iter::once(&self.pool).chain(&self.more_pools)
    }

    /// Which of this parent's pools `ptr` comes from (0: the first; n: `more_devices[n - 1]`),
    /// or `None` if none. With one pool there is nothing to ask the driver.
    fn pool_index(&self, ptr: DevicePtr) -> Option<u8> {
        if self.more_pools.is_empty() {
            return Some(0);
        }
        // Not pool memory at all (cuMemAlloc'd, say) is no pool of ours either.
        let handle = self.driver.pointer_get_mempool(ptr).ok()?;
        self.pools()
            .position(|p| p.handle() == handle)
            .and_then(|i| u8::try_from(i).ok())
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    fn now(&self) -> Timestamp {
        Timestamp(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// This side's handshake identity.
    pub fn identity(&self) -> Result<Identity, Error> {
        crate::identity(&*self.driver, self.options.device, CAPABILITIES)
    }

    /// Spawns `cmd` as a worker on an inherited socketpair and shakes hands with it.
    pub fn spawn_worker(&mut self, cmd: Command) -> Result<WorkerId, Error> {
        let (child, conn) = poolipc_transport::spawn_worker(cmd)?;
        self.adopt(Some(child), conn)
    }

    /// Takes a worker connected by other means (a listening socket), and shakes hands.
    pub fn accept_worker(&mut self, conn: Connection) -> Result<WorkerId, Error> {
        self.adopt(None, conn)
    }

    fn adopt(&mut self, mut child: Option<Child>, mut conn: Connection) -> Result<WorkerId, Error> {
        let config = HandshakeConfig {
            identity: self.identity()?,
            required: Capabilities::NONE,
        };
        let deadline = Instant::now() + self.options.handshake_timeout;
        let peer =
            match poolipc_transport::parent_handshake(&mut conn, &config, self.pool.fd(), deadline)
            {
                Ok(p) => p,
                Err(e) => {
                    if let Some(c) = child.as_mut() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    return Err(e.into());
                }
            };
        let id = WorkerId(self.next_worker);
        self.next_worker += 1;
        self.machine.add_worker(id)?;
        let ready = self.driver.event_create(true)?;
        let ready_blob = EventBlob(self.driver.ipc_get_event_handle(ready)?.0);
        let pid = child.as_ref().map(Child::id);
        tracing::info!(worker = %id, ?pid, "worker connected");
        self.workers.insert(
            id,
            Slot {
                child,
                conn,
                info: WorkerInfo {
                    id,
                    pid,
                    identity: peer.identity,
                },
                ready,
                ready_blob,
                done_events: HashMap::new(),
                next_request: 1,
                dead: false,
                canary: None,
                staging: None,
                more_pools: Vec::new(),
            },
        );
        if let Err(e) = self.offer_more_pools(id, deadline) {
            tracing::warn!(worker = %id, error = %e, "offering the other pools failed");
            if let Some(slot) = self.workers.remove(&id) {
                if let Some(mut c) = slot.child {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                let _ = self.driver.event_destroy(slot.ready);
            }
            // Nothing was lent to it yet: the contract forgets it at once.
            let now = self.now();
            let _ = self
                .machine
                .handle(ParentEvent::WorkerHungUp { worker: id }, now);
            let _ = self
                .machine
                .handle(ParentEvent::WorkerReaped { worker: id }, now);
            while self.machine.poll_action().is_some() {}
            return Err(e);
        }
        if !self.slot_mut(id)?.reaches_pool() {
            // Nothing of the first pool to prove by pool pointer: it will get none.
            tracing::warn!(
                worker = %id,
                "the worker cannot reach the pool from its device: its tensors take host staging"
            );
        } else if self.options.canary {
            let report = crate::canary::run(self, id)?;
            self.slot_mut(id)?.canary = Some(report);
        }
        Ok(id)
    }

    /// Offers a new worker the pools after the first, one `ExtraPool` each, and records which
    /// it can use.
    fn offer_more_pools(&mut self, id: WorkerId, deadline: Instant) -> Result<(), Error> {
        for (i, pool) in self.more_pools.iter().enumerate() {
            let index =
                u8::try_from(i + 1).map_err(|_| Error::Config("more than 255 pools".into()))?;
            let device = self.driver.device_info(pool.device())?.uuid;
            let slot = self.workers.get_mut(&id).ok_or(Error::UnknownWorker(id))?;
            slot.conn.send(
                &Message::ExtraPool(ExtraPool {
                    index,
                    device: poolipc_transport::DeviceUuid(device.0),
                }),
                &[pool.fd()],
                deadline,
            )?;
            let reachable = match slot.conn.recv(deadline)? {
                (Message::ExtraPoolReply(r), _) if r.index == index => {
                    if !r.reachable {
                        tracing::info!(
                            worker = %id,
                            pool_device = pool.device(),
                            reason = %r.reason,
                            "the worker cannot use this pool: its tensors go by host staging"
                        );
                    }
                    r.reachable
                }
                (other, _) => {
                    return Err(Error::Protocol(format!(
                        "expected the answer to ExtraPool {index}, got {}",
                        other.kind()
                    )));
                }
            };
            slot.more_pools.push(reachable);
        }
        Ok(())
    }

    /// What the parent knows of a worker.
    pub fn worker(&self, id: WorkerId) -> Option<&WorkerInfo> {
        self.workers.get(&id).map(|s| &s.info)
    }

    /// The canary battery's report on a worker, if it ran.
    pub fn canary_report(&self, id: WorkerId) -> Option<&CanaryReport> {
        self.workers.get(&id).and_then(|s| s.canary.as_ref())
    }

    /// Lends `inputs` to `worker` and serves its result requests, allocating results from the
    /// shared pool. See [`run_job_with`](Parent::run_job_with).
    pub fn run_job(
        &mut self,
        worker: WorkerId,
        inputs: &[Input],
        stream: StreamHandle,
    ) -> Result<JobOutput, Error> {
        let pool_alloc = {
            let driver = Arc::clone(&self.driver);
            let pool = self.pool.handle();
            move |_: &ResultShape, bytes: u64| -> Result<DevicePtr, Error> {
                Ok(driver.mem_alloc_from_pool_async(bytes, pool, stream)?)
            }
        };
        let mut alloc = pool_alloc;
        let out = self.run_job_with(worker, inputs, stream, &mut alloc);
        out.map_err(|e| self.free_returned(e, stream))
    }

    /// For the jobs whose results this crate allocated: frees what a failed job gave back.
    fn free_returned(&self, mut e: Error, stream: StreamHandle) -> Error {
        if let Error::JobFailed { results, .. } | Error::Worker { results, .. } = &mut e {
            for ptr in results.drain(..) {
                if let Err(free) = self.pool.free(ptr, stream) {
                    tracing::warn!(error = %free, ?ptr, "freeing a failed job's result failed");
                }
            }
        }
        e
    }

    /// Lends `inputs` to `worker`, READY recorded on `stream`; answers the worker's result
    /// requests by calling `alloc(shape, bytes)` (which must return memory of the shared
    /// pool); returns when the worker acknowledged everything, `stream` having waited on its
    /// DONE event. If the worker dies, the job fails with [`Error::JobFailed`] once the worker
    /// is reaped; other workers are unaffected. A failed job's error lists every result the
    /// allocator made (`results`): no process imports them any more, and they are the
    /// caller's to free. [`run_job`](Parent::run_job) frees them itself.
    pub fn run_job_with(
        &mut self,
        worker: WorkerId,
        inputs: &[Input],
        stream: StreamHandle,
        alloc: &mut Allocator<'_>,
    ) -> Result<JobOutput, Error> {
        let job = JobId(self.next_job);
        self.next_job += 1;
        self.run_job_inner(worker, job, inputs, stream, alloc)
    }

    /// [`run_job`](Parent::run_job) under a job id of the caller's (the canary battery's).
    pub(crate) fn run_job_as(
        &mut self,
        worker: WorkerId,
        job: JobId,
        inputs: &[Input],
        stream: StreamHandle,
    ) -> Result<JobOutput, Error> {
        let driver = Arc::clone(&self.driver);
        let pool = self.pool.handle();
        let mut alloc = move |_: &ResultShape, bytes: u64| -> Result<DevicePtr, Error> {
            Ok(driver.mem_alloc_from_pool_async(bytes, pool, stream)?)
        };
        let out = self.run_job_inner(worker, job, inputs, stream, &mut alloc);
        out.map_err(|e| self.free_returned(e, stream))
    }

    fn run_job_inner(
        &mut self,
        worker: WorkerId,
        job: JobId,
        inputs: &[Input],
        stream: StreamHandle,
        alloc: &mut Allocator<'_>,
    ) -> Result<JobOutput, Error> {
        let slot = self
            .workers
            .get(&worker)
            .ok_or(Error::UnknownWorker(worker))?;
        if slot.dead {
            return Err(Error::UnknownWorker(worker));
        }
        // A worker whose canary battery failed, or that cannot reach the pool, takes every
        // input by host staging.
        let demoted = !slot.takes_pointers();
        let stages = slot
            .info
            .identity
            .capabilities
            .contains(Capabilities::HOST_STAGING);
        let span = tracing::info_span!("job", worker = %worker, job = job.0);
        let _enter = span.enter();
        let cjob = contract::JobId(job.0);
        let mut st = JobState {
            job: Some(cjob),
            ..JobState::default()
        };
        let mut input_rungs = Vec::with_capacity(inputs.len());
        let mut allocs_by_base: HashMap<u64, AllocId> = HashMap::new();
        // Every input is checked before any is lent, so that a refusal leaves nothing lent.
        let mut placed = Vec::with_capacity(inputs.len());
        for input in inputs {
            let extent = input.desc.extent_bytes()?;
            let (base, size) = self.driver.pointer_get_range(input.ptr)?;
            let offset = input.ptr.0 - base.0;
            if offset + extent > size {
                return Err(Error::InvalidTensor(format!(
                    "the tensor at {:?} runs {} bytes past its allocation",
                    input.ptr,
                    offset + extent - size
                )));
            }
            let pool = self.pool_index(input.ptr);
            let by_pointer = pool.is_some_and(|i| slot.takes_pointers_from(i))
                && self.options.limit.allows(base.0, size);
            if !by_pointer && !stages {
                let why = match (self.options.limit.check(base.0, size), pool) {
                    (Err(e), _) => e.to_string(),
                    (Ok(()), _) if !slot.reaches_pool() => {
                        format!("{worker} cannot reach the pool from its device")
                    }
                    (Ok(()), _) if demoted => {
                        format!("{worker} was demoted by its canary battery")
                    }
                    (Ok(()), None) => "it is not memory of this parent's pools".into(),
                    (Ok(()), Some(i)) => format!("{worker} cannot use the parent's pool {i}"),
                };
                return Err(Error::NoRung(format!(
                    "an input cannot go by pool pointer ({why}) and the worker has no host staging"
                )));
            }
            placed.push((base, size, offset, extent, by_pointer, pool.unwrap_or(0)));
        }
        // Host staging is set up before anything is lent, so a failure leaves nothing lent.
        if placed.iter().any(|p| !p.4) {
            self.ensure_staging(worker)?;
        }
        for (input, (base, size, offset, extent, by_pointer, pool)) in inputs.iter().zip(placed) {
            if !by_pointer {
                let handle = HandoffId(STAGED_HANDLE | st.staged.len() as u64);
                st.lend.push(LentTensor {
                    handle,
                    rung: WireRung::HostStaging,
                    pool: 0,
                    export: ExportBlob([0; 64]),
                    ready_event: EventBlob([0; 64]),
                    meta: input.desc.meta(0, extent),
                });
                st.staged.push((handle, input.ptr, extent));
                input_rungs.push(Rung::HostStaging);
                tracing::debug!(bytes = extent, "input takes the host-staging rung");
                continue;
            }
            let alloc_id = *allocs_by_base.entry(base.0).or_insert_with(|| {
                let a = AllocId(self.next_alloc);
                self.next_alloc += 1;
                a
            });
            let span = Span {
                ptr: base.0,
                bytes: size,
            };
            let now = self.now();
            match self.machine.lend(worker, cjob, alloc_id, span, now) {
                Ok(_handoff) => {}
                Err(contract::ContractError::AboveImportLimit { .. }) => {
                    self.abandon(worker, &mut st);
                    return Err(Error::NoRung(format!(
                        "{size} bytes at {base:?} are over the pointer-import limit ({} chunks \
                         of {} MiB); host staging is not built yet",
                        self.options.limit.max_chunks(),
                        self.options.limit.chunk_bytes() >> 20
                    )));
                }
                Err(e) => {
                    self.abandon(worker, &mut st);
                    return Err(e.into());
                }
            }
            // The offer the machine queued describes this input; its layout comes from here.
            self.drive(stream, &mut st, alloc, Some((input, offset, extent, pool)))?;
            input_rungs.push(Rung::PoolPointer);
        }
        let sent = self
            .flush(worker, job, stream, &mut st)
            .and_then(|()| self.send_staged(worker, job, stream, &mut st));
        if let Err(e) = sent {
            self.lose_worker(worker, stream, &mut st, alloc, &e.to_string(), false)?;
        } else {
            self.serve(worker, job, stream, &mut st, alloc)?;
        }
        if st.failed.is_some() || st.worker_error.is_some() {
            // Everything the caller's allocator made for this job goes back to the caller.
            let mut results = std::mem::take(&mut st.orphans);
            results.extend(st.results.values().map(|r| r.ptr));
            if let Some((reason, detail)) = st.failed.take() {
                return Err(Error::JobFailed {
                    worker,
                    reason,
                    detail,
                    results,
                });
            }
            let message = st.worker_error.take().unwrap_or_default();
            return Err(Error::Worker { message, results });
        }
        Ok(JobOutput {
            results: st.results.into_values().collect(),
            input_rungs,
        })
    }

    /// After a failed lend: the loans already queued are cancelled with the job.
    fn abandon(&mut self, worker: WorkerId, st: &mut JobState) {
        st.lend.clear();
        if let Some(job) = st.job {
            let _ = self.machine.cancel(worker, job);
        }
        while self.machine.poll_action().is_some() {}
    }

    /// Carries out what the machine asks, in order.
    fn drive(
        &mut self,
        stream: StreamHandle,
        st: &mut JobState,
        alloc: &mut Allocator<'_>,
        mut input: Option<(&Input, u64, u64, u8)>,
    ) -> Result<(), Error> {
        while let Some(action) = self.machine.poll_action() {
            tracing::trace!(?action, "contract action");
            match action {
                ParentAction::Export { alloc: a, span } => {
                    let ptr = DevicePtr(span.ptr);
                    // Through the pool it came from, which checks that it did (memory of none
                    // goes to the first, which refuses it).
                    let index = self.pool_index(ptr).unwrap_or(0);
                    let pool = self.pools().nth(usize::from(index)).unwrap_or(&self.pool);
                    let data = pool.export(ptr)?;
                    st.exports.insert(a, data);
                }
                ParentAction::RecordReady { .. } => st.record_ready = true,
                ParentAction::Send {
                    worker: to,
                    message,
                } => match message {
                    ToWorker::Offer(offer) => {
                        let export = st
                            .exports
                            .get(&offer.alloc)
                            .copied()
                            .ok_or_else(|| Error::Protocol("offer before export".into()))?;
                        st.open_handoffs += 1;
                        match offer.purpose {
                            Purpose::Input => {
                                let (inp, offset, extent, pool) =
                                    input.take().ok_or_else(|| {
                                        Error::Protocol("an input offer with no input".into())
                                    })?;
                                let ready_event = self.slot(to)?.ready_blob;
                                st.lend.push(LentTensor {
                                    handle: HandoffId(offer.handoff.0),
                                    rung: poolipc_transport::Rung::PoolPointer,
                                    pool,
                                    export: blob64(&export.0),
                                    ready_event,
                                    meta: inp.desc.meta(offset, extent),
                                });
                            }
                            Purpose::Result { .. } => {
                                let ready_event = self.slot(to)?.ready_blob;
                                // Only memory of a pool the worker uses is offered by pointer.
                                let pool = st
                                    .result_allocs
                                    .get(&offer.alloc)
                                    .and_then(|(ptr, _)| self.pool_index(*ptr))
                                    .unwrap_or(0);
                                st.grants.push(ResultGrant::Granted {
                                    handle: HandoffId(offer.handoff.0),
                                    rung: poolipc_transport::Rung::PoolPointer,
                                    pool,
                                    export: blob64(&export.0),
                                    ready_event,
                                });
                            }
                            other => {
                                return Err(Error::Protocol(format!("an offer for {other:?}")));
                            }
                        }
                    }
                    ToWorker::ResultRefused { reason, .. } => {
                        st.grants.push(ResultGrant::Refused {
                            code: match reason {
                                contract::Refusal::AboveImportLimit => ErrorCode::OVER_IMPORT_LIMIT,
                                contract::Refusal::Cancelled => ErrorCode::CANCELLED,
                                _ => ErrorCode::OUT_OF_MEMORY,
                            },
                            message: format!("{reason:?}"),
                        });
                    }
                    ToWorker::Cancel { job: j } => {
                        let d = Instant::now() + Duration::from_secs(5);
                        let _ = self.slot_mut(to)?.conn.send(
                            &Message::Cancel { job: JobId(j.0) },
                            &[],
                            d,
                        );
                    }
                    ToWorker::Shutdown => {}
                    _ => {}
                },
                ParentAction::AllocateResult {
                    worker, request, ..
                } => {
                    let shape = st
                        .requested
                        .iter()
                        .find(|(r, _)| *r == request)
                        .map(|(_, s)| s.clone())
                        .ok_or_else(|| {
                            Error::Protocol("allocation for an unknown request".into())
                        })?;
                    let now = self.now();
                    let bytes = shape.bytes()?;
                    let made = match st.preallocated.remove(&request) {
                        Some(ptr) => Ok(ptr),
                        None => alloc(&shape, bytes),
                    };
                    match made {
                        Ok(ptr) => {
                            let a = AllocId(self.next_alloc);
                            self.next_alloc += 1;
                            st.result_allocs.insert(a, (ptr, request));
                            st.results.insert(
                                request,
                                ResultTensor {
                                    ptr,
                                    bytes,
                                    shape,
                                    rung: Rung::PoolPointer,
                                },
                            );
                            self.machine.handle(
                                ParentEvent::ResultAllocated {
                                    worker,
                                    request,
                                    alloc: a,
                                    span: Span { ptr: ptr.0, bytes },
                                },
                                now,
                            )?;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "result allocation failed");
                            self.machine
                                .handle(ParentEvent::ResultDeclined { worker, request }, now)?;
                        }
                    }
                }
                ParentAction::FreeResult {
                    alloc: a, request, ..
                } => {
                    if let Some((ptr, _)) = st.result_allocs.remove(&a) {
                        // Never offered: the caller's allocator made it, the caller frees it.
                        st.orphans.push(ptr);
                    }
                    st.results.remove(&request);
                }
                ParentAction::WaitDone { handoff } => {
                    if let Some(ev) = st.done.get(&handoff) {
                        self.driver.stream_wait_event(stream, *ev)?;
                    }
                }
                ParentAction::Release {
                    alloc: a,
                    purpose,
                    outcome,
                    ..
                } => {
                    st.open_handoffs = st.open_handoffs.saturating_sub(1);
                    if let Purpose::Result { request } = purpose {
                        if outcome != Outcome::Completed {
                            if let Some((ptr, _)) = st.result_allocs.remove(&a) {
                                // Nothing imports it any more (the worker acknowledged or was
                                // reaped); the caller's allocator made it, the caller frees it.
                                st.orphans.push(ptr);
                            }
                            st.results.remove(&request);
                        } else {
                            st.result_allocs.remove(&a);
                        }
                    }
                }
                ParentAction::KillWorker { worker } => {
                    if let Some(c) = self.slot_mut(worker)?.child.as_mut() {
                        let _ = c.kill();
                    }
                }
                ParentAction::JobFailed { reason, .. } if st.failed.is_none() => {
                    st.failed = Some((reason, String::new()));
                }
                ParentAction::ShutdownComplete => {}
                _ => {}
            }
        }
        Ok(())
    }

    fn slot(&self, w: WorkerId) -> Result<&Slot, Error> {
        self.workers.get(&w).ok_or(Error::UnknownWorker(w))
    }

    fn slot_mut(&mut self, w: WorkerId) -> Result<&mut Slot, Error> {
        self.workers.get_mut(&w).ok_or(Error::UnknownWorker(w))
    }

    /// Records READY if an offer needs it, then sends the batched offers.
    fn flush(
        &mut self,
        worker: WorkerId,
        job: JobId,
        stream: StreamHandle,
        st: &mut JobState,
    ) -> Result<(), Error> {
        let deadline = Instant::now() + self.options.handoff_timeout;
        let driver = Arc::clone(&self.driver);
        let slot = self.slot_mut(worker)?;
        if st.record_ready {
            driver.event_record(slot.ready, stream)?;
            st.record_ready = false;
        }
        if !st.lend.is_empty() {
            let tensors = std::mem::take(&mut st.lend);
            slot.conn
                .send(&Message::Lend(Lend { job, tensors }), &[], deadline)?;
        } else if st.open_handoffs == 0 && st.grants.is_empty() {
            // A job without inputs still needs to reach the worker.
            slot.conn.send(
                &Message::Lend(Lend {
                    job,
                    tensors: Vec::new(),
                }),
                &[],
                deadline,
            )?;
        }
        if !st.grants.is_empty() {
            let results = std::mem::take(&mut st.grants);
            slot.conn.send(
                &Message::AllocationGrant(AllocationGrant { job, results }),
                &[],
                deadline,
            )?;
        }
        Ok(())
    }

    /// Receives until the worker acknowledged the whole job, or died.
    fn serve(
        &mut self,
        worker: WorkerId,
        job: JobId,
        stream: StreamHandle,
        st: &mut JobState,
        alloc: &mut Allocator<'_>,
    ) -> Result<(), Error> {
        loop {
            if st.failed.is_some() && st.open_handoffs == 0 {
                return Ok(());
            }
            if st.acked_all && st.open_handoffs == 0 {
                return Ok(());
            }
            let deadline = Instant::now() + self.options.handoff_timeout;
            let received = self.slot_mut(worker)?.conn.recv(deadline);
            let now = self.now();
            let msg = match received {
                Ok((msg, _fds)) => msg,
                Err(e) => {
                    tracing::warn!(error = %e, "worker connection lost");
                    let timeout = matches!(e, poolipc_transport::TransportError::Timeout { .. });
                    return self.lose_worker(worker, stream, st, alloc, &e.to_string(), timeout);
                }
            };
            match msg {
                Message::ResultRequest(req) if req.job == job => {
                    for spec in req.results {
                        let shape = ResultShape {
                            dtype: spec.dtype,
                            shape: spec.shape,
                        };
                        let bytes = shape.bytes()?;
                        if bytes != spec.byte_len {
                            return Err(Error::Protocol(format!(
                                "result request of {} bytes for shape {:?} of {} bytes",
                                spec.byte_len, shape.shape, bytes
                            )));
                        }
                        let slot = self.slot_mut(worker)?;
                        let request = RequestId(slot.next_request);
                        slot.next_request += 1;
                        // Allocate first: the rung depends on where the memory lands.
                        let ptr = match alloc(&shape, bytes) {
                            Ok(ptr) => ptr,
                            Err(e) => {
                                tracing::warn!(error = %e, "result allocation failed");
                                st.grants.push(ResultGrant::Refused {
                                    code: ErrorCode::OUT_OF_MEMORY,
                                    message: format!(
                                        "the parent could not allocate {bytes} bytes: {e}"
                                    ),
                                });
                                continue;
                            }
                        };
                        let by_pointer = self.pool_index(ptr).is_some_and(|i| {
                            self.workers
                                .get(&worker)
                                .is_some_and(|s| s.takes_pointers_from(i))
                        });
                        if !by_pointer || !self.options.limit.allows(ptr.0, bytes) {
                            let handle = HandoffId(
                                STAGED_HANDLE | RESULT_HANDLE | st.staged_results.len() as u64,
                            );
                            st.staged_results.insert(handle, (ptr, bytes));
                            st.results.insert(
                                request,
                                ResultTensor {
                                    ptr,
                                    bytes,
                                    shape,
                                    rung: Rung::HostStaging,
                                },
                            );
                            st.grants.push(ResultGrant::Granted {
                                handle,
                                rung: WireRung::HostStaging,
                                pool: 0,
                                export: ExportBlob([0; 64]),
                                ready_event: EventBlob([0; 64]),
                            });
                            tracing::debug!(bytes, "result takes the host-staging rung");
                            continue;
                        }
                        st.preallocated.insert(request, ptr);
                        st.requested.push((request, shape));
                        let cspec = contract::ResultSpec {
                            shape: vec![bytes],
                            dtype: contract::DType::U8,
                            bytes,
                        };
                        self.machine.handle(
                            ParentEvent::Message {
                                worker,
                                message: ToParent::ResultRequest {
                                    job: contract::JobId(job.0),
                                    request,
                                    spec: cspec,
                                },
                            },
                            now,
                        )?;
                        self.drive(stream, st, alloc, None)?;
                    }
                    if !st.staged_results.is_empty() {
                        self.ensure_staging(worker)?;
                    }
                    if let Err(e) = self.flush(worker, job, stream, st) {
                        return self.lose_worker(worker, stream, st, alloc, &e.to_string(), false);
                    }
                }
                Message::Done(done) if done.job == job => {
                    let key = done.done_event.0;
                    let ev = match self.slot(worker)?.done_events.get(&key) {
                        Some(ev) => *ev,
                        None => {
                            let ev = self.driver.ipc_open_event_handle(&EventBlob(key))?;
                            self.slot_mut(worker)?.done_events.insert(key, ev);
                            ev
                        }
                    };
                    for h in done.handles {
                        if let Some(&(dst, bytes)) = st.staged_results.get(&h) {
                            // The worker sends the staged result right after its Done.
                            let received = {
                                let Slot { staging, conn, .. } = self.slot_mut(worker)?;
                                let ch = staging.as_mut().ok_or_else(|| {
                                    Error::Protocol("a staged result without host staging".into())
                                })?;
                                ch.recv_tensor(conn, job, h, dst, bytes, stream)
                            };
                            if let Err(e) = received {
                                return self.lose_worker(
                                    worker,
                                    stream,
                                    st,
                                    alloc,
                                    &e.to_string(),
                                    false,
                                );
                            }
                            st.staged_results.remove(&h);
                        } else {
                            st.done.insert(HandoffId(h.0), ev);
                        }
                    }
                }
                Message::Ack(ack) if ack.job == job => {
                    for h in ack.handles {
                        if h.0 & STAGED_HANDLE != 0 {
                            continue;
                        }
                        let handoff = HandoffId(h.0);
                        if !st.done.contains_key(&handoff) {
                            return Err(Error::Protocol(format!(
                                "ACK of {handoff:?} before its DONE"
                            )));
                        }
                        self.machine.handle(
                            ParentEvent::Message {
                                worker,
                                message: ToParent::Ack { handoff },
                            },
                            now,
                        )?;
                        self.drive(stream, st, alloc, None)?;
                    }
                    st.acked_all = true;
                }
                Message::Error { message, .. } => st.worker_error = Some(message),
                Message::Heartbeat { .. } => {}
                other => {
                    return Err(Error::Protocol(format!(
                        "unexpected {:?} during a job",
                        other.kind()
                    )));
                }
            }
        }
    }

    /// Sets host staging up with `worker` the first time one of its tensors needs it.
    fn ensure_staging(&mut self, worker: WorkerId) -> Result<(), Error> {
        if self.slot(worker)?.staging.is_some() {
            return Ok(());
        }
        let driver = Arc::clone(&self.driver);
        let config = self.options.staging.clone();
        let slot = self.slot_mut(worker)?;
        slot.staging = Some(StagingChannel::setup_parent(
            driver,
            &mut slot.conn,
            config,
        )?);
        Ok(())
    }

    /// Sends the job's staged inputs through the worker's staging channel, in order.
    fn send_staged(
        &mut self,
        worker: WorkerId,
        job: JobId,
        stream: StreamHandle,
        st: &mut JobState,
    ) -> Result<(), Error> {
        if st.staged.is_empty() {
            return Ok(());
        }
        let slot = self.slot_mut(worker)?;
        let Slot { staging, conn, .. } = slot;
        let ch = staging
            .as_mut()
            .ok_or_else(|| Error::Protocol("no staging channel".into()))?;
        for &(handle, src, bytes) in &st.staged {
            ch.send_tensor(conn, job, handle, src, bytes, stream)?;
        }
        Ok(())
    }

    /// The worker is lost (connection closed or broken, deadline passed): the contract fails
    /// its jobs, the process is killed and reaped, what it held is released.
    fn lose_worker(
        &mut self,
        worker: WorkerId,
        stream: StreamHandle,
        st: &mut JobState,
        alloc: &mut Allocator<'_>,
        why: &str,
        timeout: bool,
    ) -> Result<(), Error> {
        let now = self.now();
        if timeout {
            self.machine
                .handle_timeout(now.saturating_add(self.options.handoff_timeout));
        } else {
            self.machine
                .handle(ParentEvent::WorkerHungUp { worker }, now)?;
        }
        self.drive(stream, st, alloc, None)?;
        let status = self.reap(worker)?;
        self.machine
            .handle(ParentEvent::WorkerReaped { worker }, self.now())?;
        self.drive(stream, st, alloc, None)?;
        // Staged results never reached the worker's memory: the parent's allocations go back.
        for (_, (ptr, _)) in st.staged_results.drain() {
            st.results.retain(|_, r| r.ptr != ptr);
            st.orphans.push(ptr);
        }
        let reason = st.failed.as_ref().map_or(FailReason::HungUp, |f| f.0);
        st.failed = Some((reason, format!("{why}; worker {status}")));
        self.driver.stream_synchronize(stream)?;
        Ok(())
    }

    /// Waits for a worker's process (killing it if it still runs) and marks it dead.
    fn reap(&mut self, worker: WorkerId) -> Result<String, Error> {
        let slot = self.slot_mut(worker)?;
        slot.dead = true;
        let status: Option<ExitStatus> = match slot.child.as_mut() {
            Some(c) => {
                let _ = c.kill();
                Some(c.wait().map_err(|source| Error::Os {
                    call: "waitpid",
                    source,
                })?)
            }
            None => None,
        };
        let text = status.map_or_else(|| "not ours to reap".into(), |s| s.to_string());
        tracing::warn!(worker = %worker, status = %text, "worker reaped");
        Ok(text)
    }

    /// Tells the worker to stop and waits for it.
    pub fn stop_worker(&mut self, worker: WorkerId) -> Result<Option<ExitStatus>, Error> {
        let mut slot = self
            .workers
            .remove(&worker)
            .ok_or(Error::UnknownWorker(worker))?;
        if !slot.dead {
            let _ = slot
                .conn
                .send(&Message::Bye, &[], Instant::now() + Duration::from_secs(5));
        }
        let status = match slot.child.as_mut() {
            Some(c) => Some(c.wait().map_err(|source| Error::Os {
                call: "waitpid",
                source,
            })?),
            None => None,
        };
        let _ = self.driver.event_destroy(slot.ready);
        Ok(status)
    }
}

impl Drop for Parent {
    fn drop(&mut self) {
        let ids: Vec<WorkerId> = self.workers.keys().copied().collect();
        for id in ids {
            if let Err(e) = self.stop_worker(id) {
                tracing::warn!(worker = %id, error = %e, "stopping a worker at drop failed");
            }
        }
    }
}
