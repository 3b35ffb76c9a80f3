//! The result allocator of a job submitted with `alloc`: the facade's [`ResultAllocator`] over
//! a Python callable (torch.empty), which logs what it made and what it raised for the
//! thread that waits on the job.

use std::sync::{Arc, Mutex};

use poolipc::{DevicePtr, ResultAllocator};
use pyo3::prelude::*;

use super::lock;
use crate::dtype;

/// What the allocator callback gave for one result: the pointer and the object that owns it.
pub(super) struct Allocated {
    pub(super) ptr: u64,
    pub(super) keep: Py<PyAny>,
}

/// What the Python allocator left for the thread that waits on the job.
#[derive(Default)]
pub(super) struct AllocLog {
    pub(super) made: Vec<Allocated>,
    /// The first exception it raised.
    pub(super) raised: Option<PyErr>,
}

/// The facade's allocator over a Python callable `f(dtype, shape, nbytes, stream) -> (ptr,
/// owner)`. It runs on the parent's allocator thread (one per IO room, so that a wait for the
/// GIL stalls only this job), which takes the GIL for it: the thread that
/// waits on the job has released the GIL, so the two never wait on each other.
pub(super) fn python_allocator(f: Py<PyAny>, log: Arc<Mutex<AllocLog>>) -> ResultAllocator {
    Box::new(move |shape, bytes, stream| {
        let attached = Python::try_attach(|py| {
            let r = dtype::value(py, shape.dtype)
                .and_then(|dt| f.call1(py, (dt, shape.shape.clone(), bytes, stream.as_raw())))
                .and_then(|r| r.extract::<(u64, Py<PyAny>)>(py));
            match r {
                Ok((ptr, keep)) => {
                    lock(&log).made.push(Allocated { ptr, keep });
                    Ok(DevicePtr(ptr))
                }
                Err(e) => {
                    let text = e.to_string();
                    lock(&log).raised.get_or_insert(e);
                    Err(poolipc::Error::ResultRefused(format!(
                        "the result allocator raised {text}"
                    )))
                }
            }
        });
        attached.unwrap_or_else(|| {
            Err(poolipc::Error::ResultRefused(
                "the Python interpreter is shutting down: no result allocator can run".into(),
            ))
        })
    })
}
