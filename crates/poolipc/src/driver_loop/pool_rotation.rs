//! The IO loop's side of a pool rotation (`Parent::empty_cache`): every live worker
//! gets the new generation at a free index of its pool table before a lend names it, and a
//! retired generation is destroyed in the workers (`PoolRetire`) before the parent destroys
//! it. The answers (`ExtraPoolReply`, `PoolRetired`) are awaited as `empty_cache`'s other
//! answers are ([`Answers`](super::answers::Answers)).

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::sync::mpsc::Sender;

use poolipc_contract::{ExtraPool, ExtraPoolReply, Message, PoolRetire};
use poolipc_driver::PoolHandle;
use poolipc_types::WorkerId;

use super::Loop;
use super::WorkerPool;
use super::transfer::Held;
use crate::state::{EmptyCache, lock};

/// The key of an `ExtraPoolReply` for index `i` among the awaited (worker, key) answers is
/// `POOL_OFFER_ACK + i`, of a `PoolRetired` `POOL_RETIRE_ACK + i`: above any arena chunk's
/// index (they count up from 0) and below `MAPPINGS_ACK`.
pub(super) const POOL_OFFER_ACK: u32 = u32::MAX - 512;
pub(super) const POOL_RETIRE_ACK: u32 = u32::MAX - 256;

impl Loop {
    /// Offers generation `handle` of the parent's pool `pool` to every live worker that does
    /// not have it yet, at the lowest free index of its table; replies once they answered
    /// (or after `EMPTY_CACHE_WAIT`). Until a worker's answer says it attached the pool, no
    /// lend to it names the index (its tensors of that pool take another rung).
    pub(super) fn offer_pool_now(
        &mut self,
        pool: usize,
        handle: PoolHandle,
        reply: Sender<EmptyCache>,
    ) {
        let mut awaited = HashSet::new();
        let offer = self.shared.pools.get(pool).and_then(|p| {
            let fd = p.fd_of(handle)?;
            let device = self.shared.driver.device_info(p.device()).ok()?.uuid;
            Some((fd, device))
        });
        if let Some((fd, device)) = offer {
            // Not to a worker with a host-staged job in flight: a frame with a descriptor
            // arriving between its staged transfers would fail the transfer. It is left out
            // of this generation (its tensors of it take another rung, and the reason says
            // it was not given the generation), as a worker whose table is full is.
            let ids: Vec<WorkerId> = self
                .workers
                .iter()
                .filter(|(_, s)| s.lost.is_none() && !s.staged_in_flight)
                .map(|(id, _)| *id)
                .collect();
            for id in ids {
                let index = {
                    let mut registry = lock(&self.shared.registry);
                    let Some(r) = registry.get_mut(&id) else {
                        continue;
                    };
                    // An isolated worker gets no pool, old or new.
                    if r.info.trust.is_isolated() || r.pools.values().any(|p| p.handle == handle) {
                        continue;
                    }
                    let Some(index) = r.free_index() else {
                        tracing::warn!(worker = %id, "the worker's pool table is full: tensors of the new pool generation take another rung");
                        continue;
                    };
                    r.pools.insert(
                        index,
                        WorkerPool {
                            handle,
                            reachable: false,
                            retiring: false,
                        },
                    );
                    index
                };
                let Some(slot) = self.workers.get_mut(&id) else {
                    continue;
                };
                let message = Message::ExtraPool(ExtraPool { index, device });
                let Some(conn) = slot.conn.as_mut() else {
                    // Its staging transfer has the socket: the offer goes after it.
                    match fd.as_fd().try_clone_to_owned() {
                        Ok(dup) => slot.held.push_back(Held::Frame(message, Some(dup))),
                        Err(e) => {
                            tracing::warn!(worker = %id, index, error = %e, "duplicating the pool's FD failed: the offer is not sent");
                            continue;
                        }
                    }
                    tracing::debug!(worker = %id, index, ?handle, "new pool generation offered once its transfer ends");
                    self.await_answer(id, POOL_OFFER_ACK + u32::from(index), &mut awaited);
                    continue;
                };
                if let Err(e) = conn.enqueue(&message, &[fd.as_fd()]) {
                    self.lose(id, &format!("sending pool generation {index} failed: {e}"));
                    continue;
                }
                tracing::debug!(worker = %id, index, ?handle, "new pool generation offered");
                self.await_answer(id, POOL_OFFER_ACK + u32::from(index), &mut awaited);
            }
        } else {
            tracing::warn!(
                pool,
                ?handle,
                "a rotated pool generation vanished before it was offered"
            );
        }
        self.wait_for_answers(reply, EmptyCache::default(), awaited);
    }

    /// Tells every worker whose table holds retired generation `handle` to destroy its import
    /// of it (`PoolRetire`); replies once they answered (or after `EMPTY_CACHE_WAIT`). The
    /// entry stays, never named again, until the answer frees its index.
    pub(super) fn retire_pool_now(&mut self, handle: PoolHandle, reply: Sender<EmptyCache>) {
        let mut awaited = HashSet::new();
        let holders: Vec<(WorkerId, u8)> = {
            let mut registry = lock(&self.shared.registry);
            let mut holders = Vec::new();
            for (id, r) in registry.iter_mut() {
                // Another room's worker: that room tells it (empty_cache asks every room).
                if self.shared.room_of(*id) != self.room {
                    continue;
                }
                let live = self.workers.get(id).is_some_and(|s| s.lost.is_none());
                let indices: Vec<u8> = r
                    .pools
                    .iter()
                    .filter(|(_, p)| p.handle == handle)
                    .map(|(i, _)| *i)
                    .collect();
                for i in indices {
                    if live {
                        if let Some(p) = r.pools.get_mut(&i) {
                            p.retiring = true;
                        }
                        holders.push((*id, i));
                    } else {
                        r.pools.remove(&i);
                    }
                }
            }
            holders
        };
        for (id, index) in holders {
            let message = Message::PoolRetire(PoolRetire { index });
            self.send_awaiting(
                id,
                &message,
                POOL_RETIRE_ACK + u32::from(index),
                &mut awaited,
            );
        }
        self.wait_for_answers(reply, EmptyCache::default(), awaited);
    }

    /// A worker's `ExtraPoolReply` after its handshake: the entry it answers becomes usable
    /// (or stays unusable, with why). Returns the awaited key it answers.
    pub(super) fn pool_offer_answered(&mut self, worker: WorkerId, r: &ExtraPoolReply) -> u32 {
        if let Some(p) = lock(&self.shared.registry)
            .get_mut(&worker)
            .and_then(|w| w.pools.get_mut(&r.index))
            .filter(|p| !p.retiring)
        {
            p.reachable = r.reachable;
        }
        if !r.reachable {
            tracing::info!(worker = %worker, index = r.index, reason = %poolipc_contract::worker_text(&r.reason), "the worker cannot use a new pool generation: its tensors take another rung");
        }
        POOL_OFFER_ACK + u32::from(r.index)
    }

    /// A worker's `PoolRetired`: the index of the retired generation is free again. Returns
    /// the awaited key it answers.
    pub(super) fn pool_retire_answered(&mut self, worker: WorkerId, index: u8) -> u32 {
        if let Some(w) = lock(&self.shared.registry).get_mut(&worker)
            && w.pools.get(&index).is_some_and(|p| p.retiring)
        {
            w.pools.remove(&index);
        }
        POOL_RETIRE_ACK + u32::from(index)
    }
}
