//! The worker's state and how Python reaches it. [`WorkerThread`] owns the facade
//! [`poolipc::Worker`] (its `Job` borrows it, which a Python object cannot hold) and carries
//! out, one function per command, what the Python objects ask over a [`Link`].
//!
//! A command runs on the thread that asks (the GIL released, the worker's device pushed as
//! that thread's current context and popped after): taking a job, requesting results, finishing cost no hop to another thread and back
//! (two wake-ups each, the larger part of what Python added to a round trip). The worker's
//! own thread, which opened it, does what must not wait for a caller: commands posted from a
//! DLPack deleter or a dropped job (carried out by whichever of it and the next call holds
//! the worker first, in the order posted) and, with `auto_take`, taking jobs in the
//! background between commands, queued in [`Arrived`] for `NativeWorker.take`.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::{Driver, OwnedEvent};
use poolipc::advanced::transport::{Connection, TOKEN_LEN};
use poolipc::{DevicePtr, ResultShape, StreamHandle};
use pyo3::prelude::*;

use super::shown::Shown;
use crate::errors::err;
use crate::state;

/// What Python asks the worker thread to do.
pub(super) enum Cmd {
    /// Take the next job; with `concurrent`, also while others are held open.
    NextJob {
        concurrent: bool,
    },
    Request(u64, Vec<ResultShape>),
    /// Make `waiter` wait for the work queued so far on `on`.
    StreamWait {
        waiter: StreamHandle,
        on: StreamHandle,
    },
    Read(DevicePtr, usize),
    Write(DevicePtr, Vec<u8>),
    Finish(u64),
    Fail(u64, String),
    /// Tell the parent job `id` is still being worked on (`Job::heartbeat`).
    Heartbeat(u64),
    /// From now on take jobs as they come, between commands (`take` hands them out).
    AutoTake,
}

/// The thread's answer to a [`Cmd`].
pub(super) enum Reply {
    Job(Option<(u64, Vec<Shown>)>),
    Results(Vec<Shown>),
    Bytes(Vec<u8>),
    Ok,
}

/// What a started worker thread reports: its stream, whether simulated, its device.
type Started = (u64, bool, u32);

/// What [`spawn`] gives: the link, the thread, and what it reported once started.
type Spawned = (
    Arc<Link>,
    std::thread::JoinHandle<()>,
    Result<Started, String>,
);

/// Where the worker's connection to its parent comes from.
pub(super) enum Source {
    /// The socket the parent's `spawn` left (`POOLIPC_FD`).
    Inherited,
    /// The parent's listening socket (`Parent.listen`), connected to by path, with the
    /// token the listener demands, if it demands one.
    Listener(PathBuf, Option<[u8; TOKEN_LEN]>),
}

/// How a failed connect to a listener's path starts: the error becomes `ConnectError`.
pub(super) const CONNECT_REFUSED: &str = "poolipc: cannot connect";

/// How long connecting to a listener may take (a listener's backlog is short-lived).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the thread, taking jobs in the background, waits for the parent's next frame
/// before it looks at its commands again: the most a command waits behind that poll.
const AUTO_POLL: Duration = Duration::from_micros(500);

/// Starts the worker's thread, which opens the worker. Returns the link to it, the
/// thread's handle and what it reported once started (its stream, whether simulated, its
/// device), or why it did not start.
pub(super) fn spawn(
    py: Python<'_>,
    source: Source,
    device: poolipc::WorkerDevice,
    arrived: &Arc<Arrived>,
) -> PyResult<Spawned> {
    let link = Arc::new(Link::default());
    let (rtx, rrx) = channel();
    let thread = std::thread::Builder::new()
        .name("poolipc-worker".into())
        .spawn({
            let arrived = Arc::clone(arrived);
            let link = Arc::clone(&link);
            move || thread_main(source, device, &link, &rtx, arrived)
        })
        .map_err(|e| err(format!("poolipc: starting the worker thread: {e}")))?;
    let started = py
        .detach(move || rrx.recv())
        .map_err(|_| err("poolipc: the worker thread ended before it started"))?;
    Ok((link, thread, started))
}

