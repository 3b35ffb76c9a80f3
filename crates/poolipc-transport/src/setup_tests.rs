//! Setup and handshake checks that need no second process: the env variable, the private
//! directory, the uid comparison, and every handshake mismatch over a socket pair.

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rstest::rstest;

use crate::codec::{FrameLimits, encode};
use crate::{
    Capabilities, Connection, DeviceUuid, ErrorCode, HandshakeConfig, HandshakeError, Identity,
    Message, PeerCred, PrivateListener, SetupError, check_peer_uid, connect_private,
    ensure_private_dir, parent_handshake, parse_fd_var, worker_handshake,
    worker_handshake_choosing,
};

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

#[rstest]
#[case::plain("3", Some(3))]
#[case::large("1023", Some(1023))]
#[case::empty("", None)]
#[case::stdin("0", None)]
#[case::stderr("2", None)]
#[case::negative("-5", None)]
#[case::plus_sign("+5", None)]
#[case::leading_space(" 5", None)]
#[case::trailing_newline("5\n", None)]
#[case::leading_zero("05", None)]
#[case::hex("0x5", None)]
#[case::letters("five", None)]
#[case::overflow("99999999999", None)]
fn the_fd_variable_is_parsed_strictly(#[case] value: &str, #[case] expected: Option<i32>) {
    match (parse_fd_var(OsStr::new(value)), expected) {
        (Ok(fd), Some(want)) => assert_eq!(fd, want),
        (
            Err(SetupError::EnvInvalid {
                var: crate::FD_ENV, ..
            }),
            None,
        ) => {}
        (got, want) => panic!("{value:?}: got {got:?}, want {want:?}"),
    }
}

#[test]
fn the_fd_variable_must_be_utf8() {
    assert!(matches!(
        parse_fd_var(OsStr::from_bytes(&[0xff])),
        Err(SetupError::EnvInvalid {
            reason: "not UTF-8",
            ..
        })
    ));
}

fn temp_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("poolipc-unit-{}-{tag}", std::process::id()))
}

#[test]
fn a_missing_socket_directory_is_created_private() {
    let dir = temp_path("create");
    ensure_private_dir(&dir).expect("created");
    let mode = std::fs::metadata(&dir).expect("stat").permissions().mode() & 0o777;
    std::fs::remove_dir(&dir).expect("cleanup");
    assert_eq!(mode, 0o700);
}

