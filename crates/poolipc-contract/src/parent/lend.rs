//! Lending: a job's inputs (and its arena slice) as the facade placed them
//! ([`InputLoan`], [`SliceLoan`]), checked and sent in one `Lend`; and cancelling a job.

use std::collections::BTreeMap;

use crate::error::ContractError;
use crate::message::{ArenaLocation, Lend, LentSlice, LentTensor, Message, TensorMeta};
use crate::mutation::Mutation;
use crate::types::{
    AllocId, EventBlob, ExportBlob, HandoffId, JobId, Purpose, Rung, Span, Timestamp, WorkerId,
    ZERO_EVENT, ZERO_EXPORT, by_pointer, ready_gated, staged,
};

use super::ledger::Terms;
use super::{Parent, ParentAction};

#[cfg(doc)]
use {
    super::{FailReason, JobOutcome},
    crate::types::Outcome,
    poolipc_types::ARENA_ALIGN,
};

/// One input of a job, as the facade placed it on a rung.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputLoan {
    /// The allocation the tensor lives in (pool pointer), the id the facade gave the source
    /// (host staging), or the id it gave the arena block holding the copy (arena copy).
    pub alloc: AllocId,
    /// The allocation's range (pool pointer: checked against the import limit), the
    /// source's (host staging), or the arena block's (arena copy).
    pub span: Span,
    /// The rung it travels on.
    pub rung: Rung,
    /// Which of the parent's pools the allocation comes from (0 on host staging).
    pub pool: u8,
    /// The pointer export; zero for host staging.
    pub export: ExportBlob,
    /// The tensor's layout over the allocation (arena copy: over the block).
    pub meta: TensorMeta,
    /// [`Rung::ArenaCopy`] only: where the block the facade copied the tensor into lies. The
    /// facade queued the copy on the job's stream before the job's READY is recorded, and
    /// gives the block back only at the input's [`ParentAction::Release`] (after a
    /// [`ParentAction::WaitDone`] on the worker's DONE, or once the worker was reaped).
    pub arena: Option<ArenaLocation>,
    /// The caller said the worker only reads it (carried in the `Lend`). When false and the
    /// input crossed by a copy, its bytes come back: host staging by a
    /// [`ParentAction::ReceiveStaged`] after the worker's `Done`; arena copy by the facade's
    /// copy out of the block at the input's [`ParentAction::Release`] with
    /// [`Outcome::Completed`] or [`Outcome::Cancelled`].
    pub read_only: bool,
}

/// A job's arena slice, as the facade allocated it (protocol 6): a block of the result arena
/// the worker may carve results out of without asking. See [`Parent::start_job_with_slice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceLoan {
    /// A fresh id for the block.
    pub alloc: AllocId,
    /// The block in the parent's address space: `[ptr, ptr + bytes)`; `bytes` non-zero.
    pub span: Span,
    /// The arena chunk's index (announced to the worker before the `Lend` goes out).
    pub chunk: u32,
    /// Bytes from the chunk's start.
    pub offset: u64,
}

impl Parent {
    /// Starts `job` on `worker`: one `Lend` with every input, in order.
    ///
    /// All-or-nothing: every input is checked first (a pool-pointer input must be admitted
    /// by the import limit; an arena-copy input must name its block, and only it may; an
    /// allocation already lent must have the same range); on error nothing is queued and
    /// nothing changes. Then queues [`ParentAction::RecordReady`] (only if some input goes by
    /// pool pointer or arena copy), `Send(Lend)` (fresh handles in input order; `ready_event`
    /// on pool-pointer and arena-copy items, zero blobs on staged ones), then
    /// [`ParentAction::SendStaged`] for each host-staged input, in order. A job with no
    /// inputs still sends its (empty) `Lend`.
    ///
    /// `ready_event` is the blob of the READY event the facade records for THIS job: two
    /// jobs in flight on one worker must not share one, since the worker's wait captures
    /// the event's latest record. Every pool-pointer item of the job's `Lend` and of its
    /// `AllocationGrant`s carries it.
    ///
    /// Returns the handles of the inputs, in order.
    ///
    /// # Errors
    /// The worker is unknown ([`ContractError::UnknownWorker`]), gone or stopping
    /// ([`ContractError::WorkerGone`]); the parent is shutting down; the job is open
    /// already ([`ContractError::JobExists`]); an input is above the limit
    /// ([`ContractError::AboveImportLimit`]), on a rung that cannot carry an input or
    /// without the arena location its rung needs ([`ContractError::RungNotAllowed`]), or
    /// known with another range ([`ContractError::AllocationMismatch`]).
    pub fn start_job(
        &mut self,
        worker: WorkerId,
        job: JobId,
        ready_event: EventBlob,
        inputs: Vec<InputLoan>,
        now: Timestamp,
    ) -> Result<Vec<HandoffId>, ContractError> {
        self.start_job_with_slice(worker, job, ready_event, inputs, None, now)
            .map(|(inputs, _)| inputs)
    }

