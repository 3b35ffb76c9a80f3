//! A simulated world for testing the contract: one [`Parent`], its [`Worker`]s as processes
//! that can crash, stop, or send garbage, a network that can lose, duplicate and reorder
//! messages, a caller whose allocator answers result requests late (or over the limit, or
//! by staging), a clock that only moves when told, and an [`Auditor`] that sees everything.
//! The property tests and the fuzz target drive it with sequences of [`Op`]s.
//!
//! Host-staged bytes are not modelled as frames: a [`ParentAction::SendStaged`] or
//! [`WorkerAction::SendStaged`] stands for bytes that arrive with the message before it.
//!
//! Why this file is long: one `World` takes every `Op` and carries out every action of both machines.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use crate::Layout;
use crate::audit::Auditor;
use crate::invariant::Violation;
use crate::message::{
    Ack, AllocationGrant, ArenaLocation, CarvedResult, Done, ErrorCode, Lend, Message, ResultGrant,
    ResultRequest, ResultSpec, TensorMeta,
};
use crate::parent::{
    InputLoan, JobOutcome, Parent, ParentAction, ParentConfig, ParentEvent, SliceLoan,
};
use crate::types::{
    AllocId, DType, EventBlob, ExportBlob, HandoffId, JobId, Outcome, Purpose, RequestId, Rung,
    Span, Timestamp, WorkerId,
};
use crate::worker::{Worker, WorkerAction};
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

/// Where the simulated allocator puts a result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Memory {
    Pool,
    Staged,
    Arena,
}

