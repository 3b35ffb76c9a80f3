//! The parent side for Python: the pool swap, pool statistics, spawning workers and running
//! jobs whose results a Python allocator (torch.empty) provides.

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};

use poolipc::{DevicePtr, Driver, Input, ResultShape, StreamHandle, TensorDesc};
use poolipc_contract::WorkerId;
use poolipc_driver::PoolHandle;
use poolipc_pool::PoolStats;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::dtype;
use crate::errors::{err, to_py};
use crate::state::{self, Global};

fn driver_err(e: poolipc_driver::DriverError) -> PyErr {
    to_py(e.into())
}

/// Runs `f` on the installed pool's state with the GIL released.
fn with_global<T: Send>(
    py: Python<'_>,
    f: impl FnOnce(&mut Global) -> PyResult<T> + Send,
) -> PyResult<T> {
    py.detach(|| {
        let mut guard = state::lock();
        let g = guard.as_mut().ok_or_else(|| {
            err("poolipc: no pool is installed (call poolipc.install_pool() first)")
        })?;
        g.driver.use_device(g.device).map_err(driver_err)?;
        f(g)
    })
}

/// Installs the shared pool on `device` (the driver `POOLIPC_DRIVER` picks). Returns a dict:
/// `installed` (False when it already was), `driver` (in words), `device`. The checks around
/// torch and `PYTORCH_CUDA_ALLOC_CONF` live in the Python wrapper, `poolipc.install_pool`.
#[pyfunction]
#[pyo3(signature = (device = 0))]
pub(crate) fn _install(py: Python<'_>, device: u32) -> PyResult<Bound<'_, PyDict>> {
    let (installed, which) = py.detach(|| {
        let mut guard = state::lock();
        let installed = state::ensure(&mut guard, device)?;
        let which = guard.as_ref().map(|g| g.which.clone()).unwrap_or_default();
        Ok::<_, PyErr>((installed, which))
    })?;
    let d = PyDict::new(py);
    d.set_item("installed", installed)?;
    d.set_item("driver", which)?;
    d.set_item("device", device)?;
    Ok(d)
}

/// Whether a pool is installed in this process.
#[pyfunction]
pub(crate) fn is_installed(py: Python<'_>) -> bool {
    py.detach(|| state::lock().is_some())
}

/// The shared pool's true figures (torch's `memory_allocated()`/`memory_reserved()` read 0
/// after the swap): a dict of `used_current`, `used_high`, `reserved_current`,
/// `reserved_high` in bytes, plus `device` and `driver`.
#[pyfunction]
pub(crate) fn memory_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let inst = state::installed()
        .ok_or_else(|| err("poolipc: no pool is installed (call poolipc.install_pool() first)"))?;
    let s = {
        let inst = inst.clone();
        py.detach(move || PoolStats::read(&*inst.driver, inst.pool))
            .map_err(driver_err)?
    };
    let d = PyDict::new(py);
    d.set_item("used_current", s.used_current)?;
    d.set_item("used_high", s.used_high)?;
    d.set_item("reserved_current", s.reserved_current)?;
    d.set_item("reserved_high", s.reserved_high)?;
    d.set_item("device", inst.device)?;
    d.set_item("driver", inst.which)?;
    Ok(d)
}

/// Device memory from the shared pool, freed (stream-ordered on the legacy stream) when the
/// object dies or [`free`](DeviceBuffer::free) is called. What `Parent.run` returns as results
/// when no allocator is given, and what `Parent.alloc` gives; mostly for tests and tools
/// without torch.
#[pyclass(module = "poolipc")]
pub(crate) struct DeviceBuffer {
    driver: Arc<dyn Driver>,
    ptr: Option<DevicePtr>,
    #[pyo3(get)]
    nbytes: u64,
    #[pyo3(get)]
    dtype: &'static str,
    shape: Vec<u64>,
}

