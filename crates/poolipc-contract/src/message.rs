//! The messages of the wire protocol: one vocabulary, owned by the contract.
//!
//! The contract's machines take these in and emit them; the transport (`poolipc-transport`)
//! only encodes them and carries the file descriptors that [`MessageKind::expected_fds`]
//! names; the facade sends exactly what the machines emitted. The ids, dtypes, device UUIDs, blobs
//! and rungs they carry are `poolipc-types`', re-exported at this crate's root.

use std::fmt;

use poolipc_types::{
    AllocId, DType, DeviceUuid, EventBlob, ExportBlob, HandoffId, JobId, Layout, Rung,
};

/// The most dimensions a tensor may have on the wire.
pub const MAX_DIMS: usize = 32;

/// The longest human-readable text (error and refusal messages) on the wire, in bytes.
pub const MAX_TEXT_LEN: usize = 1024;

/// The most items in one list of a message (tensors of a `Lend`, results, grants, handles).
///
/// Besides the frame cap, this bounds what a decoder allocates: the in-memory form of an item
/// can be larger than its wire form (a refused grant is 5 bytes on the wire, ~150 in memory).
pub const MAX_BATCH: usize = 8192;

/// The most results one [`ResultRequest`] may ask for. The parent refuses every result of a
/// longer request ([`ErrorCode::LIMIT`]) instead of granting it: its answer, an
/// [`AllocationGrant`] of one entry per result, must fit one frame (the transport's cap, 1 MiB):
/// 4096 entries of at most 205 bytes each (a pool-pointer grant is 147, a refusal 5 plus its
/// text of at most [`MAX_REFUSAL_TEXT_LEN`]) take 840 KB. The transport's tests check it.
pub const MAX_RESULTS_PER_REQUEST: usize = 4096;

/// The longest refusal text in an [`AllocationGrant`], in bytes: longer ones are cut (on a
/// character boundary), so that a grant of [`MAX_RESULTS_PER_REQUEST`] refusals fits a frame.
pub const MAX_REFUSAL_TEXT_LEN: usize = 200;

/// The most devices an [`Identity`] may list.
pub const MAX_DEVICES: usize = 64;

/// Capability bits a side announces in the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Capabilities(pub u64);

impl Capabilities {
    /// No capability.
    pub const NONE: Self = Self(0);
    /// Pool pointer export/import (rung 1 of the ladder).
    pub const POOL_POINTER: Self = Self(1 << 0);
    /// Interprocess events for READY/DONE gating.
    pub const IPC_EVENTS: Self = Self(1 << 1);
    /// The VMM arena (results without a size limit).
    pub const VMM_ARENA: Self = Self(1 << 2);
    /// Host staging through pinned shared memory.
    pub const HOST_STAGING: Self = Self(1 << 3);
    /// VMM allocations lent by handle (`VmmShare`, the VMM-handle rung; protocol 8).
    pub const VMM_HANDLE: Self = Self(1 << 4);
    /// Long jobs (a worker's announcement): its jobs may compute longer than the parent's
    /// handoff timeout, and it sends a `Heartbeat` more often than that while one runs.
    /// The parent then takes its heartbeats for progress on its open jobs (not cancelled);
    /// they still end at the job lifetime.
    pub const LONG_JOBS: Self = Self(1 << 5);

    /// Whether every bit of `other` is set in `self`.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// The bits of `self` that `other` lacks.
    pub fn missing_from(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }

    /// Both sides' bits.
    pub fn intersection(self, other: Self) -> Self {
        Self(self.0 & other.0)
    }
}

impl std::ops::BitOr for Capabilities {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

/// A tensor's place in an allocation: its [`Layout`] (on the wire at most [`MAX_DIMS`]
/// dimensions, strides always one per dimension, in elements, possibly negative or zero), and
/// where in the allocation it lies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    /// The caller's layout, as the worker's view will have it.
    pub layout: Layout,
    /// Offset of element 0 from the start of the allocation, in bytes.
    pub byte_offset: u64,
    /// Bytes of the allocation the tensor may touch.
    pub byte_len: u64,
}

