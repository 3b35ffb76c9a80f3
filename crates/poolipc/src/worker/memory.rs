//! Where a job's tensors live in the worker: input views over imports, arena blocks, VMM
//! mappings or staged copies; result memory; the parent's extra pools and arena chunks.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use poolipc_contract::{self as contract, AllocId, HandoffId};
use poolipc_driver::{DevicePtr, PoolAllocation};
use poolipc_pool::{ArenaError, ArenaMapping, AttachedPool};
use poolipc_transport::{
    ArenaChunk, ArenaRelease, ExtraPool, ExtraPoolReply, JobId, LentTensor, Message, PoolRetire,
};

use super::device::{find_device, reaches};
use crate::error::Error;
use crate::tensor::Rung;

use super::{InputView, SEND_TIMEOUT, StagedCopy, Worker, failpoint};

impl Worker {
    /// The view of one lent tensor: the import at its offset (pool pointer), the parent's
    /// copy in the arena through this worker's mapping (arena copy, read-only), or this
    /// process's copy (host staging, read-only).
    pub(super) fn input_view(
        &mut self,
        job: contract::JobId,
        t: LentTensor,
    ) -> Result<InputView, Error> {
        let ptr = match t.rung {
            Rung::PoolPointer => match self.imports.get(&t.alloc) {
                Some(i) => i.ptr.offset(t.meta.byte_offset),
                None => {
                    return Err(match self.failed_imports.get(&t.alloc) {
                        Some(why) => Error::InvalidTensor(format!(
                            "input {:?}: the import of allocation {:?} failed: {why}",
                            t.handle, t.alloc
                        )),
                        None => Error::Protocol(format!(
                            "input {:?}: allocation {:?} is not imported",
                            t.handle, t.alloc
                        )),
                    });
                }
            },
            Rung::HostStaging => {
                self.staged
                    .get(&t.handle)
                    .map(StagedCopy::ptr)
                    .ok_or_else(|| {
                        Error::Protocol(format!("staged input {:?} was never received", t.handle))
                    })?
            }
            Rung::ArenaCopy => {
                let Some(at) = t.arena else {
                    return Err(Error::Protocol(format!(
                        "arena-copy input {:?} without its arena location",
                        t.handle
                    )));
                };
                // The block holds the tensor's bytes from its byte offset on: all of it must
                // lie inside a chunk this worker mapped.
                let len = t
                    .meta
                    .byte_offset
                    .checked_add(t.meta.byte_len)
                    .ok_or_else(|| {
                        Error::Protocol(format!(
                            "arena-copy input {:?}: byte offset {} and length {} overflow",
                            t.handle, t.meta.byte_offset, t.meta.byte_len
                        ))
                    })?;
                let mapping = self
                    .arena
                    .as_mut()
                    .ok_or(Error::Arena(ArenaError::UnknownChunk { chunk: at.chunk }))?;
                // Lent read-only: through the chunk's read-only mapping, so a write faults.
                let block = if t.read_only {
                    mapping.resolve_read_only(at.chunk, at.offset, len)?
                } else {
                    mapping.resolve(at.chunk, at.offset, len)?
                };
                block.offset(t.meta.byte_offset)
            }
            // The parent's VMM allocation through the mapping its share made (once, or long
            // ago): held for this job until its DONE is recorded.
            Rung::VmmHandle => self.vmm.resolve(
                job,
                t.alloc,
                t.meta.byte_offset,
                t.meta.byte_len,
                t.read_only,
            )?,
            other => {
                return Err(Error::Protocol(format!(
                    "input {:?} on rung {other}, which this worker does not take",
                    t.handle
                )));
            }
        };
        Ok(InputView {
            ptr,
            desc: t.meta.layout,
            byte_len: t.meta.byte_len,
            rung: t.rung,
            read_only: t.read_only,
        })
    }

