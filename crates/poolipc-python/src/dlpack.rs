//! How consumers take device memory without a copy: DLPack capsules (and
//! `__cuda_array_interface__`) over job views (worker side) and arena results (parent side).
//! [`export`] is the one `__dlpack__` of both: it checks the consumer's request, orders the
//! consumer's stream after the producer's, and makes the capsule. This is the one place in this
//! crate with `unsafe`.
//!
//! A DLPack consumer (torch, CuPy, JAX) takes a `PyCapsule` named `dltensor` (or
//! `dltensor_versioned`) whose pointer is a `DLManagedTensor` (or `DLManagedTensorVersioned`),
//! renames it `used_dltensor` (`used_dltensor_versioned`) and later calls the struct's
//! `deleter`. A capsule nobody consumed is cleaned up by its destructor, which calls the
//! deleter itself. Both are C callbacks over raw pointers; the layouts follow dlpack.h (v1.0).
//! The managed struct owns Rust data only (shape, strides, an `Arc` of the job's life or of an
//! arena result), never a Python object, so the deleter may run on any thread without the
//! GIL. Deleters never unwind into C: what they drop runs under `catch_unwind`.
#![allow(unsafe_code)] // FFI of the DLPack protocol; every block says why it holds.

use std::ffi::{CStr, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

use poolipc::{DType, StreamHandle};
use pyo3::exceptions::{PyAttributeError, PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};

/// A CUDA stream named by a number from Python (DLPack's `stream` argument, torch's
/// `cuda_stream`, a job's stream this crate handed to Python as an int), as the driver takes
/// it. The one place in this crate where a number becomes a stream handle.
pub(crate) fn python_stream(raw: u64) -> poolipc::advanced::driver::StreamHandle {
    // SAFETY: the binding's Python API takes streams as the driver's handles of this
    // process (0, 1 and 2 the default streams, any other a live `CUstream`, as torch's
    // `cuda_stream` is): the Python caller vouches for that, as DLPack's protocol asks of its
    // `stream` argument. Handles from Python that reach the driver are checked with
    // `stream_check` first where the binding can (parent side), which catches a number that
    // is no stream before libcuda dereferences it; a destroyed stream it cannot catch.
    unsafe { poolipc::advanced::driver::StreamHandle::from_raw(raw) }
}

/// What a capsule keeps alive until its deleter runs, and how it counts its exports: a
/// worker's job (`JobLife`: counted in its `live_exports`, so DONE waits for the deleter) or a
/// parent's arena result (`ArenaHold`: one strong reference; the last one gives the block
/// back). They implement it where they are defined, so this module, below both, names neither.
pub(crate) trait Kept: Send + Sync {
    /// A capsule over it was made.
    fn acquire(&self);

    /// A capsule's deleter ran: one export fewer, and this reference goes.
    fn release(self: Arc<Self>);

    /// What the exported thing is called in errors: `(plural, the one)`.
    fn names(&self) -> (&'static str, &'static str);
}

/// What a capsule holds until its deleter runs.
pub(crate) type Keep = Arc<dyn Kept>;

/// Device memory as the exchange protocols describe it.
pub(crate) struct Tensor<'a> {
    /// The device address of element 0.
    pub(crate) ptr: u64,
    /// The device ordinal.
    pub(crate) device: u32,
    pub(crate) dtype: DType,
    pub(crate) shape: &'a [u64],
    /// In elements.
    pub(crate) strides: &'a [i64],
    /// Sets `DLPACK_FLAG_BITMASK_READ_ONLY` in a versioned capsule, and `data[1]` in the
    /// `__cuda_array_interface__`.
    pub(crate) read_only: bool,
    /// The producer's stream: consumers are ordered after it.
    pub(crate) stream: u64,
}

/// What a consumer passes to `__dlpack__`.
pub(crate) struct Request {
    /// DLPack's numbering: None for the legacy default stream, -1 for none, 1 legacy,
    /// 2 per-thread, else a handle.
    pub(crate) stream: Option<i64>,
    pub(crate) max_version: Option<(u32, u32)>,
    pub(crate) dl_device: Option<(i32, i32)>,
    pub(crate) copy: Option<bool>,
}

/// `(kDLCUDA, device)`: what `__dlpack_device__` returns.
pub(crate) fn device(ordinal: u32) -> (i32, i32) {
    (DL_CUDA, ordinal as i32)
}