/// Where a block of the parent's result arena lies: `offset` bytes into arena chunk `chunk`
/// (announced to the worker by an [`ArenaChunk`] before any message names it). The block's
/// length is what the message carrying the location says it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ArenaLocation {
    /// The arena chunk's index.
    pub chunk: u32,
    /// Bytes from the chunk's start.
    pub offset: u64,
}

/// One tensor of a [`Lend`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LentTensor {
    /// The handoff this tensor opens (the contract's name for it).
    pub handle: HandoffId,
    /// The allocation it lives in: the worker imports once per allocation and refcounts the
    /// import. Meaningful on the pool-pointer rung; on host staging the worker ignores it.
    pub alloc: AllocId,
    /// The rung it travels on.
    pub rung: Rung,
    /// Which of the parent's pools the allocation comes from: 0 is the pool whose FD came with
    /// `Hello`, n > 0 the one offered by `ExtraPool { index: n }`. Meaningless (0) on the
    /// host-staging rung.
    pub pool: u8,
    /// The pointer export.
    pub export: ExportBlob,
    /// The READY event the worker waits on before touching the memory (pool pointer and
    /// arena copy; zero on host staging).
    pub ready_event: EventBlob,
    /// The layout. On the arena-copy rung it is over the copy: `byte_offset` and `byte_len`
    /// count from the block's start.
    pub meta: TensorMeta,
    /// On the [`Rung::ArenaCopy`] rung (protocol 5), and only there: the arena block the
    /// parent copied the tensor into. Its length is `meta.byte_offset + meta.byte_len`; the
    /// worker resolves it through its arena mapping and refuses a block outside a mapped
    /// chunk. `pool` and `export` are zero then.
    pub arena: Option<ArenaLocation>,
    /// The caller said the worker only reads this tensor (protocol 7). The worker hands it
    /// out read-only (and maps an arena-copy block read-only); the parent copies nothing
    /// back. When false, an input that crossed by a copy comes back: an arena-copy block is
    /// copied into the caller's tensor after the parent's wait on DONE, and a host-staged
    /// input's bytes follow the worker's `Done` like a staged result's.
    pub read_only: bool,
}

/// A block of the parent's result arena lent with a job (protocol 6): the job's **arena
/// slice**, out of which the worker may carve results whose shapes it learns late, without a
/// `ResultRequest` round trip.
///
/// Like an arena result block: no export, no import, no READY (the parent hands a block out
/// only once every earlier use of it completed); the worker never touches it after its DONE
/// for the job. What it carved it names in its [`Done`]'s `carved`; the parent then owns each
/// carve as a result of the job and takes the rest back after its wait on that DONE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LentSlice {
    /// The handoff the slice opens (named in the job's `Done` and `Ack` like any other).
    pub handle: HandoffId,
    /// The allocation id the parent gave the block.
    pub alloc: AllocId,
    /// The arena chunk's index (announced by an [`ArenaChunk`] before the `Lend`).
    pub chunk: u32,
    /// Bytes from the chunk's start.
    pub offset: u64,
    /// Bytes of the slice.
    pub bytes: u64,
}

/// Parent → worker: tensors lent for a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lend {
    /// The job.
    pub job: JobId,
    /// The tensors, in argument order.
    pub tensors: Vec<LentTensor>,
    /// The job's arena slice, if the parent granted one (protocol 6).
    pub slice: Option<LentSlice>,
}

/// Worker → parent, in a [`Done`]: one result the worker carved out of the job's
/// [`LentSlice`] instead of asking for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CarvedResult {
    /// Its place among the job's results, counting carved and granted results together in
    /// the order the worker asked for them (from 0).
    pub index: u32,
    /// Bytes from the slice's start: a multiple of [`poolipc_types::ARENA_ALIGN`].
    pub offset: u64,
    /// Its size: the dense size of `shape` and `dtype`, non-zero.
    pub bytes: u64,
    /// Element type.
    pub dtype: DType,
    /// Size of each dimension (at most [`MAX_DIMS`]); carved results are contiguous.
    pub shape: Vec<u64>,
}

