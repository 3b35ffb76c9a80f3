//! Rotation by generations, on SimDriver.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

use poolipc_driver::sim::{SimConfig, SimDriver};
use poolipc_driver::{Driver, PoolCounter, PoolHandle, StreamHandle};

use super::{PoolError, SharedPool};

const MIB: u64 = 1 << 20;
const S: StreamHandle = StreamHandle::NULL;

fn installed_sim() -> SharedPool<SimDriver> {
    let d = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
    d.use_device(0).unwrap();
    SharedPool::install(d, 0).unwrap()
}

fn held(pool: &SharedPool<SimDriver>) -> u64 {
    let (free, total) = pool.driver().mem_get_info().unwrap();
    total - free
}

#[test]
fn a_pool_that_exported_nothing_does_not_rotate() {
    let pool = installed_sim();
    let p = pool.alloc(4 * MIB, S).unwrap();
    pool.free(p, S).unwrap();
    assert_eq!(pool.rotate().unwrap(), None);
    assert_eq!(pool.handles().len(), 1);
}

#[test]
fn a_rotation_makes_a_new_current_pool_and_keeps_the_old_one_for_its_live_allocations() {
    let pool = installed_sim();
    let old = pool.handle();
    let live = pool.alloc(4 * MIB, S).unwrap();
    pool.export(live).unwrap();
    let r = pool.rotate().unwrap().expect("exported: rotates");
    assert_eq!(r.retired, old);
    assert_eq!(pool.handle(), r.current);
    assert_eq!(
        pool.driver().device_get_mem_pool(0).unwrap(),
        r.current,
        "the new generation is the device's current pool"
    );
    for attr in [
        PoolCounter::ReleaseThreshold,
        PoolCounter::ReuseAllowOpportunistic,
    ] {
        assert_eq!(
            pool.driver()
                .mem_pool_get_attribute(r.current, attr)
                .unwrap(),
            pool.driver().mem_pool_get_attribute(old, attr).unwrap()
        );
    }
    // New allocations come from the new generation; the old one's pointer is still ours.
    let fresh = pool.driver().mem_alloc_async(2 * MIB, S).unwrap();
    assert_eq!(pool.driver().pointer_get_mempool(fresh).unwrap(), r.current);
    assert!(pool.owns(live).unwrap() && pool.owns(fresh).unwrap());
    pool.export(live).unwrap();
    pool.export(fresh).unwrap();
    assert_eq!(pool.stats().unwrap().used_current, 6 * MIB);
    // In use: not destroyed.
    assert_eq!(pool.idle_retired().unwrap(), Vec::<PoolHandle>::new());
    assert!(matches!(
        pool.destroy_retired(old),
        Err(PoolError::InUse { .. })
    ));
    pool.free(live, S).unwrap();
    pool.driver().ctx_synchronize().unwrap();
    assert_eq!(pool.idle_retired().unwrap(), vec![old]);
    pool.destroy_retired(old).unwrap();
    assert_eq!(pool.handles(), vec![r.current]);
    assert!(matches!(
        pool.destroy_retired(r.current),
        Err(PoolError::NotRetired { .. })
    ));
    pool.free(fresh, S).unwrap();
}

#[test]
fn the_current_generation_rotates_only_for_its_own_exports() {
    let pool = installed_sim();
    let old_live = pool.alloc(4 * MIB, S).unwrap();
    pool.export(old_live).unwrap();
    pool.rotate().unwrap().unwrap();
    // Exporting the retired generation's allocation again: the new one exported nothing.
    pool.export(old_live).unwrap();
    assert!(!pool.current_exported());
    assert_eq!(pool.rotate().unwrap(), None);
    pool.free(old_live, S).unwrap();
}

#[test]
fn destroying_the_retired_generation_gives_exported_freed_memory_back() {
    let pool = installed_sim();
    let start = held(&pool);
    let p = pool.alloc(64 * MIB, S).unwrap();
    pool.export(p).unwrap();
    pool.free(p, S).unwrap();
    pool.trim().unwrap();
    assert_eq!(held(&pool), start + 64 * MIB, "trim does not give it back");
    let r = pool.rotate().unwrap().unwrap();
    pool.trim().unwrap();
    assert_eq!(pool.idle_retired().unwrap(), vec![r.retired]);
    pool.destroy_retired(r.retired).unwrap();
    assert_eq!(held(&pool), start);
}

#[test]
fn a_rotation_refuses_when_something_else_made_its_pool_current() {
    let pool = installed_sim();
    let p = pool.alloc(4 * MIB, S).unwrap();
    pool.export(p).unwrap();
    let default = pool.driver().device_get_default_mem_pool(0).unwrap();
    pool.driver().device_set_mem_pool(0, default).unwrap();
    let e = pool.rotate().unwrap_err();
    assert!(matches!(e, PoolError::CurrentPoolChanged { .. }), "{e}");
    assert_eq!(pool.handles().len(), 1);
    pool.free(p, S).unwrap();
}

#[test]
fn the_export_cache_serves_no_blob_across_a_rotation() {
    let pool = installed_sim();
    let p = pool.alloc(4 * MIB, S).unwrap();
    pool.export(p).unwrap();
    assert_eq!(pool.export_cache_stats().entries, 1);
    pool.rotate().unwrap().unwrap();
    assert_eq!(pool.export_cache_stats().entries, 0);
    pool.free(p, S).unwrap();
}

#[test]
fn each_generation_has_its_own_fd() {
    let pool = installed_sim();
    let first = pool.fd();
    let p = pool.alloc(4 * MIB, S).unwrap();
    pool.export(p).unwrap();
    let r = pool.rotate().unwrap().unwrap();
    let second = pool.fd();
    assert_ne!(ino(first.as_fd()), ino(second.as_fd()));
    assert!(pool.fd_of(r.retired).is_some());
    pool.free(p, S).unwrap();
}

fn ino(fd: BorrowedFd<'_>) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::File::from(fd.try_clone_to_owned().unwrap())
        .metadata()
        .unwrap()
        .ino()
}
