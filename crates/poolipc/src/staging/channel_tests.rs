//! The host-staging rung across two real processes on SimDriver: each test re-executes this
//! test binary as the worker (`--exact <its own path>`, role in the environment), attached to
//! the parent's simulated machine, over an inherited socketpair. The worker runs the same test
//! function with the same arguments, so both sides agree on sizes without passing them.
//!
//! Contents are verified on the receiving side, and the simulation's happens-before model
//! (which covers the shared host buffer) must record no violation, except in the tests that
//! leave a wait out on purpose and prove that it is caught.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::process::Command;
use std::sync::Arc;

use poolipc_driver::sim::{SimConfig, SimDriver, Violation, ViolationKind};
use poolipc_driver::{
    DevicePtr, Driver, OwnedPool, OwnedStream, PoolAllocation, PoolHandle, PoolSharing,
    StreamHandle,
};
use poolipc_transport::{Connection, HandoffId, JobId, Message, connection_from_env, spawn_worker};

use super::{SkipWait, StagingChannel, StagingConfig};

const ROLE: &str = "POOLIPC_STAGING_TEST_ROLE";
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Host-side pieces for filling and checking device memory (keeps test memory small).
const PIECE: u64 = 8 * MIB;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    ParentToWorker,
    WorkerToParent,
}

/// Byte `i` of tensor `seed`: no period that a chunk or a half could hide.
fn pattern(seed: u64, start: u64, out: &mut [u8]) {
    for (k, b) in out.iter_mut().enumerate() {
        let mut x = (start + k as u64) ^ (seed << 40);
        x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        *b = (x >> 56) as u8;
    }
}

struct Side {
    driver: Arc<dyn Driver>,
    sim: Arc<SimDriver>,
    stream: StreamHandle,
    pool: PoolHandle,
}

impl Side {
    fn new(sim: SimDriver) -> Side {
        let sim = Arc::new(sim);
        let driver: Arc<dyn Driver> = sim.clone();
        driver.use_device(0).unwrap();
        let stream = OwnedStream::new(driver.clone()).unwrap().into_raw();
        let pool = OwnedPool::create(driver.clone(), 0, PoolSharing::None)
            .unwrap()
            .into_raw();
        Side {
            driver,
            sim,
            stream,
            pool,
        }
    }

    fn alloc(&self, bytes: u64) -> PoolAllocation {
        PoolAllocation::from_pool(Arc::clone(&self.driver), bytes, self.pool, self.stream).unwrap()
    }

    fn fill(&self, ptr: DevicePtr, bytes: u64, seed: u64) {
        let mut buf = vec![0u8; PIECE.min(bytes) as usize];
        let mut off = 0;
        while off < bytes {
            let n = PIECE.min(bytes - off) as usize;
            pattern(seed, off, &mut buf[..n]);
            // On the stream the memory was allocated on: ordered after the free that gave
            // the pool this memory back (a legacy-stream copy would race with it).
            self.driver
                .memcpy_htod_on(ptr.offset(off), &buf[..n], self.stream)
                .unwrap();
            off += n as u64;
        }
    }

    fn verify(&self, ptr: DevicePtr, bytes: u64, seed: u64) {
        self.driver.stream_synchronize(self.stream).unwrap();
        let mut got = vec![0u8; PIECE.min(bytes) as usize];
        let mut want = got.clone();
        let mut off = 0;
        while off < bytes {
            let n = PIECE.min(bytes - off) as usize;
            self.driver
                .memcpy_dtoh(&mut got[..n], ptr.offset(off))
                .unwrap();
            pattern(seed, off, &mut want[..n]);
            if got[..n] != want[..n] {
                let i = got[..n].iter().zip(&want[..n]).position(|(a, b)| a != b);
                panic!("tensor {seed} differs at byte {}", off + i.unwrap() as u64);
            }
            off += n as u64;
        }
    }

    fn send(&self, ch: &mut StagingChannel, conn: &mut Connection, bytes: u64, seed: u64) {
        let src = self.alloc(bytes);
        self.fill(src.ptr(), bytes, seed);
        ch.send_tensor(
            conn,
            JobId(seed),
            HandoffId(seed),
            src.ptr(),
            bytes,
            self.stream,
        )
        .unwrap();
        src.free(self.stream).unwrap();
    }

