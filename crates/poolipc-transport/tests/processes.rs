//! Two real processes over real sockets. The child is this test binary, re-executed with
//! `POOLIPC_TEST_ROLE` naming what it does (see `child_process_entry`); no fork inside the
//! multithreaded harness.

mod common;

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use poolipc_transport::{
    Ack, Capabilities, Connection, DeviceUuid, Direction, ErrorCode, HandoffId, HandshakeConfig,
    HandshakeError, JobId, Message, PrivateListener, SetupError, TransportError, connect_private,
    connection_from_env, parent_handshake, spawn_worker, worker_handshake,
};

const ROLE_ENV: &str = "POOLIPC_TEST_ROLE";
const SOCKET_ENV: &str = "POOLIPC_TEST_SOCKET";
const POOL_TEXT: &[u8] = b"pool bytes from the parent";
const WORKER_TEXT: &[u8] = b"written by the worker";
const WORKER_OFFSET: u64 = 4096;

fn secs(n: u64) -> Instant {
    Instant::now() + Duration::from_secs(n)
}

fn config(device: DeviceUuid) -> HandshakeConfig {
    HandshakeConfig {
        identity: poolipc_transport::Identity {
            device,
            ..common::identity()
        },
        required: Capabilities::POOL_POINTER,
    }
}

fn worker_command(role: &str) -> Command {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args([
        "child_process_entry",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE_ENV, role)
    .stdin(Stdio::null())
    .stdout(Stdio::null());
    cmd
}

/// A directory where uid 65534 can exec a file we put there: every ancestor searchable by
/// others and the filesystem not mounted noexec.
fn exec_dir_for_nobody() -> Option<PathBuf> {
    use nix::sys::statvfs::{FsFlags, statvfs};
    let exe = std::env::current_exe().ok()?;
    let target = exe
        .parent()
        .and_then(std::path::Path::parent)
        .map(PathBuf::from);
    let candidates = ["/tmp", "/dev/shm", "/var/tmp"]
        .into_iter()
        .map(PathBuf::from)
        .chain(target);
    candidates.into_iter().find(|dir| {
        let searchable = dir.ancestors().all(|a| {
            std::fs::metadata(a).is_ok_and(|m| m.is_dir() && m.permissions().mode() & 0o001 != 0)
        });
        let exec = statvfs(dir.as_path()).is_ok_and(|v| !v.flags().contains(FsFlags::ST_NOEXEC));
        searchable && exec
    })
}

/// A child that runs as uid/gid 65534 from its first instruction: the uid is dropped between
/// fork and exec, where the process has one thread. (Calling setuid inside the child's own
/// libtest harness, where a second thread is alive, died of SIGSEGV on one CI machine.) The
/// binary is a copy in a fresh 0755 directory, so nobody can exec it wherever the checkout
/// lives. `None`, said on stderr, when no directory lets nobody exec.
fn nobody_command(role: &str) -> Option<(Command, PathBuf)> {
    use std::os::unix::process::CommandExt;
    let Some(base) = exec_dir_for_nobody() else {
        eprintln!("NOT RUN: no directory here lets uid {NOBODY} exec a copy of this test");
        return None;
    };
    let dir = base.join(format!("poolipc-test-nobody-{}-{role}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir for the copy");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod copy dir");
    let exe = dir.join("child");
    std::fs::copy(std::env::current_exe().expect("current_exe"), &exe).expect("copy test binary");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod copy");
    let template = worker_command(role);
    let mut cmd = Command::new(&exe);
    cmd.args(template.get_args())
        .envs(template.get_envs().filter_map(|(k, v)| v.map(|v| (k, v))))
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .uid(NOBODY)
        .gid(NOBODY);
    Some((cmd, dir))
}

const NOBODY: u32 = 65534;

fn spawn(role: &str) -> (Child, Connection) {
    spawn_worker(worker_command(role)).expect("spawn worker")
}

/// Waits for the child, at most `limit`; kills it if it overstays.
fn reap(mut child: Child, limit: Duration) -> std::process::ExitStatus {
    let end = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!("child {} did not exit within {limit:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn pool_memfd() -> OwnedFd {
    let fd =
        nix::sys::memfd::memfd_create(c"poolipc-test-pool", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .expect("memfd_create");
    let mut f = File::from(fd);
    f.write_all(POOL_TEXT).expect("write memfd");
    f.set_len(2 * WORKER_OFFSET).expect("size memfd");
    OwnedFd::from(f)
}

fn private_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("poolipc-test-{}-{tag}", std::process::id()))
}

// ---- the child ----------------------------------------------------------------------------

/// Not a test of its own: the entry point of the child processes the tests below start. It
/// does nothing unless `POOLIPC_TEST_ROLE` is set, and then exits with 0 when its side of the
/// story held, non-zero (with a line on stderr) otherwise.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let result = match role.as_str() {
        "handshake_worker" => handshake_worker(),
        "refusing_worker" => refusing_worker(),
        "silent_worker" => silent_worker(),
        "half_frame_worker" => half_frame_worker(),
        "handshake_then_hang" => handshake_then_hang(),
        "other_uid_connector" => other_uid_connector(),
        "other_uid_blocked" => other_uid_blocked(),
        "connecting_worker" => connecting_worker(),
        other => Err(format!("unknown role {other}")),
    };
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("child role {role} failed: {e}");
            std::process::exit(1)
        }
    }
}

