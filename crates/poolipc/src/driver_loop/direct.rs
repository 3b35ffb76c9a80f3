//! Who runs the room's loop: its IO thread, turn after turn, and, while that thread waits, a
//! caller's thread that finds the loop free (the direct path).
//!
//! The loop lives in its room behind a lock ([`Room::state`](super::shared::Room)). The IO
//! thread holds it for each turn and lets go while it waits ([`super::io::WaitPlan`]). A caller
//! that finds it asleep (not spinning) then does the loop's work for its own job on its own
//! thread instead of handing it over and paying the IO thread's wake-up: [`submit`] places and
//! lends the job and writes its Lend; [`read_direct`], called while a waiter spins, reads its
//! worker's frames (DONE and ACK) and sees to the held jobs. Where the IO thread spins, a
//! posted command reaches it within a microsecond or two, and the loop's work costs more on
//! another core than that (its state is in the IO thread's caches; the device pushed and
//! popped around it): on an H200 under MPS, a caller that lent its own jobs whatever the IO
//! thread did made one worker's jobs 2–6 µs slower and eight workers' 13 % fewer, so it posts
//! then. Both run the same code as the IO thread (the contract's machine stays the one
//! authority), with the parent's device current on the caller's thread for the while. What is asynchronous stays the IO thread's: deadlines,
//! exits, staging, commands; a caller that leaves something due sooner than the IO thread
//! would wake for it writes the wake-up byte ([`Loop::after_direct`]).
//!
//! A caller never waits for the loop: it takes it only where nobody holds it and no command
//! is queued before its own (so one thread's jobs go in the order it submitted them), else it
//! posts as before. [`Tuning::direct`](crate::Tuning::direct) turns the path off.

use std::io::Write as _;
use std::os::fd::{AsFd as _, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, TryLockError};
use std::time::Instant;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use poolipc_types::WorkerId;

use super::{Command, Loop, Shared, Submission, panic_text};
use crate::state::{Stats, lock};

/// The IO thread's work: turns until the loop ends (or another thread's panic took it).
pub(super) fn run(shared: &Arc<Shared>, room: usize) {
    let state = &shared.rooms[room].state;
    loop {
        let plan = {
            let mut held = lock(state);
            let Some(l) = held.as_deref_mut() else {
                return;
            };
            match l.turn() {
                Some(plan) => plan,
                None => {
                    let ended = held.take();
                    drop(held);
                    // Its jobs answered, its workers reaped: outside the lock.
                    drop(ended);
                    return;
                }
            }
        };
        let polled = plan.wait(shared, room);
        let mut held = lock(state);
        let Some(l) = held.as_deref_mut() else {
            return;
        };
        l.after_turn(plan, polled);
    }
}

/// The loop of room `room` panicked on `thread` ("IO thread", or a caller's on the direct
/// path) with `detail`: the parent refuses every command from now on, the loop is dropped
/// (its jobs answered with [`Error::IoThreadStopped`](crate::Error::IoThreadStopped), its
/// workers killed and reaped), and the other rooms are woken to see it.
pub(super) fn fell(shared: &Shared, room: usize, detail: &str, thread: &str) {
    tracing::error!(%detail, room, thread, "the parent's IO loop panicked: every waiter gets an error");
    {
        // With the inbox held: a post after this is refused, none is left in it unanswered.
        let _inbox = lock(&shared.rooms[room].inbox);
        *lock(&shared.io_stopped) = Some(format!("it panicked: {detail}"));
    }
    let fallen = lock(&shared.rooms[room].state).take();
    drop(fallen);
    let mine = std::mem::take(&mut *lock(&shared.rooms[room].inbox));
    for command in mine {
        command.refuse(shared.loop_gone());
    }
    // The other rooms see it at their next turn: wake them for it.
    for r in &shared.rooms {
        let _ = (&r.waker).write(&[1]);
    }
}

/// Submits `sub`: on the caller's thread where its room's IO thread sleeps, nobody holds its
/// loop and nothing is queued for it, else handed to the room's IO thread.
pub(crate) fn submit(shared: &Arc<Shared>, sub: Box<Submission>) {
    let room = shared.room_of(sub.worker);
    let ran = on_caller(
        shared,
        room,
        sub,
        // Nothing may go before a command queued earlier (this thread's previous job, say).
        |l| lock(&l.shared.rooms[l.room].inbox).is_empty(),
        |l, sub| {
            l.pace.active(Instant::now());
            crate::probe::mark("d.lend");
            Stats::bump(&l.shared.stats.direct_lends);
            l.submit(sub);
        },
    );
    // Ok: lent here, or the loop panicked, which answered the job.
    if let Err(sub) = ran {
        shared.post(Command::Submit(sub));
    }
}

