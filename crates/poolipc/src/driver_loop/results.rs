//! Results: memory allocated for a worker's request (pool or arena), released after the
//! job, and the job finished for its caller.

use std::sync::Arc;
use std::time::{Duration, Instant};

use poolipc_contract::{
    self as contract, FailReason, JobOutcome, Outcome, ParentAction, ParentEvent, Purpose,
    ResultSpec,
};
use poolipc_driver::DevicePtr;
use poolipc_transport::ErrorCode;
use poolipc_types::{ExportBlob, HandoffId, JobId, RequestId, Rung, Span, WorkerId};

use super::transfer::Held;
use super::{JobState, Loop, MPS_FAULT_GRACE, backlog_full, names_gpu_fault};
use crate::error::Error;
use crate::state::{JobOutput, ResultMemory, ResultTensor, Stats};
use crate::tensor::ResultShape;

impl Loop {
    /// The contract asks for a result's memory: made here (the pool or the arena), or by the
    /// job's own allocator on the room's allocator thread, whose answer comes back to
    /// [`Loop::answer_result`] through [`Loop::result_made`].
    pub(super) fn allocate_result(
        &mut self,
        worker: WorkerId,
        job: JobId,
        request: RequestId,
        spec: &ResultSpec,
    ) {
        if let Some(st) = self.jobs.get(&(worker, job))
            && let Some(alloc) = st.alloc.clone()
        {
            let stream = st.stream;
            self.call_allocator(worker, job, request, spec, stream, alloc);
            return;
        }
        self.answer_result(worker, job, request, spec, None);
    }

    /// Goes on with result `request`: its memory is `made` by the job's allocator, or (None)
    /// made here; the contract hears it was allocated, declined, or (host staging to set up
    /// first) nothing yet.
    pub(super) fn answer_result(
        &mut self,
        worker: WorkerId,
        job: JobId,
        request: RequestId,
        spec: &ResultSpec,
        made: Option<Result<DevicePtr, Error>>,
    ) {
        let now = self.now();
        let made = match made {
            None => self.make_result(worker, job, request, spec, None),
            Some(Ok(ptr)) => {
                let made = self.make_result(worker, job, request, spec, Some(ptr));
                if made.is_err() {
                    // Made before the checks that refused it: the caller's memory goes back
                    // with the job's error, as every result of its allocator does.
                    self.keep_orphan(worker, job, ptr);
                }
                made
            }
            Some(Err(e)) => Err(e),
        };
        let made = made.and_then(|made| match made {
            Some(event) => Ok(Some(event)),
            // Host staging is set up first, off the loop (the worker's answer may take up to
            // the staging timeout), and this allocation is asked for again, first among what
            // is held for the worker, once the setup is done ([`Loop::setup_done`]).
            None => self.start_setup(worker).map(|()| None),
        });
        let event = match made {
            Ok(Some(e)) => e,
            Ok(None) => {
                if let Some(slot) = self.workers.get_mut(&worker) {
                    slot.held
                        .push_front(Held::Action(ParentAction::AllocateResult {
                            worker,
                            job,
                            request,
                            spec: spec.clone(),
                        }));
                }
                return;
            }
            Err(e) => {
                tracing::warn!(worker = %worker, job = job.0, error = %e, "result allocation failed");
                if backlog_full(&e) {
                    let why = format!("setting host staging up for a result failed: {e}");
                    self.condemn_for_bound(worker, job, contract::Bound::StagingBacklog, why);
                }
                if let Some(st) = self.jobs.get_mut(&(worker, job)) {
                    st.refused
                        .get_or_insert_with(|| crate::error::ResultRefusal::of(&e));
                }
                ParentEvent::ResultDeclined {
                    worker,
                    request,
                    code: ErrorCode::OUT_OF_MEMORY,
                    message: format!("the parent could not allocate {} bytes: {e}", spec.byte_len),
                }
            }
        };
        if let Err(e) = self.machine.handle(event, now) {
            tracing::warn!(worker = %worker, error = %e, "the contract refused a result allocation");
            // Not granted: never handed out as a result (freed or given back at the job's end).
            if let Some(st) = self.jobs.get_mut(&(worker, job))
                && let Some(r) = st.results.remove(&request)
                && r.rung != Rung::Arena
            {
                st.orphans.push(r.ptr);
            }
        }
    }

