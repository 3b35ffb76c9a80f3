//! The invariant checker: a ledger of what the two machines *did*, as a driver would see it
//! (allocations, events recorded and waited on, imports, frees, messages sent and
//! delivered), that reports every [`Violation`] of the eight [`Invariant`]s.
//!
//! It trusts no state inside the machines. Its model of memory: an allocation is freed when
//! its owner (the caller) has dropped it and no handoff of it is unreleased; a worker's
//! imports vanish when the driver drops them (UNIMPORT, or the process being reaped).
//! Host-staged handoffs have no import and no READY or DONE gate: the worker works on its
//! own copy, and the parent's bytes move inside its own SendStaged and ReceiveStaged.
//!
//! Why this file is long: one `Auditor` checks every action and message of both machines on one model.

use std::collections::{BTreeMap, BTreeSet};

use crate::invariant::{Invariant, Violation};
use crate::message::{Message, ResultGrant};
use crate::parent::ParentAction;
use crate::types::{
    AllocId, EventBlob, HandoffId, JobId, Outcome, Rung, Span, WorkerId, by_pointer, in_arena,
    ready_gated,
};
use crate::worker::WorkerAction;
use poolipc_types::ImportLimit;

#[derive(Clone, Debug)]
struct AllocRecord {
    span: Span,
    caller_holds: bool,
    loans: BTreeSet<HandoffId>,
    freed: bool,
}

#[derive(Clone, Debug)]
struct LoanRecord {
    worker: WorkerId,
    job: JobId,
    alloc: AllocId,
    pointer: bool,
    /// A block of the result arena (a result, or an input's arena copy): no import guards
    /// it, so only DONE or the reaping does.
    arena: bool,
    /// The worker must wait on the job's READY before touching it (pool pointer: the
    /// caller's writes; arena copy: the parent's copy into the block).
    ready_gate: bool,
    result: bool,
    /// The parent recorded the job's READY before sending the message carrying it.
    ready_recorded: bool,
    ready_event: EventBlob,
    usable: bool,
    /// The worker's code queued its last access.
    past_last_access: bool,
    ack_sent: bool,
    /// The DONE event of the worker's `Done` naming it, as the parent received it.
    done_delivered: Option<EventBlob>,
    ack_delivered: bool,
    done_waited: Option<EventBlob>,
    received: bool,
    released: bool,
}

/// Checks the eight invariants on the actions of one parent and its workers.
///
/// Feed it, in the order things happen: [`Auditor::parent_allocated`] and
/// [`Auditor::caller_dropped`] for the parent's own tensors, every [`ParentAction`] and
/// [`WorkerAction`] as it is carried out, [`Auditor::accessed`] when a worker touches memory,
/// [`Auditor::worker_finishing`] when its code queued the last access to a job,
/// [`Auditor::delivered_to_parent`], [`Auditor::worker_reaped`] when a worker process is
/// gone, and [`Auditor::parent_handles_reap`] before the parent handles its reaping. Call
/// [`Auditor::check_settled`] when all actions are carried out.
#[derive(Clone, Debug)]
pub struct Auditor {
    limit: ImportLimit,
    allocs: BTreeMap<AllocId, AllocRecord>,
    loans: BTreeMap<HandoffId, LoanRecord>,
    job_loans: BTreeMap<(WorkerId, JobId), Vec<HandoffId>>,
    ready_pending: BTreeSet<(WorkerId, JobId)>,
    waited: BTreeMap<WorkerId, Vec<(JobId, EventBlob)>>,
    done_recorded: BTreeSet<(WorkerId, JobId)>,
    imports: BTreeMap<(WorkerId, AllocId), u32>,
    holders: BTreeMap<(WorkerId, AllocId), BTreeSet<HandoffId>>,
    reaped: BTreeSet<WorkerId>,
    parent_knows_reaped: BTreeSet<WorkerId>,
    reaping: Option<WorkerId>,
}

type Checked = Result<(), Vec<Violation>>;

