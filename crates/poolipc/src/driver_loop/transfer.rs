//! Host-staged transfers off the IO thread: a worker's whole staged tensor (its chunks and
//! their acks, each wait up to the staging timeout) runs on a thread of its own, so that a
//! worker that acks slowly stalls only itself.
//!
//! While a transfer runs the thread owns the worker's [`Connection`] and [`StagingChannel`]:
//! the loop neither reads nor writes that worker's socket and holds, in order, every further
//! contract action for it and every frame the loop itself means to send it. The thread hands
//! both back through the loop's command channel with the transfer's result and the frames
//! that came meanwhile ([`StagingChannel::take_backlog`]); the loop then handles the result
//! as it handled a transfer it ran itself, and replays what it held.
//!
//! The staging setup with a worker (its `StagingReady` may take up to the staging timeout)
//! runs the same way ([`Loop::start_setup`]): the thread has the connection, the loop holds
//! what comes for the worker, and the job that needs the setup waits first in the worker's
//! queue, placed, until [`Command::StagingSetUp`] brings the channel (or the failure).
//!
//! The loop never lets the worker go (reaps it) while its transfer runs: the thread copies
//! into and out of memory that the reaping releases. To end a transfer early (the worker is
//! condemned, lost, or past its stop deadline) the loop kills the process, shuts the socket
//! down (the thread's next read or write fails at once) and sets the channel's abort flag
//! ([`StagingChannel::abort_flag`]: a wait for the worker's GPU work, polled on the host,
//! fails at its next poll; shutting the socket does not reach it, and the event it polls may
//! never complete, not even once the worker is killed). The thread then hands everything
//! back.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use poolipc_contract::{self as contract, Message, ParentAction};
use poolipc_driver::{DevicePtr, StreamHandle};
use poolipc_transport::Connection;
use poolipc_types::{HandoffId, JobId, WorkerId};

use super::{Command, Loop, Slot, backlog_full};
use crate::error::Error;
use crate::staging::{StagingChannel, StagingError};
use crate::state::Stats;

/// A staging setup that ended on its thread ([`Loop::start_setup`]): the worker's
/// connection, and its channel or why there is none.
pub(crate) struct SetupDone {
    worker: WorkerId,
    conn: Connection,
    result: Result<StagingChannel, StagingError>,
}

impl SetupDone {
    /// The worker whose staging was set up.
    pub(crate) fn worker(&self) -> WorkerId {
        self.worker
    }
}

/// Which way a staged tensor goes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Direction {
    /// An input, out to the worker.
    Send,
    /// A result, or a writable staged input coming back (copy-back: `copy_back`), in from
    /// the worker; `what` names it in errors.
    Receive { what: &'static str, copy_back: bool },
}

/// One staged tensor to move.
#[derive(Clone, Copy, Debug)]
pub(super) struct Transfer {
    pub(super) worker: WorkerId,
    pub(super) job: JobId,
    pub(super) handoff: HandoffId,
    /// The tensor's place in this process's device memory: where it comes from or goes to.
    pub(super) ptr: DevicePtr,
    pub(super) bytes: u64,
    pub(super) stream: StreamHandle,
    pub(super) direction: Direction,
}

/// A transfer that ended on its thread: what it borrowed of the worker, and how it went.
pub(crate) struct TransferDone {
    transfer: Transfer,
    conn: Connection,
    channel: StagingChannel,
    result: Result<(), StagingError>,
    /// The worker's frames that arrived while the transfer waited for its own.
    backlog: VecDeque<Message>,
}

impl TransferDone {
    /// The worker whose tensor was transferred.
    pub(crate) fn worker(&self) -> WorkerId {
        self.transfer.worker
    }
}

