//! Isolated workers (`ParentOptions::isolated`): no handle on the parent's pool. Their inputs
//! cross by arena copy and their results come from the arena; a worker that tries to import
//! the pool from what its `Hello` carried gets nothing, where a worker of a parent that does
//! not isolate gets the pool and every tensor lent to it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use poolipc::{DType, Input, Layout, Parent, ParentOptions, Rung, echo};
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

/// Runs the rogue `pool-thief` against `p` and returns its report once it is written.
fn thief_report(env: &Env, p: &Parent, x: poolipc::DevicePtr) -> Result<String> {
    let dir = std::env::temp_dir().join(format!(
        "poolipc-isolation-{}-{}",
        std::process::id(),
        p.options().isolated
    ));
    std::fs::create_dir_all(&dir)?;
    let report = dir.join("report.txt");
    let _ = std::fs::remove_file(&report);
    let mut cmd = rogue_command(env, "pool-thief")?;
    cmd.env("POOLIPC_TEST_REPORT", &report);
    let w = p.spawn_worker(cmd)?;
    let stream = p.driver().stream_create()?;
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
        let stream = d.stream_create()?;
        let x = p.pool().alloc(MIB, stream)?;
        echo::fill_pattern(&*d, x, MIB, 0x1357_9BDF, stream)?;
        d.stream_synchronize(stream)?;
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let info = p.worker(w).ok_or_else(|| anyhow::anyhow!("the worker is not registered"))?;
        ensure!(
            !info.identity.capabilities.contains(poolipc_transport::Capabilities::POOL_POINTER),
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
    let stream = d.stream_create()?;
    let x = p.pool().alloc(MIB, stream)?;
    d.memset_d32_async(x, 7, MIB / 4, stream)?;
    d.stream_synchronize(stream)?;
    let report = thief_report(env, &p, x)?;
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
