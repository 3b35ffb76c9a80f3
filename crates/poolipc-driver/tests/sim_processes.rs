//! SimDriver across real processes: each test re-executes this test binary as the worker
//! (`--exact <its own name>`, with a role in the environment), attached to the parent's
//! simulated machine through `SimDriver::child_env`. The pool FD travels by SCM_RIGHTS over a
//! socketpair that is the child's stdin.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use common::{recv_fd, send_fd};

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use poolipc_driver::sim::{SimConfig, SimDriver, ViolationKind};
use poolipc_driver::{
    DevicePtr, Driver, EventBlob, ExportBlob, OwnedEvent, OwnedPool, OwnedStream, PoolHandle,
    PoolSharing, StreamHandle,
};

const ROLE: &str = "POOLIPC_SIM_TEST_ROLE";
const MIB: u64 = 1 << 20;
const S: StreamHandle = StreamHandle::NULL;

fn is_child() -> bool {
    std::env::var_os(ROLE).is_some()
}

struct Worker {
    process: std::process::Child,
    sock: UnixStream,
}

fn spawn(parent: &SimDriver, test: &str) -> Worker {
    let (mine, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .unwrap();
    let (key, value) = parent.child_env();
    let process = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture"])
        .env(key, value)
        .env(ROLE, "worker")
        .stdin(Stdio::from(theirs))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    Worker {
        process,
        sock: UnixStream::from(mine),
    }
}

fn send64(sock: &mut UnixStream, b: &[u8; 64]) {
    sock.write_all(b).unwrap();
}

fn recv64(sock: &mut UnixStream) -> [u8; 64] {
    let mut b = [0u8; 64];
    sock.read_exact(&mut b).unwrap();
    b
}

/// The parent's side of a handoff offer: pool FD, export blob, READY handle.
fn parent_offer(p: &SimDriver, w: &mut Worker, pool: PoolHandle, bytes: u64) -> DevicePtr {
    let fd = p.mem_pool_export_fd(pool).unwrap();
    let ptr = p.mem_alloc_from_pool_async(bytes, pool, S).unwrap();
    p.memset_d8_async(ptr, 0xAB, 4096, S).unwrap();
    let ready = OwnedEvent::new(p, true).unwrap().into_raw();
    p.event_record(ready, S).unwrap();
    send_fd(&w.sock, &fd);
    send64(&mut w.sock, &p.mem_pool_export_pointer(ptr).unwrap().0);
    send64(&mut w.sock, &p.ipc_get_event_handle(ready).unwrap().0);
    ptr
}

/// The worker's side: attach, import the pool and the pointer, open READY.
struct Offer {
    sim: SimDriver,
    sock: UnixStream,
    pool: PoolHandle,
    blob: ExportBlob,
    ready: EventBlob,
}

fn worker_receive() -> Offer {
    let sock = UnixStream::from(std::io::stdin().as_fd().try_clone_to_owned().unwrap());
    let mut sock = sock;
    let sim = SimDriver::from_env().unwrap().unwrap();
    sim.use_device(0).unwrap();
    let fd = recv_fd(&sock);
    let pool = sim.mem_pool_import_fd(fd.as_fd()).unwrap();
    let blob = ExportBlob(recv64(&mut sock));
    let ready = EventBlob(recv64(&mut sock));
    Offer {
        sim,
        sock,
        pool,
        blob,
        ready,
    }
}

fn parent_sim(memory: u64) -> (SimDriver, PoolHandle) {
    let p = SimDriver::new(SimConfig {
        memory_per_device: memory,
        ..SimConfig::default()
    })
    .unwrap();
    p.use_device(0).unwrap();
    let pool = OwnedPool::create(&p, 0, PoolSharing::PosixFd)
        .unwrap()
        .into_raw();
    p.device_set_mem_pool(0, pool).unwrap();
    (p, pool)
}

// --- the contract, in two processes --------------------------------------------------------

#[test]
fn a_worker_process_reads_the_parents_bytes_and_writes_in_place() {
    if is_child() {
        let mut o = worker_receive();
        let w = &o.sim;
        let ptr = w.mem_pool_import_pointer(o.pool, &o.blob).unwrap();
        let ready = w.ipc_open_event_handle(&o.ready).unwrap();
        let owned_s = OwnedStream::new(w).unwrap();
        let s = owned_s.handle();
        w.stream_wait_event(s, ready).unwrap();
        w.event_synchronize(ready).unwrap();
        let mut buf = [0u8; 64];
        w.memcpy_dtoh(&mut buf, ptr).unwrap();
        assert_eq!(buf, [0xAB; 64]);
        w.memset_d8_async(ptr, 0xCD, 64, s).unwrap();
        let owned_done = OwnedEvent::new(w, true).unwrap();
        let done = owned_done.handle();
        w.event_record(done, s).unwrap();
        // SAFETY: `ptr` is the live import made above, freed once and not used after.
        unsafe { w.mem_pool_free_import(ptr, s) }.unwrap();
        send64(&mut o.sock, &w.ipc_get_event_handle(done).unwrap().0);
        // The DONE event lives as long as this process: wait until the parent waited on it.
        let mut ack = [0u8; 1];
        o.sock.read_exact(&mut ack).unwrap();
        return;
    }
    let (p, pool) = parent_sim(1 << 30);
    let mut w = spawn(
        &p,
        "a_worker_process_reads_the_parents_bytes_and_writes_in_place",
    );
    let ptr = parent_offer(&p, &mut w, pool, 4 * MIB);
    let done = p
        .ipc_open_event_handle(&EventBlob(recv64(&mut w.sock)))
        .unwrap();
    p.stream_wait_event(S, done).unwrap();
    p.stream_synchronize(S).unwrap();
    w.sock.write_all(b"A").unwrap();
    let mut buf = [0u8; 64];
    p.memcpy_dtoh(&mut buf, ptr).unwrap();
    assert_eq!(buf, [0xCD; 64]);
    assert!(w.process.wait().unwrap().success());
    // SAFETY: `ptr` is the live allocation made above, freed once and not used after.
    unsafe { p.mem_free_async(ptr, S) }.unwrap();
    assert_eq!(p.violations(), vec![]);
}

#[test]
fn a_worker_process_touching_memory_before_ready_is_recorded_for_the_parent() {
    if is_child() {
        let o = worker_receive();
        let w = &o.sim;
        let ptr = w.mem_pool_import_pointer(o.pool, &o.blob).unwrap();
        let owned_s = OwnedStream::new(w).unwrap();
        let s = owned_s.handle();
        w.memset_d8_async(ptr, 0xCD, 64, s).unwrap(); // no wait on READY
        // SAFETY: `ptr` is the live import made above, freed once and not used after.
        unsafe { w.mem_pool_free_import(ptr, s) }.unwrap();
        return;
    }
    let (p, pool) = parent_sim(1 << 30);
    let mut w = spawn(
        &p,
        "a_worker_process_touching_memory_before_ready_is_recorded_for_the_parent",
    );
    let _ptr = parent_offer(&p, &mut w, pool, MIB);
    assert!(w.process.wait().unwrap().success());
    let v = p.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, ViolationKind::UnorderedAccess);
    assert_eq!(v[0].pid, w.process.id());
    assert_eq!(v[0].other_pid, Some(std::process::id()));
}

