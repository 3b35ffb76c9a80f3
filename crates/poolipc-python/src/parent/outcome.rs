//! The outcome of a submitted job, for Python: waiting for it in slices (signals and the
//! caller's timeout are looked at between them), and the facade's answer turned into Python
//! objects once (the allocator's objects, [`DeviceBuffer`]s, [`ArenaResult`]s, or the typed
//! error), stored for every later wait.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use poolipc::{JobOutput, StreamHandle};
use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;

use super::{DeviceBuffer, NativeJobHandle, lock};
use crate::arena::{ArenaHold, ArenaResult};
use crate::dtype;
use crate::errors::{JobFailedError, err, to_py_for, value_err};
use crate::state;

/// How long one wait of [`NativeJobHandle::wait`] lasts before it looks at signals
/// (KeyboardInterrupt) and the caller's timeout. A finished job ends the wait at once.
pub(super) const WAIT_SLICE: Duration = Duration::from_millis(50);

/// A copy of a stored job error to raise: the stored one is never raised itself. Raising
/// attaches a traceback to the exception, whose frames hold the caller's locals (the handle,
/// its results, their device memory); kept in this handle, that would be a cycle through a
/// native object the garbage collector cannot see, and the memory would never go back.
fn fresh_error(py: Python<'_>, e: &PyErr) -> PyErr {
    let copied = (|| -> PyResult<PyErr> {
        let v = e.value(py);
        let c = py.import("copy")?.call_method1("copy", (v,))?;
        c.setattr("__cause__", v.getattr("__cause__")?)?;
        c.setattr("__traceback__", py.None())?;
        Ok(PyErr::from_value(c))
    })();
    copied.unwrap_or_else(|_| e.clone_ref(py))
}

/// Seconds to a deadline, as `wait` and `wait_any` take them: None for none; a
/// `ValueError` naming the value for a negative or non-finite one.
fn deadline_of(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Some(
            Instant::now() + Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX),
        )),
        Some(t) => Err(value_err(format!(
            "poolipc: timeout={t} is not a timeout: give seconds, 0 or more, or None"
        ))),
    }
}

/// `wait_any(handles, timeout=None)`: waits (the GIL released) until one of `handles`
/// (`NativeJobHandle`s) has ended and returns its index (the lowest of those ended when it
/// looks); its `wait` then returns at once. `TimeoutError` if none had after `timeout`
/// seconds; `ValueError` for no handles or a bad timeout. Ctrl-C interrupts the wait. For
/// one thread driving several workers: submit to each, take whichever job ends first.
#[pyfunction]
#[pyo3(signature = (handles, timeout = None))]
pub(crate) fn wait_any(
    py: Python<'_>,
    handles: Vec<Py<NativeJobHandle>>,
    timeout: Option<f64>,
) -> PyResult<usize> {
    if handles.is_empty() {
        return Err(value_err(
            "poolipc: wait_any() needs at least one job handle",
        ));
    }
    let deadline = deadline_of(timeout)?;
    let watches: Vec<poolipc::JobWatch> = handles.iter().map(|h| h.get().watch.clone()).collect();
    loop {
        // A job whose answer was taken already has ended: its watch says so at once.
        let slice = deadline.map_or(WAIT_SLICE, |d| {
            WAIT_SLICE.min(d.saturating_duration_since(Instant::now()))
        });
        let watches = &watches;
        if let Some(i) = py.detach(move || poolipc::JobWatch::wait_any(watches, slice)) {
            return Ok(i);
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(PyTimeoutError::new_err(format!(
                "poolipc: none of the {} jobs has ended",
                handles.len()
            )));
        }
    }
}

impl NativeJobHandle {
    fn cached(&self, py: Python<'_>) -> Option<PyResult<Py<PyAny>>> {
        lock(&self.outcome).as_ref().map(|r| match r {
            Ok(v) => Ok(v.clone_ref(py)),
            Err(e) => Err(fresh_error(py, e)),
        })
    }

    pub(super) fn wait_inner(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let deadline = deadline_of(timeout)?;
        poolipc::probe::mark("py.wait");
        loop {
            if let Some(r) = self.cached(py) {
                return r;
            }
            let slice = deadline.map_or(WAIT_SLICE, |d| {
                WAIT_SLICE.min(d.saturating_duration_since(Instant::now()))
            });
            let pending = &self.pending;
            let raw = py.detach(move || {
                let mut p = lock(pending);
                match p.take() {
                    Some(h) => match h.wait_timeout(slice) {
                        Ok(r) => Some(r),
                        Err(h) => {
                            *p = Some(h);
                            None
                        }
                    },
                    None => {
                        // Another thread took the answer and is turning it into Python
                        // objects: it stores them in a moment.
                        drop(p);
                        std::thread::sleep(Duration::from_millis(1));
                        None
                    }
                }
            });
            if let Some(raw) = raw {
                return self.finish(py, raw);
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(PyTimeoutError::new_err(format!(
                    "poolipc: job {} on worker {} is still running",
                    self.id, self.worker
                )));
            }
        }
    }

