//! The simulation's rules, each triggered and each respected, with two simulated processes
//! inside one OS process ([`SimDriver::peer`]). Real processes: `tests/sim_processes.rs`.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use super::*;
use crate::api::Driver;
use crate::types::{
    Access, DevicePtr, Granularity, PoolAttribute, PoolCounter, PoolHandle, PoolSharing,
    StreamHandle, VmmHandle,
};
use crate::{OwnedEvent, OwnedPool, OwnedStream};
use std::os::fd::{AsFd, OwnedFd};

const MIB: u64 = 1 << 20;
const S: StreamHandle = StreamHandle::NULL;

fn sim() -> SimDriver {
    let d = SimDriver::new(SimConfig::default()).unwrap();
    d.use_device(0).unwrap();
    d
}

fn sim_with(config: SimConfig) -> SimDriver {
    let d = SimDriver::new(config).unwrap();
    d.use_device(0).unwrap();
    d
}

/// A shareable pool made current, exported: the parent's setup.
fn shared_pool(d: &SimDriver) -> (PoolHandle, OwnedFd) {
    let pool = OwnedPool::create(d, 0, PoolSharing::PosixFd)
        .unwrap()
        .into_raw();
    d.device_set_mem_pool(0, pool).unwrap();
    let fd = d.mem_pool_export_fd(pool).unwrap();
    (pool, fd)
}

fn worker(parent: &SimDriver, fd: &OwnedFd) -> (SimDriver, PoolHandle) {
    let w = parent.peer();
    w.use_device(0).unwrap();
    let pool = w.mem_pool_import_fd(fd.as_fd()).unwrap();
    (w, pool)
}

/// A worker that imports `ptr`'s export, waits on its stream for the parent's `ready` and
/// writes 16 bytes there: returns the worker and its stream.
fn worker_writes_after(
    p: &SimDriver,
    fd: &OwnedFd,
    ptr: DevicePtr,
    ready: crate::types::EventHandle,
) -> (SimDriver, StreamHandle) {
    let blob = p.mem_pool_export_pointer(ptr).unwrap();
    let (w, wpool) = worker(p, fd);
    let imported = w.mem_pool_import_pointer(wpool, &blob).unwrap();
    let r = w
        .ipc_open_event_handle(&p.ipc_get_event_handle(ready).unwrap())
        .unwrap();
    let ws = OwnedStream::new(&w).unwrap().into_raw();
    w.stream_wait_event(ws, r).unwrap();
    w.memset_d8_async(imported, 2, 16, ws).unwrap();
    (w, ws)
}

fn kinds(d: &SimDriver) -> Vec<ViolationKind> {
    d.violations().iter().map(|v| v.kind).collect()
}

/// Parent allocates, writes, records READY; worker imports, waits READY: the contract's
/// happy start. Returns (worker, parent ptr, worker ptr, worker stream).
fn handoff(
    p: &SimDriver,
    fd: &OwnedFd,
    bytes: u64,
) -> (SimDriver, DevicePtr, DevicePtr, StreamHandle) {
    let ptr = p.mem_alloc_async(bytes, S).unwrap();
    p.memset_d8_async(ptr, 0xAB, bytes, S).unwrap();
    let ready = OwnedEvent::new(p, true).unwrap().into_raw();
    p.event_record(ready, S).unwrap();
    let blob = p.mem_pool_export_pointer(ptr).unwrap();
    let (w, wpool) = worker(p, fd);
    let imported = w.mem_pool_import_pointer(wpool, &blob).unwrap();
    let ws = OwnedStream::new(&w).unwrap().into_raw();
    let r = w
        .ipc_open_event_handle(&p.ipc_get_event_handle(ready).unwrap())
        .unwrap();
    w.stream_wait_event(ws, r).unwrap();
    (w, ptr, imported, ws)
}

// --- export order --------------------------------------------------------------------------

#[test]
fn pointer_export_before_the_pool_fd_export_is_invalid_value() {
    let d = sim();
    let owned_pool = OwnedPool::create(&d, 0, PoolSharing::PosixFd).unwrap();
    let pool = owned_pool.handle();
    let ptr = d.mem_alloc_from_pool_async(MIB, pool, S).unwrap();
    let e = d.mem_pool_export_pointer(ptr).unwrap_err();
    assert!(
        e.is_call("cuMemPoolExportPointer", CuCode::INVALID_VALUE),
        "{e}"
    );
}

#[test]
fn pointer_export_after_the_pool_fd_export_gives_a_blob() {
    let d = sim();
    let (pool, _fd) = shared_pool(&d);
    let ptr = d.mem_alloc_from_pool_async(MIB, pool, S).unwrap();
    let a = d.mem_pool_export_pointer(ptr).unwrap();
    assert_eq!(a, d.mem_pool_export_pointer(ptr).unwrap());
}

#[test]
fn a_pool_without_posix_fd_sharing_cannot_be_exported() {
    let d = sim();
    let owned_pool = OwnedPool::create(&d, 0, PoolSharing::None).unwrap();
    let pool = owned_pool.handle();
    let e = d.mem_pool_export_fd(pool).unwrap_err();
    assert!(e.is_call("cuMemPoolExportToShareableHandle", CuCode::INVALID_VALUE));
    let default = d.device_get_default_mem_pool(0).unwrap();
    assert!(d.mem_pool_export_fd(default).is_err());
}

// --- the ownership contract ----------------------------------------------------------------

#[test]
fn a_worker_sees_the_parents_bytes_and_the_parent_sees_the_workers_write() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, ptr, imported, ws) = handoff(&p, &fd, 4 * MIB);
    w.stream_synchronize(ws).unwrap();
    let mut buf = vec![0u8; 4096];
    w.memcpy_dtoh(&mut buf, imported.offset(MIB)).unwrap();
    assert!(buf.iter().all(|b| *b == 0xAB));
    w.memset_d32_async(imported, 0x0102_0304, 16, ws).unwrap();
    let owned_done = OwnedEvent::new(&w, true).unwrap();
    let done = owned_done.handle();
    w.event_record(done, ws).unwrap();
    w.mem_pool_free_import_checked(imported, ws).unwrap();
    let d = p
        .ipc_open_event_handle(&w.ipc_get_event_handle(done).unwrap())
        .unwrap();
    p.event_synchronize(d).unwrap();
    p.memcpy_dtoh(&mut buf[..8], ptr).unwrap();
    assert_eq!(&buf[..8], &[4, 3, 2, 1, 4, 3, 2, 1]);
    p.mem_free_async_checked(ptr, S).unwrap();
    assert_eq!(p.violations(), vec![]);
}

#[test]
fn the_exporter_freeing_while_an_import_is_live_is_recorded() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, ptr, _imported, _ws) = handoff(&p, &fd, MIB);
    p.mem_free_async_checked(ptr, S).unwrap();
    let v = p.violations();
    assert_eq!(kinds(&p), vec![ViolationKind::FreedWhileImported]);
    assert_eq!(v[0].call, "cuMemFreeAsync");
    drop(w);
}

#[test]
fn the_exporter_freeing_after_the_import_was_freed_is_clean() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, ptr, imported, ws) = handoff(&p, &fd, MIB);
    w.mem_pool_free_import_checked(imported, ws).unwrap();
    p.mem_free_async_checked(ptr, S).unwrap();
    assert_eq!(kinds(&p), vec![]);
}

#[test]
fn an_exiting_importer_drops_its_imports() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, ptr, _imported, _ws) = handoff(&p, &fd, MIB);
    drop(w); // the simulated process exits without freeing its import
    p.mem_free_async_checked(ptr, S).unwrap();
    assert_eq!(kinds(&p), vec![]);
}

#[test]
fn an_importer_touching_memory_before_waiting_for_ready_is_recorded() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let ptr = p.mem_alloc_async(MIB, S).unwrap();
    p.memset_d8_async(ptr, 1, MIB, S).unwrap();
    let blob = p.mem_pool_export_pointer(ptr).unwrap();
    let (w, wpool) = worker(&p, &fd);
    let imported = w.mem_pool_import_pointer(wpool, &blob).unwrap();
    let owned_ws = OwnedStream::new(&w).unwrap();
    let ws = owned_ws.handle();
    w.memset_d8_async(imported, 2, 16, ws).unwrap();
    let v = p.violations();
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
    assert_eq!(v[0].call, "cuMemsetD8Async");
}

