//! Allocations and frees: `cuMemAlloc`/`cuMemFree` (kept as VMM mappings, so the race
//! detector covers them), the stream-ordered `cuMemAllocAsync`/`cuMemAllocFromPoolAsync` and
//! `cuMemFreeAsync`, of allocations and of imports alike.

use crate::api::Driver;
use crate::error::{CuCode, Result};
use crate::sim::exec::Step;
use crate::sim::hb::{self, Mem};
use crate::sim::local::Local;
use crate::sim::regions::{IMPORT_BASE, OWN_BASE, POOL_SPAN};
use crate::sim::shm::process_alive;
use crate::sim::state::{GRANULE, MemoryWork, State};
use crate::sim::{SimDriver, fail};
use crate::types::{Access, DevicePtr, PoolHandle, StreamHandle};
use crate::violation::ViolationKind;

/// `cuMemAlloc_v2`.
pub(super) fn plain(d: &SimDriver, bytes: u64) -> Result<DevicePtr> {
    // Kept as a mapping of an unexportable handle, so every access to it goes through the
    // race detector as VMM memory does; flagged plain, so no handle can be retained.
    const CALL: &str = "cuMemAlloc_v2";
    d.check_context(CALL)?;
    if bytes == 0 {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    let ordinal = SimDriver::context(&d.local(), CALL)?;
    let len = bytes
        .checked_next_multiple_of(GRANULE)
        .ok_or(fail(CALL, CuCode::OUT_OF_MEMORY))?;
    let handle = d.create_vmm(ordinal, len, false)?;
    let mapped = d.vmm_reserve(len, 0).and_then(|ptr| {
        d.vmm_map(ptr, len, handle)
            .and_then(|()| d.vmm_set_access(ptr, len, ordinal, Access::ReadWrite))
            .map(|()| ptr)
            .inspect_err(|_| {
                let _ = d.vmm_unmap_checked(ptr, len);
                let _ = d.vmm_address_free_checked(ptr, len);
            })
    });
    let ptr = match mapped {
        Ok(p) => p,
        Err(e) => {
            let _ = d.vmm_release_checked(handle);
            return Err(e);
        }
    };
    let mut l = d.local();
    if let Some(m) = l.maps.get_mut(&ptr.0) {
        m.plain = true;
    }
    l.plain.insert(ptr.0, (handle, len));
    Ok(ptr)
}

/// `cuMemAllocAsync`: from the current device's current pool.
pub(super) fn from_current_pool(
    d: &SimDriver,
    bytes: u64,
    stream: StreamHandle,
) -> Result<DevicePtr> {
    d.check_context("cuMemAllocAsync")?;
    let pool = {
        let l = d.local();
        SimDriver::context(&l, "cuMemAllocAsync")?
    };
    let pool = d.device_get_mem_pool(pool)?;
    d.alloc("cuMemAllocAsync", bytes, pool, stream)
}

/// `cuMemAllocFromPoolAsync`.
pub(super) fn from_pool(
    d: &SimDriver,
    bytes: u64,
    pool: PoolHandle,
    stream: StreamHandle,
) -> Result<DevicePtr> {
    d.check_context("cuMemAllocFromPoolAsync")?;
    d.alloc("cuMemAllocFromPoolAsync", bytes, pool, stream)
}

impl SimDriver {
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
            for pid in st.live_importers(b, generation_, process_alive) {
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
            hb::access(
                st,
                self.process(),
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
            // internal dependency). The frees' records over it are then done with, but for a
            // free not run yet of which this allocation takes only part (`pool_dependencies`).
            let (off, size, g) = (
                st.blocks[b].offset,
                st.blocks[b].size,
                st.blocks[b].generation,
            );
            let dependencies: Vec<(u64, Step)> = hb::pool_dependencies(st, s, slot, off, size)
                .into_iter()
                .map(|(dseq, fs, fseq)| {
                    (
                        dseq,
                        Step::AfterStream {
                            slot: fs,
                            seq: fseq,
                        },
                    )
                })
                .collect();
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
