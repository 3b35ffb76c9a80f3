//! Malformed input over a real socket pair: each case is a clear typed error, no panic, and
//! every file descriptor that arrived with a refused frame is closed.

use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rstest::rstest;

use crate::codec::{FrameLimits, HEADER_LEN, PROTOCOL_VERSION, encode};
use crate::{
    Capabilities, Connection, DecodeError, DeviceUuid, Direction, ExtraPool, ExtraPoolReply,
    Identity, Message, MessageKind, TransportError,
};

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn frame(msg: &Message) -> Vec<u8> {
    encode(msg, FrameLimits::default()).expect("encodes")
}

fn hello() -> Vec<u8> {
    frame(&Message::Hello(Identity {
        device: DeviceUuid([7; 16]),
        driver_version: 12080,
        capabilities: Capabilities::POOL_POINTER,
        devices: vec![],
    }))
}

fn extra_pool() -> Vec<u8> {
    frame(&Message::ExtraPool(ExtraPool {
        index: 1,
        device: DeviceUuid([8; 16]),
    }))
}

fn extra_pool_reply() -> Vec<u8> {
    frame(&Message::ExtraPoolReply(ExtraPoolReply {
        index: 1,
        reachable: true,
        reason: String::new(),
    }))
}

fn heartbeat() -> Vec<u8> {
    frame(&Message::Heartbeat { seq: 9 })
}

fn raw_header(len: u32, version: u8, tag: u8) -> Vec<u8> {
    let mut h = len.to_le_bytes().to_vec();
    h.extend_from_slice(&[version, tag, 0, 0]);
    h
}

/// `n` pipes; we send the read ends and keep the write ends, which then tell whether the
/// receiver still holds a read end (a write to a pipe with no reader fails with EPIPE).
fn pipes(n: usize) -> (Vec<OwnedFd>, Vec<std::fs::File>) {
    (0..n)
        .map(|_| {
            let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe2");
            (r, std::fs::File::from(w))
        })
        .unzip()
}

fn all_readers_closed(writers: &mut [std::fs::File]) -> bool {
    writers
        .iter_mut()
        .all(|w| matches!(w.write(b"x"), Err(e) if e.raw_os_error() == Some(libc::EPIPE)))
}

/// The receiving side's expectation for one malformed input.
type Expect = fn(&TransportError) -> bool;

#[rstest]
#[case::fd_where_none_is_expected(heartbeat(), 1, |e: &TransportError| matches!(e, TransportError::UnexpectedFds { kind: MessageKind::Heartbeat, expected: 0, received: 1 }))]
#[case::missing_fd(hello(), 0, |e: &TransportError| matches!(e, TransportError::MissingFds { kind: MessageKind::Hello, expected: 1, received: 0 }))]
#[case::extra_pool_without_its_fd(extra_pool(), 0, |e: &TransportError| matches!(e, TransportError::MissingFds { kind: MessageKind::ExtraPool, expected: 1, received: 0 }))]
#[case::extra_pool_with_two_fds(extra_pool(), 2, |e: &TransportError| matches!(e, TransportError::UnexpectedFds { kind: MessageKind::ExtraPool, expected: 1, received: 2 }))]
#[case::fd_with_an_extra_pool_reply(extra_pool_reply(), 1, |e: &TransportError| matches!(e, TransportError::UnexpectedFds { kind: MessageKind::ExtraPoolReply, expected: 0, received: 1 }))]
#[case::too_many_fds(hello(), 3, |e: &TransportError| matches!(e, TransportError::UnexpectedFds { kind: MessageKind::Hello, expected: 1, received: 3 }))]
#[case::more_fds_than_one_frame_can_carry(hello(), 12, |e: &TransportError| matches!(e, TransportError::FdsTruncated { received: 8 }))]
#[case::fds_with_an_unknown_tag(raw_header(0, PROTOCOL_VERSION, 200), 2, |e: &TransportError| matches!(e, TransportError::Decode(DecodeError::UnknownTag(200))))]
#[case::fds_with_an_unknown_version(raw_header(0, 42, 12), 1, |e: &TransportError| matches!(e, TransportError::Decode(DecodeError::UnknownVersion { found: 42, .. })))]
#[case::length_over_the_cap(raw_header(u32::MAX, PROTOCOL_VERSION, 12), 0, |e: &TransportError| matches!(e, TransportError::Decode(DecodeError::TooLarge { .. })))]
fn malformed_frames_are_typed_errors_and_close_every_fd(
    #[case] bytes: Vec<u8>,
    #[case] nfds: usize,
    #[case] expected: Expect,
) {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let (readers, mut writers) = pipes(nfds);
    let borrowed: Vec<BorrowedFd<'_>> = readers.iter().map(AsFd::as_fd).collect();
    tx.send_frame(&bytes, &borrowed, soon()).expect("raw send");
    drop(readers);
    let err = rx.recv(soon()).expect_err("malformed frame accepted");
    assert!(expected(&err), "unexpected error: {err:?}");
    assert!(
        all_readers_closed(&mut writers),
        "a received fd is still open after {err:?}"
    );
}

