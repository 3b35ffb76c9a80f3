//! The worker side for Python: `NativeWorker` starts the worker's [`thread`], which opens the
//! facade [`poolipc::Worker`]; the Python objects' commands then run on their own threads,
//! holding it (no hop to the worker's thread and back). A taken job becomes a [`Job`] whose
//! views ([`View`]) torch, CuPy and JAX take without a copy.

mod job;
mod life;
mod shown;
mod thread;
mod view;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

pub(crate) use job::{Job, LeaseHold};
use shown::Shown;
use thread::{Arrived, CONNECT_REFUSED, Cmd, Link, Reply, Source};
pub(crate) use view::View;

use crate::errors::{ConnectError, err};

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
        let arrived = Arc::new(Arrived::default());
        let (link, thread, started) = thread::spawn(py, source, device, &arrived)?;
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
            link,
            thread: Mutex::new(Some(thread)),
            stream,
            device,
            simulated,
            arrived,
        })
    }

    /// A Python `Job` over what the thread reported of a job it took.
    fn make_job(&self, py: Python<'_>, id: u64, inputs: Vec<Shown>) -> PyResult<Job> {
        Job::new(py, id, inputs, &self.link, self.stream, self.device)
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
        poolipc::probe::mark("py.take");
        match self.link.call(py, Cmd::NextJob { concurrent })? {
            Reply::Job(None) => Ok(None),
            Reply::Job(Some((id, inputs))) => {
                let job = self.make_job(py, id, inputs).map(Some);
                poolipc::probe::mark("py.job");
                job
            }
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
            let got = py.detach(move || arrived.wait_for(job, slice, deadline));
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
        self.link.close();
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
        self.link.close();
    }
}
