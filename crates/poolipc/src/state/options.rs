//! How a [`Parent`](crate::Parent) is set up: [`ParentOptions`], its defaults and the
//! environment variables that change them.

use std::time::Duration;

use poolipc_contract::{
    DEFAULT_CANCEL_GRACE, DEFAULT_MAX_IDLE_MESSAGES, DEFAULT_MAX_JOB_LIFETIME,
    DEFAULT_MAX_RESULT_BYTES_PER_JOB, DEFAULT_MAX_RESULT_BYTES_PER_WORKER,
    DEFAULT_MAX_RESULTS_PER_JOB,
};
use poolipc_types::ImportLimit;

use crate::settings::Tuning;
use crate::staging::StagingConfig;

/// How a [`Parent`](crate::Parent) behaves.
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
    /// How long a worker may go without progress on a job it holds before the parent kills
    /// it. Only progress starts the wait again (a result request that is granted, a `Done`
    /// that completes handoffs, the job's first `JobError`, a heartbeat from a worker that
    /// declared long jobs); other messages about the job count against
    /// [`max_idle_messages`](ParentOptions::max_idle_messages). See docs/threat-model.md.
    pub handoff_timeout: Duration,
    /// The most messages about one job that are not progress (an empty or refused result
    /// request, an empty or repeated `Done`, a repeated `JobError`) a worker may send
    /// (by default 32). Past it the worker is condemned
    /// ([`Bound::IdleMessages`](poolipc_contract::Bound)).
    pub max_idle_messages: u32,
    /// How long a worker has after [`JobHandle::cancel`](crate::JobHandle::cancel) to finish
    /// the cancelled job (by default 3 s). Past it the worker is killed, the
    /// job fails with [`FailReason::Cancelled`](poolipc_contract::FailReason), and what was
    /// lent to it comes back once it is reaped, as for a lost worker.
    pub cancel_grace: Duration,
    /// How long a worker may take to start and shake hands.
    pub handshake_timeout: Duration,
    /// How long [`Parent::stop_worker`](crate::Parent::stop_worker) waits for a worker to exit after Bye before it kills it.
    pub stop_timeout: Duration,
    /// How long a frame that has begun to arrive may take to complete, and how long a frame
    /// queued for a worker may wait to be all sent. The IO loop waits on neither: it reads
    /// what has come and writes what the socket takes, and a worker past this deadline is
    /// condemned alone.
    pub frame_timeout: Duration,
    /// The performance knobs: spins, IO threads, GPU turns, send queues, READY's record
    /// aside ([`Tuning`]); [`Tuning::from_env`] by default.
    pub tuning: Tuning,
    /// Run the canary battery on each new worker before it takes jobs.
    pub canary: bool,
    /// The host-staging rung's buffer and waits.
    pub staging: StagingConfig,
    /// Where results of [`submit`](crate::Parent::submit) (the default allocator) live:
    /// [`ResultMemory::Pool`] by default, [`ResultMemory::Arena`] for the fast path.
    /// [`submit_with`](crate::Parent::submit_with) always uses the caller's allocator.
    pub results: ResultMemory,
    /// Whether an input that cannot go by pool pointer but is device memory of the parent's
    /// device (the shared pool's over the import limit or for a worker that may not import
    /// it, or any other kind: `cuMemAlloc` memory, another library's pool, a VMM mapping) is
    /// copied device-to-device into a block of the arena and lent from there ([`Rung::ArenaCopy`](crate::Rung::ArenaCopy))
    /// rather than through host staging. True by default. It needs a worker with the arena
    /// capability and enough free VRAM (see
    /// [`arena_copy_vram_margin`](ParentOptions::arena_copy_vram_margin)); otherwise, or
    /// when false, such inputs take host staging as before.
    ///
    /// A copy goes to the worker's own arena (each worker has one, mapped by it alone: see
    /// [`ResultMemory::Arena`]). With [`ResultMemory::Arena`] the copies share the result
    /// arenas and their cap: a copy is made only when it fits under the cap, but it may then
    /// leave too little for the job's own results, which are refused (out of memory) rather
    /// than sent to the pool; give a capped arena room for both, or turn this off. With
    /// [`ResultMemory::Pool`] a worker's arena is made for them alone at its first copy, as
    /// large as that copy (and grown by chunks of that size), under
    /// [`arena_cap_fraction`](ParentOptions::arena_cap_fraction). An arena keeps its empty
    /// chunks for [`arena_idle_release`](ParentOptions::arena_idle_release): after a 16 GiB
    /// copy, 16 GiB of VRAM stay reserved for that worker's next one until then.
    pub arena_copy: bool,
    /// Whether workers are isolated from the parent's memory by default (false by default):
    /// the [`Trust`](crate::Trust) of every worker spawned or accepted without one of its own
    /// ([`Parent::spawn_worker`](crate::Parent::spawn_worker)); trust is chosen per worker with
    /// [`Parent::spawn_worker_with`](crate::Parent::spawn_worker_with). An isolated worker
    /// gets no handle on the parent's pool (its `Hello` carries an empty sealed memfd where
    /// the pool's FD would be, and the parent's capabilities leave pool pointers and VMM
    /// handles out), no extra pool, and no VMM allocation by handle. Its inputs cross by a
    /// copy into the result arena ([`Rung::ArenaCopy`](crate::Rung::ArenaCopy), one
    /// device-to-device copy; host staging where no arena copy can be made) and its results
    /// come from the arena ([`Rung::Arena`](crate::Rung::Arena)), in chunks only it maps.
    /// So a worker running code the parent does not trust can read and write the tensors
    /// lent to it, in their copies, and nothing else of the parent's: not a tensor it was
    /// lent before (an export blob kept after its job), not another worker's. The copies
    /// cost device-to-device bandwidth and arena memory; trusted workers are faster without.
    pub isolated: bool,
    /// The VRAM that must stay free after an arena copy that needs new arena memory: an
    /// input takes the arena-copy rung only when `cuMemGetInfo` reports at least its size
    /// plus this much free (256 MiB by default). A copy that fits in the arena as it is
    /// needs no new memory and is not checked.
    pub arena_copy_vram_margin: u64,
    /// Whether an input that is a VMM allocation of the parent's device (`cuMemCreate` +
    /// `cuMemMap`, as ComfyUI maps model weights) made with the POSIX FD handle type is lent
    /// by its handle ([`Rung::VmmHandle`](crate::Rung::VmmHandle)): no copy; each worker maps it once and keeps the
    /// mapping (and so the memory behind it) until told to drop it. True by default. Needs
    /// a worker that takes VMM handles on the parent's device and a driver that gives the
    /// allocation a buffer id; otherwise, or when false, such inputs take the arena copy.
    pub vmm_handles: bool,
    /// Bytes of the result arena lent with each job as its **arena slice** (protocol 6), out
    /// of which the worker carves results whose shapes it learns late without a round trip
    /// per request; 0 (the default) turns slices off. Changed later with
    /// [`Parent::set_arena_slice_bytes`](crate::Parent::set_arena_slice_bytes).
    ///
    /// A slice is lent only to a worker that maps the arena, for a job whose results go to
    /// the arena ([`ResultMemory::Arena`] with [`submit`](crate::Parent::submit)'s default
    /// allocator), and only when the worker's arena has a free range that large already (its
    /// first chunk, made at its first need, is `initial_bytes`): a slice
    /// never grows the arena, and one that does not fit is silently not lent (the worker
    /// then asks for its results as before). The worker carves a batch of results out of
    /// the slice's free tail (512-byte aligned) when the whole batch fits, else asks the
    /// parent. Carved results arrive in [`JobOutput::results`](crate::JobOutput::results) in the order the worker asked
    /// for them, mixed with granted ones, as [`ResultTensor`](crate::ResultTensor)s that own their part of the
    /// slice; the rest of the slice goes back to the arena once the job's stream waited on
    /// the worker's DONE (the whole slice, if the job failed or was cancelled, or once a dead
    /// worker was reaped). While a job runs, its slice is arena memory no one else can use.
    pub arena_slice_bytes: u64,
    /// The arenas' cap when none is given ([`ResultMemory::Arena`] with `max_bytes: None`,
    /// and the arenas made for arena copies under [`ResultMemory::Pool`]): this fraction of
    /// the device's total memory, read when the first arena is made (0.5 by default), shared
    /// by every worker's arena. A result
    /// that would pass the cap is refused with out-of-memory; an input copy that would pass
    /// it takes host staging. Must lie in `(0, 1]`.
    pub arena_cap_fraction: f64,
    /// How long an arena chunk with nothing in it stays mapped before the IO thread gives
    /// it back to the device (10 s by default); `None`: only [`Parent::empty_cache`](crate::Parent::empty_cache) gives
    /// chunks back. A chunk with a block lent, granted or still in use on the GPU is never
    /// given back. The worker whose arena it is (the only one that mapped it) is told to
    /// unmap it; the memory is back once it has. A reaped worker's arena gives each chunk
    /// back as soon as nothing in it is live, whatever this says.
    pub arena_idle_release: Option<Duration>,
    /// The most results one job may ask for, over all its result requests
    /// (by default 8192, as many as a job may have inputs). A worker
    /// that asks for
    /// more is condemned: killed, its jobs failed with [`Error::JobFailed`](crate::Error::JobFailed) and
    /// [`FailReason::BoundExceeded`](poolipc_contract::FailReason)`(`[`Bound::ResultsPerJob`](poolipc_contract::Bound)`)`;
    /// the parent and the other workers go on.
    pub max_results_per_job: u64,
    /// The most result bytes one job may ask for, over all its requests (counted as asked,
    /// allocated or refused). By default half the device's total memory, at least 256 MiB
    /// and at most 32 GiB: 8 GiB on a 16 GiB card.
    /// Past it the worker is condemned ([`Bound::ResultBytesPerJob`](poolipc_contract::Bound)).
    /// [`Parent::limits`](crate::Parent::limits) says what it came to.
    pub max_result_bytes_per_job: MemoryBound,
    /// The most result bytes a worker's open jobs may have asked for together (a job's
    /// results count until it finished). By default 0.6 of the device's total memory, at
    /// least 256 MiB and at most 48 GiB: one
    /// worker never holds the last 40 % of a card, so an honest worker's next small result
    /// still fits beside it. Past it the worker is condemned
    /// ([`Bound::ResultBytesPerWorker`](poolipc_contract::Bound)).
    pub max_result_bytes_per_worker: MemoryBound,
    /// The longest a job may stay open from its submit, however often its worker speaks
    /// about it (by default 4 h, above any ComfyUI node run we know of;
    /// [`handoff_timeout`](ParentOptions::handoff_timeout) catches a silent worker much
    /// sooner). Past it the job fails and the worker is condemned
    /// ([`Bound::JobLifetime`](poolipc_contract::Bound)).
    pub max_job_lifetime: Duration,
    /// The most DONE events of one worker the parent keeps open
    /// (by default 64). A worker that records every DONE on one
    /// event (as poolipc's does) holds one; one that sends a new event with each job has the
    /// least recently used closed as it sends more (reopened if it sends one again). Only
    /// when every one of them is waited on by a job held for its DONE is the worker
    /// condemned ([`Bound::OpenDoneEvents`](poolipc_contract::Bound)). Zero is taken as one.
    pub max_open_done_events: usize,
}

