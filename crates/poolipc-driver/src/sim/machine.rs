//! The simulated machine: one memfd holding the lock page and the [`State`] tables, mapped
//! shared by every process attached to it.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::AtomicU32;

use super::shm::{MachineLock, Mapping, my_pid, sparse_memfd};
use super::state::{LAYOUT, MAGIC, MAX_DEVICES, State};
use crate::error::{DriverError, Result};

/// The lock word sits alone in the first page; the state follows.
const STATE_OFFSET: usize = 4096;

#[derive(Debug)]
pub(super) struct Machine {
    fd: OwnedFd,
    map: Mapping,
    pub(super) id: u64,
    pub(super) devices: u32,
    pub(super) memory: u64,
    pub(super) import_crash: bool,
    pub(super) peer_access: bool,
    pub(super) blob_per_allocation: bool,
}

fn map_len() -> u64 {
    (STATE_OFFSET + size_of::<State>()).next_multiple_of(4096) as u64
}

fn attach_error(reason: String) -> DriverError {
    DriverError::InvalidArgument {
        call: "SimDriver::from_env",
        reason,
    }
}

impl Machine {
    pub(super) fn create(config: &super::SimConfig) -> Result<Machine> {
        let (devices, memory, import_crash) = (
            config.devices,
            config.memory_per_device,
            config.import_crash,
        );
        let fd = sparse_memfd("poolipc-sim-machine", map_len())?;
        let map = Mapping::new(&fd, 0, map_len())?;
        let id = machine_id();
        let m = Machine {
            fd,
            map,
            id,
            devices,
            memory,
            import_crash,
            peer_access: config.peer_access,
            blob_per_allocation: config.blob_per_allocation,
        };
        m.with(|st| {
            st.magic = MAGIC;
            st.layout = LAYOUT;
            st.size = size_of::<State>() as u64;
            st.machine_id = id;
            st.device_count = devices;
            st.import_crash = u32::from(import_crash);
            st.peer_access = u32::from(config.peer_access);
            st.mps = if config.mps { super::state::MPS_ON } else { 0 };
            st.blob_per_allocation = u32::from(config.blob_per_allocation);
            for d in st.devices.iter_mut().take(devices as usize) {
                d.total = memory;
            }
        });
        Ok(m)
    }

    /// Attaches to the machine of process `pid`, whose descriptor `fd` holds it.
    pub(super) fn attach(pid: u32, fd: i32, id: u64) -> Result<Machine> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|source| DriverError::Os {
                call: "open simulated machine",
                source,
            })?;
        let fd = OwnedFd::from(file);
        let len = nix::sys::stat::fstat(&fd)
            .map_err(|e| super::shm::os("fstat", e))?
            .st_size;
        if u64::try_from(len).ok() != Some(map_len()) {
            return Err(attach_error(format!(
                "{path} is {len} bytes, not a simulated machine of this build ({} bytes)",
                map_len()
            )));
        }
        let map = Mapping::new(&fd, 0, map_len())?;
        let mut m = Machine {
            fd,
            map,
            id,
            devices: 0,
            memory: 0,
            import_crash: true,
            peer_access: true,
            blob_per_allocation: false,
        };
        let (magic, layout, found, devices, memory, crash, peer, per_alloc) = m.with(|st| {
            (
                st.magic,
                st.layout,
                st.machine_id,
                st.device_count,
                st.devices[0].total,
                st.import_crash,
                st.peer_access,
                st.blob_per_allocation,
            )
        });
        if magic != MAGIC || layout != LAYOUT || found != id {
            return Err(attach_error(format!(
                "{path} is not simulated machine {id:#x} of this layout (found {found:#x}, layout {layout})"
            )));
        }
        m.devices = devices.min(MAX_DEVICES as u32);
        m.memory = memory;
        m.import_crash = crash != 0;
        m.peer_access = peer != 0;
        m.blob_per_allocation = per_alloc != 0;
        Ok(m)
    }

    /// `(pid, fd)` another process opens through `/proc` to attach.
    pub(super) fn locator(&self) -> (u32, i32) {
        (my_pid(), self.fd.as_raw_fd())
    }

    fn lock_word(&self) -> &AtomicU32 {
        // SAFETY: the mapping starts page-aligned and is at least a page long, so its first
        // four bytes are an aligned u32 that lives as long as `self`; AtomicU32 has u32's
        // layout; every process touches this word only atomically.
        unsafe { &*self.map.base().as_ptr().cast::<AtomicU32>() }
    }

    /// Runs `f` on the machine state under the machine lock.
    pub(super) fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let _guard = MachineLock::acquire(self.lock_word());
        debug_assert!(self.map.len() >= STATE_OFFSET + size_of::<State>());
        // SAFETY: `State` is repr(C) plain integers, valid for any bytes (zeroed = empty);
        // it lies page-aligned at STATE_OFFSET inside the mapping (length checked at creation
        // and attach), disjoint from the lock word; the machine lock is held by this thread,
        // and every thread of every process touches the state only under it, so this is the
        // only reference to it until `_guard` drops at the end of this function.
        let st = unsafe { &mut *self.map.base().as_ptr().add(STATE_OFFSET).cast::<State>() };
        f(st)
    }
}

fn machine_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    // splitmix64 of time, pid and a counter: distinct machines, distinct UUIDs.
    let mut z = t ^ (u64::from(my_pid()) << 32) ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
