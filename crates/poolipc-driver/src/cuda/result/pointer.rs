//! What libcuda knows of a device address: `cuPointerGetAttribute(s)`,
//! `cuMemGetAddressRange`, and a pool allocation's export and import
//! (`cuMemPoolExportPointer`, `cuMemPoolImportPointer`).
//!
//! A device address is looked up in libcuda's own tables: the queries are safe. The import
//! takes a pool handle, so it is an `unsafe fn`.

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};

use cudarc::driver::sys;

use super::check;
use crate::error::Result;

/// The attributes [`attributes`] asks for, as the driver wrote them (zeros for a pointer it
/// does not know).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attributes {
    /// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`.
    pub(crate) base: sys::CUdeviceptr,
    /// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`.
    pub(crate) size: usize,
    /// `CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE` (null when not pool memory).
    pub(crate) pool: sys::CUmemoryPool,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`.
    pub(crate) buffer_id: u64,
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`, a `CUmemorytype`.
    pub(crate) memory_type: c_uint,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (-1 where the driver wrote none).
    pub(crate) ordinal: c_int,
}

/// `cuPointerGetAttributes` of range start and size, memory pool, buffer id, memory type and
/// device ordinal, in one call.
pub(crate) fn attributes(ptr: sys::CUdeviceptr) -> Result<Attributes> {
    use sys::CUpointer_attribute as A;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut buffer_id: u64 = 0;
    let mut memory_type: c_uint = 0;
    let mut ordinal: c_int = -1;
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        A::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
        A::CU_POINTER_ATTRIBUTE_BUFFER_ID,
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    ];
    let mut data: [*mut c_void; 6] = [
        (&raw mut base).cast(),
        (&raw mut size).cast(),
        (&raw mut pool).cast(),
        (&raw mut buffer_id).cast(),
        (&raw mut memory_type).cast(),
        (&raw mut ordinal).cast(),
    ];
    // SAFETY: six attributes, six pointers, each to a live local of the type its attribute
    // writes (CUdeviceptr, size_t, CUmemoryPool, unsigned long long, CUmemorytype as unsigned
    // int, int); `ptr` is a device address the driver looks up itself.
    check("cuPointerGetAttributes", unsafe {
        sys::cuPointerGetAttributes(6, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr)
    })?;
    Ok(Attributes {
        base,
        size,
        pool,
        buffer_id,
        memory_type,
        ordinal,
    })
}

/// `cuPointerGetAttribute(attr)`, written into `value` (which starts as given).
///
/// # Safety
/// 1. `T` is the type `attr` writes.
unsafe fn attribute<T>(
    ptr: sys::CUdeviceptr,
    attr: sys::CUpointer_attribute,
    mut value: T,
) -> Result<T> {
    // SAFETY: the caller guarantees (1) that `attr` writes a `T`, and `value` is a live local
    // `T`; `ptr` is a device address the driver looks up itself.
    check("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute((&raw mut value).cast(), attr, ptr)
    })?;
    Ok(value)
}

/// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)`, a `CUmemorytype`.
pub(crate) fn memory_type(ptr: sys::CUdeviceptr) -> Result<c_uint> {
    // SAFETY: MEMORY_TYPE writes one CUmemorytype, an unsigned int (1).
    unsafe {
        attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            0 as c_uint,
        )
    }
}

/// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)`.
pub(crate) fn device_ordinal(ptr: sys::CUdeviceptr) -> Result<c_int> {
    // SAFETY: DEVICE_ORDINAL writes one int (1).
    unsafe {
        attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            -1 as c_int,
        )
    }
}

/// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)`.
pub(crate) fn mempool(ptr: sys::CUdeviceptr) -> Result<sys::CUmemoryPool> {
    // SAFETY: MEMPOOL_HANDLE writes one CUmemoryPool (1).
    unsafe {
        attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            std::ptr::null_mut(),
        )
    }
}

/// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_BUFFER_ID)`.
pub(crate) fn buffer_id(ptr: sys::CUdeviceptr) -> Result<c_ulonglong> {
    // SAFETY: BUFFER_ID writes one unsigned long long (1).
    unsafe {
        attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
            0 as c_ulonglong,
        )
    }
}

/// `cuMemGetAddressRange_v2`: the allocation `ptr` lies in, as (base, size).
pub(crate) fn address_range(ptr: sys::CUdeviceptr) -> Result<(sys::CUdeviceptr, usize)> {
    let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: both are live locals, valid places for what the driver writes; `ptr` is a
    // device address the driver looks up itself.
    check("cuMemGetAddressRange_v2", unsafe {
        sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut len, ptr)
    })?;
    Ok((base, len))
}

/// `cuMemPoolExportPointer`: the 64 bytes another process imports the allocation with.
pub(crate) fn export(ptr: sys::CUdeviceptr) -> Result<sys::CUmemPoolPtrExportData> {
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
    // SAFETY: `data` is a live local, the 64 bytes the driver writes; `ptr` is a device
    // address the driver looks up itself.
    check("cuMemPoolExportPointer", unsafe {
        sys::cuMemPoolExportPointer(&raw mut data, ptr)
    })?;
    Ok(data)
}

/// `cuMemPoolImportPointer`: maps the allocation `data` names into this process.
///
/// # Safety
/// 1. `pool` is a live pool of this process (imported here, not destroyed).
pub(crate) unsafe fn import(
    pool: sys::CUmemoryPool,
    data: sys::CUmemPoolPtrExportData,
) -> Result<sys::CUdeviceptr> {
    let mut share = data;
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: the caller guarantees (1) that `pool` is live; `p` is a live local, a valid
    // place for the address the driver writes; `share` is a live local holding the 64 bytes
    // the exporter produced (the driver reads them).
    check("cuMemPoolImportPointer", unsafe {
        sys::cuMemPoolImportPointer(&raw mut p, pool, &raw mut share)
    })?;
    Ok(p)
}