fn verdict(found: Vec<Violation>) -> Checked {
    if found.is_empty() { Ok(()) } else { Err(found) }
}

fn violation(found: &mut Vec<Violation>, invariant: Invariant, detail: String) {
    found.push(Violation::new(invariant, detail));
}

impl Auditor {
    /// An empty ledger for a parent using `limit`.
    #[must_use]
    pub fn new(limit: ImportLimit) -> Auditor {
        Auditor {
            limit,
            allocs: BTreeMap::new(),
            loans: BTreeMap::new(),
            job_loans: BTreeMap::new(),
            ready_pending: BTreeSet::new(),
            waited: BTreeMap::new(),
            done_recorded: BTreeSet::new(),
            imports: BTreeMap::new(),
            holders: BTreeMap::new(),
            reaped: BTreeSet::new(),
            parent_knows_reaped: BTreeSet::new(),
            reaping: None,
        }
    }

    /// The parent's own code allocated `alloc` over `span` (an input tensor, or memory for a
    /// result); the caller holds it.
    pub fn parent_allocated(&mut self, alloc: AllocId, span: Span) {
        self.allocs.insert(
            alloc,
            AllocRecord {
                span,
                caller_holds: true,
                loans: BTreeSet::new(),
                freed: false,
            },
        );
    }

    /// The caller dropped its reference to `alloc`; it is freed once no handoff holds it.
    ///
    /// # Errors
    /// The violations this free causes.
    pub fn caller_dropped(&mut self, alloc: AllocId) -> Checked {
        let mut found = Vec::new();
        if let Some(rec) = self.allocs.get_mut(&alloc) {
            rec.caller_holds = false;
        }
        self.maybe_free(alloc, &mut found);
        verdict(found)
    }

    fn maybe_free(&mut self, alloc: AllocId, found: &mut Vec<Violation>) {
        let Some(rec) = self.allocs.get_mut(&alloc) else {
            return;
        };
        if rec.freed || rec.caller_holds || !rec.loans.is_empty() {
            return;
        }
        rec.freed = true;
        for ((worker, a), n) in &self.imports {
            if *a == alloc && *n > 0 {
                violation(
                    found,
                    Invariant::UnimportBeforeFree,
                    format!("{alloc} freed while {worker} still imports it"),
                );
            }
        }
    }

    fn owned(&self, alloc: AllocId, what: &str, found: &mut Vec<Violation>) {
        match self.allocs.get(&alloc) {
            None => violation(
                found,
                Invariant::ParentOwnsAllocations,
                format!("{what} of {alloc}, which the parent never allocated"),
            ),
            Some(rec) if rec.freed => violation(
                found,
                Invariant::UnimportBeforeFree,
                format!("{what} of {alloc} after it was freed"),
            ),
            Some(_) => {}
        }
    }

    /// A handoff the parent sends in a `Lend` or an `AllocationGrant`.
    #[allow(clippy::too_many_arguments)] // one handoff's fields, from two message shapes
    fn sent(
        &mut self,
        worker: WorkerId,
        job: JobId,
        handoff: HandoffId,
        alloc: AllocId,
        rung: Rung,
        ready_event: EventBlob,
        ready: bool,
        result: bool,
        found: &mut Vec<Violation>,
    ) {
        let what = if result { "a grant" } else { "a lend" };
        self.owned(alloc, what, found);
        let pointer = by_pointer(rung);
        let arena = in_arena(rung);
        let ready_gate = ready_gated(rung);
        if pointer
            && let Some(rec) = self.allocs.get(&alloc)
            && !self.limit.admits(rec.span)
        {
            violation(
                found,
                Invariant::ImportLimit,
                format!(
                    "{alloc} ({} bytes at {:#x}) in {what} for pointer import",
                    rec.span.bytes, rec.span.ptr
                ),
            );
        }
        if ready_gate && !ready {
            violation(
                found,
                Invariant::ReadyBeforeAccess,
                format!(
                    "{handoff} of {job} sent on the {rung} rung before the job's READY was \
                     recorded"
                ),
            );
        }
        if let Some(rec) = self.allocs.get_mut(&alloc) {
            rec.loans.insert(handoff);
        }
        self.job_loans
            .entry((worker, job))
            .or_default()
            .push(handoff);
        self.loans.insert(
            handoff,
            LoanRecord {
                worker,
                job,
                alloc,
                pointer,
                arena,
                ready_gate,
                result,
                ready_recorded: ready,
                ready_event,
                usable: false,
                past_last_access: false,
                ack_sent: false,
                done_delivered: None,
                ack_delivered: false,
                done_waited: None,
                received: false,
                released: false,
            },
        );
    }

