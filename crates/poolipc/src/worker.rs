//! The worker: takes jobs, reads inputs and writes results in place, DONE and ACK for the user.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use poolipc_contract::{
    self as contract, AllocId, HandoffId, Offer, Purpose, RequestId, Span, Timestamp, ToParent,
    ToWorker, WorkerAction, WorkerEvent,
};
use poolipc_driver::{DevicePtr, Driver, EventHandle, ExportBlob, StreamHandle};
use poolipc_pool::{AttachedPool, ImportCache};
use poolipc_transport::{
    Ack, Capabilities, Connection, Done, ErrorCode, EventBlob, HandshakeConfig, HandshakeError,
    JobId, Lend, Message, ResultGrant, ResultRequest, ResultSpec, Rung as WireRung, TransportError,
};

use crate::error::Error;
use crate::staging::{StagingChannel, StagingConfig};
use crate::tensor::{ResultShape, Rung, TensorDesc};

/// An input of a job: readable on the job's stream, valid until the job finishes.
#[derive(Debug)]
pub struct InputView {
    ptr: DevicePtr,
    desc: TensorDesc,
    byte_len: u64,
    rung: Rung,
}

impl InputView {
    /// The address of element 0 in this process.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    /// The layout.
    pub fn desc(&self) -> &TensorDesc {
        &self.desc
    }
    /// Bytes from element 0 to the end of the last element.
    pub fn byte_len(&self) -> u64 {
        self.byte_len
    }
    /// How it crossed.
    pub fn rung(&self) -> Rung {
        self.rung
    }
}

/// A result buffer of a job, allocated by the parent: write it on the job's stream.
#[derive(Debug)]
pub struct ResultView {
    ptr: DevicePtr,
    shape: ResultShape,
    bytes: u64,
    rung: Rung,
}

impl ResultView {
    /// The address in this process.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    /// The shape asked for.
    pub fn shape(&self) -> &ResultShape {
        &self.shape
    }
    /// Its size.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// How it crosses.
    pub fn rung(&self) -> Rung {
        self.rung
    }
}

/// The worker side of poolipc.
pub struct Worker {
    driver: Arc<dyn Driver>,
    /// The device this worker works on (see [`Worker::device`]).
    device: u32,
    pool: AttachedPool,
    /// The parent's other pools (`ExtraPool` index 1, 2, ...): attached, or why not.
    more_pools: Vec<Result<AttachedPool, String>>,
    conn: Connection,
    stream: StreamHandle,
    machine: contract::Worker,
    cache: ImportCache,
    imports: HashMap<AllocId, (DevicePtr, ExportBlob)>,
    done: EventHandle,
    done_blob: EventBlob,
    ready_events: HashMap<[u8; 64], EventHandle>,
    next_request: u64,
    timeout: Duration,
    epoch: Instant,
    staging: Option<StagingChannel>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("driver", &self.driver.kind())
            .field("imports", &self.cache.len())
            .finish_non_exhaustive()
    }
}

/// The environment variable naming a failpoint: the worker kills itself with SIGKILL when it
/// reaches that step. For tests of what the parent does when a worker dies mid-handoff;
/// unset, it costs one lookup per process.
pub const FAILPOINT_ENV: &str = "POOLIPC_FAILPOINT";

/// Dies here (SIGKILL) if [`FAILPOINT_ENV`] names `step`. Canary jobs pass failpoints by.
pub fn failpoint(step: &str) {
    if IN_CANARY.with(std::cell::Cell::get) {
        return;
    }
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if AT
        .get_or_init(|| std::env::var(FAILPOINT_ENV).ok())
        .as_deref()
        == Some(step)
    {
        tracing::warn!(step, "failpoint reached: the worker kills itself");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
    }
}

