//! The storm: several threads, each with its own worker, lending fresh inputs made by GPU
//! work just before each lend, checking every byte of every answer; without and with random
//! SIGKILLs. On the asynchronous SimDriver a missing wait anywhere on the way shows up as
//! wrong bytes or a recorded violation; on the GPU as wrong bytes.
//!
//! `POOLIPC_STORM_JOBS` sets the jobs per run (default 1000, spread over 4 threads).

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Result, ensure};
use poolipc::advanced::RawDriver;
use poolipc::{Parent, ParentOptions};
use poolipc_tests::echo_jobs::{bytes_input, echoed, filled};
use poolipc_tests::{Env, both_drivers, worker_command};

const THREADS: u64 = 4;

fn jobs() -> u64 {
    std::env::var("POOLIPC_STORM_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// xorshift64: each thread's sizes, patterns and kills, reproducible from its seed.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    wrong: AtomicU64,
    killed: AtomicU64,
    errors: Mutex<Vec<String>>,
}

/// One thread's share: `jobs` echo jobs on its own worker and stream. With `kill_one_in`, a
/// job is followed, with that odds, by a SIGKILL of its worker while it runs.
fn thread_jobs(
    env: &Env,
    p: &Parent,
    seed: u64,
    jobs: u64,
    kill_one_in: Option<u64>,
    tally: &Tally,
) -> Result<()> {
    let d = p.driver();
    // Each thread makes the device's context current for itself, as any CUDA thread must.
    d.use_device(env.device)?;
    let owned_stream = poolipc::advanced::driver::OwnedStream::new(&**d)?;
    let stream = owned_stream.handle();
    let mut rng = seed.max(1);
    let mut worker = p.spawn_worker(worker_command(env, None)?)?;
    for _ in 0..jobs {
        let bytes = 4096 + next(&mut rng) % (252 * 1024);
        let pattern = next(&mut rng) as u32;
        // Fresh GPU work on the caller's stream just before the lend.
        let input = filled(p, bytes, pattern, stream)?;
        let kill = kill_one_in.is_some_and(|k| next(&mut rng).is_multiple_of(k));
        let handle = p.submit(worker, &[bytes_input(input, bytes)], stream)?;
        if kill {
            std::thread::sleep(Duration::from_micros(next(&mut rng) % 2000));
            if let Some(pid) = p.worker(worker).and_then(|w| w.pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(i32::try_from(pid)?),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        match handle.wait() {
            Ok(out) => {
                ensure!(out.results.len() == 1, "{} results", out.results.len());
                let r = &out.results[0];
                let mut got = vec![0u8; usize::try_from(r.bytes)?];
                // On the caller's stream, which the job ordered after the worker's DONE.
                d.memcpy_dtoh_on(&mut got, r.ptr, stream)?;
                if r.bytes == bytes && got == echoed(0, bytes, pattern)? {
                    tally.ok.fetch_add(1, Ordering::Relaxed);
                } else if kill && env.sim.is_some() {
                    // Killed after its DONE and ACK: the simulation drops a dead process's
                    // queued GPU work (the worker's writes with it) and lets waits on its
                    // events go. Whether a real GPU finishes a killed process's submitted work
                    // is not pinned down; learning DONE's completion on the host before
                    // handing out results (the hostile-worker issue) closes this either way.
                    tally.killed.fetch_add(1, Ordering::Relaxed);
                } else {
                    tally.wrong.fetch_add(1, Ordering::Relaxed);
                    let want = echoed(0, bytes, pattern)?;
                    let at = got.iter().zip(&want).position(|(g, w)| g != w);
                    let bad = got.iter().zip(&want).filter(|(g, w)| g != w).count();
                    tally
                        .errors
                        .lock()
                        .map_err(|_| anyhow::anyhow!("poisoned"))?
                        .push(format!(
                            "wrong (kill {kill}): {} of {} bytes (asked {bytes}), first at {at:?}: got {:#04x?} want {:#04x?}, rung {:?}",
                            bad,
                            r.bytes,
                            at.map(|a| got[a]),
                            at.map(|a| want[a]),
                            out.input_rungs
                        ));
                }
                p.pool().free(r.ptr, stream)?;
            }
            Err(_) if kill => {
                tally.killed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tally
                .errors
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?
                .push(e.to_string()),
        }
        p.pool().free(input, stream)?;
        if kill {
            let _ = p.stop_worker(worker);
            worker = p.spawn_worker(worker_command(env, None)?)?;
        }
    }
    p.stop_worker(worker)?;
    d.stream_synchronize(stream)?;
    owned_stream.close()?;
    Ok(())
}

fn storm(env: &Env, kill_one_in: Option<u64>) -> Result<()> {
    let p = Arc::new(Parent::new(
        Arc::clone(&env.driver),
        ParentOptions {
            device: env.device,
            canary: false,
            ..ParentOptions::default()
        },
    )?);
    env.driver.stream_synchronize(poolipc::StreamHandle::NULL)?;
    let base = p.pool().stats()?.used_current;
    let tally = Tally::default();
    let per_thread = jobs() / THREADS;
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (p, tally) = (&p, &tally);
                s.spawn(move || {
                    thread_jobs(env, p, 0x9E37_79B9 + t, per_thread, kill_one_in, tally)
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a storm thread panicked"))??;
        }
        Ok(())
    })?;
    // Every tensor and worker is gone: the pool's used bytes are back where they were.
    let mut used = p.pool().stats()?.used_current;
    for _ in 0..100 {
        if used == base {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        env.driver.stream_synchronize(poolipc::StreamHandle::NULL)?;
        used = p.pool().stats()?.used_current;
    }
    let errors = tally
        .errors
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?;
    let (ok, wrong, killed) = (
        tally.ok.load(Ordering::Relaxed),
        tally.wrong.load(Ordering::Relaxed),
        tally.killed.load(Ordering::Relaxed),
    );
    println!(
        "storm on {:?}, kill 1 in {kill_one_in:?}: {ok} ok, {wrong} wrong, {killed} killed, {} errors; pool used {base} -> {used}",
        env.kind(),
        errors.len()
    );
    if let Some(sim) = &env.sim {
        for v in sim.violations().iter().take(5) {
            println!("violation: {v}");
        }
    }
    ensure!(
        wrong == 0,
        "{wrong} wrong results of {}: {:?}",
        ok + wrong,
        &errors[..errors.len().min(3)]
    );
    ensure!(
        errors.is_empty(),
        "unexpected errors: {:?}",
        &errors[..errors.len().min(5)]
    );
    ensure!(
        ok + killed == per_thread * THREADS,
        "{ok} + {killed} jobs accounted for"
    );
    ensure!(
        used == base,
        "the pool still uses {} bytes after the storm",
        used.saturating_sub(base)
    );
    Ok(())
}

both_drivers!(
    fn a_storm_of_fresh_inputs_over_four_workers_gets_every_byte_right(env) {
        storm(env, None)
    }
);

both_drivers!(
    fn a_storm_with_random_kills_gets_every_surviving_byte_right_and_leaves_nothing(env) {
        storm(env, Some(30))
    }
);
