//! The simulated machine's shared state: fixed tables of plain integers in one shared mapping,
//! read and written only under the machine lock. All-zero bytes are the empty machine.
//!
//! Nothing here does IO: the driver (`super`) maps the state, takes the lock, and calls these
//! functions, which return what the caller must still do to memory (poison, punch holes).
//!
//! This module holds the layout (the records and the [`State`] they make up) and the
//! bookkeeping of VMM allocations, streams, events, violations and exiting processes; `pool`
//! holds the pool allocator (blocks, frees, releases, pools in limbo).

mod pool;

use crate::violation::ViolationKind;

/// One counter per stream slot of the machine: a vector clock (see [`hb`](super::hb)).
pub(super) type Clock = [u64; MAX_STREAMS];

pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"PLIPCSIM");
/// Bumped whenever the layout below changes: a child built from other sources refuses to attach.
pub(super) const LAYOUT: u64 = 9;

pub(super) const MAX_DEVICES: usize = 8;
/// [`State::mps`]: the machine runs an MPS server that every process is a client of.
pub(super) const MPS_ON: u32 = 1;
/// [`State::mps`]: a client faulted under MPS; every client's context is lost.
pub(super) const MPS_FAULTED: u32 = 2;
pub(super) const MAX_POOLS: usize = 128;
pub(super) const MAX_BLOCKS: usize = 8192;
pub(super) const MAX_IMPORTS: usize = 4096;
pub(super) const MAX_STREAMS: usize = 256;
pub(super) const MAX_EVENTS: usize = 1024;
pub(super) const MAX_VIOLATIONS: usize = 1024;
/// Accesses not yet known complete remembered at once (see [`AccessRec`]).
pub(super) const MAX_ACCESSES: usize = 4096;

/// VMM allocations (`cuMemCreate`) alive at once, all processes.
pub(super) const MAX_VMM: usize = 1024;
/// Processes that may hold one VMM allocation (a handle or a mapping) at once.
pub(super) const VMM_HOLDERS: usize = 16;

/// Pool allocations are rounded up to this (the real pool's granularity for pinned memory).
pub(super) const GRANULE: u64 = 2 << 20;
/// The physical chunk a pool allocation is made of; pointer import handles at most 128.
pub(super) const CHUNK: u64 = 32 << 20;
/// libcuda's on-stack array of chunk handles (docs/facts.md, "The import limit").
pub(super) const IMPORT_CHUNK_LIMIT: u64 = 128;

/// The 32 MiB chunks that `[start, start + len)` touches.
#[must_use]
pub(super) fn chunks_spanned(start: u64, len: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    let end = start.saturating_add(len - 1);
    end / CHUNK - start / CHUNK + 1
}

#[repr(C)]
#[derive(Debug)]
pub(super) struct DeviceRec {
    pub(super) total: u64,
    /// Bytes reserved by every pool and VMM allocation on the device, all processes.
    pub(super) reserved: u64,
}

pub(super) const POOL_FREE: u32 = 0;
pub(super) const POOL_LIVE: u32 = 1;
/// Destroyed while allocations were live: goes away with the last of them.
pub(super) const POOL_DYING: u32 = 2;
/// Destroyed by its owner with exported memory in limbo ([`PoolRec::limbo`]): the slot stays
/// taken, and the bytes counted against the device, until no live process holds an import of
/// the pool ([`PoolRec::importers`]). Measured on the H200 (driver 580,
/// docs/facts.md, "Other driver behaviour designed for").
pub(super) const POOL_LIMBO: u32 = 3;
/// Processes that may hold an import of one pool at once (more are not counted).
pub(super) const POOL_IMPORTERS: usize = 16;

