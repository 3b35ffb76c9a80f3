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
//! allocation it touched was freed is an [`ViolationKind::UnmappedAccess`] when it runs. The
//! model is `hb`'s, documented there.
//!
//! # Where things are
//!
//! - `hb`: the happens-before model (vector clocks) and the race detector.
//! - `address`: a process's address space, and what an access finds there; `regions`: where
//!   in it each kind of memory starts.
//! - `driver`: the [`Driver`] trait, one module per kind of resource (device, pool, pointer,
//!   alloc, event, stream, copy, vmm).
//! - `local`: one simulated process's own tables; `state`: the machine's shared tables (with
//!   `state::pool`, the pool allocator); `machine`: the shared mapping and its lock.
//! - `exec`: the engine that runs queued work; `shm`: memfds, mappings and process liveness;
//!   `blob`: the 64-byte blobs between processes.
//! - What is recorded, [`Violation`], and the [`Checker`] that reads it live in the crate's
//!   `violation` module, below both the [`Driver`] trait and this simulation.
//!
//! [`Driver`]: crate::Driver
//! [`Driver::mem_pool_export_fd`]: crate::Driver::mem_pool_export_fd
//! [`Driver::stream_create`]: crate::Driver::stream_create

mod address;
mod blob;
mod driver;
mod exec;
mod hb;
mod local;
mod machine;
mod regions;
mod shm;
mod state;

use std::sync::{Arc, Mutex, MutexGuard};

pub use crate::violation::{Checker, Violation, ViolationKind};
pub use exec::{DELAY_ENV, SEED_ENV};
use exec::{Engine, Step};
use local::Local;
use machine::Machine;
use regions::POOL_SPAN;
use shm::my_pid;
use shm::process_alive;
use state::{CHUNK, GRANULE, State};

use crate::error::{CuCode, DriverError, Result};
use crate::types::{DevicePtr, DeviceUuid, StreamHandle};
use crate::violation::{self, ViolationLog};

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

