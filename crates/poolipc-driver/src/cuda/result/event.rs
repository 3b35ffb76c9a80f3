//! Events: `cuEvent*` and their interprocess handles (`cuIpc*EventHandle`).
//!
//! The event handle (`CUevent`) is the address of libcuda's event object: every wrapper that
//! takes one is an `unsafe fn` whose caller guarantees the event is live.

use std::ffi::c_uint;

use cudarc::driver::sys;

use super::check;
use crate::error::Result;

/// `cuEventCreate` with `flags` (`CUevent_flags` bits).
pub(crate) fn create(flags: c_uint) -> Result<sys::CUevent> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: `ev` is a live local, a valid place for the one handle the driver writes;
    // `flags` is a value the driver checks.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&raw mut ev, flags)
    })?;
    Ok(ev)
}

/// `cuEventDestroy_v2`.
///
/// # Safety
/// 1. `event` was made by [`create`] or [`ipc_open_handle`] in this process and is not
///    destroyed yet.
/// 2. Nothing uses `event` after this call.
pub(crate) unsafe fn destroy(event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `event` is live and (2) that it is not used after.
    check("cuEventDestroy_v2", unsafe {
        sys::cuEventDestroy_v2(event)
    })
}

/// `cuIpcGetEventHandle`: the 64 bytes another process opens `event` with.
///
/// # Safety
/// 1. `event` is a live event of this process (made or opened here, not destroyed).
pub(crate) unsafe fn ipc_get_handle(event: sys::CUevent) -> Result<sys::CUipcEventHandle> {
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    // SAFETY: the caller guarantees (1) that `event` is live; `h` is a live local, the 64
    // bytes the driver writes.
    check("cuIpcGetEventHandle", unsafe {
        sys::cuIpcGetEventHandle(&raw mut h, event)
    })?;
    Ok(h)
}

/// `cuIpcOpenEventHandle`: the event another process's handle names, opened here.
pub(crate) fn ipc_open_handle(handle: sys::CUipcEventHandle) -> Result<sys::CUevent> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: `ev` is a live local, a valid place for the one handle the driver writes; the
    // IPC handle is passed by value, as bytes the driver checks.
    check("cuIpcOpenEventHandle", unsafe {
        sys::cuIpcOpenEventHandle(&raw mut ev, handle)
    })?;
    Ok(ev)
}

/// `cuEventRecord`.
///
/// # Safety
/// 1. `event` is a live event of this process (made or opened here, not destroyed).
/// 2. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
pub(crate) unsafe fn record(event: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `event` and (2) that `stream` is live.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(event, stream)
    })
}

/// `cuEventQuery`: `true` when complete, `false` on `CUDA_ERROR_NOT_READY`.
///
/// # Safety
/// 1. `event` is a live event of this process (made or opened here, not destroyed).
pub(crate) unsafe fn query(event: sys::CUevent) -> Result<bool> {
    // SAFETY: the caller guarantees (1) that `event` is live.
    let r = unsafe { sys::cuEventQuery(event) };
    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check("cuEventQuery", r)?;
    Ok(true)
}

/// `cuEventSynchronize`.
///
/// # Safety
/// 1. `event` is a live event of this process (made or opened here, not destroyed).
pub(crate) unsafe fn synchronize(event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `event` is live.
    check("cuEventSynchronize", unsafe {
        sys::cuEventSynchronize(event)
    })
}