#[test]
fn an_importer_waiting_on_an_event_recorded_before_the_last_write_is_recorded() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let ptr = p.mem_alloc_async(MIB, S).unwrap();
    let owned_ready = OwnedEvent::new(&p, true).unwrap();
    let ready = owned_ready.handle();
    p.event_record(ready, S).unwrap();
    p.memset_d8_async(ptr, 1, MIB, S).unwrap(); // after READY: not covered
    let _worker = worker_writes_after(&p, &fd, ptr, ready);
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
}

#[test]
fn a_ready_event_on_another_stream_than_the_write_does_not_cover_it() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let ptr = p.mem_alloc_async(MIB, S).unwrap();
    let owned_s2 = OwnedStream::new(&p).unwrap();
    let s2 = owned_s2.handle();
    p.memset_d8_async(ptr, 1, MIB, s2).unwrap();
    let owned_ready = OwnedEvent::new(&p, true).unwrap();
    let ready = owned_ready.handle();
    p.event_record(ready, S).unwrap(); // S never waited for s2
    let _worker = worker_writes_after(&p, &fd, ptr, ready);
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
}

#[test]
fn a_ready_on_another_stream_covers_the_writes_of_a_stream_the_host_saw_idle() {
    // What the parent's IO thread does when the caller's stream has nothing left to run:
    // `cuStreamQuery` says so, and READY goes on a stream of its own. The query that said
    // idle orders the host, so the record, after the writes.
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let ptr = p.mem_alloc_async(MIB, S).unwrap();
    let owned_s2 = OwnedStream::new(&p).unwrap();
    let s2 = owned_s2.handle();
    p.memset_d8_async(ptr, 1, MIB, s2).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !p.stream_query(s2).unwrap() {
        assert!(std::time::Instant::now() < deadline, "the memset never ran");
        std::thread::yield_now();
    }
    let owned_aside = OwnedStream::new(&p).unwrap();
    let aside = owned_aside.handle();
    let owned_ready = OwnedEvent::new(&p, true).unwrap();
    let ready = owned_ready.handle();
    p.event_record(ready, aside).unwrap();
    let (w, ws) = worker_writes_after(&p, &fd, ptr, ready);
    w.stream_synchronize(ws).unwrap();
    assert_eq!(kinds(&p), vec![]);
}

#[test]
fn a_new_stream_is_idle_and_a_handle_never_given_is_an_error() {
    let p = sim();
    let owned_s2 = OwnedStream::new(&p).unwrap();
    let s2 = owned_s2.handle();
    assert!(
        p.stream_query(s2).unwrap(),
        "a new stream has nothing to run"
    );
    assert!(p.stream_query(StreamHandle(0xdead_0000)).is_err());
}

#[test]
fn a_host_copy_after_only_a_stream_wait_is_not_ordered() {
    // cuMemcpyDtoH runs on the legacy stream, which never waited for READY.
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, _ptr, imported, _ws) = handoff(&p, &fd, MIB);
    let mut buf = [0u8; 16];
    w.memcpy_dtoh(&mut buf, imported).unwrap();
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
}

#[test]
fn the_parent_reading_before_done_is_recorded() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, ptr, imported, ws) = handoff(&p, &fd, MIB);
    w.memset_d8_async(imported, 7, 16, ws).unwrap();
    let mut buf = [0u8; 16];
    p.memcpy_dtoh(&mut buf, ptr).unwrap();
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
    assert_eq!(p.violations()[0].call, "cuMemcpyDtoH");
}

// --- the import limit ----------------------------------------------------------------------

#[test]
fn an_import_over_128_chunks_is_a_typed_error_when_the_crash_is_off() {
    let p = sim_with(SimConfig {
        import_crash: false,
        ..SimConfig::default()
    });
    let (_pool, fd) = shared_pool(&p);
    let small = p.mem_alloc_async(2 * MIB, S).unwrap(); // the big one starts at +2 MiB
    let big = p.mem_alloc_async(4096 * MIB, S).unwrap();
    let blob = p.mem_pool_export_pointer(big).unwrap();
    let (w, wpool) = worker(&p, &fd);
    let e = w.mem_pool_import_pointer(wpool, &blob).unwrap_err();
    assert!(
        matches!(
            e,
            DriverError::ImportOverLimit {
                chunks: 129,
                limit: 128
            }
        ),
        "{e}"
    );
    assert_eq!(kinds(&p), vec![ViolationKind::ImportOverLimit]);
    let _ = small;
}

#[test]
fn an_import_of_exactly_128_chunks_works() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let big = p.mem_alloc_async(4096 * MIB, S).unwrap();
    let blob = p.mem_pool_export_pointer(big).unwrap();
    let (w, wpool) = worker(&p, &fd);
    w.mem_pool_import_pointer(wpool, &blob).unwrap();
    assert_eq!(kinds(&p), vec![]);
}

// --- aliasing ------------------------------------------------------------------------------

#[test]
fn importing_the_same_pointer_twice_aliases_and_the_first_free_unmaps_both() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, _ptr, a, ws) = handoff(&p, &fd, MIB);
    let blob = p.mem_pool_export_pointer(_ptr).unwrap();
    let wpool = w.pointer_get_mempool(a).unwrap();
    let b = w.mem_pool_import_pointer(wpool, &blob).unwrap();
    assert_eq!(a, b);
    w.mem_pool_free_import_checked(a, ws).unwrap();
    let e = w.memset_d8_async(b, 0, 16, ws).unwrap_err();
    assert!(e.is_call("cuMemsetD8Async", CuCode::ILLEGAL_ADDRESS), "{e}");
    assert_eq!(kinds(&p), vec![ViolationKind::UnmappedAccess]);
    let e = w.mem_pool_free_import_checked(b, ws).unwrap_err();
    assert!(e.is_call("cuMemFreeAsync", CuCode::INVALID_VALUE), "{e}");
}

#[test]
fn a_single_import_used_then_freed_is_clean() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, _ptr, a, ws) = handoff(&p, &fd, MIB);
    w.memset_d8_async(a, 0, 16, ws).unwrap();
    w.mem_pool_free_import_checked(a, ws).unwrap();
    assert_eq!(kinds(&p), vec![]);
}

// --- poison and generations ----------------------------------------------------------------

#[test]
fn freed_memory_is_poisoned() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, ptr, a, ws) = handoff(&p, &fd, MIB);
    w.stream_synchronize(ws).unwrap();
    let mut before = [0u8; 8];
    w.memcpy_dtoh(&mut before, a).unwrap();
    assert_eq!(before, [0xAB; 8]);
    w.mem_pool_free_import_checked(a, ws).unwrap();
    p.mem_free_async_checked(ptr, S).unwrap();
    // Same address again from the pool: what a reader of recycled memory would see.
    let again = p.mem_alloc_async(MIB, S).unwrap();
    assert_eq!(again, ptr);
    let mut after = [0u8; 8];
    p.memcpy_dtoh(&mut after, again).unwrap();
    assert_eq!(after, [POISON; 8]);
}

#[test]
fn a_free_not_run_yet_orders_every_allocation_of_its_range_not_only_the_first() {
    // A 4 MiB free on one stream, not run yet (its poisoning still to come), handed out again
    // as two 2 MiB allocations on two other streams: both wait for the free. The first one
    // used to forget the free, and the second one's bytes were poisoned after its writes.
    let p = sim();
    let slot = 0;
    p.machine.with(|st| {
        let [fs, s, t] = [(); 3].map(|()| st.stream_create(p.agent, p.pid).unwrap());
        let fseq = st.tick(fs);
        let freed = hb::Mem::pool(slot, 0, 4 * MIB, None);
        hb::access(st, p.process(), "cuMemFreeAsync", fs, fseq, &freed, true);
        let first = hb::pool_dependencies(st, s, slot, 0, 2 * MIB);
        assert_eq!(
            first.iter().map(|d| (d.1, d.2)).collect::<Vec<_>>(),
            [(fs, fseq)]
        );
        let second = hb::pool_dependencies(st, t, slot, 2 * MIB, 2 * MIB);
        assert_eq!(
            second.iter().map(|d| (d.1, d.2)).collect::<Vec<_>>(),
            [(fs, fseq)]
        );
        // Once the free ran, nothing waits for it, and its record is done with.
        st.streams[fs].executed = fseq;
        assert!(hb::pool_dependencies(st, s, slot, 0, 2 * MIB).is_empty());
        st.streams[fs].executed = 0;
        assert!(hb::pool_dependencies(st, t, slot, 2 * MIB, 2 * MIB).is_empty());
    });
}

