//! The facade as its users meet it: every fault takes the lost-worker path and spares the
//! other workers, nothing is an error that a rung can carry, jobs run at the same time, and
//! nothing is left behind.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::contract::FailReason;
use poolipc::advanced::driver::{DevicePtr, OwnedPool, OwnedStream, PoolSharing, StreamHandle};
use poolipc::{DType, Error, Input, Layout, Parent, ParentOptions, Rung};
use poolipc_tests::echo;
use poolipc_tests::{Env, both_drivers, open_fds, rogue_command, tempdir, worker_command};

const MIB: u64 = 1 << 20;

fn parent(env: &Env, tweak: impl FnOnce(&mut ParentOptions)) -> Result<Parent> {
    let mut options = ParentOptions {
        device: env.device,
        ..ParentOptions::default()
    };
    tweak(&mut options);
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

/// An allocation from the shared pool filled with a 32-bit pattern.
fn filled(p: &Parent, bytes: u64, pattern: u32, stream: StreamHandle) -> Result<DevicePtr> {
    let ptr = p.pool().alloc(bytes, stream)?;
    echo::fill_pattern(&**p.driver(), ptr, bytes, pattern, stream)?;
    Ok(ptr)
}

/// Checks one echoed result: the worker's marker for input `i`, then the input's pattern.
fn check_echo(p: &Parent, ptr: DevicePtr, bytes: u64, i: usize, pattern: u32) -> Result<()> {
    echo::verify_echo(&**p.driver(), ptr, bytes, i, pattern, 0).map_err(|e| anyhow::anyhow!(e))
}

/// One echo job of a 1 MiB f32 tensor on `worker`; checks the result and frees everything.
fn echo_job(p: &Parent, worker: poolipc::WorkerId, stream: StreamHandle) -> Result<Rung> {
    let input = filled(p, MIB, 0x3F80_0000, stream)?;
    let out = p.run_job(
        worker,
        &[Input {
            ptr: input,
            desc: Layout::contiguous(DType::F32, &[MIB / 4]),
            read_only: false,
        }],
        stream,
    )?;
    p.driver().stream_synchronize(stream)?;
    ensure!(out.results.len() == 1, "{} results", out.results.len());
    check_echo(p, out.results[0].ptr, MIB, 0, 0x3F80_0000)?;
    p.pool().free(out.results[0].ptr, stream)?;
    p.pool().free(input, stream)?;
    p.driver().stream_synchronize(stream)?;
    Ok(out.input_rungs[0])
}

fn violation(env: &Env, mode: &str, want: FailReason) -> Result<()> {
    let p = parent(env, |o| o.canary = false)?;
    let owned_stream = OwnedStream::new(p.driver().clone())?;
    let stream = owned_stream.handle();
    let good = p.spawn_worker(worker_command(env, None)?)?;
    let rogue = p.spawn_worker(rogue_command(env, mode)?)?;
    let input = filled(&p, MIB, 0x0102_0304, stream)?;
    let tensor = Input {
        ptr: input,
        desc: Layout::contiguous(DType::U8, &[MIB]),
        read_only: false,
    };
    match p.run_job(rogue, std::slice::from_ref(&tensor), stream) {
        Err(Error::JobFailed {
            worker,
            reason,
            detail,
            ..
        }) => {
            println!("{mode}: {reason:?}: {detail}");
            ensure!(worker == rogue, "the failure names {worker}");
            ensure!(
                reason == want,
                "{mode}: reason {reason:?}, wanted {want:?} ({detail})"
            );
        }
        other => bail!("{mode}: the rogue's job gave {other:?}"),
    }
    ensure!(
        p.worker(rogue).is_none(),
        "{mode}: the rogue is still registered"
    );
    ensure!(p.stats().workers_lost == 1, "{mode}: {:?}", p.stats());
    // The good worker was never touched, and its jobs run, twice (a deadline sweep in
    // between would have found the rogue's loans).
    for _ in 0..2 {
        ensure!(echo_job(&p, good, stream)? == Rung::PoolPointer);
    }
    p.pool().free(input, stream)?;
    p.driver().stream_synchronize(stream)?;
    let status = p.stop_worker(good)?;
    ensure!(
        status.is_some_and(|s| s.success()),
        "good worker exit: {status:?}"
    );
    Ok(())
}

both_drivers!(
    fn a_result_request_of_the_wrong_length_fails_the_job_and_kills_only_that_worker(env) {
        violation(env, "bad-request-len", FailReason::ProtocolViolation)
    }
);

both_drivers!(
    fn a_done_for_another_job_fails_the_job_and_kills_only_that_worker(env) {
        violation(env, "done-other-job", FailReason::ProtocolViolation)
    }
);

both_drivers!(
    fn an_ack_before_done_fails_the_job_and_kills_only_that_worker(env) {
        violation(env, "ack-before-done", FailReason::ProtocolViolation)
    }
);

both_drivers!(
    fn a_second_hello_ack_fails_the_job_and_kills_only_that_worker(env) {
        violation(env, "second-hello-ack", FailReason::ProtocolViolation)
    }
);

both_drivers!(
    fn a_frame_that_is_no_frame_fails_the_job_and_kills_only_that_worker(env) {
        violation(env, "garbage-frame", FailReason::HungUp)
    }
);

both_drivers!(
    fn a_silent_worker_is_killed_at_its_deadline_and_spares_the_others(env) {
        let p = parent(env, |o| {
            o.canary = false;
            o.handoff_timeout = Duration::from_millis(500);
        })?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let good = p.spawn_worker(worker_command(env, None)?)?;
        let rogue = p.spawn_worker(rogue_command(env, "silent")?)?;
        let input = filled(&p, MIB, 1, stream)?;
        let got = p.run_job(rogue, &[Input { ptr: input, desc: Layout::contiguous(DType::U8, &[MIB]), read_only: false }], stream);
        ensure!(
            matches!(got, Err(Error::JobFailed { reason: FailReason::DeadlineExpired, .. })),
            "{got:?}"
        );
        ensure!(echo_job(&p, good, stream)? == Rung::PoolPointer);
        p.pool().free(input, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(good)?;
        Ok(())
    }
);

both_drivers!(
    fn a_worker_truncating_the_staging_memfd_is_refused_and_the_parent_lives(env) {
        // Before the seals, the rogue's ftruncate made the parent's copy into the buffer a
        // SIGBUS that killed this test process.
        let p = parent(env, |o| o.canary = false)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let good = p.spawn_worker(worker_command(env, None)?)?;
        let rogue = p.spawn_worker(rogue_command(env, "staging-ftruncate")?)?;
        let input = filled(&p, MIB, 0x0102_0304, stream)?;
        let got = p.run_job(
            rogue,
            &[Input { ptr: input, desc: Layout::contiguous(DType::U8, &[MIB]), read_only: false }],
            stream,
        );
        println!("staging-ftruncate: {got:?}");
        ensure!(
            matches!(&got, Err(Error::JobFailed { worker, .. }) if *worker == rogue),
            "{got:?}"
        );
        ensure!(p.worker(rogue).is_none(), "the rogue is still registered");
        ensure!(echo_job(&p, good, stream)? == Rung::PoolPointer);
        p.pool().free(input, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(good)?;
        Ok(())
    }
);

both_drivers!(
    fn a_job_too_large_to_lend_is_refused_at_submit_and_the_worker_takes_the_next(env) {
        let p = parent(env, |o| o.canary = false)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let input = filled(&p, MIB, 0x0102_0304, stream)?;
        let one = |shape: &[u64]| Input {
            ptr: input,
            desc: Layout::contiguous(DType::U8, shape),
            read_only: true,
        };
        let many = vec![one(&[4]); 7000];
        let too_many_dims = [one(&[1; 33])];
        let huge_dim = [one(&[1u64 << 63, 0])];
        for (what, inputs) in [
            ("7000 inputs", &many[..]),
            ("33 dimensions", &too_many_dims[..]),
            ("a dimension above i64::MAX", &huge_dim[..]),
        ] {
            match p.submit(worker, inputs, stream) {
                Err(Error::InvalidTensor(why)) => println!("{what}: {why}"),
                Err(e) => bail!("{what}: {e}"),
                Ok(_) => bail!("{what}: submitted"),
            }
        }
        ensure!(p.stats().workers_lost == 0, "{:?}", p.stats());
        ensure!(echo_job(&p, worker, stream)? == Rung::PoolPointer);
        p.pool().free(input, stream)?;
        p.driver().stream_synchronize(stream)?;
        let status = p.stop_worker(worker)?;
        ensure!(status.is_some_and(|s| s.success()), "worker exit: {status:?}");
        Ok(())
    }
);

both_drivers!(
    fn a_result_request_too_large_to_grant_is_refused_and_the_worker_lives(env) {
        let p = parent(env, |o| o.canary = false)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let good = p.spawn_worker(worker_command(env, None)?)?;
        let rogue = p.spawn_worker(rogue_command(env, "results-too-many")?)?;
        let input = filled(&p, MIB, 0x0102_0304, stream)?;
        let got = p.run_job(
            rogue,
            &[Input { ptr: input, desc: Layout::contiguous(DType::U8, &[MIB]), read_only: false }],
            stream,
        );
        // The rogue reports the refusal as its job's error: it got the grant, alive.
        match got {
            Err(Error::Worker { message, .. }) => ensure!(
                message.contains("refused with limit exceeded") && message.contains("at most 4096"),
                "{message}"
            ),
            other => bail!("the rogue's job gave {other:?}"),
        }
        ensure!(p.stats().workers_lost == 0, "{:?}", p.stats());
        ensure!(echo_job(&p, good, stream)? == Rung::PoolPointer);
        p.pool().free(input, stream)?;
        p.driver().stream_synchronize(stream)?;
        p.stop_worker(good)?;
        let status = p.stop_worker(rogue)?;
        ensure!(status.is_some_and(|s| s.success()), "rogue exit: {status:?}");
        Ok(())
    }
);

both_drivers!(
    fn stop_kills_a_worker_that_ignores_bye_once_the_stop_timeout_passes(env) {
        let p = parent(env, |o| {
            o.canary = false;
            o.stop_timeout = Duration::from_millis(200);
        })?;
        let rogue = p.spawn_worker(rogue_command(env, "ignore-bye")?)?;
        let status = p.stop_worker(rogue)?.context("a spawned worker has an exit status")?;
        use std::os::unix::process::ExitStatusExt as _;
        ensure!(status.signal() == Some(9), "the worker was not killed: {status:?}");
        ensure!(p.worker(rogue).is_none());
        Ok(())
    }
);

both_drivers!(
    /// A caller's allocator that returns less memory than the result needs: the result is
    /// refused (the worker would write past it), the job fails naming the shortfall, the
    /// memory comes back in the job's error as the caller's to free (nothing of it lost),
    /// and the worker takes the next job.
    fn an_allocator_returning_too_little_memory_fails_the_job_and_gives_the_memory_back(env) {
        let p = parent(env, |o| o.canary = false)?;
        let w = p.spawn_worker(worker_command(env, None)?)?;
        let stream = StreamHandle::NULL;
        let input = filled(&p, MIB, 0x3F80_0000, stream)?;
        let used_before = p.pool().stats()?.used_current;
        let (driver, pool) = (Arc::clone(p.driver()), p.pool().handle());
        let alloc: poolipc::ResultAllocator =
            Box::new(move |_, _bytes, s| Ok(driver.mem_alloc_from_pool_async(4096, pool, s)?));
        let job = p
            .submit_with(
                w,
                &[Input::new(input, Layout::contiguous(DType::F32, &[MIB / 4]))],
                stream,
                alloc,
            )
            .and_then(poolipc::JobHandle::wait);
        let (text, given_back) = match job {
            Err(e @ (Error::Worker { .. } | Error::JobFailed { .. })) => {
                let results = match &e {
                    Error::Worker { results, .. } | Error::JobFailed { results, .. } => {
                        results.clone()
                    }
                    _ => Vec::new(),
                };
                (e.to_string(), results)
            }
            other => bail!("expected the job to fail, got {other:?}"),
        };
        ensure!(
            given_back.len() == 1,
            "the error gives back {given_back:?}, not the one allocation ({text})"
        );
        for ptr in given_back {
            p.pool().free(ptr, stream)?;
        }
        p.driver().stream_synchronize(stream)?;
        let used = p.pool().stats()?.used_current;
        ensure!(
            used == used_before,
            "the pool holds {} bytes more after the refused result",
            used.saturating_sub(used_before)
        );
        echo_job(&p, w, stream)?;
        p.pool().free(input, stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A job submitted to a worker that is being stopped fails saying so (`Stopped`, "is
    /// stopping"), not as an unknown worker: the worker is known until it is reaped.
    fn a_job_for_a_worker_being_stopped_fails_as_stopped_naming_it(env) {
        let p = parent(env, |o| {
            o.canary = false;
            o.stop_timeout = Duration::from_secs(2);
        })?;
        let rogue = p.spawn_worker(rogue_command(env, "ignore-bye")?)?;
        let x = filled(&p, 4096, 0x51, StreamHandle::NULL)?;
        let input = [Input::new(x, Layout::contiguous(DType::F32, &[1024]))];
        let detail = std::thread::scope(|s| -> Result<String> {
            let stopping = s.spawn(|| p.stop_worker(rogue));
            // The stop is under way (it waits out the rogue's stop timeout) while the job goes:
            // 300 ms for the IO thread to take the stop (a job sent before it would wait for
            // the rogue's kill instead), then a try every 50 ms.
            std::thread::sleep(Duration::from_millis(250));
            let until = std::time::Instant::now() + Duration::from_secs(1);
            let outcome = loop {
                std::thread::sleep(Duration::from_millis(50));
                let job = p.submit(rogue, &input, StreamHandle::NULL);
                match job.map(|h| h.wait()) {
                    Ok(Err(Error::JobFailed { reason, detail, .. })) => break (reason, detail),
                    other if std::time::Instant::now() > until => {
                        bail!("no job failed as stopped within a second: {other:?}")
                    }
                    _ => {}
                }
            };
            stopping
                .join()
                .map_err(|_| anyhow::anyhow!("the stopping thread panicked"))??;
            ensure!(outcome.0 == FailReason::Stopped, "{outcome:?}");
            Ok(outcome.1)
        })?;
        ensure!(detail.contains("is stopping"), "{detail}");
        p.pool().free(x, StreamHandle::NULL)?;
        Ok(())
    }
);

both_drivers!(
    fn memory_of_another_pool_takes_host_staging_read_only_and_arrives_intact(env) {
        // With the arena copy on, memory of another pool on the parent's device is copied
        // into the arena (tests/device_memory.rs); off, it takes host staging.
        let p = parent(env, |o| o.arena_copy = false)?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let dir = tempdir("staged-views")?;
        let report = dir.join("report");
        let mut cmd = worker_command(env, None)?;
        cmd.env("POOLIPC_TEST_REPORT", &report);
        let worker = p.spawn_worker(cmd)?;
        // Memory the parent's pool never saw: a private pool's, as cuda.core's own would be.
        let other = OwnedPool::create(&*d, env.device, PoolSharing::None)?;
        let foreign_alloc =
            poolipc::advanced::driver::PoolAllocation::from_pool(&*d, MIB, other.handle(), stream)?;
        let foreign = foreign_alloc.ptr();
        echo::fill_pattern(&*d, foreign, MIB, 0x5A5A_0101, stream)?;
        let ours = filled(&p, MIB, 0x0F0F_0F0F, stream)?;
        let desc = Layout::contiguous(DType::F32, &[MIB / 4]);
        let out = p.run_job(
            worker,
            // The foreign one lent read-only: the worker's view says so.
            &[Input { ptr: foreign, desc: desc.clone(), read_only: true }, Input { ptr: ours, desc, read_only: false }],
            stream,
        )?;
        d.stream_synchronize(stream)?;
        ensure!(out.input_rungs == [Rung::HostStaging, Rung::PoolPointer], "{:?}", out.input_rungs);
        check_echo(&p, out.results[0].ptr, MIB, 0, 0x5A5A_0101)?;
        check_echo(&p, out.results[1].ptr, MIB, 1, 0x0F0F_0F0F)?;
        let lines = std::fs::read_to_string(&report)?;
        // Canary jobs are answered inside the worker library: only user jobs are reported.
        let user: Vec<&str> = lines.lines().collect();
        let last_two = &user[user.len().saturating_sub(2)..];
        ensure!(
            last_two.len() == 2
                && last_two[0].ends_with("HostStaging true")
                && last_two[1].ends_with("PoolPointer false"),
            "the worker's views: {lines:?}"
        );
        // The same worker takes the next job as if nothing happened.
        ensure!(echo_job(&p, worker, stream)? == Rung::PoolPointer);
        for r in &out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.pool().free(ours, stream)?;
        foreign_alloc.free(stream)?;
        d.stream_synchronize(stream)?;
        other.close()?;
        p.stop_worker(worker)?;
        Ok(())
    }
);

both_drivers!(
    fn a_refused_tensor_is_an_invalid_tensor_error_and_the_worker_goes_on(env) {
        let p = parent(env, |o| o.canary = false)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let base = filled(&p, MIB, 3, stream)?;
        let negative = Input {
            ptr: base.offset(MIB - 4),
            desc: Layout { dtype: DType::F32, shape: vec![16], strides: vec![-1] },
            read_only: false,
        };
        let got = p.run_job(worker, &[negative], stream);
        ensure!(matches!(got, Err(Error::InvalidTensor(_))), "negative strides: {got:?}");
        let past = Input {
            ptr: base.offset(MIB / 2),
            desc: Layout::contiguous(DType::U8, &[MIB]),
            read_only: false,
        };
        let got = p.run_job(worker, &[past], stream);
        match &got {
            Err(Error::InvalidTensor(why)) => ensure!(why.contains("past its allocation"), "{why}"),
            other => bail!("a view past its allocation: {other:?}"),
        }
        ensure!(echo_job(&p, worker, stream)? == Rung::PoolPointer);
        p.pool().free(base, stream)?;
        p.driver().stream_synchronize(stream)?;
        let status = p.stop_worker(worker)?;
        ensure!(status.is_some_and(|s| s.success()), "{status:?}");
        Ok(())
    }
);

both_drivers!(
    fn jobs_on_two_workers_run_at_the_same_time_from_two_threads(env) {
        let p = Arc::new(parent(env, |_| {})?);
        let dir = tempdir("gate")?;
        let mut workers = Vec::new();
        for _ in 0..2 {
            let mut cmd = worker_command(env, None)?;
            cmd.env("POOLIPC_TEST_GATE", &dir);
            workers.push(p.spawn_worker(cmd)?);
        }
        let mut threads: Vec<_> = workers
            .iter()
            .map(|&w| {
                let p = Arc::clone(&p);
                let device = env.device;
                std::thread::spawn(move || -> Result<Rung> {
                    // A new thread has no current CUDA context: the caller's streams need one.
                    p.driver().use_device(device)?;
                    let owned_stream = OwnedStream::new(p.driver().clone())?;
                    let stream = owned_stream.handle();
                    echo_job(&p, w, stream)
                })
            })
            .collect();
        // Both workers hold a job at once: each said so before either may answer.
        let until = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let started = std::fs::read_dir(&dir)?.count();
            // While they wait, the parent answers without waiting for them.
            for &w in &workers {
                ensure!(p.worker(w).and_then(|i| i.pid).is_some(), "no pid for {w}");
            }
            let _ = p.stats();
            if started >= 2 {
                break;
            }
            if let Some(i) = threads.iter().position(std::thread::JoinHandle::is_finished) {
                let ended = threads.remove(i).join();
                bail!("a job thread ended before both jobs started: {ended:?}");
            }
            ensure!(std::time::Instant::now() < until, "only {started} of 2 jobs started");
            std::thread::sleep(Duration::from_millis(5));
        }
        // Both lent and neither ended: the parent counts two workers busy at once.
        let st = p.stats();
        ensure!(
            (st.workers_busy, st.most_workers_busy) == (2, 2),
            "busy now / at most: {} / {}",
            st.workers_busy,
            st.most_workers_busy
        );
        std::fs::write(dir.join("go"), b"")?;
        for t in threads {
            let rung = t.join().map_err(|_| anyhow::anyhow!("a job thread panicked"))??;
            ensure!(rung == Rung::PoolPointer);
        }
        let st = p.stats();
        ensure!(
            (st.workers_busy, st.most_workers_busy) == (0, 2),
            "after the jobs, busy now / at most: {} / {}",
            st.workers_busy,
            st.most_workers_busy
        );
        for w in workers {
            p.stop_worker(w)?;
        }
        Ok(())
    }
);

both_drivers!(
    fn a_worker_holds_several_jobs_in_flight_and_answers_them_in_order(env) {
        let p = parent(env, |_| {})?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let mut inputs = Vec::new();
        let mut handles = Vec::new();
        for k in 0..4u32 {
            let ptr = filled(&p, MIB, 0x1000_0000 + k, stream)?;
            inputs.push(ptr);
            let input = Input { ptr, desc: Layout::contiguous(DType::U8, &[MIB]), read_only: false };
            handles.push(p.submit(worker, &[input], stream)?);
        }
        for (k, h) in handles.into_iter().enumerate() {
            let out = h.wait()?;
            d.stream_synchronize(stream)?;
            check_echo(&p, out.results[0].ptr, MIB, 0, 0x1000_0000 + k as u32)?;
            p.pool().free(out.results[0].ptr, stream)?;
        }
        for ptr in inputs {
            p.pool().free(ptr, stream)?;
        }
        d.stream_synchronize(stream)?;
        p.stop_worker(worker)?;
        Ok(())
    }
);

both_drivers!(
    fn a_worker_that_dies_during_its_canary_battery_gets_no_id(env) {
        let p = parent(env, |_| {})?;
        let got = p.spawn_worker(rogue_command(env, "exit-on-first-job")?);
        ensure!(got.is_err(), "spawn gave {got:?}");
        println!("spawn refused: {}", got.err().map(|e| e.to_string()).unwrap_or_default());
        ensure!(p.workers().is_empty(), "{:?}", p.workers());
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let w = p.spawn_worker(worker_command(env, None)?)?;
        ensure!(echo_job(&p, w, stream)? == Rung::PoolPointer);
        p.stop_worker(w)?;
        Ok(())
    }
);

both_drivers!(
    /// A worker whose canary battery fails is taken off pool pointers; one that offers no
    /// other rung (no host staging, no arena) is refused at spawn, naming both, instead of
    /// being spawned to refuse every job, and what its battery allocated is back in the pool
    /// (also the results it asked for beyond its inputs). One that offers host staging is
    /// spawned, demoted.
    fn a_worker_failing_its_canary_with_no_other_rung_is_refused_at_spawn(env) {
        let p = parent(env, |o| o.arena_copy = false)?;
        p.driver().stream_synchronize(StreamHandle::NULL)?;
        let used_before = p.pool().stats()?.used_current;
        let refused = p.spawn_worker(rogue_command(env, "canary-fail")?);
        let text = match refused {
            Err(e @ Error::NoRung(_)) => e.to_string(),
            other => bail!("expected a NoRung refusal at spawn, got {other:?}"),
        };
        println!("spawn refused: {text}");
        ensure!(
            text.contains("canary battery") && text.contains("neither host staging nor the arena"),
            "{text}"
        );
        ensure!(p.workers().is_empty(), "{:?}", p.workers());
        // One asking for a result more than its canaries' inputs: refused too, and its
        // results are given back as well (they were left in the pool).
        let mut cmd = rogue_command(env, "canary-fail")?;
        cmd.env("POOLIPC_TEST_ROGUE_EXTRA", "1");
        ensure!(p.spawn_worker(cmd).is_err(), "the rogue with extra results was spawned");
        p.driver().stream_synchronize(StreamHandle::NULL)?;
        let used = p.pool().stats()?.used_current;
        ensure!(
            used == used_before,
            "the pool holds {} bytes more after two failed canary batteries",
            used.saturating_sub(used_before)
        );
        let mut cmd = rogue_command(env, "canary-fail")?;
        cmd.env("POOLIPC_TEST_ROGUE_STAGING", "1");
        let demoted = p.spawn_worker(cmd)?;
        let report = p
            .canary_report(demoted)
            .context("the demoted worker has no canary report")?;
        ensure!(!report.ok(), "the battery passed: {report}");
        p.stop_worker(demoted)?;
        Ok(())
    }
);

both_drivers!(
    fn killed_workers_leave_no_descriptors_behind(env) {
        let p = parent(env, |o| o.canary = false)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let input = filled(&p, MIB, 9, stream)?;
        let tensor = Input { ptr: input, desc: Layout::contiguous(DType::U8, &[MIB]), read_only: false };
        // One round first, so that whatever is opened once per process is open.
        let kill_one = |p: &Parent| -> Result<()> {
            let w = p.spawn_worker(worker_command(env, Some("after-import"))?)?;
            let got = p.run_job(w, std::slice::from_ref(&tensor), stream);
            ensure!(matches!(got, Err(Error::JobFailed { .. })), "{got:?}");
            Ok(())
        };
        kill_one(&p)?;
        let before = open_fds()?;
        for _ in 0..5 {
            kill_one(&p)?;
        }
        // The thread that copies a worker's stderr closes its end when it reads EOF, just
        // after the worker died: give it a moment, then nothing may be left open.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let mut after = open_fds()?;
        while after > before && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(10));
            after = open_fds()?;
        }
        ensure!(after <= before, "{before} descriptors before 5 killed workers, {after} after");
        p.pool().free(input, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);

/// A worker whose kernel faults: without MPS the fault stays in the worker (its job fails
/// with the driver's error, other workers and the parent go on); under MPS it ends every
/// client's context, and the parent says so, naming MPS and the worker, and refuses all
/// further work instead of handing out results it cannot trust.
fn gpu_fault(env: &Env) -> Result<()> {
    let p = parent(env, |o| o.canary = false)?;
    let owned_stream = OwnedStream::new(p.driver().clone())?;
    let stream = owned_stream.handle();
    let good = p.spawn_worker(worker_command(env, None)?)?;
    let mut cmd = worker_command(env, None)?;
    cmd.env("POOLIPC_TEST_GPU_FAULT", "1");
    let faulty = p.spawn_worker(cmd)?;
    ensure!(echo_job(&p, good, stream)? == Rung::PoolPointer);
    let input = filled(&p, MIB, 0x0102_0304, stream)?;
    let tensor = Input {
        ptr: input,
        desc: Layout::contiguous(DType::U8, &[MIB]),
        read_only: false,
    };
    let got = p.run_job(faulty, std::slice::from_ref(&tensor), stream);
    let mps = p.mps_client() == Some(true);
    println!("mps client: {mps}; the faulty worker's job: {got:?}");
    if mps {
        let Err(e @ Error::ContextLost { .. }) = got else {
            bail!("under MPS a worker's GPU fault must end in ContextLost, got {got:?}");
        };
        let text = e.to_string();
        ensure!(text.contains("MPS client"), "does not name MPS: {text}");
        ensure!(
            text.contains(&faulty.to_string()),
            "does not name {faulty}: {text}"
        );
        ensure!(
            p.context_lost().is_some(),
            "the parent does not say it is lost"
        );
        // Everything after is refused cleanly, naming the cause.
        match p.run_job(good, std::slice::from_ref(&tensor), stream) {
            Err(Error::ContextLost { detail }) => ensure!(detail == text, "{detail}"),
            other => bail!("a job after the loss: {other:?}"),
        }
        match p.spawn_worker(worker_command(env, None)?) {
            Err(Error::ContextLost { .. }) => {}
            other => bail!("a worker after the loss: {other:?}"),
        }
        // The parent's memory is gone with its context: nothing to free.
        return Ok(());
    }
    // The worker cannot free its imports on a dead context, so it cannot answer by the
    // contract: it exits, and its job fails as a lost worker's (or with its error, where it
    // managed to send one).
    match got {
        Err(Error::Worker { message, .. }) => ensure!(
            message.contains("ILLEGAL_ADDRESS"),
            "the worker's error: {message}"
        ),
        Err(Error::JobFailed { worker, reason, .. }) => ensure!(
            worker == faulty && reason == FailReason::HungUp,
            "failed on {worker}: {reason:?}"
        ),
        other => bail!("without MPS the faulty worker's job must fail, got {other:?}"),
    }
    ensure!(p.context_lost().is_none(), "{:?}", p.context_lost());
    // The parent and the other worker go on.
    ensure!(echo_job(&p, good, stream)? == Rung::PoolPointer);
    p.pool().free(input, stream)?;
    p.driver().stream_synchronize(stream)?;
    p.stop_worker(good)?;
    Ok(())
}

both_drivers!(
    fn a_worker_gpu_fault_is_contained_or_named(env) {
        gpu_fault(env)
    }
);

#[test]
fn under_simulated_mps_a_worker_gpu_fault_ends_the_parent_context_and_is_named() {
    poolipc_tests::init_tracing();
    let env = Env::sim_with(poolipc::advanced::driver::sim::SimConfig {
        mps: true,
        ..Default::default()
    })
    .expect("SimDriver");
    gpu_fault(&env).expect("gpu fault under simulated MPS");
}
