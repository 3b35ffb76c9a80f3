//! The invariant checker: a ledger of what the two machines *did*, as a driver would see it
//! (allocations, exports, events, imports, frees), that reports every [`Violation`] of the
//! eight [`Invariant`]s.
//!
//! It trusts no state inside the machines. Its model of memory: an allocation is freed when
//! its owner (the caller) has dropped it and no handoff of it is unreleased; a worker's
//! imports vanish when the driver drops them (UNIMPORT, or the process being reaped).

use std::collections::{BTreeMap, BTreeSet};

use crate::invariant::{Invariant, Violation};
use crate::legacy::{ToParent, ToWorker};
use crate::parent::ParentAction;
use crate::types::{AllocId, HandoffId, Outcome, Purpose, Span, WorkerId};
use crate::worker::WorkerAction;
use poolipc_types::ImportLimit;

#[derive(Clone, Debug)]
struct AllocRecord {
    caller_holds: bool,
    loans: BTreeSet<HandoffId>,
    freed: bool,
}

#[derive(Clone, Debug, Default)]
struct LoanRecord {
    worker: Option<WorkerId>,
    alloc: Option<AllocId>,
    ready_recorded: bool,
    offered: bool,
    waited_ready: bool,
    usable: bool,
    done_recorded: bool,
    ack_sent: bool,
    ack_delivered: bool,
    done_waited: bool,
    released: bool,
}

/// Checks the eight invariants on the actions of one parent and its workers.
///
/// Feed it, in the order things happen: [`Auditor::parent_allocated`] and
/// [`Auditor::caller_dropped`] for the parent's own tensors, every [`ParentAction`] and
/// [`WorkerAction`] as it is carried out, [`Auditor::accessed`] when a worker touches memory,
/// [`Auditor::delivered_to_parent`], [`Auditor::worker_reaped`] when a worker process is gone,
/// and [`Auditor::parent_handles_reap`] before the parent handles its reaping. Call
/// [`Auditor::check_settled`] when all actions are carried out.
#[derive(Clone, Debug)]
pub struct Auditor {
    limit: ImportLimit,
    allocs: BTreeMap<AllocId, AllocRecord>,
    loans: BTreeMap<HandoffId, LoanRecord>,
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

impl Auditor {
    /// An empty ledger for a parent using `limit`.
    #[must_use]
    pub fn new(limit: ImportLimit) -> Auditor {
        Auditor {
            limit,
            allocs: BTreeMap::new(),
            loans: BTreeMap::new(),
            imports: BTreeMap::new(),
            holders: BTreeMap::new(),
            reaped: BTreeSet::new(),
            parent_knows_reaped: BTreeSet::new(),
            reaping: None,
        }
    }

    /// The parent's own code allocated `alloc` (an input tensor, or memory for a result); the
    /// caller holds it.
    pub fn parent_allocated(&mut self, alloc: AllocId, _span: Span) {
        self.allocs.insert(
            alloc,
            AllocRecord {
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
                found.push(Violation::new(
                    Invariant::UnimportBeforeFree,
                    format!("{alloc} freed while {worker} still imports it"),
                ));
            }
        }
    }

    fn owned(&self, alloc: AllocId, what: &str, found: &mut Vec<Violation>) {
        match self.allocs.get(&alloc) {
            None => found.push(Violation::new(
                Invariant::ParentOwnsAllocations,
                format!("{what} of {alloc}, which the parent never allocated"),
            )),
            Some(rec) if rec.freed => found.push(Violation::new(
                Invariant::UnimportBeforeFree,
                format!("{what} of {alloc} after it was freed"),
            )),
            Some(_) => {}
        }
    }

