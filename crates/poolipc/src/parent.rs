//! The parent: owns the shared pools, spawns workers, and runs jobs on them through one IO
//! loop that drives the ownership contract (see [`crate::driver_loop`]).
//!
//! [`Parent`] is `Send + Sync`: any thread may [`submit`](Parent::submit) a job and
//! [`wait`](JobHandle::wait) for it; jobs on different workers run at the same time and a
//! worker may have several jobs in flight. `spawn_worker`, `stop_worker`, `worker` and `stats`
//! never wait for a running job.

use std::collections::{BTreeMap, VecDeque};
use std::io::Write as _;
use std::os::fd::AsFd as _;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use poolipc_contract::{
    DEFAULT_MAX_JOB_LIFETIME, DEFAULT_MAX_RESULT_BYTES_PER_JOB,
    DEFAULT_MAX_RESULT_BYTES_PER_WORKER, DEFAULT_MAX_RESULTS_PER_JOB, ExtraPool, Identity, Message,
};
use poolipc_driver::{DevicePtr, Driver, OwnedEvent, PoolHandle, StreamHandle};
use poolipc_pool::arena::{AllocStats, ArenaBlock};
use poolipc_pool::{Arena, SharedPool};
use poolipc_transport::{Capabilities, Connection, HandshakeConfig, SendQueueLimits};
use poolipc_types::{ImportLimit, JobId, Rung, WorkerId};

use crate::canary::CanaryReport;
use crate::driver_loop::{self, Command as LoopCommand};
use crate::error::Error;
use crate::staging::StagingConfig;
use crate::tensor::{ResultShape, TensorDesc};

/// How a [`Parent`] behaves.
#[derive(Clone, Debug)]
pub struct ParentOptions {
    /// The device whose pool is shared.
    pub device: u32,
    /// More devices to share a pool of, one each (empty by default). A worker is offered them
    /// after the handshake and says which it can use from its own device; tensors from a pool
    /// it cannot use go to it by host staging.
    pub more_devices: Vec<u32>,
    /// Which allocations may go by pool pointer (the 128-chunk rule by default).
    pub limit: ImportLimit,
    /// How long a worker may stay silent about a job it holds before the parent kills it
    /// (every message about the job starts the wait again).
    pub handoff_timeout: Duration,
    /// How long a worker may take to start and shake hands.
    pub handshake_timeout: Duration,
    /// How long [`Parent::stop_worker`] waits for a worker to exit after Bye before it kills it.
    pub stop_timeout: Duration,
    /// How long a frame that has begun to arrive may take to complete, and how long a frame
    /// queued for a worker may wait to be all sent. The IO loop waits on neither: it reads
    /// what has come and writes what the socket takes, and a worker past this deadline is
    /// condemned alone.
    pub frame_timeout: Duration,
    /// How many frames (and bytes) the IO loop keeps queued for a worker that does not read
    /// before it condemns that worker (1024 frames, 16 MiB by default).
    pub send_queue: SendQueueLimits,
    /// How long the IO loop looks again, without sleeping, after its last activity (a job
    /// finished, a command came) when no job is in flight: a caller's next submit then finds
    /// it awake instead of paying its wake-up (≈ 40 µs on the H200's host, measured: with
    /// 50 µs a 4 KiB round trip was 1.13× the bare-driver floor, with 400 µs 1.03–1.06×, the
    /// GPU's part unchanged). At most this much CPU after each job. Zero turns it off. By
    /// default `POOLIPC_SPIN_US` if set, else 400 µs where the machine has four or more
    /// CPUs, else zero.
    pub spin: Duration,
    /// How long, counted from a job's submit and from each frame a worker sends, the IO loop
    /// and a thread waiting on the job's [`JobHandle`] look again before they sleep. A
    /// sleeping thread costs a wake-up when the answer comes (tens of microseconds each on
    /// a busy host, two per handoff: the loop's and the waiter's); without MPS a handoff
    /// takes ≈ 330 µs of GPU turn-taking, far past [`spin`](ParentOptions::spin), so this
    /// is what keeps those wake-ups out of it. At most this much CPU per job on each of the
    /// two threads; a long job sleeps after it. Zero turns it off. By default
    /// `POOLIPC_SPIN_IN_FLIGHT_US` if set, else 1 ms where the machine has four or more
    /// CPUs, else zero.
    pub spin_in_flight: Duration,
    /// Run the canary battery on each new worker before it takes jobs.
    pub canary: bool,
    /// The host-staging rung's buffer and waits.
    pub staging: StagingConfig,
    /// Where results of [`submit`](Parent::submit) (the default allocator) live:
    /// [`ResultMemory::Pool`] by default, [`ResultMemory::Arena`] for the fast path.
    /// [`submit_with`](Parent::submit_with) always uses the caller's allocator.
    pub results: ResultMemory,
    /// Whether an input that cannot go by pool pointer but is device memory of the parent's
    /// device (the shared pool's over the import limit or for a worker that may not import
    /// it, or any other kind: `cuMemAlloc` memory, another library's pool, a VMM mapping) is
    /// copied device-to-device into a block of the arena and lent from there ([`Rung::ArenaCopy`])
    /// rather than through host staging. True by default. It needs a worker with the arena
    /// capability and enough free VRAM (see
    /// [`arena_copy_vram_margin`](ParentOptions::arena_copy_vram_margin)); otherwise, or
    /// when false, such inputs take host staging as before.
    ///
    /// With [`ResultMemory::Arena`] the copies share the result arena and its cap: a copy
    /// is made only when it fits under the cap, but it may then leave too little for the
    /// job's own results, which are refused (out of memory) rather than sent to the pool;
    /// give a capped arena room for both, or turn this off. With
    /// [`ResultMemory::Pool`] an arena is made for them alone at the first copy, as large as
    /// that copy (and grown by chunks of that size, with no cap). The arena keeps its chunks
    /// until the parent is dropped: after a 16 GiB copy, 16 GiB of VRAM stay reserved for
    /// the next one.
    pub arena_copy: bool,
    /// The VRAM that must stay free after an arena copy that needs new arena memory: an
    /// input takes the arena-copy rung only when `cuMemGetInfo` reports at least its size
    /// plus this much free (256 MiB by default). A copy that fits in the arena as it is
    /// needs no new memory and is not checked.
    pub arena_copy_vram_margin: u64,
    /// Whether an input that is a VMM allocation of the parent's device (`cuMemCreate` +
    /// `cuMemMap`, as ComfyUI maps model weights) made with the POSIX FD handle type is lent
    /// by its handle ([`Rung::VmmHandle`]): no copy; each worker maps it once and keeps the
    /// mapping (and so the memory behind it) until told to drop it. True by default. Needs
    /// a worker that takes VMM handles on the parent's device and a driver that gives the
    /// allocation a buffer id; otherwise, or when false, such inputs take the arena copy.
    pub vmm_handles: bool,
    /// Bytes of the result arena lent with each job as its **arena slice** (protocol 6), out
    /// of which the worker carves results whose shapes it learns late without a round trip
    /// per request; 0 (the default) turns slices off. Changed later with
    /// [`Parent::set_arena_slice_bytes`].
    ///
    /// A slice is lent only to a worker that maps the arena, for a job whose results go to
    /// the arena ([`ResultMemory::Arena`] with [`submit`](Parent::submit)'s default
    /// allocator), and only when the arena has a free range that large already: a slice
    /// never grows the arena, and one that does not fit is silently not lent (the worker
    /// then asks for its results as before). The worker carves a batch of results out of
    /// the slice's free tail (512-byte aligned) when the whole batch fits, else asks the
    /// parent. Carved results arrive in [`JobOutput::results`] in the order the worker asked
    /// for them, mixed with granted ones, as [`ResultTensor`]s that own their part of the
    /// slice; the rest of the slice goes back to the arena once the job's stream waited on
    /// the worker's DONE (the whole slice, if the job failed or was cancelled, or once a dead
    /// worker was reaped). While a job runs, its slice is arena memory no one else can use.
    pub arena_slice_bytes: u64,
    /// The arena's cap when none is given ([`ResultMemory::Arena`] with `max_bytes: None`,
    /// and the arena made for arena copies under [`ResultMemory::Pool`]): this fraction of
    /// the device's total memory, read when the arena is made (0.5 by default). A result
    /// that would pass the cap is refused with out-of-memory; an input copy that would pass
    /// it takes host staging. Must lie in `(0, 1]`.
    pub arena_cap_fraction: f64,
    /// How long an arena chunk with nothing in it stays mapped before the IO thread gives
    /// it back to the device (10 s by default); `None`: only [`Parent::empty_cache`] gives
    /// chunks back. A chunk with a block lent, granted or still in use on the GPU is never
    /// given back. Each worker that mapped it is told to unmap it; the memory is back once
    /// all have.
    pub arena_idle_release: Option<Duration>,
    /// The most results one job may ask for, over all its result requests
    /// ([`DEFAULT_MAX_RESULTS_PER_JOB`]: 8192, as many as a job may have inputs). A worker
    /// that asks for
    /// more is condemned: killed, its jobs failed with [`Error::JobFailed`] and
    /// [`FailReason::BoundExceeded`](poolipc_contract::FailReason)`(`[`Bound::ResultsPerJob`](poolipc_contract::Bound)`)`;
    /// the parent and the other workers go on.
    pub max_results_per_job: u64,
    /// The most result bytes one job may ask for, over all its requests (counted as asked,
    /// allocated or refused; [`DEFAULT_MAX_RESULT_BYTES_PER_JOB`]: 32 GiB). Past it the
    /// worker is condemned ([`Bound::ResultBytesPerJob`](poolipc_contract::Bound)). The
    /// arena's cap and the pool's own out-of-memory refuse earlier on a smaller device;
    /// this bound ends a worker that keeps asking.
    pub max_result_bytes_per_job: u64,
    /// The most result bytes a worker's open jobs may have asked for together (a job's
    /// results count until it finished; [`DEFAULT_MAX_RESULT_BYTES_PER_WORKER`]: 48 GiB).
    /// Past it the worker is condemned
    /// ([`Bound::ResultBytesPerWorker`](poolipc_contract::Bound)).
    pub max_result_bytes_per_worker: u64,
    /// The longest a job may stay open from its submit, however often its worker speaks
    /// about it ([`DEFAULT_MAX_JOB_LIFETIME`]: 4 h, above any ComfyUI node run we know of;
    /// [`handoff_timeout`](ParentOptions::handoff_timeout) catches a silent worker much
    /// sooner). Past it the job fails and the worker is condemned
    /// ([`Bound::JobLifetime`](poolipc_contract::Bound)).
    pub max_job_lifetime: Duration,
    /// The most DONE events of one worker the parent keeps open
    /// ([`DEFAULT_MAX_OPEN_DONE_EVENTS`]: 64). A worker that records every DONE on one
    /// event (as poolipc's does) holds one; one that sends a new event with each job has the
    /// least recently used closed as it sends more (reopened if it sends one again). Only
    /// when every one of them is waited on by a job held for its DONE is the worker
    /// condemned ([`Bound::OpenDoneEvents`](poolipc_contract::Bound)). Zero is taken as one.
    pub max_open_done_events: usize,
}

