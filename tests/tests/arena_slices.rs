//! Arena slices (protocol 6), as the facade's users meet them
//! (`ParentOptions::arena_slice_bytes` with `ResultMemory::Arena`): each job is lent a block of
//! the arena out of which the worker carves results whose shapes it learns late, with no round
//! trip; carved results arrive intact and in the worker's order among granted ones, the unused
//! tail goes back, a dead worker's slice comes back once it is reaped, and a worker that lies
//! about its carves is condemned alone.

use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::contract::FailReason;
use poolipc::advanced::driver::OwnedStream;
use poolipc::{
    Error, JobOutput, Parent, ParentOptions, ResultMemory, Rung, StreamHandle, WorkerId,
};
use poolipc_tests::echo_jobs::{self, echo_job, settle};
use poolipc_tests::{Env, both_drivers, rogue_command, worker_command};

const MIB: u64 = 1 << 20;
const POISON: u8 = 0xEE;

fn parent(env: &Env, arena_bytes: u64, slice_bytes: u64) -> Result<Parent> {
    let options = ParentOptions {
        device: env.device,
        canary: false,
        results: ResultMemory::Arena {
            initial_bytes: arena_bytes,
            max_bytes: None,
        },
        arena_slice_bytes: slice_bytes,
        ..ParentOptions::default()
    };
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

/// The echo worker asking for its results one at a time (`echo::answer_late`), dying at
/// `die_at` if given.
fn late_worker(env: &Env, die_at: Option<&str>) -> Result<std::process::Command> {
    let mut cmd = worker_command(env, die_at)?;
    cmd.env("POOLIPC_TEST_LATE", "1");
    Ok(cmd)
}

/// Every byte of result `i` is what the echo worker made of input `i`, in a block of the
/// arena.
fn check_exact(p: &Parent, out: &JobOutput, i: usize, bytes: u64, pattern: u32) -> Result<()> {
    echo_jobs::check_exact(p, out, i, bytes, pattern)?;
    let r = &out.results[i];
    ensure!(
        r.rung == Rung::Arena && r.is_arena(),
        "result {i}: {:?}",
        r.rung
    );
    Ok(())
}

/// Fills every chunk of `w`'s arena with [`POISON`] (nothing may be live): a result the
/// worker did not write shows it.
fn poison_arena(p: &Parent, w: WorkerId, stream: StreamHandle) -> Result<()> {
    ensure!(settle(p, stream)? == 0, "blocks live before poisoning");
    let arena = p.arena_of(w).context("no arena")?;
    for c in arena.chunks() {
        p.driver().memset_d8_async(c.ptr, POISON, c.len, stream)?;
    }
    p.driver().stream_synchronize(stream)?;
    Ok(())
}

/// Makes `w`'s arena (a first job) and poisons it.
fn warm_and_poison(p: &Parent, w: WorkerId, stream: StreamHandle) -> Result<()> {
    drop(echo_job(p, w, &[4096], 0x0101_0101, stream)?);
    poison_arena(p, w, stream)
}

fn expect_failed(r: Result<JobOutput>, who: WorkerId, want: FailReason) -> Result<String> {
    match r {
        Err(e) => match e.downcast_ref::<Error>() {
            Some(Error::JobFailed {
                worker,
                reason,
                detail,
                ..
            }) if *worker == who && *reason == want => Ok(detail.clone()),
            _ => bail!("the job of {who}: {e:?}"),
        },
        Ok(out) => bail!("the job of {who} succeeded: {:?}", out.results),
    }
}

both_drivers!(
    fn carved_results_arrive_intact_without_a_round_trip(env) {
        let p = parent(env, 64 * MIB, 8 * MIB)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(late_worker(env, None)?)?;
        warm_and_poison(&p, w, stream)?;
        let before = p.stats();
        let sizes = [1, 4096, 3 * 1000 + 1, MIB];
        let out = echo_job(&p, w, &sizes, 0x0403_0201, stream)?;
        ensure!(out.results.len() == sizes.len(), "{} results", out.results.len());
        for (i, &n) in sizes.iter().enumerate() {
            check_exact(&p, &out, i, n, 0x0403_0201)?;
        }
        let after = p.stats();
        ensure!(after.arena_slices_lent == before.arena_slices_lent + 1, "{after:?}");
        ensure!(
            after.arena_results_carved == before.arena_results_carved + 4,
            "every result should be carved: {after:?}"
        );
        drop(out);
        ensure!(settle(&p, stream)? == 0, "blocks left after the results were dropped");
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn a_result_too_large_for_the_slice_is_asked_for_with_a_round_trip(env) {
        let p = parent(env, 64 * MIB, MIB)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(late_worker(env, None)?)?;
        warm_and_poison(&p, w, stream)?;
        let before = p.stats();
        let out = echo_job(&p, w, &[4 * MIB], 0x0A0B_0C0D, stream)?;
        check_exact(&p, &out, 0, 4 * MIB, 0x0A0B_0C0D)?;
        let after = p.stats();
        ensure!(after.arena_results_carved == before.arena_results_carved, "{after:?}");
        ensure!(after.arena_results == before.arena_results + 1, "{after:?}");
        ensure!(after.arena_slices_lent == before.arena_slices_lent + 1, "{after:?}");
        drop(out);
        ensure!(settle(&p, stream)? == 0);
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn carved_and_requested_results_keep_the_order_the_worker_asked_in(env) {
        let p = parent(env, 64 * MIB, 2 * MIB)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(late_worker(env, None)?)?;
        warm_and_poison(&p, w, stream)?;
        let before = p.stats();
        // Carved, asked for, carved, asked for, carved: the slice holds 2 MiB.
        let sizes = [MIB / 2, 4 * MIB, MIB / 4, 3 * MIB, 1000];
        let out = echo_job(&p, w, &sizes, 0x1122_3344, stream)?;
        ensure!(out.results.len() == sizes.len(), "{} results", out.results.len());
        for (i, &n) in sizes.iter().enumerate() {
            check_exact(&p, &out, i, n, 0x1122_3344)?;
        }
        let after = p.stats();
        ensure!(after.arena_results_carved == before.arena_results_carved + 3, "{after:?}");
        ensure!(after.arena_results == before.arena_results + 5, "{after:?}");
        drop(out);
        ensure!(settle(&p, stream)? == 0);
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn the_unused_tail_of_a_slice_goes_back_to_the_arena(env) {
        let p = parent(env, 16 * MIB, 8 * MIB)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(late_worker(env, None)?)?;
        warm_and_poison(&p, w, stream)?;
        let free = p.arena_stats().context("no arena")?.alloc.free;
        let out = echo_job(&p, w, &[4096, 100], 0x5555_AAAA, stream)?;
        check_exact(&p, &out, 0, 4096, 0x5555_AAAA)?;
        check_exact(&p, &out, 1, 100, 0x5555_AAAA)?;
        ensure!(settle(&p, stream)? == 2, "the two carves alone stay live");
        let stats = p.arena_stats().context("no arena")?;
        ensure!(stats.alloc.used == 4096 + 512, "the rest of the slice is back: {stats:?}");
        ensure!(stats.alloc.free == free - 4096 - 512, "{stats:?}");
        drop(out);
        ensure!(settle(&p, stream)? == 0);
        ensure!(p.arena_stats().context("no arena")?.alloc.free == free);
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    fn a_worker_killed_mid_job_with_a_slice_loses_nothing_once_reaped(env) {
        let p = parent(env, 32 * MIB, 2 * MIB)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let good = p.spawn_worker(late_worker(env, None)?)?;
        warm_and_poison(&p, good, stream)?;
        let free = p.arena_of(good).context("no arena")?.stats().free;
        // Dies (SIGKILL) after carving one result and being granted the other.
        let doomed = p.spawn_worker(late_worker(env, Some("after-grant"))?)?;
        let before = p.stats();
        let r = echo_job(&p, doomed, &[MIB, 4 * MIB], 0x0D0D_0D0D, stream);
        expect_failed(r, doomed, FailReason::HungUp)?;
        let after = p.stats();
        ensure!(after.arena_slices_lent == before.arena_slices_lent + 1, "{after:?}");
        ensure!(after.arena_results == before.arena_results + 1, "the grant: {after:?}");
        ensure!(p.worker(doomed).is_none(), "the doomed worker is still registered");
        ensure!(settle(&p, stream)? == 0, "blocks of the reaped worker are still out");
        let stats = p.arena_of(good).context("no arena")?.stats();
        ensure!(stats.free == free, "arena free {} != {free} at the start", stats.free);
        let out = echo_job(&p, good, &[MIB], 0x600D_600D, stream)?;
        check_exact(&p, &out, 0, MIB, 0x600D_600D)?;
        drop(out);
        ensure!(settle(&p, stream)? == 0);
        p.stop_worker(good)?;
        Ok(())
    }
);

both_drivers!(
    fn a_worker_lying_about_its_carves_is_condemned_alone(env) {
        let p = parent(env, 16 * MIB, 4 * MIB)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let good = p.spawn_worker(late_worker(env, None)?)?;
        warm_and_poison(&p, good, stream)?;
        let free = p.arena_of(good).context("no arena")?.stats().free;
        for (k, lie) in ["arena-carve-out-of-bounds", "arena-carve-overlap", "arena-carve-misaligned"]
            .into_iter()
            .enumerate()
        {
            let rogue = p.spawn_worker(rogue_command(env, lie)?)?;
            let r = echo_job(&p, rogue, &[4096], 0x0BAD_0BAD, stream);
            let detail = expect_failed(r, rogue, FailReason::ProtocolViolation)
                .with_context(|| lie.to_owned())?;
            ensure!(detail.contains("carve"), "{lie}: {detail}");
            ensure!(p.worker(rogue).is_none(), "{lie}: the rogue is still registered");
            ensure!(p.stats().workers_lost == k as u64 + 1, "{:?}", p.stats());
            ensure!(settle(&p, stream)? == 0, "{lie}: the rogue's slice is still out");
            ensure!(p.arena_of(good).context("no arena")?.stats().free == free, "{lie}");
            // The good worker never noticed.
            let out = echo_job(&p, good, &[4096], 0x600D_0000 + k as u32, stream)?;
            check_exact(&p, &out, 0, 4096, 0x600D_0000 + k as u32)?;
            drop(out);
            ensure!(settle(&p, stream)? == 0);
        }
        let status = p.stop_worker(good)?;
        ensure!(status.is_some_and(|s| s.success()), "{status:?}");
        Ok(())
    }
);

both_drivers!(
    fn with_slices_off_every_result_is_asked_for_as_before(env) {
        let p = parent(env, 64 * MIB, 0)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(late_worker(env, None)?)?;
        let sizes = [1, 4096, MIB];
        let out = echo_job(&p, w, &sizes, 0x7777_1111, stream)?;
        for (i, &n) in sizes.iter().enumerate() {
            check_exact(&p, &out, i, n, 0x7777_1111)?;
        }
        let stats = p.stats();
        ensure!(stats.arena_slices_lent == 0 && stats.arena_results_carved == 0, "{stats:?}");
        ensure!(stats.arena_results == 3, "{stats:?}");
        drop(out);
        // Turned on at run time, the next job gets a slice.
        p.set_arena_slice_bytes(4 * MIB);
        let out = echo_job(&p, w, &sizes, 0x7777_2222, stream)?;
        for (i, &n) in sizes.iter().enumerate() {
            check_exact(&p, &out, i, n, 0x7777_2222)?;
        }
        let stats = p.stats();
        ensure!(stats.arena_slices_lent == 1 && stats.arena_results_carved == 3, "{stats:?}");
        drop(out);
        ensure!(settle(&p, stream)? == 0);
        p.stop_worker(w)?;
        Ok(())
    }
);
