//! The worker's side of the contract at work: frames read and handed to the machine, and each
//! action it asks for carried out (imports, READY waits, staging, DONE, UNIMPORT, ACK).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use poolipc_contract::{HandoffId, WorkerAction};
use poolipc_driver::{OwnedEvent, PoolAllocation};
use poolipc_transport::{JobId, Message, ResultGrant, TransportError};

use crate::error::Error;
use crate::staging::{StagingChannel, StagingConfig};

use super::{
    CanaryScope, IDLE_TIMEOUT, Import, SEND_TIMEOUT, StagedCopy, Started, Worker, failpoint,
    failpoint_armed,
};

impl Worker {
    /// The next frame from the parent: the backlog first, then the socket.
    pub(super) fn next_frame(&mut self) -> Result<(Message, Vec<OwnedFd>), TransportError> {
        if let Some(message) = self.backlog.pop_front() {
            return Ok((message, Vec::new()));
        }
        self.spin_for_frame();
        let frame = self.conn.recv(Instant::now() + IDLE_TIMEOUT);
        self.last_frame = Instant::now();
        frame
    }

    /// Polls the socket without sleeping until a frame begins to arrive or
    /// [`spin`](Worker::set_spin) has passed since the last frame; the blocking read then
    /// finds the frame there instead of paying a wake-up.
    pub(super) fn spin_for_frame(&self) {
        let until = self.last_frame + self.spin;
        if Instant::now() < until {
            // A poll error shows again in the read, which says what it is.
            let _ = self.readable_by(until);
        }
    }

    /// Handles one frame from the parent: setup frames here, every other one through the
    /// machine, whose actions are then carried out.
    pub(super) fn take(&mut self, message: Message, fds: Vec<OwnedFd>) -> Result<(), Error> {
        match message {
            Message::StagingBuffer(setup) => {
                let mut ch = StagingChannel::setup_worker(
                    Arc::clone(&self.driver),
                    &mut self.conn,
                    &setup,
                    fds,
                    StagingConfig::default(),
                )?;
                self.backlog.extend(ch.take_backlog());
                tracing::debug!(chunk = ch.chunk(), "host staging set up");
                self.staging = Some(ch);
                Ok(())
            }
            Message::ExtraPool(offer) => {
                let Some(fd) = fds.into_iter().next() else {
                    return Err(Error::Protocol("an ExtraPool without its FD".into()));
                };
                self.take_extra_pool(offer, fd)
            }
            Message::ArenaChunk(c) => self.take_arena_chunk(c, fds),
            Message::ArenaRelease(r) => self.release_arena_chunk(r),
            Message::PoolRetire(r) => self.retire_pool(r),
            Message::ReleaseMappings => {
                let dropped = self.release_cached_mappings()?;
                self.conn.send(
                    &Message::MappingsReleased {
                        dropped: u32::try_from(dropped).unwrap_or(u32::MAX),
                    },
                    &[],
                    Instant::now() + SEND_TIMEOUT,
                )?;
                self.last_frame = Instant::now();
                Ok(())
            }
            Message::VmmShare(s) => {
                let Some(fd) = fds.into_iter().next() else {
                    return Err(Error::Protocol("a VmmShare without its FD".into()));
                };
                // A share that cannot be mapped fails the jobs that name it, not the worker.
                if let Err(e) = self.vmm.share(s.alloc, s.base, s.len, fd.as_fd()) {
                    let e = Error::from(e);
                    if e.is_context_lost() {
                        return Err(e);
                    }
                    tracing::warn!(alloc = ?s.alloc, len = s.len, error = %e, "a VMM allocation of the parent could not be mapped");
                }
                Ok(())
            }
            Message::Chunk(c) => Err(Error::Protocol(format!(
                "a Chunk of job {} outside a host-staging transfer",
                c.job.0
            ))),
            Message::StagingReady { .. } => {
                Err(Error::Protocol("a StagingReady from the parent".into()))
            }
            message => {
                // A canary's lend imports and waits here, before its job is answered.
                let canary =
                    matches!(&message, Message::Lend(l) if crate::canary::is_canary(l.job));
                let _canary = canary.then(CanaryScope::enter);
                let now = self.now();
                self.machine.handle(message, now)?;
                crate::probe::mark("w.contract");
                self.drain()
            }
        }
    }