    /// One parent action, as it is carried out.
    ///
    /// # Errors
    /// The violations it shows.
    pub fn parent_action(&mut self, action: &ParentAction) -> Checked {
        let mut found = Vec::new();
        match action {
            ParentAction::Export { alloc, .. } => self.owned(*alloc, "export", &mut found),
            ParentAction::RecordReady { handoff } => {
                self.loans.entry(*handoff).or_default().ready_recorded = true;
            }
            ParentAction::Send {
                worker,
                message: ToWorker::Offer(offer),
            } => {
                self.owned(offer.alloc, "offer", &mut found);
                if !self.limit.admits(offer.span) {
                    found.push(Violation::new(
                        Invariant::ImportLimit,
                        format!(
                            "{} offered for pointer import with {} bytes at {:#x}",
                            offer.alloc, offer.span.bytes, offer.span.ptr
                        ),
                    ));
                }
                let loan = self.loans.entry(offer.handoff).or_default();
                if !loan.ready_recorded {
                    found.push(Violation::new(
                        Invariant::ReadyBeforeAccess,
                        format!(
                            "{} offered before its READY event was recorded",
                            offer.handoff
                        ),
                    ));
                }
                loan.offered = true;
                loan.worker = Some(*worker);
                loan.alloc = Some(offer.alloc);
                if let Some(rec) = self.allocs.get_mut(&offer.alloc) {
                    rec.loans.insert(offer.handoff);
                }
            }
            ParentAction::WaitDone { handoff } => {
                self.loans.entry(*handoff).or_default().done_waited = true;
            }
            ParentAction::Release {
                worker,
                handoff,
                alloc,
                purpose,
                outcome,
                ..
            } => self.on_release(*worker, *handoff, *alloc, *purpose, *outcome, &mut found),
            ParentAction::FreeResult { alloc, .. } => {
                match self.allocs.get_mut(alloc) {
                    Some(rec) if rec.loans.is_empty() => rec.caller_holds = false,
                    Some(_) => found.push(Violation::new(
                        Invariant::UnimportBeforeFree,
                        format!("{alloc} freed as an unused result while it is lent"),
                    )),
                    None => found.push(Violation::new(
                        Invariant::ParentOwnsAllocations,
                        format!("free of {alloc}, which the parent never allocated"),
                    )),
                }
                self.maybe_free(*alloc, &mut found);
            }
            ParentAction::JobFailed { worker, .. }
                if self.reaping.is_some_and(|w| w != *worker) =>
            {
                found.push(Violation::new(
                    Invariant::DeathFailsOnlyItsJobs,
                    format!("a job of {worker} failed because another worker was reaped"),
                ));
            }
            _ => {}
        }
        verdict(found)
    }