    /// One parent action, as it is carried out.
    ///
    /// # Errors
    /// The violations it shows.
    pub fn parent_action(&mut self, action: &ParentAction) -> Checked {
        let mut found = Vec::new();
        match action {
            ParentAction::RecordReady { worker, job } => {
                self.ready_pending.insert((*worker, *job));
            }
            ParentAction::Send {
                worker,
                message: Message::Lend(lend),
            } => {
                let ready = self.ready_pending.remove(&(*worker, lend.job));
                for t in &lend.tensors {
                    self.sent(
                        *worker,
                        lend.job,
                        t.handle,
                        t.alloc,
                        t.rung,
                        t.ready_event,
                        ready,
                        false,
                        &mut found,
                    );
                }
                // The slice: a block of the arena, like an arena result (no READY).
                if let Some(slice) = &lend.slice {
                    self.sent(
                        *worker,
                        lend.job,
                        slice.handle,
                        slice.alloc,
                        Rung::Arena,
                        EventBlob([0; 64]),
                        ready,
                        false,
                        &mut found,
                    );
                }
            }
            ParentAction::Send {
                worker,
                message: Message::AllocationGrant(grant),
            } => {
                let ready = self.ready_pending.remove(&(*worker, grant.job));
                for g in &grant.results {
                    let (handle, alloc, rung, ready_event) = match g {
                        ResultGrant::Granted {
                            handle,
                            alloc,
                            rung,
                            ready_event,
                            ..
                        } => (*handle, *alloc, *rung, *ready_event),
                        ResultGrant::Arena { handle, alloc, .. } => {
                            (*handle, *alloc, Rung::Arena, EventBlob([0; 64]))
                        }
                        ResultGrant::Refused { .. } => continue,
                    };
                    self.sent(
                        *worker,
                        grant.job,
                        handle,
                        alloc,
                        rung,
                        ready_event,
                        ready,
                        true,
                        &mut found,
                    );
                }
            }
            ParentAction::ReceiveStaged { handoff, .. } => {
                if let Some(loan) = self.loans.get_mut(handoff) {
                    if loan.done_delivered.is_none() {
                        violation(
                            &mut found,
                            Invariant::ReleaseAfterAckAndDone,
                            format!("staged result {handoff} pulled before the worker's Done"),
                        );
                    }
                    loan.received = true;
                }
            }
            ParentAction::WaitDone {
                handoff,
                done_event,
                ..
            } => {
                if let Some(loan) = self.loans.get_mut(handoff) {
                    if loan.done_delivered != Some(*done_event) {
                        violation(
                            &mut found,
                            Invariant::ReleaseAfterAckAndDone,
                            format!(
                                "the wait on DONE of {handoff} is not on the DONE its worker sent"
                            ),
                        );
                    }
                    loan.done_waited = Some(*done_event);
                }
            }
            ParentAction::Release {
                worker,
                handoff,
                alloc,
                outcome,
                ..
            } => self.on_release(*worker, *handoff, *alloc, *outcome, &mut found),
            ParentAction::ReleaseSlice {
                worker,
                handoff,
                alloc,
                outcome,
                carved,
                ..
            } => {
                if !carved.is_empty() {
                    if *outcome != Outcome::Completed {
                        violation(
                            &mut found,
                            Invariant::ReleaseAfterAckAndDone,
                            format!(
                                "slice {handoff} delivers carved results with outcome {outcome:?}"
                            ),
                        );
                    }
                    // Its carves are results the caller holds now.
                    if let Some(loan) = self.loans.get_mut(handoff) {
                        loan.result = true;
                    }
                }
                self.on_release(*worker, *handoff, *alloc, *outcome, &mut found);
            }
            ParentAction::FreeResult { alloc, .. } => {
                match self.allocs.get_mut(alloc) {
                    Some(rec) if rec.loans.is_empty() => rec.caller_holds = false,
                    Some(_) => violation(
                        &mut found,
                        Invariant::UnimportBeforeFree,
                        format!("{alloc} freed as an unused result while it is lent"),
                    ),
                    None => violation(
                        &mut found,
                        Invariant::ParentOwnsAllocations,
                        format!("free of {alloc}, which the parent never allocated"),
                    ),
                }
                self.maybe_free(*alloc, &mut found);
            }
            ParentAction::JobFinished { worker, job, .. } => {
                if self.reaping.is_some_and(|w| w != *worker) {
                    violation(
                        &mut found,
                        Invariant::DeathFailsOnlyItsJobs,
                        format!("{job} of {worker} finished because another worker was reaped"),
                    );
                }
                let open: Vec<HandoffId> = self
                    .job_loans
                    .get(&(*worker, *job))
                    .into_iter()
                    .flatten()
                    .copied()
                    .filter(|h| self.loans.get(h).is_some_and(|l| !l.released))
                    .collect();
                if !open.is_empty() {
                    let invariant = if self.parent_knows_reaped.contains(worker) {
                        Invariant::DeathFailsOnlyItsJobs
                    } else {
                        Invariant::ReleaseAfterAckAndDone
                    };
                    violation(
                        &mut found,
                        invariant,
                        format!("{job} of {worker} finished with {open:?} never released"),
                    );
                }
                self.job_loans.remove(&(*worker, *job));
            }
            ParentAction::WorkerRemoved { worker } => {
                if !self.parent_knows_reaped.contains(worker) {
                    violation(
                        &mut found,
                        Invariant::DeathFailsOnlyItsJobs,
                        format!("{worker} removed before it was reaped"),
                    );
                }
            }
            ParentAction::Send { .. }
            | ParentAction::SendStaged { .. }
            | ParentAction::AllocateResult { .. }
            | ParentAction::KillWorker { .. }
            | ParentAction::ShutdownComplete => {}
        }
        verdict(found)
    }

