//! The export cache's invariant, over random sequences of alloc / free / export on SimDriver:
//! every blob [`SharedPool::export`] returns is the export of the allocation at that address
//! *now*, and a cached entry is never served for an address the pool handed out again.
//!
//! Few distinct sizes make the pool recycle addresses. Frees go either through the pool
//! (which tells the cache) or straight to the driver, as torch's `cudaFreeAsync` does (which
//! does not): only the buffer id can catch the second kind. The checker is itself checked: with
//! the cache's mutation switch on (serve an entry whatever its buffer id) it must fail.

use std::sync::Arc;

use poolipc_driver::sim::{SimConfig, SimDriver};
use poolipc_driver::{DevicePtr, Driver, StreamHandle};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::SharedPool;
use crate::shared::Served;

const MIB: u64 = 1 << 20;
const SIZES: [u64; 3] = [MIB, 2 * MIB, 5 * MIB];
const S: StreamHandle = StreamHandle::NULL;

#[derive(Clone, Copy, Debug)]
enum Op {
    /// Allocate `SIZES[i]`.
    Alloc(usize),
    /// Free live allocation `i` (modulo) through the driver: the cache is not told.
    FreeByDriver(usize),
    /// Free live allocation `i` (modulo) through the pool.
    FreeByPool(usize),
    /// Export live allocation `i` (modulo): what the facade does to lend it.
    Export(usize),
}

/// The model of one live allocation.
#[derive(Debug)]
struct Live {
    ptr: DevicePtr,
    /// Read from the driver right after the allocation.
    buffer_id: u64,
    /// Exported since it was allocated.
    exported: bool,
}

/// What a passing run saw.
#[derive(Debug, Default)]
struct Seen {
    /// Exports of an address an earlier, exported allocation had.
    recycled_exports: u32,
    hits: u64,
}

/// Runs `ops` against a fresh simulated machine; `Err` names the first broken step.
fn check(ops: &[Op], capacity: usize, skip_id_check: bool) -> Result<Seen, String> {
    let d = Arc::new(SimDriver::new(SimConfig::default()).map_err(|e| e.to_string())?);
    d.use_device(0).map_err(|e| e.to_string())?;
    let pool = SharedPool::install(Arc::clone(&d), 0).map_err(|e| e.to_string())?;
    pool.set_export_cache_capacity(capacity);
    pool.export_cache().set_skip_id_check(skip_id_check);
    let mut live: Vec<Live> = Vec::new();
    let mut exported_at: Vec<DevicePtr> = Vec::new();
    let mut seen = Seen::default();
    for (step, &op) in ops.iter().enumerate() {
        let at = |e: &dyn std::fmt::Display| format!("step {step} ({op:?}): {e}");
        match op {
            Op::Alloc(s) => {
                let ptr = pool.alloc(SIZES[s % SIZES.len()], S).map_err(|e| at(&e))?;
                let buffer_id = d.pointer_get_buffer_id(ptr).map_err(|e| at(&e))?;
                live.push(Live {
                    ptr,
                    buffer_id,
                    exported: false,
                });
            }
            Op::FreeByDriver(i) | Op::FreeByPool(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                if matches!(op, Op::FreeByDriver(_)) {
                    d.mem_free_async(l.ptr, S).map_err(|e| at(&e))?;
                } else {
                    pool.free(l.ptr, S).map_err(|e| at(&e))?;
                }
            }
            Op::Export(i) if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                let (blob, served) = pool.export_traced(l.ptr).map_err(|e| at(&e))?;
                let fresh = d.mem_pool_export_pointer(l.ptr).map_err(|e| at(&e))?;
                if blob != fresh {
                    return Err(at(&format!(
                        "returned {blob:?}; the allocation at {:?} now exports as {fresh:?}",
                        l.ptr
                    )));
                }
                match served {
                    Served::Cached { buffer_id } => {
                        seen.hits += 1;
                        if buffer_id != l.buffer_id {
                            return Err(at(&format!(
                                "served the entry of buffer {buffer_id} for buffer {} at {:?}: \
                                 an earlier allocation's export",
                                l.buffer_id, l.ptr
                            )));
                        }
                        if !l.exported {
                            return Err(at(&"served from the cache before any export"));
                        }
                    }
                    Served::Exported => {
                        let evicted = pool.export_cache_stats().evictions > 0;
                        if l.exported && capacity > 0 && !evicted {
                            return Err(at(&"exported again although the cache held it"));
                        }
                    }
                }
                if !l.exported && exported_at.contains(&l.ptr) {
                    seen.recycled_exports += 1;
                }
                l.exported = true;
                exported_at.push(l.ptr);
            }
            _ => {}
        }
        let s = pool.export_cache_stats();
        if s.entries > capacity {
            return Err(at(&format!(
                "{} entries over a capacity of {capacity}",
                s.entries
            )));
        }
    }
    if seen.hits != pool.export_cache_stats().hits {
        return Err(format!(
            "the stats count {} hits, the run saw {}",
            pool.export_cache_stats().hits,
            seen.hits
        ));
    }
    Ok(seen)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..SIZES.len()).prop_map(Op::Alloc),
        1 => (0..8usize).prop_map(Op::FreeByDriver),
        1 => (0..8usize).prop_map(Op::FreeByPool),
        4 => (0..8usize).prop_map(Op::Export),
    ]
}

fn capacity() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        1..4usize,
        Just(crate::DEFAULT_EXPORT_CACHE_ENTRIES)
    ]
}

fn property(ops: &[Op], capacity: usize, skip_id_check: bool) -> Result<(), TestCaseError> {
    check(ops, capacity, skip_id_check)
        .map(drop)
        .map_err(TestCaseError::fail)
}

proptest! {
    #![proptest_config(Config::with_cases(64))]

    #[test]
    fn every_export_is_the_current_allocations_and_no_entry_outlives_its_allocation(
        ops in vec(op(), 1..60),
        capacity in capacity(),
    ) {
        property(&ops, capacity, false)?;
    }
}

/// Export, free behind the cache's back, allocate the same size (the same address), export.
const RECYCLES: [Op; 5] = [
    Op::Alloc(0),
    Op::Export(0),
    Op::FreeByDriver(0),
    Op::Alloc(0),
    Op::Export(0),
];

#[test]
fn the_checker_passes_a_recycling_sequence_with_the_id_check() {
    let seen = check(&RECYCLES, 16, false).unwrap();
    assert_eq!(
        seen.recycled_exports, 1,
        "the pool should have recycled the address"
    );
}

#[test]
fn the_checker_catches_a_cache_that_skips_the_id_check() {
    let e = check(&RECYCLES, 16, true).unwrap_err();
    assert!(e.starts_with("step 4 "), "{e}");
}

#[test]
fn the_property_fails_when_the_cache_skips_the_id_check() {
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: 64,
            failure_persistence: None,
            ..Config::default()
        },
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    let r = runner.run(&(vec(op(), 1..60), Just(16usize)), |(ops, capacity)| {
        property(&ops, capacity, true)
    });
    assert!(r.is_err(), "the mutant passed 64 random sequences");
}
