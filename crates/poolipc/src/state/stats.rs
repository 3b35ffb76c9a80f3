//! What a [`Parent`](crate::Parent) reports of itself: its workers, its counters, its arena and
//! what `empty_cache` gave back.

use std::sync::atomic::{AtomicU64, Ordering};

use poolipc_contract::Identity;
use poolipc_pool::arena::AllocStats;
use poolipc_types::WorkerId;

use super::Trust;

/// What the result arena holds: every worker's arena together
/// ([`Parent::arena_stats`](crate::Parent::arena_stats)). One worker's arena says what it
/// holds itself ([`Parent::arena_of`](crate::Parent::arena_of)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArenaStats {
    /// The allocator's figures, summed over the arenas (`largest_free`: the largest of any
    /// one arena, the largest block one worker could be given without growing). Blocks given
    /// back but whose event has not been seen complete yet still count as live.
    pub alloc: AllocStats,
    /// Blocks given back, waiting for their event (reclaimed at the next arena result, or by
    /// [`Parent::reclaim_arena`](crate::Parent::reclaim_arena)).
    pub pending_frees: usize,
    /// The cap on the capacity of every arena together (see [`ParentOptions::arena_cap_fraction`](crate::ParentOptions::arena_cap_fraction)).
    pub max_bytes: Option<u64>,
    /// Chunks given back to the device so far (idle, by [`Parent::empty_cache`](crate::Parent::empty_cache), or
    /// emptied after their worker was reaped).
    pub released_chunks: u64,
    /// Their bytes.
    pub released_bytes: u64,
    /// The arenas counted: one per worker that needed one, and those of reaped workers
    /// that still hold chunks.
    pub arenas: usize,
}

/// What [`Parent::empty_cache`](crate::Parent::empty_cache) gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EmptyCache {
    /// Arena chunks given back (every chunk with nothing in it).
    pub arena_chunks: u64,
    /// Their bytes: back on the device once every worker that mapped them unmapped them.
    pub arena_bytes: u64,
    /// Workers told to give something back (unmap a chunk, drop mappings, take or drop a
    /// pool generation) that had not answered: busy in a job (not waited for at all: a job
    /// may run for seconds) or silent for 2 s. What they hold comes back
    /// when they answer.
    pub workers_not_answered: usize,
    /// Workers told to drop their cached mappings of the parent's VMM allocations (the
    /// VMM-handle rung): each keeps the memory behind it alive after the parent freed it.
    pub vmm_workers: usize,
    /// Bytes the shared pools held and gave back (`cuMemPoolTrimTo`), summed over pools.
    /// Pool allocations that were exported to a worker are not among them: the driver keeps
    /// an exported allocation's memory after its free until the pool is destroyed (measured,
    /// docs/facts.md, "Other driver behaviour designed for"); that is what the rotation is for.
    pub pool_bytes: u64,
    /// Pools rotated: a pool whose current generation exported anything got a new
    /// generation, the old one retired ([`SharedPool::rotate`](poolipc_pool::SharedPool::rotate)).
    pub pools_rotated: usize,
    /// Retired generations destroyed (nothing of them in use any more), in the parent and
    /// in every worker that had them.
    pub pools_retired: usize,
    /// Device memory free after the call less before it (`cuMemGetInfo`, all processes: other
    /// work on the device moves it too), 0 when it did not grow.
    pub device_bytes_back: u64,
}

impl EmptyCache {
    /// Adds what another part of the parent gave back (each IO room answers for its own
    /// workers).
    pub(crate) fn add(&mut self, other: &EmptyCache) {
        self.arena_chunks += other.arena_chunks;
        self.arena_bytes += other.arena_bytes;
        self.workers_not_answered += other.workers_not_answered;
        self.vmm_workers += other.vmm_workers;
        self.pool_bytes += other.pool_bytes;
        self.pools_rotated += other.pools_rotated;
        self.pools_retired += other.pools_retired;
        self.device_bytes_back += other.device_bytes_back;
    }
}

