//! The parent: owns the shared pools, spawns workers, and runs jobs on them through one IO
//! loop that drives the ownership contract (see [`crate::driver_loop`]).
//!
//! [`Parent`] is `Send + Sync`: any thread may [`submit`](Parent::submit) a job and
//! [`wait`](JobHandle::wait) for it; jobs on different workers run at the same time and a
//! worker may have several jobs in flight. `spawn_worker`, `stop_worker`, `worker` and `stats`
//! never wait for a running job.

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use poolipc_contract::Identity;
use poolipc_driver::Driver;
use poolipc_pool::{Arena, SharedPool};
use poolipc_types::{ImportLimit, WorkerId};

use crate::driver_loop::{self, Command as LoopCommand, Registered, Shared, WorkerPool};
use crate::error::Error;
use crate::settings::{IO_THREADS_ENV, MAX_IO_THREADS};
use crate::state::Stats;
pub(crate) use crate::state::lock;
pub use crate::state::{
    ArenaStats, EmptyCache, Input, JobOutput, Limits, MemoryBound, ParentOptions, ParentStats,
    ResultAllocator, ResultMemory, ResultTensor, Trust, WorkerInfo,
};

mod canary;
mod job;
mod spawn;

pub use job::{JobHandle, JobWatch};

/// The parent side: the shared pools, the workers, the jobs. `Send + Sync`: share it in an
/// `Arc` and submit from any thread.
pub struct Parent {
    shared: Arc<Shared>,
    /// The IO threads, one per room ([`Tuning::io_threads`](crate::Tuning::io_threads)).
    io: Vec<std::thread::JoinHandle<()>>,
    /// Set on every command [`spawn_worker`](Parent::spawn_worker) runs (the simulated
    /// machine's locator, from [`Parent::on`]).
    worker_env: Vec<(std::ffi::OsString, std::ffi::OsString)>,
}

impl std::fmt::Debug for Parent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parent")
            .field("driver", &self.shared.driver.kind())
            .field("device", &self.shared.options.device)
            .field("workers", &lock(&self.shared.registry).len())
            .finish_non_exhaustive()
    }
}

