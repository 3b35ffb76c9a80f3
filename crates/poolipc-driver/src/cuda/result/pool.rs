//! Memory pools: `cuMemPool*` and the device's current and default pools.
//!
//! The pool handle (`CUmemoryPool`) is the address of libcuda's pool object: every wrapper
//! that takes one is an `unsafe fn` whose caller guarantees the pool is live.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use cudarc::driver::sys;

use super::check;
use crate::error::Result;

/// `cuMemPoolCreate` of a pool of pinned memory at `location`, shareable as `handle_types`.
pub(crate) fn create(
    location: sys::CUmemLocation,
    handle_types: sys::CUmemAllocationHandleType,
) -> Result<sys::CUmemoryPool> {
    // SAFETY: CUmemPoolProps is plain data for which all-zero bytes are valid (every enum it
    // holds has a variant 0, pointers may be null).
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = handle_types;
    props.location = location;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a live local, a valid place for the one handle the driver writes;
    // `props` is initialised, and its one pointer (the Windows security attributes) is null.
    check("cuMemPoolCreate", unsafe {
        sys::cuMemPoolCreate(&raw mut pool, &raw const props)
    })?;
    Ok(pool)
}

/// `cuMemPoolDestroy`.
///
/// # Safety
/// 1. `pool` was made by [`create`] or [`import_fd`] in this process and is not destroyed yet
///    (a second destroy is a use after free inside libcuda).
/// 2. Nothing uses `pool` after this call (it is not a device's current pool either).
pub(crate) unsafe fn destroy(pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `pool` is live and (2) that it is not used after.
    check("cuMemPoolDestroy", unsafe { sys::cuMemPoolDestroy(pool) })
}

/// `cuMemPoolSetAttribute` of an attribute whose value is a `cuuint64_t`.
///
/// # Safety
/// 1. `pool` is a live pool of this process (made or imported here, not destroyed).
/// 2. `attr` takes a `cuuint64_t` (the release threshold, the high-water marks).
pub(crate) unsafe fn set_attribute_u64(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
    value: u64,
) -> Result<()> {
    let mut value = value;
    // SAFETY: the caller guarantees (1) that `pool` is live and (2) that `attr` reads a
    // cuuint64_t, which `value`, a live local, is.
    check("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(pool, attr, (&raw mut value).cast::<c_void>())
    })
}

/// `cuMemPoolSetAttribute` of an attribute whose value is an `int` (the reuse flags).
///
/// # Safety
/// 1. `pool` is a live pool of this process (made or imported here, not destroyed).
/// 2. `attr` takes an `int` (the `REUSE_*` flags).
pub(crate) unsafe fn set_attribute_int(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
    value: c_int,
) -> Result<()> {
    let mut value = value;
    // SAFETY: the caller guarantees (1) that `pool` is live and (2) that `attr` reads an int,
    // which `value`, a live local, is.
    check("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(pool, attr, (&raw mut value).cast::<c_void>())
    })
}

/// `cuMemPoolGetAttribute` of an attribute whose value is a `cuuint64_t`.
///
/// # Safety
/// 1. `pool` is a live pool of this process (made or imported here, not destroyed).
/// 2. `attr` writes a `cuuint64_t` (the threshold, the reserved and used figures).
pub(crate) unsafe fn get_attribute_u64(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
) -> Result<u64> {
    let mut value: u64 = 0;
    // SAFETY: the caller guarantees (1) that `pool` is live and (2) that `attr` writes a
    // cuuint64_t, for which `value`, a live local, is a valid place.
    check("cuMemPoolGetAttribute", unsafe {
        sys::cuMemPoolGetAttribute(pool, attr, (&raw mut value).cast::<c_void>())
    })?;
    Ok(value)
}

/// `cuMemPoolGetAttribute` of an attribute whose value is an `int` (the reuse flags).
///
/// # Safety
/// 1. `pool` is a live pool of this process (made or imported here, not destroyed).
/// 2. `attr` writes an `int` (the `REUSE_*` flags).
pub(crate) unsafe fn get_attribute_int(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
) -> Result<c_int> {
    let mut value: c_int = 0;
    // SAFETY: the caller guarantees (1) that `pool` is live and (2) that `attr` writes an int,
    // for which `value`, a live local, is a valid place.
    check("cuMemPoolGetAttribute", unsafe {
        sys::cuMemPoolGetAttribute(pool, attr, (&raw mut value).cast::<c_void>())
    })?;
    Ok(value)
}

