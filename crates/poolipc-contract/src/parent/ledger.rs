//! What the parent holds for its workers, in one place: the workers, their open jobs, the
//! handoffs on loan, the allocations lent, the result allocations answered and not yet
//! offered, and the result requests waiting for the facade's answer. The handlers read it
//! freely and change it only through its operations, each of which keeps the maps agreeing
//! with one another; [`Ledger::check`] says whether they do.
//!
//! # Invariants
//!
//! Each rule names the invariant of the ownership contract ([`Invariant`]) that it serves.
//!
//! - **L1** (invariant 4, a job finishes only when every handoff of it is released): every
//!   loan belongs to an open job and is listed, once, among that job's handoffs; while the
//!   job's worker is live (not condemned, not reaped) every handoff it lists is on loan. A
//!   job's slice is one of its handoffs, and the only one lent as a slice.
//! - **L2** (invariant 1, the parent owns every allocation): an allocation is counted as lent
//!   exactly as many times as there are loans of it, and only while there is one.
//! - **L3** (invariant 1): an allocation is unoffered exactly while an answer held in an open
//!   job's pending result request names it, once; no allocation is both unoffered and lent.
//! - **L4** (invariant 1): a result request waits for the facade's answer exactly while its
//!   slot in its open job's pending result request is empty.
//! - **L5** (invariant 8, a death fails only its own jobs): each worker's set of open jobs
//!   is the open jobs keyed by it, and every open job's worker is known; a worker has a
//!   failure recorded exactly when it is not live; a reaped worker holds no loan, and each of
//!   its jobs left open waits for the facade's answer to a result request.
//! - **L6** (invariant 4, release after the ACK and DONE): a loan carries a DONE event only
//!   once its job's `Done` was seen, and only a slice carries carves.
//! - **L7** (invariant 4, each handoff released once): every handoff and request id in use is
//!   below the next fresh one, so none is handed out twice.

use std::collections::{BTreeMap, BTreeSet};

use crate::invariant::{Invariant, Violation};
use crate::message::{CarvedResult, ErrorCode};
use crate::types::{
    AllocId, EventBlob, ExportBlob, HandoffId, JobId, Purpose, RequestId, Rung, Span, Timestamp,
    WorkerId,
};

use super::FailReason;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PeerState {
    /// Connected and in good standing (maybe stopping).
    Live,
    /// Hung up, killed or past a deadline: its messages are ignored; its jobs fail and its
    /// loans are released when it is reaped.
    Condemned,
    /// Waited for: its imports are gone.
    Reaped,
}

/// A worker, as the ledger knows it. Handlers only read it; [`Ledger::stop`],
/// [`Ledger::condemn`] and [`Ledger::reap`] change it.
#[derive(Clone, Debug)]
pub(super) struct Peer {
    pub(super) state: PeerState,
    /// `Bye` sent: no new jobs.
    pub(super) stopping: bool,
    /// Why its jobs fail, once it is condemned.
    pub(super) failure: Option<(FailReason, String)>,
    /// Its open jobs.
    pub(super) jobs: BTreeSet<JobId>,
    /// It declared long jobs: its heartbeats are progress for its open jobs.
    pub(super) long_jobs: bool,
}

/// An answer to one result request, held until every request of its message is answered.
#[derive(Clone, Debug)]
pub(super) enum Answer {
    Allocated {
        alloc: AllocId,
        span: Span,
        rung: Rung,
        pool: u8,
        export: ExportBlob,
        /// `(chunk, offset)` of an arena block (`rung` is then [`Rung::Arena`]).
        arena: Option<(u32, u64)>,
    },
    Refused {
        code: ErrorCode,
        message: String,
    },
}

impl Answer {
    /// What a request of a cancelled (or abandoned) job is answered with.
    pub(super) fn cancelled() -> Answer {
        Answer::Refused {
            code: ErrorCode::CANCELLED,
            message: "the job was cancelled".into(),
        }
    }

    fn allocation(&self) -> Option<AllocId> {
        match self {
            Answer::Allocated { alloc, .. } => Some(*alloc),
            Answer::Refused { .. } => None,
        }
    }
}

/// The requests of one `ResultRequest` message.
#[derive(Clone, Debug)]
pub(super) struct Batch {
    requests: Vec<RequestId>,
    answers: Vec<Option<Answer>>,
}

impl Batch {
    pub(super) fn answered(&self) -> bool {
        self.answers.iter().all(Option::is_some)
    }
}

