//! The facade end to end: a parent and a real worker process handing tensors both ways.

use std::sync::Arc;

use anyhow::{Result, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::{DevicePtr, Driver, OwnedStream, StreamHandle};
use poolipc::advanced::pool::ImportLimit;
use poolipc::{DType, Error, Input, Layout, Parent, ParentOptions, Rung};
use poolipc_tests::echo;
use poolipc_tests::{Env, both_drivers, worker_command};

const MIB: u64 = 1 << 20;

fn parent(env: &Env, limit: ImportLimit) -> Result<Parent> {
    let options = ParentOptions {
        device: env.device,
        limit,
        ..ParentOptions::default()
    };
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

/// An allocation from the shared pool filled with a 32-bit pattern.
fn filled(p: &Parent, bytes: u64, pattern: u32, stream: StreamHandle) -> Result<DevicePtr> {
    let ptr = p.pool().alloc(bytes, stream)?;
    echo::fill_pattern(&**p.driver(), ptr, bytes, pattern, stream)?;
    Ok(ptr)
}

fn read(d: &dyn Driver, ptr: DevicePtr, bytes: usize) -> Result<Vec<u8>> {
    let mut v = vec![0u8; bytes];
    d.memcpy_dtoh(&mut v, ptr)?;
    Ok(v)
}

/// A result the echo worker made from input `i`: its marker in the first four bytes, then
/// the input's 32-bit `pattern` as the input had it from `offset` bytes into its allocation.
fn ensure_echoed(got: &[u8], i: usize, pattern: u32, offset: usize, what: &str) -> Result<()> {
    let marker = echo::marker(i).to_le_bytes();
    let n = got.len().min(4);
    ensure!(got[..n] == marker[..n], "{what}: no marker");
    let pat = pattern.to_le_bytes();
    for (k, b) in got.iter().enumerate().skip(4) {
        ensure!(*b == pat[(k + offset) % 4], "{what}: byte {k} is {b:#x}");
    }
    Ok(())
}

struct Case {
    name: &'static str,
    alloc: u64,
    offset: u64,
    desc: Layout,
    pattern: u32,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "f32 1 MiB",
            alloc: MIB,
            offset: 0,
            desc: Layout::contiguous(DType::F32, &[256, 1024]),
            pattern: 0x3F80_0000,
        },
        Case {
            name: "bf16 odd size",
            alloc: 24_690,
            offset: 0,
            desc: Layout::contiguous(DType::BF16, &[12_345]),
            pattern: 0x3F80_3F80,
        },
        Case {
            name: "i64 view at an offset",
            alloc: 3 * MIB,
            offset: MIB + 8,
            desc: Layout::contiguous(DType::I64, &[1000]),
            pattern: 7,
        },
        Case {
            name: "u8 13 bytes",
            alloc: 13,
            offset: 0,
            desc: Layout::contiguous(DType::U8, &[13]),
            pattern: 0x0101_0101,
        },
    ]
}

both_drivers!(
    fn a_job_lends_inputs_of_several_dtypes_and_gets_results_back(env) {
        let p = parent(env, ImportLimit::default())?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let baseline = p.pool().stats()?.used_current;
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let cases = cases();
        let mut allocs = Vec::new();
        let mut inputs = Vec::new();
        for c in &cases {
            let base = filled(&p, c.alloc, c.pattern, stream)?;
            allocs.push(base);
            inputs.push(Input { ptr: base.offset(c.offset), desc: c.desc.clone(), read_only: false });
        }
        for round in 0..2 {
            let out = p.run_job(worker, &inputs, stream)?;
            ensure!(out.input_rungs.iter().all(|r| *r == Rung::PoolPointer), "{:?}", out.input_rungs);
            ensure!(out.results.len() == cases.len(), "{} results", out.results.len());
            d.stream_synchronize(stream)?;
            for (i, (c, r)) in cases.iter().zip(&out.results).enumerate() {
                let bytes = c.desc.extent_bytes()?;
                ensure!(r.bytes == bytes && r.shape.shape == c.desc.shape, "{}: result {r:?}", c.name);
                let got = read(&*d, r.ptr, bytes as usize)?;
                ensure_echoed(&got, i, c.pattern, c.offset as usize, &format!("{} round {round}", c.name))?;
                p.pool().free(r.ptr, stream)?;
            }
        }
        for a in allocs {
            p.pool().free(a, stream)?;
        }
        d.stream_synchronize(stream)?;
        ensure!(p.pool().stats()?.used_current == baseline, "memory left in use: {}", p.pool().stats()?);
        let status = p.stop_worker(worker)?;
        ensure!(status.is_some_and(|s| s.success()), "worker exit: {status:?}");
        Ok(())
    }
);

