//! The codec on its own: round trips, and malformed bytes giving typed errors.

mod common;

use poolipc_transport::Layout;
use poolipc_transport::codec::{HEADER_LEN, decode, encode};
use poolipc_transport::{
    Ack, AllocId, AllocationGrant, ArenaChunk, ArenaLocation, ArenaRelease, Capabilities,
    CarvedResult, Chunk, DType, DecodeError, DeviceEntry, DeviceUuid, Done, EncodeError, ErrorCode,
    EventBlob, ExportBlob, ExtraPool, ExtraPoolReply, FrameLimits, HandoffId, Identity, JobId,
    Lend, LentSlice, LentTensor, MAX_BATCH, MAX_DIMS, MAX_FRAME_LEN, MAX_TEXT_LEN, Message,
    MessageKind, PROTOCOL_VERSION, PoolRetire, ResultGrant, ResultRequest, ResultSpec, Rung,
    StagingBuffer, TensorMeta,
};
use proptest::prelude::*;
use rstest::rstest;

// ---- strategies -------------------------------------------------------------------------

fn blob() -> impl Strategy<Value = [u8; 64]> {
    prop::array::uniform32(any::<u8>()).prop_flat_map(|a| {
        prop::array::uniform32(any::<u8>()).prop_map(move |b| {
            let mut out = [0u8; 64];
            out[..32].copy_from_slice(&a);
            out[32..].copy_from_slice(&b);
            out
        })
    })
}

fn text() -> impl Strategy<Value = String> {
    // Up to MAX_TEXT_LEN bytes, multi-byte characters included.
    "\\PC{0,200}".prop_filter("fits", |s| s.len() <= MAX_TEXT_LEN)
}

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn rung() -> impl Strategy<Value = Rung> {
    prop::sample::select(Rung::ALL.to_vec())
}

fn identity() -> impl Strategy<Value = Identity> {
    (
        any::<[u8; 16]>(),
        any::<i32>(),
        any::<u64>(),
        prop::collection::vec((any::<[u8; 16]>(), any::<u32>()), 0..8),
    )
        .prop_map(|(d, v, c, devs)| Identity {
            device: DeviceUuid(d),
            driver_version: v,
            capabilities: Capabilities(c),
            devices: devs
                .into_iter()
                .map(|(u, o)| DeviceEntry {
                    uuid: DeviceUuid(u),
                    ordinal: o,
                })
                .collect(),
        })
}

fn tensor() -> impl Strategy<Value = LentTensor> {
    (
        (any::<u64>(), any::<u64>(), rung(), any::<u8>()),
        blob(),
        blob(),
        dtype(),
        prop::collection::vec((any::<u64>(), any::<i64>()), 0..=MAX_DIMS),
        (any::<u64>(), any::<u64>()),
        (any::<u32>(), any::<u64>()),
    )
        .prop_map(
            |((h, a, rung, pool), e, r, dtype, dims, (off, len), (chunk, offset))| LentTensor {
                handle: HandoffId(h),
                alloc: AllocId(a),
                rung,
                pool,
                export: ExportBlob(e),
                ready_event: EventBlob(r),
                meta: TensorMeta {
                    layout: Layout {
                        dtype,
                        shape: dims.iter().map(|d| d.0).collect(),
                        strides: dims.iter().map(|d| d.1).collect(),
                    },
                    byte_offset: off,
                    byte_len: len,
                },
                read_only: h % 2 == 1,
                // The wire carries a location exactly on the arena-copy rung.
                arena: (rung == Rung::ArenaCopy).then_some(ArenaLocation { chunk, offset }),
            },
        )
}

fn grant() -> impl Strategy<Value = ResultGrant> {
    prop_oneof![
        (
            any::<u64>(),
            any::<u64>(),
            rung(),
            any::<u8>(),
            blob(),
            blob()
        )
            .prop_map(|(h, a, rung, pool, e, r)| ResultGrant::Granted {
                handle: HandoffId(h),
                alloc: AllocId(a),
                rung,
                pool,
                export: ExportBlob(e),
                ready_event: EventBlob(r),
            }),
        (any::<u16>(), text()).prop_map(|(c, m)| ResultGrant::Refused {
            code: ErrorCode(c),
            message: m,
        }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(h, a, chunk, offset, bytes)| ResultGrant::Arena {
                handle: HandoffId(h),
                alloc: AllocId(a),
                chunk,
                offset,
                bytes,
            }),
    ]
}