/// Freed memory is filled with this byte (the first 64 MiB of each freed block).
pub const POISON: u8 = 0xDB;
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
    /// GPU fault in one process ([`Driver::launch_store_kernel`](crate::Driver::launch_store_kernel) through a bad address) ends
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
        self.violations_since(0)
    }

    /// The violations recorded after the first `from` (as [`violation_count`] counted them
    /// then), oldest first; those past the first 1024 are counted but not kept.
    ///
    /// [`violation_count`]: SimDriver::violation_count
    #[must_use]
    pub fn violations_since(&self, from: u64) -> Vec<Violation> {
        violations_in(&self.machine, from)
    }

    /// Forgets every recorded violation (a test that provoked one on purpose, after checking
    /// it, so that later checks see only new ones).
    pub fn clear_violations(&self) {
        self.machine.with(|st| {
            st.violation_count = 0;
            st.violations_reported = 0;
        });
    }

    /// How many violations were recorded on this machine.
    #[must_use]
    pub fn violation_count(&self) -> u64 {
        self.machine.with(|st| st.violation_count)
    }

    /// Names `stream` (one of this process's, or the null stream) in violation reports, e.g.
    /// `the worker's job stream`; at most 48 bytes are kept.
    pub fn label_stream(&self, stream: StreamHandle, label: &str) -> Result<()> {
        let mut l = self.local();
        let l = &mut *l;
        self.machine.with(|st| {
            let s = self.stream_slot(l, st, "SimDriver::label_stream", stream)?;
            st.streams[s].label = state::label(label);
            Ok(())
        })
    }

    /// Names the pool allocation (or import) holding `ptr` in violation reports, e.g.
    /// `input 0 of job 3`, until it is freed; at most 48 bytes are kept. Memory that is not
    /// a live pool allocation or import of this process is left unnamed (`false`).
    pub fn label_memory(&self, ptr: DevicePtr, label: &str) -> bool {
        let l = self.local();
        self.machine.with(|st| {
            let before = st.violation_count;
            let found = self.touch(&l, st, "SimDriver::label_memory", ptr, 1, false);
            // A lookup, not an access: whatever it would have recorded is not a violation.
            st.violation_count = before;
            match found {
                Ok((
                    _,
                    hb::Mem {
                        alloc: Some((b, g)),
                        ..
                    },
                )) if st.blocks[b].generation == g => {
                    st.blocks[b].label = state::label(label);
                    true
                }
                _ => false,
            }
        })
    }

    /// A handle on this machine's violation log, for a reader that holds the driver as
    /// `dyn Driver` ([`Driver::sim_checker`](crate::Driver::sim_checker)).
    #[must_use]
    pub fn checker(&self) -> Checker {
        Checker::new(
            Arc::clone(&self.machine) as Arc<dyn ViolationLog>,
            self.engine.seed(),
        )
    }

    /// Lends `[ptr, ptr + len)` of this process to job `job`, whose stream is `stream`, which
    /// was just made to wait for the job's READY: from now on, every access to it must come
    /// on a stream ordered after `stream` at this point
    /// ([`ViolationKind::NotAfterReady`]), never write it when `read_only`
    /// ([`ViolationKind::ReadOnlyWritten`]), and every write to it must be ordered before
    /// [`returned`](SimDriver::returned) ([`ViolationKind::WriteAfterDone`]). `label` names
    /// it in reports (`input 0 of job 3`). The race detector alone would let an access
    /// through when some host happened to see the parent's writes complete; this check does
    /// not depend on timing.
    pub fn lend(
        &self,
        job: u64,
        ptr: DevicePtr,
        len: u64,
        stream: StreamHandle,
        read_only: bool,
        label: &str,
    ) -> Result<()> {
        // A mark on the stream: an event record, whose sequence number says where it stood.
        let marker = self.local().lend_marker;
        let marker = match marker {
            Some(m) => crate::EventHandle(m),
            None => {
                let e = self.own_event()?;
                self.local().lend_marker = Some(e.0);
                e
            }
        };
        crate::Driver::event_record(self, marker, stream)?;
        let mut l = self.local();
        let l = &mut *l;
        self.machine.with(|st| {
            let slot = self.stream_slot(l, st, "SimDriver::lend", stream)?;
            let seq = st.streams[slot].clock[slot];
            let before = st.violation_count;
            let found = self.touch(l, st, "SimDriver::lend", ptr, len.max(1), false);
            st.violation_count = before;
            let (_, mem) = found?;
            l.lent
                .retain(|g| g.end <= ptr.0 || ptr.0.saturating_add(len) <= g.start);
            l.lent.push(local::Lent {
                job,
                start: ptr.0,
                end: ptr.0.saturating_add(len),
                mem,
                slot,
                seq,
                read_only,
                label: state::label(label),
                reported: false,
            });
            Ok(())
        })
    }

    /// Job `job`, whose stream is `stream`, records DONE there now: every write to memory lent
    /// for it must be ordered before this point ([`ViolationKind::WriteAfterDone`]), and the
    /// memory is no longer lent.
    pub fn returned(&self, job: u64, stream: StreamHandle) -> Result<()> {
        let mut l = self.local();
        let l = &mut *l;
        self.machine.with(|st| {
            let s = self.stream_slot(l, st, "SimDriver::returned", stream)?;
            let clock = st.streams[s].clock;
            let agent = self.agent;
            let mut found = Vec::new();
            for g in l.lent.iter().filter(|g| g.job == job) {
                let late = st.accesses.iter().find(|r| {
                    r.live == 1
                        && r.agent == agent
                        && r.write == 1
                        && r.dev == g.mem.dev
                        && r.ino == g.mem.ino
                        && r.start < g.mem.end
                        && g.mem.start < r.end
                        && clock[r.stream as usize] < r.seq
                });
                if let Some(r) = late {
                    found.push((g.label, r.stream as usize, r.call));
                }
            }
            for (label, other, call) in found {
                let v = st
                    .violation(ViolationKind::WriteAfterDone, "cuEventRecord", self.pid)
                    .memory(label)
                    .other_call(call)
                    .accesses(s, false, other, true);
                v.log();
            }
            for g in l.lent.iter().filter(|g| g.job == job) {
                let mut ended = g.label;
                let suffix = b" (ended)";
                let n = ended.iter().position(|&b| b == 0).unwrap_or(ended.len());
                if n + suffix.len() <= ended.len() {
                    ended[n..n + suffix.len()].copy_from_slice(suffix);
                }
                if l.returned.len() == local::RETURNED {
                    l.returned.pop_front();
                }
                l.returned.push_back((g.start, g.end, ended));
            }
            l.lent.retain(|g| g.job != job);
            Ok(())
        })
    }

    /// The checks of memory lent for a job ([`lend`](SimDriver::lend)), for an access by
    /// `call` on stream slot `s` to `[ptr, ptr + len)`.
    #[allow(clippy::too_many_arguments)] // the access, as every site has it
    fn lent_check(
        &self,
        l: &mut Local,
        st: &mut State,
        call: &'static str,
        ptr: DevicePtr,
        len: u64,
        write: bool,
        s: usize,
    ) {
        let end = ptr.0.saturating_add(len);
        for g in l
            .lent
            .iter_mut()
            .filter(|g| !g.reported && g.start < end && ptr.0 < g.end)
        {
            if write && g.read_only {
                g.reported = true;
                st.violation(ViolationKind::ReadOnlyWritten, call, self.pid)
                    .memory(g.label)
                    .accesses(s, true, g.slot, false)
                    .log();
            } else if st.streams[s].clock[g.slot] < g.seq {
                g.reported = true;
                // The other process's last write to it, if still remembered: what the
                // access may come before.
                let agent = self.agent;
                let last = st
                    .accesses
                    .iter()
                    .filter(|r| {
                        r.live == 1
                            && r.agent != agent
                            && r.write == 1
                            && r.dev == g.mem.dev
                            && r.ino == g.mem.ino
                            && r.start < g.mem.end
                            && g.mem.start < r.end
                    })
                    .max_by_key(|r| r.seq)
                    .map(|r| (r.pid, r.call, r.stream as usize));
                let mut v = st
                    .violation(ViolationKind::NotAfterReady, call, self.pid)
                    .memory(g.label);
                v = match last {
                    Some((pid, other_call, other)) => v
                        .other_pid(pid)
                        .other_call(other_call)
                        .accesses(s, write, other, true),
                    None => v.accesses(s, write, g.slot, false),
                };
                v.log();
            }
        }
    }

    /// The seed of this process's engine ([`SEED_ENV`], else drawn from the clock): with
    /// `POOLIPC_SIM_SEED` set to it, a run replays the same choices of delays and stream order.
    #[must_use]
    pub fn seed(&self) -> u64 {
        self.engine.seed()
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
            local: Arc::new(Mutex::new(Local::new())),
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

    /// Queues `step` as operation `seq` of stream slot `s` on this process's engine.
    fn issue(&self, s: usize, seq: u64, step: Step) {
        self.engine.push(s, seq, step, &self.local, &self.machine);
    }

    /// This simulated process, as the race detector names it.
    fn process(&self) -> hb::Process {
        hb::Process {
            pid: self.pid,
            agent: self.agent,
        }
    }
}

