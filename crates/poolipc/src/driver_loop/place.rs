//! Where each input goes: by pool pointer, by VMM handle, by a copy into the arena, or by
//! host staging, and why not the rung above (the reason each tensor reports).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use poolipc_contract::{ArenaLocation, FailReason, InputLoan, Message};
use poolipc_driver::DevicePtr;
use poolipc_transport::VmmShare;
use poolipc_types::{AllocId, ExportBlob, Rung, Span, WorkerId};

use super::Shared;
use super::{Loop, Submission};
use crate::error::Error;
use crate::state::{ArenaLease, Stats, lock};

impl Loop {
    /// Chooses each input's rung and exports what goes by pointer. Fails (sending nothing)
    /// on a tensor that cannot be lent.
    pub(super) fn place(&mut self, sub: &Submission) -> Result<Placed, Error> {
        let pointer_pools = self
            .shared
            .pointer_pools(sub.worker)
            .ok_or(Error::UnknownWorker(sub.worker))?;
        let takes_staging = self
            .workers
            .get(&sub.worker)
            .is_some_and(|s| s.takes_staging);
        let limit = self.shared.limit();
        let driver = Arc::clone(&self.shared.driver);
        let mut placed = Placed::default();
        for (i, input) in sub.inputs.iter().enumerate() {
            let extent = input
                .desc
                .extent_bytes()
                .map_err(|e| Error::InvalidTensor(format!("input {i}: {e}")))?;
            // One query for the range, the pool and the buffer id (each costs microseconds
            // under MPS).
            let info = driver.pointer_info(input.ptr).map_err(|e| {
                Error::InvalidTensor(format!(
                    "input {i} at {:?} is not device memory this process can see: {e}",
                    input.ptr
                ))
            })?;
            let (base, size) = (info.base, info.size);
            let offset = input.ptr.0 - base.0;
            if offset.saturating_add(extent) > size {
                return Err(Error::InvalidTensor(format!(
                    "input {i} at {:?} runs {} bytes past its allocation",
                    input.ptr,
                    offset + extent - size
                )));
            }
            let pool = info.pool.and_then(|h| self.shared.pool_of(h));
            // The worker's index of the pointer's pool (generation), if it takes pointers of it.
            let wire = info.pool.and_then(|h| {
                pointer_pools
                    .iter()
                    .find(|(ph, _)| *ph == h)
                    .map(|(_, i)| *i)
            });
            let by_pointer = wire.is_some() && limit.allows(base.0, size);
            if let (true, Some(p), Some(wire)) = (by_pointer, pool, wire) {
                let export = self.shared.pools[p].export_known(base, size, info.buffer_id)?;
                let alloc = self.loans.pointer_id(base.0);
                placed.inputs.push(Placement {
                    loan: InputLoan {
                        alloc,
                        span: Span {
                            ptr: base.0,
                            bytes: size,
                        },
                        rung: Rung::PoolPointer,
                        pool: wire,
                        export,
                        meta: crate::tensor::meta(&input.desc, offset, extent),
                        arena: None,
                        read_only: input.read_only,
                    },
                    reason: None,
                    copy: None,
                });
                continue;
            }
            let mut why_not = why_not_pointer(
                &self.shared,
                sub.worker,
                pool.zip(info.pool),
                limit.check(base.0, size).err(),
            );
            // Memory of no pool of ours on the parent's device may be a VMM allocation whose
            // handle can be lent: no copy.
            if pool.is_none() && info.device == Some(self.shared.options.device) {
                match self.vmm_handle(sub, base, size, info.buffer_id) {
                    Ok((alloc, how)) => {
                        let reason = format!("input {i}: {why_not}: vmm handle ({how})");
                        tracing::debug!(worker = %sub.worker, job = sub.job.0, input = i, bytes = extent, "{reason}");
                        placed.inputs.push(Placement {
                            loan: InputLoan {
                                alloc,
                                span: Span {
                                    ptr: base.0,
                                    bytes: size,
                                },
                                rung: Rung::VmmHandle,
                                pool: 0,
                                export: ExportBlob([0; 64]),
                                meta: crate::tensor::meta(&input.desc, offset, extent),
                                arena: None,
                                read_only: input.read_only,
                            },
                            reason: Some(reason),
                            copy: None,
                        });
                        continue;
                    }
                    Err(NoCopy::Failed(e)) => return Err(e),
                    Err(NoCopy::Declined(why)) => {
                        why_not = format!("{why_not}, and no VMM handle to lend ({why})");
                    }
                }
            }
            let no_copy = match self.arena_copy(sub, pool, info.device, input.ptr, extent) {
                Ok(copy) => {
                    let reason = format!("input {i}: {why_not}: arena copy ({})", copy.why);
                    tracing::debug!(worker = %sub.worker, job = sub.job.0, input = i, bytes = extent, "{reason}");
                    let alloc = self.loans.new_id();
                    placed.inputs.push(Placement {
                        loan: InputLoan {
                            alloc,
                            span: copy.span,
                            rung: Rung::ArenaCopy,
                            pool: 0,
                            export: ExportBlob([0; 64]),
                            meta: crate::tensor::meta(&input.desc, 0, extent),
                            arena: Some(copy.location),
                            read_only: input.read_only,
                        },
                        reason: Some(reason),
                        copy: Some(copy.lease),
                    });
                    continue;
                }
                Err(NoCopy::Failed(e)) => return Err(e),
                Err(NoCopy::Declined(why)) => why,
            };
            if !takes_staging {
                return Err(Error::NoRung(format!(
                    "input {i} cannot go by pool pointer ({why_not}), no arena copy ({no_copy}), \
                     and {} has no host staging",
                    sub.worker
                )));
            }
            let reason = format!("input {i}: {why_not}: host staging: {no_copy}");
            tracing::debug!(worker = %sub.worker, job = sub.job.0, input = i, bytes = extent, "{reason}");
            let alloc = self.loans.new_id();
            placed.inputs.push(Placement {
                loan: InputLoan {
                    alloc,
                    span: Span {
                        ptr: input.ptr.0,
                        bytes: extent,
                    },
                    rung: Rung::HostStaging,
                    pool: 0,
                    export: ExportBlob([0; 64]),
                    meta: crate::tensor::meta(&input.desc, 0, extent),
                    arena: None,
                    read_only: input.read_only,
                },
                reason: Some(reason),
                copy: None,
            });
            placed.staged = true;
        }
        Ok(placed)
    }