/// The DLPack `stream` argument as a stream handle: None means the legacy default stream
/// (1 in CUDA's numbering); -1 means no ordering wanted.
fn consumer_stream(stream: Option<i64>) -> PyResult<Option<StreamHandle>> {
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

/// `__dlpack__` over `t` (no copy): checks the request (`BufferError` for `copy=True`,
/// another `dl_device`, or a dtype DLPack cannot name; `ValueError` for a stream that is
/// none), has `order` make the consumer's stream wait on `t.stream` (and remember it for
/// whatever must wait on the consumer later), then makes the capsule, which holds `keep`
/// until its deleter runs. A versioned capsule (`dltensor_versioned`) when `max_version` is
/// at least (1, 0), a legacy one otherwise. Nothing is counted before the capsule is made:
/// on an error `keep` is only dropped.
pub(crate) fn export<'py>(
    py: Python<'py>,
    t: &Tensor<'_>,
    request: Request,
    order: impl FnOnce(StreamHandle) -> PyResult<()>,
    keep: Keep,
) -> PyResult<Bound<'py, PyAny>> {
    let (plural, one) = keep.names();
    if request.copy == Some(true) {
        return Err(PyBufferError::new_err(format!(
            "poolipc: {plural} are handed out without a copy (copy=True is not supported)"
        )));
    }
    let here = device(t.device);
    if let Some(d) = request.dl_device
        && d != here
    {
        return Err(PyBufferError::new_err(format!(
            "poolipc: {one} lives on {here:?}, not {d:?}"
        )));
    }
    let (code, bits) = code_of(t.dtype).ok_or_else(|| {
        PyBufferError::new_err(format!(
            "poolipc: {} has no DLPack type code here",
            crate::dtype::name(t.dtype)
        ))
    })?;
    if let Some(s) = consumer_stream(request.stream)? {
        order(s)?;
    }
    let export = Export {
        data: t.ptr,
        device_id: t.device as i32,
        code,
        bits,
        shape: t.shape.iter().map(|&d| d as i64).collect(),
        strides: t.strides.to_vec(),
        read_only: t.read_only,
        life: keep,
    };
    let versioned = request.max_version.is_some_and(|(major, _)| major >= 1);
    capsule(py, export, versioned)
}

/// `__cuda_array_interface__` version 3 over `t`, with its stream as `stream` (consumers
/// order their work after it) and `data == (ptr, read_only)`. `AttributeError` for bfloat16
/// and float8 (numpy has no type string for them): DLPack serves those.
pub(crate) fn cuda_array_interface<'py>(
    py: Python<'py>,
    t: &Tensor<'_>,
) -> PyResult<Bound<'py, PyDict>> {
    let typestr = crate::dtype::typestr(t.dtype).ok_or_else(|| {
        PyAttributeError::new_err(format!(
            "poolipc: {} has no __cuda_array_interface__ type string; use __dlpack__",
            crate::dtype::name(t.dtype)
        ))
    })?;
    let elem = t.dtype.size_bytes() as i64;
    let d = PyDict::new(py);
    d.set_item("shape", PyTuple::new(py, t.shape)?)?;
    d.set_item("typestr", typestr)?;
    d.set_item("data", (t.ptr, t.read_only))?;
    let strides: Vec<i64> = t.strides.iter().map(|s| s * elem).collect();
    d.set_item("strides", PyTuple::new(py, strides)?)?;
    d.set_item("version", 3)?;
    // Stream 0 is not allowed in the interface; the simulation may number a stream so.
    d.set_item("stream", (t.stream != 0).then_some(t.stream))?;
    Ok(d)
}

/// `kDLCUDA`.
const DL_CUDA: i32 = 2;

const LEGACY_NAME: &CStr = c"dltensor";
const VERSIONED_NAME: &CStr = c"dltensor_versioned";

/// `DLPACK_FLAG_BITMASK_READ_ONLY` (dlpack.h, v1.0): the consumer must not write the tensor.
pub(crate) const FLAG_READ_ONLY: u64 = 1 << 0;

