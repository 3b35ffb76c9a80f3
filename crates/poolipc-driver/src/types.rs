//! Plain data the [`Driver`](crate::Driver) trait speaks in: handles, attributes. The blobs
//! ([`ExportBlob`](poolipc_types::ExportBlob), [`EventBlob`](poolipc_types::EventBlob)) and
//! [`DeviceUuid`] are `poolipc-types`', re-exported at this crate's root.
//!
//! Handles are opaque `u64` newtypes rather than associated types: each driver gives them
//! meaning (`CudaDriver` stores the CUDA handle's address, `SimDriver` an index), they are
//! `Copy`, and mockall can name them. A handle from one driver means nothing to another.
//!
//! A handle is made by a driver: its field is private, a number from outside (a stream from
//! Python, torch's `cuda_stream`) becomes one only through the handle's `unsafe fn from_raw`,
//! whose caller vouches for it. Destroying one is the owning types' job
//! ([`OwnedPool`](crate::OwnedPool), [`OwnedEvent`](crate::OwnedEvent), ...): the trait's
//! destroying calls are `unsafe fn`s.

use std::fmt;

pub(crate) use poolipc_types::{DeviceUuid, EventBlob, ExportBlob};

macro_rules! handle {
    ($(#[$m:meta])* $name:ident, $what:literal) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub(crate) u64);

        impl $name {
            #[doc = concat!("The ", $what, " `raw` names, as a driver of this process gave it out.")]
            ///
            /// # Safety
            #[doc = concat!("1. `raw` is ", $what, " that the driver this value will be given to")]
            ///    made (or opened) in this process, or a value that driver documents as valid.
            /// 2. It stays live (not destroyed, by this process or another library) for as long
            ///    as this value, or a copy of it, is given to a driver call.
            #[must_use]
            pub const unsafe fn from_raw(raw: u64) -> $name {
                $name(raw)
            }

            /// The raw value, as the driver gave it out (for logs, wire formats and Python).
            #[must_use]
            pub const fn as_raw(self) -> u64 {
                self.0
            }

            #[doc = concat!("A made-up ", $what, " for mockall expectations and unit tests")]
            /// that never reach a real driver. Only with the `mock` feature.
            #[cfg(any(test, feature = "mock"))]
            #[must_use]
            pub const fn mock(raw: u64) -> $name {
                $name(raw)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#x})"), self.0)
            }
        }
    };
}

handle!(
    /// A memory pool (`CUmemoryPool`), created here or imported from another process.
    PoolHandle,
    "a memory pool (`CUmemoryPool`)"
);
handle!(
    /// A stream (`CUstream`). `StreamHandle::NULL` is the legacy default stream.
    StreamHandle,
    "a stream (`CUstream`)"
);
handle!(
    /// An event (`CUevent`), local or opened from another process's handle.
    EventHandle,
    "an event (`CUevent`)"
);
handle!(
    /// A physical allocation of the virtual memory management API (`CUmemGenericAllocationHandle`).
    VmmHandle,
    "a VMM allocation handle (`CUmemGenericAllocationHandle`)"
);

impl StreamHandle {
    /// The legacy default stream.
    pub const NULL: StreamHandle = StreamHandle(0);
    /// `CU_STREAM_LEGACY`: the legacy default stream, by the handle the driver API gives it.
    pub const LEGACY: StreamHandle = StreamHandle(1);
    /// `CU_STREAM_PER_THREAD`: the calling thread's default stream.
    pub const PER_THREAD: StreamHandle = StreamHandle(2);
}

/// A device address (`CUdeviceptr`).
///
/// Unlike the handles, an address is plain data (tensors' `data_ptr()`, offsets into an
/// allocation): the driver looks every address it is given up in its own tables and answers
/// an error for one it does not know, so a made-up address cannot reach host memory. Freeing
/// or unmapping the memory behind one is the owning types' job (the trait's calls that do it
/// are `unsafe fn`s).
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

/// What the driver's creating calls ([`Driver::mem_pool_create`](crate::Driver::mem_pool_create),
/// [`Driver::event_create`](crate::Driver::event_create),
/// [`Driver::stream_create`](crate::Driver::stream_create)) take, and only the owning types make (its field is private to this
/// crate):
/// the owning types ([`OwnedPool::create`](crate::OwnedPool::create), [`OwnedEvent::new`](crate::OwnedEvent::new), [`OwnedStream::new`](crate::OwnedStream::new)) are the
/// only callers, so what those calls return is owned the moment it exists, and code elsewhere
/// cannot make a handle that nobody destroys. A driver receives it and ignores it.
#[derive(Debug, Clone, Copy)]
pub struct OwnerToken(pub(crate) ());
