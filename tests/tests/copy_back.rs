//! No write into a lent input is lost silently: a worker writes the first 4 KiB of
//! its input in place, on each rung. Lent writable, the parent's tensor shows the write after
//! the job (pool pointer: in place; arena copy: the block copied back after the wait on DONE;
//! host staging: the worker's copy sent back after its Done). Lent read-only, nothing comes
//! back, and on the arena-copy rung the worker's write fails (its block is mapped read-only):
//! the job fails instead of the write vanishing. A read-only input on host staging is the
//! worker's private copy; the test worker ignores the flag and writes it, and the parent's
//! tensor stays as it was (what `Input`'s documentation says happens there).

use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::{OwnedPool, OwnedStream, PoolAllocation, PoolSharing};
use poolipc::advanced::types::{DType, ImportLimit};
use poolipc::{DevicePtr, Error, Input, Layout, Parent, ParentOptions, Rung, StreamHandle};
use poolipc_tests::echo;
use poolipc_tests::echo_jobs::{filled, settle};
use poolipc_tests::{Env, both_drivers, worker_command};

const MIB: u64 = 1 << 20;
/// Not a multiple of anything: the copy-back must cover every byte.
const BYTES: u64 = MIB + 3;
const PATTERN: u32 = 0x1357_9BDF;

/// How the test makes an input take each rung.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// Memory of the shared pool, within the limit.
    PoolPointer,
    /// Memory of the shared pool over a lowered (0-chunk) import limit, arena copy on.
    ArenaCopy,
    /// Memory of a private pool, which no worker can import, with the arena copy off (on,
    /// device memory of the parent's device takes the arena copy, whatever its kind).
    HostStaging,
}

impl Via {
    fn rung(self) -> Rung {
        match self {
            Via::PoolPointer => Rung::PoolPointer,
            Via::ArenaCopy => Rung::ArenaCopy,
            Via::HostStaging => Rung::HostStaging,
        }
    }
}

struct Setup {
    p: Parent,
    stream: StreamHandle,
    src: DevicePtr,
    /// The private pool of a host-staged input and `src`'s allocation in it, freed and
    /// destroyed at the end (in that order).
    private: Option<(PoolAllocation, OwnedPool)>,
    dir: std::path::PathBuf,
}

fn setup(env: &Env, via: Via, tag: &str) -> Result<Setup> {
    setup_with(env, via, tag, poolipc::Tuning::from_env())
}

fn setup_with(env: &Env, via: Via, tag: &str, tuning: poolipc::Tuning) -> Result<Setup> {
    let options = ParentOptions {
        device: env.device,
        canary: false,
        arena_copy: via != Via::HostStaging,
        tuning,
        ..ParentOptions::default()
    };
    let p = Parent::new(Arc::clone(&env.driver), options)?;
    if via == Via::ArenaCopy {
        let limit = p.limits().import;
        p.lower_import_limit(ImportLimit::new(limit.chunk_bytes(), 0).context("limit")?)?;
    }
    let stream = OwnedStream::new(p.driver().clone())?.into_raw();
    let (src, private) = if via == Via::HostStaging {
        let d = p.driver();
        let pool = OwnedPool::create(Arc::clone(d), env.device, PoolSharing::None)?;
        let alloc = PoolAllocation::from_pool(Arc::clone(d), BYTES, pool.handle(), stream)?;
        let ptr = alloc.ptr();
        echo::fill_pattern(&**d, ptr, BYTES, PATTERN, stream)?;
        (ptr, Some((alloc, pool)))
    } else {
        (filled(&p, BYTES, PATTERN, stream)?, None)
    };
    let dir = std::env::temp_dir().join(format!("poolipc-copy-back-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(Setup {
        p,
        stream,
        src,
        private,
        dir,
    })
}

