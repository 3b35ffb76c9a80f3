//! What every view of a job shares ([`JobLife`]): whether the job is open, its live DLPack
//! exports, the consumer streams DONE must come after. Below the job and its views, which
//! both hold it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::thread::{Cmd, Link};
use crate::dlpack;

/// What every view of a job shares: whether the job is still open, how many DLPack tensors
/// made from its views are alive, and the consumer streams DONE must come after.
pub(crate) struct JobLife {
    pub(super) id: u64,
    pub(super) open: AtomicBool,
    pub(crate) live_exports: AtomicUsize,
    pub(super) consumer_streams: Mutex<Vec<u64>>,
    /// Set by `Job.lease()`: the job ends when the last export (or lease hold) is dropped.
    pub(super) release_on_drop: AtomicBool,
    pub(super) link: Arc<Link>,
    pub(super) job_stream: u64,
}

impl JobLife {
    /// One export (a DLPack tensor, or a lease's hold) is gone. The last one of a leased job
    /// ends it: DONE after every consumer stream, imports freed, ACK, posted to the worker
    /// thread without waiting (this runs in a DLPack deleter, on whatever thread frees the
    /// tensor, with or without the GIL).
    pub(crate) fn export_released(&self) {
        let before = self.live_exports.fetch_sub(1, Ordering::AcqRel);
        if before == 1 && self.release_on_drop.load(Ordering::Acquire) {
            self.end_posted();
        }
    }

    /// Ends the job from any thread, without waiting for the worker thread: once.
    fn end_posted(&self) {
        if !self.open.swap(false, Ordering::AcqRel) {
            return;
        }
        let streams = std::mem::take(
            &mut *self
                .consumer_streams
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for s in streams {
            self.link.post(Cmd::StreamWait {
                waiter: crate::dlpack::python_stream(self.job_stream),
                on: crate::dlpack::python_stream(s),
            });
        }
        self.link.post(Cmd::Finish(self.id));
    }
}

impl dlpack::Kept for JobLife {
    fn acquire(&self) {
        self.live_exports.fetch_add(1, Ordering::AcqRel);
    }

    fn release(self: Arc<Self>) {
        self.export_released();
    }

    fn names(&self) -> (&'static str, &'static str) {
        ("views", "the view")
    }
}
