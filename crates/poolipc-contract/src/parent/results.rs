//! Result requests and grants: a worker asks for its results by shape; the parent checks
//! the request against its bounds, asks the facade's allocator for each result, and once
//! every one is answered records READY (for pointers) and sends one `AllocationGrant`.

use crate::error::ContractError;
use crate::message::{
    AllocationGrant, ErrorCode, MAX_REFUSAL_TEXT_LEN, MAX_RESULTS_PER_REQUEST, Message,
    ResultGrant, ResultRequest, ResultSpec,
};
use crate::mutation::Mutation;
use crate::types::{
    AllocId, JobId, Purpose, RequestId, Rung, Span, Timestamp, WorkerId, ZERO_EVENT, ZERO_EXPORT,
    by_pointer, dense_bytes,
};

use super::ledger::{Answer, Job, PeerState, Terms};
use super::{Bound, FailReason, Parent, ParentAction};

impl Parent {
    pub(super) fn on_result_request(
        &mut self,
        worker: WorkerId,
        request: ResultRequest,
        now: Timestamp,
    ) {
        let ResultRequest { job, results } = request;
        let empty = results.is_empty();
        let Some(j) = self.ledger.job(worker, job) else {
            return self.violation(
                worker,
                format!("a result request for {job}, which is not open"),
            );
        };
        if j.batch().is_some() {
            return self.violation(
                worker,
                format!("a second result request for {job} before the first was answered"),
            );
        }
        for (i, spec) in results.iter().enumerate() {
            match dense_bytes(spec.dtype, &spec.shape) {
                Some(dense) if dense == spec.byte_len => {}
                Some(dense) => {
                    return self.violation(
                        worker,
                        format!(
                            "result {i} of the request for {job} says byte_len {} but {:?} of {:?} \
                             takes {dense}",
                            spec.byte_len, spec.shape, spec.dtype
                        ),
                    );
                }
                None => {
                    return self.violation(
                        worker,
                        format!(
                            "result {i} of the request for {job}: the size of {:?} of {:?} \
                             overflows",
                            spec.shape, spec.dtype
                        ),
                    );
                }
            }
        }
        let cancelled = j.cancelled;
        if results.len() <= MAX_RESULTS_PER_REQUEST
            && let Some((bound, detail)) = self.over_result_bounds(worker, j, &results)
        {
            return self.condemn(
                worker,
                FailReason::BoundExceeded(bound),
                format!("{worker}'s result request for {job} goes past the {bound}: {detail}"),
                true,
            );
        }
        let asked = u64::try_from(results.len()).unwrap_or(u64::MAX);
        let bytes = results
            .iter()
            .fold(0u64, |acc, r| acc.saturating_add(r.byte_len));
        if results.len() <= MAX_RESULTS_PER_REQUEST
            && let Some(j) = self.ledger.job_mut(worker, job)
        {
            j.results_asked = j.results_asked.saturating_add(asked);
            j.result_bytes = j.result_bytes.saturating_add(bytes);
        }
        // A grant for more results than this would not fit a frame: refuse them all (the
        // refusals are short), and the worker goes on.
        let too_many = (results.len() > MAX_RESULTS_PER_REQUEST).then(|| Answer::Refused {
            code: ErrorCode::LIMIT,
            message: format!(
                "a request may ask for at most {MAX_RESULTS_PER_REQUEST} results; this one asked \
                 for {}",
                results.len()
            ),
        });
        let byte_lens: Vec<u64> = results.iter().map(|r| r.byte_len).collect();
        let requests = self.ledger.open_batch(worker, job, &byte_lens);
        for (request, spec) in requests.into_iter().zip(results) {
            if cancelled {
                self.ledger.answer(request, Answer::cancelled());
            } else if let Some(refusal) = &too_many {
                self.ledger.answer(request, refusal.clone());
            } else if self.mutated(Mutation::GrantBeforeAllocation) {
                // Test-only bug: grant memory nobody allocated.
                self.ledger.answer(
                    request,
                    Answer::Allocated {
                        alloc: AllocId(u64::MAX - request.0),
                        span: Span {
                            ptr: 0,
                            bytes: spec.byte_len,
                        },
                        rung: Rung::PoolPointer,
                        pool: 0,
                        export: ZERO_EXPORT,
                        arena: None,
                    },
                );
            } else {
                self.actions.push_back(ParentAction::AllocateResult {
                    worker,
                    job,
                    request,
                    spec,
                });
            }
        }
        if empty {
            self.idle(worker, job, "an empty result request");
        }
        self.grant_if_answered(worker, job, now);
    }

