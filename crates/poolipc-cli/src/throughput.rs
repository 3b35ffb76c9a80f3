//! `poolipc bench --workers N`: jobs per second with N workers served at once by one parent,
//! beside one worker, in the same run (issue 24: more workers must give more, not less).
//!
//! Each of `n` threads owns a worker, a stream and one live pool allocation, and runs jobs on
//! it back to back (the allocation lent again each time: no export after the first). The
//! figure is all threads' jobs over the wall time from the first submit to the last job's
//! stream done. Beside it, the parent's IO threads' busy share of that time, per thread
//! (`ParentStats::io_busy_ns`), and their busy microseconds per job: near 100 % the IO
//! threads are what limits the rate (`--io-threads 1,2,4` compares counts). With `--mps`
//! the same table is made plainly and under a private MPS daemon.

use std::process::{Command, ExitCode};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use anyhow::{Context, Result};
use poolipc::{DType, Input, Layout, Parent, ParentOptions, WorkerId};
use poolipc_driver::Driver;

use crate::bench::{Args, human};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The sizes measured: a small tensor (the per-job overhead) and a mid-sized one.
const SIZES: [u64; 2] = [4 * KIB, 64 * MIB];

/// Jobs per thread for a size (after a warm-up of a tenth as many).
fn jobs_for(args: &Args, bytes: u64) -> usize {
    args.iterations
        .unwrap_or(if bytes <= MIB { 400 } else { 100 })
        .max(1)
}

/// The worker counts measured up to `max`: 1, 2, 4, ... and `max` itself.
fn counts(max: usize) -> Vec<usize> {
    let mut v: Vec<usize> = std::iter::successors(Some(1usize), |n| n.checked_mul(2))
        .take_while(|&n| n < max)
        .collect();
    v.push(max);
    v
}

/// What one measurement gives.
struct Rate {
    jobs_per_s: f64,
    /// The IO thread's busy share of the measured time.
    io_busy: f64,
    /// Its busy microseconds per job.
    io_us_per_job: f64,
}

/// One measurement: `n` threads, each on its own worker, `jobs` jobs of `bytes` each.
fn jobs_per_second(
    parent: &Parent,
    d: &Arc<dyn Driver>,
    workers: &[WorkerId],
    n: usize,
    bytes: u64,
    jobs: usize,
    legacy_stream: bool,
) -> Result<Rate> {
    let barrier = Barrier::new(n + 1);
    let desc = Layout::contiguous(DType::U8, &[bytes]);
    std::thread::scope(|s| -> Result<Rate> {
        let mut handles = Vec::with_capacity(n);
        for &w in &workers[..n] {
            let (barrier, desc) = (&barrier, desc.clone());
            handles.push(s.spawn(move || -> Result<()> {
                d.use_device(parent.options().device)?;
                let owned_stream = poolipc_driver::OwnedStream::new(&**d)?;
                let stream = if legacy_stream {
                    poolipc::StreamHandle::NULL
                } else {
                    owned_stream.handle()
                };
                let ptr = parent.pool().alloc(bytes, stream)?;
                d.stream_synchronize(stream)?;
                let input = Input {
                    ptr,
                    desc,
                    read_only: false,
                };
                let run = |count: usize| -> Result<()> {
                    for _ in 0..count {
                        parent.run_job(w, std::slice::from_ref(&input), stream)?;
                    }
                    d.stream_synchronize(stream)?;
                    Ok(())
                };
                run((jobs / 10).max(1))?;
                barrier.wait();
                let measured = run(jobs);
                barrier.wait();
                parent.pool().free(ptr, stream)?;
                d.stream_synchronize(stream)?;
                owned_stream.close()?;
                measured
            }));
        }
        barrier.wait();
        let t = Instant::now();
        let busy_before = parent.stats().io_busy_ns;
        barrier.wait();
        let secs = t.elapsed().as_secs_f64();
        let busy_ns = parent.stats().io_busy_ns.saturating_sub(busy_before);
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a bench thread panicked"))??;
        }
        #[allow(clippy::cast_precision_loss)]
        let (all, busy) = ((n * jobs) as f64, busy_ns as f64);
        Ok(Rate {
            jobs_per_s: all / secs,
            io_busy: busy / 1e9 / secs,
            io_us_per_job: busy / 1e3 / all,
        })
    })
}