fn handshake_worker() -> Result<(), String> {
    let mut conn = connection_from_env().map_err(|e| e.to_string())?;
    let (peer, pool) = worker_handshake(&mut conn, &config(common::uuid(1)), secs(10))
        .map_err(|e| e.to_string())?;
    if peer.identity.device != common::uuid(1) {
        return Err(format!("parent device {}", peer.identity.device));
    }
    // The fd shares its file offset with the parent's: read and write at explicit offsets.
    let f = File::from(pool);
    let mut got = vec![0u8; POOL_TEXT.len()];
    f.read_exact_at(&mut got, 0).map_err(|e| e.to_string())?;
    if got != POOL_TEXT {
        return Err(format!("pool fd holds {got:?}"));
    }
    f.write_all_at(WORKER_TEXT, WORKER_OFFSET)
        .map_err(|e| e.to_string())?;
    let ack = Message::Ack(Ack {
        job: JobId(1),
        handles: vec![HandoffId(42)],
    });
    conn.send(&ack, &[], secs(10)).map_err(|e| e.to_string())?;
    match conn.recv(secs(10)) {
        Ok((Message::Bye, _)) => Ok(()),
        other => Err(format!("expected Bye, got {other:?}")),
    }
}

fn refusing_worker() -> Result<(), String> {
    let mut conn = connection_from_env().map_err(|e| e.to_string())?;
    match worker_handshake(&mut conn, &config(common::uuid(9)), secs(10)) {
        Err(HandshakeError::DeviceMismatch { ours, theirs })
            if ours == common::uuid(9) && theirs == common::uuid(1) =>
        {
            Ok(())
        }
        other => Err(format!("expected DeviceMismatch, got {other:?}")),
    }
}

fn silent_worker() -> Result<(), String> {
    let _conn = connection_from_env().map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_secs(30));
    Ok(())
}

fn half_frame_worker() -> Result<(), String> {
    let conn = connection_from_env().map_err(|e| e.to_string())?;
    let mut f = File::from(conn.into_fd());
    f.write_all(&[16, 0, 0, 0, 1]).map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_secs(30));
    Ok(())
}

fn handshake_then_hang() -> Result<(), String> {
    let mut conn = connection_from_env().map_err(|e| e.to_string())?;
    worker_handshake(&mut conn, &config(common::uuid(1)), secs(10)).map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_secs(60));
    Ok(())
}

/// The parent started us as nobody (see `nobody_command`); make sure it did.
fn check_nobody() -> Result<(), String> {
    let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
    if uid.as_raw() != NOBODY || gid.as_raw() != NOBODY {
        return Err(format!("running as {uid}:{gid}, not {NOBODY}:{NOBODY}"));
    }
    Ok(())
}

fn socket_path() -> Result<PathBuf, String> {
    std::env::var_os(SOCKET_ENV)
        .map(PathBuf::from)
        .ok_or_else(|| "no socket path".into())
}

