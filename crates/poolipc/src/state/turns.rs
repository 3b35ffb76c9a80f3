//! Turns on the GPU for workers that are not MPS clients ([`Tuning::gpu_turn`](crate::Tuning::gpu_turn)).
//!
//! Without MPS the GPU runs one process's context at a time, and every change from one
//! worker's context to another's costs about 330 µs (H100, driver 580: one Python thread
//! giving four workers one 4 KiB job each in turn made 2545-2817 jobs/s, one worker alone
//! 46000; `bench/probes/turns_serial.py`). Jobs of several workers in flight at once make it
//! change at nearly every job (7200 jobs/s together, whatever the count); runs of 64 jobs per
//! worker kept 0.73-0.78× of one worker's rate. So the parent gives the workers the GPU in
//! turns of [`gpu_turn`](crate::Tuning::gpu_turn): while one worker holds the turn,
//! a submit to another waits.
//!
//! The rules, all under one lock:
//! - the worker holding the turn takes jobs for the length of its turn, any number at once;
//!   after it, it takes no more while another waits, and the turn passes when its jobs in
//!   flight ended;
//! - a worker with no job in flight keeps its turn for [`GRACE`] (its caller's next submit
//!   comes within microseconds of the last job's end), then whoever waits takes it;
//! - turns go in the order they were asked for;
//! - the next in line that waited a turn and as long again past it goes anyway, and so does
//!   every submit after it until the holder's jobs ended (the gate is *open*): a worker that
//!   keeps its job for long (a big kernel, host work, or on purpose) costs the others one
//!   such wait each, not one a job.
//!
//! No IO: the callers' threads enter, the IO thread's job completion leaves.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use poolipc_types::WorkerId;

use super::lock;

/// How long a worker with no job in flight keeps its turn, for its caller's next submit
/// (within its turn's length).
pub(crate) const GRACE: Duration = Duration::from_micros(100);

/// The gate the callers of one parent share.
#[derive(Debug)]
pub(crate) struct Turns {
    state: Mutex<State>,
    cond: Condvar,
    /// A turn's length.
    turn: Duration,
    /// How long the next in line looks for the turn without sleeping: a sleeper pays a
    /// wake-up (tens of microseconds on a busy host) at every pass of the turn.
    spin: Duration,
    /// Bumped whenever the turn may have become free: what the spinner watches.
    passes: AtomicU64,
}

#[derive(Debug)]
struct State {
    /// The worker whose turn it is.
    holder: Option<WorkerId>,
    /// The thread that made the holder's latest counted submit.
    feeder: Option<ThreadId>,
    /// Its counted jobs in flight.
    held: usize,
    /// When its turn began.
    since: Instant,
    /// Since when it has had no job in flight (None while it has).
    idle_since: Option<Instant>,
    /// The submits waiting for a turn, by ticket, oldest first.
    queue: VecDeque<u64>,
    next_ticket: u64,
    /// A wait ran out: every submit goes at once until the holder's jobs ended.
    open: bool,
}

/// How a submit went through the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Entry {
    /// It holds (a share of) the turn: [`Turns::leave`] when its job ends.
    Counted { waited: Duration },
    /// It went without the turn (its wait ran out, or the gate was open): nothing to leave.
    Uncounted { waited: Duration, ran_out: bool },
}

impl Entry {
    /// How long the submit waited at the gate.
    pub(crate) fn waited(self) -> Duration {
        match self {
            Entry::Counted { waited } | Entry::Uncounted { waited, .. } => waited,
        }
    }
}

impl State {
    /// Whether a worker other than the holder may take the turn at `now`.
    fn passable(&self, now: Instant, turn: Duration) -> bool {
        match self.holder {
            None => true,
            Some(_) => {
                self.held == 0
                    && (now.saturating_duration_since(self.since) >= turn
                        || self
                            .idle_since
                            .is_some_and(|i| now.saturating_duration_since(i) >= GRACE.min(turn)))
            }
        }
    }