fn slice() -> impl Strategy<Value = LentSlice> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(h, a, chunk, offset, bytes)| LentSlice {
            handle: HandoffId(h),
            alloc: AllocId(a),
            chunk,
            offset,
            bytes,
        })
}

fn carve() -> impl Strategy<Value = CarvedResult> {
    (
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        dtype(),
        prop::collection::vec(any::<u64>(), 0..=MAX_DIMS),
    )
        .prop_map(|(index, offset, bytes, dtype, shape)| CarvedResult {
            index,
            offset,
            bytes,
            dtype,
            shape,
        })
}

fn handles() -> impl Strategy<Value = Vec<HandoffId>> {
    prop::collection::vec(any::<u64>().prop_map(HandoffId), 0..50)
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        identity().prop_map(Message::Hello),
        identity().prop_map(Message::HelloAck),
        (any::<u16>(), text()).prop_map(|(c, m)| Message::Refuse {
            code: ErrorCode(c),
            message: m
        }),
        (
            any::<u64>(),
            prop::collection::vec(tensor(), 0..20),
            prop::option::of(slice())
        )
            .prop_map(|(j, tensors, slice)| {
                Message::Lend(Lend {
                    job: JobId(j),
                    tensors,
                    slice,
                })
            }),
        (
            any::<u64>(),
            prop::collection::vec(
                (
                    dtype(),
                    prop::collection::vec(any::<u64>(), 0..=MAX_DIMS),
                    any::<u64>()
                ),
                0..20
            )
        )
            .prop_map(|(j, rs)| Message::ResultRequest(ResultRequest {
                job: JobId(j),
                results: rs
                    .into_iter()
                    .map(|(dtype, shape, byte_len)| ResultSpec {
                        dtype,
                        shape,
                        byte_len
                    })
                    .collect(),
            })),
        (any::<u64>(), prop::collection::vec(grant(), 0..20)).prop_map(|(j, results)| {
            Message::AllocationGrant(AllocationGrant {
                job: JobId(j),
                results,
            })
        }),
        (
            any::<u64>(),
            blob(),
            handles(),
            prop::collection::vec(carve(), 0..20)
        )
            .prop_map(|(j, e, handles, carved)| Message::Done(Done {
                job: JobId(j),
                done_event: EventBlob(e),
                handles,
                carved,
            })),
        (any::<u64>(), handles()).prop_map(|(j, handles)| Message::Ack(Ack {
            job: JobId(j),
            handles
        })),
        (any::<u16>(), text()).prop_map(|(c, m)| Message::Error {
            code: ErrorCode(c),
            message: m
        }),
        any::<u64>().prop_map(|j| Message::Cancel { job: JobId(j) }),
        (any::<u64>(), text()).prop_map(|(j, m)| Message::JobError {
            job: JobId(j),
            message: m
        }),
        any::<u64>().prop_map(|seq| Message::Heartbeat { seq }),
        Just(Message::Bye),
        (
            any::<u64>(),
            any::<u64>(),
            [blob(), blob()],
            [blob(), blob()]
        )
            .prop_map(|(bytes, chunk, [f0, f1], [d0, d1])| Message::StagingBuffer(
                StagingBuffer {
                    bytes,
                    chunk,
                    filled_event: [EventBlob(f0), EventBlob(f1)],
                    drained_event: [EventBlob(d0), EventBlob(d1)],
                }
            )),
        any::<u64>().prop_map(|bytes| Message::StagingReady { bytes }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(j, h, seq, offset, bytes)| Message::Chunk(Chunk {
                job: JobId(j),
                handle: HandoffId(h),
                seq,
                offset,
                bytes,
            })),
        (1u8..=u8::MAX, any::<[u8; 16]>()).prop_map(|(index, d)| Message::ExtraPool(ExtraPool {
            index,
            device: DeviceUuid(d),
        })),
        (any::<u8>(), any::<bool>(), text()).prop_map(|(index, reachable, reason)| {
            Message::ExtraPoolReply(ExtraPoolReply {
                index,
                reachable,
                reason,
            })
        }),
        (any::<u32>(), 1u64..)
            .prop_map(|(index, len)| Message::ArenaChunk(ArenaChunk { index, len })),
        any::<u32>().prop_map(|index| Message::ArenaRelease(ArenaRelease { index })),
        any::<u32>().prop_map(|index| Message::ArenaReleased(ArenaRelease { index })),
        Just(Message::ReleaseMappings),
        any::<u8>().prop_map(|index| Message::PoolRetire(PoolRetire { index })),
        any::<u8>().prop_map(|index| Message::PoolRetired(PoolRetire { index })),
        any::<u32>().prop_map(|dropped| Message::MappingsReleased { dropped }),
    ]
}