fn other_uid_connector() -> Result<(), String> {
    let path = socket_path()?;
    check_nobody()?;
    match connect_private(&path, secs(5)) {
        // Our side of the check: the listener runs as root, not as us.
        Err(SetupError::PeerUidMismatch {
            expected: 65534,
            found: 0,
            ..
        }) => Ok(()),
        other => Err(format!("expected PeerUidMismatch, got {other:?}")),
    }
}

fn other_uid_blocked() -> Result<(), String> {
    let path = socket_path()?;
    check_nobody()?;
    match connect_private(&path, secs(5)) {
        Err(SetupError::Sys {
            op: "connect",
            errno: nix::errno::Errno::EACCES,
        }) => Ok(()),
        other => Err(format!("expected EACCES from connect, got {other:?}")),
    }
}

fn connecting_worker() -> Result<(), String> {
    let mut conn = connect_private(&socket_path()?, secs(5)).map_err(|e| e.to_string())?;
    let (_peer, _pool) = worker_handshake(&mut conn, &config(common::uuid(1)), secs(10))
        .map_err(|e| e.to_string())?;
    Ok(())
}

// ---- the tests ----------------------------------------------------------------------------

#[test]
fn handshake_hands_the_pool_fd_to_a_spawned_worker_which_sees_and_writes_its_bytes() {
    let (child, mut conn) = spawn("handshake_worker");
    let pool = pool_memfd();
    let peer = parent_handshake(&mut conn, &config(common::uuid(1)), pool.as_fd(), secs(10))
        .expect("handshake");
    assert_eq!(peer.identity.device, common::uuid(1));
    assert_eq!(
        peer.capabilities,
        Capabilities::POOL_POINTER | Capabilities::IPC_EVENTS
    );
    let (msg, fds) = conn.recv(secs(10)).expect("worker's ack");
    assert_eq!(
        msg,
        Message::Ack(Ack {
            job: JobId(1),
            handles: vec![HandoffId(42)]
        })
    );
    assert!(fds.is_empty());
    let f = File::from(pool);
    let mut got = vec![0u8; WORKER_TEXT.len()];
    f.read_exact_at(&mut got, WORKER_OFFSET).expect("read");
    assert_eq!(
        got, WORKER_TEXT,
        "the worker's write through the passed fd is visible here"
    );
    conn.send(&Message::Bye, &[], secs(10)).expect("bye");
    assert!(reap(child, Duration::from_secs(10)).success());
}

#[test]
fn a_device_mismatch_is_a_typed_error_on_both_sides() {
    let (child, mut conn) = spawn("refusing_worker");
    let pool = pool_memfd();
    let err = parent_handshake(&mut conn, &config(common::uuid(1)), pool.as_fd(), secs(10))
        .expect_err("worker is on another device");
    assert!(
        matches!(&err, HandshakeError::Refused { code, .. } if *code == ErrorCode::DEVICE_MISMATCH),
        "{err:?}"
    );
    assert!(
        reap(child, Duration::from_secs(10)).success(),
        "the worker saw DeviceMismatch"
    );
}

#[test]
fn a_silent_peer_makes_recv_time_out_at_its_deadline() {
    let (mut child, mut conn) = spawn("silent_worker");
    let start = Instant::now();
    let err = conn
        .recv(Instant::now() + Duration::from_millis(300))
        .expect_err("silence");
    let took = start.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        matches!(
            err,
            TransportError::Timeout {
                direction: Direction::Recv,
                partial: false
            }
        ),
        "{err:?}"
    );
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "took {took:?}"
    );
}

#[test]
fn a_half_frame_then_silence_times_out_and_breaks_the_connection() {
    let (mut child, mut conn) = spawn("half_frame_worker");
    let start = Instant::now();
    let err = conn
        .recv(Instant::now() + Duration::from_millis(500))
        .expect_err("half frame");
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(
        matches!(err, TransportError::Timeout { partial: true, .. }),
        "{err:?}"
    );
    let _ = child.kill();
    let _ = child.wait();
    assert!(matches!(
        conn.recv(secs(1)),
        Err(TransportError::Broken { .. })
    ));
}

