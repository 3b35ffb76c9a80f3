//! The parent's IO loop: one thread per [`Parent`](crate::Parent) that polls every worker's
//! socket, feeds what arrives into the ownership contract's machine and carries out every
//! action the machine emits, matched exhaustively. What goes on the wire is what the contract
//! emitted; the loop adds nothing and drops nothing.
//!
//! Every fault (EOF, a broken or malformed frame, a protocol violation the contract names, a
//! deadline) takes the same path: the contract condemns the worker, the loop kills and reaps
//! it, the contract releases its loans and fails its jobs, and nothing of it touches another
//! worker.
//!
//! One kind of action runs elsewhere: a host-staged tensor's transfer, which waits on its
//! worker chunk by chunk, runs on a thread of its own with that worker's connection, and the
//! loop holds the worker's later actions until it ends ([`transfer`]). A worker that stages
//! slowly stalls only itself. A caller's result allocator runs on a thread of the room's too
//! ([`allocator`]): one that waits (for the GIL, say) stalls only its job.
//!
//! The [`Loop`] holds the contract's machine, the parent's shared state and the parts, each
//! owning its state and tested alone: the workers ([`roster`]: a [`Slot`] each, with its
//! connection, queued jobs and DONE events), the jobs ([`jobs`]: what each lent, its results
//! by request and handoff), the wire ids and loans ([`loans`]), the jobs held for their DONE
//! ([`gates`]), the answers `empty_cache` waits for ([`answers`]), the clock and spin window
//! ([`pace`]) and the pool's trimming after a reaping ([`trim`]). The files of `impl Loop`
//! (`io`, `actions`, `lend`, `place`, `results`, `done`, `workers`, `arena`,
//! `pool_rotation`) join them: they read what the contract emitted and ask the parts.

use std::os::unix::net::UnixStream;
use std::process::{Child, ExitStatus};
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use poolipc_contract::{self as contract, Timestamp};
use poolipc_driver::StreamHandle;
use poolipc_transport::Connection;
use poolipc_types::{JobId, WorkerId};

use crate::error::Error;
use crate::state::{Answer, EmptyCache, Input, ResultAllocator, lock};

mod actions;
mod allocator;
mod answers;
mod arena;
mod bounce;
mod direct;
mod done;
mod io;
mod jobs;
mod lend;
mod loans;
mod pace;
mod place;
mod results;
mod roster;
mod shared;
mod transfer;
mod trim;
mod workers;

/// Whether `e` is the worker overflowing the staging backlog (a bound, not a hang-up).
fn backlog_full(e: &Error) -> bool {
    matches!(
        e,
        Error::Staging(crate::staging::StagingError::BacklogFull { .. })
    )
}

mod done_events;
mod gates;
mod pool_rotation;

use answers::{Answers, MAPPINGS_ACK};
pub(crate) use direct::{read_direct, submit};
use done_events::{DoneEvents, Room};
use gates::{DoneGate, Gates};
use jobs::{JobState, Jobs};
use loans::Loans;
use pace::Pace;
use place::{ArenaInput, Placed};
use roster::{Roster, Slot};
pub(crate) use shared::{Registered, Room as Inbox, Shared, WorkerPool};
use trim::PoolTrim;

/// What a caller's thread asks of the IO loop.
pub(crate) enum Command {
    /// A worker that shook hands: the loop owns its socket and process from now on.
    Adopt {
        worker: WorkerId,
        conn: Box<Connection>,
        child: Option<Child>,
        reply: Sender<Result<(), Error>>,
    },
    /// A job to run.
    Submit(Box<Submission>),
    /// `JobHandle::cancel`: a job still queued fails at once; one sent
    /// is cancelled in the contract (the worker is told and still finishes it; it then fails
    /// with `FailReason::Cancelled`). A job that ended already is left alone.
    Cancel { worker: WorkerId, job: JobId },
    /// Bye, a bounded wait, then SIGKILL; reply with the exit status once reaped.
    Stop {
        worker: WorkerId,
        reply: Sender<Result<Option<ExitStatus>, Error>>,
    },
    /// `Parent::empty_cache`: give every idle arena chunk back, tell the workers that mapped
    /// them, reply once they answered (or after `EMPTY_CACHE_WAIT`).
    ReleaseArena { reply: Sender<EmptyCache> },
    /// `Parent::empty_cache` rotated pool `pool`: offer its new generation `handle` to every
    /// live worker (an `ExtraPool` at a free index), reply once they answered.
    OfferPool {
        pool: usize,
        handle: poolipc_driver::PoolHandle,
        reply: Sender<EmptyCache>,
    },
    /// `Parent::empty_cache` found retired generation `handle` unused: every worker that has
    /// it destroys its import (`PoolRetire`), reply once they answered.
    RetirePool {
        handle: poolipc_driver::PoolHandle,
        reply: Sender<EmptyCache>,
    },
    /// The parent is dropped: stop every worker, fail every job, end the thread.
    Shutdown,
    /// A staging transfer's thread hands the worker's connection back, with the result.
    Staged(Box<transfer::TransferDone>),
    /// A staging setup's thread hands the worker's connection back, with the channel.
    StagingSetUp(Box<transfer::SetupDone>),
    /// The allocator thread answers for a result a caller's allocator made ([`allocator`]).
    ResultMade(Box<allocator::AllocMade>),
    /// Test-only ([`Parent::panic_io_thread`](crate::Parent::panic_io_thread)): the loop
    /// panics, as a bug of its own would.
    // Only the `testing` feature's hook sends it.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    Panic,
}