    /// Carries out every action the machine has queued, in order.
    pub(super) fn drain(&mut self) -> Result<(), Error> {
        while let Some(action) = self.machine.poll_action() {
            tracing::trace!(?action, "contract action");
            let label = if crate::probe::enabled() {
                action_label(&action)
            } else {
                ""
            };
            self.act(action)?;
            if !label.is_empty() {
                crate::probe::mark(label);
            }
        }
        Ok(())
    }

    pub(super) fn act(&mut self, action: WorkerAction) -> Result<(), Error> {
        let span = action_span(&action);
        let _in_span = span.enter();
        let stream = self.stream.handle();
        match action {
            WorkerAction::Import {
                job,
                handoff,
                alloc,
                pool,
                export,
            } => {
                failpoint("before-import");
                if self.imports.contains_key(&alloc) {
                    return Err(Error::Protocol(format!(
                        "the contract imported allocation {alloc:?} twice"
                    )));
                }
                let pool = self.pool_handle(pool)?;
                // The cache is keyed by blob, and since export reuse a blob may name a new
                // allocation at an old one's address: the parent lends a recycled address
                // of the same size with the blob it exported for the earlier allocation (the
                // driver's blob of an address and size is the same bytes anyway). That is
                // sound here: an entry lives only while a handoff of this worker uses it
                // (freed at the last Unimport, before DONE), so a blob found in the cache
                // names the allocation lent now, whose range it maps, and nothing here ties
                // a blob to one allocation beyond that. Ordering is unchanged: the parent
                // frees the old allocation only after our ACK, its consumer stream waiting
                // on our DONE first; the pool hands the address out again only after that
                // free (stream order on that stream, the free's completion or its event
                // dependency on another); the parent records READY after it allocated and
                // wrote the new one; we touch it only after waiting on that READY. So even
                // with the old allocation's DONE not yet complete on the GPU when the
                // address is reused, every access of ours through the old blob is ordered
                // after it.
                let ptr = match self.cache.acquire(Arc::clone(&self.driver), pool, &export) {
                    Ok(ptr) => ptr,
                    Err(e) if crate::canary::is_canary(job) => {
                        tracing::warn!(job = job.0, ?alloc, error = %e, "a canary's import failed");
                        self.failed_imports.insert(alloc, e.to_string());
                        return Ok(());
                    }
                    Err(e) => return Err(e.into()),
                };
                tracing::trace!(job = job.0, ?handoff, ?alloc, ?ptr, "imported");
                self.imports.insert(alloc, Import { ptr, export });
            }
            WorkerAction::WaitReady { job, ready_event } => {
                failpoint("before-ready-wait");
                let event = match self.ready_events.get(&ready_event) {
                    Some(e) => e.handle(),
                    None => {
                        let e = OwnedEvent::open_ipc(Arc::clone(&self.driver), &ready_event)?;
                        let h = e.handle();
                        self.ready_events.insert(ready_event, e);
                        h
                    }
                };
                // Where READY completed already, as seen on the host, the stream is ordered
                // after it without a wait of its own (a completed query orders this
                // thread's later work after the record, as a synchronize does).
                if crate::settings::worker_ready_query() && self.driver.event_query(event)? {
                    tracing::trace!(job = job.0, "READY complete: no stream wait");
                } else {
                    tracing::trace!(job = job.0, "waiting on READY");
                    self.driver.stream_wait_event(stream, event)?;
                }
            }
            WorkerAction::ReceiveStaged { job, handoff, meta } => {
                let bytes = meta.byte_len;
                let alloc = PoolAllocation::new(Arc::clone(&self.driver), bytes.max(1), stream)?;
                let dst = alloc.ptr();
                self.staged
                    .insert(handoff, StagedCopy { job, alloc, bytes });
                let ch = self.staging.as_mut().ok_or_else(|| {
                    Error::Protocol("a staged input before host staging was set up".into())
                })?;
                let received = ch.recv_tensor(&mut self.conn, job, handoff, dst, bytes, stream);
                self.backlog.extend(ch.take_backlog());
                received?;
            }
            WorkerAction::JobStarted { job, inputs, slice } => {
                self.started.push_back(Started { job, inputs, slice });
            }
            WorkerAction::ResultsGranted { job, results } => {
                if self.granted.insert(job, results).is_some() {
                    return Err(Error::Protocol(format!(
                        "two grants for job {} before it took one",
                        job.0
                    )));
                }
            }
            WorkerAction::Unimport { alloc } => {
                if self.failed_imports.remove(&alloc).is_some() {
                    return Ok(());
                }
                let Some(import) = self.imports.remove(&alloc) else {
                    return Err(Error::Protocol(format!(
                        "the contract freed allocation {alloc:?}, which is not imported"
                    )));
                };
                self.cache.release(&import.export, stream)?;
            }
            WorkerAction::RecordDone { job } => {
                failpoint("before-done");
                if failpoint_armed("hang-before-done") {
                    tracing::warn!(
                        job = job.0,
                        "failpoint reached: DONE goes behind a kernel that never ends"
                    );
                    self.driver.launch_hang_kernel(stream)?;
                }
                tracing::trace!(job = job.0, "recording DONE");
                if self.sim.is_some() {
                    self.driver.sim_returned(job.0, stream);
                }
                if let Err(e) = self.driver.event_record(self.done.handle(), stream) {
                    // Without DONE the parent can never be ordered after this job's work:
                    // the context is most likely lost (a GPU fault, a write into read-only
                    // memory). Hang up so the parent fails the job now, as a lost worker's,
                    // rather than at its deadline.
                    tracing::error!(job = job.0, error = %e, "DONE cannot be recorded: hanging up");
                    self.conn.hang_up();
                    return Err(e.into());
                }
                // Its accesses through the parent's VMM allocations are ordered before DONE.
                self.vmm.job_done(job);
            }
            WorkerAction::Send(message) => {
                // DONE and the ACK right behind it (nothing staged between) go in one write:
                // one system call here, one wake-up and read at the parent. Not with the
                // failpoint between them armed, which must die with only DONE sent.
                let ack = match (&message, self.machine.peek_action()) {
                    (Message::Done(_), Some(WorkerAction::Send(Message::Ack(_))))
                        if !failpoint_armed("after-done") =>
                    {
                        self.machine.poll_action()
                    }
                    _ => None,
                };
                let deadline = Instant::now() + SEND_TIMEOUT;
                match &ack {
                    Some(WorkerAction::Send(ack)) => {
                        self.conn.send_many(&[&message, ack], deadline)?;
                    }
                    _ => self.conn.send(&message, &[], deadline)?,
                }
                self.last_frame = Instant::now();
                if let Message::Done(_) = message {
                    failpoint("after-done");
                }
                if ack.is_some() || matches!(message, Message::Ack(_)) {
                    failpoint("after-ack");
                }
            }
            WorkerAction::SendStaged { job, handoff } => {
                let Some(copy) = self.staged.remove(&handoff) else {
                    return Err(Error::Protocol(format!(
                        "staged tensor {handoff:?} of job {} has no memory here",
                        job.0
                    )));
                };
                if failpoint_armed("hang-before-staged-send") {
                    tracing::warn!(
                        job = job.0,
                        "failpoint reached: the staged send goes behind a kernel that never ends"
                    );
                    self.driver.launch_hang_kernel(stream)?;
                }
                let ch = self.staging.as_mut().ok_or_else(|| {
                    Error::Protocol("a staged result without host staging".into())
                })?;
                let sent =
                    ch.send_tensor(&mut self.conn, job, handoff, copy.ptr(), copy.bytes, stream);
                self.backlog.extend(ch.take_backlog());
                // Stream-ordered after the copies out of it.
                self.free_copy(copy);
                sent?;
            }
            WorkerAction::Cancelled { job } => {
                tracing::debug!(job = job.0, "the parent cancelled the job");
                self.cancelled.insert(job);
            }
            WorkerAction::Stop => {
                tracing::debug!("the parent said goodbye");
                self.stopping = true;
            }
        }
        Ok(())
    }