#[repr(C)]
#[derive(Debug)]
pub(super) struct PoolRec {
    pub(super) state: u32,
    pub(super) device: u32,
    pub(super) shareable: u32,
    pub(super) exported: u32,
    pub(super) owner_pid: u32,
    pub(super) reuse_follow: u32,
    pub(super) reuse_opportunistic: u32,
    pub(super) reuse_internal: u32,
    pub(super) owner_agent: u64,
    pub(super) generation: u64,
    pub(super) capacity: u64,
    pub(super) top: u64,
    pub(super) release_threshold: u64,
    pub(super) reserved: u64,
    pub(super) reserved_high: u64,
    pub(super) used: u64,
    pub(super) used_high: u64,
    /// Bytes of exported allocations that were freed and then released by the pool: gone
    /// from its reserved figure, still held on the device ([`BLOCK_LIMBO`] blocks).
    pub(super) limbo: u64,
    /// Processes holding an import of this pool (`cuMemPoolImportFromShareableHandle`).
    pub(super) importers: [VmmHolder; POOL_IMPORTERS],
}

pub(super) const BLOCK_EMPTY: u32 = 0;
pub(super) const BLOCK_LIVE: u32 = 1;
/// Freed, still reserved by the pool (poisoned).
pub(super) const BLOCK_CACHED: u32 = 2;
/// Address range of the pool whose memory went back to the device.
pub(super) const BLOCK_HOLE: u32 = 3;
/// Range of an exported allocation that was freed and released by the pool: not reserved by
/// the pool any more, but its memory stays on the device until the pool is gone (the real
/// driver: "trim has no effect on IPC export pools"). A new allocation there takes it again.
pub(super) const BLOCK_LIMBO: u32 = 4;

#[repr(C)]
#[derive(Debug)]
pub(super) struct BlockRec {
    pub(super) state: u32,
    pub(super) pool: u32,
    /// 1 once an allocation of this range was exported (`cuMemPoolExportPointer`): kept
    /// while the range is cached or in limbo, by the memory rather than the allocation.
    pub(super) exported: u32,
    pub(super) _pad: u32,
    pub(super) offset: u64,
    pub(super) size: u64,
    /// What the caller asked for (the allocation's size as the driver reports it).
    pub(super) bytes: u64,
    /// Machine-unique, new at every allocation: recycled memory has a new one.
    pub(super) generation: u64,
    /// What the program calls this allocation (`SimDriver::label_memory`), NUL-padded;
    /// cleared at every allocation.
    pub(super) label: Label,
}

/// A short name in shared memory, UTF-8, NUL-padded.
pub(super) type Label = [u8; LABEL_BYTES];
/// The longest name a stream or an allocation is given; longer ones are cut.
pub(super) const LABEL_BYTES: usize = 48;

/// `text` as a [`Label`], cut at a character boundary.
pub(super) fn label(text: &str) -> Label {
    let mut out = [0u8; LABEL_BYTES];
    let mut end = text.len().min(LABEL_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    out[..end].copy_from_slice(&text.as_bytes()[..end]);
    out
}

/// A [`Label`] as text; `None` when empty.
pub(super) fn label_text(l: &Label) -> Option<String> {
    let n = l.iter().position(|&b| b == 0).unwrap_or(l.len());
    (n > 0).then(|| String::from_utf8_lossy(&l[..n]).into_owned())
}

/// Generations whose free the GPU executed, remembered at once (a ring).
pub(super) const FREED_RING: usize = 4096;

/// One process's handles and mappings of a VMM allocation.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct VmmHolder {
    pub(super) pid: u32,
    pub(super) count: u32,
}

/// A VMM allocation (`cuMemCreate`), known by the file behind it: its memory counts against
/// the device until no live process holds a handle to it or maps it (the driver defers the
/// release to the last unmap).
#[repr(C)]
#[derive(Debug)]
pub(super) struct VmmRec {
    pub(super) live: u32,
    pub(super) device: u32,
    pub(super) bytes: u64,
    pub(super) file_dev: u64,
    pub(super) file_ino: u64,
    pub(super) holders: [VmmHolder; VMM_HOLDERS],
}