fn thread_main(
    source: Source,
    device: poolipc::WorkerDevice,
    link: &Link,
    ready: &std::sync::mpsc::Sender<Result<Started, String>>,
    arrived: Arc<Arrived>,
) {
    let thread = match WorkerThread::open(&source, device, arrived) {
        Ok(t) => t,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let started = (
        thread.worker.stream().as_raw(),
        thread.sim,
        thread.worker.device(),
    );
    *link.core() = Some(thread);
    let _ = ready.send(Ok(started));
    link.serve();
}

/// The connection to a listener, or None for the inherited socket. A listener is reached
/// first: a wrong path says so, whatever the driver.
fn connect(source: &Source) -> Result<Option<Connection>, String> {
    let Source::Listener(path, token) = source else {
        return Ok(None);
    };
    let deadline = Instant::now() + CONNECT_TIMEOUT;
    let mut conn = poolipc::advanced::transport::connect_private(path, deadline).map_err(|e| {
        format!(
            "{CONNECT_REFUSED}: no poolipc parent listens at {}: {e}",
            path.display()
        )
    })?;
    if let Some(t) = token {
        conn.send_token(t, deadline).map_err(|e| {
            format!(
                "{CONNECT_REFUSED}: sending the token to {}: {e}",
                path.display()
            )
        })?;
    }
    Ok(Some(conn))
}

/// What the thread owns: the facade worker, the jobs it holds open, how it takes jobs.
struct WorkerThread {
    worker: poolipc::Worker,
    driver: Arc<dyn Driver>,
    sim: bool,
    /// Recorded to order one stream after another (`Cmd::StreamWait`).
    sync_event: OwnedEvent,
    /// Open jobs, set aside between commands: several may be open at once (leases).
    held: HashMap<u64, poolipc::HeldJob>,
    /// Taking jobs as they come (`auto_take`): between commands, the socket is polled.
    auto: bool,
    /// The parent said goodbye while jobs were taken in the background: once the last held
    /// job is finished the thread ends, dropping the worker, which closes the socket: the
    /// parent's `stop` of a worker it did not start waits for that.
    parting: bool,
    arrived: Arc<Arrived>,
}

impl WorkerThread {
    /// Connects, opens the driver, shakes hands with the parent.
    fn open(
        source: &Source,
        device: poolipc::WorkerDevice,
        arrived: Arc<Arrived>,
    ) -> Result<WorkerThread, String> {
        let conn = connect(source)?;
        let driver = state::open_worker_driver()?;
        let sim = state::is_sim(&*driver);
        let worker = match conn {
            None => poolipc::Worker::from_env(driver, device)
                .map_err(|e| format!("poolipc: starting the worker: {e}")),
            Some(conn) => poolipc::Worker::connect(driver, device, conn).map_err(|e| {
                format!("poolipc: the parent's listener did not take this worker: {e}")
            }),
        }?;
        let driver = Arc::clone(worker.driver());
        let sync_event = OwnedEvent::new(Arc::clone(&driver), false)
            .map_err(|e| format!("poolipc: cuEventCreate: {e}"))?;
        Ok(WorkerThread {
            worker,
            driver,
            sim,
            sync_event,
            held: HashMap::new(),
            auto: false,
            parting: false,
            arrived,
        })
    }

    fn answer(&mut self, cmd: Cmd) -> Result<Reply, String> {
        match cmd {
            Cmd::AutoTake => {
                self.auto = true;
                Ok(Reply::Ok)
            }
            Cmd::StreamWait { waiter, on } => self.stream_wait(waiter, on),
            Cmd::Read(p, n) => self.read(p, n),
            Cmd::Write(p, data) => self.write(p, &data),
            Cmd::NextJob { concurrent } => self.next_job(concurrent),
            Cmd::Request(id, shapes) => self.request(id, &shapes),
            Cmd::Finish(id) => self.finish(id),
            Cmd::Fail(id, msg) => self.fail(id, &msg),
            Cmd::Heartbeat(id) => self.heartbeat(id),
        }
    }

    /// Makes `waiter` wait for the work queued so far on `on`.
    fn stream_wait(&self, waiter: StreamHandle, on: StreamHandle) -> Result<Reply, String> {
        // The simulation knows no CU_STREAM_LEGACY (1) or CU_STREAM_PER_THREAD (2): its
        // default stream is 0.
        let sim_default = |s: StreamHandle| {
            if self.sim && (s.as_raw() == 1 || s.as_raw() == 2) {
                StreamHandle::NULL
            } else {
                s
            }
        };
        let (waiter, on) = (sim_default(waiter), sim_default(on));
        if waiter == on {
            return Ok(Reply::Ok);
        }
        self.driver
            .event_record(self.sync_event.handle(), on)
            .and_then(|()| {
                self.driver
                    .stream_wait_event(waiter, self.sync_event.handle())
            })
            .map(|()| Reply::Ok)
            .map_err(|e| format!("poolipc: ordering streams: {e}"))
    }

    // The views' reads and writes go on the worker's stream, where the job's READY wait sits
    // and where its DONE is recorded later: a read sees the parent's bytes (not what was there
    // before the parent's kernel ran), a write lands before DONE. A synchronous copy on the
    // legacy stream would be ordered after neither (the worker's stream is non-blocking).

    /// Copies `n` bytes at `p` to the host, on the worker's stream.
    fn read(&self, p: DevicePtr, n: usize) -> Result<Reply, String> {
        let mut buf = vec![0u8; n];
        self.driver
            .memcpy_dtoh_on(&mut buf, p, self.worker.stream())
            .map(|()| Reply::Bytes(buf))
            .map_err(|e| format!("poolipc: reading device memory: {e}"))
    }

    /// Copies `data` to `p`, on the worker's stream.
    fn write(&self, p: DevicePtr, data: &[u8]) -> Result<Reply, String> {
        self.driver
            .memcpy_htod_on(p, data, self.worker.stream())
            .map(|()| Reply::Ok)
            .map_err(|e| format!("poolipc: writing device memory: {e}"))
    }

    /// Waits for the next job and holds it open.
    fn next_job(&mut self, concurrent: bool) -> Result<Reply, String> {
        if !concurrent && !self.held.is_empty() {
            return Err("poolipc: the previous job is still open; finish it first".into());
        }
        if self.auto {
            return Err(
                "poolipc: this worker takes its jobs in the background (auto_take); use take()"
                    .into(),
            );
        }
        match self.worker.next_job() {
            Ok(Some(job)) => {
                let id = job.id().0;
                let inputs = Shown::inputs_of(&job);
                self.held.insert(id, job.hold());
                Ok(Reply::Job(Some((id, inputs))))
            }
            Ok(None) => Ok(Reply::Job(None)),
            Err(e) => Err(format!("poolipc: waiting for a job: {e}")),
        }
    }

    /// Asks the parent for job `id`'s result memory; the job stays held either way.
    fn request(&mut self, id: u64, shapes: &[ResultShape]) -> Result<Reply, String> {
        let mut job = take_up(&mut self.worker, &mut self.held, id)?;
        let answer = match job.request_results(shapes) {
            Ok(views) => Ok(Reply::Results(
                views.iter().cloned().map(Shown::Result).collect(),
            )),
            Err(e) => Err(format!("poolipc: requesting results: {e}")),
        };
        self.held.insert(id, job.hold());
        answer
    }

    /// Tells the parent job `id` is still being worked on; the job stays held.
    fn heartbeat(&mut self, id: u64) -> Result<Reply, String> {
        let mut job = take_up(&mut self.worker, &mut self.held, id)?;
        let answer = job
            .heartbeat()
            .map(|()| Reply::Ok)
            .map_err(|e| format!("poolipc: sending a heartbeat: {e}"));
        self.held.insert(id, job.hold());
        answer
    }

    fn finish(&mut self, id: u64) -> Result<Reply, String> {
        let job = take_up(&mut self.worker, &mut self.held, id)?;
        job.finish()
            .map(|()| Reply::Ok)
            .map_err(|e| format!("poolipc: finishing the job: {e}"))
    }

    fn fail(&mut self, id: u64, msg: &str) -> Result<Reply, String> {
        let job = take_up(&mut self.worker, &mut self.held, id)?;
        job.fail(msg)
            .map(|()| Reply::Ok)
            .map_err(|e| format!("poolipc: failing the job: {e}"))
    }

    /// No command waits: take a job if one comes within [`AUTO_POLL`], queue it for `take`.
    fn take_in_background(&mut self) {
        let gone = match self.worker.next_job_within(AUTO_POLL) {
            Ok(poolipc::NextJob::Job(job)) => {
                let id = job.id().0;
                let inputs = Shown::inputs_of(&job);
                self.held.insert(id, job.hold());
                self.arrived.push(id, inputs);
                false
            }
            Ok(poolipc::NextJob::Idle) => false,
            Ok(poolipc::NextJob::Gone) => true,
            Err(e) => {
                self.auto = false;
                self.arrived
                    .end(Some(format!("poolipc: waiting for a job: {e}")));
                false
            }
        };
        if gone {
            self.part();
        }
    }

    /// The parent said goodbye: no more jobs; those that arrived but were never handed out
    /// fail (nobody will finish them), and the thread ends once the rest are finished.
    fn part(&mut self) {
        self.auto = false;
        self.parting = true;
        for id in self.arrived.end_and_drain(None) {
            if let Some(h) = self.held.remove(&id)
                && let Ok(job) = self.worker.resume(h)
            {
                let _ = job.fail("the parent said goodbye before this job was taken");
            }
        }
    }

    /// The Python side is gone: every job still open is taken up and dropped, which reports
    /// it failed and finishes it, so the parent is not left waiting.
    fn close(mut self) {
        self.arrived.end(None);
        for (_, h) in self.held.drain() {
            if let Ok(job) = self.worker.resume(h) {
                drop(job);
            }
        }
    }
}

/// The held job `id`, taken up again on `worker`.
fn take_up<'w>(
    worker: &'w mut poolipc::Worker,
    held: &mut HashMap<u64, poolipc::HeldJob>,
    id: u64,
) -> Result<poolipc::Job<'w>, String> {
    let h = held
        .remove(&id)
        .ok_or_else(|| format!("poolipc: job {id} is not open on this worker"))?;
    worker
        .resume(h)
        .map_err(|e| format!("poolipc: taking up job {id}: {e}"))
}

