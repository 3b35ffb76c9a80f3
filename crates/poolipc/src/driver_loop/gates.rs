//! The jobs held for their DONE ([`DoneGate`]): a job whose worker acknowledged it while its
//! DONE had not completed on the GPU yet waits here, with the contract's later actions for
//! it, until the host sees the DONE complete. Reaped workers' opened DONE events stay here
//! while a held job of theirs waits on one. The part keeps the holds, their deadlines and
//! those events; the loop queries the events and carries out what a gate releases.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use poolipc_contract::ParentAction;
use poolipc_driver::EventHandle;
use poolipc_types::{JobId, WorkerId};

use super::DoneEvents;

/// How long a job whose worker was reaped with its DONE not complete yet still waits for it.
pub(super) const REAP_GRACE: Duration = Duration::from_secs(1);
/// While a job's DONE is queried on the host and the loop does not spin, how often to ask at
/// most and at least.
const GATE_POLL: Duration = Duration::from_millis(1);
const GATE_POLL_MIN: Duration = Duration::from_micros(20);

/// A job whose worker acknowledged it while its DONE had not completed on the GPU yet: the
/// loop never makes a stream of its own wait on a worker's event (a worker that hangs on the
/// GPU, or means to, would block that stream for good, beyond its death:
/// docs/facts.md). It queries the DONE on the host until it completed and holds the
/// contract's later actions for the job (its releases, its JobFinished) until then. At the
/// deadline the worker is condemned and the job fails; its memory is then released as a lost
/// worker's, once the process is reaped.
#[derive(Debug)]
pub(super) struct DoneGate {
    /// The worker's DONE events still to complete (owned by its slot's `done_events`, or,
    /// once the worker is reaped, by the gates' dead events).
    pub(super) events: Vec<EventHandle>,
    /// The contract's actions for the job after the first incomplete DONE, in order.
    pub(super) held: VecDeque<ParentAction>,
    pub(super) deadline: Instant,
    /// Set at the deadline: the job's error.
    pub(super) expired: Option<String>,
    /// When the job was first held.
    since: Instant,
    /// Set when the worker was reaped (why) before its DONE completed. A record the worker
    /// queued before it died may still complete as the driver tears its context down: the
    /// job waits for it until [`REAP_GRACE`] after the reaping, then fails.
    pub(super) lost: Option<String>,
}

/// The room's held jobs, by (worker, job), and its reaped workers' DONE events.
#[derive(Default)]
pub(super) struct Gates {
    held: BTreeMap<(WorkerId, JobId), DoneGate>,
    /// Reaped workers' opened DONE events, kept while a job of theirs waits on one.
    dead: HashMap<WorkerId, DoneEvents>,
}

impl Gates {
    /// Whether no job is held.
    pub(super) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Whether `key`'s job is held.
    pub(super) fn holds(&self, key: (WorkerId, JobId)) -> bool {
        self.held.contains_key(&key)
    }

    /// The held jobs, in order.
    pub(super) fn keys(&self) -> Vec<(WorkerId, JobId)> {
        self.held.keys().copied().collect()
    }

    pub(super) fn get_mut(&mut self, key: (WorkerId, JobId)) -> Option<&mut DoneGate> {
        self.held.get_mut(&key)
    }

    /// Lets `key`'s job go: its gate, whose held actions are the caller's to carry out.
    pub(super) fn remove(&mut self, key: (WorkerId, JobId)) -> Option<DoneGate> {
        self.held.remove(&key)
    }

    /// Holds `action` if its job (`key`) is held; gives it back to carry out now otherwise.
    pub(super) fn hold(
        &mut self,
        key: Option<(WorkerId, JobId)>,
        action: ParentAction,
    ) -> Option<ParentAction> {
        match key.and_then(|k| self.held.get_mut(&k)) {
            Some(gate) => {
                gate.held.push_back(action);
                None
            }
            None => Some(action),
        }
    }

    /// Whether a held job of `worker`'s waits on `event`.
    pub(super) fn waits_on(&self, worker: WorkerId, event: EventHandle) -> bool {
        self.held
            .iter()
            .any(|(k, g)| k.0 == worker && g.events.contains(&event))
    }

