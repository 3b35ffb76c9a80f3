//! The worker's side of the contract, at job granularity: imports each allocation once
//! (refcounted), waits on READY before a job's memory is usable, receives host-staged
//! inputs, and on finishing a job frees its imports (stream ordered), records DONE, sends
//! `Done`, pushes staged results, then sends `Ack`.

use std::collections::{BTreeMap, VecDeque};

use crate::error::ContractError;
use crate::message::{
    Ack, AllocationGrant, CarvedResult, Done, Lend, LentSlice, LentTensor, MAX_TEXT_LEN, Message,
    ResultGrant, ResultRequest, ResultSpec, TensorMeta,
};
use crate::mutation::Mutation;
use crate::types::{
    AllocId, EventBlob, ExportBlob, HandoffId, JobId, Rung, Timestamp, by_pointer, ready_gated,
    staged,
};

/// Work the worker machine asks of the worker's facade, in the order it must be done.
///
/// Not `#[non_exhaustive]`: the facade matches every variant.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum WorkerAction {
    /// Import the allocation's pointer from this export. Only for the first handoff of an
    /// allocation this worker does not hold already; later ones share the import
    /// (refcounted, [`crate::Invariant::OneImportPerAllocation`]).
    Import {
        /// The job.
        job: JobId,
        /// The handoff that brought it.
        handoff: HandoffId,
        /// The allocation.
        alloc: AllocId,
        /// Which of the parent's pools it comes from.
        pool: u8,
        /// The pointer export.
        export: ExportBlob,
    },
    /// Make the worker's stream wait on this READY event. Once per `Lend` or
    /// `AllocationGrant` with pool-pointer or arena-copy items, after their imports.
    WaitReady {
        /// The job.
        job: JobId,
        /// The event the parent recorded for the job.
        ready_event: EventBlob,
    },
    /// A host-staged input: its bytes follow the `Lend` on the wire; receive them now.
    ReceiveStaged {
        /// The job.
        job: JobId,
        /// The staged input.
        handoff: HandoffId,
        /// Its layout.
        meta: TensorMeta,
    },
    /// The job's inputs are usable (after their imports, wait and receives). When its last
    /// access is queued, call [`Worker::finish_job`].
    JobStarted {
        /// The job.
        job: JobId,
        /// Its inputs, as lent.
        inputs: Vec<LentTensor>,
        /// Its arena slice, if the parent lent one: results may be carved out of it
        /// ([`Worker::carve_results`]). Writable without a wait (no READY, like an arena
        /// result).
        slice: Option<LentSlice>,
    },
    /// The granted results are writable (after their imports and wait).
    ResultsGranted {
        /// The job.
        job: JobId,
        /// One per requested result, in request order.
        results: Vec<ResultGrant>,
    },
    /// Free the import of the allocation, stream ordered: no handoff of this worker uses it
    /// any more.
    Unimport {
        /// The allocation.
        alloc: AllocId,
    },
    /// Record the worker's DONE event on its stream: after the job's last access and the
    /// frees.
    RecordDone {
        /// The job.
        job: JobId,
    },
    /// Send this message to the parent, unchanged.
    Send(Message),
    /// A host-staged result's bytes, or a host-staged input's lent writable (copy-back,
    /// protocol 7): push them now, right after the `Done` that names it, in its order.
    SendStaged {
        /// The job.
        job: JobId,
        /// The staged result or writable staged input.
        handoff: HandoffId,
    },
    /// The parent cancelled the job: stop, and finish it ([`Worker::finish_job`]).
    Cancelled {
        /// The job.
        job: JobId,
    },
    /// The parent said `Bye`: finish the open jobs and exit.
    Stop,
}

#[derive(Clone, Copy, Debug)]
struct Held {
    handoff: HandoffId,
    alloc: AllocId,
    rung: Rung,
    /// Whether its bytes go back to the parent after the `Done` when it is host-staged: a
    /// result, or an input not lent read-only (copy-back, protocol 7).
    sent_back: bool,
}

#[derive(Clone, Debug, Default)]
struct OpenJob {
    /// Inputs in `Lend` order, the slice, then results in grant order.
    held: Vec<Held>,
    /// Results requested and not granted yet.
    pending: Option<usize>,
    cancelled: bool,
    /// The slice's length and where its free tail starts.
    slice: Option<(u64, u64)>,
    /// What was carved out of the slice, in carve order.
    carved: Vec<CarvedResult>,
    /// Results carved or granted so far: the next result's place.
    results: u32,
}