#[pymethods]
impl DeviceBuffer {
    /// The device address.
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        self.ptr
            .map(|p| p.0)
            .ok_or_else(|| err("poolipc: this DeviceBuffer was freed"))
    }

    /// The shape (a tuple).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// Same as `ptr`, so that code written for torch tensors reads it too.
    fn data_ptr(&self) -> PyResult<u64> {
        self.ptr()
    }

    /// Frees the memory now (stream-ordered on the legacy default stream).
    fn free(&mut self) -> PyResult<()> {
        if let Some(p) = self.ptr.take() {
            self.driver
                .mem_free_async(p, StreamHandle::NULL)
                .map_err(driver_err)?;
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        match self.ptr {
            Some(p) => format!(
                "DeviceBuffer(ptr={:#x}, dtype={}, shape={:?}, nbytes={})",
                p.0, self.dtype, self.shape, self.nbytes
            ),
            None => "DeviceBuffer(freed)".into(),
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(p) = self.ptr.take() {
            // Nothing to report to at drop: an error here means the pool is gone already.
            let _ = self.driver.mem_free_async(p, StreamHandle::NULL);
        }
    }
}

/// One input as the Python wrapper describes it: `(ptr, dtype, shape, strides or None)`.
type InputSpec = (u64, String, Vec<u64>, Option<Vec<i64>>);

fn parse_inputs(specs: Vec<InputSpec>) -> PyResult<Vec<Input>> {
    specs
        .into_iter()
        .map(|(ptr, dt, shape, strides)| {
            let dtype = dtype::parse(&dt)?;
            if let Some(s) = &strides {
                if s.len() != shape.len() {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "poolipc: {} strides for {} dimensions",
                        s.len(),
                        shape.len()
                    )));
                }
                if s.iter().any(|&x| x < 0) {
                    return Err(pyo3::exceptions::PyValueError::new_err(
                        "poolipc: negative strides are not supported (flip() views); pass a \
                         .contiguous() copy",
                    ));
                }
            }
            Ok(Input {
                ptr: DevicePtr(ptr),
                desc: TensorDesc {
                    dtype,
                    shape,
                    strides: strides.unwrap_or_default(),
                },
            })
        })
        .collect()
}

/// What the allocator callback gave for one result: the pointer and the object that owns it.
struct Allocated {
    ptr: u64,
    keep: Py<PyAny>,
}

/// The parent side of poolipc for Python. Every `NativeParent` of a process shares the one
/// installed pool (installed here if `install_pool` did not already). The Python wrapper
/// `poolipc.Parent` turns torch tensors into input descriptions and back.
#[pyclass(module = "poolipc", name = "NativeParent")]
pub(crate) struct NativeParent {
    #[pyo3(get)]
    device: u32,
    workers: Vec<u32>,
    /// The driver and pool, for what needs no facade (and so no global lock): raw memory.
    inst: state::Installed,
}

#[pymethods]
impl NativeParent {
    #[new]
    #[pyo3(signature = (device = 0))]
    fn new(py: Python<'_>, device: u32) -> PyResult<Self> {
        py.detach(|| state::ensure(&mut state::lock(), device))?;
        let inst = state::installed().ok_or_else(|| err("poolipc: the pool vanished"))?;
        Ok(NativeParent {
            device,
            workers: Vec::new(),
            inst,
        })
    }

    /// Which driver the pool is on, in words.
    #[getter]
    fn driver(&self) -> String {
        self.inst.which.clone()
    }

    /// Spawns `argv` as a worker (the socket is inherited, the simulated machine passed when
    /// there is one, `POOLIPC_DEVICE` set to this process's ordinal unless `env` sets it, e.g.
    /// to `parent` for a worker whose `CUDA_VISIBLE_DEVICES` differs), shakes hands, runs the
    /// canary battery. Returns the worker's id.
    #[pyo3(signature = (argv, env = None))]
    fn spawn(
        &mut self,
        py: Python<'_>,
        argv: Vec<String>,
        env: Option<HashMap<String, String>>,
    ) -> PyResult<u32> {
        let (prog, args) = argv
            .split_first()
            .ok_or_else(|| pyo3::exceptions::PyValueError::new_err("poolipc: empty argv"))?;
        let mut cmd = Command::new(prog);
        cmd.args(args);
        let env = env.unwrap_or_default();
        let device_chosen = env.contains_key("POOLIPC_DEVICE");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let id = with_global(py, move |g| {
            if let Some((k, v)) = &g.child_env {
                cmd.env(k, v);
            }
            if !device_chosen {
                cmd.env("POOLIPC_DEVICE", g.device.to_string());
            }
            g.parent.spawn_worker(cmd).map_err(to_py)
        })?;
        self.workers.push(id.0);
        Ok(id.0)
    }