    /// Which result bound `job` (of `worker`) would pass by asking for `results` as well,
    /// and by how much.
    fn over_result_bounds(
        &self,
        worker: WorkerId,
        job: &Job,
        results: &[ResultSpec],
    ) -> Option<(Bound, String)> {
        let asked = u64::try_from(results.len()).unwrap_or(u64::MAX);
        let bytes = results
            .iter()
            .fold(0u64, |acc, r| acc.saturating_add(r.byte_len));
        let count = job.results_asked.saturating_add(asked);
        if count > self.config.max_results_per_job {
            return Some((
                Bound::ResultsPerJob,
                format!(
                    "{count} results asked for, at most {} allowed",
                    self.config.max_results_per_job
                ),
            ));
        }
        let job_bytes = job.result_bytes.saturating_add(bytes);
        if job_bytes > self.config.max_result_bytes_per_job {
            return Some((
                Bound::ResultBytesPerJob,
                format!(
                    "{job_bytes} bytes asked for, at most {} allowed",
                    self.config.max_result_bytes_per_job
                ),
            ));
        }
        let open: u64 = self.ledger.peer(worker).map_or(0, |peer| {
            peer.jobs
                .iter()
                .filter_map(|j| self.ledger.job(worker, *j))
                .fold(0u64, |acc, j| acc.saturating_add(j.result_bytes))
        });
        let worker_bytes = open.saturating_add(bytes);
        if worker_bytes > self.config.max_result_bytes_per_worker {
            return Some((
                Bound::ResultBytesPerWorker,
                format!(
                    "{worker_bytes} bytes asked for in its open jobs, at most {} allowed",
                    self.config.max_result_bytes_per_worker
                ),
            ));
        }
        None
    }

    pub(super) fn on_answer(
        &mut self,
        worker: WorkerId,
        request: RequestId,
        answer: Answer,
        now: Timestamp,
    ) -> Result<(), ContractError> {
        if self.ledger.peer(worker).is_none() {
            return Err(ContractError::UnknownWorker(worker));
        }
        let Some(p) = self.ledger.pending(request).filter(|p| p.worker == worker) else {
            return Err(ContractError::UnknownRequest { request });
        };
        let (job, byte_len) = (p.job, p.byte_len);
        if let Answer::Allocated { alloc, .. } = &answer
            && (self.ledger.lent_span(*alloc).is_some() || self.ledger.is_unoffered(*alloc))
        {
            return Err(ContractError::AllocationMismatch { alloc: *alloc });
        }
        let Some(j) = self.ledger.job(worker, job) else {
            self.ledger.answer(request, Answer::cancelled());
            return Ok(());
        };
        let reaped = self
            .ledger
            .peer(worker)
            .is_some_and(|peer| peer.state == PeerState::Reaped);
        let answer = match answer {
            Answer::Allocated { alloc, .. } if reaped || j.cancelled => {
                self.actions.push_back(ParentAction::FreeResult {
                    worker,
                    job,
                    request,
                    alloc,
                });
                Answer::cancelled()
            }
            Answer::Allocated {
                alloc, span, rung, ..
            } if by_pointer(rung)
                && !self.config.limit.admits(span)
                && !self.mutated(Mutation::IgnoreImportLimit) =>
            {
                self.actions.push_back(ParentAction::FreeResult {
                    worker,
                    job,
                    request,
                    alloc,
                });
                Answer::Refused {
                    code: ErrorCode::OVER_IMPORT_LIMIT,
                    message: format!(
                        "the allocation of {} bytes at {:#x} is above the pointer import limit",
                        span.bytes, span.ptr
                    ),
                }
            }
            Answer::Allocated { alloc, span, .. } if span.bytes < byte_len => {
                self.actions.push_back(ParentAction::FreeResult {
                    worker,
                    job,
                    request,
                    alloc,
                });
                Answer::Refused {
                    code: ErrorCode::INTERNAL,
                    message: format!(
                        "the parent allocated {} bytes for a result of {}",
                        span.bytes, byte_len
                    ),
                }
            }
            allocated @ Answer::Allocated { .. } => allocated,
            Answer::Refused { .. } if j.cancelled => Answer::cancelled(),
            refused @ Answer::Refused { .. } => refused,
        };
        self.ledger.answer(request, answer);
        if reaped {
            self.finish_abandoned(worker, job);
        } else {
            self.grant_if_answered(worker, job, now);
        }
        Ok(())
    }

