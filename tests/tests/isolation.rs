//! Isolated workers (`Trust::Isolated`, chosen per worker at spawn, or for every worker by
//! `ParentOptions::isolated`): no handle on the parent's pool. Their inputs cross by arena copy
//! and their results come from the arena; a worker that tries to import the pool from what its
//! `Hello` carried gets nothing, where a trusted worker gets the pool and every tensor lent to
//! it. A trusted and an isolated worker serve one parent side by side.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::OwnedStream;
use poolipc::advanced::transport::Capabilities;
use poolipc::{DType, Input, Layout, Parent, ParentOptions, Rung, Trust};
use poolipc_tests::echo;
use poolipc_tests::{Env, both_drivers, rogue_command, worker_command};

const MIB: u64 = 1 << 20;

/// One MiB of f32, the layout of every tensor lent here.
fn f32_mib() -> Layout {
    Layout::contiguous(DType::F32, &[MIB / 4])
}

fn parent(env: &Env, isolated: bool) -> Result<Parent> {
    let options = ParentOptions {
        device: env.device,
        isolated,
        // The rogue answers no canary job.
        canary: false,
        ..ParentOptions::default()
    };
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

/// Runs the rogue `pool-thief` against `p`, spawned with `trust` (`None`: the parent's
/// default), and returns its report once it is written.
fn thief_report(
    env: &Env,
    p: &Parent,
    x: poolipc::DevicePtr,
    trust: Option<Trust>,
) -> Result<String> {
    let dir = std::env::temp_dir().join(format!(
        "poolipc-isolation-{}-{}-{trust:?}",
        std::process::id(),
        p.options().isolated
    ));
    std::fs::create_dir_all(&dir)?;
    let report = dir.join("report.txt");
    let _ = std::fs::remove_file(&report);
    let mut cmd = rogue_command(env, "pool-thief")?;
    cmd.env("POOLIPC_TEST_REPORT", &report);
    let w = match trust {
        Some(t) => p.spawn_worker_with(cmd, t)?,
        None => p.spawn_worker(cmd)?,
    };
    let owned_stream = OwnedStream::new(p.driver().clone())?;
    let stream = owned_stream.handle();
    // The job fails, or is refused (the rogue answers nothing, and may have exited already):
    // what counts is what it imported.
    let job = p.submit(w, &[Input::new(x, f32_mib()).read_only()], stream);
    if let Ok(h) = job {
        let _ = h.wait();
    }
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(&report).unwrap_or_default();
        let done = text.contains("refused") || text.contains("pointers:");
        if done || Instant::now() > until {
            let _ = p.stop_worker(w);
            let _ = std::fs::remove_dir_all(&dir);
            return Ok(text);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

both_drivers!(
    /// A pool tensor lent to an isolated worker crosses by arena copy, the worker's result comes
    /// from the arena, the bytes are right both ways, and the reason names the isolation.
    fn an_isolated_worker_takes_its_inputs_by_arena_copy_and_its_results_from_the_arena(env) {
        let p = parent(env, true)?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = p.pool().alloc(MIB, stream)?;
        echo::fill_pattern(&*d, x, MIB, 0x1357_9BDF, stream)?;
        d.stream_synchronize(stream)?;
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let info = p.worker(w).ok_or_else(|| anyhow::anyhow!("the worker is not registered"))?;
        ensure!(
            !info.identity.capabilities.contains(Capabilities::POOL_POINTER),
            "an isolated worker said it takes pool pointers: {:?}",
            info.identity.capabilities
        );
        let out = p.run_job(
            w,
            &[Input::new(x, f32_mib()).read_only()],
            stream,
        )?;
        ensure!(out.input_rungs == [Rung::ArenaCopy], "input rungs {:?}", out.input_rungs);
        let why = out.input_reasons[0].clone().unwrap_or_default();
        ensure!(why.contains("isolated"), "the reason does not say why: {why}");
        ensure!(out.results.len() == 1, "{} results", out.results.len());
        let r = &out.results[0];
        ensure!(r.rung == Rung::Arena, "the result took {:?}", r.rung);
        d.stream_synchronize(stream)?;
        echo::verify_echo(&*d, r.ptr, MIB, 0, 0x1357_9BDF, 0).map_err(anyhow::Error::msg)?;
        drop(out);
        p.pool().free(x, stream)?;
        d.stream_synchronize(stream)?;
        // empty_cache rotates the pool (it exported nothing: the canary is off and the worker
        // took no pointer) and gives the arena back; the isolated worker serves on after it.
        let back = p.empty_cache()?;
        ensure!(back.workers_not_answered == 0, "{back:?}");
        let y = p.pool().alloc(MIB, stream)?;
        echo::fill_pattern(&*d, y, MIB, 0x2468_ACE0, stream)?;
        let out = p.run_job(
            w,
            &[Input::new(y, f32_mib())],
            stream,
        )?;
        ensure!(out.input_rungs == [Rung::ArenaCopy], "after empty_cache: {:?}", out.input_rungs);
        d.stream_synchronize(stream)?;
        echo::verify_echo(&*d, out.results[0].ptr, MIB, 0, 0x2468_ACE0, 0).map_err(anyhow::Error::msg)?;
        drop(out);
        p.pool().free(y, stream)?;
        d.stream_synchronize(stream)?;
        ensure!(p.stop_worker(w)?.is_some_and(|s| s.success()), "the worker did not exit cleanly");
        Ok(())
    }
);

/// Lends a pool tensor to the rogue `pool-thief` under a parent that isolates or not, and
/// returns what it reported.
fn thief_against(env: &Env, isolated: bool) -> Result<String> {
    let p = parent(env, isolated)?;
    let d = Arc::clone(p.driver());
    let owned_stream = OwnedStream::new(d.clone())?;
    let stream = owned_stream.handle();
    let x = p.pool().alloc(MIB, stream)?;
    d.memset_d32_async(x, 7, MIB / 4, stream)?;
    d.stream_synchronize(stream)?;
    let report = thief_report(env, &p, x, None)?;
    p.pool().free(x, stream)?;
    d.stream_synchronize(stream)?;
    Ok(report)
}

both_drivers!(
    /// A worker that imports what its Hello carried as a pool, under an isolated parent: it is
    /// refused (a sealed empty memfd is no pool), so no pointer of the parent's reaches it.
    fn a_worker_of_an_isolated_parent_has_no_pool_to_import(env) {
        let report = thief_against(env, true)?;
        ensure!(
            report.contains("pool: refused"),
            "an isolated worker imported something as the pool: {report:?}"
        );
        Ok(())
    }
);

both_drivers!(
    /// The same worker under a parent that shares its pool imports the pool and the tensor
    /// lent to it: what makes the isolated case mean something.
    fn a_worker_of_a_sharing_parent_imports_the_pool_and_its_tensor(env) {
        let report = thief_against(env, false)?;
        ensure!(
            report.contains("pool: imported") && report.contains("pointers: 1 imported"),
            "the worker of a parent that shares its pool did not import it: {report:?}"
        );
        Ok(())
    }
);

/// One parent that shares its pool by default, with an echo worker spawned trusted and one
/// spawned isolated beside it: `(parent, trusted, isolated)`.
fn parent_with_both(env: &Env) -> Result<(Parent, poolipc::WorkerId, poolipc::WorkerId)> {
    let p = parent(env, false)?;
    let trusted = p.spawn_worker_with(worker_command(env, None)?, Trust::Trusted)?;
    let isolated = p.spawn_worker_with(worker_command(env, None)?, Trust::Isolated)?;
    for (w, trust) in [(trusted, Trust::Trusted), (isolated, Trust::Isolated)] {
        let info = p
            .worker(w)
            .ok_or_else(|| anyhow::anyhow!("{w} is not registered"))?;
        ensure!(
            info.trust == trust,
            "{w} says {:?}, spawned {trust:?}",
            info.trust
        );
        ensure!(
            info.identity
                .capabilities
                .contains(Capabilities::POOL_POINTER)
                == (trust == Trust::Trusted),
            "{w} ({trust:?}) says {:?}",
            info.identity.capabilities
        );
    }
    Ok((p, trusted, isolated))
}

/// Lends pool tensor `x` (one MiB, filled with `pattern`) to `w` and checks the rung its input
/// took, the reason given, and the echoed bytes of its result.
fn echo_through(
    p: &Parent,
    w: poolipc::WorkerId,
    x: poolipc::DevicePtr,
    pattern: u32,
    want: Rung,
    stream: poolipc::StreamHandle,
) -> Result<()> {
    let d = Arc::clone(p.driver());
    let out = p.run_job(w, &[Input::new(x, f32_mib()).read_only()], stream)?;
    ensure!(
        out.input_rungs == [want],
        "{w}: input rungs {:?}, want {want:?}",
        out.input_rungs
    );
    match want {
        Rung::PoolPointer => ensure!(
            out.input_reasons[0].is_none(),
            "{w} took a pool pointer with a reason: {:?}",
            out.input_reasons[0]
        ),
        _ => {
            let why = out.input_reasons[0].clone().unwrap_or_default();
            ensure!(
                why.contains("isolated"),
                "{w}: the reason does not say why: {why}"
            );
        }
    }
    ensure!(out.results.len() == 1, "{w}: {} results", out.results.len());
    d.stream_synchronize(stream)?;
    echo::verify_echo(&*d, out.results[0].ptr, MIB, 0, pattern, 0).map_err(anyhow::Error::msg)?;
    drop(out);
    d.stream_synchronize(stream)?;
    Ok(())
}

both_drivers!(
    /// Under one parent, the rogue `pool-thief` spawned isolated is refused the pool, and the
    /// same rogue spawned trusted beside it imports the pool and the tensor lent to it: the
    /// trust is the worker's, not the parent's.
    fn one_parent_refuses_its_pool_to_an_isolated_thief_and_gives_it_to_a_trusted_one(env) {
        let p = parent(env, false)?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = p.pool().alloc(MIB, stream)?;
        d.memset_d32_async(x, 7, MIB / 4, stream)?;
        d.stream_synchronize(stream)?;
        let isolated = thief_report(env, &p, x, Some(Trust::Isolated))?;
        ensure!(
            isolated.contains("pool: refused"),
            "a worker spawned isolated imported something as the pool: {isolated:?}"
        );
        let trusted = thief_report(env, &p, x, Some(Trust::Trusted))?;
        ensure!(
            trusted.contains("pool: imported") && trusted.contains("pointers: 1 imported"),
            "a worker spawned trusted beside it did not import the pool: {trusted:?}"
        );
        p.pool().free(x, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// One pool tensor lent to an isolated and to a trusted echo worker of one parent: the
    /// isolated one takes it by arena copy (the reason says isolated), the trusted one by pool
    /// pointer, and both echo the right bytes.
    fn an_isolated_and_a_trusted_worker_of_one_parent_each_take_their_own_rung(env) {
        let (p, trusted, isolated) = parent_with_both(env)?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = p.pool().alloc(MIB, stream)?;
        echo::fill_pattern(&*d, x, MIB, 0x0BAD_CAFE, stream)?;
        d.stream_synchronize(stream)?;
        echo_through(&p, isolated, x, 0x0BAD_CAFE, Rung::ArenaCopy, stream)?;
        echo_through(&p, trusted, x, 0x0BAD_CAFE, Rung::PoolPointer, stream)?;
        echo_through(&p, isolated, x, 0x0BAD_CAFE, Rung::ArenaCopy, stream)?;
        p.pool().free(x, stream)?;
        d.stream_synchronize(stream)?;
        for w in [trusted, isolated] {
            ensure!(p.stop_worker(w)?.is_some_and(|s| s.success()), "{w} did not exit cleanly");
        }
        Ok(())
    }
);

both_drivers!(
    /// After `empty_cache` rotates the pool (the trusted worker was lent a tensor of it), only
    /// the trusted worker is given the new generation: a tensor of it goes to the trusted one
    /// by pool pointer and to the isolated one, which keeps working, by arena copy.
    fn after_a_rotation_only_the_trusted_worker_is_given_the_new_pool_generation(env) {
        let (p, trusted, isolated) = parent_with_both(env)?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = p.pool().alloc(MIB, stream)?;
        echo::fill_pattern(&*d, x, MIB, 0x1357_9BDF, stream)?;
        d.stream_synchronize(stream)?;
        echo_through(&p, trusted, x, 0x1357_9BDF, Rung::PoolPointer, stream)?;
        p.pool().free(x, stream)?;
        d.stream_synchronize(stream)?;
        let back = p.empty_cache()?;
        ensure!(back.pools_rotated == 1, "the exported pool was not rotated: {back:?}");
        ensure!(back.workers_not_answered == 0, "{back:?}");
        let y = p.pool().alloc(MIB, stream)?;
        echo::fill_pattern(&*d, y, MIB, 0x2468_ACE0, stream)?;
        d.stream_synchronize(stream)?;
        echo_through(&p, isolated, y, 0x2468_ACE0, Rung::ArenaCopy, stream)?;
        echo_through(&p, trusted, y, 0x2468_ACE0, Rung::PoolPointer, stream)?;
        echo_through(&p, isolated, y, 0x2468_ACE0, Rung::ArenaCopy, stream)?;
        p.pool().free(y, stream)?;
        d.stream_synchronize(stream)?;
        for w in [trusted, isolated] {
            ensure!(p.stop_worker(w)?.is_some_and(|s| s.success()), "{w} did not exit cleanly");
        }
        Ok(())
    }
);
