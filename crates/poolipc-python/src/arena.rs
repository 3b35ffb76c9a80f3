//! Results in the parent's result arena, for Python: an [`ArenaResult`] over a facade
//! [`ResultTensor`] whose block goes back to the arena, stream-ordered, when the last owner
//! lets go: the Python object, and every DLPack tensor made from it (torch calls the deleter
//! when the tensor's storage dies, on whatever thread frees it, with or without the GIL).
//!
//! Ownership is shared by reference count: the object and each capsule hold an
//! `Arc<ArenaHold>`; the hold owns the `ResultTensor` and drops it exactly once, in its own
//! `Drop`, which first orders the return after every stream a consumer named in `__dlpack__`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use poolipc::advanced::driver::Driver;
use poolipc::advanced::driver::{DriverError, OwnedEvent};
use poolipc::{DType, ResultTensor, StreamHandle};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::{dlpack, dtype};

/// Arena results made in this process, and those whose block went back: the difference is
/// how many are still held. A block given back twice would make it negative.
static MADE: AtomicU64 = AtomicU64::new(0);
static RETURNED: AtomicU64 = AtomicU64::new(0);

/// Arena results handed to Python and not yet given back (made minus returned; negative only
/// if a block were returned twice).
pub(crate) fn results_out() -> i64 {
    let returned = RETURNED.load(Ordering::Acquire);
    let made = MADE.load(Ordering::Acquire);
    made as i64 - returned as i64
}

/// The stream handle as the driver takes it: the simulation has no `CU_STREAM_LEGACY` (1)
/// or `CU_STREAM_PER_THREAD` (2), its default stream is 0.
fn driver_stream(sim: bool, s: u64) -> StreamHandle {
    if sim && (s == 1 || s == 2) {
        StreamHandle::NULL
    } else {
        crate::dlpack::python_stream(s)
    }
}

/// Whether two streams are one: the NULL stream and `CU_STREAM_LEGACY` both name the legacy
/// default stream in the driver API.
fn same_stream(a: u64, b: u64) -> bool {
    let legacy = |s: u64| if s == 1 { 0 } else { s };
    legacy(a) == legacy(b)
}

/// One arena result and what its return must wait for. Holds no Python object, so it may be
/// dropped on any thread without the GIL.
pub(crate) struct ArenaHold {
    tensor: Mutex<Option<ResultTensor>>,
    driver: Arc<dyn Driver>,
    device: u32,
    sim: bool,
    /// The job's stream: the block goes back on it (the worker's DONE completed before the
    /// job ended).
    job_stream: u64,
    /// Streams consumers named in `__dlpack__`: the return waits for their work too.
    consumer_streams: Mutex<Vec<u64>>,
    /// DLPack tensors made from it and not yet deleted.
    live_exports: AtomicUsize,
}

impl dlpack::Kept for ArenaHold {
    fn acquire(&self) {
        self.live_exports.fetch_add(1, Ordering::AcqRel);
    }

    /// The last reference gives the block back.
    fn release(self: Arc<Self>) {
        self.live_exports.fetch_sub(1, Ordering::AcqRel);
        drop(self);
    }

    fn names(&self) -> (&'static str, &'static str) {
        ("arena results", "the result")
    }
}

impl ArenaHold {
    pub(crate) fn new(
        tensor: ResultTensor,
        driver: Arc<dyn Driver>,
        device: u32,
        sim: bool,
        job_stream: u64,
    ) -> Arc<ArenaHold> {
        MADE.fetch_add(1, Ordering::AcqRel);
        Arc::new(ArenaHold {
            tensor: Mutex::new(Some(tensor)),
            driver,
            device,
            sim,
            job_stream,
            consumer_streams: Mutex::new(Vec::new()),
            live_exports: AtomicUsize::new(0),
        })
    }

    /// Runs `f` with the parent's device pushed as this thread's current context, popped
    /// after (a thread torch frees on may have no context, or torch's on another device).
    fn on_device<T>(&self, f: impl Fn() -> Result<T, DriverError>) -> Result<T, DriverError> {
        let _on = crate::state::OnDevice::push(&*self.driver, self.device)?;
        f()
    }

    /// Makes `waiter` wait for the work queued on `on` so far.
    fn order(&self, waiter: u64, on: u64) -> Result<(), DriverError> {
        if same_stream(waiter, on) {
            return Ok(());
        }
        let (waiter, on) = (driver_stream(self.sim, waiter), driver_stream(self.sim, on));
        self.on_device(|| {
            let event = OwnedEvent::new(Arc::clone(&self.driver), false)?;
            self.driver.event_record(event.handle(), on)?;
            self.driver.stream_wait_event(waiter, event.handle())
        })
    }
}

impl Drop for ArenaHold {
    fn drop(&mut self) {
        let Some(tensor) = self
            .tensor
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            return;
        };
        let streams = std::mem::take(
            self.consumer_streams
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for s in streams {
            if let Err(e) = self.order(self.job_stream, s) {
                // The job's stream cannot be made to wait: wait on the host instead. If even
                // that fails, the block stays out of the arena rather than be reused under a
                // consumer's running work.
                let synced =
                    self.on_device(|| self.driver.stream_synchronize(driver_stream(self.sim, s)));
                if let Err(e2) = synced {
                    eprintln!(
                        "poolipc: an arena result's block stays out of the arena: its consumer \
                         stream {s:#x} cannot be ordered ({e}) or waited for ({e2})"
                    );
                    std::mem::forget(tensor);
                    return;
                }
            }
        }
        // The facade records an event on the job's stream and gives the block back with it.
        drop(tensor);
        RETURNED.fetch_add(1, Ordering::AcqRel);
    }
}

