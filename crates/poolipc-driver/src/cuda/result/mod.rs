//! The result layer: one thin function per libcuda call (or tight group of calls), over
//! cudarc's `driver::sys`, turning its `CUresult` into [`Result`] with the call's name in the
//! error. Nothing above this layer calls `sys` for a driver call; nothing here knows the
//! [`Driver`](crate::Driver) trait or its handle types.
//!
//! # Safe and unsafe wrappers
//!
//! A wrapper whose arguments are values libcuda validates (ordinals, flags, sizes, device
//! addresses, file descriptors borrowed for the call) is a safe `fn`: the places libcuda writes
//! its answers into are the wrapper's own locals, and a device address is looked up in
//! libcuda's own tables (a wrong one is an error or a fault on the device, never an access to
//! host memory).
//!
//! A wrapper that passes a host-side handle (a pool, a stream, an event, a VMM allocation
//! handle, a context, a module, a function: the address of libcuda's object in this process,
//! which libcuda dereferences without checking) or host memory is an `unsafe fn`, with a
//! numbered `# Safety` section saying what its caller guarantees. The trait impl above meets
//! those conditions through the handle contract (see the [parent module](super)).

pub(crate) mod device;
pub(crate) mod event;
pub(crate) mod memory;
pub(crate) mod module;
pub(crate) mod pointer;
pub(crate) mod pool;
pub(crate) mod stream;
pub(crate) mod vmm;

use std::ffi::c_int;
use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys;
use nix::fcntl::{FcntlArg, FdFlag, fcntl};

use crate::error::{CuCode, DriverError, Result};

/// `r` as a [`Result`]: `Ok` on `CUDA_SUCCESS`, else the call's name and its code.
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverError::Call {
            call,
            code: CuCode(r as u32),
        })
    }
}

/// The descriptor `fd` a shareable-handle export (`call`) just returned, owned, and marked
/// close-on-exec.
///
/// Without `FD_CLOEXEC` every process the parent starts afterwards (a worker, or anything torch or ComfyUI
/// runs) would inherit a copy it never learns of, and a pool or VMM allocation keeps its
/// memory while any descriptor of it is open, so memory given back by the parent and its
/// workers would stay held until that process exits.
pub(crate) fn exported_fd(call: &'static str, fd: c_int) -> Result<OwnedFd> {
    if fd < 0 {
        return Err(DriverError::Call {
            call,
            code: CuCode::UNKNOWN,
        });
    }
    // SAFETY: the driver just created this descriptor for us; we are its only owner.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let os = |call| {
        move |e: nix::Error| DriverError::Os {
            call,
            source: std::io::Error::from(e),
        }
    };
    let flags =
        FdFlag::from_bits_truncate(fcntl(&owned, FcntlArg::F_GETFD).map_err(os("fcntl(F_GETFD)"))?);
    if !flags.contains(FdFlag::FD_CLOEXEC) {
        fcntl(&owned, FcntlArg::F_SETFD(flags | FdFlag::FD_CLOEXEC))
            .map_err(os("fcntl(F_SETFD, FD_CLOEXEC)"))?;
        tracing::debug!(
            call,
            "marked the driver's exported descriptor close-on-exec"
        );
    }
    Ok(owned)
}

/// The location of device `ordinal`, as pools and VMM allocations name it.
pub(crate) fn device_location(ordinal: u32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as c_int,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_results_map_to_named_codes() {
        let e = check(
            "cuMemPoolExportPointer",
            sys::CUresult::CUDA_ERROR_INVALID_VALUE,
        )
        .unwrap_err();
        assert!(e.is_call("cuMemPoolExportPointer", CuCode::INVALID_VALUE));
        let e = check("cuEventQuery", sys::CUresult::CUDA_ERROR_NOT_READY).unwrap_err();
        assert_eq!(e.code(), Some(CuCode::NOT_READY));
        assert!(check("cuInit", sys::CUresult::CUDA_SUCCESS).is_ok());
    }
}