// ---- properties -------------------------------------------------------------------------

proptest! {
    #[test]
    fn every_message_decodes_to_itself_after_encoding(msg in message()) {
        let bytes = encode(&msg, FrameLimits::default()).expect("fits the cap");
        prop_assert!(bytes.len() <= MAX_FRAME_LEN);
        prop_assert_eq!(decode(&bytes, FrameLimits::default()), Ok(msg));
    }

    #[test]
    fn every_strict_prefix_of_a_frame_is_an_error(msg in message(), cut in any::<prop::sample::Index>()) {
        let bytes = encode(&msg, FrameLimits::default()).expect("fits the cap");
        let cut = cut.index(bytes.len());
        prop_assert!(decode(&bytes[..cut], FrameLimits::default()).is_err());
    }

    #[test]
    fn arbitrary_bytes_decode_to_ok_or_an_error_without_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes, FrameLimits::default());
    }

    #[test]
    fn arbitrary_payloads_behind_a_valid_header_never_panic(
        tag in 0u8..=(MessageKind::ALL.len() as u8 + 1),
        payload in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut frame = header(payload.len() as u32, PROTOCOL_VERSION, tag, 0);
        frame.extend_from_slice(&payload);
        let _ = decode(&frame, FrameLimits::default());
    }
}

// ---- malformed input, one typed error each ------------------------------------------------

fn header(len: u32, version: u8, tag: u8, reserved: u16) -> Vec<u8> {
    let mut h = len.to_le_bytes().to_vec();
    h.push(version);
    h.push(tag);
    h.extend_from_slice(&reserved.to_le_bytes());
    h
}

fn frame(tag: MessageKind, payload: &[u8]) -> Vec<u8> {
    let mut f = header(payload.len() as u32, PROTOCOL_VERSION, tag as u8, 0);
    f.extend_from_slice(payload);
    f
}

fn heartbeat() -> Vec<u8> {
    encode(&Message::Heartbeat { seq: 1 }, FrameLimits::default()).expect("encodes")
}