    /// [`Parent::start_job`], with the job's arena slice (protocol 6) when `slice` is given:
    /// one more handoff, after the inputs, carried in the `Lend`'s `slice`. Like an arena
    /// result it needs no READY and is DONE-gated: it comes back with
    /// [`ParentAction::ReleaseSlice`] after the job's `Ack` and a wait on its DONE, or once
    /// the worker was reaped. The worker names what it carved in its `Done`; a carve outside
    /// the slice, not aligned to [`ARENA_ALIGN`], overlapping another, of zero bytes or not
    /// the dense size of its shape, or one whose place among the results is out of range or
    /// taken, condemns that worker (a protocol violation), like a lying `ResultSpec`.
    ///
    /// Returns the handles of the inputs, in order, and the slice's.
    ///
    /// # Errors
    /// Those of [`Parent::start_job`]; and [`ContractError::AllocationMismatch`] for a slice
    /// of zero bytes or whose allocation id is in use (lent, or an input of this job).
    pub fn start_job_with_slice(
        &mut self,
        worker: WorkerId,
        job: JobId,
        ready_event: EventBlob,
        inputs: Vec<InputLoan>,
        slice: Option<SliceLoan>,
        now: Timestamp,
    ) -> Result<(Vec<HandoffId>, Option<HandoffId>), ContractError> {
        self.check_takes_work(worker)?;
        if self.ledger.job(worker, job).is_some() {
            return Err(ContractError::JobExists(job));
        }
        let mut spans: BTreeMap<AllocId, Span> = BTreeMap::new();
        for input in &inputs {
            let (alloc, span) = (input.alloc, input.span);
            if input.rung == Rung::Arena {
                return Err(ContractError::RungNotAllowed {
                    rung: input.rung,
                    what: "a lent input",
                });
            }
            if (input.rung == Rung::ArenaCopy) != input.arena.is_some() {
                return Err(ContractError::RungNotAllowed {
                    rung: input.rung,
                    what: if input.arena.is_some() {
                        "an input with an arena location"
                    } else {
                        "an input without its arena location"
                    },
                });
            }
            if by_pointer(input.rung)
                && !self.config.limit.admits(span)
                && !self.mutated(Mutation::IgnoreImportLimit)
            {
                return Err(ContractError::AboveImportLimit { alloc, span });
            }
            let known = self
                .ledger
                .lent_span(alloc)
                .or_else(|| spans.get(&alloc).copied());
            if known.is_some_and(|s| s != span) || self.ledger.is_unoffered(alloc) {
                return Err(ContractError::AllocationMismatch { alloc });
            }
            spans.insert(alloc, span);
        }
        if let Some(sl) = &slice
            && (sl.span.bytes == 0
                || self.ledger.lent_span(sl.alloc).is_some()
                || self.ledger.is_unoffered(sl.alloc)
                || spans.contains_key(&sl.alloc))
        {
            return Err(ContractError::AllocationMismatch { alloc: sl.alloc });
        }
        self.ledger.open_job(
            worker,
            job,
            ready_event,
            now.saturating_add(self.config.handoff_timeout),
            now.saturating_add(self.config.max_job_lifetime),
        );
        let mut handoffs = Vec::with_capacity(inputs.len());
        let mut tensors = Vec::with_capacity(inputs.len());
        let mut staged_inputs = Vec::new();
        let mut any_ready = false;
        for input in inputs {
            let pointer = by_pointer(input.rung);
            let ready = ready_gated(input.rung);
            any_ready |= ready;
            let handle = self.ledger.lend(
                worker,
                job,
                Terms {
                    alloc: input.alloc,
                    span: input.span,
                    rung: input.rung,
                    purpose: Purpose::Input,
                    read_only: input.read_only,
                },
            );
            if staged(input.rung) {
                staged_inputs.push(handle);
            }
            handoffs.push(handle);
            tensors.push(LentTensor {
                handle,
                alloc: input.alloc,
                rung: input.rung,
                pool: if pointer { input.pool } else { 0 },
                export: if pointer { input.export } else { ZERO_EXPORT },
                ready_event: if ready { ready_event } else { ZERO_EVENT },
                meta: input.meta,
                arena: input.arena,
                read_only: input.read_only,
            });
        }
        let lent_slice = slice.map(|sl| {
            // No READY: like an arena result, the facade hands out a block only once every
            // earlier use of it completed on the GPU.
            let handle = self.ledger.lend(
                worker,
                job,
                Terms {
                    alloc: sl.alloc,
                    span: sl.span,
                    rung: Rung::Arena,
                    purpose: Purpose::Slice,
                    read_only: false,
                },
            );
            LentSlice {
                handle,
                alloc: sl.alloc,
                chunk: sl.chunk,
                offset: sl.offset,
                bytes: sl.span.bytes,
            }
        });
        if any_ready {
            self.actions
                .push_back(ParentAction::RecordReady { worker, job });
        }
        self.actions.push_back(ParentAction::Send {
            worker,
            message: Message::Lend(Lend {
                job,
                tensors,
                slice: lent_slice,
            }),
        });
        for handoff in staged_inputs {
            self.actions.push_back(ParentAction::SendStaged {
                worker,
                job,
                handoff,
            });
        }
        self.check_in_tests();
        Ok((handoffs, lent_slice.map(|s| s.handle)))
    }

