//! Streams: `cuStream*`.
//!
//! A stream handle (`CUstream`) other than the default streams (0, `CU_STREAM_LEGACY` = 1,
//! `CU_STREAM_PER_THREAD` = 2) is the address of libcuda's stream object: every wrapper that
//! takes one is an `unsafe fn` whose caller guarantees the stream is live.

use std::ffi::c_uint;

use cudarc::driver::sys;

use super::check;
use crate::error::Result;

/// `cuStreamCreate` with `flags` (`CUstream_flags` bits).
pub(crate) fn create(flags: c_uint) -> Result<sys::CUstream> {
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: `s` is a live local, a valid place for the one handle the driver writes; `flags`
    // is a value the driver checks.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&raw mut s, flags)
    })?;
    Ok(s)
}

/// `cuStreamDestroy_v2`. Work already queued on the stream still runs.
///
/// # Safety
/// 1. `stream` was made by [`create`] in this process and is not destroyed yet.
/// 2. Nothing uses `stream` after this call.
pub(crate) unsafe fn destroy(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `stream` is live and (2) that it is not used
    // after.
    check("cuStreamDestroy_v2", unsafe {
        sys::cuStreamDestroy_v2(stream)
    })
}

/// `cuStreamSynchronize`.
///
/// # Safety
/// 1. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
pub(crate) unsafe fn synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `stream` is live.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream)
    })
}

/// `cuStreamWaitEvent`: work queued on `stream` after this waits for `event`'s last record.
///
/// # Safety
/// 1. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
/// 2. `event` is a live event of this process (made or opened here, not destroyed).
pub(crate) unsafe fn wait_event(stream: sys::CUstream, event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `stream` and (2) that `event` is live.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(stream, event, 0)
    })
}

/// `cuStreamQuery`: `true` when all work on `stream` completed, `false` on
/// `CUDA_ERROR_NOT_READY`. A handle that is not one of the driver's streams is answered
/// with `INVALID_HANDLE` or `INVALID_CONTEXT`, as long as libcuda can read what it points at.
///
/// # Safety
/// 1. `stream` is one of the default streams (0, 1, 2), or the address of readable memory
///    of this process (libcuda reads the object a handle points at before it knows whether
///    it is one of its streams).
pub(crate) unsafe fn query(stream: sys::CUstream) -> Result<bool> {
    // SAFETY: the caller guarantees (1) that `stream` points at readable memory of this
    // process; the driver validates that it is one of its streams.
    let r = unsafe { sys::cuStreamQuery(stream) };
    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check("cuStreamQuery", r)?;
    Ok(true)
}
