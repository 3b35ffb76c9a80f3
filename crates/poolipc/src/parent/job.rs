//! A job from the caller's side: what goes in ([`Input`]), what comes out ([`JobOutput`],
//! [`ResultTensor`]), the handle a caller waits on ([`JobHandle`]), and the submitting and
//! cancelling methods of [`Parent`].

use super::turns::{Entry, Turns};
use super::{Parent, Shared, Stats, lock};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use poolipc_driver::{DevicePtr, Driver, OwnedEvent, StreamHandle};
use poolipc_pool::Arena;
use poolipc_pool::arena::ArenaBlock;
use poolipc_types::{JobId, Rung, WorkerId};

use crate::driver_loop::{self, Command as LoopCommand};
use crate::error::Error;
use crate::tensor::{Layout, ResultShape};

/// An input tensor to lend: where its first element is, and its layout. It must stay alive
/// (and unwritten by the caller) until its job returns. Memory of the shared pool goes by pool
/// pointer; memory of the shared pool that cannot (over the import limit) is copied into the
/// arena ([`Rung::ArenaCopy`], see [`ParentOptions::arena_copy`](crate::ParentOptions::arena_copy)) or takes host staging; any
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
    pub desc: Layout,
    /// The worker only reads it: no copy-back, and a write fails where the hardware allows
    /// (see above).
    pub read_only: bool,
}