/// Twenty rounds of `cases()[0]`, each a fresh allocation filled on `stream` with the case's
/// pattern XOR `vary(round)`, lent to `worker` on `stream` (synchronized first where
/// `sync_first(round)`), its echoed result read back and checked byte by byte, both freed.
fn echo_rounds(
    p: &Parent,
    worker: poolipc::WorkerId,
    stream: StreamHandle,
    vary: impl Fn(u32) -> u32,
    sync_first: impl Fn(u32) -> bool,
) -> Result<()> {
    let d = p.driver();
    let c = &cases()[0];
    for round in 0..20u32 {
        let pattern = c.pattern ^ vary(round);
        let base = filled(p, c.alloc, pattern, stream)?;
        if sync_first(round) {
            d.stream_synchronize(stream)?;
        }
        let input = Input {
            ptr: base,
            desc: c.desc.clone(),
            read_only: false,
        };
        let out = p.run_job(worker, std::slice::from_ref(&input), stream)?;
        d.stream_synchronize(stream)?;
        let bytes = c.desc.extent_bytes()?;
        let got = read(&**d, out.results[0].ptr, bytes as usize)?;
        ensure_echoed(&got, 0, pattern, 0, &format!("round {round}"))?;
        p.pool().free(out.results[0].ptr, stream)?;
        p.pool().free(base, stream)?;
    }
    d.stream_synchronize(stream)?;
    Ok(())
}

both_drivers!(
    fn a_worker_that_looks_at_ready_on_the_host_first_gets_every_byte_right(env) {
        // `POOLIPC_WORKER_READY_QUERY=1`: where READY completed already the worker's stream
        // does not wait on it (the turns experiment); on SimDriver every access is still
        // checked against happens-before, so a wait skipped wrongly would be recorded.
        let p = parent(env, ImportLimit::default())?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let mut cmd = worker_command(env, None)?;
        cmd.env("POOLIPC_WORKER_READY_QUERY", "1");
        let worker = p.spawn_worker(cmd)?;
        echo_rounds(&p, worker, stream, |round| round, |_| false)?;
        let status = p.stop_worker(worker)?;
        ensure!(status.is_some_and(|s| s.success()), "worker exit: {status:?}");
        Ok(())
    }
);

both_drivers!(
    fn a_ready_recorded_aside_for_an_idle_stream_orders_the_worker_after_the_callers_writes(env) {
        // When the caller's stream has nothing left to run, READY goes on the IO thread's own
        // stream (`POOLIPC_READY_ASIDE`, on by default; never for an MPS client): the job's
        // inputs are complete, so it orders the worker after them all the same. Every other round the caller's fill may
        // still be running (READY on its stream); SimDriver checks every access.
        let p = parent(env, ImportLimit::default())?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let aside_before = p.stats().ready_recorded_aside;
        echo_rounds(&p, worker, stream, |round| round * 0x0101_0101, |round| round % 2 == 0)?;
        let aside = p.stats().ready_recorded_aside - aside_before;
        println!("{:?}: {aside} of 20 READY recorded aside", env.kind());
        if p.mps_client() == Some(true) {
            ensure!(aside == 0, "an MPS client records READY on the caller's stream, yet {aside} aside");
        } else if p.options().tuning.ready_aside {
            ensure!(aside >= 10, "the 10 rounds after a synchronize found the stream idle: {aside} aside");
        } else {
            ensure!(aside == 0, "POOLIPC_READY_ASIDE=0, yet {aside} aside");
        }
        let status = p.stop_worker(worker)?;
        ensure!(status.is_some_and(|s| s.success()), "worker exit: {status:?}");
        Ok(())
    }
);