#[test]
fn a_truncated_frame_then_eof_is_peer_closed_mid_frame() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let bytes = heartbeat();
    tx.send_frame(&bytes[..HEADER_LEN + 3], &[], soon())
        .expect("raw send");
    drop(tx);
    let err = rx.recv(soon()).expect_err("half frame accepted");
    assert!(
        matches!(err, TransportError::PeerClosed { mid_frame: true }),
        "{err:?}"
    );
}

#[test]
fn a_truncated_frame_then_silence_times_out_and_breaks_the_connection() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    tx.send_frame(&heartbeat()[..5], &[], soon())
        .expect("raw send");
    let start = Instant::now();
    let err = rx
        .recv(Instant::now() + Duration::from_millis(100))
        .expect_err("half frame accepted");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    assert!(
        matches!(
            err,
            TransportError::Timeout {
                direction: Direction::Recv,
                partial: true
            }
        ),
        "{err:?}"
    );
    let again = rx.recv(soon()).expect_err("broken connection read");
    assert!(matches!(again, TransportError::Broken { .. }), "{again:?}");
}

#[test]
fn silence_times_out_without_breaking_the_connection() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let err = rx
        .recv(Instant::now() + Duration::from_millis(50))
        .expect_err("nothing was sent");
    assert!(
        matches!(err, TransportError::Timeout { partial: false, .. }),
        "{err:?}"
    );
    tx.send(&Message::Bye, &[], soon()).expect("send");
    assert_eq!(rx.recv(soon()).expect("recv").0, Message::Bye);
}

#[test]
fn a_decodable_but_invalid_frame_leaves_the_stream_in_step() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    tx.send_frame(&raw_header(0, PROTOCOL_VERSION, 200), &[], soon())
        .expect("raw send");
    tx.send(&Message::Bye, &[], soon()).expect("send");
    assert!(matches!(
        rx.recv(soon()),
        Err(TransportError::Decode(DecodeError::UnknownTag(200)))
    ));
    assert_eq!(rx.recv(soon()).expect("next frame").0, Message::Bye);
}

#[test]
fn send_refuses_the_wrong_number_of_fds() {
    let (mut tx, _rx) = Connection::pair().expect("socketpair");
    let (readers, _writers) = pipes(1);
    let err = tx
        .send(&Message::Bye, &[readers[0].as_fd()], soon())
        .expect_err("fd on Bye");
    assert!(matches!(
        err,
        TransportError::WrongFdCount {
            kind: MessageKind::Bye,
            expected: 0,
            given: 1
        }
    ));
}

