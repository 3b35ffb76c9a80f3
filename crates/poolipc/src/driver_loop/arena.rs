//! The result arena on the IO thread: chunks grown and announced to the workers, idle ones
//! released (asking each worker to unmap first), and the answers awaited.

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use poolipc_contract::Message;
use poolipc_driver::Driver;
use poolipc_pool::Arena;
use poolipc_transport::{ArenaChunk, ArenaRelease};
use poolipc_types::WorkerId;

use super::{IDLE_RELEASE_CHECK, Loop, MAPPINGS_ACK, ReleaseWaiter};
use crate::error::Error;
use crate::parent::{EmptyCache, ResultMemory, lock};

impl Loop {
    /// The arena, created on this thread (the device is current here) at its first use:
    /// with the [`ResultMemory::Arena`] sizes, or (arena copies only) one chunk of
    /// `first_bytes` and no cap.
    pub(super) fn ensure_arena(&self, first_bytes: u64) -> Result<Arc<Arena<dyn Driver>>, Error> {
        let mut slot = lock(&self.shared.arena);
        if let Some(a) = slot.as_ref() {
            return Ok(Arc::clone(a));
        }
        let (initial_bytes, max_bytes) = match self.shared.options.results {
            ResultMemory::Arena {
                initial_bytes,
                max_bytes,
            } => (initial_bytes, max_bytes),
            ResultMemory::Pool if self.shared.options.arena_copy => (first_bytes, None),
            ResultMemory::Pool => {
                return Err(Error::Config("the arena is not enabled".into()));
            }
        };
        // No cap given: a fraction of the device (ParentOptions::arena_cap_fraction).
        let max_bytes = match max_bytes {
            Some(m) => Some(m),
            None => {
                let (_, total) = self.shared.driver.mem_get_info()?;
                #[allow(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    clippy::cast_precision_loss
                )]
                let cap = (total as f64 * self.shared.options.arena_cap_fraction) as u64;
                Some(cap)
            }
        };
        let arena = Arc::new(Arena::with_max_bytes(
            Arc::clone(&self.shared.driver),
            self.shared.options.device,
            initial_bytes,
            max_bytes,
        )?);
        tracing::info!(
            device = self.shared.options.device,
            bytes = arena.capacity(),
            ?max_bytes,
            "result arena created"
        );
        *slot = Some(Arc::clone(&arena));
        Ok(arena)
    }

    /// Sends every arena chunk a worker that takes arena results has not been sent yet, in
    /// index order, one `ArenaChunk` (with the chunk's FD) each. A worker a chunk cannot be
    /// sent to takes no more arena results (a failed send loses it, as any send does).
    ///
    /// A worker with a host-staged job in flight is skipped unless it is `target` (whose
    /// result is being allocated: it waits for its grant, not inside a transfer): a frame
    /// with an FD cannot wait in a staging transfer's backlog. It catches up when that job
    /// finishes, and always before a grant names the chunk.
    pub(super) fn announce_chunks(&mut self, target: Option<WorkerId>) {
        let Some(arena) = lock(&self.shared.arena).clone() else {
            return;
        };
        let chunks: Vec<_> = arena.chunks().collect();
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(id, s)| {
                s.maps_arena
                    && s.lost.is_none()
                    && (!s.staged_in_flight || target == Some(**id))
                    && chunks.iter().any(|c| c.index >= s.arena_chunks_sent)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let Some(slot) = self.workers.get_mut(&id) else {
                continue;
            };
            // Chunk indices only grow (a released one is never listed or used again).
            let from = slot.arena_chunks_sent;
            for c in chunks.iter().filter(|c| c.index >= from) {
                let fd = match arena.export_fd(c.index) {
                    Ok(fd) => fd,
                    Err(e) => {
                        tracing::warn!(worker = %id, chunk = c.index, error = %e, "exporting an arena chunk failed: the worker's results go to the pool");
                        slot.maps_arena = false;
                        break;
                    }
                };
                let message = Message::ArenaChunk(ArenaChunk {
                    index: c.index,
                    len: c.len,
                });
                if let Err(e) = slot.conn.enqueue(&message, &[fd.as_fd()]) {
                    slot.maps_arena = false;
                    self.lose(id, &format!("sending arena chunk {} failed: {e}", c.index));
                    break;
                }
                tracing::debug!(worker = %id, chunk = c.index, len = c.len, "arena chunk sent");
                slot.arena_chunks_sent = c.index + 1;
            }
        }
    }

    /// Gives back arena chunks idle for [`ParentOptions::arena_idle_release`], looking at
    /// most once per [`IDLE_RELEASE_CHECK`].
    ///
    /// [`ParentOptions::arena_idle_release`]: crate::ParentOptions::arena_idle_release
    pub(super) fn release_idle_arena(&mut self) {
        let Some(idle) = self.shared.options.arena_idle_release else {
            return;
        };
        let now = Instant::now();
        if now.saturating_duration_since(self.last_idle_check) < IDLE_RELEASE_CHECK {
            return;
        }
        self.last_idle_check = now;
        let Some(arena) = lock(&self.shared.arena).clone() else {
            return;
        };
        let released = arena.release_idle(now, idle, 0);
        if !released.is_empty() {
            self.tell_released(&released);
        }
    }

    /// `empty_cache`: every idle chunk now; the reply waits for the workers' answers.
    pub(super) fn release_arena_now(&mut self, reply: Sender<EmptyCache>) {
        let mut report = EmptyCache::default();
        let released = match lock(&self.shared.arena).clone() {
            Some(arena) => arena.release_idle(Instant::now(), Duration::ZERO, 0),
            None => Vec::new(),
        };
        report.arena_chunks = released.len() as u64;
        report.arena_bytes = released.iter().map(|c| c.len).sum();
        let mut awaited = self.tell_released(&released);
        // Workers drop the VMM mappings they cache (each keeps the memory behind it alive).
        let holders: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(id, s)| {
                s.lost.is_none() && self.vmm_shared.values().any(|e| e.sent_to.contains(id))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in holders {
            self.forget_vmm_shares(id);
            if self.send_awaiting(id, &Message::ReleaseMappings, MAPPINGS_ACK, &mut awaited) {
                report.vmm_workers += 1;
            }
        }
        self.wait_for_answers(reply, report, awaited);
    }

    /// Sends `message` to `worker` and, if the worker is still there after, awaits its
    /// answer under `key` ([`await_answer`](Loop::await_answer)). Returns whether it does.
    pub(super) fn send_awaiting(
        &mut self,
        worker: WorkerId,
        message: &Message,
        key: u32,
        awaited: &mut HashSet<(WorkerId, u32)>,
    ) -> bool {
        self.send(worker, message);
        self.await_answer(worker, key, awaited)
    }

    /// Records that `worker`'s answer under `key` is awaited (in `awaited`, for one
    /// `empty_cache`, and in the loop's set, which `received` clears). A worker lost meanwhile
    /// never answers and is not waited for: `false`.
    pub(super) fn await_answer(
        &mut self,
        worker: WorkerId,
        key: u32,
        awaited: &mut HashSet<(WorkerId, u32)>,
    ) -> bool {
        if self.workers.get(&worker).is_none_or(|s| s.lost.is_some()) {
            return false;
        }
        awaited.insert((worker, key));
        self.release_acks.insert((worker, key));
        true
    }

    /// Replies `report` to an `empty_cache` once the `awaited` answers came (or as
    /// [`answer_release_waiters`](Loop::answer_release_waiters) decides otherwise).
    pub(super) fn wait_for_answers(
        &mut self,
        reply: Sender<EmptyCache>,
        report: EmptyCache,
        awaited: HashSet<(WorkerId, u32)>,
    ) {
        self.release_waiters.push(ReleaseWaiter {
            reply,
            report,
            awaited,
            deadline: Instant::now() + crate::parent::EMPTY_CACHE_WAIT,
        });
        self.answer_release_waiters();
    }

    /// Tells every worker that was sent one of `chunks` to unmap it; returns the answers
    /// now awaited. A worker lost meanwhile never answers and is not waited for.
    pub(super) fn tell_released(
        &mut self,
        chunks: &[poolipc_pool::arena::ChunkInfo],
    ) -> HashSet<(WorkerId, u32)> {
        let mut awaited = HashSet::new();
        let ids: Vec<WorkerId> = self.workers.keys().copied().collect();
        for id in ids {
            for c in chunks {
                let sent = self
                    .workers
                    .get(&id)
                    .is_some_and(|s| s.lost.is_none() && s.arena_chunks_sent > c.index);
                if !sent {
                    continue;
                }
                let message = Message::ArenaRelease(ArenaRelease { index: c.index });
                self.send_awaiting(id, &message, c.index, &mut awaited);
            }
        }
        awaited
    }

    /// Replies to each `empty_cache` whose workers all answered, or whose wait is over.
    pub(super) fn answer_release_waiters(&mut self) {
        if self.release_waiters.is_empty() {
            return;
        }
        let now = Instant::now();
        let acks = &self.release_acks;
        let workers = &self.workers;
        let mut keep = Vec::with_capacity(self.release_waiters.len());
        for mut w in std::mem::take(&mut self.release_waiters) {
            // Answered, or the worker is gone (its mapping went with it).
            w.awaited.retain(|k| {
                acks.contains(k) && workers.get(&k.0).is_some_and(|s| s.lost.is_none())
            });
            // A worker in the middle of a job (a custom node running for seconds) reads its
            // socket only after it: it answers then, and what it held comes back then. Not
            // waited for, so that an empty_cache (torch calls it often) never stalls on it.
            let all_busy = w
                .awaited
                .iter()
                .all(|k| workers.get(&k.0).is_some_and(|s| s.in_flight > 0));
            if w.awaited.is_empty() || all_busy || now >= w.deadline {
                let mut missing: Vec<WorkerId> = w.awaited.iter().map(|k| k.0).collect();
                missing.sort_unstable();
                missing.dedup();
                w.report.workers_not_answered = missing.len();
                if !missing.is_empty() {
                    tracing::debug!(
                        ?missing,
                        "workers busy or slow did not answer empty_cache yet: what they hold comes back when they do"
                    );
                }
                let _ = w.reply.send(w.report);
            } else {
                keep.push(w);
            }
        }
        self.release_waiters = keep;
    }
}
