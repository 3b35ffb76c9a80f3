//! The loop's IO: waiting for sockets, commands and deadlines; frames read and handed to
//! the contract; frames sent, queued or through the staging channel.

use std::io::Read as _;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll, ppoll};
use nix::sys::time::TimeSpec;
use poolipc_contract::{Message, ParentEvent, ResultGrant};
use poolipc_driver::EventHandle;
use poolipc_transport::{Connection, TransportError};
use poolipc_types::WorkerId;

use super::transfer::Held;
use super::{Command, EXIT_POLL, FRAMES_PER_TURN, IDLE_POLL, Loop, MAPPINGS_ACK, Shared};

/// What the IO thread waits on, planned with the loop held ([`Loop::plan_wait`]) and waited
/// on without it ([`WaitPlan::wait`]).
pub(super) struct WaitPlan {
    /// The room's wake-up socket (read end).
    wake: Arc<UnixStream>,
    /// The workers polled, with a descriptor of each one's socket, whether frames wait in
    /// its send queue, and whether a whole frame is already read.
    ids: Vec<WorkerId>,
    fds: Vec<Arc<OwnedFd>>,
    pollout: Vec<bool>,
    buffered: Vec<bool>,
    any_buffered: bool,
    /// The DONE events of the jobs held for them.
    gate_events: Vec<Vec<EventHandle>>,
    /// Until when it may sleep.
    wake_at: Instant,
    /// Until when it looks again without sleeping.
    spin_until: Option<Instant>,
}

/// What the wait saw.
pub(super) struct Polled {
    result: Result<(), nix::errno::Errno>,
    /// Whether the wake-up socket was readable.
    woke: bool,
    /// Whether each planned worker's socket was readable (or hung up), in the plan's order.
    readable: Vec<bool>,
    /// How long it waited.
    waited: Duration,
}

impl WaitPlan {
    /// Waits, without the loop, until a planned socket is readable, a command comes (the
    /// wake-up byte, or `pending` while it spins), a held job's DONE completed, or the plan's
    /// time is up.
    pub(super) fn wait(&self, shared: &Shared, room: usize) -> Polled {
        let mut fds = Vec::with_capacity(self.fds.len() + 1);
        fds.push(PollFd::new(self.wake.as_fd(), PollFlags::POLLIN));
        for (fd, &out) in self.fds.iter().zip(&self.pollout) {
            let events = if out {
                PollFlags::POLLIN | PollFlags::POLLOUT
            } else {
                PollFlags::POLLIN
            };
            fds.push(PollFd::new(fd.as_fd(), events));
        }
        // The loop's waiting (spinning or asleep) between these two marks: the rest of its
        // time is work (`probe_report.py --threads`).
        crate::probe::mark("io.wait");
        let started = Instant::now();
        let r = &shared.rooms[room];
        // `io_spinning` was raised by `plan_wait`, with the loop held, where it plans a spin.
        let (pending, spinning_flag) = (&r.pending, &r.io_spinning);
        let driver = &shared.driver;
        let polled = loop {
            let spinning = self.spin_until.is_some_and(|t| Instant::now() < t);
            if !spinning {
                spinning_flag.store(false, Ordering::SeqCst);
            }
            if spinning
                && self.gate_events.iter().any(|evs| {
                    evs.iter()
                        .all(|e| !matches!(driver.event_query(*e), Ok(false)))
                })
            {
                // A held job's DONE completed (or its query failed): see to it now.
                spinning_flag.store(false, Ordering::SeqCst);
                break Ok(0);
            }
            if pending.load(Ordering::SeqCst) {
                // A command came (while spinning, without a wake-up byte): take it now.
                spinning_flag.store(false, Ordering::SeqCst);
                break Ok(0);
            }
            let left = self.wake_at.saturating_duration_since(Instant::now());
            let polled = if spinning || self.any_buffered {
                poll(&mut fds, PollTimeout::from(0u16))
            } else if left < Duration::from_millis(1) {
                // `poll` counts in milliseconds: a held job's next look is sooner.
                ppoll(&mut fds, Some(TimeSpec::from(left)), None)
            } else {
                let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
                poll(&mut fds, PollTimeout::from(ms))
            };
            match polled {
                Ok(0) if spinning && !self.any_buffered => crate::spin::pause(),
                other => {
                    spinning_flag.store(false, Ordering::SeqCst);
                    break other;
                }
            }
        };
        let waited = started.elapsed();
        let woke = fds[0].revents().is_some_and(|r| !r.is_empty());
        let readable = fds[1..]
            .iter()
            .map(|fd| {
                let revents = fd.revents().unwrap_or(PollFlags::empty());
                // Readable, or hung up / in error (the read says which).
                !(revents - PollFlags::POLLOUT).is_empty()
            })
            .collect();
        Polled {
            result: polled.map(|_| ()),
            woke,
            readable,
            waited,
        }
    }
}