    /// Records `ptr`, memory of the job's allocator that will not be handed out, among the
    /// job's orphans (given back with its error), unless it is recorded already.
    fn keep_orphan(&mut self, worker: WorkerId, job: JobId, ptr: DevicePtr) {
        if let Some(st) = self.jobs.get_mut(&(worker, job)) {
            st.keep_orphan(ptr);
        }
    }

    /// Allocates a result (or takes `made`, what the job's allocator made) and chooses its
    /// rung: pool pointer for memory of a pool the worker takes pointers from, within the
    /// limit; host staging otherwise. `None`: the result takes host staging, which is not set
    /// up with the worker yet (the memory was given back): set it up, then ask again.
    pub(super) fn make_result(
        &mut self,
        worker: WorkerId,
        job: JobId,
        request: RequestId,
        spec: &ResultSpec,
        made: Option<DevicePtr>,
    ) -> Result<Option<ParentEvent>, Error> {
        let pointer_pools = self
            .shared
            .pointer_pools(worker)
            .ok_or(Error::UnknownWorker(worker))?;
        let takes_staging = self.workers.get(&worker).is_some_and(|s| s.takes_staging);
        let shape = ResultShape {
            dtype: spec.dtype,
            shape: spec.shape.clone(),
        };
        let bytes = spec.byte_len;
        // The arena when the parent keeps results there, and for a worker that takes no pool
        // pointer (isolated) whenever it maps the arena: better than host staging.
        let to_arena = bytes > 0
            && (matches!(self.shared.options.results, ResultMemory::Arena { .. })
                || pointer_pools.is_empty())
            && self.workers.get(&worker).is_some_and(|s| s.maps_arena)
            && self
                .jobs
                .get(&(worker, job))
                .is_some_and(|st| st.alloc.is_none());
        if to_arena {
            return self
                .make_arena_result(worker, job, request, shape, bytes)
                .map(Some);
        }
        let st = self.jobs.get_mut(&(worker, job)).ok_or_else(|| {
            Error::Protocol(format!("a result for job {} the loop does not hold", job.0))
        })?;
        let stream = st.stream;
        // Its place among the job's results (as the worker numbers them), for reports.
        let index = st.requests_by_alloc.len();
        let ptr = match made {
            Some(ptr) => {
                // The caller's allocator is trusted with the memory, not with its size: a
                // result smaller than asked would let the worker write past it.
                let room = self
                    .shared
                    .driver
                    .pointer_info(ptr)
                    .ok()
                    .and_then(|i| (i.base.0 + i.size).checked_sub(ptr.0));
                if room.is_none_or(|r| r < bytes) {
                    st.orphans.push(ptr);
                    return Err(Error::InvalidTensor(format!(
                        "the job's result allocator returned {:#x}, which has {} of the {bytes} \
                         bytes asked for result {} of its allocation",
                        ptr.0,
                        room.map_or_else(|| "none".to_owned(), |r| format!("{r} bytes")),
                        request.0,
                    )));
                }
                ptr
            }
            None => self.shared.pools[0].alloc(bytes, stream)?,
        };
        if let Some(sim) = &self.shared.sim {
            sim.label_memory(ptr, &format!("result {index} of job {}", job.0));
        }
        let alloc = self.loans.new_id();
        let handle = self.shared.driver.pointer_get_mempool(ptr).ok();
        let pool = handle.and_then(|h| self.shared.pool_of(h));
        // The worker's index of the result's pool (generation), if it takes pointers of it.
        let wire = handle.and_then(|h| {
            pointer_pools
                .iter()
                .find(|(ph, _)| *ph == h)
                .map(|(_, i)| *i)
        });
        let limit = self.shared.limit();
        let by_pointer = pool.is_some() && wire.is_some() && limit.allows(ptr.0, bytes);
        let rung = if by_pointer {
            Rung::PoolPointer
        } else if takes_staging {
            Rung::HostStaging
        } else {
            // Not lendable and no staging: give the memory back at once.
            st.orphans.push(ptr);
            return Err(Error::NoRung(format!(
                "a result of {bytes} bytes cannot go by pool pointer and {worker} has no host staging"
            )));
        };
        if rung == Rung::HostStaging
            && let Some(slot) = self.workers.get(&worker)
            && slot.staging.is_none()
        {
            if let Some(why) = &slot.staging_failed {
                let e = Error::NoRung(format!(
                    "a result of {bytes} bytes takes host staging, which could not be set up with {worker}: {why}"
                ));
                st.orphans.push(ptr);
                return Err(e);
            }
            // Given back now, or once the job ends for memory of the caller's allocator; the
            // allocation is made again once the setup is done.
            if st.alloc.is_none() {
                self.shared.pools[0].free(ptr, stream)?;
            } else {
                st.orphans.push(ptr);
            }
            return Ok(None);
        }
        let export = match (rung, pool) {
            (Rung::PoolPointer, Some(p)) => match self.shared.pools[p].export(ptr) {
                Ok(e) => e,
                Err(e) => {
                    st.orphans.push(ptr);
                    return Err(e.into());
                }
            },
            _ => ExportBlob([0; 64]),
        };
        st.results
            .insert(request, ResultTensor::new(ptr, bytes, shape, rung));
        st.requests_by_alloc.insert(alloc, request);
        // The rungs a result allocated here can take (the arena's go through
        // make_arena_result; VMM handles and arena copies are for inputs).
        let counter = match rung {
            Rung::HostStaging => &self.shared.stats.host_staged_tensors,
            Rung::PoolPointer | Rung::Arena | Rung::ArenaCopy | Rung::VmmHandle => {
                &self.shared.stats.pool_pointer_tensors
            }
        };
        Stats::bump(counter);
        if rung == Rung::HostStaging {
            // Set up before the grant goes out (above): the worker sends the bytes after its
            // Done.
            if let Some(s) = self.workers.get_mut(&worker) {
                s.staged_in_flight = true;
            }
            if let Some(st) = self.jobs.get_mut(&(worker, job)) {
                st.staged = true;
            }
        }
        Ok(Some(ParentEvent::ResultAllocated {
            worker,
            request,
            alloc,
            span: Span { ptr: ptr.0, bytes },
            rung,
            pool: if rung == Rung::PoolPointer {
                wire.unwrap_or(0)
            } else {
                0
            },
            export,
        }))
    }

