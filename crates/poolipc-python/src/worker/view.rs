//! A job's views for Python: an input view or a result buffer, device memory the parent owns
//! that torch, CuPy and JAX take without a copy (DLPack, `__cuda_array_interface__`) while
//! the job is open.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use poolipc::{DevicePtr, Layout, StreamHandle};
use pyo3::exceptions::{PyAttributeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::life::JobLife;
use super::shown::Shown;
use super::thread::{Cmd, Link, Reply};
use crate::dlpack;
use crate::dtype;
use crate::errors::{ExpiredViewError, err};

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
    shown: Shown,
    /// The strides in elements (a result's, and an input's given without, contiguous):
    /// what `strides`, DLPack and `__cuda_array_interface__` report.
    strides: Vec<i64>,
    /// A result buffer (written by the worker) rather than an input.
    #[pyo3(get)]
    is_result: bool,
    life: Arc<JobLife>,
    link: Arc<Link>,
    job_stream: u64,
    device: u32,
}

impl View {
    pub(super) fn new(
        shown: Shown,
        life: &Arc<JobLife>,
        link: &Arc<Link>,
        job_stream: u64,
        device: u32,
    ) -> View {
        let (strides, is_result) = match &shown {
            Shown::Input(v) => (v.desc.strides_or_contiguous(), false),
            Shown::Result(v) => (Layout::contiguous_strides(&v.shape.shape), true),
        };
        View {
            shown,
            strides,
            is_result,
            life: Arc::clone(life),
            link: Arc::clone(link),
            job_stream,
            device,
        }
    }

    fn ptr_(&self) -> DevicePtr {
        match &self.shown {
            Shown::Input(v) => v.ptr,
            Shown::Result(v) => v.ptr,
        }
    }

    fn dtype_(&self) -> poolipc::DType {
        match &self.shown {
            Shown::Input(v) => v.desc.dtype,
            Shown::Result(v) => v.shape.dtype,
        }
    }

    fn shape_(&self) -> &[u64] {
        match &self.shown {
            Shown::Input(v) => &v.desc.shape,
            Shown::Result(v) => &v.shape.shape,
        }
    }

    fn nbytes_(&self) -> u64 {
        match &self.shown {
            Shown::Input(v) => v.byte_len,
            Shown::Result(v) => v.bytes,
        }
    }

    fn rung_(&self) -> poolipc::Rung {
        match &self.shown {
            Shown::Input(v) => v.rung,
            Shown::Result(v) => v.rung,
        }
    }

    /// An input the parent lent read-only; never a result.
    fn read_only_(&self) -> bool {
        match &self.shown {
            Shown::Input(v) => v.read_only,
            Shown::Result(_) => false,
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

    /// The view as the exchange protocols describe it.
    fn tensor(&self) -> dlpack::Tensor<'_> {
        dlpack::Tensor {
            ptr: self.ptr_().0,
            device: self.device,
            dtype: self.dtype_(),
            shape: self.shape_(),
            strides: &self.strides,
            read_only: self.read_only_(),
            stream: self.job_stream,
        }
    }
}

#[pymethods]
impl View {
    /// The device address of element 0 in this process.
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        self.check_open()?;
        Ok(self.ptr_().0)
    }

    /// The dtype: a `poolipc.DType` (a `str` enum: `view.dtype == "float32"`).
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        dtype::value(py, self.dtype_())
    }

    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.shape_())
    }

    /// The strides, in elements.
    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.strides)
    }

    /// Bytes from element 0 to the end of the last element.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes_()
    }

    /// The rung it crossed on.
    #[getter]
    fn rung(&self) -> String {
        self.rung_().to_string()
    }

    /// Whether the view must not be written: True for an input that crossed by host staging
    /// (a write would change only this worker's copy, never the parent's tensor). False for
    /// pool-pointer inputs and for result buffers.
    #[getter]
    fn read_only(&self) -> bool {
        self.read_only_()
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
        let n = usize::try_from(self.nbytes_())
            .map_err(|_| PyValueError::new_err("poolipc: too large to read"))?;
        match self.link.call(py, Cmd::Read(self.ptr_(), n))? {
            Reply::Bytes(b) => Ok(b),
            _ => Err(err("poolipc: unexpected answer from the worker thread")),
        }
    }

    /// Writes `data` at the start of the view (synchronous; for tests and debugging).
    fn write_bytes(&self, py: Python<'_>, data: Vec<u8>) -> PyResult<()> {
        self.check_open()?;
        if self.read_only_() {
            return Err(PyValueError::new_err(
                "poolipc: this input view is read-only: the parent lent it with read_only=True, \
                 so a write would not reach its tensor (clone it to work on it in place)",
            ));
        }
        if data.len() as u64 > self.nbytes_() {
            return Err(PyValueError::new_err(format!(
                "poolipc: {} bytes do not fit in a view of {} bytes",
                data.len(),
                self.nbytes_()
            )));
        }
        self.link.call(py, Cmd::Write(self.ptr_(), data))?;
        Ok(())
    }

    /// `(kDLCUDA, device)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        dlpack::device(self.device)
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
        let request = dlpack::Request {
            stream,
            max_version,
            dl_device,
            copy,
        };
        let order = |s: StreamHandle| {
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
            Ok(())
        };
        let keep: dlpack::Keep = Arc::<JobLife>::clone(&self.life);
        dlpack::export(py, &self.tensor(), request, order, keep)
    }

    /// `__cuda_array_interface__` version 3, with the job's stream as `stream` (consumers
    /// order their work after it) and `data == (ptr, read_only)`. Not offered for bfloat16 and float8 (numpy has no type
    /// string for them): use DLPack there.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check_open()
            .map_err(|e| PyAttributeError::new_err(e.value(py).to_string()))?;
        dlpack::cuda_array_interface(py, &self.tensor())
    }

    fn __repr__(&self) -> String {
        format!(
            "{}(ptr={:#x}, dtype={}, shape={:?}, strides={:?}, rung={}, read_only={}, valid={})",
            if self.is_result {
                "ResultBuffer"
            } else {
                "InputView"
            },
            self.ptr_().0,
            dtype::name(self.dtype_()),
            self.shape_(),
            self.strides,
            self.rung_(),
            if self.read_only_() { "True" } else { "False" },
            if self.life.open.load(Ordering::Acquire) {
                "True"
            } else {
                "False"
            }
        )
    }
}
