//! The incremental paths a loop serving many peers uses: [`Connection::poll_recv`] returns
//! whole frames only, however the stream was cut into reads; a frame cut mid-way waits (with
//! its descriptors) and its deadline is the caller's; garbage fails at once; descriptors past
//! what a partial frame may carry fail; [`Connection::enqueue`] never waits, keeps order and
//! descriptors, and is bounded.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use crate::codec::{FrameLimits, HEADER_LEN, encode};
use crate::{
    Connection, DecodeError, DeviceUuid, Direction, ExtraPool, JobId, Message, SendQueueLimits,
    TransportError, scm,
};

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn frame(msg: &Message) -> Vec<u8> {
    encode(msg, FrameLimits::default()).expect("encodes")
}

fn devnull() -> OwnedFd {
    std::fs::File::open("/dev/null").expect("/dev/null").into()
}

/// Writes `bytes` to the peer's socket at once (small: the socket takes it all), `fds` with
/// the first byte.
fn write_raw(peer: &Connection, bytes: &[u8], fds: &[&OwnedFd]) {
    let fds: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    let n = scm::send(peer.as_fd(), bytes, &fds).expect("send");
    assert_eq!(n, bytes.len(), "the socket took a short write");
}

/// Every frame `poll_recv` returns now, until it says none is whole.
fn drain(conn: &mut Connection) -> Vec<(Message, usize)> {
    let mut out = Vec::new();
    while let Some((m, fds)) = conn.poll_recv().expect("poll_recv") {
        out.push((m, fds.len()));
    }
    out
}

fn sample(i: u8) -> Message {
    match i % 5 {
        0 => Message::Heartbeat { seq: u64::from(i) },
        1 => Message::Bye,
        2 => Message::Cancel {
            job: JobId(u64::from(i) << 40),
        },
        3 => Message::JobError {
            job: JobId(7),
            message: "e".repeat(usize::from(i % 64) * 13),
        },
        _ => Message::ExtraPool(ExtraPool {
            index: i,
            device: DeviceUuid([i; 16]),
        }),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever reads the stream arrives in, the frames and their descriptors come out as
    /// sent, and nothing before a frame's last byte is returned as a frame.
    #[test]
    fn any_split_of_a_valid_stream_into_reads_gives_the_same_frames(
        kinds in proptest::collection::vec(any::<u8>(), 0..12),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..40),
    ) {
        let msgs: Vec<Message> = kinds.iter().map(|&k| sample(k)).collect();
        let mut stream = Vec::new();
        // Where each frame begins and ends, and whether it carries a descriptor.
        let mut starts = Vec::new();
        let mut ends = Vec::new();
        for m in &msgs {
            starts.push((stream.len(), m.expected_fds() == 1));
            stream.extend(frame(m));
            ends.push(stream.len());
        }
        let mut points: Vec<usize> = cuts.iter().map(|c| c.index(stream.len().max(1))).collect();
        // A write with descriptors holds no byte of another frame (as `send` and `flush`
        // write them): it begins at its frame's first byte and ends by its last.
        for ((at, fd), end) in starts.iter().zip(&ends) {
            if *fd {
                points.push(*at);
                points.push(*end);
            }
        }
        points.push(0);
        points.push(stream.len());
        points.sort_unstable();
        points.dedup();
        let (peer, mut conn) = Connection::pair().expect("pair");
        let null = devnull();
        let mut got = Vec::new();
        for w in points.windows(2) {
            let (from, to) = (w[0], w[1]);
            let fds: Vec<&OwnedFd> = if starts.contains(&(from, true)) { vec![&null] } else { vec![] };
            write_raw(&peer, &stream[from..to], &fds);
            got.extend(drain(&mut conn));
            // Every frame whose last byte is written has come, and no other.
            let whole = ends.iter().filter(|&&end| end <= to).count();
            prop_assert_eq!(got.len(), whole, "frames returned after {} bytes", to);
        }
        got.extend(drain(&mut conn));
        let want: Vec<(Message, usize)> = msgs.iter().map(|m| (m.clone(), m.expected_fds())).collect();
        prop_assert_eq!(got, want);
        prop_assert!(conn.partial_frame_since().is_none());
    }
}

#[test]
fn a_frame_cut_midway_waits_until_its_last_byte_arrives() {
    let (peer, mut conn) = Connection::pair().expect("pair");
    let bytes = frame(&sample(3 + 5 * 4));
    write_raw(&peer, &bytes[..HEADER_LEN + 3], &[]);
    assert!(conn.poll_recv().expect("waits").is_none());
    assert!(
        conn.partial_frame_since().is_some(),
        "the partial frame's start is known"
    );
    assert!(conn.next_deadline(Duration::from_secs(1)).is_some());
    write_raw(&peer, &bytes[HEADER_LEN + 3..bytes.len() - 1], &[]);
    assert!(conn.poll_recv().expect("waits").is_none());
    write_raw(&peer, &bytes[bytes.len() - 1..], &[]);
    let (m, fds) = conn.poll_recv().expect("ok").expect("the whole frame");
    assert_eq!(m, sample(3 + 5 * 4));
    assert!(fds.is_empty());
    assert!(conn.partial_frame_since().is_none());
    assert!(conn.poll_recv().expect("nothing more").is_none());
}