#[test]
fn a_stream_slot_destroyed_with_work_queued_goes_to_no_other_engine_until_it_ran() {
    let p = sim();
    p.machine.with(|st| {
        let s = st.stream_create(p.agent, p.pid).unwrap();
        // One step queued and not run yet, then the stream destroyed.
        st.tick(s);
        st.streams[s].live = 0;
        let other = st.stream_create(p.agent + 1, p.pid).unwrap();
        assert_ne!(
            other, s,
            "another engine took a slot with a step still queued"
        );
        st.streams[other].live = 0;
        // The same engine may take it again (its steps run in order), and any engine once
        // the step ran.
        assert_eq!(st.stream_create(p.agent, p.pid), Some(s));
        st.streams[s].live = 0;
        st.streams[s].executed = st.streams[s].clock[s];
        assert_eq!(st.stream_create(p.agent + 1, p.pid), Some(s));
    });
}

#[test]
fn with_a_blob_per_allocation_a_stale_blob_does_not_import() {
    let p = sim_with(SimConfig {
        blob_per_allocation: true,
        ..SimConfig::default()
    });
    let (_pool, fd) = shared_pool(&p);
    let ptr = p.mem_alloc_async(MIB, S).unwrap();
    let stale = p.mem_pool_export_pointer(ptr).unwrap();
    p.mem_free_async_checked(ptr, S).unwrap();
    let again = p.mem_alloc_async(MIB, S).unwrap();
    assert_eq!(again, ptr);
    let fresh = p.mem_pool_export_pointer(again).unwrap();
    assert_ne!(stale, fresh);
    let (w, wpool) = worker(&p, &fd);
    let e = w.mem_pool_import_pointer(wpool, &stale).unwrap_err();
    assert!(
        e.is_call("cuMemPoolImportPointer", CuCode::INVALID_VALUE),
        "{e}"
    );
    w.mem_pool_import_pointer(wpool, &fresh).unwrap();
}

#[test]
fn the_export_of_an_address_is_the_same_for_a_new_allocation_of_the_same_size() {
    let p = sim();
    let (_pool, _fd) = shared_pool(&p);
    let a = p.mem_alloc_async(MIB, S).unwrap();
    let first = p.mem_pool_export_pointer(a).unwrap();
    assert_eq!(p.mem_pool_export_pointer(a).unwrap(), first);
    p.mem_free_async_checked(a, S).unwrap();
    let b = p.mem_alloc_async(MIB, S).unwrap();
    assert_eq!(b, a, "the pool hands the address out again");
    assert_ne!(p.pointer_get_buffer_id(b).unwrap(), 0);
    assert_eq!(p.mem_pool_export_pointer(b).unwrap(), first);
    p.mem_free_async_checked(b, S).unwrap();
    let c = p.mem_alloc_async(MIB / 2, S).unwrap();
    assert_eq!(c, a);
    assert_ne!(
        p.mem_pool_export_pointer(c).unwrap(),
        first,
        "another size, another range"
    );
}

#[test]
fn an_old_blob_reaches_the_new_allocation_at_its_address_both_ways() {
    let p = sim();
    let (pool, fd) = shared_pool(&p);
    p.mem_pool_set_attribute(pool, PoolAttribute::ReleaseThreshold(u64::MAX))
        .unwrap();
    let a = p.mem_alloc_async(MIB, S).unwrap();
    let old = p.mem_pool_export_pointer(a).unwrap();
    p.mem_free_async_checked(a, S).unwrap();
    let b = p.mem_alloc_async(MIB, S).unwrap();
    assert_eq!(b, a);
    p.memset_d8_async(b, 0x22, MIB, S).unwrap();
    let owned_ready = OwnedEvent::new(&p, true).unwrap();
    let ready = owned_ready.handle();
    p.event_record(ready, S).unwrap();
    // Never exported since B was allocated: the worker imports A's blob.
    let (w, wpool) = worker(&p, &fd);
    let imported = w.mem_pool_import_pointer(wpool, &old).unwrap();
    assert_eq!(w.pointer_get_range(imported).unwrap(), (imported, MIB));
    let owned_ws = OwnedStream::new(&w).unwrap();
    let ws = owned_ws.handle();
    let r = w
        .ipc_open_event_handle(&p.ipc_get_event_handle(ready).unwrap())
        .unwrap();
    w.stream_wait_event(ws, r).unwrap();
    w.stream_synchronize(ws).unwrap();
    let mut seen = [0u8; 4];
    w.memcpy_dtoh(&mut seen, imported).unwrap();
    assert_eq!(seen, [0x22; 4], "the worker reads B's bytes");
    w.memset_d8_async(imported, 0x33, 4, ws).unwrap();
    let owned_done = OwnedEvent::new(&w, true).unwrap();
    let done = owned_done.handle();
    w.event_record(done, ws).unwrap();
    w.mem_pool_free_import_checked(imported, ws).unwrap();
    w.stream_synchronize(ws).unwrap();
    let d = p
        .ipc_open_event_handle(&w.ipc_get_event_handle(done).unwrap())
        .unwrap();
    p.stream_wait_event(S, d).unwrap();
    p.stream_synchronize(S).unwrap();
    let mut back = [0u8; 4];
    p.memcpy_dtoh(&mut back, b).unwrap();
    assert_eq!(back, [0x33; 4], "the worker's write reaches B");
    assert_eq!(kinds(&p), vec![]);
}

#[test]
fn an_access_through_an_old_blob_is_raced_against_the_new_allocations_writes() {
    // The race detector sees the import as the pool memory at that address: a worker
    // touching B through A's blob without waiting for the parent's write to B is caught.
    let p = sim();
    let (pool, fd) = shared_pool(&p);
    p.mem_pool_set_attribute(pool, PoolAttribute::ReleaseThreshold(u64::MAX))
        .unwrap();
    let a = p.mem_alloc_async(MIB, S).unwrap();
    let old = p.mem_pool_export_pointer(a).unwrap();
    p.mem_free_async_checked(a, S).unwrap();
    let b = p.mem_alloc_async(MIB, S).unwrap();
    assert_eq!(b, a);
    p.memset_d8_async(b, 0x22, MIB, S).unwrap();
    let (w, wpool) = worker(&p, &fd);
    let imported = w.mem_pool_import_pointer(wpool, &old).unwrap();
    let owned_ws = OwnedStream::new(&w).unwrap();
    let ws = owned_ws.handle();
    w.memset_d8_async(imported, 0x33, 4, ws).unwrap();
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
    p.clear_violations();
    w.mem_pool_free_import_checked(imported, ws).unwrap();
    w.stream_synchronize(ws).unwrap();
}

#[test]
fn an_old_blob_over_a_smaller_allocation_maps_its_own_range_and_is_a_violation() {
    let p = sim();
    let (pool, fd) = shared_pool(&p);
    p.mem_pool_set_attribute(pool, PoolAttribute::ReleaseThreshold(u64::MAX))
        .unwrap();
    let a = p.mem_alloc_async(2 * MIB, S).unwrap();
    let old = p.mem_pool_export_pointer(a).unwrap();
    p.mem_free_async_checked(a, S).unwrap();
    let c = p.mem_alloc_async(MIB, S).unwrap();
    assert_eq!(c, a);
    let (w, wpool) = worker(&p, &fd);
    let imported = w.mem_pool_import_pointer(wpool, &old).unwrap();
    assert_eq!(w.pointer_get_range(imported).unwrap(), (imported, 2 * MIB));
    assert_eq!(kinds(&p), vec![ViolationKind::ImportBeyondAllocation]);
    p.clear_violations();
    w.mem_pool_free_import_checked(imported, S).unwrap();
}