#[repr(C)]
#[derive(Debug)]
pub(super) struct ImportRec {
    pub(super) live: u32,
    pub(super) pid: u32,
    pub(super) block: u64,
    pub(super) generation: u64,
    pub(super) agent: u64,
}

#[repr(C)]
#[derive(Debug)]
pub(super) struct StreamRec {
    pub(super) live: u32,
    pub(super) pid: u32,
    pub(super) agent: u64,
    /// What this stream's work is ordered after; `clock[own slot]` counts its own operations
    /// and survives slot reuse, so old knowledge never covers new work.
    pub(super) clock: Clock,
    /// The sequence number of the last of this stream's operations the GPU executed (kept
    /// across slot reuse, like `clock[own slot]`).
    pub(super) executed: u64,
    /// What the program calls this stream (`SimDriver::label_stream`), NUL-padded; the
    /// legacy stream is named so. Cleared when the slot is handed out.
    pub(super) label: Label,
}

#[repr(C)]
#[derive(Debug)]
pub(super) struct EventRec {
    pub(super) live: u32,
    pub(super) interprocess: u32,
    pub(super) owner_pid: u32,
    /// Opens by other processes still holding it.
    pub(super) opens: u32,
    pub(super) owner_alive: u32,
    /// The process of the last record (an interprocess event may be recorded by a process
    /// that opened it): once it is gone, so is its queued work, and a wait is over.
    pub(super) rec_pid: u32,
    pub(super) owner_agent: u64,
    pub(super) generation: u64,
    pub(super) records: u64,
    /// How many of those records the GPU has executed (the event completed up to there).
    pub(super) completed: u64,
    /// The recording stream's clock at the last record.
    pub(super) clock: Clock,
}

#[repr(C)]
#[derive(Debug)]
pub(super) struct ViolationRec {
    pub(super) kind: u32,
    pub(super) call: u32,
    pub(super) pid: u32,
    pub(super) other_pid: u32,
    pub(super) block: u64,
    pub(super) generation: u64,
    pub(super) a: u64,
    pub(super) b: u64,
    /// The other access's call ([`crate::violation::call_code`]), where there is one.
    pub(super) other_call: u32,
    /// Bit 0: the access wrote; bit 1: the other access wrote; bit 2: the streams are known.
    pub(super) flags: u32,
    /// The accessing stream's label, and the other access's stream's, when recorded.
    pub(super) stream: Label,
    pub(super) other_stream: Label,
    /// The allocation's label when recorded.
    pub(super) memory: Label,
    /// Stream slots of the access and of the other access.
    pub(super) stream_slot: u32,
    pub(super) other_stream_slot: u32,
}

/// One access to memory that the GPU has not yet been seen to complete: a kernel, memset or
/// copy reading or writing device memory (a pool's memfd, a VMM allocation's memfd) or
/// registered, file-backed host memory. Memory is named by device and inode of the file behind
/// it and ranges by file offset, so every process's mapping of the same bytes meets here.
/// Pool memory is named by a synthetic device ([`POOL_DEV`]) and the pool's slot.
#[repr(C)]
#[derive(Debug)]
pub(super) struct AccessRec {
    pub(super) live: u32,
    /// 1: the access writes the range; 0: it reads it.
    pub(super) write: u32,
    pub(super) pid: u32,
    /// Stream slot of the access.
    pub(super) stream: u32,
    /// The call ([`crate::violation::call_code`]).
    pub(super) call: u32,
    pub(super) _pad: u32,
    pub(super) dev: u64,
    pub(super) ino: u64,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) agent: u64,
    /// The access's operation on its stream (complete once the stream executed it).
    pub(super) seq: u64,
    /// The pool allocation's generation, where the memory is one.
    pub(super) generation: u64,
}

/// The device number [`AccessRec`]s use for pool memory (its inode is the pool's slot).
pub(super) const POOL_DEV: u64 = u64::MAX;