impl Parent {
    /// Installs the shared pool on `options.device` (see [`SharedPool::install`]) and one on
    /// each of `options.more_devices`, and starts the IO thread.
    pub fn new(driver: Arc<dyn Driver>, options: ParentOptions) -> Result<Parent, Error> {
        let mut devices = vec![options.device];
        for &d in &options.more_devices {
            if devices.contains(&d) {
                return Err(Error::Config(format!(
                    "device {d} is listed twice (device {}, more devices {:?})",
                    options.device, options.more_devices
                )));
            }
            devices.push(d);
        }
        if options.more_devices.len() > usize::from(u8::MAX) {
            return Err(Error::Config(format!(
                "{} more devices: at most {} pools are named on the wire",
                options.more_devices.len(),
                u8::MAX
            )));
        }
        if !(options.arena_cap_fraction > 0.0 && options.arena_cap_fraction <= 1.0) {
            return Err(Error::Config(format!(
                "arena_cap_fraction {} must lie in (0, 1]",
                options.arena_cap_fraction
            )));
        }
        if !(1..=MAX_IO_THREADS).contains(&options.tuning.io_threads) {
            return Err(Error::Config(format!(
                "io_threads {} must lie in 1..={MAX_IO_THREADS} (its default comes from \
                 {IO_THREADS_ENV} when that is set)",
                options.tuning.io_threads
            )));
        }
        if options.handoff_timeout.is_zero() || options.stop_timeout.is_zero() {
            return Err(Error::Config(
                "handoff_timeout and stop_timeout must be longer than zero".into(),
            ));
        }
        let mut pools = Vec::with_capacity(devices.len());
        // The first pool is installed last so that its device stays current on this thread.
        for &d in devices.iter().skip(1) {
            driver.use_device(d)?;
            pools.push(SharedPool::install(Arc::clone(&driver), d)?);
        }
        driver.use_device(options.device)?;
        pools.insert(0, SharedPool::install(Arc::clone(&driver), options.device)?);
        crate::warm::copies_if_asked(&driver, "parent", options.tuning.warm_copies);
        // One socket pair per room: a post writes a byte to wake that room's IO thread.
        let mut rooms = Vec::with_capacity(options.tuning.io_threads);
        let mut wake_reads = Vec::with_capacity(options.tuning.io_threads);
        for _ in 0..options.tuning.io_threads {
            let (waker, wake_read) = UnixStream::pair().map_err(|source| Error::Os {
                call: "socketpair",
                source,
            })?;
            for s in [&waker, &wake_read] {
                s.set_nonblocking(true).map_err(|source| Error::Os {
                    call: "fcntl(O_NONBLOCK)",
                    source,
                })?;
            }
            rooms.push(crate::driver_loop::Inbox::new(waker));
            wake_reads.push(wake_read);
        }
        let (_, device_bytes) = driver.mem_get_info()?;
        let limits = options.limits_for(device_bytes).map_err(Error::Config)?;
        let mps_client = driver.device_info(options.device)?.mps_client;
        if mps_client == Some(true) {
            tracing::info!(
                device = options.device,
                "poolipc: this process is an MPS client: handoffs skip the GPU's turn-taking, and a GPU fault in any client (a worker) ends every client's context"
            );
        }
        let arena_copy = options.arena_copy;
        let arena_slice_bytes = options.arena_slice_bytes;
        // Turns only where the driver says the GPU runs one process at a time.
        let turns = match options.tuning.gpu_turn {
            Some(wait) if !wait.is_zero() && mps_client == Some(false) => Some(Arc::new(
                crate::state::turns::Turns::new(wait, options.tuning.spin_in_flight),
            )),
            _ => None,
        };
        let shared = Arc::new(Shared {
            limits,
            turns,
            arenas: Mutex::new(crate::state::arenas::Arenas::default()),
            mps_client,
            context_lost: Mutex::new(None),
            sim: crate::check::Sim::of(&driver, "the parent"),
            driver,
            pools,
            limit: Mutex::new(options.limit),
            options,
            rooms,
            arena_copy_on: std::sync::atomic::AtomicBool::new(arena_copy),
            arena_slice_bytes: AtomicU64::new(arena_slice_bytes),
            registry: Mutex::new(BTreeMap::new()),
            creator: std::process::id(),
            io_stopped: Mutex::new(None),
            next_worker: AtomicU32::new(1),
            next_job: AtomicU64::new(1),
            stats: Stats::default(),
        });
        let mut io = Vec::with_capacity(wake_reads.len());
        for (room, wake_read) in wake_reads.into_iter().enumerate() {
            match driver_loop::start(Arc::clone(&shared), room, wake_read) {
                Ok(thread) => io.push(thread),
                Err(e) => {
                    // The rooms started so far end with their shutdown.
                    let parent = Parent {
                        shared,
                        io,
                        worker_env: Vec::new(),
                    };
                    drop(parent);
                    return Err(e);
                }
            }
        }
        Ok(Parent {
            shared,
            io,
            worker_env: Vec::new(),
        })
    }

    /// On the simulated driver, everything its race checker found on the machine so far, by
    /// any process (see [`check`](crate::check)): empty when the program kept every rule.
    /// `None` on the GPU, where nothing is checked. What it returns is not summarized again
    /// when the parent is dropped.
    pub fn sim_report(&self) -> Option<crate::check::RaceReport> {
        self.shared.sim.as_ref().map(|sim| sim.everything())
    }

    /// Opens the driver `POOLIPC_DRIVER` names (`cuda` when unset, `sim`, `auto`:
    /// [`driver::open_or`](crate::driver::open_or)`(`[`Choice::Cuda`](crate::driver::Choice::Cuda)`)`)
    /// and makes the parent on it, as [`Parent::on`] does.
    ///
    /// Which to use: `Parent::open` where a missing GPU is an error (production: on a machine
    /// without a usable GPU it fails with [`Error::Driver`], whose text says how to run on the
    /// simulated driver). Where the program must run on any machine (an example, a demo, a
    /// test), use
    /// `Parent::on(`[`driver::open_or`](crate::driver::open_or)`(`[`Choice::Auto`](crate::driver::Choice::Auto)`)?, options)`:
    /// the GPU where one is usable, else the simulated driver; `POOLIPC_DRIVER`, when set,
    /// still decides.
    pub fn open(options: ParentOptions) -> Result<Parent, Error> {
        Parent::on(
            crate::driver::open_or(crate::driver::Choice::Cuda)?,
            options,
        )
    }

    /// Makes the parent on an opened driver: as [`Parent::new`], and every worker
    /// [`spawn_worker`](Parent::spawn_worker) starts gets `opened.worker_env` (on the
    /// simulated driver, what lets [`driver::open_worker`](crate::driver::open_worker) attach
    /// to this process's machine).
    pub fn on(opened: crate::driver::Opened, options: ParentOptions) -> Result<Parent, Error> {
        let mut parent = Parent::new(opened.driver, options)?;
        parent.worker_env = opened.worker_env;
        Ok(parent)
    }

