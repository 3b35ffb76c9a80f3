//! Plain data the [`Driver`](crate::Driver) trait speaks in: handles, attributes. The blobs
//! ([`ExportBlob`](poolipc_types::ExportBlob), [`EventBlob`](poolipc_types::EventBlob)) and
//! [`DeviceUuid`] are `poolipc-types`', re-exported at this crate's root.
//!
//! Handles are opaque `u64` newtypes rather than associated types: each driver gives them
//! meaning (`CudaDriver` stores the CUDA handle's address, `SimDriver` an index), they are
//! `Copy`, and mockall can name them. A handle from one driver means nothing to another.

use std::fmt;

pub(crate) use poolipc_types::{DeviceUuid, EventBlob, ExportBlob};

macro_rules! handle {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u64);

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#x})"), self.0)
            }
        }
    };
}

handle!(
    /// A memory pool (`CUmemoryPool`), created here or imported from another process.
    PoolHandle
);
handle!(
    /// A stream (`CUstream`). `StreamHandle::NULL` is the legacy default stream.
    StreamHandle
);
handle!(
    /// An event (`CUevent`), local or opened from another process's handle.
    EventHandle
);
handle!(
    /// A physical allocation of the virtual memory management API (`CUmemGenericAllocationHandle`).
    VmmHandle
);

impl StreamHandle {
    /// The legacy default stream.
    pub const NULL: StreamHandle = StreamHandle(0);
}

/// A device address (`CUdeviceptr`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DevicePtr(pub u64);

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevicePtr({:#x})", self.0)
    }
}

impl DevicePtr {
    /// The address `bytes` further on.
    #[must_use]
    pub fn offset(self, bytes: u64) -> DevicePtr {
        DevicePtr(self.0.wrapping_add(bytes))
    }
}

/// What a device is and what it can do, as far as poolipc cares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The ordinal in this process (depends on `CUDA_VISIBLE_DEVICES`).
    pub ordinal: u32,
    /// The stable identity.
    pub uuid: DeviceUuid,
    /// The marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Device memory in bytes.
    pub total_memory: u64,
    /// `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`.
    pub memory_pools: bool,
    /// `CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES` includes POSIX file descriptors.
    pub pool_posix_fd: bool,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
    pub vmm: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED` (VMM handles by FD).
    pub vmm_posix_fd: bool,
    /// `CU_DEVICE_ATTRIBUTE_MPS_ENABLED`: whether this process's contexts on the device are
    /// shared through an MPS server (this process is an MPS client). `None` where the driver
    /// does not report it (before CUDA 12.4's drivers).
    pub mps_client: Option<bool>,
}

/// What [`Driver::pointer_info`](crate::Driver::pointer_info) tells of a device pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PointerInfo {
    /// The allocation's first byte.
    pub base: DevicePtr,
    /// The allocation's size.
    pub size: u64,
    /// The memory pool it came from; `None` when it is not pool memory.
    pub pool: Option<PoolHandle>,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`; `None` where the driver gives none.
    pub buffer_id: Option<u64>,
    /// The ordinal (in this process) of the device whose memory it is
    /// (`CU_POINTER_ATTRIBUTE_MEMORY_TYPE` is device, then `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`);
    /// `None` for host memory or where the driver does not say. Any kind of device memory has
    /// one: pool memory, `cuMemAlloc` memory, a VMM mapping.
    pub device: Option<u32>,
}

/// Settable pool attributes (`CUmemPool_attribute`), with their values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolAttribute {
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`: bytes the pool keeps reserved at a synchronize.
    ReleaseThreshold(u64),
    /// `CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES`.
    ReuseFollowEventDependencies(bool),
    /// `CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC`.
    ReuseAllowOpportunistic(bool),
    /// `CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES`.
    ReuseAllowInternalDependencies(bool),
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH` set to 0, the only value the driver takes: the
    /// high-water mark of reserved memory starts again from the current reserve.
    ResetReservedHigh,
    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH` set to 0, the only value the driver takes: the
    /// high-water mark of used memory starts again from what is in use now.
    ResetUsedHigh,
}

/// Readable pool attributes that are counters (`CUmemPool_attribute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolCounter {
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
    ReleaseThreshold,
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`.
    ReservedCurrent,
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`.
    ReservedHigh,
    /// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`.
    UsedCurrent,
    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH`.
    UsedHigh,
    /// `CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES` (0 or 1).
    ReuseFollowEventDependencies,
    /// `CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC` (0 or 1).
    ReuseAllowOpportunistic,
    /// `CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES` (0 or 1).
    ReuseAllowInternalDependencies,
}

/// How a pool may be shared with other processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSharing {
    /// `handleTypes = NONE`: this process only (what the default pool is).
    None,
    /// `handleTypes = POSIX_FILE_DESCRIPTOR`: exportable as an FD.
    PosixFd,
}

/// Access of a device to a pool or a mapping (`CUmemAccess_flags`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `CU_MEM_ACCESS_FLAGS_PROT_NONE`.
    None,
    /// `CU_MEM_ACCESS_FLAGS_PROT_READ`.
    Read,
    /// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
    ReadWrite,
}

/// Which granularity `cuMemGetAllocationGranularity` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granularity {
    /// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
    Minimum,
    /// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`.
    Recommended,
}

/// Which driver implements the trait: tools print it, tests branch on nothing else.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DriverKind {
    /// libcuda on real hardware.
    Cuda,
    /// The simulation, chosen explicitly.
    Sim,
    /// A mock in unit tests.
    Mock,
}

impl fmt::Display for DriverKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DriverKind::Cuda => "cuda",
            DriverKind::Sim => "sim",
            DriverKind::Mock => "mock",
        })
    }
}