    /// Waits until the machine passed the grants of `job`'s result request, handling every
    /// frame that comes first (lends of later jobs are queued).
    pub(super) fn wait_for_grants(&mut self, job: JobId) -> Result<Vec<ResultGrant>, Error> {
        loop {
            if let Some(grants) = self.granted.remove(&job) {
                return Ok(grants);
            }
            let (message, fds) = self.next_frame()?;
            self.take(message, fds)?;
        }
    }

    /// The job's last access is queued: the machine's finish (unimports, DONE, Done, staged
    /// results, Ack), then this process's copies of its staged tensors are freed.
    pub(super) fn finish_job(&mut self, job: JobId) -> Result<(), Error> {
        crate::probe::mark("w.finish");
        let finished = self
            .machine
            .finish_job(job, self.done_blob)
            .map_err(Error::from)
            .and_then(|()| self.drain());
        let copies: Vec<HandoffId> = self
            .staged
            .iter()
            .filter(|(_, c)| c.job == job)
            .map(|(h, _)| *h)
            .collect();
        for h in copies {
            if let Some(copy) = self.staged.remove(&h) {
                self.free_copy(copy);
            }
        }
        self.cancelled.remove(&job);
        self.granted.remove(&job);
        if let Some(sim) = &self.sim {
            sim.strict_own();
        }
        finished
    }

