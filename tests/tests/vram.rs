//! VRAM goes back: the result arena gives chunks with nothing in them back to the
//! device, on `Parent::empty_cache` and after `arena_idle_release`, the workers unmap them
//! when told, and a chunk with a live block is never given back; the arena's default cap is
//! a fraction of the device.
//!
//! Free device memory is compared around each release (the released bytes must come back
//! within 64 MiB), not against the process's start: pool allocations that were exported to
//! a worker keep their memory after their free until the pool is destroyed (a driver fact,
//! docs/facts.md, "Other driver behaviour designed for"), and the echo jobs' inputs are such.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::OwnedStream;
use poolipc::advanced::types::ImportLimit;
use poolipc::{Parent, ParentOptions, ResultMemory, Rung, StreamHandle};
use poolipc_tests::echo_jobs::{bytes_input, check_exact, echo_job, filled, settle};
use poolipc_tests::{Env, both_drivers, worker_command};

const MIB: u64 = 1 << 20;
/// What a release may fall short of the released bytes (the bound).
const SLACK: u64 = 64 * MIB;

fn parent(env: &Env, tweak: impl FnOnce(&mut ParentOptions)) -> Result<Parent> {
    let mut options = ParentOptions {
        device: env.device,
        canary: false,
        results: ResultMemory::Arena {
            initial_bytes: 256 * MIB,
            max_bytes: None,
        },
        arena_idle_release: None,
        ..ParentOptions::default()
    };
    tweak(&mut options);
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

fn free_vram(p: &Parent) -> Result<u64> {
    p.driver().ctx_synchronize()?;
    Ok(p.driver().mem_get_info()?.0)
}

fn results_job(
    p: &Parent,
    w: poolipc::WorkerId,
    bytes: u64,
    stream: StreamHandle,
) -> Result<poolipc::JobOutput> {
    let out = echo_job(p, w, &[bytes], 0x2323_0101, stream)?;
    ensure!(
        out.results[0].rung == Rung::Arena,
        "{:?}",
        out.results[0].rung
    );
    check_exact(p, &out, 0, bytes, 0x2323_0101)?;
    Ok(out)
}

both_drivers!(
    fn empty_cache_gives_idle_arena_chunks_back_and_every_worker_unmaps_them(env) {
        let p = parent(env, |_| {})?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let a = p.spawn_worker(worker_command(env, None)?)?;
        let b = p.spawn_worker(worker_command(env, None)?)?;
        let bytes = 256 * MIB;
        // Both workers map the chunk; one of them wrote a result into it.
        let out = results_job(&p, a, bytes, stream)?;
        drop(results_job(&p, b, MIB, stream)?);
        drop(out);
        ensure!(settle(&p, stream)? == 0, "blocks left");
        let stats = p.arena_stats().context("no arena")?;
        let capacity = stats.alloc.capacity;
        ensure!(capacity >= bytes, "{stats:?}");
        let before = free_vram(&p)?;
        let t = Instant::now();
        let report = p.empty_cache()?;
        println!("empty_cache: {report:?} in {:?}", t.elapsed());
        ensure!(report.arena_bytes == capacity, "{report:?} of {capacity}");
        ensure!(report.workers_not_answered == 0, "{report:?}");
        let after = free_vram(&p)?;
        println!(
            "free VRAM {:.3} -> {:.3} GiB ({} MiB released)",
            before as f64 / f64::from(1u32 << 30),
            after as f64 / f64::from(1u32 << 30),
            capacity / MIB
        );
        ensure!(
            after + SLACK >= before + capacity,
            "only {} of {} MiB came back",
            after.saturating_sub(before) / MIB,
            capacity / MIB
        );
        let stats = p.arena_stats().context("no arena")?;
        ensure!(stats.alloc.capacity == 0 && stats.released_bytes == capacity, "{stats:?}");
        // The arena grows again, under a new chunk index both workers map.
        for w in [a, b] {
            drop(results_job(&p, w, 2 * MIB, stream)?);
        }
        ensure!(settle(&p, stream)? == 0, "blocks left");
        p.stop_worker(a)?;
        p.stop_worker(b)?;
        Ok(())
    }
);

both_drivers!(
    fn a_chunk_with_a_live_result_is_not_given_back_and_its_bytes_stay(env) {
        let p = parent(env, |_| {})?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let out = results_job(&p, w, 64 * MIB, stream)?;
        let report = p.empty_cache()?;
        ensure!(report.arena_chunks == 0, "a chunk with a live result went: {report:?}");
        // Still the worker's bytes, and still writable by another job.
        check_exact(&p, &out, 0, 64 * MIB, 0x2323_0101)?;
        drop(results_job(&p, w, MIB, stream)?);
        drop(out);
        ensure!(settle(&p, stream)? == 0, "blocks left");
        let report = p.empty_cache()?;
        ensure!(report.arena_chunks >= 1 && report.workers_not_answered == 0, "{report:?}");
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn idle_arena_chunks_go_back_after_arena_idle_release(env) {
        let p = parent(env, |o| o.arena_idle_release = Some(Duration::from_millis(100)))?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        drop(results_job(&p, w, 128 * MIB, stream)?);
        ensure!(settle(&p, stream)? == 0, "blocks left");
        let capacity = p.arena_stats().context("no arena")?.alloc.capacity;
        let before = free_vram(&p)?;
        let t = Instant::now();
        while p.arena_stats().context("no arena")?.alloc.capacity > 0 {
            ensure!(t.elapsed() < Duration::from_secs(10), "the idle chunk stayed for 10 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        println!("idle chunk given back after {:?}", t.elapsed());
        // The worker unmaps it when its answer arrives; wait for the memory.
        let t = Instant::now();
        loop {
            let after = free_vram(&p)?;
            if after + SLACK >= before + capacity {
                break;
            }
            ensure!(
                t.elapsed() < Duration::from_secs(5),
                "only {} of {} MiB came back",
                after.saturating_sub(before) / MIB,
                capacity / MIB
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(results_job(&p, w, MIB, stream)?);
        ensure!(settle(&p, stream)? == 0, "blocks left");
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn an_arena_copied_input_gives_its_chunk_back_after_the_job(env) {
        // Pool results (the default), every input over the import limit: the input crosses
        // by arena copy, into an arena made for copies.
        let p = parent(env, |o| o.results = ResultMemory::Pool)?;
        let limit = p.limits().import;
        p.lower_import_limit(ImportLimit::new(limit.chunk_bytes(), 0).context("limit")?)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let bytes = 128 * MIB;
        let input = filled(&p, bytes, 0x0C0C_0C0C, stream)?;
        let out = p.submit(w, &[bytes_input(input, bytes)], stream)?.wait()?;
        ensure!(out.input_rungs == [Rung::ArenaCopy], "{:?}", out.input_rungs);
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.driver().stream_synchronize(stream)?;
        let capacity = p.arena_stats().context("no arena")?.alloc.capacity;
        let before = free_vram(&p)?;
        let report = p.empty_cache()?;
        ensure!(report.arena_bytes == capacity && report.workers_not_answered == 0, "{report:?}");
        let after = free_vram(&p)?;
        ensure!(
            after + SLACK >= before + capacity,
            "only {} of {} MiB came back",
            after.saturating_sub(before) / MIB,
            capacity / MIB
        );
        p.pool().free(input, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn the_arena_is_capped_at_a_fraction_of_the_device_by_default(env) {
        let p = parent(env, |o| o.arena_cap_fraction = 0.25)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        drop(results_job(&p, w, MIB, stream)?);
        let (_, total) = p.driver().mem_get_info()?;
        let stats = p.arena_stats().context("no arena")?;
        ensure!(stats.max_bytes == Some(total / 4), "{stats:?}, device {total}");
        ensure!(settle(&p, stream)? == 0, "blocks left");
        p.stop_worker(w)?;
        for bad in [0.0, -1.0, 1.5, f64::NAN] {
            let e = parent(env, |o| o.arena_cap_fraction = bad).err().context("accepted")?;
            ensure!(e.to_string().contains("arena_cap_fraction"), "{e}");
        }
        Ok(())
    }
);

// --- pool pointers: the pool is rotated and its retired generation destroyed --------------

/// A parent whose results go to the shared pool (by pool pointer, exported like the inputs).
fn pool_parent(env: &Env) -> Result<Parent> {
    parent(env, |o| o.results = ResultMemory::Pool)
}

/// Lends `input` (`bytes`) by pool pointer to `w`, checks the echo, frees the results.
fn lend_by_pointer(
    p: &Parent,
    w: poolipc::WorkerId,
    input: poolipc::DevicePtr,
    bytes: u64,
    pattern: u32,
    stream: StreamHandle,
) -> Result<()> {
    let out = p.submit(w, &[bytes_input(input, bytes)], stream)?.wait()?;
    ensure!(
        out.input_rungs == [Rung::PoolPointer],
        "{:?} {:?}",
        out.input_rungs,
        out.input_reasons
    );
    // The results are read on the host: after the stream's wait on the worker's DONE.
    p.driver().stream_synchronize(stream)?;
    check_exact(p, &out, 0, bytes, pattern)?;
    for r in out.results {
        ensure!(r.rung == Rung::PoolPointer, "result by {:?}", r.rung);
        p.pool().free(r.ptr, stream)?;
    }
    p.driver().stream_synchronize(stream)?;
    Ok(())
}

both_drivers!(
    fn a_tensor_lent_by_pool_pointer_and_freed_comes_back_at_empty_cache(env) {
        let p = pool_parent(env)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let before = free_vram(&p)?;
        let bytes = 256 * MIB;
        let input = filled(&p, bytes, 0x5151_0000, stream)?;
        lend_by_pointer(&p, w, input, bytes, 0x5151_0000, stream)?;
        p.pool().free(input, stream)?;
        let held = free_vram(&p)?;
        println!(
            "lent and freed: {} MiB still held",
            before.saturating_sub(held) / MIB
        );
        let t = Instant::now();
        let report = p.empty_cache()?;
        println!("empty_cache: {report:?} in {:?}", t.elapsed());
        ensure!(
            report.pools_rotated == 1 && report.pools_retired == 1,
            "{report:?}"
        );
        ensure!(report.workers_not_answered == 0, "{report:?}");
        let after = free_vram(&p)?;
        println!(
            "free VRAM before the lend {:.3}, after empty_cache {:.3} GiB",
            before as f64 / f64::from(1u32 << 30),
            after as f64 / f64::from(1u32 << 30)
        );
        if after + SLACK < before {
            // Whether it comes back a little later says whether the driver gives it back
            // lazily or something still holds it; the test fails either way.
            std::thread::sleep(Duration::from_secs(1));
            let later = free_vram(&p)?;
            let pid = p.worker(w).and_then(|i| i.pid);
            for (who, dir) in [("parent", "/proc/self/fd".to_string())]
                .into_iter()
                .chain(pid.map(|pid| ("worker", format!("/proc/{pid}/fd"))))
            {
                let mut links: Vec<String> = std::fs::read_dir(&dir)
                    .map(|d| {
                        d.filter_map(|e| e.ok())
                            .filter_map(|e| std::fs::read_link(e.path()).ok())
                            .map(|l| l.display().to_string())
                            .collect()
                    })
                    .unwrap_or_default();
                links.sort();
                println!("{who} descriptors: {links:?}");
            }
            bail!(
                "{} MiB short of before the lend right after empty_cache, {} MiB a second later",
                before.saturating_sub(after) / MIB,
                before.saturating_sub(later) / MIB
            );
        }
        // The worker keeps serving, from the new generation.
        let again = filled(&p, 4 * MIB, 0x5151_0001, stream)?;
        lend_by_pointer(&p, w, again, 4 * MIB, 0x5151_0001, stream)?;
        p.pool().free(again, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn a_retired_generation_with_a_live_tensor_stays_until_it_is_freed_and_still_lends(env) {
        let p = pool_parent(env)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        // Allocated before the rotation, lent only after it.
        let old = filled(&p, 8 * MIB, 0x5252_0000, stream)?;
        let lent = filled(&p, 4 * MIB, 0x5252_0001, stream)?;
        lend_by_pointer(&p, w, lent, 4 * MIB, 0x5252_0001, stream)?;
        p.pool().free(lent, stream)?;
        let first = p.pool().handle();
        let report = p.empty_cache()?;
        ensure!(
            report.pools_rotated == 1 && report.pools_retired == 0,
            "the generation of a live tensor was destroyed: {report:?}"
        );
        ensure!(
            p.pool().handles().contains(&first) && p.pool().handle() != first,
            "{:?}",
            p.pool().handles()
        );
        // The old generation's tensor still goes by pointer, under its old index.
        lend_by_pointer(&p, w, old, 8 * MIB, 0x5252_0000, stream)?;
        // (The job's results were the new generation's: it rotates and retires, not the old.)
        let report = p.empty_cache()?;
        ensure!(p.pool().handles().contains(&first), "{report:?}");
        p.pool().free(old, stream)?;
        p.driver().stream_synchronize(stream)?;
        let report = p.empty_cache()?;
        ensure!(report.pools_retired >= 1, "{report:?}");
        ensure!(!p.pool().handles().contains(&first), "{:?}", p.pool().handles());
        ensure!(report.workers_not_answered == 0, "{report:?}");
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn a_worker_spawned_after_a_rotation_takes_pool_pointers(env) {
        let p = pool_parent(env)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let a = p.spawn_worker(worker_command(env, None)?)?;
        let t = filled(&p, 4 * MIB, 0x5353_0000, stream)?;
        lend_by_pointer(&p, a, t, 4 * MIB, 0x5353_0000, stream)?;
        p.pool().free(t, stream)?;
        let report = p.empty_cache()?;
        ensure!(report.pools_rotated == 1, "{report:?}");
        let b = p.spawn_worker(worker_command(env, None)?)?;
        for w in [a, b] {
            let t = filled(&p, 4 * MIB, 0x5353_0001, stream)?;
            lend_by_pointer(&p, w, t, 4 * MIB, 0x5353_0001, stream)?;
            p.pool().free(t, stream)?;
        }
        // Both hold the second generation now: a second rotation retires it in both.
        let report = p.empty_cache()?;
        ensure!(
            report.pools_rotated == 1 && report.pools_retired == 1,
            "{report:?}"
        );
        ensure!(report.workers_not_answered == 0, "{report:?}");
        p.stop_worker(a)?;
        p.stop_worker(b)?;
        Ok(())
    }
);

both_drivers!(
    fn empty_cache_with_nothing_exported_does_not_rotate(env) {
        let p = pool_parent(env)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let t = filled(&p, 4 * MIB, 0x5454_0000, stream)?;
        p.pool().free(t, stream)?;
        let first = p.pool().handle();
        let report = p.empty_cache()?;
        ensure!(
            report.pools_rotated == 0 && report.pools_retired == 0,
            "{report:?}"
        );
        ensure!(p.pool().handles() == [first], "{:?}", p.pool().handles());
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn empty_cache_does_not_wait_for_a_worker_busy_in_a_job_and_its_share_comes_back_after(env) {
        // The worker stops at a gate inside its second job (a custom node running long):
        // it reads no frame until the job ends. empty_cache gives the idle chunk back at
        // once, without waiting out EMPTY_CACHE_WAIT for that worker; the worker unmaps the
        // chunk once its job is over.
        let p = parent(env, |_| {})?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let gate = std::env::temp_dir().join(format!("poolipc-vram-gate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&gate);
        std::fs::create_dir_all(&gate)?;
        let go = gate.join("go");
        std::fs::write(&go, b"")?;
        let mut cmd = worker_command(env, None)?;
        cmd.env("POOLIPC_TEST_GATE", &gate);
        let w = p.spawn_worker(cmd)?;
        drop(results_job(&p, w, 64 * MIB, stream)?);
        ensure!(settle(&p, stream)? == 0, "blocks left");
        let capacity = p.arena_stats().context("no arena")?.alloc.capacity;
        let before = free_vram(&p)?;
        // The second job waits at the gate.
        std::fs::remove_file(&go)?;
        let input = filled(&p, MIB, 0x0B05_0B05, stream)?;
        let job = p.submit(w, &[bytes_input(input, MIB)], stream)?;
        let t = Instant::now();
        while !std::fs::read_dir(&gate)?.any(|e| {
            e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("started-"))
        }) {
            ensure!(t.elapsed() < Duration::from_secs(30), "the second job never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        let t = Instant::now();
        let report = p.empty_cache()?;
        let took = t.elapsed();
        println!("empty_cache beside a busy worker: {report:?} in {took:?}");
        ensure!(report.arena_bytes == capacity, "{report:?}");
        ensure!(report.workers_not_answered == 1, "{report:?}");
        // 2 s: how long `empty_cache` waits for a worker's answer.
        ensure!(
            took < Duration::from_secs(2),
            "empty_cache waited {took:?} for a worker busy in a job"
        );
        // The job goes on; after it the worker unmaps the chunk and the memory is back.
        std::fs::write(&go, b"")?;
        let out = job.wait()?;
        drop(out);
        ensure!(settle(&p, stream)? == 0, "blocks left");
        // The job's own result grew the arena again (a new chunk): that much stays taken.
        let grown = p.arena_stats().context("no arena")?.alloc.capacity;
        let t = Instant::now();
        loop {
            let after = free_vram(&p)?;
            if after + SLACK + grown >= before + capacity {
                break;
            }
            ensure!(
                t.elapsed() < Duration::from_secs(10),
                "only {} of {} MiB came back after the job ({} MiB grown since)",
                (after + grown).saturating_sub(before) / MIB,
                capacity / MIB,
                grown / MIB
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        p.pool().free(input, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(w)?;
        let _ = std::fs::remove_dir_all(&gate);
        Ok(())
    }
);