/// The shape of one result, announced before the parent allocates it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResultSpec {
    /// Element type.
    pub dtype: DType,
    /// Size of each dimension (at most [`MAX_DIMS`]); results are contiguous.
    pub shape: Vec<u64>,
    /// Bytes the result needs.
    pub byte_len: u64,
}

/// Worker → parent: the results a job will produce, shape first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResultRequest {
    /// The job.
    pub job: JobId,
    /// One entry per result.
    pub results: Vec<ResultSpec>,
}

/// The parent's answer for one requested result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResultGrant {
    /// Allocated: the worker imports `export` after waiting on `ready_event`, and writes.
    Granted {
        /// The handoff this result opens (the contract's name for it).
        handle: HandoffId,
        /// The allocation made for it (see [`LentTensor::alloc`]).
        alloc: AllocId,
        /// The rung it travels on.
        rung: Rung,
        /// Which of the parent's pools the allocation comes from: 0 is the pool whose FD came
        /// with `Hello`, n > 0 the one offered by `ExtraPool { index: n }`. Meaningless (0) on
        /// the host-staging rung.
        pool: u8,
        /// The pointer export.
        export: ExportBlob,
        /// The READY event.
        ready_event: EventBlob,
    },
    /// A block of the parent's result arena (protocol 4): `bytes` at `offset` in arena chunk
    /// `chunk`, which the worker mapped when an [`ArenaChunk`] announced it (always before a
    /// grant that names it). No export, no import, no READY: the parent hands out a block
    /// only once every earlier use of it completed on the GPU. The worker writes, records
    /// DONE, and never touches the block again; the parent reuses it only after that DONE
    /// (stream-ordered) or after the worker was reaped.
    Arena {
        /// The handoff this result opens.
        handle: HandoffId,
        /// The allocation id the parent gave the block (see [`LentTensor::alloc`]).
        alloc: AllocId,
        /// The arena chunk's index.
        chunk: u32,
        /// Bytes from the chunk's start.
        offset: u64,
        /// Bytes of the block (at least the result's `byte_len`).
        bytes: u64,
    },
    /// Not allocated.
    Refused {
        /// Why, as a code the worker can act on.
        code: ErrorCode,
        /// Why, for a person.
        message: String,
    },
}

/// Parent → worker: the answer to a [`ResultRequest`], one entry per requested result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationGrant {
    /// The job.
    pub job: JobId,
    /// In the order of the request.
    pub results: Vec<ResultGrant>,
}

/// Worker → parent: the worker recorded DONE after its last access to these allocations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Done {
    /// The job.
    pub job: JobId,
    /// The DONE event the parent's consumer streams wait on.
    pub done_event: EventBlob,
    /// The allocations it covers.
    pub handles: Vec<HandoffId>,
    /// The results carved out of the job's slice (protocol 6), in carve order; empty when
    /// the job had no slice or carved nothing.
    pub carved: Vec<CarvedResult>,
}

/// Acknowledges handles: from the worker, "unimported, you may release"; from the parent,
/// "released".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ack {
    /// The job.
    pub job: JobId,
    /// The allocations it covers.
    pub handles: Vec<HandoffId>,
}

/// One device a side can see, for multi-GPU setups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceEntry {
    /// Stable identity.
    pub uuid: DeviceUuid,
    /// Ordinal in the sending process (differs across `CUDA_VISIBLE_DEVICES`).
    pub ordinal: u32,
}

/// What a side says about itself in the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The device the shared pool lives on.
    pub device: DeviceUuid,
    /// `cuDriverGetVersion`.
    pub driver_version: i32,
    /// What this side supports.
    pub capabilities: Capabilities,
    /// All devices this side sees (at most [`MAX_DEVICES`]).
    pub devices: Vec<DeviceEntry>,
}