    /// A result in a block of the worker's arena: the chunk it lies in is sent to the worker
    /// if it has not got it (before its grant), then the contract hears where it is.
    pub(super) fn make_arena_result(
        &mut self,
        worker: WorkerId,
        job: JobId,
        request: RequestId,
        shape: ResultShape,
        bytes: u64,
    ) -> Result<ParentEvent, Error> {
        let arena = self.ensure_arena(worker, bytes)?;
        let stream = self
            .jobs
            .get(&(worker, job))
            .map(|st| st.stream)
            .ok_or_else(|| {
                Error::Protocol(format!("a result for job {} the loop does not hold", job.0))
            })?;
        let block = arena.alloc(bytes)?;
        // Owned from here: dropped on any path below, the block goes back (stream-ordered).
        let result = ResultTensor::in_arena(Arc::clone(&arena), block, bytes, shape, stream);
        self.announce_chunks(Some(worker));
        let sent = self
            .workers
            .get(&worker)
            .is_some_and(|s| s.maps_arena && s.arena_chunks_sent > block.chunk);
        if !sent {
            return Err(Error::Protocol(format!(
                "arena chunk {} could not be sent to {worker}",
                block.chunk
            )));
        }
        let st = self.jobs.get_mut(&(worker, job)).ok_or_else(|| {
            Error::Protocol(format!("a result for job {} the loop does not hold", job.0))
        })?;
        let alloc = self.loans.new_id();
        st.record(request, alloc, result);
        Stats::bump(&self.shared.stats.arena_results);
        tracing::trace!(worker = %worker, job = job.0, ?block, "result in the arena");
        Ok(ParentEvent::ResultAllocatedInArena {
            worker,
            request,
            alloc,
            span: Span {
                ptr: block.ptr.0,
                bytes: block.len,
            },
            chunk: block.chunk,
            offset: block.offset,
        })
    }

