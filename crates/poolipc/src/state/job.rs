//! A job's data as the parent's threads and the IO loop share it: what goes in ([`Input`]),
//! what comes out ([`JobOutput`], [`ResultTensor`]), and how a job's end reaches its waiter
//! ([`Completion`], [`Answer`]).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use poolipc_driver::{DevicePtr, Driver, OwnedEvent, StreamHandle};
use poolipc_pool::Arena;
use poolipc_pool::arena::ArenaBlock;
use poolipc_types::{Rung, WorkerId};

use super::lock;
use super::turns::Turns;
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
/// copied after it, and work the caller queues on it after [`JobHandle::wait`](crate::JobHandle::wait) (a write, a
/// free) runs after the copy. The worker reads only the copy.
///
/// # Writes by the worker
///
/// No write is lost silently. Unless `read_only` is set, a write the worker makes to its view
/// reaches this tensor on every rung: in place on the pool pointer; on arena copy the block
/// is copied back into the tensor on the job's stream once the worker's DONE completed
/// (before the block goes back to the arena); on host staging the worker's copy comes back
/// through the staging buffer after its `Done`, copied in on the job's stream. Either way,
/// work queued on the job's stream after [`JobHandle::wait`](crate::JobHandle::wait) sees the worker's writes. The
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
/// - From the caller's allocator ([`Parent::submit_with`](crate::Parent::submit_with)) or the shared pool
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
/// that no [`JobHandle`](crate::JobHandle) waits for ever.
pub(crate) struct Answer(pub(crate) Arc<Completion>);

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

/// How a job ends, shared between the IO thread and the [`JobHandle`](crate::JobHandle).
#[derive(Default)]
pub(crate) struct Completion {
    pub(crate) result: Mutex<Option<Result<JobOutput, Error>>>,
    pub(crate) cond: Condvar,
    /// Set with the result: lets a waiter spin without the lock.
    pub(crate) finished: std::sync::atomic::AtomicBool,
    /// The GPU turn the job holds a share of, given up when it ends
    /// ([`Tuning::gpu_turn`](crate::Tuning::gpu_turn)).
    pub(crate) turn: Option<(Arc<Turns>, WorkerId)>,
    /// Threads in [`JobWatch::wait_any`](crate::JobWatch::wait_any) over this job, woken when it ends.
    pub(crate) watchers: Mutex<Vec<Arc<AnyWake>>>,
    /// Threads asleep on `cond`, counted with `result` locked: where none is, the end of
    /// the job wakes nobody (a spinning waiter sees `finished`), and the IO thread saves the
    /// system call.
    pub(crate) sleepers: std::sync::atomic::AtomicUsize,
}

/// What a thread in [`JobWatch::wait_any`](crate::JobWatch::wait_any) sleeps on: set by the first of its jobs to end.
#[derive(Default)]
pub(crate) struct AnyWake {
    pub(crate) fired: Mutex<bool>,
    pub(crate) cond: Condvar,
}

impl AnyWake {
    pub(crate) fn fire(&self) {
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
        // With `result` still locked: a waiter counts itself in under the same lock before
        // it sleeps, so none is missed.
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            self.cond.notify_all();
        }
        drop(slot);
        for w in std::mem::take(&mut *lock(&self.watchers)) {
            w.fire();
        }
    }

    /// Sleeps on `cond` with `slot` (this job's `result`, locked) until woken, at most
    /// `timeout` (`None`: no bound); returns the lock again.
    pub(crate) fn sleep<'a>(
        &self,
        slot: std::sync::MutexGuard<'a, Option<Result<JobOutput, Error>>>,
        timeout: Option<std::time::Duration>,
    ) -> std::sync::MutexGuard<'a, Option<Result<JobOutput, Error>>> {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        let slot = match timeout {
            None => self
                .cond
                .wait(slot)
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            Some(t) => {
                self.cond
                    .wait_timeout(slot, t)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0
            }
        };
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        slot
    }

    /// Spins until the result is set or `until` passes (not at all once it has), calling
    /// `look` at each turn (a waiter's read of its worker's answer, say).
    pub(crate) fn spin_until(&self, until: Instant, mut look: impl FnMut()) {
        while !self.finished.load(Ordering::Acquire) && Instant::now() < until {
            look();
            if self.finished.load(Ordering::Acquire) {
                return;
            }
            crate::spin::pause();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Completion, JobOutput, lock};
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    #[test]
    fn a_sleeping_waiter_is_woken_and_an_end_with_no_sleeper_still_sets_the_result() {
        let done = Arc::new(Completion::default());
        let waiter = {
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let mut slot = lock(&done.result);
                while slot.is_none() {
                    slot = done.sleep(slot, None);
                }
                slot.take().is_some_and(|r| r.is_ok())
            })
        };
        // The waiter counted itself in before sleeping.
        while done.sleepers.load(Ordering::Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        done.complete(Ok(JobOutput::default()));
        assert!(waiter.join().is_ok_and(|ok| ok), "woken with the result");
        assert_eq!(done.sleepers.load(Ordering::Relaxed), 0);

        let alone = Completion::default();
        alone.complete(Ok(JobOutput::default()));
        assert!(alone.finished.load(Ordering::Acquire));
        let slot = alone.sleep(lock(&alone.result), Some(Duration::from_millis(1)));
        assert!(slot.is_some(), "a bounded sleep returns, the result there");
    }
}