#[test]
fn a_worker_killed_with_sigkill_is_seen_as_gone_at_once() {
    let (mut child, mut conn) = spawn("handshake_then_hang");
    let pool = pool_memfd();
    parent_handshake(&mut conn, &config(common::uuid(1)), pool.as_fd(), secs(10))
        .expect("handshake");
    child.kill().expect("SIGKILL");
    let start = Instant::now();
    let err = conn.recv(secs(30)).expect_err("dead peer");
    let took = start.elapsed();
    // EOF, or ECONNRESET when the worker died with our last frame unread: both say "gone".
    assert!(err.is_peer_gone(), "{err:?}");
    assert!(took < Duration::from_secs(2), "noticed after {took:?}");
    let err = conn
        .send(&Message::Heartbeat { seq: 1 }, &[], secs(1))
        .expect_err("dead peer");
    assert!(err.is_peer_gone(), "{err:?}");
    let status = child.wait().expect("wait");
    assert_eq!(status.signal(), Some(libc::SIGKILL));
}

#[test]
fn a_worker_started_by_someone_else_connects_through_the_private_listener() {
    let dir = private_dir("listener");
    let listener = PrivateListener::bind(&dir, "worker.sock").expect("bind");
    let mut cmd = worker_command("connecting_worker");
    cmd.env(SOCKET_ENV, listener.path());
    let child = cmd.spawn().expect("spawn");
    let (mut conn, peer) = listener.accept(secs(10)).expect("accept");
    assert_eq!(peer.pid as u32, child.id());
    let pool = pool_memfd();
    parent_handshake(&mut conn, &config(common::uuid(1)), pool.as_fd(), secs(10))
        .expect("handshake");
    assert!(reap(child, Duration::from_secs(10)).success());
    drop(listener);
    let _ = std::fs::remove_dir(&dir);
}

fn running_as_root() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    eprintln!(
        "NOT RUN: the real second-uid part needs root (setuid to 65534); \
         the uid comparison itself is covered by listener_tests"
    );
    false
}

#[test]
fn a_peer_of_another_uid_is_dropped_with_a_typed_error_on_both_sides() {
    if !running_as_root() {
        return;
    }
    let dir = private_dir("other-uid");
    let listener = PrivateListener::bind(&dir, "worker.sock").expect("bind");
    // Open the first wall (directory and socket modes) on purpose, to show the second holds.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).expect("chmod dir");
    std::fs::set_permissions(listener.path(), std::fs::Permissions::from_mode(0o666))
        .expect("chmod socket");
    let Some((mut cmd, copy_dir)) = nobody_command("other_uid_connector") else {
        return;
    };
    cmd.env(SOCKET_ENV, listener.path());
    let child = cmd.spawn().expect("spawn");
    let err = listener.accept(secs(10)).expect_err("other uid accepted");
    assert!(
        matches!(
            err,
            SetupError::PeerUidMismatch {
                expected: 0,
                found: 65534,
                ..
            }
        ),
        "{err:?}"
    );
    let status = reap(child, Duration::from_secs(10));
    let _ = std::fs::remove_dir_all(&copy_dir);
    assert!(
        status.success(),
        "the child saw the listener's uid: {status:?}"
    );
    drop(listener);
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn a_peer_of_another_uid_cannot_reach_a_socket_in_the_private_directory() {
    if !running_as_root() {
        return;
    }
    let dir = private_dir("blocked");
    let listener = PrivateListener::bind(&dir, "worker.sock").expect("bind");
    let Some((mut cmd, copy_dir)) = nobody_command("other_uid_blocked") else {
        return;
    };
    cmd.env(SOCKET_ENV, listener.path());
    let child = cmd.spawn().expect("spawn");
    let status = reap(child, Duration::from_secs(10));
    let _ = std::fs::remove_dir_all(&copy_dir);
    assert!(status.success(), "the child got EACCES: {status:?}");
    let err = listener
        .accept(Instant::now() + Duration::from_millis(200))
        .expect_err("nobody came");
    assert!(
        matches!(err, SetupError::Timeout { op: "accept" }),
        "{err:?}"
    );
    drop(listener);
    let _ = std::fs::remove_dir(&dir);
}
