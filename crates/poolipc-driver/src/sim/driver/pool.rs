//! Memory pools: `cuMemPool*`, the device's current and default pools, and the pool
//! bookkeeping the other calls share (a handle's slot, applying what the machine's allocator
//! left to do to the pool's memfd, releases at a synchronize).

use std::os::fd::{BorrowedFd, OwnedFd};

use crate::error::{CuCode, DriverError, Result};
use crate::sim::local::{Local, LocalPool};
use crate::sim::regions::POOL_HEADER;
use crate::sim::shm::process_alive;
use crate::sim::shm::{self, Mapping, punch_hole, sparse_memfd};
use crate::sim::state::{self, MemoryWork, POOL_DYING, POOL_LIVE, State};
use crate::sim::{POISON, SimDriver, fail, reap};
use crate::types::{Access, PoolAttribute, PoolCounter, PoolHandle, PoolSharing};

/// Bytes of a freed block that are poisoned; beyond, poisoning would page in gigabytes.
const POISON_LIMIT: u64 = 64 << 20;

/// The handle of pool `slot` at `generation`.
pub(in crate::sim) fn pool_handle(slot: usize, generation: u64) -> PoolHandle {
    PoolHandle((generation << 8) | slot as u64)
}

/// `cuMemPoolCreate`.
pub(super) fn create(d: &SimDriver, ordinal: u32, sharing: PoolSharing) -> Result<PoolHandle> {
    let ordinal = d.device_check("cuMemPoolCreate", ordinal)?;
    let mut l = d.local();
    let slot = d.create_pool(&mut l, ordinal, sharing == PoolSharing::PosixFd)?;
    Ok(pool_handle(slot, l.pools[&slot].generation))
}

