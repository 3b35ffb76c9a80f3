//! The parent side for Python: spawning workers, lending them tensors, and running jobs whose
//! results a Python allocator (torch.empty) provides ([`allocator`]) or the facade does
//! ([`DeviceBuffer`], arena results); the inputs are checked in [`inputs`].
//!
//! Every Python `Parent` of a process shares the one facade [`poolipc::Parent`] (see
//! [`crate::state`]), which is `Send + Sync`: nothing here holds a lock while a job, a spawn
//! or a stop runs, and every call that waits releases the GIL. Two Python threads run jobs on
//! two workers at the same time; `pid`, `canary_report`, `stats` never wait for a job.

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex, PoisonError};

use crate::state::lock;

use poolipc::advanced::contract::WorkerId;
use poolipc::{DevicePtr, JobHandle, ResultMemory, StreamHandle};
use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::dtype;
use crate::errors::{ExpiredViewError, to_py, to_py_for, value_err};
use crate::options::{ParentConfig, Results};
use crate::state::{self, Global};

mod allocator;
mod inputs;
mod outcome;
pub(crate) use outcome::wait_any;
mod stats;

use allocator::{AllocLog, python_allocator};
use inputs::{buffer_shape, read_inputs};

/// A stream handle from Python, checked before it reaches any other driver call: the
/// simulation's default stream stands for `CU_STREAM_LEGACY` (1) and `CU_STREAM_PER_THREAD`
/// (2); any handle the driver does not know is a `ValueError` naming it.
fn checked_stream(
    driver: &dyn poolipc::advanced::driver::Driver,
    raw: u64,
) -> PyResult<StreamHandle> {
    let s = if state::is_sim(driver) && (raw == 1 || raw == 2) {
        StreamHandle::NULL
    } else {
        crate::dlpack::python_stream(raw)
    };
    driver.stream_check(s).map_err(|e| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "poolipc: stream {raw:#x} is not a CUDA stream of this process: {e}"
        ))
    })?;
    Ok(s)
}

fn driver_err(e: poolipc::advanced::driver::DriverError) -> PyErr {
    to_py(e.into())
}

/// Device memory, freed (stream-ordered on the legacy stream) when the object dies or
/// [`free`](DeviceBuffer::free) is called. What `Parent.run` returns as results when no
/// allocator is given, and what `Parent.alloc` gives; mostly for tests and tools without torch.
#[pyclass(module = "poolipc", frozen)]
pub(crate) struct DeviceBuffer {
    g: Arc<Global>,
    ptr: Mutex<Option<DevicePtr>>,
    /// Its size in bytes.
    #[pyo3(get)]
    nbytes: u64,
    /// The element type; Python gets it as a `poolipc.DType`.
    dtype: poolipc::DType,
    shape: Vec<u64>,
    /// From the shared pool (lends by pool pointer) or the device's default pool (lends by
    /// host staging).
    #[pyo3(get)]
    shared: bool,
}

impl DeviceBuffer {
    fn free_now(&self) -> Result<(), poolipc::advanced::driver::DriverError> {
        if let Some(p) = lock(&self.ptr).take() {
            let _on = self.g.on_device()?;
            poolipc::advanced::driver::PoolAllocation::claim(&*self.g.driver, p)?
                .free(StreamHandle::NULL)?;
        }
        Ok(())
    }
}

#[pymethods]
impl DeviceBuffer {
    /// The dtype: a `poolipc.DType` (a `str` enum: `buffer.dtype == "float32"`).
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        crate::dtype::value(py, self.dtype)
    }

    /// The device address. `ExpiredViewError` once the buffer was freed.
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        lock(&self.ptr).map(|p| p.0).ok_or_else(|| {
            ExpiredViewError::new_err(
                "poolipc: this DeviceBuffer was freed; its memory belongs to the pool again",
            )
        })
    }

    /// The shape (a tuple).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// Same as `ptr`, so that code written for torch tensors reads it too
    /// (`ExpiredViewError` once freed).
    fn data_ptr(&self) -> PyResult<u64> {
        self.ptr()
    }

    /// Frees the memory now (stream-ordered on the legacy default stream).
    fn free(&self) -> PyResult<()> {
        self.free_now().map_err(driver_err)
    }

    fn __repr__(&self) -> String {
        match *lock(&self.ptr) {
            Some(p) => format!(
                "DeviceBuffer(ptr={:#x}, dtype={}, shape={:?}, nbytes={}, shared={})",
                p.0,
                crate::dtype::name(self.dtype),
                self.shape,
                self.nbytes,
                self.shared
            ),
            None => "DeviceBuffer(freed)".into(),
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Nothing to report to at drop: an error here means the pool is gone already.
        let _ = self.free_now();
    }
}