/// [`ParentOptions::max_open_done_events`]'s default.
pub const DEFAULT_MAX_OPEN_DONE_EVENTS: usize = 64;

/// Where the parent puts a job's results when the caller gives no allocator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResultMemory {
    /// The shared pool (the seed's way): each result is allocated from the pool, its pointer
    /// exported (about 0.43 ms/GiB, every time) and imported by the worker; results above
    /// the import limit take host staging. The caller gets an ordinary pool allocation and
    /// frees it through [`Parent::pool`]. The default, so that existing callers keep these
    /// semantics.
    #[default]
    Pool,
    /// The result arena: the fast path. Parent-owned VMM memory (`cuMemCreate` chunks) that
    /// each worker maps once; a result handoff is then an offset: no export, no import, no
    /// import limit (a result may be as large as the arena). The caller gets a
    /// [`ResultTensor`] that gives its block back, stream-ordered, when dropped (or with
    /// [`ResultTensor::return_to_arena`]).
    ///
    /// The arena is created lazily, on the parent's IO thread, at the first result that goes
    /// to it: a parent whose workers never return results reserves no device memory for it.
    /// It starts with one chunk of `initial_bytes` (rounded up to the driver's granularity)
    /// and grows by chunks of that size (or of the request, if larger) up to `max_bytes`
    /// (`None`: no cap); a result that would pass the cap is refused with out-of-memory.
    /// Workers whose driver or device has no VMM by POSIX FD, or that cannot reach the
    /// parent's device, get pool results as before.
    Arena {
        /// The first chunk's size, and the size of chunks added by growth.
        initial_bytes: u64,
        /// The most the arena may hold in total; `None` for no cap.
        max_bytes: Option<u64>,
    },
}

impl Default for ParentOptions {
    fn default() -> Self {
        ParentOptions {
            device: 0,
            more_devices: Vec::new(),
            limit: ImportLimit::default(),
            handoff_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(60),
            stop_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(5),
            send_queue: SendQueueLimits::default(),
            spin: default_spin(SPIN_ENV, Duration::from_micros(400)),
            spin_in_flight: default_spin(SPIN_IN_FLIGHT_ENV, Duration::from_millis(1)),
            canary: true,
            staging: StagingConfig::default(),
            results: ResultMemory::Pool,
            arena_copy: true,
            arena_copy_vram_margin: DEFAULT_ARENA_COPY_VRAM_MARGIN,
            vmm_handles: true,
            arena_slice_bytes: 0,
            arena_cap_fraction: DEFAULT_ARENA_CAP_FRACTION,
            arena_idle_release: Some(DEFAULT_ARENA_IDLE_RELEASE),
            max_results_per_job: DEFAULT_MAX_RESULTS_PER_JOB,
            max_result_bytes_per_job: DEFAULT_MAX_RESULT_BYTES_PER_JOB,
            max_result_bytes_per_worker: DEFAULT_MAX_RESULT_BYTES_PER_WORKER,
            max_job_lifetime: DEFAULT_MAX_JOB_LIFETIME,
            max_open_done_events: DEFAULT_MAX_OPEN_DONE_EVENTS,
        }
    }
}

/// [`ParentOptions::arena_cap_fraction`]'s default: half the device.
pub const DEFAULT_ARENA_CAP_FRACTION: f64 = 0.5;

/// [`ParentOptions::arena_idle_release`]'s default: 10 s.
pub const DEFAULT_ARENA_IDLE_RELEASE: Duration = Duration::from_secs(10);

/// How long [`Parent::empty_cache`] waits for the workers to unmap the arena chunks it gave
/// back: a worker busy in a long job answers after it; its chunks' memory follows then.
pub const EMPTY_CACHE_WAIT: Duration = Duration::from_secs(2);

/// [`ParentOptions::arena_copy_vram_margin`]'s default: 256 MiB.
pub const DEFAULT_ARENA_COPY_VRAM_MARGIN: u64 = 256 << 20;

/// The environment variable that sets [`ParentOptions::spin`]'s default, in microseconds.
pub const SPIN_ENV: &str = "POOLIPC_SPIN_US";

/// The environment variable that sets [`ParentOptions::spin_in_flight`]'s default, in
/// microseconds.
pub const SPIN_IN_FLIGHT_ENV: &str = "POOLIPC_SPIN_IN_FLIGHT_US";

/// `env` if set to a number of microseconds; else `spin` where there are CPUs to spare for
/// spinning (four or more), none otherwise.
fn default_spin(env: &str, spin: Duration) -> Duration {
    if let Some(us) = std::env::var(env).ok().and_then(|v| v.trim().parse().ok()) {
        return Duration::from_micros(us);
    }
    match std::thread::available_parallelism() {
        Ok(n) if n.get() >= 4 => spin,
        _ => Duration::ZERO,
    }
}

/// An input tensor to lend: where its first element is, and its layout. It must stay alive
/// (and unwritten by the caller) until its job returns. Memory of the shared pool goes by pool
/// pointer; memory of the shared pool that cannot (over the import limit) is copied into the
/// arena ([`Rung::ArenaCopy`], see [`ParentOptions::arena_copy`]) or takes host staging; any
/// other device memory (`cuMemAlloc`, another pool) takes host staging.
///
/// An arena copy is queued on the job's stream when the job is placed, before its READY: work
/// the caller queued on that stream before submitting (the kernels that wrote the tensor) is
/// copied after it, and work the caller queues on it after [`JobHandle::wait`] (a write, a
/// free) runs after the copy. The worker reads only the copy.
///
/// # Writes by the worker
///
/// No write is lost silently. Unless `read_only` is set, a write the worker makes to its view
/// reaches this tensor on every rung: in place on the pool pointer; on arena copy the block
/// is copied back into the tensor on the job's stream once the worker's DONE completed
/// (before the block goes back to the arena); on host staging the worker's copy comes back
/// through the staging buffer after its `Done`, copied in on the job's stream. Either way,
/// work queued on the job's stream after [`JobHandle::wait`] sees the worker's writes. The
/// copy-back covers the tensor's whole extent (element 0 to its last element, gaps of a
/// strided view included: the bytes the worker was sent). It happens when the worker
/// finished the job (Done and Ack: completed, cancelled, or its code reported an error, as a
/// pool-pointer write would have landed too); a job whose worker died or was killed before
/// that leaves the tensor as it was: no DONE orders the worker's writes.
///
/// With `read_only` ([`Input::read_only`]) nothing is copied back, and the worker learns
/// the flag (its view says so, DLPack exports it read-only). A write then fails loudly where
/// the hardware allows: an arena-copy block is mapped read-only in the worker, so a kernel's
/// write faults and a copy into it fails. On the pool pointer the worker writes the caller's
/// memory itself (the import cannot be made read-only for one tensor of a pool): the flag is
/// advice the worker's views enforce, and such a write is seen by the parent, not lost. On
/// host staging the worker's copy is private device memory: the views refuse a write, but a
/// kernel that writes it anyway changes only that copy, which is freed after the job.
#[derive(Clone, Debug)]
pub struct Input {
    /// The address of element 0.
    pub ptr: DevicePtr,
    /// The layout.
    pub desc: TensorDesc,
    /// The worker only reads it: no copy-back, and a write fails where the hardware allows
    /// (see above).
    pub read_only: bool,
}

