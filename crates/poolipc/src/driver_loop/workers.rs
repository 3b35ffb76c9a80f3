//! Workers coming and going on the IO thread: adopted after their handshake, stopped,
//! cancelled jobs, exits noticed and reaped, faults escalated and condemned.

use std::os::fd::{AsFd as _, OwnedFd};
use std::process::{Child, ExitStatus};
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::Instant;

use poolipc_contract::{self as contract, FailReason, JobOutcome, ParentEvent};
use poolipc_transport::{Capabilities, Connection};
use poolipc_types::{JobId, WorkerId};

use super::{Loop, Slot, Submission};
use crate::error::Error;
use crate::state::{ResultMemory, Stats, lock};

impl Loop {
    /// Whether `worker` may join this loop (the parent is not shutting down, its contract
    /// machine takes it), with the descriptor of `conn`'s socket that the IO thread polls
    /// while a caller's thread may hold the loop.
    fn admit(&mut self, worker: WorkerId, conn: &Connection) -> Result<Arc<OwnedFd>, Error> {
        if self.shutting_down {
            return Err(Error::Protocol("the parent is shutting down".into()));
        }
        let poll_fd = conn
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| Error::Os {
                call: "dup (the worker's socket, for the IO thread's poll)",
                source,
            })?;
        self.machine.add_worker(worker)?;
        Ok(Arc::new(poll_fd))
    }

    pub(super) fn adopt(
        &mut self,
        worker: WorkerId,
        conn: Connection,
        mut child: Option<Child>,
    ) -> Result<(), Error> {
        let poll_fd = match self.admit(worker, &conn) {
            Ok(fd) => fd,
            Err(e) => {
                // Refused: a worker the loop will not serve is killed and reaped here.
                if let Some(c) = child.as_mut() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(e);
            }
        };
        let registered = self.shared.registered(worker);
        let takes_staging = registered.as_ref().is_some_and(|r| {
            r.info
                .identity
                .capabilities
                .contains(Capabilities::HOST_STAGING)
        });
        let maps_arena = (matches!(self.shared.options.results, ResultMemory::Arena { .. })
            || self.shared.options.arena_copy)
            && registered.as_ref().is_some_and(|r| {
                r.info
                    .identity
                    .capabilities
                    .contains(Capabilities::VMM_ARENA)
                    // An isolated worker reaches the device (its capabilities say VMM_ARENA
                    // only then) but not the pool.
                    && (r.reaches_first || r.info.trust.is_isolated())
            });
        let takes_vmm = registered.as_ref().is_some_and(|r| {
            r.info
                .identity
                .capabilities
                .contains(Capabilities::VMM_HANDLE)
                && r.reaches_first
        });
        if registered.as_ref().is_some_and(|r| {
            r.info
                .identity
                .capabilities
                .contains(Capabilities::LONG_JOBS)
        }) && let Err(e) = self.machine.allow_long_jobs(worker)
        {
            tracing::debug!(worker = %worker, error = %e, "long jobs of a worker the contract let go");
        }
        let mut conn = conn;
        conn.set_queue_limits(self.shared.options.tuning.send_queue);
        self.workers.insert(
            worker,
            Slot::new(
                Some(conn),
                Some(poll_fd),
                child,
                takes_staging,
                maps_arena,
                takes_vmm,
            ),
        );
        // The arena's chunks so far, before any grant can name one.
        self.announce_chunks(Some(worker));
        Ok(())
    }

    pub(super) fn stop(
        &mut self,
        worker: WorkerId,
        reply: Option<Sender<Result<Option<ExitStatus>, Error>>>,
    ) {
        let Some(slot) = self.workers.get_mut(&worker) else {
            if let Some(r) = reply {
                let _ = r.send(Err(Error::UnknownWorker(worker)));
            }
            return;
        };
        slot.stop_replies.extend(reply);
        if slot.exit_deadline.is_some() {
            return;
        }
        slot.exit_deadline = Some(Instant::now() + self.shared.options.stop_timeout);
        // Jobs not yet sent fail at once; jobs in flight fail when it is reaped.
        let queued: Vec<Box<Submission>> = slot.queued.drain(..).collect();
        for sub in queued {
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(Error::JobFailed {
                worker,
                reason: FailReason::Stopped,
                detail: "the worker was stopped before the job was sent".into(),
                results: Vec::new(),
            }));
        }
        if let Err(e) = self.machine.stop_worker(worker) {
            tracing::debug!(worker = %worker, error = %e, "stopping a worker the contract has let go");
        }
        self.drive();
    }

    /// A job the caller cancelled: failed at once while still queued; else the contract
    /// sends the worker `Cancel` and fails the job once the worker finished it (nothing of
    /// it is reused before the worker's DONE, or its death).
    pub(super) fn cancel(&mut self, worker: WorkerId, job: JobId) {
        if let Some(slot) = self.workers.get_mut(&worker)
            && let Some(at) = slot.queued.iter().position(|s| s.job == job)
            && let Some(sub) = slot.queued.remove(at)
        {
            Stats::bump(&self.shared.stats.jobs_failed);
            sub.done.complete(Err(Error::JobFailed {
                worker,
                reason: FailReason::Cancelled,
                detail: format!("{job} was cancelled before it was sent to {worker}"),
                results: Vec::new(),
            }));
            return;
        }
        if !self.jobs.contains_key(&(worker, job)) {
            return;
        }
        if let Err(e) = self.machine.cancel(worker, job, self.now()) {
            // Its worker is gone or the job ended meanwhile: it fails or ended on its own.
            tracing::debug!(worker = %worker, job = job.0, error = %e, "cancel after the fact");
        }
        self.drive();
    }

    /// Workers being stopped: reaped once they exit, killed at their deadline.
    pub(super) fn check_exits(&mut self) {
        let now = Instant::now();
        let due: Vec<(WorkerId, bool)> = self
            .workers
            .iter_mut()
            .filter(|(_, s)| s.away.is_none())
            .filter_map(|(id, s)| {
                let deadline = s.exit_deadline?;
                let exited = match s.child.as_mut() {
                    Some(c) => matches!(c.try_wait(), Ok(Some(_))),
                    // Not ours to reap: its closing the socket is its exit.
                    None => s.lost.is_some(),
                };
                (exited || now >= deadline).then_some((*id, exited))
            })
            .collect();
        // One whose transfer runs is reaped once the transfer handed its socket back; past
        // its deadline it is killed, which ends the transfer.
        let late: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, s)| s.away.as_ref().is_some_and(|a| !a.aborted()))
            .filter(|(_, s)| s.exit_deadline.is_some_and(|d| now >= d))
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            tracing::warn!(worker = %id, "the worker's staging transfer outlasted its stop deadline: killing it");
            Stats::bump(&self.shared.stats.workers_lost);
            self.abort_transfer(id);
        }
        for (id, exited) in due {
            if !exited {
                tracing::warn!(worker = %id, "the worker did not exit after Bye in time: killing it");
                Stats::bump(&self.shared.stats.workers_lost);
            }
            self.reap(id, !exited);
        }
    }

    /// One more worker has a job in flight (`busy`), or one fewer: counts the workers busy
    /// at once across the rooms, and the first time two are, in a process that is not an MPS
    /// client, says once why they will take turns on the GPU and what removes it.
    pub(super) fn worker_busy(&self, busy: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &self.shared.stats;
        if !busy {
            // Never below 0 (a miscount would say so in the stats, not wrap).
            let _ = s
                .workers_busy
                .fetch_update(Relaxed, Relaxed, |n| Some(n.saturating_sub(1)));
            return;
        }
        let now = s.workers_busy.fetch_add(1, Relaxed) + 1;
        s.most_workers_busy.fetch_max(now, Relaxed);
        if now >= 2 && self.shared.mps_client == Some(false) && !s.turns_said.swap(true, Relaxed) {
            let why = match self.shared.turns.as_ref().map(|t| t.turn()) {
                Some(w) => format!(
                    "a worker kept the GPU turn two turns past its own (gpu_turn {} µs: a long \
                     job), so the others' jobs went beside it",
                    w.as_micros()
                ),
                None => "the parent keeps no GPU turns (off by default; for workers running many \
                      small GPU jobs, Tuning::gpu_turn or POOLIPC_GPU_TURN_US=2000 gave \
                      8 workers 4.4x the jobs/s on an H100)"
                    .to_owned(),
            };
            tracing::info!(
                workers_busy = now,
                "poolipc: {now} workers have jobs at once and this process is not an MPS \
                 client: {why}. The GPU runs one process's context at a time, so workers \
                 that compute at once make it switch at every job (on an H100, workers \
                 running a kernel a job: about 36000 jobs/s for one alone, about 7200 for two \
                 or more together); under MPS they run at once: `poolipc mps \
                 --accept-shared-gpu-faults -- CMD` or \
                 poolipc.start_mps(accept_shared_gpu_faults=True) for trusted workers \
                 (docs/guide.md: MPS). ParentStats::most_workers_busy counts them"
            );
        }
    }

    /// Kills (if asked) and waits for the worker, closes everything the loop held of it
    /// (socket, events, staging buffer), then tells the contract, which releases what the
    /// worker held and fails its jobs. The jobs end after the slot is gone, so a caller that
    /// sees its job fail finds nothing of the worker left open.
    pub(super) fn reap(&mut self, worker: WorkerId, kill: bool) {
        self.answers.forget(worker);
        let Some(mut slot) = self.workers.remove(&worker) else {
            return;
        };
        if slot.in_flight > 0 {
            // Its jobs end without it (they fail below): it is busy no more.
            self.worker_busy(false);
        }
        let status = match slot.child.as_mut() {
            Some(c) => {
                if kill {
                    let _ = c.kill();
                }
                match c.wait() {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::error!(worker = %worker, error = %e, "waitpid failed");
                        None
                    }
                }
            }
            None => None,
        };
        // What was held for it while a transfer ran (the transfer ended: the loop reaps no
        // worker whose transfer runs), in the contract's order, before its hang-up.
        for held in std::mem::take(&mut slot.held) {
            if let super::transfer::Held::Action(action) = held {
                self.act_now(action);
            }
        }
        // Killed with results from the pool in its open jobs: once they are freed (below, as
        // its jobs fail), the pool gives those bytes back to the device, not only to itself;
        // and its arena's chunks go back as soon as their blocks' frees ran, not at the next
        // idle check.
        if kill || slot.lost.is_some() {
            let granted = self.jobs.pool_result_bytes(worker);
            self.pool_trim.after(granted, Instant::now());
        }
        let text = status.map_or_else(|| "not ours to reap".into(), |s| s.to_string());
        tracing::info!(worker = %worker, status = %text, "worker reaped");
        let why = slot
            .lost
            .clone()
            .unwrap_or_else(|| "the worker was stopped".into());
        let queued: Vec<Box<Submission>> = slot.queued.drain(..).collect();
        let replies: Vec<_> = slot.stop_replies.drain(..).collect();
        let held = self
            .gates
            .outlive(worker, &mut slot.done_events, &why, Instant::now());
        drop(slot);
        self.forget_vmm_shares(worker);
        self.workers.reaped(worker, text);
        // Reaped, it leaves the registry: `Parent::workers` lists the living only, and a
        // parent whose workers come and go keeps no trace of each.
        lock(&self.shared.registry).remove(&worker);
        let now = self.now();
        // The contract learns that the connection is gone (if it has not yet), then that the
        // process is: only now may what the worker imported be reused.
        if let Err(e) = self.machine.handle(
            ParentEvent::WorkerHungUp {
                worker,
                why: why.clone(),
            },
            now,
        ) {
            tracing::debug!(worker = %worker, error = %e, "hang-up of a worker the contract let go");
        }
        if let Err(e) = self
            .machine
            .handle(ParentEvent::WorkerReaped { worker }, now)
        {
            tracing::warn!(worker = %worker, error = %e, "the contract refused a reaping");
        }
        self.drive();
        for (key, gate) in held {
            self.fail_gate(key, gate, &why);
        }
        self.forget_dead_events();
        for q in queued {
            Stats::bump(&self.shared.stats.jobs_failed);
            q.done.complete(Err(Error::JobFailed {
                worker,
                reason: FailReason::HungUp,
                detail: format!("the worker was lost before the job was sent ({why})"),
                results: Vec::new(),
            }));
        }
        // Jobs the contract has not finished (it finishes them after an allocation answer it
        // still waits for, which this loop gives at once) fail here rather than hang.
        // (Jobs held for their DONE are not: they end with it, or at their grace's end.)
        let orphaned: Vec<JobId> = self
            .jobs
            .of(worker)
            .into_iter()
            .filter(|&j| !self.gates.holds((worker, j)))
            .collect();
        for job in orphaned {
            tracing::error!(worker = %worker, job = job.0, "a job outlived its worker's reaping");
            self.finish(
                worker,
                job,
                JobOutcome::Failed {
                    reason: FailReason::HungUp,
                    detail: why.clone(),
                },
            );
        }
        self.workers.forget_reaped(worker);
        // Its arena's blocks came back with its loans (or come back with the jobs held for
        // their DONE, and the results the caller holds): its chunks go back as they empty.
        self.retire_arena(worker);
        for r in replies {
            let _ = r.send(Ok(status));
        }
    }

    /// A driver error in the loop: if it says this process's CUDA context is lost, nothing
    /// on the GPU can be trusted any more. Then the parent records why (naming MPS and the
    /// worker most likely at fault), condemns every worker, and refuses all later work;
    /// returns whether that happened. The actions it queues run at the next `drive`.
    pub(super) fn escalate(&mut self, what: &str, e: &Error) -> bool {
        let e = match self.lost_context(e) {
            Some(e) => e,
            None => return false,
        };
        if self.shared.check_context().is_ok() {
            let suspect = self.workers.suspects();
            let cause = match self.shared.mps_client {
                Some(true) => format!(
                    "this process is an MPS client, and under MPS a GPU fault in any client (a worker's kernel) ends every client's context.{suspect}"
                ),
                _ => format!(
                    "a GPU fault in this process (a kernel of its own), or the GPU itself; a worker's fault does not reach the parent without MPS.{suspect}"
                ),
            };
            let detail = format!(
                "the GPU context of this process is lost ({what}: {e}): {cause} Every later CUDA call here fails and nothing computed since can be trusted, so this parent refuses all further work; restart the process{}",
                if self.shared.mps_client == Some(true) {
                    ", and run workers you do not trust without MPS."
                } else {
                    "."
                }
            );
            tracing::error!("{detail}");
            *crate::state::lock(&self.shared.context_lost) = Some(detail.clone());
            let workers: Vec<WorkerId> = self.workers.keys().copied().collect();
            for w in workers {
                self.lose(w, "the parent's GPU context is lost");
            }
            // Jobs still waiting for a worker will never run.
            let queued: Vec<Box<Submission>> = self
                .workers
                .values_mut()
                .flat_map(|s| s.queued.drain(..))
                .collect();
            for sub in queued {
                Stats::bump(&self.shared.stats.jobs_failed);
                sub.done.complete(Err(Error::ContextLost {
                    detail: detail.clone(),
                }));
            }
        }
        true
    }

    /// Whether `e` means the context is lost, and the error that says so. Under MPS, calls on
    /// handles made before another client's fault fail with `CUDA_ERROR_INVALID_HANDLE`
    /// while new work fails with the sticky code (H200, driver 580): so after any driver
    /// error, one event creation asks the context itself.
    pub(super) fn lost_context(&self, e: &Error) -> Option<String> {
        if e.is_context_lost() {
            return Some(e.to_string());
        }
        if !matches!(
            e,
            Error::Driver(_) | Error::Pool(_) | Error::Import(_) | Error::Staging(_)
        ) {
            return None;
        }
        match poolipc_driver::OwnedEvent::new(&*self.shared.driver, false) {
            Ok(ev) => {
                if let Err(d) = ev.close() {
                    tracing::debug!(error = %d, "destroying the probe event");
                }
                None
            }
            Err(p) if p.is_context_lost() => Some(format!("{e}; then {p}")),
            Err(_) => None,
        }
    }

    /// The error every job gets once the context is lost.
    pub(super) fn context_error(&self) -> Error {
        match self.shared.check_context() {
            Err(e) => e,
            Ok(()) => Error::ContextLost {
                detail: "the GPU context of this process is lost".into(),
            },
        }
    }

    /// The worker is lost outside the contract's view (a send failed, staging broke): tell the
    /// contract it hung up; it condemns the worker, and the actions do the rest.
    pub(super) fn lose(&mut self, worker: WorkerId, why: &str) {
        if let Some(s) = self.workers.get_mut(&worker) {
            if s.lost.is_some() {
                return;
            }
            s.lost = Some(why.to_owned());
            // Its transfer, if one runs, is not waited out.
            self.abort_transfer(worker);
            let Some(s) = self.workers.get_mut(&worker) else {
                return;
            };
            if s.exit_deadline.is_some() {
                // Bye was sent: the worker closing is how it says goodbye. Its exit (or its
                // stop deadline) reaps it.
                return;
            }
        }
        tracing::warn!(worker = %worker, "{why}");
        if self.shared.check_context().is_ok() {
            self.workers.suspect(worker, why.to_owned());
        }
        let now = self.now();
        if let Err(e) = self.machine.handle(
            ParentEvent::WorkerHungUp {
                worker,
                why: why.to_owned(),
            },
            now,
        ) {
            tracing::warn!(worker = %worker, error = %e, "the contract refused a hang-up");
        }
    }

    /// `worker` went past `bound` while the loop carried out `job`'s actions: the contract
    /// condemns it (kills it; its jobs fail naming the bound), and `job`, whose later
    /// actions may already be queued as a success, fails too.
    pub(super) fn condemn_for_bound(
        &mut self,
        worker: WorkerId,
        job: JobId,
        bound: contract::Bound,
        why: String,
    ) {
        tracing::warn!(worker = %worker, job = job.0, %bound, "{why}");
        if let Some(st) = self.jobs.get_mut(&(worker, job)) {
            st.done_failed.get_or_insert_with(|| why.clone());
            st.failed_as.get_or_insert(FailReason::BoundExceeded(bound));
        }
        if let Err(e) = self.machine.condemn_for(worker, bound, why) {
            tracing::debug!(worker = %worker, error = %e, "condemning a worker the contract has let go");
        }
    }

    /// At the end of the thread: whatever job is left fails.
    pub(super) fn fail_leftover_jobs(&mut self) {
        self.gates.clear();
        for ((worker, _), mut st) in self.jobs.take_all() {
            let results = self.give_back_results(&mut st);
            st.done.complete(Err(Error::JobFailed {
                worker,
                reason: FailReason::Stopped,
                detail: "the parent shut down".into(),
                results,
            }));
        }
    }
}