#[test]
fn with_a_blob_per_allocation_a_new_allocation_exports_other_bytes_and_the_old_blob_fails() {
    let p = sim_with(SimConfig {
        blob_per_allocation: true,
        ..SimConfig::default()
    });
    let (pool, fd) = shared_pool(&p);
    p.mem_pool_set_attribute(pool, PoolAttribute::ReleaseThreshold(u64::MAX))
        .unwrap();
    let a = p.mem_alloc_async(MIB, S).unwrap();
    let old = p.mem_pool_export_pointer(a).unwrap();
    p.mem_free_async_checked(a, S).unwrap();
    let b = p.mem_alloc_async(MIB, S).unwrap();
    assert_eq!(b, a);
    assert_ne!(p.mem_pool_export_pointer(b).unwrap(), old);
    // A process attached through the environment sees the machine's setting too.
    let (w, wpool) = worker(&p, &fd);
    let e = w.mem_pool_import_pointer(wpool, &old).unwrap_err();
    assert!(
        e.is_call("cuMemPoolImportPointer", CuCode::INVALID_VALUE),
        "{e}"
    );
}

#[test]
fn the_export_of_freed_memory_still_held_by_the_pool_imports_with_a_recorded_violation() {
    // Driver 580 on the H200: the export of a freed allocation, whose memory the pool still
    // holds (threshold UINT64_MAX), imports without an error.
    let p = sim();
    let (pool, fd) = shared_pool(&p);
    p.mem_pool_set_attribute(pool, PoolAttribute::ReleaseThreshold(u64::MAX))
        .unwrap();
    let ptr = p.mem_alloc_async(MIB, S).unwrap();
    let stale = p.mem_pool_export_pointer(ptr).unwrap();
    p.mem_free_async_checked(ptr, S).unwrap();
    p.stream_synchronize(S).unwrap();
    let (w, wpool) = worker(&p, &fd);
    w.mem_pool_import_pointer(wpool, &stale).unwrap();
    assert_eq!(kinds(&p), vec![ViolationKind::ImportOfFreed]);
}

#[test]
fn the_export_of_freed_memory_the_pool_gave_back_does_not_import() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p); // release threshold 0: given back at the synchronize
    let ptr = p.mem_alloc_async(MIB, S).unwrap();
    let stale = p.mem_pool_export_pointer(ptr).unwrap();
    p.mem_free_async_checked(ptr, S).unwrap();
    p.stream_synchronize(S).unwrap();
    let (w, wpool) = worker(&p, &fd);
    let e = w.mem_pool_import_pointer(wpool, &stale).unwrap_err();
    assert!(
        e.is_call("cuMemPoolImportPointer", CuCode::INVALID_VALUE),
        "{e}"
    );
}

#[test]
fn an_import_used_after_its_memory_was_recycled_is_caught() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, ptr, a, ws) = handoff(&p, &fd, MIB);
    p.mem_free_async_checked(ptr, S).unwrap(); // violation 1: freed while imported
    let _again = p.mem_alloc_async(MIB, S).unwrap();
    w.memset_d8_async(a, 0, 16, ws).unwrap(); // violation 2: stale generation
    assert_eq!(
        kinds(&p),
        vec![
            ViolationKind::FreedWhileImported,
            ViolationKind::StaleGeneration
        ]
    );
}

// --- statistics, threshold, current pool, attributes ---------------------------------------

fn counter(d: &SimDriver, pool: PoolHandle, c: PoolCounter) -> u64 {
    d.mem_pool_get_attribute(pool, c).unwrap()
}

#[test]
fn used_and_reserved_follow_allocations_and_their_high_marks_stay() {
    let d = sim();
    let owned_pool = OwnedPool::create(&d, 0, PoolSharing::PosixFd).unwrap();
    let pool = owned_pool.handle();
    let a = d.mem_alloc_from_pool_async(3 * MIB, pool, S).unwrap(); // rounds to 4 MiB
    let b = d.mem_alloc_from_pool_async(MIB, pool, S).unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::UsedCurrent), 6 * MIB);
    assert_eq!(counter(&d, pool, PoolCounter::ReservedCurrent), 6 * MIB);
    d.mem_free_async_checked(a, S).unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::UsedCurrent), 2 * MIB);
    assert_eq!(counter(&d, pool, PoolCounter::UsedHigh), 6 * MIB);
    assert_eq!(counter(&d, pool, PoolCounter::ReservedCurrent), 6 * MIB);
    d.mem_free_async_checked(b, S).unwrap();
    let (free, total) = d.mem_get_info().unwrap();
    assert_eq!(total - free, 6 * MIB);
}

#[test]
fn resetting_the_high_marks_restarts_them_from_the_current_figures() {
    let d = sim();
    let owned_pool = OwnedPool::create(&d, 0, PoolSharing::PosixFd).unwrap();
    let pool = owned_pool.handle();
    d.mem_pool_set_attribute(pool, PoolAttribute::ReleaseThreshold(u64::MAX))
        .unwrap();
    let a = d.mem_alloc_from_pool_async(8 * MIB, pool, S).unwrap();
    let b = d.mem_alloc_from_pool_async(2 * MIB, pool, S).unwrap();
    d.mem_free_async_checked(a, S).unwrap();
    d.mem_pool_trim_to(pool, 0).unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::UsedHigh), 10 * MIB);
    assert_eq!(counter(&d, pool, PoolCounter::ReservedHigh), 10 * MIB);
    d.mem_pool_set_attribute(pool, PoolAttribute::ResetUsedHigh)
        .unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::UsedHigh), 2 * MIB);
    assert_eq!(counter(&d, pool, PoolCounter::ReservedHigh), 10 * MIB);
    d.mem_pool_set_attribute(pool, PoolAttribute::ResetReservedHigh)
        .unwrap();
    let reserved = counter(&d, pool, PoolCounter::ReservedCurrent);
    assert!(reserved < 10 * MIB, "{reserved}");
    assert_eq!(counter(&d, pool, PoolCounter::ReservedHigh), reserved);
    // And they climb again from there.
    let c = d.mem_alloc_from_pool_async(4 * MIB, pool, S).unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::UsedHigh), 6 * MIB);
    d.mem_free_async_checked(b, S).unwrap();
    d.mem_free_async_checked(c, S).unwrap();
}

#[test]
fn with_threshold_zero_freed_memory_is_released_at_a_synchronize() {
    let d = sim();
    let owned_pool = OwnedPool::create(&d, 0, PoolSharing::PosixFd).unwrap();
    let pool = owned_pool.handle();
    let a = d.mem_alloc_from_pool_async(8 * MIB, pool, S).unwrap();
    d.mem_free_async_checked(a, S).unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::ReservedCurrent), 8 * MIB);
    d.stream_synchronize(S).unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::ReservedCurrent), 0);
    assert_eq!(counter(&d, pool, PoolCounter::ReservedHigh), 8 * MIB);
}

#[test]
fn with_threshold_max_freed_memory_stays_reserved_until_trimmed() {
    let d = sim();
    let owned_pool = OwnedPool::create(&d, 0, PoolSharing::PosixFd).unwrap();
    let pool = owned_pool.handle();
    d.mem_pool_set_attribute(pool, PoolAttribute::ReleaseThreshold(u64::MAX))
        .unwrap();
    let a = d.mem_alloc_from_pool_async(8 * MIB, pool, S).unwrap();
    d.mem_free_async_checked(a, S).unwrap();
    d.stream_synchronize(S).unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::ReservedCurrent), 8 * MIB);
    d.mem_pool_trim_to(pool, 0).unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::ReservedCurrent), 0);
}