    fn on_release(
        &mut self,
        worker: WorkerId,
        handoff: HandoffId,
        alloc: AllocId,
        outcome: Outcome,
        found: &mut Vec<Violation>,
    ) {
        let reaped = self.reaped.contains(&worker);
        let Some(loan) = self.loans.get_mut(&handoff) else {
            violation(
                found,
                Invariant::ParentOwnsAllocations,
                format!("release of {handoff}, which was never lent"),
            );
            return;
        };
        if loan.released {
            violation(
                found,
                Invariant::ReleaseAfterAckAndDone,
                format!("{handoff} released twice"),
            );
        }
        if outcome == Outcome::Failed {
            if loan.pointer && !reaped {
                violation(
                    found,
                    Invariant::UnimportBeforeFree,
                    format!(
                        "{handoff} released before {worker} was reaped: its import may be live"
                    ),
                );
            }
            if loan.arena && !reaped {
                violation(
                    found,
                    Invariant::UnimportBeforeFree,
                    format!(
                        "arena block {handoff} returned before {worker} was reaped and without \
                         a wait on its DONE: the process may still write into it"
                    ),
                );
            }
        } else {
            let gated = loan.ack_delivered
                && (!(loan.pointer || loan.arena)
                    || (loan.done_waited.is_some() && loan.done_waited == loan.done_delivered));
            if !gated {
                violation(
                    found,
                    Invariant::ReleaseAfterAckAndDone,
                    format!(
                        "{handoff} released ({outcome:?}) with its ACK received: {}, the stream \
                         waiting on its DONE: {}",
                        loan.ack_delivered,
                        loan.done_waited.is_some()
                    ),
                );
            }
            let staged = !loan.pointer && !loan.arena;
            if loan.result && staged && outcome == Outcome::Completed && !loan.received {
                violation(
                    found,
                    Invariant::ReleaseAfterAckAndDone,
                    format!("staged result {handoff} delivered before its bytes were received"),
                );
            }
        }
        if self.reaping.is_some_and(|w| w != worker) {
            violation(
                found,
                Invariant::DeathFailsOnlyItsJobs,
                format!("{handoff} of {worker} released because another worker was reaped"),
            );
        }
        loan.released = true;
        let result = loan.result;
        if outcome == Outcome::Completed && result {
            self.owned(alloc, "result delivered", found);
            if let Some(rec) = self.allocs.get_mut(&alloc) {
                rec.caller_holds = true;
            }
        }
        if let Some(rec) = self.allocs.get_mut(&alloc) {
            rec.loans.remove(&handoff);
        }
        self.maybe_free(alloc, found);
    }

