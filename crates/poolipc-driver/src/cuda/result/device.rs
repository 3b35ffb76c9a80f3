//! Devices, their primary contexts and the current context: `cuInit`, `cuDevice*`,
//! `cuDevicePrimaryCtx*`, `cuCtx*`, `cuMemGetInfo`.

use std::ffi::{c_char, c_int};

use cudarc::driver::sys;

use super::check;
use crate::error::Result;

/// `cuInit(0)`.
pub(crate) fn init() -> Result<()> {
    // SAFETY: no pointer is passed; 0 is the only flag value the call takes.
    check("cuInit", unsafe { sys::cuInit(0) })
}

/// `cuDriverGetVersion`: e.g. 13000 for a CUDA 13.0 driver.
pub(crate) fn driver_version() -> Result<c_int> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a live local, a valid place for the one int the driver writes.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&raw mut v)
    })?;
    Ok(v)
}

/// `cuDeviceGetCount`.
pub(crate) fn count() -> Result<c_int> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a live local, a valid place for the one int the driver writes.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&raw mut n)
    })?;
    Ok(n)
}

/// `cuDeviceGet`: the device of `ordinal` (an ordinal out of range is the driver's error).
pub(crate) fn get(ordinal: c_int) -> Result<sys::CUdevice> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: `dev` is a live local, a valid place for the one CUdevice the driver writes;
    // the ordinal is a value the driver checks.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&raw mut dev, ordinal)
    })?;
    Ok(dev)
}

/// `cuDeviceGetAttribute`.
pub(crate) fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<c_int> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a live local, a valid place for the one int every device attribute
    // writes; `dev` and `attr` are values the driver checks.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&raw mut v, attr, dev)
    })?;
    Ok(v)
}

/// `cuDeviceGetUuid_v2`.
pub(crate) fn uuid(dev: sys::CUdevice) -> Result<sys::CUuuid> {
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: `uuid` is a live local CUuuid, the 16 bytes the driver writes; `dev` is a value
    // the driver checks.
    check("cuDeviceGetUuid_v2", unsafe {
        sys::cuDeviceGetUuid_v2(&raw mut uuid, dev)
    })?;
    Ok(uuid)
}

/// `cuDeviceGetName`: the bytes of the name, up to its NUL (at most 255).
pub(crate) fn name(dev: sys::CUdevice) -> Result<Vec<u8>> {
    let mut name = [0 as c_char; 256];
    // SAFETY: the buffer is a live local of 256 chars and we pass that length, so the driver
    // writes inside it; `dev` is a value the driver checks.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)
    })?;
    Ok(name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect())
}

/// `cuDeviceTotalMem_v2`, in bytes.
pub(crate) fn total_mem(dev: sys::CUdevice) -> Result<usize> {
    let mut total: usize = 0;
    // SAFETY: `total` is a live local, a valid place for the one size_t the driver writes.
    check("cuDeviceTotalMem_v2", unsafe {
        sys::cuDeviceTotalMem_v2(&raw mut total, dev)
    })?;
    Ok(total)
}

/// `cuDeviceCanAccessPeer`: nonzero when `dev` can reach `peer`'s memory.
pub(crate) fn can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<c_int> {
    let mut can: c_int = 0;
    // SAFETY: `can` is a live local, a valid place for the one int the driver writes; both
    // devices are values the driver checks.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&raw mut can, dev, peer)
    })?;
    Ok(can)
}

/// `cuDevicePrimaryCtxRetain`: the device's primary context, retained once more (give it
/// back with [`primary_ctx_release`]).
pub(crate) fn primary_ctx_retain(dev: sys::CUdevice) -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a live local, a valid place for the one CUcontext the driver writes;
    // `dev` is a value the driver checks.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&raw mut ctx, dev)
    })?;
    Ok(ctx)
}

/// `cuDevicePrimaryCtxRelease_v2`: gives back one retain of the device's primary context.
///
/// # Safety
/// 1. This process retained `dev`'s primary context with [`primary_ctx_retain`] and this
///    call gives back one of those retains, not one it gave back already.
/// 2. When it is the last retain (the driver destroys the context then), nothing uses the
///    context, or anything made in it, after this call.
pub(crate) unsafe fn primary_ctx_release(dev: sys::CUdevice) -> Result<()> {
    // SAFETY: the caller guarantees (1) that a retain is given back and (2) that nothing
    // uses the context after its last retain is given back.
    check("cuDevicePrimaryCtxRelease_v2", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(dev)
    })
}

/// `cuCtxSetCurrent` on the calling thread.
///
/// # Safety
/// 1. `ctx` is a context of this process, live (retained, not released) for as long as it is
///    current on this thread: libcuda dereferences it without checking.
pub(crate) unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `ctx` is a live context of this process.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
}

/// `cuCtxPushCurrent_v2` on the calling thread: `ctx` current until the matching pop.
///
/// # Safety
/// 1. `ctx` is a context of this process, live (retained, not released) for as long as it is
///    on this thread's context stack: libcuda dereferences it without checking.
pub(crate) unsafe fn ctx_push_current(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `ctx` is a live context of this process.
    check("cuCtxPushCurrent_v2", unsafe {
        sys::cuCtxPushCurrent_v2(ctx)
    })
}

/// `cuCtxPopCurrent_v2` on the calling thread: the context pushed last leaves the stack and
/// the one before it is current again (an error when the stack is empty).
pub(crate) fn ctx_pop_current() -> Result<()> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a live local, a valid place for the one CUcontext the driver writes;
    // popping touches only this thread's stack (an empty one is the driver's error).
    check("cuCtxPopCurrent_v2", unsafe {
        sys::cuCtxPopCurrent_v2(&raw mut ctx)
    })
}

/// `cuCtxGetCurrent`: the calling thread's current context (null when none is).
pub(crate) fn ctx_get_current() -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a live local, a valid place for the one CUcontext the driver writes.
    check("cuCtxGetCurrent", unsafe {
        sys::cuCtxGetCurrent(&raw mut ctx)
    })?;
    Ok(ctx)
}

/// `cuCtxSynchronize`: waits for all work of the current context.
pub(crate) fn ctx_synchronize() -> Result<()> {
    // SAFETY: no argument; the call acts on the current context, whose absence is the
    // driver's error.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// `cuMemGetInfo_v2` for the current device: (free, total) bytes.
pub(crate) fn mem_get_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both are live locals, valid places for the one size_t each the driver writes.
    check("cuMemGetInfo_v2", unsafe {
        sys::cuMemGetInfo_v2(&raw mut free, &raw mut total)
    })?;
    Ok((free, total))
}
