//! The worker side for Python: a thread owns the facade [`poolipc::Worker`] (its `Job` borrows
//! it, which a Python object cannot hold) and carries out the commands Python objects send it.
//! Every CUDA call of the worker happens on that thread, where the context is current.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use poolipc::{DType, DevicePtr, ResultShape, StreamHandle};
use pyo3::exceptions::{PyAttributeError, PyBufferError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::dlpack;
use crate::dtype;
use crate::errors::{ConnectError, ExpiredViewError, JobFailedError, err};
use crate::state;

/// What Python asks the worker thread to do.
enum Cmd {
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
    /// From now on take jobs as they come, between commands (`take` hands them out).
    AutoTake,
}

/// A view as the thread describes it.
#[derive(Clone)]
struct ViewInfo {
    ptr: DevicePtr,
    dtype: DType,
    shape: Vec<u64>,
    /// In elements, filled in when contiguous.
    strides: Vec<i64>,
    nbytes: u64,
    rung: String,
    /// A host-staged input: this worker's private copy, which goes one way only.
    read_only: bool,
}

enum Reply {
    Job(Option<(u64, Vec<ViewInfo>)>),
    Results(Vec<ViewInfo>),
    Bytes(Vec<u8>),
    Ok,
}

type Envelope = (Cmd, Sender<Result<Reply, String>>);

/// What a started worker thread reports: its stream, whether simulated, its device.
type Started = (u64, bool, u32);

/// Where the worker's connection to its parent comes from.
enum Source {
    /// The socket the parent's `spawn` left (`POOLIPC_FD`).
    Inherited,
    /// The parent's listening socket (`Parent.listen`), connected to by path, with the
    /// token the listener demands, if it demands one.
    Listener(PathBuf, Option<[u8; poolipc_transport::TOKEN_LEN]>),
}

/// How a failed connect to a listener's path starts: the error becomes `ConnectError`.
const CONNECT_REFUSED: &str = "poolipc: cannot connect";

/// How long connecting to a listener may take (a listener's backlog is short-lived).
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn thread_main(
    source: Source,
    device: poolipc::WorkerDevice,
    rx: Receiver<Envelope>,
    ready: Sender<Result<Started, String>>,
    arrived: Arc<Arrived>,
) {
    // A listener is reached first: a wrong path says so, whatever the driver.
    let conn = match &source {
        Source::Inherited => Ok(None),
        Source::Listener(path, token) => {
            let deadline = std::time::Instant::now() + CONNECT_TIMEOUT;
            poolipc_transport::connect_private(path, deadline)
                .map_err(|e| {
                    format!(
                        "{CONNECT_REFUSED}: no poolipc parent listens at {}: {e}",
                        path.display()
                    )
                })
                .and_then(|mut conn| match token {
                    Some(t) => conn.send_token(t, deadline).map(|()| conn).map_err(|e| {
                        format!(
                            "{CONNECT_REFUSED}: sending the token to {}: {e}",
                            path.display()
                        )
                    }),
                    None => Ok(conn),
                })
                .map(Some)
        }
    };
    let opened = conn.and_then(|conn| {
        let driver = state::open_worker_driver()?;
        let sim = state::is_sim(&*driver);
        let worker = match conn {
            None => poolipc::Worker::from_env_with(driver, device)
                .map_err(|e| format!("poolipc: starting the worker: {e}")),
            Some(conn) => poolipc::Worker::connect_with(driver, device, conn).map_err(|e| {
                format!("poolipc: the parent's listener did not take this worker: {e}")
            }),
        };
        worker.map(|w| (w, sim))
    });
    let (mut worker, sim) = match opened {
        Ok(w) => w,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let driver = Arc::clone(worker.driver());
    let sync_event = match driver.event_create(false) {
        Ok(e) => e,
        Err(e) => {
            let _ = ready.send(Err(format!("poolipc: cuEventCreate: {e}")));
            return;
        }
    };
    let _ = ready.send(Ok((worker.stream().as_raw(), sim, worker.device())));
    let stream_wait = |waiter: StreamHandle, on: StreamHandle| -> Result<Reply, String> {
        // The simulation knows no CU_STREAM_LEGACY (1) or CU_STREAM_PER_THREAD (2): its
        // default stream is 0.
        let sim_default = |s: StreamHandle| {
            if sim && (s.as_raw() == 1 || s.as_raw() == 2) {
                StreamHandle::NULL
            } else {
                s
            }
        };
        let (waiter, on) = (sim_default(waiter), sim_default(on));
        if waiter == on {
            return Ok(Reply::Ok);
        }
        driver
            .event_record(sync_event, on)
            .and_then(|()| driver.stream_wait_event(waiter, sync_event))
            .map(|()| Reply::Ok)
            .map_err(|e| format!("poolipc: ordering streams: {e}"))
    };
    // The views' reads and writes go on the worker's stream, where the job's READY wait sits
    // and where its DONE is recorded later: a read sees the parent's bytes (not what was there
    // before the parent's kernel ran), a write lands before DONE. A synchronous copy on the
    // legacy stream would be ordered after neither (the worker's stream is non-blocking).
    let job_stream = worker.stream();
    let copy = |cmd: Cmd| -> Result<Reply, String> {
        match cmd {
            Cmd::Read(p, n) => {
                let mut buf = vec![0u8; n];
                driver
                    .memcpy_dtoh_on(&mut buf, p, job_stream)
                    .map(|()| Reply::Bytes(buf))
                    .map_err(|e| format!("poolipc: reading device memory: {e}"))
            }
            Cmd::Write(p, data) => driver
                .memcpy_htod_on(p, &data, job_stream)
                .map(|()| Reply::Ok)
                .map_err(|e| format!("poolipc: writing device memory: {e}")),
            _ => Err("poolipc: not a copy".into()),
        }
    };
    // Open jobs, set aside between commands: several may be open at once (leases).
    let mut held: HashMap<u64, poolipc::HeldJob> = HashMap::new();
    // Taking jobs as they come (`auto_take`): between commands, the socket is polled.
    let mut auto = false;
    // The parent said goodbye while jobs were taken in the background: once the last held
    // job is finished the thread ends, dropping the worker, which closes the socket: the
    // parent's `stop` of a worker it did not start waits for that.
    let mut parting = false;
    loop {
        if parting && held.is_empty() {
            break;
        }
        let next = if auto {
            match rx.try_recv() {
                Ok(m) => Some(m),
                Err(std::sync::mpsc::TryRecvError::Empty) => None,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
            }
        } else {
            match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => break,
            }
        };
        let Some((cmd, reply)) = next else {
            let gone = match worker.next_job_within(AUTO_POLL) {
                Ok(poolipc::NextJob::Job(job)) => {
                    let id = job.id().0;
                    let inputs = input_infos(&job);
                    held.insert(id, job.hold());
                    arrived.push(id, inputs);
                    false
                }
                Ok(poolipc::NextJob::Idle) => false,
                Ok(poolipc::NextJob::Gone) => true,
                Err(e) => {
                    auto = false;
                    arrived.end(Some(format!("poolipc: waiting for a job: {e}")));
                    false
                }
            };
            if gone {
                auto = false;
                parting = true;
                // Jobs that arrived but were never handed out: nobody will finish them.
                for id in arrived.end_and_drain(None) {
                    if let Some(h) = held.remove(&id)
                        && let Ok(job) = worker.resume(h)
                    {
                        let _ = job.fail("the parent said goodbye before this job was taken");
                    }
                }
            }
            continue;
        };
        let answer = match cmd {
            Cmd::AutoTake => {
                auto = true;
                Ok(Reply::Ok)
            }
            Cmd::StreamWait { waiter, on } => stream_wait(waiter, on),
            c @ (Cmd::Read(..) | Cmd::Write(..)) => copy(c),
            Cmd::NextJob { concurrent } if !concurrent && !held.is_empty() => {
                Err("poolipc: the previous job is still open; finish it first".into())
            }
            Cmd::NextJob { .. } if auto => Err(
                "poolipc: this worker takes its jobs in the background (auto_take); use take()"
                    .into(),
            ),
            Cmd::NextJob { .. } => match worker.next_job() {
                Ok(Some(job)) => {
                    let id = job.id().0;
                    let inputs = input_infos(&job);
                    held.insert(id, job.hold());
                    Ok(Reply::Job(Some((id, inputs))))
                }
                Ok(None) => Ok(Reply::Job(None)),
                Err(e) => Err(format!("poolipc: waiting for a job: {e}")),
            },
            Cmd::Request(id, shapes) => match take_up(&mut worker, &mut held, id) {
                Err(e) => Err(e),
                Ok(mut job) => {
                    let answer = match job.request_results(&shapes) {
                        Ok(views) => Ok(Reply::Results(
                            views
                                .iter()
                                .map(|v| ViewInfo {
                                    ptr: v.ptr(),
                                    dtype: v.shape().dtype,
                                    shape: v.shape().shape.clone(),
                                    strides: poolipc::TensorDesc::contiguous_strides(
                                        &v.shape().shape,
                                    ),
                                    nbytes: v.bytes(),
                                    rung: v.rung().to_string(),
                                    read_only: false,
                                })
                                .collect(),
                        )),
                        Err(e) => Err(format!("poolipc: requesting results: {e}")),
                    };
                    held.insert(id, job.hold());
                    answer
                }
            },
            Cmd::Finish(id) => take_up(&mut worker, &mut held, id).and_then(|job| {
                job.finish()
                    .map(|()| Reply::Ok)
                    .map_err(|e| format!("poolipc: finishing the job: {e}"))
            }),
            Cmd::Fail(id, msg) => take_up(&mut worker, &mut held, id).and_then(|job| {
                job.fail(&msg)
                    .map(|()| Reply::Ok)
                    .map_err(|e| format!("poolipc: failing the job: {e}"))
            }),
        };
        let _ = reply.send(answer);
    }
    arrived.end(None);
    // The Python side is gone: every job still open is taken up and dropped, which reports
    // it failed and finishes it, so the parent is not left waiting.
    for (_, h) in held.drain() {
        if let Ok(job) = worker.resume(h) {
            drop(job);
        }
    }
}

/// How long the thread, taking jobs in the background, waits for the parent's next frame
/// before it looks at its commands again: the most a command waits behind that poll.
const AUTO_POLL: std::time::Duration = std::time::Duration::from_micros(500);

fn input_infos(job: &poolipc::Job<'_>) -> Vec<ViewInfo> {
    job.inputs()
        .iter()
        .map(|v| ViewInfo {
            ptr: v.ptr(),
            dtype: v.desc().dtype,
            shape: v.desc().shape.clone(),
            strides: v.desc().strides_or_contiguous(),
            nbytes: v.byte_len(),
            rung: v.rung().to_string(),
            read_only: v.read_only(),
        })
        .collect()
}

/// Jobs the thread took in the background, for `NativeWorker.take`.
#[derive(Default)]
pub(crate) struct Arrived {
    queue: Mutex<ArrivedQueue>,
    changed: std::sync::Condvar,
}

#[derive(Default)]
struct ArrivedQueue {
    jobs: std::collections::VecDeque<(u64, Vec<ViewInfo>)>,
    /// No more will come: the parent said goodbye or went away (None), or an error.
    ended: Option<Option<String>>,
}

impl Arrived {
    fn push(&self, id: u64, inputs: Vec<ViewInfo>) {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .jobs
            .push_back((id, inputs));
        self.changed.notify_all();
    }

    /// Ends the queue and gives back the ids of the jobs still in it.
    fn end_and_drain(&self, why: Option<String>) -> Vec<u64> {
        let mut q = self
            .queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        q.ended.get_or_insert(why);
        let ids = q.jobs.drain(..).map(|(id, _)| id).collect();
        drop(q);
        self.changed.notify_all();
        ids
    }

    fn end(&self, why: Option<String>) {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .ended
            .get_or_insert(why);
        self.changed.notify_all();
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

/// The channel to the worker thread.
struct Link {
    tx: Mutex<Option<Sender<Envelope>>>,
}

impl Link {
    fn call(&self, py: Python<'_>, cmd: Cmd) -> PyResult<Reply> {
        let (rtx, rrx) = channel();
        {
            let guard = self
                .tx
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let tx = guard
                .as_ref()
                .ok_or_else(|| err("poolipc: this worker was closed"))?;
            tx.send((cmd, rtx))
                .map_err(|_| err("poolipc: the worker thread is gone"))?;
        }
        py.detach(move || rrx.recv())
            .map_err(|_| err("poolipc: the worker thread is gone"))?
            .map_err(err)
    }

    /// Sends without waiting for the answer (used at drop).
    fn post(&self, cmd: Cmd) {
        let guard = self
            .tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(tx) = guard.as_ref() {
            let (rtx, _) = channel();
            let _ = tx.send((cmd, rtx));
        }
    }
}

/// What every view of a job shares: whether the job is still open, how many DLPack tensors
/// made from its views are alive, and the consumer streams DONE must come after.
pub(crate) struct JobLife {
    id: u64,
    open: AtomicBool,
    pub(crate) live_exports: AtomicUsize,
    consumer_streams: Mutex<Vec<u64>>,
    /// Set by `Job.lease()`: the job ends when the last export (or lease hold) is dropped.
    release_on_drop: AtomicBool,
    link: Arc<Link>,
    job_stream: u64,
}

impl JobLife {
    /// One export (a DLPack tensor, or a lease's hold) is gone. The last one of a leased job
    /// ends it: DONE after every consumer stream, imports freed, ACK, posted to the worker
    /// thread without waiting (this runs in a DLPack deleter, on whatever thread frees the
    /// tensor, with or without the GIL).
    pub(crate) fn export_released(&self) {
        let before = self.live_exports.fetch_sub(1, Ordering::AcqRel);
        if before == 1 && self.release_on_drop.load(Ordering::Acquire) {
            self.end_posted();
        }
    }

    /// Ends the job from any thread, without waiting for the worker thread: once.
    fn end_posted(&self) {
        if !self.open.swap(false, Ordering::AcqRel) {
            return;
        }
        let streams = std::mem::take(
            &mut *self
                .consumer_streams
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for s in streams {
            self.link.post(Cmd::StreamWait {
                waiter: crate::dlpack::python_stream(self.job_stream),
                on: crate::dlpack::python_stream(s),
            });
        }
        self.link.post(Cmd::Finish(self.id));
    }
}

/// A worker process's side of poolipc. Made from the environment its parent set
/// (`POOLIPC_FD`, and `POOLIPC_SIM_MACHINE` on the simulated driver).
///
/// `NativeWorker(device=0, any=False)`: `device` is this process's ordinal of the parent's
/// device; `None` for whichever device has the parent's UUID (ordinals differ when the
/// processes' `CUDA_VISIBLE_DEVICES` differ); with `any=True`, the ordinal to work on
/// wherever the parent's pool is (peer access, else host staging).
///
/// Raises `PoolipcError` when the process was not spawned by a poolipc parent, the
/// handshake fails, no driver can be opened, or no device fits (the message says why).
#[pyclass(module = "poolipc", name = "NativeWorker", frozen)]
pub(crate) struct NativeWorker {
    link: Arc<Link>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The jobs' stream: it waits on each job's READY; DONE is recorded on it.
    #[pyo3(get)]
    stream: u64,
    /// The device ordinal this process works on.
    #[pyo3(get)]
    device: u32,
    /// Whether the worker is on the simulated driver (its parent was).
    #[pyo3(get)]
    simulated: bool,
    arrived: Arc<Arrived>,
}

impl NativeWorker {
    fn start(py: Python<'_>, source: Source, device: Option<u32>, any: bool) -> PyResult<Self> {
        let device = match (device, any) {
            (Some(n), false) => poolipc::WorkerDevice::Exactly(n),
            (Some(n), true) => poolipc::WorkerDevice::Any(n),
            (None, _) => poolipc::WorkerDevice::Parent,
        };
        let (tx, rx) = channel::<Envelope>();
        let (rtx, rrx) = channel();
        let arrived = Arc::new(Arrived::default());
        let thread = std::thread::Builder::new()
            .name("poolipc-worker".into())
            .spawn({
                let arrived = Arc::clone(&arrived);
                move || thread_main(source, device, rx, rtx, arrived)
            })
            .map_err(|e| err(format!("poolipc: starting the worker thread: {e}")))?;
        let started = py
            .detach(move || rrx.recv())
            .map_err(|_| err("poolipc: the worker thread ended before it started"))?;
        let (stream, simulated, device) = match started {
            Ok(s) => s,
            Err(e) => {
                let _ = thread.join();
                if e.starts_with(CONNECT_REFUSED) {
                    return Err(ConnectError::new_err(e));
                }
                return Err(err(e));
            }
        };
        Ok(NativeWorker {
            link: Arc::new(Link {
                tx: Mutex::new(Some(tx)),
            }),
            thread: Mutex::new(Some(thread)),
            stream,
            device,
            simulated,
            arrived,
        })
    }

    /// A Python `Job` over what the thread reported of a job it took.
    fn make_job(&self, py: Python<'_>, id: u64, inputs: Vec<ViewInfo>) -> PyResult<Job> {
        let life = Arc::new(JobLife {
            id,
            open: AtomicBool::new(true),
            live_exports: AtomicUsize::new(0),
            consumer_streams: Mutex::new(Vec::new()),
            release_on_drop: AtomicBool::new(false),
            link: Arc::clone(&self.link),
            job_stream: self.stream,
        });
        let views = inputs
            .into_iter()
            .map(|info| {
                Py::new(
                    py,
                    View::new(info, false, &life, &self.link, self.stream, self.device),
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Job {
            id,
            link: Arc::clone(&self.link),
            life,
            stream: self.stream,
            device: self.device,
            inputs: views,
            results: Mutex::new(Vec::new()),
        })
    }
}

#[pymethods]
impl NativeWorker {
    /// `device`: this process's ordinal of the parent's device; `None` for whichever device
    /// has the parent's UUID (ordinals differ when the processes' `CUDA_VISIBLE_DEVICES`
    /// differ); with `any=True`, the ordinal to work on wherever the parent's pool is (peer
    /// access, else host staging). See `poolipc::WorkerDevice`.
    #[new]
    #[pyo3(signature = (device = Some(0), any = false), text_signature = "(device=0, any=False)")]
    fn new(py: Python<'_>, device: Option<u32>, any: bool) -> PyResult<Self> {
        NativeWorker::start(py, Source::Inherited, device, any)
    }

    /// Connects to a parent's listening socket at `path` (`Parent.listen`): the worker of a
    /// process the parent did not start. `device` and `any` as for the constructor; `token`
    /// the listener's token when it demands one (sent before anything else).
    ///
    /// Raises `ValueError` for a token that is not 32 ASCII characters; `ConnectError` when
    /// nothing listens at `path` (no such socket, the listener is closed, the parent is gone)
    /// or the listener runs as another user; `PoolipcError` when the handshake fails (a
    /// wrong token: the listener hangs up) or no device fits.
    #[staticmethod]
    #[pyo3(signature = (path, device = Some(0), any = false, token = None), text_signature = "(path, device=0, any=False, token=None)")]
    fn connect(
        py: Python<'_>,
        path: PathBuf,
        device: Option<u32>,
        any: bool,
        token: Option<String>,
    ) -> PyResult<Self> {
        crate::listen::check_socket_path(&path)?;
        let token = token.map(|t| crate::listen::parse_token(&t)).transpose()?;
        NativeWorker::start(py, Source::Listener(path, token), device, any)
    }

    /// Waits for the next job; None when the parent said goodbye or went away. With
    /// `concurrent=True` it takes the next job also while others are open (leases: each is
    /// finished on its own, in any order); otherwise a job still open is a `PoolipcError`.
    #[pyo3(signature = (concurrent = false))]
    fn next_job(&self, py: Python<'_>, concurrent: bool) -> PyResult<Option<Job>> {
        match self.link.call(py, Cmd::NextJob { concurrent })? {
            Reply::Job(None) => Ok(None),
            Reply::Job(Some((id, inputs))) => self.make_job(py, id, inputs).map(Some),
            _ => Err(err("poolipc: unexpected answer from the worker thread")),
        }
    }

    /// From now on the worker's thread takes jobs as they come, between the commands of
    /// the jobs it holds (several may be open at once); `take` hands them out. Needed where
    /// nothing else waits for jobs: the parent's canary battery is answered as it arrives.
    /// `next_job` is refused from then on.
    fn auto_take(&self, py: Python<'_>) -> PyResult<()> {
        self.link.call(py, Cmd::AutoTake).map(|_| ())
    }

    /// A job taken in the background (`auto_take`): the one with id `job`, or the first to
    /// arrive when `job` is None; others stay queued. Waits at most `timeout` seconds (None:
    /// until it comes), the GIL released. None when the parent said goodbye or went away
    /// and no such job is queued. Raises `TimeoutError` when it did not come in time,
    /// `PoolipcError` when taking jobs failed (the message says why), `ValueError` for a
    /// negative timeout.
    #[pyo3(signature = (job = None, timeout = None))]
    fn take(
        &self,
        py: Python<'_>,
        job: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Job>> {
        let deadline = match timeout {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => Some(
                std::time::Instant::now()
                    + std::time::Duration::try_from_secs_f64(t).unwrap_or(std::time::Duration::MAX),
            ),
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "poolipc: timeout={t} is not a timeout: give seconds, 0 or more, or None"
                )));
            }
        };
        let slice = std::time::Duration::from_millis(50);
        loop {
            let arrived = &self.arrived;
            let got = py.detach(move || {
                let pick = |q: &mut ArrivedQueue| {
                    let at = match job {
                        Some(id) => q.jobs.iter().position(|(j, _)| *j == id),
                        None => (!q.jobs.is_empty()).then_some(0),
                    };
                    at.and_then(|i| q.jobs.remove(i))
                };
                let mut q = arrived
                    .queue
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(found) = pick(&mut q) {
                    return Some(Ok(found));
                }
                if let Some(why) = &q.ended {
                    return Some(Err(why.clone()));
                }
                let wait = deadline.map_or(slice, |d| {
                    slice.min(d.saturating_duration_since(std::time::Instant::now()))
                });
                let (mut q, _) = arrived
                    .changed
                    .wait_timeout(q, wait)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                pick(&mut q).map(Ok)
            });
            match got {
                Some(Ok((id, inputs))) => return self.make_job(py, id, inputs).map(Some),
                Some(Err(None)) => return Ok(None),
                Some(Err(Some(why))) => return Err(err(why)),
                None => {}
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return Err(pyo3::exceptions::PyTimeoutError::new_err(match job {
                    Some(id) => format!("poolipc: job {id} did not arrive in time"),
                    None => "poolipc: no job arrived in time".to_owned(),
                }));
            }
        }
    }

    /// Stops the worker thread (an open job is finished first).
    fn close(&self, py: Python<'_>) {
        self.link
            .tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            py.detach(move || {
                let _ = t.join();
            });
        }
    }
}

impl Drop for NativeWorker {
    fn drop(&mut self) {
        // Closing the channel ends the thread; it is not joined here (no GIL juggling at drop).
        self.link
            .tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
    }
}

/// One job: input views, result buffers, and the obligation to finish. Finishing records
/// DONE after every consumer stream that took a view by DLPack, frees the imports, and
/// acknowledges; the views then raise `ExpiredViewError`.
#[pyclass(module = "poolipc", frozen)]
pub(crate) struct Job {
    /// The job's id (the parent's `JobHandle.id`).
    #[pyo3(get)]
    id: u64,
    link: Arc<Link>,
    life: Arc<JobLife>,
    /// The job's stream: it waited on READY; DONE is recorded on it.
    #[pyo3(get)]
    stream: u64,
    device: u32,
    inputs: Vec<Py<View>>,
    results: Mutex<Vec<Py<View>>>,
}

impl Job {
    fn end(&self, py: Python<'_>, cmd: Cmd) -> PyResult<()> {
        // Claimed at once, so two threads that end the job at the same time end it once
        // (the views expire from here; only the streams are still to be ordered).
        if !self.life.open.swap(false, Ordering::AcqRel) {
            return Err(ExpiredViewError::new_err(
                "poolipc: this job has already ended",
            ));
        }
        let streams = std::mem::take(
            &mut *self
                .life
                .consumer_streams
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let mut first_err = None;
        for s in streams {
            if let Err(e) = self.link.call(
                py,
                Cmd::StreamWait {
                    waiter: crate::dlpack::python_stream(self.stream),
                    on: crate::dlpack::python_stream(s),
                },
            ) {
                first_err.get_or_insert(e);
            }
        }
        self.link.call(py, cmd)?;
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[pymethods]
impl Job {
    /// The input views, in argument order.
    #[getter]
    fn inputs(&self, py: Python<'_>) -> Vec<Py<View>> {
        self.inputs.iter().map(|v| v.clone_ref(py)).collect()
    }

    /// The result buffers requested so far.
    #[getter]
    fn results(&self, py: Python<'_>) -> Vec<Py<View>> {
        self.results
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|v| v.clone_ref(py))
            .collect()
    }

    /// Whether the job is still open.
    #[getter]
    fn open(&self) -> bool {
        self.life.open.load(Ordering::Acquire)
    }

    /// How many DLPack tensors made from this job's views are still alive. After `finish` they
    /// point at memory the parent owns again and must not be used.
    #[getter]
    fn live_exports(&self) -> usize {
        self.life.live_exports.load(Ordering::Acquire)
    }

    /// Makes the job a lease: instead of `finish`, it ends by itself once every tensor made
    /// from its views by DLPack has been freed and the returned `LeaseHold` released
    /// (`release()`, or dropped). Ending it is what `finish` does: DONE after every consumer
    /// stream that took a view, imports freed, ACK; it is posted to the worker's thread from
    /// whichever thread frees the last tensor. The `Job` object may be dropped meanwhile.
    /// Views themselves hold nothing: take the tensors you need before releasing the hold.
    ///
    /// Raises `ExpiredViewError` once the job ended.
    fn lease(&self) -> PyResult<LeaseHold> {
        if !self.life.open.load(Ordering::Acquire) {
            return Err(ExpiredViewError::new_err(
                "poolipc: this job has already ended",
            ));
        }
        self.life.live_exports.fetch_add(1, Ordering::AcqRel);
        self.life.release_on_drop.store(true, Ordering::Release);
        Ok(LeaseHold {
            life: Mutex::new(Some(Arc::clone(&self.life))),
        })
    }

    /// Asks the parent for result memory, shape first: `shapes` is a list of
    /// `(dtype, shape)`. Returns the new result buffers (contiguous).
    ///
    /// Raises `ValueError` for an unknown dtype or a shape too large to count in bytes (before
    /// anything is asked), `ExpiredViewError` once the job ended, `JobFailedError` when the
    /// parent refused the results or is gone.
    fn request_results(
        &self,
        py: Python<'_>,
        shapes: Vec<(String, Vec<u64>)>,
    ) -> PyResult<Vec<Py<View>>> {
        if !self.life.open.load(Ordering::Acquire) {
            return Err(ExpiredViewError::new_err(
                "poolipc: this job has already ended",
            ));
        }
        let shapes = shapes
            .into_iter()
            .enumerate()
            .map(|(i, (d, s))| {
                let shape = ResultShape::new(dtype::parse(&d)?, &s);
                shape.bytes().map_err(|_| {
                    PyValueError::new_err(format!(
                        "poolipc: result {i}: shape {s:?} of {d} has more bytes than 2^64"
                    ))
                })?;
                Ok(shape)
            })
            .collect::<PyResult<Vec<_>>>()?;
        match self.link.call(py, Cmd::Request(self.id, shapes)) {
            Ok(Reply::Results(infos)) => {
                let mut new = Vec::with_capacity(infos.len());
                for info in infos {
                    let v = Py::new(
                        py,
                        View::new(info, true, &self.life, &self.link, self.stream, self.device),
                    )?;
                    self.results
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(v.clone_ref(py));
                    new.push(v);
                }
                Ok(new)
            }
            Ok(_) => Err(err("poolipc: unexpected answer from the worker thread")),
            Err(e) => Err(JobFailedError::new_err(e.value(py).to_string())),
        }
    }

    /// Ends the job: DONE after the job's stream and every stream in `streams` (and every
    /// consumer stream that took a view by DLPack), imports freed, ACK. The views expire.
    #[pyo3(signature = (streams = None))]
    fn finish(&self, py: Python<'_>, streams: Option<Vec<u64>>) -> PyResult<()> {
        if let Some(s) = streams {
            self.life
                .consumer_streams
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(s);
        }
        self.end(py, Cmd::Finish(self.id))
    }

    /// Reports the job as failed to the parent (its `run` raises `JobFailedError` with
    /// `message`), then ends it like `finish`.
    fn fail(&self, py: Python<'_>, message: String) -> PyResult<()> {
        self.end(py, Cmd::Fail(self.id, message))
    }

    /// Returns the job itself; leaving the `with` block finishes or fails it (`__exit__`).
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Finishes the job, or fails it with the exception's text when the block raised.
    #[pyo3(signature = (exc_type = None, exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<Bound<'_, PyAny>>,
        exc: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if !self.life.open.load(Ordering::Acquire) {
            return Ok(false);
        }
        match (exc_type, exc) {
            (Some(t), Some(e)) if !t.is_none() => {
                let name = t
                    .getattr("__name__")
                    .map(|n| n.to_string())
                    .unwrap_or_else(|_| "exception".into());
                self.fail(py, format!("{name}: {e}"))?;
            }
            _ => self.finish(py, None)?,
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "Job(id={}, inputs={}, results={}, open={})",
            self.id,
            self.inputs.len(),
            self.results
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .len(),
            self.life.open.load(Ordering::Acquire)
        )
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if self.life.release_on_drop.load(Ordering::Acquire) {
            // A lease: its last export or hold ends it.
            return;
        }
        if self.life.open.swap(false, Ordering::AcqRel) {
            // Dropped without finish: finish it, so the parent is not left waiting.
            self.link.post(Cmd::Finish(self.id));
        }
    }
}

/// What `Job.lease()` returns: while it is held, the leased job stays open even with no
/// tensor made from it alive. `release()` (or dropping it) lets the job end once its last
/// tensor is freed.
#[pyclass(module = "poolipc", frozen)]
pub(crate) struct LeaseHold {
    life: Mutex<Option<Arc<JobLife>>>,
}

#[pymethods]
impl LeaseHold {
    /// Releases the hold (once; later calls do nothing). The job ends now if no tensor
    /// made from it is alive, else when the last one is freed.
    fn release(&self) {
        let life = self
            .life
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(l) = life {
            l.export_released();
        }
    }

    /// The leased job's id.
    #[getter]
    fn job(&self) -> Option<u64> {
        self.life
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|l| l.id)
    }

    /// Whether the leased job is still open (a released hold says False).
    #[getter]
    fn open(&self) -> bool {
        self.life
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .is_some_and(|l| l.open.load(Ordering::Acquire))
    }

    fn __repr__(&self) -> String {
        match self.job() {
            Some(id) => format!("LeaseHold(job={id}, open={})", self.open()),
            None => "LeaseHold(released)".into(),
        }
    }
}

impl Drop for LeaseHold {
    fn drop(&mut self) {
        if let Some(l) = self
            .life
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            l.export_released();
        }
    }
}

/// An input view or a result buffer of a job: device memory the parent owns, usable by
/// torch, CuPy and JAX without a copy (`__dlpack__`, `__cuda_array_interface__`) until the
/// job ends; any use after that raises `ExpiredViewError`.
///
/// Read-only inputs. A write to an input reaches the parent's tensor on every rung (an arena
/// copy or a host-staged copy is copied back after the job) unless the parent lent it
/// read-only (`Parent.submit(..., read_only=True)`). Such a view says `read_only == True`,
/// and says so to consumers: `__cuda_array_interface__`'s `data` is `(ptr, True)`; the DLPack
/// capsule a consumer asking for `max_version >= (1, 0)` gets is versioned with
/// `DLPACK_FLAG_BITMASK_READ_ONLY` set (a legacy consumer gets the unversioned capsule, which
/// cannot carry the flag); `write_bytes` raises `ValueError`; an arena-copy input is mapped
/// read-only, so a kernel's write faults.
///
/// What consumers do with the flag differs. NumPy and CuPy read it. torch (2.9 to 2.11:
/// `torch.from_dlpack` asks for `max_version=(1, 0)`, `at::fromDLPackImpl` never looks at
/// `flags`) has no read-only tensors: it makes an ordinary, writable tensor of a read-only
/// capsule, without a warning. So with torch, check `view.read_only` (or `view.rung`) and
/// `.clone()` a staged input before writing to it in place; the write does not raise.
#[pyclass(module = "poolipc", frozen)]
pub(crate) struct View {
    info: ViewInfo,
    /// A result buffer (written by the worker) rather than an input.
    #[pyo3(get)]
    is_result: bool,
    life: Arc<JobLife>,
    link: Arc<Link>,
    job_stream: u64,
    device: u32,
}

impl View {
    fn new(
        info: ViewInfo,
        is_result: bool,
        life: &Arc<JobLife>,
        link: &Arc<Link>,
        job_stream: u64,
        device: u32,
    ) -> View {
        View {
            info,
            is_result,
            life: Arc::clone(life),
            link: Arc::clone(link),
            job_stream,
            device,
        }
    }

    fn check_open(&self) -> PyResult<()> {
        if self.life.open.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(ExpiredViewError::new_err(
                "poolipc: this view's job has ended; its memory belongs to the parent again \
                 (use views, and tensors made from them, only inside the job)",
            ))
        }
    }

    /// The DLPack `stream` argument as a stream handle: None means the legacy default stream
    /// (1 in CUDA's numbering); -1 means no ordering wanted.
    fn consumer_stream(&self, stream: Option<i64>) -> PyResult<Option<StreamHandle>> {
        match stream {
            Some(-1) => Ok(None),
            Some(0) => Err(PyValueError::new_err(
                "poolipc: stream 0 is ambiguous in DLPack; pass 1 (legacy default), 2 \
                 (per-thread default) or a stream handle",
            )),
            Some(s) if s < -1 => Err(PyValueError::new_err(format!(
                "poolipc: {s} is not a stream"
            ))),
            // CU_STREAM_LEGACY is the handle 1, CU_STREAM_PER_THREAD the handle 2 in the driver
            // API, so the DLPack numbers are the driver's handles.
            Some(s) => Ok(Some(crate::dlpack::python_stream(s as u64))),
            None => Ok(Some(StreamHandle::LEGACY)),
        }
    }
}