/// What the parent's tensor should hold: the pattern, with the worker's marker over the
/// first 4 KiB when its write came back.
fn expected(written: bool) -> Result<Vec<u8>> {
    let mut want: Vec<u8> = PATTERN
        .to_le_bytes()
        .iter()
        .copied()
        .cycle()
        .take(usize::try_from(BYTES)?)
        .collect();
    if written {
        for w in want[..4096].chunks_exact_mut(4) {
            w.copy_from_slice(&echo::marker(0).to_le_bytes());
        }
    }
    Ok(want)
}

fn check_tensor(s: &Setup, written: bool) -> Result<()> {
    s.p.driver().stream_synchronize(s.stream)?;
    let mut got = vec![0u8; usize::try_from(BYTES)?];
    s.p.driver().memcpy_dtoh(&mut got, s.src)?;
    let want = expected(written)?;
    if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
        bail!(
            "the parent's tensor at byte {at}: {:#04x}, expected {:#04x} ({})",
            got[at],
            want[at],
            if written {
                "the worker's write should have come back"
            } else {
                "it should be as lent"
            }
        );
    }
    Ok(())
}

fn finish(s: Setup, worker: poolipc::WorkerId) -> Result<()> {
    if s.p.arena_stats().is_some() {
        ensure!(settle(&s.p, s.stream)? == 0, "arena blocks still out");
    }
    let d = Arc::clone(s.p.driver());
    match s.private {
        Some((alloc, pool)) => {
            alloc.free(s.stream)?;
            d.stream_synchronize(s.stream)?;
            pool.close()?;
        }
        None => s.p.pool().free(s.src, s.stream)?,
    }
    d.stream_synchronize(s.stream)?;
    let _ = s.p.stop_worker(worker);
    let _ = std::fs::remove_dir_all(&s.dir);
    Ok(())
}

/// A worker that writes its inputs whatever their flag, reporting each view's flag.
fn writer(env: &Env, s: &Setup) -> Result<(poolipc::WorkerId, std::path::PathBuf)> {
    let report = s.dir.join("report");
    let _ = std::fs::remove_file(&report);
    let mut cmd = worker_command(env, None)?;
    cmd.env("POOLIPC_TEST_WRITE_INPUTS", "1")
        .env("POOLIPC_TEST_REPORT", &report);
    Ok((s.p.spawn_worker(cmd)?, report))
}

/// Lent writable on `via`: the job succeeds and the parent's tensor shows the write.
fn a_write_comes_back(env: &Env, via: Via) -> Result<()> {
    a_write_comes_back_with(env, via, poolipc::Tuning::from_env())
}

fn a_write_comes_back_with(env: &Env, via: Via, tuning: poolipc::Tuning) -> Result<()> {
    let through_host = tuning.copy_through_host;
    let s = setup_with(env, via, &format!("{via:?}-rw-{through_host}"), tuning)?;
    let (w, report) = writer(env, &s)?;
    let input = Input::new(s.src, Layout::contiguous(DType::U8, &[BYTES]));
    let out = s.p.run_job(w, &[input], s.stream)?;
    ensure!(out.input_rungs == [via.rung()], "{:?}", out.input_rungs);
    let views = std::fs::read_to_string(&report)?;
    ensure!(
        views
            .trim_end()
            .ends_with(&format!("{:?} false", via.rung())),
        "the worker's view: {views:?}"
    );
    check_tensor(&s, true)?;
    let copied_back = s.p.stats().inputs_copied_back;
    let want = u64::from(via != Via::PoolPointer);
    ensure!(
        copied_back == want,
        "{copied_back} inputs copied back, expected {want}"
    );
    // The copy in and the copy back go through the host where the arena copy's bound takes
    // them and this process is no MPS client; device to device otherwise.
    let host = s.p.stats().copies_through_host;
    let want = if via == Via::ArenaCopy && BYTES <= through_host && s.p.mps_client() != Some(true) {
        2
    } else {
        0
    };
    ensure!(
        host == want,
        "{host} copies through the host, expected {want} (bound {through_host}, MPS {:?})",
        s.p.mps_client()
    );
    finish(s, w)
}

both_drivers!(
    fn a_write_into_a_pool_pointer_input_is_seen_by_the_parent(env) {
        a_write_comes_back(env, Via::PoolPointer)
    }
);