impl Command {
    /// The worker the command is for, which decides the room (IO thread) that takes it;
    /// None for a command every room takes (`Shutdown`) or that the caller addresses
    /// itself (`empty_cache`'s, asked of every room).
    pub(crate) fn worker(&self) -> Option<WorkerId> {
        match self {
            Command::Adopt { worker, .. }
            | Command::Cancel { worker, .. }
            | Command::Stop { worker, .. } => Some(*worker),
            Command::Submit(sub) => Some(sub.worker),
            Command::Staged(done) => Some(done.worker()),
            Command::StagingSetUp(done) => Some(done.worker()),
            Command::ResultMade(made) => Some(made.worker()),
            Command::ReleaseArena { .. }
            | Command::OfferPool { .. }
            | Command::RetirePool { .. }
            | Command::Shutdown
            | Command::Panic => None,
        }
    }

    /// Answers the command with `e` without the loop (which cannot take it).
    pub(crate) fn refuse(self, e: Error) {
        match self {
            Command::Adopt { reply, child, .. } => {
                if let Some(mut c) = child {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                let _ = reply.send(Err(e));
            }
            Command::Submit(sub) => sub.done.complete(Err(e)),
            Command::Stop { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            // Its caller maps the closed channel to the loop's error.
            Command::ReleaseArena { reply }
            | Command::OfferPool { reply, .. }
            | Command::RetirePool { reply, .. } => drop(reply),
            // The loop is gone: the worker's socket closes with it.
            Command::Staged(_) | Command::StagingSetUp(_) => {}
            // The memory is the caller's; its job failed with the loop.
            Command::ResultMade(_) => {}
            Command::Cancel { .. } | Command::Shutdown | Command::Panic => {}
        }
    }
}

/// A job as submitted.
pub(crate) struct Submission {
    pub(crate) worker: WorkerId,
    pub(crate) job: JobId,
    pub(crate) inputs: Vec<Input>,
    pub(crate) stream: StreamHandle,
    /// `None`: the shared pool, and a failed job's results are freed by the loop.
    pub(crate) alloc: Option<ResultAllocator>,
    pub(crate) done: Answer,
    /// Set while a placed job waits for its worker's other jobs (a staged job runs alone).
    pub(crate) placed: Option<Placed>,
}

/// Starts room `room`'s IO thread; returns once it made the device current (or failed to).
pub(crate) fn start(
    shared: Arc<Shared>,
    room: usize,
    wake: UnixStream,
) -> Result<std::thread::JoinHandle<()>, Error> {
    let (tx, rx) = std::sync::mpsc::channel();
    // The first room's name is the one thread's of a parent with one room (as before).
    let name = if room == 0 {
        "poolipc-parent-io".to_owned()
    } else {
        format!("poolipc-io-{room}")
    };
    let handle = std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            // CUDA contexts are per thread: every driver call of the loop needs this one.
            if let Err(e) = shared.driver.use_device(shared.options.device) {
                let _ = tx.send(Err(Error::from(e)));
                return;
            }
            let _ = tx.send(Ok(()));
            let io = Arc::clone(&shared);
            // A panic here is a bug of the loop's; still, nobody may wait for ever on it:
            // the loop is taken and dropped, which answers its jobs (each `Answer` answers
            // its handle), drops its reply channels (each caller maps the closed channel to
            // the error) and kills and reaps its workers; from now on every command is
            // refused.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                *lock(&io.rooms[room].state) =
                    Some(Box::new(Loop::new(Arc::clone(&io), room, wake)));
                direct::run(&io, room);
            }));
            if let Err(payload) = ran {
                direct::fell(&shared, room, &panic_text(payload.as_ref()), "IO thread");
            }
        })
        .map_err(|source| Error::Os {
            call: "pthread_create",
            source,
        })?;
    match rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => {
            let _ = handle.join();
            Err(Error::Protocol(
                "the parent's IO thread ended at its start".into(),
            ))
        }
    }
}