#[rstest]
#[case::empty_input(vec![], |e: &DecodeError| matches!(e, DecodeError::Truncated { needed: HEADER_LEN, available: 0 }))]
#[case::half_header(heartbeat()[..5].to_vec(), |e: &DecodeError| matches!(e, DecodeError::Truncated { needed: HEADER_LEN, .. }))]
#[case::truncated_payload(heartbeat()[..12].to_vec(), |e: &DecodeError| matches!(e, DecodeError::Truncated { needed: 16, available: 12 }))]
#[case::length_over_the_cap(header((MAX_FRAME_LEN) as u32, PROTOCOL_VERSION, 11, 0), |e: &DecodeError| matches!(e, DecodeError::TooLarge { .. }))]
#[case::length_u32_max(header(u32::MAX, PROTOCOL_VERSION, 11, 0), |e: &DecodeError| matches!(e, DecodeError::TooLarge { .. }))]
#[case::unknown_version(header(0, 99, 12, 0), |e: &DecodeError| matches!(e, DecodeError::UnknownVersion { found: 99, supported: PROTOCOL_VERSION }))]
#[case::version_zero(header(0, 0, 12, 0), |e: &DecodeError| matches!(e, DecodeError::UnknownVersion { found: 0, .. }))]
#[case::unknown_tag(header(0, PROTOCOL_VERSION, 200, 0), |e: &DecodeError| matches!(e, DecodeError::UnknownTag(200)))]
#[case::tag_zero(header(0, PROTOCOL_VERSION, 0, 0), |e: &DecodeError| matches!(e, DecodeError::UnknownTag(0)))]
#[case::reserved_bits_set(header(0, PROTOCOL_VERSION, 12, 1), |e: &DecodeError| matches!(e, DecodeError::ReservedBits(1)))]
#[case::trailing_payload_bytes(frame(MessageKind::Bye, &[0]), |e: &DecodeError| matches!(e, DecodeError::TrailingBytes { kind: MessageKind::Bye, count: 1 }))]
#[case::bytes_after_the_frame({ let mut f = heartbeat(); f.push(0); f }, |e: &DecodeError| matches!(e, DecodeError::TrailingBytes { count: 1, .. }))]
#[case::payload_field_cut(frame(MessageKind::Heartbeat, &[1, 2, 3]), |e: &DecodeError| matches!(e, DecodeError::PayloadTruncated { field: "seq", .. }))]
#[case::count_larger_than_the_frame(frame(MessageKind::Ack, &[7, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]), |e: &DecodeError| matches!(e, DecodeError::BadCount { field: "handles", count: 0xffff_ffff, max: 0, .. }))]
#[case::too_many_dims(frame(MessageKind::ResultRequest, &{ let mut p = vec![0; 8]; p.extend_from_slice(&1u32.to_le_bytes()); p.extend_from_slice(&[DType::F32 as u8, 33]); p.extend_from_slice(&[0; 33 * 8 + 8]); p }), |e: &DecodeError| matches!(e, DecodeError::BadCount { field: "shape", count: 33, max: MAX_DIMS, .. }))]
#[case::text_over_its_limit(frame(MessageKind::Error, &{ let mut p = vec![0, 0]; p.extend_from_slice(&2000u16.to_le_bytes()); p.extend_from_slice(&[b'a'; 2000]); p }), |e: &DecodeError| matches!(e, DecodeError::BadCount { field: "message", count: 2000, .. }))]
#[case::text_not_utf8(frame(MessageKind::Error, &[0, 0, 2, 0, 0xc3, 0x28]), |e: &DecodeError| matches!(e, DecodeError::InvalidUtf8 { field: "message", .. }))]
#[case::unknown_dtype(frame(MessageKind::ResultRequest, &{ let mut p = vec![0; 8]; p.extend_from_slice(&1u32.to_le_bytes()); p.extend_from_slice(&[0xee, 0]); p.extend_from_slice(&[0; 8]); p }), |e: &DecodeError| matches!(e, DecodeError::UnknownValue { field: "dtype", value: 0xee, .. }))]
#[case::unknown_rung(frame(MessageKind::AllocationGrant, &{ let mut p = vec![0; 8]; p.extend_from_slice(&1u32.to_le_bytes()); p.push(1); p.extend_from_slice(&[0; 16]); p.push(9); p.extend_from_slice(&[0; 128]); p }), |e: &DecodeError| matches!(e, DecodeError::UnknownValue { field: "rung", value: 9, .. }))]
#[case::lend_unknown_rung(frame(MessageKind::Lend, &{ let mut p = vec![0; 8]; p.extend_from_slice(&1u32.to_le_bytes()); p.extend_from_slice(&[0; 16]); p.push(9); p.push(0); p.extend_from_slice(&[0; 1 + 128 + 2 + 16]); p }), |e: &DecodeError| matches!(e, DecodeError::UnknownValue { kind: MessageKind::Lend, field: "rung", value: 9 }))]
#[case::grant_cut_in_pool(frame(MessageKind::AllocationGrant, &{ let mut p = vec![0; 8]; p.extend_from_slice(&1u32.to_le_bytes()); p.push(1); p.extend_from_slice(&[0; 16]); p.push(Rung::PoolPointer as u8); p }), |e: &DecodeError| matches!(e, DecodeError::PayloadTruncated { kind: MessageKind::AllocationGrant, field: "pool" }))]
#[case::extra_pool_index_zero(frame(MessageKind::ExtraPool, &[0; 17]), |e: &DecodeError| matches!(e, DecodeError::OutOfRange { kind: MessageKind::ExtraPool, field: "index", value: 0, min: 1, max: 255 }))]
#[case::extra_pool_cut_in_device(frame(MessageKind::ExtraPool, &[1; 16]), |e: &DecodeError| matches!(e, DecodeError::PayloadTruncated { kind: MessageKind::ExtraPool, field: "device" }))]
#[case::extra_pool_trailing_byte(frame(MessageKind::ExtraPool, &[1; 18]), |e: &DecodeError| matches!(e, DecodeError::TrailingBytes { kind: MessageKind::ExtraPool, count: 1 }))]
#[case::extra_pool_reply_bool_two(frame(MessageKind::ExtraPoolReply, &[1, 2, 0, 0]), |e: &DecodeError| matches!(e, DecodeError::UnknownValue { kind: MessageKind::ExtraPoolReply, field: "reachable", value: 2 }))]
#[case::extra_pool_reply_reason_over_its_limit(frame(MessageKind::ExtraPoolReply, &{ let mut p = vec![1, 0]; p.extend_from_slice(&2000u16.to_le_bytes()); p.extend_from_slice(&[b'a'; 2000]); p }), |e: &DecodeError| matches!(e, DecodeError::BadCount { kind: MessageKind::ExtraPoolReply, field: "reason", count: 2000, .. }))]
#[case::extra_pool_reply_reason_not_utf8(frame(MessageKind::ExtraPoolReply, &[1, 0, 2, 0, 0xc3, 0x28]), |e: &DecodeError| matches!(e, DecodeError::InvalidUtf8 { kind: MessageKind::ExtraPoolReply, field: "reason" }))]
#[case::arena_chunk_of_zero_bytes(frame(MessageKind::ArenaChunk, &[0; 12]), |e: &DecodeError| matches!(e, DecodeError::OutOfRange { kind: MessageKind::ArenaChunk, field: "len", value: 0, .. }))]
#[case::arena_chunk_cut_in_len(frame(MessageKind::ArenaChunk, &[1; 8]), |e: &DecodeError| matches!(e, DecodeError::PayloadTruncated { kind: MessageKind::ArenaChunk, field: "len" }))]
#[case::arena_grant_cut_in_bytes(frame(MessageKind::AllocationGrant, &{ let mut p = vec![0; 8]; p.extend_from_slice(&1u32.to_le_bytes()); p.push(3); p.extend_from_slice(&[0; 8 + 8 + 4 + 8 + 4]); p }), |e: &DecodeError| matches!(e, DecodeError::PayloadTruncated { kind: MessageKind::AllocationGrant, field: "bytes" }))]
#[case::unknown_grant_kind(frame(MessageKind::AllocationGrant, &{ let mut p = vec![0; 8]; p.extend_from_slice(&1u32.to_le_bytes()); p.push(7); p.extend_from_slice(&[0; 16]); p }), |e: &DecodeError| matches!(e, DecodeError::UnknownValue { field: "grant", value: 7, .. }))]
#[case::lend_slice_presence_two(frame(MessageKind::Lend, &{ let mut p = vec![0; 8]; p.extend_from_slice(&0u32.to_le_bytes()); p.push(2); p.extend_from_slice(&[0; 36]); p }), |e: &DecodeError| matches!(e, DecodeError::UnknownValue { kind: MessageKind::Lend, field: "slice", value: 2 }))]
#[case::lend_without_its_slice_byte(frame(MessageKind::Lend, &{ let mut p = vec![0; 8]; p.extend_from_slice(&0u32.to_le_bytes()); p }), |e: &DecodeError| matches!(e, DecodeError::PayloadTruncated { kind: MessageKind::Lend, field: "slice" }))]
#[case::lend_slice_cut_in_bytes(frame(MessageKind::Lend, &{ let mut p = vec![0; 8]; p.extend_from_slice(&0u32.to_le_bytes()); p.push(1); p.extend_from_slice(&[0; 8 + 8 + 4 + 8 + 4]); p }), |e: &DecodeError| matches!(e, DecodeError::PayloadTruncated { kind: MessageKind::Lend, field: "slice.bytes" }))]
#[case::lend_no_slice_then_trailing_bytes(frame(MessageKind::Lend, &{ let mut p = vec![0; 8]; p.extend_from_slice(&0u32.to_le_bytes()); p.push(0); p.extend_from_slice(&[0; 36]); p }), |e: &DecodeError| matches!(e, DecodeError::TrailingBytes { kind: MessageKind::Lend, count: 36 }))]
#[case::done_carved_count_larger_than_the_frame(frame(MessageKind::Done, &{ let mut p = vec![0; 8 + 64]; p.extend_from_slice(&0u32.to_le_bytes()); p.extend_from_slice(&3u32.to_le_bytes()); p.extend_from_slice(&[0; 22 * 2]); p }), |e: &DecodeError| matches!(e, DecodeError::BadCount { kind: MessageKind::Done, field: "carved", count: 3, max: 2 }))]
#[case::done_carved_count_over_the_batch_limit(frame(MessageKind::Done, &{ let mut p = vec![0; 8 + 64]; p.extend_from_slice(&0u32.to_le_bytes()); p.extend_from_slice(&(MAX_BATCH as u32 + 1).to_le_bytes()); p.extend_from_slice(&vec![0; 22 * (MAX_BATCH + 1)]); p }), |e: &DecodeError| matches!(e, DecodeError::BadCount { kind: MessageKind::Done, field: "carved", max: MAX_BATCH, .. }))]
#[case::done_carve_unknown_dtype(frame(MessageKind::Done, &{ let mut p = vec![0; 8 + 64]; p.extend_from_slice(&0u32.to_le_bytes()); p.extend_from_slice(&1u32.to_le_bytes()); p.extend_from_slice(&[0; 20]); p.extend_from_slice(&[0xee, 0]); p }), |e: &DecodeError| matches!(e, DecodeError::UnknownValue { kind: MessageKind::Done, field: "dtype", value: 0xee }))]
#[case::done_carve_too_many_dims(frame(MessageKind::Done, &{ let mut p = vec![0; 8 + 64]; p.extend_from_slice(&0u32.to_le_bytes()); p.extend_from_slice(&1u32.to_le_bytes()); p.extend_from_slice(&[0; 20]); p.extend_from_slice(&[DType::F32 as u8, 33]); p.extend_from_slice(&[0; 33 * 8]); p }), |e: &DecodeError| matches!(e, DecodeError::BadCount { kind: MessageKind::Done, field: "shape", count: 33, max: MAX_DIMS }))]
#[case::done_without_its_carved_list(frame(MessageKind::Done, &{ let mut p = vec![0; 8 + 64]; p.extend_from_slice(&0u32.to_le_bytes()); p }), |e: &DecodeError| matches!(e, DecodeError::PayloadTruncated { kind: MessageKind::Done, field: "carved" }))]
fn malformed_bytes_give_a_typed_decode_error(
    #[case] bytes: Vec<u8>,
    #[case] expected: fn(&DecodeError) -> bool,
) {
    match decode(&bytes, FrameLimits::default()) {
        Err(e) => assert!(expected(&e), "unexpected error: {e:?}"),
        Ok(m) => panic!("decoded {m:?}"),
    }
}