/// Parent → worker: the host-staging buffer, sent with exactly one FD (its memfd).
///
/// The parent created the buffer and all four interprocess events; the worker maps the
/// buffer, registers it, opens the events and answers [`Message::StagingReady`]. Whichever
/// side sends a tensor's bytes records `filled`, the side receiving them records `drained`,
/// so one buffer serves both directions (one transfer at a time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingBuffer {
    /// Bytes of the shared buffer (both halves).
    pub bytes: u64,
    /// Bytes of one chunk: the size of each half.
    pub chunk: u64,
    /// `filled[h]`: recorded by the sender of the data after its copy into half `h`.
    pub filled_event: [EventBlob; 2],
    /// `drained[h]`: recorded by the receiver of the data after its copy out of half `h`.
    pub drained_event: [EventBlob; 2],
}

/// Either side: one chunk of a host-staged tensor is in the buffer (from the sender of the
/// data), or has been copied out of it (the receiver's acknowledgement, same fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// The job the tensor belongs to.
    pub job: JobId,
    /// The tensor's handle.
    pub handle: HandoffId,
    /// The chunk's number within the tensor, from 0; it uses half `seq % 2`.
    pub seq: u64,
    /// The chunk's offset within the tensor, in bytes.
    pub offset: u64,
    /// The chunk's length in bytes.
    pub bytes: u64,
}

/// Parent → worker, with exactly one FD (the pool's): another of the parent's pools (a pool
/// per device).
///
/// `index` (1..=255) is what [`LentTensor::pool`] and [`ResultGrant::Granted`]'s `pool` name
/// it by; `device` is the UUID of the device it lives on. The worker answers
/// [`ExtraPoolReply`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtraPool {
    /// The pool's number on this connection, 1..=255 (0 is the pool that came with `Hello`).
    pub index: u8,
    /// The device the pool lives on.
    pub device: DeviceUuid,
}

/// Worker → parent: the answer to an [`ExtraPool`].
///
/// Whether the worker attached the pool and can use it from its device; when not, `reason`
/// says why (at most [`MAX_TEXT_LEN`] bytes, like other texts) and the parent sends that
/// pool's tensors by host staging.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtraPoolReply {
    /// The [`ExtraPool::index`] answered.
    pub index: u8,
    /// Whether the worker attached the pool and can use it from its device.
    pub reachable: bool,
    /// When not reachable, why, for a person (at most [`MAX_TEXT_LEN`] bytes).
    pub reason: String,
}

/// Parent → worker, with exactly one FD (the chunk's `cuMemExportToShareableHandle`): a
/// chunk of the parent's result arena (protocol 4).
///
/// Sent after the handshake for every chunk the arena has, and to every attached worker when
/// the arena grows, always before any [`ResultGrant::Arena`] that names the chunk. The worker
/// imports and maps it once (`ArenaMapping::map_chunk`) and answers nothing; a chunk it
/// cannot map makes the grants that name it fail on its side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaChunk {
    /// The chunk's index: what [`ResultGrant::Arena`]'s `chunk` names it by.
    pub index: u32,
    /// Its length in bytes (non-zero; a multiple of the driver's granularity).
    pub len: u64,
}

/// Parent → worker: chunk `index` of the result arena was given back to the device (protocol
/// 8). No block in it is lent or granted, and its index is never used again. The worker
/// unmaps the chunk (and its read-only alias) and answers [`Message::ArenaReleased`] with the
/// same index, also for a chunk it never mapped; the memory goes back to the device once
/// every worker that mapped it did.
///
/// A worker that does not answer only keeps that chunk's memory from the device: the parent
/// never names the index again either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaRelease {
    /// The chunk's index.
    pub index: u32,
}

/// Parent → worker: the parent's pool this worker knows by wire `index` (an `ExtraPool` it
/// took, a generation of a pool the parent rotated on `empty_cache`) was retired and has
/// nothing in use any more (protocol 8). The worker destroys its imported handle of the
/// pool (no import of it can be live) and answers [`Message::PoolRetired`] with the same
/// index; the pool's exported memory goes back to the device once the parent and every
/// worker that imported it did. The index may then be offered again by a later `ExtraPool`.
/// Index 0 (the Hello pool) is retired like any other once the parent rotated it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolRetire {
    /// The pool's wire index in this worker's table.
    pub index: u8,
}