/// A panic's message, where it carries one.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

struct Loop {
    shared: Arc<Shared>,
    /// Which of the parent's rooms this loop is: it serves the workers `Shared::room_of`
    /// gives it, and only them.
    room: usize,
    /// The read end of the room's wake-up socket.
    wake: Arc<UnixStream>,
    /// While the IO thread waits without the loop: until when at the latest
    /// ([`Loop::after_direct`] wakes it where something comes due sooner).
    asleep_until: Option<Instant>,
    /// When the IO thread's current turn began (for `ParentStats::io_busy_ns`).
    turn_started: Instant,
    machine: contract::Parent,
    /// The room's workers and what outlives their slots ([`roster`]).
    workers: Roster,
    /// The room's jobs ([`jobs`]).
    jobs: Jobs,
    /// The ids, pointer loans and VMM shares ([`loans`]).
    loans: Loans,
    /// The room's allocator thread for callers' allocators, once one was needed.
    allocator: Option<Sender<allocator::AllocCall>>,
    shutting_down: bool,
    /// The contract's clock and the spin window ([`pace`]).
    pace: Pace,
    /// The answers `empty_cache` awaits ([`answers`]).
    answers: Answers,
    /// Jobs acknowledged whose DONE has not completed on the GPU yet ([`gates`]).
    gates: Gates,
    /// Where READY is recorded when the caller's stream has nothing left to run
    /// ([`crate::warm::aside_stream`]); `None`: always on the caller's stream.
    aside: Option<poolipc_driver::OwnedStream>,
    /// The pool being trimmed back after a killed worker.
    pool_trim: PoolTrim,
    /// Pinned buffers for the arena copy's copies through the host ([`bounce`]).
    bounce: bounce::Bounce,
}