    /// The worker's process id.
    fn pid(&self, py: Python<'_>, worker: u32) -> PyResult<Option<u32>> {
        with_global(py, move |g| {
            Ok(g.parent.worker(WorkerId(worker)).and_then(|w| w.pid))
        })
    }

    /// The canary battery's report on the worker, in words.
    fn canary_report(&self, py: Python<'_>, worker: u32) -> PyResult<Option<String>> {
        with_global(py, move |g| {
            Ok(g.parent
                .canary_report(WorkerId(worker))
                .map(ToString::to_string))
        })
    }

    /// Lends `inputs` (`(ptr, dtype, shape, strides or None)` each) to `worker`, READY
    /// recorded on `stream`, and returns `(results, input_rungs)` once the worker acknowledged,
    /// `stream` having waited on DONE. Each result is `(ptr, nbytes, dtype, shape, rung,
    /// owner)`: `owner` is what `alloc(dtype, shape, nbytes) -> (ptr, owner)` returned (torch
    /// tensors, from `torch.empty`), or a [`DeviceBuffer`] from the pool when `alloc` is None.
    #[pyo3(signature = (worker, inputs, stream = 0, alloc = None))]
    #[allow(clippy::type_complexity)] // the tuple is the Python-facing shape, documented above
    fn run(
        &self,
        py: Python<'_>,
        worker: u32,
        inputs: Vec<InputSpec>,
        stream: u64,
        alloc: Option<Py<PyAny>>,
    ) -> PyResult<(
        Vec<(u64, u64, &'static str, Vec<u64>, String, Py<PyAny>)>,
        Vec<String>,
    )> {
        let inputs = parse_inputs(inputs)?;
        let stream = StreamHandle(stream);
        let caller_alloc = alloc.is_some();
        // Results of the caller's allocator, in request order; errors it raised.
        let allocated: Mutex<Vec<Allocated>> = Mutex::new(Vec::new());
        let raised: Mutex<Option<String>> = Mutex::new(None);
        let out = with_global(py, |g| {
            let driver = Arc::clone(&g.driver);
            let pool: PoolHandle = g.parent.pool().handle();
            let mut call = |shape: &ResultShape, bytes: u64| -> Result<DevicePtr, poolipc::Error> {
                match &alloc {
                    None => Ok(driver.mem_alloc_from_pool_async(bytes, pool, stream)?),
                    Some(f) => Python::attach(|py| {
                        let r = f
                            .call1(py, (dtype::name(shape.dtype), shape.shape.clone(), bytes))
                            .and_then(|r| r.extract::<(u64, Py<PyAny>)>(py));
                        match r {
                            Ok((ptr, keep)) => {
                                allocated
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                                    .push(Allocated { ptr, keep });
                                Ok(DevicePtr(ptr))
                            }
                            Err(e) => {
                                let text = e.to_string();
                                *raised
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner) =
                                    Some(text.clone());
                                Err(poolipc::Error::ResultRefused(format!(
                                    "the result allocator raised {text}"
                                )))
                            }
                        }
                    }),
                }
            };
            let res = g
                .parent
                .run_job_with(WorkerId(worker), &inputs, stream, &mut call);
            Ok((res, Arc::clone(&g.driver)))
        })?;
        let (res, driver) = out;
        let allocated = allocated
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let output = match res {
            Ok(o) => o,
            Err(mut e) => {
                // A failed job gives back every result memory it allocated: nothing imports
                // it any more. Torch's own tensors are dropped (torch frees them); memory the
                // default allocator took from the pool is freed here.
                drop(allocated);
                if let poolipc::Error::JobFailed { results, .. }
                | poolipc::Error::Worker { results, .. } = &mut e
                    && !caller_alloc
                {
                    for ptr in results.drain(..) {
                        if let Err(free) = driver.mem_free_async(ptr, stream) {
                            eprintln!("poolipc: freeing a failed job's result failed: {free}");
                        }
                    }
                }
                let mut e = to_py(e);
                if let Some(text) = raised
                    .into_inner()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                {
                    e = crate::errors::JobFailedError::new_err(format!(
                        "{} (the result allocator raised {text})",
                        e.value(py)
                    ));
                }
                return Err(e);
            }
        };
        let mut by_ptr: HashMap<u64, Py<PyAny>> = HashMap::new();
        for a in allocated {
            by_ptr.insert(a.ptr, a.keep);
        }
        let mut results = Vec::with_capacity(output.results.len());
        for r in output.results {
            let owner = if caller_alloc {
                by_ptr
                    .remove(&r.ptr.0)
                    .ok_or_else(|| err("poolipc: a result the allocator did not make"))?
            } else {
                Py::new(
                    py,
                    DeviceBuffer {
                        driver: Arc::clone(&driver),
                        ptr: Some(r.ptr),
                        nbytes: r.bytes,
                        dtype: dtype::name(r.shape.dtype),
                        shape: r.shape.shape.clone(),
                    },
                )?
                .into_any()
            };
            results.push((
                r.ptr.0,
                r.bytes,
                dtype::name(r.shape.dtype),
                r.shape.shape,
                r.rung.to_string(),
                owner,
            ));
        }
        let rungs = output.input_rungs.iter().map(ToString::to_string).collect();
        Ok((results, rungs))
    }

