//! A job from the caller's side: the handle a caller waits on ([`JobHandle`]), and the
//! submitting and cancelling methods of [`Parent`].

use super::Parent;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use poolipc_driver::StreamHandle;
use poolipc_types::{JobId, WorkerId};

use crate::driver_loop::{self, Command as LoopCommand, Shared};
use crate::error::Error;
use crate::state::turns::{Entry, Turns};
use crate::state::{Answer, AnyWake, Completion, Input, JobOutput, ResultAllocator, Stats, lock};

/// A job submitted with [`Parent::submit`]: wait for it from any thread.
#[must_use = "a job's results are the caller's to take (and free): wait for it"]
pub struct JobHandle {
    worker: WorkerId,
    job: JobId,
    done: Arc<Completion>,
    /// The parent's loop, for [`cancel`](JobHandle::cancel) (weak: a handle does not keep a
    /// dropped parent alive; its job was failed then).
    shared: std::sync::Weak<Shared>,
    /// Until when a waiter spins before it sleeps: the submit plus
    /// [`Tuning::spin_in_flight`](crate::Tuning::spin_in_flight), whichever wait (or how many) comes.
    spin_until: Instant,
    /// On the simulated driver: its race checker, the violations recorded when the job was
    /// submitted, and the worker's pid.
    sim: Option<(Arc<crate::check::Sim>, u64, Option<u32>)>,
}

impl std::fmt::Debug for JobHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobHandle")
            .field("worker", &self.worker)
            .field("job", &self.job)
            .field("finished", &self.is_finished())
            .finish()
    }
}

/// A job's end, watched apart from its [`JobHandle`] ([`JobHandle::watch`]): whether it
/// has ended, and waiting for the first of several to end ([`JobWatch::wait_any`]).
#[derive(Clone)]
pub struct JobWatch {
    done: Arc<Completion>,
    spin_until: Instant,
}