impl Loop {
    /// How long the loop may wait from `now` before something is due: the contract's next
    /// deadline, a worker exiting, an answer awaited, the pool's trim, a frame's deadline, a
    /// held job's next look; [`IDLE_POLL`] at most.
    pub(super) fn wait_timeout(&self, now: Instant) -> Duration {
        let mut timeout = IDLE_POLL;
        if let Some(t) = self.machine.poll_timeout() {
            let stamp = self.pace.stamp(now);
            timeout = timeout.min(Duration::from_nanos(t.0.saturating_sub(stamp.0)));
        }
        if self.workers.exiting() {
            timeout = timeout.min(EXIT_POLL);
        }
        if self.answers.waiting() {
            timeout = timeout.min(EXIT_POLL);
        }
        if let Some(t) = self.pool_trim.next() {
            timeout = timeout.min(t.saturating_duration_since(now));
        }
        let frame_timeout = self.shared.options.frame_timeout;
        for s in self.workers.values().filter(|s| s.lost.is_none()) {
            if let Some(t) = s.conn.as_ref().and_then(|c| c.next_deadline(frame_timeout)) {
                timeout = timeout.min(t.saturating_duration_since(now));
            }
        }
        if let Some(next) = self.gates.next_look(now) {
            timeout = timeout.min(next);
        }
        timeout
    }

    /// What the IO thread waits on next, planned with the loop held: it then waits without
    /// it ([`WaitPlan::wait`]), so that a caller's thread can take the direct path, and hands
    /// what it saw to [`Loop::after_wait`].
    pub(super) fn plan_wait(&mut self) -> WaitPlan {
        let now = Instant::now();
        let timeout = self.wait_timeout(now);
        let gate_events: Vec<Vec<EventHandle>> = self.gates.events();
        let mut ids = Vec::new();
        let mut fds = Vec::new();
        let mut pollout = Vec::new();
        let mut buffered = Vec::new();
        for (id, s) in self.workers.iter() {
            if s.lost.is_some() {
                continue;
            }
            let (Some(conn), Some(fd)) = (s.conn.as_ref(), s.poll_fd.as_ref()) else {
                continue;
            };
            ids.push(*id);
            fds.push(Arc::clone(fd));
            // Writability too while frames wait in its send queue.
            pollout.push(conn.send_queued());
            // Frames already read from a socket (behind another frame, or while a staged
            // transfer read the socket) wake no poll: take them first, without sleeping.
            buffered.push(conn.frame_buffered());
        }
        // While jobs are in flight a frame is due soon (≈ 330 µs without MPS, ≈ 50 µs
        // with), and just after one finished the caller's next submit often is: look again
        // without sleeping for up to `options.tuning.spin_in_flight` after the last activity
        // (`options.tuning.spin` when idle), which saves a wake-up per frame and per submit.
        let options = &self.shared.options;
        let spin_until = self.pace.spin_until(
            !self.jobs.is_empty(),
            options.tuning.spin,
            options.tuning.spin_in_flight,
            now,
        );
        if spin_until.is_some() {
            // Raised before the loop is let go: a caller that takes the loop after that sees
            // it (`direct::on_caller` looks again once it holds the loop) and leaves the loop
            // alone while the spin queries `gate_events` without it, since the loop's work
            // may close those events (a reaped worker's, or one aged out of `DoneEvents`).
            self.shared.rooms[self.room]
                .io_spinning
                .store(true, Ordering::SeqCst);
        }
        let wake_at = now + timeout;
        // A caller's thread that holds the loop meanwhile wakes the thread where something
        // comes due before this ([`Loop::after_direct`]).
        self.asleep_until = Some(wake_at);
        WaitPlan {
            wake: Arc::clone(&self.wake),
            any_buffered: buffered.iter().any(|&b| b),
            ids,
            fds,
            pollout,
            buffered,
            gate_events,
            wake_at,
            spin_until,
        }
    }

