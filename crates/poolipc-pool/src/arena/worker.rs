//! `ArenaMapping`: the parent's arena chunks as one worker mapped them.

use std::collections::BTreeMap;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use poolipc_driver::{Access, DevicePtr, Driver, Granularity, VmmAllocation, VmmMapping};

use super::{ArenaError, MappedChunk, map_handle, map_handle_with, unmap, unmap_alias};

/// The arena chunks a worker has mapped, and the bounds check between the wire and a device
/// pointer.
///
/// Each chunk is imported from the FD the parent sent, given its own address range, and
/// mapped read-write for the worker's device, once per worker. A grant names a block as
/// `(chunk, offset, len)`; [`resolve`](ArenaMapping::resolve) turns that into a pointer only
/// when the range lies inside a mapped chunk. `Drop` unmaps every chunk.
///
/// A block lent read-only ([`resolve_read_only`](ArenaMapping::resolve_read_only)) is read
/// through a second mapping of its chunk granted read access only, made the first time a
/// read-only block of that chunk is asked for: `cuMemSetAccess` must cover whole mappings and
/// `cuMemMap`'s offset must be 0, so one block cannot be made read-only inside the read-write
/// mapping. The alias costs an address range and page-table entries the size of the chunk,
/// no memory; a write through it faults on the GPU (`CUDA_ERROR_ILLEGAL_ADDRESS`) or fails
/// the copy that tried it, instead of vanishing.
pub struct ArenaMapping<D: Driver + ?Sized> {
    driver: Arc<D>,
    device: u32,
    chunks: BTreeMap<u32, MappedChunk<D>>,
    /// Read-only aliases of chunks, by index. Each is unmapped before its chunk.
    read_only: BTreeMap<u32, VmmMapping<Arc<D>>>,
}

impl<D: Driver + ?Sized> std::fmt::Debug for ArenaMapping<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaMapping")
            .field("device", &self.device)
            .field("chunks", &self.chunks)
            .finish_non_exhaustive()
    }
}

impl<D: Driver + ?Sized> ArenaMapping<D> {
    /// No chunks mapped yet; `device` is the worker's device (the one granted access).
    #[must_use]
    pub fn new(driver: Arc<D>, device: u32) -> ArenaMapping<D> {
        ArenaMapping {
            driver,
            device,
            chunks: BTreeMap::new(),
            read_only: BTreeMap::new(),
        }
    }

    /// Imports chunk `index` of `len` bytes from `fd` (`cuMemImportFromShareableHandle`),
    /// reserves address space, maps it and grants this worker's device read-write access.
    /// Returns the chunk's base address here. The caller keeps `fd` (it may close it after).
    ///
    /// The calling thread must have made the device current ([`Driver::use_device`]).
    /// Mapping an index twice is [`ArenaError::AlreadyMapped`]; a length that is 0 or not a
    /// multiple of the driver's granularity is [`ArenaError::BadChunkLen`], checked before
    /// any driver call that changes state.
    pub fn map_chunk(
        &mut self,
        index: u32,
        len: u64,
        fd: BorrowedFd<'_>,
    ) -> Result<DevicePtr, ArenaError> {
        if self.chunks.contains_key(&index) {
            return Err(ArenaError::AlreadyMapped { chunk: index });
        }
        let granularity = self
            .driver
            .vmm_granularity(self.device, Granularity::Minimum)?;
        if len == 0 || granularity == 0 || !len.is_multiple_of(granularity) {
            return Err(ArenaError::BadChunkLen {
                chunk: index,
                len,
                granularity,
            });
        }
        let handle = VmmAllocation::import_fd(Arc::clone(&self.driver), fd)?;
        // A failed mapping releases the import (dropped inside, logged).
        let chunk = map_handle(&self.driver, self.device, handle, len)?;
        let base = chunk.base();
        self.chunks.insert(index, chunk);
        tracing::debug!(index, len, ?base, "arena chunk mapped");
        Ok(base)
    }

    /// The address of `len` bytes at `offset` in chunk `chunk`, when that range lies inside
    /// a chunk this worker mapped; otherwise a typed error naming all three and nothing is
    /// touched. An empty range is refused too: the arena never grants one.
    pub fn resolve(&self, chunk: u32, offset: u64, len: u64) -> Result<DevicePtr, ArenaError> {
        let c = self
            .chunks
            .get(&chunk)
            .ok_or(ArenaError::UnknownChunk { chunk })?;
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= c.len() => Ok(c.base().offset(offset)),
            _ => Err(ArenaError::OutOfBounds {
                chunk,
                offset,
                len,
                chunk_len: c.len(),
            }),
        }
    }

    /// [`resolve`](Self::resolve) through the chunk's read-only alias, mapped (read access
    /// only, for this worker's device) the first time it is asked for. The same bounds
    /// checks; a driver call that fails while mapping the alias is an error and leaves no
    /// alias behind.
    pub fn resolve_read_only(
        &mut self,
        chunk: u32,
        offset: u64,
        len: u64,
    ) -> Result<DevicePtr, ArenaError> {
        let rw = self.resolve(chunk, offset, len)?;
        let base = match self.read_only.get(&chunk) {
            Some(alias) => alias.ptr(),
            None => {
                let c = self
                    .chunks
                    .get(&chunk)
                    .ok_or(ArenaError::UnknownChunk { chunk })?;
                let alias = map_handle_with(
                    &self.driver,
                    self.device,
                    c.handle.handle(),
                    c.len(),
                    Access::Read,
                )?;
                let base = alias.ptr();
                tracing::debug!(chunk, len = c.len(), ?base, "arena chunk mapped read-only");
                self.read_only.insert(chunk, alias);
                base
            }
        };
        let c_base = self.chunks.get(&chunk).map_or(rw, |c| c.base());
        Ok(base.offset(rw.0 - c_base.0))
    }

    /// Unmaps chunk `index` (and its read-only alias), frees its address range and releases
    /// the import. Every step is tried; the first failure is returned. The chunk is forgotten
    /// either way.
    pub fn unmap_chunk(&mut self, index: u32) -> Result<(), ArenaError> {
        let chunk = self
            .chunks
            .remove(&index)
            .ok_or(ArenaError::UnknownChunk { chunk: index })?;
        let alias = match self.read_only.remove(&index) {
            Some(alias) => unmap_alias(alias),
            None => Ok(()),
        };
        let unmapped = unmap(chunk);
        Ok(alias.and(unmapped)?)
    }

    /// The length of chunk `index`, if mapped.
    #[must_use]
    pub fn chunk_len(&self, index: u32) -> Option<u64> {
        self.chunks.get(&index).map(MappedChunk::len)
    }

    /// How many chunks are mapped.
    #[must_use]
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether no chunk is mapped.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// The worker's device.
    #[must_use]
    pub fn device(&self) -> u32 {
        self.device
    }
}

impl<D: Driver + ?Sized> Drop for ArenaMapping<D> {
    fn drop(&mut self) {
        for (index, chunk) in std::mem::take(&mut self.chunks) {
            // Failures are logged inside; a destructor has no one to return them to.
            if let Some(alias) = self.read_only.remove(&index) {
                let _ = unmap_alias(alias);
            }
            let _ = unmap(chunk);
        }
    }
}

#[cfg(test)]
#[path = "worker_tests.rs"]
mod tests;