/// A job submitted with `NativeParent.submit`: wait for it from any thread, with the GIL
/// released. Waiting twice (or from two threads) gives the same results.
///
/// Dropped before it was waited for, it lets the job run to its end on a thread of its own
/// (a job cannot be taken back from a worker), keeping the inputs and the allocator's results
/// alive until then, and frees the results of the default allocator.
#[pyclass(module = "poolipc", name = "NativeJobHandle", frozen)]
pub(crate) struct NativeJobHandle {
    /// The job's id.
    #[pyo3(get)]
    id: u64,
    /// The worker it runs on.
    #[pyo3(get)]
    worker: u32,
    g: Arc<Global>,
    /// Until some thread took the facade's answer.
    pending: Mutex<Option<JobHandle>>,
    /// The job's end, for `wait_any` (without `pending`'s lock).
    watch: poolipc::JobWatch,
    /// The answer as Python objects, once taken.
    outcome: Mutex<Option<Result<Py<PyAny>, PyErr>>>,
    log: Arc<Mutex<AllocLog>>,
    caller_alloc: bool,
    /// The job's stream (arena results go back on it).
    stream: u64,
    /// What the caller's inputs are (torch tensors): alive until the job ended.
    keep: Mutex<Option<Py<PyAny>>>,
}

#[pymethods]
impl NativeJobHandle {
    /// Waits for the job (the GIL released) and returns `(results, input_rungs)` as
    /// `NativeParent.run` does, or raises its typed error. `timeout` in seconds (None: until
    /// it ends; the worker's handoff deadline bounds that): `TimeoutError` if it is still
    /// running then. Ctrl-C interrupts the wait, not the job.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        self.wait_inner(py, timeout)
    }

    /// Cancels the job: the worker is told and has the parent's `cancel_grace` (3 s by
    /// default) to finish it; the job then fails with `JobFailedError`
    /// (`reason == "cancelled"`). A worker that does not finish it in time is killed, and
    /// what was lent to the job comes back once it is reaped. Nothing it held is reused before
    /// the worker's DONE or its death. A job that ended already is left as it is. Holds no GIL
    /// while it waits for a waiting thread's slice.
    fn cancel(&self, py: Python<'_>) -> PyResult<()> {
        if lock(&self.outcome).is_some() {
            return Ok(());
        }
        let pending = &self.pending;
        py.detach(move || match lock(pending).as_ref() {
            Some(h) => h.cancel(),
            None => Ok(()),
        })
        .map_err(to_py)
    }

    /// Whether the job has ended (its results or its error are ready).
    #[getter]
    fn done(&self, py: Python<'_>) -> bool {
        if lock(&self.outcome).is_some() {
            return true;
        }
        let pending = &self.pending;
        // A waiting thread holds `pending` for at most one wait slice.
        py.detach(move || lock(pending).as_ref().is_none_or(JobHandle::is_finished))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "JobHandle(id={}, worker={}, done={})",
            self.id,
            self.worker,
            self.done(py)
        )
    }
}