    fn usable(
        &mut self,
        worker: WorkerId,
        job: JobId,
        handoff: HandoffId,
        found: &mut Vec<Violation>,
    ) {
        let waited = self.waited.get(&worker).cloned().unwrap_or_default();
        let Some(loan) = self.loans.get_mut(&handoff) else {
            violation(
                found,
                Invariant::ParentOwnsAllocations,
                format!("{worker} uses {handoff}, which the parent never lent"),
            );
            return;
        };
        loan.usable = true;
        if !loan.ready_gate {
            return;
        }
        if !loan.ready_recorded || !waited.contains(&(job, loan.ready_event)) {
            violation(
                found,
                Invariant::ReadyBeforeAccess,
                format!(
                    "{handoff} of {job} usable on {worker} before it waited on that job's READY"
                ),
            );
        }
        if !loan.pointer {
            return;
        }
        let alloc = loan.alloc;
        if self.imports.get(&(worker, alloc)).copied().unwrap_or(0) != 1 {
            violation(
                found,
                Invariant::OneImportPerAllocation,
                format!("{handoff} usable on {worker} without exactly one import of {alloc}"),
            );
        }
        self.holders
            .entry((worker, alloc))
            .or_default()
            .insert(handoff);
    }

    /// Whether `worker` still imports the allocation of pointer handoff `h` though no
    /// handoff of it uses it any more: a free that should have come already.
    fn import_left(&self, worker: WorkerId, h: HandoffId) -> Option<AllocId> {
        let loan = self.loans.get(&h)?;
        if !loan.pointer || loan.worker != worker {
            return None;
        }
        let key = (worker, loan.alloc);
        let imported = self.imports.get(&key).copied().unwrap_or(0) > 0;
        let unused = self.holders.get(&key).is_none_or(BTreeSet::is_empty);
        (imported && unused).then_some(loan.alloc)
    }