/// A worker's misbehaviour: a message the protocol does not allow at that point. Each must
/// condemn the worker that sends it and no other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[non_exhaustive]
pub enum Fault {
    /// A `Done` naming a handoff of another job (or none that exists).
    DoneOfAnotherJob,
    /// An `Ack` of a job whose `Done` the parent has not received (or naming a stranger).
    AckBeforeDone,
    /// A second `ResultRequest` for a job whose first is not answered yet (or for a job that
    /// is not open).
    SecondResultRequest,
    /// A `ResultRequest` whose `byte_len` is not the dense size of its shape.
    LyingByteLen,
    /// An `Error` message.
    ErrorMessage,
    /// A message only the parent sends (`Lend`, `Bye`, ...).
    Unexpected,
    /// A `Done` naming a carve out of the job's slice that lies past the slice's end (or a
    /// carve of a job with no slice).
    LyingCarve,
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
    /// The caller starts a job of `inputs % 4` tensors on a worker. `plan` holds four bits per
    /// input: bit 0 lends a tensor the caller holds (else a new one of `size`), bits 1 and 2
    /// both set send it by host staging, as does a tensor above the limit unless bit 3 forces
    /// the pool pointer (which must be refused); bits 2 and 3 pick the held tensor. Bit 12
    /// lends the job's even-numbered inputs read-only, bit 13 its odd-numbered ones (a
    /// writable staged input's bytes come back after the `Done`). Bit 14 gives the job an
    /// arena slice; bit 15 lets the job go to any worker.
    StartJob {
        /// Worker index.
        worker: u8,
        /// How many inputs (modulo 4).
        inputs: u8,
        /// Four bits per input, see above.
        plan: u16,
        /// The size of new tensors.
        size: SizeClass,
    },
    /// The caller drops a tensor it holds.
    DropTensor {
        /// Which held tensor.
        pick: u8,
    },
    /// A worker asks for `count % 3` results of a started job.
    RequestResults {
        /// Worker index (among workers with started jobs).
        worker: u8,
        /// Which started job.
        pick: u8,
        /// How many results (modulo 3).
        count: u8,
        /// Their size.
        size: SizeClass,
    },
    /// The parent's allocator answers a pending result request.
    AnswerResult {
        /// Which pending request.
        pick: u8,
        /// The size allocated (may be above the limit).
        size: SizeClass,
        /// Allocate for host staging rather than pool pointer.
        staged: bool,
        /// Allocate a block of the result arena (before `staged`).
        arena: bool,
        /// Decline instead of allocating.
        decline: bool,
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
        /// Worker index (among workers holding some).
        worker: u8,
        /// Which held handoff.
        pick: u8,
    },
    /// The worker's code is done with a started job.
    Finish {
        /// Worker index (among workers with started jobs).
        worker: u8,
        /// Which started job.
        pick: u8,
    },
    /// The worker's code fails on a started job (it still finishes it).
    FailJob {
        /// Worker index (among workers with started jobs).
        worker: u8,
        /// Which started job.
        pick: u8,
    },
    /// The parent cancels an open job.
    Cancel {
        /// Worker index (among workers with open jobs, if any).
        worker: u8,
        /// Which open job.
        pick: u8,
    },
    /// The parent stops a worker (`Bye`).
    StopWorker {
        /// Worker index.
        worker: u8,
    },
    /// A worker sends garbage, delivered at once.
    Garbage {
        /// Worker index.
        worker: u8,
        /// What kind.
        fault: Fault,
        /// Which job or message it is about.
        pick: u8,
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
    to_worker: Vec<Message>,
    to_parent: Vec<Message>,
    /// Jobs whose inputs are usable and that the worker's code has not finished.
    started: Vec<JobId>,
    /// Handoffs the worker's code may touch, with their job.
    usable: Vec<(JobId, HandoffId)>,
    /// Started jobs whose result request is not granted yet.
    requested: BTreeSet<JobId>,
    /// The parent killed it, it crashed, or hung up: the parent must no longer count it live.
    condemned: bool,
    /// The parent said `Bye` to it.
    stopping: bool,
}

fn move_to_back<T>(queue: &mut Vec<T>, pick: u8) {
    if !queue.is_empty() {
        let m = queue.remove(usize::from(pick) % queue.len());
        queue.push(m);
    }
}

fn pick<T: Copy>(items: &[T], pick: u8) -> Option<T> {
    (!items.is_empty()).then(|| items[usize::from(pick) % items.len()])
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

/// What the world expects of a job the parent has open.
#[derive(Debug, Default, Clone)]
struct OpenJob {
    handoffs: Vec<HandoffId>,
}

/// The simulated world. See the module docs.
#[derive(Debug)]
pub struct World {
    parent: Parent,
    workers: Vec<SimWorker>,
    auditor: Auditor,
    now: Timestamp,
    next_alloc: u64,
    next_job: u64,
    held_tensors: Vec<(AllocId, Span)>,
    spans: BTreeMap<AllocId, Span>,
    /// Result requests the parent asked its allocator for, not answered yet.
    alloc_requests: Vec<(WorkerId, JobId, RequestId)>,
    /// The jobs the parent must count open.
    open_jobs: BTreeMap<(WorkerId, JobId), OpenJob>,
    /// Result allocations answered and neither granted nor freed yet.
    unoffered: BTreeSet<AllocId>,
    /// Jobs whose `Done` (a real one) reached the parent.
    done_delivered: BTreeSet<(WorkerId, JobId)>,
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

fn blob_of(tag: u8, id: u64) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[0] = tag;
    b[1..9].copy_from_slice(&id.to_le_bytes());
    b
}

fn ready_blob(worker: WorkerId, job: JobId) -> EventBlob {
    let mut b = blob_of(1, job.0);
    b[9..13].copy_from_slice(&worker.0.to_le_bytes());
    EventBlob(b)
}

fn done_blob(worker: WorkerId, job: JobId) -> EventBlob {
    let mut b = blob_of(2, job.0);
    b[9..13].copy_from_slice(&worker.0.to_le_bytes());
    EventBlob(b)
}

fn result_spec(size: SizeClass) -> ResultSpec {
    let bytes = match size {
        SizeClass::Small => 256,
        SizeClass::AtLimit | SizeClass::Unaligned => SIM_CHUNK * SIM_MAX_CHUNKS,
        SizeClass::Huge => SIM_CHUNK * 40,
    };
    ResultSpec {
        dtype: DType::F32,
        shape: vec![bytes / 4],
        byte_len: bytes,
    }
}

impl World {
    /// The most workers a world starts.
    pub const MAX_WORKERS: usize = 3;
    /// The parent's deadline in the simulation.
    pub const HANDOFF_TIMEOUT: Duration = Duration::from_millis(100);

    /// A world with a parent and no workers.
    #[must_use]
    pub fn new() -> World {
        let config = ParentConfig {
            limit: sim_limit(),
            handoff_timeout: World::HANDOFF_TIMEOUT,
            ..ParentConfig::default()
        };
        World {
            parent: Parent::new(config),
            workers: Vec::new(),
            auditor: Auditor::new(sim_limit()),
            now: Timestamp(0),
            next_alloc: 1,
            next_job: 1,
            held_tensors: Vec::new(),
            spans: BTreeMap::new(),
            alloc_requests: Vec::new(),
            open_jobs: BTreeMap::new(),
            unoffered: BTreeSet::new(),
            done_delivered: BTreeSet::new(),
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

    /// How often each kind of path was taken so far (action kinds, outcomes, faults), to
    /// show that a test reaches them.
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

    /// Apply one op, carry out every action it causes, and check every invariant (and the
    /// parent's ledger).
    ///
    /// # Errors
    /// The violations and model disagreements found in this step.
    pub fn step(&mut self, op: &Op) -> Result<(), Failure> {
        self.apply(op);
        self.drain();
        self.settle();
        let ledger = self.parent.check_ledger().map_err(|v| vec![v]);
        self.note(ledger);
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
        pick(&candidates, worker)
    }

    fn fresh_alloc(&mut self, size: SizeClass) -> (AllocId, Span) {
        let base = self.next_alloc * 64 * SIM_CHUNK;
        let span = match size {
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
        };
        let alloc = AllocId(self.next_alloc);
        self.next_alloc += 1;
        self.auditor.parent_allocated(alloc, span);
        self.spans.insert(alloc, span);
        (alloc, span)
    }

    fn connected(&self, i: usize) -> bool {
        let w = &self.workers[i];
        w.process != Process::Reaped && !w.condemned
    }

    fn start_job(&mut self, i: usize, inputs: u8, plan: u16, size: SizeClass) {
        let mut loans = Vec::new();
        let mut blocks = Vec::new();
        for n in 0..usize::from(inputs % 4) {
            let bits = (plan >> (4 * n)) & 0xf;
            let read_only = (plan >> (12 + n % 2)) & 1 == 1;
            let held = if bits & 1 == 1 {
                pick(&self.held_tensors, u8::try_from(bits >> 2).unwrap_or(0))
            } else {
                None
            };
            let (alloc, span) = match held {
                Some(t) => t,
                None => {
                    let t = self.fresh_alloc(size);
                    self.held_tensors.push(t);
                    t
                }
            };
            // As the facade does: staging when asked; when the pointer rung is not allowed,
            // an arena copy (bit 2) or staging, unless bit 3 forces the pointer (which
            // start_job must refuse); within the limit, bit 1 alone lends the tensor as a VMM
            // allocation by handle (the caller's memory, no import, READY and DONE gated).
            let over = !sim_limit().admits(span) && bits & 0b1000 == 0;
            let rung = if bits & 0b110 == 0b110 {
                Rung::HostStaging
            } else if over && bits & 0b100 != 0 {
                Rung::ArenaCopy
            } else if over {
                Rung::HostStaging
            } else if bits & 0b110 == 0b010 {
                Rung::VmmHandle
            } else {
                Rung::PoolPointer
            };
            let meta = TensorMeta {
                layout: Layout {
                    dtype: DType::U8,
                    shape: vec![span.bytes],
                    strides: vec![1],
                },
                byte_offset: 0,
                byte_len: span.bytes,
            };
            if rung == Rung::ArenaCopy {
                // The facade copies the tensor into a fresh arena block and lends the block:
                // the block is what the loan holds (the caller's tensor is not lent at all).
                let (block, block_span) = self.fresh_alloc(size);
                blocks.push(block);
                loans.push(InputLoan {
                    alloc: block,
                    span: block_span,
                    rung,
                    pool: 0,
                    export: ExportBlob([0; 64]),
                    meta,
                    arena: Some(ArenaLocation {
                        chunk: u32::try_from(block.0 % 3).unwrap_or(0),
                        offset: block.0 * 512,
                    }),
                    read_only,
                });
                continue;
            }
            loans.push(InputLoan {
                alloc,
                span,
                rung,
                pool: 0,
                export: if rung == Rung::PoolPointer {
                    ExportBlob(blob_of(3, alloc.0))
                } else {
                    ExportBlob([0; 64])
                },
                meta,
                arena: None,
                read_only,
            });
        }
        let w = &self.workers[i];
        let (id, expected) = (
            w.id,
            w.process == Process::Running && !w.condemned && !w.stopping && !self.shutting_down,
        );
        let admitted = loans
            .iter()
            .all(|l| l.rung != Rung::PoolPointer || sim_limit().admits(l.span));
        let job = JobId(self.next_job);
        self.next_job += 1;
        // The facade allocates the slice in the arena as it would an arena result, and holds
        // it only through its loan, like an arena copy's block.
        let slice = (plan & 0x4000 != 0).then(|| {
            let (alloc, span) = self.fresh_alloc(SizeClass::AtLimit);
            blocks.push(alloc);
            SliceLoan {
                alloc,
                span,
                chunk: u32::try_from(alloc.0 % 3).unwrap_or(0),
                offset: alloc.0 * 512,
            }
        });
        let got = self
            .parent
            .start_job_with_slice(id, job, ready_blob(id, job), loans, slice, self.now)
            .map(|(inputs, _)| inputs);
        // The facade owns an arena-copy block only through its loan: it drops its own hold
        // once the Lend lends the block (then the block goes back to the arena when the loan
        // is released), or at once if the job was refused.
        for block in blocks {
            if got.is_ok() {
                self.unoffered.insert(block);
            } else {
                let checked = self.auditor.caller_dropped(block);
                self.note(checked);
            }
        }
        match got {
            Ok(_) => {
                self.open_jobs.insert((id, job), OpenJob::default());
                if self.parent.jobs_of(id).len() > 1 {
                    self.count("two jobs in flight on one worker");
                }
            }
            Err(_) => {
                self.count("start_job refused");
                if let Some(action) = self.parent.poll_action() {
                    self.mismatch(format!("a refused start_job queued {action:?}"));
                    let checked = self.auditor.parent_action(&action);
                    self.note(checked);
                    self.carry_out_parent(action);
                }
            }
        }
        if got.is_ok() != (expected && admitted) {
            self.mismatch(format!(
                "start_job of {job} on {id}: expected success {}, got {got:?}",
                expected && admitted
            ));
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::SpawnWorker => self.spawn(),
            Op::StartJob {
                worker,
                inputs,
                plan,
                size,
            } => {
                // Mostly a worker that takes jobs; sometimes any.
                let live =
                    |w: &SimWorker| w.process == Process::Running && !w.condemned && !w.stopping;
                let i = if plan & 0x8000 == 0 {
                    self.busy_worker(worker, live)
                } else {
                    None
                };
                if let Some(i) = i.or(self.worker_index(worker)) {
                    self.start_job(i, inputs, plan, size);
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
            Op::RequestResults {
                worker,
                pick: p,
                count,
                size,
            } => {
                // Mostly a job without a request; sometimes any (refused while one waits).
                let busy = |w: &SimWorker| w.process == Process::Running && !w.started.is_empty();
                if let Some(i) = self.busy_worker(worker, busy) {
                    let w = &mut self.workers[i];
                    let free: Vec<JobId> = w
                        .started
                        .iter()
                        .copied()
                        .filter(|j| !w.requested.contains(j) || count == 0)
                        .collect();
                    if let Some(job) = pick(&free, p) {
                        let specs: Vec<ResultSpec> =
                            (0..count % 3).map(|_| result_spec(size)).collect();
                        if let Ok(Some(_)) = w.machine.carve_results(job, &specs) {
                            self.count("slice carved");
                        } else if w.machine.request_results(job, specs).is_ok() {
                            w.requested.insert(job);
                        } else {
                            self.count("worker: second request refused");
                        }
                    }
                }
            }
            Op::AnswerResult {
                pick,
                size,
                staged,
                arena,
                decline,
            } => {
                let memory = if arena {
                    Memory::Arena
                } else if staged {
                    Memory::Staged
                } else {
                    Memory::Pool
                };
                self.answer(pick, size, memory, decline);
            }
            Op::DeliverToWorker { worker } => {
                let busy = |w: &SimWorker| w.process == Process::Running && !w.to_worker.is_empty();
                if let Some(i) = self.busy_worker(worker, busy) {
                    let w = &mut self.workers[i];
                    let msg = w.to_worker.remove(0);
                    if w.machine.handle(msg, self.now).is_err() {
                        self.count("worker refused a stale message");
                    }
                }
            }
            Op::DeliverToParent { worker } => {
                if let Some(i) = self.busy_worker(worker, |w| !w.to_parent.is_empty()) {
                    let message = self.workers[i].to_parent.remove(0);
                    self.deliver_to_parent(i, message);
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
                    let queue = if to_parent {
                        &mut w.to_parent
                    } else {
                        &mut w.to_worker
                    };
                    if !queue.is_empty() {
                        queue.remove(usize::from(pick) % queue.len());
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
                    let queue = if to_parent {
                        &mut w.to_parent
                    } else {
                        &mut w.to_worker
                    };
                    if !queue.is_empty() {
                        let m = queue[usize::from(pick) % queue.len()].clone();
                        queue.push(m);
                    }
                }
            }
            Op::Access { worker, pick: p } => {
                let busy = |w: &SimWorker| w.process == Process::Running && !w.usable.is_empty();
                if let Some(i) = self.busy_worker(worker, busy)
                    && let Some((_, handoff)) = pick(&self.workers[i].usable, p)
                {
                    let checked = self.auditor.accessed(self.workers[i].id, handoff);
                    self.note(checked);
                }
            }
            Op::Finish { worker, pick: p } => {
                // Mostly a job not waiting for its grant; sometimes any (then refused).
                let busy = |w: &SimWorker| w.process == Process::Running && !w.started.is_empty();
                if let Some(i) = self.busy_worker(worker, busy) {
                    let w = &mut self.workers[i];
                    let id = w.id;
                    let ready: Vec<JobId> = w
                        .started
                        .iter()
                        .copied()
                        .filter(|j| !w.requested.contains(j) || p % 8 == 0)
                        .collect();
                    if let Some(job) = pick(&ready, p) {
                        if w.machine.finish_job(job, done_blob(id, job)).is_ok() {
                            w.started.retain(|j| *j != job);
                            w.usable.retain(|(j, _)| *j != job);
                            self.auditor.worker_finishing(id, job);
                        } else {
                            self.count("worker: finish waits for its grant");
                        }
                    }
                }
            }
            Op::FailJob { worker, pick: p } => {
                let busy = |w: &SimWorker| w.process == Process::Running && !w.started.is_empty();
                if let Some(i) = self.busy_worker(worker, busy) {
                    let w = &mut self.workers[i];
                    if let Some(job) = pick(&w.started, p) {
                        let failed = w.machine.fail_job(job, "the worker's code failed".into());
                        if let Err(e) = failed {
                            self.mismatch(format!("fail_job of started {job}: {e}"));
                        }
                    }
                }
            }
            Op::Cancel { worker, pick: p } => {
                let open: Vec<usize> = (0..self.workers.len())
                    .filter(|&i| !self.parent.jobs_of(self.workers[i].id).is_empty())
                    .collect();
                if let Some(i) = crate::sim::pick(&open, worker).or(self.worker_index(worker)) {
                    let id = self.workers[i].id;
                    let jobs = self.parent.jobs_of(id);
                    let job = pick(&jobs, p).unwrap_or(JobId(0));
                    let got = self.parent.cancel(id, job, self.now);
                    let expected = self.connected(i) && !jobs.is_empty();
                    if got.is_ok() != expected {
                        self.mismatch(format!(
                            "cancel of {job} on {id}: expected success {expected}, got {got:?}"
                        ));
                    }
                }
            }
            Op::StopWorker { worker } => {
                if let Some(i) = self.worker_index(worker) {
                    let id = self.workers[i].id;
                    let got = self.parent.stop_worker(id);
                    if got.is_ok() != self.connected(i) {
                        self.mismatch(format!("stop_worker of {id}: got {got:?}"));
                    }
                    if got.is_ok() {
                        self.workers[i].stopping = true;
                    }
                }
            }
            Op::Garbage {
                worker,
                fault,
                pick,
            } => {
                if let Some(i) = self.worker_index(worker)
                    && self.workers[i].process == Process::Running
                {
                    self.garbage(i, fault, pick);
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
                    self.crash(i, "crashed");
                }
            }
            Op::Reap { worker } => {
                if let Some(i) = self.busy_worker(worker, |w| w.process == Process::Dead) {
                    self.reap(i);
                }
            }
            Op::Shutdown => {
                self.shutting_down = true;
                self.parent.shutdown();
                for i in 0..self.workers.len() {
                    if self.connected(i) {
                        self.workers[i].stopping = true;
                    }
                }
            }
        }
    }

    fn spawn(&mut self) {
        if self.workers.len() >= World::MAX_WORKERS {
            return;
        }
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
                started: Vec::new(),
                usable: Vec::new(),
                requested: BTreeSet::new(),
                condemned: false,
                stopping: false,
            });
        }
    }

    fn answer(&mut self, p: u8, size: SizeClass, memory: Memory, decline: bool) {
        if self.alloc_requests.is_empty() {
            return;
        }
        let (worker, _, request) = self
            .alloc_requests
            .remove(usize::from(p) % self.alloc_requests.len());
        self.answer_request(worker, request, size, memory, decline);
    }

    fn answer_request(
        &mut self,
        worker: WorkerId,
        request: RequestId,
        size: SizeClass,
        memory: Memory,
        decline: bool,
    ) {
        if decline {
            let got = self.parent.handle(
                ParentEvent::ResultDeclined {
                    worker,
                    request,
                    code: ErrorCode::OUT_OF_MEMORY,
                    message: "no memory in the simulation".into(),
                },
                self.now,
            );
            if let Err(e) = got {
                self.mismatch(format!("declining {request} refused: {e}"));
            }
            return;
        }
        let (alloc, span) = self.fresh_alloc(size);
        let staged = memory == Memory::Staged;
        let event = if memory == Memory::Arena {
            // Any location: the worker machine does not resolve it, the facade does.
            ParentEvent::ResultAllocatedInArena {
                worker,
                request,
                alloc,
                span,
                chunk: u32::try_from(alloc.0 % 3).unwrap_or(0),
                offset: alloc.0 * 512,
            }
        } else {
            ParentEvent::ResultAllocated {
                worker,
                request,
                alloc,
                span,
                rung: if staged {
                    Rung::HostStaging
                } else {
                    Rung::PoolPointer
                },
                pool: 0,
                export: if staged {
                    ExportBlob([0; 64])
                } else {
                    ExportBlob(blob_of(3, alloc.0))
                },
            }
        };
        let got = self.parent.handle(event, self.now);
        if let Err(e) = got {
            self.mismatch(format!("allocating for {request} refused: {e}"));
        }
        // From here the caller's only reference is the contract's: it is dropped once the
        // grant lends it (then released to the caller, or freed) or the contract frees it.
        self.unoffered.insert(alloc);
    }

    fn deliver_to_parent(&mut self, i: usize, message: Message) {
        let id = self.workers[i].id;
        if !self.connected(i) {
            self.count("parent ignored a late message");
        }
        if let Message::Done(d) = &message {
            self.done_delivered.insert((id, d.job));
        }
        self.auditor.delivered_to_parent(id, &message);
        let got = self.parent.handle(
            ParentEvent::Received {
                worker: id,
                message,
            },
            self.now,
        );
        if let Err(e) = got {
            self.mismatch(format!("a message from {id} came back as an error: {e}"));
        }
    }

    fn garbage(&mut self, i: usize, fault: Fault, p: u8) {
        let id = self.workers[i].id;
        let jobs = self.parent.jobs_of(id);
        let job = pick(&jobs, p).unwrap_or(JobId(u64::MAX));
        let handoffs = |w: &World, job: JobId| {
            w.open_jobs
                .get(&(id, job))
                .map(|j| j.handoffs.clone())
                .unwrap_or_default()
        };
        let stranger = HandoffId(u64::MAX);
        let message = match fault {
            Fault::DoneOfAnotherJob => {
                let other = jobs.iter().copied().find(|j| *j != job);
                let handle = other
                    .and_then(|o| handoffs(self, o).first().copied())
                    .unwrap_or(stranger);
                Message::Done(Done {
                    job,
                    done_event: done_blob(id, job),
                    handles: vec![handle],
                    carved: Vec::new(),
                })
            }
            Fault::AckBeforeDone => {
                let mut handles = handoffs(self, job);
                if self.done_delivered.contains(&(id, job)) {
                    handles.push(stranger);
                }
                Message::Ack(Ack { job, handles })
            }
            Fault::SecondResultRequest => {
                let pending = self
                    .alloc_requests
                    .iter()
                    .find(|(w, _, _)| *w == id)
                    .map_or(JobId(u64::MAX), |(_, j, _)| *j);
                Message::ResultRequest(ResultRequest {
                    job: pending,
                    results: vec![result_spec(SizeClass::Small)],
                })
            }
            Fault::LyingByteLen => {
                let mut spec = result_spec(SizeClass::Small);
                spec.byte_len += 4;
                Message::ResultRequest(ResultRequest {
                    job,
                    results: vec![spec],
                })
            }
            Fault::LyingCarve => Message::Done(Done {
                job,
                done_event: done_blob(id, job),
                handles: handoffs(self, job),
                carved: vec![CarvedResult {
                    index: 0,
                    offset: 1 << 40,
                    bytes: 256,
                    dtype: DType::F32,
                    shape: vec![64],
                }],
            }),
            Fault::ErrorMessage => Message::Error {
                code: ErrorCode::INTERNAL,
                message: "garbage".into(),
            },
            Fault::Unexpected => match p % 4 {
                0 => Message::Bye,
                1 => Message::Cancel { job },
                2 => Message::Lend(Lend {
                    job,
                    tensors: Vec::new(),
                    slice: None,
                }),
                _ => Message::AllocationGrant(AllocationGrant {
                    job,
                    results: vec![ResultGrant::Refused {
                        code: ErrorCode::OTHER,
                        message: String::new(),
                    }],
                }),
            },
        };
        let was_connected = self.connected(i);
        self.deliver_to_parent(i, message.clone());
        self.drain();
        if was_connected {
            if self.workers[i].condemned {
                self.count("garbage condemned its worker");
            } else {
                self.mismatch(format!("{id} sent {message:?} and is not condemned"));
            }
        }
    }

    fn crash(&mut self, i: usize, why: &str) {
        let w = &mut self.workers[i];
        if w.process != Process::Running {
            return;
        }
        w.process = Process::Dead;
        w.condemned = true;
        w.to_worker.clear();
        w.usable.clear();
        w.started.clear();
        w.requested.clear();
        let id = w.id;
        let got = self.parent.handle(
            ParentEvent::WorkerHungUp {
                worker: id,
                why: why.into(),
            },
            self.now,
        );
        if let Err(e) = got {
            self.mismatch(format!("hang-up of {id} refused: {e}"));
        }
    }

    /// A worker told to stop exits once its code has finished every job: the parent reads
    /// what it sent, then EOF.
    fn exit_if_stopped(&mut self, i: usize) -> bool {
        let w = &self.workers[i];
        if w.process != Process::Running
            || !w.machine.is_stopping()
            || w.machine.jobs().next().is_some()
        {
            return false;
        }
        self.count("stopped worker exited");
        let sent = std::mem::take(&mut self.workers[i].to_parent);
        for message in sent {
            self.deliver_to_parent(i, message);
        }
        self.crash(i, "EOF after Bye");
        true
    }

    fn reap(&mut self, i: usize) {
        let id = self.workers[i].id;
        self.workers[i].process = Process::Reaped;
        self.workers[i].to_parent.clear();
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
        let waiting: BTreeSet<JobId> = self
            .alloc_requests
            .iter()
            .filter(|(w, _, _)| *w == id)
            .map(|(_, j, _)| *j)
            .collect();
        if self.parent.jobs_of(id).iter().any(|j| !waiting.contains(j)) {
            self.mismatch(format!(
                "{id} reaped but jobs {:?} are still open",
                self.parent.jobs_of(id)
            ));
        }
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
                    self.carry_out_worker(i, action);
                }
                progressed |= self.exit_if_stopped(i);
            }
            if !progressed {
                break;
            }
        }
    }

    fn carry_out_worker(&mut self, i: usize, action: WorkerAction) {
        self.count(match &action {
            WorkerAction::Import { .. } => "worker: import",
            WorkerAction::WaitReady { .. } => "worker: wait ready",
            WorkerAction::ReceiveStaged { .. } => "worker: receive staged",
            WorkerAction::JobStarted { .. } => "worker: job started",
            WorkerAction::ResultsGranted { .. } => "worker: results granted",
            WorkerAction::Unimport { .. } => "worker: unimport",
            WorkerAction::RecordDone { .. } => "worker: record done",
            WorkerAction::Send(_) => "worker: send",
            WorkerAction::SendStaged { .. } => "worker: send staged",
            WorkerAction::Cancelled { .. } => "worker: cancelled",
            WorkerAction::Stop => "worker: stop",
        });
        let shared = if let WorkerAction::JobStarted { inputs, .. } = &action {
            let machine = &self.workers[i].machine;
            inputs
                .iter()
                .any(|t| machine.imports().any(|(a, n)| a == t.alloc && n > 1))
        } else {
            false
        };
        if shared {
            self.count("import shared by two handoffs");
        }
        let w = &mut self.workers[i];
        match action {
            WorkerAction::Send(msg) => {
                if w.process == Process::Running {
                    w.to_parent.push(msg);
                }
            }
            WorkerAction::JobStarted { job, inputs, slice } => {
                w.started.push(job);
                w.usable.extend(inputs.iter().map(|t| (job, t.handle)));
                w.usable.extend(slice.map(|s| (job, s.handle)));
                // The worker's code asks for its results at once in one job of two (and
                // later, by `Op::RequestResults`, in others): carved out of the slice when
                // they fit, else by a request.
                if job.0 % 2 == 0 {
                    let specs = vec![result_spec(SizeClass::Small); 1 + (job.0 % 3) as usize];
                    if let Ok(Some(_)) = w.machine.carve_results(job, &specs) {
                        self.count("slice carved");
                    } else if w.machine.request_results(job, specs).is_ok() {
                        w.requested.insert(job);
                    }
                }
            }
            WorkerAction::ResultsGranted { job, results } => {
                w.requested.remove(&job);
                w.usable.extend(results.iter().filter_map(|g| match g {
                    ResultGrant::Granted { handle, .. } | ResultGrant::Arena { handle, .. } => {
                        Some((job, *handle))
                    }
                    ResultGrant::Refused { .. } => None,
                }));
            }
            WorkerAction::Import { .. }
            | WorkerAction::WaitReady { .. }
            | WorkerAction::ReceiveStaged { .. }
            | WorkerAction::Unimport { .. }
            | WorkerAction::RecordDone { .. }
            | WorkerAction::SendStaged { .. }
            | WorkerAction::Cancelled { .. }
            | WorkerAction::Stop => {}
        }
    }

    fn carry_out_parent(&mut self, action: ParentAction) {
        self.count(match &action {
            ParentAction::RecordReady { .. } => "record ready",
            ParentAction::Send {
                message: Message::Lend(l),
                ..
            } => {
                if l.slice.is_some() {
                    "lend with a slice"
                } else if l.tensors.iter().any(|t| t.rung == Rung::ArenaCopy) {
                    "lend with an arena copy"
                } else if l.tensors.iter().any(|t| t.rung == Rung::HostStaging) {
                    "lend with a staged input"
                } else if l.tensors.iter().any(|t| t.rung == Rung::VmmHandle) {
                    "lend by VMM handle"
                } else {
                    "lend"
                }
            }
            ParentAction::Send {
                message: Message::AllocationGrant(g),
                ..
            } => {
                let granted = |rung: Rung| {
                    g.results
                        .iter()
                        .any(|r| matches!(r, ResultGrant::Granted { rung: x, .. } if *x == rung))
                };
                let arena = g
                    .results
                    .iter()
                    .any(|r| matches!(r, ResultGrant::Arena { .. }));
                if arena {
                    "grant an arena result"
                } else if granted(Rung::HostStaging) {
                    "grant a staged result"
                } else if granted(Rung::PoolPointer) {
                    "grant a pointer result"
                } else {
                    "refuse results"
                }
            }
            ParentAction::Send {
                message: Message::Cancel { .. },
                ..
            } => "cancel",
            ParentAction::Send {
                message: Message::Bye,
                ..
            } => "bye",
            ParentAction::Send { .. } => "send other",
            ParentAction::SendStaged { .. } => "send staged",
            ParentAction::AllocateResult { .. } => "allocate result",
            ParentAction::ReceiveStaged { .. } => "receive staged",
            ParentAction::WaitDone { .. } => "wait done",
            ParentAction::FreeResult { .. } => "free unused result",
            ParentAction::Release {
                outcome: Outcome::Completed,
                ..
            } => "release completed",
            ParentAction::Release {
                outcome: Outcome::Cancelled,
                ..
            } => "release cancelled",
            ParentAction::Release { .. } => "release failed",
            ParentAction::ReleaseSlice { carved, .. } if !carved.is_empty() => {
                "release a carved slice"
            }
            ParentAction::ReleaseSlice { .. } => "release a slice whole",
            ParentAction::KillWorker { .. } => "kill worker",
            ParentAction::JobFinished {
                outcome: JobOutcome::Completed,
                ..
            } => "job completed",
            ParentAction::JobFinished {
                outcome: JobOutcome::WorkerError(_),
                ..
            } => "job finished with the worker's error",
            ParentAction::JobFinished { .. } => "job failed",
            ParentAction::WorkerRemoved { .. } => "worker removed",
            ParentAction::ShutdownComplete => "shutdown complete",
        });
        match action {
            ParentAction::Send { worker, message } => {
                match &message {
                    Message::Lend(l) => {
                        if let Some(j) = self.open_jobs.get_mut(&(worker, l.job)) {
                            j.handoffs.extend(
                                l.tensors
                                    .iter()
                                    .map(|t| t.handle)
                                    .chain(l.slice.map(|s| s.handle)),
                            );
                        }
                        let blocks = l
                            .tensors
                            .iter()
                            .filter(|t| t.rung == Rung::ArenaCopy)
                            .map(|t| t.alloc)
                            .chain(l.slice.map(|s| s.alloc));
                        for alloc in blocks.collect::<Vec<_>>() {
                            if self.unoffered.remove(&alloc) {
                                let checked = self.auditor.caller_dropped(alloc);
                                self.note(checked);
                            }
                        }
                    }
                    Message::AllocationGrant(g) => {
                        for r in &g.results {
                            if let ResultGrant::Granted { handle, alloc, .. }
                            | ResultGrant::Arena { handle, alloc, .. } = r
                            {
                                if let Some(j) = self.open_jobs.get_mut(&(worker, g.job)) {
                                    j.handoffs.push(*handle);
                                }
                                if self.unoffered.remove(alloc) {
                                    let checked = self.auditor.caller_dropped(*alloc);
                                    self.note(checked);
                                }
                            }
                        }
                    }
                    _ => {}
                }
                if let Some(w) = self.workers.iter_mut().find(|w| w.id == worker)
                    && w.process == Process::Running
                {
                    w.to_worker.push(message);
                }
            }
            ParentAction::AllocateResult {
                worker,
                job,
                request,
                spec,
            } => {
                // Like the facade, the simulated allocator mostly answers at once, with the
                // size asked for (pool, staged or arena in turn); one request in seven waits
                // for an `Op::AnswerResult`.
                let size = match spec.byte_len {
                    0..=256 => SizeClass::Small,
                    257..=4096 => SizeClass::AtLimit,
                    _ => SizeClass::Huge,
                };
                let memory = match request.0 % 7 {
                    0 => None,
                    1 | 2 => Some(Memory::Pool),
                    3 | 4 => Some(Memory::Staged),
                    _ => Some(Memory::Arena),
                };
                match memory {
                    None => self.alloc_requests.push((worker, job, request)),
                    Some(m) => self.answer_request(worker, request, size, m, false),
                }
            }
            ParentAction::KillWorker { worker } => {
                if let Some(i) = self.workers.iter().position(|w| w.id == worker) {
                    self.workers[i].condemned = true;
                    self.crash(i, "killed");
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
            ParentAction::ReleaseSlice {
                alloc,
                outcome: Outcome::Completed,
                carved,
                ..
            } if !carved.is_empty() => {
                // The carved results are the caller's (the slice's block, in this model).
                if let Some(span) = self.spans.get(&alloc) {
                    self.held_tensors.push((alloc, *span));
                }
            }
            ParentAction::JobFinished { worker, job, .. } => {
                if self.open_jobs.remove(&(worker, job)).is_none() {
                    self.mismatch(format!("{job} of {worker} finished twice or never started"));
                }
            }
            ParentAction::WorkerRemoved { worker } => {
                let reaped = self
                    .workers
                    .iter()
                    .any(|w| w.id == worker && w.process == Process::Reaped);
                if !reaped {
                    self.mismatch(format!("{worker} removed before it was reaped"));
                }
            }
            ParentAction::FreeResult { alloc, .. } => {
                self.unoffered.remove(&alloc);
            }
            ParentAction::RecordReady { .. }
            | ParentAction::SendStaged { .. }
            | ParentAction::ReceiveStaged { .. }
            | ParentAction::WaitDone { .. }
            | ParentAction::Release { .. }
            | ParentAction::ReleaseSlice { .. }
            | ParentAction::ShutdownComplete => {}
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
        for i in 0..self.workers.len() {
            let w = &self.workers[i];
            let expected = w.process == Process::Running && !w.condemned && !w.stopping;
            if self.parent.is_live(w.id) != expected {
                let what = format!(
                    "{} is {:?}, condemned: {}, stopping: {}, but the parent says live: {}",
                    w.id, w.process, w.condemned, w.stopping, !expected
                );
                self.failure.mismatches.push(what);
            }
            let open: Vec<JobId> = self
                .open_jobs
                .keys()
                .filter(|(wid, _)| *wid == w.id)
                .map(|(_, j)| *j)
                .collect();
            let theirs = self.parent.jobs_of(w.id);
            if open != theirs {
                let what = format!(
                    "{} has open jobs {theirs:?}, the world expects {open:?}",
                    w.id
                );
                self.failure.mismatches.push(what);
            }
        }
    }
}