/// An open job. Its handoffs, result request and slice are the ledger's to change (private
/// fields, read through the accessors); the rest is the handlers'.
#[derive(Clone, Debug)]
pub(super) struct Job {
    pub(super) ready_event: EventBlob,
    pub(super) deadline: Timestamp,
    /// Its start plus [`super::ParentConfig::max_job_lifetime`].
    pub(super) expires: Timestamp,
    /// Results asked for so far (counted against
    /// [`super::ParentConfig::max_results_per_job`]).
    pub(super) results_asked: u64,
    /// Result bytes asked for so far.
    pub(super) result_bytes: u64,
    pub(super) cancelled: bool,
    /// When a cancelled job's grace ends ([`super::ParentConfig::cancel_grace`]).
    pub(super) cancel_by: Option<Timestamp>,
    /// Messages about it that were not progress ([`super::ParentConfig::max_idle_messages`]).
    pub(super) idle_messages: u32,
    pub(super) done_seen: bool,
    pub(super) error: Option<String>,
    /// Inputs in `Lend` order, then results in grant order.
    handoffs: Vec<HandoffId>,
    batch: Option<Batch>,
    /// The job's arena slice: its handoff and length.
    slice: Option<(HandoffId, u64)>,
}

impl Job {
    /// Its handoffs: inputs in `Lend` order, then the slice, then results in grant order.
    pub(super) fn handoffs(&self) -> &[HandoffId] {
        &self.handoffs
    }

    /// Its result request waiting to be granted, if any.
    pub(super) fn batch(&self) -> Option<&Batch> {
        self.batch.as_ref()
    }

    /// Its arena slice: the handoff and its length.
    pub(super) fn slice(&self) -> Option<(HandoffId, u64)> {
        self.slice
    }

    /// Whether a request of its pending result request waits for the facade's answer.
    pub(super) fn awaiting_answer(&self) -> bool {
        self.batch.as_ref().is_some_and(|b| !b.answered())
    }
}

/// One handoff on loan. Handlers only read it; [`Ledger::mark_done`] and
/// [`Ledger::set_carves`] change it.
#[derive(Clone, Debug)]
pub(super) struct Loan {
    pub(super) worker: WorkerId,
    pub(super) job: JobId,
    pub(super) alloc: AllocId,
    pub(super) rung: Rung,
    pub(super) purpose: Purpose,
    pub(super) done: Option<EventBlob>,
    /// A slice's carves, checked, from the worker's `Done`.
    pub(super) carved: Vec<CarvedResult>,
    /// An input the caller lent read-only: a staged one's bytes do not come back.
    pub(super) read_only: bool,
}

/// What a new loan is: [`Ledger::lend`] adds the worker, the job and the DONE state.
#[derive(Clone, Copy, Debug)]
pub(super) struct Terms {
    pub(super) alloc: AllocId,
    pub(super) span: Span,
    pub(super) rung: Rung,
    pub(super) purpose: Purpose,
    pub(super) read_only: bool,
}

/// A result request waiting for the facade's answer.
#[derive(Clone, Debug)]
pub(super) struct Pending {
    pub(super) worker: WorkerId,
    pub(super) job: JobId,
    /// Its place in its job's batch.
    index: usize,
    /// What the worker asked for.
    pub(super) byte_len: u64,
}

/// The parent's records; see the module docs for what it keeps and its invariants.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    workers: BTreeMap<WorkerId, Peer>,
    jobs: BTreeMap<(WorkerId, JobId), Job>,
    loans: BTreeMap<HandoffId, Loan>,
    /// Allocations with open loans: their range and how many.
    lent: BTreeMap<AllocId, (Span, u32)>,
    /// Result allocations answered and not yet granted.
    unoffered: BTreeSet<AllocId>,
    /// Result requests waiting for the facade's answer.
    requests: BTreeMap<RequestId, Pending>,
    next_handoff: u64,
    next_request: u64,
}

impl Ledger {
    // ---- workers ----

    pub(super) fn peer(&self, worker: WorkerId) -> Option<&Peer> {
        self.workers.get(&worker)
    }

    /// Every worker known, in id order.
    pub(super) fn peers(&self) -> impl Iterator<Item = (WorkerId, &Peer)> {
        self.workers.iter().map(|(w, p)| (*w, p))
    }

    /// A new live worker with no job. The caller checked the id is new.
    pub(super) fn add_worker(&mut self, worker: WorkerId) {
        self.workers.insert(
            worker,
            Peer {
                state: PeerState::Live,
                stopping: false,
                failure: None,
                jobs: BTreeSet::new(),
                long_jobs: false,
            },
        );
    }