    /// One worker action, as it is carried out.
    ///
    /// # Errors
    /// The violations it shows.
    pub fn worker_action(&mut self, worker: WorkerId, action: &WorkerAction) -> Checked {
        let mut found = Vec::new();
        match action {
            WorkerAction::Import { alloc, .. } => {
                if self.allocs.get(alloc).is_some_and(|r| r.freed) {
                    violation(
                        &mut found,
                        Invariant::UnimportBeforeFree,
                        format!("{worker} imports {alloc} after it was freed"),
                    );
                }
                let n = self.imports.entry((worker, *alloc)).or_insert(0);
                *n += 1;
                if *n > 1 {
                    violation(
                        &mut found,
                        Invariant::OneImportPerAllocation,
                        format!("{worker} holds {n} driver imports of {alloc}"),
                    );
                }
            }
            WorkerAction::WaitReady { job, ready_event } => {
                self.waited
                    .entry(worker)
                    .or_default()
                    .push((*job, *ready_event));
            }
            WorkerAction::JobStarted { job, inputs, slice } => {
                for t in inputs {
                    self.usable(worker, *job, t.handle, &mut found);
                }
                if let Some(slice) = slice {
                    self.usable(worker, *job, slice.handle, &mut found);
                }
                self.waited.remove(&worker);
            }
            WorkerAction::ResultsGranted { job, results } => {
                for g in results {
                    if let ResultGrant::Granted { handle, .. } | ResultGrant::Arena { handle, .. } =
                        g
                    {
                        self.usable(worker, *job, *handle, &mut found);
                    }
                }
                self.waited.remove(&worker);
            }
            WorkerAction::Unimport { alloc } => {
                let key = (worker, *alloc);
                if self.holders.get(&key).is_some_and(|h| !h.is_empty()) {
                    violation(
                        &mut found,
                        Invariant::OneImportPerAllocation,
                        format!("{worker} unimports {alloc} while a handoff still uses it"),
                    );
                }
                match self.imports.get_mut(&key) {
                    Some(n) if *n > 0 => *n -= 1,
                    _ => violation(
                        &mut found,
                        Invariant::OneImportPerAllocation,
                        format!("{worker} unimports {alloc}, which it does not import"),
                    ),
                }
            }
            WorkerAction::RecordDone { job } => {
                self.done_recorded.insert((worker, *job));
                let handoffs = self
                    .job_loans
                    .get(&(worker, *job))
                    .cloned()
                    .unwrap_or_default();
                for h in handoffs {
                    if let Some(alloc) = self.import_left(worker, h) {
                        violation(
                            &mut found,
                            Invariant::DoneThenUnimportThenAck,
                            format!(
                                "{worker} records DONE of {job} before freeing its import of {alloc}"
                            ),
                        );
                    }
                }
            }
            WorkerAction::Send(Message::Done(done)) => {
                if !self.done_recorded.contains(&(worker, done.job)) {
                    violation(
                        &mut found,
                        Invariant::DoneThenUnimportThenAck,
                        format!(
                            "{worker} sends the Done of {} before recording DONE",
                            done.job
                        ),
                    );
                }
            }
            WorkerAction::Send(Message::Ack(ack)) => {
                if !self.done_recorded.contains(&(worker, ack.job)) {
                    violation(
                        &mut found,
                        Invariant::DoneThenUnimportThenAck,
                        format!("{worker} ACKs {} before recording DONE", ack.job),
                    );
                }
                for h in &ack.handles {
                    if let Some(alloc) = self.import_left(worker, *h) {
                        violation(
                            &mut found,
                            Invariant::DoneThenUnimportThenAck,
                            format!("{worker} ACKs {h} before freeing its import of {alloc}"),
                        );
                    }
                    if let Some(loan) = self.loans.get_mut(h)
                        && loan.worker == worker
                    {
                        loan.ack_sent = true;
                    }
                }
            }
            WorkerAction::Send(_)
            | WorkerAction::ReceiveStaged { .. }
            | WorkerAction::SendStaged { .. }
            | WorkerAction::Cancelled { .. }
            | WorkerAction::Stop => {}
        }
        verdict(found)
    }

    /// The worker's code queued its last access to `job`'s memory (it is about to call
    /// [`crate::Worker::finish_job`]).
    pub fn worker_finishing(&mut self, worker: WorkerId, job: JobId) {
        let handoffs = self
            .job_loans
            .get(&(worker, job))
            .cloned()
            .unwrap_or_default();
        for h in handoffs {
            let Some(loan) = self.loans.get_mut(&h) else {
                continue;
            };
            if loan.worker != worker {
                continue;
            }
            loan.past_last_access = true;
            if let Some(holders) = self.holders.get_mut(&(worker, loan.alloc)) {
                holders.remove(&h);
            }
        }
    }

