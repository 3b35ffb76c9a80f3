//! The room's workers as the loop holds them ([`Slot`]), with what outlives a worker's slot:
//! the exit statuses of workers being reaped (for their jobs' errors) and the worker last
//! suspected of a GPU fault (named when the context turns out lost).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::process::{Child, ExitStatus};
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::Instant;

use poolipc_contract::Message;
use poolipc_driver::OwnedEvent;
use poolipc_transport::Connection;
use poolipc_types::{EventBlob, WorkerId};

use super::answers::Standing;
use super::{DoneEvents, Submission, transfer};
use crate::error::Error;
use crate::staging::StagingChannel;

/// A worker as the loop holds it.
pub(super) struct Slot {
    /// `None` while a staging transfer's (or setup's) thread has it ([`Slot::away`]).
    pub(super) conn: Option<Connection>,
    /// A second descriptor of the connection's socket, which the IO thread polls while it
    /// waits without the loop (a caller's thread may hold the loop then, [`super::direct`]).
    pub(super) poll_fd: Option<Arc<OwnedFd>>,
    /// Set while a staging transfer runs on its own thread with the connection and `staging`,
    /// or the staging setup with the connection.
    pub(super) away: Option<transfer::Away>,
    /// What came for the worker while its transfer ran, carried out once it ends.
    pub(super) held: VecDeque<transfer::Held>,
    pub(super) child: Option<Child>,
    /// READY events not in use by a job (a job takes one and gives it back when it ends: a
    /// worker's wait captures an event's latest record, so two jobs in flight never share one).
    pub(super) ready_free: Vec<(OwnedEvent, EventBlob)>,
    /// The worker's DONE events, opened once each, at most
    /// `options.max_open_done_events` (least recently used closed first).
    pub(super) done_events: DoneEvents,
    pub(super) staging: Option<StagingChannel>,
    /// Why setting host staging up with the worker failed, once it did: a result that needs
    /// it is refused instead of setting it up again.
    pub(super) staging_failed: Option<String>,
    /// Frames that arrived while the loop waited for another (host staging's): handled next.
    pub(super) backlog: VecDeque<Message>,
    pub(super) takes_staging: bool,
    /// Whether it maps its arena (results in the arena, inputs copied into it): an arena is
    /// enabled ([`ResultMemory::Arena`](crate::ResultMemory::Arena) or [`ParentOptions::arena_copy`]), it
    /// announced VMM, reaches the parent's device, and every chunk of its arena announced so
    /// far went out.
    ///
    /// [`ParentOptions::arena_copy`]: crate::ParentOptions::arena_copy
    pub(super) maps_arena: bool,
    /// One past the highest chunk index of its arena sent to it: every chunk of its arena
    /// below was sent (or released before it could be). It is sent no other arena's chunk.
    pub(super) arena_chunks_sent: u32,
    /// Whether it takes VMM allocations by handle ([`Rung::VmmHandle`](poolipc_types::Rung::VmmHandle)): it announced
    /// [`Capabilities::VMM_HANDLE`](poolipc_transport::Capabilities::VMM_HANDLE) and reaches the parent's device.
    pub(super) takes_vmm: bool,
    /// Set when the worker is being stopped: when to kill it if it has not exited.
    pub(super) exit_deadline: Option<Instant>,
    pub(super) stop_replies: Vec<Sender<Result<Option<ExitStatus>, Error>>>,
    /// Jobs waiting for this worker (staged jobs run alone on their worker).
    pub(super) queued: VecDeque<Box<Submission>>,
    /// Jobs sent to it and not finished.
    pub(super) in_flight: usize,
    /// Whether one of the jobs in flight takes host staging.
    pub(super) staged_in_flight: bool,
    /// Why it was lost, for the jobs that fail with it.
    pub(super) lost: Option<String>,
}

impl Slot {
    /// A worker that just shook hands, holding nothing yet.
    pub(super) fn new(
        conn: Option<Connection>,
        poll_fd: Option<Arc<OwnedFd>>,
        child: Option<Child>,
        takes_staging: bool,
        maps_arena: bool,
        takes_vmm: bool,
    ) -> Slot {
        Slot {
            conn,
            poll_fd,
            away: None,
            held: VecDeque::new(),
            child,
            ready_free: Vec::new(),
            done_events: DoneEvents::default(),
            staging: None,
            staging_failed: None,
            backlog: VecDeque::new(),
            takes_staging,
            maps_arena,
            arena_chunks_sent: 0,
            takes_vmm,
            exit_deadline: None,
            stop_replies: Vec::new(),
            queued: VecDeque::new(),
            in_flight: 0,
            staged_in_flight: false,
            lost: None,
        }
    }
}

/// The room's workers, by id, and what the loop remembers of those it reaps.
#[derive(Default)]
pub(super) struct Roster {
    slots: BTreeMap<WorkerId, Slot>,
    /// Exit statuses of workers being reaped, for the errors of their jobs.
    reaped: HashMap<WorkerId, String>,
    /// The last worker that failed or reported an error, and what it said: named when the
    /// process's context turns out lost (under MPS, a worker's GPU fault ends it).
    suspect: Option<(WorkerId, String)>,
}

impl Roster {
    pub(super) fn get(&self, id: &WorkerId) -> Option<&Slot> {
        self.slots.get(id)
    }

    pub(super) fn get_mut(&mut self, id: &WorkerId) -> Option<&mut Slot> {
        self.slots.get_mut(id)
    }

    pub(super) fn contains_key(&self, id: &WorkerId) -> bool {
        self.slots.contains_key(id)
    }

