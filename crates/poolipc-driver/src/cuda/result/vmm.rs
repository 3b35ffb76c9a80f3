//! Virtual memory management: `cuMemCreate`, `cuMemAddressReserve`, `cuMemMap` and the rest.
//!
//! An allocation handle (`CUmemGenericAllocationHandle`) is held to the same contract as the
//! other handles: every wrapper that takes one is an `unsafe fn` whose caller guarantees the
//! handle is one libcuda gave out in this process and is not released. Device addresses are
//! looked up by libcuda itself.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use cudarc::driver::sys;

use super::{check, device_location};
use crate::error::Result;

/// Pinned device memory at `location`, shareable as `handle_types`. Its one pointer (the
/// Windows handle metadata) is null.
fn prop(
    location: sys::CUmemLocation,
    handle_types: sys::CUmemAllocationHandleType,
) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handle_types,
        location,
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `cuMemGetAllocationGranularity` for pinned memory at `location` shareable as
/// `handle_types`.
pub(crate) fn granularity(
    location: sys::CUmemLocation,
    handle_types: sys::CUmemAllocationHandleType,
    option: sys::CUmemAllocationGranularity_flags,
) -> Result<usize> {
    let prop = prop(location, handle_types);
    let mut g: usize = 0;
    // SAFETY: `g` is a live local, a valid place for the one size_t the driver writes; `prop`
    // is an initialised live local whose one pointer is null.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&raw mut g, &raw const prop, option)
    })?;
    Ok(g)
}

/// `cuMemCreate` of `bytes` of pinned memory at `location`, shareable as `handle_types`
/// (`CU_MEM_HANDLE_TYPE_NONE`: not shareable).
pub(crate) fn create(
    bytes: usize,
    location: sys::CUmemLocation,
    handle_types: sys::CUmemAllocationHandleType,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let prop = prop(location, handle_types);
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `h` is a live local, a valid place for the one handle the driver writes; `prop`
    // is an initialised live local whose one pointer is null.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&raw mut h, bytes, &raw const prop, 0)
    })?;
    Ok(h)
}

/// `cuMemRetainAllocationHandle`: a new reference to the allocation mapped at `ptr`.
pub(crate) fn retain(ptr: sys::CUdeviceptr) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    let addr: *mut c_void = std::ptr::without_provenance_mut(ptr as usize);
    // SAFETY: `h` is a live local, a valid place for the one handle the driver writes; the
    // address is only a key for the driver, never dereferenced on the host.
    check("cuMemRetainAllocationHandle", unsafe {
        sys::cuMemRetainAllocationHandle(&raw mut h, addr)
    })?;
    Ok(h)
}

/// `cuMemGetAllocationPropertiesFromHandle`: the handle types the allocation was created
/// shareable as.
///
/// # Safety
/// 1. `handle` is a live allocation handle of this process (from [`create`], [`retain`] or
///    [`import_fd`], not released).
pub(crate) unsafe fn requested_handle_types(
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<sys::CUmemAllocationHandleType> {
    let mut prop = prop(
        device_location(0),
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
    );
    // SAFETY: the caller guarantees (1) that `handle` is live; `prop` is a live, initialised
    // CUmemAllocationProp the driver overwrites.
    check("cuMemGetAllocationPropertiesFromHandle", unsafe {
        sys::cuMemGetAllocationPropertiesFromHandle(&raw mut prop, handle)
    })?;
    Ok(prop.requestedHandleTypes)
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor: a new descriptor, owned from
/// the moment the call returns it.
///
/// # Safety
/// 1. `handle` is a live allocation handle of this process (from [`create`], [`retain`] or
///    [`import_fd`], not released).
pub(crate) unsafe fn export_fd(handle: sys::CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    const CALL: &str = "cuMemExportToShareableHandle";
    let mut fd: c_int = -1;
    // SAFETY: the caller guarantees (1) that `handle` is live; for POSIX_FILE_DESCRIPTOR the
    // driver writes one int through the pointer, and `fd` is a live local int.
    check(CALL, unsafe {
        sys::cuMemExportToShareableHandle(
            (&raw mut fd).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    super::exported_fd(CALL, fd)
}

/// `cuMemImportFromShareableHandle` of a POSIX file descriptor. The caller keeps `fd`.
pub(crate) fn import_fd(fd: BorrowedFd<'_>) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // The POSIX FD travels in the pointer-sized handle argument by value.
    let handle: *mut c_void = std::ptr::without_provenance_mut(fd.as_raw_fd() as usize);
    // SAFETY: `h` is a live local, a valid place for the one handle the driver writes; the
    // handle argument is the FD by value (never dereferenced), open for the call's duration
    // (it is borrowed).
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &raw mut h,
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(h)
}

/// `cuMemAddressReserve` of `bytes` at an address aligned to `alignment` (0: the default).
pub(crate) fn address_reserve(bytes: usize, alignment: usize) -> Result<sys::CUdeviceptr> {
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: `p` is a live local, a valid place for the one address the driver writes.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&raw mut p, bytes, alignment, 0, 0)
    })?;
    Ok(p)
}

/// `cuMemMap` of the whole of `handle` at `ptr`.
///
/// # Safety
/// 1. `handle` is a live allocation handle of this process (from [`create`], [`retain`] or
///    [`import_fd`], not released).
pub(crate) unsafe fn map(
    ptr: sys::CUdeviceptr,
    bytes: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<()> {
    // SAFETY: the caller guarantees (1) that `handle` is live; `ptr` is a device address,
    // which libcuda looks up in its reservations itself.
    check("cuMemMap", unsafe {
        sys::cuMemMap(ptr, bytes, 0, handle, 0)
    })
}

/// `cuMemSetAccess` of the mapped range `ptr..ptr + bytes` for one location.
pub(crate) fn set_access(
    ptr: sys::CUdeviceptr,
    bytes: usize,
    location: sys::CUmemLocation,
    flags: sys::CUmemAccess_flags,
) -> Result<()> {
    let desc = sys::CUmemAccessDesc { location, flags };
    // SAFETY: `desc` is one initialised descriptor, a live local, and we pass a count of 1;
    // `ptr` is a device address, which libcuda looks up in its mappings itself.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, bytes, &raw const desc, 1)
    })
}

/// `cuMemUnmap`.
///
/// # Safety
/// 1. `ptr..ptr + bytes` is a mapping [`map`] made in this process, not unmapped yet.
/// 2. Nothing (no queued work either) uses the range after this call.
pub(crate) unsafe fn unmap(ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: the caller guarantees (1) that the range is a live mapping and (2) that nothing
    // uses it after.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, bytes) })
}

/// `cuMemAddressFree`.
///
/// # Safety
/// 1. `ptr..ptr + bytes` is a range [`address_reserve`] gave out in this process, not freed
///    yet, with nothing mapped in it any more.
/// 2. Nothing uses the range after this call.
pub(crate) unsafe fn address_free(ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: the caller guarantees (1) that the range is a live, unmapped reservation and
    // (2) that nothing uses it after.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(ptr, bytes)
    })
}

/// `cuMemRelease` of one reference to an allocation (the memory lives on while mapped).
///
/// # Safety
/// 1. `handle` came from [`create`], [`retain`] or [`import_fd`] in this process, and this
///    reference is not released yet.
/// 2. Nothing uses `handle` after this call.
pub(crate) unsafe fn release(handle: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller guarantees (1) that the reference is live and (2) that it is not
    // used after.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}
