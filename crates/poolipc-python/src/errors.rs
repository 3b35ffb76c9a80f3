//! The Python exceptions, and how the facade's errors become them.
//!
//! | facade error                       | Python exception                                   |
//! |------------------------------------|----------------------------------------------------|
//! | `InvalidTensor` (negative strides, past its allocation) | `ValueError`, naming the input |
//! | `Config` (options that cannot work, a clash with the process's parent) | `ValueError` |
//! | `JobFailed` (the worker was lost: died, hung up, missed a deadline, stopped) | `JobFailedError` (`.worker`, `.reason`, `.detail`) |
//! | `Worker` (the worker reported an error for the job) | `WorkerError` (`.worker`, `.message`), a `JobFailedError` |
//! | `Worker`, failing because the parent's result arena refused a result over its cap | `ArenaFullError`: a `WorkerError` and a `MemoryError` |
//! | `UnknownWorker`                    | `UnknownWorkerError`: a `PoolipcError` and a `KeyError` |
//! | `ContextLost` (this process's CUDA context is gone; under MPS, after a worker's GPU fault) | `ContextLostError` |
//! | `poolipc::mps::MpsError` (`start_mps` refused or failed) | `MpsError` |
//! | anything else (driver, pool, transport, handshake, protocol) | `PoolipcError` |
//!
//! `PoolipcError` derives from `RuntimeError`, so nothing the binding raises is a bare
//! `RuntimeError`.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::{PyErr, create_exception};

create_exception!(
    poolipc,
    PoolipcError,
    PyRuntimeError,
    "A poolipc operation failed; the message names the call and the reason."
);
create_exception!(
    poolipc,
    JobFailedError,
    PoolipcError,
    "A job failed because its worker was lost: it died, hung up, missed a deadline, broke the \
     protocol or was stopped while it held the job. The worker is killed and reaped, what the \
     job held is released, and the parent goes on serving other workers. Attributes: `worker` \
     (the worker's id), `reason` (`deadline_expired`, `hung_up`, `reaped`, ...), `detail` \
     (what the parent saw)."
);
create_exception!(
    poolipc,
    WorkerError,
    JobFailedError,
    "The worker reported an error for the job (its code raised inside the job, or called \
     `job.fail`). The worker is alive and serves the next job. A `JobFailedError`, so code \
     that catches that catches this too. Attributes: `worker`, `message` (the worker's words), \
     `reason` (`worker_error`), `detail` (= `message`)."
);
create_exception!(
    poolipc,
    SimViolationError,
    PoolipcError,
    "On the simulated driver, the job broke the GPU's ordering rules: its worker (or the \
     parent) touched memory on a stream that never waited for READY, wrote a read-only input, \
     wrote a result after DONE, or used memory after its job or its free. The message names \
     both calls, their streams and processes, and the seed that replays the run. Attributes: \
     `worker`, `job`, `seed`, `violations` (one sentence each)."
);
create_exception!(
    poolipc,
    ExpiredViewError,
    PoolipcError,
    "A view or result buffer was used after its job ended: the memory belongs to the parent again."
);

create_exception!(
    poolipc,
    ConnectError,
    PoolipcError,
    "A worker could not reach a parent's listening socket (`Worker.connect`): nothing listens \
     at the path (no such socket, the listener was closed, the parent is gone), or the \
     listener runs as another user. The message names the path and the reason."
);
create_exception!(
    poolipc,
    ContextLostError,
    PoolipcError,
    "This process's CUDA context is lost: a GPU fault (under MPS, possibly a worker's: under \
     MPS one client's fault ends every client's context), an uncorrectable ECC error, or the \
     MPS server dropped it. Every later CUDA call here fails and nothing computed since can be \
     trusted, so the parent refuses all further work; restart the process. The message names \
     the first failing call and the worker most likely at fault."
);
create_exception!(
    poolipc,
    MpsError,
    PoolipcError,
    "start_mps refused or failed: not acknowledged (accept_shared_gpu_faults), MPS not \
     installed, CUDA already initialised in this process, another MPS daemon reachable, or \
     the daemon did not start. The message says which."
);

