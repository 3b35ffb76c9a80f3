//! Turns on the GPU for workers that are not MPS clients ([`ParentOptions::gpu_turn_wait`]).
//!
//! Without MPS the GPU runs one process's context at a time. Jobs of two workers in flight at
//! once make it switch between their contexts at every job: on an H100, one worker alone ran
//! 32-38k small jobs/s and two or more together 7200 jobs/s (stop 36/37), while one thread
//! giving two workers one job at a time in turn kept one worker's rate (`bench/probes/
//! turns_serial.py`). So a caller's submit to a worker waits, at most
//! [`gpu_turn_wait`](crate::ParentOptions::gpu_turn_wait), while another worker has jobs in
//! flight: the workers take turns at the parent, job by job, instead of on the GPU.
//!
//! The rules, all under one lock:
//! - a worker with the turn takes more jobs at once unless others wait for it (then it
//!   queues behind them: turns go in the order they were asked for);
//! - the turn passes when the holder's last counted job ended;
//! - a submit whose wait runs out goes at once, and so does every submit after it until the
//!   holder's counted jobs ended (the gate is *open*): a worker that holds its job for long
//!   (a big kernel, host work, or on purpose) costs the others one wait, not one each.
//!
//! No IO: the callers' threads enter, the IO thread's job completion leaves.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use poolipc_types::WorkerId;

use super::lock;

/// The gate the callers of one parent share.
#[derive(Debug)]
pub(crate) struct Turns {
    state: Mutex<State>,
    cond: Condvar,
    /// The most a submit waits for its turn.
    wait: Duration,
    /// How long the next in line looks for the turn without sleeping: a sleeper pays a
    /// wake-up (tens of microseconds on a busy host) at every pass of the turn.
    spin: Duration,
    /// Bumped each time the turn passes (its holder's jobs ended): what the spinner watches.
    passes: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    /// The worker whose jobs run now, while `held > 0`.
    holder: Option<WorkerId>,
    /// The holder's counted jobs in flight.
    held: usize,
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

impl Turns {
    /// A gate where a submit waits at most `wait` for its turn, the next in line spinning
    /// for at most `spin` of it before it sleeps.
    pub(crate) fn new(wait: Duration, spin: Duration) -> Turns {
        Turns {
            state: Mutex::new(State::default()),
            cond: Condvar::new(),
            wait,
            spin,
            passes: AtomicU64::new(0),
        }
    }

    /// Waits (at most the gate's wait) until `worker` may have a job in flight.
    pub(crate) fn enter(&self, worker: WorkerId) -> Entry {
        let mut s = lock(&self.state);
        if s.open {
            return Entry::Uncounted {
                waited: Duration::ZERO,
                ran_out: false,
            };
        }
        if s.queue.is_empty() && s.holder.is_none_or(|h| h == worker) {
            s.holder = Some(worker);
            s.held += 1;
            return Entry::Counted {
                waited: Duration::ZERO,
            };
        }
        let ticket = s.next_ticket;
        s.next_ticket += 1;
        s.queue.push_back(ticket);
        let start = Instant::now();
        let deadline = start + self.wait;
        let spin_until = start + self.spin.min(self.wait);
        loop {
            if s.open {
                s.queue.retain(|&t| t != ticket);
                self.cond.notify_all();
                return Entry::Uncounted {
                    waited: start.elapsed(),
                    ran_out: false,
                };
            }
            if s.queue.front() == Some(&ticket) && s.holder.is_none_or(|h| h == worker) {
                s.queue.pop_front();
                s.holder = Some(worker);
                s.held += 1;
                // The next in the queue may be a job of the same worker: it joins this turn.
                self.cond.notify_all();
                return Entry::Counted {
                    waited: start.elapsed(),
                };
            }
            let now = Instant::now();
            if now >= deadline {
                s.queue.retain(|&t| t != ticket);
                s.open = true;
                self.cond.notify_all();
                return Entry::Uncounted {
                    waited: now - start,
                    ran_out: true,
                };
            }
            if s.queue.front() == Some(&ticket) && now < spin_until {
                // Next in line: look for the pass without sleeping, then check again.
                let seen = self.passes.load(Ordering::Acquire);
                drop(s);
                while self.passes.load(Ordering::Acquire) == seen && Instant::now() < spin_until {
                    crate::spin::pause();
                }
                s = lock(&self.state);
                continue;
            }
            s = self
                .cond
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// A counted job of `worker` ended: the turn passes once the holder has none left.
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
            s.holder = None;
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
        assert!(
            counted(t.enter(B)),
            "the turn passed once A had nothing in flight"
        );
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
        let got = answered(&b, Duration::from_secs(10)).expect("B's turn once A's jobs ended");
        assert!(counted(got), "{got:?}");
        assert!(got.waited() >= Duration::from_millis(150), "{got:?}");
    }

    #[test]
    fn the_holder_queues_behind_a_waiting_worker_so_turns_alternate() {
        let t = Arc::new(Turns::new(LONG, Duration::ZERO));
        assert!(counted(t.enter(A)));
        let b = enter_on_thread(&t, B);
        std::thread::sleep(Duration::from_millis(50));
        // A's next job comes while B waits: it goes after B's turn.
        let a2 = enter_on_thread(&t, A);
        std::thread::sleep(Duration::from_millis(50));
        t.leave(A);
        assert!(counted(
            answered(&b, Duration::from_secs(10)).expect("B's turn")
        ));
        assert_eq!(
            answered(&a2, Duration::from_millis(100)),
            None,
            "A went again before B's job ended"
        );
        t.leave(B);
        assert!(counted(
            answered(&a2, Duration::from_secs(10)).expect("A's turn again")
        ));
        t.leave(A);
    }

    #[test]
    fn the_next_in_line_spinning_takes_the_turn_as_it_passes() {
        // It spins for up to 10 s and is not on the condition variable meanwhile: only the
        // pass it watches lets it see the turn free within the second.
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
        let t = Arc::new(Turns::new(Duration::from_millis(50), Duration::ZERO));
        assert!(counted(t.enter(A)));
        let got = t.enter(B);
        assert!(
            matches!(got, Entry::Uncounted { ran_out: true, waited } if waited >= Duration::from_millis(50)),
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
        assert!(start.elapsed() < Duration::from_millis(50));
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
    fn waiters_let_go_when_the_gate_opens_under_them() {
        let t = Arc::new(Turns::new(
            Duration::from_millis(300),
            Duration::from_millis(1),
        ));
        assert!(counted(t.enter(A)));
        let b = enter_on_thread(&t, B);
        std::thread::sleep(Duration::from_millis(50));
        let c = enter_on_thread(&t, C);
        // B's wait runs out first and opens the gate: C, queued behind it, goes too, long
        // before its own wait would have run out.
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
        assert!(gc.waited() < Duration::from_millis(300), "{gc:?}");
        t.leave(A);
    }

    #[test]
    fn a_worker_holding_its_job_costs_each_other_worker_one_wait_not_one_a_job() {
        let t = Arc::new(Turns::new(
            Duration::from_millis(30),
            Duration::from_millis(1),
        ));
        assert!(counted(t.enter(A))); // A never ends its job in this test.
        let start = Instant::now();
        for _ in 0..50 {
            let _ = t.enter(B);
        }
        // One wait of 30 ms, then open: 50 waits would be 1.5 s.
        assert!(
            start.elapsed() < Duration::from_millis(750),
            "{:?}",
            start.elapsed()
        );
    }
}