/// What the parent knows of a worker.
#[derive(Clone, Debug)]
pub struct WorkerInfo {
    /// Its id.
    pub id: WorkerId,
    /// Its process id, if the parent spawned it.
    pub pid: Option<u32>,
    /// What it said in the handshake.
    pub identity: Identity,
    /// The trust it was spawned (or accepted) with: [`Trust::Isolated`] keeps it from the
    /// parent's memory beyond its inputs' copies.
    pub trust: Trust,
}

/// Counters of a [`Parent`](crate::Parent), read without waiting for anything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParentStats {
    /// Workers connected (canary battery passed or not run).
    pub workers_connected: u64,
    /// Workers lost: killed after a fault (EOF, deadline, protocol violation) or a stop that
    /// had to kill.
    pub workers_lost: u64,
    /// Jobs submitted.
    pub jobs_submitted: u64,
    /// Jobs that completed (the worker's own error included).
    pub jobs_completed: u64,
    /// Jobs that failed (the worker lost, the tensor refused).
    pub jobs_failed: u64,
    /// Tensors (inputs and results) that went by pool pointer.
    pub pool_pointer_tensors: u64,
    /// Tensors (inputs and results) that went by host staging.
    pub host_staged_tensors: u64,
    /// Results that went by the result arena.
    pub arena_results: u64,
    /// Inputs copied into the arena and lent from there ([`Rung::ArenaCopy`](crate::Rung::ArenaCopy)).
    pub arena_copied_inputs: u64,
    /// Arena copies (in, and back for a writable input) made through pinned host memory on
    /// copy engines instead of device to device ([`Tuning::copy_through_host`](crate::Tuning::copy_through_host)).
    pub copies_through_host: u64,
    /// Jobs lent an arena slice ([`ParentOptions::arena_slice_bytes`](crate::ParentOptions::arena_slice_bytes)).
    pub arena_slices_lent: u64,
    /// Results the workers carved out of arena slices (no round trip each); also counted in
    /// [`arena_results`](ParentStats::arena_results).
    pub arena_results_carved: u64,
    /// Inputs that crossed by a copy (arena copy, host staging), lent writable, whose bytes
    /// were copied back into the caller's tensor after the job.
    pub inputs_copied_back: u64,
    /// Jobs whose worker acknowledged them before their DONE had completed on the GPU: the
    /// IO thread held them, querying DONE on the host, until it had (the parent never makes
    /// a stream of its own wait on a worker's event). The others' DONE had completed when
    /// their frames arrived (the usual case under MPS) and cost one query.
    pub jobs_held_for_done: u64,
    /// Jobs whose READY the IO thread recorded on a stream of its own, kept on a copy
    /// engine, because the caller's stream had nothing left to run
    /// ([`Tuning::ready_aside`](crate::Tuning::ready_aside)): without MPS that spares the GPU a
    /// context switch each way (a 4 KiB round trip ~290 → ~20 µs on the H100). The others'
    /// READY went on the caller's stream.
    pub ready_recorded_aside: u64,
    /// Jobs whose Lend the submitting thread wrote itself, finding its IO thread waiting
    /// (the direct path, [`Tuning::direct`](crate::Tuning::direct)); the others went through
    /// the IO thread.
    pub direct_lends: u64,
    /// Frames (a worker's DONE and ACK, mostly) that a thread waiting on a job read itself
    /// while its IO thread slept ([`Tuning::direct`](crate::Tuning::direct)).
    pub direct_reads: u64,
    /// Workers with a job in flight now (lent, not yet ended), as the IO threads last
    /// counted them.
    pub workers_busy: u64,
    /// The most workers that had a job in flight at once since the parent started. Without
    /// MPS the GPU runs one process's context at a time, so workers that compute at once
    /// take turns (on an H100, workers running a kernel a job: about 36000 jobs/s for one
    /// alone, about 7200 for two or more together); the first time two are busy in a
    /// process that is not an MPS client, the parent says so once in its log, with what to
    /// do (`poolipc mps`).
    pub most_workers_busy: u64,
    /// Submits that waited for their worker's turn on the GPU
    /// ([`Tuning::gpu_turn`](crate::Tuning::gpu_turn): without MPS,
    /// while another worker had jobs in flight).
    pub turn_waits: u64,
    /// Nanoseconds those submits waited, all together.
    pub turn_wait_ns: u64,
    /// Waits that ran out (the worker holding the turn kept its jobs longer than
    /// `gpu_turn`): that submit went anyway, and so did every submit after it until
    /// that worker's jobs ended.
    pub turn_waits_ran_out: u64,
    /// The workers' DONE events the parent holds open now (as the IO thread last counted
    /// them): at most [`ParentOptions::max_open_done_events`](crate::ParentOptions::max_open_done_events) per worker.
    pub done_events_open: u64,
    /// Whether a new allocation at a recycled address of the first pool, of the same size,
    /// is lent with its cached blob (proven by the canary battery's check) or exported
    /// again; the counts are in the pool's
    /// [`export_cache_stats`](poolipc_pool::SharedPool::export_cache_stats).
    pub export_reuse: poolipc_pool::ExportReuse,
    /// Inputs lent by VMM handle ([`Rung::VmmHandle`](crate::Rung::VmmHandle)).
    pub vmm_handle_tensors: u64,
    /// VMM allocations whose handle was exported and sent to a worker (once per allocation
    /// and worker; a tensor lent again to a worker that mapped it costs none).
    pub vmm_handles_shared: u64,
    /// Nanoseconds the IO threads have spent working since the parent started, all
    /// together: everything but waiting for sockets, commands and deadlines (their
    /// spinning, and the DONE queries made while they spin, count as waiting). One IO thread
    /// serves every worker unless [`Tuning::io_threads`](crate::Tuning::io_threads)
    /// says more: the busy share of a stretch of time (this figure's growth over the wall
    /// time, per IO thread) near 1 means they are what limits the jobs per second; `poolipc
    /// bench --workers N` prints it.
    pub io_busy_ns: u64,
}