/// [`ParentOptions::max_open_done_events`]'s default.
pub(crate) const DEFAULT_MAX_OPEN_DONE_EVENTS: usize = 64;

/// Where the parent puts a job's results when the caller gives no allocator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResultMemory {
    /// The shared pool (the first way poolipc had): each result is allocated from the pool, its pointer
    /// exported (about 0.43 ms/GiB, every time) and imported by the worker; results above
    /// the import limit take host staging. The caller gets an ordinary pool allocation and
    /// frees it through [`Parent::pool`](crate::Parent::pool). The default, so that existing callers keep these
    /// semantics.
    #[default]
    Pool,
    /// The result arena: the fast path. Parent-owned VMM memory (`cuMemCreate` chunks) that
    /// each worker maps once; a result handoff is then an offset: no export, no import, no
    /// import limit (a result may be as large as the arena). The caller gets a
    /// [`ResultTensor`](crate::ResultTensor) that gives its block back, stream-ordered, when dropped (or with
    /// [`ResultTensor::return_to_arena`](crate::ResultTensor::return_to_arena)).
    ///
    /// Each worker has an arena of its own, and every chunk of it is mapped by that worker
    /// alone: a worker's blocks (its results, its arena-copied inputs, its slices) lie where
    /// no other worker can read or write them. A worker's arena is created lazily, on the
    /// parent's IO thread, at the first result (or arena copy, or slice) of that worker's
    /// that goes to it: a parent whose workers never return results reserves no device
    /// memory for it. It starts with one chunk of `initial_bytes` (rounded up to the
    /// driver's granularity) and grows by chunks of that size (or of the request, if larger).
    /// `max_bytes` (`None`: no cap) caps every worker's arena together: a worker whose first
    /// chunk no longer fits under it starts with none and grows by what each request needs,
    /// and a result that would pass the cap is refused with out-of-memory. When a worker is
    /// reaped, each chunk of its arena goes back to the device once nothing in it is live
    /// (a result the caller holds keeps its chunk).
    /// Workers whose driver or device has no VMM by POSIX FD, or that cannot reach the
    /// parent's device, get pool results as before.
    Arena {
        /// The first chunk's size of each worker's arena, and the size of chunks added by growth.
        initial_bytes: u64,
        /// The most every worker's arena together may hold; `None` for no cap.
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
            max_idle_messages: DEFAULT_MAX_IDLE_MESSAGES,
            cancel_grace: DEFAULT_CANCEL_GRACE,
            handshake_timeout: Duration::from_secs(60),
            stop_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(5),
            tuning: Tuning::from_env(),
            canary: true,
            staging: StagingConfig::default(),
            results: ResultMemory::Pool,
            arena_copy: true,
            isolated: false,
            arena_copy_vram_margin: DEFAULT_ARENA_COPY_VRAM_MARGIN,
            vmm_handles: true,
            arena_slice_bytes: 0,
            arena_cap_fraction: DEFAULT_ARENA_CAP_FRACTION,
            arena_idle_release: Some(DEFAULT_ARENA_IDLE_RELEASE),
            max_results_per_job: DEFAULT_MAX_RESULTS_PER_JOB,
            max_result_bytes_per_job: MemoryBound::Fraction(DEFAULT_RESULT_FRACTION_PER_JOB),
            max_result_bytes_per_worker: MemoryBound::Fraction(DEFAULT_RESULT_FRACTION_PER_WORKER),
            max_job_lifetime: DEFAULT_MAX_JOB_LIFETIME,
            max_open_done_events: DEFAULT_MAX_OPEN_DONE_EVENTS,
        }
    }
}

