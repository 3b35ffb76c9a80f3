//! DLPack capsules over job views (worker side) and arena results (parent side): the one
//! place in this crate with `unsafe`.
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
use std::sync::atomic::Ordering;

use poolipc::DType;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::arena::ArenaHold;
use crate::worker::JobLife;

/// A CUDA stream named by a number from Python (DLPack's `stream` argument, torch's
/// `cuda_stream`, a job's stream this crate handed to Python as an int), as the driver takes
/// it. The one place in this crate where a number becomes a stream handle.
pub(crate) fn python_stream(raw: u64) -> poolipc_driver::StreamHandle {
    // SAFETY: the binding's Python API takes streams as the driver's handles of this
    // process (0, 1 and 2 the default streams, any other a live `CUstream`, as torch's
    // `cuda_stream` is): the Python caller vouches for that, as DLPack's protocol asks of its
    // `stream` argument. Handles from Python that reach the driver are checked with
    // `stream_check` first where the binding can (parent side), which catches a number that
    // is no stream before libcuda dereferences it; a destroyed stream it cannot catch.
    unsafe { poolipc_driver::StreamHandle::from_raw(raw) }
}

/// What a capsule keeps alive until its deleter runs.
pub(crate) enum Keep {
    /// A worker's job: counted in its `live_exports`, so DONE waits for the deleter.
    Job(Arc<JobLife>),
    /// A parent's arena result: one strong reference; the last one gives the block back.
    Arena(Arc<ArenaHold>),
}

impl Keep {
    fn acquire(&self) {
        match self {
            Keep::Job(life) => {
                life.live_exports.fetch_add(1, Ordering::AcqRel);
            }
            Keep::Arena(hold) => hold.export_made(),
        }
    }

    fn release(self) {
        match self {
            Keep::Job(life) => life.export_released(),
            Keep::Arena(hold) => hold.export_deleted(),
        }
    }
}

/// `kDLCUDA`.
pub(crate) const DL_CUDA: i32 = 2;

const LEGACY_NAME: &CStr = c"dltensor";
const VERSIONED_NAME: &CStr = c"dltensor_versioned";

/// `DLPACK_FLAG_BITMASK_READ_ONLY` (dlpack.h, v1.0): the consumer must not write the tensor.
pub(crate) const FLAG_READ_ONLY: u64 = 1 << 0;

/// `(code, bits)` of a dtype in DLPack.
pub(crate) fn code_of(d: DType) -> Option<(u8, u8)> {
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
pub(crate) struct Export {
    pub(crate) data: u64,
    pub(crate) device_id: i32,
    pub(crate) code: u8,
    pub(crate) bits: u8,
    pub(crate) shape: Vec<i64>,
    /// In elements.
    pub(crate) strides: Vec<i64>,
    /// Sets `DLPACK_FLAG_BITMASK_READ_ONLY` in a versioned capsule (a legacy one has no flags).
    pub(crate) read_only: bool,
    pub(crate) life: Keep,
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
pub(crate) fn capsule(
    py: Python<'_>,
    mut e: Export,
    versioned: bool,
) -> PyResult<Bound<'_, PyAny>> {
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