thread_local! {
    /// Whether this thread is answering the parent's canary battery.
    static IN_CANARY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Which device a worker works on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerDevice {
    /// This ordinal, which must be the parent's device (else the handshake fails as a device
    /// mismatch).
    Exactly(u32),
    /// Whichever of this process's devices has the parent's device UUID.
    Parent,
    /// This ordinal, whatever device the parent's pool lives on, as long as this process sees
    /// that device too. Where the two devices can reach each other (`cuDeviceCanAccessPeer`),
    /// the pool is given access from this one (`cuMemPoolSetAccess`) and tensors go by pool
    /// pointer; otherwise the worker tells the parent it cannot take pool pointers, and every
    /// tensor goes by host staging.
    Any(u32),
}

/// Where a worker works, worked out from the parent's `Hello`.
#[derive(Clone, Debug)]
struct Placement {
    identity: poolipc_transport::Identity,
    compute: u32,
    pool_device: u32,
    /// The compute device can reach the pool's (or is it).
    peer: bool,
}

/// Where the parent's pool is in this process, and where this worker works: `compute`, or
/// the pool's device when `None`.
fn place(
    driver: &dyn Driver,
    parent: poolipc_transport::DeviceUuid,
    compute: Option<u32>,
) -> Result<Placement, HandshakeError> {
    let failed = |reason: String| HandshakeError::DeviceNotVisible {
        theirs: parent,
        reason,
    };
    let pool_device = find_device(driver, parent)?;
    let compute = compute.unwrap_or(pool_device);
    let peer = reaches(driver, compute, pool_device).map_err(failed)?;
    let mut capabilities = crate::parent::CAPABILITIES;
    if !peer {
        capabilities = Capabilities(capabilities.0 & !Capabilities::POOL_POINTER.0);
    }
    let identity = crate::identity(driver, pool_device, capabilities)
        .map_err(|e| failed(format!("asking device {pool_device} failed: {e}")))?;
    Ok(Placement {
        identity,
        compute,
        pool_device,
        peer,
    })
}

/// Whether work on device `from` can use memory of device `to`: the same device, or a peer.
fn reaches(driver: &dyn Driver, from: u32, to: u32) -> Result<bool, String> {
    if from == to {
        return Ok(true);
    }
    driver
        .device_can_access_peer(from, to)
        .map_err(|e| format!("asking whether device {from} reaches device {to} failed: {e}"))
}

/// This process's ordinal for the device with UUID `uuid`.
fn find_device(
    driver: &dyn Driver,
    uuid: poolipc_transport::DeviceUuid,
) -> Result<u32, HandshakeError> {
    let listing = |e: poolipc_driver::DriverError| HandshakeError::DeviceNotVisible {
        theirs: uuid,
        reason: format!("listing this process's devices failed: {e}"),
    };
    let count = driver.device_count().map_err(listing)?;
    let mut seen = Vec::new();
    for ordinal in 0..count {
        let info = driver.device_info(ordinal).map_err(listing)?;
        if info.uuid.0 == uuid.0 {
            return Ok(ordinal);
        }
        seen.push(info.uuid.to_string());
    }
    Err(HandshakeError::DeviceNotVisible {
        theirs: uuid,
        reason: if seen.is_empty() {
            "this process sees no device (check CUDA_VISIBLE_DEVICES)".into()
        } else {
            format!(
                "this process sees {} ({}); check CUDA_VISIBLE_DEVICES",
                seen.len(),
                seen.join(", ")
            )
        },
    })
}

fn alloc_of(data: &ExportBlob) -> AllocId {
    // One import per exported allocation: the parent sends the same export bytes for the
    // same allocation, so the bytes name it.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    data.0.hash(&mut h);
    AllocId(h.finish())
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
        let identity = crate::identity(&*driver, device, crate::parent::CAPABILITIES)?;
        let config = HandshakeConfig {
            identity,
            required: Capabilities::NONE,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
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
        let deadline = Instant::now() + Duration::from_secs(60);
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
        let pool = AttachedPool::attach(&*driver, pool_fd, device)?;
        let stream = driver.stream_create()?;
        let done = driver.event_create(true)?;
        let done_blob = EventBlob(driver.ipc_get_event_handle(done)?.0);
        Ok(Worker {
            device,
            more_pools: Vec::new(),
            driver,
            pool,
            conn,
            stream,
            machine: contract::Worker::new(),
            cache: ImportCache::new(),
            imports: HashMap::new(),
            done,
            done_blob,
            ready_events: HashMap::new(),
            next_request: 1,
            timeout: Duration::from_secs(3600),
            epoch: Instant::now(),
            staging: None,
        })
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
        self.stream
    }

    fn now(&self) -> Timestamp {
        Timestamp(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// Waits for the next job. `None` when the parent said goodbye or went away: the worker
    /// should exit.
    pub fn next_job(&mut self) -> Result<Option<Job<'_>>, Error> {
        loop {
            let deadline = Instant::now() + self.timeout;
            let (msg, fds) = match self.conn.recv(deadline) {
                Ok(got) => got,
                Err(TransportError::PeerClosed { .. }) => return Ok(None),
                Err(e) if e.is_peer_gone() => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            match msg {
                Message::Lend(lend) if crate::canary::is_canary(lend.job) => {
                    // The parent's canary battery: answered here, before user jobs.
                    IN_CANARY.with(|c| c.set(true));
                    let answered = self.start(lend).and_then(|mut job| {
                        match crate::echo::answer(&mut job, None) {
                            Ok(()) => job.finish(),
                            Err(e) => job.fail(&e.to_string()),
                        }
                    });
                    IN_CANARY.with(|c| c.set(false));
                    answered?;
                }
                Message::Lend(lend) => return self.start(lend).map(Some),
                Message::Bye => return Ok(None),
                Message::StagingBuffer(setup) => {
                    let driver = Arc::clone(&self.driver);
                    let ch = StagingChannel::setup_worker(
                        driver,
                        &mut self.conn,
                        &setup,
                        fds,
                        StagingConfig::default(),
                    )?;
                    tracing::debug!(chunk = ch.chunk(), "host staging set up");
                    self.staging = Some(ch);
                }
                Message::ExtraPool(offer) => {
                    let Some(fd) = fds.into_iter().next() else {
                        return Err(Error::Protocol("an ExtraPool without its FD".into()));
                    };
                    self.take_extra_pool(offer, fd)?;
                }
                Message::Heartbeat { .. } | Message::Cancel { .. } => {}
                other => {
                    return Err(Error::Protocol(format!(
                        "unexpected {:?} between jobs",
                        other.kind()
                    )));
                }
            }
        }
    }

    /// Attaches another of the parent's pools if this worker's device can use it, and says so.
    fn take_extra_pool(
        &mut self,
        offer: poolipc_transport::ExtraPool,
        fd: std::os::fd::OwnedFd,
    ) -> Result<(), Error> {
        let expected = self.more_pools.len() + 1;
        if usize::from(offer.index) != expected {
            return Err(Error::Protocol(format!(
                "ExtraPool {} where {expected} was next",
                offer.index
            )));
        }
        failpoint("before-extra-pool-reply");
        let attached = self.attach_extra_pool(offer.device, &fd);
        let reply = poolipc_transport::ExtraPoolReply {
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
        self.more_pools.push(attached);
        let deadline = Instant::now() + Duration::from_secs(60);
        self.conn
            .send(&Message::ExtraPoolReply(reply), &[], deadline)?;
        Ok(())
    }

    fn attach_extra_pool(
        &self,
        uuid: poolipc_transport::DeviceUuid,
        fd: &std::os::fd::OwnedFd,
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
        AttachedPool::attach(d, fd.as_fd(), self.device).map_err(|e| e.to_string())
    }

    /// The imported handle of the parent's pool `index`.
    fn pool_handle(&self, index: u8) -> Result<poolipc_driver::PoolHandle, Error> {
        if index == 0 {
            return Ok(self.pool.pool);
        }
        match self.more_pools.get(usize::from(index) - 1) {
            Some(Ok(p)) => Ok(p.pool),
            Some(Err(why)) => Err(Error::Protocol(format!(
                "a tensor by pointer from the parent's pool {index}, which this worker cannot use ({why})"
            ))),
            None => Err(Error::Protocol(format!(
                "a tensor by pointer from the parent's pool {index}, never offered"
            ))),
        }
    }

    fn start(&mut self, lend: Lend) -> Result<Job<'_>, Error> {
        let id = lend.job;
        let mut job = Job {
            worker: self,
            id,
            inputs: Vec::new(),
            results: Vec::new(),
            held: Vec::new(),
            staged: Vec::new(),
            staged_results: Vec::new(),
            finished: false,
        };
        for t in lend.tensors {
            if t.rung == WireRung::HostStaging {
                // Copied into memory of our own, which we free when the job finishes.
                let w = &mut *job.worker;
                let bytes = t.meta.byte_len;
                let dst = w.driver.mem_alloc_async(bytes.max(1), w.stream)?;
                job.staged.push(dst);
                let ch = w.staging.as_mut().ok_or_else(|| {
                    Error::Protocol("a staged input before host staging was set up".into())
                })?;
                ch.recv_tensor(&mut w.conn, id, t.handle, dst, bytes, w.stream)?;
                job.inputs.push(InputView {
                    ptr: dst,
                    desc: TensorDesc::from_meta(&t.meta),
                    byte_len: bytes,
                    rung: Rung::HostStaging,
                });
                continue;
            }
            let data = ExportBlob(t.export.0);
            let offer = Offer {
                handoff: HandoffId(t.handle.0),
                job: contract::JobId(id.0),
                alloc: alloc_of(&data),
                span: Span {
                    ptr: 0,
                    bytes: t.meta.byte_offset + t.meta.byte_len,
                },
                purpose: Purpose::Input,
            };
            let pool = job.worker.pool_handle(t.pool)?;
            let base = job.worker.take_offer(offer, pool, data, t.ready_event)?;
            job.held.push(HandoffId(t.handle.0));
            job.inputs.push(InputView {
                ptr: base.offset(t.meta.byte_offset),
                desc: TensorDesc::from_meta(&t.meta),
                byte_len: t.meta.byte_len,
                rung: Rung::PoolPointer,
            });
        }
        Ok(job)
    }

    /// Tells the contract a result request will not be met by a pointer offer (refused, or
    /// granted on the host-staging rung, which the contract does not cover).
    fn end_request(&mut self, job: JobId, request: RequestId) -> Result<(), Error> {
        let now = self.now();
        self.machine.handle(
            WorkerEvent::Message(ToWorker::ResultRefused {
                job: contract::JobId(job.0),
                request,
                reason: contract::Refusal::Declined,
            }),
            now,
        )?;
        while self.machine.poll_action().is_some() {}
        Ok(())
    }

    /// Feeds one offer to the contract and carries out its actions; returns the import's
    /// address.
    fn take_offer(
        &mut self,
        offer: Offer,
        pool: poolipc_driver::PoolHandle,
        data: ExportBlob,
        ready: EventBlob,
    ) -> Result<DevicePtr, Error> {
        let now = self.now();
        let alloc = offer.alloc;
        self.machine
            .handle(WorkerEvent::Message(ToWorker::Offer(offer)), now)?;
        while let Some(action) = self.machine.poll_action() {
            match action {
                WorkerAction::Import { alloc, .. } => {
                    failpoint("before-import");
                    let ptr = self.cache.acquire(&*self.driver, pool, &data)?;
                    self.imports.insert(alloc, (ptr, data));
                }
                WorkerAction::WaitReady { .. } => {
                    failpoint("before-ready-wait");
                    let ev = match self.ready_events.get(&ready.0) {
                        Some(ev) => *ev,
                        None => {
                            let ev = self.driver.ipc_open_event_handle(&EventBlob(ready.0))?;
                            self.ready_events.insert(ready.0, ev);
                            ev
                        }
                    };
                    self.driver.stream_wait_event(self.stream, ev)?;
                }
                WorkerAction::Usable { .. } => {}
                other => {
                    return Err(Error::Protocol(format!(
                        "unexpected contract action {other:?}"
                    )));
                }
            }
        }
        self.imports
            .get(&alloc)
            .map(|(p, _)| *p)
            .ok_or_else(|| Error::Protocol("an offer whose import is missing".into()))
    }
}

/// One job: its inputs, the results asked for, and the obligation to finish it.
///
/// Views are valid until [`finish`](Job::finish) (or drop, which finishes too): the parent
/// may reuse the memory after that.
pub struct Job<'w> {
    worker: &'w mut Worker,
    id: JobId,
    inputs: Vec<InputView>,
    results: Vec<ResultView>,
    held: Vec<HandoffId>,
    /// This process's copies of staged inputs and results, freed when the job finishes.
    staged: Vec<DevicePtr>,
    /// Staged results to send when the job finishes: (wire handle, our copy, bytes).
    staged_results: Vec<(HandoffId, DevicePtr, u64)>,
    finished: bool,
}

impl std::fmt::Debug for Job<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("id", &self.id)
            .field("inputs", &self.inputs.len())
            .finish_non_exhaustive()
    }
}

