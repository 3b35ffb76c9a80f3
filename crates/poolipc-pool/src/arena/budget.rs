//! `ArenaBudget`: a cap on the device bytes several arenas hold together.

use std::sync::atomic::{AtomicU64, Ordering};

/// A cap on the bytes of every chunk of the arenas that draw on it, and what they hold now.
///
/// One arena per worker keeps each worker's memory in chunks only that worker maps; the
/// cap is still the parent's as a whole: each arena is made with the same budget
/// ([`Arena::with_budget`](super::Arena::with_budget)), a chunk is added only when the
/// budget has room for it, and a chunk released (or dropped with its arena) gives its bytes
/// back. Makes no driver call; any thread may look at it.
#[derive(Debug)]
pub struct ArenaBudget {
    max: Option<u64>,
    used: AtomicU64,
}

impl ArenaBudget {
    /// A budget of `max_bytes` (`None`: no cap), nothing drawn yet.
    #[must_use]
    pub fn new(max_bytes: Option<u64>) -> ArenaBudget {
        ArenaBudget {
            max: max_bytes,
            used: AtomicU64::new(0),
        }
    }

    /// The cap, if any.
    #[must_use]
    pub fn max_bytes(&self) -> Option<u64> {
        self.max
    }

    /// Bytes of every chunk of every arena drawing on it now.
    #[must_use]
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The bytes a new chunk may have without passing the cap (`u64::MAX` without one).
    #[must_use]
    pub fn room(&self) -> u64 {
        self.max.map_or(u64::MAX, |m| m.saturating_sub(self.used()))
    }

    /// Draws `len` bytes for a new chunk; on refusal, the bytes held and the cap.
    pub(super) fn take(&self, len: u64) -> Result<(), (u64, u64)> {
        let Some(max) = self.max else {
            self.used.fetch_add(len, Ordering::AcqRel);
            return Ok(());
        };
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(len).filter(|total| *total <= max)
            })
            .map(|_| ())
            .map_err(|used| (used, max))
    }

    /// Gives back the bytes of a chunk released or dropped.
    pub(super) fn give(&self, len: u64) {
        // Never below 0: each chunk gives back exactly what it took.
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(len))
            });
    }
}
