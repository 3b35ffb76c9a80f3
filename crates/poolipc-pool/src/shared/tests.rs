//! The shared pool against a mock driver: the install sequence, the export cache, the reuse
//! check, attach and the figures.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use mockall::Sequence;
use poolipc_driver::{
    Access, CuCode, DeviceInfo, DevicePtr, DeviceUuid, DriverError, DriverKind, ExportBlob,
    MockDriver, PoolAttribute, PoolCounter, PoolHandle, PoolSharing, StreamHandle,
};

use super::{AttachedPool, PoolError, SharedPool, TORCH_POOL_ATTRIBUTES};
use crate::export_cache::ExportReuse;

const DEFAULT: PoolHandle = PoolHandle::mock(0xd0);
const OURS: PoolHandle = PoolHandle::mock(0xa1);

fn info(pool_fd: bool) -> DeviceInfo {
    DeviceInfo {
        ordinal: 0,
        uuid: DeviceUuid([7; 16]),
        name: "mock".into(),
        total_memory: 1 << 30,
        memory_pools: true,
        pool_posix_fd: pool_fd,
        vmm: true,
        vmm_posix_fd: true,
        mps_client: None,
    }
}

fn some_fd() -> OwnedFd {
    OwnedFd::from(std::fs::File::open("/dev/null").unwrap())
}

/// A driver that expects the install sequence in order, then whatever `then` adds.
fn installing(seq: &mut Sequence) -> MockDriver {
    let mut d = MockDriver::new();
    d.expect_kind().return_const(DriverKind::Mock);
    d.expect_device_info().returning(|_| Ok(info(true)));
    d.expect_device_get_mem_pool()
        .times(1)
        .in_sequence(seq)
        .returning(|_| Ok(DEFAULT));
    d.expect_device_get_default_mem_pool()
        .times(1)
        .in_sequence(seq)
        .returning(|_| Ok(DEFAULT));
    d.expect_mem_pool_create()
        .withf(|dev, s, _| *dev == 0 && *s == PoolSharing::PosixFd)
        .times(1)
        .in_sequence(seq)
        .returning(|_, _, _| Ok(OURS));
    for attr in TORCH_POOL_ATTRIBUTES {
        d.expect_mem_pool_set_attribute()
            .withf(move |p, a| *p == OURS && *a == attr)
            .times(1)
            .in_sequence(seq)
            .returning(|_, _| Ok(()));
    }
    d.expect_device_set_mem_pool()
        .withf(|dev, p| *dev == 0 && *p == OURS)
        .times(1)
        .in_sequence(seq)
        .returning(|_, _| Ok(()));
    d.expect_mem_pool_export_fd()
        .withf(|p| *p == OURS)
        .times(1)
        .in_sequence(seq)
        .returning(|_| Ok(some_fd()));
    d
}

#[test]
fn install_sets_torchs_attributes_before_making_the_pool_current_then_exports_the_fd() {
    let mut seq = Sequence::new();
    let d = Arc::new(installing(&mut seq));
    let pool = SharedPool::install(d, 0).unwrap();
    assert_eq!(pool.handle(), OURS);
}

#[test]
fn the_fd_is_exported_before_any_pointer_export() {
    let mut seq = Sequence::new();
    let mut d = installing(&mut seq);
    d.expect_pointer_get_buffer_id().returning(|_| Ok(7));
    d.expect_pointer_get_mempool()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(OURS));
    d.expect_mem_pool_export_pointer()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(ExportBlob([1; 64])));
    d.expect_pointer_get_range().returning(|p| Ok((p, 4096)));
    let pool = SharedPool::install(Arc::new(d), 0).unwrap();
    assert_eq!(pool.export(DevicePtr(0x1000)).unwrap(), ExportBlob([1; 64]));
}

#[test]
fn a_pointer_of_another_pool_is_not_exported() {
    let mut seq = Sequence::new();
    let mut d = installing(&mut seq);
    d.expect_pointer_get_buffer_id().returning(|_| Ok(9));
    d.expect_pointer_get_mempool().returning(|_| Ok(DEFAULT));
    d.expect_mem_pool_export_pointer().never();
    let pool = SharedPool::install(Arc::new(d), 0).unwrap();
    let e = pool.export(DevicePtr(0x1000)).unwrap_err();
    assert!(matches!(e, PoolError::ForeignPointer { .. }), "{e}");
}

