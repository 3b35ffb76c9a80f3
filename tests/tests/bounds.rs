//! Bounds on what one worker may make the parent hold: results per job, result
//! bytes per job, the arena's cap, a job's lifetime, cancel. Going past a bound condemns
//! that worker alone with `FailReason::BoundExceeded` naming the bound; the parent, its
//! memory and the other workers go on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::{DevicePtr, OwnedStream, StreamHandle};
use poolipc::{
    Bound, DType, Error, FailReason, Input, Layout, Parent, ParentOptions, ResultMemory, WorkerId,
};
use poolipc_tests::echo;
use poolipc_tests::{Env, both_drivers, rogue_command, tempdir, worker_command};

const MIB: u64 = 1 << 20;

fn parent(env: &Env, tweak: impl FnOnce(&mut ParentOptions)) -> Result<Parent> {
    let mut options = ParentOptions {
        device: env.device,
        canary: false,
        ..ParentOptions::default()
    };
    tweak(&mut options);
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

fn filled(p: &Parent, bytes: u64, pattern: u32, stream: StreamHandle) -> Result<DevicePtr> {
    let ptr = p.pool().alloc(bytes, stream)?;
    echo::fill_pattern(&**p.driver(), ptr, bytes, pattern, stream)?;
    Ok(ptr)
}

fn input(ptr: DevicePtr) -> [Input; 1] {
    [Input::new(ptr, Layout::contiguous(DType::F32, &[MIB / 4]))]
}

/// A honest job on `worker`: it succeeds; its results are given back.
fn honest_job(p: &Parent, worker: WorkerId, x: DevicePtr, stream: StreamHandle) -> Result<()> {
    let out = p.run_job(worker, &input(x), stream)?;
    ensure!(!out.results.is_empty(), "the honest job returned no result");
    for r in out.results {
        if r.rung == poolipc::Rung::Arena {
            drop(r);
        } else {
            p.pool().free(r.ptr, stream)?;
        }
    }
    p.driver().stream_synchronize(stream)?;
    Ok(())
}

/// The parent's resident set, in bytes.
fn rss() -> Result<u64> {
    Ok(poolipc_tests::proc_status_kib("VmRSS")? * 1024)
}

/// `r` is `JobFailed` on `worker` for going past `bound`; returns the detail.
fn expect_bound(
    r: Result<poolipc::JobOutput, Error>,
    worker: WorkerId,
    bound: Bound,
) -> Result<String> {
    match r {
        Err(Error::JobFailed {
            worker: w,
            reason: FailReason::BoundExceeded(b),
            detail,
            ..
        }) => {
            ensure!(w == worker, "the failure names {w}, not {worker}");
            ensure!(
                b == bound,
                "the failure names the bound {b:?}, not {bound:?} ({detail})"
            );
            Ok(detail)
        }
        other => bail!("expected JobFailed(BoundExceeded({bound:?})), got {other:?}"),
    }
}

/// Waits for `job` at most a minute: a bound, not a timing (a bound not enforced leaves the
/// job open forever; this fails it instead of hanging).
fn bounded(job: poolipc::JobHandle) -> Result<Result<poolipc::JobOutput, Error>> {
    match job.wait_timeout(Duration::from_secs(60)) {
        Ok(r) => Ok(r),
        Err(_) => bail!("the job did not end within a minute"),
    }
}

const ARENA_CAP: u64 = 64 * MIB;

both_drivers!(
    /// A worker that asks for 4096 results, then 4096 more after each grant, is condemned at
    /// the results-per-job bound (the third request, past 8192): its job fails naming the
    /// bound, the
    /// parent's memory grew by less than 64 MiB, the arena is back to what the honest worker
    /// left in it (no block of the rogue's stays) and under its cap, and a honest worker
    /// beside it serves jobs before and after.
    fn a_worker_flooding_result_requests_is_condemned_at_the_results_per_job_bound(env) {
        let p = parent(env, |o| {
            o.results = ResultMemory::Arena {
                initial_bytes: 4 * MIB,
                max_bytes: Some(ARENA_CAP),
            };
        })?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, MIB, 0x1357_9BDF, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let rogue = p.spawn_worker(rogue_command(env, "results-flood")?)?;
        honest_job(&p, honest, x, stream)?;
        p.reclaim_arena();
        let used_before = p.arena_stats().map_or(0, |s| s.alloc.used);
        let rss_before = rss()?;

        let detail = expect_bound(bounded(p.submit(rogue, &input(x), stream)?)?, rogue, Bound::ResultsPerJob)?;
        ensure!(detail.contains("results per job"), "the detail does not name the bound: {detail}");
        ensure!(p.worker(rogue).is_none(), "the condemned worker is still listed");
        honest_job(&p, honest, x, stream)?;

        let grown = rss()?.saturating_sub(rss_before);
        ensure!(grown < 64 * MIB, "the parent's resident set grew by {grown} bytes");
        p.driver().stream_synchronize(stream)?;
        p.reclaim_arena();
        let arena = p.arena_stats().context("the arena was never made")?;
        ensure!(
            arena.alloc.used == used_before,
            "{} arena bytes in use after the rogue died, {used_before} before it",
            arena.alloc.used
        );
        ensure!(arena.alloc.capacity <= ARENA_CAP, "the arena holds {} bytes, past its cap", arena.alloc.capacity);
        p.stop_worker(honest)?;
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A worker that asks for one result of 1 TiB under the default bounds is condemned at
    /// the result-bytes-per-job bound before anything is allocated: the pool holds what it
    /// held before, and a honest worker goes on.
    fn a_giant_result_request_is_condemned_at_the_result_bytes_per_job_bound(env) {
        let p = parent(env, |_| {})?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, MIB, 0x2468_ACE0, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let rogue = p.spawn_worker(rogue_command(env, "giant-result")?)?;
        honest_job(&p, honest, x, stream)?;
        let before = p.pool().stats()?.used_current;

        expect_bound(bounded(p.submit(rogue, &input(x), stream)?)?, rogue, Bound::ResultBytesPerJob)?;
        ensure!(p.worker(rogue).is_none(), "the condemned worker is still listed");
        honest_job(&p, honest, x, stream)?;
        p.driver().stream_synchronize(stream)?;
        let used = p.pool().stats()?.used_current;
        ensure!(used == before, "{used} pool bytes in use after the rogue, {before} before it");
        p.stop_worker(honest)?;
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// With the byte bounds lifted, a result of 1 TiB asked of an arena under its default cap
    /// (half the device) is refused as past the cap, the arena does not grow, and the worker
    /// (which then fails its job properly) is not condemned.
    fn a_giant_arena_result_is_refused_at_the_arena_cap_without_growing_it(env) {
        let p = parent(env, |o| {
            o.results = ResultMemory::Arena {
                initial_bytes: 4 * MIB,
                max_bytes: None,
            };
            o.max_result_bytes_per_job = poolipc::MemoryBound::Bytes(u64::MAX);
            o.max_result_bytes_per_worker = poolipc::MemoryBound::Bytes(u64::MAX);
        })?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, MIB, 0x0F0F_0F0F, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let rogue = p.spawn_worker(rogue_command(env, "arena-giant-result")?)?;
        // The arena exists (the honest worker's result made it) before the giant request.
        honest_job(&p, honest, x, stream)?;
        let before = p.arena_stats().context("no arena after an arena result")?;
        let cap = before.max_bytes.context("the default arena has no cap")?;
        ensure!(cap < 1 << 40, "the device's half ({cap} bytes) holds 1 TiB: the test proves nothing");

        match bounded(p.submit(rogue, &input(x), stream)?)? {
            Err(Error::Worker { refused: Some(poolipc::ResultRefusal::ArenaFull { requested, max, .. }), .. }) => {
                ensure!(requested >= 1 << 40, "refused {requested} bytes, not the 1 TiB asked");
                ensure!(max == cap, "refused against {max}, the cap is {cap}");
            }
            other => bail!("expected the worker's error after an ArenaFull refusal, got {other:?}"),
        }
        let after = p.arena_stats().context("the arena is gone")?;
        ensure!(
            after.alloc.capacity == before.alloc.capacity,
            "the arena grew from {} to {} bytes for a refused result",
            before.alloc.capacity,
            after.alloc.capacity
        );
        ensure!(p.worker(rogue).is_some(), "the refused worker was condemned");
        honest_job(&p, honest, x, stream)?;
        p.stop_worker(rogue)?;
        p.stop_worker(honest)?;
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A worker that declared long jobs and keeps its job open with a heartbeat every 200 ms
    /// never meets the handoff deadline; the job lifetime ends it: the job fails naming the
    /// bound, the worker is condemned, a honest worker goes on.
    fn a_job_kept_alive_forever_fails_at_its_lifetime(env) {
        let lifetime = Duration::from_secs(2);
        let p = parent(env, |o| {
            o.handoff_timeout = Duration::from_secs(1);
            o.max_job_lifetime = lifetime;
        })?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, MIB, 0x1111_2222, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let rogue = p.spawn_worker(rogue_command(env, "long-job")?)?;
        let job = p.submit(rogue, &input(x), stream)?;
        honest_job(&p, honest, x, stream)?;
        // Bound only: the lifetime is 2 s; a job that never ends fails here.
        let r = match job.wait_timeout(lifetime * 15) {
            Ok(r) => r,
            Err(_) => bail!("the kept-alive job did not end within fifteen times its lifetime"),
        };
        let detail = expect_bound(r, rogue, Bound::JobLifetime)?;
        ensure!(detail.contains("lifetime"), "the detail does not name the lifetime: {detail}");
        ensure!(p.worker(rogue).is_none(), "the condemned worker is still listed");
        honest_job(&p, honest, x, stream)?;
        p.stop_worker(honest)?;
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A job cancelled while its worker holds it fails with `Cancelled` once the worker
    /// finished it; the worker is not condemned and takes the next job, which succeeds; the
    /// pool holds what it held before.
    fn a_job_cancelled_mid_flight_fails_with_cancelled_and_the_worker_takes_the_next(env) {
        let p = parent(env, |_| {})?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, MIB, 0x3333_4444, stream)?;
        let dir = tempdir("cancel")?;
        let mut cmd = worker_command(env, None)?;
        cmd.env("POOLIPC_TEST_GATE", &dir);
        let worker = p.spawn_worker(cmd)?;
        p.driver().stream_synchronize(stream)?;
        let before = p.pool().stats()?.used_current;

        let job = p.submit(worker, &input(x), stream)?;
        // Bound only: wait until the worker holds the job.
        let until = Instant::now() + Duration::from_secs(60);
        while std::fs::read_dir(&dir)?.count() == 0 {
            ensure!(Instant::now() < until, "the worker never started the job");
            std::thread::sleep(Duration::from_millis(5));
        }
        job.cancel()?;
        job.cancel()?; // twice is once
        std::fs::write(dir.join("go"), b"")?;
        match bounded(job)? {
            Err(Error::JobFailed { worker: w, reason: FailReason::Cancelled, .. }) if w == worker => {}
            other => bail!("expected JobFailed(Cancelled) on {worker}, got {other:?}"),
        }
        ensure!(p.worker(worker).is_some(), "the worker was dropped for a cancel");
        honest_job(&p, worker, x, stream)?;
        p.driver().stream_synchronize(stream)?;
        let used = p.pool().stats()?.used_current;
        ensure!(used == before, "{used} pool bytes in use after the cancel, {before} before it");
        p.stop_worker(worker)?;
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
);

both_drivers!(
    /// 10 000 jobs, each finished properly with a new DONE event: the parent keeps at most
    /// `max_open_done_events` of the worker's events open (the oldest are closed as new ones
    /// come), every job succeeds, and once the worker is gone none is open.
    fn a_worker_churning_done_events_has_at_most_the_bound_open(env) {
        const MAX: usize = 8;
        let p = parent(env, |o| o.max_open_done_events = MAX)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let x = p.pool().alloc(4096, stream)?;
        p.driver().stream_synchronize(stream)?;
        let churn = p.spawn_worker(rogue_command(env, "done-churn")?)?;
        let one = [Input::new(x, Layout::contiguous(DType::U8, &[4096])).read_only()];
        let mut most = 0;
        for i in 0..10_000 {
            match bounded(p.submit(churn, &one, stream)?)? {
                Ok(out) => ensure!(out.results.is_empty(), "job {i} returned results"),
                Err(e) => bail!("job {i} failed: {e}"),
            }
            let open = p.stats().done_events_open;
            most = most.max(open);
            ensure!(open <= MAX as u64, "{open} DONE events open after job {i}, at most {MAX} allowed");
        }
        ensure!(most >= MAX as u64, "at most {most} events were ever open: the churn never reached the bound");
        p.stop_worker(churn)?;
        let open = p.stats().done_events_open;
        ensure!(open == 0, "{open} DONE events still open after the worker was reaped");
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A worker that floods the parent with frames while the parent waits for its staging
    /// setup (4096-result requests, as fast as it can) is condemned at the staging backlog's
    /// bound: its job fails naming the bound, the parent's resident set grew by less than
    /// 64 MiB, and a honest worker beside it serves jobs before and after.
    fn a_worker_flooding_frames_during_staging_is_condemned_at_the_backlog_bound(env) {
        let p = parent(env, |o| {
            // Long enough that a parent without the bound keeps frames past 64 MiB.
            o.staging.timeout = Duration::from_secs(20);
        })?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, MIB, 0x5555_6666, stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let rogue = p.spawn_worker(rogue_command(env, "staging-flood")?)?;
        honest_job(&p, honest, x, stream)?;
        let rss_before = rss()?;

        let r = bounded(p.submit(rogue, &input(x), stream)?)?;
        let grown = rss()?.saturating_sub(rss_before);
        ensure!(grown < 64 * MIB, "the parent's resident set grew by {grown} bytes");
        let detail = expect_bound(r, rogue, Bound::StagingBacklog)?;
        ensure!(detail.contains("backlog"), "the detail does not name the backlog: {detail}");
        ensure!(p.worker(rogue).is_none(), "the condemned worker is still listed");
        honest_job(&p, honest, x, stream)?;
        p.stop_worker(honest)?;
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);