    /// Lends the VMM allocation `[base, base + size)` by handle to the job's worker, when
    /// the rung may carry it: the option is on, the worker takes VMM handles, the driver
    /// gives the allocation a buffer id (how a later lend knows it is the same allocation,
    /// not a new one at the same address), and the allocation is a VMM mapping made with the
    /// POSIX FD handle type. A worker that mapped this allocation already (same address,
    /// size and buffer id) gets nothing: no driver call, no frame. Otherwise the handle is
    /// retained (`cuMemRetainAllocationHandle`), exported as an FD, released again, and the
    /// FD sent in a `VmmShare` frame ahead of the job's `Lend`. Returns the allocation's id
    /// and how, or why not (the input then takes the arena copy); a lost send fails the job.
    pub(super) fn vmm_handle(
        &mut self,
        sub: &Submission,
        base: DevicePtr,
        size: u64,
        buffer_id: Option<u64>,
    ) -> Result<(AllocId, String), NoCopy> {
        if !self.shared.options.vmm_handles {
            return Err(NoCopy::Declined(
                "lending by VMM handle is off (ParentOptions::vmm_handles)".into(),
            ));
        }
        if !self.workers.get(&sub.worker).is_some_and(|s| s.takes_vmm) {
            return Err(NoCopy::Declined(format!(
                "{} takes no VMM handles (no VMM by POSIX FD, or not on the parent's device)",
                sub.worker
            )));
        }
        let Some(buffer_id) = buffer_id else {
            return Err(NoCopy::Declined(
                "the driver gives it no buffer id, so a worker's mapping could not be told \
                 from a new allocation at its address"
                    .into(),
            ));
        };
        if let Some(alloc) = self
            .loans
            .vmm_mapped_by(base.0, size, buffer_id, sub.worker)
        {
            return Ok((alloc, "mapped by the worker already".into()));
        }
        let fd = self.export_vmm(base)?;
        let alloc = self.loans.vmm_id(base.0, size, buffer_id);
        let Some(slot) = self.workers.get_mut(&sub.worker) else {
            return Err(NoCopy::Failed(Error::UnknownWorker(sub.worker)));
        };
        let message = Message::VmmShare(VmmShare {
            alloc,
            base: base.0,
            len: size,
        });
        // A job is placed on a worker only once its staged job (whose transfer may have the
        // socket) has ended.
        let sent = match slot.conn.as_mut() {
            Some(conn) => conn
                .enqueue(&message, &[fd.as_fd()])
                .map_err(|e| e.to_string()),
            None => Err("a staging transfer has the worker's socket".into()),
        };
        if let Err(e) = sent {
            let why = format!("sending a VMM handle failed: {e}");
            self.lose(sub.worker, &why);
            return Err(NoCopy::Failed(Error::JobFailed {
                worker: sub.worker,
                reason: FailReason::HungUp,
                detail: why,
                results: Vec::new(),
            }));
        }
        Stats::bump(&self.shared.stats.vmm_handles_shared);
        self.loans.vmm_sent(base.0, sub.worker);
        tracing::debug!(worker = %sub.worker, ?alloc, size, "VMM handle sent");
        Ok((alloc, "handle sent".into()))
    }