#[test]
fn a_lowered_cap_rejects_frames_the_default_accepts() {
    let limits = FrameLimits::new(4096);
    let big = Message::Ack(Ack {
        job: JobId(1),
        handles: (0..1000).map(HandoffId).collect(),
    });
    let bytes = encode(&big, FrameLimits::default()).expect("fits the default cap");
    assert!(matches!(
        decode(&bytes, limits),
        Err(DecodeError::TooLarge { max: 4096, .. })
    ));
    assert!(matches!(
        encode(&big, limits),
        Err(EncodeError::TooLarge { max: 4096, .. })
    ));
}

#[test]
fn a_cap_cannot_be_raised_above_the_hard_cap() {
    assert_eq!(FrameLimits::new(usize::MAX).max_frame_len(), MAX_FRAME_LEN);
}

#[test]
fn a_batch_of_a_thousand_tensors_fits_one_frame() {
    let Message::Lend(lend) = &common::samples()[3].1 else {
        panic!("sample 3 is a Lend")
    };
    let t = lend.tensors[0].clone();
    let msg = Message::Lend(Lend {
        job: JobId(1),
        tensors: vec![t; 1000],
        slice: None,
    });
    let bytes = encode(&msg, FrameLimits::default()).expect("1000 tensors fit");
    assert_eq!(decode(&bytes, FrameLimits::default()), Ok(msg));
}