    pub(super) fn release(
        &mut self,
        worker: WorkerId,
        job: JobId,
        handoff: HandoffId,
        purpose: Purpose,
        rung: Rung,
        outcome: Outcome,
    ) {
        let Some(st) = self.jobs.get_mut(&(worker, job)) else {
            return;
        };
        if purpose == Purpose::Input && rung == Rung::ArenaCopy {
            // The contract releases it once the host saw the worker's DONE complete (the loop
            // holds the release until then), or once the worker was reaped: the block goes
            // back ordered after both.
            let Some(input) = st.arena_inputs.remove(&handoff) else {
                return;
            };
            // Copy-back: what the worker wrote into the block reaches the caller's tensor,
            // on the job's stream after DONE completed and before the block goes back (the
            // lease's return is recorded after it). The worker acknowledged after DONE
            // (completed or cancelled); a worker reaped before that leaves the tensor as it
            // was, since nothing orders its writes.
            // Not after a DONE wait that failed: nothing orders the copy after the worker.
            let acked = matches!(outcome, Outcome::Completed | Outcome::Cancelled)
                && st.done_failed.is_none();
            if acked && !input.read_only {
                let copied = super::bounce::copy_on_device(
                    &mut self.bounce,
                    &self.shared,
                    input.src,
                    input.block,
                    input.bytes,
                    st.stream,
                );
                match copied {
                    Ok(()) => {
                        Stats::bump(&self.shared.stats.inputs_copied_back);
                        tracing::trace!(worker = %worker, job = job.0, bytes = input.bytes, "arena-copy input copied back");
                    }
                    Err(e) => {
                        tracing::warn!(worker = %worker, job = job.0, error = %e, "copying an arena-copy input back failed");
                        st.copy_back_error.get_or_insert(format!(
                            "copying the worker's writes to an input back from the arena failed: {e}"
                        ));
                    }
                }
            }
            drop(input.lease);
            return;
        }
        // Inputs stay the caller's; a result that did not complete goes back.
        if let Purpose::Result { request } = purpose
            && outcome != Outcome::Completed
            && let Some(r) = st.results.remove(&request)
        {
            // Nothing imports it any more: the worker acknowledged (and the stream waited on
            // its DONE) or was reaped.
            st.discard(r);
        }
    }

