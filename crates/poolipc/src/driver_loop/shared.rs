//! The state the callers' threads share with the IO thread: the worker registry, the pools each
//! worker attached, the counters, and the lock every access goes through.

use std::collections::{BTreeMap, VecDeque};
use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use poolipc_driver::{Driver, PoolHandle};
use poolipc_pool::SharedPool;
use poolipc_types::{ImportLimit, WorkerId};

use super::Command as LoopCommand;
use crate::canary::CanaryReport;
use crate::error::Error;
use crate::state::arenas::Arenas;
use crate::state::{Limits, ParentOptions, Stats, WorkerInfo, lock};

/// A worker as every thread sees it: readable without the IO loop.
#[derive(Clone, Debug)]
pub(crate) struct Registered {
    pub(crate) info: WorkerInfo,
    pub(crate) canary: Option<CanaryReport>,
    /// Its pool table: the wire index each of the parent's pools (each live generation of
    /// one) has for this worker. Index 0 is the Hello pool; the others came by `ExtraPool`,
    /// at spawn or at a rotation.
    pub(crate) pools: BTreeMap<u8, WorkerPool>,
    /// Whether it reached the Hello pool (the parent's device) at spawn.
    pub(crate) reaches_first: bool,
}

/// One entry of a worker's pool table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WorkerPool {
    /// The parent's pool (generation) it names.
    pub(crate) handle: PoolHandle,
    /// Whether the worker attached it and can use it (its `ExtraPoolReply` said so; false
    /// while the answer is awaited).
    pub(crate) reachable: bool,
    /// Set once `PoolRetire` went out: never named again; the index is free once answered.
    pub(crate) retiring: bool,
}

impl Registered {
    /// The wire index under which memory of the parent's pool `handle` may go to it by pool
    /// pointer: it attached the pool, the pool is not being retired, and no canary failed.
    pub(crate) fn pointer_index(&self, handle: PoolHandle) -> Option<u8> {
        if !self.canary.as_ref().is_none_or(CanaryReport::ok) {
            return None;
        }
        self.pools
            .iter()
            .find(|(_, p)| p.handle == handle && p.reachable && !p.retiring)
            .map(|(i, _)| *i)
    }

    /// The lowest index of its table that is free (1..=255), for a new `ExtraPool`.
    pub(crate) fn free_index(&self) -> Option<u8> {
        (1..=u8::MAX).find(|i| !self.pools.contains_key(i))
    }
}

/// What the IO thread and the callers share.
pub(crate) struct Shared {
    pub(crate) driver: Arc<dyn Driver>,
    /// The simulated driver's race checker; `None` on the GPU.
    pub(crate) sim: Option<Arc<crate::check::Sim>>,
    /// Index 0: `options.device`; then `options.more_devices` in order.
    pub(crate) pools: Vec<SharedPool<dyn Driver>>,
    pub(crate) options: ParentOptions,
    /// What the options' memory bounds came to on the device.
    pub(crate) limits: Limits,
    pub(crate) limit: Mutex<ImportLimit>,
    /// The IO loop's rooms, one IO thread each ([`Tuning::io_threads`](crate::Tuning::io_threads)); a worker is
    /// served by room `id % rooms.len()` for its whole life ([`Shared::room_of`]).
    pub(crate) rooms: Vec<Room>,
    /// Whether the arena-copy rung may be chosen now ([`ParentOptions::arena_copy`] at
    /// first, then [`Parent::set_arena_copy`](crate::Parent::set_arena_copy)).
    pub(crate) arena_copy_on: std::sync::atomic::AtomicBool,
    /// The bytes of each job's arena slice now, 0 for none
    /// ([`ParentOptions::arena_slice_bytes`] at first, then
    /// [`Parent::set_arena_slice_bytes`](crate::Parent::set_arena_slice_bytes)).
    pub(crate) arena_slice_bytes: AtomicU64,
    pub(crate) registry: Mutex<BTreeMap<WorkerId, Registered>>,
    /// The process that made the parent: a call from another (a forked child, where the IO
    /// thread does not exist) fails with [`Error::Forked`].
    pub(crate) creator: u32,
    /// Set (with the inbox locked) once the IO thread stopped on a panic: why. Commands are
    /// refused from then on.
    pub(crate) io_stopped: Mutex<Option<String>>,
    pub(crate) next_worker: AtomicU32,
    pub(crate) next_job: AtomicU64,
    pub(crate) stats: Stats,
    /// Whether this process is an MPS client on the parent's device (`None`: not reported).
    pub(crate) mps_client: Option<bool>,
    /// The workers' turns on the GPU ([`Tuning::gpu_turn`](crate::Tuning::gpu_turn)): `None` under MPS,
    /// where the driver does not say, or when turned off.
    pub(crate) turns: Option<Arc<crate::state::turns::Turns>>,
    /// Set once the process's CUDA context is lost: why, for every later refusal.
    pub(crate) context_lost: Mutex<Option<String>>,
    /// The arenas, one per worker, each made by the IO thread at its worker's first need
    /// ([`ResultMemory::Arena`](crate::ResultMemory::Arena), [`ParentOptions::arena_copy`]).
    pub(crate) arenas: Mutex<Arenas>,
}

