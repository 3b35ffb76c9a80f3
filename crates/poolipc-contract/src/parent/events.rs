//! What the parent machine is told from outside ([`ParentEvent`]), and where each event
//! goes: [`Parent::handle`] hands the worker's messages, the facade's answers to result
//! requests, and hang-ups and reaping to their handlers.

use crate::error::ContractError;
use crate::message::{ErrorCode, Message};
use crate::types::{
    AllocId, ExportBlob, JobId, RequestId, Rung, Span, Timestamp, WorkerId, ZERO_EXPORT,
};

use super::Parent;
use super::ledger::Answer;

#[cfg(doc)]
use super::ParentAction;

/// Something from outside for the parent machine.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParentEvent {
    /// Any message the worker sent after the handshake (the facade passes every one, except
    /// the host-staging frames it consumes inside [`ParentAction::SendStaged`] and
    /// [`ParentAction::ReceiveStaged`]).
    Received {
        /// The sender.
        worker: WorkerId,
        /// The message.
        message: Message,
    },
    /// The answer to [`ParentAction::AllocateResult`]: allocated.
    ResultAllocated {
        /// The worker that asked.
        worker: WorkerId,
        /// The request answered.
        request: RequestId,
        /// The new allocation, a fresh id.
        alloc: AllocId,
        /// The allocation: `[ptr, ptr + bytes)`.
        span: Span,
        /// The rung the facade chose for it.
        rung: Rung,
        /// Which of the parent's pools it comes from (0 on host staging).
        pool: u8,
        /// Pool pointer: the allocation's export. Host staging: zero.
        export: ExportBlob,
    },
    /// The answer to [`ParentAction::AllocateResult`]: allocated as a block of the result
    /// arena (the [`Rung::Arena`] rung). The grant names the block by `(chunk, offset,
    /// span.bytes)`; there is no export, no import and no import limit. The block is
    /// released ([`ParentAction::Release`]) only after a [`ParentAction::WaitDone`] on the
    /// worker's DONE for the job, or once the worker was reaped: only then may the facade
    /// reuse it.
    ResultAllocatedInArena {
        /// The worker that asked.
        worker: WorkerId,
        /// The request answered.
        request: RequestId,
        /// A fresh id for the block.
        alloc: AllocId,
        /// The block in the parent's address space: `[ptr, ptr + bytes)`.
        span: Span,
        /// The arena chunk's index (announced to the worker before the grant goes out).
        chunk: u32,
        /// Bytes from the chunk's start.
        offset: u64,
    },
    /// The answer to [`ParentAction::AllocateResult`]: not allocated.
    ResultDeclined {
        /// The worker that asked.
        worker: WorkerId,
        /// The request answered.
        request: RequestId,
        /// Why, for the worker's code.
        code: ErrorCode,
        /// Why, for a person.
        message: String,
    },
    /// EOF or a broken connection (`why` says which). The process may still run and hold
    /// imports: nothing is released until [`ParentEvent::WorkerReaped`].
    WorkerHungUp {
        /// The worker.
        worker: WorkerId,
        /// What was seen.
        why: String,
    },
    /// The process has been waited for: the driver dropped its imports.
    WorkerReaped {
        /// The worker.
        worker: WorkerId,
    },
}

impl Parent {
    /// An input from outside.
    ///
    /// A worker's misbehaviour is not an error: it condemns the worker (see [`Parent`]).
    /// Messages from a condemned or reaped worker are ignored.
    ///
    /// # Errors
    /// The facade's own mistakes: an unknown worker; an answer to a request that is not
    /// pending ([`ContractError::UnknownRequest`]) or with an allocation id that is live
    /// ([`ContractError::AllocationMismatch`]). Nothing changes then.
    pub fn handle(&mut self, event: ParentEvent, now: Timestamp) -> Result<(), ContractError> {
        let handled = match event {
            ParentEvent::Received { worker, message } => self.on_message(worker, message, now),
            ParentEvent::ResultAllocated { rung, .. } if rung == Rung::Arena => {
                Err(ContractError::RungNotAllowed {
                    rung,
                    what: "a result allocation without its arena location",
                })
            }
            ParentEvent::ResultAllocated { rung, .. } if rung == Rung::ArenaCopy => {
                Err(ContractError::RungNotAllowed {
                    rung,
                    what: "a result allocation",
                })
            }
            ParentEvent::ResultAllocated {
                worker,
                request,
                alloc,
                span,
                rung,
                pool,
                export,
            } => self.on_answer(
                worker,
                request,
                Answer::Allocated {
                    alloc,
                    span,
                    rung,
                    pool,
                    export,
                    arena: None,
                },
                now,
            ),
            ParentEvent::ResultAllocatedInArena {
                worker,
                request,
                alloc,
                span,
                chunk,
                offset,
            } => self.on_answer(
                worker,
                request,
                Answer::Allocated {
                    alloc,
                    span,
                    rung: Rung::Arena,
                    pool: 0,
                    export: ZERO_EXPORT,
                    arena: Some((chunk, offset)),
                },
                now,
            ),
            ParentEvent::ResultDeclined {
                worker,
                request,
                code,
                message,
            } => self.on_answer(worker, request, Answer::Refused { code, message }, now),
            ParentEvent::WorkerHungUp { worker, why } => self.on_hung_up(worker, &why),
            ParentEvent::WorkerReaped { worker } => self.on_reaped(worker),
        };
        self.check_shutdown_complete();
        self.check_in_tests();
        handled
    }

    fn on_message(
        &mut self,
        worker: WorkerId,
        message: Message,
        now: Timestamp,
    ) -> Result<(), ContractError> {
        if self.ledger.peer(worker).is_none() {
            return Err(ContractError::UnknownWorker(worker));
        }
        if !self.connected(worker) {
            return Ok(());
        }
        match message {
            Message::ResultRequest(r) => self.on_result_request(worker, r, now),
            Message::Done(d) => self.on_done(worker, d, now),
            Message::Ack(a) => self.on_ack(worker, a),
            Message::JobError { job, message } => match self.ledger.job_mut(worker, job) {
                Some(j) if j.error.is_none() => {
                    j.error = Some(crate::text::worker_text(&message));
                    self.progress(worker, job, now);
                }
                Some(_) => self.idle(worker, job, "a repeated JobError"),
                None => self.violation(worker, format!("a JobError for {job}, which is not open")),
            },
            Message::Heartbeat { .. } => {
                if self.ledger.peer(worker).is_some_and(|p| p.long_jobs) {
                    let open: Vec<JobId> = self
                        .ledger
                        .peer(worker)
                        .map(|p| p.jobs.iter().copied().collect())
                        .unwrap_or_default();
                    for job in open {
                        if self.ledger.job(worker, job).is_some_and(|j| !j.cancelled) {
                            self.progress(worker, job, now);
                        }
                    }
                }
            }
            Message::Error { code, message } => {
                let message = crate::text::worker_text(&message);
                self.violation(worker, format!("the worker reported: {code}: {message}"));
            }
            other => {
                self.violation(
                    worker,
                    format!("unexpected {} from the worker", other.kind()),
                );
            }
        }
        Ok(())
    }
}