    /// Frees a staged copy, stream-ordered; a failure is logged (the memory is ours).
    pub(super) fn free_copy(&self, copy: StagedCopy) {
        let (job, ptr) = (copy.job, copy.ptr());
        if let Err(e) = copy.alloc.free(self.stream.handle()) {
            tracing::warn!(job = job.0, ?ptr, error = %e, "freeing a staged copy failed");
        }
    }
}

/// The span an action is carried out in, named for its job: with a subscriber at debug, every
/// event logged while carrying it out says which job it was for.
fn action_span(action: &WorkerAction) -> tracing::Span {
    match action {
        WorkerAction::Import { job, .. }
        | WorkerAction::WaitReady { job, .. }
        | WorkerAction::ReceiveStaged { job, .. }
        | WorkerAction::JobStarted { job, .. }
        | WorkerAction::ResultsGranted { job, .. }
        | WorkerAction::RecordDone { job }
        | WorkerAction::SendStaged { job, .. }
        | WorkerAction::Cancelled { job } => tracing::debug_span!("job", %job),
        WorkerAction::Unimport { .. } | WorkerAction::Send(_) | WorkerAction::Stop => {
            tracing::Span::none()
        }
    }
}

/// The probe's name for a worker action, marked when it was carried out.
fn action_label(action: &WorkerAction) -> &'static str {
    match action {
        WorkerAction::Import { .. } => "w.import",
        WorkerAction::WaitReady { .. } => "w.wait_ready",
        WorkerAction::ReceiveStaged { .. } => "w.receive_staged",
        WorkerAction::JobStarted { .. } => "w.started",
        WorkerAction::ResultsGranted { .. } => "w.granted",
        WorkerAction::Unimport { .. } => "w.unimport",
        WorkerAction::RecordDone { .. } => "w.record_done",
        WorkerAction::Send(Message::Done(_)) => "w.send_done",
        WorkerAction::Send(_) => "w.send",
        WorkerAction::SendStaged { .. } => "w.send_staged",
        WorkerAction::Cancelled { .. } => "w.cancelled",
        WorkerAction::Stop => "w.stop",
    }
}