#[test]
fn attributes_read_back_and_reuse_flags_start_enabled() {
    let d = sim();
    let owned_pool = OwnedPool::create(&d, 0, PoolSharing::PosixFd).unwrap();
    let pool = owned_pool.handle();
    assert_eq!(counter(&d, pool, PoolCounter::ReleaseThreshold), 0);
    assert_eq!(
        counter(&d, pool, PoolCounter::ReuseFollowEventDependencies),
        1
    );
    d.mem_pool_set_attribute(pool, PoolAttribute::ReleaseThreshold(u64::MAX))
        .unwrap();
    d.mem_pool_set_attribute(pool, PoolAttribute::ReuseAllowOpportunistic(false))
        .unwrap();
    d.mem_pool_set_attribute(pool, PoolAttribute::ReuseAllowInternalDependencies(false))
        .unwrap();
    d.mem_pool_set_attribute(pool, PoolAttribute::ReuseFollowEventDependencies(false))
        .unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::ReleaseThreshold), u64::MAX);
    assert_eq!(counter(&d, pool, PoolCounter::ReuseAllowOpportunistic), 0);
    assert_eq!(
        counter(&d, pool, PoolCounter::ReuseAllowInternalDependencies),
        0
    );
    assert_eq!(
        counter(&d, pool, PoolCounter::ReuseFollowEventDependencies),
        0
    );
}

#[test]
fn the_current_pool_is_the_default_until_set_and_allocations_come_from_it() {
    let d = sim();
    let default = d.device_get_default_mem_pool(0).unwrap();
    assert_eq!(d.device_get_mem_pool(0).unwrap(), default);
    let pool = OwnedPool::create(&d, 0, PoolSharing::PosixFd)
        .unwrap()
        .into_raw();
    d.device_set_mem_pool(0, pool).unwrap();
    assert_eq!(d.device_get_mem_pool(0).unwrap(), pool);
    let ptr = d.mem_alloc_async(MIB, S).unwrap();
    assert_eq!(d.pointer_get_mempool(ptr).unwrap(), pool);
    assert_eq!(d.pointer_get_range(ptr.offset(100)).unwrap(), (ptr, MIB));
    d.mem_free_async_checked(ptr, S).unwrap();
    d.mem_pool_destroy_checked(pool).unwrap();
    assert_eq!(d.device_get_mem_pool(0).unwrap(), default);
}

#[test]
fn allocations_need_a_current_device() {
    let d = SimDriver::new(SimConfig::default()).unwrap();
    let e = d.mem_alloc_async(MIB, S).unwrap_err();
    assert!(e.is_call("cuMemAllocAsync", CuCode::INVALID_CONTEXT), "{e}");
}

#[test]
fn a_pointer_outside_any_allocation_has_no_pool_and_no_range() {
    let d = sim();
    let e = d.pointer_get_mempool(DevicePtr(0x1234)).unwrap_err();
    assert!(e.is_call("cuPointerGetAttribute", CuCode::INVALID_VALUE));
    let e = d.pointer_get_range(DevicePtr(0x1234)).unwrap_err();
    assert!(e.is_call("cuMemGetAddressRange_v2", CuCode::NOT_FOUND));
}

// --- buffer ids ------------------------------------------------------------------------------

#[test]
fn an_address_the_pool_hands_out_again_has_a_new_buffer_id() {
    let d = sim();
    let (pool, _fd) = shared_pool(&d);
    let a = d.mem_alloc_from_pool_async(MIB, pool, S).unwrap();
    let first = d.pointer_get_buffer_id(a).unwrap();
    d.mem_free_async_checked(a, S).unwrap();
    let b = d.mem_alloc_from_pool_async(MIB, pool, S).unwrap();
    assert_eq!(a, b, "the pool should recycle the address");
    let second = d.pointer_get_buffer_id(b).unwrap();
    assert!(second > first, "ids {first} then {second}");
}

#[test]
fn a_live_allocation_keeps_its_buffer_id_and_interior_pointers_share_it() {
    let d = sim();
    let a = d.mem_alloc_async(3 * MIB, S).unwrap();
    let id = d.pointer_get_buffer_id(a).unwrap();
    assert_eq!(d.pointer_get_buffer_id(a).unwrap(), id);
    assert_eq!(d.pointer_get_buffer_id(a.offset(MIB + 5)).unwrap(), id);
    let b = d.mem_alloc_async(MIB, S).unwrap();
    assert_ne!(d.pointer_get_buffer_id(b).unwrap(), id);
}

#[test]
fn a_freed_or_unknown_pointer_has_no_buffer_id() {
    let d = sim();
    let a = d.mem_alloc_async(MIB, S).unwrap();
    d.mem_free_async_checked(a, S).unwrap();
    for p in [a, DevicePtr(0x1234)] {
        let e = d.pointer_get_buffer_id(p).unwrap_err();
        assert!(
            e.is_call("cuPointerGetAttribute", CuCode::INVALID_VALUE),
            "{e}"
        );
    }
}

#[test]
fn an_import_has_a_buffer_id_of_the_importing_process() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let ptr = p.mem_alloc_async(MIB, S).unwrap();
    let blob = p.mem_pool_export_pointer(ptr).unwrap();
    let (w, wpool) = worker(&p, &fd);
    let imported = w.mem_pool_import_pointer(wpool, &blob).unwrap();
    let id = w.pointer_get_buffer_id(imported).unwrap();
    assert_eq!(w.pointer_get_buffer_id(imported.offset(100)).unwrap(), id);
    // The exporter's pointer means nothing in the importer.
    assert!(w.pointer_get_buffer_id(ptr).is_err());
    w.mem_pool_free_import_checked(imported, S).unwrap();
    assert!(w.pointer_get_buffer_id(imported).is_err());
}

// --- devices and access --------------------------------------------------------------------

#[test]
fn simulated_devices_have_distinct_uuids_and_machines_too() {
    let d = sim_with(SimConfig {
        devices: 3,
        ..SimConfig::default()
    });
    let uuids: std::collections::HashSet<_> =
        (0..3).map(|i| d.device_info(i).unwrap().uuid).collect();
    assert_eq!(uuids.len(), 3);
    assert!(!uuids.contains(&sim().device_info(0).unwrap().uuid));
    assert!(d.device_info(3).is_err());
}

#[test]
fn an_imported_pool_starts_with_read_write_access_from_its_own_device_only() {
    let p = sim_with(SimConfig {
        devices: 2,
        ..SimConfig::default()
    });
    let (_pool, fd) = shared_pool(&p);
    let (w, wpool) = worker(&p, &fd);
    assert_eq!(w.mem_pool_get_access(wpool, 0).unwrap(), Access::ReadWrite);
    assert_eq!(w.mem_pool_get_access(wpool, 1).unwrap(), Access::None);
}

#[test]
fn touching_an_import_from_a_device_without_access_is_recorded() {
    let p = sim_with(SimConfig {
        devices: 2,
        ..SimConfig::default()
    });
    let (_pool, fd) = shared_pool(&p);
    let (w, _ptr, a, ws) = handoff(&p, &fd, MIB);
    w.use_device(1).unwrap();
    assert!(w.memset_d8_async(a, 0, 16, ws).is_err());
    assert_eq!(kinds(&p), vec![ViolationKind::NoAccess]);
    let wpool = w.pointer_get_mempool(a).unwrap();
    w.mem_pool_set_access(wpool, 1, Access::ReadWrite).unwrap();
    w.memset_d8_async(a, 0, 16, ws).unwrap();
    assert_eq!(kinds(&p), vec![ViolationKind::NoAccess]);
}

#[test]
fn visible_devices_reorder_ordinals_but_not_uuids() {
    let d = sim_with(SimConfig {
        devices: 3,
        ..SimConfig::default()
    });
    let uuid = |d: &SimDriver, i| d.device_info(i).unwrap().uuid;
    let w = d.peer_seeing("2,0");
    assert_eq!(w.device_count().unwrap(), 2);
    assert_eq!(uuid(&w, 0), uuid(&d, 2));
    assert_eq!(uuid(&w, 1), uuid(&d, 0));
    assert_eq!(w.device_info(1).unwrap().ordinal, 1);
    assert!(
        w.device_info(2)
            .unwrap_err()
            .is_call("cuDeviceGet", CuCode::INVALID_DEVICE)
    );
    // By UUID, in any case, as nvidia-smi prints it.
    let by_uuid = d.peer_seeing(&format!(" {} ,0", uuid(&d, 1).to_string().to_uppercase()));
    assert_eq!(by_uuid.device_count().unwrap(), 2);
    assert_eq!(uuid(&by_uuid, 0), uuid(&d, 1));
}