    fn on_release(
        &mut self,
        worker: WorkerId,
        handoff: HandoffId,
        alloc: AllocId,
        purpose: Purpose,
        outcome: Outcome,
        found: &mut Vec<Violation>,
    ) {
        let loan = self.loans.entry(handoff).or_default();
        if loan.released {
            found.push(Violation::new(
                Invariant::ReleaseAfterAckAndDone,
                format!("{handoff} released twice"),
            ));
        }
        if outcome != Outcome::Failed && !(loan.ack_delivered && loan.done_waited) {
            found.push(Violation::new(
                Invariant::ReleaseAfterAckAndDone,
                format!(
                    "{handoff} released ({outcome:?}) with ACK received: {}, streams waiting on DONE: {}",
                    loan.ack_delivered, loan.done_waited
                ),
            ));
        }
        if self.reaping.is_some_and(|w| w != worker) {
            found.push(Violation::new(
                Invariant::DeathFailsOnlyItsJobs,
                format!("{handoff} of {worker} released because another worker was reaped"),
            ));
        }
        loan.released = true;
        if outcome == Outcome::Completed && matches!(purpose, Purpose::Result { .. }) {
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

    /// One worker action, as it is carried out.
    ///
    /// # Errors
    /// The violations it shows.
    pub fn worker_action(&mut self, worker: WorkerId, action: &WorkerAction) -> Checked {
        let mut found = Vec::new();
        match action {
            WorkerAction::Import { alloc, .. } => {
                if self.allocs.get(alloc).is_some_and(|r| r.freed) {
                    found.push(Violation::new(
                        Invariant::UnimportBeforeFree,
                        format!("{worker} imports {alloc} after it was freed"),
                    ));
                }
                let n = self.imports.entry((worker, *alloc)).or_insert(0);
                *n += 1;
                if *n > 1 {
                    found.push(Violation::new(
                        Invariant::OneImportPerAllocation,
                        format!("{worker} holds {n} driver imports of {alloc}"),
                    ));
                }
            }
            WorkerAction::WaitReady { handoff } => {
                let loan = self.loans.entry(*handoff).or_default();
                if !loan.ready_recorded {
                    found.push(Violation::new(
                        Invariant::ReadyBeforeAccess,
                        format!("{worker} waits on READY of {handoff}, never recorded"),
                    ));
                }
                loan.waited_ready = true;
            }
            WorkerAction::Usable { handoff, alloc, .. } => {
                let loan = self.loans.entry(*handoff).or_default();
                loan.usable = true;
                if !loan.waited_ready {
                    found.push(Violation::new(
                        Invariant::ReadyBeforeAccess,
                        format!("{handoff} usable on {worker} before it waited on READY"),
                    ));
                }
                if self.imports.get(&(worker, *alloc)).copied().unwrap_or(0) != 1 {
                    found.push(Violation::new(
                        Invariant::OneImportPerAllocation,
                        format!(
                            "{handoff} usable on {worker} without exactly one import of {alloc}"
                        ),
                    ));
                }
                self.holders
                    .entry((worker, *alloc))
                    .or_default()
                    .insert(*handoff);
            }
            WorkerAction::RecordDone { handoff } => {
                let loan = self.loans.entry(*handoff).or_default();
                loan.done_recorded = true;
                if let Some(alloc) = loan.alloc
                    && let Some(h) = self.holders.get_mut(&(worker, alloc))
                {
                    h.remove(handoff);
                }
            }
            WorkerAction::Unimport { alloc } => {
                let key = (worker, *alloc);
                if self.holders.get(&key).is_some_and(|h| !h.is_empty()) {
                    found.push(Violation::new(
                        Invariant::OneImportPerAllocation,
                        format!("{worker} unimports {alloc} while a handoff still uses it"),
                    ));
                }
                match self.imports.get_mut(&key) {
                    Some(n) if *n > 0 => *n -= 1,
                    _ => found.push(Violation::new(
                        Invariant::OneImportPerAllocation,
                        format!("{worker} unimports {alloc}, which it does not import"),
                    )),
                }
            }
            WorkerAction::Send(ToParent::Ack { handoff }) => {
                let loan = self.loans.entry(*handoff).or_default();
                loan.ack_sent = true;
                if loan.usable && !loan.done_recorded {
                    found.push(Violation::new(
                        Invariant::DoneThenUnimportThenAck,
                        format!("{worker} ACKs {handoff} before recording DONE"),
                    ));
                }
                if let Some(alloc) = loan.alloc {
                    let key = (worker, alloc);
                    let unused = self.holders.get(&key).is_none_or(BTreeSet::is_empty);
                    let imported = self.imports.get(&key).copied().unwrap_or(0) > 0;
                    if unused && imported {
                        found.push(Violation::new(
                            Invariant::DoneThenUnimportThenAck,
                            format!("{worker} ACKs {handoff} before unimporting {alloc}"),
                        ));
                    }
                }
            }
            _ => {}
        }
        verdict(found)
    }

    /// A worker touches the memory of `handoff` (reads an input, writes a result).
    ///
    /// # Errors
    /// The violations it shows.
    pub fn accessed(&mut self, worker: WorkerId, handoff: HandoffId) -> Checked {
        let mut found = Vec::new();
        let loan = self.loans.entry(handoff).or_default();
        if !loan.waited_ready {
            found.push(Violation::new(
                Invariant::ReadyBeforeAccess,
                format!("{worker} touches {handoff} before waiting on READY"),
            ));
        }
        if loan.done_recorded {
            found.push(Violation::new(
                Invariant::DoneThenUnimportThenAck,
                format!("{worker} touches {handoff} after recording DONE"),
            ));
        }
        if let Some(alloc) = loan.alloc {
            if self.imports.get(&(worker, alloc)).copied().unwrap_or(0) == 0 {
                found.push(Violation::new(
                    Invariant::OneImportPerAllocation,
                    format!("{worker} touches {handoff} with no import of {alloc}"),
                ));
            }
            if self.allocs.get(&alloc).is_some_and(|r| r.freed) {
                found.push(Violation::new(
                    Invariant::UnimportBeforeFree,
                    format!("{worker} touches {alloc} after it was freed"),
                ));
            }
        }
        verdict(found)
    }

    /// The parent received `message` from `worker`.
    pub fn delivered_to_parent(&mut self, worker: WorkerId, message: &ToParent) {
        if let ToParent::Ack { handoff } = message
            && let Some(loan) = self.loans.get_mut(handoff)
            && loan.worker == Some(worker)
            && loan.ack_sent
        {
            loan.ack_delivered = true;
        }
    }

    /// The worker process is gone and reaped: the driver dropped its imports.
    pub fn worker_reaped(&mut self, worker: WorkerId) {
        self.reaped.insert(worker);
        self.imports.retain(|(w, _), _| *w != worker);
        self.holders.retain(|(w, _), _| *w != worker);
    }

    /// The parent is about to handle the reaping of `worker`: until
    /// [`Auditor::check_settled`], every release and failed job must be that worker's.
    pub fn parent_handles_reap(&mut self, worker: WorkerId) {
        self.parent_knows_reaped.insert(worker);
        self.reaping = Some(worker);
    }

    /// Handoffs offered and not released.
    #[must_use]
    pub fn unreleased(&self) -> usize {
        self.loans
            .values()
            .filter(|l| l.offered && !l.released)
            .count()
    }

    /// Checks that hold whenever all actions are carried out.
    ///
    /// # Errors
    /// The violations found.
    pub fn check_settled(&mut self) -> Checked {
        self.reaping = None;
        let mut found = Vec::new();
        for (handoff, loan) in &self.loans {
            if let Some(worker) = loan.worker
                && loan.offered
                && !loan.released
                && self.parent_knows_reaped.contains(&worker)
            {
                found.push(Violation::new(
                    Invariant::DeathFailsOnlyItsJobs,
                    format!("{handoff} of reaped {worker} was never released"),
                ));
            }
        }
        for ((worker, alloc), n) in &self.imports {
            if *n > 1 {
                found.push(Violation::new(
                    Invariant::OneImportPerAllocation,
                    format!("{worker} holds {n} driver imports of {alloc}"),
                ));
            }
        }
        verdict(found)
    }
}