    /// A worker touches the memory of `handoff` (reads an input, writes a result).
    ///
    /// # Errors
    /// The violations it shows.
    pub fn accessed(&mut self, worker: WorkerId, handoff: HandoffId) -> Checked {
        let mut found = Vec::new();
        let Some(loan) = self.loans.get(&handoff) else {
            violation(
                &mut found,
                Invariant::ParentOwnsAllocations,
                format!("{worker} touches {handoff}, which the parent never lent"),
            );
            return verdict(found);
        };
        if loan.past_last_access {
            violation(
                &mut found,
                Invariant::DoneThenUnimportThenAck,
                format!("{worker} touches {handoff} after its last access"),
            );
        }
        if loan.arena && self.allocs.get(&loan.alloc).is_some_and(|r| r.freed) {
            violation(
                &mut found,
                Invariant::UnimportBeforeFree,
                format!(
                    "{worker} touches arena block {} after it was returned",
                    loan.alloc
                ),
            );
        }
        if loan.ready_gate && !loan.usable {
            violation(
                &mut found,
                Invariant::ReadyBeforeAccess,
                format!("{worker} touches {handoff} before it was usable"),
            );
        }
        if loan.pointer {
            if self
                .imports
                .get(&(worker, loan.alloc))
                .copied()
                .unwrap_or(0)
                == 0
            {
                violation(
                    &mut found,
                    Invariant::OneImportPerAllocation,
                    format!(
                        "{worker} touches {handoff} with no import of {}",
                        loan.alloc
                    ),
                );
            }
            if self.allocs.get(&loan.alloc).is_some_and(|r| r.freed) {
                violation(
                    &mut found,
                    Invariant::UnimportBeforeFree,
                    format!("{worker} touches {} after it was freed", loan.alloc),
                );
            }
        }
        verdict(found)
    }

    /// The parent received `message` from `worker`.
    pub fn delivered_to_parent(&mut self, worker: WorkerId, message: &Message) {
        match message {
            Message::Ack(ack) => {
                for h in &ack.handles {
                    if let Some(loan) = self.loans.get_mut(h)
                        && loan.worker == worker
                        && loan.ack_sent
                    {
                        loan.ack_delivered = true;
                    }
                }
            }
            Message::Done(done) => {
                if !self.done_recorded.contains(&(worker, done.job)) {
                    return;
                }
                for h in &done.handles {
                    if let Some(loan) = self.loans.get_mut(h)
                        && loan.worker == worker
                        && loan.job == done.job
                    {
                        loan.done_delivered = Some(done.done_event);
                    }
                }
            }
            _ => {}
        }
    }

    /// The worker process is gone and reaped: the driver dropped its imports.
    pub fn worker_reaped(&mut self, worker: WorkerId) {
        self.reaped.insert(worker);
        self.imports.retain(|(w, _), _| *w != worker);
        self.holders.retain(|(w, _), _| *w != worker);
        self.waited.remove(&worker);
    }

    /// The parent is about to handle the reaping of `worker`: until
    /// [`Auditor::check_settled`], every release and finished job must be that worker's.
    pub fn parent_handles_reap(&mut self, worker: WorkerId) {
        self.parent_knows_reaped.insert(worker);
        self.reaping = Some(worker);
    }

    /// Handoffs sent and not released.
    #[must_use]
    pub fn unreleased(&self) -> usize {
        self.loans.values().filter(|l| !l.released).count()
    }

    /// Checks that hold whenever all actions are carried out.
    ///
    /// # Errors
    /// The violations found.
    pub fn check_settled(&mut self) -> Checked {
        self.reaping = None;
        let mut found = Vec::new();
        for (handoff, loan) in &self.loans {
            if !loan.released && self.parent_knows_reaped.contains(&loan.worker) {
                violation(
                    &mut found,
                    Invariant::DeathFailsOnlyItsJobs,
                    format!("{handoff} of reaped {} was never released", loan.worker),
                );
            }
        }
        for ((worker, alloc), n) in &self.imports {
            if *n > 1 {
                violation(
                    &mut found,
                    Invariant::OneImportPerAllocation,
                    format!("{worker} holds {n} driver imports of {alloc}"),
                );
            }
        }
        verdict(found)
    }
}