    /// `key`'s job waits on `event` too, held from `now` until `deadline` if it was not
    /// yet; whether it is newly held.
    pub(super) fn add(
        &mut self,
        key: (WorkerId, JobId),
        event: EventHandle,
        deadline: Instant,
        now: Instant,
    ) -> bool {
        let mut new = false;
        self.held
            .entry(key)
            .or_insert_with(|| {
                new = true;
                DoneGate {
                    events: Vec::new(),
                    held: VecDeque::new(),
                    deadline,
                    expired: None,
                    lost: None,
                    since: now,
                }
            })
            .events
            .push(event);
        new
    }

    /// How long the loop may sleep at `now` before it queries the held DONEs again: a
    /// quarter of the youngest job's wait so far, from 20 µs to 1 ms (a short wait costs
    /// little latency, a long one few wake-ups), and no longer than to a deadline.
    pub(super) fn next_look(&self, now: Instant) -> Option<Duration> {
        self.held
            .values()
            .map(|gate| {
                let left = gate.deadline.saturating_duration_since(now);
                let next =
                    (now.saturating_duration_since(gate.since) / 4).clamp(GATE_POLL_MIN, GATE_POLL);
                next.min(left)
            })
            .min()
    }

    /// Each held job's DONE events still to complete.
    pub(super) fn events(&self) -> Vec<Vec<EventHandle>> {
        self.held.values().map(|g| g.events.clone()).collect()
    }

    /// `worker` is being reaped at `now` (its `done_events` about to close) with jobs held
    /// for their DONE. Those past their deadline, or waiting on a DONE never opened (nothing
    /// can tell whether it completed), are returned, to fail now. The others wait on for
    /// [`REAP_GRACE`]: their held `WaitDone`s become events of the gate, and the worker's
    /// opened events move here so that they stay open meanwhile.
    pub(super) fn outlive(
        &mut self,
        worker: WorkerId,
        done_events: &mut DoneEvents,
        why: &str,
        now: Instant,
    ) -> Vec<((WorkerId, JobId), DoneGate)> {
        let keys: Vec<_> = self
            .held
            .keys()
            .filter(|k| k.0 == worker)
            .copied()
            .collect();
        let mut fail_now = Vec::new();
        let grace_end = now + REAP_GRACE;
        for key in keys {
            let Some(mut gate) = self.held.remove(&key) else {
                continue;
            };
            let mut known = gate.expired.is_none();
            let mut rest = VecDeque::with_capacity(gate.held.len());
            for action in gate.held.drain(..) {
                if let ParentAction::WaitDone { done_event, .. } = &action {
                    match done_events.get(done_event) {
                        Some(e) if !gate.events.contains(&e.handle()) => {
                            gate.events.push(e.handle());
                        }
                        Some(_) => {}
                        None => known = false,
                    }
                    continue;
                }
                rest.push_back(action);
            }
            gate.held = rest;
            if known {
                gate.lost = Some(why.to_owned());
                gate.deadline = gate.deadline.min(grace_end);
                self.held.insert(key, gate);
            } else {
                fail_now.push((key, gate));
            }
        }
        if self.held.keys().any(|k| k.0 == worker) {
            self.dead.insert(worker, std::mem::take(done_events));
        }
        fail_now
    }

    /// Closes the DONE events of reaped workers no held job waits on any more.
    pub(super) fn forget_dead(&mut self) {
        let held = &self.held;
        self.dead.retain(|w, _| held.keys().any(|k| k.0 == *w));
    }

    /// How many reaped workers' DONE events are open.
    pub(super) fn dead_open(&self) -> usize {
        self.dead.values().map(DoneEvents::len).sum()
    }