    /// Once every request of the job's pending message is answered, and the worker is
    /// connected: RECORD READY (if a pointer is granted), then the `AllocationGrant`.
    pub(super) fn grant_if_answered(&mut self, worker: WorkerId, job: JobId, now: Timestamp) {
        if !self.connected(worker) {
            return;
        }
        let Some(answers) = self.ledger.take_answered(worker, job) else {
            return;
        };
        let Some(j) = self.ledger.job(worker, job) else {
            return;
        };
        let ready_event = j.ready_event;
        if answers
            .iter()
            .any(|(_, a)| matches!(a, Answer::Allocated { .. }))
        {
            self.progress(worker, job, now);
        } else if !answers.is_empty() {
            self.idle(worker, job, "a result request refused whole");
        }
        let mut results = Vec::with_capacity(answers.len());
        let mut any_pointer = false;
        for (request, answer) in answers {
            match answer {
                Answer::Allocated {
                    alloc,
                    span,
                    rung,
                    pool,
                    export,
                    arena,
                } => {
                    let pointer = by_pointer(rung);
                    any_pointer |= pointer;
                    let handle = self.ledger.lend(
                        worker,
                        job,
                        Terms {
                            alloc,
                            span,
                            rung,
                            purpose: Purpose::Result { request },
                            read_only: false,
                        },
                    );
                    results.push(match arena {
                        // No READY: the facade hands out a block only once every earlier use
                        // of it completed on the GPU (its return waited on an event).
                        Some((chunk, offset)) => ResultGrant::Arena {
                            handle,
                            alloc,
                            chunk,
                            offset,
                            bytes: span.bytes,
                        },
                        None => ResultGrant::Granted {
                            handle,
                            alloc,
                            rung,
                            pool: if pointer { pool } else { 0 },
                            export: if pointer { export } else { ZERO_EXPORT },
                            ready_event: if pointer { ready_event } else { ZERO_EVENT },
                        },
                    });
                }
                Answer::Refused { code, mut message } => {
                    cut_text(&mut message, MAX_REFUSAL_TEXT_LEN);
                    results.push(ResultGrant::Refused { code, message });
                }
            }
        }
        if any_pointer {
            self.actions
                .push_back(ParentAction::RecordReady { worker, job });
        }
        self.actions.push_back(ParentAction::Send {
            worker,
            message: Message::AllocationGrant(AllocationGrant { job, results }),
        });
    }

    /// The answers already given to `job`'s pending result request become cancelled
    /// refusals; what was allocated for them is the caller's to free (never offered).
    pub(super) fn refuse_answered(&mut self, worker: WorkerId, job: JobId) {
        for (request, alloc) in self.ledger.refuse_answered(worker, job) {
            self.actions.push_back(ParentAction::FreeResult {
                worker,
                job,
                request,
                alloc,
            });
        }
    }
}

/// Cuts `text` to at most `max` bytes, on a character boundary.
fn cut_text(text: &mut String, max: usize) {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}