    /// What the IO thread saw while it waited (`plan`, `polled`): the wake-up bytes taken,
    /// queued frames written, one frame read from each readable socket.
    pub(super) fn after_wait(&mut self, plan: WaitPlan, polled: Polled) {
        self.asleep_until = None;
        self.pace.waited(polled.waited);
        crate::probe::mark("io.woke");
        match polled.result {
            Ok(()) => {}
            Err(nix::errno::Errno::EINTR) => return,
            Err(e) => {
                tracing::error!(error = %e, "poll failed");
                std::thread::sleep(Duration::from_millis(10));
                return;
            }
        }
        if polled.woke {
            let mut buf = [0u8; 256];
            while matches!((&*self.wake).read(&mut buf), Ok(n) if n > 0) {}
        }
        self.flush_sends();
        for (i, id) in plan.ids.iter().enumerate() {
            if plan.buffered[i] || polled.readable.get(i).copied().unwrap_or(false) {
                self.pace.active(Instant::now());
                let _ = self.read_one(*id);
            }
        }
        self.check_frame_deadlines();
    }

    /// Reads what a readable worker socket holds, without waiting, and hands each whole frame
    /// to the contract (a worker's DONE and ACK come together), at most
    /// [`FRAMES_PER_TURN`] before the other workers get their turn. A frame not all here
    /// stays in the connection, with its descriptors, until it is (or its deadline passes:
    /// [`Loop::check_frame_deadlines`]).
    /// Returns how many frames it handed on.
    pub(super) fn read_one(&mut self, worker: WorkerId) -> usize {
        for n in 0..FRAMES_PER_TURN {
            let Some(slot) = self.workers.get_mut(&worker) else {
                return n;
            };
            let Some(conn) = slot.conn.as_mut().filter(|_| slot.lost.is_none()) else {
                return n;
            };
            match conn.poll_recv() {
                Ok(Some((message, _fds))) => {
                    crate::probe::mark("io.recv");
                    self.received(worker, message);
                }
                Ok(None) => return n,
                Err(e) => {
                    self.hung_up(worker, &e);
                    return n;
                }
            }
        }
        FRAMES_PER_TURN
    }