/// How the Python objects reach the worker: [`call`](Link::call) runs a command on the
/// calling thread, holding the worker; [`post`](Link::post) leaves one for the worker's
/// thread (or the next call), without waiting.
#[derive(Default)]
pub(super) struct Link {
    /// The worker; None before it opened and once it is closed.
    core: Mutex<Option<WorkerThread>>,
    posted: Mutex<Posted>,
    /// Something was posted, the link closed, or a call let go of the worker (the
    /// background taking, which gives calls the way, goes on).
    changed: Condvar,
    /// Calls waiting for the worker: the background taking lets them have it first.
    waiting: AtomicUsize,
    /// Whether the worker takes jobs in the background (`auto_take`), as its thread sees it.
    auto: AtomicBool,
}

/// Commands posted and not yet carried out, and whether the link is closed.
#[derive(Default)]
struct Posted {
    cmds: VecDeque<Cmd>,
    /// `close` was called, or the worker ended (it parted from its parent): no more calls.
    closed: bool,
}

/// How long the worker's thread sleeps, with nothing posted, before it looks again.
const IDLE_WAIT: Duration = Duration::from_millis(50);

impl Link {
    fn core(&self) -> MutexGuard<'_, Option<WorkerThread>> {
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn posted(&self) -> MutexGuard<'_, Posted> {
        self.posted.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `cmd` on this thread, the GIL released, and returns its answer. Commands posted
    /// before it run first.
    pub(super) fn call(&self, py: Python<'_>, cmd: Cmd) -> PyResult<Reply> {
        py.detach(move || self.run(cmd)).map_err(err)
    }