both_drivers!(
    fn a_write_into_an_arena_copied_input_is_copied_back_to_the_parent(env) {
        a_write_comes_back(env, Via::ArenaCopy)
    }
);

both_drivers!(
    fn an_arena_copied_input_goes_device_to_device_when_no_copy_goes_through_the_host(env) {
        let tuning = poolipc::Tuning {
            copy_through_host: 0,
            ..poolipc::Tuning::from_env()
        };
        a_write_comes_back_with(env, Via::ArenaCopy, tuning)
    }
);

both_drivers!(
    fn a_write_into_a_host_staged_input_comes_back_to_the_parent(env) {
        a_write_comes_back(env, Via::HostStaging)
    }
);

both_drivers!(
    fn a_write_into_a_read_only_arena_copied_input_fails_the_job_and_the_tensor_is_as_lent(env) {
        let s = setup(env, Via::ArenaCopy, "ro-arena")?;
        let (w, report) = writer(env, &s)?;
        let input = Input::new(s.src, Layout::contiguous(DType::U8, &[BYTES])).read_only();
        match s.p.run_job(w, &[input], s.stream) {
            Err(e @ (Error::Worker { .. } | Error::JobFailed { .. })) => println!("{:?}: {e}", env.kind()),
            // The simulation's race checker names the write as well.
            Err(Error::SimViolation { during: Some(e), .. })
                if matches!(*e, Error::Worker { .. } | Error::JobFailed { .. }) =>
            {
                println!("{:?}: {e}", env.kind());
            }
            Ok(out) => bail!("the write into a read-only block went through silently: {:?}", out.input_rungs),
            Err(other) => bail!("an unexpected error: {other}"),
        }
        let views = std::fs::read_to_string(&report)?;
        ensure!(views.trim_end().ends_with("ArenaCopy true"), "the worker's view: {views:?}");
        check_tensor(&s, false)?;
        ensure!(s.p.stats().inputs_copied_back == 0, "{:?}", s.p.stats());
        if let Some(sim) = &env.sim {
            // The simulation refused the write as the hardware does, and logged it: expected.
            let v = sim.violations();
            ensure!(
                !v.is_empty() && v.iter().all(|v| format!("{:?}", v.kind) == "NoAccess"),
                "the refused write should be logged as NoAccess, and only it: {v:#?}"
            );
            sim.clear_violations();
        }
        finish(s, w)
    }
);

both_drivers!(
    fn a_read_only_host_staged_input_is_not_copied_back_and_the_worker_is_told(env) {
        let s = setup(env, Via::HostStaging, "ro-staged")?;
        let (w, report) = writer(env, &s)?;
        let input = Input::new(s.src, Layout::contiguous(DType::U8, &[BYTES])).read_only();
        match s.p.run_job(w, &[input], s.stream) {
            // The GPU lets the write into the worker's private copy through.
            Ok(out) if env.sim.is_none() => {
                ensure!(out.input_rungs == [Rung::HostStaging], "{:?}", out.input_rungs);
            }
            // The simulation's race checker names it: the worker wrote an input lent
            // read-only, whatever the rung.
            Err(Error::SimViolation { report, results, .. }) if env.sim.is_some() => {
                ensure!(
                    report.violations.iter().all(|v| v.kind == poolipc::check::ViolationKind::ReadOnlyWritten),
                    "{report}"
                );
                println!("{:?}: {report}", env.kind());
                for r in results {
                    s.p.pool().free(r, s.stream)?;
                }
                if let Some(sim) = &env.sim {
                    // Expected, and checked above.
                    sim.clear_violations();
                }
            }
            other => bail!("{:?}: {other:?}", env.kind()),
        }
        let views = std::fs::read_to_string(&report)?;
        ensure!(views.trim_end().ends_with("HostStaging true"), "the worker's view: {views:?}");
        // The write the worker made anyway changed only its private copy.
        check_tensor(&s, false)?;
        ensure!(s.p.stats().inputs_copied_back == 0, "{:?}", s.p.stats());
        finish(s, w)
    }
);
