//! The direct path ([`poolipc::Tuning::direct`]): a submitting thread that finds its room's
//! IO thread waiting lends its job itself, and a waiting thread reads its worker's answer
//! itself while the IO thread sleeps; the same jobs come out right either way, many threads
//! at once mix both paths without losing or reordering anything, and a deadline still
//! fires on time when a caller lent the job while the IO thread slept.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::OwnedStream;
use poolipc::{Error, FailReason, Parent, ParentOptions, Tuning};
use poolipc_tests::echo_jobs::{bytes_input, check_exact, filled, free_results};
use poolipc_tests::{Env, both_drivers, rogue_command, worker_command};

const KIB: u64 = 1 << 10;

fn parent(env: &Env, tuning: Tuning, handoff_timeout: Duration) -> Result<Parent> {
    Ok(Parent::new(
        Arc::clone(&env.driver),
        ParentOptions {
            device: env.device,
            canary: false,
            handoff_timeout,
            tuning,
            ..ParentOptions::default()
        },
    )?)
}

/// `jobs` echo jobs of 4 KiB on one worker, one after another, `gap` apart, each result
/// checked byte for byte.
fn serial_jobs(p: &Parent, env: &Env, jobs: u32, gap: Duration) -> Result<()> {
    let owned_stream = OwnedStream::new(p.driver().clone())?;
    let stream = owned_stream.handle();
    let w = p.spawn_worker(worker_command(env, None)?)?;
    for i in 0..jobs {
        let pattern = 0x5100_0000 | i;
        let x = filled(p, 4 * KIB, pattern, stream)?;
        let out = p.run_job(w, &[bytes_input(x, 4 * KIB)], stream)?;
        check_exact(p, &out, 0, 4 * KIB, pattern)?;
        free_results(p, out, stream)?;
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        std::thread::sleep(gap);
    }
    p.stop_worker(w)?;
    Ok(())
}

/// [`serial_jobs`] with the direct path on or off: what the stats say of who lent and who
/// read.
fn lends(env: &Env, direct: bool) -> Result<poolipc::ParentStats> {
    // Enough that a caller reads some answers itself on a loaded machine too, where the IO
    // thread, woken by the socket, often gets to the frame first (30 were not, once).
    const JOBS: u32 = 120;
    let tuning = Tuning {
        direct,
        spin: Duration::ZERO,
        spin_in_flight: Duration::from_millis(50),
        ..Tuning::default()
    };
    let p = parent(env, tuning, Duration::from_secs(30))?;
    serial_jobs(&p, env, JOBS, Duration::from_millis(3))?;
    let s = p.stats();
    ensure!(
        s.jobs_completed == u64::from(JOBS) && s.jobs_failed == 0,
        "{s:?}"
    );
    Ok(s)
}

both_drivers!(
    /// Jobs a few milliseconds apart find the IO thread asleep: the caller lends most of
    /// them itself, and, the IO thread not spinning while the caller does, reads some of the
    /// answers itself. Every result is right.
    fn a_caller_lends_its_own_job_while_the_io_thread_waits(env) {
        let s = lends(env, true)?;
        ensure!(
            s.direct_lends >= s.jobs_completed / 2,
            "only {} of {} jobs were lent by their caller: {s:?}",
            s.direct_lends,
            s.jobs_completed
        );
        ensure!(s.direct_reads > 0, "no answer was read by its caller: {s:?}");
        Ok(())
    }
);

both_drivers!(
    /// With the path off (`Tuning::direct`, `POOLIPC_DIRECT=0`) every job goes through the
    /// IO thread, and every result is right.
    fn with_the_path_off_every_job_goes_through_the_io_thread(env) {
        let s = lends(env, false)?;
        ensure!(s.direct_lends == 0 && s.direct_reads == 0, "off, yet {s:?}");
        Ok(())
    }
);

