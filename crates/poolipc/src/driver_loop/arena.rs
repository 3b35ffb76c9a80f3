//! The arenas on the IO thread: each worker's made at its first need, its chunks grown and
//! announced to that worker alone, idle ones released (asking the worker to unmap first), a
//! reaped worker's emptied, and the answers awaited.

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use poolipc_contract::Message;
use poolipc_pool::Arena;
use poolipc_pool::arena::{ArenaBudget, ArenaError};
use poolipc_transport::{ArenaChunk, ArenaRelease};
use poolipc_types::WorkerId;

use super::{Loop, MAPPINGS_ACK};
use crate::error::Error;
use crate::state::{EmptyCache, ResultMemory, SharedArena, lock};

impl Loop {
    /// `worker`'s arena, made on this thread (the device is current here) at its first use:
    /// with the [`ResultMemory::Arena`] sizes, or (arena copies only) chunks of
    /// `first_bytes`; the cap is the one every arena shares (made with the first arena).
    /// Refused for a worker the loop does not hold (reaped: its arena is retired).
    pub(super) fn ensure_arena(
        &self,
        worker: WorkerId,
        first_bytes: u64,
    ) -> Result<SharedArena, Error> {
        if !self.workers.contains_key(&worker) {
            return Err(Error::UnknownWorker(worker));
        }
        let mut arenas = lock(&self.shared.arenas);
        if let Some(a) = arenas.live(worker) {
            return Ok(a);
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
        let budget = match arenas.budget() {
            Some(b) => b,
            None => Arc::new(ArenaBudget::new(Some(self.arena_cap(max_bytes)?))),
        };
        let arena = Arc::new(Arena::with_budget(
            Arc::clone(&self.shared.driver),
            self.shared.options.device,
            initial_bytes,
            Arc::clone(&budget),
        )?);
        // Its first chunk at once, as large as its growth step, when the first need fits in
        // it and the shared cap leaves room for it (a slice never grows an arena: it fits
        // there). Otherwise the arena starts empty and its first block adds the chunk it
        // needs, or is refused at the cap without anything made for it.
        if first_bytes <= initial_bytes {
            match arena.grow(initial_bytes) {
                Ok(_) => {}
                Err(e @ ArenaError::Exhausted { .. }) => {
                    tracing::debug!(worker = %worker, error = %e, "a worker's arena starts with no chunk");
                }
                Err(e) => return Err(e.into()),
            }
        }
        tracing::info!(
            worker = %worker,
            device = self.shared.options.device,
            bytes = arena.capacity(),
            max_bytes = ?budget.max_bytes(),
            held = budget.used(),
            "arena created"
        );
        arenas.insert(worker, budget, Arc::clone(&arena));
        Ok(arena)
    }

    /// The cap of every arena together: `max_bytes`, or when none is given a fraction of
    /// the device ([`ParentOptions::arena_cap_fraction`]).
    ///
    /// [`ParentOptions::arena_cap_fraction`]: crate::ParentOptions::arena_cap_fraction
    fn arena_cap(&self, max_bytes: Option<u64>) -> Result<u64, Error> {
        if let Some(m) = max_bytes {
            return Ok(m);
        }
        let (_, total) = self.shared.driver.mem_get_info()?;
        // A fraction in (0, 1] of the device's bytes: non-negative, within u64, and a byte
        // more or less does not matter.
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let cap = (total as f64 * self.shared.options.arena_cap_fraction) as u64;
        Ok(cap)
    }

    /// Sends each worker that maps the arena every chunk of its own arena it has not been
    /// sent yet, in index order, one `ArenaChunk` (with the chunk's FD) each: a worker is sent
    /// its own chunks and no other's. A worker a chunk cannot be sent to takes no more arena
    /// results (a failed send loses it, as any send does).
    ///
    /// A worker with a host-staged job in flight is skipped unless it is `target` (whose
    /// result is being allocated: it waits for its grant, not inside a transfer): a frame
    /// with an FD cannot wait in a staging transfer's backlog. It catches up when that job
    /// finishes, and always before a grant names the chunk.
    pub(super) fn announce_chunks(&mut self, target: Option<WorkerId>) {
        let arenas = lock(&self.shared.arenas).live_arenas();
        for (id, arena) in arenas {
            let Some(slot) = self.workers.get_mut(&id) else {
                continue;
            };
            if !slot.maps_arena
                || slot.lost.is_some()
                || (slot.staged_in_flight && target != Some(id))
            {
                continue;
            }
            // A staged job's transfer has its socket (and it is `staged_in_flight`).
            let Some(conn) = slot.conn.as_mut() else {
                continue;
            };
            // Chunk indices only grow (a released one is never listed or used again).
            let from = slot.arena_chunks_sent;
            for c in arena.chunks().filter(|c| c.index >= from) {
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
                if let Err(e) = conn.enqueue(&message, &[fd.as_fd()]) {
                    slot.maps_arena = false;
                    self.lose(id, &format!("sending arena chunk {} failed: {e}", c.index));
                    break;
                }
                tracing::debug!(worker = %id, chunk = c.index, len = c.len, "arena chunk sent");
                slot.arena_chunks_sent = c.index + 1;
            }
        }
    }

    /// Gives back arena chunks idle for [`ParentOptions::arena_idle_release`] (each worker
    /// told of its own), and every empty chunk of a reaped worker's arena, looking at most
    /// once per [`IDLE_RELEASE_CHECK`](super::answers::IDLE_RELEASE_CHECK).
    ///
    /// [`ParentOptions::arena_idle_release`]: crate::ParentOptions::arena_idle_release
    pub(super) fn release_idle_arena(&mut self) {
        let now = Instant::now();
        if !self.answers.idle_check_due(now) {
            return;
        }
        self.empty_retired_arenas();
        let Some(idle) = self.shared.options.arena_idle_release else {
            return;
        };
        // This room's workers' arenas: another room tells its own workers.
        let arenas = lock(&self.shared.arenas).live_arenas();
        for (id, arena) in arenas {
            if !self.workers.contains_key(&id) {
                continue;
            }
            let released = arena.release_idle(now, idle, 0);
            if !released.is_empty() {
                self.tell_released(id, &released);
            }
        }
    }

    /// Gives every empty chunk of the reaped workers' arenas back to the device at once (no
    /// worker maps them: the driver dropped the dead process's mappings), and forgets the
    /// arenas left with none. Returns the chunks and bytes given back.
    pub(super) fn empty_retired_arenas(&mut self) -> (u64, u64) {
        let retired = lock(&self.shared.arenas).retired_arenas();
        let (mut chunks, mut bytes) = (0, 0);
        for arena in retired {
            for c in arena.release_idle(Instant::now(), Duration::ZERO, 0) {
                chunks += 1;
                bytes += c.len;
            }
        }
        lock(&self.shared.arenas).forget_empty();
        (chunks, bytes)
    }

    /// `worker` was reaped: its arena grants nothing more, and gives its chunks back to the
    /// device as they empty.
    pub(super) fn retire_arena(&mut self, worker: WorkerId) {
        lock(&self.shared.arenas).retire(worker);
        self.empty_retired_arenas();
    }

    /// `empty_cache`: every idle chunk now; the reply waits for the workers' answers.
    pub(super) fn release_arena_now(&mut self, reply: Sender<EmptyCache>) {
        let mut report = EmptyCache::default();
        let mut awaited = HashSet::new();
        let arenas = lock(&self.shared.arenas).live_arenas();
        for (id, arena) in arenas {
            // Another room's worker: that room releases it (empty_cache asks every room).
            if !self.workers.contains_key(&id) {
                continue;
            }
            let released = arena.release_idle(Instant::now(), Duration::ZERO, 0);
            report.arena_chunks += released.len() as u64;
            report.arena_bytes += released.iter().map(|c| c.len).sum::<u64>();
            awaited.extend(self.tell_released(id, &released));
        }
        let (chunks, bytes) = self.empty_retired_arenas();
        report.arena_chunks += chunks;
        report.arena_bytes += bytes;
        // Workers drop the VMM mappings they cache (each keeps the memory behind it alive).
        let holders: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(id, s)| s.lost.is_none() && self.loans.vmm_held_by(**id))
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
        self.answers.expect(worker, key);
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
        let deadline = Instant::now() + crate::state::EMPTY_CACHE_WAIT;
        self.answers.wait(reply, report, awaited, deadline);
        self.answer_release_waiters();
    }

    /// Tells `worker`, if it was sent any of `chunks` (of its arena), to unmap them; returns
    /// the answers now awaited. A worker lost meanwhile never answers and is not waited for.
    pub(super) fn tell_released(
        &mut self,
        worker: WorkerId,
        chunks: &[poolipc_pool::arena::ChunkInfo],
    ) -> HashSet<(WorkerId, u32)> {
        let mut awaited = HashSet::new();
        for c in chunks {
            let sent = self
                .workers
                .get(&worker)
                .is_some_and(|s| s.lost.is_none() && s.arena_chunks_sent > c.index);
            if !sent {
                continue;
            }
            let message = Message::ArenaRelease(ArenaRelease { index: c.index });
            self.send_awaiting(worker, &message, c.index, &mut awaited);
        }
        awaited
    }

    /// Replies to each `empty_cache` whose workers all answered, or whose wait is over
    /// ([`Answers::reply_due`](super::answers::Answers::reply_due)).
    pub(super) fn answer_release_waiters(&mut self) {
        let workers = &self.workers;
        self.answers
            .reply_due(Instant::now(), |w| workers.standing(w));
    }
}