/// An installed pool whose driver exports `ptr`'s allocation (`bytes` long) with blob
/// `[n; 64]` at the n-th `cuMemPoolExportPointer`, and reports the buffer ids `ids`
/// gives, one per query.
fn exporting(
    bytes: u64,
    exports: usize,
    ids: impl FnMut(DevicePtr) -> Result<u64, DriverError> + Send + 'static,
) -> SharedPool<MockDriver> {
    let mut seq = Sequence::new();
    let mut d = installing(&mut seq);
    d.expect_pointer_get_buffer_id().returning(ids);
    d.expect_pointer_get_mempool().returning(|_| Ok(OURS));
    let mut n = 0u8;
    d.expect_mem_pool_export_pointer()
        .times(exports)
        .returning(move |_| {
            n += 1;
            Ok(ExportBlob([n; 64]))
        });
    d.expect_pointer_get_range()
        .returning(move |p| Ok((DevicePtr(p.0 & !0xfff), bytes)));
    SharedPool::install(Arc::new(d), 0).unwrap()
}

#[test]
fn a_second_export_of_a_live_allocation_reuses_the_blob() {
    let pool = exporting(1 << 30, 1, |_| Ok(917));
    let first = pool.export(DevicePtr(0x1000)).unwrap();
    assert_eq!(pool.export(DevicePtr(0x1000)).unwrap(), first);
    let s = pool.export_cache_stats();
    assert_eq!(
        (s.hits, s.misses, s.stale, s.bytes_saved),
        (1, 1, 0, 1 << 30)
    );
}

#[test]
fn an_address_holding_a_new_allocation_is_exported_again() {
    // Two queries per miss (before and after the export), then the recycled address.
    let mut ids = [917, 917, 918, 918, 918].into_iter();
    let pool = exporting(4096, 2, move |_| Ok(ids.next().unwrap_or(0)));
    let first = pool.export(DevicePtr(0x1000)).unwrap();
    let second = pool.export(DevicePtr(0x1000)).unwrap();
    assert_ne!(first, second);
    assert_eq!(pool.export(DevicePtr(0x1000)).unwrap(), second);
    let s = pool.export_cache_stats();
    assert_eq!((s.hits, s.misses, s.stale, s.entries), (1, 1, 1, 1));
}

#[test]
fn a_second_reuse_check_is_refused_and_leaves_the_first_running() {
    let pool = exporting(4096, 0, |_| Ok(1));
    let first = pool.begin_export_reuse_check().expect("the first check");
    assert!(pool.begin_export_reuse_check().is_none());
    assert_eq!(pool.export_reuse().0, ExportReuse::Checking);
    first.finish(Ok(()));
    assert!(pool.begin_export_reuse_check().is_none());
    assert_eq!(pool.export_reuse(), (ExportReuse::Proven, None));
    assert_eq!(pool.export_cache_stats().reuse, ExportReuse::Proven);
}

#[test]
fn a_reuse_check_dropped_unfinished_can_be_made_again() {
    let pool = exporting(4096, 0, |_| Ok(1));
    drop(pool.begin_export_reuse_check());
    assert_eq!(pool.export_reuse().0, ExportReuse::Unchecked);
    pool.begin_export_reuse_check()
        .expect("a second try")
        .finish(Err("no".into()));
    assert_eq!(
        pool.export_reuse(),
        (ExportReuse::NotProven, Some("no".into()))
    );
}

#[test]
fn once_proven_a_recycled_address_of_the_same_size_is_not_exported_again() {
    let gib = 1u64 << 30;
    let pool = exporting(gib, 2, |_| Ok(0));
    pool.begin_export_reuse_check()
        .expect("check")
        .finish(Ok(()));
    let base = DevicePtr(0x1000);
    let first = pool.export_known(base, gib, Some(917)).unwrap();
    // A new allocation there (buffer id 918), same size: the cached blob, no export.
    assert_eq!(pool.export_known(base, gib, Some(918)).unwrap(), first);
    // Another size there: exported (the driver's second blob).
    assert_ne!(pool.export_known(base, gib / 2, Some(919)).unwrap(), first);
    let s = pool.export_cache_stats();
    assert_eq!(
        (s.reused, s.reused_bytes, s.misses, s.stale),
        (1, gib, 1, 1)
    );
}

#[test]
fn unproven_a_recycled_address_of_the_same_size_is_exported_again() {
    let pool = exporting(4096, 2, |_| Ok(0));
    let base = DevicePtr(0x1000);
    pool.export_known(base, 4096, Some(1)).unwrap();
    pool.export_known(base, 4096, Some(2)).unwrap();
    let s = pool.export_cache_stats();
    assert_eq!((s.reused, s.stale), (0, 1));
}

