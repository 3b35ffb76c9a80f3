//! The loop's IO: waiting for sockets, commands and deadlines; frames read and handed to
//! the contract; frames sent, queued or through the staging channel.

use std::io::Read as _;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll, ppoll};
use nix::sys::time::TimeSpec;
use poolipc_contract::{Message, ParentEvent, ResultGrant};
use poolipc_driver::EventHandle;
use poolipc_transport::{Connection, TransportError};
use poolipc_types::WorkerId;

use super::transfer::Held;
use super::{Command, EXIT_POLL, FRAMES_PER_TURN, IDLE_POLL, Loop, MAPPINGS_ACK};

impl Loop {
    /// Sleeps in `poll` until a worker's socket is readable, a command arrives, or the next
    /// deadline; reads one frame from each readable socket.
    pub(super) fn wait_for_io(&mut self) {
        let mut timeout = IDLE_POLL;
        if let Some(t) = self.machine.poll_timeout() {
            let now = self.now();
            timeout = timeout.min(Duration::from_nanos(t.0.saturating_sub(now.0)));
        }
        if self.workers.exiting() {
            timeout = timeout.min(EXIT_POLL);
        }
        if self.answers.waiting() {
            timeout = timeout.min(EXIT_POLL);
        }
        let now = Instant::now();
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
        let gate_events: Vec<Vec<EventHandle>> = self.gates.events();
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, s)| s.lost.is_none() && s.conn.is_some())
            .map(|(id, _)| *id)
            .collect();
        // Frames already read from a socket (behind another frame, or while a staged
        // transfer read the socket) wake no poll: take them first, without sleeping.
        let buffered: Vec<bool> = ids
            .iter()
            .map(|id| {
                self.workers
                    .get(id)
                    .and_then(|s| s.conn.as_ref())
                    .is_some_and(Connection::frame_buffered)
            })
            .collect();
        let any_buffered = buffered.iter().any(|&b| b);
        let readable: Vec<(WorkerId, bool)> = {
            let mut fds = Vec::with_capacity(ids.len() + 1);
            fds.push(PollFd::new(self.wake.as_fd(), PollFlags::POLLIN));
            for id in &ids {
                if let Some(conn) = self.workers.get(id).and_then(|s| s.conn.as_ref()) {
                    // Writability too while frames wait in its send queue.
                    let events = if conn.send_queued() {
                        PollFlags::POLLIN | PollFlags::POLLOUT
                    } else {
                        PollFlags::POLLIN
                    };
                    fds.push(PollFd::new(conn.as_fd(), events));
                }
            }
            let ms = u16::try_from(timeout.as_millis().max(1)).unwrap_or(u16::MAX);
            // While jobs are in flight a frame is due soon (≈ 330 µs without MPS, ≈ 50 µs
            // with), and just after one finished the caller's next submit often is: look
            // again without sleeping for up to `options.tuning.spin_in_flight` after the last
            // activity (`options.tuning.spin` when idle), which saves a wake-up per frame and per
            // submit.
            let options = &self.shared.options;
            // The loop's waiting (spinning or asleep) between these two marks: the rest of
            // its time is work (`probe_report.py --threads`).
            crate::probe::mark("io.wait");
            let started = Instant::now();
            let busy = !self.jobs.is_empty();
            let spin_until = self.pace.spin_until(
                busy,
                options.tuning.spin,
                options.tuning.spin_in_flight,
                started,
            );
            let room = &self.shared.rooms[self.room];
            let pending = &room.pending;
            let spinning_flag = &room.io_spinning;
            if spin_until.is_some() {
                spinning_flag.store(true, Ordering::SeqCst);
            }
            let driver = &self.shared.driver;
            let polled = loop {
                let spinning = spin_until.is_some_and(|t| Instant::now() < t);
                if !spinning {
                    spinning_flag.store(false, Ordering::SeqCst);
                }
                if spinning
                    && gate_events.iter().any(|evs| {
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
                let polled = if spinning || any_buffered {
                    poll(&mut fds, PollTimeout::from(0u16))
                } else if timeout < Duration::from_millis(1) {
                    // `poll` counts in milliseconds: a held job's next look is sooner.
                    ppoll(&mut fds, Some(TimeSpec::from(timeout)), None)
                } else {
                    poll(&mut fds, PollTimeout::from(ms))
                };
                match polled {
                    Ok(0) if spinning && !any_buffered => crate::spin::pause(),
                    other => {
                        spinning_flag.store(false, Ordering::SeqCst);
                        break other;
                    }
                }
            };
            self.pace.waited(started.elapsed());
            crate::probe::mark("io.woke");
            match polled {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => return,
                Err(e) => {
                    tracing::error!(error = %e, "poll failed");
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
            let woke = fds[0].revents().is_some_and(|r| !r.is_empty());
            if woke {
                let mut buf = [0u8; 256];
                while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
            }
            ids.iter()
                .zip(&fds[1..])
                .zip(&buffered)
                .map(|((id, fd), &b)| {
                    let revents = fd.revents().unwrap_or(PollFlags::empty());
                    // Readable, or hung up / in error (the read says which).
                    let readable = !(revents - PollFlags::POLLOUT).is_empty();
                    (*id, b || readable)
                })
                .collect()
        };
        self.flush_sends();
        for (id, ready) in readable {
            if ready {
                self.pace.active(Instant::now());
                self.read_one(id);
            }
        }
        self.check_frame_deadlines();
    }

    /// Reads what a readable worker socket holds, without waiting, and hands each whole frame
    /// to the contract (a worker's DONE and ACK come together), at most
    /// [`FRAMES_PER_TURN`] before the other workers get their turn. A frame not all here
    /// stays in the connection, with its descriptors, until it is (or its deadline passes:
    /// [`Loop::check_frame_deadlines`]).
    pub(super) fn read_one(&mut self, worker: WorkerId) {
        for _ in 0..FRAMES_PER_TURN {
            let Some(slot) = self.workers.get_mut(&worker) else {
                return;
            };
            let Some(conn) = slot.conn.as_mut().filter(|_| slot.lost.is_none()) else {
                return;
            };
            match conn.poll_recv() {
                Ok(Some((message, _fds))) => {
                    crate::probe::mark("io.recv");
                    self.received(worker, message);
                }
                Ok(None) => return,
                Err(e) => {
                    self.hung_up(worker, &e);
                    return;
                }
            }
        }
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
