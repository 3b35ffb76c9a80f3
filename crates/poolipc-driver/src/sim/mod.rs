//! `SimDriver`: the CUDA driver simulated faithfully across real processes, for machines
//! without a GPU. Chosen explicitly with [`SimDriver::new`]; nothing falls back to it.
//!
//! # The simulated machine
//!
//! [`SimDriver::new`] creates a machine: a shared memfd holding the allocation table, the
//! streams' and events' clocks and the violation log, behind a lock that survives a process
//! killed while holding it. Another process attaches to the same machine with
//! [`SimDriver::from_env`], after the parent passed [`SimDriver::child_env`] to
//! `std::process::Command::env`. Each `SimDriver` value is one simulated process;
//! [`SimDriver::peer`] gives a second one inside the same OS process, for quick unit tests.
//!
//! Every memory pool is a sparse memfd whose first page names the machine and the pool; its
//! shareable handle ([`Driver::mem_pool_export_fd`]) is that memfd, a real FD that travels by
//! SCM_RIGHTS. A pointer import maps it, so two processes share real bytes. Pointer export
//! data is 64 bytes naming the machine, the pool and the allocation's range (address and
//! size): as on driver 580 (`reuse_blob.py`, docs/facts.md), the export of an address is the
//! same bytes every time for the same size, and an import maps the range the blob names at
//! that address, whatever allocation lives there now (its reads see the new allocation's
//! bytes, its writes reach it, and the race detector sees its accesses as accesses to that
//! pool memory). An import whose range is larger than the live allocation there is a
//! recorded [`ViolationKind::ImportBeyondAllocation`]. With [`SimConfig::blob_per_allocation`]
//! the simulated driver behaves the other way: the blob names the allocation and its
//! generation, and an old allocation's blob does not import once the address holds a new
//! allocation, so a reuse of old blobs fails as it would on such a driver.
//!
//! Device addresses are not host addresses: each process sees its own pools at
//! `0x1_0000_0000_0000 + slot * 128 GiB`, imported pools at `0x2_...`, VMM reservations at
//! `0x3_...`, so an exporter's pointer used by an importer is caught as an unmapped access.
//! Every pool allocation, pointer import and VMM mapping gets a buffer id
//! (`CU_POINTER_ATTRIBUTE_BUFFER_ID`) from a per-process counter, so memory the pool hands
//! out again has a new one, as on the H200.
//!
//! # What it enforces
//!
//! As errors, with the call and code the real driver gives: pointer export before the pool's
//! FD export (`cuMemPoolExportPointer`, `INVALID_VALUE`), import of a stale or foreign blob
//! (`cuMemPoolImportPointer`, `INVALID_VALUE`), freeing what is not an allocation or a live
//! import (`cuMemFreeAsync`, `INVALID_VALUE`), touching unmapped memory (`ILLEGAL_ADDRESS`).
//!
//! As [`Violation`]s, readable machine-wide with [`SimDriver::violations`]: the exporter
//! freeing while an import is live (imports of dead processes are dropped first, as the real
//! driver drops them at exit), memory touched before the other process's last write was
//! ordered before it (a vector-clock happens-before model: writes stamp the stream's clock,
//! `cuEventRecord` captures it, `cuStreamWaitEvent` and host synchronization merge it), use of
//! an import after its free or after its alias's free, use of an import whose allocation was
//! recycled (generations), access without `cuMemSetAccess`. The same happens-before model
//! covers host memory registered with `cuMemHostRegister` when it is a shared file mapping
//! (the memfd of host staging): an asynchronous copy into it must be ordered after the other
//! process's last copy out of or into those bytes, and a copy out of it after the other
//! process's last copy into them, both by file offset, so the two processes' mappings meet.
//!
//! A pointer import spanning more than 128 chunks of 32 MiB is a recorded violation. As on
//! driver 580, one of 129 to 164 chunks still imports (libcuda's stack overflow only hits dead
//! bytes) and one above 164 kills the importing process with SIGSEGV; with
//! [`SimConfig::import_crash`] off, every import over 128 chunks fails with
//! [`crate::DriverError::ImportOverLimit`] instead.
//!
//! # Streams run asynchronously
//!
//! As on a GPU, a call that queues work returns before the work runs: each simulated process
//! has an engine (`exec`) that runs every stream's queue in order, after the events it waits
//! on, at a random moment (bounded by [`DELAY_ENV`], seeded by [`SEED_ENV`]), interleaving
//! streams at random. Events complete when the engine reaches their record;
//! `cuEventQuery` says so, `cuEventSynchronize` and `cuStreamSynchronize` block until then,
//! and the synchronous copies (`cuMemcpyDtoH`, `cuMemcpyHtoD`) run on the process's legacy
//! stream (which, as on hardware, does not wait for the non-blocking streams
//! [`Driver::stream_create`] makes) and wait for their own completion only. A missing wait
//! therefore shows up as wrong bytes, as it does on hardware.
//!
//! # The race detector
//!
//! Every access to memory (a memset, a copy's source and destination, a kernel's store, an
//! allocation, a free, a copy into or out of registered host memory) is checked, when it is
//! issued, against every earlier access to the same bytes by any stream of any live process
//! (whether or not it ran yet): unless one of the two only reads, the earlier one must be
//! ordered before it (its stream's clock, carried by events, waits and host synchronizes, is
//! known to the accessing stream), else an [`ViolationKind::UnorderedAccess`] is recorded,
//! naming both calls, both processes and the allocation. An access that runs after the
//! allocation it touched was freed is an [`ViolationKind::UnmappedAccess`] when it runs.

mod exec;
mod machine;
mod shm;
mod state;
mod violation;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub use exec::{DELAY_ENV, SEED_ENV};
use exec::{Engine, Step};
use machine::Machine;
use shm::{Mapping, backing_file, my_pid, punch_hole, sparse_memfd};
use state::{AccessRec, MAX_ACCESSES, POOL_DEV};
use state::{
    BLOCK_CACHED, BLOCK_LIVE, CHUNK, Clock, GRANULE, IMPORT_CHUNK_LIMIT, MAX_STREAMS, MemoryWork,
    POOL_DYING, POOL_LIVE, State, chunks_spanned, merge,
};
pub use violation::{Violation, ViolationKind};

use crate::api::Driver;
use crate::error::{CuCode, DriverError, Result};
use crate::types::{
    Access, DeviceInfo, DevicePtr, DeviceUuid, DriverKind, EventBlob, EventHandle, ExportBlob,
    Granularity, PoolAttribute, PoolCounter, PoolHandle, PoolSharing, StreamHandle, VmmHandle,
};

/// The environment variable [`SimDriver::child_env`] sets and [`SimDriver::from_env`] reads.
pub const MACHINE_ENV: &str = "POOLIPC_SIM_MACHINE";

/// The simulated `CUDA_VISIBLE_DEVICES`: which of the machine's devices this process sees, in
/// which order. Read when a process makes or attaches to a machine. A comma-separated list of
/// machine indices (`2,0`) or UUIDs (`GPU-…`, as [`DeviceUuid`] prints them); as with the real
/// variable, the list ends at the first entry that names no device or names one twice, and an
/// empty value hides every device. Unset: all devices, in machine order.
///
/// A variable of its own rather than `CUDA_VISIBLE_DEVICES` itself, so that the simulated
/// machine in a test on a GPU host does not take the real GPU's setting.
pub const VISIBLE_ENV: &str = "POOLIPC_SIM_VISIBLE_DEVICES";

const OWN_BASE: u64 = 1 << 48;
const IMPORT_BASE: u64 = 2 << 48;
const VMM_BASE: u64 = 3 << 48;
/// Address space per pool: the most memory a simulated device may have.
const POOL_SPAN: u64 = 128 << 30;
/// The pool memfd's first page is its header; memory starts after it.
const POOL_HEADER: u64 = 4096;
/// Freed memory is filled with this byte (the first 64 MiB of each freed block).
pub const POISON: u8 = 0xDB;
/// Bytes of a freed block that are poisoned; beyond, poisoning would page in gigabytes.
const POISON_LIMIT: u64 = 64 << 20;
const MIB: u64 = 1 << 20;

/// How the simulated machine looks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Simulated devices, each with its own UUID (1 to 8).
    pub devices: u32,
    /// Device memory per device, in bytes (at most 128 GiB; the memfds are sparse, so only
    /// what is written costs host memory).
    pub memory_per_device: u64,
    /// Emulate libcuda's crash: a pointer import over 128 chunks of 32 MiB kills the
    /// importing process with SIGSEGV. Off: the import fails with
    /// [`crate::DriverError::ImportOverLimit`] instead.
    pub import_crash: bool,
    /// Whether distinct devices can reach each other's memory (`cuDeviceCanAccessPeer`, and
    /// `cuMemPoolSetAccess` for another device than the pool's). Off: a machine whose GPUs
    /// share no NVLink or PCIe peer path.
    pub peer_access: bool,
    /// Every process on the machine is an MPS client: `DeviceInfo::mps_client` says so, and a
    /// GPU fault in one process ([`Driver::launch_store_kernel`] through a bad address) ends
    /// every process's context, as on the H200 under MPS. Off: only the faulting process's.
    pub mps: bool,
    /// Each allocation's pointer export names that allocation (its generation), so an old
    /// allocation's export does not import once the pool handed its address out again, and
    /// the new allocation's export differs from the old. Off (the default): driver 580's
    /// behaviour, the export of an address and size is the same bytes every time and maps
    /// whatever lives there (see the [module docs](self)). On: a driver on which poolipc's
    /// startup check of export reuse must fail, so that its fallback is tested.
    pub blob_per_allocation: bool,
}

impl Default for SimConfig {
    /// One device of 16 GiB, import crash emulated, devices peers of each other.
    fn default() -> Self {
        SimConfig {
            devices: 1,
            memory_per_device: 16 << 30,
            import_crash: true,
            peer_access: true,
            mps: false,
            blob_per_allocation: false,
        }
    }
}

/// One simulated process on a simulated machine. See the [module docs](self).
pub struct SimDriver {
    machine: Arc<Machine>,
    /// This process's ordinals: machine device indices, in visible order.
    visible: Vec<u32>,
    agent: u64,
    pid: u32,
    local: Arc<Mutex<Local>>,
    engine: Engine,
}

impl std::fmt::Debug for SimDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDriver")
            .field("machine", &format_args!("{:#x}", self.machine.id))
            .field("agent", &self.agent)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct LocalPool {
    fd: OwnedFd,
    map: Mapping,
    generation: u64,
    device: u32,
    imported: bool,
    destroyed: bool,
    /// Access by device, for imported pools (own pools: their device has read-write).
    access: Vec<Access>,
}

#[derive(Debug, Clone, Copy)]
struct LocalImport {
    record: usize,
    pool: usize,
    block: usize,
    generation: u64,
    bytes: u64,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID` of the import in this process.
    buffer_id: u64,
}

#[derive(Debug)]
struct LocalEvent {
    slot: usize,
    generation: u64,
    owner: bool,
}

#[derive(Debug)]
struct VmmAlloc {
    fd: OwnedFd,
    bytes: u64,
    /// The device the memory is on (an import's: the importing context's device).
    device: u32,
    /// Created with the POSIX FD handle type: `cuMemExportToShareableHandle` works.
    exportable: bool,
}

#[derive(Debug)]
struct VmmMap {
    map: Mapping,
    bytes: u64,
    access: Access,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID` of the mapping.
    buffer_id: u64,
    /// (device, inode) of the memfd behind the handle: how the race detector names it.
    file: (u64, u64),
    /// The memfd behind the handle, for `cuMemRetainAllocationHandle`.
    fd: OwnedFd,
    /// The device the memory is on.
    device: u32,
    /// The handle was made with the POSIX FD handle type.
    exportable: bool,
    /// `cuMemAlloc` memory, which this simulation keeps as a mapping of an unexportable
    /// handle (so the race detector covers it as it covers VMM memory): no handle can be
    /// retained from it.
    plain: bool,
}