    /// Sets the import limit from here on (tensors over it take host staging), at most the
    /// limit the parent was made with.
    pub fn lower_import_limit(&self, limit: ImportLimit) -> Result<(), Error> {
        let cur = self.shared.options.limit;
        if limit.chunk_bytes() != cur.chunk_bytes() || limit.max_chunks() > cur.max_chunks() {
            return Err(Error::Config(format!(
                "the import limit can only be lowered: {} chunks of {} bytes is not within {} of {}",
                limit.max_chunks(),
                limit.chunk_bytes(),
                cur.max_chunks(),
                cur.chunk_bytes()
            )));
        }
        *lock(&self.shared.limit) = limit;
        Ok(())
    }

    /// The import limit in force (the options' one, or lower: see
    /// [`lower_import_limit`](Parent::lower_import_limit)); [`Parent::limits`] says it too.
    pub(crate) fn import_limit(&self) -> ImportLimit {
        self.shared.limit()
    }

    /// The limits in force: what its memory bounds came to on its device (the defaults are
    /// fractions of the device's total memory: [`ParentOptions::max_result_bytes_per_job`],
    /// [`ParentOptions::max_result_bytes_per_worker`], the arenas' cap), and the import limit
    /// (the options' one, or lower: see [`lower_import_limit`](Parent::lower_import_limit)).
    #[must_use]
    pub fn limits(&self) -> Limits {
        Limits {
            import: self.shared.limit(),
            ..self.shared.limits
        }
    }

    /// The options it was made with.
    pub fn options(&self) -> &ParentOptions {
        &self.shared.options
    }

    /// The shared pool (on `options.device`).
    pub fn pool(&self) -> &SharedPool<dyn Driver> {
        &self.shared.pools[0]
    }

    /// The shared pool on `device`: the first one's, or one of `options.more_devices`.
    pub fn pool_on(&self, device: u32) -> Option<&SharedPool<dyn Driver>> {
        self.shared.pools.iter().find(|p| p.device() == device)
    }

    /// The driver (the facade's own code; callers reach it through
    /// [`RawDriver`](crate::advanced::RawDriver)).
    pub(crate) fn driver_ref(&self) -> &Arc<dyn Driver> {
        &self.shared.driver
    }

    /// This side's handshake identity.
    pub(crate) fn identity(&self) -> Result<Identity, Error> {
        crate::handshake::identity(
            &*self.shared.driver,
            self.shared.options.device,
            crate::settings::capabilities(&*self.shared.driver, self.shared.options.device),
        )
    }

    /// Whether this process is an MPS client on the parent's device, as the driver reported
    /// at [`Parent::new`] (`None`: the driver does not say). See [`crate::mps`].
    pub fn mps_client(&self) -> Option<bool> {
        self.shared.mps_client
    }

    /// The length of the GPU turns this parent keeps ([`Tuning::gpu_turn`](crate::Tuning::gpu_turn)): `None`
    /// where turns are off, or where the driver does not say this process is not an MPS
    /// client.
    pub fn gpu_turn(&self) -> Option<std::time::Duration> {
        self.shared.turns.as_ref().map(|t| t.turn())
    }

    /// Why this parent refuses all work, once the process's CUDA context is lost (see
    /// [`Error::ContextLost`]); `None` while it is usable.
    pub fn context_lost(&self) -> Option<String> {
        lock(&self.shared.context_lost).clone()
    }

    /// `worker`'s arena, once made (see [`ResultMemory::Arena`]: lazily, at the first
    /// result, arena copy or arena slice of that worker's that goes to it), until it is
    /// empty after the worker was reaped. Each worker has its own: every chunk of it is
    /// mapped by that worker alone, and holds only blocks lent or granted to it. Blocks a
    /// caller allocates from it directly are the caller's to give back; the parent never
    /// grants them (a reaped worker's arena is still the caller's to allocate from, but the
    /// parent gives its empty chunks back to the device). What one worker's arena holds is
    /// its [`stats`](crate::advanced::pool::Arena::stats); what all of them hold together,
    /// [`arena_stats`](Parent::arena_stats).
    pub fn arena_of(&self, worker: WorkerId) -> Option<Arc<Arena<dyn Driver>>> {
        lock(&self.shared.arenas).of(worker)
    }

    /// What the arenas hold together (`None` before the first one is made); `max_bytes` is
    /// the cap they share. Makes no driver call: blocks given back whose event completed
    /// still count as live until reclaimed.
    pub fn arena_stats(&self) -> Option<ArenaStats> {
        lock(&self.shared.arenas).stats()
    }