    /// Lets every job go and closes every reaped worker's event (the thread ends).
    pub(super) fn clear(&mut self) {
        self.held.clear();
        self.dead.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use poolipc_contract::ParentAction;
    use poolipc_driver::sim::{SimConfig, SimDriver};
    use poolipc_driver::{Driver, OwnedEvent};
    use poolipc_types::{EventBlob, HandoffId, JobId, WorkerId};

    use super::{DoneEvents, GATE_POLL, GATE_POLL_MIN, Gates, REAP_GRACE};

    const W: WorkerId = WorkerId(1);

    fn wait_done(job: u64, blob: EventBlob) -> ParentAction {
        ParentAction::WaitDone {
            worker: W,
            job: JobId(job),
            handoff: HandoffId(job),
            done_event: blob,
        }
    }

    fn driver() -> Arc<dyn Driver> {
        let d = SimDriver::new(SimConfig::default()).expect("SimDriver");
        d.use_device(0).expect("device 0");
        Arc::new(d)
    }

    /// `n` events of the simulated driver (kept open while the test holds them).
    fn events(d: &Arc<dyn Driver>, n: usize) -> Vec<OwnedEvent> {
        (0..n)
            .map(|_| OwnedEvent::new(Arc::clone(d), false).expect("event"))
            .collect()
    }

    #[test]
    fn an_action_of_a_held_job_waits_and_any_other_goes_now() {
        let d = driver();
        let e = events(&d, 2);
        let now = Instant::now();
        let mut g = Gates::default();
        let key = (W, JobId(1));
        assert!(g.add(key, e[0].handle(), now + Duration::from_secs(1), now));
        assert!(
            !g.add(key, e[1].handle(), now + Duration::from_secs(1), now),
            "held already"
        );
        assert!(g.waits_on(W, e[1].handle()) && !g.waits_on(WorkerId(2), e[1].handle()));
        assert!(g.holds(key) && !g.holds((W, JobId(2))));
        let a = wait_done(1, EventBlob([1; 64]));
        assert!(g.hold(Some(key), a).is_none(), "held");
        let b = wait_done(2, EventBlob([2; 64]));
        assert!(
            g.hold(Some((W, JobId(2))), b).is_some(),
            "job 2 is not held"
        );
        assert_eq!(g.events(), vec![vec![e[0].handle(), e[1].handle()]]);
        let gate = g.remove(key).expect("held");
        assert_eq!((gate.events.len(), gate.held.len()), (2, 1));
        assert!(g.is_empty());
    }

    #[test]
    fn the_next_look_grows_with_the_wait_and_stops_at_the_deadline() {
        let d = driver();
        let e = events(&d, 1);
        let now = Instant::now();
        let mut g = Gates::default();
        assert_eq!(g.next_look(now), None);
        g.add(
            (W, JobId(1)),
            e[0].handle(),
            now + Duration::from_secs(5),
            now,
        );
        assert_eq!(g.next_look(now), Some(GATE_POLL_MIN), "a young wait: soon");
        assert_eq!(
            g.next_look(now + Duration::from_secs(1)),
            Some(GATE_POLL),
            "an old one: at most 1 ms"
        );
        assert_eq!(
            g.next_look(now + Duration::from_micros(400)),
            Some(Duration::from_micros(100))
        );
        assert_eq!(
            g.next_look(now + Duration::from_secs(5)),
            Some(Duration::ZERO),
            "deadline"
        );
    }

    #[test]
    fn a_reaped_workers_held_job_waits_out_the_grace_on_its_opened_events() {
        let d = driver();
        let now = Instant::now();
        let (opened, unopened) = (EventBlob([1; 64]), EventBlob([2; 64]));
        let mut events = DoneEvents::default();
        let e = events.insert(
            opened,
            OwnedEvent::new(Arc::clone(&d), false).expect("event"),
        );
        let mut g = Gates::default();
        let far = now + Duration::from_secs(30);
        g.add((W, JobId(1)), e, far, now);
        g.hold(Some((W, JobId(1))), wait_done(1, opened));
        g.add((W, JobId(2)), e, far, now);
        g.hold(Some((W, JobId(2))), wait_done(2, unopened));
        let fail_now = g.outlive(W, &mut events, "killed", now);
        assert_eq!(fail_now.len(), 1, "job 2 waits on a DONE never opened");
        assert_eq!(fail_now[0].0, (W, JobId(2)));
        let gate = g.get_mut((W, JobId(1))).expect("job 1 waits on");
        assert_eq!(gate.deadline, now + REAP_GRACE);
        assert_eq!(gate.lost.as_deref(), Some("killed"));
        assert!(
            gate.held.is_empty(),
            "its WaitDone became an event of the gate"
        );
        assert_eq!(
            (events.len(), g.dead_open()),
            (0, 1),
            "the event moved to the gates"
        );
        g.forget_dead();
        assert_eq!(g.dead_open(), 1, "job 1 still waits on it");
        g.remove((W, JobId(1)));
        g.forget_dead();
        assert_eq!(g.dead_open(), 0, "closed once no job waits");
    }
}