/// `cuMemPoolTrimTo`.
///
/// # Safety
/// 1. `pool` is a live pool of this process (made or imported here, not destroyed).
pub(crate) unsafe fn trim_to(pool: sys::CUmemoryPool, keep: usize) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `pool` is live.
    check("cuMemPoolTrimTo", unsafe {
        sys::cuMemPoolTrimTo(pool, keep)
    })
}

/// `cuDeviceGetMemPool`: the pool stream-ordered allocations on `dev` come from.
pub(crate) fn current(dev: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a live local, a valid place for the one handle the driver writes;
    // `dev` is a value the driver checks.
    check("cuDeviceGetMemPool", unsafe {
        sys::cuDeviceGetMemPool(&raw mut pool, dev)
    })?;
    Ok(pool)
}

/// `cuDeviceGetDefaultMemPool`.
pub(crate) fn default(dev: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a live local, a valid place for the one handle the driver writes;
    // `dev` is a value the driver checks.
    check("cuDeviceGetDefaultMemPool", unsafe {
        sys::cuDeviceGetDefaultMemPool(&raw mut pool, dev)
    })?;
    Ok(pool)
}

/// `cuDeviceSetMemPool`.
///
/// # Safety
/// 1. `pool` is a live pool of this process (made or imported here, not destroyed), and stays
///    live while it is `dev`'s current pool.
pub(crate) unsafe fn set_current(dev: sys::CUdevice, pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `pool` is live; `dev` is a value the driver
    // checks.
    check("cuDeviceSetMemPool", unsafe {
        sys::cuDeviceSetMemPool(dev, pool)
    })
}

/// `cuMemPoolExportToShareableHandle` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a new
/// descriptor, owned from the moment the call returns it.
///
/// # Safety
/// 1. `pool` is a live pool of this process (made or imported here, not destroyed).
pub(crate) unsafe fn export_fd(pool: sys::CUmemoryPool) -> Result<OwnedFd> {
    const CALL: &str = "cuMemPoolExportToShareableHandle";
    let mut fd: c_int = -1;
    // SAFETY: the caller guarantees (1) that `pool` is live; for POSIX_FILE_DESCRIPTOR the
    // driver writes one int through the handle pointer, and `fd` is a live local int.
    check(CALL, unsafe {
        sys::cuMemPoolExportToShareableHandle(
            (&raw mut fd).cast(),
            pool,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    super::exported_fd(CALL, fd)
}

/// `cuMemPoolImportFromShareableHandle` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`. The
/// driver duplicates what it needs; the caller keeps `fd`.
pub(crate) fn import_fd(fd: BorrowedFd<'_>) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // The POSIX FD travels in the pointer-sized handle argument by value.
    let handle: *mut c_void = std::ptr::without_provenance_mut(fd.as_raw_fd() as usize);
    // SAFETY: `pool` is a live local, a valid place for the one handle the driver writes; the
    // handle argument is the FD by value (never dereferenced), open for the call's duration
    // (it is borrowed).
    check("cuMemPoolImportFromShareableHandle", unsafe {
        sys::cuMemPoolImportFromShareableHandle(
            &raw mut pool,
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    Ok(pool)
}

/// `cuMemPoolSetAccess` for one location.
///
/// # Safety
/// 1. `pool` is a live pool of this process (made or imported here, not destroyed).
pub(crate) unsafe fn set_access(
    pool: sys::CUmemoryPool,
    location: sys::CUmemLocation,
    flags: sys::CUmemAccess_flags,
) -> Result<()> {
    let desc = sys::CUmemAccessDesc { location, flags };
    // SAFETY: the caller guarantees (1) that `pool` is live; `desc` is one initialised
    // descriptor, a live local, and we pass a count of 1.
    check("cuMemPoolSetAccess", unsafe {
        sys::cuMemPoolSetAccess(pool, &raw const desc, 1)
    })
}

/// `cuMemPoolGetAccess` for one location.
///
/// # Safety
/// 1. `pool` is a live pool of this process (made or imported here, not destroyed).
pub(crate) unsafe fn get_access(
    pool: sys::CUmemoryPool,
    location: sys::CUmemLocation,
) -> Result<sys::CUmemAccess_flags> {
    let mut location = location;
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    // SAFETY: the caller guarantees (1) that `pool` is live; `flags` and `location` are live,
    // initialised locals of the types the driver writes and reads.
    check("cuMemPoolGetAccess", unsafe {
        sys::cuMemPoolGetAccess(&raw mut flags, pool, &raw mut location)
    })?;
    Ok(flags)
}
