//! The simulated GPU's engine: work issued on a stream runs later, on a thread of the
//! simulated process, in stream order, after the events it waits on, with random delays.
//!
//! Each [`super::SimDriver`] (one simulated process) has one engine. An issuing call checks
//! its arguments and the happens-before rules at once, then queues a [`Step`] on the stream;
//! the engine's thread picks a stream whose first step can run (a wait whose event has not
//! completed cannot), at random among those, sleeps a random delay, and runs it under the
//! machine lock. So a missing wait shows up the way it does on hardware: as wrong bytes, read
//! before the write that should have preceded them ran.
//!
//! `POOLIPC_SIM_DELAY_US` (default 100) bounds the random delay before each step; 0 runs
//! steps as soon as they can run (still on the engine's thread, still out of order across
//! streams). `POOLIPC_SIM_SEED` seeds the choices (default: from the process id and the
//! clock); the seed is logged at debug level, so a failing order can be replayed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::local::Local;
use super::machine::Machine;
use super::shm::my_pid;
use super::shm::process_alive;
use super::state::State;

/// The environment variable bounding the random delay before each step, in microseconds.
pub const DELAY_ENV: &str = "POOLIPC_SIM_DELAY_US";
/// The environment variable seeding the engine's random choices.
pub const SEED_ENV: &str = "POOLIPC_SIM_SEED";

const DEFAULT_DELAY_US: u64 = 100;
/// How long a process exiting waits for its queued work before dropping what is left (a
/// wait on an event that never completes, as on hardware, would otherwise hold it forever).
const DRAIN_LIMIT: Duration = Duration::from_secs(10);
/// How often a stream waiting on another process's event looks again.
const POLL: Duration = Duration::from_micros(100);

/// Memory work run by the engine, with this process's tables and the machine's state.
pub(super) type Work = Box<dyn FnOnce(&mut Local, &mut State) + Send>;

/// One operation queued on a stream.
pub(super) enum Step {
    /// Memory work: a memset, a copy, a kernel's store, a free.
    Run(Work),
    /// `cuEventRecord`: the event completes up to its record `n`.
    Record {
        event: usize,
        generation: u64,
        n: u64,
    },
    /// `cuStreamWaitEvent`: the stream goes on once the event's record `n` completed.
    Wait {
        event: usize,
        generation: u64,
        n: u64,
    },
    /// A point in the stream that does nothing (an allocation, an import's free).
    Mark,
    /// The stream goes on once stream `slot` executed operation `seq` (a pool's internal
    /// dependency on a free).
    AfterStream { slot: usize, seq: u64 },
    /// A kernel that never ends ([`Driver::launch_hang_kernel`]): never runnable, so the
    /// stream stops here until the process goes away.
    ///
    /// [`Driver::launch_hang_kernel`]: crate::Driver::launch_hang_kernel
    Hang,
}

struct Op {
    seq: u64,
    step: Step,
}

#[derive(Default)]
struct Queues {
    /// Queued steps by machine stream slot.
    streams: BTreeMap<usize, VecDeque<Op>>,
    /// The last executed sequence number by stream slot.
    executed: HashMap<usize, u64>,
    /// Steps queued and not yet run or dropped.
    pending: usize,
    /// The process is going away: run what can run, then stop.
    stop: bool,
    /// Drop whatever is left and stop now.
    abandon: bool,
    /// The process whose thread runs the queues (a forked child starts its own).
    thread_pid: u32,
    /// The stream whose step the thread is running now.
    inflight: Option<usize>,
}

impl Queues {
    /// Whether stream `slot` executed operation `seq`, or has nothing of it left queued
    /// here: it ran (or was dropped) already, or it was issued by another simulated process
    /// sharing the slot number.
    fn ran(&self, slot: usize, seq: u64) -> bool {
        self.executed.get(&slot).copied().unwrap_or(0) >= seq
            || (self.streams.get(&slot).is_none_or(VecDeque::is_empty)
                && self.inflight != Some(slot))
    }
}

struct Shared {
    q: Mutex<Queues>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        self.q
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One simulated process's GPU engine.
pub(super) struct Engine {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    delay_us: u64,
    seed: u64,
    /// The simulated process's id on the machine.
    agent: u64,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("delay_us", &self.delay_us)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

/// xorshift64*: small, seeded, good enough to shuffle streams and pick delays.
fn next(x: &mut u64) -> u64 {
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

impl Engine {
    pub(super) fn new(agent: u64) -> Engine {
        let delay_us = std::env::var(DELAY_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_DELAY_US);
        let seed = std::env::var(SEED_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64);
                t ^ (u64::from(my_pid()) << 32) ^ agent
            })
            .max(1);
        tracing::debug!(seed, delay_us, "simulated GPU engine");
        Engine {
            shared: Arc::new(Shared {
                q: Mutex::new(Queues::default()),
                cv: Condvar::new(),
            }),
            thread: Mutex::new(None),
            delay_us,
            seed,
            agent,
        }
    }

    /// The seed the engine was made with.
    pub(super) fn seed(&self) -> u64 {
        self.seed
    }