    /// The POSIX FD of the VMM allocation mapped at `base`: its handle retained, checked for
    /// the POSIX FD handle type, exported, and released again (the FD and the worker's import
    /// keep what they need). Memory that is no VMM mapping, or one made without that handle
    /// type, is declined with the reason; a lost context fails the job.
    pub(super) fn export_vmm(&self, base: DevicePtr) -> Result<OwnedFd, NoCopy> {
        let d = &*self.shared.driver;
        let declined = |what: &str, e: poolipc_driver::DriverError| {
            if e.is_context_lost() {
                NoCopy::Failed(e.into())
            } else {
                NoCopy::Declined(format!("{what}: {e}"))
            }
        };
        // The retained reference only serves the export: released when dropped below.
        let retained = poolipc_driver::VmmAllocation::retain(d, base)
            .map_err(|e| declined("not a VMM allocation", e))?;
        let handle = retained.handle();
        let fd = match d.vmm_exports_fd(handle) {
            Ok(true) => d
                .vmm_export_fd(handle)
                .map_err(|e| declined("its handle could not be exported", e)),
            Ok(false) => Err(NoCopy::Declined(
                "a VMM allocation made without the POSIX FD handle type, which cannot be shared"
                    .into(),
            )),
            Err(e) => Err(declined("its handle's properties could not be read", e)),
        };
        if let Err(e) = retained.close() {
            tracing::warn!(error = %e, "releasing a retained VMM handle failed");
        }
        fd
    }

    /// Forgets which VMM allocations `worker` mapped: it was reaped, or it was told to drop
    /// its cached mappings (`Worker::release_cached_mappings`). An allocation lent to it
    /// again is sent again first. Whoever sends the worker that order calls this at the
    /// same time.
    pub(crate) fn forget_vmm_shares(&mut self, worker: WorkerId) {
        self.loans.forget_vmm(worker);
    }