// --- the import limit ----------------------------------------------------------------------

fn import_and_exit() {
    let o = worker_receive();
    let ptr = o.sim.mem_pool_import_pointer(o.pool, &o.blob).unwrap();
    // SAFETY: `ptr` is the live import made above, freed once and not used after.
    unsafe { o.sim.mem_pool_free_import(ptr, S) }.unwrap();
}

#[test]
fn an_import_over_164_chunks_kills_the_worker_with_sigsegv() {
    if is_child() {
        return import_and_exit();
    }
    let (p, pool) = parent_sim(8 << 30);
    let mut w = spawn(
        &p,
        "an_import_over_164_chunks_kills_the_worker_with_sigsegv",
    );
    // 5264 MiB, chunk-aligned: 165 chunks, the first size that crashed on the H200.
    let _ptr = parent_offer(&p, &mut w, pool, 5264 * MIB);
    let status = w.process.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
    let v = p.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, ViolationKind::ImportOverLimit);
    assert_eq!(v[0].detail, (165, 128));
    // The parent goes on: allocating and exporting still work.
    let more = p.mem_alloc_from_pool_async(MIB, pool, S).unwrap();
    p.mem_pool_export_pointer(more).unwrap();
}

#[test]
fn an_import_of_129_chunks_works_as_on_driver_580_but_is_a_recorded_violation() {
    if is_child() {
        return import_and_exit();
    }
    let (p, pool) = parent_sim(8 << 30);
    let _head = p.mem_alloc_from_pool_async(2 * MIB, pool, S).unwrap();
    let mut w = spawn(
        &p,
        "an_import_of_129_chunks_works_as_on_driver_580_but_is_a_recorded_violation",
    );
    // 4096 MiB starting 2 MiB into a chunk: 129 chunks, a silent stack overwrite on hardware.
    let _ptr = parent_offer(&p, &mut w, pool, 4096 * MIB);
    let status = w.process.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let v = p.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, ViolationKind::ImportOverLimit);
    assert_eq!(v[0].detail, (129, 128));
}

