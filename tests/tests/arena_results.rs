//! Results through the result arena, as the facade's users meet them
//! (`ParentOptions::results = ResultMemory::Arena`): a result is an offset into parent-owned
//! VMM memory each worker mapped once, the caller's `ResultTensor` gives its block back
//! stream-ordered and exactly once, the arena grows while workers are attached, and a worker
//! that dies or breaks the protocol while holding blocks loses none of them.

use std::collections::BTreeSet;
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::contract::FailReason;
use poolipc::advanced::driver::{DriverKind, OwnedStream};
use poolipc::{
    DevicePtr, Error, Parent, ParentOptions, ResultMemory, ResultRefusal, Rung, WorkerId,
};
use poolipc_tests::echo;
use poolipc_tests::echo_jobs::{bytes_input, check_exact, echo_job, filled, settle};
use poolipc_tests::{Env, both_drivers, rogue_command, worker_command};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn parent(env: &Env, initial_bytes: u64, max_bytes: Option<u64>) -> Result<Parent> {
    let options = ParentOptions {
        device: env.device,
        canary: false,
        results: ResultMemory::Arena {
            initial_bytes,
            max_bytes,
        },
        ..ParentOptions::default()
    };
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

/// The index of the chunk of `worker`'s arena that `ptr` lies in.
fn chunk_of(p: &Parent, worker: WorkerId, ptr: DevicePtr) -> Result<u32> {
    let arena = p.arena_of(worker).context("no arena")?;
    arena
        .chunks()
        .find(|c| c.ptr.0 <= ptr.0 && ptr.0 < c.ptr.0 + c.len)
        .map(|c| c.index)
        .with_context(|| format!("{ptr:?} is in no chunk of {worker}'s arena"))
}

both_drivers!(
    fn results_of_one_byte_one_mib_and_64_mib_cross_through_the_arena_byte_for_byte(env) {
        let p = parent(env, 64 * MIB, None)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        ensure!(p.arena_stats().is_none(), "the arena is made at the first result, not before");
        let sizes = [1, MIB, 64 * MIB];
        let out = echo_job(&p, w, &sizes, 0x0403_0201, stream)?;
        ensure!(out.results.len() == 3, "{} results", out.results.len());
        for (i, &n) in sizes.iter().enumerate() {
            let r = &out.results[i];
            ensure!(r.rung == Rung::Arena && r.is_arena(), "result {i}: {:?}", r.rung);
            chunk_of(&p, w, r.ptr)?;
            check_exact(&p, &out, i, n, 0x0403_0201)?;
        }
        ensure!(p.stats().arena_results == 3, "{:?}", p.stats());
        ensure!(p.stats().pool_pointer_tensors == 3, "the inputs: {:?}", p.stats());
        ensure!(p.arena_stats().context("no arena")?.alloc.live_blocks == 3);
        drop(out);
        ensure!(settle(&p, stream)? == 0, "blocks left after the results were dropped");
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn a_16_gib_result_crosses_through_the_arena_byte_for_byte(env) {
        // The worker copies a 16 GiB input (itself over the import limit: an arena copy)
        // into a 16 GiB arena result; every byte of it is read back and checked. Only on
        // hardware with room for the input, its copy and the result (48 GiB).
        if env.kind() != DriverKind::Cuda {
            println!("NOT RUN on {}: 48 GiB of simulated device memory is host memory", env.kind());
            return Ok(());
        }
        let (free, _) = env.driver.mem_get_info()?;
        if free < 52 * GIB {
            println!("NOT RUN: {} GiB of VRAM free, 52 GiB needed", free / GIB);
            return Ok(());
        }
        let bytes = 16 * GIB;
        let p = parent(env, 2 * bytes + GIB, None)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let pattern = 0x1600_C0DE;
        let t = std::time::Instant::now();
        let out = echo_job(&p, w, &[bytes], pattern, stream)?;
        println!("16 GiB echo job: {:?}, input {:?}", t.elapsed(), out.input_rungs);
        let r = &out.results[0];
        ensure!(r.rung == Rung::Arena && r.bytes == bytes, "{:?}, {} bytes", r.rung, r.bytes);
        // Read back in 256 MiB pieces against the pattern (the marker in the first 4 bytes).
        let piece = 256 * MIB;
        let mut got = vec![0u8; usize::try_from(piece)?];
        let want: Vec<u8> = pattern.to_le_bytes().iter().copied().cycle().take(got.len()).collect();
        for k in 0..bytes / piece {
            p.driver().memcpy_dtoh(&mut got, r.ptr.offset(k * piece))?;
            let skip = if k == 0 {
                ensure!(got[..4] == echo::marker(0).to_le_bytes(), "the marker is not there");
                4
            } else {
                0
            };
            if let Some(at) = got[skip..].iter().zip(&want[skip..]).position(|(g, w)| g != w) {
                let at = skip + at;
                bail!(
                    "byte {} of the 16 GiB result is {:#04x}, expected {:#04x}",
                    k * piece + at as u64,
                    got[at],
                    want[at]
                );
            }
        }
        println!("16 GiB result checked byte for byte: {:?}", t.elapsed());
        drop(out);
        ensure!(settle(&p, stream)? == 0, "blocks left after the result was dropped");
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn a_result_past_the_arena_cap_fails_its_job_with_a_typed_refusal_and_the_worker_goes_on(env) {
        let p = parent(env, 8 * MIB, Some(8 * MIB))?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        match echo_job(&p, w, &[16 * MIB], 0x5150_0001, stream) {
            Err(e) => match e.downcast_ref::<Error>() {
                Some(Error::Worker {
                    refused: Some(ResultRefusal::ArenaFull { requested, max, .. }),
                    message,
                    ..
                }) => {
                    println!("refused: {message}");
                    ensure!(*requested >= 16 * MIB && *max == 8 * MIB, "{requested} {max}");
                }
                _ => bail!("not a typed arena refusal: {e:?}"),
            },
            Ok(out) => bail!("a 16 MiB result in an 8 MiB arena: {:?}", out.results),
        }
        // The worker is alive and the arena still serves what fits.
        let out = echo_job(&p, w, &[MIB], 0x5150_0002, stream)?;
        ensure!(out.results[0].rung == Rung::Arena, "{:?}", out.results[0].rung);
        check_exact(&p, &out, 0, MIB, 0x5150_0002)?;
        drop(out);
        ensure!(settle(&p, stream)? == 0, "blocks left out");
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn a_worker_that_dies_of_a_refused_result_fails_its_job_naming_the_refusal(env) {
        let p = parent(env, 8 * MIB, Some(8 * MIB))?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, Some("after-refusal"))?)?;
        match echo_job(&p, w, &[16 * MIB], 0x5150_0003, stream) {
            Err(e) => {
                let text = e.to_string();
                println!("failed: {text}");
                match e.downcast_ref::<Error>() {
                    // The worker died of the refusal: the error names both.
                    Some(Error::JobFailed { detail, .. }) => ensure!(
                        detail.contains("the parent refused its results")
                            && detail.contains("cannot hold"),
                        "the refusal is not named: {detail}"
                    ),
                    // Or its report of the refusal won the race with its death.
                    Some(Error::Worker {
                        refused: Some(ResultRefusal::ArenaFull { .. }),
                        ..
                    }) => {}
                    _ => bail!("neither a failed job naming the refusal nor a typed refusal: {e:?}"),
                }
            }
            Ok(out) => bail!("a 16 MiB result in an 8 MiB arena: {:?}", out.results),
        }
        // Nothing is lost, and the parent serves a new worker.
        ensure!(settle(&p, stream)? == 0, "blocks left out");
        let w2 = p.spawn_worker(worker_command(env, None)?)?;
        let out = echo_job(&p, w2, &[MIB], 0x5150_0004, stream)?;
        check_exact(&p, &out, 0, MIB, 0x5150_0004)?;
        drop(out);
        ensure!(settle(&p, stream)? == 0, "blocks left out");
        p.stop_worker(w2)?;
        Ok(())
    }
);

both_drivers!(
    fn many_jobs_reuse_the_same_block_without_growing_the_arena(env) {
        let p = parent(env, 4 * MIB, Some(4 * MIB))?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let mut seen = BTreeSet::new();
        for k in 0..24u32 {
            let out = echo_job(&p, w, &[MIB], 0x0100_0000 + k, stream)?;
            check_exact(&p, &out, 0, MIB, 0x0100_0000 + k)?;
            seen.insert(out.results[0].ptr.0);
            drop(out);
            // The drop's event completes here; the next result reclaims the block.
            p.driver().stream_synchronize(stream)?;
        }
        ensure!(seen.len() == 1, "{} distinct blocks for one live result at a time", seen.len());
        let stats = p.arena_stats().context("no arena")?;
        ensure!(stats.alloc.chunks == 1, "the arena grew: {stats:?}");
        ensure!(settle(&p, stream)? == 0);
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn each_worker_attached_has_its_own_arena_which_grows_for_it_alone(env) {
        let p = parent(env, 4 * MIB, None)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let a = p.spawn_worker(worker_command(env, None)?)?;
        let b = p.spawn_worker(worker_command(env, None)?)?;
        let size = 3 * MIB;
        let first = echo_job(&p, a, &[size], 0xA1A1_A1A1, stream)?;
        ensure!(chunk_of(&p, a, first.results[0].ptr)? == 0);
        // B's result goes to B's own arena, made for it: A's chunk 0 is not B's.
        let second = echo_job(&p, b, &[size], 0xB2B2_B2B2, stream)?;
        ensure!(chunk_of(&p, b, second.results[0].ptr)? == 0, "not in B's first chunk");
        ensure!(chunk_of(&p, a, second.results[0].ptr).is_err(), "B's result lies in A's arena");
        check_exact(&p, &second, 0, size, 0xB2B2_B2B2)?;
        drop(second);
        p.driver().stream_synchronize(stream)?;
        // A's chunk 0 cannot hold a second one while the first is live: A's arena grows, and
        // A is sent the new chunk before its grant.
        let third = echo_job(&p, a, &[size], 0xC3C3_C3C3, stream)?;
        ensure!(chunk_of(&p, a, third.results[0].ptr)? == 1, "not in A's new chunk");
        check_exact(&p, &third, 0, size, 0xC3C3_C3C3)?;
        check_exact(&p, &first, 0, size, 0xA1A1_A1A1)?;
        let stats = p.arena_stats().context("no arena")?;
        ensure!(stats.alloc.chunks == 3 && stats.arenas == 2, "{stats:?}");
        let of_a = p.arena_of(a).context("no arena of A")?.stats();
        let of_b = p.arena_of(b).context("no arena of B")?.stats();
        ensure!(of_a.chunks == 2 && of_b.chunks == 1, "{of_a:?} {of_b:?}");
        drop((first, third));
        ensure!(settle(&p, stream)? == 0);
        for w in [a, b] {
            let status = p.stop_worker(w)?;
            ensure!(status.is_some_and(|s| s.success()), "{w}: {status:?}");
        }
        Ok(())
    }
);

both_drivers!(
    fn a_worker_killed_holding_arena_blocks_gives_them_back_once_reaped(env) {
        let p = parent(env, 8 * MIB, None)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let good = p.spawn_worker(worker_command(env, None)?)?;
        // Dies (SIGKILL) after its two results were granted, before writing them.
        let doomed = p.spawn_worker(worker_command(env, Some("after-grant"))?)?;
        match echo_job(&p, doomed, &[MIB, 2 * MIB], 0x0D0D_0D0D, stream) {
            Err(e) => match e.downcast_ref::<Error>() {
                Some(Error::JobFailed { worker, reason: FailReason::HungUp, .. })
                    if *worker == doomed => {}
                _ => bail!("the doomed worker's job: {e:?}"),
            },
            Ok(out) => bail!("the doomed worker's job succeeded: {:?}", out.results),
        }
        ensure!(p.stats().arena_results == 2, "the blocks were not granted: {:?}", p.stats());
        ensure!(p.worker(doomed).is_none(), "the doomed worker is still registered");
        ensure!(settle(&p, stream)? == 0, "blocks of the reaped worker are still out");
        // The other worker goes on, in its own arena.
        let out = echo_job(&p, good, &[MIB], 0x600D_600D, stream)?;
        check_exact(&p, &out, 0, MIB, 0x600D_600D)?;
        drop(out);
        ensure!(settle(&p, stream)? == 0);
        let stats = p.arena_of(good).context("no arena")?.stats();
        ensure!(stats.chunks == 1, "{stats:?}");
        p.stop_worker(good)?;
        Ok(())
    }
);

both_drivers!(
    fn a_rogue_acking_an_arena_grant_before_done_is_condemned_alone(env) {
        let p = parent(env, 4 * MIB, None)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let good = p.spawn_worker(worker_command(env, None)?)?;
        let rogue = p.spawn_worker(rogue_command(env, "arena-ack-before-done")?)?;
        match echo_job(&p, rogue, &[MIB], 0x0BAD_0BAD, stream) {
            Err(e) => match e.downcast_ref::<Error>() {
                Some(Error::JobFailed { worker, reason: FailReason::ProtocolViolation, detail, .. })
                    if *worker == rogue => println!("the rogue: {detail}"),
                _ => bail!("the rogue's job: {e:?}"),
            },
            Ok(out) => bail!("the rogue's job succeeded: {:?}", out.results),
        }
        ensure!(p.stats().arena_results == 1, "{:?}", p.stats());
        ensure!(p.stats().workers_lost == 1, "{:?}", p.stats());
        ensure!(p.worker(rogue).is_none(), "the rogue is still registered");
        ensure!(settle(&p, stream)? == 0, "the rogue's block is still out");
        // The good worker never noticed.
        for k in 0..2 {
            let out = echo_job(&p, good, &[MIB], 0x600D_0000 + k, stream)?;
            check_exact(&p, &out, 0, MIB, 0x600D_0000 + k)?;
        }
        ensure!(settle(&p, stream)? == 0);
        let status = p.stop_worker(good)?;
        ensure!(status.is_some_and(|s| s.success()), "{status:?}");
        Ok(())
    }
);

both_drivers!(
    fn a_result_tensor_gives_its_block_back_exactly_once(env) {
        let p = parent(env, 4 * MIB, None)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let mut out = echo_job(&p, w, &[MIB, MIB], 0x1234_5678, stream)?;
        let arena = p.arena_of(w).context("no arena")?;
        ensure!(arena.stats().live_blocks == 2);
        // Given back explicitly: once now, and not again when the value is gone.
        let first = out.results.remove(0);
        ensure!(first.return_to_arena(stream)?, "no block to give back");
        ensure!(arena.pending_frees() == 1, "pending: {}", arena.pending_frees());
        // Dropped: once.
        drop(out);
        ensure!(arena.pending_frees() == 2, "pending: {}", arena.pending_frees());
        p.driver().stream_synchronize(stream)?;
        ensure!(p.reclaim_arena() == 2, "not exactly two blocks came back");
        ensure!(p.reclaim_arena() == 0);
        ensure!(arena.stats().live_blocks == 0, "{:?}", arena.stats());
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn results_of_a_callers_allocator_stay_in_the_callers_memory_with_the_arena_on(env) {
        let p = parent(env, 4 * MIB, None)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let input = filled(&p, MIB, 0x7777_0001, stream)?;
        let driver = Arc::clone(p.driver());
        let pool = p.pool().handle();
        let alloc: poolipc::ResultAllocator = Box::new(move |_, bytes, s| {
            Ok(driver.mem_alloc_from_pool_async(bytes, pool, s)?)
        });
        let out = p.submit_with(w, &[bytes_input(input, MIB)], stream, alloc)?.wait()?;
        p.driver().stream_synchronize(stream)?;
        let r = &out.results[0];
        ensure!(r.rung == Rung::PoolPointer && !r.is_arena(), "{:?}", r.rung);
        check_exact(&p, &out, 0, MIB, 0x7777_0001)?;
        ensure!(p.arena_stats().is_none(), "the arena was made for a caller's allocator");
        p.pool().free(r.ptr, stream)?;
        p.pool().free(input, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn the_canary_battery_passes_with_its_results_in_the_arena(env) {
        let options = ParentOptions {
            device: env.device,
            results: ResultMemory::Arena { initial_bytes: 16 * MIB, max_bytes: None },
            ..ParentOptions::default()
        };
        let p = Parent::new(Arc::clone(&env.driver), options)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let report = p.canary_report(w).context("no canary report")?;
        ensure!(report.ok(), "{report}");
        ensure!(p.stats().arena_results > 0, "{:?}", p.stats());
        ensure!(settle(&p, stream)? == 0, "the battery's blocks are still out");
        p.stop_worker(w)?;
        Ok(())
    }
);
