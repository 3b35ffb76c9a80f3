//! The loop's clock and pace: the contract's time (nanoseconds since the loop started), when
//! the loop last had something to do (it spins for a while after that, so that the next
//! frame or submit finds it awake), and how long each turn waited rather than worked (for
//! `ParentStats::io_busy_ns`).

use std::time::{Duration, Instant};

use poolipc_contract::Timestamp;

/// The room's clock and spin window.
#[derive(Debug)]
pub(super) struct Pace {
    epoch: Instant,
    /// When a job last finished, a command last came or a worker last sent a frame.
    last_activity: Instant,
    /// How long this turn of the loop waited for IO.
    waited: Duration,
}

impl Pace {
    /// The contract's time starts at `now`, which counts as activity.
    pub(super) fn new(now: Instant) -> Pace {
        Pace {
            epoch: now,
            last_activity: now,
            waited: Duration::ZERO,
        }
    }

    /// The contract's time at `at`: nanoseconds since the loop started (0 before it).
    pub(super) fn stamp(&self, at: Instant) -> Timestamp {
        let since = at.saturating_duration_since(self.epoch);
        Timestamp(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
    }

    /// Something happened at `at`: the spin window runs from there.
    pub(super) fn active(&mut self, at: Instant) {
        self.last_activity = at;
    }

    /// Until when a wait that starts at `started` spins rather than sleeps: `spin` after the
    /// last activity, or the longer of `spin` and `spin_in_flight` while jobs are in flight
    /// (`busy`); `None` when that is over already.
    pub(super) fn spin_until(
        &self,
        busy: bool,
        spin: Duration,
        spin_in_flight: Duration,
        started: Instant,
    ) -> Option<Instant> {
        let window = if busy { spin_in_flight.max(spin) } else { spin };
        self.last_activity
            .checked_add(window)
            .filter(|&t| t > started)
    }

    /// This turn waited `waited` for IO.
    pub(super) fn waited(&mut self, waited: Duration) {
        self.waited = waited;
    }

    /// A turn that took `elapsed` ends: the part of it that was work, not waiting.
    pub(super) fn busy(&mut self, elapsed: Duration) -> Duration {
        elapsed.saturating_sub(std::mem::take(&mut self.waited))
    }
}

#[cfg(test)]
mod tests {
    use super::Pace;
    use std::time::{Duration, Instant};

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_contracts_time_counts_nanoseconds_from_the_start() {
        let t0 = Instant::now();
        let p = Pace::new(t0);
        assert_eq!(p.stamp(t0).0, 0);
        assert_eq!(p.stamp(t0 + MS).0, 1_000_000);
        assert!(p.stamp(t0 + 2 * MS).0 > p.stamp(t0 + MS).0);
    }

    #[test]
    fn the_spin_window_runs_from_the_last_activity_and_is_longer_in_flight() {
        let t0 = Instant::now();
        let mut p = Pace::new(t0);
        let (spin, in_flight) = (MS, 4 * MS);
        assert_eq!(p.spin_until(false, spin, in_flight, t0), Some(t0 + MS));
        assert_eq!(p.spin_until(true, spin, in_flight, t0), Some(t0 + 4 * MS));
        assert_eq!(
            p.spin_until(false, spin, in_flight, t0 + 2 * MS),
            None,
            "over"
        );
        assert_eq!(
            p.spin_until(true, 5 * MS, in_flight, t0),
            Some(t0 + 5 * MS),
            "in flight never shorter than idle"
        );
        p.active(t0 + 10 * MS);
        assert_eq!(
            p.spin_until(false, spin, in_flight, t0 + 10 * MS),
            Some(t0 + 11 * MS)
        );
        assert_eq!(
            p.spin_until(false, Duration::ZERO, in_flight, t0 + 10 * MS),
            None,
            "off"
        );
    }

    #[test]
    fn a_turns_busy_time_is_what_it_did_not_wait_and_the_wait_counts_once() {
        let mut p = Pace::new(Instant::now());
        p.waited(3 * MS);
        assert_eq!(p.busy(5 * MS), 2 * MS);
        assert_eq!(p.busy(5 * MS), 5 * MS, "the next turn did not wait");
        p.waited(9 * MS);
        assert_eq!(p.busy(5 * MS), Duration::ZERO, "never below zero");
    }
}
