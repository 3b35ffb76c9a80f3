//! Shared by the integration tests: one sample of every message, with fixed values.
#![allow(dead_code)] // each test file uses part of this

use poolipc_transport::Layout;
use poolipc_transport::{
    Ack, AllocId, AllocationGrant, ArenaChunk, ArenaLocation, ArenaRelease, Capabilities,
    CarvedResult, Chunk, DType, DeviceEntry, DeviceUuid, Done, ErrorCode, EventBlob, ExportBlob,
    ExtraPool, ExtraPoolReply, HandoffId, Identity, JobId, Lend, LentSlice, LentTensor, Message,
    PoolRetire, ResultGrant, ResultRequest, ResultSpec, Rung, StagingBuffer, TensorMeta, VmmShare,
};

/// 64 bytes counting up from `start`, so every byte of a blob is visible in a hex dump.
pub(crate) fn blob64(start: u8) -> [u8; 64] {
    std::array::from_fn(|i| start.wrapping_add(i as u8))
}

pub(crate) fn uuid(seed: u8) -> DeviceUuid {
    DeviceUuid(std::array::from_fn(|i| {
        seed.wrapping_mul(16).wrapping_add(i as u8)
    }))
}

pub(crate) fn identity() -> Identity {
    Identity {
        device: uuid(1),
        driver_version: 13000,
        capabilities: Capabilities::POOL_POINTER | Capabilities::IPC_EVENTS,
        devices: vec![
            DeviceEntry {
                uuid: uuid(1),
                ordinal: 0,
            },
            DeviceEntry {
                uuid: uuid(2),
                ordinal: 1,
            },
        ],
    }
}