/// [`ParentOptions::max_result_bytes_per_job`]'s default fraction of the device.
pub(crate) const DEFAULT_RESULT_FRACTION_PER_JOB: f64 = 0.5;
/// [`ParentOptions::max_result_bytes_per_worker`]'s default fraction of the device.
pub(crate) const DEFAULT_RESULT_FRACTION_PER_WORKER: f64 = 0.6;
/// The least a fraction of the device makes of a result bound: 256 MiB.
pub(crate) const MIN_RESULT_BOUND: u64 = 256 << 20;

/// A bound on device memory: bytes, or a fraction of the device's total memory (read when
/// the parent is made).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum MemoryBound {
    /// This many bytes, whatever the device.
    Bytes(u64),
    /// This fraction of the device's total memory, in `(0, 1]`; clamped where the option
    /// says.
    Fraction(f64),
}

impl MemoryBound {
    /// The bytes on a device of `total` bytes: a fraction clamped to `[min, max]`.
    ///
    /// # Errors
    /// A fraction outside `(0, 1]`.
    pub(crate) fn resolve(self, total: u64, min: u64, max: u64) -> Result<u64, String> {
        match self {
            MemoryBound::Bytes(b) => Ok(b),
            MemoryBound::Fraction(f) if f > 0.0 && f <= 1.0 => {
                #[allow(
                    clippy::cast_precision_loss,
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss
                )]
                let bytes = (total as f64 * f) as u64;
                Ok(bytes.clamp(min, max.max(min)))
            }
            MemoryBound::Fraction(f) => Err(format!("the fraction {f} must lie in (0, 1]")),
        }
    }
}

