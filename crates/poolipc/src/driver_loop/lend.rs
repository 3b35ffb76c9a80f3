//! Submitting a job: placing its inputs, lending them (the Lend frame), the arena slice,
//! and the READY events each handoff waits on.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use poolipc_contract::{self as contract, CarvedResult, FailReason, Outcome, SliceLoan};
use poolipc_driver::{DevicePtr, OwnedEvent};
use poolipc_types::ARENA_ALIGN as ALIGN;
use poolipc_types::{EventBlob, JobId, Rung, Span, WorkerId};

use super::place::{ArenaInput, Placed, Placement};
use super::{JobState, Loop, Submission, backlog_full};
use crate::error::Error;
use crate::state::{ArenaLease, ResultMemory, ResultTensor, Stats};
use crate::tensor::ResultShape;

impl Loop {
    /// A submitted job: placed and lent now, or queued behind the worker's jobs in flight.
    pub(super) fn submit(&mut self, sub: Box<Submission>) {
        let worker = sub.worker;
        if let Err(e) = self.shared.check_context() {
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(e));
            return;
        }
        let Some(slot) = self.workers.get_mut(&worker) else {
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(Error::UnknownWorker(worker)));
            return;
        };
        // Known, but on its way out: the job fails saying why, not as an unknown worker.
        let leaving = match (&slot.lost, slot.exit_deadline) {
            (Some(why), _) => Some((
                FailReason::HungUp,
                format!("{worker} was lost before the job was sent: {why}"),
            )),
            (None, Some(_)) => Some((
                FailReason::Stopped,
                format!("{worker} is stopping; the job was not sent"),
            )),
            (None, None) => None,
        };
        if let Some((reason, detail)) = leaving {
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(Error::JobFailed {
                worker,
                reason,
                detail,
                results: Vec::new(),
            }));
            return;
        }
        slot.queued.push_back(sub);
        self.dispatch(worker);
    }

    /// Sends the worker's queued jobs that may go now. Host staging shares the worker's socket
    /// with its frames, so a job that stages runs alone on its worker.
    pub(super) fn dispatch(&mut self, worker: WorkerId) {
        loop {
            let Some(slot) = self.workers.get_mut(&worker) else {
                return;
            };
            // `away`: the staging setup runs; the job that waits for it is first in the queue.
            if slot.staged_in_flight
                || slot.away.is_some()
                || slot.lost.is_some()
                || slot.exit_deadline.is_some()
            {
                return;
            }
            let Some(mut sub) = slot.queued.pop_front() else {
                return;
            };
            let placement = match sub.placed.take() {
                Some(placed) => Ok(placed),
                None => self.place(&sub),
            };
            crate::probe::mark("io.placed");
            match placement {
                Ok(placed) => {
                    let slot = match self.workers.get_mut(&worker) {
                        Some(s) => s,
                        None => return,
                    };
                    if placed.staged && slot.in_flight > 0 {
                        // Wait until the worker's other jobs are done, keeping the placement
                        // (its exports are made).
                        sub.placed = Some(placed);
                        slot.queued.push_front(sub);
                        return;
                    }
                    self.lend(*sub, placed);
                }
                Err(e) => {
                    // Nothing was sent: the worker's session is untouched.
                    tracing::warn!(worker = %worker, job = sub.job.0, error = %e, "job refused");
                    Stats::bump(&self.shared.stats.jobs_failed);
                    if self.escalate("placing a job's inputs", &e) {
                        sub.done.complete(Err(self.context_error()));
                        self.drive();
                        return;
                    }
                    sub.done.complete(Err(e));
                }
            }
        }
    }

    /// Host staging could not be set up for `sub`, a job with staged inputs: a worker past
    /// the backlog's bound is condemned, any other failure loses it; then the job fails.
    pub(super) fn staging_setup_failed(&mut self, sub: Submission, e: &Error) {
        let (worker, job) = (sub.worker, sub.job);
        let detail = format!("setting host staging up failed: {e}");
        let reason = if backlog_full(e) {
            let bound = contract::Bound::StagingBacklog;
            tracing::warn!(worker = %worker, job = job.0, %bound, "{detail}");
            if let Err(c) = self.machine.condemn_for(worker, bound, detail.clone()) {
                tracing::debug!(worker = %worker, error = %c, "condemning a worker the contract has let go");
            }
            FailReason::BoundExceeded(bound)
        } else {
            self.lose(worker, &detail);
            FailReason::HungUp
        };
        // The kill and the reaping first: a caller that sees its job fail finds nothing
        // of the worker left.
        self.drive();
        Stats::bump(&self.shared.stats.jobs_failed);
        sub.done.complete(Err(Error::JobFailed {
            worker,
            reason,
            detail,
            results: Vec::new(),
        }));
    }

    /// Starts a placed job in the contract and carries out what it asks.
    pub(super) fn lend(&mut self, sub: Submission, placed: Placed) {
        let worker = sub.worker;
        let job = sub.job;
        if placed.staged
            && self
                .workers
                .get(&worker)
                .is_none_or(|s| s.staging.is_none())
        {
            // Host staging is set up first, off the loop (the worker's answer may take up to
            // the staging timeout); the job waits first in the queue, placed, and is lent
            // once the setup is done ([`Loop::setup_done`]).
            match self.start_setup(worker) {
                Ok(()) => {
                    if let Some(slot) = self.workers.get_mut(&worker) {
                        let mut sub = Box::new(sub);
                        sub.placed = Some(placed);
                        slot.queued.push_front(sub);
                    }
                }
                Err(e) => self.staging_setup_failed(sub, &e),
            }
            return;
        }
        let ready = match self.take_ready(worker) {
            Ok(r) => r,
            Err(e) => {
                Stats::bump(&self.shared.stats.jobs_failed);
                let lost = self.escalate("making a READY event", &e);
                sub.done
                    .complete(Err(if lost { self.context_error() } else { e }));
                if lost {
                    self.drive();
                }
                return;
            }
        };
        crate::probe::mark("io.ready_taken");
        let slice = self.make_slice(&sub);
        let now = self.now();
        let started = self.machine.start_job_with_slice(
            worker,
            job,
            ready.1,
            placed.inputs.iter().map(|p| p.loan.clone()).collect(),
            slice.as_ref().map(|(loan, _)| *loan),
            now,
        );
        let handoffs = match started {
            Ok((h, _)) => h,
            Err(e) => {
                self.give_ready(worker, ready);
                Stats::bump(&self.shared.stats.jobs_failed);
                sub.done.complete(Err(e.into()));
                return;
            }
        };
        crate::probe::mark("io.started");
        let mut staged_inputs = HashMap::new();
        let mut lent_bases = Vec::new();
        let mut arena_inputs = HashMap::new();
        let Placed { inputs, staged } = placed;
        let mut rungs = Vec::with_capacity(inputs.len());
        let mut reasons = Vec::with_capacity(inputs.len());
        for ((h, placement), input) in handoffs.iter().zip(inputs).zip(&sub.inputs) {
            let Placement { loan, reason, copy } = placement;
            rungs.push(loan.rung);
            reasons.push(reason);
            match loan.rung {
                Rung::HostStaging => {
                    staged_inputs.insert(*h, (input.ptr, loan.span.bytes));
                    Stats::bump(&self.shared.stats.host_staged_tensors);
                }
                Rung::ArenaCopy => {
                    if let Some(lease) = copy {
                        arena_inputs.insert(
                            *h,
                            ArenaInput {
                                lease,
                                block: DevicePtr(loan.span.ptr),
                                src: input.ptr,
                                bytes: loan.meta.byte_len,
                                read_only: loan.read_only,
                            },
                        );
                    }
                    Stats::bump(&self.shared.stats.arena_copied_inputs);
                }
                Rung::VmmHandle => {
                    // The caller's memory, mapped by the worker: nothing to give back.
                    Stats::bump(&self.shared.stats.vmm_handle_tensors);
                }
                Rung::PoolPointer => {
                    self.loans.lend_pointer(loan.span.ptr, loan.alloc);
                    lent_bases.push(loan.span.ptr);
                    Stats::bump(&self.shared.stats.pool_pointer_tensors);
                }
                // Results only: the contract refuses it for an input before this point.
                Rung::Arena => {}
            }
        }
        if let Some(s) = self.workers.get_mut(&worker) {
            s.in_flight += 1;
            s.staged_in_flight |= staged;
            if s.in_flight == 1 {
                self.worker_busy(true);
            }
        }
        let Submission {
            stream,
            alloc,
            done,
            ..
        } = sub;
        let mut st = JobState::new(
            stream,
            alloc.map(|a| Arc::new(std::sync::Mutex::new(a))),
            done,
        );
        st.ready = Some(ready);
        st.input_rungs = rungs;
        st.input_reasons = reasons;
        st.arena_inputs = arena_inputs;
        st.staged = staged;
        st.staged_inputs = staged_inputs;
        st.lent_bases = lent_bases;
        st.slice = slice.map(|(loan, lease)| {
            Stats::bump(&self.shared.stats.arena_slices_lent);
            tracing::trace!(worker = %worker, job = job.0, bytes = loan.span.bytes, "arena slice lent");
            lease
        });
        self.jobs.insert((worker, job), st);
        self.drive();
    }

    /// The job's arena slice ([`crate::ParentOptions::arena_slice_bytes`]), when slices are
    /// on, the job's results go to the arena (the default allocator,
    /// [`ResultMemory::Arena`]), the worker maps the arena, the arena has a free range that
    /// large without growing, and the chunk reached the worker. Otherwise none, silently: the
    /// worker asks for its results as it always could.
    pub(super) fn make_slice(&mut self, sub: &Submission) -> Option<(SliceLoan, ArenaLease)> {
        let bytes = self.shared.arena_slice_bytes.load(Ordering::Relaxed);
        if bytes == 0
            || sub.alloc.is_some()
            || !matches!(self.shared.options.results, ResultMemory::Arena { .. })
            || !self.workers.get(&sub.worker).is_some_and(|s| s.maps_arena)
        {
            return None;
        }
        let arena = match self.ensure_arena(sub.worker, bytes) {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(worker = %sub.worker, job = sub.job.0, error = %e, "no arena slice: no arena");
                return None;
            }
        };
        // Blocks given back whose work completed count as free; a slice never grows the arena.
        arena.reclaim();
        let len = bytes.checked_next_multiple_of(ALIGN)?;
        if arena.stats().largest_free < len {
            tracing::trace!(worker = %sub.worker, job = sub.job.0, bytes, "no arena slice: no room");
            return None;
        }
        let block = arena.alloc(bytes).ok()?;
        // Owned from here: dropped on any path below, the block goes back stream-ordered.
        let lease = ArenaLease::new(Arc::clone(&arena), block, sub.stream);
        self.announce_chunks(Some(sub.worker));
        let sent = self
            .workers
            .get(&sub.worker)
            .is_some_and(|s| s.maps_arena && s.arena_chunks_sent > block.chunk);
        if !sent {
            return None;
        }
        let alloc = self.loans.new_id();
        let loan = SliceLoan {
            alloc,
            span: Span {
                ptr: block.ptr.0,
                bytes: block.len,
            },
            chunk: block.chunk,
            offset: block.offset,
        };
        Some((loan, lease))
    }

    /// The contract released the job's slice (once the host saw DONE complete, or once the
    /// worker was reaped): on completion each carve becomes a result owning its part of the
    /// slice; everything else goes back to the arena, stream-ordered on the job's stream.
    pub(super) fn release_slice(
        &mut self,
        worker: WorkerId,
        job: JobId,
        outcome: Outcome,
        mut carved: Vec<CarvedResult>,
    ) {
        let Some(st) = self.jobs.get_mut(&(worker, job)) else {
            return;
        };
        let Some(mut lease) = st.slice.take() else {
            return;
        };
        if outcome != Outcome::Completed || carved.is_empty() {
            // The whole slice goes back (dropping the lease), ordered after the DONE wait.
            return;
        }
        let Some((arena, whole)) = lease.take() else {
            return;
        };
        let stream = st.stream;
        let count = carved.len();
        carved.sort_unstable_by_key(|c| c.offset);
        // What of the slice is not handed out yet: from `rest.offset` to its end.
        let mut rest = Some(whole);
        for c in carved {
            let Some(block) = rest.take() else {
                break;
            };
            let split = |b: poolipc_pool::arena::ArenaBlock, at: u64| {
                if at == 0 {
                    Ok((None, Some(b)))
                } else if at >= b.len {
                    Ok((Some(b), None))
                } else {
                    arena.split(b, at).map(|(x, y)| (Some(x), Some(y)))
                }
            };
            let gap = (whole.offset + c.offset).saturating_sub(block.offset);
            let len = c.bytes.checked_next_multiple_of(ALIGN).unwrap_or(u64::MAX);
            let pieces = split(block, gap).and_then(|(gap, after)| match after {
                Some(after) => split(after, len).map(|(piece, tail)| (gap, piece, tail)),
                None => Ok((gap, None, None)),
            });
            match pieces {
                Ok((gap, Some(piece), tail)) => {
                    drop(gap.map(|g| ArenaLease::new(Arc::clone(&arena), g, stream)));
                    let shape = ResultShape {
                        dtype: c.dtype,
                        shape: c.shape,
                    };
                    let result =
                        ResultTensor::in_arena(Arc::clone(&arena), piece, c.bytes, shape, stream);
                    st.carved.insert(c.index, result);
                    rest = tail;
                }
                Ok((gap, None, _)) => {
                    drop(gap.map(|g| ArenaLease::new(Arc::clone(&arena), g, stream)));
                    st.slice_error.get_or_insert_with(|| {
                        format!("carve {} of {} bytes lies past its slice", c.index, c.bytes)
                    });
                }
                Err(e) => {
                    // The block is unchanged by a refused split: it goes back whole below.
                    rest = Some(block);
                    st.slice_error
                        .get_or_insert_with(|| format!("splitting the job's slice failed: {e}"));
                    break;
                }
            }
        }
        drop(rest.map(|r| ArenaLease::new(Arc::clone(&arena), r, stream)));
        for _ in 0..count {
            Stats::bump(&self.shared.stats.arena_results_carved);
            Stats::bump(&self.shared.stats.arena_results);
        }
    }

    pub(super) fn take_ready(
        &mut self,
        worker: WorkerId,
    ) -> Result<(OwnedEvent, EventBlob), Error> {
        if let Some(r) = self
            .workers
            .get_mut(&worker)
            .and_then(|s| s.ready_free.pop())
        {
            return Ok(r);
        }
        let event = OwnedEvent::new(Arc::clone(&self.shared.driver), true)?;
        let blob = event.ipc_handle()?;
        Ok((event, blob))
    }

    pub(super) fn give_ready(&mut self, worker: WorkerId, ready: (OwnedEvent, EventBlob)) {
        if let Some(s) = self.workers.get_mut(&worker) {
            s.ready_free.push(ready);
        }
    }
}
