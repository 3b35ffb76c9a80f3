//! The answers `empty_cache` waits for: each worker told to unmap an arena chunk, to drop its
//! cached VMM mappings, to take or destroy a pool generation answers under a key, and each
//! `empty_cache` is replied to once its workers answered, or were lost, or are all busy in a
//! job, or its wait ran out. Also when the loop last looked for idle arena chunks.

use std::collections::HashSet;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use poolipc_types::WorkerId;

use crate::state::EmptyCache;

/// The key of a `ReleaseMappings` answer among the awaited (worker, chunk) answers: no chunk
/// has this index (indices count up from 0 and a `u32` runs out long before).
pub(super) const MAPPINGS_ACK: u32 = u32::MAX;

/// How often the IO thread looks for arena chunks idle long enough to give back.
pub(super) const IDLE_RELEASE_CHECK: Duration = Duration::from_secs(1);

/// An `empty_cache` waiting for workers to answer.
struct ReleaseWaiter {
    reply: Sender<EmptyCache>,
    report: EmptyCache,
    /// (worker, key) answers still awaited.
    awaited: HashSet<(WorkerId, u32)>,
    deadline: Instant,
}

/// Where a worker an answer is awaited from stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Standing {
    /// Lost or reaped: it never answers (what it mapped went with it).
    Gone,
    /// In the middle of a job: it reads its socket only after it.
    Busy,
    /// Between jobs.
    Idle,
}

/// The room's awaited answers and the `empty_cache`s waiting on them.
#[derive(Debug)]
pub(super) struct Answers {
    /// Answers awaited, by (worker, key), until they come.
    awaited: HashSet<(WorkerId, u32)>,
    waiters: Vec<ReleaseWaiter>,
    /// When the loop last looked for idle arena chunks.
    last_idle_check: Instant,
}

impl std::fmt::Debug for ReleaseWaiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReleaseWaiter")
            .field("awaited", &self.awaited)
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}

impl Answers {
    /// No answer awaited; the first look for idle chunks [`IDLE_RELEASE_CHECK`] after `now`.
    pub(super) fn new(now: Instant) -> Answers {
        Answers {
            awaited: HashSet::new(),
            waiters: Vec::new(),
            last_idle_check: now,
        }
    }

    /// `worker`'s answer under `key` is awaited.
    pub(super) fn expect(&mut self, worker: WorkerId, key: u32) {
        self.awaited.insert((worker, key));
    }

    /// `worker` answered under `key`: whether that answer was awaited.
    pub(super) fn answered(&mut self, worker: WorkerId, key: u32) -> bool {
        self.awaited.remove(&(worker, key))
    }

    /// `worker` is gone: none of its answers is awaited any more.
    pub(super) fn forget(&mut self, worker: WorkerId) {
        self.awaited.retain(|k| k.0 != worker);
    }

    /// Whether an `empty_cache` waits (the loop then looks again soon).
    pub(super) fn waiting(&self) -> bool {
        !self.waiters.is_empty()
    }

    /// An `empty_cache` whose `report` goes to `reply` once the `awaited` answers came (or
    /// as [`reply_due`](Answers::reply_due) decides otherwise), at the latest at `deadline`.
    pub(super) fn wait(
        &mut self,
        reply: Sender<EmptyCache>,
        report: EmptyCache,
        awaited: HashSet<(WorkerId, u32)>,
        deadline: Instant,
    ) {
        self.waiters.push(ReleaseWaiter {
            reply,
            report,
            awaited,
            deadline,
        });
    }

    /// Replies to each `empty_cache` whose workers all answered or are gone, or whose
    /// workers still to answer are all busy in a job (a custom node running for seconds
    /// answers after it, and what it held comes back then: never waited for, so that an
    /// `empty_cache`, which torch calls often, never stalls on it), or whose wait is over at
    /// `now`. The report counts the workers that had not answered.
    pub(super) fn reply_due(&mut self, now: Instant, standing: impl Fn(WorkerId) -> Standing) {
        if self.waiters.is_empty() {
            return;
        }
        let acks = &self.awaited;
        let mut keep = Vec::with_capacity(self.waiters.len());
        for mut w in std::mem::take(&mut self.waiters) {
            w.awaited
                .retain(|k| acks.contains(k) && standing(k.0) != Standing::Gone);
            let all_busy = w.awaited.iter().all(|k| standing(k.0) == Standing::Busy);
            if w.awaited.is_empty() || all_busy || now >= w.deadline {
                let mut missing: Vec<WorkerId> = w.awaited.iter().map(|k| k.0).collect();
                missing.sort_unstable();
                missing.dedup();
                w.report.workers_not_answered = missing.len();
                if !missing.is_empty() {
                    tracing::debug!(
                        ?missing,
                        "workers busy or slow did not answer empty_cache yet: what they hold comes back when they do"
                    );
                }
                let _ = w.reply.send(w.report);
            } else {
                keep.push(w);
            }
        }
        self.waiters = keep;
    }

