//! Virtual memory management: `cuMemCreate`, handles exported and imported as memfds,
//! reservations, mappings and their access, and their release.

use std::os::fd::{BorrowedFd, OwnedFd};

use crate::error::{CuCode, DriverError, Result};
use crate::sim::local::{VmmAlloc, VmmMap};
use crate::sim::shm::process_alive;
use crate::sim::shm::{self, Mapping, sparse_memfd};
use crate::sim::state::GRANULE;
use crate::sim::{SimDriver, fail};
use crate::types::{Access, DevicePtr, VmmHandle};

/// The (device, inode) of the file behind `fd`: what names a VMM allocation across processes.
fn file_of(fd: &impl std::os::fd::AsFd) -> Result<(u64, u64)> {
    let st = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| shm::os("fstat", e))?;
    Ok((st.st_dev, st.st_ino))
}

/// `cuMemGetAllocationGranularity`: 2 MiB, whichever is asked.
pub(super) fn granularity(d: &SimDriver, ordinal: u32) -> Result<u64> {
    d.device_check("cuMemGetAllocationGranularity", ordinal)?;
    Ok(GRANULE)
}

/// `cuMemCreate`, shareable by POSIX FD.
pub(super) fn create(d: &SimDriver, ordinal: u32, bytes: u64) -> Result<VmmHandle> {
    d.create_vmm(ordinal, bytes, true)
}

/// `cuMemCreate` with no shareable handle type.
pub(super) fn create_unshared(d: &SimDriver, ordinal: u32, bytes: u64) -> Result<VmmHandle> {
    d.create_vmm(ordinal, bytes, false)
}

/// `cuMemRetainAllocationHandle` of a VMM mapping (not `cuMemAlloc` memory).
pub(super) fn retain(d: &SimDriver, ptr: DevicePtr) -> Result<VmmHandle> {
    const CALL: &str = "cuMemRetainAllocationHandle";
    let mut l = d.local();
    let p = ptr.0;
    let Some((_, m)) = l
        .maps
        .range(..=p)
        .next_back()
        .filter(|(base, m)| p < **base + m.bytes && !m.plain)
    else {
        // Pool memory, cuMemAlloc memory, nothing: INVALID_VALUE, as on the H200.
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    };
    let fd = m.fd.try_clone().map_err(|source| DriverError::Os {
        call: "dup",
        source,
    })?;
    let alloc = VmmAlloc {
        fd,
        bytes: m.bytes,
        device: m.device,
        exportable: m.exportable,
    };
    // A retained handle holds the memory as any handle does.
    let file = m.file;
    let pid = d.pid;
    d.machine.with(|st| st.vmm_hold(file, pid, true));
    l.next_handle += 1;
    let h = l.next_handle;
    l.vmm.insert(h, alloc);
    Ok(VmmHandle(h))
}

/// `cuMemGetAllocationPropertiesFromHandle`: whether the handle exports as an FD.
pub(super) fn exports_fd(d: &SimDriver, handle: VmmHandle) -> Result<bool> {
    d.local()
        .vmm
        .get(&handle.0)
        .map(|v| v.exportable)
        .ok_or(fail(
            "cuMemGetAllocationPropertiesFromHandle",
            CuCode::INVALID_VALUE,
        ))
}