impl Input {
    /// A writable input: what the worker writes reaches the tensor.
    #[must_use]
    pub fn new(ptr: DevicePtr, desc: TensorDesc) -> Input {
        Input {
            ptr,
            desc,
            read_only: false,
        }
    }

    /// The same input, lent read-only: nothing comes back, the worker's view is read-only.
    #[must_use]
    pub fn read_only(self) -> Input {
        Input {
            read_only: true,
            ..self
        }
    }
}

/// A result the worker wrote, in memory the parent allocated.
///
/// - From the caller's allocator ([`Parent::submit_with`]) or the shared pool
///   ([`ResultMemory::Pool`]): an ordinary allocation, the caller's to keep and free.
/// - From the result arena ([`ResultMemory::Arena`], [`Rung::Arena`]): a block of the
///   parent's arena that this value owns. Dropping it gives the block back **stream-ordered**:
///   an event is recorded on the job's stream (after the worker's DONE completed) and the
///   arena reuses the block only once that event completed, so work the caller queued on
///   that stream before the drop finishes first. Work on another stream must be ordered
///   before the drop by the caller, or the block given back on that stream with
///   [`return_to_arena`](ResultTensor::return_to_arena). Either way, exactly once.
#[derive(Debug)]
pub struct ResultTensor {
    /// The allocation (from the job's allocator, the shared pool by default), or the arena
    /// block's address.
    pub ptr: DevicePtr,
    /// Its size.
    pub bytes: u64,
    /// The shape the worker announced.
    pub shape: ResultShape,
    /// How it crossed.
    pub rung: Rung,
    /// The arena block this result owns, for arena results.
    lease: Option<ArenaLease>,
}

impl ResultTensor {
    pub(crate) fn new(ptr: DevicePtr, bytes: u64, shape: ResultShape, rung: Rung) -> Self {
        ResultTensor {
            ptr,
            bytes,
            shape,
            rung,
            lease: None,
        }
    }

    pub(crate) fn in_arena(
        arena: Arc<Arena<dyn Driver>>,
        block: ArenaBlock,
        bytes: u64,
        shape: ResultShape,
        stream: StreamHandle,
    ) -> Self {
        ResultTensor {
            ptr: block.ptr,
            bytes,
            shape,
            rung: Rung::Arena,
            lease: Some(ArenaLease {
                held: Some((arena, block)),
                stream,
            }),
        }
    }

    /// Whether this result is a block of the result arena (given back when dropped).
    pub fn is_arena(&self) -> bool {
        self.lease.as_ref().is_some_and(|l| l.held.is_some())
    }

    /// Gives an arena result's block back, ordered after the work queued on `stream` so far
    /// (an event recorded there; the arena reuses the block once it completed). Returns
    /// whether there was a block to give back: `false` for memory of the pool or of the
    /// caller's allocator, which stays the caller's to free.
    pub fn return_to_arena(mut self, stream: StreamHandle) -> Result<bool, Error> {
        match self.lease.as_mut().and_then(|l| l.held.take()) {
            Some((arena, block)) => give_back(&arena, block, stream).map(|()| true),
            None => Ok(false),
        }
    }
}

/// An arena block owned by a [`ResultTensor`] (or by the IO loop, for an input's arena copy):
/// given back once, stream-ordered, when dropped (unless [`ResultTensor::return_to_arena`]
/// gave it back first). The drop lives here, not on `ResultTensor`, so that a result's fields
/// can still be moved out of it.
pub(crate) struct ArenaLease {
    held: Option<(Arc<Arena<dyn Driver>>, ArenaBlock)>,
    /// The job's stream: where the drop orders the return.
    stream: StreamHandle,
}

impl ArenaLease {
    /// `block` of `arena`, given back on `stream` when dropped.
    pub(crate) fn new(
        arena: Arc<Arena<dyn Driver>>,
        block: ArenaBlock,
        stream: StreamHandle,
    ) -> ArenaLease {
        ArenaLease {
            held: Some((arena, block)),
            stream,
        }
    }
}

impl ArenaLease {
    /// The block, no longer given back on drop: the caller owns it now.
    pub(crate) fn take(&mut self) -> Option<(Arc<Arena<dyn Driver>>, ArenaBlock)> {
        self.held.take()
    }
}

impl std::fmt::Debug for ArenaLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaLease")
            .field("block", &self.held.as_ref().map(|(_, b)| b))
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl Drop for ArenaLease {
    fn drop(&mut self) {
        if let Some((arena, block)) = self.held.take()
            && let Err(e) = give_back(&arena, block, self.stream)
        {
            tracing::warn!(?block, error = %e, "an arena result could not be given back: its block stays out of the arena");
        }
    }
}

/// Records an event on `stream` and hands `block` to `arena` with it. A thread with no (or
/// another) current context gets the arena's device made current and tries once more. On
/// failure the block stays out of the arena: it is never reused unordered.
fn give_back(
    arena: &Arena<dyn Driver>,
    block: ArenaBlock,
    stream: StreamHandle,
) -> Result<(), Error> {
    let driver = Arc::clone(arena.driver());
    let record = || -> Result<OwnedEvent, poolipc_driver::DriverError> {
        let event = OwnedEvent::new(Arc::clone(&driver), false)?;
        driver.event_record(event.handle(), stream)?;
        Ok(event)
    };
    let event = match record() {
        Ok(e) => e,
        Err(first) => {
            tracing::debug!(error = %first, "recording an arena return failed; retrying on the arena's device");
            driver.use_device(arena.device())?;
            // The returns already pending hold an event each: a job that gave back thousands
            // of blocks at once (a worker condemned after a results flood) can exhaust the
            // driver's events (SimDriver has 1024). Those that completed free theirs; if
            // none had, wait for `stream` (the caller's own work, never a worker's event:
            // the loop orders nothing after one) and free them then. Rare: only when the
            // driver had no event to give.
            arena.reclaim();
            match record() {
                Ok(e) => e,
                Err(again) => {
                    tracing::debug!(error = %again, "no event for an arena return; waiting for its stream to free the pending ones");
                    driver.stream_synchronize(stream)?;
                    arena.reclaim();
                    record()?
                }
            }
        }
    };
    arena.free_after(block, event)?;
    tracing::trace!(?block, "arena result given back");
    Ok(())
}

/// What the result arena holds: [`Parent::arena_stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArenaStats {
    /// The allocator's figures. Blocks given back but whose event has not been seen complete
    /// yet still count as live.
    pub alloc: AllocStats,
    /// Blocks given back, waiting for their event (reclaimed at the next arena result, or by
    /// [`Parent::reclaim_arena`]).
    pub pending_frees: usize,
    /// The cap on the arena's capacity (see [`ParentOptions::arena_cap_fraction`]).
    pub max_bytes: Option<u64>,
    /// Chunks given back to the device so far (idle, or by [`Parent::empty_cache`]).
    pub released_chunks: u64,
    /// Their bytes.
    pub released_bytes: u64,
}

/// What [`Parent::empty_cache`] gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EmptyCache {
    /// Arena chunks given back (every chunk with nothing in it).
    pub arena_chunks: u64,
    /// Their bytes: back on the device once every worker that mapped them unmapped them.
    pub arena_bytes: u64,
    /// Workers told to give something back (unmap a chunk, drop mappings, take or drop a
    /// pool generation) that had not answered: busy in a job (not waited for at all: a job
    /// may run for seconds) or silent for [`EMPTY_CACHE_WAIT`]. What they hold comes back
    /// when they answer.
    pub workers_not_answered: usize,
    /// Workers told to drop their cached mappings of the parent's VMM allocations (the
    /// VMM-handle rung): each keeps the memory behind it alive after the parent freed it.
    pub vmm_workers: usize,
    /// Bytes the shared pools held and gave back (`cuMemPoolTrimTo`), summed over pools.
    /// Pool allocations that were exported to a worker are not among them: the driver keeps
    /// an exported allocation's memory after its free until the pool is destroyed (measured,
    /// `bench/results/2026-12-04-h200-export-limbo/`); that is what the rotation is for.
    pub pool_bytes: u64,
    /// Pools rotated: a pool whose current generation exported anything got a new
    /// generation, the old one retired ([`SharedPool::rotate`]).
    pub pools_rotated: usize,
    /// Retired generations destroyed (nothing of them in use any more), in the parent and
    /// in every worker that had them.
    pub pools_retired: usize,
    /// Device memory free after the call less before it (`cuMemGetInfo`, all processes: other
    /// work on the device moves it too), 0 when it did not grow.
    pub device_bytes_back: u64,
}