    /// The memory of one granted result: the import (pool pointer), or memory of this
    /// process sent to the parent when the job finishes (host staging).
    pub(super) fn result_memory(
        &mut self,
        job: JobId,
        handle: HandoffId,
        alloc: AllocId,
        rung: Rung,
        bytes: u64,
    ) -> Result<DevicePtr, Error> {
        match rung {
            Rung::PoolPointer => self.imports.get(&alloc).map(|i| i.ptr).ok_or_else(|| {
                Error::Protocol(format!(
                    "result {handle:?} of job {}: allocation {alloc:?} is not imported",
                    job.0
                ))
            }),
            Rung::HostStaging => {
                let alloc = PoolAllocation::new(
                    Arc::clone(&self.driver),
                    bytes.max(1),
                    self.stream.handle(),
                )?;
                let ptr = alloc.ptr();
                self.staged.insert(handle, StagedCopy { job, alloc, bytes });
                Ok(ptr)
            }
            other => Err(Error::Protocol(format!(
                "result {handle:?} on rung {other}, which this worker does not take"
            ))),
        }
    }

    /// The address of an arena result: `bytes` at `offset` of chunk `chunk`, which must lie
    /// inside a chunk this worker mapped and hold the `needed` bytes asked for. Anything
    /// else is malformed input: a typed error, nothing touched.
    pub(super) fn arena_memory(
        &self,
        chunk: u32,
        offset: u64,
        bytes: u64,
        needed: u64,
    ) -> Result<DevicePtr, Error> {
        let mapping = self
            .arena
            .as_ref()
            .ok_or(Error::Arena(ArenaError::UnknownChunk { chunk }))?;
        let ptr = mapping.resolve(chunk, offset, bytes)?;
        if bytes < needed {
            return Err(Error::Protocol(format!(
                "an arena grant of {bytes} bytes (chunk {chunk}, offset {offset}) for a result \
                 of {needed}"
            )));
        }
        Ok(ptr)
    }

    /// Maps a chunk of the parent's result arena from the FD that came with its frame.
    pub(super) fn take_arena_chunk(
        &mut self,
        c: ArenaChunk,
        fds: Vec<OwnedFd>,
    ) -> Result<(), Error> {
        let Some(fd) = fds.into_iter().next() else {
            return Err(Error::Protocol("an ArenaChunk without its FD".into()));
        };
        let (driver, device) = (Arc::clone(&self.driver), self.device);
        let mapping = self
            .arena
            .get_or_insert_with(|| ArenaMapping::new(driver, device));
        let base = mapping.map_chunk(c.index, c.len, fd.as_fd())?;
        tracing::debug!(chunk = c.index, len = c.len, ?base, "arena chunk mapped");
        Ok(())
    }

    /// Unmaps a chunk of the parent's arena that the parent gave back to the device, and says
    /// so. No block in it is lent or granted (the parent releases only idle chunks), so no
    /// work of this worker's can still reach it. A chunk never mapped here is answered too.
    pub(super) fn release_arena_chunk(&mut self, r: ArenaRelease) -> Result<(), Error> {
        match self.arena.as_mut().map(|m| m.unmap_chunk(r.index)) {
            Some(Ok(())) => tracing::debug!(chunk = r.index, "arena chunk unmapped"),
            None | Some(Err(ArenaError::UnknownChunk { .. })) => {
                tracing::debug!(
                    chunk = r.index,
                    "a released arena chunk that was not mapped here"
                );
            }
            // The chunk is forgotten either way; what could not be undone is logged inside.
            Some(Err(e)) => {
                tracing::warn!(chunk = r.index, error = %e, "unmapping a released arena chunk failed")
            }
        }
        self.conn.send(
            &Message::ArenaReleased(r),
            &[],
            Instant::now() + SEND_TIMEOUT,
        )?;
        self.last_frame = Instant::now();
        Ok(())
    }