impl Drop for Loop {
    /// Workers are left only when the loop is dropped after a panic ([`direct::fell`], which
    /// first made the parent refuse every later command, so that a caller woken by a job's
    /// `Answer` dropping here finds it refused): nothing can serve them any more, so they are
    /// killed and reaped (their jobs' handles are answered as the jobs drop). The loop lives
    /// in its room's lock, never on an unwinding stack.
    fn drop(&mut self) {
        for (id, slot) in self.workers.iter_mut() {
            if let Some(c) = slot.child.as_mut() {
                tracing::warn!(worker = %id, "the IO loop is gone: killing the worker");
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Under MPS, how long a failed job's context check keeps asking whether the failure ended
/// this process's context too (the server marks the other clients shortly after the fault).
const MPS_FAULT_GRACE: Duration = Duration::from_millis(250);

/// Whether a worker's error text names a GPU fault (a sticky CUDA error).
fn names_gpu_fault(message: &str) -> bool {
    [
        "ILLEGAL_ADDRESS",
        "ILLEGAL_INSTRUCTION",
        "MISALIGNED_ADDRESS",
        "INVALID_ADDRESS_SPACE",
        "INVALID_PC",
        "LAUNCH_FAILED",
        "HARDWARE_STACK_ERROR",
        "ECC_UNCORRECTABLE",
        "MPS_CLIENT_TERMINATED",
        "illegal memory access",
    ]
    .iter()
    .any(|needle| message.contains(needle))
}

/// Frames the loop takes from one worker before it looks at the others again.
const FRAMES_PER_TURN: usize = 64;
/// How long the loop sleeps when nothing is due: commands and frames wake it earlier.
const IDLE_POLL: Duration = Duration::from_millis(500);
/// While a worker is exiting, how often to look whether it has.
const EXIT_POLL: Duration = Duration::from_millis(2);
impl Loop {
    fn new(shared: Arc<Shared>, room: usize, wake: UnixStream) -> Loop {
        let limit = shared.options.limit;
        let machine = contract::Parent::new(contract::ParentConfig {
            limit,
            handoff_timeout: shared.options.handoff_timeout,
            max_results_per_job: shared.options.max_results_per_job,
            max_result_bytes_per_job: shared.limits.max_result_bytes_per_job,
            max_result_bytes_per_worker: shared.limits.max_result_bytes_per_worker,
            max_job_lifetime: shared.options.max_job_lifetime,
            max_idle_messages: shared.options.max_idle_messages,
            cancel_grace: shared.options.cancel_grace,
        });
        // Under MPS one context runs every process's work: a record on the caller's stream
        // costs no change of context, and the query that picks the stream would be a driver
        // call a job for nothing.
        let aside = match shared.mps_client {
            Some(true) => None,
            _ => crate::warm::aside_stream(&shared.driver, shared.options.tuning.ready_aside),
        };
        // Under MPS one context runs everything: a device-to-device copy costs no change.
        let through_host = match shared.mps_client {
            Some(true) => 0,
            _ => shared.options.tuning.copy_through_host,
        };
        let bounce = bounce::Bounce::new(Arc::clone(&shared.driver), through_host);
        Loop {
            bounce,
            aside,
            shared,
            room,
            wake: Arc::new(wake),
            asleep_until: None,
            turn_started: Instant::now(),
            machine,
            workers: Roster::default(),
            jobs: Jobs::default(),
            loans: Loans::default(),
            allocator: None,
            shutting_down: false,
            pace: Pace::new(Instant::now()),
            answers: Answers::new(Instant::now()),
            gates: Gates::default(),
            pool_trim: PoolTrim::default(),
        }
    }

    /// Trims the pool if a look of [`PoolTrim`]'s is due.
    fn trim_pool(&mut self) {
        let Some(owed) = self.pool_trim.due(Instant::now()) else {
            return;
        };
        self.empty_retired_arenas();
        if owed == 0 {
            return;
        }
        let keep = match self.shared.pools[0].stats() {
            Ok(s) => PoolTrim::keep(s.reserved_current, owed),
            Err(e) => {
                tracing::warn!(error = %e, "reading the pool before trimming it after a killed worker");
                return;
            }
        };
        match self.shared.pools[0].trim_to(keep) {
            Ok((before, after)) if before > after => {
                self.pool_trim.gave_back(before - after);
                tracing::info!(
                    before,
                    after,
                    "poolipc: the pool gave a killed worker's results back to the device"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "trimming the pool after a killed worker"),
        }
    }

    fn now(&self) -> Timestamp {
        self.pace.stamp(Instant::now())
    }

    /// The IO thread's turn up to its wait: the commands, the backlogs, the exits, the
    /// arena, `empty_cache`'s answers; then what it waits on. `None` once the loop ends
    /// (shut down, or another room's thread panicked).
    fn turn(&mut self) -> Option<io::WaitPlan> {
        if lock(&self.shared.io_stopped).is_some() {
            // Another room's thread panicked: the parent can do nothing more.
            self.abandon();
            return None;
        }
        self.turn_started = Instant::now();
        for command in self.shared.take_commands(self.room) {
            self.command(command);
        }
        self.drain_backlogs();
        self.check_exits();
        self.drive();
        self.release_idle_arena();
        self.answer_release_waiters();
        if self.shutting_down && self.workers.is_empty() && self.gates.is_empty() {
            self.fail_leftover_jobs();
            return None;
        }
        Some(self.plan_wait())
    }

    /// The IO thread's turn after its wait: what it saw, the deadlines, the held jobs, the
    /// pool's trim.
    fn after_turn(&mut self, plan: io::WaitPlan, polled: io::Polled) {
        self.after_wait(plan, polled);
        self.machine.handle_timeout(self.now());
        self.drive();
        self.check_gates();
        self.trim_pool();
        let busy = self.pace.busy(self.turn_started.elapsed());
        self.shared.stats.io_busy_ns.fetch_add(
            u64::try_from(busy.as_nanos()).unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Another room panicked: kills and reaps this room's workers and refuses its commands;
    /// its jobs are answered with [`Error::IoThreadStopped`] as the loop drops them.
    fn abandon(&mut self) {
        for command in self.shared.take_commands(self.room) {
            command.refuse(self.shared.loop_gone());
        }
        for (id, slot) in self.workers.iter_mut() {
            if let Some(c) = slot.child.as_mut() {
                tracing::warn!(worker = %id, "another IO thread panicked: killing the worker");
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::names_gpu_fault;
    use super::place::human_bytes;

    #[test]
    fn a_worker_error_naming_a_sticky_cuda_error_counts_as_a_gpu_fault() {
        assert!(names_gpu_fault(
            "the job's kernel faulted: cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)"
        ));
        assert!(names_gpu_fault(
            "RuntimeError: CUDA error: an illegal memory access was encountered"
        ));
        assert!(!names_gpu_fault("ValueError: shapes (3,) and (4,) differ"));
        assert!(!names_gpu_fault("CUDA_ERROR_OUT_OF_MEMORY"));
    }

    #[test]
    fn sizes_read_in_the_largest_unit_with_one_decimal_at_most() {
        assert_eq!(human_bytes(16 << 30), "16 GiB");
        assert_eq!(human_bytes((7 << 29) + 5), "3.5 GiB");
        assert_eq!(human_bytes(64 << 20), "64 MiB");
        assert_eq!(human_bytes((1 << 20) + 3), "1.0 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(100), "100 bytes");
        assert_eq!(human_bytes(u64::MAX), "17179869183.9 GiB");
    }
}