#[test]
fn encoding_refuses_shape_and_strides_of_different_lengths() {
    let mut msg = common::samples()[3].1.clone();
    if let Message::Lend(l) = &mut msg {
        l.tensors[0].meta.layout.strides.pop();
    }
    assert!(matches!(
        encode(&msg, FrameLimits::default()),
        Err(EncodeError::StridesMismatch {
            shape: 3,
            strides: 2,
            ..
        })
    ));
}

#[test]
fn encoding_refuses_extra_pool_index_zero() {
    let msg = Message::ExtraPool(ExtraPool {
        index: 0,
        device: DeviceUuid([1; 16]),
    });
    assert!(matches!(
        encode(&msg, FrameLimits::default()),
        Err(EncodeError::OutOfRange {
            kind: MessageKind::ExtraPool,
            field: "index",
            value: 0,
            ..
        })
    ));
}

#[test]
fn encoding_refuses_a_reason_over_its_limit() {
    let msg = Message::ExtraPoolReply(ExtraPoolReply {
        index: 1,
        reachable: false,
        reason: "x".repeat(MAX_TEXT_LEN + 1),
    });
    assert!(matches!(
        encode(&msg, FrameLimits::default()),
        Err(EncodeError::FieldTooLong {
            field: "reason",
            ..
        })
    ));
}