    /// Marks `worker` as one that declared long jobs (its heartbeats are progress).
    pub(super) fn allow_long_jobs(&mut self, worker: WorkerId) {
        if let Some(peer) = self.workers.get_mut(&worker) {
            peer.long_jobs = true;
        }
    }

    /// Marks `worker` stopping (no new job).
    pub(super) fn stop(&mut self, worker: WorkerId) {
        if let Some(peer) = self.workers.get_mut(&worker) {
            peer.stopping = true;
        }
    }

    /// Condemns `worker` if it is live, with why its jobs will fail; whether it was live.
    pub(super) fn condemn(&mut self, worker: WorkerId, reason: FailReason, detail: String) -> bool {
        let Some(peer) = self.workers.get_mut(&worker) else {
            return false;
        };
        if peer.state != PeerState::Live {
            return false;
        }
        peer.state = PeerState::Condemned;
        peer.failure = Some((reason, detail));
        true
    }

    /// Marks a condemned `worker` reaped; its open jobs. Its loans are the caller's to
    /// release now (L5).
    pub(super) fn reap(&mut self, worker: WorkerId) -> Vec<JobId> {
        let Some(peer) = self.workers.get_mut(&worker) else {
            return Vec::new();
        };
        peer.state = PeerState::Reaped;
        peer.jobs.iter().copied().collect()
    }

    // ---- jobs ----

    pub(super) fn job(&self, worker: WorkerId, job: JobId) -> Option<&Job> {
        self.jobs.get(&(worker, job))
    }

    /// The job, to change what is the handlers' (deadlines, flags, counts, its error).
    pub(super) fn job_mut(&mut self, worker: WorkerId, job: JobId) -> Option<&mut Job> {
        self.jobs.get_mut(&(worker, job))
    }

    /// Every open job, in `(worker, job)` order.
    pub(super) fn jobs(&self) -> impl Iterator<Item = (WorkerId, JobId, &Job)> {
        self.jobs.iter().map(|((w, j), job)| (*w, *j, job))
    }

    /// Whether no job is open and no result request waits for an answer.
    pub(super) fn is_idle(&self) -> bool {
        self.jobs.is_empty() && self.requests.is_empty()
    }

    /// Opens `job` on `worker` with no handoff yet; [`Ledger::lend`] adds them. The caller
    /// checked the job is not open.
    pub(super) fn open_job(
        &mut self,
        worker: WorkerId,
        job: JobId,
        ready_event: EventBlob,
        deadline: Timestamp,
        expires: Timestamp,
    ) {
        self.jobs.insert(
            (worker, job),
            Job {
                ready_event,
                deadline,
                expires,
                results_asked: 0,
                result_bytes: 0,
                cancelled: false,
                cancel_by: None,
                idle_messages: 0,
                done_seen: false,
                error: None,
                handoffs: Vec::new(),
                batch: None,
                slice: None,
            },
        );
        if let Some(peer) = self.workers.get_mut(&worker) {
            peer.jobs.insert(job);
        }
    }

    /// Closes `job` of `worker`: what it was. Its loans must be released and no request of
    /// it pending (L1, L4) by the end of the caller's step.
    pub(super) fn close_job(&mut self, worker: WorkerId, job: JobId) -> Option<Job> {
        let closed = self.jobs.remove(&(worker, job));
        if let Some(peer) = self.workers.get_mut(&worker) {
            peer.jobs.remove(&job);
        }
        closed
    }

    // ---- loans ----

    pub(super) fn loan(&self, handoff: HandoffId) -> Option<&Loan> {
        self.loans.get(&handoff)
    }

    /// Every loan, in handoff order.
    pub(super) fn loans(&self) -> impl Iterator<Item = (HandoffId, &Loan)> {
        self.loans.iter().map(|(h, l)| (*h, l))
    }

    /// The handoffs on loan to `worker`, in order.
    pub(super) fn loans_of(&self, worker: WorkerId) -> Vec<HandoffId> {
        self.loans()
            .filter(|(_, l)| l.worker == worker)
            .map(|(h, _)| h)
            .collect()
    }

    pub(super) fn outstanding(&self) -> usize {
        self.loans.len()
    }

    /// The range an allocation on loan was lent with.
    pub(super) fn lent_span(&self, alloc: AllocId) -> Option<Span> {
        self.lent.get(&alloc).map(|(s, _)| *s)
    }

