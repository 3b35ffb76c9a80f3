//! A job for Python: the `Job` a worker holds open and the `LeaseHold` that keeps a leased job
//! open; what its views share is [`JobLife`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use poolipc::ResultShape;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::life::JobLife;
use super::shown::Shown;
use super::thread::{Cmd, Link, Reply};
use super::view::View;
use crate::dtype;
use crate::errors::{ExpiredViewError, JobFailedError, err};

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
    /// A job the thread took: open, its input views over `inputs`.
    pub(super) fn new(
        py: Python<'_>,
        id: u64,
        inputs: Vec<Shown>,
        link: &Arc<Link>,
        stream: u64,
        device: u32,
    ) -> PyResult<Job> {
        let life = Arc::new(JobLife {
            id,
            open: AtomicBool::new(true),
            live_exports: AtomicUsize::new(0),
            consumer_streams: Mutex::new(Vec::new()),
            release_on_drop: AtomicBool::new(false),
            link: Arc::clone(link),
            job_stream: stream,
        });
        let views = inputs
            .into_iter()
            .map(|shown| Py::new(py, View::new(shown, &life, link, stream, device)))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Job {
            id,
            link: Arc::clone(link),
            life,
            stream,
            device,
            inputs: views,
            results: Mutex::new(Vec::new()),
        })
    }

    fn end(&self, py: Python<'_>, cmd: Cmd) -> PyResult<()> {
        poolipc::probe::mark("py.end");
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
        poolipc::probe::mark("py.ended");
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
            Ok(Reply::Results(shown)) => {
                let mut new = Vec::with_capacity(shown.len());
                for one in shown {
                    let v = Py::new(
                        py,
                        View::new(one, &self.life, &self.link, self.stream, self.device),
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

    /// Tells the parent this job is still being worked on: each call moves the job's handoff
    /// deadline (`ParentOptions.handoff_timeout`, 30 s by default) forward, never past its
    /// lifetime. Call it from a long computation (a sampler's steps, say) more often than the
    /// deadline; once a second is plenty. Without it, a job that sends nothing for longer than
    /// the deadline is failed and its worker condemned.
    ///
    /// Raises `ExpiredViewError` once the job ended, `JobFailedError` when the parent is gone.
    fn heartbeat(&self, py: Python<'_>) -> PyResult<()> {
        if !self.life.open.load(Ordering::Acquire) {
            return Err(ExpiredViewError::new_err(
                "poolipc: this job has already ended",
            ));
        }
        match self.link.call(py, Cmd::Heartbeat(self.id)) {
            Ok(Reply::Ok) => Ok(()),
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
