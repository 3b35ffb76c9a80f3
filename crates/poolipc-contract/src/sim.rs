//! A simulated world for testing the contract: one [`Parent`], its [`Worker`]s as processes
//! that can crash, a network that can lose, duplicate and reorder messages, a clock that only
//! moves when told, and an [`Auditor`] that sees everything. The property tests and the fuzz
//! target drive it with sequences of [`Op`]s.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use crate::audit::Auditor;
use crate::error::ContractError;
use crate::invariant::Violation;
use crate::legacy::{ToParent, ToWorker};
use crate::parent::{Parent, ParentAction, ParentConfig, ParentEvent};
use crate::types::{
    AllocId, DType, HandoffId, JobId, Outcome, Purpose, RequestId, ResultSpec, Span, Timestamp,
    WorkerId,
};
use crate::worker::{Worker, WorkerAction, WorkerEvent};
use poolipc_types::ImportLimit;

/// The sizes the simulation uses, relative to its import limit (chunks of 1 KiB, at most 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[non_exhaustive]
pub enum SizeClass {
    /// One chunk or less.
    Small,
    /// Exactly the limit, chunk aligned.
    AtLimit,
    /// The limit's size, but starting inside a chunk: one chunk too many.
    Unaligned,
    /// Far above the limit.
    Huge,
}

/// The simulation's chunk size.
pub const SIM_CHUNK: u64 = 1024;
/// The simulation's most chunks per import.
pub const SIM_MAX_CHUNKS: u64 = 4;

/// The simulation's pointer limit.
#[must_use]
pub fn sim_limit() -> ImportLimit {
    ImportLimit::new(SIM_CHUNK, SIM_MAX_CHUNKS).unwrap_or_default()
}