    /// The facade's answer turned into Python objects and stored for every later wait; the
    /// job ended, so the inputs kept for it are the caller's again.
    pub(super) fn finish(
        &self,
        py: Python<'_>,
        raw: Result<JobOutput, poolipc::Error>,
    ) -> PyResult<Py<PyAny>> {
        let out = self.convert(py, raw);
        let (stored, out) = match out {
            Ok(v) => (Ok(v.clone_ref(py)), Ok(v)),
            Err(e) => {
                let raised = fresh_error(py, &e);
                (Err(e), Err(raised))
            }
        };
        *lock(&self.outcome) = Some(stored);
        lock(&self.keep).take();
        poolipc::probe::mark("py.waited");
        out
    }

    /// The facade's answer as `(results, input_rungs)`: each result `(ptr, nbytes, dtype,
    /// shape, rung, owner)`, or the typed exception.
    fn convert(
        &self,
        py: Python<'_>,
        raw: Result<JobOutput, poolipc::Error>,
    ) -> PyResult<Py<PyAny>> {
        let log = std::mem::take(&mut *lock(&self.log));
        let output = match raw {
            Ok(o) => o,
            Err(e) => {
                // A failed job's results are nobody's: the allocator's objects are dropped
                // here (torch frees its tensors); the facade freed the default allocator's,
                // except where the race checker failed the job: those come up with the
                // error, the caller's to free, and the caller is this binding.
                drop(log.made);
                if let poolipc::Error::SimViolation { results, .. } = &e
                    && !self.caller_alloc
                    && self.g.use_device().is_ok()
                {
                    for p in results {
                        let _ =
                            poolipc::advanced::driver::PoolAllocation::claim(&*self.g.driver, *p)
                                .and_then(|a| a.free(StreamHandle::NULL));
                    }
                }
                let pe = to_py_for(py, e, Some(self.worker));
                return Err(match log.raised {
                    None => pe,
                    Some(raised) => {
                        let text = format!(
                            "{} (the result allocator raised {})",
                            pe.value(py),
                            raised
                                .value(py)
                                .repr()
                                .map(|r| r.to_string())
                                .unwrap_or_default()
                        );
                        let e = JobFailedError::new_err(text.clone());
                        let v = e.value(py);
                        let _ = v.setattr("worker", self.worker);
                        let _ = v.setattr("reason", "allocator_raised");
                        let _ = v.setattr("detail", text);
                        e.set_cause(py, Some(raised));
                        e
                    }
                });
            }
        };
        let mut by_ptr: HashMap<u64, Py<PyAny>> = HashMap::new();
        for a in log.made {
            by_ptr.insert(a.ptr, a.keep);
        }
        let mut results = Vec::with_capacity(output.results.len());
        for r in output.results {
            if r.is_arena() {
                let (ptr, bytes, dt, shape) =
                    (r.ptr.0, r.bytes, r.shape.dtype, r.shape.shape.clone());
                let hold = ArenaHold::new(
                    r,
                    Arc::clone(&self.g.driver),
                    self.g.device,
                    state::is_sim(&*self.g.driver),
                    self.stream,
                );
                let owner = Py::new(py, ArenaResult::new(hold, ptr, bytes, dt, shape.clone()))?;
                results.push((
                    ptr,
                    bytes,
                    dtype::name(dt),
                    shape,
                    "arena".to_owned(),
                    owner.into_any(),
                ));
                continue;
            }
            let owner = if self.caller_alloc {
                by_ptr
                    .remove(&r.ptr.0)
                    .ok_or_else(|| err("poolipc: a result the allocator did not make"))?
            } else {
                Py::new(
                    py,
                    DeviceBuffer {
                        g: Arc::clone(&self.g),
                        ptr: Mutex::new(Some(r.ptr)),
                        nbytes: r.bytes,
                        dtype: r.shape.dtype,
                        shape: r.shape.shape.clone(),
                        shared: true,
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
        let rungs: Vec<String> = output.input_rungs.iter().map(ToString::to_string).collect();
        Ok((results, rungs).into_pyobject(py)?.into_any().unbind())
    }
}