#[test]
fn visible_devices_end_at_the_first_entry_naming_no_device_or_one_twice() {
    let d = sim_with(SimConfig {
        devices: 3,
        ..SimConfig::default()
    });
    assert_eq!(d.peer_seeing("1,7,0").device_count().unwrap(), 1);
    assert_eq!(d.peer_seeing("1,1,0").device_count().unwrap(), 1);
    assert_eq!(d.peer_seeing("GPU-nonsense,0").device_count().unwrap(), 0);
    let none = d.peer_seeing("");
    assert_eq!(none.device_count().unwrap(), 0);
    assert!(none.use_device(0).is_err());
}

#[test]
fn a_pool_is_shared_by_uuid_whatever_ordinal_each_process_gives_its_device() {
    let p = sim_with(SimConfig {
        devices: 2,
        ..SimConfig::default()
    });
    p.use_device(1).unwrap();
    let pool = OwnedPool::create(&p, 1, PoolSharing::PosixFd)
        .unwrap()
        .into_raw();
    p.device_set_mem_pool(1, pool).unwrap();
    let fd = p.mem_pool_export_fd(pool).unwrap();
    let ptr = p.mem_alloc_async(MIB, S).unwrap();
    p.memset_d8_async(ptr, 0x5A, MIB, S).unwrap();
    let owned_ready = OwnedEvent::new(&p, true).unwrap();
    let ready = owned_ready.handle();
    p.event_record(ready, S).unwrap();
    let blob = p.mem_pool_export_pointer(ptr).unwrap();
    // The parent's device 1 is this worker's device 0.
    let w = p.peer_seeing("1");
    w.use_device(0).unwrap();
    let wpool = w.mem_pool_import_fd(fd.as_fd()).unwrap();
    assert_eq!(w.mem_pool_get_access(wpool, 0).unwrap(), Access::ReadWrite);
    let a = w.mem_pool_import_pointer(wpool, &blob).unwrap();
    let r = w
        .ipc_open_event_handle(&p.ipc_get_event_handle(ready).unwrap())
        .unwrap();
    w.event_synchronize(r).unwrap();
    let mut got = [0u8; 4];
    w.memcpy_dtoh(&mut got, a).unwrap();
    assert_eq!(got, [0x5A; 4]);
    w.mem_pool_free_import_checked(a, S).unwrap();
    assert!(kinds(&p).is_empty(), "{:?}", p.violations());
}

#[test]
fn devices_without_a_peer_path_refuse_access_to_each_others_pools() {
    let p = sim_with(SimConfig {
        devices: 2,
        peer_access: false,
        ..SimConfig::default()
    });
    assert!(!p.device_can_access_peer(0, 1).unwrap());
    assert!(!p.device_can_access_peer(1, 0).unwrap());
    let (_pool, fd) = shared_pool(&p);
    let (w, wpool) = worker(&p, &fd);
    let e = w
        .mem_pool_set_access(wpool, 1, Access::ReadWrite)
        .unwrap_err();
    assert!(
        e.is_call("cuMemPoolSetAccess", CuCode::INVALID_DEVICE),
        "{e}"
    );
    // Its own device keeps read-write; taking nothing away from another is allowed.
    w.mem_pool_set_access(wpool, 0, Access::ReadWrite).unwrap();
    w.mem_pool_set_access(wpool, 1, Access::None).unwrap();
    let peers = sim_with(SimConfig {
        devices: 2,
        ..SimConfig::default()
    });
    assert!(peers.device_can_access_peer(0, 1).unwrap());
}

// --- events --------------------------------------------------------------------------------

#[test]
fn an_event_handle_opens_in_another_process_and_a_plain_event_has_none() {
    let p = sim();
    let owned_ev = OwnedEvent::new(&p, true).unwrap();
    let ev = owned_ev.handle();
    let h = p.ipc_get_event_handle(ev).unwrap();
    let w = p.peer();
    w.use_device(0).unwrap();
    let a = w.ipc_open_event_handle(&h).unwrap();
    let b = w.ipc_open_event_handle(&h).unwrap();
    assert!(w.event_query(a).unwrap());
    w.event_destroy_checked(a).unwrap();
    w.event_synchronize(b).unwrap();
    let owned_plain = OwnedEvent::new(&p, false).unwrap();
    let plain = owned_plain.handle();
    assert!(p.ipc_get_event_handle(plain).is_err());
}

// --- VMM and host registration -------------------------------------------------------------

#[test]
fn vmm_memory_maps_in_another_process_and_needs_access() {
    let p = sim();
    let g = p.vmm_granularity(0, Granularity::Minimum).unwrap();
    let h = p.vmm_create(0, 2 * g).unwrap();
    let va = p.vmm_reserve(2 * g, 0).unwrap();
    p.vmm_map(va, 2 * g, h).unwrap();
    let e = p.memset_d8_async(va, 1, 16, S).unwrap_err();
    assert!(e.is_call("cuMemsetD8Async", CuCode::ILLEGAL_ADDRESS));
    p.vmm_set_access(va, 2 * g, 0, Access::ReadWrite).unwrap();
    p.memset_d8_async(va, 0x5A, 2 * g, S).unwrap();
    // Without this the read below would see zeros: the memset has not run yet.
    p.stream_synchronize(S).unwrap();

    let fd = p.vmm_export_fd(h).unwrap();
    let w = p.peer();
    w.use_device(0).unwrap();
    let wh = w.vmm_import_fd(fd.as_fd()).unwrap();
    let wva = w.vmm_reserve(2 * g, 0).unwrap();
    w.vmm_map(wva, 2 * g, wh).unwrap();
    w.vmm_set_access(wva, 2 * g, 0, Access::ReadWrite).unwrap();
    let mut buf = [0u8; 4];
    w.memcpy_dtoh(&mut buf, wva.offset(g)).unwrap();
    assert_eq!(buf, [0x5A; 4]);
    w.vmm_unmap_checked(wva, 2 * g).unwrap();
    assert!(w.memcpy_dtoh(&mut buf, wva).is_err());
    w.vmm_address_free_checked(wva, 2 * g).unwrap();
    w.vmm_release_checked(wh).unwrap();
    assert_eq!(
        kinds(&p),
        vec![ViolationKind::NoAccess, ViolationKind::UnmappedAccess]
    );
}

#[test]
fn host_memory_registers_once() {
    let d = sim();
    let mut buf = vec![0u8; 8192];
    // SAFETY: `buf` outlives the registration, which is removed below.
    unsafe {
        d.host_register(buf.as_mut_ptr(), buf.len()).unwrap();
        let e = d.host_register(buf.as_mut_ptr().add(4096), 16).unwrap_err();
        assert!(e.is_call(
            "cuMemHostRegister_v2",
            CuCode::HOST_MEMORY_ALREADY_REGISTERED
        ));
        d.host_unregister(buf.as_mut_ptr()).unwrap();
        let e = d.host_unregister(buf.as_mut_ptr()).unwrap_err();
        assert!(e.is_call("cuMemHostUnregister", CuCode::HOST_MEMORY_NOT_REGISTERED));
    }
}

// --- the machine lock ----------------------------------------------------------------------