impl std::fmt::Debug for JobWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobWatch")
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl JobWatch {
    /// Whether the job has ended (successfully or not).
    pub fn is_finished(&self) -> bool {
        self.done.finished.load(Ordering::Acquire)
    }

    /// Waits until one of `watches` has ended, at most `timeout`: the index of one that has
    /// (the lowest of those ended when it looks), `None` if none had by then or `watches` is
    /// empty. Spins first for the jobs' [`spin_in_flight`](crate::Tuning::spin_in_flight)
    /// as [`JobHandle::wait`] does, then sleeps until a job's end wakes it.
    pub fn wait_any(watches: &[JobWatch], timeout: Duration) -> Option<usize> {
        let ended = || watches.iter().position(JobWatch::is_finished);
        let deadline = Instant::now().checked_add(timeout);
        let before = |t: Instant| deadline.map_or(t, |d| d.min(t));
        let spin_until = before(watches.iter().map(|w| w.spin_until).max()?);
        loop {
            if let Some(i) = ended() {
                return Some(i);
            }
            if Instant::now() >= spin_until {
                break;
            }
            crate::spin::pause();
        }
        let wake = Arc::new(AnyWake::default());
        for w in watches {
            lock(&w.done.watchers).push(Arc::clone(&wake));
        }
        let mut fired = lock(&wake.fired);
        let found = loop {
            // Looked at after registering: a job that ended before it is seen here.
            if let Some(i) = ended() {
                break Some(i);
            }
            let now = Instant::now();
            let left = match deadline {
                Some(d) if now >= d => break None,
                Some(d) => d - now,
                None => Duration::from_secs(3600),
            };
            if *fired {
                // Fired by a job that is seen ended on the next look.
                *fired = false;
                continue;
            }
            fired = wake
                .cond
                .wait_timeout(fired, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        drop(fired);
        for w in watches {
            lock(&w.done.watchers).retain(|x| !Arc::ptr_eq(x, &wake));
        }
        found
    }
}

impl JobHandle {
    /// The job's id.
    pub fn id(&self) -> JobId {
        self.job
    }

    /// The worker it runs on.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Cancels the job: the worker is sent `Cancel`; its result requests from now on are
    /// refused with `CANCELLED`; it still finishes the job (DONE, ACK), and only then is
    /// anything the job held reused (or once the worker was reaped, if it dies first). The
    /// job ends with [`Error::JobFailed`] and
    /// [`FailReason::Cancelled`](poolipc_contract::FailReason); a job not sent yet ends so at
    /// once. The worker goes on taking jobs. A job that ended already, or whose parent is
    /// gone, is left as it is; cancelling twice is cancelling once. A worker that never
    /// finishes a cancelled job meets the handoff deadline and the job lifetime as any other.
    ///
    /// # Errors
    /// [`Error::Forked`] from a forked child; [`Error::IoThreadStopped`].
    pub fn cancel(&self) -> Result<(), Error> {
        match self.shared.upgrade() {
            Some(shared) => cancel_on(&shared, self.worker, self.job),
            None => Ok(()),
        }
    }

    /// Whether the job has ended (successfully or not).
    pub fn is_finished(&self) -> bool {
        lock(&self.done.result).is_some()
    }

    /// Waits until the job ends. A worker lost mid-job ends it with [`Error::JobFailed`] once
    /// the worker is reaped; the handoff deadline bounds the wait.
    pub fn wait(self) -> Result<JobOutput, Error> {
        self.spin(self.spin_until);
        let mut slot = lock(&self.done.result);
        loop {
            if let Some(r) = slot.take() {
                crate::probe::mark("c.woke");
                drop(slot);
                return self.checked(r);
            }
            slot = self.done.sleep(slot, None);
        }
    }

    /// A watch of the job's end, to wait for with others ([`JobWatch::wait_any`]) without
    /// the handle (which [`wait`](JobHandle::wait) consumes).
    pub fn watch(&self) -> JobWatch {
        JobWatch {
            done: Arc::clone(&self.done),
            spin_until: self.spin_until,
        }
    }

    /// Spins until the job ended or `until` passes, reading the worker's answer itself where
    /// its IO thread sleeps ([`Tuning::direct`](crate::Tuning::direct)).
    fn spin(&self, until: Instant) {
        match self.shared.upgrade().filter(|s| s.options.tuning.direct) {
            Some(shared) => self.done.spin_until(until, || {
                driver_loop::read_direct(&shared, self.worker);
            }),
            None => self.done.spin_until(until, || {}),
        }
    }

    /// On the simulated driver, the job's outcome as its race checker sees it.
    fn checked(&self, r: Result<JobOutput, Error>) -> Result<JobOutput, Error> {
        match &self.sim {
            Some((sim, from, pid)) => check_job(sim, *from, self.worker, *pid, self.job, r),
            None => r,
        }
    }

    /// Waits at most `timeout`: `Err(self)` if the job is still running.
    pub fn wait_timeout(self, timeout: Duration) -> Result<Result<JobOutput, Error>, JobHandle> {
        let deadline = Instant::now() + timeout;
        self.spin(self.spin_until.min(deadline));
        {
            let mut slot = lock(&self.done.result);
            loop {
                if let Some(r) = slot.take() {
                    drop(slot);
                    return Ok(self.checked(r));
                }
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                slot = self.done.sleep(slot, Some(deadline - now));
            }
        }
        Err(self)
    }
}

/// Why a job on `CU_STREAM_PER_THREAD` is refused ([`Error::InvalidStream`]).
pub(crate) const PER_THREAD_REFUSED: &str = "CU_STREAM_PER_THREAD (2) names the calling thread's default stream, which the parent's IO thread cannot reach: READY would be recorded on the IO thread's own default stream, not after the work that wrote the inputs. Pass the stream's own handle (torch: torch.cuda.current_stream().cuda_stream) or the legacy stream (0 or 1)";

impl Parent {
    /// Submits a job: lends `inputs` to `worker` (READY recorded on `stream`) and answers its
    /// result requests from the shared pool (allocated on `stream`). Returns at once; the
    /// handle's [`wait`](JobHandle::wait) gives the results once the worker's DONE completed
    /// on the GPU (the IO thread asks on the host; `stream` never waits on a worker's event),
    /// so work queued on `stream` after `wait` comes after the worker's writes. A DONE that
    /// does not complete within `handoff_timeout` fails the job
    /// ([`FailReason::DeadlineExpired`](poolipc_contract::FailReason)) and kills the worker.
    /// A tensor that cannot be lent (negative strides, past its allocation, a dimension above
    /// `i64::MAX`), or a job too large for one message (more than 32 dimensions, more tensors
    /// than one frame holds: about 5000 of 2 dimensions) fails with [`Error::InvalidTensor`]
    /// before anything reaches the worker; a job on `CU_STREAM_PER_THREAD`, which the IO
    /// thread cannot reach, with [`Error::InvalidStream`]. Where `stream` has nothing left to
    /// run, READY goes on the IO thread's own stream instead ([`Tuning::ready_aside`](crate::Tuning::ready_aside)).
    pub fn submit(
        &self,
        worker: WorkerId,
        inputs: &[Input],
        stream: StreamHandle,
    ) -> Result<JobHandle, Error> {
        let job = JobId(self.shared.next_job.fetch_add(1, Ordering::Relaxed));
        self.submit_as(worker, job, inputs, stream, None)
    }

    /// [`submit`](Parent::submit) with the caller's allocator for results. A failed job's
    /// error lists every result the allocator made (`results`): no process imports them any
    /// more, and they are the caller's to free.
    pub fn submit_with(
        &self,
        worker: WorkerId,
        inputs: &[Input],
        stream: StreamHandle,
        alloc: ResultAllocator,
    ) -> Result<JobHandle, Error> {
        let job = JobId(self.shared.next_job.fetch_add(1, Ordering::Relaxed));
        self.submit_as(worker, job, inputs, stream, Some(alloc))
    }

    /// Submits under a job id of the caller's (the canary battery's).
    pub(crate) fn submit_as(
        &self,
        worker: WorkerId,
        job: JobId,
        inputs: &[Input],
        stream: StreamHandle,
        alloc: Option<ResultAllocator>,
    ) -> Result<JobHandle, Error> {
        crate::probe::mark("c.submit");
        if stream == StreamHandle::PER_THREAD {
            return Err(Error::InvalidStream(PER_THREAD_REFUSED.into()));
        }
        // What needs no driver is checked here, so a bad tensor fails at the caller.
        for (i, input) in inputs.iter().enumerate() {
            input
                .desc
                .extent_bytes()
                .map_err(|e| Error::InvalidTensor(format!("input {i}: {e}")))?;
        }
        self.shared.check_loop()?;
        // A job whose Lend cannot be encoded fails here, not at the send (which would cost
        // the worker its life).
        poolipc_transport::check_lend(
            inputs.iter().map(|input| input.desc.shape.len()),
            poolipc_transport::FrameLimits::default(),
        )
        .map_err(|e| Error::InvalidTensor(format!("the job cannot be lent in one message: {e}")))?;
        self.shared.check_context()?;
        if !self.shared.is_registered(worker) {
            return Err(Error::UnknownWorker(worker));
        }
        Stats::bump(&self.shared.stats.jobs_submitted);
        let sim = self.shared.sim.as_ref().map(|sim| {
            let from = sim.count();
            sim.label_stream(
                stream,
                &format!("the stream job {} was submitted on", job.0),
            );
            for (i, input) in inputs.iter().enumerate() {
                sim.label_memory(input.ptr, &format!("input {i} of job {}", job.0));
            }
            let pid = self.shared.registered(worker).and_then(|r| r.info.pid);
            (Arc::clone(sim), from, pid)
        });
        // The last step before the post: from the turn on, the job's answer gives it up.
        let turn = self.take_turn(worker);
        let done = Arc::new(Completion {
            turn,
            ..Completion::default()
        });
        // Lent on this thread where the worker's IO thread waits, else handed to it.
        driver_loop::submit(
            &self.shared,
            Box::new(driver_loop::Submission {
                worker,
                job,
                inputs: inputs.to_vec(),
                stream,
                alloc,
                done: Answer(Arc::clone(&done)),
                placed: None,
            }),
        );
        crate::probe::mark("c.posted");
        Ok(JobHandle {
            worker,
            job,
            done,
            shared: Arc::downgrade(&self.shared),
            spin_until: Instant::now() + self.shared.options.tuning.spin_in_flight,
            sim,
        })
    }

    /// Waits for `worker`'s turn on the GPU where the parent keeps turns
    /// ([`Tuning::gpu_turn`](crate::Tuning::gpu_turn)); the turn
    /// the job then holds a share of, if any.
    fn take_turn(&self, worker: WorkerId) -> Option<(Arc<Turns>, WorkerId)> {
        let turns = self.shared.turns.as_ref()?;
        let entry = turns.enter(worker);
        let waited = entry.waited();
        if !waited.is_zero() {
            let s = &self.shared.stats;
            Stats::bump(&s.turn_waits);
            s.turn_wait_ns.fetch_add(
                u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
        }
        match entry {
            Entry::Counted { .. } => Some((Arc::clone(turns), worker)),
            Entry::Uncounted { ran_out, .. } => {
                if ran_out {
                    Stats::bump(&self.shared.stats.turn_waits_ran_out);
                }
                None
            }
        }
    }

    /// Lends `inputs` to `worker` and waits: [`submit`](Parent::submit) then
    /// [`wait`](JobHandle::wait). Results of a failed job are freed here.
    pub fn run_job(
        &self,
        worker: WorkerId,
        inputs: &[Input],
        stream: StreamHandle,
    ) -> Result<JobOutput, Error> {
        self.submit(worker, inputs, stream)?.wait()
    }
}

/// Posts `Cancel` for `job` of `worker` to `shared`'s loop.
pub(crate) fn cancel_on(shared: &Shared, worker: WorkerId, job: JobId) -> Result<(), Error> {
    shared.check_loop()?;
    shared.post(LoopCommand::Cancel { worker, job });
    Ok(())
}

/// `outcome` of job `job` on `worker` (process `worker_pid`), which started when the
/// machine had recorded `from` violations: a [`Error::SimViolation`] instead when it or
/// the parent made one meanwhile.
fn check_job(
    sim: &crate::check::Sim,
    from: u64,
    worker: WorkerId,
    worker_pid: Option<u32>,
    job: JobId,
    outcome: Result<JobOutput, Error>,
) -> Result<JobOutput, Error> {
    let mut pids = vec![std::process::id()];
    pids.extend(worker_pid);
    let from = from.min(sim.reported());
    let Some(report) = sim.job(from, &pids) else {
        return outcome;
    };
    let (results, during) = match outcome {
        Ok(output) => (
            output
                .results
                .iter()
                .filter(|r| !r.is_arena())
                .map(|r| r.ptr)
                .collect(),
            None,
        ),
        // The job failed besides: its error goes along, its results (the caller's to
        // free) move up, listed once.
        Err(mut e) => {
            let results = match &mut e {
                Error::Worker { results, .. } | Error::JobFailed { results, .. } => {
                    std::mem::take(results)
                }
                _ => Vec::new(),
            };
            (results, Some(Box::new(e)))
        }
    };
    Err(Error::SimViolation {
        worker,
        job,
        report,
        results,
        during,
    })
}