#[pymethods]
impl View {
    /// The device address of element 0 in this process.
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        self.check_open()?;
        Ok(self.info.ptr.0)
    }

    /// The dtype's name (torch's spelling: `float32`, `bfloat16`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype::name(self.info.dtype)
    }

    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.info.shape)
    }

    /// The strides, in elements.
    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.info.strides)
    }

    /// Bytes from element 0 to the end of the last element.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.info.nbytes
    }

    /// The rung it crossed on.
    #[getter]
    fn rung(&self) -> &str {
        &self.info.rung
    }

    /// Whether the view must not be written: True for an input that crossed by host staging
    /// (a write would change only this worker's copy, never the parent's tensor). False for
    /// pool-pointer inputs and for result buffers.
    #[getter]
    fn read_only(&self) -> bool {
        self.info.read_only
    }

    /// The job's stream (it waited on READY).
    #[getter]
    fn stream(&self) -> u64 {
        self.job_stream
    }

    /// Whether its job is still open.
    #[getter]
    fn valid(&self) -> bool {
        self.life.open.load(Ordering::Acquire)
    }

    /// A copy of the bytes `[ptr, ptr + nbytes)` (synchronous; for tests and debugging).
    fn read_bytes(&self, py: Python<'_>) -> PyResult<Vec<u8>> {
        self.check_open()?;
        let n = usize::try_from(self.info.nbytes)
            .map_err(|_| PyValueError::new_err("poolipc: too large to read"))?;
        match self.link.call(py, Cmd::Read(self.info.ptr, n))? {
            Reply::Bytes(b) => Ok(b),
            _ => Err(err("poolipc: unexpected answer from the worker thread")),
        }
    }

    /// Writes `data` at the start of the view (synchronous; for tests and debugging).
    fn write_bytes(&self, py: Python<'_>, data: Vec<u8>) -> PyResult<()> {
        self.check_open()?;
        if self.info.read_only {
            return Err(PyValueError::new_err(
                "poolipc: this input view is read-only: the parent lent it with read_only=True, \
                 so a write would not reach its tensor (clone it to work on it in place)",
            ));
        }
        if data.len() as u64 > self.info.nbytes {
            return Err(PyValueError::new_err(format!(
                "poolipc: {} bytes do not fit in a view of {} bytes",
                data.len(),
                self.info.nbytes
            )));
        }
        self.link.call(py, Cmd::Write(self.info.ptr, data))?;
        Ok(())
    }

    /// `(kDLCUDA, device)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (dlpack::DL_CUDA, self.device as i32)
    }

    /// A DLPack capsule over the view (no copy). `stream` is the consumer's stream: it is made
    /// to wait on the job's stream, and DONE will wait on it. A versioned capsule
    /// (`dltensor_versioned`) when `max_version` is at least (1, 0), a legacy one otherwise.
    /// A read-only view's versioned capsule has `DLPACK_FLAG_BITMASK_READ_ONLY` set; torch
    /// ignores the flag (see the class docs), NumPy and CuPy honour it.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.check_open()?;
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "poolipc: views are handed out without a copy (copy=True is not supported)",
            ));
        }
        if let Some(d) = dl_device
            && d != self.__dlpack_device__()
        {
            return Err(PyBufferError::new_err(format!(
                "poolipc: the view lives on {:?}, not {d:?}",
                self.__dlpack_device__()
            )));
        }
        let (code, bits) = dlpack::code_of(self.info.dtype).ok_or_else(|| {
            PyBufferError::new_err(format!(
                "poolipc: {} has no DLPack type code here",
                dtype::name(self.info.dtype)
            ))
        })?;
        if let Some(s) = self.consumer_stream(stream)? {
            self.link.call(
                py,
                Cmd::StreamWait {
                    waiter: s,
                    on: crate::dlpack::python_stream(self.job_stream),
                },
            )?;
            let mut cs = self
                .life
                .consumer_streams
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if !cs.contains(&s.as_raw()) && s.as_raw() != self.job_stream {
                cs.push(s.as_raw());
            }
        }
        let tensor = dlpack::Export {
            data: self.info.ptr.0,
            device_id: self.device as i32,
            code,
            bits,
            shape: self.info.shape.iter().map(|&d| d as i64).collect(),
            strides: self.info.strides.clone(),
            read_only: self.info.read_only,
            life: dlpack::Keep::Job(Arc::clone(&self.life)),
        };
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        dlpack::capsule(py, tensor, versioned)
    }

    /// `__cuda_array_interface__` version 3, with the job's stream as `stream` (consumers
    /// order their work after it) and `data == (ptr, read_only)`. Not offered for bfloat16 and float8 (numpy has no type
    /// string for them): use DLPack there.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check_open()
            .map_err(|e| PyAttributeError::new_err(e.value(py).to_string()))?;
        let typestr = dtype::typestr(self.info.dtype).ok_or_else(|| {
            PyAttributeError::new_err(format!(
                "poolipc: {} has no __cuda_array_interface__ type string; use __dlpack__",
                dtype::name(self.info.dtype)
            ))
        })?;
        let elem = self.info.dtype.size_bytes() as i64;
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, &self.info.shape)?)?;
        d.set_item("typestr", typestr)?;
        // `data[1]` is the read-only flag: set for host-staged inputs.
        d.set_item("data", (self.info.ptr.0, self.info.read_only))?;
        let strides: Vec<i64> = self.info.strides.iter().map(|s| s * elem).collect();
        d.set_item("strides", PyTuple::new(py, strides)?)?;
        d.set_item("version", 3)?;
        // Stream 0 is not allowed in the interface; the simulation may number a stream so.
        d.set_item("stream", (self.job_stream != 0).then_some(self.job_stream))?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "{}(ptr={:#x}, dtype={}, shape={:?}, strides={:?}, rung={}, read_only={}, valid={})",
            if self.is_result {
                "ResultBuffer"
            } else {
                "InputView"
            },
            self.info.ptr.0,
            dtype::name(self.info.dtype),
            self.info.shape,
            self.info.strides,
            self.info.rung,
            if self.info.read_only { "True" } else { "False" },
            if self.life.open.load(Ordering::Acquire) {
                "True"
            } else {
                "False"
            }
        )
    }
}