    fn run(&self, cmd: Cmd) -> Result<Reply, String> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let mut core = self.core();
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        let closed = self.posted().closed;
        let answer = match core.as_mut() {
            Some(w) if !closed => {
                // CUDA contexts are per thread: this one may never have had the worker's,
                // or have torch's on another device, which it gets back after.
                let driver = Arc::clone(&w.driver);
                match state::OnDevice::push(&*driver, w.worker.device()) {
                    Ok(_on) => {
                        self.run_posted(w);
                        w.answer(cmd)
                    }
                    Err(e) => Err(format!("poolipc: making the worker's device current: {e}")),
                }
            }
            _ => Err("poolipc: this worker was closed".into()),
        };
        self.settle(&mut core);
        drop(core);
        if self.auto.load(Ordering::SeqCst) {
            self.changed.notify_all();
        }
        answer
    }

    /// Carries out what was posted, in order (the worker held by the caller).
    fn run_posted(&self, w: &mut WorkerThread) {
        loop {
            let Some(cmd) = self.posted().cmds.pop_front() else {
                return;
            };
            if let Err(e) = w.answer(cmd) {
                tracing::warn!(error = %e, "a posted worker command failed");
            }
        }
    }

    /// After the worker was used: notes whether it takes jobs in the background, and closes
    /// it once it parted from its parent and its last job ended.
    fn settle(&self, core: &mut Option<WorkerThread>) {
        let Some(w) = core.as_ref() else { return };
        self.auto.store(w.auto, Ordering::SeqCst);
        if w.parting && w.held.is_empty() {
            self.posted().closed = true;
            if let Some(w) = core.take() {
                w.close();
            }
            self.changed.notify_all();
        }
    }

    /// Leaves `cmd` for the worker's thread (or the next call), without waiting: what a
    /// DLPack deleter or a dropped job does, on whatever thread, with or without the GIL.
    pub(super) fn post(&self, cmd: Cmd) {
        let mut p = self.posted();
        if !p.closed {
            p.cmds.push_back(cmd);
        }
        drop(p);
        self.changed.notify_all();
    }

    /// Closes the link: calls are refused from now on, and the worker's thread closes the
    /// worker (every job still open is failed and finished) and ends.
    pub(super) fn close(&self) {
        self.posted().closed = true;
        self.changed.notify_all();
    }

    /// The worker's thread: carries out what is posted and, with `auto_take`, takes jobs
    /// between calls; closes the worker once the link is closed.
    fn serve(&self) {
        loop {
            let closed = {
                let mut p = self.posted();
                loop {
                    let taking = self.auto.load(Ordering::SeqCst)
                        && self.waiting.load(Ordering::SeqCst) == 0;
                    if p.closed || !p.cmds.is_empty() || taking {
                        break;
                    }
                    p = self
                        .changed
                        .wait_timeout(p, IDLE_WAIT)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                p.closed
            };
            let mut core = self.core();
            let Some(w) = core.as_mut() else { return };
            self.run_posted(w);
            if closed {
                if let Some(w) = core.take() {
                    w.close();
                }
                return;
            }
            if w.auto && self.waiting.load(Ordering::SeqCst) == 0 {
                w.take_in_background();
            }
            self.settle(&mut core);
        }
    }
}