    /// Tells the worker to stop and waits for it; returns its exit code (None if it was
    /// killed by a signal or not ours to wait for).
    fn stop(&mut self, py: Python<'_>, worker: u32) -> PyResult<Option<i32>> {
        self.workers.retain(|w| *w != worker);
        with_global(py, move |g| {
            let status = g.parent.stop_worker(WorkerId(worker)).map_err(to_py)?;
            Ok(status.and_then(|s| s.code()))
        })
    }

    /// Allocates `nbytes` from the shared pool (stream-ordered on `stream`). Needs no lock, so
    /// a result allocator may call it while a job runs.
    #[pyo3(signature = (nbytes, stream = 0, dtype = "uint8", shape = None))]
    fn alloc(
        &self,
        py: Python<'_>,
        nbytes: u64,
        stream: u64,
        dtype: &str,
        shape: Option<Vec<u64>>,
    ) -> PyResult<DeviceBuffer> {
        let dt = dtype::parse(dtype)?;
        let inst = self.inst.clone();
        let ptr = py
            .detach(move || {
                inst.driver.use_device(inst.device)?;
                inst.driver
                    .mem_alloc_from_pool_async(nbytes, inst.pool, StreamHandle(stream))
            })
            .map_err(driver_err)?;
        Ok(DeviceBuffer {
            driver: Arc::clone(&self.inst.driver),
            ptr: Some(ptr),
            nbytes,
            dtype: dtype::name(dt),
            shape: shape.unwrap_or_else(|| vec![nbytes / dt.size_bytes() as u64]),
        })
    }

    /// Copies `data` to device address `ptr` (synchronous).
    fn write(&self, py: Python<'_>, ptr: u64, data: Vec<u8>) -> PyResult<()> {
        let inst = self.inst.clone();
        py.detach(move || {
            inst.driver.use_device(inst.device)?;
            inst.driver.memcpy_htod(DevicePtr(ptr), &data)
        })
        .map_err(driver_err)
    }

    /// Reads `nbytes` from device address `ptr` (synchronous).
    fn read(&self, py: Python<'_>, ptr: u64, nbytes: usize) -> PyResult<Vec<u8>> {
        let inst = self.inst.clone();
        py.detach(move || {
            inst.driver.use_device(inst.device)?;
            let mut buf = vec![0u8; nbytes];
            inst.driver.memcpy_dtoh(&mut buf, DevicePtr(ptr))?;
            Ok(buf)
        })
        .map_err(driver_err)
    }

    /// Waits for `stream` on the host.
    #[pyo3(signature = (stream = 0))]
    fn synchronize(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        let inst = self.inst.clone();
        py.detach(move || {
            inst.driver.use_device(inst.device)?;
            inst.driver.stream_synchronize(StreamHandle(stream))
        })
        .map_err(driver_err)
    }

    /// Whether the process is on the simulated driver.
    #[getter]
    fn simulated(&self) -> bool {
        state::is_sim(&*self.inst.driver)
    }
}
