//! One simulated process's own tables: its pools, imports, events, streams, VMM handles,
//! reservations and mappings, registered host memory, and its host clock. The machine's
//! shared tables are `state`'s; these are what a real process keeps in its own libcuda.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use super::regions::VMM_BASE;
use super::shm::Mapping;
use super::state::Clock;
use super::state::MAX_STREAMS;
use crate::types::{Access, VmmHandle};

#[derive(Debug)]
pub(super) struct LocalPool {
    pub(super) fd: OwnedFd,
    pub(super) map: Mapping,
    pub(super) generation: u64,
    pub(super) device: u32,
    pub(super) imported: bool,
    pub(super) destroyed: bool,
    /// Access by device, for imported pools (own pools: their device has read-write).
    pub(super) access: Vec<Access>,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct LocalImport {
    pub(super) record: usize,
    pub(super) pool: usize,
    pub(super) block: usize,
    pub(super) generation: u64,
    pub(super) bytes: u64,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID` of the import in this process.
    pub(super) buffer_id: u64,
}

#[derive(Debug)]
pub(super) struct LocalEvent {
    pub(super) slot: usize,
    pub(super) generation: u64,
    pub(super) owner: bool,
}

#[derive(Debug)]
pub(super) struct VmmAlloc {
    pub(super) fd: OwnedFd,
    pub(super) bytes: u64,
    /// The device the memory is on (an import's: the importing context's device).
    pub(super) device: u32,
    /// Created with the POSIX FD handle type: `cuMemExportToShareableHandle` works.
    pub(super) exportable: bool,
}

#[derive(Debug)]
pub(super) struct VmmMap {
    pub(super) map: Mapping,
    pub(super) bytes: u64,
    pub(super) access: Access,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID` of the mapping.
    pub(super) buffer_id: u64,
    /// (device, inode) of the memfd behind the handle: how the race detector names it.
    pub(super) file: (u64, u64),
    /// The memfd behind the handle, for `cuMemRetainAllocationHandle`.
    pub(super) fd: OwnedFd,
    /// The device the memory is on.
    pub(super) device: u32,
    /// The handle was made with the POSIX FD handle type.
    pub(super) exportable: bool,
    /// `cuMemAlloc` memory, which this simulation keeps as a mapping of an unexportable
    /// handle (so the race detector covers it as it covers VMM memory): no handle can be
    /// retained from it.
    pub(super) plain: bool,
}

#[derive(Debug)]
pub(super) struct Local {
    pub(super) device: Option<u32>,
    pub(super) pools: HashMap<usize, LocalPool>,
    pub(super) current_pool: HashMap<u32, usize>,
    pub(super) default_pool: HashMap<u32, usize>,
    /// Live imports by the address they were imported at.
    pub(super) imports: BTreeMap<u64, LocalImport>,
    pub(super) streams: HashMap<u64, usize>,
    pub(super) null_stream: Option<usize>,
    pub(super) events: HashMap<u64, LocalEvent>,
    pub(super) next_handle: u64,
    /// What the host thread has synchronized with: merged into every stream it issues to.
    pub(super) host_clock: Box<Clock>,
    pub(super) vmm: HashMap<u64, VmmAlloc>,
    pub(super) reservations: BTreeMap<u64, u64>,
    pub(super) maps: BTreeMap<u64, VmmMap>,
    /// `cuMemAlloc` allocations by address: the handle and reservation behind each.
    pub(super) plain: HashMap<u64, (VmmHandle, u64)>,
    pub(super) next_va: u64,
    pub(super) host_registered: BTreeMap<usize, HostRegistration>,
    /// This process's context faulted (a store through a bad address): every call that
    /// touches the GPU fails from now on, as with a real sticky error.
    pub(super) context_lost: bool,
    /// The last `CU_POINTER_ATTRIBUTE_BUFFER_ID` handed out: per process and increasing, as
    /// the real driver's ids are, so recycled memory gets a new one.
    pub(super) last_buffer_id: u64,
    /// Buffer ids of this process's live pool allocations, by (block, generation).
    pub(super) buffer_ids: HashMap<(usize, u64), u64>,
    /// Memory lent to this process for a job ([`SimDriver::lend`](super::SimDriver::lend)).
    pub(super) lent: Vec<Lent>,
    /// Memory lent for jobs that ended, latest last (at most [`RETURNED`]): an access after
    /// its job names it in reports.
    pub(super) returned: std::collections::VecDeque<(u64, u64, super::state::Label)>,
    /// The event [`SimDriver::lend`](super::SimDriver::lend) records to mark where a job's
    /// stream stood.
    pub(super) lend_marker: Option<u64>,
}

/// How many ranges of memory lent for ended jobs [`Local::returned`] remembers.
pub(super) const RETURNED: usize = 64;

/// Memory lent for a job: reached only by streams ordered after operation `seq` of stream
/// slot `slot` (the job's stream once it waited for READY), written only if not read-only,
/// and every write to it ordered before DONE.
#[derive(Clone, Debug)]
pub(super) struct Lent {
    pub(super) job: u64,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) mem: super::hb::Mem,
    pub(super) slot: usize,
    pub(super) seq: u64,
    pub(super) read_only: bool,
    pub(super) label: super::state::Label,
    /// Already reported: once per lending is enough.
    pub(super) reported: bool,
}

