//! The export cache's invariant, over random sequences of alloc / free / export on SimDriver:
//! every blob [`SharedPool::export`] returns is the export of the allocation at that address
//! *now*, and a cached entry is never served for an address the pool handed out again.
//!
//! Few distinct sizes make the pool recycle addresses. Frees go either through the pool
//! (which tells the cache) or straight to the driver, as torch's `cudaFreeAsync` does (which
//! does not): only the buffer id can catch the second kind. The checker is itself checked: with
//! the cache's mutation switch on (serve an entry whatever its buffer id) it must fail.
//!
//! Export reuse (a recycled address of the same size served with the cached blob) is run in
//! every state of the startup check: proven, it must reuse wherever the cache holds a blob of
//! that address and size, and never for another size (the sim's blob names the range, so a
//! wrong size shows as a blob that is not the fresh export); not proven, never. Its checkers
//! are checked too: reuse whatever the size must fail, and so must reuse on a simulated
//! driver whose blobs name the allocation (`SimConfig::blob_per_allocation`).

use std::collections::HashMap;
use std::sync::Arc;

use poolipc_driver::sim::{SimConfig, SimDriver};
use poolipc_driver::{DevicePtr, Driver, StreamHandle};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::Served;
use crate::{ExportReuse, SharedPool};

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
    /// The allocation's size, as the driver reports it.
    size: u64,
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
    reused: u64,
}

/// How a run is set up: the check's verdict, the simulated driver, the mutation switches.
#[derive(Clone, Copy, Debug)]
struct Setup {
    /// What the startup check found (the cache is told so; the checker expects it).
    reuse: ExportReuse,
    /// The simulated driver's blobs name the allocation: old blobs do not reach new ones.
    blob_per_allocation: bool,
    skip_id_check: bool,
    skip_size_check: bool,
}

const PLAIN: Setup = Setup {
    reuse: ExportReuse::Unchecked,
    blob_per_allocation: false,
    skip_id_check: false,
    skip_size_check: false,
};