/// Jobs the thread took in the background, for `NativeWorker.take`.
#[derive(Default)]
pub(super) struct Arrived {
    queue: Mutex<ArrivedQueue>,
    changed: Condvar,
}

/// A job that arrived: its id and its inputs.
pub(super) type ArrivedJob = (u64, Vec<Shown>);

#[derive(Default)]
struct ArrivedQueue {
    jobs: VecDeque<ArrivedJob>,
    /// No more will come: the parent said goodbye or went away (None), or an error.
    ended: Option<Option<String>>,
}

impl ArrivedQueue {
    /// Takes job `job` out of the queue, or the first one when `job` is None.
    fn pick(&mut self, job: Option<u64>) -> Option<ArrivedJob> {
        let at = match job {
            Some(id) => self.jobs.iter().position(|(j, _)| *j == id),
            None => (!self.jobs.is_empty()).then_some(0),
        };
        at.and_then(|i| self.jobs.remove(i))
    }
}

impl Arrived {
    fn push(&self, id: u64, inputs: Vec<Shown>) {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .jobs
            .push_back((id, inputs));
        self.changed.notify_all();
    }

    /// Ends the queue and gives back the ids of the jobs still in it.
    fn end_and_drain(&self, why: Option<String>) -> Vec<u64> {
        let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        q.ended.get_or_insert(why);
        let ids = q.jobs.drain(..).map(|(id, _)| id).collect();
        drop(q);
        self.changed.notify_all();
        ids
    }

    fn end(&self, why: Option<String>) {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ended
            .get_or_insert(why);
        self.changed.notify_all();
    }

    /// Job `job` (or the first to arrive, when None) if it is queued or comes within `slice`
    /// (and before `deadline`): `Some(Ok(job))`; `Some(Err(why))` when the queue ended
    /// without it (None: the parent said goodbye or went away; else the error); None when it
    /// has not come yet.
    pub(super) fn wait_for(
        &self,
        job: Option<u64>,
        slice: Duration,
        deadline: Option<Instant>,
    ) -> Option<Result<ArrivedJob, Option<String>>> {
        let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = q.pick(job) {
            return Some(Ok(found));
        }
        if let Some(why) = &q.ended {
            return Some(Err(why.clone()));
        }
        let wait = deadline.map_or(slice, |d| {
            slice.min(d.saturating_duration_since(Instant::now()))
        });
        let (mut q, _) = self
            .changed
            .wait_timeout(q, wait)
            .unwrap_or_else(PoisonError::into_inner);
        q.pick(job).map(Ok)
    }
}