impl Local {
    /// The tables of a simulated process that has done nothing yet.
    pub(super) fn new() -> Local {
        Local {
            device: None,
            pools: HashMap::new(),
            current_pool: HashMap::new(),
            default_pool: HashMap::new(),
            imports: BTreeMap::new(),
            streams: HashMap::new(),
            null_stream: None,
            events: HashMap::new(),
            next_handle: 0x10,
            host_clock: Box::new([0; MAX_STREAMS]),
            vmm: HashMap::new(),
            reservations: BTreeMap::new(),
            maps: BTreeMap::new(),
            plain: HashMap::new(),
            next_va: VMM_BASE,
            lent: Vec::new(),
            returned: std::collections::VecDeque::new(),
            lend_marker: None,
            host_registered: BTreeMap::new(),
            context_lost: false,
            last_buffer_id: 0,
            buffer_ids: HashMap::new(),
        }
    }
    pub(super) fn new_buffer_id(&mut self) -> u64 {
        self.last_buffer_id += 1;
        self.last_buffer_id
    }
}

/// A range registered with `cuMemHostRegister`.
#[derive(Debug, Clone, Copy)]
pub(super) struct HostRegistration {
    pub(super) bytes: usize,
    /// (device, inode, file offset of the first byte), when the range is one file mapping.
    pub(super) file: Option<(u64, u64, u64)>,
}

/// Host bytes a queued copy reads or writes.
pub(super) enum HostBuf {
    /// The caller's memory, `(address, length)`, which the caller keeps valid and untouched
    /// until the copy ran (the asynchronous copies' contract).
    Raw(usize, usize),
    /// A buffer of the simulation's own: a synchronous copy waits for its copy to run, then
    /// moves the bytes between it and the caller's slice.
    Owned(Arc<Mutex<Vec<u8>>>),
}

impl HostBuf {
    pub(super) fn len(&self) -> usize {
        match self {
            HostBuf::Raw(_, n) => *n,
            HostBuf::Owned(b) => b.lock().map_or(0, |v| v.len()),
        }
    }

    /// Device to host: `self.len()` bytes of `map` from `off` into the host bytes.
    pub(super) fn fill_from(&self, map: &Mapping, off: usize) {
        match self {
            HostBuf::Raw(p, n) => {
                // SAFETY: the asynchronous copy's caller promised `[p, p + n)` is valid for
                // writes and not touched by anyone else until the copy completed, which is
                // now (this runs as the copy).
                let dst = unsafe { std::slice::from_raw_parts_mut(*p as *mut u8, *n) };
                map.read(off, dst);
            }
            HostBuf::Owned(b) => {
                if let Ok(mut v) = b.lock() {
                    map.read(off, &mut v);
                }
            }
        }
    }

    /// Host to device: the host bytes into `map` from `off`.
    pub(super) fn store_into(&self, map: &Mapping, off: usize) {
        match self {
            HostBuf::Raw(p, n) => {
                // SAFETY: the asynchronous copy's caller promised `[p, p + n)` is valid for
                // reads and not written until the copy completed, which is now.
                let src = unsafe { std::slice::from_raw_parts(*p as *const u8, *n) };
                map.write(off, src);
            }
            HostBuf::Owned(b) => {
                if let Ok(v) = b.lock() {
                    map.write(off, &v);
                }
            }
        }
    }
}