#[test]
fn an_import_of_128_chunks_succeeds_in_the_worker() {
    if is_child() {
        return import_and_exit();
    }
    let (p, pool) = parent_sim(8 << 30);
    let mut w = spawn(&p, "an_import_of_128_chunks_succeeds_in_the_worker");
    let _ptr = parent_offer(&p, &mut w, pool, 4096 * MIB);
    let status = w.process.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(p.violations(), vec![]);
}

// --- imports and the importer's life -------------------------------------------------------

/// Imports, says so, then holds the import until the parent closes the socket.
fn import_and_hold() {
    let mut o = worker_receive();
    let ptr = o.sim.mem_pool_import_pointer(o.pool, &o.blob).unwrap();
    o.sock.write_all(b"I").unwrap();
    let mut b = [0u8; 1];
    let _ = o.sock.read(&mut b);
    // SAFETY: `ptr` is the live import made above, freed once and not used after.
    unsafe { o.sim.mem_pool_free_import(ptr, S) }.unwrap();
}

#[test]
fn freeing_while_a_live_worker_holds_an_import_is_recorded() {
    if is_child() {
        return import_and_hold();
    }
    let (p, pool) = parent_sim(1 << 30);
    let mut w = spawn(
        &p,
        "freeing_while_a_live_worker_holds_an_import_is_recorded",
    );
    let ptr = parent_offer(&p, &mut w, pool, MIB);
    let mut b = [0u8; 1];
    w.sock.read_exact(&mut b).unwrap();
    // SAFETY: `ptr` is the live allocation made above, freed once and not used after.
    unsafe { p.mem_free_async(ptr, S) }.unwrap();
    let v = p.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].kind, ViolationKind::FreedWhileImported);
    assert_eq!(v[0].other_pid, Some(w.process.id()));
    drop(w.sock);
    assert!(w.process.wait().unwrap().success());
}

#[test]
fn a_killed_workers_imports_are_dropped_so_the_parent_may_free() {
    if is_child() {
        return import_and_hold();
    }
    let (p, pool) = parent_sim(1 << 30);
    let mut w = spawn(
        &p,
        "a_killed_workers_imports_are_dropped_so_the_parent_may_free",
    );
    let ptr = parent_offer(&p, &mut w, pool, MIB);
    let mut b = [0u8; 1];
    w.sock.read_exact(&mut b).unwrap();
    w.process.kill().unwrap(); // SIGKILL
    let status = w.process.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    // SAFETY: `ptr` is the live allocation made above, freed once and not used after.
    unsafe { p.mem_free_async(ptr, S) }.unwrap();
    assert_eq!(p.violations(), vec![]);
}