    /// Whether a result allocation was answered and not yet offered.
    pub(super) fn is_unoffered(&self, alloc: AllocId) -> bool {
        self.unoffered.contains(&alloc)
    }

    /// Lends `terms` to `job` of `worker` under a fresh handle, listed after the job's
    /// handoffs so far (as its slice, for [`Purpose::Slice`]).
    pub(super) fn lend(&mut self, worker: WorkerId, job: JobId, terms: Terms) -> HandoffId {
        let handle = HandoffId(self.next_handoff);
        self.next_handoff += 1;
        self.lent.entry(terms.alloc).or_insert((terms.span, 0)).1 += 1;
        self.loans.insert(
            handle,
            Loan {
                worker,
                job,
                alloc: terms.alloc,
                rung: terms.rung,
                purpose: terms.purpose,
                done: None,
                carved: Vec::new(),
                read_only: terms.read_only,
            },
        );
        if let Some(j) = self.jobs.get_mut(&(worker, job)) {
            j.handoffs.push(handle);
            if terms.purpose == Purpose::Slice {
                j.slice = Some((handle, terms.span.bytes));
            }
        }
        handle
    }

    /// Ends the loan of `handoff`: what it was, if it was on loan.
    pub(super) fn release(&mut self, handoff: HandoffId) -> Option<Loan> {
        let loan = self.loans.remove(&handoff)?;
        if let Some(entry) = self.lent.get_mut(&loan.alloc) {
            entry.1 = entry.1.saturating_sub(1);
            if entry.1 == 0 {
                self.lent.remove(&loan.alloc);
            }
        }
        Some(loan)
    }

    /// Records the worker's DONE event on a loan of a job whose `Done` was seen (L6).
    pub(super) fn mark_done(&mut self, handoff: HandoffId, done_event: EventBlob) {
        if let Some(loan) = self.loans.get_mut(&handoff) {
            loan.done = Some(done_event);
        }
    }

    /// Records a slice's checked carves (L6: slices only).
    pub(super) fn set_carves(&mut self, handoff: HandoffId, carved: Vec<CarvedResult>) {
        if let Some(loan) = self.loans.get_mut(&handoff)
            && loan.purpose == Purpose::Slice
        {
            loan.carved = carved;
        }
    }

    // ---- result requests ----

    pub(super) fn pending(&self, request: RequestId) -> Option<&Pending> {
        self.requests.get(&request)
    }

    /// Opens `job`'s result request: one fresh request id per `byte_lens` entry, in order,
    /// each waiting for its answer ([`Ledger::answer`]). The caller checked the job is open
    /// with no result request pending.
    pub(super) fn open_batch(
        &mut self,
        worker: WorkerId,
        job: JobId,
        byte_lens: &[u64],
    ) -> Vec<RequestId> {
        let mut requests = Vec::with_capacity(byte_lens.len());
        for (index, &byte_len) in byte_lens.iter().enumerate() {
            let request = RequestId(self.next_request);
            self.next_request += 1;
            self.requests.insert(
                request,
                Pending {
                    worker,
                    job,
                    index,
                    byte_len,
                },
            );
            requests.push(request);
        }
        if let Some(j) = self.jobs.get_mut(&(worker, job)) {
            j.batch = Some(Batch {
                requests: requests.clone(),
                answers: vec![None; byte_lens.len()],
            });
        }
        requests
    }

    /// Answers a pending request: it waits no more, and its answer is held in its job's
    /// result request (an allocation in it unoffered until granted or freed).
    pub(super) fn answer(&mut self, request: RequestId, answer: Answer) {
        let Some(p) = self.requests.remove(&request) else {
            return;
        };
        let Some(slot) = self
            .jobs
            .get_mut(&(p.worker, p.job))
            .and_then(|j| j.batch.as_mut())
            .and_then(|b| b.answers.get_mut(p.index))
        else {
            return;
        };
        if let Some(alloc) = answer.allocation() {
            self.unoffered.insert(alloc);
        }
        *slot = Some(answer);
    }