/// What a job gave back.
#[derive(Debug, Default)]
pub struct JobOutput {
    /// The results, in the order the worker asked for them: granted results and results
    /// carved out of the job's arena slice ([`ParentOptions::arena_slice_bytes`]) together.
    pub results: Vec<ResultTensor>,
    /// The rung each input took, in argument order.
    pub input_rungs: Vec<Rung>,
    /// Why each input took its rung, in argument order: `None` for a pool pointer (the
    /// rung every input tries first), a sentence for every other (why not by pointer, and
    /// why this rung rather than the next), e.g. `"input 0: 16 GiB over the import limit (it
    /// touches 513 chunks of 32 MiB, pointer import allows at most 128): arena copy (VRAM
    /// free 120 GiB)"` or `"…: host staging: only 3 GiB of VRAM free, the copy needs 16 GiB
    /// and 256 MiB to spare"`. The same sentence is logged (`debug`) when the job is placed.
    /// Meant for people and logs, not for parsing: the wording may change.
    pub input_reasons: Vec<Option<String>>,
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
}

/// Counters of a [`Parent`], read without waiting for anything.
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
    /// Inputs copied into the arena and lent from there ([`Rung::ArenaCopy`]).
    pub arena_copied_inputs: u64,
    /// Jobs lent an arena slice ([`ParentOptions::arena_slice_bytes`]).
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
    /// The workers' DONE events the parent holds open now (as the IO thread last counted
    /// them): at most [`ParentOptions::max_open_done_events`] per worker.
    pub done_events_open: u64,
    /// Whether a new allocation at a recycled address of the first pool, of the same size,
    /// is lent with its cached blob (proven by the canary battery's check) or exported
    /// again; the counts are in the pool's
    /// [`export_cache_stats`](poolipc_pool::SharedPool::export_cache_stats).
    pub export_reuse: poolipc_pool::ExportReuse,
    /// Inputs lent by VMM handle ([`Rung::VmmHandle`]).
    pub vmm_handle_tensors: u64,
    /// VMM allocations whose handle was exported and sent to a worker (once per allocation
    /// and worker; a tensor lent again to a worker that mapped it costs none).
    pub vmm_handles_shared: u64,
}

/// Allocates a job's result memory: `(shape, bytes, stream)` to an allocation of at least
/// `bytes`. Called on the parent's IO thread. Memory of the shared pool goes back by pool
/// pointer; any other takes host staging.
pub type ResultAllocator =
    Box<dyn FnMut(&ResultShape, u64, StreamHandle) -> Result<DevicePtr, Error> + Send>;

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
    pub(crate) arena_slices_lent: AtomicU64,
    pub(crate) arena_results_carved: AtomicU64,
    pub(crate) inputs_copied_back: AtomicU64,
    pub(crate) vmm_handle_tensors: AtomicU64,
    pub(crate) vmm_handles_shared: AtomicU64,
    pub(crate) jobs_held_for_done: AtomicU64,
    pub(crate) done_events_open: AtomicU64,
}

impl Stats {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A worker as every thread sees it: readable without the IO loop.
#[derive(Clone, Debug)]
pub(crate) struct Registered {
    pub(crate) info: WorkerInfo,
    pub(crate) canary: Option<CanaryReport>,
    /// Its pool table: the wire index each of the parent's pools (each live generation of
    /// one) has for this worker. Index 0 is the Hello pool; the others came by `ExtraPool`,
    /// at spawn or at a rotation.
    pub(crate) pools: BTreeMap<u8, WorkerPool>,
    /// Whether it reached the Hello pool (the parent's device) at spawn.
    pub(crate) reaches_first: bool,
}

/// One entry of a worker's pool table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WorkerPool {
    /// The parent's pool (generation) it names.
    pub(crate) handle: PoolHandle,
    /// Whether the worker attached it and can use it (its `ExtraPoolReply` said so; false
    /// while the answer is awaited).
    pub(crate) reachable: bool,
    /// Set once `PoolRetire` went out: never named again; the index is free once answered.
    pub(crate) retiring: bool,
}

impl Registered {
    /// The wire index under which memory of the parent's pool `handle` may go to it by pool
    /// pointer: it attached the pool, the pool is not being retired, and no canary failed.
    pub(crate) fn pointer_index(&self, handle: PoolHandle) -> Option<u8> {
        if !self.canary.as_ref().is_none_or(CanaryReport::ok) {
            return None;
        }
        self.pools
            .iter()
            .find(|(_, p)| p.handle == handle && p.reachable && !p.retiring)
            .map(|(i, _)| *i)
    }

    /// The lowest index of its table that is free (1..=255), for a new `ExtraPool`.
    pub(crate) fn free_index(&self) -> Option<u8> {
        (1..=u8::MAX).find(|i| !self.pools.contains_key(i))
    }
}

/// What the IO thread and the callers share.
pub(crate) struct Shared {
    pub(crate) driver: Arc<dyn Driver>,
    /// Index 0: `options.device`; then `options.more_devices` in order.
    pub(crate) pools: Vec<SharedPool<dyn Driver>>,
    pub(crate) options: ParentOptions,
    limit: Mutex<ImportLimit>,
    pub(crate) inbox: Mutex<VecDeque<LoopCommand>>,
    waker: UnixStream,
    /// Whether the arena-copy rung may be chosen now ([`ParentOptions::arena_copy`] at
    /// first, then [`Parent::set_arena_copy`]).
    pub(crate) arena_copy_on: std::sync::atomic::AtomicBool,
    /// The bytes of each job's arena slice now, 0 for none
    /// ([`ParentOptions::arena_slice_bytes`] at first, then
    /// [`Parent::set_arena_slice_bytes`]).
    pub(crate) arena_slice_bytes: AtomicU64,
    /// Set by [`Shared::post`] before it decides whether to wake the loop; cleared by the
    /// loop when it takes the commands.
    pub(crate) pending: std::sync::atomic::AtomicBool,
    /// Set while the IO loop spins instead of sleeping: a post need not write the wake-up
    /// byte then (a system call and a wake-up saved per submit).
    pub(crate) io_spinning: std::sync::atomic::AtomicBool,
    pub(crate) registry: Mutex<BTreeMap<WorkerId, Registered>>,
    /// The process that made the parent: a call from another (a forked child, where the IO
    /// thread does not exist) fails with [`Error::Forked`].
    creator: u32,
    /// Set (with the inbox locked) once the IO thread stopped on a panic: why. Commands are
    /// refused from then on.
    pub(crate) io_stopped: Mutex<Option<String>>,
    next_worker: AtomicU32,
    next_job: AtomicU64,
    pub(crate) stats: Stats,
    /// Whether this process is an MPS client on the parent's device (`None`: not reported).
    pub(crate) mps_client: Option<bool>,
    /// Set once the process's CUDA context is lost: why, for every later refusal.
    pub(crate) context_lost: Mutex<Option<String>>,
    /// The result arena, once the IO thread created it ([`ResultMemory::Arena`]).
    pub(crate) arena: Mutex<Option<Arc<Arena<dyn Driver>>>>,
}