#[test]
fn the_pool_byte_follows_the_rung_byte() {
    // Lend: header, job, count, then handle u64, alloc u64, rung u8, pool u8.
    let lend = Message::Lend(Lend {
        job: JobId(1),
        tensors: vec![LentTensor {
            pool: 0xab,
            ..lend_sample_tensor()
        }],
        slice: None,
    });
    let bytes = encode(&lend, FrameLimits::default()).expect("encodes");
    let at = HEADER_LEN + 8 + 4 + 8 + 8;
    assert_eq!(
        &bytes[at..at + 2],
        &[Rung::PoolPointer as u8, 0xab],
        "rung, then pool"
    );
    // AllocationGrant: header, job, count, then kind u8, handle u64, alloc u64, rung u8, pool u8.
    let grant = Message::AllocationGrant(AllocationGrant {
        job: JobId(1),
        results: vec![ResultGrant::Granted {
            handle: HandoffId(5),
            alloc: AllocId(9),
            rung: Rung::HostStaging,
            pool: 0xcd,
            export: ExportBlob([0; 64]),
            ready_event: EventBlob([0; 64]),
        }],
    });
    let bytes = encode(&grant, FrameLimits::default()).expect("encodes");
    let at = HEADER_LEN + 8 + 4 + 1 + 8 + 8;
    assert_eq!(
        &bytes[at..at + 2],
        &[Rung::HostStaging as u8, 0xcd],
        "rung, then pool"
    );
}