    /// Cancels `job` on `worker`: `Send(Cancel)`. The worker still finishes the job (Done,
    /// Ack); its handoffs are released as [`Outcome::Cancelled`] and it ends
    /// [`JobOutcome::Failed`] with [`FailReason::Cancelled`]. Result requests of the job are
    /// declined: those not answered yet become `Refused { CANCELLED }` when answered, those
    /// answered and not granted are freed now. Cancelling twice is a no-op.
    ///
    /// The worker has [`ParentConfig::cancel_grace`](super::ParentConfig::cancel_grace) from
    /// `now` to finish the job; past it, it is condemned ([`ParentAction::KillWorker`]) and
    /// the job fails with [`FailReason::Cancelled`] once the worker is reaped.
    ///
    /// # Errors
    /// The worker is unknown or not connected, or the job is not open on it.
    pub fn cancel(
        &mut self,
        worker: WorkerId,
        job: JobId,
        now: Timestamp,
    ) -> Result<(), ContractError> {
        if self.ledger.peer(worker).is_none() {
            return Err(ContractError::UnknownWorker(worker));
        }
        if !self.connected(worker) {
            return Err(ContractError::WorkerGone(worker));
        }
        let Some(j) = self.ledger.job_mut(worker, job) else {
            return Err(ContractError::UnknownJob(job));
        };
        if j.cancelled {
            return Ok(());
        }
        j.cancelled = true;
        j.cancel_by = Some(now.saturating_add(self.config.cancel_grace));
        self.actions.push_back(ParentAction::Send {
            worker,
            message: Message::Cancel { job },
        });
        self.refuse_answered(worker, job);
        self.check_in_tests();
        Ok(())
    }
}
