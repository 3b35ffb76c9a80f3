//! Turns on the GPU without MPS (`Tuning::gpu_turn`): a submit waits while
//! another worker holds the turn with a job in flight, goes once that job ended, and goes
//! anyway when its wait runs out; a worker that keeps its job costs the others one wait, not
//! one a job.
//! Under MPS (or where the driver does not say) there are no turns: the same jobs overlap.

use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::OwnedStream;
use poolipc::{DType, Input, JobWatch, Layout, Parent, ParentOptions, WorkerId};
use poolipc_tests::echo;
use poolipc_tests::{Env, both_drivers, tempdir, worker_command};

const KIB: u64 = 1 << 10;

fn parent(env: &Env, wait: Option<Duration>) -> Result<Arc<Parent>> {
    let options = ParentOptions {
        device: env.device,
        tuning: poolipc::Tuning {
            gpu_turn: wait,
            ..poolipc::Tuning::from_env()
        },
        ..ParentOptions::default()
    };
    Ok(Arc::new(Parent::new(Arc::clone(&env.driver), options)?))
}

/// Whether this parent keeps turns: its driver says it is not an MPS client.
fn keeps_turns(p: &Parent) -> bool {
    p.mps_client() == Some(false)
}

/// One 4 KiB echo job on `worker` from a thread of its own; the thread answers when the job
/// ended, with the result checked and everything freed.
fn job_on_thread(p: &Arc<Parent>, worker: WorkerId, device: u32) -> JoinHandle<Result<()>> {
    let p = Arc::clone(p);
    std::thread::spawn(move || -> Result<()> {
        // A new thread has no current CUDA context: the caller's streams need one.
        p.driver().use_device(device)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let input = p.pool().alloc(4 * KIB, stream)?;
        echo::fill_pattern(&**p.driver(), input, 4 * KIB, 0x0A0B_0C0D, stream)?;
        let out = p.run_job(
            worker,
            &[Input {
                ptr: input,
                desc: Layout::contiguous(DType::U8, &[4 * KIB]),
                read_only: false,
            }],
            stream,
        )?;
        p.driver().stream_synchronize(stream)?;
        ensure!(out.results.len() == 1, "{} results", out.results.len());
        echo::verify_echo(
            &**p.driver(),
            out.results[0].ptr,
            4 * KIB,
            0,
            0x0A0B_0C0D,
            0,
        )
        .map_err(|e| anyhow::anyhow!(e))?;
        p.pool().free(out.results[0].ptr, stream)?;
        p.pool().free(input, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    })
}

/// Waits until `n` gated jobs said they started (a file each in `dir`).
fn started(dir: &Path, n: usize) -> Result<()> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let got = std::fs::read_dir(dir)?.count();
        if got >= n {
            return Ok(());
        }
        ensure!(Instant::now() < until, "{got} of {n} gated jobs started");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Joins a job thread.
fn joined(t: JoinHandle<Result<()>>) -> Result<()> {
    match t.join() {
        Ok(r) => r,
        Err(_) => bail!("a job thread panicked"),
    }
}

/// Waits at most `d` for `t` to end.
fn ends_within(t: &JoinHandle<Result<()>>, d: Duration) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if t.is_finished() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    t.is_finished()
}

/// A gated worker (it holds each job until `go` appears in `dir`) and a plain one.
fn two_workers(env: &Env, p: &Parent, dir: &Path) -> Result<(WorkerId, WorkerId)> {
    let mut cmd = worker_command(env, None)?;
    cmd.env("POOLIPC_TEST_GATE", dir);
    let held = p.spawn_worker(cmd)?;
    let free = p.spawn_worker(worker_command(env, None)?)?;
    Ok((held, free))
}

both_drivers!(
    fn a_job_waits_while_another_workers_job_is_in_flight_and_goes_when_it_ended(env) {
        let p = parent(env, Some(Duration::from_secs(60)))?;
        // The turn in force: asked for, and kept only where the driver says no MPS.
        let kept = keeps_turns(&p).then_some(Duration::from_secs(60));
        ensure!(p.gpu_turn() == kept, "gpu_turn() {:?}, not {kept:?}", p.gpu_turn());
        let dir = tempdir("turns-wait")?;
        let (held, free) = two_workers(env, &p, &dir)?;
        let a = job_on_thread(&p, held, env.device);
        started(&dir, 1)?;
        let b = job_on_thread(&p, free, env.device);
        let b_went = ends_within(&b, Duration::from_millis(400));
        let st = p.stats();
        if keeps_turns(&p) {
            ensure!(!b_went, "the second worker's job ended while the first held the turn");
            ensure!(st.workers_busy == 1, "{} workers busy while one held the turn", st.workers_busy);
        } else {
            ensure!(b_went, "without turns (MPS: {:?}) the second job waited", p.mps_client());
        }
        std::fs::write(dir.join("go"), b"")?;
        joined(a)?;
        joined(b)?;
        let st = p.stats();
        if keeps_turns(&p) {
            ensure!(
                (st.turn_waits, st.turn_waits_ran_out) == (1, 0),
                "turn waits / ran out: {} / {}",
                st.turn_waits,
                st.turn_waits_ran_out
            );
            ensure!(
                st.turn_wait_ns >= 400_000_000,
                "the wait counted {} ns",
                st.turn_wait_ns
            );
            ensure!(st.most_workers_busy == 1, "{} workers were busy at once", st.most_workers_busy);
        } else {
            ensure!(st.turn_waits == 0, "{} turn waits without turns", st.turn_waits);
        }
        for w in [held, free] {
            p.stop_worker(w)?;
        }
        Ok(())
    }
);

