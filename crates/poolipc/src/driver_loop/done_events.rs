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