impl ViolationLog for Machine {
    fn id(&self) -> u64 {
        self.id
    }

    fn count(&self) -> u64 {
        self.with(|st| st.violation_count)
    }

    fn since(&self, from: u64) -> Vec<Violation> {
        violations_in(self, from)
    }

    fn reported(&self) -> u64 {
        self.with(|st| st.violations_reported)
    }

    fn mark_reported(&self, upto: u64) {
        self.with(|st| st.violations_reported = st.violations_reported.max(upto));
    }
}

fn violations_in(machine: &Machine, from: u64) -> Vec<Violation> {
    machine.with(|st| {
        let n = (st.violation_count as usize).min(st.violations.len());
        let from = (from as usize).min(n);
        st.violations[from..n]
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
                    stream: (v.flags & 4 != 0).then(|| {
                        state::label_text(&v.stream)
                            .unwrap_or_else(|| format!("stream #{}", v.stream_slot))
                    }),
                    other_stream: (v.flags & 4 != 0).then(|| {
                        state::label_text(&v.other_stream)
                            .unwrap_or_else(|| format!("stream #{}", v.other_stream_slot))
                    }),
                    memory: state::label_text(&v.memory),
                    writes: (v.flags & 4 != 0).then_some((v.flags & 1 != 0, v.flags & 2 != 0)),
                })
            })
            .collect()
    })
}

/// Drops what dead processes held (their imports above all) to free table slots.
fn reap(st: &mut State) {
    let mut work = Vec::new();
    st.drop_process(|_, pid| pid != 0 && !process_alive(pid), &mut work);
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

#[cfg(test)]
mod tests;

// Keep the chunk size and MiB in the public docs honest.
const _: () = assert!(CHUNK == 32 * MIB);