#[test]
fn sending_to_a_closed_peer_is_peer_gone() {
    let (mut tx, rx) = Connection::pair().expect("socketpair");
    drop(rx);
    let err = tx
        .send(&Message::Bye, &[], soon())
        .expect_err("peer closed");
    assert!(
        matches!(
            err,
            TransportError::PeerGone {
                errno: nix::errno::Errno::EPIPE
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_full_socket_times_out_the_sender() {
    let (mut tx, _rx) = Connection::pair().expect("socketpair");
    let big = Message::Ack(crate::Ack {
        job: crate::JobId(1),
        handles: (0..crate::MAX_BATCH as u64).map(crate::HandoffId).collect(),
    });
    let deadline = Instant::now() + Duration::from_millis(200);
    let err = loop {
        if let Err(e) = tx.send(&big, &[], deadline) {
            break e;
        }
    };
    assert!(
        matches!(
            err,
            TransportError::Timeout {
                direction: Direction::Send,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn frames_and_fds_arrive_in_order() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let (readers, _writers) = pipes(1);
    tx.send(&Message::Heartbeat { seq: 1 }, &[], soon())
        .expect("send");
    tx.send_frame(&hello(), &[readers[0].as_fd()], soon())
        .expect("send hello");
    tx.send(&Message::Heartbeat { seq: 2 }, &[], soon())
        .expect("send");
    let (m1, f1) = rx.recv(soon()).expect("1");
    let (m2, f2) = rx.recv(soon()).expect("2");
    let (m3, f3) = rx.recv(soon()).expect("3");
    assert_eq!((m1, f1.len()), (Message::Heartbeat { seq: 1 }, 0));
    assert_eq!((m2.kind(), f2.len()), (MessageKind::Hello, 1));
    assert_eq!((m3, f3.len()), (Message::Heartbeat { seq: 2 }, 0));
}

#[test]
fn an_extra_pool_arrives_with_its_fd_and_its_reply_without() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let (readers, _writers) = pipes(1);
    let offer = Message::ExtraPool(ExtraPool {
        index: 3,
        device: DeviceUuid([9; 16]),
    });
    tx.send(&offer, &[readers[0].as_fd()], soon())
        .expect("send extra pool");
    let err = tx
        .send(&offer, &[], soon())
        .expect_err("extra pool without its fd");
    assert!(matches!(
        err,
        TransportError::WrongFdCount {
            kind: MessageKind::ExtraPool,
            expected: 1,
            given: 0
        }
    ));
    let (m, fds) = rx.recv(soon()).expect("recv extra pool");
    assert_eq!((m, fds.len()), (offer, 1));
    let reply = Message::ExtraPoolReply(ExtraPoolReply {
        index: 3,
        reachable: false,
        reason: "no peer access".into(),
    });
    rx.send(&reply, &[], soon()).expect("send reply");
    let (m, fds) = tx.recv(soon()).expect("recv reply");
    assert_eq!((m, fds.len()), (reply, 0));
}

/// The inode of a descriptor: which pipe a received descriptor is.
fn inode(fd: BorrowedFd<'_>) -> u64 {
    nix::sys::stat::fstat(fd).expect("fstat").st_ino
}

#[test]
fn descriptors_of_frames_sent_back_to_back_go_each_with_its_own_frame() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let (readers, _writers) = pipes(3);
    tx.send(&Message::Heartbeat { seq: 1 }, &[], soon())
        .expect("send");
    tx.send_frame(&hello(), &[readers[0].as_fd()], soon())
        .expect("send hello");
    tx.send_frame(&extra_pool(), &[readers[1].as_fd()], soon())
        .expect("send extra pool");
    tx.send(&Message::Heartbeat { seq: 2 }, &[], soon())
        .expect("send");
    tx.send_frame(&extra_pool(), &[readers[2].as_fd()], soon())
        .expect("send extra pool");
    let mut got = Vec::new();
    for _ in 0..5 {
        let (m, fds) = rx.recv(soon()).expect("recv");
        got.push((
            m.kind(),
            fds.iter().map(|f| inode(f.as_fd())).collect::<Vec<_>>(),
        ));
    }
    let ino = |i: usize| inode(readers[i].as_fd());
    assert_eq!(
        got,
        vec![
            (MessageKind::Heartbeat, vec![]),
            (MessageKind::Hello, vec![ino(0)]),
            (MessageKind::ExtraPool, vec![ino(1)]),
            (MessageKind::Heartbeat, vec![]),
            (MessageKind::ExtraPool, vec![ino(2)]),
        ]
    );
    assert!(!rx.buffered());
}

#[test]
fn frames_written_at_once_are_read_one_at_a_time_without_the_socket() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let msgs = [
        Message::Heartbeat { seq: 1 },
        Message::Heartbeat { seq: 2 },
        Message::Bye,
    ];
    tx.send_many(&msgs.iter().collect::<Vec<_>>(), soon())
        .expect("send_many");
    assert!(!rx.frame_buffered());
    assert_eq!(rx.recv(soon()).expect("1").0, msgs[0]);
    // The rest came with the first read: buffered, not waiting in the socket.
    assert!(rx.frame_buffered());
    let mut poll = [nix::poll::PollFd::new(
        rx.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    assert_eq!(
        nix::poll::poll(&mut poll, nix::poll::PollTimeout::ZERO).expect("poll"),
        0,
        "the socket still had bytes"
    );
    assert_eq!(rx.recv(soon()).expect("2").0, msgs[1]);
    assert_eq!(rx.recv(soon()).expect("3").0, msgs[2]);
    assert!(!rx.buffered());
    assert!(matches!(
        rx.recv(Instant::now() + Duration::from_millis(20)),
        Err(TransportError::Timeout { partial: false, .. })
    ));
}

#[test]
fn send_many_refuses_a_message_that_carries_descriptors_and_sends_nothing() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let offer = Message::ExtraPool(ExtraPool {
        index: 1,
        device: DeviceUuid([8; 16]),
    });
    let err = tx
        .send_many(&[&Message::Heartbeat { seq: 1 }, &offer], soon())
        .expect_err("a frame without its fd went out");
    assert!(
        matches!(
            err,
            TransportError::WrongFdCount {
                kind: MessageKind::ExtraPool,
                expected: 1,
                given: 0
            }
        ),
        "{err:?}"
    );
    assert!(matches!(
        rx.recv(Instant::now() + Duration::from_millis(20)),
        Err(TransportError::Timeout { partial: false, .. })
    ));
}

#[test]
fn a_frame_longer_than_a_read_arrives_whole_between_two_short_ones() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    // A lend of 2000 tensors: about 400 KiB, several reads' worth.
    let big = Message::Lend(crate::Lend {
        job: crate::JobId(7),
        tensors: (0..2000u64)
            .map(|i| crate::LentTensor {
                handle: crate::HandoffId(i),
                alloc: crate::AllocId(i),
                rung: crate::Rung::PoolPointer,
                pool: 0,
                export: crate::ExportBlob([i as u8; 64]),
                ready_event: crate::EventBlob([!(i as u8); 64]),
                meta: crate::TensorMeta {
                    layout: crate::Layout {
                        dtype: crate::DType::F32,
                        shape: vec![1, 4, 32, 32],
                        strides: vec![4096, 1024, 32, 1],
                    },
                    byte_offset: 0,
                    byte_len: 16_384,
                },
                read_only: false,
                arena: None,
            })
            .collect(),
        slice: None,
    });
    assert!(frame(&big).len() > 4 * 64 * 1024);
    let writer = std::thread::spawn(move || {
        tx.send(&Message::Heartbeat { seq: 1 }, &[], soon())
            .expect("send");
        tx.send(&big, &[], soon()).expect("send big");
        tx.send(&Message::Heartbeat { seq: 2 }, &[], soon())
            .expect("send");
        big
    });
    assert_eq!(rx.recv(soon()).expect("1").0, Message::Heartbeat { seq: 1 });
    let (m, _) = rx.recv(soon()).expect("big");
    assert_eq!(rx.recv(soon()).expect("3").0, Message::Heartbeat { seq: 2 });
    assert_eq!(m, writer.join().expect("writer"));
}

#[test]
fn a_frame_cut_by_eof_after_a_whole_one_is_reported_mid_frame() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let mut bytes = frame(&Message::Heartbeat { seq: 1 });
    let second = frame(&Message::Heartbeat { seq: 2 });
    bytes.extend_from_slice(&second[..second.len() - 1]);
    tx.send_frame(&bytes, &[], soon()).expect("raw send");
    drop(tx);
    assert_eq!(rx.recv(soon()).expect("1").0, Message::Heartbeat { seq: 1 });
    assert!(rx.buffered());
    assert!(!rx.frame_buffered());
    assert!(matches!(
        rx.recv(soon()),
        Err(TransportError::PeerClosed { mid_frame: true })
    ));
}

#[test]
fn a_long_stream_with_a_partial_frame_behind_every_read_keeps_the_buffer_small() {
    // The writer sends frames in pieces that end mid-frame, so every read leaves part of a
    // frame unread; 20 MB go by, and the buffer must not grow with them.
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let one = frame(&Message::Heartbeat { seq: 1 });
    let n = 20_000_000 / one.len();
    let writer = std::thread::spawn(move || {
        let mut bytes = Vec::with_capacity(n * one.len());
        for _ in 0..n {
            bytes.extend_from_slice(&one);
        }
        for piece in bytes.chunks(one.len() * 1000 + 7) {
            tx.send_frame(piece, &[], soon()).expect("send");
        }
    });
    for i in 0..n {
        let (m, _) = rx.recv(soon()).unwrap_or_else(|e| panic!("frame {i}: {e}"));
        assert_eq!(m, Message::Heartbeat { seq: 1 });
        assert!(
            rx.recv_capacity() <= 2 * 64 * 1024,
            "the buffer grew to {} bytes after frame {i}",
            rx.recv_capacity()
        );
    }
    writer.join().expect("writer");
}

#[test]
fn the_right_token_is_taken_and_the_handshake_follows_unread() {
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    let token = [b'a'; crate::TOKEN_LEN];
    tx.send_token(&token, soon()).expect("send token");
    tx.send(&Message::Heartbeat { seq: 7 }, &[], soon())
        .expect("send frame");
    rx.expect_token(&token, soon()).expect("the token");
    // Nothing past the token was read: the frame after it arrives whole.
    assert_eq!(
        rx.recv(soon()).expect("frame").0,
        Message::Heartbeat { seq: 7 }
    );
}

#[test]
fn a_wrong_or_missing_token_is_refused() {
    let token = [b'a'; crate::TOKEN_LEN];
    let (mut tx, mut rx) = Connection::pair().expect("socketpair");
    tx.send_token(&[b'b'; crate::TOKEN_LEN], soon())
        .expect("send");
    assert!(matches!(
        rx.expect_token(&token, soon()),
        Err(TransportError::WrongToken)
    ));
    let (tx, mut rx) = Connection::pair().expect("socketpair");
    drop(tx);
    assert!(matches!(
        rx.expect_token(&token, soon()),
        Err(TransportError::PeerClosed { .. })
    ));
}

#[test]
fn descriptors_sent_with_a_token_are_refused_and_closed() {
    let (tx, mut rx) = Connection::pair().expect("socketpair");
    let extra = std::fs::File::open("/dev/null").expect("open");
    let n =
        crate::scm::send(tx.as_fd(), &[b'a'; crate::TOKEN_LEN], &[extra.as_fd()]).expect("sendmsg");
    assert_eq!(n, crate::TOKEN_LEN);
    assert!(matches!(
        rx.expect_token(&[b'a'; crate::TOKEN_LEN], soon()),
        Err(TransportError::FdsTruncated { received: 1 })
    ));
}