/// The whole machine. Lives in shared memory only (it is megabytes: never on a stack).
#[repr(C)]
#[derive(Debug)]
pub(super) struct State {
    pub(super) magic: u64,
    pub(super) layout: u64,
    pub(super) size: u64,
    pub(super) machine_id: u64,
    pub(super) device_count: u32,
    pub(super) import_crash: u32,
    /// Whether distinct devices can reach each other (peer access); 1 or 0.
    pub(super) peer_access: u32,
    /// [`MPS_ON`] when every process is an MPS client; [`MPS_FAULTED`] once one of them
    /// faulted, which ends every client's context.
    pub(super) mps: u32,
    /// 1 when each allocation's pointer export names the allocation (see
    /// `SimConfig::blob_per_allocation`); 0: the export of an address and size is the same
    /// every time, as on driver 580.
    pub(super) blob_per_allocation: u32,
    pub(super) _pad_config: u32,
    pub(super) next_id: u64,
    pub(super) violation_count: u64,
    /// How many of the violations some process reported to its user (`Checker::reported`).
    pub(super) violations_reported: u64,
    pub(super) devices: [DeviceRec; MAX_DEVICES],
    pub(super) pools: [PoolRec; MAX_POOLS],
    pub(super) blocks: [BlockRec; MAX_BLOCKS],
    pub(super) imports: [ImportRec; MAX_IMPORTS],
    pub(super) streams: [StreamRec; MAX_STREAMS],
    pub(super) events: [EventRec; MAX_EVENTS],
    pub(super) violations: [ViolationRec; MAX_VIOLATIONS],
    /// Where the next access record goes when no slot is free (oldest first, roughly).
    pub(super) access_cursor: u64,
    pub(super) accesses: [AccessRec; MAX_ACCESSES],
    /// Allocation generations whose stream-ordered free has run: queued work touching one of
    /// them runs after the memory went back to the pool.
    /// What some host has seen complete (a stream or event synchronize, a query that said
    /// complete, a synchronous copy): the merge of every process's host clock. Work covered
    /// by it is ordered before anything any process issues afterwards, since that host may
    /// have told it so (a socket, a pipe) without the driver seeing.
    pub(super) observed: Clock,
    pub(super) freed_cursor: u64,
    pub(super) freed: [u64; FREED_RING],
    pub(super) vmm: [VmmRec; MAX_VMM],
}

/// Work left to the caller after a state change: byte ranges of a pool's memfd.
#[derive(Debug, Default)]
#[must_use]
pub(super) struct MemoryWork {
    /// Fill with the poison pattern (freed, still reserved).
    pub(super) poison: Vec<(u64, u64)>,
    /// Give back to the kernel (released by the pool).
    pub(super) release: Vec<(u64, u64)>,
}

impl State {
    /// Records a VMM allocation made by `pid` (holding its handle) on `device`. `false` when
    /// the table is full.
    pub(super) fn vmm_create(
        &mut self,
        device: u32,
        bytes: u64,
        file: (u64, u64),
        pid: u32,
    ) -> bool {
        let Some(r) = self.vmm.iter_mut().find(|r| r.live == 0) else {
            return false;
        };
        r.live = 1;
        r.device = device;
        r.bytes = bytes;
        (r.file_dev, r.file_ino) = file;
        r.holders = [VmmHolder { pid: 0, count: 0 }; VMM_HOLDERS];
        r.holders[0] = VmmHolder { pid, count: 1 };
        true
    }