#[test]
fn without_a_buffer_id_every_export_goes_to_the_driver() {
    let pool = exporting(4096, 2, |_| {
        Err(DriverError::Call {
            call: "cuPointerGetAttribute",
            code: CuCode::NOT_SUPPORTED,
        })
    });
    pool.export(DevicePtr(0x1000)).unwrap();
    pool.export(DevicePtr(0x1000)).unwrap();
    let s = pool.export_cache_stats();
    assert_eq!((s.hits, s.uncached, s.entries), (0, 2, 0));
}

#[test]
fn the_export_of_an_interior_pointer_is_not_cached() {
    let pool = exporting(4096, 2, |_| Ok(5));
    pool.export(DevicePtr(0x1010)).unwrap();
    pool.export(DevicePtr(0x1010)).unwrap();
    assert_eq!(pool.export_cache_stats().entries, 0);
}

#[test]
fn an_export_whose_allocation_changed_meanwhile_is_not_cached() {
    let mut ids = [1, 2, 2, 2].into_iter();
    let pool = exporting(4096, 2, move |_| Ok(ids.next().unwrap_or(0)));
    pool.export(DevicePtr(0x1000)).unwrap();
    assert_eq!(pool.export_cache_stats().entries, 0);
    pool.export(DevicePtr(0x1000)).unwrap();
    assert_eq!(pool.export_cache_stats().entries, 1);
}

#[test]
fn a_free_through_the_pool_drops_the_cached_export() {
    let mut seq = Sequence::new();
    let mut d = installing(&mut seq);
    d.expect_pointer_get_buffer_id().returning(|_| Ok(3));
    d.expect_pointer_get_mempool().returning(|_| Ok(OURS));
    d.expect_mem_pool_export_pointer()
        .times(1)
        .returning(|_| Ok(ExportBlob([1; 64])));
    d.expect_pointer_get_range().returning(|p| Ok((p, 4096)));
    // The free checks that the address starts a live pool allocation first.
    d.expect_pointer_info().returning(|p| {
        Ok(poolipc_driver::PointerInfo {
            base: p,
            size: 4096,
            pool: Some(OURS),
            buffer_id: Some(3),
            device: Some(0),
        })
    });
    d.expect_mem_free_async().times(1).returning(|_, _| Ok(()));
    let pool = SharedPool::install(Arc::new(d), 0).unwrap();
    pool.export(DevicePtr(0x1000)).unwrap();
    pool.free(DevicePtr(0x1000), StreamHandle::NULL).unwrap();
    assert_eq!(pool.export_cache_stats().entries, 0);
}

#[test]
fn install_refuses_when_the_current_pool_was_already_swapped() {
    let mut d = MockDriver::new();
    d.expect_kind().return_const(DriverKind::Mock);
    d.expect_device_info().returning(|_| Ok(info(true)));
    d.expect_device_get_mem_pool()
        .returning(|_| Ok(PoolHandle::mock(0xbeef)));
    d.expect_device_get_default_mem_pool()
        .returning(|_| Ok(DEFAULT));
    d.expect_mem_pool_create().never();
    let e = SharedPool::install(Arc::new(d), 0).unwrap_err();
    assert!(
        matches!(e, PoolError::CurrentPoolNotDefault { device: 0 }),
        "{e}"
    );
    assert!(e.to_string().contains("not its default pool"));
}

#[test]
fn install_twice_on_one_device_is_refused() {
    let mut seq = Sequence::new();
    let mut d = installing(&mut seq);
    // The second look at the device finds our pool current.
    d.expect_device_get_mem_pool().returning(|_| Ok(OURS));
    d.expect_device_get_default_mem_pool()
        .returning(|_| Ok(DEFAULT));
    let d = Arc::new(d);
    let _pool = SharedPool::install(Arc::clone(&d), 0).unwrap();
    let e = SharedPool::install(d, 0).unwrap_err();
    assert!(
        matches!(e, PoolError::AlreadyInstalled { device: 0 }),
        "{e}"
    );
}

#[test]
fn a_device_without_posix_fd_pools_is_refused() {
    let mut d = MockDriver::new();
    d.expect_device_info().returning(|_| Ok(info(false)));
    d.expect_mem_pool_create().never();
    let e = SharedPool::install(Arc::new(d), 0).unwrap_err();
    assert!(matches!(e, PoolError::Unsupported { .. }), "{e}");
}