    /// Writes what the socket of each worker with queued frames takes now.
    pub(super) fn flush_sends(&mut self) {
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, s)| {
                s.lost.is_none() && s.conn.as_ref().is_some_and(Connection::send_queued)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let Some(conn) = self.workers.get_mut(&id).and_then(|s| s.conn.as_mut()) else {
                continue;
            };
            if let Err(e) = conn.flush() {
                self.hung_up(id, &e);
            }
        }
    }

    /// Condemns each worker whose frame began to arrive, or was queued for it, a frame
    /// timeout ago or more and is not all there.
    pub(super) fn check_frame_deadlines(&mut self) {
        let now = Instant::now();
        let timeout = self.shared.options.frame_timeout;
        let late: Vec<(WorkerId, TransportError)> = self
            .workers
            .iter_mut()
            .filter(|(_, s)| s.lost.is_none())
            .filter_map(|(id, s)| {
                let e = s.conn.as_mut()?.check_deadlines(now, timeout).err()?;
                Some((*id, e))
            })
            .collect();
        for (id, e) in late {
            self.hung_up(id, &e);
        }
    }

    pub(super) fn received(&mut self, worker: WorkerId, message: Message) {
        let span = tracing::debug_span!("received", %worker);
        let _in_span = span.enter();
        tracing::trace!(kind = ?message.kind(), "received");
        // What empty_cache asked, not the contract's: a chunk unmapped, cached mappings
        // dropped.
        let answered = match message {
            Message::ArenaReleased(r) => Some(r.index),
            Message::MappingsReleased { dropped } => {
                tracing::debug!(worker = %worker, dropped, "cached VMM mappings dropped");
                Some(MAPPINGS_ACK)
            }
            Message::ExtraPoolReply(ref r) => Some(self.pool_offer_answered(worker, r)),
            Message::PoolRetired(r) => Some(self.pool_retire_answered(worker, r.index)),
            _ => None,
        };
        if let Some(key) = answered {
            if !self.answers.answered(worker, key) {
                tracing::debug!(worker = %worker, key, "a release answer not asked for");
            }
            return;
        }
        let now = self.now();
        if let Err(e) = self
            .machine
            .handle(ParentEvent::Received { worker, message }, now)
        {
            tracing::warn!(worker = %worker, error = %e, "the contract refused an event");
        }
        crate::probe::mark("io.contract");
        self.drive();
    }

    pub(super) fn hung_up(&mut self, worker: WorkerId, e: &TransportError) {
        let why = if e.is_peer_gone() {
            format!("the worker closed its connection ({e})")
        } else {
            format!("the worker's connection broke: {e}")
        };
        self.lose(worker, &why);
        self.drive();
    }

    pub(super) fn drain_backlogs(&mut self) {
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, s)| !s.backlog.is_empty())
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            while let Some(m) = self
                .workers
                .get_mut(&id)
                .and_then(|s| s.backlog.pop_front())
            {
                self.received(id, m);
            }
        }
    }

    pub(super) fn command(&mut self, command: Command) {
        self.pace.active(Instant::now());
        match command {
            Command::Adopt {
                worker,
                conn,
                child,
                reply,
            } => {
                let r = self.adopt(worker, *conn, child);
                let _ = reply.send(r);
            }
            Command::Submit(sub) => {
                crate::probe::mark("io.cmd");
                self.submit(sub);
            }
            Command::Stop { worker, reply } => self.stop(worker, Some(reply)),
            Command::Cancel { worker, job } => self.cancel(worker, job),
            Command::ReleaseArena { reply } => self.release_arena_now(reply),
            Command::Staged(done) => self.transfer_done(*done),
            Command::StagingSetUp(done) => self.setup_done(*done),
            Command::ResultMade(made) => self.result_made(*made),
            Command::Panic => {
                // The test hook's whole point: stand in for a bug of the loop's.
                #[allow(clippy::panic)] // asked for by `Parent::panic_io_thread`, tests only
                {
                    panic!("Parent::panic_io_thread asked the IO thread to panic");
                }
            }
            Command::OfferPool {
                pool,
                handle,
                reply,
            } => self.offer_pool_now(pool, handle, reply),
            Command::RetirePool { handle, reply } => self.retire_pool_now(handle, reply),
            Command::Shutdown => {
                self.shutting_down = true;
                let ids: Vec<WorkerId> = self.workers.keys().copied().collect();
                for id in ids {
                    self.stop(id, None);
                }
            }
        }
    }

    /// Sends what the contract emitted, unchanged; notes result grants for later.
    pub(super) fn send(&mut self, worker: WorkerId, message: &Message) {
        if let Message::AllocationGrant(g) = message
            && let Some(st) = self.jobs.get_mut(&(worker, g.job))
        {
            for grant in &g.results {
                if let ResultGrant::Granted { handle, alloc, .. }
                | ResultGrant::Arena { handle, alloc, .. } = grant
                {
                    st.granted(*alloc, *handle);
                }
            }
        }
        let Some(slot) = self.workers.get_mut(&worker) else {
            return;
        };
        if slot.lost.is_some() {
            return;
        }
        let Some(conn) = slot.conn.as_mut() else {
            // Its transfer has the socket: the frame goes after it, in order.
            slot.held.push_back(Held::Frame(message.clone(), None));
            return;
        };
        // Queued, written as the socket takes it: a worker that does not read blocks no one
        // (its queue's bound and the frame deadline condemn it).
        if let Err(e) = conn.enqueue(message, &[]) {
            if matches!(message, Message::Bye) {
                // A worker that already left needs no goodbye.
                slot.lost = Some(format!("sending Bye failed: {e}"));
                return;
            }
            self.lose(worker, &format!("sending {} failed: {e}", message.kind()));
        }
    }

    /// Queues a frame of the loop's own (with its FD, if it has one) for `worker`, or holds
    /// it while the worker's transfer has its socket.
    pub(super) fn enqueue_frame(
        &mut self,
        worker: WorkerId,
        message: &Message,
        fd: Option<std::os::fd::OwnedFd>,
    ) {
        let Some(slot) = self.workers.get_mut(&worker) else {
            return;
        };
        if slot.lost.is_some() {
            return;
        }
        let Some(conn) = slot.conn.as_mut() else {
            slot.held.push_back(Held::Frame(message.clone(), fd));
            return;
        };
        let fds: Vec<std::os::fd::BorrowedFd<'_>> = fd.iter().map(AsFd::as_fd).collect();
        if let Err(e) = conn.enqueue(message, &fds) {
            self.lose(worker, &format!("sending {} failed: {e}", message.kind()));
        }
    }
}