/// `cuMemPoolSetAttribute` (own pools only).
pub(super) fn set_attribute(d: &SimDriver, pool: PoolHandle, attr: PoolAttribute) -> Result<()> {
    let l = d.local();
    // Measured on the H200 (driver 580): attributes of an imported pool are refused.
    let slot = SimDriver::own_pool_slot(&l, "cuMemPoolSetAttribute", pool)?;
    d.machine.with(|st| {
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

/// `cuMemPoolGetAttribute` (own pools only).
pub(super) fn get_attribute(d: &SimDriver, pool: PoolHandle, counter: PoolCounter) -> Result<u64> {
    let l = d.local();
    // Measured on the H200 (driver 580): cuMemPoolGetAttribute on an imported pool is
    // INVALID_VALUE.
    let slot = SimDriver::own_pool_slot(&l, "cuMemPoolGetAttribute", pool)?;
    Ok(d.machine.with(|st| {
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

/// `cuMemPoolTrimTo`.
pub(super) fn trim_to(d: &SimDriver, pool: PoolHandle, keep_bytes: u64) -> Result<()> {
    let l = d.local();
    let slot = SimDriver::own_pool_slot(&l, "cuMemPoolTrimTo", pool)?;
    d.machine.with(|st| {
        let mut work = MemoryWork::default();
        st.release_cached(slot, keep_bytes, &mut work);
        SimDriver::apply(&l, slot, &work);
    });
    Ok(())
}

/// `cuDeviceGetMemPool`: the pool set current, else the default pool.
pub(super) fn current(d: &SimDriver, ordinal: u32) -> Result<PoolHandle> {
    let ordinal = d.device_check("cuDeviceGetMemPool", ordinal)?;
    let mut l = d.local();
    let slot = match l.current_pool.get(&ordinal) {
        Some(&s) => s,
        None => d.default_pool(&mut l, ordinal)?,
    };
    Ok(pool_handle(slot, l.pools[&slot].generation))
}

/// `cuDeviceGetDefaultMemPool`, made the first time it is asked for.
pub(super) fn default(d: &SimDriver, ordinal: u32) -> Result<PoolHandle> {
    let ordinal = d.device_check("cuDeviceGetDefaultMemPool", ordinal)?;
    let mut l = d.local();
    let slot = d.default_pool(&mut l, ordinal)?;
    Ok(pool_handle(slot, l.pools[&slot].generation))
}

/// `cuDeviceSetMemPool` of an own pool of that device.
pub(super) fn set_current(d: &SimDriver, ordinal: u32, pool: PoolHandle) -> Result<()> {
    const CALL: &str = "cuDeviceSetMemPool";
    let ordinal = d.device_check(CALL, ordinal)?;
    let mut l = d.local();
    let slot = SimDriver::own_pool_slot(&l, CALL, pool)?;
    if l.pools[&slot].device != ordinal {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    l.current_pool.insert(ordinal, slot);
    Ok(())
}

/// `cuMemPoolExportToShareableHandle`: the pool's memfd, duplicated; marks the pool exported.
pub(super) fn export_fd(d: &SimDriver, pool: PoolHandle) -> Result<OwnedFd> {
    const CALL: &str = "cuMemPoolExportToShareableHandle";
    let l = d.local();
    let slot = SimDriver::own_pool_slot(&l, CALL, pool)?;
    let shareable = d.machine.with(|st| {
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

/// `cuMemPoolImportFromShareableHandle`: maps another process's pool memfd here.
pub(super) fn import_fd(d: &SimDriver, fd: BorrowedFd<'_>) -> Result<PoolHandle> {
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
    if magic != state::MAGIC || machine != d.machine.id || slot >= state::MAX_POOLS as u64 {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    let slot = slot as usize;
    let found = d.machine.with(|st| {
        let p = &st.pools[slot];
        (p.state == POOL_LIVE && p.generation == generation && p.shareable == 1)
            .then_some((p.device, p.owner_agent))
    });
    let (device, owner) = found.ok_or(fail(CALL, CuCode::INVALID_VALUE))?;
    if owner == d.agent {
        // Importing one's own pool: not something poolipc does; refuse.
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    let mut l = d.local();
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
    let map = Mapping::new(&own, POOL_HEADER, d.machine.memory)?;
    let pid = d.pid;
    d.machine.with(|st| st.pool_hold(slot, pid, true));
    let mut access = vec![Access::None; d.machine.devices as usize];
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

/// `cuMemPoolSetAccess` for one device.
pub(super) fn set_access(
    d: &SimDriver,
    pool: PoolHandle,
    ordinal: u32,
    access: Access,
) -> Result<()> {
    const CALL: &str = "cuMemPoolSetAccess";
    let ordinal = d.device_check(CALL, ordinal)?;
    let mut l = d.local();
    let slot = SimDriver::pool_slot(&l, CALL, pool)?;
    let Some(p) = l.pools.get_mut(&slot) else {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    };
    if p.device == ordinal && access != Access::ReadWrite && !p.imported {
        // The pool's own device always has read-write access.
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    if p.device != ordinal && access != Access::None && !d.machine.peer_access {
        // No peer path between the two devices (an assumption: not measured on hardware).
        return Err(fail(CALL, CuCode::INVALID_DEVICE));
    }
    if p.access.len() < d.machine.devices as usize {
        p.access.resize(d.machine.devices as usize, Access::None);
        let own = p.device as usize;
        p.access[own] = Access::ReadWrite;
    }
    p.access[ordinal as usize] = access;
    Ok(())
}

/// `cuMemPoolGetAccess` for one device.
pub(super) fn get_access(d: &SimDriver, pool: PoolHandle, ordinal: u32) -> Result<Access> {
    const CALL: &str = "cuMemPoolGetAccess";
    let ordinal = d.device_check(CALL, ordinal)?;
    let l = d.local();
    let slot = SimDriver::pool_slot(&l, CALL, pool)?;
    let p = &l.pools[&slot];
    Ok(match p.access.get(ordinal as usize) {
        Some(a) => *a,
        None if p.device == ordinal => Access::ReadWrite,
        None => Access::None,
    })
}

impl SimDriver {
    /// Creates a pool in the machine and maps it here.
    pub(super) fn create_pool(
        &self,
        l: &mut Local,
        ordinal: u32,
        shareable: bool,
    ) -> Result<usize> {
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

    pub(super) fn default_pool(&self, l: &mut Local, ordinal: u32) -> Result<usize> {
        if let Some(&p) = l.default_pool.get(&ordinal) {
            return Ok(p);
        }
        let p = self.create_pool(l, ordinal, false)?;
        l.default_pool.insert(ordinal, p);
        Ok(p)
    }

    /// The slot of a pool handle valid in this process.
    pub(super) fn pool_slot(l: &Local, call: &'static str, pool: PoolHandle) -> Result<usize> {
        let slot = (pool.0 & 0xff) as usize;
        match l.pools.get(&slot) {
            Some(p) if p.generation == pool.0 >> 8 && !p.destroyed => Ok(slot),
            _ => Err(fail(call, CuCode::INVALID_VALUE)),
        }
    }

    pub(super) fn own_pool_slot(l: &Local, call: &'static str, pool: PoolHandle) -> Result<usize> {
        let slot = Self::pool_slot(l, call, pool)?;
        if l.pools[&slot].imported {
            return Err(fail(call, CuCode::INVALID_VALUE));
        }
        Ok(slot)
    }

    /// Applies the releases (not the poisoning) that a state change left to do.
    pub(in crate::sim) fn apply_release(l: &Local, pool: usize, work: &MemoryWork) {
        let Some(p) = l.pools.get(&pool) else { return };
        for &(off, len) in &work.release {
            punch_hole(&p.fd, POOL_HEADER + off, len);
        }
    }

    /// Applies poisoning and releases that a state change left to do.
    pub(in crate::sim) fn apply(l: &Local, pool: usize, work: &MemoryWork) {
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
    pub(super) fn release_at_sync(&self, l: &Local, st: &mut State) {
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
                st.pool_sweep(process_alive);
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
            st.pool_sweep(process_alive);
            Self::apply(l, slot, &work);
        });
        Ok(())
    }
}