/// What a parent's memory bounds came to on its device, and its import limit
/// ([`Parent::limits`](crate::Parent::limits), shown by `poolipc doctor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// The device's total memory.
    pub device_bytes: u64,
    /// [`ParentOptions::max_result_bytes_per_job`], in bytes.
    pub max_result_bytes_per_job: u64,
    /// [`ParentOptions::max_result_bytes_per_worker`], in bytes.
    pub max_result_bytes_per_worker: u64,
    /// The arenas' cap ([`ResultMemory::Arena`]'s `max_bytes`, else
    /// [`ParentOptions::arena_cap_fraction`] of the device).
    pub arena_cap: u64,
    /// The import limit: tensors over it take another rung than the pool pointer
    /// ([`ParentOptions::limit`], or lower once
    /// [`Parent::lower_import_limit`](crate::Parent::lower_import_limit) lowered it).
    pub import: ImportLimit,
}

impl ParentOptions {
    /// What these options' memory bounds come to on a device of `total` bytes.
    ///
    /// # Errors
    /// A fraction outside `(0, 1]`, naming the option.
    pub fn limits_for(&self, total: u64) -> Result<Limits, String> {
        let per_job = self
            .max_result_bytes_per_job
            .resolve(total, MIN_RESULT_BOUND, DEFAULT_MAX_RESULT_BYTES_PER_JOB)
            .map_err(|e| format!("max_result_bytes_per_job: {e}"))?;
        let per_worker = self
            .max_result_bytes_per_worker
            .resolve(total, MIN_RESULT_BOUND, DEFAULT_MAX_RESULT_BYTES_PER_WORKER)
            .map_err(|e| format!("max_result_bytes_per_worker: {e}"))?;
        let arena_cap = match self.results {
            ResultMemory::Arena {
                max_bytes: Some(m), ..
            } => m,
            _ => MemoryBound::Fraction(self.arena_cap_fraction)
                .resolve(total, 0, u64::MAX)
                .map_err(|e| format!("arena_cap_fraction: {e}"))?,
        };
        Ok(Limits {
            device_bytes: total,
            max_result_bytes_per_job: per_job,
            max_result_bytes_per_worker: per_worker,
            arena_cap,
            import: self.limit,
        })
    }
}