    /// `pid` took (`up`) or let go of a handle or a mapping of the VMM allocation behind
    /// `file`. Unknown files (not made by `cuMemCreate` here) are ignored.
    pub(super) fn vmm_hold(&mut self, file: (u64, u64), pid: u32, up: bool) {
        let Some(r) = self
            .vmm
            .iter_mut()
            .find(|r| r.live != 0 && (r.file_dev, r.file_ino) == file)
        else {
            return;
        };
        if let Some(h) = r.holders.iter_mut().find(|h| h.count > 0 && h.pid == pid) {
            h.count = if up { h.count + 1 } else { h.count - 1 };
        } else if up && let Some(h) = r.holders.iter_mut().find(|h| h.count == 0) {
            *h = VmmHolder { pid, count: 1 };
        }
    }

    /// Gives back the memory of every VMM allocation no live process holds.
    pub(super) fn vmm_sweep(&mut self, alive: impl Fn(u32) -> bool) {
        for i in 0..MAX_VMM {
            let r = &mut self.vmm[i];
            if r.live == 0 || r.holders.iter().any(|h| h.count > 0 && alive(h.pid)) {
                continue;
            }
            r.live = 0;
            let (device, bytes) = (r.device as usize, r.bytes);
            if let Some(d) = self.devices.get_mut(device) {
                d.reserved = d.reserved.saturating_sub(bytes);
            }
        }
    }

    pub(super) fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub(super) fn record(&mut self, v: ViolationRec) {
        let i = self.violation_count as usize;
        tracing::warn!(kind = ?ViolationKind::from_u32(v.kind), pid = v.pid, "sim: contract violation recorded");
        if i < MAX_VIOLATIONS {
            self.violations[i] = v;
        }
        self.violation_count += 1;
    }

    pub(super) fn violation(
        &mut self,
        kind: ViolationKind,
        call: &'static str,
        pid: u32,
    ) -> ViolationBuilder<'_> {
        ViolationBuilder {
            state: self,
            rec: ViolationRec {
                kind: kind as u32,
                call: crate::violation::call_code(call),
                pid,
                other_pid: 0,
                block: u64::MAX,
                generation: 0,
                a: 0,
                b: 0,
                other_call: 0,
                flags: 0,
                stream: [0; LABEL_BYTES],
                other_stream: [0; LABEL_BYTES],
                memory: [0; LABEL_BYTES],
                stream_slot: 0,
                other_stream_slot: 0,
            },
        }
    }

    // --- streams and events --------------------------------------------------------------

    /// A free stream slot for `agent`'s new stream. A slot destroyed with work still queued
    /// goes only to the same agent (its engine runs a slot's steps in order, the old ones
    /// first) until that work ran or its process is gone: another engine's steps would
    /// raise the slot's `executed` past the old steps that have not run (a free not run yet
    /// taken for done).
    pub(super) fn stream_create(&mut self, agent: u64, pid: u32) -> Option<usize> {
        let slot = self.streams.iter().enumerate().position(|(i, s)| {
            s.live == 0
                && (s.agent == agent
                    || s.executed >= s.clock[i]
                    || !super::shm::process_alive(s.pid))
        })?;
        let s = &mut self.streams[slot];
        let own = s.clock[slot];
        s.clock = [0; MAX_STREAMS];
        s.clock[slot] = own;
        s.live = 1;
        s.pid = pid;
        s.agent = agent;
        s.label = [0; LABEL_BYTES];
        Some(slot)
    }

    /// Advances stream `s` by one operation and returns its sequence number.
    pub(super) fn tick(&mut self, s: usize) -> u64 {
        self.streams[s].clock[s] += 1;
        self.streams[s].clock[s]
    }

    pub(super) fn event_create(
        &mut self,
        interprocess: bool,
        agent: u64,
        pid: u32,
    ) -> Option<(usize, u64)> {
        let slot = self.events.iter().position(|e| e.live == 0)?;
        let generation = self.next_id();
        let e = &mut self.events[slot];
        e.live = 1;
        e.interprocess = u32::from(interprocess);
        e.owner_pid = pid;
        e.opens = 0;
        e.owner_alive = 1;
        e.owner_agent = agent;
        e.generation = generation;
        e.records = 0;
        e.completed = 0;
        e.rec_pid = pid;
        e.clock = [0; MAX_STREAMS];
        Some((slot, generation))
    }

    // --- processes -----------------------------------------------------------------------

    /// Everything an exiting (or dead) simulated process held, as the real driver drops it
    /// when the process exits: imports, pools, streams, its side of events.
    pub(super) fn drop_process(
        &mut self,
        gone: impl Fn(u64, u32) -> bool,
        work: &mut Vec<(usize, MemoryWork)>,
    ) {
        for imp in self.imports.iter_mut().filter(|i| i.live == 1) {
            if gone(imp.agent, imp.pid) {
                imp.live = 0;
            }
        }
        for h in self.accesses.iter_mut().filter(|h| h.live == 1) {
            if gone(h.agent, h.pid) {
                h.live = 0;
            }
        }
        for p in 0..MAX_POOLS {
            let rec = &self.pools[p];
            if (rec.state == POOL_LIVE || rec.state == POOL_DYING)
                && gone(rec.owner_agent, rec.owner_pid)
            {
                let mut w = MemoryWork::default();
                self.pool_drop(p, &mut w);
                work.push((p, w));
            }
        }
        for s in self.streams.iter_mut().filter(|s| s.live == 1) {
            if gone(s.agent, s.pid) {
                s.live = 0;
            }
        }
        for e in self.events.iter_mut().filter(|e| e.live == 1) {
            if e.owner_alive == 1 && gone(e.owner_agent, e.owner_pid) {
                e.owner_alive = 0;
                if e.opens == 0 {
                    e.live = 0;
                }
            }
        }
    }
}