#[derive(Debug)]
struct Local {
    device: Option<u32>,
    pools: HashMap<usize, LocalPool>,
    current_pool: HashMap<u32, usize>,
    default_pool: HashMap<u32, usize>,
    /// Live imports by the address they were imported at.
    imports: BTreeMap<u64, LocalImport>,
    streams: HashMap<u64, usize>,
    null_stream: Option<usize>,
    events: HashMap<u64, LocalEvent>,
    next_handle: u64,
    /// What the host thread has synchronized with: merged into every stream it issues to.
    host_clock: Box<Clock>,
    vmm: HashMap<u64, VmmAlloc>,
    reservations: BTreeMap<u64, u64>,
    maps: BTreeMap<u64, VmmMap>,
    /// `cuMemAlloc` allocations by address: the handle and reservation behind each.
    plain: HashMap<u64, (VmmHandle, u64)>,
    next_va: u64,
    host_registered: BTreeMap<usize, HostRegistration>,
    /// This process's context faulted (a store through a bad address): every call that
    /// touches the GPU fails from now on, as with a real sticky error.
    context_lost: bool,
    /// The last `CU_POINTER_ATTRIBUTE_BUFFER_ID` handed out: per process and increasing, as
    /// the real driver's ids are, so recycled memory gets a new one.
    last_buffer_id: u64,
    /// Buffer ids of this process's live pool allocations, by (block, generation).
    buffer_ids: HashMap<(usize, u64), u64>,
}

impl Local {
    fn new_buffer_id(&mut self) -> u64 {
        self.last_buffer_id += 1;
        self.last_buffer_id
    }
}

/// A range registered with `cuMemHostRegister`.
#[derive(Debug, Clone, Copy)]
struct HostRegistration {
    bytes: usize,
    /// (device, inode, file offset of the first byte), when the range is one file mapping.
    file: Option<(u64, u64, u64)>,
}

/// Host bytes a queued copy reads or writes.
enum HostBuf {
    /// The caller's memory, `(address, length)`, which the caller keeps valid and untouched
    /// until the copy ran (the asynchronous copies' contract).
    Raw(usize, usize),
    /// A buffer of the simulation's own: a synchronous copy waits for its copy to run, then
    /// moves the bytes between it and the caller's slice.
    Owned(Arc<Mutex<Vec<u8>>>),
}

impl HostBuf {
    fn len(&self) -> usize {
        match self {
            HostBuf::Raw(_, n) => *n,
            HostBuf::Owned(b) => b.lock().map_or(0, |v| v.len()),
        }
    }