    /// Copies an input (`bytes` from element 0 at `src`) into a block of the arena, queued on
    /// the job's stream now, before the job's READY is recorded, when the arena-copy rung may
    /// carry it: the option is on, the memory is device memory of the parent's device (its
    /// shared pool's, or any other kind the pointer's attributes place there: `cuMemAlloc`,
    /// another pool, a VMM mapping), the worker maps the arena, the arena has room (or VRAM is free for
    /// more, with the margin to spare) and the chunk reached the worker. Otherwise says why
    /// not, and the input takes host staging; a driver call that fails on the way fails the
    /// job.
    pub(super) fn arena_copy(
        &mut self,
        sub: &Submission,
        pool: Option<usize>,
        device: Option<u32>,
        src: DevicePtr,
        bytes: u64,
    ) -> Result<ArenaCopy, NoCopy> {
        let options = &self.shared.options;
        if !self.shared.arena_copy_on.load(Ordering::Relaxed) {
            return Err(NoCopy::Declined(
                "arena copy is off (ParentOptions::arena_copy)".into(),
            ));
        }
        if bytes == 0 {
            return Err(NoCopy::Declined("an empty tensor needs no copy".into()));
        }
        // Pool 0 is the parent's device's; another of the parent's pools is another device's.
        // Memory of no pool of ours is copied when its attributes place it on the parent's
        // device: the copy is then device-to-device on one GPU.
        let on_parent_device = match pool {
            Some(p) => p == 0,
            None => device == Some(options.device),
        };
        if !on_parent_device {
            let found = match (pool, device) {
                (Some(p), _) => format!("memory of the parent's pool {p}"),
                (None, Some(d)) => format!("device memory of device {d}"),
                (None, None) => "not device memory (host or managed memory)".to_owned(),
            };
            return Err(NoCopy::Declined(format!(
                "only device memory of the parent's device {} is copied into the arena, this \
                 is {found}",
                options.device
            )));
        }
        if !self.workers.get(&sub.worker).is_some_and(|s| s.maps_arena) {
            return Err(NoCopy::Declined(format!(
                "{} does not map the arena (no VMM by POSIX FD, or not on the parent's device)",
                sub.worker
            )));
        }
        let room = lock(&self.shared.arenas).live(sub.worker).is_some_and(|a| {
            // Blocks given back whose work completed count as free.
            a.reclaim();
            a.stats().largest_free >= bytes
        });
        let why = if room {
            "room in the arena".to_owned()
        } else {
            let (free, _) = self
                .shared
                .driver
                .mem_get_info()
                .map_err(|e| NoCopy::Failed(e.into()))?;
            let margin = options.arena_copy_vram_margin;
            if free < bytes.saturating_add(margin) {
                return Err(NoCopy::Declined(format!(
                    "only {} of VRAM free, the copy needs {} and {} to spare",
                    human_bytes(free),
                    human_bytes(bytes),
                    human_bytes(margin)
                )));
            }
            format!("VRAM free {}", human_bytes(free))
        };
        let arena = self
            .ensure_arena(sub.worker, bytes)
            .map_err(|e| NoCopy::Declined(format!("the arena could not be made: {e}")))?;
        let block = arena
            .alloc(bytes)
            .map_err(|e| NoCopy::Declined(format!("no arena block for it: {e}")))?;
        // Owned from here: dropped on any path below, the block goes back stream-ordered.
        let lease = ArenaLease::new(Arc::clone(&arena), block, sub.stream);
        self.announce_chunks(Some(sub.worker));
        let sent = self
            .workers
            .get(&sub.worker)
            .is_some_and(|s| s.maps_arena && s.arena_chunks_sent > block.chunk);
        if !sent {
            return Err(NoCopy::Declined(format!(
                "arena chunk {} could not be sent to {}",
                block.chunk, sub.worker
            )));
        }
        super::bounce::copy_on_device(
            &mut self.bounce,
            &self.shared,
            block.ptr,
            src,
            bytes,
            sub.stream,
        )
        .map_err(|e| NoCopy::Failed(e.into()))?;
        tracing::trace!(worker = %sub.worker, job = sub.job.0, ?block, bytes, "input copied into the arena");
        Ok(ArenaCopy {
            lease,
            location: ArenaLocation {
                chunk: block.chunk,
                offset: block.offset,
            },
            span: Span {
                ptr: block.ptr.0,
                bytes: block.len,
            },
            why,
        })
    }
}

/// Where each input of a job goes, in the caller's order, and whether any takes host staging
/// (the job then runs alone on its worker).
#[derive(Default)]
pub(crate) struct Placed {
    pub(super) inputs: Vec<Placement>,
    pub(super) staged: bool,
}

