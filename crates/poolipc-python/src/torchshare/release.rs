//! A receiver's releases, sent only once the GPU is done with the memory: a share released
//! while a kernel queued on this process's streams may still read it would let its sender
//! reuse the block under that kernel. Each release waits for an event recorded on the legacy
//! stream at release time, on a thread of its own, then goes to the sender.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use poolipc::StreamHandle;
use poolipc::advanced::driver::Driver;
use poolipc::advanced::driver::OwnedEvent;

use super::wire::OP_RELEASE;
use super::{Peer, driver};
use crate::state::{OnDevice, lock};

/// A release waiting for this process's work on the memory: the sender frees the block as
/// soon as it hears, and its next allocation may be written while a kernel queued here
/// still reads the old bytes.
struct Pending {
    ev: OwnedEvent<Arc<dyn Driver>>,
    driver: Arc<dyn Driver>,
    device: u32,
    peer: Arc<Peer>,
    id: u64,
}

type PendingList = (u32, Vec<Pending>);
static PENDING: Mutex<Option<PendingList>> = Mutex::new(None);
static PENDING_WAKE: Condvar = Condvar::new();

fn send_release(peer: &Peer, id: u64) {
    if let Err(e) = peer.send(OP_RELEASE, id) {
        tracing::debug!(error = %e, "telling the sender of a release failed (it exited?)");
    }
}

/// Records an event on the legacy default stream (ordered after this process's work on the
/// blocking streams, torch's default stream among them) and sends the release once it has
/// completed, from a thread of its own. Where no event can be made, synchronizes instead.
pub(super) fn defer_release(device: u32, peer: Arc<Peer>, id: u64) {
    let Ok(driver) = driver() else {
        send_release(&peer, id);
        return;
    };
    let recorded = OnDevice::push(&*driver, device).and_then(|_on| {
        let ev = OwnedEvent::new(Arc::clone(&driver), false)?;
        driver.event_record(ev.handle(), StreamHandle::NULL)?;
        Ok(ev)
    });
    let ev = match recorded {
        Ok(ev) => ev,
        Err(e) => {
            tracing::debug!(error = %e, "no event for a release: synchronizing instead");
            if let Ok(_on) = OnDevice::push(&*driver, device) {
                let _ = driver.stream_synchronize(StreamHandle::NULL);
            }
            send_release(&peer, id);
            return;
        }
    };
    let pid = std::process::id();
    let mut slot = lock(&PENDING);
    if slot.as_ref().is_none_or(|(p, _)| *p != pid) {
        let started = std::thread::Builder::new()
            .name("poolipc-release".into())
            .spawn(release_loop);
        if let Err(e) = started {
            drop(slot);
            tracing::warn!(error = %e, "no release thread: synchronizing instead");
            if let Ok(_on) = OnDevice::push(&*driver, device) {
                let _ = driver.stream_synchronize(StreamHandle::NULL);
            }
            send_release(&peer, id);
            return;
        }
        *slot = Some((pid, Vec::new()));
    }
    if let Some((_, list)) = slot.as_mut() {
        list.push(Pending {
            ev,
            driver,
            device,
            peer,
            id,
        });
    }
    PENDING_WAKE.notify_one();
}

fn release_loop() {
    loop {
        let batch = {
            let mut slot = lock(&PENDING);
            loop {
                match slot.as_mut() {
                    Some((_, list)) if !list.is_empty() => break std::mem::take(list),
                    _ => {
                        slot = PENDING_WAKE
                            .wait(slot)
                            .unwrap_or_else(PoisonError::into_inner);
                    }
                }
            }
        };
        let mut left = Vec::new();
        for p in batch {
            let done = OnDevice::push(&*p.driver, p.device)
                .and_then(|_on| p.driver.event_query(p.ev.handle()));
            match done {
                // A failed query (the context is gone) cannot be waited out: release.
                Ok(true) | Err(_) => {
                    send_release(&p.peer, p.id);
                    let driver = Arc::clone(&p.driver);
                    let on = OnDevice::push(&*driver, p.device);
                    drop(p);
                    drop(on);
                }
                Ok(false) => left.push(p),
            }
        }
        if !left.is_empty() {
            if let Some((_, list)) = lock(&PENDING).as_mut() {
                left.append(list);
                *list = left;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// How many releases wait for the GPU (`torch_sharing.stats()`).
pub(super) fn pending_releases() -> usize {
    lock(&PENDING).as_ref().map_or(0, |(_, l)| l.len())
}