    /// Queues `step` as operation `seq` of stream `slot`, starting the engine's thread in this
    /// process if it is not running.
    pub(super) fn push(
        &self,
        slot: usize,
        seq: u64,
        step: Step,
        local: &Arc<Mutex<Local>>,
        machine: &Arc<Machine>,
    ) {
        let mut q = self.shared.lock();
        let pid = my_pid();
        if q.thread_pid != pid {
            // First use, or a forked child: the parent's thread does not exist here.
            q.thread_pid = pid;
            q.stop = false;
            q.abandon = false;
            let shared = Arc::clone(&self.shared);
            let local = Arc::clone(local);
            let machine = Arc::clone(machine);
            // Each simulated process its own sequence, the same in every run with the same
            // seed (processes get their ids on the machine in the order they attach).
            let (delay, seed) = (
                self.delay_us,
                self.seed ^ self.agent.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            let spawned = std::thread::Builder::new()
                .name("poolipc-sim-gpu".into())
                .spawn(move || run(&shared, &local, &machine, delay, seed.max(1)));
            match spawned {
                Ok(h) => {
                    *self
                        .thread
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(h);
                }
                Err(e) => tracing::error!(error = %e, "the simulated GPU's thread did not start"),
            }
        }
        q.streams
            .entry(slot)
            .or_default()
            .push_back(Op { seq, step });
        q.pending += 1;
        self.shared.cv.notify_all();
    }

    /// Whether stream `slot` executed operation `seq` (what [`wait_executed`] waits for),
    /// without waiting.
    ///
    /// [`wait_executed`]: Self::wait_executed
    pub(super) fn executed(&self, slot: usize, seq: u64) -> bool {
        self.shared.lock().ran(slot, seq)
    }

    /// Blocks until stream `slot` executed operation `seq`.
    pub(super) fn wait_executed(&self, slot: usize, seq: u64) {
        let mut q = self.shared.lock();
        loop {
            if q.ran(slot, seq) {
                return;
            }
            q = self
                .shared
                .cv
                .wait_timeout(q, Duration::from_millis(50))
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// Runs what is queued, for up to [`DRAIN_LIMIT`], then stops the thread: the process
    /// exits.
    pub(super) fn shut_down(&self) {
        let deadline = Instant::now() + DRAIN_LIMIT;
        {
            let mut q = self.shared.lock();
            if q.thread_pid != my_pid() {
                return;
            }
            q.stop = true;
            self.shared.cv.notify_all();
            while q.pending > 0 && Instant::now() < deadline {
                q = self
                    .shared
                    .cv
                    .wait_timeout(q, Duration::from_millis(20))
                    .map_or_else(|e| e.into_inner().0, |(g, _)| g);
            }
            if q.pending > 0 {
                tracing::warn!(
                    left = q.pending,
                    "simulated GPU work still queued at exit is dropped (a wait that never completes?)"
                );
            }
            q.abandon = true;
            self.shared.cv.notify_all();
        }
        let h = self
            .thread
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }
}

/// Whether `step` can run now.
fn runnable(step: &Step, machine: &Machine) -> bool {
    match *step {
        Step::Wait {
            event,
            generation,
            n,
        } => machine.with(|st| {
            let e = &st.events[event];
            e.live == 0
                || e.generation != generation
                || e.completed >= n
                // The recorder died: its queued work is gone, the wait is over.
                || !process_alive(e.rec_pid)
        }),
        Step::AfterStream { slot, seq } => machine.with(|st| st.streams[slot].executed >= seq),
        Step::Hang => false,
        _ => true,
    }
}

fn run(shared: &Shared, local: &Mutex<Local>, machine: &Machine, delay_us: u64, mut rng: u64) {
    loop {
        let (slot, op) = {
            let mut q = shared.lock();
            loop {
                if q.abandon {
                    let dropped: usize = q.streams.values().map(VecDeque::len).sum();
                    q.streams.clear();
                    q.pending = q.pending.saturating_sub(dropped);
                    shared.cv.notify_all();
                    return;
                }
                let slots: Vec<usize> = q
                    .streams
                    .iter()
                    .filter(|(_, d)| !d.is_empty())
                    .map(|(s, _)| *s)
                    .collect();
                if slots.is_empty() {
                    if q.stop {
                        return;
                    }
                    q = shared
                        .cv
                        .wait_timeout(q, Duration::from_millis(50))
                        .map_or_else(|e| e.into_inner().0, |(g, _)| g);
                    continue;
                }
                let start = (next(&mut rng) % slots.len() as u64) as usize;
                let found = (0..slots.len())
                    .map(|k| slots[(start + k) % slots.len()])
                    .find(|s| {
                        q.streams
                            .get(s)
                            .and_then(VecDeque::front)
                            .is_some_and(|op| runnable(&op.step, machine))
                    });
                match found {
                    Some(s) => {
                        let op = q.streams.get_mut(&s).and_then(VecDeque::pop_front);
                        if let Some(op) = op {
                            q.inflight = Some(s);
                            break (s, op);
                        }
                    }
                    None => {
                        q = shared
                            .cv
                            .wait_timeout(q, POLL)
                            .map_or_else(|e| e.into_inner().0, |(g, _)| g);
                    }
                }
            }
        };
        if delay_us > 0 {
            let r = next(&mut rng);
            // Half the steps run at once, the others after up to `delay_us`.
            if r & 1 == 0 {
                std::thread::sleep(Duration::from_micros((r >> 1) % (delay_us + 1)));
            }
        }
        {
            let mut l = local
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            machine.with(|st| {
                match op.step {
                    Step::Run(work) => work(&mut l, st),
                    Step::Record {
                        event,
                        generation,
                        n,
                    } => {
                        let e = &mut st.events[event];
                        if e.live == 1 && e.generation == generation {
                            e.completed = e.completed.max(n);
                        }
                    }
                    Step::Wait { .. } | Step::Mark | Step::AfterStream { .. } | Step::Hang => {}
                }
                let s = &mut st.streams[slot];
                s.executed = s.executed.max(op.seq);
            });
        }
        let mut q = shared.lock();
        let e = q.executed.entry(slot).or_insert(0);
        *e = (*e).max(op.seq);
        q.pending = q.pending.saturating_sub(1);
        q.inflight = None;
        shared.cv.notify_all();
    }
}
