//! `CudaDriver`: the [`Driver`] trait on libcuda, through cudarc's `driver::sys` with dynamic
//! loading. Driver API only.
//!
//! # Handles, and what the safety comments rest on
//!
//! A [`PoolHandle`], [`StreamHandle`], [`EventHandle`] or [`VmmHandle`] carries what libcuda
//! gave out, for the host-side ones the address of its object in this process, which libcuda
//! dereferences without checking. The handle types make passing one sound (*the handle
//! contract*): a handle is made by this driver, or by `from_raw`, whose caller vouches that
//! it is live; destroying one is an `unsafe fn` whose caller promises it is not used after,
//! and safe code destroys only through the owning types (`OwnedPool`, ...), which hand the
//! handle out while they live. A device address ([`DevicePtr`]) is different: libcuda looks
//! it up in its own tables, and a wrong one is an error or a fault on the device, never an
//! access to host memory.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use cudarc::driver::sys;

use crate::api::Driver;
use crate::error::{CuCode, DriverError, Result};
use crate::types::{
    Access, DeviceInfo, DevicePtr, DeviceUuid, DriverKind, EventBlob, EventHandle, ExportBlob,
    Granularity, PointerInfo, PoolAttribute, PoolCounter, PoolHandle, PoolSharing, StreamHandle,
    VmmHandle,
};
use crate::{MIN_DRIVER_VERSION, platform};

/// Every libcuda symbol `CudaDriver` calls. Checked once at [`CudaDriver::new`], because
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

/// The kernel of [`Driver::launch_store_kernel`], as PTX the driver compiles for the device
/// (no nvrtc, no toolkit): one thread stores a 32-bit value through a pointer.
const STORE_KERNEL_PTX: &[u8] = b".version 7.0
.target sm_50
.address_size 64
.visible .entry poolipc_store(.param .u64 p, .param .u32 v)
{
  .reg .u64 %rd<2>;
  .reg .u32 %r<2>;
  ld.param.u64 %rd1, [p];
  ld.param.u32 %r1, [v];
  st.global.u32 [%rd1], %r1;
  ret;
}
\0";

/// The kernel of [`Driver::launch_hang_kernel`]: one thread spins while the clock reads
/// nonzero, for ever (the clock is a special register: the compiler can neither hoist the
/// read nor prove that the loop ends). In a module of its own (a fault in it leaves
/// the store kernel's loading alone).
const HANG_KERNEL_PTX: &[u8] = b".version 7.0
.target sm_50
.address_size 64
.visible .entry poolipc_hang()
{
  .reg .u64 %rd<2>;
  .reg .pred %p<2>;
$spin:
  mov.u64 %rd1, %clock64;
  setp.ne.u64 %p1, %rd1, 0;
  @%p1 bra $spin;
  ret;
}
\0";

fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverError::Call {
            call,
            code: CuCode(r as u32),
        })
    }
}

fn size(call: &'static str, bytes: u64) -> Result<usize> {
    usize::try_from(bytes).map_err(|_| DriverError::InvalidArgument {
        call,
        reason: format!("{bytes} bytes does not fit in usize"),
    })
}

fn pool_raw(pool: PoolHandle) -> sys::CUmemoryPool {
    std::ptr::with_exposed_provenance_mut(pool.0 as usize)
}

fn pool_handle(pool: sys::CUmemoryPool) -> PoolHandle {
    PoolHandle(pool.expose_provenance() as u64)
}

fn stream_raw(stream: StreamHandle) -> sys::CUstream {
    std::ptr::with_exposed_provenance_mut(stream.0 as usize)
}

fn event_raw(event: EventHandle) -> sys::CUevent {
    std::ptr::with_exposed_provenance_mut(event.0 as usize)
}

fn device_location(ordinal: u32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as c_int,
    }
}