impl Input {
    /// A writable input: what the worker writes reaches the tensor.
    #[must_use]
    pub fn new(ptr: DevicePtr, desc: Layout) -> Input {
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
///   ([`ResultMemory::Pool`](crate::ResultMemory::Pool)): an ordinary allocation, the caller's to keep and free.
/// - From the result arena ([`ResultMemory::Arena`](crate::ResultMemory::Arena), [`Rung::Arena`]): a block of the
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
pub(crate) fn give_back(
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

/// What a job gave back.
#[derive(Debug, Default)]
pub struct JobOutput {
    /// The results, in the order the worker asked for them: granted results and results
    /// carved out of the job's arena slice ([`ParentOptions::arena_slice_bytes`](crate::ParentOptions::arena_slice_bytes)) together.
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

/// Allocates a job's result memory: `(shape, bytes, stream)` to an allocation of at least
/// `bytes`. Memory of the shared pool goes back by pool pointer; any other takes host staging.
///
/// Called on a thread the parent keeps for callers' allocators (one per IO room; one job's
/// calls in the order its worker asked), not on the IO thread, so one that takes its time
/// holds up only its own job. A result it makes after its job ended (the worker was lost
/// meanwhile) is in no job's error: it is logged (`warn`) and the caller's to free.
pub type ResultAllocator =
    Box<dyn FnMut(&ResultShape, u64, StreamHandle) -> Result<DevicePtr, Error> + Send>;

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
    /// The GPU turn the job holds a share of, given up when it ends
    /// ([`ParentOptions::gpu_turn`](crate::ParentOptions::gpu_turn)).
    turn: Option<(Arc<Turns>, WorkerId)>,
    /// Threads in [`JobHandle::wait_any`] over this job, woken when it ends.
    watchers: Mutex<Vec<Arc<AnyWake>>>,
}

/// What a thread in [`JobHandle::wait_any`] sleeps on: set by the first of its jobs to end.
#[derive(Default)]
struct AnyWake {
    fired: Mutex<bool>,
    cond: Condvar,
}

impl AnyWake {
    fn fire(&self) {
        *lock(&self.fired) = true;
        self.cond.notify_all();
    }
}

impl Completion {
    pub(crate) fn complete(&self, result: Result<JobOutput, Error>) {
        let mut slot = lock(&self.result);
        if slot.is_none() {
            *slot = Some(result);
            // Once only: the job's share of the turn ends with it.
            if let Some((turns, worker)) = &self.turn {
                turns.leave(*worker);
            }
        }
        self.finished.store(true, Ordering::Release);
        self.cond.notify_all();
        for w in std::mem::take(&mut *lock(&self.watchers)) {
            w.fire();
        }
    }

    /// Spins until the result is set or `until` passes (not at all once it has).
    fn spin_until(&self, until: Instant) {
        while !self.finished.load(Ordering::Acquire) && Instant::now() < until {
            crate::spin::pause();
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
    /// [`ParentOptions::spin_in_flight`](crate::ParentOptions::spin_in_flight), whichever wait (or how many) comes.
    spin_until: Instant,
    /// On the simulated driver: its race checker, the violations recorded when the job was
    /// submitted, and the worker's pid.
    sim: Option<(Arc<crate::check::Sim>, u64, Option<u32>)>,
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

/// A job's end, watched apart from its [`JobHandle`] ([`JobHandle::watch`]): whether it
/// has ended, and waiting for the first of several to end ([`JobWatch::wait_any`]).
#[derive(Clone)]
pub struct JobWatch {
    done: Arc<Completion>,
    spin_until: Instant,
}

impl std::fmt::Debug for JobWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobWatch")
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl JobWatch {
    /// Whether the job has ended (successfully or not).
    pub fn is_finished(&self) -> bool {
        self.done.finished.load(Ordering::Acquire)
    }

    /// Waits until one of `watches` has ended, at most `timeout`: the index of one that has
    /// (the lowest of those ended when it looks), `None` if none had by then or `watches` is
    /// empty. Spins first for the jobs' [`spin_in_flight`](crate::ParentOptions::spin_in_flight)
    /// as [`JobHandle::wait`] does, then sleeps until a job's end wakes it.
    pub fn wait_any(watches: &[JobWatch], timeout: Duration) -> Option<usize> {
        let ended = || watches.iter().position(JobWatch::is_finished);
        let deadline = Instant::now().checked_add(timeout);
        let before = |t: Instant| deadline.map_or(t, |d| d.min(t));
        let spin_until = before(watches.iter().map(|w| w.spin_until).max()?);
        loop {
            if let Some(i) = ended() {
                return Some(i);
            }
            if Instant::now() >= spin_until {
                break;
            }
            crate::spin::pause();
        }
        let wake = Arc::new(AnyWake::default());
        for w in watches {
            lock(&w.done.watchers).push(Arc::clone(&wake));
        }
        let mut fired = lock(&wake.fired);
        let found = loop {
            // Looked at after registering: a job that ended before it is seen here.
            if let Some(i) = ended() {
                break Some(i);
            }
            let now = Instant::now();
            let left = match deadline {
                Some(d) if now >= d => break None,
                Some(d) => d - now,
                None => Duration::from_secs(3600),
            };
            if *fired {
                // Fired by a job that is seen ended on the next look.
                *fired = false;
                continue;
            }
            fired = wake
                .cond
                .wait_timeout(fired, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        drop(fired);
        for w in watches {
            lock(&w.done.watchers).retain(|x| !Arc::ptr_eq(x, &wake));
        }
        found
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
                drop(slot);
                return self.checked(r);
            }
            slot = self
                .done
                .cond
                .wait(slot)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits until one of `handles` has ended, at most `timeout`: the index of one that has
    /// (the lowest of those ended when it looks), `None` if none had by then or `handles` is
    /// empty. Its [`wait`](JobHandle::wait) then returns at once. For one thread driving
    /// several workers: submit to each, take whichever job ends first, submit again.
    /// [`JobWatch::wait_any`] does the same for watches.
    pub fn wait_any(handles: &[&JobHandle], timeout: Duration) -> Option<usize> {
        let watches: Vec<JobWatch> = handles.iter().map(|h| h.watch()).collect();
        JobWatch::wait_any(&watches, timeout)
    }

    /// A watch of the job's end, to wait for with others ([`JobWatch::wait_any`]) without
    /// the handle (which [`wait`](JobHandle::wait) consumes).
    pub fn watch(&self) -> JobWatch {
        JobWatch {
            done: Arc::clone(&self.done),
            spin_until: self.spin_until,
        }
    }

    /// On the simulated driver, the job's outcome as its race checker sees it.
    fn checked(&self, r: Result<JobOutput, Error>) -> Result<JobOutput, Error> {
        match &self.sim {
            Some((sim, from, pid)) => sim.check_job(*from, self.worker, *pid, self.job, r),
            None => r,
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
                    drop(slot);
                    return Ok(self.checked(r));
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

/// Why a job on `CU_STREAM_PER_THREAD` is refused ([`Error::InvalidStream`]).
pub(crate) const PER_THREAD_REFUSED: &str = "CU_STREAM_PER_THREAD (2) names the calling thread's default stream, which the parent's IO thread cannot reach: READY would be recorded on the IO thread's own default stream, not after the work that wrote the inputs. Pass the stream's own handle (torch: torch.cuda.current_stream().cuda_stream) or the legacy stream (0 or 1)";

impl Parent {
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
    /// before anything reaches the worker; a job on `CU_STREAM_PER_THREAD`, which the IO
    /// thread cannot reach, with [`Error::InvalidStream`]. Where `stream` has nothing left to
    /// run, READY goes on the IO thread's own stream instead ([`crate::READY_ASIDE_ENV`]).
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
        if stream == StreamHandle::PER_THREAD {
            return Err(Error::InvalidStream(PER_THREAD_REFUSED.into()));
        }
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
        let sim = self.shared.sim.as_ref().map(|sim| {
            let from = sim.count();
            sim.label_stream(
                stream,
                &format!("the stream job {} was submitted on", job.0),
            );
            for (i, input) in inputs.iter().enumerate() {
                sim.label_memory(input.ptr, &format!("input {i} of job {}", job.0));
            }
            let pid = self.shared.registered(worker).and_then(|r| r.info.pid);
            (Arc::clone(sim), from, pid)
        });
        // The last step before the post: from the turn on, the job's answer gives it up.
        let turn = self.take_turn(worker);
        let done = Arc::new(Completion {
            turn,
            ..Completion::default()
        });
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
            sim,
        })
    }

    /// Waits for `worker`'s turn on the GPU where the parent keeps turns
    /// ([`ParentOptions::gpu_turn`](crate::ParentOptions::gpu_turn)); the turn
    /// the job then holds a share of, if any.
    fn take_turn(&self, worker: WorkerId) -> Option<(Arc<Turns>, WorkerId)> {
        let turns = self.shared.turns.as_ref()?;
        let entry = turns.enter(worker);
        let waited = entry.waited();
        if !waited.is_zero() {
            let s = &self.shared.stats;
            Stats::bump(&s.turn_waits);
            s.turn_wait_ns.fetch_add(
                u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
        }
        match entry {
            Entry::Counted { .. } => Some((Arc::clone(turns), worker)),
            Entry::Uncounted { ran_out, .. } => {
                if ran_out {
                    Stats::bump(&self.shared.stats.turn_waits_ran_out);
                }
                None
            }
        }
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
}

/// Posts `Cancel` for `job` of `worker` to `shared`'s loop.
pub(crate) fn cancel_on(shared: &Shared, worker: WorkerId, job: JobId) -> Result<(), Error> {
    shared.check_loop()?;
    shared.post(LoopCommand::Cancel { worker, job });
    Ok(())
}