    /// Device to host: `self.len()` bytes of `map` from `off` into the host bytes.
    fn fill_from(&self, map: &Mapping, off: usize) {
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
    fn store_into(&self, map: &Mapping, off: usize) {
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

/// The UUID of device `index` of machine `machine`.
fn sim_uuid(machine: u64, index: u32) -> DeviceUuid {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&machine.to_le_bytes());
    b[8..12].copy_from_slice(&0x5349_4d00_u32.to_le_bytes());
    b[12..].copy_from_slice(&index.to_le_bytes());
    DeviceUuid(b)
}

/// The machine indices a process sees, in its ordinal order (see [`VISIBLE_ENV`]).
fn visible_devices(machine: u64, devices: u32, setting: Option<&str>) -> Vec<u32> {
    let Some(setting) = setting else {
        return (0..devices).collect();
    };
    let mut seen = Vec::new();
    for entry in setting.split(',').map(str::trim) {
        let index = match entry.parse::<u32>() {
            Ok(i) => (i < devices).then_some(i),
            Err(_) => {
                (0..devices).find(|&i| sim_uuid(machine, i).to_string().eq_ignore_ascii_case(entry))
            }
        };
        match index {
            Some(i) if !seen.contains(&i) => seen.push(i),
            // The real driver stops at the first entry it cannot use.
            _ => break,
        }
    }
    seen
}

fn fail(call: &'static str, code: CuCode) -> DriverError {
    DriverError::Call { call, code }
}

fn pool_handle(slot: usize, generation: u64) -> PoolHandle {
    PoolHandle((generation << 8) | slot as u64)
}

/// Where a device address points in this process.
#[derive(Clone, Copy, Debug)]
enum Place {
    Pool(usize, u64),
    Vmm(u64, u64),
}

/// The bytes an access touches, as the race detector names them: (device, inode) of the file
/// behind them (pool memory: [`POOL_DEV`] and the pool's slot), a range of file offsets, and
/// the pool allocation `(block, generation)` where the memory is one.
#[derive(Clone, Copy, Debug)]
struct Mem {
    dev: u64,
    ino: u64,
    start: u64,
    end: u64,
    alloc: Option<(usize, u64)>,
}

impl Mem {
    fn pool(slot: usize, off: u64, len: u64, alloc: Option<(usize, u64)>) -> Mem {
        Mem {
            dev: POOL_DEV,
            ino: slot as u64,
            start: off,
            end: off.saturating_add(len),
            alloc,
        }
    }
}

impl SimDriver {
    /// A new simulated machine, and this process as the first on it.
    pub fn new(config: SimConfig) -> Result<SimDriver> {
        if config.devices == 0 || config.devices as usize > state::MAX_DEVICES {
            return Err(DriverError::InvalidArgument {
                call: "SimDriver::new",
                reason: format!(
                    "{} devices: 1 to {} are simulated",
                    config.devices,
                    state::MAX_DEVICES
                ),
            });
        }
        if config.memory_per_device < GRANULE || config.memory_per_device > POOL_SPAN {
            return Err(DriverError::InvalidArgument {
                call: "SimDriver::new",
                reason: format!(
                    "{} bytes per device: 2 MiB to 128 GiB are simulated",
                    config.memory_per_device
                ),
            });
        }
        let machine = Machine::create(&config)?;
        Ok(SimDriver::on(Arc::new(machine)))
    }

    /// Attaches this process to the machine named by [`MACHINE_ENV`], which a parent set with
    /// [`child_env`](SimDriver::child_env). The parent must still be alive.
    ///
    /// `None` when the variable is not set (this process was not given a simulated machine:
    /// the caller decides what that means, e.g. use the real driver); `Some(Err(_))` when it is
    /// set but the machine cannot be attached.
    #[must_use]
    pub fn from_env() -> Option<Result<SimDriver>> {
        let value = std::env::var(MACHINE_ENV).ok()?;
        Some(SimDriver::attach(&value))
    }

    /// Attaches to the machine a [`child_env`](SimDriver::child_env) value names.
    pub fn attach(value: &str) -> Result<SimDriver> {
        let bad = || DriverError::InvalidArgument {
            call: "SimDriver::from_env",
            reason: format!("{MACHINE_ENV}={value:?} is not `pid:fd:machine`"),
        };
        let mut it = value.split(':');
        let pid: u32 = it.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let fd: i32 = it.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let id = it
            .next()
            .and_then(|s| u64::from_str_radix(s, 16).ok())
            .ok_or_else(bad)?;
        Ok(SimDriver::on(Arc::new(Machine::attach(pid, fd, id)?)))
    }

    /// The environment variable that lets a child process attach to this machine with
    /// [`from_env`](SimDriver::from_env): pass it to `std::process::Command::env`.
    ///
    /// The child opens the machine through `/proc/<this pid>/fd/<fd>`, so this process must
    /// outlive the attach (not the child).
    #[must_use]
    pub fn child_env(&self) -> (&'static str, String) {
        let (pid, fd) = self.machine.locator();
        (MACHINE_ENV, format!("{pid}:{fd}:{:x}", self.machine.id))
    }

    /// Another simulated process on the same machine, inside this OS process: imports,
    /// pools, streams and events are its own, as if it were a separate process. For unit
    /// tests; real processes use [`child_env`](SimDriver::child_env).
    #[must_use]
    pub fn peer(&self) -> SimDriver {
        SimDriver::on(Arc::clone(&self.machine))
    }

    /// Like [`peer`](SimDriver::peer), for a process whose [`VISIBLE_ENV`] is `visible`.
    #[must_use]
    pub fn peer_seeing(&self, visible: &str) -> SimDriver {
        SimDriver::on_seeing(Arc::clone(&self.machine), Some(visible))
    }

    /// The simulated machine's identity (also in device UUIDs).
    #[must_use]
    pub fn machine_id(&self) -> u64 {
        self.machine.id
    }

    /// Every violation any process recorded on this machine so far, oldest first (the first
    /// 1024; [`violation_count`](SimDriver::violation_count) counts all).
    #[must_use]
    pub fn violations(&self) -> Vec<Violation> {
        self.machine.with(|st| {
            let n = (st.violation_count as usize).min(st.violations.len());
            st.violations[..n]
                .iter()
                .filter_map(|v| {
                    Some(Violation {
                        kind: ViolationKind::from_u32(v.kind)?,
                        call: violation::call_name(v.call),
                        pid: v.pid,
                        other_pid: (v.other_pid != 0).then_some(v.other_pid),
                        generation: (v.generation != 0).then_some(v.generation),
                        other_call: (v.other_call != 0).then(|| violation::call_name(v.other_call)),
                        detail: (v.a, v.b),
                    })
                })
                .collect()
        })
    }

    /// Forgets every recorded violation (a test that provoked one on purpose, after checking
    /// it, so that later checks see only new ones).
    pub fn clear_violations(&self) {
        self.machine.with(|st| st.violation_count = 0);
    }

    /// How many violations were recorded on this machine.
    #[must_use]
    pub fn violation_count(&self) -> u64 {
        self.machine.with(|st| st.violation_count)
    }

    fn on(machine: Arc<Machine>) -> SimDriver {
        let visible = std::env::var(VISIBLE_ENV).ok();
        SimDriver::on_seeing(machine, visible.as_deref())
    }

    fn on_seeing(machine: Arc<Machine>, visible: Option<&str>) -> SimDriver {
        let agent = machine.with(State::next_id);
        let visible = visible_devices(machine.id, machine.devices, visible);
        if visible.len() != machine.devices as usize {
            tracing::debug!(?visible, "simulated devices visible to this process");
        }
        SimDriver {
            machine,
            visible,
            agent,
            pid: my_pid(),
            engine: Engine::new(agent),
            local: Arc::new(Mutex::new(Local {
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
                host_registered: BTreeMap::new(),
                context_lost: false,
                last_buffer_id: 0,
                buffer_ids: HashMap::new(),
            })),
        }
    }

    fn local(&self) -> MutexGuard<'_, Local> {
        // A panic while holding it leaves plain bookkeeping behind: keep going.
        self.local
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The machine's index of the device this process calls `ordinal` (see [`VISIBLE_ENV`]).
    fn device_check(&self, call: &'static str, ordinal: u32) -> Result<u32> {
        self.visible
            .get(ordinal as usize)
            .copied()
            .ok_or(fail(call, CuCode::INVALID_DEVICE))
    }

    /// Fails `call` with `CUDA_ERROR_ILLEGAL_ADDRESS` once this process's context is lost:
    /// it faulted itself, or another MPS client faulted (see [`SimConfig::mps`]).
    fn check_context(&self, call: &'static str) -> Result<()> {
        let lost =
            self.local().context_lost || self.machine.with(|st| st.mps & state::MPS_FAULTED != 0);
        if lost {
            Err(fail(call, CuCode::ILLEGAL_ADDRESS))
        } else {
            Ok(())
        }
    }

    fn context(l: &Local, call: &'static str) -> Result<u32> {
        l.device.ok_or(fail(call, CuCode::INVALID_CONTEXT))
    }

    fn uuid(&self, index: u32) -> DeviceUuid {
        sim_uuid(self.machine.id, index)
    }

    /// Creates a pool in the machine and maps it here.
    fn create_pool(&self, l: &mut Local, ordinal: u32, shareable: bool) -> Result<usize> {
        let capacity = self.machine.memory;
        let fd = sparse_memfd("poolipc-sim-pool", POOL_HEADER + capacity)?;
        let made = self.machine.with(|st| {
            st.pool_create(ordinal, shareable, capacity, self.agent, self.pid)
                .or_else(|| {
                    reap(st);
                    st.pool_create(ordinal, shareable, capacity, self.agent, self.pid)
                })
                .map(|slot| (slot, st.pools[slot].generation))
        });
        let (slot, generation) = made.ok_or(fail("cuMemPoolCreate", CuCode::OUT_OF_MEMORY))?;
        let mut header = [0u8; 32];
        for (i, v) in [state::MAGIC, self.machine.id, slot as u64, generation]
            .iter()
            .enumerate()
        {
            header[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        nix::sys::uio::pwrite(&fd, &header, 0).map_err(|e| shm::os("pwrite", e))?;
        let map = Mapping::new(&fd, POOL_HEADER, capacity)?;
        l.pools.insert(
            slot,
            LocalPool {
                fd,
                map,
                generation,
                device: ordinal,
                imported: false,
                destroyed: false,
                access: Vec::new(),
            },
        );
        Ok(slot)
    }

    fn default_pool(&self, l: &mut Local, ordinal: u32) -> Result<usize> {
        if let Some(&p) = l.default_pool.get(&ordinal) {
            return Ok(p);
        }
        let p = self.create_pool(l, ordinal, false)?;
        l.default_pool.insert(ordinal, p);
        Ok(p)
    }

    /// The slot of a pool handle valid in this process.
    fn pool_slot(l: &Local, call: &'static str, pool: PoolHandle) -> Result<usize> {
        let slot = (pool.0 & 0xff) as usize;
        match l.pools.get(&slot) {
            Some(p) if p.generation == pool.0 >> 8 && !p.destroyed => Ok(slot),
            _ => Err(fail(call, CuCode::INVALID_VALUE)),
        }
    }

    fn own_pool_slot(l: &Local, call: &'static str, pool: PoolHandle) -> Result<usize> {
        let slot = Self::pool_slot(l, call, pool)?;
        if l.pools[&slot].imported {
            return Err(fail(call, CuCode::INVALID_VALUE));
        }
        Ok(slot)
    }

    /// The machine stream slot for a stream handle; the host's knowledge flows into it first
    /// (work issued after a host synchronize is ordered after what it waited for).
    fn stream_slot(
        &self,
        l: &mut Local,
        st: &mut State,
        call: &'static str,
        s: StreamHandle,
    ) -> Result<usize> {
        let slot = if s == StreamHandle::NULL {
            match l.null_stream {
                Some(x) if st.streams[x].live == 1 && st.streams[x].agent == self.agent => x,
                _ => {
                    let x = st
                        .stream_create(self.agent, self.pid)
                        .or_else(|| {
                            reap(st);
                            st.stream_create(self.agent, self.pid)
                        })
                        .ok_or(fail(call, CuCode::OUT_OF_MEMORY))?;
                    l.null_stream = Some(x);
                    x
                }
            }
        } else {
            *l.streams
                .get(&s.0)
                .ok_or(fail(call, CuCode::INVALID_HANDLE))?
        };
        merge(&mut st.streams[slot].clock, &l.host_clock);
        Ok(slot)
    }

    fn event<'l>(
        l: &'l Local,
        st: &State,
        call: &'static str,
        e: EventHandle,
    ) -> Result<&'l LocalEvent> {
        match l.events.get(&e.0) {
            Some(ev)
                if st.events[ev.slot].live == 1
                    && st.events[ev.slot].generation == ev.generation =>
            {
                Ok(ev)
            }
            _ => Err(fail(call, CuCode::INVALID_HANDLE)),
        }
    }

    /// Applies the releases (not the poisoning) that a state change left to do.
    fn apply_release(l: &Local, pool: usize, work: &MemoryWork) {
        let Some(p) = l.pools.get(&pool) else { return };
        for &(off, len) in &work.release {
            punch_hole(&p.fd, POOL_HEADER + off, len);
        }
    }

    /// Applies poisoning and releases that a state change left to do.
    fn apply(l: &Local, pool: usize, work: &MemoryWork) {
        let Some(p) = l.pools.get(&pool) else { return };
        for &(off, len) in &work.poison {
            let n = len.min(POISON_LIMIT);
            if let (Ok(o), Ok(n)) = (usize::try_from(off), usize::try_from(n)) {
                p.map.fill(o, POISON, n);
            }
        }
        for &(off, len) in &work.release {
            punch_hole(&p.fd, POOL_HEADER + off, len);
        }
    }

    /// Pools of this process give back what exceeds their release threshold, as the real
    /// driver does at a synchronize.
    fn release_at_sync(&self, l: &Local, st: &mut State) {
        for (&slot, p) in &l.pools {
            if p.imported || st.pools[slot].state == state::POOL_FREE {
                continue;
            }
            let mut work = MemoryWork::default();
            let keep = st.pools[slot].release_threshold;
            st.release_cached(slot, keep, &mut work);
            Self::apply(l, slot, &work);
        }
    }

    /// Resolves `[ptr, ptr + len)` for an access, checking every rule but ordering (which
    /// [`access`](Self::access) checks once the operation has its sequence number).
    /// Violations are recorded; an unmapped range is also an error.
    #[allow(clippy::too_many_arguments)] // one call site per kind of access; a struct would only rename them
    fn touch(
        &self,
        l: &Local,
        st: &mut State,
        call: &'static str,
        ptr: DevicePtr,
        len: u64,
        write: bool,
    ) -> Result<(Place, Mem)> {
        let p = ptr.0;
        let unmapped = |st: &mut State| {
            st.violation(ViolationKind::UnmappedAccess, call, self.pid)
                .values(p, len)
                .log();
            fail(call, CuCode::ILLEGAL_ADDRESS)
        };
        let within = |start: u64, size: u64| p >= start && p.saturating_add(len) <= start + size;
        // Own pools.
        if (OWN_BASE..IMPORT_BASE).contains(&p) {
            let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
            let off = (p - OWN_BASE) % POOL_SPAN;
            let Some(lp) = l.pools.get(&slot).filter(|lp| !lp.imported) else {
                return Err(unmapped(st));
            };
            let _ = lp;
            let Some(b) = st.block_containing(slot, off) else {
                return Err(unmapped(st));
            };
            let (state, start, size, generation_, requested) = {
                let r = &st.blocks[b];
                (r.state, r.offset, r.size, r.generation, r.bytes)
            };
            if !within(OWN_BASE + slot as u64 * POOL_SPAN + start, size) {
                return Err(unmapped(st));
            }
            // Past the size asked for, inside the pool's rounding: driver 580 refuses the
            // call (INVALID_VALUE, measured on the H200 with a memset 2 bytes too long).
            if state == BLOCK_LIVE && !within(OWN_BASE + slot as u64 * POOL_SPAN + start, requested)
            {
                return Err(fail(call, CuCode::INVALID_VALUE));
            }
            match state {
                BLOCK_LIVE => {}
                // Freed but still reserved: the GPU would not fault, but it is use after free.
                BLOCK_CACHED => {
                    st.violation(ViolationKind::UnmappedAccess, call, self.pid)
                        .block(b, generation_)
                        .values(p, len)
                        .log();
                    return Ok((Place::Pool(slot, off), Mem::pool(slot, off, len, None)));
                }
                _ => return Err(unmapped(st)),
            }
            return Ok((
                Place::Pool(slot, off),
                Mem::pool(slot, off, len, Some((b, generation_))),
            ));
        }
        // Imports.
        if (IMPORT_BASE..VMM_BASE).contains(&p) {
            let Some((&base, imp)) = l.imports.range(..=p).next_back() else {
                return Err(unmapped(st));
            };
            if !within(base, imp.bytes.next_multiple_of(GRANULE)) {
                return Err(unmapped(st));
            }
            if !within(base, imp.bytes) {
                return Err(fail(call, CuCode::INVALID_VALUE));
            }
            let imp = *imp;
            let dev = l.device.or(self.visible.first().copied()).unwrap_or(0) as usize;
            let access = l
                .pools
                .get(&imp.pool)
                .and_then(|lp| lp.access.get(dev).copied());
            let allowed = match access {
                Some(Access::ReadWrite) => true,
                Some(Access::Read) => !write,
                _ => false,
            };
            if !allowed {
                st.violation(ViolationKind::NoAccess, call, self.pid)
                    .block(imp.block, imp.generation)
                    .values(p, len)
                    .log();
                return Err(fail(call, CuCode::ILLEGAL_ADDRESS));
            }
            let off = p - (IMPORT_BASE + imp.pool as u64 * POOL_SPAN);
            let b = &st.blocks[imp.block];
            if b.state != BLOCK_LIVE || b.generation != imp.generation {
                let now = if b.state == BLOCK_LIVE {
                    b.generation
                } else {
                    0
                };
                st.violation(ViolationKind::StaleGeneration, call, self.pid)
                    .block(imp.block, imp.generation)
                    .values(imp.generation, now)
                    .log();
                return Ok((
                    Place::Pool(imp.pool, off),
                    Mem::pool(imp.pool, off, len, None),
                ));
            }
            return Ok((
                Place::Pool(imp.pool, off),
                Mem::pool(imp.pool, off, len, Some((imp.block, imp.generation))),
            ));
        }
        // VMM mappings.
        if let Some((&base, m)) = l.maps.range(..=p).next_back()
            && within(base, m.bytes)
        {
            let allowed = match m.access {
                Access::ReadWrite => true,
                Access::Read => !write,
                Access::None => false,
            };
            if !allowed {
                st.violation(ViolationKind::NoAccess, call, self.pid)
                    .values(p, len)
                    .log();
                return Err(fail(call, CuCode::ILLEGAL_ADDRESS));
            }
            let rel = p - base;
            return Ok((
                Place::Vmm(base, rel),
                Mem {
                    dev: m.file.0,
                    ino: m.file.1,
                    start: rel,
                    end: rel + len,
                    alloc: None,
                },
            ));
        }
        Err(unmapped(st))
    }

    /// The race detector: operation `seq` of stream slot `s` (already ticked) reads or writes
    /// `mem`. Every earlier access to overlapping bytes by any stream of any live simulated
    /// process, where one of the two writes, must be ordered before this one by
    /// happens-before (stream order, events recorded and waited on, host synchronizes); else
    /// an [`ViolationKind::UnorderedAccess`] naming both. Whether the earlier access happened
    /// to have run already does not matter: the order must be guaranteed, not lucky. Then
    /// this access is remembered until a write covering it supersedes it, or its process
    /// goes away. An earlier access some host has seen complete (`State::observed`) is
    /// ordered before everything issued later, as on hardware.
    #[allow(clippy::too_many_arguments)] // the access's identity: one call per kind of access
    fn access(
        &self,
        st: &mut State,
        call: &'static str,
        s: usize,
        seq: u64,
        mem: &Mem,
        write: bool,
    ) {
        let mut unordered: Option<(u32, u32, u64, u64)> = None;
        for i in 0..MAX_ACCESSES {
            let r = &st.accesses[i];
            if r.live != 1 {
                continue;
            }
            let (rs, rseq) = (r.stream as usize, r.seq);
            if r.dev != mem.dev || r.ino != mem.ino || r.end <= mem.start || mem.end <= r.start {
                continue;
            }
            if r.write == 0 && !write {
                continue;
            }
            let known = st.streams[s].clock[rs];
            if known >= rseq || st.observed[rs] >= rseq {
                continue;
            }
            if r.pid != self.pid && !Machine::alive(r.pid) {
                // Its process is gone, and its queued work with it.
                st.accesses[i].live = 0;
                continue;
            }
            if unordered.is_none() {
                unordered = Some((r.pid, r.call, rseq, known));
            }
        }
        if let Some((pid, other_call, seq_other, known)) = unordered {
            let mut v = st
                .violation(ViolationKind::UnorderedAccess, call, self.pid)
                .other_pid(pid)
                .other_call(other_call)
                .values(seq_other, known);
            if let Some((b, g)) = mem.alloc {
                v = v.block(b, g);
            }
            v.log();
        }
        // What this access covers is superseded: a write supersedes every earlier access
        // (ordered before it, or reported just now), a read this stream's earlier reads.
        let agent = self.agent;
        for r in st.accesses.iter_mut().filter(|r| {
            r.live == 1
                && r.dev == mem.dev
                && r.ino == mem.ino
                && mem.start <= r.start
                && r.end <= mem.end
                && (write || (r.write == 0 && r.agent == agent && r.stream as usize == s))
        }) {
            r.live = 0;
        }
        let slot = match st.accesses.iter().position(|r| r.live == 0).or_else(|| {
            // Full: forget an access that already ran first.
            st.accesses
                .iter()
                .position(|r| st.streams[r.stream as usize].executed >= r.seq)
        }) {
            Some(i) => i,
            None => {
                // Full: forget one. A forgotten access can only hide a violation, never
                // invent one.
                st.access_cursor = st.access_cursor.wrapping_add(1);
                (st.access_cursor % MAX_ACCESSES as u64) as usize
            }
        };
        st.accesses[slot] = AccessRec {
            live: 1,
            write: u32::from(write),
            pid: self.pid,
            stream: s as u32,
            call: violation::call_code(call),
            _pad: 0,
            dev: mem.dev,
            ino: mem.ino,
            start: mem.start,
            end: mem.end,
            agent,
            seq,
            generation: mem.alloc.map_or(0, |(_, g)| g),
        };
    }

    /// Queues `step` as operation `seq` of stream slot `s` on this process's engine.
    fn issue(&self, s: usize, seq: u64, step: Step) {
        self.engine.push(s, seq, step, &self.local, &self.machine);
    }

    /// When a queued access runs: the mapping and offset of `place`, if the memory is still
    /// there; an access that runs after its allocation was freed (or recycled), or after its
    /// mapping went, is an [`ViolationKind::UnmappedAccess`] and touches nothing.
    fn at_run<'l>(
        l: &'l Local,
        st: &mut State,
        call: &'static str,
        pid: u32,
        place: &Place,
        mem: &Mem,
    ) -> Option<(&'l Mapping, usize)> {
        if let Some((b, g)) = mem.alloc
            && st.freed_ran(g)
        {
            {
                st.violation(ViolationKind::UnmappedAccess, call, pid)
                    .block(b, g)
                    .values(mem.start, mem.end - mem.start)
                    .other_call(violation::call_code("(executed)"))
                    .log();
                return None;
            }
        }
        let found = Self::mapping(l, place);
        if found.is_none() {
            st.violation(ViolationKind::UnmappedAccess, call, pid)
                .values(mem.start, mem.end - mem.start)
                .other_call(violation::call_code("(executed)"))
                .log();
        }
        found
    }

    fn mapping<'l>(l: &'l Local, place: &Place) -> Option<(&'l Mapping, usize)> {
        match *place {
            Place::Pool(slot, off) => Some((&l.pools.get(&slot)?.map, usize::try_from(off).ok()?)),
            Place::Vmm(base, off) => Some((&l.maps.get(&base)?.map, usize::try_from(off).ok()?)),
        }
    }