/// `UnknownWorkerError(PoolipcError, KeyError)`: made at import, since a class with two bases
/// cannot be declared by `create_exception!`.
static UNKNOWN_WORKER: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The `UnknownWorkerError` class: a worker id this parent does not know, or no longer serves
/// (stopped, or lost and reaped). Both a `PoolipcError` and a `KeyError` (the id is the key);
/// its text is the message itself, not `KeyError`'s quoted repr.
pub(crate) fn unknown_worker_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    UNKNOWN_WORKER
        .get_or_try_init(py, || {
            let bases = PyTuple::new(
                py,
                [
                    py.get_type::<PoolipcError>().into_any(),
                    py.get_type::<pyo3::exceptions::PyKeyError>().into_any(),
                ],
            )?;
            let ns = PyDict::new(py);
            ns.set_item("__module__", "poolipc")?;
            ns.set_item(
                "__doc__",
                "A worker id this parent does not know, or no longer serves (stopped, or lost \
                 and reaped). A PoolipcError and a KeyError; `worker` is the id.",
            )?;
            ns.set_item(
                "__str__",
                py.get_type::<pyo3::exceptions::PyBaseException>()
                    .getattr("__str__")?,
            )?;
            let ty = py
                .get_type::<PyType>()
                .call1(("UnknownWorkerError", bases, ns))?;
            Ok::<_, PyErr>(ty.cast_into::<PyType>()?.unbind())
        })
        .map(|t| t.bind(py))
}

/// `ArenaFullError(WorkerError, MemoryError)`: made at import, as `UnknownWorkerError` is.
static ARENA_FULL: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The `ArenaFullError` class: a job whose worker failed because the parent's result arena
/// would pass its cap (`arena_max_bytes`) to hold a result. Both a `WorkerError` (the worker
/// is alive and serves the next job) and a `MemoryError`; the message names the bytes asked
/// for, the arena's size and its cap.
pub(crate) fn arena_full_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    ARENA_FULL
        .get_or_try_init(py, || {
            let bases = PyTuple::new(
                py,
                [
                    py.get_type::<WorkerError>().into_any(),
                    py.get_type::<pyo3::exceptions::PyMemoryError>().into_any(),
                ],
            )?;
            let ns = PyDict::new(py);
            ns.set_item("__module__", "poolipc")?;
            ns.set_item(
                "__doc__",
                "A result was refused because the parent's result arena would pass its cap \
                 (arena_max_bytes) to hold it; the message names the bytes asked for, the \
                 arena's size and its cap. A WorkerError (the worker failed the job and serves \
                 the next one) and a MemoryError. Attributes as WorkerError's; `reason` is \
                 `arena_full`.",
            )?;
            let ty = py
                .get_type::<PyType>()
                .call1(("ArenaFullError", bases, ns))?;
            Ok::<_, PyErr>(ty.cast_into::<PyType>()?.unbind())
        })
        .map(|t| t.bind(py))
}

/// Sets attributes on an exception's value (best effort: an exception without them is still
/// the right exception).
fn with_attrs(py: Python<'_>, e: PyErr, attrs: &[(&str, Py<PyAny>)]) -> PyErr {
    let v = e.value(py);
    for (k, x) in attrs {
        let _ = v.setattr(*k, x.bind(py));
    }
    e
}

/// `DeadlineExpired` to `deadline_expired`: the contract's reason as Python spells names.
fn snake(reason: &impl std::fmt::Debug) -> String {
    let camel = format!("{reason:?}");
    let mut out = String::with_capacity(camel.len() + 4);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else if c.is_alphanumeric() || c == '_' {
            out.push(c);
        } else {
            break;
        }
    }
    out
}