fn access_flags(access: Access) -> sys::CUmemAccess_flags {
    match access {
        Access::None => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
        Access::Read => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

fn vmm_prop(ordinal: u32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: device_location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// What [`CudaDriver::new`] found out before it trusted libcuda, in the order it asks.
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

/// A primary context this driver retained, kept as an address so the map is `Send`.
#[derive(Debug, Clone, Copy)]
struct Retained {
    device: sys::CUdevice,
    context: usize,
}

/// The real CUDA driver: libcuda loaded at run time, driver API only.
///
/// [`CudaDriver::new`] fails with a clear [`DriverError`] (never a panic) when libcuda is
/// missing or lacks a symbol, when there is no device, under WSL2, or when the driver is
/// older than [`MIN_DRIVER_VERSION`].
#[derive(Debug)]
pub struct CudaDriver {
    retained: Mutex<HashMap<u32, Retained>>,
    /// The test kernels' functions, by the context they were loaded in (its address) and
    /// their name.
    store_kernels: Mutex<HashMap<(usize, &'static std::ffi::CStr), usize>>,
}

impl CudaDriver {
    /// Load libcuda, check it, and initialise the driver API.
    pub fn new() -> Result<CudaDriver> {
        Preflight {
            wsl2: platform::is_wsl2(),
            // SAFETY: only tries to dlopen candidate names; no symbol is called.
            library_present: unsafe { sys::is_culib_present() },
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
        // SAFETY: plain driver call with a valid flag value.
        let r = unsafe { sys::cuInit(0) };
        match check("cuInit", r) {
            Err(DriverError::Call {
                code: CuCode::NO_DEVICE,
                ..
            }) => {
                return Err(DriverError::NoDevice);
            }
            other => other?,
        }
        let mut version: c_int = 0;
        // SAFETY: `version` is a valid place for the driver to write.
        check("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&raw mut version)
        })?;
        version_check(version)?;
        let driver = CudaDriver {
            retained: Mutex::new(HashMap::new()),
            store_kernels: Mutex::new(HashMap::new()),
        };
        if driver.device_count()? == 0 {
            return Err(DriverError::NoDevice);
        }
        Ok(driver)
    }

    /// Whether libcuda can be loaded at all (no initialisation, no device query).
    #[must_use]
    pub fn library_present() -> bool {
        // SAFETY: only tries to dlopen candidate names.
        unsafe { sys::is_culib_present() }
    }

    /// The kernel `name` of the PTX `image` in the current context, loaded the first time.
    fn kernel(
        &self,
        image: &'static [u8],
        name: &'static std::ffi::CStr,
    ) -> Result<sys::CUfunction> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid place to write.
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&raw mut ctx)
        })?;
        let mut kernels = self
            .store_kernels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (ctx.expose_provenance(), name);
        if let Some(&f) = kernels.get(&key) {
            return Ok(std::ptr::with_exposed_provenance_mut(f));
        }
        if image.last() != Some(&0) {
            return Err(DriverError::InvalidArgument {
                call: "cuModuleLoadData",
                reason: "the PTX image is not NUL-terminated".into(),
            });
        }
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: the image is NUL-terminated (checked above) PTX text, static;
        // `module` is a valid place to write. The module stays loaded while the context lives.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&raw mut module, image.as_ptr().cast())
        })?;
        let mut function: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: `module` was just loaded; the name is NUL-terminated; `function` is a
        // valid place to write.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&raw mut function, module, name.as_ptr())
        })?;
        kernels.insert(key, function.expose_provenance());
        Ok(function)
    }

    fn device(&self, ordinal: u32) -> Result<sys::CUdevice> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(DriverError::DeviceOutOfRange { ordinal, count });
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: `dev` is a valid place to write; the ordinal was checked.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&raw mut dev, ordinal as c_int)
        })?;
        Ok(dev)
    }

    fn attribute(&self, dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid place to write; `dev` came from cuDeviceGet.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(&raw mut v, attr, dev)
        })?;
        Ok(v)
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        let retained = match self.retained.get_mut() {
            Ok(map) => std::mem::take(map),
            Err(poisoned) => std::mem::take(poisoned.into_inner()),
        };
        for (ordinal, r) in retained {
            // SAFETY: we retained this primary context once in `use_device`.
            let res = check("cuDevicePrimaryCtxRelease_v2", unsafe {
                sys::cuDevicePrimaryCtxRelease_v2(r.device)
            });
            if let Err(e) = res {
                tracing::warn!(ordinal, error = %e, "releasing the primary context failed");
            }
        }
    }
}

impl Driver for CudaDriver {
    fn kind(&self) -> DriverKind {
        DriverKind::Cuda
    }