/// Parent → worker, with exactly one FD (the allocation's `cuMemExportToShareableHandle`): a
/// VMM allocation of the parent's that tensors on [`Rung::VmmHandle`] will name by `alloc`
/// (protocol 8).
///
/// Sent before the first `Lend` that names `alloc` to this worker, and again only after the
/// parent told the worker to drop its cached mappings. The worker imports the handle, maps
/// `len` bytes of it, and keeps the mapping (so that lending the allocation again costs no
/// driver call) until the parent says to drop it; a mapping it holds for another `alloc` at
/// the same parent `base` is stale (the parent's allocation there was replaced) and goes
/// when no job uses it. A handle it cannot map makes the jobs that name `alloc` fail on its
/// side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmmShare {
    /// The parent's id for the allocation: what lent tensors name it by.
    pub alloc: AllocId,
    /// Where the allocation is mapped in the parent (identifies it across shares).
    pub base: u64,
    /// The mapping's length in bytes (non-zero).
    pub len: u64,
}

/// A numeric reason on the wire. Unknown codes decode fine (a newer peer may send one); the
/// names below are the ones this version knows.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ErrorCode(pub u16);

impl ErrorCode {
    /// Something else; read the message.
    pub const OTHER: Self = Self(0);
    /// The protocol versions differ.
    pub const VERSION_MISMATCH: Self = Self(1);
    /// The sides are not on the same device.
    pub const DEVICE_MISMATCH: Self = Self(2);
    /// The driver versions differ.
    pub const DRIVER_MISMATCH: Self = Self(3);
    /// The peer lacks a required capability.
    pub const MISSING_CAPABILITY: Self = Self(4);
    /// A message arrived that the protocol does not allow at this point.
    pub const UNEXPECTED_MESSAGE: Self = Self(5);
    /// A frame could not be decoded.
    pub const MALFORMED_FRAME: Self = Self(6);
    /// Not enough memory for the allocation.
    pub const OUT_OF_MEMORY: Self = Self(7);
    /// The allocation exceeds the import limit.
    pub const OVER_IMPORT_LIMIT: Self = Self(8);
    /// The job was cancelled.
    pub const CANCELLED: Self = Self(9);
    /// An internal failure of the sender.
    pub const INTERNAL: Self = Self(10);
    /// A limit of the protocol was exceeded (too many results in one request).
    pub const LIMIT: Self = Self(11);

    /// The known name, if any.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::OTHER => "other",
            Self::VERSION_MISMATCH => "version mismatch",
            Self::DEVICE_MISMATCH => "device mismatch",
            Self::DRIVER_MISMATCH => "driver version mismatch",
            Self::MISSING_CAPABILITY => "missing capability",
            Self::UNEXPECTED_MESSAGE => "unexpected message",
            Self::MALFORMED_FRAME => "malformed frame",
            Self::OUT_OF_MEMORY => "out of memory",
            Self::OVER_IMPORT_LIMIT => "over import limit",
            Self::CANCELLED => "cancelled",
            Self::INTERNAL => "internal",
            Self::LIMIT => "limit exceeded",
            _ => return None,
        })
    }
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "ErrorCode({} {n:?})", self.0),
            None => write!(f, "ErrorCode({})", self.0),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n}"),
            None => write!(f, "code {}", self.0),
        }
    }
}