    fn free(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        const CALL: &str = "cuMemFreeAsync";
        let mut l = self.local();
        let l = &mut *l;
        let (s, seq, step) = self.machine.with(|st| {
            let s = self.stream_slot(l, st, CALL, stream)?;
            if let Some(imp) = l.imports.remove(&ptr.0) {
                // Both aliases of a doubled import share this one record: both are gone.
                st.imports[imp.record].live = 0;
                return Ok((s, st.tick(s), Step::Mark));
            }
            if !(OWN_BASE..IMPORT_BASE).contains(&ptr.0) {
                return Err(fail(CALL, CuCode::INVALID_VALUE));
            }
            let slot = ((ptr.0 - OWN_BASE) / POOL_SPAN) as usize;
            let off = (ptr.0 - OWN_BASE) % POOL_SPAN;
            if l.pools.get(&slot).is_none_or(|p| p.imported) {
                return Err(fail(CALL, CuCode::INVALID_VALUE));
            }
            let b = st
                .live_block_at(slot, off)
                .ok_or(fail(CALL, CuCode::INVALID_VALUE))?;
            let generation_ = st.blocks[b].generation;
            l.buffer_ids.remove(&(b, generation_));
            for pid in st.live_importers(b, generation_, Machine::alive) {
                st.violation(ViolationKind::FreedWhileImported, CALL, self.pid)
                    .block(b, generation_)
                    .other_pid(pid)
                    .log();
            }
            // The free is stream-ordered: it is the allocation's last use, and any access
            // not ordered before it races with whoever gets the memory next. The pool may
            // hand the memory out again at once: on this stream after the free, on another
            // after waiting for it (the pool's internal dependency, see `alloc`).
            let seq = st.tick(s);
            let size = st.blocks[b].size;
            self.access(
                st,
                CALL,
                s,
                seq,
                &Mem::pool(slot, off, size, Some((b, generation_))),
                true,
            );
            let mut work = MemoryWork::default();
            st.free(b, &mut work);
            Self::apply_release(l, slot, &work);
            let poison = work.poison;
            let step = Step::Run(Box::new(move |l: &mut Local, st: &mut State| {
                st.note_freed(generation_);
                // Poisoned when the free runs: memory handed out again on this stream meanwhile
                // gets its new owner's work after (stream order), memory handed out on another
                // stream waited for this free.
                Self::apply(
                    l,
                    slot,
                    &MemoryWork {
                        poison,
                        release: vec![],
                    },
                );
            }));
            Ok((s, seq, step))
        })?;
        self.issue(s, seq, step);
        Ok(())
    }

    fn memset(
        &self,
        call: &'static str,
        ptr: DevicePtr,
        pattern: &[u8],
        count: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let bytes = count
            .checked_mul(pattern.len() as u64)
            .ok_or(fail(call, CuCode::INVALID_VALUE))?;
        if bytes == 0 {
            return Ok(());
        }
        let n = usize::try_from(bytes).map_err(|_| fail(call, CuCode::INVALID_VALUE))?;
        let mut l = self.local();
        let l = &mut *l;
        let (s, seq, place, mem) = self.machine.with(|st| {
            let s = self.stream_slot(l, st, call, stream)?;
            let (place, mem) = self.touch(l, st, call, ptr, bytes, true)?;
            Self::mapping(l, &place).ok_or(fail(call, CuCode::ILLEGAL_ADDRESS))?;
            let seq = st.tick(s);
            self.access(st, call, s, seq, &mem, true);
            Ok((s, seq, place, mem))
        })?;
        let pattern = pattern.to_vec();
        let pid = self.pid;
        self.issue(
            s,
            seq,
            Step::Run(Box::new(move |l: &mut Local, st: &mut State| {
                let Some((map, off)) = Self::at_run(l, st, call, pid, &place, &mem) else {
                    return;
                };
                if pattern.iter().all(|b| *b == pattern[0]) {
                    map.fill(off, pattern[0], n);
                } else {
                    let chunk: Vec<u8> = pattern
                        .iter()
                        .copied()
                        .cycle()
                        .take(pattern.len() * 4096)
                        .collect();
                    let mut done = 0;
                    while done < n {
                        let k = chunk.len().min(n - done);
                        map.write(off + done, &chunk[..k]);
                        done += k;
                    }
                }
            })),
        );
        Ok(())
    }

    /// A copy between device memory at `dev` and the host bytes `host` on `stream`, device
    /// to host when `to_host`: queued, and, for a registered shared host range, checked as an
    /// access of those host bytes too (written by a copy out, read by a copy in). Returns the
    /// stream slot and the operation's sequence number.
    fn host_copy(
        &self,
        call: &'static str,
        dev: DevicePtr,
        host: HostBuf,
        to_host: bool,
        stream: StreamHandle,
    ) -> Result<(usize, u64)> {
        let mut l = self.local();
        let l = &mut *l;
        let shared = match &host {
            HostBuf::Raw(p, n) => Self::host_range(l, *p, *n),
            HostBuf::Owned(_) => None,
        };
        let len = host.len() as u64;
        let (s, seq, place, mem) = self.machine.with(|st| {
            let s = self.stream_slot(l, st, call, stream)?;
            let (place, mem) = self.touch(l, st, call, dev, len, !to_host)?;
            Self::mapping(l, &place).ok_or(fail(call, CuCode::ILLEGAL_ADDRESS))?;
            let seq = st.tick(s);
            self.access(st, call, s, seq, &mem, !to_host);
            if let Some(h) = shared {
                self.access(st, call, s, seq, &h, to_host);
            }
            Ok((s, seq, place, mem))
        })?;
        let pid = self.pid;
        self.issue(
            s,
            seq,
            Step::Run(Box::new(move |l: &mut Local, st: &mut State| {
                let Some((map, off)) = Self::at_run(l, st, call, pid, &place, &mem) else {
                    return;
                };
                if to_host {
                    host.fill_from(map, off);
                } else {
                    host.store_into(map, off);
                }
            })),
        );
        Ok((s, seq))
    }

    /// A synchronous copy on the legacy stream: queued, then waited for (that copy alone:
    /// the legacy stream does not wait for the non-blocking streams); what the host learned
    /// flows into its clock.
    fn sync_on_legacy(&self, s: usize, seq: u64) {
        self.engine.wait_executed(s, seq);
        let mut l = self.local();
        let l = &mut *l;
        self.machine.with(|st| {
            let clock = st.streams[s].clock;
            merge(&mut l.host_clock, &clock);
            merge(&mut st.observed, &clock);
        });
    }

    /// The shared file bytes behind `[ptr, ptr + len)`, when that lies in one registered,
    /// file-backed range, as the race detector names them.
    fn host_range(l: &Local, ptr: usize, len: usize) -> Option<Mem> {
        let (&base, reg) = l.host_registered.range(..=ptr).next_back()?;
        let (dev, ino, file_off) = reg.file?;
        let rel = ptr - base;
        if rel.checked_add(len)? > reg.bytes {
            return None;
        }
        let start = file_off + rel as u64;
        Some(Mem {
            dev,
            ino,
            start,
            end: start + len as u64,
            alloc: None,
        })
    }

    fn host_len(call: &'static str, bytes: u64) -> Result<usize> {
        usize::try_from(bytes).map_err(|_| DriverError::InvalidArgument {
            call,
            reason: format!("{bytes} bytes do not fit usize"),
        })
    }
}

/// Drops what dead processes held (their imports above all) to free table slots.
fn reap(st: &mut State) {
    let mut work = Vec::new();
    st.drop_process(|_, pid| pid != 0 && !Machine::alive(pid), &mut work);
}

impl Drop for SimDriver {
    /// This simulated process exits: the machine drops its imports, pools, streams and its
    /// side of events, as the real driver does when a process exits.
    fn drop(&mut self) {
        // The process exits: its queued GPU work runs first (bounded), as a context's
        // destruction waits for it.
        self.engine.shut_down();
        let agent = self.agent;
        let mut work = Vec::new();
        self.machine
            .with(|st| st.drop_process(|a, _| a == agent, &mut work));
        let l = self.local();
        for (pool, w) in &work {
            Self::apply(&l, *pool, w);
        }
    }
}

fn export_blob(fields: [u64; 8]) -> [u8; 64] {
    let mut b = [0u8; 64];
    for (i, v) in fields.iter().enumerate() {
        b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    b
}

fn blob_fields(b: &[u8; 64]) -> [u64; 8] {
    let mut f = [0u64; 8];
    for (i, v) in f.iter_mut().enumerate() {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i * 8..i * 8 + 8]);
        *v = u64::from_le_bytes(w);
    }
    f
}

const BLOB_POINTER: u64 = 1;
const BLOB_EVENT: u64 = 2;
/// The block field of a pointer blob that names an address and size, not an allocation
/// (driver 580's behaviour; see [`SimConfig::blob_per_allocation`]).
const BLOB_BY_ADDRESS: u64 = u64::MAX;

impl Driver for SimDriver {
    fn kind(&self) -> DriverKind {
        DriverKind::Sim
    }

    fn driver_version(&self) -> Result<i32> {
        Ok(13000)
    }

    fn device_count(&self) -> Result<u32> {
        Ok(u32::try_from(self.visible.len()).unwrap_or(u32::MAX))
    }

    fn device_info(&self, ordinal: u32) -> Result<DeviceInfo> {
        let index = self.device_check("cuDeviceGet", ordinal)?;
        Ok(DeviceInfo {
            ordinal,
            uuid: self.uuid(index),
            name: format!("poolipc simulated device {index}"),
            total_memory: self.machine.memory,
            memory_pools: true,
            pool_posix_fd: true,
            vmm: true,
            vmm_posix_fd: true,
            mps_client: Some(self.machine.with(|st| st.mps & state::MPS_ON != 0)),
        })
    }

    fn device_can_access_peer(&self, ordinal: u32, peer: u32) -> Result<bool> {
        let index = self.device_check("cuDeviceGet", ordinal)?;
        let peer = self.device_check("cuDeviceGet", peer)?;
        Ok(index != peer && self.machine.peer_access)
    }