    /// Attaches another of the parent's pools if this worker's device can use it, and says so.
    pub(super) fn take_extra_pool(&mut self, offer: ExtraPool, fd: OwnedFd) -> Result<(), Error> {
        if offer.index == 0 || self.pools.contains_key(&offer.index) {
            return Err(Error::Protocol(format!(
                "ExtraPool {} where that index is taken (free indices are 1..=255 not in use)",
                offer.index
            )));
        }
        failpoint("before-extra-pool-reply");
        let attached = self.attach_extra_pool(offer.device, &fd);
        let reply = ExtraPoolReply {
            index: offer.index,
            reachable: attached.is_ok(),
            reason: attached.as_ref().err().cloned().unwrap_or_default(),
        };
        match &attached {
            Ok(_) => tracing::debug!(
                index = offer.index,
                "attached another of the parent's pools"
            ),
            Err(why) => {
                tracing::info!(index = offer.index, %why, "cannot use one of the parent's pools")
            }
        }
        self.pools.insert(offer.index, attached);
        self.conn.send(
            &Message::ExtraPoolReply(reply),
            &[],
            Instant::now() + SEND_TIMEOUT,
        )?;
        Ok(())
    }

    pub(super) fn attach_extra_pool(
        &self,
        uuid: poolipc_transport::DeviceUuid,
        fd: &OwnedFd,
    ) -> Result<AttachedPool, String> {
        let d = &*self.driver;
        let pool_device = find_device(d, uuid).map_err(|e| e.to_string())?;
        if !reaches(d, self.device, pool_device)? {
            return Err(format!(
                "device {} cannot reach device {pool_device} ({uuid}): no peer path",
                self.device
            ));
        }
        // Access from the device this worker works on (a peer grant when it is another).
        AttachedPool::attach(Arc::clone(&self.driver), fd.as_fd(), self.device)
            .map_err(|e| e.to_string())
    }

    /// The imported handle of the parent's pool `index`.
    pub(super) fn pool_handle(&self, index: u8) -> Result<poolipc_driver::PoolHandle, Error> {
        match self.pools.get(&index) {
            Some(Ok(p)) => Ok(p.pool.handle()),
            Some(Err(why)) => Err(Error::Protocol(format!(
                "a tensor by pointer from the parent's pool {index}, which this worker cannot use ({why})"
            ))),
            None => Err(Error::Protocol(format!(
                "a tensor by pointer from the parent's pool {index}, never offered (or retired)"
            ))),
        }
    }

    /// Destroys this worker's import of the parent's pool `index`, which the parent retired
    /// (nothing of it is in use: no import of it can be live here), and says so. An index not
    /// in the table is answered too. The pool's exported memory goes back to the device once
    /// the parent and every worker that imported it destroyed theirs.
    pub(super) fn retire_pool(&mut self, r: PoolRetire) -> Result<(), Error> {
        match self.pools.remove(&r.index) {
            Some(Ok(p)) => {
                // The stream-ordered frees of this pool's imports have run before the destroy,
                // and the context is synchronized after it, as in the probe that measured the
                // memory coming back (`bench/probes/export_destroy.py`). Without these (and
                // with the parent destroying its pool after the workers) the memory stayed
                // held on the H200 until this process exited (docs/facts.md).
                self.driver.stream_synchronize(self.stream.handle())?;
                let closed = p.pool.close();
                if closed.is_ok() {
                    self.driver.ctx_synchronize()?;
                }
                if let Err(e) = closed {
                    let e = Error::from(e);
                    if e.is_context_lost() {
                        return Err(e);
                    }
                    tracing::warn!(index = r.index, error = %e, "destroying a retired pool's import failed");
                } else {
                    tracing::debug!(index = r.index, "retired pool's import destroyed");
                }
            }
            Some(Err(_)) | None => {
                tracing::debug!(index = r.index, "a retired pool that was not attached here");
            }
        }
        self.conn
            .send(&Message::PoolRetired(r), &[], Instant::now() + SEND_TIMEOUT)?;
        self.last_frame = Instant::now();
        Ok(())
    }
}
