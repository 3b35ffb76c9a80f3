//! Events: `cuEventCreate`/`Destroy`, their interprocess handles, records, queries and
//! synchronizes. A record captures the stream's clock, which a wait or a host synchronize
//! takes in (see [`hb`](crate::sim::hb)).

use std::time::Duration;

use crate::error::{CuCode, Result};
use crate::sim::blob::{BLOB_EVENT, blob_fields, export_blob};
use crate::sim::exec::Step;
use crate::sim::hb::host_learns;
use crate::sim::local::{Local, LocalEvent};
use crate::sim::shm::process_alive;
use crate::sim::state::{self, State};
use crate::sim::{SimDriver, fail, reap};
use crate::types::{EventBlob, EventHandle, StreamHandle};

/// `cuEventCreate`.
pub(super) fn create(d: &SimDriver, interprocess: bool) -> Result<EventHandle> {
    d.check_context("cuEventCreate")?;
    const CALL: &str = "cuEventCreate";
    let mut l = d.local();
    SimDriver::context(&l, CALL)?;
    let (slot, generation) = d
        .machine
        .with(|st| {
            st.event_create(interprocess, d.agent, d.pid).or_else(|| {
                reap(st);
                st.event_create(interprocess, d.agent, d.pid)
            })
        })
        .ok_or(fail(CALL, CuCode::OUT_OF_MEMORY))?;
    l.next_handle += 1;
    let h = l.next_handle;
    l.events.insert(
        h,
        LocalEvent {
            slot,
            generation,
            owner: true,
        },
    );
    Ok(EventHandle(h))
}

/// `cuIpcGetEventHandle` of an interprocess event.
pub(super) fn ipc_get_handle(d: &SimDriver, event: EventHandle) -> Result<EventBlob> {
    const CALL: &str = "cuIpcGetEventHandle";
    let l = d.local();
    d.machine.with(|st| {
        let ev = SimDriver::event(&l, st, CALL, event)?;
        if st.events[ev.slot].interprocess != 1 {
            // INVALID_HANDLE, as driver 580 answers (measured on the H200).
            return Err(fail(CALL, CuCode::INVALID_HANDLE));
        }
        Ok(EventBlob(export_blob([
            state::MAGIC,
            d.machine.id,
            BLOB_EVENT,
            ev.slot as u64,
            ev.generation,
            0,
            0,
            0,
        ])))
    })
}

/// `cuIpcOpenEventHandle`.
pub(super) fn ipc_open_handle(d: &SimDriver, handle: &EventBlob) -> Result<EventHandle> {
    const CALL: &str = "cuIpcOpenEventHandle";
    let [magic, machine, kind, slot, generation, ..] = blob_fields(&handle.0);
    if magic != state::MAGIC
        || machine != d.machine.id
        || kind != BLOB_EVENT
        || slot >= state::MAX_EVENTS as u64
    {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    let mut l = d.local();
    SimDriver::context(&l, CALL)?;
    let slot = slot as usize;
    d.machine.with(|st| {
        let e = &mut st.events[slot];
        if e.live != 1 || e.generation != generation || e.interprocess != 1 {
            return Err(fail(CALL, CuCode::INVALID_VALUE));
        }
        e.opens += 1;
        Ok(())
    })?;
    l.next_handle += 1;
    let h = l.next_handle;
    l.events.insert(
        h,
        LocalEvent {
            slot,
            generation,
            owner: false,
        },
    );
    Ok(EventHandle(h))
}

/// `cuEventRecord`: the event captures the stream's clock; it completes when the engine reaches
/// the record.
pub(super) fn record(d: &SimDriver, event: EventHandle, stream: StreamHandle) -> Result<()> {
    d.check_context("cuEventRecord")?;
    const CALL: &str = "cuEventRecord";
    let mut l = d.local();
    let l = &mut *l;
    let (s, seq, step) = d.machine.with(|st| {
        let slot = SimDriver::event(l, st, CALL, event)?.slot;
        let s = d.stream_slot(l, st, CALL, stream)?;
        let seq = st.tick(s);
        let clock = st.streams[s].clock;
        let e = &mut st.events[slot];
        e.clock = clock;
        e.records += 1;
        e.rec_pid = d.pid;
        let step = Step::Record {
            event: slot,
            generation: e.generation,
            n: e.records,
        };
        Ok((s, seq, step))
    })?;
    d.issue(s, seq, step);
    Ok(())
}

/// `cuEventQuery`: a query that says complete orders the host after the event.
pub(super) fn query(d: &SimDriver, event: EventHandle) -> Result<bool> {
    d.check_context("cuEventQuery")?;
    let mut l = d.local();
    d.machine.with(|st| {
        let slot = SimDriver::event(&l, st, "cuEventQuery", event)?.slot;
        let e = &st.events[slot];
        let done = e.completed >= e.records || !process_alive(e.rec_pid);
        if done {
            // A query that says complete orders the host after the event, as a
            // synchronize does.
            let clock = e.clock;
            host_learns(&mut l.host_clock, &mut st.observed, &clock);
        }
        Ok(done)
    })
}

/// `cuEventSynchronize`: waits until the record ran (in whichever process), then the host is
/// ordered after it.
pub(super) fn synchronize(d: &SimDriver, event: EventHandle) -> Result<()> {
    d.check_context("cuEventSynchronize")?;
    const CALL: &str = "cuEventSynchronize";
    let (slot, generation, n) = {
        let l = d.local();
        d.machine.with(|st| {
            let slot = SimDriver::event(&l, st, CALL, event)?.slot;
            let e = &st.events[slot];
            Ok((slot, e.generation, e.records))
        })?
    };
    // Another process's record runs on that process's engine: look until it has.
    let mut pause = Duration::from_micros(20);
    loop {
        let done = d.machine.with(|st| {
            let e = &st.events[slot];
            e.live == 0
                || e.generation != generation
                || e.completed >= n
                || !process_alive(e.rec_pid)
        });
        if done {
            break;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(2));
    }
    let mut l = d.local();
    let l = &mut *l;
    d.machine.with(|st| {
        let clock = st.events[slot].clock;
        host_learns(&mut l.host_clock, &mut st.observed, &clock);
        d.release_at_sync(l, st);
    });
    Ok(())
}

impl SimDriver {
    pub(super) fn event<'l>(
        l: &'l Local,
        st: &State,
        call: &'static str,
        e: EventHandle,
    ) -> Result<&'l LocalEvent> {
        match l.events.get(&e.0) {
            Some(ev)
                if st.events[ev.slot].live == 1
                    && st.events[ev.slot].generation == ev.generation =>
            {
                Ok(ev)
            }
            _ => Err(fail(call, CuCode::INVALID_HANDLE)),
        }
    }

    /// `event_destroy` of the trait, checked against the simulation's tables (so safe).
    pub(crate) fn event_destroy_checked(&self, event: EventHandle) -> Result<()> {
        const CALL: &str = "cuEventDestroy_v2";
        let mut l = self.local();
        let ev = l
            .events
            .remove(&event.0)
            .ok_or(fail(CALL, CuCode::INVALID_HANDLE))?;
        self.machine.with(|st| {
            let e = &mut st.events[ev.slot];
            if e.live != 1 || e.generation != ev.generation {
                return;
            }
            if ev.owner {
                e.owner_alive = 0;
            } else {
                e.opens = e.opens.saturating_sub(1);
            }
            if e.owner_alive == 0 && e.opens == 0 {
                e.live = 0;
            }
        });
        Ok(())
    }
}
