//! The arena-copy rung, as the facade's users meet it: an input of the parent's
//! shared pool that cannot go by pool pointer (over the import limit) is copied
//! device-to-device into a block of the parent's arena, on the job's stream before READY,
//! and the worker reads the copy through the mapping it made once. The block comes back only
//! after the worker's DONE, or after the worker was reaped. Without the VRAM for it, or with
//! the rung switched off, such an input takes host staging as before, and the job says why.
//!
//! The import limit is lowered to 0 chunks here ([`Parent::lower_import_limit`]), so that a
//! tensor of a megabyte is "over the limit" and the tests stay cheap; one test lends a real
//! 5 GiB tensor, on hardware with the VRAM for it.

use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::contract::FailReason;
use poolipc::advanced::driver::{DriverKind, OwnedStream};
use poolipc::advanced::types::ImportLimit;
use poolipc::{Error, Parent, ParentOptions, ResultMemory, Rung};
use poolipc_tests::echo;
use poolipc_tests::echo_jobs::{bytes_input, check_exact, filled, free_results, settle};
use poolipc_tests::{Env, both_drivers, worker_command};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn parent(env: &Env, tweak: impl FnOnce(&mut ParentOptions)) -> Result<Parent> {
    let mut options = ParentOptions {
        device: env.device,
        canary: false,
        ..ParentOptions::default()
    };
    tweak(&mut options);
    let p = Parent::new(Arc::clone(&env.driver), options)?;
    // Every allocation touches at least one chunk: a limit of none puts every input over it.
    let limit = p.limits().import;
    p.lower_import_limit(ImportLimit::new(limit.chunk_bytes(), 0).context("limit")?)?;
    Ok(p)
}

