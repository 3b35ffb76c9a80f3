//! Trimming the pool back after a killed worker's results were freed, and giving its arena's
//! chunks back: the frees are stream-ordered, and a job held for its worker's DONE waits out
//! the reap grace before its results are freed, so the loop looks (without waiting on the GPU)
//! every [`TRIM_EVERY`] from the reaping: for [`TRIM_FOR`] at least, and on while pool bytes
//! are still owed, until [`TRIM_GIVE_UP`]. The part keeps the schedule and what is still owed;
//! the loop does the trims it says are due.

use std::time::{Duration, Instant};

/// How often a trim looks.
pub(super) const TRIM_EVERY: Duration = Duration::from_millis(100);
/// How long after a killed worker's reaping the pool and the arenas are looked at, at least.
pub(super) const TRIM_FOR: Duration = Duration::from_secs(1);
/// How long after a killed worker's reaping the pool is trimmed while bytes are still owed.
pub(super) const TRIM_GIVE_UP: Duration = Duration::from_secs(10);

/// The trims after killed workers' reapings, if any is running.
#[derive(Debug, Default)]
pub(super) struct PoolTrim(Option<Window>);

#[derive(Debug)]
struct Window {
    /// The bytes still to give back to the device (the killed workers' pool results less what
    /// the trims gave back so far); 0: the arenas only. Each look trims the pool to its
    /// reserved bytes then less these, so memory the parent frees meanwhile stays the pool's.
    owed: u64,
    next: Instant,
    /// The looks go on at least until then (the arenas' chunks), ...
    until: Instant,
    /// ... and while bytes are owed, until then.
    give_up: Instant,
}

impl PoolTrim {
    /// A killed worker's pool results (`owed` bytes) were freed at `now`: give that much more
    /// back, looking from now until [`TRIM_FOR`] from now.
    pub(super) fn after(&mut self, owed: u64, now: Instant) {
        let owed = self
            .0
            .as_ref()
            .map_or(owed, |t| t.owed.saturating_add(owed));
        self.0 = Some(Window {
            owed,
            next: now,
            until: now + TRIM_FOR,
            give_up: now + TRIM_GIVE_UP,
        });
    }

    /// Whether a look is due at `now`: the bytes still owed (0: only the arenas), the next
    /// look set [`TRIM_EVERY`] later; the window ends with the look at or past its end, once
    /// nothing is owed or at [`TRIM_GIVE_UP`].
    pub(super) fn due(&mut self, now: Instant) -> Option<u64> {
        let t = self.0.as_mut()?;
        if now < t.next {
            return None;
        }
        t.next = now + TRIM_EVERY;
        let owed = t.owed;
        if now >= t.until && (owed == 0 || now >= t.give_up) {
            self.0 = None;
        }
        Some(owed)
    }

    /// A trim gave `bytes` back to the device: that much less is owed.
    pub(super) fn gave_back(&mut self, bytes: u64) {
        if let Some(t) = self.0.as_mut() {
            t.owed = t.owed.saturating_sub(bytes);
        }
    }

    /// When the next look is due, while trims run.
    pub(super) fn next(&self) -> Option<Instant> {
        self.0.as_ref().map(|t| t.next)
    }

    /// What a look keeps of a pool holding `reserved` bytes when `owed` are owed.
    pub(super) fn keep(reserved: u64, owed: u64) -> u64 {
        reserved.saturating_sub(owed)
    }
}

#[cfg(test)]
mod tests {
    use super::{PoolTrim, TRIM_EVERY, TRIM_FOR, TRIM_GIVE_UP};
    use std::time::{Duration, Instant};

    #[test]
    fn nothing_is_due_before_a_reaping() {
        let mut t = PoolTrim::default();
        assert_eq!(t.due(Instant::now()), None);
        assert_eq!(t.next(), None);
    }

    #[test]
    fn looks_come_every_period_until_the_window_ends() {
        let t0 = Instant::now();
        let mut t = PoolTrim::default();
        t.after(1000, t0);
        assert_eq!(t.due(t0), Some(1000), "the first look at once");
        assert_eq!(t.due(t0 + TRIM_EVERY / 2), None, "not before the period");
        assert_eq!(t.next(), Some(t0 + TRIM_EVERY));
        assert_eq!(t.due(t0 + TRIM_EVERY), Some(1000));
        t.gave_back(1000);
        assert_eq!(t.due(t0 + TRIM_FOR), Some(0), "the last look");
        assert_eq!(t.next(), None, "the window ended with it");
        assert_eq!(t.due(t0 + TRIM_FOR + TRIM_EVERY), None);
    }

    #[test]
    fn looks_go_on_while_bytes_are_owed_until_they_give_up() {
        // The frees can come after the first second (a job held for its DONE is freed at the
        // end of the reap grace): until then the pool cannot give the memory back.
        let t0 = Instant::now();
        let mut t = PoolTrim::default();
        t.after(1000, t0);
        assert_eq!(
            t.due(t0 + TRIM_FOR),
            Some(1000),
            "past the arenas' window, still owed"
        );
        assert!(t.next().is_some(), "the looks go on");
        assert_eq!(t.due(t0 + TRIM_FOR + TRIM_EVERY), Some(1000));
        assert_eq!(t.due(t0 + TRIM_GIVE_UP), Some(1000), "the last look");
        assert_eq!(t.next(), None, "given up");
        assert_eq!(t.due(t0 + TRIM_GIVE_UP + TRIM_EVERY), None);
    }

    #[test]
    fn what_was_given_back_is_owed_no_more_and_a_second_reaping_adds_and_extends() {
        let t0 = Instant::now();
        let mut t = PoolTrim::default();
        t.after(1000, t0);
        assert_eq!(t.due(t0), Some(1000));
        t.gave_back(600);
        assert_eq!(t.due(t0 + TRIM_EVERY), Some(400));
        t.gave_back(1000);
        assert_eq!(
            t.due(t0 + 2 * TRIM_EVERY),
            Some(0),
            "the arenas only, never less"
        );
        let t1 = t0 + TRIM_FOR - Duration::from_millis(1);
        t.after(50, t1);
        assert_eq!(t.due(t1), Some(50), "added, looked at once");
        assert!(
            t.due(t0 + TRIM_FOR + TRIM_EVERY).is_some(),
            "the window runs from the later reaping"
        );
    }

    #[test]
    fn a_look_keeps_the_reserved_bytes_less_what_is_owed() {
        assert_eq!(PoolTrim::keep(1 << 30, 1 << 20), (1 << 30) - (1 << 20));
        assert_eq!(PoolTrim::keep(100, 1000), 0);
    }
}