/// A message of the protocol. See the crate documentation for who sends which.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Parent → worker, first frame, with exactly one FD: the shared pool's.
    Hello(Identity),
    /// Worker → parent, then parent → worker: the handshake is accepted; the sender's side of
    /// the story.
    HelloAck(Identity),
    /// Either side, during the handshake: refused, and why. The sender closes after it.
    Refuse {
        /// What the sender found wrong.
        code: ErrorCode,
        /// For a person.
        message: String,
    },
    /// Parent → worker: tensors lent for a job.
    Lend(Lend),
    /// Worker → parent: the results' shapes, before the parent allocates them.
    ResultRequest(ResultRequest),
    /// Parent → worker: allocations for the requested results.
    AllocationGrant(AllocationGrant),
    /// Worker → parent: DONE was recorded after the last access.
    Done(Done),
    /// Either side: handles acknowledged (see [`Ack`]).
    Ack(Ack),
    /// Either side: something failed.
    Error {
        /// What failed, as a code.
        code: ErrorCode,
        /// For a person.
        message: String,
    },
    /// Worker → parent: the worker's code failed on this job. The worker still finishes the
    /// job (Done, Ack); the job then ends with this message as its error.
    JobError {
        /// The job.
        job: JobId,
        /// For a person.
        message: String,
    },
    /// Parent → worker: stop working on a job.
    Cancel {
        /// The job.
        job: JobId,
    },
    /// Either side: still alive.
    Heartbeat {
        /// Echoed by the answer, so round trips can be matched.
        seq: u64,
    },
    /// Either side: closing on purpose.
    Bye,
    /// Parent → worker, once per connection before the first host-staged tensor, with exactly
    /// one FD (the buffer's memfd). See [`StagingBuffer`].
    StagingBuffer(StagingBuffer),
    /// Worker → parent: the staging buffer is mapped and registered, the events opened.
    StagingReady {
        /// The buffer's size as the worker found it (equal to [`StagingBuffer::bytes`]).
        bytes: u64,
    },
    /// Either side: a host-staged chunk is in the buffer, or (echoed back) drained from it.
    Chunk(Chunk),
    /// Parent → worker, with exactly one FD (the pool's): another of the parent's pools (a
    /// pool per device). See [`ExtraPool`].
    ExtraPool(ExtraPool),
    /// Worker → parent: whether the worker can use that pool. See [`ExtraPoolReply`].
    ExtraPoolReply(ExtraPoolReply),
    /// Parent → worker, with exactly one FD (the chunk's): a chunk of the result arena. See
    /// [`ArenaChunk`].
    ArenaChunk(ArenaChunk),
    /// Parent → worker, with exactly one FD (the allocation's): a VMM allocation lent by
    /// handle. See [`VmmShare`].
    VmmShare(VmmShare),
    /// Parent → worker: an arena chunk was released; unmap it. See [`ArenaRelease`].
    ArenaRelease(ArenaRelease),
    /// Worker → parent: the chunk of that [`ArenaRelease`] is unmapped here (or never was).
    ArenaReleased(ArenaRelease),
    /// Parent → worker (protocol 8): drop every cached mapping of the parent's VMM
    /// allocations that no running job uses (`Worker::release_cached_mappings`); the parent
    /// sends an allocation again before it names it next. A cached mapping keeps the memory
    /// behind it alive after the parent freed it.
    ReleaseMappings,
    /// Worker → parent: the answer to [`Message::ReleaseMappings`], with how many mappings
    /// went.
    MappingsReleased {
        /// Mappings dropped.
        dropped: u32,
    },
    /// Parent → worker: destroy your import of the pool of this index. See [`PoolRetire`].
    PoolRetire(PoolRetire),
    /// Worker → parent: the import of that [`PoolRetire`]'s pool is destroyed here (or never
    /// was made).
    PoolRetired(PoolRetire),
}

/// The kind of a [`Message`], with its wire tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[allow(missing_docs)] // one per Message variant, same names
pub enum MessageKind {
    Hello = 1,
    HelloAck = 2,
    Refuse = 3,
    Lend = 4,
    ResultRequest = 5,
    AllocationGrant = 6,
    Done = 7,
    Ack = 8,
    Error = 9,
    Cancel = 10,
    Heartbeat = 11,
    Bye = 12,
    StagingBuffer = 13,
    StagingReady = 14,
    Chunk = 15,
    ExtraPool = 16,
    ExtraPoolReply = 17,
    JobError = 18,
    ArenaChunk = 19,
    VmmShare = 20,
    ArenaRelease = 21,
    ArenaReleased = 22,
    ReleaseMappings = 23,
    MappingsReleased = 24,
    PoolRetire = 25,
    PoolRetired = 26,
}