    pub(super) fn insert(&mut self, id: WorkerId, slot: Slot) {
        self.slots.insert(id, slot);
    }

    pub(super) fn remove(&mut self, id: &WorkerId) -> Option<Slot> {
        self.slots.remove(id)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &WorkerId> {
        self.slots.keys()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Slot> {
        self.slots.values()
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut Slot> {
        self.slots.values_mut()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&WorkerId, &Slot)> {
        self.slots.iter()
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = (&WorkerId, &mut Slot)> {
        self.slots.iter_mut()
    }

    /// Where `worker` stands for an answer awaited from it.
    pub(super) fn standing(&self, worker: WorkerId) -> Standing {
        match self.slots.get(&worker) {
            Some(s) if s.lost.is_none() && s.in_flight > 0 => Standing::Busy,
            Some(s) if s.lost.is_none() => Standing::Idle,
            _ => Standing::Gone,
        }
    }

    /// Whether a worker is being stopped (the loop looks at its exit often).
    pub(super) fn exiting(&self) -> bool {
        self.slots.values().any(|s| s.exit_deadline.is_some())
    }

    /// `worker` was reaped with exit status `status` (its jobs' errors name it until
    /// [`forget_reaped`](Roster::forget_reaped)).
    pub(super) fn reaped(&mut self, worker: WorkerId, status: String) {
        self.reaped.insert(worker, status);
    }

    /// The exit status of `worker`, being reaped; empty if it is not.
    pub(super) fn reaped_status(&self, worker: WorkerId) -> String {
        self.reaped.get(&worker).cloned().unwrap_or_default()
    }

    /// `worker`'s reaping is over.
    pub(super) fn forget_reaped(&mut self, worker: WorkerId) {
        self.reaped.remove(&worker);
    }

    /// `worker` failed or reported an error, saying `why`: the one to name should the
    /// context turn out lost.
    pub(super) fn suspect(&mut self, worker: WorkerId, why: String) {
        self.suspect = Some((worker, why));
    }

    /// Who to name when the context is found lost: the last suspect, else the workers with
    /// jobs on the GPU; a sentence to append, empty if there is no one.
    pub(super) fn suspects(&self) -> String {
        if let Some((w, said)) = &self.suspect {
            return format!(" The worker most likely at fault: {w} ({said}).");
        }
        let busy: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, s)| s.in_flight > 0)
            .map(|(w, _)| w.to_string())
            .collect();
        if busy.is_empty() {
            String::new()
        } else {
            format!(" Workers with jobs on the GPU then: {}.", busy.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Roster, Slot, Standing};
    use poolipc_types::WorkerId;
    use std::time::Instant;

    const W1: WorkerId = WorkerId(1);
    const W2: WorkerId = WorkerId(2);

    fn roster() -> Roster {
        let mut r = Roster::default();
        r.insert(W1, Slot::new(None, None, None, true, false, false));
        r.insert(W2, Slot::new(None, None, None, false, true, true));
        r
    }

    #[test]
    fn a_worker_stands_busy_in_a_job_idle_between_and_gone_once_lost_or_reaped() {
        let mut r = roster();
        assert_eq!(r.standing(W1), Standing::Idle);
        r.get_mut(&W1).expect("W1").in_flight = 1;
        assert_eq!(r.standing(W1), Standing::Busy);
        r.get_mut(&W1).expect("W1").lost = Some("hung up".into());
        assert_eq!(r.standing(W1), Standing::Gone, "lost, even with a job");
        r.remove(&W2);
        assert_eq!(r.standing(W2), Standing::Gone);
        assert_eq!(r.standing(WorkerId(9)), Standing::Gone, "never known");
    }

    #[test]
    fn a_new_slot_holds_nothing_and_says_what_the_worker_takes() {
        let r = roster();
        let (s1, s2) = (r.get(&W1).expect("W1"), r.get(&W2).expect("W2"));
        assert!(s1.takes_staging && !s1.maps_arena && !s1.takes_vmm);
        assert!(!s2.takes_staging && s2.maps_arena && s2.takes_vmm);
        assert!(s1.queued.is_empty() && s1.in_flight == 0 && s1.lost.is_none());
        assert!(!s1.holds(), "no transfer away, nothing held");
        assert!(!r.exiting());
        assert_eq!(
            r.keys().copied().collect::<Vec<_>>(),
            vec![W1, W2],
            "in id order"
        );
    }

    #[test]
    fn a_stop_makes_the_roster_exiting() {
        let mut r = roster();
        r.get_mut(&W2).expect("W2").exit_deadline = Some(Instant::now());
        assert!(r.exiting());
    }

    #[test]
    fn a_reaped_workers_status_is_kept_until_its_reaping_ends() {
        let mut r = roster();
        assert_eq!(r.reaped_status(W1), "");
        r.reaped(W1, "exit status: 9".into());
        assert_eq!(r.reaped_status(W1), "exit status: 9");
        r.forget_reaped(W1);
        assert_eq!(r.reaped_status(W1), "");
    }

    #[test]
    fn the_suspect_named_is_the_last_that_failed_else_the_busy_workers() {
        let mut r = roster();
        assert_eq!(r.suspects(), "", "no one to name");
        r.get_mut(&W2).expect("W2").in_flight = 2;
        assert_eq!(
            r.suspects(),
            " Workers with jobs on the GPU then: WorkerId#2."
        );
        r.suspect(W1, "it reported: boom".into());
        assert_eq!(
            r.suspects(),
            " The worker most likely at fault: WorkerId#1 (it reported: boom)."
        );
    }
}