    /// Whether a look for idle arena chunks is due at `now` (at most one per
    /// [`IDLE_RELEASE_CHECK`]); if so, it counts as made.
    pub(super) fn idle_check_due(&mut self, now: Instant) -> bool {
        if now.saturating_duration_since(self.last_idle_check) < IDLE_RELEASE_CHECK {
            return false;
        }
        self.last_idle_check = now;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::{Answers, IDLE_RELEASE_CHECK, Standing};
    use crate::state::EmptyCache;
    use poolipc_types::WorkerId;
    use std::collections::HashSet;
    use std::sync::mpsc::{Receiver, TryRecvError, channel};
    use std::time::{Duration, Instant};

    const W1: WorkerId = WorkerId(1);
    const W2: WorkerId = WorkerId(2);

    /// One `empty_cache` awaiting `keys` of `answers`, with a deadline a minute off.
    fn waiter(a: &mut Answers, keys: &[(WorkerId, u32)], now: Instant) -> Receiver<EmptyCache> {
        let (tx, rx) = channel();
        for &(w, k) in keys {
            a.expect(w, k);
        }
        let awaited: HashSet<_> = keys.iter().copied().collect();
        let report = EmptyCache {
            arena_chunks: 3,
            ..EmptyCache::default()
        };
        a.wait(tx, report, awaited, now + Duration::from_secs(60));
        rx
    }

    #[test]
    fn an_empty_cache_is_answered_once_every_worker_answered() {
        let now = Instant::now();
        let mut a = Answers::new(now);
        let rx = waiter(&mut a, &[(W1, 0), (W1, 1), (W2, 0)], now);
        assert!(a.waiting());
        assert!(a.answered(W1, 0) && a.answered(W1, 1));
        assert!(!a.answered(W1, 1), "an answer counts once");
        a.reply_due(now, |_| Standing::Idle);
        assert_eq!(
            rx.try_recv(),
            Err(TryRecvError::Empty),
            "W2 has not answered"
        );
        assert!(a.answered(W2, 0));
        a.reply_due(now, |_| Standing::Idle);
        let report = rx.try_recv().expect("answered");
        assert_eq!((report.arena_chunks, report.workers_not_answered), (3, 0));
        assert!(!a.waiting());
    }

    #[test]
    fn a_gone_worker_is_not_waited_for_and_a_busy_one_only_while_another_answers() {
        let now = Instant::now();
        let mut a = Answers::new(now);
        let rx = waiter(&mut a, &[(W1, 0), (W2, 0)], now);
        a.forget(W1);
        let standing = |w| {
            if w == W1 {
                Standing::Gone
            } else {
                Standing::Busy
            }
        };
        a.reply_due(now, standing);
        let report = rx.try_recv().expect("W1 gone, W2 busy: answered now");
        assert_eq!(report.workers_not_answered, 1, "W2 did not answer");
        let rx = waiter(&mut a, &[(W1, 5), (W2, 5)], now);
        let standing = |w| {
            if w == W1 {
                Standing::Idle
            } else {
                Standing::Busy
            }
        };
        a.reply_due(now, standing);
        assert_eq!(
            rx.try_recv(),
            Err(TryRecvError::Empty),
            "W1 idle: waited for"
        );
    }

    #[test]
    fn the_deadline_answers_with_the_workers_missing() {
        let now = Instant::now();
        let mut a = Answers::new(now);
        let rx = waiter(&mut a, &[(W1, 0), (W2, 0), (W2, 1)], now);
        a.reply_due(now + Duration::from_secs(61), |_| Standing::Idle);
        assert_eq!(rx.try_recv().map(|r| r.workers_not_answered), Ok(2));
    }

    #[test]
    fn idle_chunks_are_looked_for_once_a_period() {
        let now = Instant::now();
        let mut a = Answers::new(now);
        assert!(!a.idle_check_due(now));
        assert!(a.idle_check_due(now + IDLE_RELEASE_CHECK));
        assert!(!a.idle_check_due(now + IDLE_RELEASE_CHECK + Duration::from_millis(10)));
        assert!(a.idle_check_due(now + 2 * IDLE_RELEASE_CHECK));
    }
}