/// The worker's side of the ownership contract.
///
/// Sans-IO: [`Worker::handle`] takes the parent's messages; [`Worker::request_results`],
/// [`Worker::fail_job`] and [`Worker::finish_job`] the worker's decisions;
/// [`Worker::poll_action`] gives what to do. Several jobs may be open at once (a `Lend`
/// may arrive while an earlier job waits for its grant); the facade runs them one at a
/// time, in the order of their [`WorkerAction::JobStarted`].
#[derive(Debug, Default)]
pub struct Worker {
    imports: BTreeMap<AllocId, u32>,
    jobs: BTreeMap<JobId, OpenJob>,
    newest: Option<HandoffId>,
    stopping: bool,
    /// Heartbeats sent so far (each one's `seq`).
    heartbeats: u64,
    actions: VecDeque<WorkerAction>,
    #[cfg(test)]
    pub(crate) mutation: Option<Mutation>,
}

impl Worker {
    /// A worker holding nothing.
    #[must_use]
    pub fn new() -> Worker {
        Worker::default()
    }

    #[cfg(test)]
    pub(crate) fn with_mutation(mutation: Option<Mutation>) -> Worker {
        Worker {
            mutation,
            ..Worker::default()
        }
    }

    #[cfg(test)]
    fn mutated(&self, m: Mutation) -> bool {
        self.mutation == Some(m)
    }

    #[cfg(not(test))]
    #[allow(clippy::unused_self)] // the test build reads `self`
    fn mutated(&self, _: Mutation) -> bool {
        false
    }

    /// The next action to carry out, if any.
    pub fn poll_action(&mut self) -> Option<WorkerAction> {
        self.actions.pop_front()
    }

    /// The action [`poll_action`](Worker::poll_action) would return next, left queued (a
    /// worker that sends DONE looks whether the ACK follows, to write both at once).
    #[must_use]
    pub fn peek_action(&self) -> Option<&WorkerAction> {
        self.actions.front()
    }

    /// Handoffs held: of open jobs, inputs and granted results.
    #[must_use]
    pub fn held(&self) -> usize {
        self.jobs.values().map(|j| j.held.len()).sum()
    }

