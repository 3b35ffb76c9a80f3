//! A receiver's releases, sent only once the GPU is done with the memory: a share released
//! while a kernel queued on this process's streams may still read it would let its sender
//! reuse the block under that kernel. Each release waits for an event recorded on the legacy
//! stream at release time, on a thread of its own, then goes to the sender.
//!
//! A small allocation's import lingers a little after its last mapping goes ([`LINGER`],
//! [`LINGER_MAX_BYTES`] in all): a sender that shares the same storage again soon (a loop
//! putting the same tensor, weights sent again) finds it mapped, and the receiver neither
//! imports it again nor frees it on its stream each time (freeing an import is GPU work the
//! next kernel on the legacy stream waits behind). While it lingers the share that mapped it
//! is not released, so the sender keeps the block (CUDA: the importer frees before the
//! exporter); a new share of the same allocation takes the import over, and the old share is
//! released then.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use poolipc::StreamHandle;
use poolipc::advanced::driver::Driver;
use poolipc::advanced::driver::OwnedEvent;

use super::receive::Import;
use super::wire::OP_RELEASE;
use super::{Peer, driver};
use crate::state::{OnDevice, lock};

/// How long an import with no mapping left stays mapped for a new share of it.
const LINGER: Duration = Duration::from_millis(20);
/// An allocation larger than this is not kept mapped, and the imports lingering at once
/// hold at most this much.
const LINGER_MAX_BYTES: u64 = 64 << 20;

/// The bytes of the imports lingering now.
static LINGERING: AtomicU64 = AtomicU64::new(0);

/// A release waiting for this process's work on the memory: the sender frees the block as
/// soon as it hears, and its next allocation may be written while a kernel queued here
/// still reads the old bytes.
struct Pending {
    ev: OwnedEvent<Arc<dyn Driver>>,
    driver: Arc<dyn Driver>,
    device: u32,
    /// The share to release (None: the mapping claimed none).
    share: Option<(Arc<Peer>, u64)>,
    /// The import kept mapped meanwhile, and until when once the event completed.
    lingering: Option<(Arc<Import>, Option<Instant>)>,
}

type PendingList = (u32, Vec<Pending>);
static PENDING: Mutex<Option<PendingList>> = Mutex::new(None);
static PENDING_WAKE: Condvar = Condvar::new();

fn send_release(peer: &Peer, id: u64) {
    if let Err(e) = peer.send(OP_RELEASE, id) {
        tracing::debug!(error = %e, "telling the sender of a release failed (it exited?)");
    }
}

/// Whether the import of an allocation of `bytes` may linger, counting it in if so.
fn may_linger(bytes: u64) -> bool {
    bytes <= LINGER_MAX_BYTES
        && LINGERING
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                n.checked_add(bytes).filter(|t| *t <= LINGER_MAX_BYTES)
            })
            .is_ok()
}

/// A mapping of `import` went: its share (if any) is released once the work this process
/// queued so far is done. The import goes first (CUDA: the importer frees before the
/// exporter): at once, or (a small allocation) after lingering for a new share of it.
pub(super) fn release_mapping(device: u32, import: Arc<Import>, share: Option<(Arc<Peer>, u64)>) {
    let linger = import.lingers() && may_linger(import.bytes);
    let lingering = if linger {
        Some((import, None))
    } else {
        // The last mapping of it frees it here, on the legacy stream, before the event.
        drop(import);
        None
    };
    if share.is_none() && lingering.is_none() {
        return;
    }
    defer(device, share, lingering);
}

