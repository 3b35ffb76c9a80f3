//! Export reuse end to end: once the canary battery proved that an old blob reaches the new
//! allocation at its address, a recycled address of the same size is lent without a new
//! `cuMemPoolExportPointer`, and the worker still reads the new bytes and writes into them.
//! On a (simulated) driver where old blobs do not reach new allocations, the check fails, the
//! worker keeps its rung, and every recycled allocation is exported again, still correct.

use std::sync::Arc;

use anyhow::{Result, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::sim::SimConfig;
use poolipc::advanced::driver::{DevicePtr, StreamHandle};
use poolipc::advanced::pool::ExportCacheStats;
use poolipc::{DType, ExportReuse, Input, Layout, Parent, ParentOptions, Rung};
use poolipc_tests::echo;
use poolipc_tests::{Env, both_drivers, worker_command};

const MIB: u64 = 1 << 20;
/// Several 32 MiB chunks, as the sizes measured on the H200 (64 MiB, 1 GiB, 4 GiB).
const BYTES: u64 = 96 * MIB;

/// Results in the arena, so that the only pool exports are the lent inputs'.
fn parent(env: &Env) -> Result<Parent> {
    let options = ParentOptions {
        device: env.device,
        results: poolipc::ResultMemory::Arena {
            initial_bytes: 256 * MIB,
            max_bytes: None,
        },
        ..ParentOptions::default()
    };
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

/// `cuMemPoolExportPointer` calls the cache made (every lend that was not a hit or a reuse).
fn exports(s: &ExportCacheStats) -> u64 {
    s.misses + s.stale + s.uncached
}

/// Frees `ptr` as torch does (`cudaFreeAsync`, the cache not told), then allocates `BYTES`
/// until the pool hands `ptr`'s address back (each miss held, then freed).
fn recycle(p: &Parent, ptr: DevicePtr, stream: StreamHandle) -> Result<DevicePtr> {
    let d = p.driver();
    poolipc::advanced::driver::PoolAllocation::claim(&**d, ptr)?.free(stream)?;
    let mut misses = Vec::new();
    let mut found = None;
    for _ in 0..8 {
        let q = p.pool().alloc(BYTES, stream)?;
        if q == ptr {
            found = Some(q);
            break;
        }
        misses.push(q);
    }
    for q in misses {
        p.pool().free(q, stream)?;
    }
    d.stream_synchronize(stream)?;
    found.ok_or_else(|| anyhow::anyhow!("the pool never handed {ptr:?} back"))
}

fn input(ptr: DevicePtr) -> Input {
    Input {
        ptr,
        desc: Layout::contiguous(DType::U8, &[BYTES]),
        read_only: false,
    }
}

/// Lends `ptr` (filled with `pattern`) to the echo worker `w`; its result must be the
/// pattern: the worker read these bytes.
fn lend_and_echo(
    p: &Parent,
    w: poolipc::WorkerId,
    ptr: DevicePtr,
    pattern: u32,
    stream: StreamHandle,
) -> Result<()> {
    let d = Arc::clone(p.driver());
    echo::fill_pattern(&*d, ptr, BYTES, pattern, stream)?;
    let out = p.run_job(w, &[input(ptr)], stream)?;
    ensure!(
        out.input_rungs == [Rung::PoolPointer],
        "{:?}",
        out.input_rungs
    );
    d.stream_synchronize(stream)?;
    let r = &out.results[0];
    let check = echo::verify_echo(&*d, r.ptr, r.bytes, 0, pattern, 0);
    if !r.is_arena() {
        p.pool().free(r.ptr, stream)?;
    }
    check.map_err(|why| anyhow::anyhow!("the worker's echo of pattern {pattern:#x}: {why}"))
}

/// Lends `ptr` to the writing worker `w` (it sets the first 4 KiB to its marker); the
/// parent must see the write.
fn lend_for_write(
    p: &Parent,
    w: poolipc::WorkerId,
    ptr: DevicePtr,
    stream: StreamHandle,
) -> Result<()> {
    let d = Arc::clone(p.driver());
    echo::fill_pattern(&*d, ptr, BYTES, 0x5555_5555, stream)?;
    let out = p.run_job(w, &[input(ptr)], stream)?;
    ensure!(
        out.input_rungs == [Rung::PoolPointer],
        "{:?}",
        out.input_rungs
    );
    d.stream_synchronize(stream)?;
    let mut word = [0u8; 8];
    d.memcpy_dtoh(&mut word, ptr)?;
    let want = echo::marker(0).to_le_bytes();
    ensure!(
        word[..4] == want && word[4..] == want,
        "the worker's write in place did not reach the parent: {word:02x?}"
    );
    Ok(())
}

/// Allocates, lends, recycles the address twice (once to the echo worker, once to the
/// writing worker) and checks every byte; returns the export cache's stats before the
/// recycling and after.
fn recycled_lends(env: &Env, p: &Parent) -> Result<(ExportCacheStats, ExportCacheStats)> {
    let d = Arc::clone(p.driver());
    let owned_stream = poolipc::advanced::driver::OwnedStream::new(Arc::clone(&d))?;
    let stream = owned_stream.handle();
    let reader = p.spawn_worker(worker_command(env, None)?)?;
    let mut cmd = worker_command(env, None)?;
    cmd.env("POOLIPC_TEST_WRITE_INPUTS", "1");
    let writer = p.spawn_worker(cmd)?;
    for w in [reader, writer] {
        let report = p.canary_report(w);
        ensure!(
            report.as_ref().is_some_and(poolipc::CanaryReport::ok),
            "{w}: {report:?}"
        );
    }
    // The canaries left freed memory in the pool, which the pool may prefer for the next
    // allocation of this size: give it back first, so that the address freed next is the
    // one the pool hands out again.
    p.pool().trim()?;
    let a = p.pool().alloc(BYTES, stream)?;
    d.stream_synchronize(stream)?;
    lend_and_echo(p, reader, a, 0x1111_1111, stream)?;
    let before = p.pool().export_cache_stats();
    let b = recycle(p, a, stream)?;
    lend_and_echo(p, reader, b, 0x2222_2222, stream)?;
    let c = recycle(p, b, stream)?;
    lend_for_write(p, writer, c, stream)?;
    let after = p.pool().export_cache_stats();
    p.pool().free(c, stream)?;
    d.stream_synchronize(stream)?;
    p.stop_worker(reader)?;
    p.stop_worker(writer)?;
    owned_stream.close()?;
    Ok((before, after))
}

both_drivers!(
    /// The canary battery proves reuse on this driver (the simulation behaves as driver 580);
    /// two recycled lends then cost no export, and the bytes are right both ways.
    fn a_recycled_address_of_the_same_size_is_lent_without_a_new_export(env) {
        let p = parent(env)?;
        let (before, after) = recycled_lends(env, &p)?;
        let (verdict, why) = p.pool().export_reuse();
        ensure!(verdict == ExportReuse::Proven, "export reuse {verdict}: {why:?}");
        ensure!(p.stats().export_reuse == ExportReuse::Proven, "{:?}", p.stats());
        ensure!(
            exports(&after) == exports(&before),
            "recycled lends exported again: {before} -> {after}"
        );
        ensure!(after.reused == before.reused + 2, "{before} -> {after}");
        ensure!(after.reused_bytes - before.reused_bytes >= 2 * BYTES, "{after}");
        println!("{after}");
        Ok(())
    }
);

/// The simulated driver the other way: an old blob does not import once its address holds a
/// new allocation. The check must fail without costing the worker its rung, and every
/// recycled lend must be exported again, and still be right.
#[test]
fn where_old_blobs_do_not_reach_new_allocations_the_check_fails_and_every_allocation_is_exported() {
    poolipc_tests::init_tracing();
    let env = Env::sim_with(SimConfig {
        blob_per_allocation: true,
        ..SimConfig::default()
    })
    .expect("SimDriver");
    let p = parent(&env).expect("parent");
    let (before, after) = recycled_lends(&env, &p).expect("recycled lends");
    let (verdict, why) = p.pool().export_reuse();
    assert_eq!(verdict, ExportReuse::NotProven, "{why:?}");
    let why = why.expect("a reason");
    assert!(why.contains("old blob failed"), "{why}");
    assert_eq!(after.reused, before.reused, "{after}");
    assert_eq!(exports(&after), exports(&before) + 2, "{before} -> {after}");
    env.assert_no_violations();
}
