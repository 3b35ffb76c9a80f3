//! The happens-before model: when one access to memory is ordered before another, and the
//! race detector that checks every access against it.
//!
//! # Vector clocks
//!
//! Each stream of the machine (a slot of `State::streams`, whatever process it belongs to) has a
//! [`Clock`]: one counter per stream slot. Its own entry counts its operations
//! (`State::tick` gives each operation its sequence number); the others say, for every other
//! stream, up to which operation this stream's work is known to come after. Knowledge moves
//! between clocks by [`merge`] (the larger of each entry), and only in the ways the real
//! driver orders work:
//!
//! - **stream order**: an operation is ordered after every earlier one on its stream (its own
//!   entry);
//! - **events**: `cuEventRecord` captures the recording stream's clock in the event;
//!   `cuStreamWaitEvent` merges that capture into the waiting stream's clock (an event never
//!   recorded orders nothing);
//! - **the host**: each simulated process keeps a host clock, what its host thread has seen
//!   complete (a stream or event synchronize, a query that said complete, a synchronous copy:
//!   [`host_learns`]); every stream the host issues to merges it first, so work issued after a
//!   synchronize is ordered after what it waited for;
//! - **what some host observed**: `State::observed` merges every process's host clock. A host
//!   that saw work complete may have told another process so (a socket, a pipe) without the
//!   driver seeing: work it covers is ordered before anything any process issues afterwards;
//! - **the pool's internal dependency**: memory a pool hands out again after a free on another
//!   stream, before that free ran, makes the allocating stream wait for it
//!   ([`pool_dependencies`]).
//!
//! # Accesses
//!
//! Every access to memory (a memset, either side of a copy, a kernel's store, a free) is
//! checked when it is issued, not when it runs: [`access`] compares it with every remembered
//! access to overlapping bytes, by any stream of any live process, whether or not that one ran
//! yet. Unless both only read, the earlier one must be ordered before it (its stream's entry
//! in the accessing stream's clock, or in `observed`, reaches its sequence number), else an
//! [`ViolationKind::UnorderedAccess`] is recorded naming both calls, both processes and the
//! allocation. The order must be guaranteed, not lucky.
//!
//! Memory is named by the file behind it ([`Mem`]: device and inode, and a range of file
//! offsets), so every process's mapping of the same bytes meets in one table
//! (`State::accesses`): a pool's memfd (by [`POOL_DEV`] and the pool's slot), a VMM
//! allocation's memfd, or registered host memory backed by a shared file. An access is
//! remembered until a write covering it supersedes it (a read supersedes only its own stream's
//! earlier reads), or its process goes away.
//!
//! Nothing here does IO: these functions read and write the machine's [`State`] under its lock.

use super::shm::process_alive;
use super::state::{AccessRec, Clock, MAX_ACCESSES, POOL_DEV, State};
use crate::violation::{self, ViolationKind};

/// Takes in what `from` knows: every entry becomes the larger of the two.
pub(super) fn merge(into: &mut Clock, from: &Clock) {
    for (a, b) in into.iter_mut().zip(from) {
        *a = (*a).max(*b);
    }
}

/// The host of a process learned that everything `clock` covers completed: its host clock
/// takes it in, and so does what some host observed.
pub(super) fn host_learns(host: &mut Clock, observed: &mut Clock, clock: &Clock) {
    merge(host, clock);
    merge(observed, clock);
}

/// The bytes an access touches, as the race detector names them: (device, inode) of the file
/// behind them (pool memory: [`POOL_DEV`] and the pool's slot), a range of file offsets, and
/// the pool allocation `(block, generation)` where the memory is one.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mem {
    pub(super) dev: u64,
    pub(super) ino: u64,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) alloc: Option<(usize, u64)>,
}

impl Mem {
    /// `len` bytes of pool `slot` from `off`.
    pub(super) fn pool(slot: usize, off: u64, len: u64, alloc: Option<(usize, u64)>) -> Mem {
        Mem {
            dev: POOL_DEV,
            ino: slot as u64,
            start: off,
            end: off.saturating_add(len),
            alloc,
        }
    }
}

/// The simulated process making an access: its OS process id and its id on the machine.
#[derive(Clone, Copy, Debug)]
pub(super) struct Process {
    pub(super) pid: u32,
    pub(super) agent: u64,
}

/// The race detector: operation `seq` of stream slot `s` (already ticked), issued by `by`,
/// reads or writes `mem`. Every earlier access to overlapping bytes by any stream of any live
/// simulated process, where one of the two writes, must be ordered before this one by
/// happens-before (stream order, events recorded and waited on, host synchronizes); else
/// an [`ViolationKind::UnorderedAccess`] naming both. Whether the earlier access happened
/// to have run already does not matter: the order must be guaranteed, not lucky. Then
/// this access is remembered until a write covering it supersedes it, or its process
/// goes away. An earlier access some host has seen complete (`State::observed`) is
/// ordered before everything issued later, as on hardware.
pub(super) fn access(
    st: &mut State,
    by: Process,
    call: &'static str,
    s: usize,
    seq: u64,
    mem: &Mem,
    write: bool,
) {
    let mut unordered: Option<(u32, u32, u64, u64, usize, bool)> = None;
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
        if r.pid != by.pid && !process_alive(r.pid) {
            // Its process is gone, and its queued work with it.
            st.accesses[i].live = 0;
            continue;
        }
        if unordered.is_none() {
            unordered = Some((r.pid, r.call, rseq, known, rs, r.write == 1));
        }
    }
    if let Some((pid, other_call, seq_other, known, rs, other_write)) = unordered {
        let mut v = st
            .violation(ViolationKind::UnorderedAccess, call, by.pid)
            .other_pid(pid)
            .other_call(other_call)
            .values(seq_other, known)
            .accesses(s, write, rs, other_write);
        if let Some((b, g)) = mem.alloc {
            v = v.block(b, g);
        }
        v.log();
    }
    // What this access covers is superseded: a write supersedes every earlier access
    // (ordered before it, or reported just now), a read this stream's earlier reads.
    let agent = by.agent;
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
        pid: by.pid,
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

/// The pool's internal dependency, for a new allocation at `off..off + size` of pool `slot`
/// issued on stream slot `s`: memory recycled from a free is ordered after that free, a free
/// on this stream by stream order, one on another stream that has not run yet by a dependency
/// of this stream on it. A free's record is done with (forgotten) once the free ran or an
/// allocation took all of its range; one not run yet whose range was handed out only in part
/// stays, so that every allocation of its range waits for it. For each dependency: (its
/// sequence number on `s`, the freeing stream's slot, the free's sequence number there), for
/// the caller to queue.
pub(super) fn pool_dependencies(
    st: &mut State,
    s: usize,
    slot: usize,
    off: u64,
    size: u64,
) -> Vec<(u64, usize, u64)> {
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
        // A free that has not run yet poisons its whole range when it runs: its record is done
        // with once it ran, or once this allocation takes all of that range. Else the rest of
        // the range, handed out later (on another stream, say), must wait for it too.
        let ran = st.streams[fs].executed >= fseq;
        if ran || (off <= r.start && r.end <= off + size) {
            st.accesses[i].live = 0;
        }
        if fs != s && !ran {
            let mut upto = st.streams[fs].clock;
            upto[fs] = fseq;
            merge(&mut st.streams[s].clock, &upto);
            dependencies.push((st.tick(s), fs, fseq));
        }
    }
    dependencies
}