    /// `worker` takes the turn, or a share of its own, for a submit of thread `by`.
    fn take(&mut self, worker: WorkerId, by: ThreadId, now: Instant, turn: Duration) {
        if self.holder != Some(worker) || now.saturating_duration_since(self.since) >= turn {
            self.since = now;
        }
        self.holder = Some(worker);
        self.feeder = Some(by);
        self.held += 1;
        self.idle_since = None;
    }

    /// When the turn may next become passable by time alone (None: only by a job's end).
    fn next_change(&self, turn: Duration) -> Option<Instant> {
        if self.holder.is_none() || self.held > 0 {
            return None;
        }
        let ends = self.since + turn;
        Some(match self.idle_since {
            Some(i) => ends.min(i + GRACE.min(turn)),
            None => ends,
        })
    }
}

impl Turns {
    /// A gate with turns of `turn`, the next in line spinning for at most `spin` before it
    /// sleeps.
    pub(crate) fn new(turn: Duration, spin: Duration) -> Turns {
        Turns {
            state: Mutex::new(State {
                holder: None,
                feeder: None,
                held: 0,
                since: Instant::now(),
                idle_since: None,
                queue: VecDeque::new(),
                next_ticket: 0,
                open: false,
            }),
            cond: Condvar::new(),
            turn,
            spin,
            passes: AtomicU64::new(0),
        }
    }

    /// A turn's length.
    pub(crate) fn turn(&self) -> Duration {
        self.turn
    }