both_drivers!(
    fn a_worker_keeping_its_job_costs_the_others_one_wait_and_then_they_go_at_once(env) {
        let turn = Duration::from_millis(75);
        let p = parent(env, Some(turn))?;
        let dir = tempdir("turns-ran-out")?;
        let (held, free) = two_workers(env, &p, &dir)?;
        let a = job_on_thread(&p, held, env.device);
        started(&dir, 1)?;
        // The first waits out two turns (150 ms), then every job after it goes at once while
        // the held job is still in flight.
        let start = Instant::now();
        for i in 0..5 {
            let b = job_on_thread(&p, free, env.device);
            ensure!(
                ends_within(&b, Duration::from_secs(30)),
                "job {i} on the free worker did not end while the other held its job"
            );
            joined(b)?;
        }
        let took = start.elapsed();
        ensure!(!a.is_finished(), "the held job ended without its go");
        let st = p.stats();
        if keeps_turns(&p) {
            ensure!(
                (st.turn_waits, st.turn_waits_ran_out) == (1, 1),
                "turn waits / ran out: {} / {}",
                st.turn_waits,
                st.turn_waits_ran_out
            );
            ensure!(took >= 2 * turn, "five jobs took {took:?}, less than one wait");
            ensure!(st.most_workers_busy == 2, "{} workers were busy at once", st.most_workers_busy);
        } else {
            ensure!(st.turn_waits == 0, "{} turn waits without turns", st.turn_waits);
        }
        std::fs::write(dir.join("go"), b"")?;
        joined(a)?;
        // The held job ended: turns again, the gate closed.
        let b = job_on_thread(&p, free, env.device);
        joined(b)?;
        for w in [held, free] {
            p.stop_worker(w)?;
        }
        Ok(())
    }
);

both_drivers!(
    fn with_turns_off_jobs_of_two_workers_overlap(env) {
        let p = parent(env, None)?;
        ensure!(p.gpu_turn().is_none(), "turns off, yet gpu_turn() {:?}", p.gpu_turn());
        let dir = tempdir("turns-off")?;
        let (held, free) = two_workers(env, &p, &dir)?;
        let a = job_on_thread(&p, held, env.device);
        started(&dir, 1)?;
        let b = job_on_thread(&p, free, env.device);
        ensure!(
            ends_within(&b, Duration::from_secs(30)),
            "with turns off the second job waited for the first"
        );
        joined(b)?;
        std::fs::write(dir.join("go"), b"")?;
        joined(a)?;
        let st = p.stats();
        ensure!(st.turn_waits == 0 && st.most_workers_busy == 2, "{st:?}");
        for w in [held, free] {
            p.stop_worker(w)?;
        }
        Ok(())
    }
);

both_drivers!(
    fn wait_any_gives_the_job_that_ended_first_and_none_when_none_did(env) {
        let p = parent(env, None)?;
        let dir = tempdir("wait-any")?;
        let (held, free) = two_workers(env, &p, &dir)?;
        let d = Arc::clone(p.driver());
        let owned_stream = OwnedStream::new(d.clone())?;
        let stream = owned_stream.handle();
        let mut inputs = Vec::new();
        for _ in 0..2 {
            let ptr = p.pool().alloc(4 * KIB, stream)?;
            echo::fill_pattern(&*d, ptr, 4 * KIB, 0x0102_0304, stream)?;
            inputs.push(Input {
                ptr,
                desc: Layout::contiguous(DType::U8, &[4 * KIB]),
                read_only: false,
            });
        }
        let a = p.submit(held, &inputs[..1], stream)?;
        let b = p.submit(free, &inputs[1..], stream)?;
        // The free worker's job ends; the held one's cannot until its go. A job's end wakes
        // the waiter (not its timeout: 60 s).
        let start = Instant::now();
        let first = JobWatch::wait_any(&[a.watch(), b.watch()], Duration::from_secs(60));
        ensure!(first == Some(1), "wait_any said {first:?}, not the free worker's job");
        ensure!(start.elapsed() < Duration::from_secs(20), "woken after {:?}", start.elapsed());
        let out_b = b.wait()?;
        let start = Instant::now();
        let none = JobWatch::wait_any(&[a.watch()], Duration::from_millis(200));
        ensure!(none.is_none(), "wait_any said {none:?} for a job still held");
        ensure!(start.elapsed() >= Duration::from_millis(200), "it gave up early");
        ensure!(JobWatch::wait_any(&[], Duration::from_secs(1)).is_none());
        std::fs::write(dir.join("go"), b"")?;
        ensure!(JobWatch::wait_any(&[a.watch()], Duration::from_secs(30)) == Some(0));
        let out_a = a.wait()?;
        d.stream_synchronize(stream)?;
        for out in [out_a, out_b] {
            for r in out.results {
                p.pool().free(r.ptr, stream)?;
            }
        }
        for input in inputs {
            p.pool().free(input.ptr, stream)?;
        }
        d.stream_synchronize(stream)?;
        for w in [held, free] {
            p.stop_worker(w)?;
        }
        Ok(())
    }
);