/// `poolipc bench --workers N`.
pub(crate) fn run(args: &Args, max_workers: usize) -> Result<ExitCode> {
    anyhow::ensure!(
        (1..=64).contains(&max_workers),
        "--workers {max_workers}: give 1 to 64"
    );
    anyhow::ensure!(
        args.io_threads
            .iter()
            .all(|n| (1..=poolipc::MAX_IO_THREADS).contains(n)),
        "--io-threads {:?}: give counts from 1 to {}",
        args.io_threads,
        poolipc::MAX_IO_THREADS
    );
    if args.mps {
        return run_plain_and_mps(args, max_workers);
    }
    if let [_, _, ..] = args.io_threads[..] {
        // A process has one parent's pool for good: each count runs in a process of its own.
        return run_each_io_threads(args, max_workers);
    }
    let (driver, child_env, which) = crate::demo::open_driver(args.sim, args.device)?;
    let mut rows = Vec::new();
    let io_threads = args.io_threads.first().copied().unwrap_or(1);
    let mps = table(
        args,
        max_workers,
        io_threads,
        (&driver, &child_env, &which),
        &mut rows,
    )?;
    if let Some(path) = &args.json_out {
        let v = serde_json::json!({ "mps_client": mps, "which": which, "rows": rows });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// One table per `--io-threads` count, each from a child `poolipc bench` of its own (the
/// shared pool, once installed, stays with its process).
fn run_each_io_threads(args: &Args, max_workers: usize) -> Result<ExitCode> {
    for &n in &args.io_threads {
        let mut c = bench_child(args, max_workers, &[n])?;
        if let Some(path) = &args.json_out {
            let mut p = path.clone().into_os_string();
            p.push(format!(".io{n}"));
            c.arg("--json-out").arg(p);
        }
        let status = c.status()?;
        anyhow::ensure!(
            status.success(),
            "the run with {n} IO threads failed: {status}"
        );
        println!();
    }
    Ok(ExitCode::SUCCESS)
}

/// The table for one parent with `io_threads` rooms: its rows printed and added to `rows`.
/// Returns whether the parent is an MPS client.
fn table(
    args: &Args,
    max_workers: usize,
    io_threads: usize,
    (driver, child_env, which): (&Arc<dyn Driver>, &Option<(&'static str, String)>, &str),
    rows: &mut Vec<serde_json::Value>,
) -> Result<bool> {
    let options = ParentOptions {
        device: args.device,
        canary: false,
        io_threads,
        ..ParentOptions::default()
    };
    let parent = Parent::new(Arc::clone(driver), options).context("starting the parent")?;
    let mps = parent.mps_client() == Some(true);
    println!(
        "poolipc bench --workers {max_workers} {which}{}, {io_threads} IO thread{}{}",
        if mps { ", an MPS client" } else { "" },
        if io_threads == 1 { "" } else { "s" },
        if args.caller_stream == "legacy" {
            ", callers on the legacy stream"
        } else {
            ""
        }
    );
    let mut workers = Vec::with_capacity(max_workers);
    for i in 0..max_workers {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("__demo-worker")
            .env("POOLIPC_DEMO_DEVICE", args.device.to_string())
            .env("POOLIPC_WORKER_MODE", &args.worker_mode);
        if let Some((k, v)) = child_env {
            cmd.env(k, v);
        }
        workers.push(
            parent
                .spawn_worker(cmd)
                .with_context(|| format!("starting worker {i}"))?,
        );
    }
    // IO busy: the IO threads' working share of the time, per thread (their sum over the
    // threads); near 100 % they limit the rate.
    println!(
        "  {:>8} {:>8} {:>12} {:>10} {:>12} {:>8} {:>10}",
        "size", "workers", "jobs/s", "× one", "µs/job/wkr", "IO busy", "IO µs/job"
    );
    for bytes in SIZES {
        let jobs = jobs_for(args, bytes);
        let mut one = f64::NAN;
        for n in counts(max_workers) {
            let legacy = args.caller_stream == "legacy";
            let r = jobs_per_second(&parent, driver, &workers, n, bytes, jobs, legacy)
                .with_context(|| format!("{n} workers, {bytes} bytes"))?;
            let rate = r.jobs_per_s;
            if n == 1 {
                one = rate;
            }
            #[allow(clippy::cast_precision_loss)]
            let (per, busy) = (1e6 * n as f64 / rate, r.io_busy / io_threads as f64);
            println!(
                "  {:>8} {:>8} {:>12.0} {:>9.2}× {:>12.1} {:>7.0}% {:>10.2}",
                human(bytes),
                n,
                rate,
                rate / one,
                per,
                100.0 * busy,
                r.io_us_per_job
            );
            rows.push(serde_json::json!({
                "bytes": bytes, "workers": n, "jobs_per_s": rate, "vs_one": rate / one,
                "io_threads": io_threads, "io_busy": busy, "io_us_per_job": r.io_us_per_job,
            }));
        }
    }
    for w in workers {
        parent.stop_worker(w)?;
    }
    Ok(mps)
}

/// A child `poolipc bench --workers max_workers` with this run's options and `io_threads`.
fn bench_child(args: &Args, max_workers: usize, io_threads: &[usize]) -> Result<Command> {
    let mut c = Command::new(std::env::current_exe()?);
    c.arg("bench")
        .arg("--device")
        .arg(args.device.to_string())
        .arg("--workers")
        .arg(max_workers.to_string())
        .arg("--worker-mode")
        .arg(&args.worker_mode)
        .arg("--caller-stream")
        .arg(&args.caller_stream)
        .arg("--io-threads")
        .arg(
            io_threads
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
        );
    if let Some(n) = args.iterations {
        c.arg("--iterations").arg(n.to_string());
    }
    if args.sim {
        c.arg("--sim");
    }
    Ok(c)
}

/// The table plainly, then under a private MPS daemon this command starts and stops.
fn run_plain_and_mps(args: &Args, max_workers: usize) -> Result<ExitCode> {
    let child = || bench_child(args, max_workers, &args.io_threads);
    println!("== poolipc bench --workers {max_workers}, plain (no MPS)");
    let status = child()?
        .env_remove(poolipc_driver::mps_env::PIPE_DIRECTORY_ENV)
        .status()?;
    anyhow::ensure!(status.success(), "the plain run failed: {status}");
    let mps = poolipc::mps::PrivateMps::start(&poolipc::mps::MpsOptions {
        accept_shared_gpu_faults: true,
        ..Default::default()
    })?;
    println!();
    println!("== poolipc bench --workers {max_workers} under a private MPS daemon");
    let status = child()?.envs(mps.env()).status();
    mps.shutdown(std::time::Duration::from_secs(30));
    let status = status?;
    anyhow::ensure!(status.success(), "the run under MPS failed: {status}");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::counts;

    #[test]
    fn worker_counts_double_up_to_the_maximum() {
        assert_eq!(counts(1), [1]);
        assert_eq!(counts(4), [1, 2, 4]);
        assert_eq!(counts(6), [1, 2, 4, 6]);
        assert_eq!(counts(8), [1, 2, 4, 8]);
    }
}
