//! What a worker that hangs, or a bug of the parent's own, must not do to the parent: block the
//! caller's stream, leave a waiter hanging, answer a forked child with silence, or stay listed
//! once it is gone.

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::contract::FailReason;
use poolipc::advanced::driver::{DevicePtr, OwnedStream, StreamHandle};
use poolipc::{DType, Error, Input, Layout, Parent, ParentOptions};
use poolipc_tests::echo;
use poolipc_tests::{Env, both_drivers, worker_command};

const MIB: u64 = 1 << 20;

fn parent(env: &Env, handoff_timeout: Duration) -> Result<Parent> {
    let options = ParentOptions {
        device: env.device,
        handoff_timeout,
        ..ParentOptions::default()
    };
    Ok(Parent::new(Arc::clone(&env.driver), options)?)
}

fn filled(p: &Parent, bytes: u64, pattern: u32, stream: StreamHandle) -> Result<DevicePtr> {
    let ptr = p.pool().alloc(bytes, stream)?;
    echo::fill_pattern(&**p.driver(), ptr, bytes, pattern, stream)?;
    Ok(ptr)
}

fn input(ptr: DevicePtr) -> [Input; 1] {
    [Input {
        ptr,
        desc: Layout::contiguous(DType::F32, &[MIB / 4]),
        read_only: false,
    }]
}

/// A honest job on `worker` on `stream`: it succeeds; its results are freed.
fn honest_job(
    p: &Parent,
    worker: poolipc::WorkerId,
    x: DevicePtr,
    stream: StreamHandle,
) -> Result<()> {
    let out = p.run_job(worker, &input(x), stream)?;
    ensure!(!out.results.is_empty(), "the honest job returned no result");
    for r in &out.results {
        p.pool().free(r.ptr, stream)?;
    }
    p.driver().stream_synchronize(stream)?;
    Ok(())
}

both_drivers!(
    /// The worker's DONE sits behind a kernel that never ends. The parent never makes the
    /// caller's stream wait on it: the job fails at the handoff deadline with
    /// `DeadlineExpired`, the worker is killed and leaves the registry, the caller's stream
    /// takes and finishes new work, the memory goes back, and a honest worker beside it
    /// serves jobs before, during and after.
    fn a_worker_whose_done_never_completes_fails_its_job_at_the_deadline_and_leaves_the_callers_stream_free(env) {
        let timeout = Duration::from_secs(3);
        let p = parent(env, timeout)?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let owned_other = OwnedStream::new(d.clone())?;
        let other = owned_other.handle();
        let baseline = p.pool().stats()?.used_current;
        let x = filled(&p, MIB, 0x1234_5678, stream)?;
        let y = filled(&p, MIB, 0x0BAD_F00D, other)?;
        d.stream_synchronize(stream)?;
        d.stream_synchronize(other)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let hung = p.spawn_worker(worker_command(env, Some("hang-before-done"))?)?;
        honest_job(&p, honest, y, other)?;

        let before = p.pool().stats()?.used_current;
        let job = p.submit(hung, &input(x), stream)?;
        // While the hung job is held, the honest worker goes on.
        honest_job(&p, honest, y, other)?;
        // Bound only: the deadline is `timeout`; a hang of the parent fails here.
        let failed = match job.wait_timeout(timeout * 10) {
            Ok(r) => r,
            Err(_) => bail!("the hung job did not end within ten times its deadline"),
        };
        match failed {
            Err(Error::JobFailed {
                worker,
                reason: FailReason::DeadlineExpired,
                detail,
                ..
            }) => {
                ensure!(worker == hung, "the failure names {worker}, not {hung}");
                ensure!(
                    detail.contains("DONE") && detail.contains("handoff timeout"),
                    "the error does not name the DONE and its deadline: {detail}"
                );
            }
            other => bail!("expected JobFailed(DeadlineExpired), got {other:?}"),
        }
        ensure!(p.worker(hung).is_none(), "the condemned worker is still listed");
        ensure!(p.worker(honest).is_some(), "the honest worker is no longer listed");
        ensure!(p.stats().workers_lost >= 1, "the hung worker was not counted lost");

        // The caller's stream was never made to wait on the worker: new work on it runs.
        d.memset_d32_async(x, 0x5A5A_5A5A, MIB / 4, stream)?;
        d.stream_synchronize(stream)?;
        let mut head = [0u8; 4];
        d.memcpy_dtoh(&mut head, x)?;
        ensure!(head == 0x5A5A_5A5Au32.to_le_bytes(), "the memset after the failed job did not land");

        honest_job(&p, honest, y, other)?;
        // The failed job's results went back: what is in use is what was before it.
        d.stream_synchronize(stream)?;
        let used = p.pool().stats()?.used_current;
        ensure!(used == before, "{used} bytes in use after the failed job, {before} before it");
        p.stop_worker(honest)?;
        p.pool().free(x, stream)?;
        p.pool().free(y, other)?;
        d.stream_synchronize(stream)?;
        d.stream_synchronize(other)?;
        let used = p.pool().stats()?.used_current;
        ensure!(used == baseline, "{used} bytes in use at the end, {baseline} at the start");
        Ok(())
    }
);