/// Locks a mutex, taking the data back if a thread panicked while holding it (the data of
/// these mutexes stays consistent at every unlock).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    pub(crate) fn limit(&self) -> ImportLimit {
        *lock(&self.limit)
    }

    /// `Err` when the IO loop cannot answer: this is a forked child of the process that
    /// made the parent ([`Error::Forked`]), or the loop stopped ([`Error::IoThreadStopped`]).
    pub(crate) fn check_loop(&self) -> Result<(), Error> {
        let this = std::process::id();
        if this != self.creator {
            return Err(Error::Forked {
                creator: self.creator,
                this,
            });
        }
        match lock(&self.io_stopped).as_ref() {
            Some(detail) => Err(Error::IoThreadStopped {
                detail: detail.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The error of a caller whose answer channel the loop dropped.
    pub(crate) fn loop_gone(&self) -> Error {
        self.check_loop()
            .err()
            .unwrap_or_else(|| Error::IoThreadStopped {
                detail: "it dropped a command without an answer".into(),
            })
    }

    /// Hands a command to the IO loop and wakes it; answers it with the error at once when
    /// the loop cannot ([`check_loop`](Self::check_loop)).
    pub(crate) fn post(&self, command: LoopCommand) {
        let mut inbox = lock(&self.inbox);
        if let Err(e) = self.check_loop() {
            drop(inbox);
            command.refuse(e);
            return;
        }
        inbox.push_back(command);
        drop(inbox);
        // Dekker with the loop's `io_spinning.store(false)` then `pending.load()`: either the
        // loop sees `pending` before it sleeps, or we see it is not spinning and wake it.
        self.pending.store(true, Ordering::SeqCst);
        if !self.io_spinning.load(Ordering::SeqCst) {
            // A full socket buffer means a wake-up is pending anyway.
            let _ = (&self.waker).write(&[1]);
        }
    }

    pub(crate) fn take_commands(&self) -> VecDeque<LoopCommand> {
        self.pending.store(false, Ordering::SeqCst);
        std::mem::take(&mut *lock(&self.inbox))
    }

    /// `Err(ContextLost)` once the process's CUDA context is lost: nothing more is done.
    pub(crate) fn check_context(&self) -> Result<(), Error> {
        match lock(&self.context_lost).as_ref() {
            Some(detail) => Err(Error::ContextLost {
                detail: detail.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn registered(&self, id: WorkerId) -> Option<Registered> {
        lock(&self.registry).get(&id).cloned()
    }

    /// The pools (generations) `id` takes pool pointers from, each with its wire index for
    /// `id`; `None` for a worker the parent does not know. On every job and result: copies
    /// no more than this.
    pub(crate) fn pointer_pools(&self, id: WorkerId) -> Option<Vec<(PoolHandle, u8)>> {
        let registry = lock(&self.registry);
        let r = registry.get(&id)?;
        Some(
            r.pools
                .values()
                .filter_map(|p| r.pointer_index(p.handle).map(|i| (p.handle, i)))
                .collect(),
        )
    }

    /// The parent's pool (index into [`Shared::pools`]) that generation `handle` is of.
    pub(crate) fn pool_of(&self, handle: PoolHandle) -> Option<usize> {
        self.pools.iter().position(|p| p.is_generation(handle))
    }
}

/// The IO thread's end of a job's [`Completion`]: dropped without an answer (the thread
/// unwinding from a panic, a command refused), it answers [`Error::IoThreadStopped`], so
/// that no [`JobHandle`] waits for ever.
pub(crate) struct Answer(Arc<Completion>);

impl Answer {
    pub(crate) fn complete(&self, result: Result<JobOutput, Error>) {
        self.0.complete(result);
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if !self.0.finished.load(Ordering::Acquire) {
            self.0.complete(Err(Error::IoThreadStopped {
                detail: "it let go of the job without an answer".into(),
            }));
        }
    }
}

/// How a job ends, shared between the IO thread and the [`JobHandle`].
#[derive(Default)]
pub(crate) struct Completion {
    result: Mutex<Option<Result<JobOutput, Error>>>,
    cond: Condvar,
    /// Set with the result: lets a waiter spin without the lock.
    finished: std::sync::atomic::AtomicBool,
}

impl Completion {
    pub(crate) fn complete(&self, result: Result<JobOutput, Error>) {
        let mut slot = lock(&self.result);
        if slot.is_none() {
            *slot = Some(result);
        }
        self.finished.store(true, Ordering::Release);
        self.cond.notify_all();
    }

    /// Spins until the result is set or `until` passes (not at all once it has).
    fn spin_until(&self, until: Instant) {
        while !self.finished.load(Ordering::Acquire) && Instant::now() < until {
            std::hint::spin_loop();
        }
    }
}

/// A job submitted with [`Parent::submit`]: wait for it from any thread.
#[must_use = "a job's results are the caller's to take (and free): wait for it"]
pub struct JobHandle {
    worker: WorkerId,
    job: JobId,
    done: Arc<Completion>,
    /// The parent's loop, for [`cancel`](JobHandle::cancel) (weak: a handle does not keep a
    /// dropped parent alive; its job was failed then).
    shared: std::sync::Weak<Shared>,
    /// Until when a waiter spins before it sleeps: the submit plus
    /// [`ParentOptions::spin_in_flight`], whichever wait (or how many) comes.
    spin_until: Instant,
}

impl std::fmt::Debug for JobHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobHandle")
            .field("worker", &self.worker)
            .field("job", &self.job)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl JobHandle {
    /// The job's id.
    pub fn id(&self) -> JobId {
        self.job
    }

    /// The worker it runs on.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Cancels the job ([`Parent::cancel`]): it ends with [`Error::JobFailed`] and
    /// [`FailReason::Cancelled`](poolipc_contract::FailReason) once its worker finished it
    /// (at once if it was not sent yet). A job that ended already, or whose parent is gone,
    /// is left as it is.
    ///
    /// # Errors
    /// [`Error::Forked`] from a forked child; [`Error::IoThreadStopped`].
    pub fn cancel(&self) -> Result<(), Error> {
        match self.shared.upgrade() {
            Some(shared) => cancel_on(&shared, self.worker, self.job),
            None => Ok(()),
        }
    }

    /// Whether the job has ended (successfully or not).
    pub fn is_finished(&self) -> bool {
        lock(&self.done.result).is_some()
    }

    /// Waits until the job ends. A worker lost mid-job ends it with [`Error::JobFailed`] once
    /// the worker is reaped; the handoff deadline bounds the wait.
    pub fn wait(self) -> Result<JobOutput, Error> {
        self.done.spin_until(self.spin_until);
        let mut slot = lock(&self.done.result);
        loop {
            if let Some(r) = slot.take() {
                crate::probe::mark("c.woke");
                return r;
            }
            slot = self
                .done
                .cond
                .wait(slot)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits at most `timeout`: `Err(self)` if the job is still running.
    pub fn wait_timeout(self, timeout: Duration) -> Result<Result<JobOutput, Error>, JobHandle> {
        let deadline = Instant::now() + timeout;
        self.done.spin_until(self.spin_until.min(deadline));
        {
            let mut slot = lock(&self.done.result);
            loop {
                if let Some(r) = slot.take() {
                    return Ok(r);
                }
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                slot = self
                    .done
                    .cond
                    .wait_timeout(slot, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        }
        Err(self)
    }
}

/// The parent side: the shared pools, the workers, the jobs. `Send + Sync`: share it in an
/// `Arc` and submit from any thread.
pub struct Parent {
    shared: Arc<Shared>,
    io: Option<std::thread::JoinHandle<()>>,
    /// Set on every command [`spawn_worker`](Parent::spawn_worker) runs (the simulated
    /// machine's locator, from [`Parent::on`]).
    worker_env: Vec<(std::ffi::OsString, std::ffi::OsString)>,
}

impl std::fmt::Debug for Parent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parent")
            .field("driver", &self.shared.driver.kind())
            .field("device", &self.shared.options.device)
            .field("workers", &lock(&self.shared.registry).len())
            .finish_non_exhaustive()
    }
}

/// What the facade's sides can do on any device, said in the handshake.
pub(crate) const CAPABILITIES: Capabilities = Capabilities(
    Capabilities::POOL_POINTER.0 | Capabilities::IPC_EVENTS.0 | Capabilities::HOST_STAGING.0,
);

/// What this side can do on `device`: [`CAPABILITIES`], and the result arena
/// ([`Capabilities::VMM_ARENA`]) and VMM allocations lent by handle
/// ([`Capabilities::VMM_HANDLE`]) where the device has VMM with POSIX FD handles.
pub(crate) fn capabilities(driver: &dyn Driver, device: u32) -> Capabilities {
    match driver.device_info(device) {
        Ok(info) if info.vmm && info.vmm_posix_fd => {
            CAPABILITIES | Capabilities::VMM_ARENA | Capabilities::VMM_HANDLE
        }
        _ => CAPABILITIES,
    }
}

impl Parent {
    /// Installs the shared pool on `options.device` (see [`SharedPool::install`]) and one on
    /// each of `options.more_devices`, and starts the IO thread.
    pub fn new(driver: Arc<dyn Driver>, options: ParentOptions) -> Result<Parent, Error> {
        let mut devices = vec![options.device];
        for &d in &options.more_devices {
            if devices.contains(&d) {
                return Err(Error::Config(format!(
                    "device {d} is listed twice (device {}, more devices {:?})",
                    options.device, options.more_devices
                )));
            }
            devices.push(d);
        }
        if options.more_devices.len() > usize::from(u8::MAX) {
            return Err(Error::Config(format!(
                "{} more devices: at most {} pools are named on the wire",
                options.more_devices.len(),
                u8::MAX
            )));
        }
        if !(options.arena_cap_fraction > 0.0 && options.arena_cap_fraction <= 1.0) {
            return Err(Error::Config(format!(
                "arena_cap_fraction {} must lie in (0, 1]",
                options.arena_cap_fraction
            )));
        }
        if options.handoff_timeout.is_zero() || options.stop_timeout.is_zero() {
            return Err(Error::Config(
                "handoff_timeout and stop_timeout must be longer than zero".into(),
            ));
        }
        let mut pools = Vec::with_capacity(devices.len());
        // The first pool is installed last so that its device stays current on this thread.
        for &d in devices.iter().skip(1) {
            driver.use_device(d)?;
            pools.push(SharedPool::install(Arc::clone(&driver), d)?);
        }
        driver.use_device(options.device)?;
        pools.insert(0, SharedPool::install(Arc::clone(&driver), options.device)?);
        let (waker, wake_read) = UnixStream::pair().map_err(|source| Error::Os {
            call: "socketpair",
            source,
        })?;
        for s in [&waker, &wake_read] {
            s.set_nonblocking(true).map_err(|source| Error::Os {
                call: "fcntl(O_NONBLOCK)",
                source,
            })?;
        }
        let mps_client = driver.device_info(options.device)?.mps_client;
        if mps_client == Some(true) {
            tracing::info!(
                device = options.device,
                "poolipc: this process is an MPS client: handoffs skip the GPU's turn-taking, and a GPU fault in any client (a worker) ends every client's context"
            );
        }
        let arena_copy = options.arena_copy;
        let arena_slice_bytes = options.arena_slice_bytes;
        let shared = Arc::new(Shared {
            arena: Mutex::new(None),
            mps_client,
            context_lost: Mutex::new(None),
            driver,
            pools,
            limit: Mutex::new(options.limit),
            options,
            inbox: Mutex::new(VecDeque::new()),
            waker,
            pending: std::sync::atomic::AtomicBool::new(false),
            arena_copy_on: std::sync::atomic::AtomicBool::new(arena_copy),
            arena_slice_bytes: AtomicU64::new(arena_slice_bytes),
            io_spinning: std::sync::atomic::AtomicBool::new(false),
            registry: Mutex::new(BTreeMap::new()),
            creator: std::process::id(),
            io_stopped: Mutex::new(None),
            next_worker: AtomicU32::new(1),
            next_job: AtomicU64::new(1),
            stats: Stats::default(),
        });
        let io = driver_loop::start(Arc::clone(&shared), wake_read)?;
        Ok(Parent {
            shared,
            io: Some(io),
            worker_env: Vec::new(),
        })
    }

    /// Opens the driver `POOLIPC_DRIVER` names ([`driver::open`](crate::driver::open): `cuda`
    /// when unset, `sim`, `auto`) and makes the parent on it, as [`Parent::on`] does.
    pub fn open(options: ParentOptions) -> Result<Parent, Error> {
        Parent::on(crate::driver::open()?, options)
    }

    /// Makes the parent on an opened driver: as [`Parent::new`], and every worker
    /// [`spawn_worker`](Parent::spawn_worker) starts gets `opened.worker_env` (on the
    /// simulated driver, what lets [`driver::open_worker`](crate::driver::open_worker) attach
    /// to this process's machine).
    pub fn on(opened: crate::driver::Opened, options: ParentOptions) -> Result<Parent, Error> {
        let mut parent = Parent::new(opened.driver, options)?;
        parent.worker_env = opened.worker_env;
        Ok(parent)
    }

    /// Sets the import limit from here on (tensors over it take host staging), at most the
    /// limit the parent was made with.
    pub fn lower_import_limit(&self, limit: ImportLimit) -> Result<(), Error> {
        let cur = self.shared.options.limit;
        if limit.chunk_bytes() != cur.chunk_bytes() || limit.max_chunks() > cur.max_chunks() {
            return Err(Error::Config(format!(
                "the import limit can only be lowered: {} chunks of {} bytes is not within {} of {}",
                limit.max_chunks(),
                limit.chunk_bytes(),
                cur.max_chunks(),
                cur.chunk_bytes()
            )));
        }
        *lock(&self.shared.limit) = limit;
        Ok(())
    }

    /// The import limit in force (the options' one, or lower: see
    /// [`lower_import_limit`](Parent::lower_import_limit)).
    pub fn import_limit(&self) -> ImportLimit {
        self.shared.limit()
    }

    /// The options it was made with.
    pub fn options(&self) -> &ParentOptions {
        &self.shared.options
    }

    /// The shared pool (on `options.device`).
    pub fn pool(&self) -> &SharedPool<dyn Driver> {
        &self.shared.pools[0]
    }

    /// The shared pool on `device`: the first one's, or one of `options.more_devices`.
    pub fn pool_on(&self, device: u32) -> Option<&SharedPool<dyn Driver>> {
        self.shared.pools.iter().find(|p| p.device() == device)
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.shared.driver
    }

    /// This side's handshake identity.
    pub fn identity(&self) -> Result<Identity, Error> {
        crate::identity(
            &*self.shared.driver,
            self.shared.options.device,
            capabilities(&*self.shared.driver, self.shared.options.device),
        )
    }

    /// Whether this process is an MPS client on the parent's device, as the driver reported
    /// at [`Parent::new`] (`None`: the driver does not say). See [`crate::mps`].
    pub fn mps_client(&self) -> Option<bool> {
        self.shared.mps_client
    }

    /// Why this parent refuses all work, once the process's CUDA context is lost (see
    /// [`Error::ContextLost`]); `None` while it is usable.
    pub fn context_lost(&self) -> Option<String> {
        lock(&self.shared.context_lost).clone()
    }

    /// The result arena, once created (see [`ResultMemory::Arena`]: lazily, at the first
    /// result that goes to it). Blocks a caller allocates from it directly are the caller's
    /// to give back; the parent never grants them.
    pub fn arena(&self) -> Option<Arc<Arena<dyn Driver>>> {
        lock(&self.shared.arena).clone()
    }

    /// What the result arena holds (`None` before it is created). Makes no driver call:
    /// blocks given back whose event completed still count as live until reclaimed.
    pub fn arena_stats(&self) -> Option<ArenaStats> {
        self.arena().map(|a| {
            let (released_chunks, released_bytes) = a.released();
            ArenaStats {
                alloc: a.stats(),
                pending_frees: a.pending_frees(),
                max_bytes: a.max_bytes(),
                released_chunks,
                released_bytes,
            }
        })
    }

    /// Frees the arena blocks given back whose event completed (the next arena result does
    /// this too); returns how many. Queries events: the calling thread must have the
    /// parent's device current ([`Driver::use_device`]).
    pub fn reclaim_arena(&self) -> usize {
        self.arena().map_or(0, |a| a.reclaim())
    }

    /// Turns the arena-copy rung on or off for jobs placed from now on (it starts as
    /// [`ParentOptions::arena_copy`] says). Turning it on helps only where the arena is set
    /// up for it: with [`ParentOptions::arena_copy`] or [`ResultMemory::Arena`] at
    /// [`Parent::new`].
    pub fn set_arena_copy(&self, on: bool) {
        self.shared.arena_copy_on.store(on, Ordering::Relaxed);
    }

    /// Sets the bytes of the arena slice lent with each job from now on (0: none); see
    /// [`ParentOptions::arena_slice_bytes`]. Jobs already placed keep what they got.
    pub fn set_arena_slice_bytes(&self, bytes: u64) {
        self.shared
            .arena_slice_bytes
            .store(bytes, Ordering::Relaxed);
    }

    /// Counters, read without waiting for any job.
    pub fn stats(&self) -> ParentStats {
        let s = &self.shared.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ParentStats {
            workers_connected: get(&s.workers_connected),
            workers_lost: get(&s.workers_lost),
            jobs_submitted: get(&s.jobs_submitted),
            jobs_completed: get(&s.jobs_completed),
            jobs_failed: get(&s.jobs_failed),
            pool_pointer_tensors: get(&s.pool_pointer_tensors),
            host_staged_tensors: get(&s.host_staged_tensors),
            arena_results: get(&s.arena_results),
            arena_copied_inputs: get(&s.arena_copied_inputs),
            arena_slices_lent: get(&s.arena_slices_lent),
            arena_results_carved: get(&s.arena_results_carved),
            inputs_copied_back: get(&s.inputs_copied_back),
            jobs_held_for_done: get(&s.jobs_held_for_done),
            done_events_open: get(&s.done_events_open),
            export_reuse: self.pool().export_reuse().0,
            vmm_handle_tensors: get(&s.vmm_handle_tensors),
            vmm_handles_shared: get(&s.vmm_handles_shared),
        }
    }

    /// Runs the export reuse check with `worker` unless the first pool has a verdict
    /// already, and returns the verdict with why not proven (the canary battery's check). The
    /// canary battery does this on its own; a parent without it (`canary: false`) calls this
    /// to stop exporting recycled allocations of the same size.
    pub fn check_export_reuse(
        &self,
        worker: WorkerId,
    ) -> Result<(poolipc_pool::ExportReuse, Option<String>), Error> {
        crate::canary::check_export_reuse(self, worker)
    }

    /// Spawns `cmd` as a worker on an inherited socketpair, shakes hands with it and runs the
    /// canary battery. The worker gets an id only if all of that got through: a worker that
    /// dies on the way is reaped and the error says what happened; one that exits before its
    /// handshake is [`Error::WorkerExited`], with its exit status and last lines on stderr.
    ///
    /// The worker's stderr is a pipe read by a thread of this process, which copies it to
    /// this process's stderr as it comes and keeps its last few KiB for that report. The
    /// variables of [`Parent::on`]'s driver are set on `cmd`.
    ///
    /// The worker inherits this process's whole environment unless `cmd` was restricted
    /// first with [`worker_env::restrict_env`](crate::worker_env::restrict_env) (an
    /// allowlist; do that for workers you do not trust with your secrets).
    pub fn spawn_worker(&self, mut cmd: Command) -> Result<WorkerId, Error> {
        self.shared.check_loop()?;
        cmd.envs(self.worker_env.iter().map(|(k, v)| (k, v)))
            .stderr(std::process::Stdio::piped());
        let (mut child, conn) = poolipc_transport::spawn_worker(cmd)?;
        let tail = child.stderr.take().map(crate::handshake::StderrTail::start);
        self.adopt(Some(child), conn, tail)
    }

    /// Takes a worker connected by other means (a listening socket), and shakes hands.
    pub fn accept_worker(&self, conn: Connection) -> Result<WorkerId, Error> {
        self.shared.check_loop()?;
        self.adopt(None, conn, None)
    }

    fn adopt(
        &self,
        mut child: Option<Child>,
        mut conn: Connection,
        tail: Option<crate::handshake::StderrTail>,
    ) -> Result<WorkerId, Error> {
        let kill = |child: &mut Option<Child>| {
            if let Some(c) = child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
        };
        if let Err(e) = self
            .shared
            .check_loop()
            .and_then(|()| self.shared.check_context())
        {
            kill(&mut child);
            return Err(e);
        }
        let deadline = Instant::now() + self.shared.options.handshake_timeout;
        let setup = self.identity().and_then(|identity| {
            let config = HandshakeConfig {
                identity,
                required: Capabilities::NONE,
            };
            let first = self.shared.pools[0].handle();
            let fd = self.shared.pools[0]
                .fd_of(first)
                .ok_or_else(|| Error::Protocol("the parent's pool has no FD".into()))?;
            let peer =
                poolipc_transport::parent_handshake(&mut conn, &config, fd.as_fd(), deadline)?;
            let more = self.offer_more_pools(&mut conn, first, deadline)?;
            Ok((peer, first, more))
        });
        let (peer, first, more) = match setup {
            Ok(s) => s,
            Err(e) => {
                // A worker that hung up has most likely exited, or is about to: its status
                // and its last words say why, where "peer is gone" does not.
                let exited = child.as_mut().and_then(|c| {
                    let until = Instant::now() + Duration::from_millis(300);
                    loop {
                        match c.try_wait() {
                            Ok(Some(status)) => return Some(status),
                            Ok(None) if Instant::now() < until => {
                                std::thread::sleep(Duration::from_millis(5));
                            }
                            _ => return None,
                        }
                    }
                });
                kill(&mut child);
                // A refusal says why by itself (and callers match on it); a hang-up does not.
                let hung_up = matches!(
                    e,
                    Error::Transport(_)
                        | Error::Handshake(poolipc_transport::HandshakeError::Transport(_))
                );
                return Err(match (exited, tail) {
                    (Some(status), Some(tail)) if hung_up => Error::WorkerExited {
                        status: status.to_string(),
                        stderr: tail.last_lines(Duration::from_millis(500)),
                        during: Box::new(e),
                    },
                    _ => e,
                });
            }
        };
        let id = WorkerId(self.shared.next_worker.fetch_add(1, Ordering::Relaxed));
        let pid = child.as_ref().map(Child::id);
        let reaches_first = peer
            .identity
            .capabilities
            .contains(Capabilities::POOL_POINTER);
        let mut pools = BTreeMap::new();
        pools.insert(
            0,
            WorkerPool {
                handle: first,
                reachable: reaches_first,
                retiring: false,
            },
        );
        pools.extend(more);
        let info = WorkerInfo {
            id,
            pid,
            identity: peer.identity,
        };
        lock(&self.shared.registry).insert(
            id,
            Registered {
                info,
                canary: None,
                pools,
                reaches_first,
            },
        );
        let (tx, rx) = std::sync::mpsc::channel();
        self.shared.post(LoopCommand::Adopt {
            worker: id,
            conn: Box::new(conn),
            child,
            reply: tx,
        });
        let adopted = rx
            .recv()
            .map_err(|_| self.shared.loop_gone())
            .and_then(|r| r);
        if let Err(e) = adopted {
            lock(&self.shared.registry).remove(&id);
            return Err(e);
        }
        tracing::info!(worker = %id, ?pid, "worker connected");
        if !reaches_first {
            tracing::warn!(
                worker = %id,
                "the worker cannot reach the pool from its device: its tensors take host staging"
            );
        } else if self.shared.options.canary {
            let report = match crate::canary::run(self, id) {
                Ok(r) => r,
                Err(e) => {
                    let _ = self.stop_worker(id);
                    return Err(e);
                }
            };
            if let Some(r) = lock(&self.shared.registry).get_mut(&id) {
                r.canary = Some(report);
            }
        }
        if self.shared.registered(id).is_none() {
            let _ = self.stop_worker(id);
            return Err(Error::Protocol(format!(
                "{id} was lost during its canary battery"
            )));
        }
        Stats::bump(&self.shared.stats.workers_connected);
        Ok(id)
    }

    /// Offers a new worker every live pool generation but `first` (the Hello pool), one
    /// `ExtraPool` each at indices 1, 2, ..., and returns its table entries.
    fn offer_more_pools(
        &self,
        conn: &mut Connection,
        first: PoolHandle,
        deadline: Instant,
    ) -> Result<Vec<(u8, WorkerPool)>, Error> {
        let mut table = Vec::new();
        let generations = self.shared.pools.iter().flat_map(|pool| {
            pool.handles()
                .into_iter()
                .filter(|h| *h != first)
                .map(move |h| (pool, h))
        });
        for (i, (pool, handle)) in generations.enumerate() {
            let index = u8::try_from(i + 1)
                .map_err(|_| Error::Config("more than 255 pool generations".into()))?;
            let device = self.shared.driver.device_info(pool.device())?.uuid;
            // Retired meanwhile and destroyed: nothing of it can be lent any more.
            let Some(fd) = pool.fd_of(handle) else {
                continue;
            };
            conn.send(
                &Message::ExtraPool(ExtraPool { index, device }),
                &[fd.as_fd()],
                deadline,
            )?;
            match conn.recv(deadline)? {
                (Message::ExtraPoolReply(r), _) if r.index == index => {
                    if !r.reachable {
                        tracing::info!(
                            pool_device = pool.device(),
                            reason = %poolipc_contract::worker_text(&r.reason),
                            "the worker cannot use this pool: its tensors go by host staging"
                        );
                    }
                    table.push((
                        index,
                        WorkerPool {
                            handle,
                            reachable: r.reachable,
                            retiring: false,
                        },
                    ));
                }
                (other, _) => {
                    return Err(Error::Protocol(format!(
                        "expected the answer to ExtraPool {index}, got {}",
                        other.kind()
                    )));
                }
            }
        }
        Ok(table)
    }

    /// What the parent knows of a worker (never waits for a job).
    pub fn worker(&self, id: WorkerId) -> Option<WorkerInfo> {
        self.shared.registered(id).map(|r| r.info)
    }

    /// Every live worker.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        lock(&self.shared.registry)
            .values()
            .map(|r| r.info.clone())
            .collect()
    }

    /// The canary battery's report on a worker, if it ran.
    pub fn canary_report(&self, id: WorkerId) -> Option<CanaryReport> {
        self.shared.registered(id).and_then(|r| r.canary)
    }

    /// Submits a job: lends `inputs` to `worker` (READY recorded on `stream`) and answers its
    /// result requests from the shared pool (allocated on `stream`). Returns at once; the
    /// handle's [`wait`](JobHandle::wait) gives the results once the worker's DONE completed
    /// on the GPU (the IO thread asks on the host; `stream` never waits on a worker's event),
    /// so work queued on `stream` after `wait` comes after the worker's writes. A DONE that
    /// does not complete within `handoff_timeout` fails the job
    /// ([`FailReason::DeadlineExpired`](poolipc_contract::FailReason)) and kills the worker.
    /// A tensor that cannot be lent (negative strides, past its allocation, a dimension above
    /// `i64::MAX`), or a job too large for one message (more than 32 dimensions, more tensors
    /// than one frame holds: about 5000 of 2 dimensions) fails with [`Error::InvalidTensor`]
    /// before anything reaches the worker.
    pub fn submit(
        &self,
        worker: WorkerId,
        inputs: &[Input],
        stream: StreamHandle,
    ) -> Result<JobHandle, Error> {
        let job = JobId(self.shared.next_job.fetch_add(1, Ordering::Relaxed));
        self.submit_as(worker, job, inputs, stream, None)
    }

    /// [`submit`](Parent::submit) with the caller's allocator for results. A failed job's
    /// error lists every result the allocator made (`results`): no process imports them any
    /// more, and they are the caller's to free.
    pub fn submit_with(
        &self,
        worker: WorkerId,
        inputs: &[Input],
        stream: StreamHandle,
        alloc: ResultAllocator,
    ) -> Result<JobHandle, Error> {
        let job = JobId(self.shared.next_job.fetch_add(1, Ordering::Relaxed));
        self.submit_as(worker, job, inputs, stream, Some(alloc))
    }

    /// Submits under a job id of the caller's (the canary battery's).
    pub(crate) fn submit_as(
        &self,
        worker: WorkerId,
        job: JobId,
        inputs: &[Input],
        stream: StreamHandle,
        alloc: Option<ResultAllocator>,
    ) -> Result<JobHandle, Error> {
        crate::probe::mark("c.submit");
        // What needs no driver is checked here, so a bad tensor fails at the caller.
        for (i, input) in inputs.iter().enumerate() {
            input
                .desc
                .extent_bytes()
                .map_err(|e| Error::InvalidTensor(format!("input {i}: {e}")))?;
        }
        self.shared.check_loop()?;
        // A job whose Lend cannot be encoded fails here, not at the send (which would cost
        // the worker its life).
        poolipc_transport::check_lend(
            inputs.iter().map(|input| input.desc.shape.len()),
            poolipc_transport::FrameLimits::default(),
        )
        .map_err(|e| Error::InvalidTensor(format!("the job cannot be lent in one message: {e}")))?;
        self.shared.check_context()?;
        if self.shared.registered(worker).is_none() {
            return Err(Error::UnknownWorker(worker));
        }
        Stats::bump(&self.shared.stats.jobs_submitted);
        let done = Arc::new(Completion::default());
        self.shared
            .post(LoopCommand::Submit(Box::new(driver_loop::Submission {
                worker,
                job,
                inputs: inputs.to_vec(),
                stream,
                alloc,
                done: Answer(Arc::clone(&done)),
                placed: None,
            })));
        crate::probe::mark("c.posted");
        Ok(JobHandle {
            worker,
            job,
            done,
            shared: Arc::downgrade(&self.shared),
            spin_until: Instant::now() + self.shared.options.spin_in_flight,
        })
    }

    /// Lends `inputs` to `worker` and waits: [`submit`](Parent::submit) then
    /// [`wait`](JobHandle::wait). Results of a failed job are freed here.
    pub fn run_job(
        &self,
        worker: WorkerId,
        inputs: &[Input],
        stream: StreamHandle,
    ) -> Result<JobOutput, Error> {
        self.submit(worker, inputs, stream)?.wait()
    }

    /// [`submit_with`](Parent::submit_with) then [`wait`](JobHandle::wait).
    pub fn run_job_with(
        &self,
        worker: WorkerId,
        inputs: &[Input],
        stream: StreamHandle,
        alloc: ResultAllocator,
    ) -> Result<JobOutput, Error> {
        self.submit_with(worker, inputs, stream, alloc)?.wait()
    }

    /// Gives memory the parent does not use back to the device, as `torch.cuda.empty_cache()`
    /// does for torch's pool: every arena chunk with nothing in it (each worker that mapped
    /// one is told to unmap it; waits up to [`EMPTY_CACHE_WAIT`] for their answers), then
    /// each shared pool is trimmed ([`SharedPool::trim`]: waits for this process's GPU work,
    /// then `cuMemPoolTrimTo(pool, 0)`).
    ///
    /// Memory lent by pool pointer and freed is not given back by a trim: the driver keeps an
    /// exported allocation's memory until its pool is destroyed. So each shared pool whose
    /// current generation exported anything is *rotated* ([`SharedPool::rotate`]): a new pool
    /// becomes the device's current one, every live worker is given it (an `ExtraPool`; waits
    /// up to [`EMPTY_CACHE_WAIT`] for their answers), and the old one is retired. A retired
    /// generation with nothing in use is destroyed: every worker that imported it destroys its
    /// import first (`PoolRetire`, waited for the same way), then the parent. One still in use
    /// (a tensor allocated before and not freed) stays, valid for that tensor, until a later
    /// `empty_cache` finds it unused.
    ///
    /// What it costs: the synchronize, and the next allocations and arena results map memory
    /// again instead of reusing it; after a rotation the new pool maps all its memory afresh,
    /// and the first lend of each new allocation exports it again (about 0.4 ms/GiB). A chunk
    /// with a block lent, granted or still in use on the GPU stays. See
    /// [`EmptyCache::pool_bytes`] for what the driver keeps regardless.
    ///
    /// Refused with [`poolipc_pool::PoolError::CurrentPoolChanged`] when something else made
    /// its own pool the device's current pool.
    pub fn empty_cache(&self) -> Result<EmptyCache, Error> {
        self.shared.check_loop()?;
        let device_free = || {
            self.shared
                .driver
                .use_device(self.shared.options.device)
                .and_then(|()| self.shared.driver.mem_get_info())
                .map(|(free, _)| free)
                .ok()
        };
        let free_before = device_free();
        let mut out = self.ask_loop(|reply| LoopCommand::ReleaseArena { reply })?;
        for (i, pool) in self.shared.pools.iter().enumerate() {
            if let Some(r) = pool.rotate()? {
                out.pools_rotated += 1;
                let offered = self.ask_loop(|reply| LoopCommand::OfferPool {
                    pool: i,
                    handle: r.current,
                    reply,
                })?;
                out.workers_not_answered =
                    out.workers_not_answered.max(offered.workers_not_answered);
            }
        }
        for pool in &self.shared.pools {
            let (before, after) = pool.trim()?;
            out.pool_bytes += before.saturating_sub(after);
            for handle in pool.idle_retired()? {
                let retired = self.ask_loop(|reply| LoopCommand::RetirePool { handle, reply })?;
                out.workers_not_answered =
                    out.workers_not_answered.max(retired.workers_not_answered);
                match pool.destroy_retired(handle) {
                    Ok(()) => out.pools_retired += 1,
                    // Another thread's empty_cache destroyed it meanwhile.
                    Err(poolipc_pool::PoolError::NotRetired { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        if let (Some(before), Some(after)) = (free_before, device_free()) {
            out.device_bytes_back = after.saturating_sub(before);
        }
        tracing::debug!(?out, "empty_cache");
        Ok(out)
    }

    /// Test-only: makes the parent's IO thread panic, as a bug of its own would, to check
    /// that every waiter then gets [`Error::IoThreadStopped`] rather than hanging. Never call
    /// it otherwise: the parent can do nothing after it.
    #[doc(hidden)]
    pub fn panic_io_thread(&self) {
        self.shared.post(LoopCommand::Panic);
    }

    /// Posts the command `make` builds to the IO loop and waits for its `EmptyCache` reply.
    fn ask_loop(
        &self,
        make: impl FnOnce(std::sync::mpsc::Sender<EmptyCache>) -> LoopCommand,
    ) -> Result<EmptyCache, Error> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.shared.post(make(tx));
        rx.recv().map_err(|_| self.shared.loop_gone())
    }

    /// Cancels `job`: the worker is sent `Cancel`; its result requests from now on are
    /// refused with `CANCELLED`; it still finishes the job (DONE, ACK), and only then is
    /// anything the job held reused (or once the worker was reaped, if it dies first). The
    /// job ends with [`Error::JobFailed`] and
    /// [`FailReason::Cancelled`](poolipc_contract::FailReason); a job not sent yet ends so at
    /// once. The worker goes on taking jobs. A job that ended already is left as it is;
    /// cancelling twice is cancelling once. A worker that never finishes a cancelled job
    /// meets the handoff deadline and the job lifetime as any other.
    ///
    /// # Errors
    /// [`Error::Forked`] from a forked child; [`Error::IoThreadStopped`].
    pub fn cancel(&self, job: &JobHandle) -> Result<(), Error> {
        cancel_on(&self.shared, job.worker, job.job)
    }

    /// Tells the worker to stop (Bye), waits for it to exit at most `options.stop_timeout`,
    /// then kills it, and reaps it. Jobs it still held fail. Never waits for other workers'
    /// jobs.
    pub fn stop_worker(&self, worker: WorkerId) -> Result<Option<ExitStatus>, Error> {
        self.shared.check_loop()?;
        if self.shared.registered(worker).is_none() {
            return Err(Error::UnknownWorker(worker));
        }
        let (tx, rx) = std::sync::mpsc::channel();
        self.shared.post(LoopCommand::Stop { worker, reply: tx });
        let status = rx.recv().map_err(|_| self.shared.loop_gone())?;
        lock(&self.shared.registry).remove(&worker);
        status
    }
}

/// Posts `Cancel` for `job` of `worker` to `shared`'s loop.
fn cancel_on(shared: &Shared, worker: WorkerId, job: JobId) -> Result<(), Error> {
    shared.check_loop()?;
    shared.post(LoopCommand::Cancel { worker, job });
    Ok(())
}

impl Drop for Parent {
    fn drop(&mut self) {
        if std::process::id() != self.shared.creator {
            // A forked child: the IO thread is the parent process's; there is none to join.
            if let Some(io) = self.io.take() {
                std::mem::forget(io);
            }
            return;
        }
        self.shared.post(LoopCommand::Shutdown);
        if let Some(io) = self.io.take()
            && io.join().is_err()
        {
            tracing::error!("the parent's IO thread panicked");
        }
        crate::probe::dump();
    }
}