    /// The contract's last word on a job: its handle gets the results or the error.
    pub(super) fn finish(&mut self, worker: WorkerId, job: JobId, outcome: JobOutcome) {
        self.pace.active(Instant::now());
        let Some(mut st) = self.jobs.remove(&(worker, job)) else {
            return;
        };
        for base in st.lent_bases.drain(..) {
            self.loans.return_pointer(base);
        }
        if !matches!(outcome, JobOutcome::Completed) {
            if let JobOutcome::WorkerError(m) = &outcome {
                self.workers.suspect(worker, format!("it reported: {m}"));
            }
            // A worker that failed may have faulted on the GPU: under MPS that ends our
            // context too. Ask now rather than at the next job. The MPS server marks the
            // other clients a little after the faulting one sees its error (on the H200 the
            // parent's first query sometimes still succeeded), so under MPS, for a failure
            // that looks like a crash or a GPU fault, ask again for up to MPS_FAULT_GRACE.
            let crash_like = match &outcome {
                JobOutcome::Failed { reason, .. } => {
                    matches!(reason, FailReason::HungUp | FailReason::ProtocolViolation)
                }
                JobOutcome::WorkerError(m) => names_gpu_fault(m),
                JobOutcome::Completed => false,
            };
            let grace = if crash_like && self.shared.mps_client == Some(true) {
                MPS_FAULT_GRACE
            } else {
                Duration::ZERO
            };
            let started = Instant::now();
            while self.shared.check_context().is_ok() {
                let probe = poolipc_driver::OwnedEvent::new(&*self.shared.driver, false)
                    .and_then(poolipc_driver::OwnedEvent::close);
                match probe {
                    Err(e) => {
                        self.escalate("checking the context after a failed job", &e.into());
                        break;
                    }
                    Ok(()) if started.elapsed() < grace => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Ok(()) => break,
                }
            }
        }
        if let Some(ready) = st.ready.take() {
            self.give_ready(worker, ready);
        }
        if let Some(s) = self.workers.get_mut(&worker) {
            let was = s.in_flight;
            s.in_flight = s.in_flight.saturating_sub(1);
            if st.staged {
                s.staged_in_flight = false;
            }
            if was == 1 {
                self.worker_busy(false);
            }
        }
        if st.staged {
            // Chunks held back while its staging transfer ran.
            self.announce_chunks(None);
        }
        let result = match outcome {
            JobOutcome::Completed
                if st.done_failed.is_some()
                    || st.slice_error.is_some()
                    || st.copy_back_error.is_some() =>
            {
                let why = st
                    .done_failed
                    .take()
                    .or_else(|| st.slice_error.take())
                    .or_else(|| st.copy_back_error.take())
                    .unwrap_or_default();
                let results = self.give_back_results(&mut st);
                Err(Error::JobFailed {
                    worker,
                    reason: st.failed_as.take().unwrap_or(FailReason::ProtocolViolation),
                    detail: why,
                    results,
                })
            }
            JobOutcome::Completed => {
                self.free_orphans(&mut st);
                // Carved results at their places, granted ones in request order in the others.
                let mut granted = std::mem::take(&mut st.results).into_values();
                let mut carved = std::mem::take(&mut st.carved);
                let total = carved.len() + granted.len();
                let mut results = Vec::with_capacity(total);
                for place in 0..total {
                    let carve = u32::try_from(place).ok().and_then(|p| carved.remove(&p));
                    results.extend(carve.or_else(|| granted.next()));
                }
                Ok(JobOutput {
                    results,
                    input_rungs: std::mem::take(&mut st.input_rungs),
                    input_reasons: std::mem::take(&mut st.input_reasons),
                })
            }
            JobOutcome::WorkerError(message) => {
                let results = self.give_back_results(&mut st);
                Err(Error::Worker {
                    message,
                    results,
                    refused: st.refused.take(),
                })
            }
            JobOutcome::Failed { reason, detail } => {
                let results = self.give_back_results(&mut st);
                let status = self.workers.reaped_status(worker);
                let detail = if status.is_empty() {
                    detail
                } else {
                    format!("{detail}; worker {status}")
                };
                // A worker that went away after the parent refused its results most likely
                // died of the refusal: name it, it is the cause the caller can act on.
                let detail = match st.refused.take() {
                    Some(r) => format!("{detail}; before that the parent refused its results: {r}"),
                    None => detail,
                };
                Err(Error::JobFailed {
                    worker,
                    reason,
                    detail,
                    results,
                })
            }
        };
        let result = match result {
            Err(_) if self.shared.check_context().is_err() => Err(self.context_error()),
            r => r,
        };
        let counter = if matches!(
            result,
            Err(Error::JobFailed { .. } | Error::ContextLost { .. })
        ) {
            &self.shared.stats.jobs_failed
        } else {
            &self.shared.stats.jobs_completed
        };
        Stats::bump(counter);
        st.done.complete(result);
        self.dispatch(worker);
    }

    /// A failed job's result memory: freed here for the default allocator (arena blocks go
    /// back to the arena, stream-ordered), else returned.
    pub(super) fn give_back_results(&mut self, st: &mut JobState) -> Vec<DevicePtr> {
        for r in std::mem::take(&mut st.results).into_values() {
            st.discard(r);
        }
        // Carved results and an unreleased slice: arena blocks, back stream-ordered.
        st.carved.clear();
        drop(st.slice.take());
        let all = std::mem::take(&mut st.orphans);
        if st.alloc.is_none() {
            st.orphans = all;
            self.free_orphans(st);
            Vec::new()
        } else {
            all
        }
    }

    /// Frees the result memory of the default allocator that was not handed out. Memory of
    /// a caller's allocator is the caller's: left alone (and said so).
    pub(super) fn free_orphans(&mut self, st: &mut JobState) {
        if st.alloc.is_some() {
            if !st.orphans.is_empty() {
                tracing::warn!(
                    count = st.orphans.len(),
                    "result memory of the job's allocator was not handed out: the caller's to free"
                );
            }
            st.orphans.clear();
            return;
        }
        for ptr in st.orphans.drain(..) {
            if let Err(e) = self.shared.pools[0].free(ptr, st.stream) {
                tracing::warn!(error = %e, ?ptr, "freeing a result that was not handed out failed");
            }
        }
    }
}