/// A job's result in the parent's result arena (`results="arena"`): parent-owned memory the
/// worker wrote in place. Hand it to torch with `torch.from_dlpack(r)` (CuPy:
/// `cupy.from_dlpack(r)` or `cupy.asarray(r)` through `__cuda_array_interface__`); no copy is
/// made. Its block goes back to the arena, ordered after the job's stream (and after every
/// stream named in `__dlpack__(stream=...)`), once this object and every tensor made from it
/// are gone. `__dlpack__` may be called more than once: each tensor shares the block.
#[pyclass(module = "poolipc", frozen)]
pub(crate) struct ArenaResult {
    hold: Arc<ArenaHold>,
    ptr: u64,
    /// Its size in bytes.
    #[pyo3(get)]
    nbytes: u64,
    dtype: DType,
    shape: Vec<u64>,
    /// Contiguous, in elements.
    strides: Vec<i64>,
}

impl ArenaResult {
    pub(crate) fn new(
        hold: Arc<ArenaHold>,
        ptr: u64,
        nbytes: u64,
        dtype: DType,
        shape: Vec<u64>,
    ) -> Self {
        ArenaResult {
            hold,
            ptr,
            nbytes,
            dtype,
            strides: poolipc::Layout::contiguous_strides(&shape),
            shape,
        }
    }

    /// The result as the exchange protocols describe it: contiguous, writable, on the job's
    /// stream.
    fn tensor(&self) -> dlpack::Tensor<'_> {
        dlpack::Tensor {
            ptr: self.ptr,
            device: self.hold.device,
            dtype: self.dtype,
            shape: &self.shape,
            strides: &self.strides,
            read_only: false,
            stream: self.hold.job_stream,
        }
    }
}

#[pymethods]
impl ArenaResult {
    /// The device address of element 0.
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Same as `ptr`, for code written for torch tensors.
    fn data_ptr(&self) -> u64 {
        self.ptr
    }

    /// The dtype: a `poolipc.DType` (a `str` enum: `result.dtype == "float32"`).
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        dtype::value(py, self.dtype)
    }

    /// The shape (a tuple).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// How it crossed: always `arena`.
    #[getter]
    fn rung(&self) -> &'static str {
        "arena"
    }

    /// The device ordinal it lives on.
    #[getter]
    fn device(&self) -> u32 {
        self.hold.device
    }

    /// The job's stream: the worker's writes are ordered before work queued on it.
    #[getter]
    fn stream(&self) -> u64 {
        self.hold.job_stream
    }

    /// How many DLPack tensors made from it are still alive (their deleter has not run).
    #[getter]
    fn live_exports(&self) -> usize {
        self.hold.live_exports.load(Ordering::Acquire)
    }

    /// `(kDLCUDA, device)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        dlpack::device(self.hold.device)
    }

    /// A DLPack capsule over the result (no copy) that shares the block: the block goes back
    /// only after this object and every tensor made from it are gone. `stream`: the
    /// consumer's stream (DLPack's numbering: None for the legacy default stream, -1 for
    /// none, 1 legacy, 2 per-thread, else a handle); it is made to wait on the job's stream,
    /// and the block's return waits for it. A versioned capsule (`dltensor_versioned`) when
    /// `max_version` is at least (1, 0), a legacy one otherwise. `BufferError` for
    /// `copy=True`, another `dl_device`, or a dtype DLPack cannot name; `PoolipcError` when
    /// the driver cannot order the streams.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let request = dlpack::Request {
            stream,
            max_version,
            dl_device,
            copy,
        };
        let hold = &self.hold;
        let order = |s: StreamHandle| {
            let s = s.as_raw();
            py.detach(|| hold.order(s, hold.job_stream))
                .map_err(|e| crate::errors::err(format!("poolipc: ordering streams: {e}")))?;
            let mut cs = hold
                .consumer_streams
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !same_stream(s, hold.job_stream) && !cs.contains(&s) {
                cs.push(s);
            }
            Ok(())
        };
        let keep: dlpack::Keep = Arc::<ArenaHold>::clone(&self.hold);
        dlpack::export(py, &self.tensor(), request, order, keep)
    }

    /// `__cuda_array_interface__` version 3: contiguous, writable, with the job's stream as
    /// `stream`. Not offered for bfloat16 and float8 (numpy has no type string for them): use
    /// DLPack there. The interface carries no ownership: the block stays out of the arena as
    /// long as this object lives (CuPy and Numba keep it alive with the arrays they make).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        dlpack::cuda_array_interface(py, &self.tensor())
    }

    fn __repr__(&self) -> String {
        format!(
            "ArenaResult(ptr={:#x}, dtype={}, shape={:?}, nbytes={}, live_exports={})",
            self.ptr,
            dtype::name(self.dtype),
            self.shape,
            self.nbytes,
            self.live_exports()
        )
    }
}
