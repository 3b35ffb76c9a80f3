//! A worker's DONE events as the parent opened them: at most
//! [`ParentOptions::max_open_done_events`](crate::ParentOptions::max_open_done_events) per
//! worker, the least recently used closed first.
//!
//! Every distinct DONE blob a worker sends is an interprocess event the parent opens
//! (`cuIpcOpenEventHandle`) and keeps, so that a worker that records DONE on the same event
//! job after job costs one open. A worker that sends a new blob with every job would make the
//! parent hold one open event per job until it is reaped. The choice here: **close events as
//! they age**, not condemn. An event no held job waits on is only a cache entry: closing it
//! costs a reopen if the worker sends that blob again, nothing more. Only when every open
//! event is one a held job still waits on (the bound reached by jobs whose DONE has not
//! completed) is there nothing to close; the worker is then condemned
//! ([`Bound::OpenDoneEvents`](poolipc_contract::Bound)).

use std::collections::HashMap;

use poolipc_driver::{EventHandle, OwnedEvent};
use poolipc_types::EventBlob;

/// One worker's opened DONE events, least recently used first out.
#[derive(Default)]
pub(super) struct DoneEvents {
    open: HashMap<EventBlob, (OwnedEvent, u64)>,
    /// Counts uses: an event's last use is the tick it was last asked for.
    tick: u64,
}

/// What [`DoneEvents::make_room`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Room {
    /// The blob is open, or there is room for it (an old event was closed if needed).
    Ready,
    /// All `max` open events are waited on by held jobs: none may be closed.
    Full,
}

impl DoneEvents {
    /// The event opened for `blob`, marked as used now.
    pub(super) fn use_open(&mut self, blob: &EventBlob) -> Option<EventHandle> {
        self.tick += 1;
        let tick = self.tick;
        self.open.get_mut(blob).map(|(e, used)| {
            *used = tick;
            e.handle()
        })
    }

    /// The event opened for `blob`, without marking it used.
    pub(super) fn get(&self, blob: &EventBlob) -> Option<&OwnedEvent> {
        self.open.get(blob).map(|(e, _)| e)
    }

    /// Before opening `blob`: with `max` open already, closes the least recently used event
    /// that `in_use` does not name. A `max` of zero is taken as one.
    pub(super) fn make_room(
        &mut self,
        blob: &EventBlob,
        max: usize,
        in_use: impl Fn(EventHandle) -> bool,
    ) -> Room {
        if self.open.contains_key(blob) || self.open.len() < max.max(1) {
            return Room::Ready;
        }
        let oldest = self
            .open
            .iter()
            .filter(|(_, (e, _))| !in_use(e.handle()))
            .min_by_key(|(_, (_, used))| *used)
            .map(|(b, _)| *b);
        match oldest {
            Some(b) => {
                // Dropping it closes it (`OwnedEvent` records a failure, never panics).
                self.open.remove(&b);
                Room::Ready
            }
            None => Room::Full,
        }
    }

    /// Keeps `event`, opened for `blob`, as used now.
    pub(super) fn insert(&mut self, blob: EventBlob, event: OwnedEvent) -> EventHandle {
        self.tick += 1;
        let handle = event.handle();
        self.open.insert(blob, (event, self.tick));
        handle
    }

    /// How many are open.
    pub(super) fn len(&self) -> usize {
        self.open.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use poolipc_driver::sim::{SimConfig, SimDriver};
    use poolipc_driver::{Driver, EventHandle, OwnedEvent};
    use poolipc_types::EventBlob;

    use super::{DoneEvents, Room};

    fn driver() -> Arc<dyn Driver> {
        let d = SimDriver::new(SimConfig::default()).expect("SimDriver");
        d.use_device(0).expect("device 0");
        Arc::new(d)
    }

    fn blob(n: u8) -> EventBlob {
        EventBlob([n; 64])
    }

    /// Opens `n` in `events` as the loop does: room first, then the event.
    fn open(
        events: &mut DoneEvents,
        d: &Arc<dyn Driver>,
        n: u8,
        max: usize,
        held: &[EventHandle],
    ) -> Room {
        let room = events.make_room(&blob(n), max, |e| held.contains(&e));
        if room == Room::Ready && events.use_open(&blob(n)).is_none() {
            let e = OwnedEvent::new(Arc::clone(d), false).expect("event");
            events.insert(blob(n), e);
        }
        room
    }

    #[test]
    fn the_least_recently_used_event_is_closed_when_a_new_one_comes_at_the_bound() {
        let d = driver();
        let mut events = DoneEvents::default();
        for n in 1..=3 {
            assert_eq!(open(&mut events, &d, n, 3, &[]), Room::Ready);
        }
        // 1 used again: 2 is now the oldest.
        assert!(events.use_open(&blob(1)).is_some());
        assert_eq!(open(&mut events, &d, 4, 3, &[]), Room::Ready);
        assert_eq!(events.len(), 3);
        assert!(events.get(&blob(2)).is_none());
        for n in [1, 3, 4] {
            assert!(events.get(&blob(n)).is_some(), "event {n} was closed");
        }
    }

    #[test]
    fn an_event_a_held_job_waits_on_is_never_closed_and_all_held_is_full() {
        let d = driver();
        let mut events = DoneEvents::default();
        for n in 1..=2 {
            assert_eq!(open(&mut events, &d, n, 2, &[]), Room::Ready);
        }
        let first = events
            .get(&blob(1))
            .map(OwnedEvent::handle)
            .expect("1 open");
        assert!(events.get(&blob(2)).is_some(), "2 open");
        // 1 is the oldest but held: 2 goes.
        assert_eq!(open(&mut events, &d, 3, 2, &[first]), Room::Ready);
        assert!(events.get(&blob(1)).is_some());
        assert!(events.get(&blob(2)).is_none());
        let third = events
            .get(&blob(3))
            .map(OwnedEvent::handle)
            .expect("3 open");
        // Both held: nothing may go.
        assert_eq!(open(&mut events, &d, 4, 2, &[first, third]), Room::Full);
        assert_eq!(events.len(), 2);
        // A blob already open needs no room, held or not.
        assert_eq!(events.make_room(&blob(3), 2, |_| true), Room::Ready);
    }
}