both_drivers!(
    /// A worker that sends a host-staged result from behind a kernel that never ends: the
    /// parent waits for its `filled` record on the host, not on the caller's stream, so at
    /// the staging timeout the worker is condemned, the job fails, and the caller's stream
    /// takes new work; a honest worker goes on.
    fn a_worker_whose_staged_chunks_never_fill_is_condemned_and_leaves_the_callers_stream_free(env) {
        let p = Parent::new(
            Arc::clone(&env.driver),
            ParentOptions {
                device: env.device,
                // 2 chunks of 1 MiB stand in for the 128 x 32 MiB rule; no arena copies:
                // a 5 MiB tensor takes host staging both ways.
                limit: poolipc::advanced::pool::ImportLimit::new(MIB, 2).expect("limit"),
                arena_copy: false,
                staging: poolipc::StagingConfig {
                    timeout: Duration::from_secs(3),
                    ..poolipc::StagingConfig::default()
                },
                ..ParentOptions::default()
            },
        )?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let owned_other = OwnedStream::new(d.clone())?;
        let other = owned_other.handle();
        let bytes = 5 * MIB;
        let big = filled(&p, bytes, 0x1357_9BDF, stream)?;
        let y = filled(&p, MIB, 0x0BAD_F00D, other)?;
        d.stream_synchronize(stream)?;
        d.stream_synchronize(other)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let hung = p.spawn_worker(worker_command(env, Some("hang-before-staged-send"))?)?;
        let inputs = [Input {
            ptr: big,
            desc: Layout::contiguous(DType::U8, &[bytes]),
            read_only: true,
        }];
        let before = p.pool().stats()?.used_current;
        match p.run_job(hung, &inputs, stream) {
            Err(Error::JobFailed { worker, detail, .. }) => {
                ensure!(worker == hung, "the failure names {worker}, not {hung}");
                ensure!(
                    detail.contains("did not complete on the GPU"),
                    "the error does not say the staged chunk never completed: {detail}"
                );
            }
            other => bail!("expected the staged job to fail, got {other:?}"),
        }
        ensure!(p.worker(hung).is_none(), "the condemned worker is still listed");
        d.memset_d32_async(big, 0x5A5A_5A5A, bytes / 4, stream)?;
        d.stream_synchronize(stream)?;
        honest_job(&p, honest, y, other)?;
        d.stream_synchronize(stream)?;
        let used = p.pool().stats()?.used_current;
        ensure!(used == before, "{used} bytes in use after the failed job, {before} before it");
        p.stop_worker(honest)?;
        p.pool().free(big, stream)?;
        p.pool().free(y, other)?;
        d.stream_synchronize(stream)?;
        d.stream_synchronize(other)?;
        Ok(())
    }
);

both_drivers!(
    /// A panic on the IO thread (a bug of the loop's, here asked for by the test hook): the
    /// job handle waiting, a stop in flight, and every later call get
    /// `Error::IoThreadStopped` instead of hanging, and dropping the parent returns.
    fn a_panic_on_the_io_thread_answers_every_waiter_with_an_error(env) {
        let p = Arc::new(parent(env, Duration::from_secs(60))?);
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, MIB, 0x1234_5678, stream)?;
        d.stream_synchronize(stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let hung = p.spawn_worker(worker_command(env, Some("hang-before-done"))?)?;
        // A job that will not end on its own for a minute.
        let job = p.submit(hung, &input(x), stream)?;
        p.panic_io_thread();
        let stopper = {
            let p = Arc::clone(&p);
            std::thread::spawn(move || p.stop_worker(honest))
        };
        let bound = Duration::from_secs(30);
        match job.wait_timeout(bound) {
            Ok(Err(Error::IoThreadStopped { .. })) => {}
            Ok(other) => bail!("the job handle got {other:?}, not IoThreadStopped"),
            Err(_) => bail!("the job handle still waits after the IO thread panicked"),
        }
        match stopper.join() {
            Ok(Err(Error::IoThreadStopped { .. })) => {}
            Ok(other) => bail!("stop_worker got {other:?}, not IoThreadStopped"),
            Err(_) => bail!("the stopping thread panicked"),
        }
        ensure!(
            matches!(p.submit(honest, &input(x), stream), Err(Error::IoThreadStopped { .. })),
            "a submit after the panic did not fail with IoThreadStopped"
        );
        ensure!(
            matches!(p.spawn_worker(worker_command(env, None)?), Err(Error::IoThreadStopped { .. })),
            "a spawn after the panic did not fail with IoThreadStopped"
        );
        ensure!(
            matches!(p.empty_cache(), Err(Error::IoThreadStopped { .. })),
            "empty_cache after the panic did not fail with IoThreadStopped"
        );
        let said = match p.submit(honest, &input(x), stream) {
            Err(e) => e.to_string(),
            Ok(_) => bail!("a submit after the panic was taken"),
        };
        ensure!(said.contains("panicked"), "the error does not say the IO thread panicked: {said}");
        // The loop killed and reaped both workers as it unwound; the parent still drops.
        let Ok(p) = Arc::try_unwrap(p) else {
            bail!("the parent is still shared");
        };
        drop(p);
        Ok(())
    }
);

