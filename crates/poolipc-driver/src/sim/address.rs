//! The simulated address space of a process, and what an access finds there: each process
//! sees its own pools at [`OWN_BASE`] + slot * [`POOL_SPAN`], imported pools at
//! [`IMPORT_BASE`] + slot * [`POOL_SPAN`], VMM reservations (and `cuMemAlloc` memory) from
//! [`VMM_BASE`]. [`SimDriver::touch`] resolves an address range for an access when it is issued
//! and checks every rule but ordering (which [`hb`](super::hb) checks);
//! [`SimDriver::at_run`] finds the memory again when the access runs.

use super::hb::Mem;
use super::local::Local;
use super::regions::{IMPORT_BASE, OWN_BASE, POOL_SPAN, VMM_BASE};
use super::shm::Mapping;
use super::state::{BLOCK_CACHED, BLOCK_LIVE, GRANULE, State};
use super::{SimDriver, fail};
use crate::error::{CuCode, Result};
use crate::types::{Access, DevicePtr};
use crate::violation::{self, ViolationKind};

/// Where a device address points in this process.
#[derive(Clone, Copy, Debug)]
pub(super) enum Place {
    Pool(usize, u64),
    Vmm(u64, u64),
}

impl SimDriver {
    /// Resolves `[ptr, ptr + len)` for an access, checking every rule but ordering (which
    /// [`hb::access`](super::hb::access) checks once the operation has its sequence number).
    /// Violations are recorded; an unmapped range is also an error.
    #[allow(clippy::too_many_arguments)] // one call site per kind of access; a struct would only rename them
    pub(super) fn touch(
        &self,
        l: &Local,
        st: &mut State,
        call: &'static str,
        ptr: DevicePtr,
        len: u64,
        write: bool,
    ) -> Result<(Place, Mem)> {
        let p = ptr.0;
        // Memory lent for a job that ended: named so in the report.
        let ended = l
            .returned
            .iter()
            .rev()
            .find(|(start, end, _)| *start <= p && p < *end)
            .map(|(_, _, label)| *label);
        let unmapped = |st: &mut State| {
            let mut v = st
                .violation(ViolationKind::UnmappedAccess, call, self.pid)
                .values(p, len);
            if let Some(label) = ended {
                v = v.memory(label);
            }
            v.log();
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

    /// When a queued access runs: the mapping and offset of `place`, if the memory is still
    /// there; an access that runs after its allocation was freed (or recycled), or after its
    /// mapping went, is an [`ViolationKind::UnmappedAccess`] and touches nothing.
    pub(super) fn at_run<'l>(
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

    pub(super) fn mapping<'l>(l: &'l Local, place: &Place) -> Option<(&'l Mapping, usize)> {
        match *place {
            Place::Pool(slot, off) => Some((&l.pools.get(&slot)?.map, usize::try_from(off).ok()?)),
            Place::Vmm(base, off) => Some((&l.maps.get(&base)?.map, usize::try_from(off).ok()?)),
        }
    }

    /// The shared file bytes behind `[ptr, ptr + len)`, when that lies in one registered,
    /// file-backed range, as the race detector names them.
    pub(super) fn host_range(l: &Local, ptr: usize, len: usize) -> Option<Mem> {
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
}