#[test]
fn a_lock_held_by_a_dead_thread_is_taken_over() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let word = std::sync::atomic::AtomicU32::new(dead);
    let t = std::time::Instant::now();
    drop(shm::MachineLock::acquire(&word));
    assert!(t.elapsed() < std::time::Duration::from_secs(2));
    assert_eq!(word.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[test]
fn from_env_without_the_variable_is_none() {
    // The variable is never set in this process (tests never call set_var).
    if std::env::var_os(MACHINE_ENV).is_none() {
        assert!(SimDriver::from_env().is_none());
    }
}

#[test]
fn attach_finds_the_same_machine() {
    let p = sim();
    let (_, value) = p.child_env();
    let q = SimDriver::attach(&value).unwrap();
    assert_eq!(q.machine_id(), p.machine_id());
    assert!(SimDriver::attach("1:2:3").is_err());
}

#[test]
fn a_memset_past_the_size_asked_for_is_invalid_value_as_on_the_h200() {
    // Driver 580: a 24 690-byte allocation refuses a memset of 24 692 bytes, although the
    // pool rounds the allocation up.
    let p = sim();
    let (_pool, _fd) = shared_pool(&p);
    let ptr = p.mem_alloc_async(24_690, S).unwrap();
    let e = p.memset_d32_async(ptr, 1, 24_692 / 4, S).unwrap_err();
    assert!(e.is_call("cuMemsetD32Async", CuCode::INVALID_VALUE), "{e}");
    p.memset_d32_async(ptr, 1, 24_690 / 4, S).unwrap();
    p.memset_d8_async(ptr.offset(24_688), 1, 2, S).unwrap();
    assert_eq!(kinds(&p), vec![]);
}

// --- the asynchronous GPU and the race detector: the handoff's mutations --------------------

/// The worker's DONE: an interprocess event recorded on `ws`, opened by the parent.
fn done_event(p: &SimDriver, w: &SimDriver, ws: StreamHandle) -> crate::EventHandle {
    let done = OwnedEvent::new(w, true).unwrap().into_raw();
    w.event_record(done, ws).unwrap();
    p.ipc_open_event_handle(&w.ipc_get_event_handle(done).unwrap())
        .unwrap()
}

#[test]
fn the_handoff_done_right_records_nothing_and_the_parent_reads_the_workers_bytes() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, ptr, imported, ws) = handoff(&p, &fd, MIB);
    w.memset_d8_async(imported, 0x5A, MIB, ws).unwrap();
    let done = done_event(&p, &w, ws);
    let owned_caller = OwnedStream::new(&p).unwrap();
    let caller = owned_caller.handle();
    p.stream_wait_event(caller, done).unwrap();
    let mut buf = [0u8; 16];
    p.memcpy_dtoh_on(&mut buf, ptr.offset(MIB - 16), caller)
        .unwrap();
    assert_eq!(buf, [0x5A; 16]);
    assert_eq!(kinds(&p), vec![]);
}

#[test]
fn mutation_done_recorded_before_the_last_write_is_caught() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, ptr, imported, ws) = handoff(&p, &fd, MIB);
    let done = done_event(&p, &w, ws);
    w.memset_d8_async(imported, 0x5A, MIB, ws).unwrap(); // after DONE
    let owned_caller = OwnedStream::new(&p).unwrap();
    let caller = owned_caller.handle();
    p.stream_wait_event(caller, done).unwrap();
    let mut buf = [0u8; 16];
    p.memcpy_dtoh_on(&mut buf, ptr, caller).unwrap();
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
    let v = &p.violations()[0];
    assert_eq!(
        (v.call, v.other_call),
        ("cuMemcpyDtoHAsync", Some("cuMemsetD8Async"))
    );
}

#[test]
fn mutation_the_consumer_streams_done_wait_removed_is_caught() {
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, ptr, imported, ws) = handoff(&p, &fd, MIB);
    w.memset_d8_async(imported, 0x5A, MIB, ws).unwrap();
    let done = done_event(&p, &w, ws);
    let owned_job = OwnedStream::new(&p).unwrap();
    let job = owned_job.handle();
    p.stream_wait_event(job, done).unwrap();
    // The caller's own stream never waited on the job's stream.
    let owned_caller = OwnedStream::new(&p).unwrap();
    let caller = owned_caller.handle();
    p.memset_d8_async(ptr, 0, 16, caller).unwrap();
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
}

#[test]
fn mutation_an_arena_block_reused_before_done_is_caught() {
    let p = sim();
    let g = p.vmm_granularity(0, Granularity::Minimum).unwrap();
    let h = p.vmm_create(0, g).unwrap();
    let va = p.vmm_reserve(g, 0).unwrap();
    p.vmm_map(va, g, h).unwrap();
    p.vmm_set_access(va, g, 0, Access::ReadWrite).unwrap();
    let fd = p.vmm_export_fd(h).unwrap();
    let w = p.peer();
    w.use_device(0).unwrap();
    let wh = w.vmm_import_fd(fd.as_fd()).unwrap();
    let wva = w.vmm_reserve(g, 0).unwrap();
    w.vmm_map(wva, g, wh).unwrap();
    w.vmm_set_access(wva, g, 0, Access::ReadWrite).unwrap();
    // The parent fills the block, READY; the worker reads it after READY, then DONE.
    p.memset_d8_async(va, 1, g, S).unwrap();
    let owned_ready = OwnedEvent::new(&p, true).unwrap();
    let ready = owned_ready.handle();
    p.event_record(ready, S).unwrap();
    let r = w
        .ipc_open_event_handle(&p.ipc_get_event_handle(ready).unwrap())
        .unwrap();
    let owned_ws = OwnedStream::new(&w).unwrap();
    let ws = owned_ws.handle();
    w.stream_wait_event(ws, r).unwrap();
    // A kernel's read (a device copy out of the block), asynchronous: nobody waits for it
    // on the host.
    let own = w.mem_alloc_async(64, ws).unwrap();
    w.memcpy_dtod_async(own, wva, 64, ws).unwrap();
    let _done = done_event(&p, &w, ws);
    assert_eq!(kinds(&p), vec![]);
    // The block goes to the next job without waiting on DONE: its fill races the read.
    let owned_next = OwnedStream::new(&p).unwrap();
    let next = owned_next.handle();
    p.memset_d8_async(va, 2, 64, next).unwrap();
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
}

#[test]
fn a_missing_ready_wait_reads_stale_bytes_on_the_asynchronous_gpu() {
    // The parent's fill is queued with a delay; the worker's legacy-stream read is not
    // ordered after it. Over a few rounds the read sees the bytes from before the fill at
    // least once, and every round is reported.
    let p = sim();
    let (_pool, fd) = shared_pool(&p);
    let (w, _wpool) = worker(&p, &fd);
    let wpool = _wpool;
    let mut stale = 0;
    let rounds = 40;
    for round in 0..rounds {
        let owned_s = OwnedStream::new(&p).unwrap();
        let s = owned_s.handle();
        let ptr = p.mem_alloc_async(MIB, s).unwrap();
        p.memset_d8_async(ptr, 0, 16, s).unwrap();
        p.stream_synchronize(s).unwrap();
        p.memset_d8_async(ptr, 0x77, 16, s).unwrap();
        let blob = p.mem_pool_export_pointer(ptr).unwrap();
        let imported = w.mem_pool_import_pointer(wpool, &blob).unwrap();
        let mut buf = [0u8; 16];
        w.memcpy_dtoh(&mut buf, imported).unwrap();
        if buf != [0x77; 16] {
            stale += 1;
        }
        w.mem_pool_free_import_checked(imported, S).unwrap();
        w.stream_synchronize(S).unwrap();
        p.stream_synchronize(s).unwrap();
        p.mem_free_async_checked(ptr, s).unwrap();
        p.stream_synchronize(s).unwrap();
        p.stream_destroy_checked(s).unwrap();
        let _ = round;
    }
    let unordered = kinds(&p)
        .iter()
        .filter(|k| **k == ViolationKind::UnorderedAccess)
        .count();
    assert_eq!(unordered, rounds, "every unordered read is reported");
    assert!(
        stale > 0,
        "the asynchronous GPU never ran the read before the fill"
    );
}

// --- memory outside the pool: cuMemAlloc and VMM allocations lent by handle ---

/// A VMM allocation of the parent's, mapped read-write at its own address: (handle, va, len).
fn parent_vmm(p: &SimDriver, exportable: bool) -> (VmmHandle, DevicePtr, u64) {
    let g = p.vmm_granularity(0, Granularity::Minimum).unwrap();
    let h = if exportable {
        p.vmm_create(0, g).unwrap()
    } else {
        p.vmm_create_unshared(0, g).unwrap()
    };
    let va = p.vmm_reserve(g, 0).unwrap();
    p.vmm_map(va, g, h).unwrap();
    p.vmm_set_access(va, g, 0, Access::ReadWrite).unwrap();
    (h, va, g)
}

/// What the parent does to lend a VMM allocation by handle: retain from an interior
/// address, check the handle type, export, release the retained reference.
fn lend_by_handle(p: &SimDriver, interior: DevicePtr) -> OwnedFd {
    let retained = p.vmm_retain(interior).unwrap();
    assert!(p.vmm_exports_fd(retained).unwrap());
    let fd = p.vmm_export_fd(retained).unwrap();
    p.vmm_release_checked(retained).unwrap();
    fd
}

