//! Streams and the context: `cuStreamCreate`/`Destroy`, waits on events, synchronizes, and the
//! check of a stream handle from outside.

use crate::error::{CuCode, Result};
use crate::sim::exec::Step;
use crate::sim::hb::{host_learns, merge};
use crate::sim::local::Local;
use crate::sim::state::State;
use crate::sim::{SimDriver, fail, reap};
use crate::types::{EventHandle, StreamHandle};

/// `cuStreamWaitEvent`: the stream takes in the event's clock and waits for its record.
pub(super) fn wait_event(d: &SimDriver, stream: StreamHandle, event: EventHandle) -> Result<()> {
    d.check_context("cuStreamWaitEvent")?;
    const CALL: &str = "cuStreamWaitEvent";
    let mut l = d.local();
    let l = &mut *l;
    let wait = d.machine.with(|st| {
        let slot = SimDriver::event(l, st, CALL, event)?.slot;
        let s = d.stream_slot(l, st, CALL, stream)?;
        let clock = st.events[slot].clock;
        merge(&mut st.streams[s].clock, &clock);
        let e = &st.events[slot];
        // Waiting on an event never recorded waits for nothing, as on hardware.
        let step = (e.records > 0).then_some(Step::Wait {
            event: slot,
            generation: e.generation,
            n: e.records,
        });
        Ok(step.map(|step| (s, st.tick(s), step)))
    })?;
    if let Some((s, seq, step)) = wait {
        d.issue(s, seq, step);
    }
    Ok(())
}

/// `cuStreamCreate`.
pub(super) fn create(d: &SimDriver) -> Result<StreamHandle> {
    d.check_context("cuStreamCreate")?;
    const CALL: &str = "cuStreamCreate";
    let mut l = d.local();
    SimDriver::context(&l, CALL)?;
    let slot = d
        .machine
        .with(|st| {
            st.stream_create(d.agent, d.pid).or_else(|| {
                reap(st);
                st.stream_create(d.agent, d.pid)
            })
        })
        .ok_or(fail(CALL, CuCode::OUT_OF_MEMORY))?;
    l.next_handle += 1;
    let h = l.next_handle;
    l.streams.insert(h, slot);
    Ok(StreamHandle(h))
}

/// `cuCtxSynchronize`: waits for every stream this process issued to.
pub(super) fn ctx_synchronize(d: &SimDriver) -> Result<()> {
    d.check_context("cuCtxSynchronize")?;
    // Every stream this process issued to, up to its last operation.
    let lasts: Vec<(usize, u64)> = {
        let l = d.local();
        let mut slots: Vec<usize> = l.streams.values().copied().collect();
        slots.extend(l.null_stream);
        d.machine
            .with(|st| slots.iter().map(|&s| (s, st.streams[s].clock[s])).collect())
    };
    for &(s, last) in &lasts {
        d.engine.wait_executed(s, last);
    }
    let mut l = d.local();
    let l = &mut *l;
    d.machine.with(|st| {
        for &(s, _) in &lasts {
            let clock = st.streams[s].clock;
            host_learns(&mut l.host_clock, &mut st.observed, &clock);
        }
        d.release_at_sync(l, st);
    });
    Ok(())
}

/// Whether `stream` is a stream of this process (the null stream or one it made).
pub(super) fn check(d: &SimDriver, stream: StreamHandle) -> Result<()> {
    // The simulation's default stream is 0; 1 and 2 (CU_STREAM_LEGACY,
    // CU_STREAM_PER_THREAD) are not its handles (callers map them to 0).
    if stream == StreamHandle::NULL || d.local().streams.contains_key(&stream.0) {
        Ok(())
    } else {
        Err(fail("cuStreamQuery", CuCode::INVALID_HANDLE))
    }
}

/// `cuStreamQuery`: whether everything issued to the stream ran; a stream that did orders
/// the host after its work, as a synchronize does (without the synchronize's pool release).
pub(super) fn query(d: &SimDriver, stream: StreamHandle) -> Result<bool> {
    d.check_context("cuStreamQuery")?;
    let (s, last) = last_issued(d, "cuStreamQuery", stream)?;
    if !d.engine.executed(s, last) {
        return Ok(false);
    }
    host_learns_stream(d, s, false);
    Ok(true)
}

/// `cuStreamSynchronize`.
pub(super) fn synchronize(d: &SimDriver, stream: StreamHandle) -> Result<()> {
    d.check_context("cuStreamSynchronize")?;
    let (s, last) = last_issued(d, "cuStreamSynchronize", stream)?;
    d.engine.wait_executed(s, last);
    host_learns_stream(d, s, true);
    Ok(())
}

/// The machine slot of `stream` and the sequence number of the last operation issued to it.
fn last_issued(d: &SimDriver, call: &'static str, stream: StreamHandle) -> Result<(usize, u64)> {
    let mut l = d.local();
    let l = &mut *l;
    d.machine.with(|st| {
        let s = d.stream_slot(l, st, call, stream)?;
        Ok((s, st.streams[s].clock[s]))
    })
}

/// The host, having seen stream slot `s` run everything issued to it, is ordered after it;
/// with `release`, the pools give back what a synchronize releases.
fn host_learns_stream(d: &SimDriver, s: usize, release: bool) {
    let mut l = d.local();
    let l = &mut *l;
    d.machine.with(|st| {
        let clock = st.streams[s].clock;
        host_learns(&mut l.host_clock, &mut st.observed, &clock);
        if release {
            d.release_at_sync(l, st);
        }
    });
}

impl SimDriver {
    /// The machine stream slot for a stream handle; the host's knowledge flows into it first
    /// (work issued after a host synchronize is ordered after what it waited for).
    pub(in crate::sim) fn stream_slot(
        &self,
        l: &mut Local,
        st: &mut State,
        call: &'static str,
        s: StreamHandle,
    ) -> Result<usize> {
        let slot = if s == StreamHandle::NULL {
            match l.null_stream {
                Some(x) if st.streams[x].live == 1 && st.streams[x].agent == self.agent => x,
                _ => {
                    let x = st
                        .stream_create(self.agent, self.pid)
                        .or_else(|| {
                            reap(st);
                            st.stream_create(self.agent, self.pid)
                        })
                        .ok_or(fail(call, CuCode::OUT_OF_MEMORY))?;
                    st.streams[x].label = crate::sim::state::label("its legacy stream");
                    l.null_stream = Some(x);
                    x
                }
            }
        } else {
            *l.streams
                .get(&s.0)
                .ok_or(fail(call, CuCode::INVALID_HANDLE))?
        };
        merge(&mut st.streams[slot].clock, &l.host_clock);
        Ok(slot)
    }

    /// `stream_destroy` of the trait, checked against the simulation's tables (so safe).
    pub(crate) fn stream_destroy_checked(&self, stream: StreamHandle) -> Result<()> {
        const CALL: &str = "cuStreamDestroy_v2";
        let slot = self
            .local()
            .streams
            .remove(&stream.0)
            .ok_or(fail(CALL, CuCode::INVALID_HANDLE))?;
        self.machine.with(|st| st.streams[slot].live = 0);
        Ok(())
    }
}