/// A worker's connection while a transfer has it.
pub(super) struct Away {
    /// A duplicate of the worker's socket, to shut it down under the transfer
    /// ([`Loop::abort_transfer`]); `None` if it could not be duplicated (then only killing
    /// the process ends the transfer early).
    socket: Option<OwnedFd>,
    /// The channel's abort flag ([`StagingChannel::abort_flag`]), set to end the
    /// transfer's waits for the worker's GPU work early.
    abort: Arc<AtomicBool>,
    /// Whether the loop ended the transfer early already.
    aborted: bool,
}

impl Away {
    /// Whether the loop ended the transfer early already ([`Loop::abort_transfer`]).
    pub(super) fn aborted(&self) -> bool {
        self.aborted
    }
}

/// What the loop held for a worker while its transfer ran, in the order it came.
pub(super) enum Held {
    /// A contract action for the worker.
    Action(ParentAction),
    /// A frame of the loop's own (an `empty_cache` request, a pool offer), with its FD.
    Frame(Message, Option<OwnedFd>),
}

/// What a transfer's thread is given: moved to it only once the thread runs, so that a
/// failed spawn leaves it with the loop.
struct Payload {
    transfer: Transfer,
    conn: Connection,
    channel: StagingChannel,
}

impl Slot {
    /// Whether the loop holds what comes for this worker (its transfer runs, or what was
    /// held meanwhile has not all been replayed).
    pub(super) fn holds(&self) -> bool {
        self.away.is_some() || !self.held.is_empty()
    }
}