    /// Live driver imports, and the handoffs counted on each.
    pub fn imports(&self) -> impl Iterator<Item = (AllocId, u32)> + '_ {
        self.imports.iter().map(|(a, n)| (*a, *n))
    }

    /// Open jobs, in id order.
    pub fn jobs(&self) -> impl Iterator<Item = JobId> + '_ {
        self.jobs.keys().copied()
    }

    /// Whether the parent said `Bye`.
    #[must_use]
    pub fn is_stopping(&self) -> bool {
        self.stopping
    }

    /// A message from the parent: every one after the handshake except the setup and
    /// staging frames the facade consumes itself (`StagingBuffer`, `Chunk`, `StagingReady`,
    /// `ExtraPool`).
    ///
    /// # Errors
    /// A `Lend` for a job open already ([`ContractError::JobExists`]); a handle not newer
    /// than one seen ([`ContractError::StaleHandle`]: duplicated or reordered); a grant that
    /// answers no pending request of an open job; any message the parent does not send here
    /// ([`ContractError::Unexpected`]). Nothing is imported then and nothing changes.
    pub fn handle(&mut self, message: Message, _now: Timestamp) -> Result<(), ContractError> {
        match message {
            Message::Lend(lend) => self.on_lend(lend),
            Message::AllocationGrant(grant) => self.on_grant(grant),
            Message::Cancel { job } => {
                if let Some(j) = self.jobs.get_mut(&job)
                    && !j.cancelled
                {
                    j.cancelled = true;
                    self.actions.push_back(WorkerAction::Cancelled { job });
                }
                Ok(())
            }
            Message::Bye => {
                if !self.stopping {
                    self.stopping = true;
                    self.actions.push_back(WorkerAction::Stop);
                }
                Ok(())
            }
            Message::Heartbeat { .. } => Ok(()),
            other => Err(ContractError::Unexpected(other.kind())),
        }
    }

    /// Checks that `handles` are newer than any seen and increasing.
    fn check_fresh(&self, handles: impl Iterator<Item = HandoffId>) -> Result<(), ContractError> {
        let mut newest = self.newest;
        for h in handles {
            if newest.is_some_and(|n| h <= n) {
                return Err(ContractError::StaleHandle(h));
            }
            newest = Some(h);
        }
        Ok(())
    }

    /// One reference on `alloc`; the driver import only for the first.
    fn import(
        &mut self,
        job: JobId,
        handoff: HandoffId,
        alloc: AllocId,
        pool: u8,
        export: ExportBlob,
    ) {
        let every = self.mutated(Mutation::ImportEveryOffer);
        let refs = self.imports.entry(alloc).or_insert(0);
        if *refs == 0 || every {
            self.actions.push_back(WorkerAction::Import {
                job,
                handoff,
                alloc,
                pool,
                export,
            });
        }
        *refs += 1;
    }

    /// WAIT READY once per distinct event (once, for a parent that keeps the contract).
    fn wait_ready(&mut self, job: JobId, events: Vec<EventBlob>) {
        if self.mutated(Mutation::UseBeforeReady) {
            return;
        }
        let mut waited: Vec<EventBlob> = Vec::new();
        for ready_event in events {
            if !waited.contains(&ready_event) {
                waited.push(ready_event);
                self.actions
                    .push_back(WorkerAction::WaitReady { job, ready_event });
            }
        }
    }

    fn on_lend(&mut self, lend: Lend) -> Result<(), ContractError> {
        let Lend {
            job,
            tensors,
            slice,
        } = lend;
        if self.jobs.contains_key(&job) {
            return Err(ContractError::JobExists(job));
        }
        if let Some(t) = tensors.iter().find(|t| t.rung == Rung::Arena) {
            return Err(ContractError::RungNotAllowed {
                rung: t.rung,
                what: "a lent input",
            });
        }
        if let Some(t) = tensors
            .iter()
            .find(|t| (t.rung == Rung::ArenaCopy) != t.arena.is_some())
        {
            return Err(ContractError::RungNotAllowed {
                rung: t.rung,
                what: if t.arena.is_some() {
                    "a lent input with an arena location"
                } else {
                    "a lent input without its arena location"
                },
            });
        }
        self.check_fresh(
            tensors
                .iter()
                .map(|t| t.handle)
                .chain(slice.map(|s| s.handle)),
        )?;
        if let Some(last) = tensors.last() {
            self.newest = Some(last.handle);
        }
        let mut open = OpenJob::default();
        if let Some(sl) = &slice {
            self.newest = Some(sl.handle);
            open.slice = Some((sl.bytes, 0));
        }
        let mut events = Vec::new();
        for t in &tensors {
            if by_pointer(t.rung) {
                self.import(job, t.handle, t.alloc, t.pool, t.export);
            }
            if ready_gated(t.rung) {
                events.push(t.ready_event);
            }
            open.held.push(Held {
                handoff: t.handle,
                alloc: t.alloc,
                rung: t.rung,
                sent_back: !t.read_only,
            });
        }
        if let Some(sl) = &slice {
            open.held.push(Held {
                handoff: sl.handle,
                alloc: sl.alloc,
                rung: Rung::Arena,
                sent_back: false,
            });
        }
        self.wait_ready(job, events);
        for t in &tensors {
            if staged(t.rung) {
                self.actions.push_back(WorkerAction::ReceiveStaged {
                    job,
                    handoff: t.handle,
                    meta: t.meta.clone(),
                });
            }
        }
        self.jobs.insert(job, open);
        self.actions.push_back(WorkerAction::JobStarted {
            job,
            inputs: tensors,
            slice,
        });
        Ok(())
    }

    fn on_grant(&mut self, grant: AllocationGrant) -> Result<(), ContractError> {
        let AllocationGrant { job, results } = grant;
        let answers = self
            .jobs
            .get(&job)
            .is_some_and(|j| j.pending == Some(results.len()));
        if !answers {
            return Err(ContractError::GrantMismatch(job));
        }
        if results.iter().any(|g| {
            matches!(
                g,
                ResultGrant::Granted {
                    rung: Rung::Arena,
                    ..
                }
            )
        }) {
            return Err(ContractError::RungNotAllowed {
                rung: Rung::Arena,
                what: "a grant without its arena location",
            });
        }
        if results.iter().any(|g| {
            matches!(
                g,
                ResultGrant::Granted {
                    rung: Rung::ArenaCopy,
                    ..
                }
            )
        }) {
            return Err(ContractError::RungNotAllowed {
                rung: Rung::ArenaCopy,
                what: "a result grant",
            });
        }
        // Arena grants: no export, no READY (the zero blobs stand in; nothing uses them).
        let zero_export = ExportBlob([0; 64]);
        let zero_event = EventBlob([0; 64]);
        let granted = || {
            results.iter().filter_map(|g| match g {
                ResultGrant::Granted {
                    handle,
                    alloc,
                    rung,
                    pool,
                    export,
                    ready_event,
                } => Some((*handle, *alloc, *rung, *pool, *export, *ready_event)),
                ResultGrant::Arena { handle, alloc, .. } => {
                    Some((*handle, *alloc, Rung::Arena, 0, zero_export, zero_event))
                }
                ResultGrant::Refused { .. } => None,
            })
        };
        self.check_fresh(granted().map(|g| g.0))?;
        let mut held = Vec::new();
        let mut events = Vec::new();
        for (handoff, alloc, rung, pool, export, ready_event) in granted() {
            self.newest = Some(handoff);
            if by_pointer(rung) {
                self.import(job, handoff, alloc, pool, export);
                events.push(ready_event);
            }
            held.push(Held {
                handoff,
                alloc,
                rung,
                sent_back: true,
            });
        }
        self.wait_ready(job, events);
        if let Some(j) = self.jobs.get_mut(&job) {
            j.pending = None;
            let granted = u32::try_from(held.len()).unwrap_or(u32::MAX);
            j.results = j.results.saturating_add(granted);
            j.held.extend(held);
        }
        self.actions
            .push_back(WorkerAction::ResultsGranted { job, results });
        Ok(())
    }

    /// Asks the parent for the job's results' memory, shape first: `Send(ResultRequest)`.
    /// The answer comes as [`WorkerAction::ResultsGranted`].
    ///
    /// # Errors
    /// The job is not open; a request of it is not answered yet; a spec's `byte_len` is not
    /// the dense size of its shape and dtype (the parent would condemn the worker for it).
    pub fn request_results(
        &mut self,
        job: JobId,
        specs: Vec<ResultSpec>,
    ) -> Result<(), ContractError> {
        let Some(j) = self.jobs.get(&job) else {
            return Err(ContractError::UnknownJob(job));
        };
        if j.pending.is_some() {
            return Err(ContractError::RequestPending(job));
        }
        for (index, spec) in specs.iter().enumerate() {
            if crate::types::dense_bytes(spec.dtype, &spec.shape) != Some(spec.byte_len) {
                return Err(ContractError::MalformedResult {
                    job,
                    index,
                    byte_len: spec.byte_len,
                });
            }
        }
        if let Some(j) = self.jobs.get_mut(&job) {
            j.pending = Some(specs.len());
        }
        self.actions
            .push_back(WorkerAction::Send(Message::ResultRequest(ResultRequest {
                job,
                results: specs,
            })));
        Ok(())
    }

    /// Carves every result of `specs` out of the job's arena slice, if they all fit in its
    /// free tail (bump allocation, each at an offset aligned to [`poolipc_types::ARENA_ALIGN`]):
    /// returns their offsets in the slice, in order, and they will be named in the job's
    /// `Done`. Carved results need no round trip and no wait: the slice is writable from the
    /// job's start. Returns `None`, changing nothing, when the job has no slice, was
    /// cancelled, or some result does not fit or is empty: ask with
    /// [`Worker::request_results`] then (a batch is carved whole or not at all, so results
    /// keep the order they were asked in).
    ///
    /// # Errors
    /// The job is not open; a request of it is not answered yet; a spec's `byte_len` is not
    /// the dense size of its shape and dtype.
    pub fn carve_results(
        &mut self,
        job: JobId,
        specs: &[ResultSpec],
    ) -> Result<Option<Vec<u64>>, ContractError> {
        let Some(j) = self.jobs.get(&job) else {
            return Err(ContractError::UnknownJob(job));
        };
        if j.pending.is_some() {
            return Err(ContractError::RequestPending(job));
        }
        for (index, spec) in specs.iter().enumerate() {
            if crate::types::dense_bytes(spec.dtype, &spec.shape) != Some(spec.byte_len) {
                return Err(ContractError::MalformedResult {
                    job,
                    index,
                    byte_len: spec.byte_len,
                });
            }
        }
        let Some((len, mut next)) = j.slice else {
            return Ok(None);
        };
        if j.cancelled || specs.is_empty() {
            return Ok(None);
        }
        let mut offsets = Vec::with_capacity(specs.len());
        for spec in specs {
            let Some(start) = next.checked_next_multiple_of(poolipc_types::ARENA_ALIGN) else {
                return Ok(None);
            };
            match start.checked_add(spec.byte_len) {
                Some(end) if spec.byte_len > 0 && end <= len => {
                    offsets.push(start);
                    next = end;
                }
                _ => return Ok(None),
            }
        }
        let Some(j) = self.jobs.get_mut(&job) else {
            return Err(ContractError::UnknownJob(job));
        };
        for (spec, &offset) in specs.iter().zip(&offsets) {
            j.carved.push(CarvedResult {
                index: j.results,
                offset,
                bytes: spec.byte_len,
                dtype: spec.dtype,
                shape: spec.shape.clone(),
            });
            j.results = j.results.saturating_add(1);
        }
        j.slice = Some((len, next));
        Ok(Some(offsets))
    }

    /// The worker's code failed on the job: `Send(JobError)` (the text cut to
    /// [`MAX_TEXT_LEN`] bytes). The job must still be finished ([`Worker::finish_job`]); it
    /// then ends with this text as its error.
    ///
    /// # Errors
    /// The job is not open.
    pub fn fail_job(&mut self, job: JobId, message: String) -> Result<(), ContractError> {
        if !self.jobs.contains_key(&job) {
            return Err(ContractError::UnknownJob(job));
        }
        let mut message = message;
        if message.len() > MAX_TEXT_LEN {
            let mut end = MAX_TEXT_LEN;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
        }
        self.actions
            .push_back(WorkerAction::Send(Message::JobError { job, message }));
        Ok(())
    }

    /// The worker's code is still computing on the open job `job`: `Send(Heartbeat)`. A
    /// parent takes it for progress on the worker's open jobs only when the worker declared
    /// long jobs (`Capabilities::LONG_JOBS`), and never past a job's lifetime; to any other
    /// parent it is a message without progress, so send one only when the job is long.
    ///
    /// # Errors
    /// The job is not open.
    pub fn heartbeat(&mut self, job: JobId) -> Result<(), ContractError> {
        if !self.jobs.contains_key(&job) {
            return Err(ContractError::UnknownJob(job));
        }
        self.heartbeats = self.heartbeats.wrapping_add(1);
        self.actions
            .push_back(WorkerAction::Send(Message::Heartbeat {
                seq: self.heartbeats,
            }));
        Ok(())
    }

    /// The worker's code queued its last access to the job's memory. In this order:
    /// [`WorkerAction::Unimport`] for every allocation whose last handoff is this job's
    /// (stream-ordered frees), [`WorkerAction::RecordDone`] (so the parent's wait on DONE
    /// covers the frees on the GPU timeline), `Send(Done)` naming every handoff of the job
    /// (inputs, then results; pointer and staged), [`WorkerAction::SendStaged`] for each
    /// staged input lent writable and each staged result, in that order, then `Send(Ack)` with the same handles.
    ///
    /// # Errors
    /// The job is not open, or its result request is not answered yet.
    pub fn finish_job(&mut self, job: JobId, done_event: EventBlob) -> Result<(), ContractError> {
        match self.jobs.get(&job) {
            None => return Err(ContractError::UnknownJob(job)),
            Some(j) if j.pending.is_some() => return Err(ContractError::RequestPending(job)),
            Some(_) => {}
        }
        let Some(open) = self.jobs.remove(&job) else {
            return Err(ContractError::UnknownJob(job));
        };
        let mut unimports = Vec::new();
        for h in open.held.iter().filter(|h| by_pointer(h.rung)) {
            if let Some(refs) = self.imports.get_mut(&h.alloc) {
                *refs = refs.saturating_sub(1);
                if *refs == 0 {
                    self.imports.remove(&h.alloc);
                    unimports.push(WorkerAction::Unimport { alloc: h.alloc });
                }
            }
        }
        let ack_first = self.mutated(Mutation::AckBeforeUnimport);
        if !ack_first {
            self.actions.extend(unimports.drain(..));
        }
        let handles: Vec<HandoffId> = open.held.iter().map(|h| h.handoff).collect();
        self.actions.push_back(WorkerAction::RecordDone { job });
        self.actions
            .push_back(WorkerAction::Send(Message::Done(Done {
                job,
                done_event,
                handles: handles.clone(),
                carved: open.carved.clone(),
            })));
        for h in open.held.iter().filter(|h| h.sent_back && staged(h.rung)) {
            self.actions.push_back(WorkerAction::SendStaged {
                job,
                handoff: h.handoff,
            });
        }
        self.actions
            .push_back(WorkerAction::Send(Message::Ack(Ack { job, handles })));
        // Test-only bug: the frees after the ACK.
        self.actions.extend(unimports);
        Ok(())
    }
}