/// One room of the IO loop: its thread's inbox and how it is woken.
pub(crate) struct Room {
    pub(crate) inbox: Mutex<VecDeque<LoopCommand>>,
    pub(crate) waker: UnixStream,
    /// Set by [`Shared::post`] before it decides whether to wake the loop; cleared by the
    /// loop when it takes the commands.
    pub(crate) pending: std::sync::atomic::AtomicBool,
    /// Set while the IO loop spins instead of sleeping: a post need not write the wake-up
    /// byte then (a system call and a wake-up saved per submit).
    pub(crate) io_spinning: std::sync::atomic::AtomicBool,
    /// The DONE events this room holds open now (its part of
    /// [`ParentStats::done_events_open`](crate::ParentStats::done_events_open)).
    pub(crate) done_events_open: AtomicU64,
    /// The room's loop. Its IO thread holds it for each turn and lets go while it waits; a
    /// caller's thread that finds it free meanwhile runs its own submit, or reads its job's
    /// answer, on it ([`direct`](super::direct)). `None` before the IO thread made it and
    /// once the loop ended.
    pub(super) state: Mutex<Option<Box<super::Loop>>>,
}

impl Room {
    /// A room woken through `waker` (the write end of its thread's socket pair).
    pub(crate) fn new(waker: UnixStream) -> Room {
        Room {
            inbox: Mutex::new(VecDeque::new()),
            waker,
            pending: std::sync::atomic::AtomicBool::new(false),
            io_spinning: std::sync::atomic::AtomicBool::new(false),
            done_events_open: AtomicU64::new(0),
            state: Mutex::new(None),
        }
    }
}

impl Shared {
    pub(crate) fn limit(&self) -> ImportLimit {
        *lock(&self.limit)
    }

    /// `Err` when the IO loop cannot answer: this is a forked child of the process that
    /// made the parent ([`Error::Forked`]), or the loop stopped ([`Error::IoThreadStopped`]).
    pub(crate) fn check_loop(&self) -> Result<(), Error> {
        let this = std::process::id();
        if this != self.creator {
            return Err(Error::Forked {
                creator: self.creator,
                this,
            });
        }
        match lock(&self.io_stopped).as_ref() {
            Some(detail) => Err(Error::IoThreadStopped {
                detail: detail.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The error of a caller whose answer channel the loop dropped.
    pub(crate) fn loop_gone(&self) -> Error {
        self.check_loop()
            .err()
            .unwrap_or_else(|| Error::IoThreadStopped {
                detail: "it dropped a command without an answer".into(),
            })
    }

    /// The room (IO thread) that serves `worker`.
    pub(crate) fn room_of(&self, worker: WorkerId) -> usize {
        usize::try_from(worker.0).unwrap_or(0) % self.rooms.len()
    }

    /// Hands a command to the IO loop and wakes it: to the room of the worker it is for;
    /// `Shutdown` to every room; anything else to the first (`empty_cache` asks every room
    /// itself, with [`post_to`](Self::post_to)). Answers it with the error at once when the
    /// loop cannot ([`check_loop`](Self::check_loop)).
    pub(crate) fn post(&self, command: LoopCommand) {
        if matches!(command, LoopCommand::Shutdown) {
            for room in 0..self.rooms.len() {
                self.post_to(room, LoopCommand::Shutdown);
            }
            return;
        }
        let room = command.worker().map_or(0, |w| self.room_of(w));
        self.post_to(room, command);
    }

    /// Hands a command to room `room`'s IO thread and wakes it (see [`post`](Self::post)).
    pub(crate) fn post_to(&self, room: usize, command: LoopCommand) {
        let Some(r) = self.rooms.get(room) else {
            command.refuse(Error::Protocol(format!("no IO room {room}")));
            return;
        };
        let mut inbox = lock(&r.inbox);
        if let Err(e) = self.check_loop() {
            drop(inbox);
            command.refuse(e);
            return;
        }
        inbox.push_back(command);
        drop(inbox);
        // Dekker with the loop's `io_spinning.store(false)` then `pending.load()`: either the
        // loop sees `pending` before it sleeps, or we see it is not spinning and wake it.
        r.pending.store(true, Ordering::SeqCst);
        if !r.io_spinning.load(Ordering::SeqCst) {
            // A full socket buffer means a wake-up is pending anyway.
            let _ = (&r.waker).write(&[1]);
        }
    }

    /// Room `room`'s commands, taken by its IO thread.
    pub(crate) fn take_commands(&self, room: usize) -> VecDeque<LoopCommand> {
        let r = &self.rooms[room];
        r.pending.store(false, Ordering::SeqCst);
        std::mem::take(&mut *lock(&r.inbox))
    }

    /// `Err(ContextLost)` once the process's CUDA context is lost: nothing more is done.
    pub(crate) fn check_context(&self) -> Result<(), Error> {
        match lock(&self.context_lost).as_ref() {
            Some(detail) => Err(Error::ContextLost {
                detail: detail.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Whether the parent knows worker `id` (without copying its entry).
    pub(crate) fn is_registered(&self, id: WorkerId) -> bool {
        lock(&self.registry).contains_key(&id)
    }

    pub(crate) fn registered(&self, id: WorkerId) -> Option<Registered> {
        lock(&self.registry).get(&id).cloned()
    }

    /// The pools (generations) `id` takes pool pointers from, each with its wire index for
    /// `id`; `None` for a worker the parent does not know. On every job and result: copies
    /// no more than this.
    pub(crate) fn pointer_pools(&self, id: WorkerId) -> Option<Vec<(PoolHandle, u8)>> {
        let registry = lock(&self.registry);
        let r = registry.get(&id)?;
        Some(
            r.pools
                .values()
                .filter_map(|p| r.pointer_index(p.handle).map(|i| (p.handle, i)))
                .collect(),
        )
    }

    /// The parent's pool (index into [`Shared::pools`]) that generation `handle` is of.
    pub(crate) fn pool_of(&self, handle: PoolHandle) -> Option<usize> {
        self.pools.iter().position(|p| p.is_generation(handle))
    }
}