    /// Turns the answers already given to `job`'s result request into cancelled refusals:
    /// the allocations they held, no longer unoffered, with their requests, for the caller
    /// to free.
    pub(super) fn refuse_answered(
        &mut self,
        worker: WorkerId,
        job: JobId,
    ) -> Vec<(RequestId, AllocId)> {
        let Some(batch) = self
            .jobs
            .get_mut(&(worker, job))
            .and_then(|j| j.batch.as_mut())
        else {
            return Vec::new();
        };
        let mut freed = Vec::new();
        for (request, answer) in batch.requests.iter().zip(batch.answers.iter_mut()) {
            if let Some(a) = answer {
                if let Some(alloc) = a.allocation() {
                    freed.push((*request, alloc));
                }
                *a = Answer::cancelled();
            }
        }
        for (_, alloc) in &freed {
            self.unoffered.remove(alloc);
        }
        freed
    }

    /// Takes `job`'s result request once every request of it is answered: the requests and
    /// their answers, in order, none unoffered any more (the caller grants or frees them).
    pub(super) fn take_answered(
        &mut self,
        worker: WorkerId,
        job: JobId,
    ) -> Option<Vec<(RequestId, Answer)>> {
        let j = self.jobs.get_mut(&(worker, job))?;
        if !j.batch.as_ref().is_some_and(Batch::answered) {
            return None;
        }
        let batch = j.batch.take()?;
        let answers: Vec<(RequestId, Answer)> = batch
            .requests
            .into_iter()
            .zip(batch.answers)
            .filter_map(|(r, a)| a.map(|a| (r, a)))
            .collect();
        for (_, answer) in &answers {
            if let Some(alloc) = answer.allocation() {
                self.unoffered.remove(&alloc);
            }
        }
        Some(answers)
    }

    // ---- the invariants ----

    /// Whether the maps agree with one another: the first rule of the module docs broken, as
    /// a [`Violation`] of the invariant it serves, with a detail starting with the rule.
    pub(super) fn check(&self) -> Result<(), Violation> {
        self.check_loans()?;
        self.check_lent()?;
        self.check_requests()?;
        self.check_workers()?;
        Ok(())
    }

    /// L1, L6, L7 on the loans and the jobs' handoff lists.
    fn check_loans(&self) -> Result<(), Violation> {
        let l1 = |detail: String| Violation::new(Invariant::ReleaseAfterAckAndDone, detail);
        for (h, loan) in &self.loans {
            let Some(job) = self.jobs.get(&(loan.worker, loan.job)) else {
                return Err(l1(format!(
                    "ledger L1: {h} is on loan to {} of {}, which is not open",
                    loan.job, loan.worker
                )));
            };
            if job.handoffs.iter().filter(|x| *x == h).count() != 1 {
                return Err(l1(format!(
                    "ledger L1: {h} is on loan but listed {} times in {} of {}",
                    job.handoffs.iter().filter(|x| *x == h).count(),
                    loan.job,
                    loan.worker
                )));
            }
            if (loan.purpose == Purpose::Slice) != job.slice.is_some_and(|(s, _)| s == *h) {
                return Err(l1(format!(
                    "ledger L1: {h} is lent as {:?} but the slice of {} of {} is {:?}",
                    loan.purpose, loan.job, loan.worker, job.slice
                )));
            }
            if loan.done.is_some() && !job.done_seen {
                return Err(Violation::new(
                    Invariant::ReleaseAfterAckAndDone,
                    format!("ledger L6: {h} is DONE before the Done of {}", loan.job),
                ));
            }
            if !loan.carved.is_empty() && loan.purpose != Purpose::Slice {
                return Err(Violation::new(
                    Invariant::ReleaseAfterAckAndDone,
                    format!("ledger L6: {h} carries carves but is not a slice"),
                ));
            }
        }
        for ((worker, id), job) in &self.jobs {
            let live = self
                .workers
                .get(worker)
                .is_some_and(|p| p.state == PeerState::Live);
            let mut seen = BTreeSet::new();
            for h in &job.handoffs {
                if h.0 >= self.next_handoff {
                    return Err(l1(format!(
                        "ledger L7: {h} of {id} of {worker} was never handed out"
                    )));
                }
                if !seen.insert(*h) {
                    return Err(l1(format!(
                        "ledger L1: {h} is listed twice in {id} of {worker}"
                    )));
                }
                if live && !self.loans.contains_key(h) {
                    return Err(l1(format!(
                        "ledger L1: {h} of {id} of live {worker} is not on loan"
                    )));
                }
            }
            if let Some((s, _)) = job.slice
                && !seen.contains(&s)
            {
                return Err(l1(format!(
                    "ledger L1: the slice {s} of {id} of {worker} is not among its handoffs"
                )));
            }
        }
        Ok(())
    }