/// Records an event on the legacy default stream (ordered after this process's work on the
/// blocking streams, torch's default stream among them) and sends the release once it has
/// completed, from a thread of its own. Where no event can be made, synchronizes instead.
fn defer(
    device: u32,
    share: Option<(Arc<Peer>, u64)>,
    lingering: Option<(Arc<Import>, Option<Instant>)>,
) {
    let now = |share: Option<(Arc<Peer>, u64)>,
               lingering: Option<(Arc<Import>, Option<Instant>)>| {
        if let Some((import, _)) = lingering {
            LINGERING.fetch_sub(import.bytes, Ordering::AcqRel);
            drop(import);
        }
        if let Ok(driver) = driver()
            && let Ok(_on) = OnDevice::push(&*driver, device)
        {
            let _ = driver.stream_synchronize(StreamHandle::NULL);
        }
        if let Some((peer, id)) = share {
            send_release(&peer, id);
        }
    };
    let Ok(driver) = driver() else {
        now(share, lingering);
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
            now(share, lingering);
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
            now(share, lingering);
            return;
        }
        *slot = Some((pid, Vec::new()));
    }
    if let Some((_, list)) = slot.as_mut() {
        list.push(Pending {
            ev,
            driver,
            device,
            share,
            lingering,
        });
    }
    PENDING_WAKE.notify_one();
}

/// What became of a pending release at one look.
enum Step {
    /// Still waiting (for the GPU, or lingering), until about then at the latest.
    Wait(Option<Instant>),
    /// Done: sent, or handed on.
    Done,
}

fn step(p: &mut Pending, now: Instant) -> Step {
    let done =
        OnDevice::push(&*p.driver, p.device).and_then(|_on| p.driver.event_query(p.ev.handle()));
    // A failed query (the context is gone) cannot be waited out: go on.
    if let Ok(false) = done {
        return Step::Wait(None);
    }
    if let Some((import, until)) = p.lingering.as_mut() {
        // Another mapping took the import over: its share keeps the block at the sender,
        // so this one's may go now, and the import stays with that mapping.
        let taken_over = Arc::strong_count(import) > 1;
        let until = *until.get_or_insert(now + LINGER);
        if !taken_over && now < until {
            return Step::Wait(Some(until));
        }
        if let Some((import, _)) = p.lingering.take() {
            LINGERING.fetch_sub(import.bytes, Ordering::AcqRel);
            let last = Arc::strong_count(&import) == 1;
            // The last mapping's import is freed here, on the legacy stream: the share goes
            // once that free is done, behind a new event.
            let on = OnDevice::push(&*p.driver, p.device);
            drop(import);
            if last && p.share.is_some() {
                let again =
                    on.and_then(|_on| p.driver.event_record(p.ev.handle(), StreamHandle::NULL));
                if again.is_ok() {
                    return Step::Wait(None);
                }
                if let Ok(_on) = OnDevice::push(&*p.driver, p.device) {
                    let _ = p.driver.stream_synchronize(StreamHandle::NULL);
                }
            }
        }
    }
    if let Some((peer, id)) = p.share.take() {
        send_release(&peer, id);
    }
    Step::Done
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
        let now = Instant::now();
        let mut left = Vec::new();
        // How long to sleep: 100 µs while an event is outstanding, else to the first
        // lingering import's end.
        let mut wake: Option<Instant> = None;
        for mut p in batch {
            match step(&mut p, now) {
                Step::Done => {
                    let driver = Arc::clone(&p.driver);
                    let on = OnDevice::push(&*driver, p.device);
                    drop(p);
                    drop(on);
                }
                Step::Wait(until) => {
                    let at = until.unwrap_or(now + Duration::from_micros(100));
                    wake = Some(wake.map_or(at, |w| w.min(at)));
                    left.push(p);
                }
            }
        }
        if let Some(wake) = wake {
            let mut slot = lock(&PENDING);
            if let Some((_, list)) = slot.as_mut() {
                left.append(list);
                *list = left;
            }
            // Woken early by a new release (it may take a lingering import over).
            let wait = wake.saturating_duration_since(Instant::now());
            if !wait.is_zero() {
                let _ = PENDING_WAKE
                    .wait_timeout(slot, wait)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
    }
}

/// How many releases wait for the GPU or linger (`torch_sharing.stats()`).
pub(super) fn pending_releases() -> usize {
    lock(&PENDING).as_ref().map_or(0, |(_, l)| l.len())
}