#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) workers_connected: AtomicU64,
    pub(crate) workers_lost: AtomicU64,
    pub(crate) jobs_submitted: AtomicU64,
    pub(crate) jobs_completed: AtomicU64,
    pub(crate) jobs_failed: AtomicU64,
    pub(crate) pool_pointer_tensors: AtomicU64,
    pub(crate) host_staged_tensors: AtomicU64,
    pub(crate) arena_results: AtomicU64,
    pub(crate) arena_copied_inputs: AtomicU64,
    pub(crate) copies_through_host: AtomicU64,
    pub(crate) arena_slices_lent: AtomicU64,
    pub(crate) arena_results_carved: AtomicU64,
    pub(crate) inputs_copied_back: AtomicU64,
    pub(crate) vmm_handle_tensors: AtomicU64,
    pub(crate) vmm_handles_shared: AtomicU64,
    pub(crate) jobs_held_for_done: AtomicU64,
    pub(crate) ready_recorded_aside: AtomicU64,
    pub(crate) direct_lends: AtomicU64,
    pub(crate) direct_reads: AtomicU64,
    pub(crate) io_busy_ns: AtomicU64,
    pub(crate) workers_busy: AtomicU64,
    pub(crate) most_workers_busy: AtomicU64,
    pub(crate) turn_waits: AtomicU64,
    pub(crate) turn_wait_ns: AtomicU64,
    pub(crate) turn_waits_ran_out: AtomicU64,
    /// Whether the log has said that busy workers take turns without MPS (once a parent).
    pub(crate) turns_said: std::sync::atomic::AtomicBool,
}

impl Stats {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