/// One input's place: its loan (the rung is the loan's), why it did not go by pool pointer,
/// and the arena block holding its copy (arena copy). Dropped before the job is lent (a later
/// input refused), a block goes back stream-ordered after its copy.
pub(crate) struct Placement {
    pub(super) loan: InputLoan,
    pub(super) reason: Option<String>,
    pub(super) copy: Option<ArenaLease>,
}

/// An arena-copy input of a job in flight: the block holding the copy and where to copy it
/// back.
pub(super) struct ArenaInput {
    /// The block: given back (stream-ordered) when dropped.
    pub(super) lease: ArenaLease,
    /// The block in this process.
    pub(super) block: DevicePtr,
    /// The caller's tensor (element 0).
    pub(super) src: DevicePtr,
    /// Bytes copied in, from element 0 to the end of the last element: copied back as many.
    pub(super) bytes: u64,
    /// Lent read-only: nothing is copied back.
    pub(super) read_only: bool,
}

/// An input copied into the arena, its copy queued on the job's stream.
pub(super) struct ArenaCopy {
    pub(super) lease: ArenaLease,
    pub(super) location: ArenaLocation,
    /// The block in this process.
    pub(super) span: Span,
    /// What made the copy possible, for the reason (free VRAM, or room in the arena).
    pub(super) why: String,
}

/// Why an input is not copied into the arena (or lent by VMM handle).
pub(super) enum NoCopy {
    /// Not for this input, worker or machine, in words: it takes host staging.
    Declined(String),
    /// A driver call failed on the way: the job fails.
    Failed(Error),
}

/// `bytes` for a person: `16 GiB`, `3.5 GiB`, `64 MiB`, `12 KiB`, `100 bytes`.
pub(super) fn human_bytes(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if bytes >= unit {
            return if bytes.is_multiple_of(unit) {
                format!("{} {name}", bytes / unit)
            } else {
                // One decimal, rounded down: enough to tell sizes apart in a log line.
                format!("{}.{} {name}", bytes / unit, bytes % unit * 10 / unit)
            };
        }
    }
    format!("{bytes} bytes")
}

/// Why an input does not go by pool pointer, in words (for the log and the error).
pub(super) fn why_not_pointer(
    shared: &Shared,
    worker: WorkerId,
    pool: Option<(usize, poolipc_driver::PoolHandle)>,
    limit: Option<poolipc_types::LimitExceeded>,
) -> String {
    if let Some(e) = limit {
        return format!(
            "{} over the import limit (it touches {} chunks of {}, pointer import allows at most \
             {})",
            human_bytes(e.bytes),
            e.chunks,
            human_bytes(e.chunk_bytes),
            e.max_chunks
        );
    }
    // The worker's table entry of the pool's generation: (reachable, being retired).
    let entry = |h: poolipc_driver::PoolHandle| {
        lock(&shared.registry).get(&worker).and_then(|r| {
            r.pools
                .values()
                .find(|p| p.handle == h)
                .map(|p| (p.reachable, p.retiring))
        })
    };
    let isolated = lock(&shared.registry)
        .get(&worker)
        .is_some_and(|r| r.info.trust.is_isolated());
    match pool {
        None => "it is not memory of this parent's pools".into(),
        Some(_) if isolated => {
            format!("{worker} is isolated (Trust::Isolated): it has no handle on the pool")
        }
        Some((p, h)) => match entry(h) {
            None => format!(
                "{worker} has not been given this generation of the parent's pool {p} (it was \
                 made by a rotation after the worker started, or was offered and refused)"
            ),
            Some((false, true)) | Some((true, true)) => {
                format!("this generation of the parent's pool {p} is being retired")
            }
            Some((false, false)) => {
                format!(
                    "{worker} cannot reach the parent's pool {p} from its device (or has not answered its offer yet)"
                )
            }
            Some((true, false)) => format!("{worker} was demoted by its canary battery"),
        },
    }
}