both_drivers!(
    /// A forked child calling the parent's `submit` and `spawn_worker` gets `Error::Forked`
    /// at once (the IO thread is not in the child) instead of waiting for ever.
    fn a_call_from_a_forked_child_fails_at_once_with_forked(env) {
        let p = parent(env, Duration::from_secs(30))?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, MIB, 0x1234_5678, stream)?;
        d.stream_synchronize(stream)?;
        let worker = p.spawn_worker(worker_command(env, None)?)?;
        let cmd = worker_command(env, None)?;
        let (mut theirs, mut ours) = UnixStream::pair()?;
        // SAFETY: the child only calls into `Parent` (whose fork check comes before any lock
        // or driver call), writes two bytes to a socket it owns, and then kills itself with
        // SIGKILL: it never returns into the test harness, runs no atexit handler (the CUDA
        // driver's among them) and touches no state another thread may hold locked.
        match unsafe { nix::unistd::fork() }? {
            nix::unistd::ForkResult::Child => {
                drop(ours);
                let submitted = matches!(p.submit(worker, &input(x), stream), Err(Error::Forked { .. }));
                let spawned = matches!(p.spawn_worker(cmd), Err(Error::Forked { .. }));
                let _ = theirs.write_all(&[u8::from(submitted), u8::from(spawned)]);
                let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
                // SIGKILL does not return; should it, end here all the same.
                std::process::abort();
            }
            nix::unistd::ForkResult::Parent { child } => {
                drop(theirs);
                // Bound only: the child answers at once; a hang fails here.
                ours.set_read_timeout(Some(Duration::from_secs(10)))?;
                let mut said = [0u8; 2];
                let started = Instant::now();
                let read = ours.read_exact(&mut said);
                let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
                let _ = nix::sys::wait::waitpid(child, None);
                read.map_err(|e| anyhow::anyhow!("the forked child did not answer within {:?}: {e}", started.elapsed()))?;
                ensure!(said[0] == 1, "submit in the forked child did not fail with Error::Forked");
                ensure!(said[1] == 1, "spawn_worker in the forked child did not fail with Error::Forked");
            }
        }
        // The parent itself is untouched.
        let out = p.run_job(worker, &input(x), stream)?;
        for r in &out.results {
            p.pool().free(r.ptr, stream)?;
        }
        p.stop_worker(worker)?;
        p.pool().free(x, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);

both_drivers!(
    /// A worker that dies and is reaped without `stop_worker` leaves the registry:
    /// `workers()` lists the living only, `worker(id)` knows it no more, and a job for it is
    /// refused as for an unknown worker.
    fn a_reaped_worker_leaves_the_registry(env) {
        let p = parent(env, Duration::from_secs(30))?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let x = filled(&p, MIB, 0x1234_5678, stream)?;
        d.stream_synchronize(stream)?;
        let honest = p.spawn_worker(worker_command(env, None)?)?;
        let doomed = p.spawn_worker(worker_command(env, Some("before-import"))?)?;
        ensure!(p.workers().len() == 2, "two workers spawned, {} listed", p.workers().len());
        ensure!(p.run_job(doomed, &input(x), stream).is_err(), "the doomed worker's job succeeded");
        let listed: Vec<_> = p.workers().into_iter().map(|w| w.id).collect();
        ensure!(listed == vec![honest], "listed after the reaping: {listed:?}");
        ensure!(p.worker(doomed).is_none(), "the reaped worker is still known");
        ensure!(
            matches!(p.submit(doomed, &input(x), stream), Err(Error::UnknownWorker(w)) if w == doomed),
            "a job for the reaped worker was not refused as unknown"
        );
        p.stop_worker(honest)?;
        ensure!(p.workers().is_empty(), "a stopped worker is still listed");
        p.pool().free(x, stream)?;
        d.stream_synchronize(stream)?;
        Ok(())
    }
);