    fn use_device(&self, ordinal: u32) -> Result<()> {
        let ordinal = self.device_check("cuDeviceGet", ordinal)?;
        self.local().device = Some(ordinal);
        Ok(())
    }

    fn mem_get_info(&self) -> Result<(u64, u64)> {
        let dev = Self::context(&self.local(), "cuMemGetInfo_v2")?;
        Ok(self.machine.with(|st| {
            // VMM memory of processes that ended without releasing it.
            st.vmm_sweep(Machine::alive);
            // Exported pool memory of destroyed pools nobody imports any more.
            st.pool_sweep(Machine::alive);
            let d = &st.devices[dev as usize];
            (d.total.saturating_sub(d.reserved), d.total)
        }))
    }

    fn mem_pool_create(&self, ordinal: u32, sharing: PoolSharing) -> Result<PoolHandle> {
        let ordinal = self.device_check("cuMemPoolCreate", ordinal)?;
        let mut l = self.local();
        let slot = self.create_pool(&mut l, ordinal, sharing == PoolSharing::PosixFd)?;
        Ok(pool_handle(slot, l.pools[&slot].generation))
    }

    unsafe fn mem_pool_destroy(&self, pool: PoolHandle) -> Result<()> {
        self.mem_pool_destroy_checked(pool)
    }

    fn mem_pool_set_attribute(&self, pool: PoolHandle, attr: PoolAttribute) -> Result<()> {
        let l = self.local();
        // Measured on the H200 (driver 580): attributes of an imported pool are refused.
        let slot = Self::own_pool_slot(&l, "cuMemPoolSetAttribute", pool)?;
        self.machine.with(|st| {
            let p = &mut st.pools[slot];
            match attr {
                PoolAttribute::ReleaseThreshold(v) => p.release_threshold = v,
                PoolAttribute::ReuseFollowEventDependencies(b) => p.reuse_follow = u32::from(b),
                PoolAttribute::ReuseAllowOpportunistic(b) => p.reuse_opportunistic = u32::from(b),
                PoolAttribute::ReuseAllowInternalDependencies(b) => p.reuse_internal = u32::from(b),
                // Setting a high-water mark to 0 restarts it from the current figure.
                PoolAttribute::ResetReservedHigh => p.reserved_high = p.reserved,
                PoolAttribute::ResetUsedHigh => p.used_high = p.used,
            }
        });
        Ok(())
    }

    fn mem_pool_get_attribute(&self, pool: PoolHandle, counter: PoolCounter) -> Result<u64> {
        let l = self.local();
        // Measured on the H200 (driver 580): cuMemPoolGetAttribute on an imported pool is
        // INVALID_VALUE.
        let slot = Self::own_pool_slot(&l, "cuMemPoolGetAttribute", pool)?;
        Ok(self.machine.with(|st| {
            let p = &st.pools[slot];
            match counter {
                PoolCounter::ReleaseThreshold => p.release_threshold,
                PoolCounter::ReservedCurrent => p.reserved,
                PoolCounter::ReservedHigh => p.reserved_high,
                PoolCounter::UsedCurrent => p.used,
                PoolCounter::UsedHigh => p.used_high,
                PoolCounter::ReuseFollowEventDependencies => u64::from(p.reuse_follow),
                PoolCounter::ReuseAllowOpportunistic => u64::from(p.reuse_opportunistic),
                PoolCounter::ReuseAllowInternalDependencies => u64::from(p.reuse_internal),
            }
        }))
    }

    fn mem_pool_trim_to(&self, pool: PoolHandle, keep_bytes: u64) -> Result<()> {
        let l = self.local();
        let slot = Self::own_pool_slot(&l, "cuMemPoolTrimTo", pool)?;
        self.machine.with(|st| {
            let mut work = MemoryWork::default();
            st.release_cached(slot, keep_bytes, &mut work);
            Self::apply(&l, slot, &work);
        });
        Ok(())
    }

    fn device_get_mem_pool(&self, ordinal: u32) -> Result<PoolHandle> {
        let ordinal = self.device_check("cuDeviceGetMemPool", ordinal)?;
        let mut l = self.local();
        let slot = match l.current_pool.get(&ordinal) {
            Some(&s) => s,
            None => self.default_pool(&mut l, ordinal)?,
        };
        Ok(pool_handle(slot, l.pools[&slot].generation))
    }

    fn device_get_default_mem_pool(&self, ordinal: u32) -> Result<PoolHandle> {
        let ordinal = self.device_check("cuDeviceGetDefaultMemPool", ordinal)?;
        let mut l = self.local();
        let slot = self.default_pool(&mut l, ordinal)?;
        Ok(pool_handle(slot, l.pools[&slot].generation))
    }