/// Reads what `worker`'s socket holds and sees to the jobs held for their DONE, on the
/// caller's thread, where the room's IO thread sleeps (it would pay a wake-up for the frame)
/// and nobody holds its loop: a waiter on a job of `worker` calls it as it spins. Where no
/// frame is there and no job is held, it costs a look at the socket and nothing more.
pub(crate) fn read_direct(shared: &Arc<Shared>, worker: WorkerId) {
    let room = shared.room_of(worker);
    let wanted = |l: &Loop| {
        let Some(slot) = l.workers.get(&worker) else {
            return false;
        };
        // Frames that wait behind a staging transfer's, or a socket its thread has: the IO
        // thread's, in order.
        let (Some(conn), Some(fd)) = (slot.conn.as_ref(), slot.poll_fd.as_ref()) else {
            return false;
        };
        if !slot.backlog.is_empty() || slot.holds() || slot.lost.is_some() {
            return false;
        }
        conn.frame_buffered() || !l.gates.is_empty() || readable(fd)
    };
    let _ = on_caller(shared, room, (), wanted, |l, ()| {
        let frames = l.read_one(worker);
        l.shared
            .stats
            .direct_reads
            .fetch_add(frames as u64, Ordering::Relaxed);
        l.check_gates();
    });
}

/// Whether `fd` has something to read (or hung up) now.
fn readable(fd: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
}

/// Runs `f` on room `room`'s loop on this thread, with the parent's device current, if the
/// path is on, the room's IO thread is not spinning (a spinning one takes a posted command
/// within a microsecond or two, less than the loop's work costs on another core), nobody
/// holds the loop now and `wanted` says so: `Ok(Some(what f returned))`, or `Ok(None)` where
/// `f` panicked (the loop's panic: [`fell`] answered every waiter); `Err(arg)` where it did
/// not run.
fn on_caller<A, R>(
    shared: &Arc<Shared>,
    room: usize,
    arg: A,
    wanted: impl FnOnce(&Loop) -> bool,
    f: impl FnOnce(&mut Loop, A) -> R,
) -> Result<Option<R>, A> {
    if !shared.options.tuning.direct {
        return Err(arg);
    }
    let Some(r) = shared.rooms.get(room) else {
        return Err(arg);
    };
    if r.io_spinning.load(Ordering::Relaxed) {
        return Err(arg);
    }
    let mut held: MutexGuard<'_, Option<Box<Loop>>> = match r.state.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => return Err(arg),
    };
    // Again with the loop held: the IO thread raises the flag before it lets the loop go
    // for a spin (`Loop::plan_wait`), and that spin reads the held jobs' DONE events without
    // the loop, so the loop's work must not run beside it.
    if r.io_spinning.load(Ordering::SeqCst) {
        return Err(arg);
    }
    let Some(l) = held.as_deref_mut() else {
        return Err(arg);
    };
    if !wanted(l) {
        return Err(arg);
    }
    // The loop's driver calls need the parent's device on this thread, whatever the caller
    // had current (pushed, and popped after).
    if l.shared
        .driver
        .push_device(l.shared.options.device)
        .is_err()
    {
        return Err(arg);
    }
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let r = f(l, arg);
        l.after_direct();
        r
    }));
    let _ = shared.driver.pop_device();
    drop(held);
    match ran {
        Ok(r) => Ok(Some(r)),
        Err(payload) => {
            fell(
                shared,
                room,
                &panic_text(payload.as_ref()),
                "a caller's (direct path)",
            );
            Ok(None)
        }
    }
}

impl Loop {
    /// A caller's thread did the loop's work: wakes the IO thread where it now has something
    /// to do before it would wake by itself (a frame to write or read, a deadline or a held
    /// job's look sooner than its wait's end).
    fn after_direct(&mut self) {
        let Some(asleep_until) = self.asleep_until else {
            // Between its turns: it plans its wait from what it finds.
            return;
        };
        let now = Instant::now();
        let frames = self.workers.values().any(|s| {
            !s.backlog.is_empty()
                || s.conn
                    .as_ref()
                    .is_some_and(|c| c.send_queued() || c.frame_buffered())
        });
        if frames || now + self.wait_timeout(now) < asleep_until {
            let r = &self.shared.rooms[self.room];
            let _ = (&r.waker).write(&[1]);
        }
    }
}