impl Loop {
    /// Starts moving one staged tensor on a thread of its own; its result comes back as
    /// [`Command::Staged`].
    pub(super) fn start_transfer(&mut self, t: Transfer) {
        let Some(slot) = self.workers.get_mut(&t.worker) else {
            return;
        };
        if slot.lost.is_some() {
            // Its socket is gone or condemned: the transfer could only fail, and the contract
            // fails the job with the worker.
            return;
        }
        let (Some(conn), Some(channel)) = (slot.conn.take(), slot.staging.take()) else {
            let e = Error::Protocol("host staging is not set up".into());
            self.transfer_failed(t, e);
            return;
        };
        let socket = match conn.as_fd().try_clone_to_owned() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(worker = %t.worker, error = %e, "duplicating the worker's socket failed: only killing it ends its transfer early");
                None
            }
        };
        let abort = channel.abort_flag();
        let (tx, rx) = std::sync::mpsc::channel::<Payload>();
        let shared = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new()
            .name("poolipc-staging".into())
            .spawn(move || {
                let Ok(Payload {
                    transfer,
                    mut conn,
                    mut channel,
                }) = rx.recv()
                else {
                    return;
                };
                let result = run(&shared, &transfer, &mut channel, &mut conn);
                let backlog = channel.take_backlog();
                // The loop wakes for it; a loop already gone drops it, closing the socket.
                shared.post(Command::Staged(Box::new(TransferDone {
                    transfer,
                    conn,
                    channel,
                    result,
                    backlog,
                })));
            });
        let payload = Payload {
            transfer: t,
            conn,
            channel,
        };
        let refused = match spawned {
            Ok(_) => match tx.send(payload) {
                Ok(()) => None,
                Err(back) => Some((back.0, "the staging thread ended at its start".to_owned())),
            },
            Err(e) => Some((payload, format!("starting a staging thread failed: {e}"))),
        };
        let Some(slot) = self.workers.get_mut(&t.worker) else {
            return;
        };
        match refused {
            None => {
                slot.away = Some(Away {
                    socket,
                    abort,
                    aborted: false,
                });
            }
            Some((p, why)) => {
                slot.conn = Some(p.conn);
                slot.staging = Some(p.channel);
                self.transfer_failed(t, Error::Protocol(why));
            }
        }
    }

    /// A transfer's thread handed the worker's connection and channel back: the result is
    /// handled as a transfer run on the loop was, then what was held for the worker runs.
    pub(super) fn transfer_done(&mut self, done: TransferDone) {
        let TransferDone {
            transfer: t,
            conn,
            channel,
            result,
            backlog,
        } = done;
        let Some(slot) = self.workers.get_mut(&t.worker) else {
            // Not reaped while away (see the module docs): nothing to give back to.
            tracing::error!(worker = %t.worker, "a staging transfer ended for a worker the loop let go");
            return;
        };
        slot.conn = Some(conn);
        slot.staging = Some(channel);
        slot.backlog.extend(backlog);
        slot.away = None;
        match result {
            Ok(()) => {
                if matches!(
                    t.direction,
                    Direction::Receive {
                        copy_back: true,
                        ..
                    }
                ) {
                    Stats::bump(&self.shared.stats.inputs_copied_back);
                }
            }
            Err(e) => self.transfer_failed(t, e.into()),
        }
        self.replay_held(t.worker);
    }

    /// A transfer failed: a worker past the backlog's bound is condemned for it; any other
    /// failure is a lost context or the worker lost.
    fn transfer_failed(&mut self, t: Transfer, e: Error) {
        let (worker, job) = (t.worker, t.job);
        let what = match t.direction {
            Direction::Send => "sending a staged input",
            Direction::Receive { what, .. } => what,
        };
        let why = match t.direction {
            Direction::Send => format!("sending a staged input failed: {e}"),
            Direction::Receive { what, .. } => format!("receiving {what} failed: {e}"),
        };
        if backlog_full(&e) {
            self.condemn_for_bound(worker, job, contract::Bound::StagingBacklog, why);
        } else {
            let context = match t.direction {
                Direction::Send => what.to_owned(),
                Direction::Receive { what, .. } => format!("receiving {what}"),
            };
            if !self.escalate(&context, &e) {
                self.lose(worker, &why);
            }
        }
    }

    /// Starts setting host staging up with `worker` on a thread of its own, as a transfer
    /// runs (see the module docs): the worker's answer ([`StagingChannel::setup_parent`]
    /// waits for its `StagingReady`) may take up to the staging timeout. The connection comes
    /// back as [`Command::StagingSetUp`]; meanwhile what comes for the worker is held.
    pub(super) fn start_setup(&mut self, worker: WorkerId) -> Result<(), Error> {
        let slot = self
            .workers
            .get_mut(&worker)
            .ok_or(Error::UnknownWorker(worker))?;
        let conn = slot
            .conn
            .take()
            .ok_or_else(|| Error::Protocol("a staging transfer has the connection".into()))?;
        let socket = match conn.as_fd().try_clone_to_owned() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(worker = %worker, error = %e, "duplicating the worker's socket failed: only killing it ends its staging setup early");
                None
            }
        };
        let (tx, rx) = std::sync::mpsc::channel::<Connection>();
        let shared = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new()
            .name("poolipc-staging".into())
            .spawn(move || {
                let Ok(mut conn) = rx.recv() else {
                    return;
                };
                let driver = Arc::clone(&shared.driver);
                // CUDA contexts are per thread: the setup's buffer and events need the device's.
                let result = driver
                    .use_device(shared.options.device)
                    .map_err(StagingError::from)
                    .and_then(|()| {
                        StagingChannel::setup_parent(
                            driver,
                            &mut conn,
                            shared.options.staging.clone(),
                        )
                    });
                // The loop wakes for it; a loop already gone drops it, closing the socket.
                shared.post(Command::StagingSetUp(Box::new(SetupDone {
                    worker,
                    conn,
                    result,
                })));
            });
        let refused = match spawned {
            Ok(_) => match tx.send(conn) {
                Ok(()) => None,
                Err(back) => Some((back.0, "the staging thread ended at its start".to_owned())),
            },
            Err(e) => Some((conn, format!("starting a staging thread failed: {e}"))),
        };
        let slot = self
            .workers
            .get_mut(&worker)
            .ok_or(Error::UnknownWorker(worker))?;
        match refused {
            None => {
                slot.away = Some(Away {
                    socket,
                    // The setup waits only on the socket, which the shutdown reaches.
                    abort: Arc::new(AtomicBool::new(false)),
                    aborted: false,
                });
                Ok(())
            }
            Some((conn, why)) => {
                slot.conn = Some(conn);
                Err(Error::Protocol(why))
            }
        }
    }

    /// A staging setup's thread handed the worker's connection back: what was held for the
    /// worker runs, then its jobs, first the one that waited for the setup (lent now, or
    /// failed with the setup).
    pub(super) fn setup_done(&mut self, done: SetupDone) {
        let SetupDone {
            worker,
            conn,
            result,
        } = done;
        let Some(slot) = self.workers.get_mut(&worker) else {
            tracing::error!(worker = %worker, "a staging setup ended for a worker the loop let go");
            return;
        };
        slot.conn = Some(conn);
        slot.away = None;
        match result {
            Ok(mut channel) => {
                slot.backlog.extend(channel.take_backlog());
                slot.staging = Some(channel);
                self.replay_held(worker);
                self.dispatch(worker);
            }
            Err(e) => {
                slot.staging_failed = Some(e.to_string());
                let waiting = slot
                    .queued
                    .front()
                    .is_some_and(|s| s.placed.as_ref().is_some_and(|p| p.staged));
                let sub = if waiting {
                    slot.queued.pop_front()
                } else {
                    None
                };
                self.replay_held(worker);
                let e = Error::from(e);
                match sub {
                    Some(sub) => self.staging_setup_failed(*sub, &e),
                    None => self.lose(worker, &format!("setting host staging up failed: {e}")),
                }
            }
        }
    }

    /// Carries out, in order, what was held for `worker` while its transfer ran, until all
    /// ran or one of them started another transfer (the rest then waits for that one).
    pub(super) fn replay_held(&mut self, worker: WorkerId) {
        loop {
            let Some(slot) = self.workers.get_mut(&worker) else {
                return;
            };
            if slot.away.is_some() {
                return;
            }
            match slot.held.pop_front() {
                None => return,
                Some(Held::Action(action)) => self.act_now(action),
                Some(Held::Frame(message, fd)) => self.enqueue_frame(worker, &message, fd),
            }
        }
    }

    /// Ends `worker`'s transfer early, where one runs: the process is killed (reaped later,
    /// once the transfer handed its connection back), its socket shut down under the
    /// transfer's thread and the channel's abort flag set (see the module docs).
    pub(super) fn abort_transfer(&mut self, worker: WorkerId) {
        let Some(slot) = self.workers.get_mut(&worker) else {
            return;
        };
        let Some(away) = slot.away.as_mut().filter(|a| !a.aborted) else {
            return;
        };
        away.aborted = true;
        away.abort.store(true, Ordering::Relaxed);
        if let Some(c) = slot.child.as_mut() {
            let _ = c.kill();
        }
        if let Some(fd) = &away.socket
            && let Err(e) =
                nix::sys::socket::shutdown(fd.as_raw_fd(), nix::sys::socket::Shutdown::Both)
        {
            tracing::debug!(worker = %worker, error = %e, "shutting the worker's socket down failed");
        }
    }
}

/// The transfer itself, on its thread.
fn run(
    shared: &super::Shared,
    t: &Transfer,
    channel: &mut StagingChannel,
    conn: &mut Connection,
) -> Result<(), StagingError> {
    // CUDA contexts are per thread: the channel's copies and event calls need the device's.
    shared.driver.use_device(shared.options.device)?;
    match t.direction {
        Direction::Send => channel.send_tensor(conn, t.job, t.handoff, t.ptr, t.bytes, t.stream),
        Direction::Receive { .. } => {
            channel.recv_tensor(conn, t.job, t.handoff, t.ptr, t.bytes, t.stream)
        }
    }
}