/// [`ParentOptions::arena_cap_fraction`]'s default: half the device.
pub(crate) const DEFAULT_ARENA_CAP_FRACTION: f64 = 0.5;

/// [`ParentOptions::arena_idle_release`]'s default: 10 s.
pub(crate) const DEFAULT_ARENA_IDLE_RELEASE: Duration = Duration::from_secs(10);

/// How long [`Parent::empty_cache`](crate::Parent::empty_cache) waits for the workers to unmap the arena chunks it gave
/// back: a worker busy in a long job answers after it; its chunks' memory follows then.
pub(crate) const EMPTY_CACHE_WAIT: Duration = Duration::from_secs(2);

/// [`ParentOptions::arena_copy_vram_margin`]'s default: 256 MiB.
pub(crate) const DEFAULT_ARENA_COPY_VRAM_MARGIN: u64 = 256 << 20;

#[cfg(test)]
mod tests {
    use super::{MemoryBound, ParentOptions};

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_default_result_bounds_scale_with_the_device_and_are_clamped() {
        let o = ParentOptions::default();
        for (device, job, worker) in [
            (16 * GIB, 8 * GIB, 9830 << 20),
            (24 * GIB, 12 * GIB, 14746 << 20),
            (80 * GIB, 32 * GIB, 48 * GIB),
            (GIB / 4, 256 << 20, 256 << 20),
        ] {
            let l = o.limits_for(device).expect("default fractions are valid");
            assert_eq!(l.max_result_bytes_per_job, job, "per job on {device}");
            assert!(
                l.max_result_bytes_per_worker.abs_diff(worker) < (1 << 20),
                "per worker on {device}: {}",
                l.max_result_bytes_per_worker
            );
            assert_eq!(l.arena_cap, device / 2);
        }
        let bytes = ParentOptions {
            max_result_bytes_per_job: MemoryBound::Bytes(5),
            ..ParentOptions::default()
        };
        assert_eq!(
            bytes
                .limits_for(16 * GIB)
                .map(|l| l.max_result_bytes_per_job),
            Ok(5)
        );
        let bad = ParentOptions {
            max_result_bytes_per_worker: MemoryBound::Fraction(1.5),
            ..ParentOptions::default()
        };
        assert!(
            bad.limits_for(16 * GIB)
                .is_err_and(|e| e.contains("max_result_bytes_per_worker"))
        );
    }
}
