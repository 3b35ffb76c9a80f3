//! Device memory and what touches it: `cuMemAlloc`, the stream-ordered allocations and
//! frees, memsets, copies, and host memory registration.
//!
//! Device addresses are looked up by libcuda itself. Streams, pools and host memory are not:
//! a wrapper that takes one is an `unsafe fn`.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::check;
use crate::error::Result;

/// `cuMemAlloc_v2`: plain device memory on the current device.
pub(crate) fn alloc(bytes: usize) -> Result<sys::CUdeviceptr> {
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: `p` is a live local, a valid place for the one address the driver writes.
    check("cuMemAlloc_v2", unsafe {
        sys::cuMemAlloc_v2(&raw mut p, bytes)
    })?;
    Ok(p)
}

/// `cuMemFree_v2`.
///
/// # Safety
/// 1. `ptr` is the start of memory [`alloc`] gave out in this process, not freed yet.
/// 2. Nothing (no queued work either) uses the memory after this call.
pub(crate) unsafe fn free(ptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `ptr` is live memory of cuMemAlloc and (2) that
    // nothing uses it after.
    check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr) })
}

/// `cuMemAllocAsync`: from the current device's current pool, ordered on `stream`.
///
/// # Safety
/// 1. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
pub(crate) unsafe fn alloc_async(bytes: usize, stream: sys::CUstream) -> Result<sys::CUdeviceptr> {
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: the caller guarantees (1) that `stream` is live; `p` is a live local, a valid
    // place for the one address the driver writes.
    check("cuMemAllocAsync", unsafe {
        sys::cuMemAllocAsync(&raw mut p, bytes, stream)
    })?;
    Ok(p)
}

/// `cuMemAllocFromPoolAsync`.
///
/// # Safety
/// 1. `pool` is a live pool of this process (made or imported here, not destroyed).
/// 2. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
pub(crate) unsafe fn alloc_from_pool_async(
    bytes: usize,
    pool: sys::CUmemoryPool,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr> {
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: the caller guarantees (1) that `pool` and (2) that `stream` is live; `p` is a
    // live local, a valid place for the one address the driver writes.
    check("cuMemAllocFromPoolAsync", unsafe {
        sys::cuMemAllocFromPoolAsync(&raw mut p, bytes, pool, stream)
    })?;
    Ok(p)
}

/// `cuMemFreeAsync`: of a stream-ordered allocation, or of an import
/// ([`super::pointer::import`]), which are freed alike.
///
/// # Safety
/// 1. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
/// 2. `ptr` is the start of a live stream-ordered allocation of this process, or a live
///    import, not freed yet, and no one else frees it.
/// 3. Nothing uses `ptr` after this call, except work ordered before the free on `stream`.
pub(crate) unsafe fn free_async(ptr: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `stream` is live, (2) that `ptr` is a live
    // allocation or import it owns and (3) that nothing uses it after.
    check("cuMemFreeAsync", unsafe {
        sys::cuMemFreeAsync(ptr, stream)
    })
}

/// `cuMemsetD8Async`.
///
/// # Safety
/// 1. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
pub(crate) unsafe fn memset_d8_async(
    ptr: sys::CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `stream` is live; `ptr` is a device address,
    // which libcuda looks up itself (a wrong one is an error or a device fault).
    check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(ptr, value, bytes, stream)
    })
}

/// `cuMemsetD32Async`.
///
/// # Safety
/// 1. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
pub(crate) unsafe fn memset_d32_async(
    ptr: sys::CUdeviceptr,
    value: u32,
    words: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `stream` is live; `ptr` is a device address,
    // which libcuda looks up itself (a wrong one is an error or a device fault).
    check("cuMemsetD32Async", unsafe {
        sys::cuMemsetD32Async(ptr, value, words, stream)
    })
}

/// `cuMemcpyDtoH_v2` (synchronous): `dst.len()` bytes from `src`.
pub(crate) fn memcpy_dtoh(dst: &mut [u8], src: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: `dst` is borrowed mutably for the whole synchronous copy, so valid for
    // `dst.len()` writes that nothing else sees meanwhile; `src` is a device address, which
    // libcuda looks up itself.
    check("cuMemcpyDtoH_v2", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), src, dst.len())
    })
}

/// `cuMemcpyHtoD_v2` (synchronous): `src` to `dst`.
pub(crate) fn memcpy_htod(dst: sys::CUdeviceptr, src: &[u8]) -> Result<()> {
    // SAFETY: `src` is borrowed for the whole synchronous copy, so valid for `src.len()`
    // reads and unwritten meanwhile; `dst` is a device address, which libcuda looks up itself.
    check("cuMemcpyHtoD_v2", unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast::<c_void>(), src.len())
    })
}

/// `cuMemcpyDtoDAsync_v2`.
///
/// # Safety
/// 1. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
pub(crate) unsafe fn memcpy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `stream` is live; both addresses are device
    // addresses, which libcuda looks up itself.
    check("cuMemcpyDtoDAsync_v2", unsafe {
        sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream)
    })
}

/// `cuMemcpyDtoHAsync_v2` into host memory the caller keeps alive until the stream passes.
///
/// # Safety
/// 1. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
/// 2. `dst` is valid for `bytes` writes until the copy completed on `stream`, and nothing
///    else accesses it meanwhile.
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `stream` is live and (2) that `dst` stays valid
    // for `bytes` writes, untouched by anything else, until the copy completed; `src` is a
    // device address, which libcuda looks up itself.
    check("cuMemcpyDtoHAsync_v2", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, bytes, stream)
    })
}

/// `cuMemcpyHtoDAsync_v2` from host memory the caller keeps alive until the stream passes.
///
/// # Safety
/// 1. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
/// 2. `src` is valid for `bytes` reads until the copy completed on `stream`, and nothing
///    writes it meanwhile.
pub(crate) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const u8,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `stream` is live and (2) that `src` stays valid
    // for `bytes` reads, unwritten, until the copy completed; `dst` is a device address,
    // which libcuda looks up itself.
    check("cuMemcpyHtoDAsync_v2", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), bytes, stream)
    })
}

/// `cuMemHostRegister_v2`, portable and device-mapped.
///
/// # Safety
/// 1. `ptr..ptr + bytes` is mapped host memory of this process that stays mapped until
///    [`host_unregister`].
pub(crate) unsafe fn host_register(ptr: *mut u8, bytes: usize) -> Result<()> {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: the caller guarantees (1) that `ptr..ptr + bytes` is mapped until unregistered.
    check("cuMemHostRegister_v2", unsafe {
        sys::cuMemHostRegister_v2(ptr.cast::<c_void>(), bytes, flags)
    })
}

/// `cuMemHostUnregister`.
///
/// # Safety
/// 1. `ptr` was registered with [`host_register`] and is not unregistered yet.
/// 2. No copy still uses the range.
pub(crate) unsafe fn host_unregister(ptr: *mut u8) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `ptr` is registered and (2) that no copy uses it.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(ptr.cast::<c_void>())
    })
}