impl Drop for NativeJobHandle {
    fn drop(&mut self) {
        let Some(h) = self
            .pending
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            return;
        };
        let keep = self
            .keep
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let log = Arc::clone(&self.log);
        let g = Arc::clone(&self.g);
        let caller_alloc = self.caller_alloc;
        let spawned = std::thread::Builder::new()
            .name("poolipc-unwaited-job".into())
            .spawn(move || {
                if let Ok(out) = h.wait()
                    && !caller_alloc
                    && g.use_device().is_ok()
                {
                    for r in out.results {
                        // An arena result goes back to the arena when dropped here.
                        if !r.is_arena() {
                            let _ =
                                poolipc::advanced::driver::PoolAllocation::claim(&*g.driver, r.ptr)
                                    .and_then(|a| a.free(StreamHandle::NULL));
                        }
                    }
                }
                // The inputs and the allocator's objects go only now (their references are
                // released the next time some thread holds the GIL).
                drop(keep);
                drop(log);
            });
        if spawned.is_err() {
            eprintln!("poolipc: could not start a thread to see an unwaited job to its end");
        }
    }
}

/// The parent side of poolipc for Python. Every `NativeParent` of a process shares the one
/// process parent (made here if `install_pool` did not already). The Python wrapper
/// `poolipc.Parent` turns torch tensors into input descriptions and back.
///
/// `NativeParent(device=0, options=None)`: `device` is the pool's device; `options` the
/// package's `ParentConfig` with every key (the deadlines in seconds and the result memory,
/// each None for the process parent's, or the default: see `poolipc.ParentConfig`), None for
/// all defaults. They apply when this call creates the process's parent.
///
/// Raises `ValueError` for a deadline that is not more than 0 seconds, an unknown `results`,
/// arena sizes without `results="arena"` (at creation) or a cap below the first chunk, a
/// device other than the process parent's, or an option that differs from the process
/// parent's (the message names the clash); `PoolipcError` when no driver can be opened or the pool cannot be
/// installed.
#[pyclass(module = "poolipc", name = "NativeParent", frozen)]
pub(crate) struct NativeParent {
    /// The pool's device ordinal.
    #[pyo3(get)]
    device: u32,
    g: Arc<Global>,
}

impl NativeParent {
    /// `submit`'s work. With `wait_first`, the job's first wait (one slice) happens in the
    /// same release of the GIL as the submit, so that a job that ends within it (most do)
    /// costs one GIL hand-back instead of two: with several Python threads each taking the
    /// GIL back is a wait of its own. The handle then holds the answer already.
    #[allow(clippy::too_many_arguments)] // submit's Python arguments, passed on
    fn submit_inner(
        &self,
        py: Python<'_>,
        worker: u32,
        inputs: Vec<Bound<'_, PyAny>>,
        stream: u64,
        alloc: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
        read_only: Option<Vec<bool>>,
        wait_first: bool,
    ) -> PyResult<NativeJobHandle> {
        poolipc::probe::mark("py.submit");
        let inputs = read_inputs(&inputs, read_only)?;
        let log = Arc::new(Mutex::new(AllocLog::default()));
        let caller_alloc = alloc.is_some();
        let alloc = alloc.map(|f| python_allocator(f, Arc::clone(&log)));
        let g = Arc::clone(&self.g);
        let _on = self.g.on_device().map_err(driver_err)?;
        // CU_STREAM_PER_THREAD goes to the facade as it is (not mapped as `checked_stream`
        // maps it on the simulation): the facade refuses a job on it, naming why.
        let stream = if stream == 2 {
            StreamHandle::PER_THREAD
        } else {
            checked_stream(&*g.driver, stream)?
        };
        let (id, watch, handle, answer) = py
            .detach(move || {
                // The device was pushed on this thread above.
                let w = WorkerId(worker);
                let handle = match alloc {
                    Some(a) => g.parent.submit_with(w, &inputs, stream, a),
                    None => g.parent.submit(w, &inputs, stream),
                }?;
                let id = handle.id().0;
                let watch = handle.watch();
                if !wait_first {
                    return Ok((id, watch, Some(handle), None));
                }
                poolipc::probe::mark("py.submitted");
                Ok(match handle.wait_timeout(outcome::WAIT_SLICE) {
                    Ok(answer) => (id, watch, None, Some(answer)),
                    Err(handle) => (id, watch, Some(handle), None),
                })
            })
            .map_err(|e| to_py_for(py, e, Some(worker)))?;
        if !wait_first {
            poolipc::probe::mark("py.submitted");
        }
        let native = NativeJobHandle {
            id,
            worker,
            g: Arc::clone(&self.g),
            pending: Mutex::new(handle),
            watch,
            outcome: Mutex::new(None),
            log,
            caller_alloc,
            stream: stream.as_raw(),
            keep: Mutex::new(keep),
        };
        if let Some(answer) = answer {
            // Stored for the caller's wait, which returns it at once (an error raised there,
            // as a later wait would).
            let _ = native.finish(py, answer);
        }
        Ok(native)
    }
}