#[test]
fn an_arena_copy_tensor_carries_its_chunk_and_offset_right_after_its_ready_event() {
    let t = LentTensor {
        rung: Rung::ArenaCopy,
        pool: 0,
        export: ExportBlob([0; 64]),
        read_only: false,
        arena: Some(ArenaLocation {
            chunk: 0x0102_0304,
            offset: 0x1112_1314_1516_1718,
        }),
        ..lend_sample_tensor()
    };
    let lend = Message::Lend(Lend {
        job: JobId(1),
        tensors: vec![t.clone()],
        slice: None,
    });
    let bytes = encode(&lend, FrameLimits::default()).expect("encodes");
    // Header, job, count, handle, alloc, rung, pool, read-only, export, ready event.
    let at = HEADER_LEN + 8 + 4 + 8 + 8 + 1 + 1 + 1 + 64 + 64;
    assert_eq!(&bytes[at..at + 4], &0x0102_0304u32.to_le_bytes());
    assert_eq!(
        &bytes[at + 4..at + 12],
        &0x1112_1314_1516_1718u64.to_le_bytes()
    );
    assert_eq!(decode(&bytes, FrameLimits::default()), Ok(lend));
    let plain = encode(
        &Message::Lend(Lend {
            job: JobId(1),
            tensors: vec![LentTensor {
                rung: Rung::HostStaging,
                read_only: false,
                arena: None,
                ..t
            }],
            slice: None,
        }),
        FrameLimits::default(),
    )
    .expect("encodes");
    assert_eq!(
        bytes.len(),
        plain.len() + 12,
        "12 bytes more, on that rung only"
    );
}

#[test]
fn encoding_refuses_an_arena_location_that_does_not_go_with_the_rung() {
    for (rung, arena) in [
        (Rung::ArenaCopy, None),
        (
            Rung::PoolPointer,
            Some(ArenaLocation {
                chunk: 0,
                offset: 0,
            }),
        ),
    ] {
        let lend = Message::Lend(Lend {
            job: JobId(1),
            tensors: vec![LentTensor {
                rung,
                arena,
                ..lend_sample_tensor()
            }],
            slice: None,
        });
        assert!(
            matches!(
                encode(&lend, FrameLimits::default()),
                Err(EncodeError::ArenaLocationMismatch { rung: r, .. }) if r == rung
            ),
            "{rung}"
        );
    }
}

#[test]
fn an_arena_copy_tensor_cut_inside_its_location_is_a_typed_error() {
    let lend = Message::Lend(Lend {
        job: JobId(1),
        tensors: vec![LentTensor {
            rung: Rung::ArenaCopy,
            read_only: false,
            arena: Some(ArenaLocation {
                chunk: 1,
                offset: 512,
            }),
            ..lend_sample_tensor()
        }],
        slice: None,
    });
    let mut bytes = encode(&lend, FrameLimits::default()).expect("encodes");
    // Keep the header, job, count, the tensor up to its ready event and 6 of the 12 bytes of
    // its location; fix the length field.
    let keep = 8 + 4 + 8 + 8 + 1 + 1 + 64 + 64 + 6;
    bytes.truncate(HEADER_LEN + keep);
    bytes[..4].copy_from_slice(&u32::try_from(keep).expect("small").to_le_bytes());
    assert!(
        matches!(
            decode(&bytes, FrameLimits::default()),
            // The count check sees first that one tensor no longer fits.
            Err(DecodeError::PayloadTruncated { .. } | DecodeError::BadCount { .. })
        ),
        "{:?}",
        decode(&bytes, FrameLimits::default())
    );
}

fn lend_sample_tensor() -> LentTensor {
    let Message::Lend(lend) = &common::samples()[3].1 else {
        panic!("sample 3 is a Lend")
    };
    lend.tensors[0].clone()
}

#[test]
fn encoding_refuses_text_over_its_limit() {
    let msg = Message::Error {
        code: ErrorCode::OTHER,
        message: "x".repeat(MAX_TEXT_LEN + 1),
    };
    assert!(matches!(
        encode(&msg, FrameLimits::default()),
        Err(EncodeError::FieldTooLong {
            field: "message",
            ..
        })
    ));
}
