//! What a device pointer is (`cuPointerGetAttribute`, `cuMemGetAddressRange`), and a pool
//! allocation's export and import across processes (`cuMemPoolExportPointer`,
//! `cuMemPoolImportPointer`), with the import limit and the reuse of blobs as driver 580 has
//! them.

use super::pool::pool_handle;
use crate::error::{CuCode, DriverError, Result};
use crate::sim::blob::{BLOB_BY_ADDRESS, BLOB_POINTER, blob_fields, export_blob};
use crate::sim::local::LocalImport;
use crate::sim::regions::{IMPORT_BASE, OWN_BASE, POOL_SPAN, VMM_BASE};
use crate::sim::shm;
use crate::sim::state::{
    self, BLOCK_CACHED, BLOCK_LIVE, IMPORT_CHUNK_LIMIT, State, chunks_spanned,
};
use crate::sim::{SimDriver, fail, reap};
use crate::types::{DevicePtr, ExportBlob, PoolHandle};
use crate::violation::ViolationKind;

/// Above this many chunks libcuda's overflow reaches saved registers and the return address:
/// the importer dies (docs/facts.md: 5248 MiB imports, 5264 MiB crashes, on driver 580).
const IMPORT_CRASH_CHUNKS: u64 = 164;

/// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)`.
pub(super) fn mempool(d: &SimDriver, ptr: DevicePtr) -> Result<PoolHandle> {
    const CALL: &str = "cuPointerGetAttribute";
    let l = d.local();
    let p = ptr.0;
    if (OWN_BASE..IMPORT_BASE).contains(&p) {
        let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
        let off = (p - OWN_BASE) % POOL_SPAN;
        let lp = l.pools.get(&slot).filter(|lp| !lp.imported);
        let live = d.machine.with(|st| {
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

/// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_BUFFER_ID)`.
pub(super) fn buffer_id(d: &SimDriver, ptr: DevicePtr) -> Result<u64> {
    // Found as `pointer_get_mempool` finds the allocation, failing the same way.
    const CALL: &str = "cuPointerGetAttribute";
    let l = d.local();
    let p = ptr.0;
    if (OWN_BASE..IMPORT_BASE).contains(&p) {
        let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
        let off = (p - OWN_BASE) % POOL_SPAN;
        if l.pools.get(&slot).is_some_and(|lp| !lp.imported) {
            let live = d.machine.with(|st| {
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

/// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)` of device memory.
pub(super) fn device(d: &SimDriver, ptr: DevicePtr) -> Result<u32> {
    // Found as `pointer_get_mempool` finds pool memory, and through the mappings for VMM
    // and cuMemAlloc memory.
    const CALL: &str = "cuPointerGetAttribute";
    let l = d.local();
    let p = ptr.0;
    if (OWN_BASE..IMPORT_BASE).contains(&p) {
        let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
        let off = (p - OWN_BASE) % POOL_SPAN;
        if let Some(lp) = l.pools.get(&slot).filter(|lp| !lp.imported) {
            let live = d.machine.with(|st| {
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

/// `cuMemGetAddressRange`: the allocation, import or mapping `ptr` lies in.
pub(super) fn range(d: &SimDriver, ptr: DevicePtr) -> Result<(DevicePtr, u64)> {
    const CALL: &str = "cuMemGetAddressRange_v2";
    let l = d.local();
    let p = ptr.0;
    if (OWN_BASE..IMPORT_BASE).contains(&p) {
        let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
        let off = (p - OWN_BASE) % POOL_SPAN;
        if l.pools.get(&slot).is_some_and(|lp| !lp.imported) {
            let found = d.machine.with(|st| {
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

/// `cuMemPoolExportPointer` of a live allocation of an exported pool.
pub(super) fn export(d: &SimDriver, ptr: DevicePtr) -> Result<ExportBlob> {
    d.check_context("cuMemPoolExportPointer")?;
    const CALL: &str = "cuMemPoolExportPointer";
    let l = d.local();
    let p = ptr.0;
    if !(OWN_BASE..IMPORT_BASE).contains(&p) {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    let slot = ((p - OWN_BASE) / POOL_SPAN) as usize;
    let off = (p - OWN_BASE) % POOL_SPAN;
    if l.pools.get(&slot).is_none_or(|lp| lp.imported) {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    d.machine.with(|st| {
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
        let (block, generation) = if d.machine.blob_per_allocation {
            (b as u64, r.generation)
        } else {
            (BLOB_BY_ADDRESS, 0)
        };
        Ok(ExportBlob(export_blob([
            state::MAGIC,
            d.machine.id,
            BLOB_POINTER,
            slot as u64 | (st.pools[slot].generation << 8),
            block,
            generation,
            r.offset,
            r.bytes,
        ])))
    })
}

/// `cuMemPoolImportPointer`: the range a blob names, mapped at its address in the imported
/// pool.
pub(super) fn import(d: &SimDriver, pool: PoolHandle, data: &ExportBlob) -> Result<DevicePtr> {
    d.check_context("cuMemPoolImportPointer")?;
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
    let mut l = d.local();
    let slot = SimDriver::pool_slot(&l, CALL, pool)?;
    if magic != state::MAGIC
        || machine != d.machine.id
        || kind != BLOB_POINTER
        || !l.pools[&slot].imported
        || pool_id != (slot as u64 | (l.pools[&slot].generation << 8))
        || (block >= state::MAX_BLOCKS as u64 && block != BLOB_BY_ADDRESS)
        || (block == BLOB_BY_ADDRESS) == d.machine.blob_per_allocation
    {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    let ptr = IMPORT_BASE + slot as u64 * POOL_SPAN + offset;
    let l = &mut *l;
    d.machine.with(|st| {
        let (mut block, mut generation) = if block == BLOB_BY_ADDRESS {
            // Driver 580: the blob names a range; it maps whatever allocation starts
            // there now. Its range, not the allocation's: one larger than the live
            // allocation reaches past it (measured on the H200), a violation here.
            match st.live_block_at(slot, offset) {
                Some(b) => {
                    let (live_bytes, g) = (st.blocks[b].bytes, st.blocks[b].generation);
                    if live_bytes < bytes {
                        st.violation(ViolationKind::ImportBeyondAllocation, CALL, d.pid)
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
            st.violation(ViolationKind::ImportOfFreed, CALL, d.pid)
                .block(block, generation)
                .log();
            (block, generation) = (j, st.blocks[j].generation);
        }
        let chunks = chunks_spanned(offset, bytes);
        if chunks > IMPORT_CHUNK_LIMIT {
            st.violation(ViolationKind::ImportOverLimit, CALL, d.pid)
                .block(block, generation)
                .values(chunks, IMPORT_CHUNK_LIMIT)
                .log();
            if !d.machine.import_crash {
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
        r.pid = d.pid;
        r.agent = d.agent;
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