    fn recv(&self, ch: &mut StagingChannel, conn: &mut Connection, bytes: u64, seed: u64) {
        let alloc = self.alloc(bytes);
        let dst = alloc.ptr();
        ch.recv_tensor(conn, JobId(seed), HandoffId(seed), dst, bytes, self.stream)
            .unwrap();
        if ch.skips_a_wait() {
            // A channel told to skip a wait races on the GPU: the simulation's streams run
            // asynchronously, so the bytes may be wrong; the test checks the violation.
            self.driver.stream_synchronize(self.stream).unwrap();
        } else {
            self.verify(dst, bytes, seed);
        }
        alloc.free(self.stream).unwrap();
    }

    /// With `chatter`, each side sends [`chatter`] before each transfer, and then finds the
    /// peer's in its channel's backlog.
    fn run(
        &self,
        ch: &mut StagingChannel,
        conn: &mut Connection,
        parent: bool,
        transfers: &[(Direction, u64)],
        chatter_too: bool,
    ) {
        for (i, (dir, bytes)) in transfers.iter().enumerate() {
            let seed = i as u64 + 1;
            if chatter_too {
                chatter(conn, 1000 + seed);
            }
            let sends = (*dir == Direction::ParentToWorker) == parent;
            if sends {
                self.send(ch, conn, *bytes, seed);
            } else {
                self.recv(ch, conn, *bytes, seed);
            }
            if chatter_too {
                assert_eq!(ch.take_backlog(), [kept(1000 + seed)], "transfer {seed}");
            }
        }
    }
}

/// Frames that are not the channel's own, sent where a staging wait will read them: a
/// heartbeat (dropped) and a cancel (kept in the backlog).
fn chatter(conn: &mut Connection, n: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    conn.send(&Message::Heartbeat { seq: n }, &[], deadline)
        .unwrap();
    conn.send(&kept(n), &[], deadline).unwrap();
}

/// The frame of [`chatter`] that the backlog keeps.
fn kept(n: u64) -> Message {
    Message::Cancel { job: JobId(n) }
}

/// Runs `transfers` over one staging channel between this process and a worker that re-runs
/// `test`. Returns the violations the machine recorded.
fn run_case(
    test: &str,
    chunk: u64,
    transfers: &[(Direction, u64)],
    skip: SkipWait,
) -> Vec<Violation> {
    run_case_with(test, chunk, transfers, skip, false)
}