both_drivers!(
    /// Four threads on two workers, each with three jobs in flight at a time: the jobs go
    /// some by the caller and some by the IO thread (whichever holds the room), and every
    /// one of them ends with the right bytes.
    fn many_threads_at_once_mix_both_paths_and_every_job_is_right(env) {
        const THREADS: u32 = 4;
        const ROUNDS: u32 = 15;
        const IN_FLIGHT: u32 = 3;
        let tuning = Tuning {
            direct: true,
            spin: Duration::ZERO,
            spin_in_flight: Duration::from_millis(1),
            ..Tuning::default()
        };
        let p = parent(env, tuning, Duration::from_secs(30))?;
        let workers = [
            p.spawn_worker(worker_command(env, None)?)?,
            p.spawn_worker(worker_command(env, None)?)?,
        ];
        std::thread::scope(|scope| -> Result<()> {
            let mut threads = Vec::new();
            for t in 0..THREADS {
                let p = &p;
                let w = workers[usize::try_from(t)? % workers.len()];
                let device = env.device;
                threads.push(scope.spawn(move || -> Result<()> {
                    // A thread of its own: the device made current, as a CUDA program does.
                    p.driver().use_device(device)?;
                    let owned_stream = OwnedStream::new(p.driver().clone())?;
                    let stream = owned_stream.handle();
                    for round in 0..ROUNDS {
                        let mut jobs = Vec::new();
                        for k in 0..IN_FLIGHT {
                            let pattern = (t << 24) | (round << 8) | k;
                            let x = filled(p, 4 * KIB, pattern, stream)?;
                            jobs.push((p.submit(w, &[bytes_input(x, 4 * KIB)], stream)?, x, pattern));
                        }
                        for (job, x, pattern) in jobs {
                            let out = job.wait()?;
                            check_exact(p, &out, 0, 4 * KIB, pattern)?;
                            free_results(p, out, stream)?;
                            p.pool().free(x, stream)?;
                        }
                        p.driver().stream_synchronize(stream)?;
                    }
                    Ok(())
                }));
            }
            for t in threads {
                t.join().map_err(|_| anyhow::anyhow!("a lending thread panicked"))??;
            }
            Ok(())
        })?;
        let s = p.stats();
        ensure!(s.jobs_completed == u64::from(THREADS * ROUNDS * IN_FLIGHT) && s.jobs_failed == 0, "{s:?}");
        for w in workers {
            p.stop_worker(w)?;
        }
        Ok(())
    }
);

both_drivers!(
    /// A job its caller lent while the IO thread slept (up to half a second, nothing being
    /// due) on a worker that never answers still fails at its handoff deadline, not when the
    /// IO thread would have woken by itself: the caller woke it for the deadline.
    fn a_deadline_of_a_job_lent_by_its_caller_fires_on_time(env) {
        const DEADLINE: Duration = Duration::from_millis(100);
        let tuning = Tuning {
            direct: true,
            spin: Duration::ZERO,
            spin_in_flight: Duration::ZERO,
            ..Tuning::default()
        };
        let p = parent(env, tuning, DEADLINE)?;
        let owned_stream = OwnedStream::new(p.driver().clone())?;
        let stream = owned_stream.handle();
        let rogue = p.spawn_worker(rogue_command(env, "silent")?)?;
        let x = filled(&p, 4 * KIB, 7, stream)?;
        p.driver().stream_synchronize(stream)?;
        // The IO thread falls asleep with nothing due.
        std::thread::sleep(Duration::from_millis(20));
        let t = Instant::now();
        let got = p.run_job(rogue, &[bytes_input(x, 4 * KIB)], stream);
        let took = t.elapsed();
        ensure!(
            matches!(got, Err(Error::JobFailed { reason: FailReason::DeadlineExpired, .. })),
            "{got:?}"
        );
        ensure!(p.stats().direct_lends == 1, "{:?}", p.stats());
        // Asleep until its planned wake-up, it would have failed the job some 480 ms after
        // the submit.
        ensure!(
            took < DEADLINE + Duration::from_millis(250),
            "the job failed {} ms after its submit, its deadline {} ms",
            took.as_millis(),
            DEADLINE.as_millis()
        );
        p.pool().free(x, stream)?;
        p.driver().stream_synchronize(stream)?;
        Ok(())
    }
);