/// `cuMemExportToShareableHandle`: the allocation's memfd, duplicated.
pub(super) fn export_fd(d: &SimDriver, handle: VmmHandle) -> Result<OwnedFd> {
    const CALL: &str = "cuMemExportToShareableHandle";
    let l = d.local();
    let v = l
        .vmm
        .get(&handle.0)
        .ok_or(fail(CALL, CuCode::INVALID_VALUE))?;
    if !v.exportable {
        // Made without the POSIX FD handle type.
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    v.fd.try_clone().map_err(|source| DriverError::Os {
        call: "dup",
        source,
    })
}

/// `cuMemImportFromShareableHandle` of a memfd.
pub(super) fn import_fd(d: &SimDriver, fd: BorrowedFd<'_>) -> Result<VmmHandle> {
    const CALL: &str = "cuMemImportFromShareableHandle";
    let st = nix::sys::stat::fstat(fd).map_err(|_| fail(CALL, CuCode::INVALID_VALUE))?;
    let bytes = u64::try_from(st.st_size).map_err(|_| fail(CALL, CuCode::INVALID_VALUE))?;
    if bytes == 0 || bytes % GRANULE != 0 {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    let own = fd.try_clone_to_owned().map_err(|source| DriverError::Os {
        call: "dup",
        source,
    })?;
    let file = (st.st_dev, st.st_ino);
    let pid = d.pid;
    let mut l = d.local();
    let device = SimDriver::context(&l, CALL)?;
    d.machine.with(|s| s.vmm_hold(file, pid, true));
    l.next_handle += 1;
    let h = l.next_handle;
    l.vmm.insert(
        h,
        VmmAlloc {
            fd: own,
            bytes,
            device,
            exportable: true,
        },
    );
    Ok(VmmHandle(h))
}

/// `cuMemAddressReserve`.
pub(super) fn reserve(d: &SimDriver, bytes: u64, alignment: u64) -> Result<DevicePtr> {
    const CALL: &str = "cuMemAddressReserve";
    if bytes == 0
        || !bytes.is_multiple_of(GRANULE)
        || (alignment != 0 && !alignment.is_power_of_two())
    {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    let mut l = d.local();
    let start = l.next_va.next_multiple_of(alignment.max(GRANULE));
    l.next_va = start + bytes;
    l.reservations.insert(start, bytes);
    Ok(DevicePtr(start))
}

/// `cuMemMap` of a whole handle inside a reservation.
pub(super) fn map(d: &SimDriver, ptr: DevicePtr, bytes: u64, handle: VmmHandle) -> Result<()> {
    const CALL: &str = "cuMemMap";
    let mut l = d.local();
    let v = l
        .vmm
        .get(&handle.0)
        .ok_or(fail(CALL, CuCode::INVALID_VALUE))?;
    if bytes != v.bytes {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    let end = ptr
        .0
        .checked_add(bytes)
        .ok_or(fail(CALL, CuCode::INVALID_VALUE))?;
    let reserved = l
        .reservations
        .range(..=ptr.0)
        .next_back()
        .is_some_and(|(&s, &n)| end <= s + n);
    if !reserved {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    if l.maps
        .range(..end)
        .next_back()
        .is_some_and(|(&s, m)| s + m.bytes > ptr.0)
    {
        return Err(fail(CALL, CuCode::ALREADY_MAPPED));
    }
    let map = Mapping::new(&v.fd, 0, bytes)?;
    let st = nix::sys::stat::fstat(&v.fd).map_err(|e| shm::os("fstat", e))?;
    let file = (st.st_dev, st.st_ino);
    let fd = v.fd.try_clone().map_err(|source| DriverError::Os {
        call: "dup",
        source,
    })?;
    let (device, exportable) = (v.device, v.exportable);
    // A mapping holds the memory as a handle does, until it is unmapped.
    let pid = d.pid;
    d.machine.with(|s| s.vmm_hold(file, pid, true));
    let buffer_id = l.new_buffer_id();
    l.maps.insert(
        ptr.0,
        VmmMap {
            map,
            bytes,
            access: Access::None,
            buffer_id,
            file,
            fd,
            device,
            exportable,
            plain: false,
        },
    );
    Ok(())
}

/// `cuMemSetAccess` of mapped ranges.
pub(super) fn set_access(
    d: &SimDriver,
    ptr: DevicePtr,
    bytes: u64,
    ordinal: u32,
    access: Access,
) -> Result<()> {
    const CALL: &str = "cuMemSetAccess";
    d.device_check(CALL, ordinal)?;
    let mut l = d.local();
    let end = ptr.0.saturating_add(bytes);
    let mut covered = ptr.0;
    for (&s, m) in l.maps.range_mut(ptr.0..end) {
        if s != covered {
            break;
        }
        m.access = access;
        covered = s + m.bytes;
    }
    if covered < end || bytes == 0 {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    Ok(())
}

impl SimDriver {
    /// `cuMemUnmap`, for the trait and for `cuMemFree_v2` of plain memory.
    pub(crate) fn vmm_unmap_checked(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        const CALL: &str = "cuMemUnmap";
        let mut l = self.local();
        let end = ptr.0.saturating_add(bytes);
        let starts: Vec<u64> = l.maps.range(ptr.0..end).map(|(&s, _)| s).collect();
        if starts.first() != Some(&ptr.0) {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        let mut files = Vec::with_capacity(starts.len());
        for s in starts {
            if let Some(m) = l.maps.remove(&s) {
                files.push(m.file);
            }
        }
        drop(l);
        let pid = self.pid;
        self.machine.with(|st| {
            for file in files {
                st.vmm_hold(file, pid, false);
            }
            st.vmm_sweep(process_alive);
        });
        Ok(())
    }

    /// `cuMemAddressFree`.
    pub(crate) fn vmm_address_free_checked(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        const CALL: &str = "cuMemAddressFree";
        let mut l = self.local();
        if l.reservations.get(&ptr.0) != Some(&bytes) {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        if l.maps.range(ptr.0..ptr.0 + bytes).next().is_some() {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        l.reservations.remove(&ptr.0);
        Ok(())
    }

    /// `cuMemRelease`.
    pub(crate) fn vmm_release_checked(&self, handle: VmmHandle) -> Result<()> {
        let v = self
            .local()
            .vmm
            .remove(&handle.0)
            .ok_or(fail("cuMemRelease", CuCode::INVALID_VALUE))?;
        // The memory goes back when no live process holds a handle or a mapping (the real
        // driver defers the release until the last unmap, in any process).
        let file = file_of(&v.fd)?;
        let pid = self.pid;
        self.machine.with(|st| {
            st.vmm_hold(file, pid, false);
            st.vmm_sweep(process_alive);
        });
        Ok(())
    }

    /// `cuMemCreate`, with or without the POSIX FD handle type.
    pub(super) fn create_vmm(
        &self,
        ordinal: u32,
        bytes: u64,
        exportable: bool,
    ) -> Result<VmmHandle> {
        const CALL: &str = "cuMemCreate";
        let ordinal = self.device_check(CALL, ordinal)?;
        if bytes == 0 || !bytes.is_multiple_of(GRANULE) {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        self.machine.with(|st| {
            let d = &mut st.devices[ordinal as usize];
            if d.reserved.saturating_add(bytes) > d.total {
                return Err(fail(CALL, CuCode::OUT_OF_MEMORY));
            }
            d.reserved += bytes;
            Ok(())
        })?;
        // The memory counts against the device until no live process holds a handle to it
        // or maps it (the machine's VMM table, by the file behind it).
        let made = sparse_memfd("poolipc-sim-vmm", bytes).and_then(|fd| {
            let file = file_of(&fd)?;
            let pid = self.pid;
            if self
                .machine
                .with(|st| st.vmm_create(ordinal, bytes, file, pid))
            {
                Ok(fd)
            } else {
                Err(fail(CALL, CuCode::OUT_OF_MEMORY))
            }
        });
        let fd = match made {
            Ok(fd) => fd,
            Err(e) => {
                self.machine
                    .with(|st| st.devices[ordinal as usize].reserved -= bytes);
                return Err(e);
            }
        };
        let mut l = self.local();
        l.next_handle += 1;
        let h = l.next_handle;
        l.vmm.insert(
            h,
            VmmAlloc {
                fd,
                bytes,
                device: ordinal,
                exportable,
            },
        );
        Ok(VmmHandle(h))
    }
}