#[test]
fn a_failed_export_puts_the_default_pool_back() {
    let mut d = MockDriver::new();
    d.expect_kind().return_const(DriverKind::Mock);
    d.expect_device_info().returning(|_| Ok(info(true)));
    d.expect_device_get_mem_pool().returning(|_| Ok(DEFAULT));
    d.expect_device_get_default_mem_pool()
        .returning(|_| Ok(DEFAULT));
    d.expect_mem_pool_create().returning(|_, _, _| Ok(OURS));
    d.expect_mem_pool_set_attribute().returning(|_, _| Ok(()));
    d.expect_device_set_mem_pool()
        .withf(|_, p| *p == OURS)
        .times(1)
        .returning(|_, _| Ok(()));
    d.expect_mem_pool_export_fd().returning(|_| {
        Err(DriverError::Call {
            call: "cuMemPoolExportToShareableHandle",
            code: CuCode::NOT_SUPPORTED,
        })
    });
    d.expect_device_set_mem_pool()
        .withf(|_, p| *p == DEFAULT)
        .times(1)
        .returning(|_, _| Ok(()));
    d.expect_mem_pool_destroy()
        .withf(|p| *p == OURS)
        .times(1)
        .returning(|_| Ok(()));
    let e = SharedPool::install(Arc::new(d), 0).unwrap_err();
    assert!(
        e.to_string().contains("cuMemPoolExportToShareableHandle"),
        "{e}"
    );
}

#[test]
fn attach_grants_read_write_when_the_import_lacks_it() {
    let mut d = MockDriver::new();
    d.expect_mem_pool_import_fd()
        .returning(|_| Ok(PoolHandle::mock(0x55)));
    // Dropped, the attached pool destroys its import.
    d.expect_mem_pool_destroy()
        .withf(|p| *p == PoolHandle::mock(0x55))
        .times(1)
        .returning(|_| Ok(()));
    d.expect_mem_pool_get_access()
        .returning(|_, _| Ok(Access::None));
    d.expect_mem_pool_get_attribute().returning(|_, _| Ok(0));
    d.expect_mem_pool_set_attribute()
        .withf(|p, a| {
            *p == PoolHandle::mock(0x55) && *a == PoolAttribute::ReleaseThreshold(u64::MAX)
        })
        .times(1)
        .returning(|_, _| Ok(()));
    d.expect_mem_pool_set_access()
        .withf(|p, dev, a| *p == PoolHandle::mock(0x55) && *dev == 0 && *a == Access::ReadWrite)
        .times(1)
        .returning(|_, _, _| Ok(()));
    let fd = some_fd();
    let a = AttachedPool::attach(&d, fd.as_fd(), 0).unwrap();
    assert_eq!(a.initial_access, Access::None);
}

#[test]
fn attach_leaves_read_write_access_alone() {
    let mut d = MockDriver::new();
    d.expect_mem_pool_import_fd()
        .returning(|_| Ok(PoolHandle::mock(0x55)));
    // Dropped, the attached pool destroys its import.
    d.expect_mem_pool_destroy()
        .withf(|p| *p == PoolHandle::mock(0x55))
        .times(1)
        .returning(|_| Ok(()));
    d.expect_mem_pool_get_access()
        .returning(|_, _| Ok(Access::ReadWrite));
    d.expect_mem_pool_get_attribute()
        .returning(|_, _| Ok(u64::MAX));
    d.expect_mem_pool_set_attribute().returning(|_, _| Ok(()));
    d.expect_mem_pool_set_access().never();
    let fd = some_fd();
    AttachedPool::attach(&d, fd.as_fd(), 0).unwrap();
}

#[test]
fn attach_tries_to_raise_the_imported_pools_release_threshold_and_says_if_it_could_not() {
    let mut d = MockDriver::new();
    d.expect_mem_pool_import_fd()
        .returning(|_| Ok(PoolHandle::mock(0x55)));
    // Dropped, the attached pool destroys its import.
    d.expect_mem_pool_destroy()
        .withf(|p| *p == PoolHandle::mock(0x55))
        .times(1)
        .returning(|_| Ok(()));
    d.expect_mem_pool_get_access()
        .returning(|_, _| Ok(Access::ReadWrite));
    d.expect_mem_pool_get_attribute().returning(|_, _| Ok(0));
    d.expect_mem_pool_set_attribute().returning(|_, _| {
        Err(DriverError::Call {
            call: "cuMemPoolSetAttribute",
            code: CuCode::NOT_SUPPORTED,
        })
    });
    let fd = some_fd();
    let a = AttachedPool::attach(&d, fd.as_fd(), 0).unwrap();
    assert!(!a.keeps_mappings);
    assert_eq!(a.initial_release_threshold, Some(0));
}