impl MessageKind {
    /// Every kind, in tag order.
    pub const ALL: [MessageKind; 26] = [
        MessageKind::Hello,
        MessageKind::HelloAck,
        MessageKind::Refuse,
        MessageKind::Lend,
        MessageKind::ResultRequest,
        MessageKind::AllocationGrant,
        MessageKind::Done,
        MessageKind::Ack,
        MessageKind::Error,
        MessageKind::Cancel,
        MessageKind::Heartbeat,
        MessageKind::Bye,
        MessageKind::StagingBuffer,
        MessageKind::StagingReady,
        MessageKind::Chunk,
        MessageKind::ExtraPool,
        MessageKind::ExtraPoolReply,
        MessageKind::JobError,
        MessageKind::ArenaChunk,
        MessageKind::VmmShare,
        MessageKind::ArenaRelease,
        MessageKind::ArenaReleased,
        MessageKind::ReleaseMappings,
        MessageKind::MappingsReleased,
        MessageKind::PoolRetire,
        MessageKind::PoolRetired,
    ];

    /// The kind with this wire tag.
    pub fn from_tag(tag: u8) -> Option<Self> {
        Self::ALL.iter().copied().find(|k| *k as u8 == tag)
    }

    /// How many file descriptors a frame of this kind carries: the only count accepted.
    ///
    /// `Hello` and `ExtraPool` carry a pool's FD, `StagingBuffer` the host-staging memfd,
    /// `ArenaChunk` an arena chunk's, `VmmShare` a VMM allocation's; nothing else carries any. New rungs that need FDs add
    /// kinds here, never relax the check.
    pub fn expected_fds(self) -> usize {
        match self {
            MessageKind::Hello
            | MessageKind::StagingBuffer
            | MessageKind::ExtraPool
            | MessageKind::ArenaChunk
            | MessageKind::VmmShare => 1,
            _ => 0,
        }
    }
}

impl fmt::Display for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl Message {
    /// The kind (and wire tag) of this message.
    pub fn kind(&self) -> MessageKind {
        match self {
            Message::Hello(_) => MessageKind::Hello,
            Message::HelloAck(_) => MessageKind::HelloAck,
            Message::Refuse { .. } => MessageKind::Refuse,
            Message::Lend(_) => MessageKind::Lend,
            Message::ResultRequest(_) => MessageKind::ResultRequest,
            Message::AllocationGrant(_) => MessageKind::AllocationGrant,
            Message::Done(_) => MessageKind::Done,
            Message::Ack(_) => MessageKind::Ack,
            Message::Error { .. } => MessageKind::Error,
            Message::Cancel { .. } => MessageKind::Cancel,
            Message::Heartbeat { .. } => MessageKind::Heartbeat,
            Message::Bye => MessageKind::Bye,
            Message::StagingBuffer(_) => MessageKind::StagingBuffer,
            Message::StagingReady { .. } => MessageKind::StagingReady,
            Message::Chunk(_) => MessageKind::Chunk,
            Message::ExtraPool(_) => MessageKind::ExtraPool,
            Message::ExtraPoolReply(_) => MessageKind::ExtraPoolReply,
            Message::JobError { .. } => MessageKind::JobError,
            Message::ArenaChunk(_) => MessageKind::ArenaChunk,
            Message::VmmShare(_) => MessageKind::VmmShare,
            Message::ArenaRelease(_) => MessageKind::ArenaRelease,
            Message::ArenaReleased(_) => MessageKind::ArenaReleased,
            Message::ReleaseMappings => MessageKind::ReleaseMappings,
            Message::MappingsReleased { .. } => MessageKind::MappingsReleased,
            Message::PoolRetire(_) => MessageKind::PoolRetire,
            Message::PoolRetired(_) => MessageKind::PoolRetired,
        }
    }

    /// How many file descriptors travel with this message (see [`MessageKind::expected_fds`]).
    pub fn expected_fds(&self) -> usize {
        self.kind().expected_fds()
    }
}