pub(super) struct ViolationBuilder<'a> {
    state: &'a mut State,
    rec: ViolationRec,
}

impl ViolationBuilder<'_> {
    pub(super) fn block(mut self, block: usize, generation: u64) -> Self {
        self.rec.block = block as u64;
        self.rec.generation = generation;
        if let Some(b) = self.state.blocks.get(block)
            && b.generation == generation
        {
            self.rec.memory = b.label;
        }
        self
    }
    /// The two accesses' streams (slots) and whether each wrote.
    pub(super) fn accesses(
        mut self,
        s: usize,
        write: bool,
        other: usize,
        other_write: bool,
    ) -> Self {
        self.rec.stream = self.state.streams[s].label;
        self.rec.other_stream = self.state.streams[other].label;
        self.rec.stream_slot = s as u32;
        self.rec.other_stream_slot = other as u32;
        self.rec.flags = u32::from(write) | u32::from(other_write) << 1 | 4;
        self
    }
    /// The allocation's label, where the caller knows it better than the block does.
    pub(super) fn memory(mut self, label: Label) -> Self {
        self.rec.memory = label;
        self
    }
    pub(super) fn other_call(mut self, code: u32) -> Self {
        self.rec.other_call = code;
        self
    }

    pub(super) fn other_pid(mut self, pid: u32) -> Self {
        self.rec.other_pid = pid;
        self
    }
    pub(super) fn values(mut self, a: u64, b: u64) -> Self {
        self.rec.a = a;
        self.rec.b = b;
        self
    }
    pub(super) fn log(self) {
        self.state.record(self.rec);
    }
}

#[cfg(test)]
mod tests {
    use super::chunks_spanned;

    const MIB: u64 = 1 << 20;

    #[test]
    fn chunks_are_counted_from_32_mib_boundaries() {
        assert_eq!(chunks_spanned(0, 1), 1);
        assert_eq!(chunks_spanned(0, 4096 * MIB), 128);
        assert_eq!(chunks_spanned(2 * MIB, 4096 * MIB), 129);
        assert_eq!(chunks_spanned(16 * MIB, 5248 * MIB), 165);
        assert_eq!(chunks_spanned(31 * MIB, 2 * MIB), 2);
        assert_eq!(chunks_spanned(5, 0), 0);
    }
}