    /// Waits until `worker` may have a job in flight: its turn, or the gate open.
    pub(crate) fn enter(&self, worker: WorkerId) -> Entry {
        let mut s = lock(&self.state);
        if s.open && s.held == 0 {
            // Open until the holder's jobs ended: it has none (only `leave` closes it
            // otherwise, and a holder with nothing in flight never leaves).
            s.open = false;
        }
        if s.open {
            return Entry::Uncounted {
                waited: Duration::ZERO,
                ran_out: false,
            };
        }
        let start = Instant::now();
        let me = std::thread::current().id();
        if s.holder == Some(worker)
            && (s.queue.is_empty() || start.saturating_duration_since(s.since) < self.turn)
        {
            s.take(worker, me, start, self.turn);
            return Entry::Counted {
                waited: Duration::ZERO,
            };
        }
        if s.queue.is_empty() && s.passable(start, self.turn) {
            s.take(worker, me, start, self.turn);
            return Entry::Counted {
                waited: Duration::ZERO,
            };
        }
        // The thread feeding the holder moves on to another worker: turns arbitrate between
        // callers, never within one, whose jobs go in the order it makes them (one thread
        // driving every worker is no slower with turns than without).
        if s.queue.is_empty() && s.feeder == Some(me) {
            if s.held == 0 {
                s.take(worker, me, start, self.turn);
                self.passes.fetch_add(1, Ordering::Release);
                return Entry::Counted {
                    waited: Duration::ZERO,
                };
            }
            return Entry::Uncounted {
                waited: Duration::ZERO,
                ran_out: false,
            };
        }
        let ticket = s.next_ticket;
        s.next_ticket += 1;
        s.queue.push_back(ticket);
        // Since when this submit has been next in line.
        let mut first_since: Option<Instant> = None;
        loop {
            if s.open {
                s.queue.retain(|&t| t != ticket);
                self.cond.notify_all();
                return Entry::Uncounted {
                    waited: start.elapsed(),
                    ran_out: false,
                };
            }
            let now = Instant::now();
            if s.queue.front() != Some(&ticket) {
                s = self
                    .cond
                    .wait_timeout(s, self.turn)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
                continue;
            }
            let first = *first_since.get_or_insert(now);
            if s.holder == Some(worker) || s.passable(now, self.turn) {
                s.queue.pop_front();
                s.take(worker, me, now, self.turn);
                self.passes.fetch_add(1, Ordering::Release);
                // The next in line starts its own clock.
                self.cond.notify_all();
                return Entry::Counted {
                    waited: now - start,
                };
            }
            // A turn and as long again, next in line: the holder keeps its jobs for long.
            let deadline = first + 2 * self.turn;
            if now >= deadline && s.held > 0 {
                s.queue.pop_front();
                s.open = true;
                self.cond.notify_all();
                return Entry::Uncounted {
                    waited: now - start,
                    ran_out: true,
                };
            }
            // Past the deadline with the holder idle: it is passable within its grace.
            let until = match s.next_change(self.turn) {
                Some(c) if now >= deadline => c,
                Some(c) => c.min(deadline),
                None => deadline,
            };
            if now.saturating_duration_since(first) < self.spin {
                // Look for the change without sleeping, then check again.
                let seen = self.passes.load(Ordering::Acquire);
                let spin_until = until.min(first + self.spin);
                drop(s);
                while self.passes.load(Ordering::Acquire) == seen && Instant::now() < spin_until {
                    crate::spin::pause();
                }
                s = lock(&self.state);
                continue;
            }
            s = self
                .cond
                .wait_timeout(s, until.saturating_duration_since(now))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// A counted job of `worker` ended. The holder keeps its turn while it lasts and for
    /// [`GRACE`] after its last job; the gate closes again once it has no job in flight.
    pub(crate) fn leave(&self, worker: WorkerId) {
        let mut s = lock(&self.state);
        debug_assert_eq!(
            s.holder,
            Some(worker),
            "a counted job's worker holds the turn"
        );
        if s.holder != Some(worker) || s.held == 0 {
            return;
        }
        s.held -= 1;
        if s.held == 0 {
            s.idle_since = Some(Instant::now());
            s.open = false;
            self.passes.fetch_add(1, Ordering::Release);
            self.cond.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::mpsc;

    const A: WorkerId = WorkerId(1);
    const B: WorkerId = WorkerId(2);
    const C: WorkerId = WorkerId(3);
    const LONG: Duration = Duration::from_secs(30);

    fn counted(e: Entry) -> bool {
        matches!(e, Entry::Counted { .. })
    }

    /// Enters on a thread of its own; the receiver gets the entry once through.
    fn enter_on_thread(t: &Arc<Turns>, w: WorkerId) -> mpsc::Receiver<Entry> {
        let (tx, rx) = mpsc::channel();
        let t = Arc::clone(t);
        std::thread::spawn(move || {
            let _ = tx.send(t.enter(w));
        });
        rx
    }

    /// Whether `rx` answers within `d`.
    fn answered(rx: &mpsc::Receiver<Entry>, d: Duration) -> Option<Entry> {
        rx.recv_timeout(d).ok()
    }

    #[test]
    fn one_worker_takes_any_number_of_jobs_without_waiting() {
        let t = Turns::new(LONG, Duration::ZERO);
        for _ in 0..5 {
            assert_eq!(
                t.enter(A),
                Entry::Counted {
                    waited: Duration::ZERO
                }
            );
        }
        for _ in 0..5 {
            t.leave(A);
        }
        // Idle, A keeps its turn for its caller's next submit.
        assert_eq!(
            t.enter(A),
            Entry::Counted {
                waited: Duration::ZERO
            }
        );
        t.leave(A);
    }

    #[test]
    fn a_second_worker_waits_until_the_first_ones_jobs_ended() {
        let t = Arc::new(Turns::new(LONG, Duration::ZERO));
        assert!(counted(t.enter(A)));
        assert!(counted(t.enter(A)));
        let b = enter_on_thread(&t, B);
        assert_eq!(
            answered(&b, Duration::from_millis(100)),
            None,
            "B went while A held the turn"
        );
        t.leave(A);
        assert_eq!(
            answered(&b, Duration::from_millis(100)),
            None,
            "B went with one of A's jobs in flight"
        );
        t.leave(A);
        // A has nothing in flight: past the grace, B takes the turn (A's is 30 s long).
        let got = answered(&b, Duration::from_secs(10)).expect("B's turn once A's jobs ended");
        assert!(counted(got), "{got:?}");
        assert!(got.waited() >= Duration::from_millis(150), "{got:?}");
        let a = enter_on_thread(&t, A);
        assert_eq!(
            answered(&a, Duration::from_millis(100)),
            None,
            "A went during B's turn"
        );
        t.leave(B);
        assert!(counted(
            answered(&a, Duration::from_secs(10)).expect("A's turn again")
        ));
    }

    #[test]
    fn the_holder_takes_more_jobs_during_its_turn_while_another_waits() {
        let t = Arc::new(Turns::new(Duration::from_secs(5), Duration::ZERO));
        assert!(counted(t.enter(A)));
        let b = enter_on_thread(&t, B);
        std::thread::sleep(Duration::from_millis(50));
        // Within its turn A goes on, B waiting or not: a run of jobs on one context.
        for _ in 0..3 {
            assert_eq!(
                t.enter(A),
                Entry::Counted {
                    waited: Duration::ZERO
                }
            );
        }
        for _ in 0..4 {
            t.leave(A);
        }
        assert!(counted(
            answered(&b, Duration::from_secs(10)).expect("B after A's jobs")
        ));
        t.leave(B);
    }

    #[test]
    fn after_its_turn_the_holder_queues_behind_a_waiting_worker() {
        let turn = Duration::from_millis(100);
        let t = Arc::new(Turns::new(turn, Duration::ZERO));
        assert!(counted(t.enter(A)));
        let b = enter_on_thread(&t, B);
        std::thread::sleep(turn + Duration::from_millis(50));
        // A's turn is over and B waits: A's next job goes after B's turn.
        let a2 = enter_on_thread(&t, A);
        std::thread::sleep(Duration::from_millis(20));
        t.leave(A);
        assert!(counted(
            answered(&b, Duration::from_secs(10)).expect("B's turn")
        ));
        assert_eq!(
            answered(&a2, Duration::from_millis(50)),
            None,
            "A went again during B's turn"
        );
        t.leave(B);
        assert!(counted(
            answered(&a2, Duration::from_secs(10)).expect("A's turn again")
        ));
        t.leave(A);
    }

    #[test]
    fn the_next_in_line_spinning_takes_the_turn_once_it_passes() {
        // It spins for up to 10 s and is not on the condition variable meanwhile: only the
        // pass it watches, and the grace's end it computes, let it take the turn in time.
        let t = Arc::new(Turns::new(LONG, Duration::from_secs(10)));
        assert!(counted(t.enter(A)));
        let b = enter_on_thread(&t, B);
        std::thread::sleep(Duration::from_millis(50));
        t.leave(A);
        let got = answered(&b, Duration::from_secs(1)).expect("B saw the pass");
        assert!(counted(got), "{got:?}");
        t.leave(B);
    }

    #[test]
    fn one_thread_moving_from_worker_to_worker_never_waits_on_itself() {
        let t = Arc::new(Turns::new(LONG, Duration::ZERO));
        // Alternating with nothing in flight: the turn follows the thread at once.
        for w in [A, B, A, C] {
            assert_eq!(
                t.enter(w),
                Entry::Counted {
                    waited: Duration::ZERO
                }
            );
            t.leave(w);
        }
        // A job of A's in flight and one for B from the same thread: B's goes at once,
        // outside the turn (A keeps it).
        assert!(counted(t.enter(A)));
        assert_eq!(
            t.enter(B),
            Entry::Uncounted {
                waited: Duration::ZERO,
                ran_out: false
            }
        );
        // Another thread's submit still waits for A's turn.
        let c = enter_on_thread(&t, C);
        assert_eq!(
            answered(&c, Duration::from_millis(100)),
            None,
            "C went during A's turn"
        );
        t.leave(A);
        assert!(counted(
            answered(&c, Duration::from_secs(10)).expect("C after A")
        ));
        t.leave(C);
    }

    #[test]
    fn turns_go_in_the_order_they_were_asked_for() {
        let t = Arc::new(Turns::new(LONG, Duration::ZERO));
        assert!(counted(t.enter(A)));
        let b = enter_on_thread(&t, B);
        std::thread::sleep(Duration::from_millis(50));
        let c = enter_on_thread(&t, C);
        std::thread::sleep(Duration::from_millis(50));
        t.leave(A);
        assert!(counted(
            answered(&b, Duration::from_secs(10)).expect("B first")
        ));
        assert_eq!(
            answered(&c, Duration::from_millis(100)),
            None,
            "C went during B's turn"
        );
        t.leave(B);
        assert!(counted(
            answered(&c, Duration::from_secs(10)).expect("C after B")
        ));
        t.leave(C);
    }

    #[test]
    fn a_wait_that_runs_out_opens_the_gate_until_the_holder_is_done() {
        let turn = Duration::from_millis(50);
        let t = Arc::new(Turns::new(turn, Duration::ZERO));
        // A's job comes from another thread (a thread's own submits never wait on each other).
        assert!(counted(enter_on_thread(&t, A).recv().unwrap()));
        let got = t.enter(B);
        assert!(
            matches!(got, Entry::Uncounted { ran_out: true, waited } if waited >= 2 * turn),
            "{got:?}"
        );
        // Open: every submit goes at once, of any worker, while A's job is in flight.
        let start = Instant::now();
        assert_eq!(
            t.enter(C),
            Entry::Uncounted {
                waited: Duration::ZERO,
                ran_out: false
            }
        );
        assert_eq!(
            t.enter(B),
            Entry::Uncounted {
                waited: Duration::ZERO,
                ran_out: false
            }
        );
        assert!(start.elapsed() < turn);
        // A's job ended: the gate closes and the turns start again.
        t.leave(A);
        assert!(counted(t.enter(C)));
        let b = enter_on_thread(&t, B);
        assert_eq!(
            answered(&b, Duration::from_millis(20)),
            None,
            "B went during C's turn"
        );
        t.leave(C);
        assert!(counted(
            answered(&b, Duration::from_secs(10)).expect("B's turn")
        ));
    }

    #[test]
    fn an_open_gate_with_nothing_of_the_holder_in_flight_closes_at_the_next_submit() {
        // Only the holder's last job's end closes the gate; should it be open with none in
        // flight (a wait that ran out as the holder went idle), it must not stay open.
        let t = Turns::new(LONG, Duration::ZERO);
        assert!(counted(t.enter(A)));
        t.leave(A);
        {
            let mut s = lock(&t.state);
            s.open = true;
        }
        assert!(
            counted(t.enter(A)),
            "the gate stayed open with nothing in flight"
        );
        t.leave(A);
    }

    #[test]
    fn waiters_let_go_when_the_gate_opens_under_them() {
        let turn = Duration::from_millis(150);
        let t = Arc::new(Turns::new(turn, Duration::from_millis(1)));
        assert!(counted(t.enter(A)));
        let b = enter_on_thread(&t, B);
        std::thread::sleep(Duration::from_millis(50));
        let c = enter_on_thread(&t, C);
        // B's wait runs out first and opens the gate: C, behind it, goes too, long before
        // its own wait (as next in line) would have run out.
        let gb = answered(&b, Duration::from_secs(10)).expect("B through");
        let gc = answered(&c, Duration::from_secs(10)).expect("C through");
        assert!(
            matches!(gb, Entry::Uncounted { ran_out: true, .. }),
            "{gb:?}"
        );
        assert!(
            matches!(gc, Entry::Uncounted { ran_out: false, .. }),
            "{gc:?}"
        );
        assert!(gc.waited() < 2 * turn, "{gc:?}");
        t.leave(A);
    }

    #[test]
    fn a_worker_holding_its_job_costs_each_other_worker_one_wait_not_one_a_job() {
        let turn = Duration::from_millis(15);
        let t = Arc::new(Turns::new(turn, Duration::from_millis(1)));
        // A never ends its job in this test; it comes from another thread.
        assert!(counted(enter_on_thread(&t, A).recv().unwrap()));
        let start = Instant::now();
        for _ in 0..50 {
            let _ = t.enter(B);
        }
        // One wait of two turns (30 ms), then open: 50 waits would be 1.5 s.
        assert!(
            start.elapsed() < Duration::from_millis(750),
            "{:?}",
            start.elapsed()
        );
    }
}