#[rstest]
#[case::group_readable(0o750)]
#[case::world_searchable(0o701)]
fn a_socket_directory_open_to_others_is_refused(#[case] mode: u32) {
    let dir = temp_path(&format!("open-{mode:o}"));
    std::fs::create_dir(&dir).expect("mkdir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).expect("chmod");
    let got = ensure_private_dir(&dir);
    std::fs::remove_dir(&dir).expect("cleanup");
    assert!(
        matches!(got, Err(SetupError::InsecureDir { .. })),
        "{got:?}"
    );
}

#[test]
fn a_symlink_as_socket_directory_is_refused() {
    let target = temp_path("link-target");
    let link = temp_path("link");
    std::fs::create_dir(&target).expect("mkdir");
    std::os::unix::fs::symlink(&target, &link).expect("symlink");
    let got = ensure_private_dir(&link);
    std::fs::remove_file(&link).expect("cleanup");
    std::fs::remove_dir(&target).expect("cleanup");
    assert!(
        matches!(got, Err(SetupError::InsecureDir { .. })),
        "{got:?}"
    );
}

#[test]
fn a_file_in_the_way_of_the_socket_is_not_removed() {
    let dir = temp_path("occupied");
    ensure_private_dir(&dir).expect("dir");
    std::fs::write(dir.join("sock"), b"mine").expect("file");
    let got = PrivateListener::bind(&dir, "sock");
    std::fs::remove_file(dir.join("sock")).expect("cleanup");
    std::fs::remove_dir(&dir).expect("cleanup");
    assert!(
        matches!(got, Err(SetupError::PathOccupied { .. })),
        "{got:?}"
    );
}

#[test]
fn the_uid_comparison_refuses_another_uid() {
    let peer = PeerCred {
        pid: 1234,
        uid: 1000,
        gid: 1000,
    };
    assert!(check_peer_uid(peer, 1000).is_ok());
    assert!(matches!(
        check_peer_uid(peer, 0),
        Err(SetupError::PeerUidMismatch {
            expected: 0,
            found: 1000,
            pid: 1234
        })
    ));
}

#[test]
fn the_listener_drops_a_peer_whose_uid_it_does_not_accept() {
    let dir = temp_path("injected-uid");
    let mut listener = PrivateListener::bind(&dir, "sock").expect("bind");
    let me = nix::unistd::geteuid().as_raw();
    listener.set_allowed_uid(me.wrapping_add(4242));
    let mut client = connect_private(listener.path(), soon()).expect("connect");
    let err = listener.accept(soon()).expect_err("uid not accepted");
    assert!(
        matches!(err, SetupError::PeerUidMismatch { found, .. } if found == me),
        "{err:?}"
    );
    // The listener closed its end: the client sees EOF.
    let got = client.recv(soon());
    assert!(
        matches!(got, Err(crate::TransportError::PeerClosed { .. })),
        "{got:?}"
    );
    drop(listener);
    std::fs::remove_dir(&dir).expect("cleanup");
}

// ---- handshake mismatches, both sides ---------------------------------------------------

fn cfg(device: u8, driver: i32, caps: Capabilities, required: Capabilities) -> HandshakeConfig {
    HandshakeConfig {
        identity: Identity {
            device: DeviceUuid([device; 16]),
            driver_version: driver,
            capabilities: caps,
            devices: vec![],
        },
        required,
    }
}

fn base() -> HandshakeConfig {
    cfg(
        1,
        12080,
        Capabilities::POOL_POINTER,
        Capabilities::POOL_POINTER,
    )
}

fn pool() -> std::os::fd::OwnedFd {
    nix::sys::memfd::memfd_create(c"test-pool", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .expect("memfd")
}

/// Runs the parent's handshake here and `worker_side` on a thread, over a socket pair;
/// returns (parent result, worker result).
fn both_sides<T: Send + 'static>(
    parent: &HandshakeConfig,
    worker_side: impl FnOnce(&mut Connection) -> Result<T, HandshakeError> + Send + 'static,
) -> (
    Result<crate::Peer, HandshakeError>,
    Result<T, HandshakeError>,
) {
    let (mut p, mut w) = Connection::pair().expect("pair");
    let worker_side = std::thread::spawn(move || worker_side(&mut w));
    let fd = pool();
    let parent_result = parent_handshake(&mut p, parent, fd.as_fd(), soon());
    let worker_result = worker_side.join().expect("worker thread");
    (parent_result, worker_result)
}

/// Both sides of the handshake; returns (parent result, worker result).
fn handshake(
    parent: HandshakeConfig,
    worker: HandshakeConfig,
) -> (
    Result<crate::Peer, HandshakeError>,
    Result<crate::Peer, HandshakeError>,
) {
    both_sides(&parent, move |w| {
        worker_handshake(w, &worker, soon()).map(|(peer, _fd)| peer)
    })
}

#[test]
fn matching_sides_agree_on_the_common_capabilities() {
    let parent = cfg(
        1,
        12080,
        Capabilities::POOL_POINTER | Capabilities::VMM_ARENA,
        Capabilities::POOL_POINTER,
    );
    let (p, w) = handshake(parent, base());
    assert_eq!(p.expect("parent").capabilities, Capabilities::POOL_POINTER);
    assert_eq!(w.expect("worker").capabilities, Capabilities::POOL_POINTER);
}

#[test]
fn a_device_mismatch_is_refused_by_the_worker() {
    let (p, w) = handshake(
        base(),
        cfg(2, 12080, Capabilities::POOL_POINTER, Capabilities::NONE),
    );
    assert!(
        matches!(w, Err(HandshakeError::DeviceMismatch { .. })),
        "{w:?}"
    );
    assert!(
        matches!(&p, Err(HandshakeError::Refused { code, .. }) if *code == ErrorCode::DEVICE_MISMATCH),
        "{p:?}"
    );
}

/// The worker's side chosen from the parent's Hello; returns (parent result, worker result).
fn handshake_choosing(
    parent: HandshakeConfig,
    choose: impl FnOnce(&Identity) -> Result<HandshakeConfig, HandshakeError> + Send + 'static,
) -> (
    Result<crate::Peer, HandshakeError>,
    Result<HandshakeConfig, HandshakeError>,
) {
    both_sides(&parent, move |w| {
        worker_handshake_choosing(w, choose, soon()).map(|(_peer, _fd, local)| local)
    })
}

#[test]
fn a_worker_may_choose_its_device_from_the_parents_hello() {
    // The worker sees devices 7, 1 and 9 and takes the one the parent named.
    let (p, w) = handshake_choosing(base(), |theirs| {
        let seen = [7u8, 1, 9];
        let found = seen
            .into_iter()
            .find(|&d| DeviceUuid([d; 16]) == theirs.device)
            .expect("the parent's device is among ours");
        Ok(cfg(
            found,
            12080,
            Capabilities::POOL_POINTER,
            Capabilities::NONE,
        ))
    });
    assert_eq!(p.expect("parent").identity.device, DeviceUuid([1; 16]));
    assert_eq!(w.expect("worker").identity.device, DeviceUuid([1; 16]));
}

#[test]
fn a_worker_that_does_not_see_the_parents_device_refuses_and_both_sides_say_so() {
    let (p, w) = handshake_choosing(base(), |theirs| {
        Err(HandshakeError::DeviceNotVisible {
            theirs: theirs.device,
            reason: "this process sees 2 devices".into(),
        })
    });
    assert!(
        matches!(&w, Err(HandshakeError::DeviceNotVisible { theirs, .. }) if *theirs == DeviceUuid([1; 16])),
        "{w:?}"
    );
    assert!(
        matches!(&p, Err(HandshakeError::Refused { code, message })
            if *code == ErrorCode::DEVICE_MISMATCH && message.contains("sees 2 devices")),
        "{p:?}"
    );
}

#[test]
fn a_chosen_side_is_still_checked_against_the_parent() {
    // Choosing does not skip the checks: a choice of another device is a mismatch.
    let (p, w) = handshake_choosing(base(), |_| {
        Ok(cfg(
            2,
            12080,
            Capabilities::POOL_POINTER,
            Capabilities::NONE,
        ))
    });
    assert!(
        matches!(w, Err(HandshakeError::DeviceMismatch { .. })),
        "{w:?}"
    );
    assert!(
        matches!(&p, Err(HandshakeError::Refused { code, .. }) if *code == ErrorCode::DEVICE_MISMATCH),
        "{p:?}"
    );
}

#[test]
fn a_driver_version_mismatch_is_refused_by_the_worker() {
    let (p, w) = handshake(
        base(),
        cfg(1, 13000, Capabilities::POOL_POINTER, Capabilities::NONE),
    );
    assert!(
        matches!(
            w,
            Err(HandshakeError::DriverMismatch {
                ours: 13000,
                theirs: 12080
            })
        ),
        "{w:?}"
    );
    assert!(
        matches!(&p, Err(HandshakeError::Refused { code, .. }) if *code == ErrorCode::DRIVER_MISMATCH),
        "{p:?}"
    );
}

#[test]
fn a_worker_missing_a_required_capability_is_refused_by_the_parent() {
    let parent = cfg(
        1,
        12080,
        Capabilities::POOL_POINTER,
        Capabilities::POOL_POINTER | Capabilities::IPC_EVENTS,
    );
    let (p, w) = handshake(parent, base());
    assert!(
        matches!(p, Err(HandshakeError::MissingCapabilities { missing }) if missing == Capabilities::IPC_EVENTS),
        "{p:?}"
    );
    assert!(
        matches!(&w, Err(HandshakeError::Refused { code, .. }) if *code == ErrorCode::MISSING_CAPABILITY),
        "{w:?}"
    );
}

#[test]
fn a_parent_missing_a_required_capability_is_refused_by_the_worker() {
    let worker = cfg(
        1,
        12080,
        Capabilities::POOL_POINTER,
        Capabilities::VMM_ARENA,
    );
    let (p, w) = handshake(base(), worker);
    assert!(
        matches!(w, Err(HandshakeError::MissingCapabilities { .. })),
        "{w:?}"
    );
    assert!(
        matches!(&p, Err(HandshakeError::Refused { code, .. }) if *code == ErrorCode::MISSING_CAPABILITY),
        "{p:?}"
    );
}

#[test]
fn a_hello_of_another_protocol_version_is_refused_with_a_version_mismatch() {
    let (mut p, mut w) = Connection::pair().expect("pair");
    let mut hello =
        encode(&Message::Hello(base().identity), FrameLimits::default()).expect("encode");
    hello[4] = crate::PROTOCOL_VERSION + 1;
    let fd = pool();
    p.send_frame(&hello, &[fd.as_fd()], soon()).expect("send");
    let got = worker_handshake(&mut w, &base(), soon());
    assert!(
        matches!(
            got,
            Err(HandshakeError::VersionMismatch { ours, theirs })
                if ours == crate::PROTOCOL_VERSION && theirs == crate::PROTOCOL_VERSION + 1
        ),
        "{got:?}"
    );
    let (refusal, _) = p.recv(soon()).expect("refusal frame");
    assert!(matches!(refusal, Message::Refuse { code, .. } if code == ErrorCode::VERSION_MISMATCH));
}

#[test]
fn a_first_frame_other_than_hello_is_refused() {
    let (mut p, mut w) = Connection::pair().expect("pair");
    p.send(&Message::Heartbeat { seq: 1 }, &[], soon())
        .expect("send");
    let got = worker_handshake(&mut w, &base(), soon());
    assert!(
        matches!(
            got,
            Err(HandshakeError::UnexpectedMessage {
                got: crate::MessageKind::Heartbeat,
                ..
            })
        ),
        "{got:?}"
    );
    let (refusal, _) = p.recv(soon()).expect("refusal frame");
    assert!(
        matches!(refusal, Message::Refuse { code, .. } if code == ErrorCode::UNEXPECTED_MESSAGE)
    );
}

#[test]
fn a_hello_without_the_pool_fd_is_refused_as_malformed() {
    let (mut p, mut w) = Connection::pair().expect("pair");
    let hello = encode(&Message::Hello(base().identity), FrameLimits::default()).expect("encode");
    p.send_frame(&hello, &[], soon()).expect("send");
    let got = worker_handshake(&mut w, &base(), soon());
    assert!(
        matches!(
            got,
            Err(HandshakeError::Transport(
                crate::TransportError::MissingFds { .. }
            ))
        ),
        "{got:?}"
    );
    let (refusal, _) = p.recv(soon()).expect("refusal frame");
    assert!(matches!(refusal, Message::Refuse { code, .. } if code == ErrorCode::MALFORMED_FRAME));
}

#[test]
fn a_silent_worker_times_the_parent_out() {
    let (mut p, _w) = Connection::pair().expect("pair");
    let fd = pool();
    let got = parent_handshake(
        &mut p,
        &base(),
        fd.as_fd(),
        Instant::now() + Duration::from_millis(100),
    );
    assert!(
        matches!(
            got,
            Err(HandshakeError::Transport(
                crate::TransportError::Timeout { .. }
            ))
        ),
        "{got:?}"
    );
}

/// A spawned worker inherits its socket and nothing else of the parent's, not even a
/// descriptor some library opened without close-on-exec (libcuda's exports come so).
#[test]
fn a_spawned_worker_inherits_its_socket_and_no_other_descriptor() {
    use std::io::Read as _;
    use std::os::fd::AsRawFd;
    let leaky = std::fs::File::open("/dev/null").expect("open /dev/null");
    nix::fcntl::fcntl(
        &leaky,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
    )
    .expect("clear FD_CLOEXEC");
    let n = leaky.as_raw_fd();
    let mut cmd = std::process::Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            "[ -e /proc/$$/fd/{n} ] && echo leaked || echo closed; \
             [ -S /proc/$$/fd/${{{}}} ] && echo socket || echo no-socket",
            crate::FD_ENV
        ))
        .stdout(std::process::Stdio::piped());
    let (mut child, _conn) = crate::spawn_worker(cmd).expect("spawn");
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut out)
        .expect("read");
    child.wait().expect("wait");
    assert_eq!(
        out, "closed\nsocket\n",
        "descriptor {n} in the child: {out:?}"
    );
    drop(leaky);
}

/// The fallback for kernels without `close_range` (before 5.11) marks what it is given.
#[test]
fn the_fallback_marks_each_descriptor_close_on_exec() {
    use nix::fcntl::{FcntlArg, FdFlag, fcntl};
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open("/dev/null").expect("open");
    fcntl(&f, FcntlArg::F_SETFD(FdFlag::empty())).expect("clear");
    let n = f.as_raw_fd();
    crate::spawn::cloexec_each(n, n);
    let flags = fcntl(&f, FcntlArg::F_GETFD).expect("get");
    assert_eq!(flags, libc::FD_CLOEXEC, "descriptor {n}");
}