/// One step of a test: a command to a side, a delivery, a fault, or time passing. Indices
/// (`worker`, `pick`) are taken modulo what exists, so every sequence is meaningful.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[non_exhaustive]
pub enum Op {
    /// Start a worker (at most [`World::MAX_WORKERS`]).
    SpawnWorker,
    /// The caller makes a new tensor and lends it.
    LendNew {
        /// Worker index.
        worker: u8,
        /// Job number.
        job: u8,
        /// Its size.
        size: SizeClass,
    },
    /// The caller lends a tensor it still holds (again, or to another worker).
    LendAgain {
        /// Worker index.
        worker: u8,
        /// Job number.
        job: u8,
        /// Which held tensor.
        pick: u8,
    },
    /// The caller drops a tensor it holds.
    DropTensor {
        /// Which held tensor.
        pick: u8,
    },
    /// A worker asks for result memory.
    RequestResult {
        /// Worker index.
        worker: u8,
        /// Job number.
        job: u8,
        /// Result size.
        size: SizeClass,
    },
    /// The parent's facade allocates for a pending result request.
    AllocateResult {
        /// Which pending request.
        pick: u8,
        /// The size allocated (may be above the limit, or too small).
        size: SizeClass,
    },
    /// The parent's facade declines a pending result request.
    DeclineResult {
        /// Which pending request.
        pick: u8,
    },
    /// Deliver the oldest in-flight message to a worker.
    DeliverToWorker {
        /// Worker index (among workers with messages in flight).
        worker: u8,
    },
    /// Deliver the oldest in-flight message from a worker to the parent.
    DeliverToParent {
        /// Worker index (among workers with messages in flight).
        worker: u8,
    },
    /// Move an in-flight message behind all others.
    Reorder {
        /// Worker index.
        worker: u8,
        /// Towards the parent, or towards the worker.
        to_parent: bool,
        /// Which message.
        pick: u8,
    },
    /// Lose an in-flight message.
    Lose {
        /// Worker index.
        worker: u8,
        /// Towards the parent, or towards the worker.
        to_parent: bool,
        /// Which message.
        pick: u8,
    },
    /// Duplicate an in-flight message.
    Duplicate {
        /// Worker index.
        worker: u8,
        /// Towards the parent, or towards the worker.
        to_parent: bool,
        /// Which message.
        pick: u8,
    },
    /// The worker touches memory it holds.
    Access {
        /// Worker index.
        worker: u8,
        /// Which held handoff.
        pick: u8,
    },
    /// The worker is done with memory it holds.
    Finish {
        /// Worker index.
        worker: u8,
        /// Which held handoff.
        pick: u8,
    },
    /// The parent cancels a job.
    Cancel {
        /// Worker index (among workers holding or being sent handoffs, if any).
        worker: u8,
        /// Job number.
        job: u8,
    },
    /// Time passes.
    Advance {
        /// Milliseconds.
        millis: u16,
    },
    /// The parent's timer fires.
    Timeout,
    /// The worker process dies.
    Crash {
        /// Worker index (among workers holding or being sent handoffs, if any).
        worker: u8,
    },
    /// A dead worker process is reaped.
    Reap {
        /// Worker index (among dead workers).
        worker: u8,
    },
    /// The parent shuts down.
    Shutdown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Process {
    Running,
    Dead,
    Reaped,
}

#[derive(Debug)]
struct SimWorker {
    id: WorkerId,
    machine: Worker,
    process: Process,
    to_worker: Vec<ToWorker>,
    to_parent: Vec<ToParent>,
    usable: Vec<HandoffId>,
    /// Jobs that had memory usable on this worker, to aim cancellations at.
    usable_jobs: Vec<JobId>,
    next_request: u64,
    condemned: bool,
}

fn move_to_back<T>(queue: &mut Vec<T>, pick: u8) {
    if !queue.is_empty() {
        let m = queue.remove(usize::from(pick) % queue.len());
        queue.push(m);
    }
}

/// A failed step: the invariants broken and the reference model's disagreements.
#[derive(Debug, Clone, Default)]
pub struct Failure {
    /// Broken invariants.
    pub violations: Vec<Violation>,
    /// Where the machines disagree with the reference model.
    pub mismatches: Vec<String>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for v in &self.violations {
            writeln!(f, "{v}")?;
        }
        for m in &self.mismatches {
            writeln!(f, "model: {m}")?;
        }
        Ok(())
    }
}

/// The simulated world. See the module docs.
#[derive(Debug)]
pub struct World {
    parent: Parent,
    workers: Vec<SimWorker>,
    auditor: Auditor,
    now: Timestamp,
    next_alloc: u64,
    held_tensors: Vec<(AllocId, Span)>,
    spans: BTreeMap<AllocId, Span>,
    alloc_requests: Vec<(WorkerId, RequestId, ResultSpec)>,
    cancelled: BTreeSet<(WorkerId, JobId)>,
    shutting_down: bool,
    failure: Failure,
    coverage: BTreeMap<&'static str, u64>,
    #[cfg(test)]
    mutation: Option<crate::mutation::Mutation>,
}

impl Default for World {
    fn default() -> Self {
        World::new()
    }
}

impl World {
    /// The most workers a world starts.
    pub const MAX_WORKERS: usize = 3;
    /// The parent's handoff deadline in the simulation.
    pub const HANDOFF_TIMEOUT: Duration = Duration::from_millis(100);

    /// A world with a parent and no workers.
    #[must_use]
    pub fn new() -> World {
        let config = ParentConfig {
            limit: sim_limit(),
            handoff_timeout: World::HANDOFF_TIMEOUT,
        };
        World {
            parent: Parent::new(config),
            workers: Vec::new(),
            auditor: Auditor::new(sim_limit()),
            now: Timestamp(0),
            next_alloc: 1,
            held_tensors: Vec::new(),
            spans: BTreeMap::new(),
            alloc_requests: Vec::new(),
            cancelled: BTreeSet::new(),
            shutting_down: false,
            failure: Failure::default(),
            coverage: BTreeMap::new(),
            #[cfg(test)]
            mutation: None,
        }
    }