#[test]
fn garbage_fails_at_once_without_waiting_for_more() {
    let (peer, mut conn) = Connection::pair().expect("pair");
    write_raw(&peer, b"\xffGARBAGE", &[]);
    let t = Instant::now();
    match conn.poll_recv() {
        Err(TransportError::Decode(
            DecodeError::UnknownVersion { .. } | DecodeError::TooLarge { .. },
        )) => {}
        other => panic!("expected a decode error, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_millis(100));
    assert!(matches!(
        conn.poll_recv(),
        Err(TransportError::Broken {
            direction: Direction::Recv,
            ..
        })
    ));
}

#[test]
fn a_partial_frame_past_the_frame_deadline_fails_as_too_slow() {
    let (peer, mut conn) = Connection::pair().expect("pair");
    let null = devnull();
    let bytes = frame(&sample(4));
    write_raw(&peer, &bytes[..2], &[&null]);
    assert!(conn.poll_recv().expect("waits").is_none());
    let timeout = Duration::from_millis(50);
    conn.check_deadlines(Instant::now(), timeout)
        .expect("not yet");
    let late = Instant::now() + timeout;
    match conn.check_deadlines(late, timeout) {
        Err(TransportError::FrameTooSlow {
            direction: Direction::Recv,
            after,
        }) => {
            assert_eq!(after, timeout);
        }
        other => panic!("expected FrameTooSlow, got {other:?}"),
    }
    assert!(matches!(
        conn.poll_recv(),
        Err(TransportError::Broken { .. })
    ));
}

#[test]
fn descriptors_dripped_onto_a_partial_frame_past_its_bound_fail() {
    let (peer, mut conn) = Connection::pair().expect("pair");
    let null = devnull();
    let bytes = frame(&sample(3 + 5 * 10));
    let mut failed = None;
    for (i, b) in bytes.iter().enumerate() {
        write_raw(&peer, std::slice::from_ref(b), &[&null]);
        match conn.poll_recv() {
            Ok(None) => {}
            Ok(Some(_)) => panic!("a frame came from a drip"),
            Err(e) => {
                failed = Some((i, e));
                break;
            }
        }
    }
    match failed {
        // Before its header is whole a frame may hold what any kind carries (one) and the
        // slack; one more fails, one per byte.
        Some((i, TransportError::TooManyFds { held, bound })) => {
            assert_eq!(bound, 1 + crate::PARTIAL_FD_SLACK);
            assert_eq!(held, bound + 1);
            assert_eq!(i, bound);
        }
        other => panic!("expected TooManyFds, got {other:?}"),
    }
}

/// Fills the peer's socket until it takes no more, through the queue; the frames queued.
fn fill_socket(conn: &mut Connection) -> usize {
    let mut sent = 0;
    while !conn.send_queued() {
        conn.enqueue(&Message::Heartbeat { seq: sent as u64 }, &[])
            .expect("enqueue");
        sent += 1;
    }
    sent
}

#[test]
fn a_peer_that_does_not_read_fills_the_queue_to_its_bound_and_no_further() {
    let (_peer, conn) = Connection::pair().expect("pair");
    let limits = SendQueueLimits {
        max_frames: 8,
        max_bytes: 1 << 20,
    };
    let mut conn = conn.with_queue_limits(limits);
    fill_socket(&mut conn);
    // One is queued already.
    for seq in 0..7 {
        conn.enqueue(&Message::Heartbeat { seq }, &[])
            .expect("under the bound");
    }
    match conn.enqueue(&Message::Bye, &[]) {
        Err(TransportError::SendQueueFull {
            frames: 9,
            limits: l,
            ..
        }) => assert_eq!(l, limits),
        other => panic!("expected SendQueueFull, got {other:?}"),
    }
    assert!(matches!(
        conn.enqueue(&Message::Bye, &[]),
        Err(TransportError::Broken {
            direction: Direction::Send,
            ..
        })
    ));
}

#[test]
fn queued_frames_arrive_in_order_with_their_descriptors_once_the_peer_reads() {
    let (mut peer, mut conn) = Connection::pair().expect("pair");
    let filler = fill_socket(&mut conn);
    let null = devnull();
    conn.enqueue(&sample(4), &[null.as_fd()])
        .expect("queued with its fd");
    conn.enqueue(&Message::Bye, &[]).expect("queued");
    let mut got = Vec::new();
    while got.len() < filler + 2 {
        conn.flush().expect("flush");
        let (m, fds) = peer.recv(soon()).expect("recv");
        got.push((m, fds.len()));
    }
    assert!(!conn.send_queued());
    for (i, (m, n)) in got[..filler].iter().enumerate() {
        assert_eq!((m, *n), (&Message::Heartbeat { seq: i as u64 }, 0));
    }
    assert_eq!(got[filler], (sample(4), 1));
    assert_eq!(got[filler + 1], (Message::Bye, 0));
}

#[test]
fn a_blocking_send_goes_after_the_queued_frames() {
    let (mut peer, mut conn) = Connection::pair().expect("pair");
    let filler = fill_socket(&mut conn);
    let reader = std::thread::spawn(move || {
        let mut last = None;
        for _ in 0..=filler {
            last = Some(peer.recv(soon()).expect("recv").0);
        }
        last
    });
    conn.send(&Message::Bye, &[], soon())
        .expect("sent after the queue");
    assert!(!conn.send_queued());
    assert_eq!(reader.join().expect("reader"), Some(Message::Bye));
}

#[test]
fn a_send_queue_stuck_past_the_frame_deadline_fails_as_too_slow() {
    let (_peer, mut conn) = Connection::pair().expect("pair");
    fill_socket(&mut conn);
    let timeout = Duration::from_millis(50);
    conn.check_deadlines(Instant::now(), timeout)
        .expect("not yet");
    match conn.check_deadlines(Instant::now() + timeout, timeout) {
        Err(TransportError::FrameTooSlow {
            direction: Direction::Send,
            ..
        }) => {}
        other => panic!("expected FrameTooSlow, got {other:?}"),
    }
    assert!(!conn.send_queued(), "the queue was dropped");
}