/// The Python exception for a facade error. `worker`: the worker the call was about, if any
/// (the facade's `Worker` error does not carry it).
pub(crate) fn to_py_for(py: Python<'_>, e: poolipc::Error, worker: Option<u32>) -> PyErr {
    let text = format!("poolipc: {e}");
    let int = |x: u32| x.into_pyobject(py).map(|o| o.into_any().unbind()).ok();
    let s = |x: &str| x.into_pyobject(py).map(|o| o.into_any().unbind()).ok();
    let none = || py.None();
    match e {
        poolipc::Error::JobFailed {
            worker: w,
            reason,
            detail,
            ..
        } => with_attrs(
            py,
            JobFailedError::new_err(text),
            &[
                ("worker", int(w.0).unwrap_or_else(none)),
                ("reason", s(&snake(&reason)).unwrap_or_else(none)),
                ("detail", s(&detail).unwrap_or_else(none)),
            ],
        ),
        poolipc::Error::Worker {
            message, refused, ..
        } => {
            // The parent's own record of what it refused this job, not the worker's words.
            let full = matches!(refused, Some(poolipc::ResultRefusal::ArenaFull { .. }));
            let text = match &refused {
                Some(r) if !message.contains(&r.to_string()) => {
                    format!("{text} (the parent refused a result of the job: {r})")
                }
                _ => text,
            };
            let e = match arena_full_type(py) {
                Ok(ty) if full => PyErr::from_type(ty.clone(), (text,)),
                _ => WorkerError::new_err(text),
            };
            let reason = if full { "arena_full" } else { "worker_error" };
            with_attrs(
                py,
                e,
                &[
                    ("worker", worker.and_then(int).unwrap_or_else(none)),
                    ("reason", s(reason).unwrap_or_else(none)),
                    ("message", s(&message).unwrap_or_else(none)),
                    ("detail", s(&message).unwrap_or_else(none)),
                ],
            )
        }
        poolipc::Error::SimViolation {
            worker: w,
            job,
            report,
            ..
        } => {
            let lines = report
                .lines()
                .into_pyobject(py)
                .map(|o| o.into_any().unbind())
                .ok();
            let u64_ = |x: u64| x.into_pyobject(py).map(|o| o.into_any().unbind()).ok();
            with_attrs(
                py,
                SimViolationError::new_err(text),
                &[
                    ("worker", int(w.0).unwrap_or_else(none)),
                    ("job", u64_(job.0).unwrap_or_else(none)),
                    ("seed", u64_(report.seed).unwrap_or_else(none)),
                    ("violations", lines.unwrap_or_else(none)),
                ],
            )
        }
        poolipc::Error::InvalidTensor(_)
        | poolipc::Error::InvalidStream(_)
        | poolipc::Error::Config(_) => PyValueError::new_err(text),
        poolipc::Error::UnknownWorker(w) => unknown_worker(py, w.0, text),
        poolipc::Error::ContextLost { .. } => ContextLostError::new_err(text),
        _ => PoolipcError::new_err(text),
    }
}

/// [`to_py_for`] without a worker to name.
pub(crate) fn to_py(e: poolipc::Error) -> PyErr {
    Python::attach(|py| to_py_for(py, e, None))
}

/// An `UnknownWorkerError` for `worker` with this text.
pub(crate) fn unknown_worker(py: Python<'_>, worker: u32, text: String) -> PyErr {
    match unknown_worker_type(py) {
        Ok(ty) => {
            let e = PyErr::from_type(ty.clone(), (text,));
            let w = worker.into_pyobject(py).map(|o| o.into_any().unbind());
            match w {
                Ok(w) => with_attrs(py, e, &[("worker", w)]),
                Err(_) => e,
            }
        }
        Err(e) => e,
    }
}

/// A [`PoolipcError`] with this message.
pub(crate) fn err(msg: impl Into<String>) -> PyErr {
    PoolipcError::new_err(msg.into())
}

/// A `ValueError` with this message.
pub(crate) fn value_err(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

#[cfg(test)]
mod tests {
    use super::snake;

    #[derive(Debug)]
    #[allow(dead_code)]
    enum R {
        DeadlineExpired,
        HungUp,
        Other { x: u8 },
    }

    #[test]
    fn reasons_read_as_python_names() {
        assert_eq!(snake(&R::DeadlineExpired), "deadline_expired");
        assert_eq!(snake(&R::HungUp), "hung_up");
        assert_eq!(snake(&R::Other { x: 1 }), "other");
    }
}