/// [`run_case`], and with `chatter_too` each side sends other frames before the setup and
/// before each transfer ([`chatter`]), which the peer's channel must keep in its backlog.
fn run_case_with(
    test: &str,
    chunk: u64,
    transfers: &[(Direction, u64)],
    skip: SkipWait,
    chatter_too: bool,
) -> Vec<Violation> {
    let config = StagingConfig {
        chunk: chunk as usize,
        skip_wait: skip,
        ..StagingConfig::default()
    };
    if std::env::var_os(ROLE).is_some() {
        let side = Side::new(
            SimDriver::from_env()
                .unwrap()
                .expect("a machine to attach to"),
        );
        let mut conn = connection_from_env().unwrap();
        if chatter_too {
            chatter(&mut conn, 999);
        }
        let mut ch = StagingChannel::accept_worker(side.driver.clone(), &mut conn, config).unwrap();
        if chatter_too {
            assert_eq!(ch.take_backlog(), [kept(998)], "setup (worker)");
        }
        side.run(&mut ch, &mut conn, false, transfers, chatter_too);
        drop(ch);
        // The simulated process ends before the OS process: its queued GPU work runs first
        // (`exit` would skip the drop).
        drop(side);
        std::process::exit(0);
    }
    let side = Side::new(
        SimDriver::new(SimConfig {
            memory_per_device: 4 << 30,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    // The harness names a unit test by its path below the crate.
    let path = format!("{}::{test}", module_path!().trim_start_matches("poolipc::"));
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([path.as_str(), "--exact", "--nocapture"]);
    let (key, value) = side.sim.child_env();
    cmd.env(key, value).env(ROLE, "worker");
    let (mut child, mut conn) = spawn_worker(cmd).unwrap();
    if chatter_too {
        chatter(&mut conn, 998);
    }
    let mut ch = StagingChannel::setup_parent(side.driver.clone(), &mut conn, config).unwrap();
    if chatter_too {
        assert_eq!(ch.take_backlog(), [kept(999)], "setup (parent)");
    }
    side.run(&mut ch, &mut conn, true, transfers, chatter_too);
    let status = child.wait().unwrap();
    assert!(status.success(), "worker failed: {status}");
    drop(ch);
    side.sim.violations()
}

fn assert_clean(v: &[Violation]) {
    assert!(v.is_empty(), "violations recorded: {v:#?}");
}

use Direction::{ParentToWorker as P2W, WorkerToParent as W2P};

#[test]
fn one_byte_arrives_intact_in_both_directions() {
    let v = run_case(
        "one_byte_arrives_intact_in_both_directions",
        64 * KIB,
        &[(P2W, 1), (W2P, 1)],
        SkipWait::None,
    );
    assert_clean(&v);
}

#[test]
fn an_odd_size_over_several_chunks_arrives_intact_in_both_directions() {
    let odd = 5 * 64 * KIB + 12_345;
    let v = run_case(
        "an_odd_size_over_several_chunks_arrives_intact_in_both_directions",
        64 * KIB,
        &[(P2W, odd), (W2P, odd)],
        SkipWait::None,
    );
    assert_clean(&v);
}

#[test]
fn exactly_one_chunk_arrives_intact_in_both_directions() {
    let v = run_case(
        "exactly_one_chunk_arrives_intact_in_both_directions",
        MIB,
        &[(P2W, MIB), (W2P, MIB), (P2W, 2 * MIB)],
        SkipWait::None,
    );
    assert_clean(&v);
}

#[test]
fn three_hundred_mib_through_two_eight_mib_halves_arrive_intact_in_both_directions() {
    let v = run_case(
        "three_hundred_mib_through_two_eight_mib_halves_arrive_intact_in_both_directions",
        8 * MIB,
        &[(P2W, 300 * MIB), (W2P, 300 * MIB)],
        SkipWait::None,
    );
    assert_clean(&v);
}

#[test]
fn transfers_alternating_directions_on_one_channel_stay_ordered() {
    let v = run_case(
        "transfers_alternating_directions_on_one_channel_stay_ordered",
        64 * KIB,
        &[
            (P2W, 3 * 64 * KIB + 1),
            (P2W, 64 * KIB - 1),
            (W2P, 2 * 64 * KIB + 7),
            (W2P, 5),
            (P2W, 4 * 64 * KIB),
        ],
        SkipWait::None,
    );
    assert_clean(&v);
}

#[test]
fn frames_other_than_chunks_during_setup_and_transfers_wait_in_the_backlog_in_order() {
    let v = run_case_with(
        "frames_other_than_chunks_during_setup_and_transfers_wait_in_the_backlog_in_order",
        64 * KIB,
        &[
            (P2W, 3 * 64 * KIB + 1),
            (W2P, 1),
            (W2P, 4 * 64 * KIB),
            (P2W, 5),
        ],
        SkipWait::None,
        true,
    );
    assert_clean(&v);
}

#[test]
fn a_receiver_that_skips_the_filled_wait_is_caught_by_the_simulation() {
    let v = run_case(
        "a_receiver_that_skips_the_filled_wait_is_caught_by_the_simulation",
        64 * KIB,
        &[(P2W, 4 * 64 * KIB)],
        SkipWait::Filled,
    );
    assert!(
        v.iter()
            .any(|v| v.kind == ViolationKind::UnorderedAccess && v.call == "cuMemcpyHtoDAsync"),
        "no unordered host-to-device copy recorded: {v:#?}"
    );
}

#[test]
fn a_sender_that_skips_the_drained_wait_is_caught_by_the_simulation() {
    let v = run_case(
        "a_sender_that_skips_the_drained_wait_is_caught_by_the_simulation",
        64 * KIB,
        &[(W2P, 4 * 64 * KIB)],
        SkipWait::Drained,
    );
    assert!(
        v.iter()
            .any(|v| v.kind == ViolationKind::UnorderedAccess && v.call == "cuMemcpyDtoHAsync"),
        "no unordered device-to-host copy recorded: {v:#?}"
    );
}