both_drivers!(
    fn a_job_on_the_per_thread_default_stream_is_refused_and_the_next_goes_through(env) {
        // The IO thread cannot reach the caller's per-thread default stream: READY would go
        // on its own. Refused at the submit, naming the stream; the worker takes the next job.
        let p = parent(env, ImportLimit::default())?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let base = filled(&p, MIB, 0x0a0b_0c0d, stream)?;
        let input = Input { ptr: base, desc: Layout::contiguous(DType::U8, &[MIB]), read_only: true };
        match p.submit(worker, std::slice::from_ref(&input), StreamHandle::PER_THREAD) {
            Err(Error::InvalidStream(why)) => ensure!(why.contains("CU_STREAM_PER_THREAD"), "{why}"),
            other => anyhow::bail!("a job on CU_STREAM_PER_THREAD: {:?}", other.map(|_| ())),
        }
        let out = p.run_job(worker, std::slice::from_ref(&input), stream)?;
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.pool().free(base, stream)?;
        d.stream_synchronize(stream)?;
        ensure!(p.stats().jobs_failed == 0, "no job failed");
        p.stop_worker(worker)?;
        Ok(())
    }
);

/// A worker killed (SIGKILL) at `step`, twice: the parent survives, the job errs, the pool's
/// used bytes return to the baseline, the next job on a fresh worker succeeds. `after-ack`
/// dies once the job is acknowledged: that job succeeds and the worker's next one fails.
fn killed_at(env: &Env, step: &str) -> Result<()> {
    let p = parent(env, ImportLimit::default())?;
    let d = Arc::clone(p.driver());
    let owned_stream = OwnedStream::new(d.clone())?;
    let stream = owned_stream.handle();
    let baseline = p.pool().stats()?.used_current;
    let input = filled(&p, 4 * MIB, 0x1234_5678, stream)?;
    let inputs = [Input {
        ptr: input,
        desc: Layout::contiguous(DType::F32, &[MIB]),
        read_only: false,
    }];
    for attempt in 0..2 {
        let doomed = p.spawn_worker(worker_command(env, Some(step))?)?;
        let first = p.run_job(doomed, &inputs, stream);
        let failed = if step == "after-ack" {
            let out =
                first.map_err(|e| anyhow::anyhow!("{step}: the acknowledged job failed: {e}"))?;
            d.stream_synchronize(stream)?;
            for r in &out.results {
                p.pool().free(r.ptr, stream)?;
            }
            p.run_job(doomed, &inputs, stream)
        } else {
            first
        };
        match failed {
            Err(Error::JobFailed { .. } | Error::UnknownWorker(_)) => {}
            other => {
                anyhow::bail!("{step} attempt {attempt}: expected the job to fail, got {other:?}")
            }
        }
        d.stream_synchronize(stream)?;
        let used = p.pool().stats()?.used_current;
        ensure!(
            used == baseline + 4 * MIB,
            "{step}: {used} bytes in use after the failed job"
        );
        // The dead worker is busy no more, once it is reaped (its count never leaks).
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while p.stats().workers_busy != 0 {
            ensure!(
                std::time::Instant::now() < until,
                "{step}: {} workers still busy 10 s after the failed job",
                p.stats().workers_busy
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let fresh = p.spawn_worker(worker_command(env, None)?)?;
        let out = p.run_job(fresh, &inputs, stream)?;
        d.stream_synchronize(stream)?;
        for r in &out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.stop_worker(fresh)?;
    }
    p.pool().free(input, stream)?;
    d.stream_synchronize(stream)?;
    ensure!(
        p.pool().stats()?.used_current == baseline,
        "memory left in use"
    );
    Ok(())
}

both_drivers!(
    fn a_worker_killed_before_import_fails_its_job_only(env) {
        killed_at(env, "before-import")
    }
);

both_drivers!(
    fn a_worker_killed_before_waiting_on_ready_fails_its_job_only(env) {
        killed_at(env, "before-ready-wait")
    }
);

both_drivers!(
    fn a_worker_killed_after_import_fails_its_job_only(env) {
        killed_at(env, "after-import")
    }
);

both_drivers!(
    fn a_worker_killed_after_the_result_grant_fails_its_job_only(env) {
        killed_at(env, "after-grant")
    }
);

both_drivers!(
    fn a_worker_killed_after_writing_fails_its_job_only(env) {
        killed_at(env, "after-write")
    }
);

both_drivers!(
    fn a_worker_killed_before_recording_done_fails_its_job_only(env) {
        killed_at(env, "before-done")
    }
);

both_drivers!(
    fn a_worker_killed_between_done_and_ack_fails_its_job_only(env) {
        killed_at(env, "after-done")
    }
);

both_drivers!(
    fn a_worker_killed_after_its_ack_fails_only_its_next_job(env) {
        killed_at(env, "after-ack")
    }
);

both_drivers!(
    fn a_tensor_over_the_import_limit_takes_host_staging_both_ways_and_arrives_intact(env) {
        // A 2-chunk limit of 1 MiB chunks stands in for the 128 × 32 MiB rule. Arena copies
        // off: this is host staging's test (tests/arena_copy.rs has the arena-copy rung's).
        let p = Parent::new(
            Arc::clone(&env.driver),
            ParentOptions {
                device: env.device,
                limit: ImportLimit::new(MIB, 2).expect("limit"),
                arena_copy: false,
                ..ParentOptions::default()
            },
        )?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let baseline = p.pool().stats()?.used_current;
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let report = p.canary_report(worker).expect("the battery ran").clone();
        ensure!(report.ok(), "{report}");
        ensure!(!report.skipped.is_empty(), "over-limit canaries are skipped: {report}");
        // 5 MiB + 3 bytes: over the limit, and not a multiple of the staging chunk.
        let bytes = 5 * MIB + 3;
        let big = filled(&p, bytes, 0x1357_9BDF, stream)?;
        let small = filled(&p, MIB / 2, 0x2468_ACE0, stream)?;
        let inputs = [
            Input { ptr: big, desc: Layout::contiguous(DType::U8, &[bytes]), read_only: false },
            Input { ptr: small, desc: Layout::contiguous(DType::U8, &[MIB / 2]), read_only: false },
        ];
        let out = p.run_job(worker, &inputs, stream)?;
        ensure!(out.input_rungs == vec![Rung::HostStaging, Rung::PoolPointer], "{:?}", out.input_rungs);
        ensure!(out.results[0].rung == Rung::HostStaging, "{:?}", out.results[0]);
        ensure!(out.results[1].rung == Rung::PoolPointer, "{:?}", out.results[1]);
        d.stream_synchronize(stream)?;
        for (i, (r, pattern)) in out.results.iter().zip([0x1357_9BDFu32, 0x2468_ACE0]).enumerate() {
            let got = read(&*d, r.ptr, r.bytes as usize)?;
            ensure_echoed(&got, i, pattern, 0, &format!("result {i}"))?;
            p.pool().free(r.ptr, stream)?;
        }
        p.pool().free(big, stream)?;
        p.pool().free(small, stream)?;
        d.stream_synchronize(stream)?;
        ensure!(p.pool().stats()?.used_current == baseline, "memory left in use: {}", p.pool().stats()?);
        Ok(())
    }
);

both_drivers!(
    fn a_rogue_peer_is_refused_and_the_parent_serves_the_next_worker(env) {
        let p = parent(env, ImportLimit::default())?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        // Not a worker: writes garbage on the inherited socket and exits.
        let mut rogue = std::process::Command::new("sh");
        rogue.args(["-c", "printf 'GARBAGE-NOT-A-FRAME-AT-ALL' >&$POOLIPC_FD; sleep 0.2"]);
        let err = p.spawn_worker(rogue).expect_err("a rogue peer");
        println!("{:?}: rogue peer: {err}", env.kind());
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let input = filled(&p, MIB, 3, stream)?;
        let out = p.run_job(worker, &[Input { ptr: input, desc: Layout::contiguous(DType::U8, &[MIB]), read_only: false }], stream)?;
        d.stream_synchronize(stream)?;
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.pool().free(input, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    fn a_worker_holding_two_jobs_finishes_the_later_first_and_both_complete(env) {
        let p = parent(env, ImportLimit::default())?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let mut cmd = worker_command(env, None)?;
        cmd.env("POOLIPC_TEST_HOLD", "1");
        let worker = p.spawn_worker(cmd)?;
        for round in 0..3u32 {
            let a = filled(&p, MIB, 0xA000 + round, stream)?;
            let b = filled(&p, 4096, 0xB000 + round, stream)?;
            let first = p.submit(worker, &[Input { ptr: a, desc: Layout::contiguous(DType::U8, &[MIB]), read_only: false }], stream)?;
            let second = p.submit(worker, &[Input { ptr: b, desc: Layout::contiguous(DType::U8, &[4096]), read_only: false }], stream)?;
            // The worker finishes `second` before `first`, which it held open meanwhile.
            let out_b = second.wait()?;
            let out_a = first.wait()?;
            d.stream_synchronize(stream)?;
            ensure!(read(&*d, out_a.results[0].ptr, 8)?[4..] == (0xA000 + round).to_le_bytes(), "first job's result");
            ensure!(read(&*d, out_b.results[0].ptr, 8)?[4..] == (0xB000 + round).to_le_bytes(), "second job's result");
            for r in out_a.results.iter().chain(&out_b.results) {
                p.pool().free(r.ptr, stream)?;
            }
            p.pool().free(a, stream)?;
            p.pool().free(b, stream)?;
        }
        d.stream_synchronize(stream)?;
        ensure!(p.stats().jobs_failed == 0, "no job failed");
        p.stop_worker(worker)?;
        Ok(())
    }
);

both_drivers!(
    fn a_worker_started_by_someone_else_connects_to_a_private_socket(env) {
        let p = parent(env, ImportLimit::default())?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let dir = std::env::temp_dir().join(format!("poolipc-test-{}-{:?}", std::process::id(), env.kind()));
        let listener = poolipc::advanced::transport::PrivateListener::bind(&dir, "parent.sock")?;
        // Not spawned through the parent: a plain process told where the socket is.
        let mut cmd = worker_command(env, None)?;
        cmd.env("POOLIPC_SOCKET", listener.path());
        let mut child = cmd.spawn()?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let (conn, cred) = listener.accept(deadline)?;
        ensure!(cred.pid == child.id() as i32, "peer credentials: {cred:?}");
        let worker = p.accept_worker(conn, p.default_trust())?;
        let input = filled(&p, MIB, 0x0BAD_F00D, stream)?;
        let out = p.run_job(worker, &[Input { ptr: input, desc: Layout::contiguous(DType::U8, &[MIB]), read_only: false }], stream)?;
        d.stream_synchronize(stream)?;
        ensure!(read(&*d, out.results[0].ptr, 8)?[4..] == 0x0BAD_F00Du32.to_le_bytes(), "result content");
        p.pool().free(out.results[0].ptr, stream)?;
        p.pool().free(input, stream)?;
        d.stream_synchronize(stream)?;
        p.stop_worker(worker)?;
        ensure!(child.wait()?.success(), "worker exit");
        drop(listener);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
);

both_drivers!(
    fn a_worker_whose_parent_dies_exits_by_itself(env) {
        let mut cmd = std::process::Command::new(poolipc_tests::sibling_binary(
            "poolipc-test-parent",
            "POOLIPC_TEST_PARENT",
        )?);
        if let Some(sim) = &env.sim {
            let (k, v) = sim.child_env();
            cmd.env(k, v);
        }
        let out = cmd.stderr(std::process::Stdio::inherit()).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let pid: i32 = text
            .trim()
            .strip_prefix("worker ")
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("the parent printed {text:?} ({})", out.status))?;
        ensure!(
            std::os::unix::process::ExitStatusExt::signal(&out.status) == Some(9),
            "the parent should have died by SIGKILL: {}",
            out.status
        );
        // The worker sees its connection close and leaves; it is not our child, so watch /proc.
        let t = std::time::Instant::now();
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| s.contains(") Z "))
                .unwrap_or(true);
            if zombie {
                break;
            }
            ensure!(t.elapsed() < std::time::Duration::from_secs(20), "worker {pid} still runs");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        println!("{:?}: worker {pid} left {:?} after its parent died", env.kind(), t.elapsed());
        Ok(())
    }
);

both_drivers!(
    fn the_io_threads_busy_time_grows_with_jobs_and_stays_within_the_wall_time(env) {
        // `ParentStats::io_busy_ns` is what `bench --workers` reads to say whether the one IO
        // thread limits the rate: it must count the work of jobs, and never more than the
        // time that passed.
        let started = std::time::Instant::now();
        let p = parent(env, ImportLimit::default())?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let input = filled(&p, MIB, 3, stream)?;
        let tensor = Input { ptr: input, desc: Layout::contiguous(DType::U8, &[MIB]), read_only: true };
        let before = p.stats().io_busy_ns;
        for _ in 0..20 {
            let out = p.run_job(worker, std::slice::from_ref(&tensor), stream)?;
            for r in out.results {
                p.pool().free(r.ptr, stream)?;
            }
        }
        let after = p.stats().io_busy_ns;
        let wall = started.elapsed().as_nanos();
        println!("{:?}: IO busy {} ns over 20 jobs, {wall} ns since the parent started", env.kind(), after - before);
        ensure!(after > before, "20 jobs took no IO time: {before} -> {after}");
        ensure!(u128::from(after) <= wall, "busy {after} ns is more than the {wall} ns that passed");
        // Idle, the loop waits (spinning counts as waiting): little of 300 ms is busy.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let idle = p.stats().io_busy_ns - after;
        println!("{:?}: IO busy {idle} ns over 300 ms idle", env.kind());
        ensure!(idle < 50_000_000, "idle, the IO thread counted {idle} ns busy in 300 ms");
        p.pool().free(input, stream)?;
        d.stream_synchronize(stream)?;
        p.stop_worker(worker)?;
        Ok(())
    }
);

both_drivers!(
    fn two_io_rooms_serve_four_workers_at_once_and_empty_cache_asks_both(env) {
        // `Tuning::io_threads`: each room (IO thread) serves its own workers with its
        // own contract; every byte must still be right, the counters add up, and
        // `empty_cache` hears from both rooms.
        let options = ParentOptions {
            device: env.device,
            tuning: poolipc::Tuning {
                io_threads: 2,
                ..poolipc::Tuning::from_env()
            },
            ..ParentOptions::default()
        };
        let p = Parent::new(Arc::clone(&env.driver), options)?;
        let workers = (0..4)
            .map(|_| p.spawn_worker(worker_command(env, None)?).map_err(anyhow::Error::from))
            .collect::<Result<Vec<_>>>()?;
        let rooms: std::collections::BTreeSet<usize> = workers.iter().map(|w| w.0 as usize % 2).collect();
        ensure!(rooms.len() == 2, "the four workers are not in both rooms: {workers:?}");
        std::thread::scope(|s| -> Result<()> {
            let handles: Vec<_> = workers
                .iter()
                .enumerate()
                .map(|(t, &w)| {
                    let p = &p;
                    s.spawn(move || -> Result<()> {
                        let d = Arc::clone(p.driver());
                        d.use_device(env.device)?;
                        let owned_stream = OwnedStream::new(d.clone())?;
                        let stream = owned_stream.handle();
                        let pattern = 0x0101_0101 * (t as u32 + 1);
                        let input = filled(p, 64 * 1024, pattern, stream)?;
                        let tensor = Input { ptr: input, desc: Layout::contiguous(DType::U8, &[64 * 1024]), read_only: false };
                        for round in 0..10 {
                            let out = p.run_job(w, std::slice::from_ref(&tensor), stream)?;
                            d.stream_synchronize(stream)?;
                            let r = &out.results[0];
                            echo::verify_echo(&*d, r.ptr, 64 * 1024, 0, pattern, 0)
                                .map_err(|e| anyhow::anyhow!("worker {w} round {round}: {e}"))?;
                            p.pool().free(r.ptr, stream)?;
                        }
                        p.pool().free(input, stream)?;
                        d.stream_synchronize(stream)?;
                        Ok(())
                    })
                })
                .collect();
            for h in handles {
                h.join().map_err(|_| anyhow::anyhow!("a job thread panicked"))??;
            }
            Ok(())
        })?;
        let stats = p.stats();
        ensure!(stats.jobs_completed >= 40 && stats.jobs_failed == 0, "{stats:?}");
        // A tensor lent by pool pointer to a worker of the second room, then freed: its
        // memory comes back only once that worker destroyed its import of the retired pool
        // generation, which only its own room may tell it to (another room must not forget
        // it for it).
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let free_now = || -> Result<u64> {
            d.ctx_synchronize()?;
            Ok(d.mem_get_info()?.0)
        };
        p.empty_cache()?;
        let before = free_now()?;
        let big = 64 * MIB;
        let input = filled(&p, big, 7, stream)?;
        let odd = *workers.iter().find(|w| w.0 % 2 == 1).expect("a worker of room 1");
        let out = p.run_job(odd, &[Input { ptr: input, desc: Layout::contiguous(DType::U8, &[big]), read_only: true }], stream)?;
        ensure!(out.input_rungs == [Rung::PoolPointer], "{:?}", out.input_rungs);
        for r in out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.pool().free(input, stream)?;
        d.stream_synchronize(stream)?;
        let report = p.empty_cache()?;
        ensure!(report.workers_not_answered == 0 && report.pools_retired >= 1, "{report:?}");
        let after = free_now()?;
        ensure!(
            after + 8 * MIB >= before,
            "{} MiB still held after empty_cache ({report:?})",
            before.saturating_sub(after) / MIB
        );
        for w in workers {
            let status = p.stop_worker(w)?;
            ensure!(status.is_some_and(|s| s.success()), "worker {w} exit: {status:?}");
        }
        Ok(())
    }
);