both_drivers!(
    fn an_input_over_the_import_limit_arrives_byte_for_byte_through_an_arena_copy(env) {
        // The result arena is off (`ResultMemory::Pool`, the default): an arena is made for
        // the copy all the same.
        let p = parent(env, |_| {})?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let dir = std::env::temp_dir().join(format!("poolipc-arena-copy-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let report = dir.join("report");
        let _ = std::fs::remove_file(&report);
        let mut cmd = worker_command(env, None)?;
        cmd.env("POOLIPC_TEST_REPORT", &report);
        let w = p.spawn_worker(cmd)?;
        // Not a multiple of anything: every byte of the copy counts.
        let bytes = MIB + 3;
        let src = filled(&p, bytes, 0x1357_9BDF, stream)?;
        let out = p.run_job(w, &[bytes_input(src, bytes)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::ArenaCopy], "{:?}", out.input_rungs);
        let reason = out.input_reasons[0].as_deref().context("no reason for a non-pointer rung")?;
        println!("{reason}");
        ensure!(
            reason.starts_with("input 0: ") && reason.contains("over the import limit (it touches 1 chunks of 32 MiB")
                && reason.contains(": arena copy ("),
            "{reason}"
        );
        check_exact(&p, &out, 0, bytes, 0x1357_9BDF)?;
        ensure!(p.stats().arena_copied_inputs == 1, "{:?}", p.stats());
        ensure!(p.stats().arena_results == 0, "results stay in the pool: {:?}", p.stats());
        let views = std::fs::read_to_string(&report)?;
        ensure!(
            views.lines().last().is_some_and(|l| l.ends_with("ArenaCopy false")),
            "the worker's view of the copy is writable (lent so; copied back): {views:?}"
        );
        // The block went back after the worker's DONE: nothing is left out.
        ensure!(settle(&p, stream)? == 0, "the copy's block is still out");
        free_results(&p, out, stream)?;
        p.pool().free(src, stream)?;
        p.driver().stream_synchronize(stream)?;
        let _ = std::fs::remove_dir_all(&dir);
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn arena_copies_reuse_one_block_and_share_the_result_arena(env) {
        let p = parent(env, |o| {
            o.results = ResultMemory::Arena { initial_bytes: 8 * MIB, max_bytes: Some(8 * MIB) };
        })?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        for k in 0..6u32 {
            let src = filled(&p, 2 * MIB, 0x0A0B_0000 + k, stream)?;
            let out = p.run_job(w, &[bytes_input(src, 2 * MIB)], stream)?;
            p.driver().stream_synchronize(stream)?;
            ensure!(out.input_rungs == [Rung::ArenaCopy], "{:?}", out.input_rungs);
            ensure!(out.results[0].rung == Rung::Arena, "{:?}", out.results[0].rung);
            check_exact(&p, &out, 0, 2 * MIB, 0x0A0B_0000 + k)?;
            drop(out);
            p.pool().free(src, stream)?;
            ensure!(settle(&p, stream)? == 0, "job {k} left blocks out");
        }
        let stats = p.arena_stats().context("no arena")?;
        ensure!(stats.alloc.chunks == 1, "the arena grew: {stats:?}");
        ensure!(p.stats().arena_copied_inputs == 6, "{:?}", p.stats());
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn without_vram_to_spare_an_input_over_the_limit_takes_host_staging_and_says_why(env) {
        // No device has an exabyte to spare: the VRAM check refuses the copy.
        let p = parent(env, |o| o.arena_copy_vram_margin = 1 << 60)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let src = filled(&p, MIB, 0x2468_ACE0, stream)?;
        let out = p.run_job(w, &[bytes_input(src, MIB)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::HostStaging], "{:?}", out.input_rungs);
        let reason = out.input_reasons[0].as_deref().context("no reason")?;
        println!("{reason}");
        ensure!(
            reason.contains(": host staging: only ") && reason.contains("of VRAM free"),
            "{reason}"
        );
        check_exact(&p, &out, 0, MIB, 0x2468_ACE0)?;
        ensure!(p.arena_stats().is_none(), "an arena was made for a copy that did not happen");
        ensure!(p.stats().arena_copied_inputs == 0, "{:?}", p.stats());
        free_results(&p, out, stream)?;
        p.pool().free(src, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn with_arena_copy_off_an_input_over_the_limit_takes_host_staging_and_says_why(env) {
        let p = parent(env, |o| o.arena_copy = false)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let src = filled(&p, MIB, 0x0F0F_1E1E, stream)?;
        let out = p.run_job(w, &[bytes_input(src, MIB)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::HostStaging], "{:?}", out.input_rungs);
        let reason = out.input_reasons[0].as_deref().context("no reason")?;
        ensure!(reason.contains("host staging: arena copy is off"), "{reason}");
        check_exact(&p, &out, 0, MIB, 0x0F0F_1E1E)?;
        ensure!(p.arena_stats().is_none(), "an arena was made with the rung off");
        free_results(&p, out, stream)?;
        p.pool().free(src, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn a_worker_killed_holding_an_arena_copy_gives_the_block_back_once_it_is_reaped(env) {
        let p = parent(env, |_| {})?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        // Dies (SIGKILL) with its input mapped and read, before it asks for results.
        let doomed = p.spawn_worker(worker_command(env, Some("after-import"))?)?;
        let src = filled(&p, MIB, 0xDEAD_0001, stream)?;
        match p.run_job(doomed, &[bytes_input(src, MIB)], stream) {
            Err(Error::JobFailed { worker, reason: FailReason::HungUp, .. }) if worker == doomed => {}
            other => bail!("the doomed worker's job: {other:?}"),
        }
        ensure!(p.stats().arena_copied_inputs == 1, "the input was not copied: {:?}", p.stats());
        ensure!(p.worker(doomed).is_none(), "the doomed worker is still registered");
        ensure!(settle(&p, stream)? == 0, "the reaped worker's block is still out");
        // Another worker takes the same input, in a block of its own arena.
        let good = p.spawn_worker(worker_command(env, None)?)?;
        let out = p.run_job(good, &[bytes_input(src, MIB)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::ArenaCopy], "{:?}", out.input_rungs);
        check_exact(&p, &out, 0, MIB, 0xDEAD_0001)?;
        ensure!(settle(&p, stream)? == 0);
        ensure!(p.arena_of(good).context("no arena")?.stats().chunks == 1);
        free_results(&p, out, stream)?;
        p.pool().free(src, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(good)?;
        Ok(())
    }
);

both_drivers!(
    fn the_source_may_be_overwritten_and_freed_on_the_jobs_stream_once_the_job_returned(env) {
        // The copy is queued on the job's stream before READY: work the caller queues on that
        // stream after `wait()` runs after it, so the source is the caller's again.
        let p = parent(env, |_| {})?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let src = filled(&p, 4 * MIB, 0x5151_A0A0, stream)?;
        let job = p.submit(w, &[bytes_input(src, 4 * MIB)], stream)?;
        let out = job.wait()?;
        // No synchronize: overwrite, then free, stream-ordered after the job.
        echo::fill_pattern(&**p.driver(), src, 4 * MIB, 0xFFFF_FFFF, stream)?;
        p.pool().free(src, stream)?;
        // And reuse the memory for the next job's input.
        let next = filled(&p, 4 * MIB, 0x6262_B1B1, stream)?;
        let again = p.run_job(w, &[bytes_input(next, 4 * MIB)], stream)?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::ArenaCopy] && again.input_rungs == [Rung::ArenaCopy]);
        check_exact(&p, &out, 0, 4 * MIB, 0x5151_A0A0)?;
        check_exact(&p, &again, 0, 4 * MIB, 0x6262_B1B1)?;
        ensure!(settle(&p, stream)? == 0);
        free_results(&p, out, stream)?;
        free_results(&p, again, stream)?;
        p.pool().free(next, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn a_5_gib_input_above_the_real_import_limit_crosses_by_arena_copy(env) {
        // The real limit (128 chunks of 32 MiB), not a lowered one: a single 5 GiB allocation
        // would crash the worker's pointer import. Only on hardware with room for the tensor,
        // its copy and the echo's result: on SimDriver the copies would fill 10+ GiB of this
        // machine's memory (the simulated device memory is host memory).
        if env.kind() != DriverKind::Cuda {
            println!("NOT RUN on {}: 15 GiB of simulated device memory is host memory", env.kind());
            return Ok(());
        }
        let (free, _) = env.driver.mem_get_info()?;
        if free < 20 * GIB {
            println!("NOT RUN: {} GiB of VRAM free, 20 GiB needed", free / GIB);
            return Ok(());
        }
        let options = ParentOptions {
            device: env.device,
            canary: false,
            results: ResultMemory::Arena { initial_bytes: 6 * GIB, max_bytes: None },
            ..ParentOptions::default()
        };
        let p = Parent::new(Arc::clone(&env.driver), options)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let bytes = 5 * GIB;
        let src = filled(&p, bytes, 0x7A7A_5B5B, stream)?;
        let t = std::time::Instant::now();
        let out = p.run_job(w, &[bytes_input(src, bytes)], stream)?;
        p.driver().stream_synchronize(stream)?;
        println!("5 GiB echo job by arena copy: {:?}", t.elapsed());
        ensure!(out.input_rungs == [Rung::ArenaCopy], "{:?} {:?}", out.input_rungs, out.input_reasons);
        println!("{}", out.input_reasons[0].as_deref().unwrap_or_default());
        let r = &out.results[0];
        echo::verify_echo(&**p.driver(), r.ptr, bytes, 0, 0x7A7A_5B5B, 0)
            .map_err(anyhow::Error::msg)?;
        drop(out);
        p.pool().free(src, stream)?;
        ensure!(settle(&p, stream)? == 0);
        p.stop_worker(w)?;
        Ok(())
    }
);