    fn device_set_mem_pool(&self, ordinal: u32, pool: PoolHandle) -> Result<()> {
        const CALL: &str = "cuDeviceSetMemPool";
        let ordinal = self.device_check(CALL, ordinal)?;
        let mut l = self.local();
        let slot = Self::own_pool_slot(&l, CALL, pool)?;
        if l.pools[&slot].device != ordinal {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        l.current_pool.insert(ordinal, slot);
        Ok(())
    }

    fn mem_pool_export_fd(&self, pool: PoolHandle) -> Result<OwnedFd> {
        const CALL: &str = "cuMemPoolExportToShareableHandle";
        let l = self.local();
        let slot = Self::own_pool_slot(&l, CALL, pool)?;
        let shareable = self.machine.with(|st| {
            let p = &mut st.pools[slot];
            if p.shareable == 1 {
                p.exported = 1;
            }
            p.shareable == 1
        });
        if !shareable {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        l.pools[&slot]
            .fd
            .try_clone()
            .map_err(|source| DriverError::Os {
                call: "dup",
                source,
            })
    }

    fn mem_pool_import_fd(&self, fd: BorrowedFd<'_>) -> Result<PoolHandle> {
        const CALL: &str = "cuMemPoolImportFromShareableHandle";
        let mut header = [0u8; 32];
        match nix::sys::uio::pread(fd, &mut header, 0) {
            Ok(32) => {}
            _ => return Err(fail(CALL, CuCode::INVALID_VALUE)),
        }
        let mut f = [0u64; 4];
        for (i, v) in f.iter_mut().enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(&header[i * 8..i * 8 + 8]);
            *v = u64::from_le_bytes(w);
        }
        let [magic, machine, slot, generation] = f;
        if magic != state::MAGIC || machine != self.machine.id || slot >= state::MAX_POOLS as u64 {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        let slot = slot as usize;
        let found = self.machine.with(|st| {
            let p = &st.pools[slot];
            (p.state == POOL_LIVE && p.generation == generation && p.shareable == 1)
                .then_some((p.device, p.owner_agent))
        });
        let (device, owner) = found.ok_or(fail(CALL, CuCode::INVALID_VALUE))?;
        if owner == self.agent {
            // Importing one's own pool: not something poolipc does; refuse.
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        let mut l = self.local();
        if let Some(p) = l
            .pools
            .get(&slot)
            .filter(|p| p.imported && p.generation == generation && !p.destroyed)
        {
            return Ok(pool_handle(slot, p.generation));
        }
        let own = fd.try_clone_to_owned().map_err(|source| DriverError::Os {
            call: "dup",
            source,
        })?;
        let map = Mapping::new(&own, POOL_HEADER, self.machine.memory)?;
        let pid = self.pid;
        self.machine.with(|st| st.pool_hold(slot, pid, true));
        let mut access = vec![Access::None; self.machine.devices as usize];
        // The imported pool starts with read-write access from its own device, as the
        // exporter's pool does; other devices need cuMemPoolSetAccess.
        access[device as usize] = Access::ReadWrite;
        l.pools.insert(
            slot,
            LocalPool {
                fd: own,
                map,
                generation,
                device,
                imported: true,
                destroyed: false,
                access,
            },
        );
        Ok(pool_handle(slot, generation))
    }

    fn mem_pool_set_access(&self, pool: PoolHandle, ordinal: u32, access: Access) -> Result<()> {
        const CALL: &str = "cuMemPoolSetAccess";
        let ordinal = self.device_check(CALL, ordinal)?;
        let mut l = self.local();
        let slot = Self::pool_slot(&l, CALL, pool)?;
        let Some(p) = l.pools.get_mut(&slot) else {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        };
        if p.device == ordinal && access != Access::ReadWrite && !p.imported {
            // The pool's own device always has read-write access.
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        if p.device != ordinal && access != Access::None && !self.machine.peer_access {
            // No peer path between the two devices (an assumption: not measured on hardware).
            return Err(fail(CALL, CuCode::INVALID_DEVICE));
        }
        if p.access.len() < self.machine.devices as usize {
            p.access.resize(self.machine.devices as usize, Access::None);
            let d = p.device as usize;
            p.access[d] = Access::ReadWrite;
        }
        p.access[ordinal as usize] = access;
        Ok(())
    }

    fn mem_pool_get_access(&self, pool: PoolHandle, ordinal: u32) -> Result<Access> {
        const CALL: &str = "cuMemPoolGetAccess";
        let ordinal = self.device_check(CALL, ordinal)?;
        let l = self.local();
        let slot = Self::pool_slot(&l, CALL, pool)?;
        let p = &l.pools[&slot];
        Ok(match p.access.get(ordinal as usize) {
            Some(a) => *a,
            None if p.device == ordinal => Access::ReadWrite,
            None => Access::None,
        })
    }

    fn pointer_get_mempool(&self, ptr: DevicePtr) -> Result<PoolHandle> {
        const CALL: &str = "cuPointerGetAttribute";
        let l = self.local();
        let p = ptr.0;
        if (OWN_BASE..IMPORT_BASE).contains(&p) {
            let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
            let off = (p - OWN_BASE) % POOL_SPAN;
            let lp = l.pools.get(&slot).filter(|lp| !lp.imported);
            let live = self.machine.with(|st| {
                st.block_containing(slot, off)
                    .is_some_and(|b| st.blocks[b].state == BLOCK_LIVE)
            });
            if let (Some(lp), true) = (lp, live) {
                return Ok(pool_handle(slot, lp.generation));
            }
        } else if let Some((&base, imp)) = l.imports.range(..=p).next_back()
            && p < base + imp.bytes.max(1)
        {
            return Ok(pool_handle(imp.pool, l.pools[&imp.pool].generation));
        }
        Err(fail(CALL, CuCode::INVALID_VALUE))
    }

    fn pointer_get_buffer_id(&self, ptr: DevicePtr) -> Result<u64> {
        // Found as `pointer_get_mempool` finds the allocation, failing the same way.
        const CALL: &str = "cuPointerGetAttribute";
        let l = self.local();
        let p = ptr.0;
        if (OWN_BASE..IMPORT_BASE).contains(&p) {
            let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
            let off = (p - OWN_BASE) % POOL_SPAN;
            if l.pools.get(&slot).is_some_and(|lp| !lp.imported) {
                let live = self.machine.with(|st| {
                    st.block_containing(slot, off)
                        .filter(|&b| st.blocks[b].state == BLOCK_LIVE)
                        .map(|b| (b, st.blocks[b].generation))
                });
                if let Some(id) = live.and_then(|key| l.buffer_ids.get(&key)) {
                    return Ok(*id);
                }
            }
        } else if (IMPORT_BASE..VMM_BASE).contains(&p) {
            if let Some((&base, imp)) = l.imports.range(..=p).next_back()
                && p < base + imp.bytes.max(1)
            {
                return Ok(imp.buffer_id);
            }
        } else if let Some((&base, m)) = l.maps.range(..=p).next_back()
            && p < base + m.bytes
        {
            return Ok(m.buffer_id);
        }
        Err(fail(CALL, CuCode::INVALID_VALUE))
    }

    fn pointer_get_device(&self, ptr: DevicePtr) -> Result<u32> {
        // Found as `pointer_get_mempool` finds pool memory, and through the mappings for VMM
        // and cuMemAlloc memory.
        const CALL: &str = "cuPointerGetAttribute";
        let l = self.local();
        let p = ptr.0;
        if (OWN_BASE..IMPORT_BASE).contains(&p) {
            let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
            let off = (p - OWN_BASE) % POOL_SPAN;
            if let Some(lp) = l.pools.get(&slot).filter(|lp| !lp.imported) {
                let live = self.machine.with(|st| {
                    st.block_containing(slot, off)
                        .is_some_and(|b| st.blocks[b].state == BLOCK_LIVE)
                });
                if live {
                    return Ok(lp.device);
                }
            }
        } else if (IMPORT_BASE..VMM_BASE).contains(&p) {
            if let Some((&base, imp)) = l.imports.range(..=p).next_back()
                && p < base + imp.bytes.max(1)
                && let Some(lp) = l.pools.get(&imp.pool)
            {
                return Ok(lp.device);
            }
        } else if let Some((&base, m)) = l.maps.range(..=p).next_back()
            && p < base + m.bytes
        {
            return Ok(m.device);
        }
        Err(fail(CALL, CuCode::INVALID_VALUE))
    }

    fn pointer_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64)> {
        const CALL: &str = "cuMemGetAddressRange_v2";
        let l = self.local();
        let p = ptr.0;
        if (OWN_BASE..IMPORT_BASE).contains(&p) {
            let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
            let off = (p - OWN_BASE) % POOL_SPAN;
            if l.pools.get(&slot).is_some_and(|lp| !lp.imported) {
                let found = self.machine.with(|st| {
                    st.block_containing(slot, off)
                        .filter(|&b| {
                            st.blocks[b].state == BLOCK_LIVE
                                && off < st.blocks[b].offset + st.blocks[b].bytes
                        })
                        .map(|b| (st.blocks[b].offset, st.blocks[b].bytes))
                });
                if let Some((start, bytes)) = found {
                    return Ok((DevicePtr(OWN_BASE + slot as u64 * POOL_SPAN + start), bytes));
                }
            }
        } else if (IMPORT_BASE..VMM_BASE).contains(&p) {
            if let Some((&base, imp)) = l.imports.range(..=p).next_back()
                && p < base + imp.bytes
            {
                return Ok((DevicePtr(base), imp.bytes));
            }
        } else if let Some((&base, m)) = l.maps.range(..=p).next_back()
            && p < base + m.bytes
        {
            return Ok((DevicePtr(base), m.bytes));
        }
        Err(fail(CALL, CuCode::NOT_FOUND))
    }

    fn mem_alloc(&self, bytes: u64) -> Result<DevicePtr> {
        // Kept as a mapping of an unexportable handle, so every access to it goes through the
        // race detector as VMM memory does; flagged plain, so no handle can be retained.
        const CALL: &str = "cuMemAlloc_v2";
        self.check_context(CALL)?;
        if bytes == 0 {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        let ordinal = Self::context(&self.local(), CALL)?;
        let len = bytes
            .checked_next_multiple_of(GRANULE)
            .ok_or(fail(CALL, CuCode::OUT_OF_MEMORY))?;
        let handle = self.create_vmm(ordinal, len, false)?;
        let mapped = self.vmm_reserve(len, 0).and_then(|ptr| {
            self.vmm_map(ptr, len, handle)
                .and_then(|()| self.vmm_set_access(ptr, len, ordinal, Access::ReadWrite))
                .map(|()| ptr)
                .inspect_err(|_| {
                    let _ = self.vmm_unmap_checked(ptr, len);
                    let _ = self.vmm_address_free_checked(ptr, len);
                })
        });
        let ptr = match mapped {
            Ok(p) => p,
            Err(e) => {
                let _ = self.vmm_release_checked(handle);
                return Err(e);
            }
        };
        let mut l = self.local();
        if let Some(m) = l.maps.get_mut(&ptr.0) {
            m.plain = true;
        }
        l.plain.insert(ptr.0, (handle, len));
        Ok(ptr)
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        self.mem_free_checked(ptr)
    }

    fn mem_alloc_async(&self, bytes: u64, stream: StreamHandle) -> Result<DevicePtr> {
        self.check_context("cuMemAllocAsync")?;
        let pool = {
            let l = self.local();
            Self::context(&l, "cuMemAllocAsync")?
        };
        let pool = self.device_get_mem_pool(pool)?;
        self.alloc("cuMemAllocAsync", bytes, pool, stream)
    }

    fn mem_alloc_from_pool_async(
        &self,
        bytes: u64,
        pool: PoolHandle,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        self.check_context("cuMemAllocFromPoolAsync")?;
        self.alloc("cuMemAllocFromPoolAsync", bytes, pool, stream)
    }

    unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        self.mem_free_async_checked(ptr, stream)
    }

    fn mem_pool_export_pointer(&self, ptr: DevicePtr) -> Result<ExportBlob> {
        self.check_context("cuMemPoolExportPointer")?;
        const CALL: &str = "cuMemPoolExportPointer";
        let l = self.local();
        let p = ptr.0;
        if !(OWN_BASE..IMPORT_BASE).contains(&p) {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
        let off = (p - OWN_BASE) % POOL_SPAN;
        if l.pools.get(&slot).is_none_or(|lp| lp.imported) {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        self.machine.with(|st| {
            if st.pools[slot].exported != 1 {
                // Measured on the H200: export before the pool's FD export fails so.
                return Err(fail(CALL, CuCode::INVALID_VALUE));
            }
            let b = st
                .live_block_at(slot, off)
                .ok_or(fail(CALL, CuCode::INVALID_VALUE))?;
            // The range's memory stays on the device after its free until the pool is gone.
            st.blocks[b].exported = 1;
            let r = &st.blocks[b];
            // Driver 580: the same bytes for the same address and size, whatever the
            // allocation; the other way, the allocation and its generation.
            let (block, generation) = if self.machine.blob_per_allocation {
                (b as u64, r.generation)
            } else {
                (BLOB_BY_ADDRESS, 0)
            };
            Ok(ExportBlob(export_blob([
                state::MAGIC,
                self.machine.id,
                BLOB_POINTER,
                slot as u64 | (st.pools[slot].generation << 8),
                block,
                generation,
                r.offset,
                r.bytes,
            ])))
        })
    }

    fn mem_pool_import_pointer(&self, pool: PoolHandle, data: &ExportBlob) -> Result<DevicePtr> {
        self.check_context("cuMemPoolImportPointer")?;
        const CALL: &str = "cuMemPoolImportPointer";
        let [
            magic,
            machine,
            kind,
            pool_id,
            block,
            generation,
            offset,
            bytes,
        ] = blob_fields(&data.0);
        let mut l = self.local();
        let slot = Self::pool_slot(&l, CALL, pool)?;
        if magic != state::MAGIC
            || machine != self.machine.id
            || kind != BLOB_POINTER
            || !l.pools[&slot].imported
            || pool_id != (slot as u64 | (l.pools[&slot].generation << 8))
            || (block >= state::MAX_BLOCKS as u64 && block != BLOB_BY_ADDRESS)
            || (block == BLOB_BY_ADDRESS) == self.machine.blob_per_allocation
        {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        let ptr = IMPORT_BASE + slot as u64 * POOL_SPAN + offset;
        let l = &mut *l;
        self.machine.with(|st| {
            let (mut block, mut generation) = if block == BLOB_BY_ADDRESS {
                // Driver 580: the blob names a range; it maps whatever allocation starts
                // there now. Its range, not the allocation's: one larger than the live
                // allocation reaches past it (measured on the H200), a violation here.
                match st.live_block_at(slot, offset) {
                    Some(b) => {
                        let (live_bytes, g) = (st.blocks[b].bytes, st.blocks[b].generation);
                        if live_bytes < bytes {
                            st.violation(ViolationKind::ImportBeyondAllocation, CALL, self.pid)
                                .block(b, g)
                                .values(bytes, live_bytes)
                                .log();
                        }
                        (b, g)
                    }
                    // No allocation starts there: the freed-memory path below decides.
                    None => (usize::MAX, 0),
                }
            } else {
                (block as usize, generation)
            };
            let live = st.blocks.get(block).is_some_and(|b| {
                b.state == BLOCK_LIVE
                    && b.generation == generation
                    && b.pool as usize == slot
                    && b.offset == offset
            });
            if !live {
                // The export of an allocation the exporter has freed. While the pool still
                // holds the memory, driver 580 imports it without complaint (measured on the
                // H200): the importer now reads memory the pool may hand out again.
                let cached = st.block_containing(slot, offset).filter(|&j| {
                    let c = &st.blocks[j];
                    c.state == BLOCK_CACHED && offset + bytes <= c.offset + c.size
                });
                let Some(j) = cached else {
                    // Handed out again, or given back: nothing to map.
                    return Err(fail(CALL, CuCode::INVALID_VALUE));
                };
                st.violation(ViolationKind::ImportOfFreed, CALL, self.pid)
                    .block(block, generation)
                    .log();
                (block, generation) = (j, st.blocks[j].generation);
            }
            let chunks = chunks_spanned(offset, bytes);
            if chunks > IMPORT_CHUNK_LIMIT {
                st.violation(ViolationKind::ImportOverLimit, CALL, self.pid)
                    .block(block, generation)
                    .values(chunks, IMPORT_CHUNK_LIMIT)
                    .log();
                if !self.machine.import_crash {
                    return Err(DriverError::ImportOverLimit {
                        chunks,
                        limit: IMPORT_CHUNK_LIMIT,
                    });
                }
                if chunks > IMPORT_CRASH_CHUNKS {
                    tracing::error!(chunks, "sim: pointer import over {IMPORT_CRASH_CHUNKS} chunks; dying by SIGSEGV as libcuda does");
                    shm::die_by_sigsegv();
                }
                // 129..=164 chunks: driver 580 overwrites dead stack bytes and the import
                // "works" (docs/facts.md). So does this one, with the violation recorded above.
                tracing::warn!(chunks, "sim: pointer import over the 128-chunk limit overwrote the importer's stack (silently, as on driver 580)");
            }
            if let Some(imp) = l.imports.get(&ptr)
                && imp.generation == generation && st.imports[imp.record].live == 1 {
                    // The driver's aliasing: the same address again, one mapping for both.
                    return Ok(DevicePtr(ptr));
                }
            let find = |st: &State| st.imports.iter().position(|i| i.live == 0);
            let record = match find(st) {
                Some(r) => r,
                None => {
                    reap(st);
                    find(st).ok_or(fail(CALL, CuCode::OUT_OF_MEMORY))?
                }
            };
            let r = &mut st.imports[record];
            r.live = 1;
            r.pid = self.pid;
            r.agent = self.agent;
            r.block = block as u64;
            r.generation = generation;
            let buffer_id = l.new_buffer_id();
            l.imports.insert(
                ptr,
                LocalImport {
                    record,
                    pool: slot,
                    block,
                    generation,
                    bytes,
                    buffer_id,
                },
            );
            Ok(DevicePtr(ptr))
        })
    }

    unsafe fn mem_pool_free_import(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        self.mem_pool_free_import_checked(ptr, stream)
    }

    fn event_create(&self, interprocess: bool) -> Result<EventHandle> {
        self.check_context("cuEventCreate")?;
        const CALL: &str = "cuEventCreate";
        let mut l = self.local();
        Self::context(&l, CALL)?;
        let (slot, generation) = self
            .machine
            .with(|st| {
                st.event_create(interprocess, self.agent, self.pid)
                    .or_else(|| {
                        reap(st);
                        st.event_create(interprocess, self.agent, self.pid)
                    })
            })
            .ok_or(fail(CALL, CuCode::OUT_OF_MEMORY))?;
        l.next_handle += 1;
        let h = l.next_handle;
        l.events.insert(
            h,
            LocalEvent {
                slot,
                generation,
                owner: true,
            },
        );
        Ok(EventHandle(h))
    }

    unsafe fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.event_destroy_checked(event)
    }

    fn ipc_get_event_handle(&self, event: EventHandle) -> Result<EventBlob> {
        const CALL: &str = "cuIpcGetEventHandle";
        let l = self.local();
        self.machine.with(|st| {
            let ev = Self::event(&l, st, CALL, event)?;
            if st.events[ev.slot].interprocess != 1 {
                // INVALID_HANDLE, as driver 580 answers (measured on the H200).
                return Err(fail(CALL, CuCode::INVALID_HANDLE));
            }
            Ok(EventBlob(export_blob([
                state::MAGIC,
                self.machine.id,
                BLOB_EVENT,
                ev.slot as u64,
                ev.generation,
                0,
                0,
                0,
            ])))
        })
    }

    fn ipc_open_event_handle(&self, handle: &EventBlob) -> Result<EventHandle> {
        const CALL: &str = "cuIpcOpenEventHandle";
        let [magic, machine, kind, slot, generation, ..] = blob_fields(&handle.0);
        if magic != state::MAGIC
            || machine != self.machine.id
            || kind != BLOB_EVENT
            || slot >= state::MAX_EVENTS as u64
        {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        let mut l = self.local();
        Self::context(&l, CALL)?;
        let slot = slot as usize;
        self.machine.with(|st| {
            let e = &mut st.events[slot];
            if e.live != 1 || e.generation != generation || e.interprocess != 1 {
                return Err(fail(CALL, CuCode::INVALID_VALUE));
            }
            e.opens += 1;
            Ok(())
        })?;
        l.next_handle += 1;
        let h = l.next_handle;
        l.events.insert(
            h,
            LocalEvent {
                slot,
                generation,
                owner: false,
            },
        );
        Ok(EventHandle(h))
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.check_context("cuEventRecord")?;
        const CALL: &str = "cuEventRecord";
        let mut l = self.local();
        let l = &mut *l;
        let (s, seq, step) = self.machine.with(|st| {
            let slot = Self::event(l, st, CALL, event)?.slot;
            let s = self.stream_slot(l, st, CALL, stream)?;
            let seq = st.tick(s);
            let clock = st.streams[s].clock;
            let e = &mut st.events[slot];
            e.clock = clock;
            e.records += 1;
            e.rec_pid = self.pid;
            let step = Step::Record {
                event: slot,
                generation: e.generation,
                n: e.records,
            };
            Ok((s, seq, step))
        })?;
        self.issue(s, seq, step);
        Ok(())
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.check_context("cuEventQuery")?;
        let mut l = self.local();
        self.machine.with(|st| {
            let slot = Self::event(&l, st, "cuEventQuery", event)?.slot;
            let e = &st.events[slot];
            let done = e.completed >= e.records || !Machine::alive(e.rec_pid);
            if done {
                // A query that says complete orders the host after the event, as a
                // synchronize does.
                let clock = e.clock;
                merge(&mut l.host_clock, &clock);
                merge(&mut st.observed, &clock);
            }
            Ok(done)
        })
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        self.check_context("cuEventSynchronize")?;
        const CALL: &str = "cuEventSynchronize";
        let (slot, generation, n) = {
            let l = self.local();
            self.machine.with(|st| {
                let slot = Self::event(&l, st, CALL, event)?.slot;
                let e = &st.events[slot];
                Ok((slot, e.generation, e.records))
            })?
        };
        // Another process's record runs on that process's engine: look until it has.
        let mut pause = Duration::from_micros(20);
        loop {
            let done = self.machine.with(|st| {
                let e = &st.events[slot];
                e.live == 0
                    || e.generation != generation
                    || e.completed >= n
                    || !Machine::alive(e.rec_pid)
            });
            if done {
                break;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
        let mut l = self.local();
        let l = &mut *l;
        self.machine.with(|st| {
            let clock = st.events[slot].clock;
            merge(&mut l.host_clock, &clock);
            merge(&mut st.observed, &clock);
            self.release_at_sync(l, st);
        });
        Ok(())
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.check_context("cuStreamWaitEvent")?;
        const CALL: &str = "cuStreamWaitEvent";
        let mut l = self.local();
        let l = &mut *l;
        let wait = self.machine.with(|st| {
            let slot = Self::event(l, st, CALL, event)?.slot;
            let s = self.stream_slot(l, st, CALL, stream)?;
            let clock = st.events[slot].clock;
            merge(&mut st.streams[s].clock, &clock);
            let e = &st.events[slot];
            // Waiting on an event never recorded waits for nothing, as on hardware.
            let step = (e.records > 0).then_some(Step::Wait {
                event: slot,
                generation: e.generation,
                n: e.records,
            });
            Ok(step.map(|step| (s, st.tick(s), step)))
        })?;
        if let Some((s, seq, step)) = wait {
            self.issue(s, seq, step);
        }
        Ok(())
    }

    fn stream_create(&self) -> Result<StreamHandle> {
        self.check_context("cuStreamCreate")?;
        const CALL: &str = "cuStreamCreate";
        let mut l = self.local();
        Self::context(&l, CALL)?;
        let slot = self
            .machine
            .with(|st| {
                st.stream_create(self.agent, self.pid).or_else(|| {
                    reap(st);
                    st.stream_create(self.agent, self.pid)
                })
            })
            .ok_or(fail(CALL, CuCode::OUT_OF_MEMORY))?;
        l.next_handle += 1;
        let h = l.next_handle;
        l.streams.insert(h, slot);
        Ok(StreamHandle(h))
    }

    unsafe fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.stream_destroy_checked(stream)
    }

    fn ctx_synchronize(&self) -> Result<()> {
        self.check_context("cuCtxSynchronize")?;
        // Every stream this process issued to, up to its last operation.
        let lasts: Vec<(usize, u64)> = {
            let l = self.local();
            let mut slots: Vec<usize> = l.streams.values().copied().collect();
            slots.extend(l.null_stream);
            self.machine
                .with(|st| slots.iter().map(|&s| (s, st.streams[s].clock[s])).collect())
        };
        for &(s, last) in &lasts {
            self.engine.wait_executed(s, last);
        }
        let mut l = self.local();
        let l = &mut *l;
        self.machine.with(|st| {
            for &(s, _) in &lasts {
                let clock = st.streams[s].clock;
                merge(&mut l.host_clock, &clock);
                merge(&mut st.observed, &clock);
            }
            self.release_at_sync(l, st);
        });
        Ok(())
    }

    fn stream_check(&self, stream: StreamHandle) -> Result<()> {
        // The simulation's default stream is 0; 1 and 2 (CU_STREAM_LEGACY,
        // CU_STREAM_PER_THREAD) are not its handles (callers map them to 0).
        if stream == StreamHandle::NULL || self.local().streams.contains_key(&stream.0) {
            Ok(())
        } else {
            Err(fail("cuStreamQuery", CuCode::INVALID_HANDLE))
        }
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.check_context("cuStreamSynchronize")?;
        const CALL: &str = "cuStreamSynchronize";
        let (s, last) = {
            let mut l = self.local();
            let l = &mut *l;
            self.machine.with(|st| {
                let s = self.stream_slot(l, st, CALL, stream)?;
                Ok((s, st.streams[s].clock[s]))
            })?
        };
        self.engine.wait_executed(s, last);
        let mut l = self.local();
        let l = &mut *l;
        self.machine.with(|st| {
            let clock = st.streams[s].clock;
            merge(&mut l.host_clock, &clock);
            merge(&mut st.observed, &clock);
            self.release_at_sync(l, st);
        });
        Ok(())
    }

    fn memset_d8_async(
        &self,
        ptr: DevicePtr,
        value: u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        self.check_context("cuMemsetD8Async")?;
        self.memset("cuMemsetD8Async", ptr, &[value], bytes, stream)
    }

    fn memset_d32_async(
        &self,
        ptr: DevicePtr,
        value: u32,
        words: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        self.check_context("cuMemsetD32Async")?;
        if !ptr.0.is_multiple_of(4) {
            return Err(fail("cuMemsetD32Async", CuCode::INVALID_VALUE));
        }
        self.memset("cuMemsetD32Async", ptr, &value.to_le_bytes(), words, stream)
    }

    fn launch_hang_kernel(&self, stream: StreamHandle) -> Result<()> {
        const CALL: &str = "cuLaunchKernel";
        self.check_context(CALL)?;
        let mut l = self.local();
        let l = &mut *l;
        let (s, seq) = self.machine.with(|st| {
            let s = self.stream_slot(l, st, CALL, stream)?;
            Ok((s, st.tick(s)))
        })?;
        self.issue(s, seq, Step::Hang);
        Ok(())
    }

    fn launch_store_kernel(
        &self,
        address: DevicePtr,
        value: u32,
        stream: StreamHandle,
    ) -> Result<()> {
        const CALL: &str = "cuStreamSynchronize";
        self.check_context("cuLaunchKernel")?;
        let unaligned = !address.0.is_multiple_of(4);
        // What this process can reach (asked without recording an access violation: a
        // fault is the expected outcome here, not a bug of the caller's).
        let reachable = self
            .pointer_get_range(address)
            .is_ok_and(|(base, len)| address.0 + 4 <= base.0 + len);
        let stored = !unaligned
            && reachable
            && self
                .memset("cuLaunchKernel", address, &value.to_le_bytes(), 1, stream)
                .is_ok();
        if stored {
            return self.stream_synchronize(stream);
        }
        // A store the GPU cannot make: the context is lost, and under MPS every client's.
        self.local().context_lost = true;
        let mps = self.machine.with(|st| {
            if st.mps & state::MPS_ON != 0 {
                st.mps |= state::MPS_FAULTED;
                true
            } else {
                false
            }
        });
        tracing::debug!(?address, mps, "simulated GPU fault");
        Err(fail(
            CALL,
            if unaligned {
                CuCode::MISALIGNED_ADDRESS
            } else {
                CuCode::ILLEGAL_ADDRESS
            },
        ))
    }

    fn memcpy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.check_context("cuMemcpyDtoH")?;
        if dst.is_empty() {
            return Ok(());
        }
        let buf = Arc::new(Mutex::new(vec![0u8; dst.len()]));
        let (s, seq) = self.host_copy(
            "cuMemcpyDtoH",
            src,
            HostBuf::Owned(Arc::clone(&buf)),
            true,
            StreamHandle::NULL,
        )?;
        self.sync_on_legacy(s, seq);
        let got = buf
            .lock()
            .map_err(|_| fail("cuMemcpyDtoH", CuCode::UNKNOWN))?;
        dst.copy_from_slice(&got);
        Ok(())
    }

    fn memcpy_htod(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.check_context("cuMemcpyHtoD")?;
        if src.is_empty() {
            return Ok(());
        }
        let buf = HostBuf::Owned(Arc::new(Mutex::new(src.to_vec())));
        let (s, seq) = self.host_copy("cuMemcpyHtoD", dst, buf, false, StreamHandle::NULL)?;
        self.sync_on_legacy(s, seq);
        Ok(())
    }

    fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        self.check_context("cuMemcpyDtoDAsync")?;
        const CALL: &str = "cuMemcpyDtoDAsync";
        if bytes == 0 {
            return Ok(());
        }
        let n = Self::host_len(CALL, bytes)?;
        let mut l = self.local();
        let l = &mut *l;
        let (s, seq, from, to) = self.machine.with(|st| {
            let s = self.stream_slot(l, st, CALL, stream)?;
            let from = self.touch(l, st, CALL, src, bytes, false)?;
            let to = self.touch(l, st, CALL, dst, bytes, true)?;
            Self::mapping(l, &from.0).ok_or(fail(CALL, CuCode::ILLEGAL_ADDRESS))?;
            Self::mapping(l, &to.0).ok_or(fail(CALL, CuCode::ILLEGAL_ADDRESS))?;
            let seq = st.tick(s);
            self.access(st, CALL, s, seq, &from.1, false);
            self.access(st, CALL, s, seq, &to.1, true);
            Ok((s, seq, from, to))
        })?;
        let pid = self.pid;
        self.issue(
            s,
            seq,
            Step::Run(Box::new(move |l: &mut Local, st: &mut State| {
                let Some((fm, fo)) = Self::at_run(l, st, CALL, pid, &from.0, &from.1) else {
                    return;
                };
                let Some((tm, to)) = Self::at_run(l, st, CALL, pid, &to.0, &to.1) else {
                    return;
                };
                // Through a bounce buffer: the two ranges may be two mappings of the same
                // bytes.
                let mut buf = vec![0u8; n.min(8 << 20)];
                let mut done = 0;
                while done < n {
                    let k = buf.len().min(n - done);
                    fm.read(fo + done, &mut buf[..k]);
                    tm.write(to + done, &buf[..k]);
                    done += k;
                }
            })),
        );
        Ok(())
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        const CALL: &str = "cuMemcpyDtoHAsync";
        let n = Self::host_len(CALL, bytes)?;
        if dst.is_null() {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        if n == 0 {
            return Ok(());
        }
        // The caller promises `dst` is valid for `bytes` writes and untouched by anything
        // else until the copy completed: the engine writes it when the copy runs.
        self.host_copy(CALL, src, HostBuf::Raw(dst as usize, n), true, stream)
            .map(drop)
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        const CALL: &str = "cuMemcpyHtoDAsync";
        let n = Self::host_len(CALL, bytes)?;
        if src.is_null() {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        if n == 0 {
            return Ok(());
        }
        // The caller promises `src` is valid for `bytes` reads and not written until the copy
        // completed: the engine reads it when the copy runs.
        self.host_copy(CALL, dst, HostBuf::Raw(src as usize, n), false, stream)
            .map(drop)
    }

    unsafe fn host_register(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        const CALL: &str = "cuMemHostRegister_v2";
        if ptr.is_null() || bytes == 0 {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        let start = ptr as usize;
        let end = start
            .checked_add(bytes)
            .ok_or(fail(CALL, CuCode::INVALID_VALUE))?;
        let mut l = self.local();
        let overlaps = l
            .host_registered
            .range(..end)
            .next_back()
            .is_some_and(|(&s, r)| s + r.bytes > start);
        if overlaps {
            return Err(fail(CALL, CuCode::HOST_MEMORY_ALREADY_REGISTERED));
        }
        let file = backing_file(start, bytes);
        l.host_registered
            .insert(start, HostRegistration { bytes, file });
        Ok(())
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        self.local()
            .host_registered
            .remove(&(ptr as usize))
            .map(drop)
            .ok_or(fail(
                "cuMemHostUnregister",
                CuCode::HOST_MEMORY_NOT_REGISTERED,
            ))
    }

    fn vmm_granularity(&self, ordinal: u32, _which: Granularity) -> Result<u64> {
        self.device_check("cuMemGetAllocationGranularity", ordinal)?;
        Ok(GRANULE)
    }

    fn vmm_create(&self, ordinal: u32, bytes: u64) -> Result<VmmHandle> {
        self.create_vmm(ordinal, bytes, true)
    }

    fn vmm_create_unshared(&self, ordinal: u32, bytes: u64) -> Result<VmmHandle> {
        self.create_vmm(ordinal, bytes, false)
    }

    fn vmm_retain(&self, ptr: DevicePtr) -> Result<VmmHandle> {
        const CALL: &str = "cuMemRetainAllocationHandle";
        let mut l = self.local();
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
        let pid = self.pid;
        self.machine.with(|st| st.vmm_hold(file, pid, true));
        l.next_handle += 1;
        let h = l.next_handle;
        l.vmm.insert(h, alloc);
        Ok(VmmHandle(h))
    }

    fn vmm_exports_fd(&self, handle: VmmHandle) -> Result<bool> {
        self.local()
            .vmm
            .get(&handle.0)
            .map(|v| v.exportable)
            .ok_or(fail(
                "cuMemGetAllocationPropertiesFromHandle",
                CuCode::INVALID_VALUE,
            ))
    }

    fn vmm_export_fd(&self, handle: VmmHandle) -> Result<OwnedFd> {
        const CALL: &str = "cuMemExportToShareableHandle";
        let l = self.local();
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

    fn vmm_import_fd(&self, fd: BorrowedFd<'_>) -> Result<VmmHandle> {
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
        let pid = self.pid;
        let mut l = self.local();
        let device = Self::context(&l, CALL)?;
        self.machine.with(|s| s.vmm_hold(file, pid, true));
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

    fn vmm_reserve(&self, bytes: u64, alignment: u64) -> Result<DevicePtr> {
        const CALL: &str = "cuMemAddressReserve";
        if bytes == 0
            || !bytes.is_multiple_of(GRANULE)
            || (alignment != 0 && !alignment.is_power_of_two())
        {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        let mut l = self.local();
        let start = l.next_va.next_multiple_of(alignment.max(GRANULE));
        l.next_va = start + bytes;
        l.reservations.insert(start, bytes);
        Ok(DevicePtr(start))
    }

    fn vmm_map(&self, ptr: DevicePtr, bytes: u64, handle: VmmHandle) -> Result<()> {
        const CALL: &str = "cuMemMap";
        let mut l = self.local();
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
        let pid = self.pid;
        self.machine.with(|s| s.vmm_hold(file, pid, true));
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

    fn vmm_set_access(
        &self,
        ptr: DevicePtr,
        bytes: u64,
        ordinal: u32,
        access: Access,
    ) -> Result<()> {
        const CALL: &str = "cuMemSetAccess";
        self.device_check(CALL, ordinal)?;
        let mut l = self.local();
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

    // The simulation looks every handle and address up in its tables and answers an error
    // for one it does not know: its destroying calls are sound whatever they are given
    // (they are `unsafe fn`s because the trait's are).
    unsafe fn vmm_unmap(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        self.vmm_unmap_checked(ptr, bytes)
    }

    unsafe fn vmm_address_free(&self, ptr: DevicePtr, bytes: u64) -> Result<()> {
        self.vmm_address_free_checked(ptr, bytes)
    }

    unsafe fn vmm_release(&self, handle: VmmHandle) -> Result<()> {
        self.vmm_release_checked(handle)
    }
}

/// The destroying calls, safe here: the simulation looks every handle and address up in its
/// own tables and answers an error for one it does not know (the trait's `unsafe fn`s call
/// these; the simulation's own tests call them directly to check that).
impl SimDriver {
    /// `mem_pool_destroy` of the trait, checked against the simulation's tables (so safe).
    pub(crate) fn mem_pool_destroy_checked(&self, pool: PoolHandle) -> Result<()> {
        const CALL: &str = "cuMemPoolDestroy";
        let mut l = self.local();
        let slot = Self::pool_slot(&l, CALL, pool)?;
        if l.pools[&slot].imported {
            l.pools.remove(&slot);
            // The exporter's memory in limbo goes back once no process imports the pool.
            let pid = self.pid;
            self.machine.with(|st| {
                st.pool_hold(slot, pid, false);
                st.pool_sweep(Machine::alive);
            });
            return Ok(());
        }
        let device = l.pools[&slot].device;
        if l.default_pool.get(&device) == Some(&slot) {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        if l.current_pool.get(&device) == Some(&slot) {
            // Destroying the current pool makes the default pool current again.
            l.current_pool.remove(&device);
        }
        if let Some(p) = l.pools.get_mut(&slot) {
            p.destroyed = true;
        }
        let l = &*l;
        self.machine.with(|st| {
            let mut work = MemoryWork::default();
            if st.pools[slot].used == 0 {
                st.pool_drop(slot, &mut work);
            } else {
                // Freed with its last allocation, as the real driver defers it.
                st.pools[slot].state = POOL_DYING;
            }
            st.pool_sweep(Machine::alive);
            Self::apply(l, slot, &work);
        });
        Ok(())
    }

    /// `mem_free` of the trait, checked against the simulation's tables (so safe).
    pub(crate) fn mem_free_checked(&self, ptr: DevicePtr) -> Result<()> {
        const CALL: &str = "cuMemFree_v2";
        let (handle, len) = self
            .local()
            .plain
            .remove(&ptr.0)
            .ok_or(fail(CALL, CuCode::INVALID_VALUE))?;
        self.vmm_unmap_checked(ptr, len)?;
        self.vmm_address_free_checked(ptr, len)?;
        self.vmm_release_checked(handle)
    }

    /// `mem_free_async` of the trait, checked against the simulation's tables (so safe).
    pub(crate) fn mem_free_async_checked(
        &self,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<()> {
        self.free(ptr, stream)
    }

    /// `mem_pool_free_import` of the trait, checked against the simulation's tables (so safe).
    pub(crate) fn mem_pool_free_import_checked(
        &self,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<()> {
        self.free(ptr, stream)
    }

    /// `event_destroy` of the trait, checked against the simulation's tables (so safe).
    pub(crate) fn event_destroy_checked(&self, event: EventHandle) -> Result<()> {
        const CALL: &str = "cuEventDestroy_v2";
        let mut l = self.local();
        let ev = l
            .events
            .remove(&event.0)
            .ok_or(fail(CALL, CuCode::INVALID_HANDLE))?;
        self.machine.with(|st| {
            let e = &mut st.events[ev.slot];
            if e.live != 1 || e.generation != ev.generation {
                return;
            }
            if ev.owner {
                e.owner_alive = 0;
            } else {
                e.opens = e.opens.saturating_sub(1);
            }
            if e.owner_alive == 0 && e.opens == 0 {
                e.live = 0;
            }
        });
        Ok(())
    }

    /// `stream_destroy` of the trait, checked against the simulation's tables (so safe).
    pub(crate) fn stream_destroy_checked(&self, stream: StreamHandle) -> Result<()> {
        const CALL: &str = "cuStreamDestroy_v2";
        let slot = self
            .local()
            .streams
            .remove(&stream.0)
            .ok_or(fail(CALL, CuCode::INVALID_HANDLE))?;
        self.machine.with(|st| st.streams[slot].live = 0);
        Ok(())
    }

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
            st.vmm_sweep(Machine::alive);
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
            st.vmm_sweep(Machine::alive);
        });
        Ok(())
    }
}

/// The (device, inode) of the file behind `fd`: what names a VMM allocation across processes.
fn file_of(fd: &impl std::os::fd::AsFd) -> Result<(u64, u64)> {
    let st = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| shm::os("fstat", e))?;
    Ok((st.st_dev, st.st_ino))
}

impl SimDriver {
    /// `cuMemCreate`, with or without the POSIX FD handle type.
    fn create_vmm(&self, ordinal: u32, bytes: u64, exportable: bool) -> Result<VmmHandle> {
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

    fn alloc(
        &self,
        call: &'static str,
        bytes: u64,
        pool: PoolHandle,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        if bytes == 0 {
            return Err(fail(call, CuCode::INVALID_VALUE));
        }
        let mut l = self.local();
        let slot = Self::own_pool_slot(&l, call, pool)?;
        let l = &mut *l;
        let (s, seq, dependencies, ptr) = self.machine.with(|st| {
            let s = self.stream_slot(l, st, call, stream)?;
            let mut work = MemoryWork::default();
            let r = st.alloc(slot, bytes, &mut work);
            Self::apply(l, slot, &work);
            let b = r.map_err(|code| fail(call, code))?;
            // The allocation touches nothing. Memory recycled from a free is ordered after
            // that free by the pool: a free on this stream by stream order, one on another
            // stream that has not run yet by a dependency of this stream on it (the pool's
            // internal dependency). The frees' records over it are then done with.
            let (off, size, g) = (
                st.blocks[b].offset,
                st.blocks[b].size,
                st.blocks[b].generation,
            );
            let free_call = violation::call_code("cuMemFreeAsync");
            let mut dependencies = Vec::new();
            for i in 0..MAX_ACCESSES {
                let r = &st.accesses[i];
                if r.live != 1
                    || r.dev != POOL_DEV
                    || r.ino != slot as u64
                    || r.call != free_call
                    || r.end <= off
                    || off + size <= r.start
                {
                    continue;
                }
                let (fs, fseq) = (r.stream as usize, r.seq);
                st.accesses[i].live = 0;
                if fs != s && st.streams[fs].executed < fseq {
                    let mut upto = st.streams[fs].clock;
                    upto[fs] = fseq;
                    merge(&mut st.streams[s].clock, &upto);
                    dependencies.push((
                        st.tick(s),
                        Step::AfterStream {
                            slot: fs,
                            seq: fseq,
                        },
                    ));
                }
            }
            let seq = st.tick(s);
            let id = l.new_buffer_id();
            l.buffer_ids.insert((b, g), id);
            Ok((
                s,
                seq,
                dependencies,
                DevicePtr(OWN_BASE + slot as u64 * POOL_SPAN + off),
            ))
        })?;
        for (dseq, step) in dependencies {
            self.issue(s, dseq, step);
        }
        self.issue(s, seq, Step::Mark);
        Ok(ptr)
    }
}

#[cfg(test)]
mod tests;

// Keep the chunk size and MiB in the public docs honest.
const _: () = assert!(CHUNK == 32 * MIB);

/// Above this many chunks libcuda's overflow reaches saved registers and the return address:
/// the importer dies (docs/facts.md: 5248 MiB imports, 5264 MiB crashes, on driver 580).
const IMPORT_CRASH_CHUNKS: u64 = 164;