    #[cfg(test)]
    pub(crate) fn with_mutation(mutation: Option<crate::mutation::Mutation>) -> World {
        let mut world = World::new();
        world.parent.mutation = mutation;
        world.mutation = mutation;
        world
    }

    /// How often each kind of path was taken so far (action kinds, outcomes, dedupe), to show
    /// that a test reaches them.
    #[must_use]
    pub fn coverage(&self) -> &BTreeMap<&'static str, u64> {
        &self.coverage
    }

    fn count(&mut self, what: &'static str) {
        *self.coverage.entry(what).or_insert(0) += 1;
    }

    /// Workers started so far.
    #[must_use]
    pub fn workers_started(&self) -> usize {
        self.workers.len()
    }

    /// The parent machine.
    #[must_use]
    pub fn parent(&self) -> &Parent {
        &self.parent
    }

    /// Apply one op, carry out every action it causes, and check every invariant.
    ///
    /// # Errors
    /// The violations and model disagreements found in this step.
    pub fn step(&mut self, op: &Op) -> Result<(), Failure> {
        self.apply(op);
        self.drain();
        self.settle();
        let failure = std::mem::take(&mut self.failure);
        if failure.violations.is_empty() && failure.mismatches.is_empty() {
            Ok(())
        } else {
            Err(failure)
        }
    }

    fn note(&mut self, checked: Result<(), Vec<Violation>>) {
        if let Err(mut v) = checked {
            self.failure.violations.append(&mut v);
        }
    }

    fn mismatch(&mut self, what: String) {
        self.failure.mismatches.push(what);
    }

    fn worker_index(&self, worker: u8) -> Option<usize> {
        if self.workers.is_empty() {
            None
        } else {
            Some(usize::from(worker) % self.workers.len())
        }
    }

    /// Like `worker_index`, but among the workers for which `busy` holds, so deliveries and
    /// finishes are never wasted on an idle worker.
    fn busy_worker(&self, worker: u8, busy: impl Fn(&SimWorker) -> bool) -> Option<usize> {
        let candidates: Vec<usize> = (0..self.workers.len())
            .filter(|&i| busy(&self.workers[i]))
            .collect();
        if candidates.is_empty() {
            None
        } else {
            Some(candidates[usize::from(worker) % candidates.len()])
        }
    }

    fn size(&mut self, size: SizeClass) -> Span {
        let base = self.next_alloc * 64 * SIM_CHUNK;
        match size {
            SizeClass::Small => Span {
                ptr: base,
                bytes: 256,
            },
            SizeClass::AtLimit => Span {
                ptr: base,
                bytes: SIM_CHUNK * SIM_MAX_CHUNKS,
            },
            SizeClass::Unaligned => Span {
                ptr: base + 512,
                bytes: SIM_CHUNK * SIM_MAX_CHUNKS,
            },
            SizeClass::Huge => Span {
                ptr: base,
                bytes: SIM_CHUNK * 40,
            },
        }
    }

    fn fresh_alloc(&mut self, size: SizeClass) -> (AllocId, Span) {
        let span = self.size(size);
        let alloc = AllocId(self.next_alloc);
        self.next_alloc += 1;
        self.auditor.parent_allocated(alloc, span);
        self.spans.insert(alloc, span);
        (alloc, span)
    }

    /// What the reference model expects of a lend.
    fn lend_should_succeed(&self, index: usize, job: JobId, span: Span) -> bool {
        let w = &self.workers[index];
        w.process == Process::Running
            && !w.condemned
            && !self.shutting_down
            && !self.cancelled.contains(&(w.id, job))
            && sim_limit().admits(span)
    }

    fn lend(&mut self, index: usize, job: JobId, alloc: AllocId, span: Span) {
        let expected = self.lend_should_succeed(index, job, span);
        let worker = self.workers[index].id;
        let got = self.parent.lend(worker, job, alloc, span, self.now);
        // The actions are audited before the model compares, so a mutation shows as the
        // invariant it breaks.
        self.drain();
        if got.is_ok() != expected {
            self.mismatch(format!(
                "lend of {alloc} ({span:?}) to {worker} for {job}: expected success {expected}, got {got:?}"
            ));
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::SpawnWorker => {
                if self.workers.len() < World::MAX_WORKERS {
                    let id = WorkerId(u32::try_from(self.workers.len()).unwrap_or(u32::MAX));
                    let added = self.parent.add_worker(id);
                    if added.is_ok() == self.shutting_down {
                        self.mismatch(format!(
                            "adding {id} while shutting down={}: {added:?}",
                            self.shutting_down
                        ));
                    }
                    if added.is_ok() {
                        #[cfg(test)]
                        let machine = Worker::with_mutation(self.mutation);
                        #[cfg(not(test))]
                        let machine = Worker::new();
                        self.workers.push(SimWorker {
                            id,
                            machine,
                            process: Process::Running,
                            to_worker: Vec::new(),
                            to_parent: Vec::new(),
                            usable: Vec::new(),
                            usable_jobs: Vec::new(),
                            next_request: 0,
                            condemned: false,
                        });
                    }
                }
            }
            Op::LendNew { worker, job, size } => {
                if let Some(i) = self.worker_index(worker) {
                    let (alloc, span) = self.fresh_alloc(size);
                    self.held_tensors.push((alloc, span));
                    self.lend(i, JobId(u64::from(job % 4)), alloc, span);
                }
            }
            Op::LendAgain { worker, job, pick } => {
                if let (Some(i), false) = (self.worker_index(worker), self.held_tensors.is_empty())
                {
                    let (alloc, span) =
                        self.held_tensors[usize::from(pick) % self.held_tensors.len()];
                    self.lend(i, JobId(u64::from(job % 4)), alloc, span);
                }
            }
            Op::DropTensor { pick } => {
                if !self.held_tensors.is_empty() {
                    let (alloc, _) = self
                        .held_tensors
                        .remove(usize::from(pick) % self.held_tensors.len());
                    let checked = self.auditor.caller_dropped(alloc);
                    self.note(checked);
                }
            }
            Op::RequestResult { worker, job, size } => {
                if let Some(i) = self.worker_index(worker) {
                    let w = &mut self.workers[i];
                    if w.process == Process::Running {
                        let bytes = match size {
                            SizeClass::Small => 256,
                            SizeClass::AtLimit | SizeClass::Unaligned => SIM_CHUNK * SIM_MAX_CHUNKS,
                            SizeClass::Huge => SIM_CHUNK * 40,
                        };
                        let spec = ResultSpec {
                            shape: vec![bytes / 4],
                            dtype: DType::F32,
                            bytes,
                        };
                        let request = RequestId(w.next_request);
                        w.next_request += 1;
                        let _ = w
                            .machine
                            .request_result(JobId(u64::from(job % 4)), request, spec);
                    }
                }
            }
            Op::AllocateResult { pick, size } => {
                if !self.alloc_requests.is_empty() {
                    let (worker, request, _) = self
                        .alloc_requests
                        .remove(usize::from(pick) % self.alloc_requests.len());
                    let (alloc, span) = self.fresh_alloc(size);
                    let _ = self.parent.handle(
                        ParentEvent::ResultAllocated {
                            worker,
                            request,
                            alloc,
                            span,
                        },
                        self.now,
                    );
                    // The caller's only reference is the contract's: once the contract
                    // frees or releases it, the allocation is gone or the caller's result.
                    self.drain();
                    let checked = self.auditor.caller_dropped(alloc);
                    self.note(checked);
                }
            }
            Op::DeclineResult { pick } => {
                if !self.alloc_requests.is_empty() {
                    let (worker, request, _) = self
                        .alloc_requests
                        .remove(usize::from(pick) % self.alloc_requests.len());
                    let _ = self
                        .parent
                        .handle(ParentEvent::ResultDeclined { worker, request }, self.now);
                }
            }
            Op::DeliverToWorker { worker } => {
                let busy = |w: &SimWorker| w.process == Process::Running && !w.to_worker.is_empty();
                if let Some(i) = self.busy_worker(worker, busy) {
                    let w = &mut self.workers[i];
                    if w.process == Process::Running && !w.to_worker.is_empty() {
                        let msg = w.to_worker.remove(0);
                        if let Err(e) = w.machine.handle(WorkerEvent::Message(msg), self.now) {
                            self.count(match e {
                                ContractError::StaleOffer(_) => "worker refused a stale offer",
                                _ => "worker refused a message",
                            });
                        }
                    }
                }
            }
            Op::DeliverToParent { worker } => {
                if let Some(i) = self.busy_worker(worker, |w| !w.to_parent.is_empty()) {
                    let w = &mut self.workers[i];
                    if !w.to_parent.is_empty() {
                        let message = w.to_parent.remove(0);
                        let id = w.id;
                        self.auditor.delivered_to_parent(id, &message);
                        let got = self.parent.handle(
                            ParentEvent::Message {
                                worker: id,
                                message,
                            },
                            self.now,
                        );
                        if let Err(e) = got {
                            self.count(match e {
                                ContractError::WorkerGone(_) => "parent refused a late message",
                                ContractError::UnknownHandoff(_) => {
                                    "parent refused a duplicate ack"
                                }
                                _ => "parent refused a message",
                            });
                        }
                    }
                }
            }
            Op::Reorder {
                worker,
                to_parent,
                pick,
            } => {
                if let Some(i) = self.worker_index(worker) {
                    let w = &mut self.workers[i];
                    if to_parent {
                        move_to_back(&mut w.to_parent, pick);
                    } else {
                        move_to_back(&mut w.to_worker, pick);
                    }
                }
            }
            Op::Lose {
                worker,
                to_parent,
                pick,
            } => {
                if let Some(i) = self.worker_index(worker) {
                    let w = &mut self.workers[i];
                    if to_parent && !w.to_parent.is_empty() {
                        w.to_parent.remove(usize::from(pick) % w.to_parent.len());
                    } else if !to_parent && !w.to_worker.is_empty() {
                        w.to_worker.remove(usize::from(pick) % w.to_worker.len());
                    }
                }
            }
            Op::Duplicate {
                worker,
                to_parent,
                pick,
            } => {
                if let Some(i) = self.worker_index(worker) {
                    let w = &mut self.workers[i];
                    if to_parent && !w.to_parent.is_empty() {
                        let m = w.to_parent[usize::from(pick) % w.to_parent.len()].clone();
                        w.to_parent.push(m);
                    } else if !to_parent && !w.to_worker.is_empty() {
                        let m = w.to_worker[usize::from(pick) % w.to_worker.len()].clone();
                        w.to_worker.push(m);
                    }
                }
            }
            Op::Access { worker, pick } => {
                let busy = |w: &SimWorker| w.process == Process::Running && !w.usable.is_empty();
                if let Some(i) = self.busy_worker(worker, busy) {
                    let w = &self.workers[i];
                    if w.process == Process::Running && !w.usable.is_empty() {
                        let handoff = w.usable[usize::from(pick) % w.usable.len()];
                        let id = w.id;
                        let checked = self.auditor.accessed(id, handoff);
                        self.note(checked);
                    }
                }
            }
            Op::Finish { worker, pick } => {
                let busy = |w: &SimWorker| w.process == Process::Running && !w.usable.is_empty();
                if let Some(i) = self.busy_worker(worker, busy) {
                    let w = &mut self.workers[i];
                    if w.process == Process::Running && !w.usable.is_empty() {
                        let handoff = w.usable.remove(usize::from(pick) % w.usable.len());
                        if let Err(e) = w.machine.finish(handoff) {
                            let what = format!("finishing usable {handoff} failed: {e}");
                            self.mismatch(what);
                        }
                    }
                }
            }
            Op::Cancel { worker, job } => {
                let holding = |w: &SimWorker| !w.usable.is_empty() || !w.to_worker.is_empty();
                if let Some(i) = self
                    .busy_worker(worker, holding)
                    .or(self.worker_index(worker))
                {
                    let w = &self.workers[i];
                    let id = w.id;
                    // Mostly a job that has handoffs out; sometimes any job.
                    let job = if job % 2 == 0 && !w.usable_jobs.is_empty() {
                        w.usable_jobs[usize::from(job / 2) % w.usable_jobs.len()]
                    } else {
                        JobId(u64::from(job % 4))
                    };
                    if self.parent.cancel(id, job).is_ok() {
                        self.cancelled.insert((id, job));
                    }
                }
            }
            Op::Advance { millis } => {
                self.now = self
                    .now
                    .saturating_add(Duration::from_millis(u64::from(millis)));
            }
            Op::Timeout => {
                if self.parent.poll_timeout().is_some_and(|t| t <= self.now) {
                    self.count("deadline expired");
                    self.parent.handle_timeout(self.now);
                }
            }
            Op::Crash { worker } => {
                // Mid-handoff deaths are the interesting ones: prefer a worker holding some.
                let holding = |w: &SimWorker| {
                    w.process == Process::Running
                        && (!w.usable.is_empty() || !w.to_worker.is_empty())
                };
                if let Some(i) = self
                    .busy_worker(worker, holding)
                    .or(self.worker_index(worker))
                {
                    self.crash(i);
                }
            }
            Op::Reap { worker } => {
                if let Some(i) = self.worker_index(worker)
                    && self.workers[i].process == Process::Dead
                {
                    let id = self.workers[i].id;
                    self.workers[i].process = Process::Reaped;
                    self.auditor.worker_reaped(id);
                    self.auditor.parent_handles_reap(id);
                    let got = self
                        .parent
                        .handle(ParentEvent::WorkerReaped { worker: id }, self.now);
                    if let Err(e) = got {
                        self.mismatch(format!("reaping {id} refused: {e}"));
                    }
                    self.drain();
                    let left = self.parent.outstanding_for(id);
                    if left != 0 {
                        self.mismatch(format!(
                            "{id} reaped but the parent still counts {left} of its handoffs"
                        ));
                    }
                }
            }
            Op::Shutdown => {
                self.shutting_down = true;
                self.parent.shutdown();
            }
        }
    }

    fn crash(&mut self, i: usize) {
        let w = &mut self.workers[i];
        if w.process != Process::Running {
            return;
        }
        w.process = Process::Dead;
        w.condemned = true;
        w.to_worker.clear();
        w.usable.clear();
        w.usable_jobs.clear();
        let id = w.id;
        let _ = self
            .parent
            .handle(ParentEvent::WorkerHungUp { worker: id }, self.now);
    }

    /// Carry out every action both sides have queued, until none is left.
    fn drain(&mut self) {
        loop {
            let mut progressed = false;
            while let Some(action) = self.parent.poll_action() {
                progressed = true;
                let checked = self.auditor.parent_action(&action);
                self.note(checked);
                self.carry_out_parent(action);
            }
            for i in 0..self.workers.len() {
                while let Some(action) = self.workers[i].machine.poll_action() {
                    progressed = true;
                    let id = self.workers[i].id;
                    let checked = self.auditor.worker_action(id, &action);
                    self.note(checked);
                    self.count(match &action {
                        WorkerAction::Usable { .. } => "worker: usable",
                        WorkerAction::Send(ToParent::Ack { .. }) => "worker: ack",
                        WorkerAction::Send(ToParent::ResultRequest { .. }) => "worker: request",
                        _ => "worker: other",
                    });
                    if let WorkerAction::Usable { alloc, .. } = &action {
                        let shared = self.workers[i]
                            .machine
                            .imports()
                            .any(|(a, n)| a == *alloc && n > 1);
                        if shared {
                            self.count("import shared by two handoffs");
                        }
                    }
                    let w = &mut self.workers[i];
                    match action {
                        WorkerAction::Send(msg) => w.to_parent.push(msg),
                        WorkerAction::Usable { handoff, job, .. } => {
                            w.usable.push(handoff);
                            w.usable_jobs.push(job);
                        }
                        _ => {}
                    }
                }
            }
            if !progressed {
                break;
            }
        }
    }

    fn carry_out_parent(&mut self, action: ParentAction) {
        self.count(match &action {
            ParentAction::Export { .. } => "export",
            ParentAction::Send {
                message: ToWorker::Offer(o),
                ..
            } => match o.purpose {
                Purpose::Input => "offer input",
                Purpose::Result { .. } => "offer result",
            },
            ParentAction::Send {
                message: ToWorker::ResultRefused { .. },
                ..
            } => "refuse result",
            ParentAction::Send {
                message: ToWorker::Cancel { .. },
                ..
            } => "cancel",
            ParentAction::Send {
                message: ToWorker::Shutdown,
                ..
            } => "shutdown",
            ParentAction::FreeResult { .. } => "free unused result",
            ParentAction::Release {
                outcome: Outcome::Completed,
                ..
            } => "release completed",
            ParentAction::Release {
                outcome: Outcome::Cancelled,
                ..
            } => "release cancelled",
            ParentAction::Release {
                outcome: Outcome::Failed,
                ..
            } => "release failed",
            ParentAction::KillWorker { .. } => "kill worker",
            ParentAction::ShutdownComplete => "shutdown complete",
            _ => "other parent action",
        });
        match action {
            ParentAction::Send { worker, message } => {
                if let Some(w) = self.workers.iter_mut().find(|w| w.id == worker)
                    && w.process == Process::Running
                {
                    w.to_worker.push(message);
                }
            }
            ParentAction::AllocateResult {
                worker,
                request,
                spec,
                ..
            } => {
                self.alloc_requests.push((worker, request, spec));
            }
            ParentAction::KillWorker { worker } => {
                if let Some(i) = self.workers.iter().position(|w| w.id == worker) {
                    self.workers[i].condemned = true;
                    self.crash(i);
                }
            }
            ParentAction::JobFailed { worker, .. } => {
                if let Some(w) = self.workers.iter_mut().find(|w| w.id == worker) {
                    w.condemned = true;
                }
            }
            ParentAction::Release {
                alloc,
                purpose: Purpose::Result { .. },
                outcome: Outcome::Completed,
                ..
            } => {
                // The result is the caller's tensor now; it may lend it on.
                if let Some(span) = self.spans.get(&alloc) {
                    self.held_tensors.push((alloc, *span));
                }
            }
            _ => {}
        }
    }

    fn settle(&mut self) {
        let checked = self.auditor.check_settled();
        self.note(checked);
        if !self.failure.violations.is_empty() {
            return;
        }
        let (ours, audited) = (self.parent.outstanding(), self.auditor.unreleased());
        if ours != audited {
            self.mismatch(format!(
                "the parent counts {ours} outstanding handoffs, the auditor {audited}"
            ));
        }
        if self.parent.is_shut_down() && (ours != 0 || !self.alloc_requests.is_empty()) {
            self.mismatch(format!(
                "shut down with {ours} handoffs and {} result allocations outstanding",
                self.alloc_requests.len()
            ));
        }
        for w in &self.workers {
            let expected = w.process == Process::Running && !w.condemned;
            if self.parent.is_live(w.id) != expected {
                let what = format!(
                    "{} is {:?}, condemned: {}, but the parent says live: {}",
                    w.id, w.process, w.condemned, !expected
                );
                self.failure.mismatches.push(what);
            }
        }
    }
}