#[test]
fn every_kind_of_device_memory_names_its_device_and_host_memory_none() {
    let p = sim();
    let _pool = shared_pool(&p);
    let pooled = p.mem_alloc_async(MIB, S).unwrap();
    let plain = p.mem_alloc(MIB).unwrap();
    let (_h, va, _) = parent_vmm(&p, false);
    for ptr in [pooled, plain.offset(100), va.offset(4096)] {
        assert_eq!(p.pointer_get_device(ptr).unwrap(), 0, "{ptr:?}");
        assert_eq!(p.pointer_info(ptr).unwrap().device, Some(0), "{ptr:?}");
    }
    assert_eq!(p.pointer_info(plain).unwrap().pool, None);
    let host = [0u8; 64];
    let on_host = DevicePtr(host.as_ptr() as u64);
    assert!(p.pointer_get_device(on_host).is_err());
    p.mem_free_checked(plain).unwrap();
    assert!(p.pointer_get_device(plain).is_err(), "freed: no device");
    assert_eq!(kinds(&p), vec![]);
}

#[test]
fn only_vmm_mappings_can_be_retained_and_only_posix_fd_handles_exported() {
    let p = sim();
    let _pool = shared_pool(&p);
    let pooled = p.mem_alloc_async(MIB, S).unwrap();
    let plain = p.mem_alloc(MIB).unwrap();
    // Pool memory: INVALID_VALUE (measured on the H200); cuMemAlloc memory likewise.
    for ptr in [pooled, plain] {
        let e = p.vmm_retain(ptr).unwrap_err();
        assert!(e.to_string().contains("cuMemRetainAllocationHandle"), "{e}");
    }
    let (_h, va, _) = parent_vmm(&p, false);
    let retained = p.vmm_retain(va.offset(8)).unwrap();
    assert!(!p.vmm_exports_fd(retained).unwrap());
    assert!(
        p.vmm_export_fd(retained).is_err(),
        "no POSIX FD handle type, no FD"
    );
    p.vmm_release_checked(retained).unwrap();
    let (_h2, va2, _) = parent_vmm(&p, true);
    drop(lend_by_handle(&p, va2.offset(8)));
    p.mem_free_checked(plain).unwrap();
}

#[test]
fn a_worker_touching_a_vmm_allocation_lent_by_handle_before_ready_is_recorded() {
    let p = sim();
    let (_h, va, g) = parent_vmm(&p, true);
    p.memset_d8_async(va, 1, g, S).unwrap();
    let fd = lend_by_handle(&p, va.offset(64));
    let w = p.peer();
    w.use_device(0).unwrap();
    let wh = w.vmm_import_fd(fd.as_fd()).unwrap();
    let wva = w.vmm_reserve(g, 0).unwrap();
    w.vmm_map(wva, g, wh).unwrap();
    w.vmm_set_access(wva, g, 0, Access::ReadWrite).unwrap();
    let owned_ws = OwnedStream::new(&w).unwrap();
    let ws = owned_ws.handle();
    w.memset_d8_async(wva, 2, 16, ws).unwrap();
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
}

#[test]
fn a_worker_waiting_on_ready_before_touching_a_vmm_allocation_lent_by_handle_is_clean() {
    let p = sim();
    let (_h, va, g) = parent_vmm(&p, true);
    p.memset_d8_async(va, 1, g, S).unwrap();
    let owned_ready = OwnedEvent::new(&p, true).unwrap();
    let ready = owned_ready.handle();
    p.event_record(ready, S).unwrap();
    let fd = lend_by_handle(&p, va);
    let w = p.peer();
    w.use_device(0).unwrap();
    let wh = w.vmm_import_fd(fd.as_fd()).unwrap();
    let wva = w.vmm_reserve(g, 0).unwrap();
    w.vmm_map(wva, g, wh).unwrap();
    w.vmm_set_access(wva, g, 0, Access::ReadWrite).unwrap();
    let r = w
        .ipc_open_event_handle(&p.ipc_get_event_handle(ready).unwrap())
        .unwrap();
    let owned_ws = OwnedStream::new(&w).unwrap();
    let ws = owned_ws.handle();
    w.stream_wait_event(ws, r).unwrap();
    w.memset_d8_async(wva, 2, 16, ws).unwrap();
    w.stream_synchronize(ws).unwrap();
    let mut got = [0u8; 32];
    p.memcpy_dtoh(&mut got, va).unwrap();
    assert_eq!(
        &got[..16],
        &[2; 16],
        "the worker's write is in the parent's memory"
    );
    assert_eq!(&got[16..], &[1; 16]);
    assert_eq!(kinds(&p), vec![]);
}

#[test]
fn unordered_writes_to_cu_mem_alloc_memory_on_two_streams_are_recorded() {
    let p = sim();
    let plain = p.mem_alloc(MIB).unwrap();
    p.memset_d8_async(plain, 1, MIB, S).unwrap();
    let owned_other = OwnedStream::new(&p).unwrap();
    let other = owned_other.handle();
    p.memset_d8_async(plain, 2, 16, other).unwrap();
    assert_eq!(kinds(&p), vec![ViolationKind::UnorderedAccess]);
}

// --- exported memory in limbo (docs/facts.md, "Other driver behaviour designed for") ---

fn held(d: &SimDriver) -> u64 {
    let (free, total) = d.mem_get_info().unwrap();
    total - free
}

#[test]
fn freed_memory_never_exported_goes_back_at_a_trim() {
    let d = sim();
    let (pool, _fd) = shared_pool(&d);
    let start = held(&d);
    let ptr = d.mem_alloc_async(64 * MIB, S).unwrap();
    d.mem_free_async_checked(ptr, S).unwrap();
    d.mem_pool_trim_to(pool, 0).unwrap();
    assert_eq!(held(&d), start);
}

#[test]
fn exported_freed_memory_stays_on_the_device_after_a_trim_and_is_taken_again_not_twice() {
    let d = sim();
    let (pool, _fd) = shared_pool(&d);
    let start = held(&d);
    let ptr = d.mem_alloc_async(64 * MIB, S).unwrap();
    d.mem_pool_export_pointer(ptr).unwrap();
    d.mem_free_async_checked(ptr, S).unwrap();
    d.mem_pool_trim_to(pool, 0).unwrap();
    assert_eq!(counter(&d, pool, PoolCounter::ReservedCurrent), 0);
    assert_eq!(held(&d), start + 64 * MIB);
    // A new allocation there takes the same memory: the device holds the high-water mark.
    let again = d.mem_alloc_async(64 * MIB, S).unwrap();
    assert_eq!(held(&d), start + 64 * MIB);
    assert_eq!(counter(&d, pool, PoolCounter::ReservedCurrent), 64 * MIB);
    d.mem_free_async_checked(again, S).unwrap();
    d.mem_pool_trim_to(pool, 0).unwrap();
    assert_eq!(held(&d), start + 64 * MIB);
}

#[test]
fn exported_freed_memory_goes_back_when_the_pool_is_destroyed_and_no_import_of_it_is_left() {
    let p = sim();
    let (pool, fd) = shared_pool(&p);
    let start = held(&p);
    let (w, ptr, imported, _ws) = handoff(&p, &fd, 64 * MIB);
    let wpool = w.mem_pool_import_fd(fd.as_fd()).unwrap();
    w.mem_free_async_checked(imported, StreamHandle::NULL)
        .unwrap();
    w.ctx_synchronize().unwrap();
    p.mem_free_async_checked(ptr, S).unwrap();
    p.mem_pool_trim_to(pool, 0).unwrap();
    let default = p.device_get_default_mem_pool(0).unwrap();
    p.device_set_mem_pool(0, default).unwrap();
    p.mem_pool_destroy_checked(pool).unwrap();
    assert_eq!(
        held(&p),
        start + 64 * MIB,
        "the worker still holds its import of the pool"
    );
    w.mem_pool_destroy_checked(wpool).unwrap();
    assert_eq!(held(&p), start);
}