#[test]
fn stats_come_from_our_pool() {
    let mut seq = Sequence::new();
    let mut d = installing(&mut seq);
    d.expect_mem_pool_get_attribute()
        .withf(|p, _| *p == OURS)
        .returning(|_, c| {
            Ok(match c {
                PoolCounter::UsedCurrent => 1,
                PoolCounter::UsedHigh => 2,
                PoolCounter::ReservedCurrent => 3,
                PoolCounter::ReservedHigh => 4,
                _ => 0,
            })
        });
    let pool = SharedPool::install(Arc::new(d), 0).unwrap();
    let s = pool.stats().unwrap();
    assert_eq!(
        (
            s.used_current,
            s.used_high,
            s.reserved_current,
            s.reserved_high
        ),
        (1, 2, 3, 4)
    );
}

/// A pool whose driver exports the same 64 bytes for an address every time (`stable`), or
/// new bytes every time; the allocation at the address is the `alloc` counter's (bump it for a
/// new allocation of the same size there).
fn exporting_blobs(
    stable: bool,
    exports: usize,
) -> (SharedPool<MockDriver>, Arc<std::sync::atomic::AtomicU64>) {
    let mut seq = Sequence::new();
    let mut d = installing(&mut seq);
    let alloc = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let a = Arc::clone(&alloc);
    d.expect_pointer_get_buffer_id()
        .returning(move |_| Ok(a.load(std::sync::atomic::Ordering::Relaxed)));
    d.expect_pointer_get_mempool().returning(|_| Ok(OURS));
    let mut n = 0u8;
    d.expect_mem_pool_export_pointer()
        .times(exports)
        .returning(move |_| {
            n += 1;
            Ok(ExportBlob([if stable { 1 } else { n }; 64]))
        });
    d.expect_pointer_get_range()
        .returning(|p| Ok((DevicePtr(p.0 & !0xfff), 1 << 30)));
    (SharedPool::install(Arc::new(d), 0).unwrap(), alloc)
}

/// What torch sharing does without a worker: export under a trial, then prove by identity.
fn export_by_identity(pool: &SharedPool<MockDriver>, base: DevicePtr) -> ExportBlob {
    let check = pool.begin_export_reuse_check();
    if let Some(c) = &check {
        c.trial(base, 1 << 30);
    }
    let blob = pool.export(base).unwrap();
    match check {
        Some(c) if c.trial_used() => c.finish_by_identity(base, &blob).unwrap(),
        _ => blob,
    }
}

fn recycle(alloc: &std::sync::atomic::AtomicU64) {
    alloc.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

#[test]
fn identical_blobs_of_a_recycled_address_prove_reuse_without_a_worker() {
    // Exports: the first, the check's fresh one, the one after the check (its entry went
    // with it); then none: a recycled address reuses its blob.
    let (pool, alloc) = exporting_blobs(true, 3);
    let base = DevicePtr(0x1000);
    let first = export_by_identity(&pool, base);
    assert_eq!(
        export_by_identity(&pool, base),
        first,
        "the same allocation: a hit"
    );
    assert_eq!(
        pool.export_reuse().0,
        ExportReuse::Unchecked,
        "nothing recycled yet"
    );
    recycle(&alloc);
    assert_eq!(export_by_identity(&pool, base), first);
    assert_eq!(pool.export_reuse(), (ExportReuse::Proven, None));
    for _ in 0..3 {
        recycle(&alloc);
        assert_eq!(export_by_identity(&pool, base), first);
    }
    // The trial's, then two of the three (the first after the check is exported).
    assert_eq!(pool.export_cache_stats().reused, 3);
}

#[test]
fn different_blobs_of_a_recycled_address_refute_reuse_and_the_fresh_blob_is_lent() {
    let (pool, alloc) = exporting_blobs(false, 3);
    let base = DevicePtr(0x1000);
    let first = export_by_identity(&pool, base);
    recycle(&alloc);
    let second = export_by_identity(&pool, base);
    assert_ne!(second, first, "the stale blob must never be lent");
    assert_eq!(pool.export_reuse().0, ExportReuse::NotProven);
    // From now on every new allocation is exported.
    recycle(&alloc);
    let third = export_by_identity(&pool, base);
    assert_ne!(third, second);
    assert_eq!(pool.export_cache_stats().reused, 1, "the trial's only");
}