    fn driver_version(&self) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid place to write.
        check("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&raw mut v)
        })?;
        Ok(v)
    }

    fn device_count(&self) -> Result<u32> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid place to write.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&raw mut n)
        })?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    fn device_info(&self, ordinal: u32) -> Result<DeviceInfo> {
        use sys::CUdevice_attribute as A;
        let dev = self.device(ordinal)?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: `uuid` is a valid CUuuid to write.
        check("cuDeviceGetUuid_v2", unsafe {
            sys::cuDeviceGetUuid_v2(&raw mut uuid, dev)
        })?;
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds 256 chars and we pass its length.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)
        })?;
        let name_bytes: Vec<u8> = name
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        let mut total: usize = 0;
        // SAFETY: `total` is a valid place to write.
        check("cuDeviceTotalMem_v2", unsafe {
            sys::cuDeviceTotalMem_v2(&raw mut total, dev)
        })?;
        let posix_fd =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 as i32;
        let pool_types =
            self.attribute(dev, A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)?;
        Ok(DeviceInfo {
            ordinal,
            uuid: DeviceUuid(uuid.bytes.map(|c| c as u8)),
            name: String::from_utf8_lossy(&name_bytes).into_owned(),
            total_memory: total as u64,
            memory_pools: self.attribute(dev, A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0,
            pool_posix_fd: pool_types & posix_fd != 0,
            vmm: self.attribute(
                dev,
                A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            )? != 0,
            vmm_posix_fd: self.attribute(
                dev,
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )? != 0,
            mps_client: self
                .attribute(dev, A::CU_DEVICE_ATTRIBUTE_MPS_ENABLED)
                .ok()
                .map(|v| v != 0),
        })
    }

    fn device_can_access_peer(&self, ordinal: u32, peer: u32) -> Result<bool> {
        let (a, b) = (self.device(ordinal)?, self.device(peer)?);
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid place to write; both devices came from cuDeviceGet.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&raw mut can, a, b)
        })?;
        Ok(can != 0)
    }

    fn use_device(&self, ordinal: u32) -> Result<()> {
        let mut map = self
            .retained
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let r = match map.get(&ordinal) {
            Some(r) => *r,
            None => {
                let device = self.device(ordinal)?;
                let mut ctx: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: `ctx` is a valid place to write; released in Drop.
                check("cuDevicePrimaryCtxRetain", unsafe {
                    sys::cuDevicePrimaryCtxRetain(&raw mut ctx, device)
                })?;
                let r = Retained {
                    device,
                    context: ctx.expose_provenance(),
                };
                map.insert(ordinal, r);
                r
            }
        };
        drop(map);
        let ctx: sys::CUcontext = std::ptr::with_exposed_provenance_mut(r.context);
        // SAFETY: the context is retained for as long as this driver lives.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
    }

    fn mem_get_info(&self) -> Result<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid places to write.
        check("cuMemGetInfo_v2", unsafe {
            sys::cuMemGetInfo_v2(&raw mut free, &raw mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    fn mem_pool_create(&self, ordinal: u32, sharing: PoolSharing) -> Result<PoolHandle> {
        self.device(ordinal)?;
        // SAFETY: CUmemPoolProps is plain data for which all-zero bytes are valid (every
        // enum it holds has a variant 0, pointers may be null).
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = match sharing {
            PoolSharing::None => sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            PoolSharing::PosixFd => {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            }
        };
        props.location = device_location(ordinal);
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid place to write; `props` is initialised.
        check("cuMemPoolCreate", unsafe {
            sys::cuMemPoolCreate(&raw mut pool, &raw const props)
        })?;
        Ok(pool_handle(pool))
    }

    unsafe fn mem_pool_destroy(&self, pool: PoolHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `pool` is a live pool of
        // this driver, destroyed once, and not used after.
        check("cuMemPoolDestroy", unsafe {
            sys::cuMemPoolDestroy(pool_raw(pool))
        })
    }

    fn mem_pool_set_attribute(&self, pool: PoolHandle, attr: PoolAttribute) -> Result<()> {
        use sys::CUmemPool_attribute as A;
        // The threshold is a cuuint64_t, the reuse flags are ints (CUDA's documentation).
        let (which, mut wide, mut narrow, is_wide) = match attr {
            PoolAttribute::ReleaseThreshold(v) => {
                (A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, v, 0, true)
            }
            PoolAttribute::ReuseFollowEventDependencies(b) => (
                A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
                0,
                c_int::from(b),
                false,
            ),
            PoolAttribute::ReuseAllowOpportunistic(b) => (
                A::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
                0,
                c_int::from(b),
                false,
            ),
            PoolAttribute::ReuseAllowInternalDependencies(b) => (
                A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                0,
                c_int::from(b),
                false,
            ),
            // The high-water marks are cuuint64_t and take 0 only: the driver restarts them
            // from the current figure (what torch's resetPeakStats does to its own pool).
            PoolAttribute::ResetReservedHigh => (A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0, 0, true),
            PoolAttribute::ResetUsedHigh => (A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0, 0, true),
        };
        let value: *mut c_void = if is_wide {
            (&raw mut wide).cast()
        } else {
            (&raw mut narrow).cast()
        };
        // SAFETY: `value` points to a live value of the type the attribute expects.
        check("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(pool_raw(pool), which, value)
        })
    }

    fn mem_pool_get_attribute(&self, pool: PoolHandle, counter: PoolCounter) -> Result<u64> {
        use sys::CUmemPool_attribute as A;
        let (which, is_wide) = match counter {
            PoolCounter::ReleaseThreshold => (A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, true),
            PoolCounter::ReservedCurrent => (A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, true),
            PoolCounter::ReservedHigh => (A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, true),
            PoolCounter::UsedCurrent => (A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, true),
            PoolCounter::UsedHigh => (A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, true),
            PoolCounter::ReuseFollowEventDependencies => {
                (A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, false)
            }
            PoolCounter::ReuseAllowOpportunistic => {
                (A::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, false)
            }
            PoolCounter::ReuseAllowInternalDependencies => {
                (A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, false)
            }
        };
        let (mut wide, mut narrow): (u64, c_int) = (0, 0);
        let value: *mut c_void = if is_wide {
            (&raw mut wide).cast()
        } else {
            (&raw mut narrow).cast()
        };
        // SAFETY: `value` points to a live value of the size the attribute writes.
        check("cuMemPoolGetAttribute", unsafe {
            sys::cuMemPoolGetAttribute(pool_raw(pool), which, value)
        })?;
        Ok(if is_wide {
            wide
        } else {
            u64::from(narrow != 0)
        })
    }

    fn mem_pool_trim_to(&self, pool: PoolHandle, keep_bytes: u64) -> Result<()> {
        let keep = size("cuMemPoolTrimTo", keep_bytes)?;
        // SAFETY: `pool` is live (the handle contract, module docs).
        check("cuMemPoolTrimTo", unsafe {
            sys::cuMemPoolTrimTo(pool_raw(pool), keep)
        })
    }

    fn device_get_mem_pool(&self, ordinal: u32) -> Result<PoolHandle> {
        let dev = self.device(ordinal)?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid place to write.
        check("cuDeviceGetMemPool", unsafe {
            sys::cuDeviceGetMemPool(&raw mut pool, dev)
        })?;
        Ok(pool_handle(pool))
    }

    fn device_get_default_mem_pool(&self, ordinal: u32) -> Result<PoolHandle> {
        let dev = self.device(ordinal)?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid place to write.
        check("cuDeviceGetDefaultMemPool", unsafe {
            sys::cuDeviceGetDefaultMemPool(&raw mut pool, dev)
        })?;
        Ok(pool_handle(pool))
    }

    fn device_set_mem_pool(&self, ordinal: u32, pool: PoolHandle) -> Result<()> {
        let dev = self.device(ordinal)?;
        // SAFETY: `dev` came from cuDeviceGet; `pool` is live (the handle contract).
        check("cuDeviceSetMemPool", unsafe {
            sys::cuDeviceSetMemPool(dev, pool_raw(pool))
        })
    }

    fn mem_pool_export_fd(&self, pool: PoolHandle) -> Result<OwnedFd> {
        let mut fd: c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an int through `handle_out`.
        check("cuMemPoolExportToShareableHandle", unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&raw mut fd).cast(),
                pool_raw(pool),
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(DriverError::Call {
                call: "cuMemPoolExportToShareableHandle",
                code: CuCode::UNKNOWN,
            });
        }
        // SAFETY: the driver just created this descriptor for us; we are its only owner.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn mem_pool_import_fd(&self, fd: BorrowedFd<'_>) -> Result<PoolHandle> {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // The POSIX FD travels in the pointer-sized handle argument by value.
        let handle: *mut c_void = std::ptr::without_provenance_mut(fd.as_raw_fd() as usize);
        // SAFETY: `pool` is a valid place to write; `fd` is open for the call's duration.
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                &raw mut pool,
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        Ok(pool_handle(pool))
    }

    fn mem_pool_set_access(&self, pool: PoolHandle, ordinal: u32, access: Access) -> Result<()> {
        let desc = sys::CUmemAccessDesc {
            location: device_location(ordinal),
            flags: access_flags(access),
        };
        // SAFETY: one initialised descriptor.
        check("cuMemPoolSetAccess", unsafe {
            sys::cuMemPoolSetAccess(pool_raw(pool), &raw const desc, 1)
        })
    }

    fn mem_pool_get_access(&self, pool: PoolHandle, ordinal: u32) -> Result<Access> {
        let mut loc = device_location(ordinal);
        let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        // SAFETY: both are valid, initialised places.
        check("cuMemPoolGetAccess", unsafe {
            sys::cuMemPoolGetAccess(&raw mut flags, pool_raw(pool), &raw mut loc)
        })?;
        Ok(match flags {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ => Access::Read,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE => Access::ReadWrite,
            _ => Access::None,
        })
    }

    fn pointer_info(&self, ptr: DevicePtr) -> Result<PointerInfo> {
        use sys::CUpointer_attribute as A;
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut buffer_id: u64 = 0;
        let mut memory_type: std::ffi::c_uint = 0;
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
        // SAFETY: six attributes, six pointers, each to a live value of the type its
        // attribute writes (CUdeviceptr, size_t, CUmemoryPool, unsigned long long,
        // CUmemorytype as unsigned int, int).
        check("cuPointerGetAttributes", unsafe {
            sys::cuPointerGetAttributes(6, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr.0)
        })?;
        // Not a pointer of this process: the driver answers with zeros rather than an error.
        if size == 0 || base == 0 {
            return Err(DriverError::Call {
                call: "cuPointerGetAttributes",
                code: CuCode::INVALID_VALUE,
            });
        }
        let device_memory = memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
        Ok(PointerInfo {
            base: DevicePtr(base),
            size: size as u64,
            pool: (!pool.is_null()).then(|| pool_handle(pool)),
            buffer_id: (buffer_id != 0).then_some(buffer_id),
            device: u32::try_from(ordinal).ok().filter(|_| device_memory),
        })
    }

    fn pointer_get_device(&self, ptr: DevicePtr) -> Result<u32> {
        let mut memory_type: std::ffi::c_uint = 0;
        // SAFETY: MEMORY_TYPE writes one CUmemorytype (an unsigned int) into `memory_type`.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut memory_type).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr.0,
            )
        })?;
        if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(DriverError::Call {
                call: "cuPointerGetAttribute",
                code: CuCode::INVALID_VALUE,
            });
        }
        let mut ordinal: c_int = -1;
        // SAFETY: DEVICE_ORDINAL writes one int into `ordinal`.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut ordinal).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr.0,
            )
        })?;
        u32::try_from(ordinal).map_err(|_| DriverError::Call {
            call: "cuPointerGetAttribute",
            code: CuCode::INVALID_VALUE,
        })
    }

    fn pointer_get_mempool(&self, ptr: DevicePtr) -> Result<PoolHandle> {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: MEMPOOL_HANDLE writes one CUmemoryPool into `pool`.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut pool).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                ptr.0,
            )
        })?;
        Ok(pool_handle(pool))
    }

    fn pointer_get_buffer_id(&self, ptr: DevicePtr) -> Result<u64> {
        let mut id: std::ffi::c_ulonglong = 0;
        // SAFETY: BUFFER_ID writes one unsigned long long into `id`.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut id).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                ptr.0,
            )
        })?;
        Ok(id)
    }

    fn pointer_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64)> {
        let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: both are valid places to write.
        check("cuMemGetAddressRange_v2", unsafe {
            sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut len, ptr.0)
        })?;
        Ok((DevicePtr(base), len as u64))
    }

    fn mem_alloc(&self, bytes: u64) -> Result<DevicePtr> {
        let n = size("cuMemAlloc_v2", bytes)?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: `p` is a valid place to write.
        check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&raw mut p, n)
        })?;
        Ok(DevicePtr(p))
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `ptr` is memory of
        // cuMemAlloc it owns, freed once and not used after.
        check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    fn mem_alloc_async(&self, bytes: u64, stream: StreamHandle) -> Result<DevicePtr> {
        let n = size("cuMemAllocAsync", bytes)?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: `p` is a valid place to write.
        check("cuMemAllocAsync", unsafe {
            sys::cuMemAllocAsync(&raw mut p, n, stream_raw(stream))
        })?;
        Ok(DevicePtr(p))
    }

    fn mem_alloc_from_pool_async(
        &self,
        bytes: u64,
        pool: PoolHandle,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        let n = size("cuMemAllocFromPoolAsync", bytes)?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: `p` is a valid place to write.
        check("cuMemAllocFromPoolAsync", unsafe {
            sys::cuMemAllocFromPoolAsync(&raw mut p, n, pool_raw(pool), stream_raw(stream))
        })?;
        Ok(DevicePtr(p))
    }

    unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `ptr` is a live allocation
        // it owns, freed once and not used after; `stream` is live (the handle contract).
        check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr.0, stream_raw(stream))
        })
    }

    fn mem_pool_export_pointer(&self, ptr: DevicePtr) -> Result<ExportBlob> {
        let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
        // SAFETY: `data` is a valid 64-byte place to write.
        check("cuMemPoolExportPointer", unsafe {
            sys::cuMemPoolExportPointer(&raw mut data, ptr.0)
        })?;
        Ok(ExportBlob(data.reserved))
    }

    fn mem_pool_import_pointer(&self, pool: PoolHandle, data: &ExportBlob) -> Result<DevicePtr> {
        let mut share = sys::CUmemPoolPtrExportData { reserved: data.0 };
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: `p` is a valid place to write; `share` holds the 64 bytes the exporter
        // produced (the driver reads them).
        check("cuMemPoolImportPointer", unsafe {
            sys::cuMemPoolImportPointer(&raw mut p, pool_raw(pool), &raw mut share)
        })?;
        Ok(DevicePtr(p))
    }

    unsafe fn mem_pool_free_import(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `ptr` is a live import,
        // freed once and not used after; `stream` is live (the handle contract). Imports are
        // freed with cuMemFreeAsync like allocations.
        check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr.0, stream_raw(stream))
        })
    }

    fn event_create(&self, interprocess: bool) -> Result<EventHandle> {
        let mut flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        if interprocess {
            flags |= sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        }
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `ev` is a valid place to write.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&raw mut ev, flags)
        })?;
        Ok(EventHandle(ev.expose_provenance() as u64))
    }

    unsafe fn event_destroy(&self, event: EventHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `event` is a live event of
        // this driver, destroyed once, and not used after.
        check("cuEventDestroy_v2", unsafe {
            sys::cuEventDestroy_v2(event_raw(event))
        })
    }

    fn ipc_get_event_handle(&self, event: EventHandle) -> Result<EventBlob> {
        let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
        // SAFETY: `h` is a valid 64-byte place to write.
        check("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(&raw mut h, event_raw(event))
        })?;
        Ok(EventBlob(h.reserved.map(|c| c as u8)))
    }

    fn ipc_open_event_handle(&self, handle: &EventBlob) -> Result<EventHandle> {
        let h = sys::CUipcEventHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `ev` is a valid place to write; the handle is passed by value.
        check("cuIpcOpenEventHandle", unsafe {
            sys::cuIpcOpenEventHandle(&raw mut ev, h)
        })?;
        Ok(EventHandle(ev.expose_provenance() as u64))
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        // SAFETY: `event` and `stream` are live (the handle contract, module docs).
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(event_raw(event), stream_raw(stream))
        })
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        // SAFETY: `event` is live (the handle contract, module docs).
        let r = unsafe { sys::cuEventQuery(event_raw(event)) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", r)?;
        Ok(true)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        // SAFETY: `event` is live (the handle contract, module docs).
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(event_raw(event))
        })
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        // SAFETY: `event` and `stream` are live (the handle contract, module docs).
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream_raw(stream), event_raw(event), 0)
        })
    }

    fn stream_create(&self) -> Result<StreamHandle> {
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: `s` is a valid place to write.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                &raw mut s,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(StreamHandle(s.expose_provenance() as u64))
    }

    unsafe fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `stream` is a live stream
        // of this driver, destroyed once, and not used after.
        check("cuStreamDestroy_v2", unsafe {
            sys::cuStreamDestroy_v2(stream_raw(stream))
        })
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: `stream` is live (the handle contract, module docs).
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream_raw(stream))
        })
    }

    fn ctx_synchronize(&self) -> Result<()> {
        // SAFETY: plain call on the current context.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn stream_check(&self, stream: StreamHandle) -> Result<()> {
        const CALL: &str = "cuStreamQuery";
        if stream.0 <= 2 {
            return Ok(());
        }
        let bad = |reason: String| DriverError::InvalidArgument { call: CALL, reason };
        if !stream.0.is_multiple_of(8) {
            return Err(bad(format!(
                "{:#x} is not a stream handle (misaligned)",
                stream.0
            )));
        }
        // A stream handle points at the driver's object in this process: the handle must be
        // readable memory here before libcuda dereferences it (a made-up number would crash
        // the process instead of failing the call). process_vm_readv on ourselves reads
        // without faulting: EFAULT for an unmapped address.
        let mut word = [0u8; 8];
        let readable = usize::try_from(stream.0).is_ok_and(|addr| {
            let local = [std::io::IoSliceMut::new(&mut word)];
            let remote = [nix::sys::uio::RemoteIoVec { base: addr, len: 8 }];
            nix::sys::uio::process_vm_readv(nix::unistd::Pid::this(), &mut { local }, &remote)
                .is_ok_and(|n| n == 8)
        });
        if !readable {
            return Err(bad(format!(
                "{:#x} is not a stream handle of this process (no memory there)",
                stream.0
            )));
        }
        // SAFETY: the handle points at readable memory of this process (checked above); the
        // driver validates that it is one of its streams and answers INVALID_HANDLE or
        // INVALID_CONTEXT otherwise.
        let r = unsafe { sys::cuStreamQuery(stream_raw(stream)) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(());
        }
        check(CALL, r)
    }

    fn memset_d8_async(
        &self,
        ptr: DevicePtr,
        value: u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let n = size("cuMemsetD8Async", bytes)?;
        // SAFETY: `stream` is live (the handle contract); `ptr` is a device address, which
        // libcuda looks up itself (a wrong one is an error or a device fault).
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(ptr.0, value, n, stream_raw(stream))
        })
    }

    fn memset_d32_async(
        &self,
        ptr: DevicePtr,
        value: u32,
        words: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let n = size("cuMemsetD32Async", words)?;
        // SAFETY: `stream` is live (the handle contract); `ptr` is a device address, which
        // libcuda looks up itself (a wrong one is an error or a device fault).
        check("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(ptr.0, value, n, stream_raw(stream))
        })
    }

    fn launch_store_kernel(
        &self,
        address: DevicePtr,
        value: u32,
        stream: StreamHandle,
    ) -> Result<()> {
        let function = self.kernel(STORE_KERNEL_PTX, c"poolipc_store")?;
        let mut p = address.0;
        let mut v = value;
        let mut params = [(&raw mut p).cast::<c_void>(), (&raw mut v).cast::<c_void>()];
        // SAFETY: `function` is the loaded `poolipc_store(u64, u32)`; `params` points to one
        // pointer per parameter, each to a live value of the parameter's type, for the call
        // (the driver copies them at launch); no extra arguments.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream_raw(stream),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        self.stream_synchronize(stream)
    }

    fn launch_hang_kernel(&self, stream: StreamHandle) -> Result<()> {
        let function = self.kernel(HANG_KERNEL_PTX, c"poolipc_hang")?;
        // SAFETY: `function` is the loaded `poolipc_hang()`, which takes no parameters: an
        // empty parameter list and no extra arguments.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream_raw(stream),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        })
    }

    fn memcpy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        // SAFETY: `dst` is valid for `dst.len()` writes for the whole synchronous copy.
        check("cuMemcpyDtoH_v2", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src.0, dst.len())
        })
    }

    fn memcpy_htod(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        // SAFETY: `src` is valid for `src.len()` reads for the whole synchronous copy.
        check("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(dst.0, src.as_ptr().cast(), src.len())
        })
    }

    fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let n = size("cuMemcpyDtoDAsync_v2", bytes)?;
        // SAFETY: `stream` is live (the handle contract); both addresses are device addresses,
        // which libcuda looks up itself.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, n, stream_raw(stream))
        })
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let n = size("cuMemcpyDtoHAsync_v2", bytes)?;
        // SAFETY: the caller promises `dst` stays valid for `bytes` until the stream passes.
        check("cuMemcpyDtoHAsync_v2", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src.0, n, stream_raw(stream))
        })
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let n = size("cuMemcpyHtoDAsync_v2", bytes)?;
        // SAFETY: the caller promises `src` stays valid for `bytes` until the stream passes.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.0, src.cast(), n, stream_raw(stream))
        })
    }

    unsafe fn host_register(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller promises `ptr..ptr+bytes` is mapped until unregistered.
        check("cuMemHostRegister_v2", unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), bytes, flags)
        })
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: the caller promises `ptr` was registered and no copy uses it.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr.cast())
        })
    }

    fn vmm_granularity(&self, ordinal: u32, which: Granularity) -> Result<u64> {
        let prop = vmm_prop(ordinal);
        let option = match which {
            Granularity::Minimum => {
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
            }
            Granularity::Recommended => {
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            }
        };
        let mut g: usize = 0;
        // SAFETY: `g` is a valid place to write; `prop` is initialised.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(&raw mut g, &raw const prop, option)
        })?;
        Ok(g as u64)
    }

    fn vmm_create(&self, ordinal: u32, bytes: u64) -> Result<VmmHandle> {
        let n = size("cuMemCreate", bytes)?;
        let prop = vmm_prop(ordinal);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `h` is a valid place to write; `prop` is initialised.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&raw mut h, n, &raw const prop, 0)
        })?;
        Ok(VmmHandle(h))
    }

    fn vmm_create_unshared(&self, ordinal: u32, bytes: u64) -> Result<VmmHandle> {
        let n = size("cuMemCreate", bytes)?;
        let mut prop = vmm_prop(ordinal);
        prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `h` is a valid place to write; `prop` is initialised.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&raw mut h, n, &raw const prop, 0)
        })?;
        Ok(VmmHandle(h))
    }

    fn vmm_retain(&self, ptr: DevicePtr) -> Result<VmmHandle> {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        let addr: *mut c_void = std::ptr::without_provenance_mut(ptr.0 as usize);
        // SAFETY: `h` is a valid place to write; the address is only a key for the driver,
        // never dereferenced on the host.
        check("cuMemRetainAllocationHandle", unsafe {
            sys::cuMemRetainAllocationHandle(&raw mut h, addr)
        })?;
        Ok(VmmHandle(h))
    }

    fn vmm_exports_fd(&self, handle: VmmHandle) -> Result<bool> {
        let mut prop = vmm_prop(0);
        prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        // SAFETY: `prop` is a live, initialised CUmemAllocationProp the driver overwrites.
        check("cuMemGetAllocationPropertiesFromHandle", unsafe {
            sys::cuMemGetAllocationPropertiesFromHandle(&raw mut prop, handle.0)
        })?;
        let fd = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
        Ok(prop.requestedHandleTypes.0 & fd == fd)
    }

    fn vmm_export_fd(&self, handle: VmmHandle) -> Result<OwnedFd> {
        let mut fd: c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an int through the pointer.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&raw mut fd).cast(),
                handle.0,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(DriverError::Call {
                call: "cuMemExportToShareableHandle",
                code: CuCode::UNKNOWN,
            });
        }
        // SAFETY: the driver just created this descriptor for us; we are its only owner.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn vmm_import_fd(&self, fd: BorrowedFd<'_>) -> Result<VmmHandle> {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        let handle: *mut c_void = std::ptr::without_provenance_mut(fd.as_raw_fd() as usize);
        // SAFETY: `h` is a valid place to write; the FD travels by value and stays open.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &raw mut h,
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(VmmHandle(h))
    }

    fn vmm_reserve(&self, bytes: u64, alignment: u64) -> Result<DevicePtr> {
        let n = size("cuMemAddressReserve", bytes)?;
        let a = size("cuMemAddressReserve", alignment)?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: `p` is a valid place to write.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&raw mut p, n, a, 0, 0)
        })?;
        Ok(DevicePtr(p))
    }

    fn vmm_map(&self, ptr: DevicePtr, bytes: u64, handle: VmmHandle) -> Result<()> {
        let n = size("cuMemMap", bytes)?;
        // SAFETY: `handle` is live (the handle contract); `ptr` is a device address, which
        // libcuda looks up in its reservations itself.
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr.0, n, 0, handle.0, 0)
        })
    }

    fn vmm_set_access(
        &self,
        ptr: DevicePtr,
        bytes: u64,
        ordinal: u32,
        access: Access,
    ) -> Result<()> {
        let n = size("cuMemSetAccess", bytes)?;
        let desc = sys::CUmemAccessDesc {
            location: device_location(ordinal),
            flags: access_flags(access),
        };
        // SAFETY: one initialised descriptor.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr.0, n, &raw const desc, 1)
        })
    }

    unsafe fn vmm_unmap(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        let n = size("cuMemUnmap", bytes)?;
        // SAFETY: the caller promises (the trait's `# Safety`) that the range is a mapping of
        // this driver, unmapped once and not used after.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr.0, n) })
    }

    unsafe fn vmm_address_free(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        let n = size("cuMemAddressFree", bytes)?;
        // SAFETY: the caller promises (the trait's `# Safety`) that the range is an unmapped
        // reservation of this driver, freed once and not used after.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(ptr.0, n)
        })
    }

    unsafe fn vmm_release(&self, handle: VmmHandle) -> Result<()> {
        // SAFETY: the caller promises (the trait's `# Safety`) that `handle` is a reference of
        // this driver, released once and not used after.
        check("cuMemRelease", unsafe { sys::cuMemRelease(handle.0) })
    }
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

    #[test]
    fn new_without_a_gpu_fails_cleanly() {
        // On a machine with a GPU this succeeds; without one it must be a typed error.
        match CudaDriver::new() {
            Ok(d) => assert_eq!(d.kind(), DriverKind::Cuda),
            Err(e) => assert!(
                matches!(
                    e,
                    DriverError::LibraryNotFound { .. }
                        | DriverError::NoDevice
                        | DriverError::Wsl2
                        | DriverError::DriverTooOld { .. }
                ),
                "unexpected error: {e}"
            ),
        }
    }

    #[test]
    fn every_symbol_is_listed_once() {
        let mut seen = std::collections::HashSet::new();
        for s in SYMBOLS {
            assert!(seen.insert(s), "{s} listed twice");
        }
    }
}
