//! Loading libcuda: what is checked before the driver is trusted, and in which order.

use cudarc::driver::sys;

use super::result;
use crate::error::{CuCode, DriverError, Result};
use crate::{MIN_DRIVER_VERSION, platform};

/// Every libcuda symbol `CudaDriver` calls. Checked once by [`load`], because
/// cudarc's loader panics on a missing symbol at first use, and we promise an error instead.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetUuid_v2",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemGetInfo_v2",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
    "cuMemPoolTrimTo",
    "cuDeviceGetMemPool",
    "cuDeviceGetDefaultMemPool",
    "cuDeviceSetMemPool",
    "cuMemPoolExportToShareableHandle",
    "cuMemPoolImportFromShareableHandle",
    "cuMemPoolSetAccess",
    "cuMemPoolGetAccess",
    "cuPointerGetAttribute",
    "cuPointerGetAttributes",
    "cuMemGetAddressRange_v2",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuMemPoolExportPointer",
    "cuMemPoolImportPointer",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamWaitEvent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuMemsetD8Async",
    "cuMemsetD32Async",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemAddressFree",
    "cuMemRelease",
    "cuCtxGetCurrent",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

/// Loads libcuda and initialises the driver API: refuses WSL2 and a missing library before
/// touching libcuda, checks every symbol in [`SYMBOLS`] is there, runs `cuInit`, then refuses
/// a driver older than [`MIN_DRIVER_VERSION`].
pub(super) fn load() -> Result<()> {
    Preflight {
        wsl2: platform::is_wsl2(),
        library_present: library_present(),
    }
    .check()?;
    for &symbol in SYMBOLS {
        // SAFETY: `culib()` cannot panic here because `is_culib_present` just found a
        // library; we look the symbol up without calling it.
        let found = unsafe { sys::culib().get::<unsafe extern "C" fn()>(symbol.as_bytes()) };
        if found.is_err() {
            return Err(DriverError::MissingSymbol { symbol });
        }
    }
    match result::device::init() {
        Err(DriverError::Call {
            code: CuCode::NO_DEVICE,
            ..
        }) => {
            return Err(DriverError::NoDevice);
        }
        other => other?,
    }
    version_check(result::device::driver_version()?)
}

/// Whether libcuda can be loaded at all (no initialisation, no device query).
pub(super) fn library_present() -> bool {
    // SAFETY: only tries to dlopen candidate names; no symbol is called.
    unsafe { sys::is_culib_present() }
}

/// What [`load`] found out before it trusted libcuda, in the order it asks.
#[derive(Debug, Clone, Copy)]
struct Preflight {
    wsl2: bool,
    library_present: bool,
}

impl Preflight {
    fn check(self) -> Result<()> {
        if self.wsl2 {
            return Err(DriverError::Wsl2);
        }
        if !self.library_present {
            return Err(DriverError::LibraryNotFound {
                searched: "libcuda.so, libcuda.so.1 and cudarc's other candidates".into(),
            });
        }
        Ok(())
    }
}

fn version_check(found: i32) -> Result<()> {
    if found < MIN_DRIVER_VERSION {
        return Err(DriverError::DriverTooOld {
            found,
            required: MIN_DRIVER_VERSION,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wsl2_is_refused_before_libcuda_is_touched() {
        let e = Preflight {
            wsl2: true,
            library_present: true,
        }
        .check()
        .unwrap_err();
        assert!(matches!(e, DriverError::Wsl2), "{e}");
    }

    #[test]
    fn a_missing_libcuda_is_an_error_not_a_panic() {
        let e = Preflight {
            wsl2: false,
            library_present: false,
        }
        .check()
        .unwrap_err();
        assert!(matches!(e, DriverError::LibraryNotFound { .. }), "{e}");
        assert!(e.to_string().contains("NVIDIA driver"));
    }

    #[test]
    fn an_old_driver_is_refused_with_both_versions() {
        let e = version_check(11080).unwrap_err();
        assert!(matches!(
            e,
            DriverError::DriverTooOld {
                found: 11080,
                required: 12000
            }
        ));
        assert!(version_check(12000).is_ok());
        assert!(version_check(13000).is_ok());
    }

    #[test]
    fn every_symbol_is_listed_once() {
        let mut seen = std::collections::HashSet::new();
        for s in SYMBOLS {
            assert!(seen.insert(s), "{s} listed twice");
        }
    }
}