/// Runs `ops` against a fresh simulated machine; `Err` names the first broken step.
fn check(ops: &[Op], capacity: usize, setup: Setup) -> Result<Seen, String> {
    let d = Arc::new(
        SimDriver::new(SimConfig {
            blob_per_allocation: setup.blob_per_allocation,
            ..SimConfig::default()
        })
        .map_err(|e| e.to_string())?,
    );
    d.use_device(0).map_err(|e| e.to_string())?;
    let pool = SharedPool::install(Arc::clone(&d), 0).map_err(|e| e.to_string())?;
    pool.set_export_cache_capacity(capacity);
    pool.export_cache().set_skip_id_check(setup.skip_id_check);
    pool.export_cache()
        .set_skip_size_check(setup.skip_size_check);
    pool.export_cache().set_reuse(setup.reuse);
    let proven = setup.reuse == ExportReuse::Proven;
    let mut live: Vec<Live> = Vec::new();
    let mut exported_at: Vec<DevicePtr> = Vec::new();
    // The size of the last export at each address that the cache still holds (as the
    // model sees it): what a reuse there must match.
    let mut cached_size: HashMap<DevicePtr, u64> = HashMap::new();
    let mut seen = Seen::default();
    for (step, &op) in ops.iter().enumerate() {
        let at = |e: &dyn std::fmt::Display| format!("step {step} ({op:?}): {e}");
        match op {
            Op::Alloc(s) => {
                let ptr = pool.alloc(SIZES[s % SIZES.len()], S).map_err(|e| at(&e))?;
                let buffer_id = d.pointer_get_buffer_id(ptr).map_err(|e| at(&e))?;
                let (_, size) = d.pointer_get_range(ptr).map_err(|e| at(&e))?;
                live.push(Live {
                    ptr,
                    size,
                    buffer_id,
                    exported: false,
                });
            }
            Op::FreeByDriver(i) | Op::FreeByPool(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                if matches!(op, Op::FreeByDriver(_)) {
                    // As torch frees: through the driver, not the pool.
                    poolipc_driver::PoolAllocation::claim(&*d, l.ptr)
                        .and_then(|a| a.free(S))
                        .map_err(|e| at(&e))?;
                } else {
                    pool.free(l.ptr, S).map_err(|e| at(&e))?;
                    if !proven {
                        cached_size.remove(&l.ptr);
                    }
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
                    Served::Reused { buffer_id } => {
                        seen.reused += 1;
                        if !proven {
                            return Err(at(&format!(
                                "reused a blob at {:?} although reuse is {:?}",
                                l.ptr, setup.reuse
                            )));
                        }
                        if buffer_id != l.buffer_id {
                            return Err(at(&format!(
                                "reused for buffer {buffer_id}, the allocation is buffer {}",
                                l.buffer_id
                            )));
                        }
                        if cached_size.get(&l.ptr) != Some(&l.size) {
                            return Err(at(&format!(
                                "reused the blob of a {:?}-byte allocation for one of {} at {:?}",
                                cached_size.get(&l.ptr),
                                l.size,
                                l.ptr
                            )));
                        }
                    }
                    Served::Exported => {
                        let evicted = pool.export_cache_stats().evictions > 0;
                        if l.exported && capacity > 0 && !evicted {
                            return Err(at(&"exported again although the cache held it"));
                        }
                        if proven
                            && capacity > 0
                            && !evicted
                            && cached_size.get(&l.ptr) == Some(&l.size)
                        {
                            return Err(at(&format!(
                                "exported again although the cache held a blob of the same \
                                 size at {:?} and reuse is proven",
                                l.ptr
                            )));
                        }
                    }
                }
                if capacity > 0 {
                    cached_size.insert(l.ptr, l.size);
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

fn property(ops: &[Op], capacity: usize, setup: Setup) -> Result<(), TestCaseError> {
    check(ops, capacity, setup)
        .map(drop)
        .map_err(TestCaseError::fail)
}

fn verdict() -> impl Strategy<Value = ExportReuse> {
    prop_oneof![
        Just(ExportReuse::Unchecked),
        Just(ExportReuse::NotProven),
        Just(ExportReuse::Proven),
    ]
}

proptest! {
    #![proptest_config(Config::with_cases(64))]

    #[test]
    fn every_export_is_the_current_allocations_and_no_entry_outlives_its_allocation(
        ops in vec(op(), 1..60),
        capacity in capacity(),
        reuse in verdict(),
    ) {
        property(&ops, capacity, Setup { reuse, ..PLAIN })?;
    }

    #[test]
    fn unproven_reuse_never_happens_so_a_driver_whose_blobs_name_the_allocation_gets_fresh_exports(
        ops in vec(op(), 1..60),
        capacity in capacity(),
    ) {
        let setup = Setup {
            reuse: ExportReuse::NotProven,
            blob_per_allocation: true,
            ..PLAIN
        };
        property(&ops, capacity, setup)?;
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

/// Export, free behind the cache's back, allocate another size there (the same address),
/// export.
const RESIZES: [Op; 5] = [
    Op::Alloc(1),
    Op::Export(0),
    Op::FreeByDriver(0),
    Op::Alloc(0),
    Op::Export(0),
];

const PROVEN: Setup = Setup {
    reuse: ExportReuse::Proven,
    ..PLAIN
};

#[test]
fn the_checker_passes_a_recycling_sequence_with_the_id_check() {
    let seen = check(&RECYCLES, 16, PLAIN).unwrap();
    assert_eq!(
        seen.recycled_exports, 1,
        "the pool should have recycled the address"
    );
    assert_eq!(seen.reused, 0, "reuse unchecked");
}

#[test]
fn once_proven_a_recycled_address_of_the_same_size_reuses_its_blob() {
    let seen = check(&RECYCLES, 16, PROVEN).unwrap();
    assert_eq!((seen.reused, seen.recycled_exports), (1, 1));
}

#[test]
fn proven_or_not_a_recycled_address_of_another_size_is_exported_again() {
    let seen = check(&RESIZES, 16, PROVEN).unwrap();
    assert_eq!(
        (seen.reused, seen.recycled_exports),
        (0, 1),
        "the pool should have recycled the address for the smaller size"
    );
}

#[test]
fn the_checker_catches_a_cache_that_skips_the_id_check() {
    let e = check(
        &RECYCLES,
        16,
        Setup {
            skip_id_check: true,
            ..PLAIN
        },
    )
    .unwrap_err();
    assert!(e.starts_with("step 4 "), "{e}");
}

#[test]
fn the_checker_catches_a_reuse_of_another_sizes_blob() {
    let e = check(
        &RESIZES,
        16,
        Setup {
            skip_size_check: true,
            ..PROVEN
        },
    )
    .unwrap_err();
    assert!(e.starts_with("step 4 "), "{e}");
}

#[test]
fn the_checker_catches_reuse_on_a_driver_whose_blobs_name_the_allocation() {
    let e = check(
        &RECYCLES,
        16,
        Setup {
            blob_per_allocation: true,
            ..PROVEN
        },
    )
    .unwrap_err();
    assert!(e.starts_with("step 4 "), "{e}");
}

/// Whether 64 random sequences (deterministic) pass under `setup`.
fn mutant_survives(setup: Setup) -> bool {
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
    runner
        .run(&(vec(op(), 1..60), Just(16usize)), |(ops, capacity)| {
            property(&ops, capacity, setup)
        })
        .is_ok()
}

#[test]
fn the_property_fails_when_the_cache_skips_the_id_check() {
    assert!(
        !mutant_survives(Setup {
            skip_id_check: true,
            ..PLAIN
        }),
        "the mutant passed 64 random sequences"
    );
}

#[test]
fn the_property_fails_when_the_cache_reuses_a_blob_whatever_the_size() {
    assert!(
        !mutant_survives(Setup {
            skip_size_check: true,
            ..PROVEN
        }),
        "the mutant passed 64 random sequences"
    );
}

#[test]
fn the_property_fails_when_reuse_is_assumed_on_a_driver_whose_blobs_name_the_allocation() {
    assert!(
        !mutant_survives(Setup {
            blob_per_allocation: true,
            ..PROVEN
        }),
        "the mutant passed 64 random sequences"
    );
}