impl Job<'_> {
    /// The job's id.
    pub fn id(&self) -> JobId {
        self.id
    }
    /// The inputs, in argument order. Their memory is ready on [`stream`](Job::stream).
    pub fn inputs(&self) -> &[InputView] {
        &self.inputs
    }
    /// The results requested so far.
    pub fn results(&self) -> &[ResultView] {
        &self.results
    }
    /// The stream to work on: it waited on READY; DONE is recorded on it.
    pub fn stream(&self) -> StreamHandle {
        self.worker.stream
    }
    /// The driver.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.worker.driver
    }

    /// Asks the parent for result memory, shape first; returns the new result views.
    pub fn request_results(&mut self, shapes: &[ResultShape]) -> Result<&[ResultView], Error> {
        let w = &mut *self.worker;
        let mut specs = Vec::with_capacity(shapes.len());
        let mut requests = Vec::with_capacity(shapes.len());
        for shape in shapes {
            let bytes = shape.bytes()?;
            let request = RequestId(w.next_request);
            w.next_request += 1;
            w.machine.request_result(
                contract::JobId(self.id.0),
                request,
                contract::ResultSpec {
                    shape: vec![bytes],
                    dtype: contract::DType::U8,
                    bytes,
                },
            )?;
            while let Some(a) = w.machine.poll_action() {
                if !matches!(a, WorkerAction::Send(ToParent::ResultRequest { .. })) {
                    return Err(Error::Protocol(format!("unexpected contract action {a:?}")));
                }
            }
            specs.push(ResultSpec {
                dtype: shape.dtype,
                shape: shape.shape.clone(),
                byte_len: bytes,
            });
            requests.push((request, shape.clone(), bytes));
        }
        let deadline = Instant::now() + w.timeout;
        w.conn.send(
            &Message::ResultRequest(ResultRequest {
                job: self.id,
                results: specs,
            }),
            &[],
            deadline,
        )?;
        let grant = loop {
            let (msg, fds) = w.conn.recv(deadline)?;
            match msg {
                Message::AllocationGrant(g) if g.job == self.id => break g,
                Message::Heartbeat { .. } => {}
                Message::StagingBuffer(setup) => {
                    // The parent sets host staging up before the first staged result.
                    let driver = Arc::clone(&w.driver);
                    let ch = StagingChannel::setup_worker(
                        driver,
                        &mut w.conn,
                        &setup,
                        fds,
                        StagingConfig::default(),
                    )?;
                    w.staging = Some(ch);
                }
                other => {
                    return Err(Error::Protocol(format!(
                        "expected an AllocationGrant, got {:?}",
                        other.kind()
                    )));
                }
            }
        };
        if grant.results.len() != requests.len() {
            return Err(Error::Protocol(format!(
                "{} grants for {} requests",
                grant.results.len(),
                requests.len()
            )));
        }
        let first = self.results.len();
        let mut refused = None;
        for (g, (request, shape, bytes)) in grant.results.into_iter().zip(requests) {
            match g {
                ResultGrant::Granted {
                    handle,
                    rung: WireRung::HostStaging,
                    ..
                } => {
                    // Written here into memory of our own, sent to the parent's allocation
                    // through host staging when the job finishes.
                    w.end_request(self.id, request)?;
                    let ptr = w.driver.mem_alloc_async(bytes.max(1), w.stream)?;
                    self.staged.push(ptr);
                    self.staged_results.push((handle, ptr, bytes));
                    self.results.push(ResultView {
                        ptr,
                        shape,
                        bytes,
                        rung: Rung::HostStaging,
                    });
                }
                ResultGrant::Granted {
                    handle,
                    pool,
                    export,
                    ready_event,
                    ..
                } => {
                    let pool = w.pool_handle(pool)?;
                    let data = ExportBlob(export.0);
                    let offer = Offer {
                        handoff: HandoffId(handle.0),
                        job: contract::JobId(self.id.0),
                        alloc: alloc_of(&data),
                        span: Span { ptr: 0, bytes },
                        purpose: Purpose::Result { request },
                    };
                    let ptr = w.take_offer(offer, pool, data, ready_event)?;
                    self.held.push(HandoffId(handle.0));
                    self.results.push(ResultView {
                        ptr,
                        shape,
                        bytes,
                        rung: Rung::PoolPointer,
                    });
                }
                ResultGrant::Refused { message, .. } => {
                    w.end_request(self.id, request)?;
                    refused.get_or_insert(message);
                }
                _ => return Err(Error::Protocol("a grant of an unknown kind".into())),
            }
        }
        if let Some(message) = refused {
            return Err(Error::ResultRefused(message));
        }
        Ok(&self.results[first..])
    }

    /// Reports a failure of the job to the parent, then finishes it.
    pub fn fail(mut self, message: &str) -> Result<(), Error> {
        let deadline = Instant::now() + Duration::from_secs(30);
        self.worker.conn.send(
            &Message::Error {
                code: ErrorCode::OTHER,
                message: message.to_owned(),
            },
            &[],
            deadline,
        )?;
        self.finish_inner()
    }

    /// The work on every view is queued on [`stream`](Job::stream): free the imports
    /// (stream-ordered), record DONE after them, tell the parent (Done, then Ack).
    ///
    /// DONE is recorded after the imports' frees, so the parent's wait on DONE covers them
    /// too: the importer's free is ordered before the exporter may reuse the memory. The
    /// worker does not synchronize: a synchronize would unmap the freed imports, making the
    /// next import of recycled memory cost 1 ms/GiB (measured on the H200).
    pub fn finish(mut self) -> Result<(), Error> {
        self.finish_inner()
    }

    fn finish_inner(&mut self) -> Result<(), Error> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        let w = &mut *self.worker;
        let mut unimport = Vec::new();
        let mut acked = Vec::new();
        for &h in &self.held {
            w.machine.finish(h)?;
            while let Some(a) = w.machine.poll_action() {
                match a {
                    WorkerAction::RecordDone { .. } => {}
                    WorkerAction::Unimport { alloc } => unimport.push(alloc),
                    WorkerAction::Send(ToParent::Ack { handoff }) => {
                        acked.push(HandoffId(handoff.0))
                    }
                    other => {
                        return Err(Error::Protocol(format!(
                            "unexpected contract action {other:?}"
                        )));
                    }
                }
            }
        }
        for alloc in unimport {
            if let Some((_, data)) = w.imports.remove(&alloc) {
                w.cache.release(&*w.driver, &data, w.stream)?;
            }
        }
        failpoint("before-done");
        w.driver.event_record(w.done, w.stream)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut done_handles = acked.clone();
        done_handles.extend(self.staged_results.iter().map(|(h, _, _)| *h));
        w.conn.send(
            &Message::Done(Done {
                job: self.id,
                done_event: w.done_blob,
                handles: done_handles,
            }),
            &[],
            deadline,
        )?;
        failpoint("after-done");
        // Staged results go right after the Done that names them, in its order.
        for (handle, src, bytes) in std::mem::take(&mut self.staged_results) {
            let ch = w
                .staging
                .as_mut()
                .ok_or_else(|| Error::Protocol("a staged result without host staging".into()))?;
            ch.send_tensor(&mut w.conn, self.id, handle, src, bytes, w.stream)?;
        }
        for dst in self.staged.drain(..) {
            w.driver.mem_free_async(dst, w.stream)?;
        }
        w.conn.send(
            &Message::Ack(Ack {
                job: self.id,
                handles: acked,
            }),
            &[],
            deadline,
        )?;
        failpoint("after-ack");
        Ok(())
    }
}

impl Drop for Job<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.finish_inner() {
            tracing::warn!(job = self.id.0, error = %e, "finishing a dropped job failed");
        }
    }
}