#[pymethods]
impl NativeParent {
    /// See the class: `device` is the pool's device; `options` (a `ParentConfig` with every
    /// key; None: all defaults) apply when this call creates the process's parent; a value
    /// that differs from the parent's is a `ValueError` naming the clash.
    #[new]
    #[pyo3(signature = (device = 0, options = None))]
    fn new(py: Python<'_>, device: u32, options: Option<ParentConfig>) -> PyResult<Self> {
        let requested = options.unwrap_or_default();
        let (g, _) = py
            .detach(|| state::ensure(device, &requested, "Parent"))
            .map_err(state::EnsureError::into_py)?;
        Ok(NativeParent { device, g })
    }

    /// Which driver the pool is on, in words.
    #[getter]
    fn driver(&self) -> String {
        self.g.which.clone()
    }

    /// Whether the process is on the simulated driver.
    #[getter]
    fn simulated(&self) -> bool {
        state::is_sim(&*self.g.driver)
    }

    /// The process parent's options: `device`, the deadlines in seconds, `canary`, `results`
    /// (`pool` or `arena`), `arena_bytes` and `arena_max_bytes` (None without an arena, or
    /// without a cap), `isolated`, `io_threads`, `gpu_turn` (seconds, 0 for none), and
    /// `made_by` (`install_pool` or `Parent`).
    fn options<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let o = self.g.parent.options();
        let d = PyDict::new(py);
        d.set_item("device", o.device)?;
        for (name, secs) in ParentConfig::deadlines(o) {
            d.set_item(name, secs)?;
        }
        d.set_item("canary", o.canary)?;
        let (first, max) = match o.results {
            ResultMemory::Arena {
                initial_bytes,
                max_bytes,
            } => (Some(initial_bytes), max_bytes),
            _ => (None, None),
        };
        d.set_item("results", Results::of(&o.results).name())?;
        d.set_item("arena_bytes", first)?;
        d.set_item("arena_max_bytes", max)?;
        d.set_item("isolated", o.isolated)?;
        d.set_item("io_threads", o.tuning.io_threads)?;
        d.set_item("gpu_turn", crate::options::turn_secs(o))?;
        d.set_item("made_by", self.g.made_by)?;
        Ok(d)
    }

    /// Spawns `argv` as a worker (the socket is inherited, the simulated machine passed when
    /// there is one, `POOLIPC_DEVICE` set to this process's ordinal unless `env` sets it, e.g.
    /// to `parent` for a worker whose `CUDA_VISIBLE_DEVICES` differs), shakes hands, runs the
    /// canary battery. Returns the worker's id. Other threads' jobs go on meanwhile.
    ///
    /// With `env_allowlist`, the worker inherits only the variables named there from this
    /// process's environment, plus `env` and what poolipc keeps
    /// ([`poolipc::restrict_env`]); without it, all of them.
    ///
    /// With `isolated` True the worker gets no handle on the parent's memory
    /// ([`poolipc::Trust::Isolated`]), False it is trusted with the pool; None (the default)
    /// takes the parent's `isolated` option.
    ///
    /// Raises `ValueError` for an empty `argv`; `PoolipcError` when the program cannot be
    /// started, exits or is refused during the handshake (the message says why).
    #[pyo3(signature = (argv, env = None, env_allowlist = None, isolated = None))]
    fn spawn(
        &self,
        py: Python<'_>,
        argv: Vec<String>,
        env: Option<HashMap<String, String>>,
        env_allowlist: Option<Vec<String>>,
        isolated: Option<bool>,
    ) -> PyResult<u32> {
        let (prog, args) = argv
            .split_first()
            .ok_or_else(|| value_err("poolipc: empty argv"))?;
        let mut cmd = Command::new(prog);
        cmd.args(args);
        let env = env.unwrap_or_default();
        if !env.contains_key("POOLIPC_DEVICE") {
            cmd.env("POOLIPC_DEVICE", self.g.device.to_string());
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        if let Some(allow) = env_allowlist {
            poolipc::restrict_env(&mut cmd, allow);
        }
        if let Some((k, v)) = &self.g.child_env {
            cmd.env(k, v);
        }
        let trust = match isolated {
            None => self.g.parent.default_trust(),
            Some(true) => poolipc::Trust::Isolated,
            Some(false) => poolipc::Trust::Trusted,
        };
        let g = Arc::clone(&self.g);
        py.detach(move || {
            let _on = g.on_device()?;
            g.parent.spawn_worker_with(cmd, trust)
        })
        .map(|id| id.0)
        .map_err(|e| to_py_for(py, e, None))
    }

    /// Listens for workers this parent does not start (pyisolate's children, say): a socket
    /// in `directory` (which must be ours and mode 0700; None: a fresh private directory
    /// under `$XDG_RUNTIME_DIR` or the temporary directory). Returns a `NativeListener`: its
    /// `path` and `env()` go to the worker process, which calls `Worker.connect(path)`;
    /// `accept(timeout)` gives each accepted worker's id.
    ///
    /// With `token` (32 ASCII characters), every connection must present it before the
    /// parent sends anything, and is dropped otherwise (`refused`); `env()` carries it to the
    /// worker. With `once`, the listener takes one worker and closes.
    ///
    /// Raises `ValueError` for a directory that is not private (another owner, group or
    /// other bits), a socket path that is not free, or a bad token; `PoolipcError` when the
    /// socket cannot be made.
    #[pyo3(signature = (directory = None, token = None, once = false))]
    fn listen(
        &self,
        directory: Option<std::path::PathBuf>,
        token: Option<String>,
        once: bool,
    ) -> PyResult<crate::listen::NativeListener> {
        crate::listen::NativeListener::open(Arc::clone(&self.g), directory, token, once)
    }

    /// The worker's process id; None for a worker this parent does not serve (stopped, lost)
    /// or did not spawn. Never waits for a job.
    fn pid(&self, py: Python<'_>, worker: u32) -> Option<u32> {
        let g = &self.g;
        py.detach(move || g.parent.worker(WorkerId(worker)).and_then(|w| w.pid))
    }

    /// The ids of the workers this parent serves.
    fn workers(&self, py: Python<'_>) -> Vec<u32> {
        let g = &self.g;
        py.detach(move || g.parent.workers().into_iter().map(|w| w.id.0).collect())
    }

    /// The canary battery's report on the worker, in words. Never waits for a job.
    fn canary_report(&self, py: Python<'_>, worker: u32) -> Option<String> {
        let g = &self.g;
        py.detach(move || {
            g.parent
                .canary_report(WorkerId(worker))
                .map(|r| r.to_string())
        })
    }

    /// The parent's counters (a dict); never waits for a job.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats::to_dict(py, &self.g.parent.stats())
    }

    /// Lowers the pool-pointer import limit from here on: an allocation touching more than
    /// `max_chunks` of the driver's 32 MiB chunks no longer goes by pointer (a `Parent`'s
    /// tensors take host staging or the arena copy; torch sharing crosses as a copy). For
    /// a driver whose crash boundary `poolipc doctor --probe-limit` found lower than 128
    /// chunks. `ValueError` above the limit in force.
    fn lower_import_limit(&self, max_chunks: u64) -> PyResult<()> {
        let cur = self.g.parent.limits().import;
        let limit = poolipc::advanced::pool::ImportLimit::new(cur.chunk_bytes(), max_chunks)
            .ok_or_else(|| value_err(format!("poolipc: an import limit of {max_chunks} chunks")))?;
        self.g
            .parent
            .lower_import_limit(limit)
            .map_err(|e| value_err(format!("poolipc: {e}")))
    }

    /// Lends every job placed from now on a slice of the result arena of `nbytes` (0: none),
    /// out of which its worker carves the results it asks for without a round trip. Needs
    /// the parent's results in the arena (`results="arena"`): a `ValueError` otherwise.
    fn set_arena_slice_bytes(&self, nbytes: u64) -> PyResult<()> {
        if nbytes > 0 && Results::of(&self.g.parent.options().results) != Results::Arena {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "poolipc: arena slices of {nbytes} bytes need the parent's results in the arena: \
                 this process's parent was made with results=\"pool\""
            )));
        }
        self.g.parent.set_arena_slice_bytes(nbytes);
        Ok(())
    }

    /// The result arena's figures (a dict), every worker's arena together, after freeing the
    /// blocks given back whose event completed: `enabled` (the process parent has
    /// `results="arena"`), `created` (an arena was made: each worker's is made at its first
    /// result, or input copy, that goes to it), `capacity`,
    /// `used` and `largest_free` in bytes, `live_blocks` (blocks out, including those given
    /// back whose event has not completed), `pending_frees`, `chunks`, `max_bytes` (the cap:
    /// half the device unless `arena_max_bytes` says otherwise), `released_chunks` and
    /// `released_bytes` (chunks given back to the device: idle for 10 s, or by
    /// `empty_cache`), and `results_out`: arena results handed to Python whose block has not gone back
    /// (the objects and the DLPack tensors made from them; it never goes below 0 unless a
    /// block went back twice). `PoolipcError` when the driver cannot be reached.
    fn arena_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = Arc::clone(&self.g);
        let stats = py
            .detach(move || {
                let _on = g.on_device()?;
                g.parent.reclaim_arena();
                Ok::<_, poolipc::Error>(g.parent.arena_stats())
            })
            .map_err(|e| to_py_for(py, e, None))?;
        let a = stats.map(|s| s.alloc).unwrap_or_default();
        let d = PyDict::new(py);
        d.set_item(
            "enabled",
            Results::of(&self.g.parent.options().results) == Results::Arena,
        )?;
        d.set_item("created", stats.is_some())?;
        d.set_item("capacity", a.capacity)?;
        d.set_item("used", a.used)?;
        d.set_item("largest_free", a.largest_free)?;
        d.set_item("live_blocks", a.live_blocks)?;
        d.set_item("pending_frees", stats.map_or(0, |s| s.pending_frees))?;
        d.set_item("chunks", a.chunks)?;
        d.set_item("max_bytes", stats.and_then(|s| s.max_bytes))?;
        d.set_item("released_chunks", stats.map_or(0, |s| s.released_chunks))?;
        d.set_item("released_bytes", stats.map_or(0, |s| s.released_bytes))?;
        d.set_item("results_out", crate::arena::results_out())?;
        Ok(d)
    }

    /// Lends `inputs` (torch tensors, `TensorRef`s, view-like objects: each read once, see
    /// `inputs::read_inputs`) to `worker`, READY
    /// recorded on `stream`, and returns a `NativeJobHandle` at once. `alloc(dtype, shape,
    /// nbytes, stream) -> (ptr, owner)` makes each result (torch.empty); it runs on the
    /// parent's IO thread, holding the GIL, and must not wait on the parent (no `run`,
    /// `wait`, `spawn` or `stop` inside it). None: results from the shared pool, as
    /// `DeviceBuffer`s. `keep`: objects kept alive until the job ended (the input tensors).
    /// A tensor refused before anything is lent raises `ValueError` here (`TypeError` for an
    /// object that is no tensor); one refused by the IO thread (past its allocation) raises it from `wait`. `UnknownWorkerError` for a
    /// worker this parent does not serve.
    ///
    /// Without `alloc`, results go where the process parent's `results` says: the shared
    /// pool (`DeviceBuffer`s, the default) or the result arena (`ArenaResult`s).
    ///
    /// `read_only`: one flag per input (None: all writable). A writable input that crossed
    /// by a copy (arena copy, host staging) is copied back after the job, so a write of the
    /// worker's reaches it; a read-only one is not, and the worker's view of it is read-only.
    /// A count that differs from the inputs' is a `ValueError`.
    ///
    /// `wait_first`: wait for the job once (50 ms at most) before returning, in the same
    /// release of the GIL as the submit (`Parent.run`'s path: one GIL hand-back per job
    /// instead of two); the handle then holds the answer if it came, and its `wait` returns
    /// it (or raises its error) at once.
    #[pyo3(signature = (worker, inputs, stream = 0, alloc = None, keep = None, read_only = None, wait_first = false))]
    #[allow(clippy::too_many_arguments)] // one per Python keyword argument, as Python spells them
    fn submit(
        &self,
        py: Python<'_>,
        worker: u32,
        inputs: Vec<Bound<'_, PyAny>>,
        stream: u64,
        alloc: Option<Py<PyAny>>,
        keep: Option<Py<PyAny>>,
        read_only: Option<Vec<bool>>,
        wait_first: bool,
    ) -> PyResult<NativeJobHandle> {
        self.submit_inner(
            py, worker, inputs, stream, alloc, keep, read_only, wait_first,
        )
    }

    /// `submit` then `wait`: returns `(results, input_rungs)` once the worker acknowledged,
    /// the worker's DONE having completed. Each result is `(ptr, nbytes, dtype, shape, rung,
    /// owner)`: `owner` is what the allocator returned, a [`DeviceBuffer`] from the pool, or
    /// an [`ArenaResult`] (a parent made with `results="arena"`, no allocator).
    ///
    /// Raises `ValueError` (an input cannot be lent), `UnknownWorkerError`, `JobFailedError`
    /// (the worker was lost, or the allocator raised: its exception is the `__cause__`),
    /// `WorkerError` (the worker reported an error for the job), `ArenaFullError` (a result
    /// would pass the result arena's cap).
    #[pyo3(signature = (worker, inputs, stream = 0, alloc = None, read_only = None))]
    fn run(
        &self,
        py: Python<'_>,
        worker: u32,
        inputs: Vec<Bound<'_, PyAny>>,
        stream: u64,
        alloc: Option<Py<PyAny>>,
        read_only: Option<Vec<bool>>,
    ) -> PyResult<Py<PyAny>> {
        self.submit_inner(py, worker, inputs, stream, alloc, None, read_only, true)?
            .wait_inner(py, None)
    }

    /// Tells the worker to stop (Bye), waits for it to exit at most the parent's
    /// `stop_timeout`, then kills it, and reaps it. Returns its exit code (None if it was
    /// killed by a signal, or not ours to wait for). Jobs it still held fail with
    /// `JobFailedError`; other workers' jobs go on. `UnknownWorkerError` for a worker this
    /// parent does not serve.
    fn stop(&self, py: Python<'_>, worker: u32) -> PyResult<Option<i32>> {
        let g = Arc::clone(&self.g);
        py.detach(move || g.parent.stop_worker(WorkerId(worker)))
            .map(|s| s.and_then(|s| s.code()))
            .map_err(|e| to_py_for(py, e, Some(worker)))
    }

    /// Allocates `nbytes` (stream-ordered on `stream`): from the shared pool (lent by pool
    /// pointer), or with `shared=False` from the device's default pool, which no worker can
    /// import (lent by arena copy, or host staging where the worker has no arena, like memory
    /// of `--disable-cuda-malloc`). `shape`
    /// (default: `nbytes` over the dtype's size) must cover `nbytes` exactly.
    ///
    /// Raises `ValueError` for an unknown dtype, `nbytes` of 0, or a shape whose elements do
    /// not take `nbytes`; `PoolipcError` when the driver refuses (out of memory).
    #[pyo3(signature = (nbytes, stream = 0, dtype = "uint8", shape = None, shared = true))]
    fn alloc(
        &self,
        py: Python<'_>,
        nbytes: u64,
        stream: u64,
        dtype: &str,
        shape: Option<Vec<u64>>,
        shared: bool,
    ) -> PyResult<DeviceBuffer> {
        let dt = dtype::parse(dtype)?;
        let shape = buffer_shape(nbytes, dt, shape)?;
        let g = Arc::clone(&self.g);
        let _on = self.g.on_device().map_err(driver_err)?;
        let stream = checked_stream(&*g.driver, stream)?;
        let ptr = py
            .detach(move || {
                let pool = if shared {
                    g.parent.pool().handle()
                } else {
                    g.driver.device_get_default_mem_pool(g.device)?
                };
                g.driver.mem_alloc_from_pool_async(nbytes, pool, stream)
            })
            .map_err(driver_err)?;
        Ok(DeviceBuffer {
            g: Arc::clone(&self.g),
            ptr: Mutex::new(Some(ptr)),
            nbytes,
            dtype: dt,
            shape,
            shared,
        })
    }

    /// Copies `data` to device address `ptr` and waits for it. Without `stream`, on the
    /// legacy stream (ordered after nothing on non-blocking streams); with it, on `stream`,
    /// after the work queued there. `PoolipcError` when the driver refuses (an address that
    /// is not device memory), `ValueError` for a `stream` that is none of this process.
    #[pyo3(signature = (ptr, data, stream = None))]
    fn write(&self, py: Python<'_>, ptr: u64, data: Vec<u8>, stream: Option<u64>) -> PyResult<()> {
        let g = Arc::clone(&self.g);
        let _on = self.g.on_device().map_err(driver_err)?;
        let stream = stream.map(|s| checked_stream(&*g.driver, s)).transpose()?;
        py.detach(move || match stream {
            Some(s) => g.driver.memcpy_htod_on(DevicePtr(ptr), &data, s),
            None => g.driver.memcpy_htod(DevicePtr(ptr), &data),
        })
        .map_err(driver_err)
    }

    /// Sets `nbytes` bytes at device address `ptr` to `value`, queued on `stream` (GPU work:
    /// it returns before the bytes are set). `PoolipcError` when the driver refuses,
    /// `ValueError` for a `stream` that is none of this process.
    #[pyo3(signature = (ptr, nbytes, value, stream = 0))]
    fn fill(&self, py: Python<'_>, ptr: u64, nbytes: u64, value: u8, stream: u64) -> PyResult<()> {
        let g = Arc::clone(&self.g);
        let _on = self.g.on_device().map_err(driver_err)?;
        let stream = checked_stream(&*g.driver, stream)?;
        py.detach(move || {
            g.driver
                .memset_d8_async(DevicePtr(ptr), value, nbytes, stream)
        })
        .map_err(driver_err)
    }

    /// Reads `nbytes` from device address `ptr` and waits for it: without `stream` on the
    /// legacy stream, with it on `stream` (after the work queued there: a job's results on
    /// the stream the job was submitted on). `PoolipcError` when the driver refuses (an
    /// address that is not device memory), `MemoryError` when no host buffer of `nbytes` can
    /// be had, `ValueError` for a `stream` that is none of this process.
    #[pyo3(signature = (ptr, nbytes, stream = None))]
    fn read(
        &self,
        py: Python<'_>,
        ptr: u64,
        nbytes: usize,
        stream: Option<u64>,
    ) -> PyResult<Vec<u8>> {
        let mut buf = Vec::new();
        buf.try_reserve_exact(nbytes).map_err(|e| {
            PyMemoryError::new_err(format!(
                "poolipc: no host buffer of {nbytes} bytes to read into: {e}"
            ))
        })?;
        buf.resize(nbytes, 0);
        let g = Arc::clone(&self.g);
        let _on = self.g.on_device().map_err(driver_err)?;
        let stream = stream.map(|s| checked_stream(&*g.driver, s)).transpose()?;
        py.detach(move || {
            match stream {
                Some(s) => g.driver.memcpy_dtoh_on(&mut buf, DevicePtr(ptr), s)?,
                None => g.driver.memcpy_dtoh(&mut buf, DevicePtr(ptr))?,
            }
            Ok(buf)
        })
        .map_err(driver_err)
    }

    /// Waits for `stream` on the host. `PoolipcError` when the driver refuses (no such
    /// stream) or the stream's work failed.
    #[pyo3(signature = (stream = 0))]
    fn synchronize(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let g = Arc::clone(&self.g);
        let _on = self.g.on_device().map_err(driver_err)?;
        let stream = checked_stream(&*g.driver, stream)?;
        py.detach(move || g.driver.stream_synchronize(stream))
            .map_err(driver_err)
    }
}