    /// L2 and L3 on the lent and unoffered allocations.
    fn check_lent(&self) -> Result<(), Violation> {
        let fail = |detail: String| Err(Violation::new(Invariant::ParentOwnsAllocations, detail));
        let mut counts: BTreeMap<AllocId, u32> = BTreeMap::new();
        for loan in self.loans.values() {
            *counts.entry(loan.alloc).or_insert(0) += 1;
        }
        let lent: BTreeMap<AllocId, u32> = self.lent.iter().map(|(a, (_, n))| (*a, *n)).collect();
        if counts != lent {
            return fail(format!(
                "ledger L2: allocations lent {lent:?}, but the loans count {counts:?}"
            ));
        }
        let mut held = BTreeSet::new();
        for ((worker, id), job) in &self.jobs {
            let answers = job.batch.iter().flat_map(|b| b.answers.iter().flatten());
            for alloc in answers.filter_map(Answer::allocation) {
                if !held.insert(alloc) {
                    return fail(format!(
                        "ledger L3: {alloc} is answered twice ({id} of {worker})"
                    ));
                }
            }
        }
        if held != self.unoffered {
            return fail(format!(
                "ledger L3: unoffered {:?}, but the answers held name {held:?}",
                self.unoffered
            ));
        }
        if let Some(alloc) = self.unoffered.iter().find(|a| self.lent.contains_key(a)) {
            return fail(format!("ledger L3: {alloc} is both unoffered and lent"));
        }
        Ok(())
    }

    /// L4 and L7 on the pending requests and the jobs' result requests.
    fn check_requests(&self) -> Result<(), Violation> {
        let fail = |detail: String| Err(Violation::new(Invariant::ParentOwnsAllocations, detail));
        for (request, p) in &self.requests {
            if request.0 >= self.next_request {
                return fail(format!("ledger L7: {request} was never handed out"));
            }
            let batch = self.jobs.get(&(p.worker, p.job)).and_then(Job::batch);
            let in_place = batch.is_some_and(|b| {
                b.requests.get(p.index) == Some(request)
                    && b.answers.get(p.index).is_some_and(Option::is_none)
            });
            if !in_place {
                return fail(format!(
                    "ledger L4: {request} waits, but is not an empty slot of {} of {}",
                    p.job, p.worker
                ));
            }
        }
        for ((worker, id), job) in &self.jobs {
            let Some(b) = &job.batch else {
                continue;
            };
            if b.requests.len() != b.answers.len() {
                return fail(format!(
                    "ledger L4: {id} of {worker} has {} requests and {} answers",
                    b.requests.len(),
                    b.answers.len()
                ));
            }
            for (request, answer) in b.requests.iter().zip(&b.answers) {
                if answer.is_none() && !self.requests.contains_key(request) {
                    return fail(format!(
                        "ledger L4: {request} of {id} of {worker} is unanswered but not waiting"
                    ));
                }
            }
        }
        Ok(())
    }

    /// L5 on the workers.
    fn check_workers(&self) -> Result<(), Violation> {
        let fail = |detail: String| Err(Violation::new(Invariant::DeathFailsOnlyItsJobs, detail));
        let mut keyed: BTreeMap<WorkerId, BTreeSet<JobId>> = BTreeMap::new();
        for (worker, job) in self.jobs.keys() {
            if !self.workers.contains_key(worker) {
                return fail(format!("ledger L5: {job} is open on unknown {worker}"));
            }
            keyed.entry(*worker).or_default().insert(*job);
        }
        for (worker, peer) in &self.workers {
            let open = keyed.remove(worker).unwrap_or_default();
            if peer.jobs != open {
                return fail(format!(
                    "ledger L5: {worker} lists jobs {:?}, but {open:?} are open",
                    peer.jobs
                ));
            }
            if (peer.state == PeerState::Live) == peer.failure.is_some() {
                return fail(format!(
                    "ledger L5: {worker} is {:?} with failure {:?}",
                    peer.state, peer.failure
                ));
            }
            if peer.state != PeerState::Reaped {
                continue;
            }
            if let Some((h, _)) = self.loans().find(|(_, l)| l.worker == *worker) {
                return fail(format!("ledger L5: {h} is on loan to reaped {worker}"));
            }
            for job in &peer.jobs {
                if !self
                    .jobs
                    .get(&(*worker, *job))
                    .is_some_and(Job::awaiting_answer)
                {
                    return fail(format!(
                        "ledger L5: {job} of reaped {worker} is open with no answer awaited"
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