/// One named sample per message kind: the golden frames are these, encoded.
pub(crate) fn samples() -> Vec<(&'static str, Message)> {
    vec![
        ("hello", Message::Hello(identity())),
        (
            "hello_ack",
            Message::HelloAck(Identity {
                devices: vec![DeviceEntry {
                    uuid: uuid(1),
                    ordinal: 3,
                }],
                ..identity()
            }),
        ),
        (
            "refuse",
            Message::Refuse {
                code: ErrorCode::DEVICE_MISMATCH,
                message: "device mismatch: GPU-a vs GPU-b".into(),
            },
        ),
        (
            "lend",
            Message::Lend(Lend {
                job: JobId(7),
                tensors: vec![
                    LentTensor {
                        handle: HandoffId(1),
                        alloc: AllocId(11),
                        rung: Rung::PoolPointer,
                        pool: 0,
                        export: ExportBlob(blob64(0x10)),
                        ready_event: EventBlob(blob64(0x80)),
                        meta: TensorMeta {
                            layout: Layout {
                                dtype: DType::BF16,
                                shape: vec![2, 3, 4],
                                strides: vec![12, 4, 1],
                            },
                            byte_offset: 0,
                            byte_len: 48,
                        },
                        read_only: false,
                        arena: None,
                    },
                    LentTensor {
                        handle: HandoffId(2),
                        alloc: AllocId(11),
                        rung: Rung::PoolPointer,
                        pool: 2,
                        export: ExportBlob(blob64(0x20)),
                        ready_event: EventBlob(blob64(0x90)),
                        meta: TensorMeta {
                            layout: Layout {
                                dtype: DType::F32,
                                shape: vec![5],
                                strides: vec![-1],
                            },
                            byte_offset: 16,
                            byte_len: 20,
                        },
                        read_only: true,
                        arena: None,
                    },
                ],
                slice: None,
            }),
        ),
        (
            "result_request",
            Message::ResultRequest(ResultRequest {
                job: JobId(7),
                results: vec![ResultSpec {
                    dtype: DType::F16,
                    shape: vec![1, 4, 64, 64],
                    byte_len: 32768,
                }],
            }),
        ),
        (
            "allocation_grant",
            Message::AllocationGrant(AllocationGrant {
                job: JobId(7),
                results: vec![
                    ResultGrant::Granted {
                        handle: HandoffId(3),
                        alloc: AllocId(12),
                        rung: Rung::PoolPointer,
                        pool: 1,
                        export: ExportBlob(blob64(0x30)),
                        ready_event: EventBlob(blob64(0xa0)),
                    },
                    ResultGrant::Refused {
                        code: ErrorCode::OVER_IMPORT_LIMIT,
                        message: "over the import limit".into(),
                    },
                    ResultGrant::Arena {
                        handle: HandoffId(4),
                        alloc: AllocId(13),
                        chunk: 2,
                        offset: 3 << 20,
                        bytes: 64 << 20,
                    },
                ],
            }),
        ),
        (
            "done",
            Message::Done(Done {
                job: JobId(7),
                done_event: EventBlob(blob64(0xc0)),
                handles: vec![HandoffId(1), HandoffId(2), HandoffId(3)],
                carved: Vec::new(),
            }),
        ),
        (
            "ack",
            Message::Ack(Ack {
                job: JobId(7),
                handles: vec![HandoffId(1), HandoffId(2), HandoffId(3)],
            }),
        ),
        (
            "error",
            Message::Error {
                code: ErrorCode::INTERNAL,
                message: "worker failed: ünïcode ok".into(),
            },
        ),
        ("cancel", Message::Cancel { job: JobId(7) }),
        (
            "job_error",
            Message::JobError {
                job: JobId(7),
                message: "the node raised ValueError".into(),
            },
        ),
        (
            "heartbeat",
            Message::Heartbeat {
                seq: 0x0102_0304_0506_0708,
            },
        ),
        ("bye", Message::Bye),
        (
            "staging_buffer",
            Message::StagingBuffer(StagingBuffer {
                bytes: 128 << 20,
                chunk: 64 << 20,
                filled_event: [EventBlob(blob64(0x40)), EventBlob(blob64(0x50))],
                drained_event: [EventBlob(blob64(0x60)), EventBlob(blob64(0x70))],
            }),
        ),
        ("staging_ready", Message::StagingReady { bytes: 128 << 20 }),
        (
            "chunk",
            Message::Chunk(Chunk {
                job: JobId(7),
                handle: HandoffId(4),
                seq: 3,
                offset: 3 * (64 << 20),
                bytes: 12345,
            }),
        ),
        (
            "extra_pool",
            Message::ExtraPool(ExtraPool {
                index: 2,
                device: uuid(3),
            }),
        ),
        (
            "extra_pool_reply",
            Message::ExtraPoolReply(ExtraPoolReply {
                index: 2,
                reachable: false,
                reason: "no peer access from GPU-10 to GPU-30".into(),
            }),
        ),
        (
            "arena_chunk",
            Message::ArenaChunk(ArenaChunk {
                index: 1,
                len: 2 << 30,
            }),
        ),
        (
            "arena_release",
            Message::ArenaRelease(ArenaRelease { index: 3 }),
        ),
        (
            "arena_released",
            Message::ArenaReleased(ArenaRelease { index: 3 }),
        ),
        ("release_mappings", Message::ReleaseMappings),
        ("pool_retire", Message::PoolRetire(PoolRetire { index: 2 })),
        (
            "pool_retired",
            Message::PoolRetired(PoolRetire { index: 2 }),
        ),
        (
            "mappings_released",
            Message::MappingsReleased { dropped: 2 },
        ),
        (
            "vmm_share",
            Message::VmmShare(VmmShare {
                alloc: AllocId(21),
                base: 0x7f00_0000_0000,
                len: 6 << 30,
            }),
        ),
        (
            "lend_vmm_handle",
            Message::Lend(Lend {
                job: JobId(9),
                tensors: vec![LentTensor {
                    handle: HandoffId(5),
                    alloc: AllocId(21),
                    rung: Rung::VmmHandle,
                    pool: 0,
                    export: ExportBlob([0; 64]),
                    ready_event: EventBlob(blob64(0xb0)),
                    meta: TensorMeta {
                        layout: Layout {
                            dtype: DType::BF16,
                            shape: vec![1024, 4096],
                            strides: vec![4096, 1],
                        },
                        byte_offset: 0x10_0000,
                        byte_len: 8 << 20,
                    },
                    read_only: true,
                    arena: None,
                }],
                slice: None,
            }),
        ),
        (
            "lend_arena_copy",
            Message::Lend(Lend {
                job: JobId(8),
                tensors: vec![
                    LentTensor {
                        handle: HandoffId(3),
                        alloc: AllocId(12),
                        rung: Rung::ArenaCopy,
                        pool: 0,
                        export: ExportBlob([0; 64]),
                        ready_event: EventBlob(blob64(0xa0)),
                        meta: TensorMeta {
                            layout: Layout {
                                dtype: DType::U8,
                                shape: vec![6 << 30],
                                strides: vec![1],
                            },
                            byte_offset: 0,
                            byte_len: 6 << 30,
                        },
                        read_only: false,
                        arena: Some(ArenaLocation {
                            chunk: 2,
                            offset: 0x20_0000,
                        }),
                    },
                    LentTensor {
                        handle: HandoffId(4),
                        alloc: AllocId(13),
                        rung: Rung::HostStaging,
                        pool: 0,
                        export: ExportBlob([0; 64]),
                        ready_event: EventBlob([0; 64]),
                        meta: TensorMeta {
                            layout: Layout {
                                dtype: DType::F32,
                                shape: vec![4],
                                strides: vec![1],
                            },
                            byte_offset: 0,
                            byte_len: 16,
                        },
                        read_only: false,
                        arena: None,
                    },
                ],
                slice: None,
            }),
        ),
        (
            "lend_slice",
            Message::Lend(Lend {
                job: JobId(9),
                tensors: vec![LentTensor {
                    handle: HandoffId(5),
                    alloc: AllocId(14),
                    rung: Rung::PoolPointer,
                    pool: 0,
                    export: ExportBlob(blob64(0x30)),
                    ready_event: EventBlob(blob64(0xb0)),
                    meta: TensorMeta {
                        layout: Layout {
                            dtype: DType::F16,
                            shape: vec![8],
                            strides: vec![1],
                        },
                        byte_offset: 0,
                        byte_len: 16,
                    },
                    read_only: false,
                    arena: None,
                }],
                slice: Some(LentSlice {
                    handle: HandoffId(6),
                    alloc: AllocId(15),
                    chunk: 1,
                    offset: 0x40_0000,
                    bytes: 64 << 20,
                }),
            }),
        ),
        (
            "done_carved",
            Message::Done(Done {
                job: JobId(9),
                done_event: EventBlob(blob64(0xd0)),
                handles: vec![HandoffId(5), HandoffId(6), HandoffId(7)],
                carved: vec![
                    CarvedResult {
                        index: 0,
                        offset: 0,
                        bytes: 24,
                        dtype: DType::F32,
                        shape: vec![2, 3],
                    },
                    CarvedResult {
                        index: 2,
                        offset: 512,
                        bytes: 4096,
                        dtype: DType::BF16,
                        shape: vec![2048],
                    },
                ],
            }),
        ),
    ]
}