    /// Frees the arena blocks given back whose event completed, in every arena (the next
    /// arena result does this too); returns how many. Queries events: the calling thread
    /// must have the parent's device current ([`Driver::use_device`]).
    pub fn reclaim_arena(&self) -> usize {
        lock(&self.shared.arenas).reclaim()
    }

    /// Turns the arena-copy rung on or off for jobs placed from now on (it starts as
    /// [`ParentOptions::arena_copy`] says). Turning it on helps only where the arena is set
    /// up for it: with [`ParentOptions::arena_copy`] or [`ResultMemory::Arena`] at
    /// [`Parent::new`].
    pub fn set_arena_copy(&self, on: bool) {
        self.shared.arena_copy_on.store(on, Ordering::Relaxed);
    }

    /// Sets the bytes of the arena slice lent with each job from now on (0: none); see
    /// [`ParentOptions::arena_slice_bytes`]. Jobs already placed keep what they got.
    pub fn set_arena_slice_bytes(&self, bytes: u64) {
        self.shared
            .arena_slice_bytes
            .store(bytes, Ordering::Relaxed);
    }

    /// Counters, read without waiting for any job.
    pub fn stats(&self) -> ParentStats {
        let s = &self.shared.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ParentStats {
            workers_connected: get(&s.workers_connected),
            workers_lost: get(&s.workers_lost),
            jobs_submitted: get(&s.jobs_submitted),
            jobs_completed: get(&s.jobs_completed),
            jobs_failed: get(&s.jobs_failed),
            pool_pointer_tensors: get(&s.pool_pointer_tensors),
            host_staged_tensors: get(&s.host_staged_tensors),
            arena_results: get(&s.arena_results),
            arena_copied_inputs: get(&s.arena_copied_inputs),
            copies_through_host: get(&s.copies_through_host),
            arena_slices_lent: get(&s.arena_slices_lent),
            arena_results_carved: get(&s.arena_results_carved),
            inputs_copied_back: get(&s.inputs_copied_back),
            jobs_held_for_done: get(&s.jobs_held_for_done),
            ready_recorded_aside: get(&s.ready_recorded_aside),
            direct_lends: get(&s.direct_lends),
            direct_reads: get(&s.direct_reads),
            workers_busy: get(&s.workers_busy),
            most_workers_busy: get(&s.most_workers_busy),
            turn_waits: get(&s.turn_waits),
            turn_wait_ns: get(&s.turn_wait_ns),
            turn_waits_ran_out: get(&s.turn_waits_ran_out),
            done_events_open: self
                .shared
                .rooms
                .iter()
                .map(|r| get(&r.done_events_open))
                .sum(),
            export_reuse: self.pool().export_reuse().0,
            vmm_handle_tensors: get(&s.vmm_handle_tensors),
            vmm_handles_shared: get(&s.vmm_handles_shared),
            io_busy_ns: get(&s.io_busy_ns),
        }
    }

    /// Runs the export reuse check with `worker` unless the first pool has a verdict
    /// already, and returns the verdict with why not proven (the canary battery's check). The
    /// canary battery does this on its own; a parent without it (`canary: false`) calls this
    /// to stop exporting recycled allocations of the same size.
    pub fn check_export_reuse(
        &self,
        worker: WorkerId,
    ) -> Result<(poolipc_pool::ExportReuse, Option<String>), Error> {
        canary::check_export_reuse(self, worker)
    }