/// `(code, bits)` of a dtype in DLPack.
fn code_of(d: DType) -> Option<(u8, u8)> {
    crate::dtype::dlpack(d)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// What a capsule describes.
struct Export {
    data: u64,
    device_id: i32,
    code: u8,
    bits: u8,
    shape: Vec<i64>,
    /// In elements.
    strides: Vec<i64>,
    /// Sets `DLPACK_FLAG_BITMASK_READ_ONLY` in a versioned capsule (a legacy one has no flags).
    read_only: bool,
    life: Keep,
}

/// The managed struct first (so a pointer to the holder is a pointer to it), then what its
/// pointers point into.
#[repr(C)]
struct Holder<M> {
    managed: M,
    shape: Vec<i64>,
    strides: Vec<i64>,
    life: Keep,
}

fn tensor(e: &mut Export) -> DLTensor {
    DLTensor {
        data: e.data as *mut c_void,
        device: DLDevice {
            device_type: DL_CUDA,
            device_id: e.device_id,
        },
        ndim: e.shape.len() as i32,
        dtype: DLDataType {
            code: e.code,
            bits: e.bits,
            lanes: 1,
        },
        shape: e.shape.as_mut_ptr(),
        strides: e.strides.as_mut_ptr(),
        byte_offset: 0,
    }
}

/// A capsule over `e`; counts as one live export of the job until its deleter runs.
fn capsule(py: Python<'_>, mut e: Export, versioned: bool) -> PyResult<Bound<'_, PyAny>> {
    e.life.acquire();
    // The Vecs' heap buffers do not move when the Vecs move into the holder, so the pointers
    // taken here stay valid for the holder's life.
    let t = tensor(&mut e);
    let (ptr, name, destructor): (*mut c_void, &'static CStr, ffi::PyCapsule_Destructor) =
        if versioned {
            let h = Box::new(Holder {
                managed: DLManagedTensorVersioned {
                    version: DLPackVersion { major: 1, minor: 0 },
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_versioned),
                    flags: if e.read_only { FLAG_READ_ONLY } else { 0 },
                    dl_tensor: t,
                },
                shape: e.shape,
                strides: e.strides,
                life: e.life,
            });
            (Box::into_raw(h).cast(), VERSIONED_NAME, destroy_versioned)
        } else {
            let h = Box::new(Holder {
                managed: DLManagedTensor {
                    dl_tensor: t,
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_legacy),
                },
                shape: e.shape,
                strides: e.strides,
                life: e.life,
            });
            (Box::into_raw(h).cast(), LEGACY_NAME, destroy_legacy)
        };
    let nn = NonNull::new(ptr).ok_or_else(|| crate::errors::err("poolipc: null DLPack holder"))?;
    // SAFETY: `ptr` is a live `Box<Holder<_>>` whose first field is the managed struct the
    // name announces; the destructor frees it exactly once unless a consumer renamed the
    // capsule, in which case the consumer calls the managed struct's deleter (which frees it).
    // The destructor only touches Rust data and is safe to run from any thread.
    let cap = unsafe { PyCapsule::new_with_pointer_and_destructor(py, nn, name, Some(destructor)) };
    match cap {
        Ok(c) => Ok(c.into_any()),
        Err(err) => {
            // SAFETY: the capsule was not created, so nothing else holds `ptr`: free it here,
            // through the deleter matching its type.
            unsafe {
                if versioned {
                    delete_versioned(ptr.cast());
                } else {
                    delete_legacy(ptr.cast());
                }
            }
            Err(err)
        }
    }
}

/// Frees a holder: its `Keep` is released (an arena result's last reference gives the block
/// back, which calls the driver). Never unwinds: the deleters are called from C.
fn release<M>(h: Box<Holder<M>>) {
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let Holder { life, .. } = *h;
        life.release();
    }));
    if dropped.is_err() {
        eprintln!("poolipc: a DLPack deleter panicked; the panic was stopped at the C boundary");
    }
}

/// The legacy deleter.
///
/// # Safety
/// `m` is null or a pointer made by [`capsule`] (a `Box<Holder<DLManagedTensor>>`) not yet
/// deleted.
unsafe extern "C" fn delete_legacy(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: by the contract above, `m` came from `Box::into_raw` of this holder type, whose
    // first field (repr(C)) is the managed struct, and is deleted once.
    let h = unsafe { Box::from_raw(m.cast::<Holder<DLManagedTensor>>()) };
    release(h);
}

/// The versioned deleter.
///
/// # Safety
/// As [`delete_legacy`], for `Holder<DLManagedTensorVersioned>`.
unsafe extern "C" fn delete_versioned(m: *mut DLManagedTensorVersioned) {
    if m.is_null() {
        return;
    }
    // SAFETY: as in `delete_legacy`.
    let h = unsafe { Box::from_raw(m.cast::<Holder<DLManagedTensorVersioned>>()) };
    release(h);
}

/// The capsule destructor (legacy): deletes the tensor unless a consumer took it.
///
/// # Safety
/// Called by Python with the GIL held on a capsule made by [`capsule`].
unsafe extern "C" fn destroy_legacy(cap: *mut ffi::PyObject) {
    // SAFETY: `cap` is a live capsule (Python calls the destructor on it). A consumer that
    // took the tensor renamed it, so `IsValid` with the original name is false and the
    // consumer owns the deleter call; otherwise the pointer is ours and still undeleted.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, LEGACY_NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, LEGACY_NAME.as_ptr()).cast::<DLManagedTensor>();
            delete_legacy(m);
        }
    }
}

/// The capsule destructor (versioned).
///
/// # Safety
/// As [`destroy_legacy`].
unsafe extern "C" fn destroy_versioned(cap: *mut ffi::PyObject) {
    // SAFETY: as in `destroy_legacy`.
    unsafe {
        if ffi::PyCapsule_IsValid(cap, VERSIONED_NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(cap, VERSIONED_NAME.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            delete_versioned(m);
        }
    }
}
