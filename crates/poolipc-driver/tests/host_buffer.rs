//! `SharedHostBuffer` across two real processes on SimDriver: the test binary re-executes
//! itself as the other process (`--exact <its own name>`, a role in the environment); the
//! buffer's memfd travels by SCM_RIGHTS over a socketpair that is the child's stdin.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use common::{recv_fd, send_fd};

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::Arc;

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use poolipc_driver::host::SharedHostBuffer;
use poolipc_driver::sim::{SimConfig, SimDriver, ViolationKind};
use poolipc_driver::{
    Driver, DriverError, EventBlob, OwnedEvent, OwnedPool, OwnedStream, PoolSharing, StreamHandle,
};

const ROLE: &str = "POOLIPC_HOST_BUFFER_TEST_ROLE";
const LEN: usize = 1 << 20;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 9)) as u8
}

/// The parent copies device memory into the buffer and records `filled`; the child, which
/// waits `filled` unless `skip_wait`, copies it into its own device memory and checks it.
/// Returns the violations the machine recorded.
fn share(test: &str, skip_wait: bool) -> Vec<poolipc_driver::sim::Violation> {
    if std::env::var_os(ROLE).is_some() {
        let mut sock = UnixStream::from(std::io::stdin().as_fd().try_clone_to_owned().unwrap());
        let sim = Arc::new(SimDriver::from_env().unwrap().unwrap());
        let d: Arc<dyn Driver> = sim;
        d.use_device(0).unwrap();
        let buf = SharedHostBuffer::from_fd(recv_fd(&sock), LEN).unwrap();
        buf.register(&d).unwrap();
        let mut blob = [0u8; 64];
        sock.read_exact(&mut blob).unwrap();
        let filled = d.ipc_open_event_handle(&EventBlob(blob)).unwrap();
        let owned_s = OwnedStream::new(&*d).unwrap();
        let s = owned_s.handle();
        let owned_pool = OwnedPool::create(&*d, 0, PoolSharing::None).unwrap();
        let pool = owned_pool.handle();
        let dst = d.mem_alloc_from_pool_async(LEN as u64, pool, s).unwrap();
        if !skip_wait {
            d.stream_wait_event(s, filled).unwrap();
        }
        buf.copy_to_device(0, dst, LEN, s).unwrap();
        d.stream_synchronize(s).unwrap();
        if !skip_wait {
            // Without the wait the copy races the parent's on the asynchronous GPU: the bytes
            // may be anything, and the test checks the violation instead.
            let mut got = vec![0u8; LEN];
            d.memcpy_dtoh(&mut got, dst).unwrap();
            assert!(got.iter().enumerate().all(|(i, b)| *b == pattern(i)));
            // The host sees the same bytes through its own mapping.
            let mut host = [0u8; 4];
            buf.read_at(1000, &mut host).unwrap();
            assert_eq!(
                host,
                [pattern(1000), pattern(1001), pattern(1002), pattern(1003)]
            );
        }
        drop(buf);
        sock.write_all(b"k").unwrap();
        std::process::exit(0);
    }
    let sim = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
    let d: Arc<dyn Driver> = sim.clone();
    d.use_device(0).unwrap();
    let (mine, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .unwrap();
    let (key, value) = sim.child_env();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture"])
        .env(key, value)
        .env(ROLE, "child")
        .stdin(Stdio::from(theirs))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut sock = UnixStream::from(mine);
    let buf = SharedHostBuffer::create(LEN).unwrap();
    buf.register(&d).unwrap();
    let owned_s = OwnedStream::new(&*d).unwrap();
    let s = owned_s.handle();
    let owned_pool = OwnedPool::create(&*d, 0, PoolSharing::None).unwrap();
    let pool = owned_pool.handle();
    let src = d.mem_alloc_from_pool_async(LEN as u64, pool, s).unwrap();
    let bytes: Vec<u8> = (0..LEN).map(pattern).collect();
    d.memcpy_htod(src, &bytes).unwrap();
    d.stream_synchronize(StreamHandle::NULL).unwrap();
    buf.copy_from_device(0, src, LEN, s).unwrap();
    let owned_filled = OwnedEvent::new(&*d, true).unwrap();
    let filled = owned_filled.handle();
    d.event_record(filled, s).unwrap();
    send_fd(&sock, &buf.fd().unwrap());
    sock.write_all(&d.ipc_get_event_handle(filled).unwrap().0)
        .unwrap();
    let mut ok = [0u8; 1];
    sock.read_exact(&mut ok).unwrap();
    assert!(child.wait().unwrap().success());
    sim.violations()
}

#[test]
fn bytes_staged_by_one_process_arrive_in_the_device_memory_of_the_other() {
    let v = share(
        "bytes_staged_by_one_process_arrive_in_the_device_memory_of_the_other",
        false,
    );
    assert!(v.is_empty(), "violations: {v:#?}");
}

#[test]
fn a_copy_out_of_the_buffer_not_ordered_after_the_other_process_copy_in_is_a_violation() {
    let v = share(
        "a_copy_out_of_the_buffer_not_ordered_after_the_other_process_copy_in_is_a_violation",
        true,
    );
    assert!(
        v.iter()
            .any(|v| v.kind == ViolationKind::UnorderedAccess && v.call == "cuMemcpyHtoDAsync"),
        "no violation: {v:#?}"
    );
}

#[test]
fn the_staging_file_is_sealed_so_the_other_side_cannot_resize_it() {
    let buf = SharedHostBuffer::create(8192).unwrap();
    // What a rogue worker holding the received FD would try: the kernel refuses both.
    let fd = buf.fd().unwrap().try_clone_to_owned().unwrap();
    assert_eq!(
        nix::unistd::ftruncate(&fd, 0),
        Err(nix::errno::Errno::EPERM)
    );
    assert_eq!(
        nix::unistd::ftruncate(&fd, 1 << 20),
        Err(nix::errno::Errno::EPERM)
    );
    // Nor can the seals be taken off or the file be resealed differently.
    assert!(
        nix::fcntl::fcntl(
            &fd,
            nix::fcntl::FcntlArg::F_ADD_SEALS(nix::fcntl::SealFlag::F_SEAL_WRITE)
        )
        .is_err()
    );
    // The mapping is intact.
    buf.write_at(8000, &[9; 8]).unwrap();
    let mut back = [0u8; 8];
    buf.read_at(8000, &mut back).unwrap();
    assert_eq!(back, [9; 8]);
}

#[test]
fn from_fd_refuses_a_file_not_sealed_against_resizing() {
    let fd =
        nix::sys::memfd::memfd_create("unsealed", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    nix::unistd::ftruncate(&fd, 4096).unwrap();
    let err = SharedHostBuffer::from_fd(fd, 4096).unwrap_err();
    assert!(
        matches!(&err, DriverError::InvalidArgument { reason, .. } if reason.contains("sealed")),
        "{err}"
    );
}

#[test]
fn from_fd_refuses_a_size_the_file_does_not_have() {
    let buf = SharedHostBuffer::create(8192).unwrap();
    let fd = buf.fd().unwrap().try_clone_to_owned().unwrap();
    assert!(matches!(
        SharedHostBuffer::from_fd(fd, 4096),
        Err(DriverError::InvalidArgument { .. })
    ));
}

#[test]
fn copies_past_the_end_are_refused_before_reaching_the_driver() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
    let d: Arc<dyn Driver> = sim;
    d.use_device(0).unwrap();
    let buf = SharedHostBuffer::create(4096).unwrap();
    buf.register(&d).unwrap();
    let owned_pool = OwnedPool::create(&*d, 0, PoolSharing::None).unwrap();
    let pool = owned_pool.handle();
    let p = d
        .mem_alloc_from_pool_async(8192, pool, StreamHandle::NULL)
        .unwrap();
    assert!(matches!(
        buf.copy_from_device(4000, p, 200, StreamHandle::NULL),
        Err(DriverError::OutOfBounds {
            offset: 4000,
            bytes: 200,
            len: 4096,
            ..
        })
    ));
    assert!(matches!(
        buf.copy_to_device(1, p, 4096, StreamHandle::NULL),
        Err(DriverError::OutOfBounds { .. })
    ));
    buf.copy_to_device(0, p, 4096, StreamHandle::NULL).unwrap();
}

#[test]
fn copies_need_the_buffer_registered() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
    let d: Arc<dyn Driver> = sim;
    d.use_device(0).unwrap();
    let buf = SharedHostBuffer::create(4096).unwrap();
    let owned_pool = OwnedPool::create(&*d, 0, PoolSharing::None).unwrap();
    let pool = owned_pool.handle();
    let p = d
        .mem_alloc_from_pool_async(4096, pool, StreamHandle::NULL)
        .unwrap();
    assert!(buf.copy_from_device(0, p, 16, StreamHandle::NULL).is_err());
    buf.register(&d).unwrap();
    assert!(buf.register(&d).is_err(), "registering twice is refused");
    buf.copy_from_device(0, p, 16, StreamHandle::NULL).unwrap();
}

#[test]
fn dropping_the_buffer_unregisters_its_memory() {
    let sim = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
    let d: Arc<dyn Driver> = sim;
    d.use_device(0).unwrap();
    let buf = SharedHostBuffer::create(4096).unwrap();
    buf.register(&d).unwrap();
    let fd = buf.fd().unwrap().try_clone_to_owned().unwrap();
    drop(buf);
    // The same file mapped again (likely at the same address) registers cleanly.
    let again = SharedHostBuffer::from_fd(fd, 4096).unwrap();
    again.register(&d).unwrap();
}