    /// Gives memory the parent does not use back to the device, as `torch.cuda.empty_cache()`
    /// does for torch's pool: every arena chunk with nothing in it (each worker that mapped
    /// one is told to unmap it; waits up to 2 s for their answers), then
    /// each shared pool is trimmed ([`SharedPool::trim`]: waits for this process's GPU work,
    /// then `cuMemPoolTrimTo(pool, 0)`).
    ///
    /// Memory lent by pool pointer and freed is not given back by a trim: the driver keeps an
    /// exported allocation's memory until its pool is destroyed. So each shared pool whose
    /// current generation exported anything is *rotated* ([`SharedPool::rotate`]): a new pool
    /// becomes the device's current one, every live worker is given it (an `ExtraPool`; waits
    /// up to 2 s for their answers), and the old one is retired. A retired
    /// generation with nothing in use is destroyed: by the parent first, then by every worker
    /// that imported it (`PoolRetire`, waited for the same way; the worker synchronizes
    /// around its destroy). Its memory goes back once the last of them did. One still in use
    /// (a tensor allocated before and not freed) stays, valid for that tensor, until a later
    /// `empty_cache` finds it unused.
    ///
    /// What it costs: the synchronize, and the next allocations and arena results map memory
    /// again instead of reusing it; after a rotation the new pool maps all its memory afresh,
    /// and the first lend of each new allocation exports it again (about 0.4 ms/GiB). A chunk
    /// with a block lent, granted or still in use on the GPU stays. See
    /// [`EmptyCache::pool_bytes`] for what the driver keeps regardless.
    ///
    /// Refused with
    /// [`PoolError::CurrentPoolChanged`](crate::advanced::pool::PoolError::CurrentPoolChanged)
    /// when something else made its own pool the device's current pool.
    pub fn empty_cache(&self) -> Result<EmptyCache, Error> {
        self.shared.check_loop()?;
        let device_free = || {
            self.shared
                .driver
                .use_device(self.shared.options.device)
                .and_then(|()| self.shared.driver.mem_get_info())
                .map(|(free, _)| free)
                .ok()
        };
        let free_before = device_free();
        let mut out = self.ask_loop(|reply| LoopCommand::ReleaseArena { reply })?;
        for (i, pool) in self.shared.pools.iter().enumerate() {
            if let Some(r) = pool.rotate()? {
                out.pools_rotated += 1;
                let offered = self.ask_loop(|reply| LoopCommand::OfferPool {
                    pool: i,
                    handle: r.current,
                    reply,
                })?;
                out.workers_not_answered =
                    out.workers_not_answered.max(offered.workers_not_answered);
            }
        }
        for pool in &self.shared.pools {
            let (before, after) = pool.trim()?;
            out.pool_bytes += before.saturating_sub(after);
            for handle in pool.idle_retired()? {
                // The parent's pool first, then the workers' imports of it: the order in
                // which the memory was measured coming back (bench/probes/export_destroy.py).
                match pool.destroy_retired(handle) {
                    Ok(()) => out.pools_retired += 1,
                    // Another thread's empty_cache destroyed it meanwhile, and tells the
                    // workers.
                    Err(poolipc_pool::PoolError::NotRetired { .. }) => continue,
                    Err(e) => return Err(e.into()),
                }
                let retired = self.ask_loop(|reply| LoopCommand::RetirePool { handle, reply })?;
                out.workers_not_answered =
                    out.workers_not_answered.max(retired.workers_not_answered);
            }
        }
        if let (Some(before), Some(after)) = (free_before, device_free()) {
            out.device_bytes_back = after.saturating_sub(before);
        }
        tracing::debug!(?out, "empty_cache");
        Ok(out)
    }

    /// Test-only: makes the parent's IO thread panic, as a bug of its own would, to check
    /// that every waiter then gets [`Error::IoThreadStopped`] rather than hanging. Never call
    /// it otherwise: the parent can do nothing after it. Returns once the panic is recorded
    /// (at most 10 s), so that every later call is refused whichever room it goes to. Only
    /// with the `testing` feature.
    #[cfg(feature = "testing")]
    pub fn panic_io_thread(&self) {
        self.shared.post(LoopCommand::Panic);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while lock(&self.shared.io_stopped).is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Posts the command `make` builds to the IO loop and waits for its `EmptyCache` reply.
    fn ask_loop(
        &self,
        make: impl Fn(std::sync::mpsc::Sender<EmptyCache>) -> LoopCommand,
    ) -> Result<EmptyCache, Error> {
        // Every room serves its own workers: each is asked, and the answers add up.
        let mut out = EmptyCache::default();
        let answers: Vec<_> = (0..self.shared.rooms.len())
            .map(|room| {
                let (tx, rx) = std::sync::mpsc::channel();
                self.shared.post_to(room, make(tx));
                rx
            })
            .collect();
        for rx in answers {
            out.add(&rx.recv().map_err(|_| self.shared.loop_gone())?);
        }
        Ok(out)
    }
}

impl Drop for Parent {
    fn drop(&mut self) {
        if std::process::id() != self.shared.creator {
            // A forked child: the IO threads are the parent process's; there is none to join.
            for io in self.io.drain(..) {
                std::mem::forget(io);
            }
            return;
        }
        self.shared.post(LoopCommand::Shutdown);
        for io in self.io.drain(..) {
            if io.join().is_err() {
                tracing::error!("the parent's IO thread panicked");
            }
        }
        if let Some(sim) = &self.shared.sim {
            sim.summary(&[]);
        }
        crate::probe::dump();
    }
}
