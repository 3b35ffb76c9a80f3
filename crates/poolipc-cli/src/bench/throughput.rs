//! `poolipc bench --workers N`: jobs per second with N workers served at once by one parent,
//! beside one worker, in the same run (more workers must give more, not less).
//!
//! Each of `n` threads owns a worker, a stream and one live pool allocation, and runs jobs on
//! it back to back (the allocation lent again each time: no export after the first), for
//! 300 ms after a warm-up (`--iterations N`: N jobs each instead). The figure is all
//! threads' jobs over the wall time from the first submit to the last job's stream done.
//! Beside it, the parent's IO threads' busy share of that time, per thread
//! (`ParentStats::io_busy_ns`), and their busy microseconds per job: near 100 % the IO
//! threads are what limits the rate (`--io-threads 1,2,4` compares counts). With `--mps`
//! the same table is made plainly and under a private MPS daemon.

use std::collections::BTreeSet;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use poolipc::advanced::driver::Driver;
use poolipc::{DType, Input, Layout, Parent, ParentOptions, Rung, WorkerId};

use super::{Args, human};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The sizes measured: a small tensor (the per-job overhead) and a mid-sized one.
const SIZES: [u64; 2] = [4 * KIB, 64 * MIB];

/// How long each measurement runs without `--iterations`: long enough that one worker's rate
/// holds still from run to run (a fixed 400 jobs lasted 10 ms under MPS, and one worker's
/// jobs/s, the ratios' base, moved between 20k and 47k from table to table: H100,
/// 2026-12-05).
const WINDOW: Duration = Duration::from_millis(300);

/// Jobs per thread before each measurement.
const WARM_UP_JOBS: usize = 40;

/// How much each thread runs in one measurement.
#[derive(Clone, Copy)]
enum Span {
    /// This many jobs each (`--iterations`).
    Jobs(usize),
    /// Jobs back to back until this much time passed.
    Window(Duration),
}

/// The measurement's span: `--iterations` jobs a thread, else [`WINDOW`].
fn span_for(args: &Args) -> Span {
    args.iterations
        .map_or(Span::Window(WINDOW), |n| Span::Jobs(n.max(1)))
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
    /// The rungs the measured jobs' inputs took (pool pointer, unless a worker was demoted).
    rungs: BTreeSet<String>,
}

/// One worker count's row over the rounds: medians, and its ratio to one worker taken within
/// each round (the count's rate over one worker's of the same round).
struct Summary {
    rate: f64,
    vs_one: f64,
    vs_one_min: f64,
    vs_one_max: f64,
    io_busy: f64,
    io_us_per_job: f64,
    rungs: BTreeSet<String>,
}

impl Summary {
    /// `rates` and `ones` (one worker's), one per round, in round order.
    fn of(rates: &[Rate], ones: &[Rate]) -> Summary {
        let mut ratios: Vec<f64> = rates
            .iter()
            .zip(ones)
            .map(|(r, o)| r.jobs_per_s / o.jobs_per_s)
            .collect();
        ratios.sort_by(f64::total_cmp);
        Summary {
            rate: median(rates.iter().map(|r| r.jobs_per_s)),
            vs_one: median(ratios.iter().copied()),
            vs_one_min: ratios.first().copied().unwrap_or(f64::NAN),
            vs_one_max: ratios.last().copied().unwrap_or(f64::NAN),
            io_busy: median(rates.iter().map(|r| r.io_busy)),
            io_us_per_job: median(rates.iter().map(|r| r.io_us_per_job)),
            rungs: rates.iter().flat_map(|r| r.rungs.iter().cloned()).collect(),
        }
    }
}

/// The median of `values` (the mean of the middle two for an even count; NaN for none).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// One measurement: `n` threads, each on its own worker, jobs of `bytes` for `span`.
fn jobs_per_second(
    parent: &Parent,
    d: &Arc<dyn Driver>,
    workers: &[WorkerId],
    n: usize,
    bytes: u64,
    span: Span,
    legacy_stream: bool,
) -> Result<Rate> {
    let barrier = Barrier::new(n + 1);
    let stop = AtomicBool::new(false);
    let desc = Layout::contiguous(DType::U8, &[bytes]);
    std::thread::scope(|s| -> Result<Rate> {
        let mut handles = Vec::with_capacity(n);
        for &w in &workers[..n] {
            let (barrier, desc, stop) = (&barrier, desc.clone(), &stop);
            handles.push(s.spawn(move || -> Result<(usize, BTreeSet<String>)> {
                // Every thread passes both barriers whatever happens to it (one that returned
                // early would leave the others and the timer waiting for ever); its first
                // error is returned after them.
                let state = (|| -> Result<_> {
                    d.use_device(parent.options().device)?;
                    let owned_stream = poolipc::advanced::driver::OwnedStream::new(&**d)?;
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
                    Ok((owned_stream, stream, input))
                })();
                // Jobs until `count` or, without one, until `stop`: how many, and the rungs
                // their inputs took.
                let run = |input: &Input,
                           stream,
                           count: Option<usize>|
                 -> Result<(usize, BTreeSet<String>)> {
                    let (mut done, mut rungs) = (0, BTreeSet::new());
                    while count.map_or(!stop.load(Ordering::Relaxed), |c| done < c) {
                        let out = parent.run_job(w, std::slice::from_ref(input), stream)?;
                        rungs.extend(out.input_rungs.iter().map(ToString::to_string));
                        done += 1;
                    }
                    d.stream_synchronize(stream)?;
                    Ok((done, rungs))
                };
                let warm = match &state {
                    Ok((_, stream, input)) => run(input, *stream, Some(WARM_UP_JOBS)).map(|_| ()),
                    Err(_) => Ok(()),
                };
                barrier.wait();
                let measured = match (&state, warm) {
                    (Ok((_, stream, input)), Ok(())) => run(
                        input,
                        *stream,
                        match span {
                            Span::Jobs(n) => Some(n),
                            Span::Window(_) => None,
                        },
                    ),
                    (_, Err(e)) => Err(e),
                    // Returned below, after the barrier: the setup's own error.
                    (Err(_), Ok(())) => Ok((0, BTreeSet::new())),
                };
                barrier.wait();
                let (owned_stream, stream, input) = state?;
                parent.pool().free(input.ptr, stream)?;
                d.stream_synchronize(stream)?;
                owned_stream.close()?;
                measured
            }));
        }
        barrier.wait();
        let t = Instant::now();
        let busy_before = parent.stats().io_busy_ns;
        if let Span::Window(window) = span {
            std::thread::sleep(window);
            stop.store(true, Ordering::Relaxed);
        }
        barrier.wait();
        let secs = t.elapsed().as_secs_f64();
        let busy_ns = parent.stats().io_busy_ns.saturating_sub(busy_before);
        let (mut jobs, mut rungs) = (0usize, BTreeSet::new());
        for h in handles {
            let (done, took) = h
                .join()
                .map_err(|_| anyhow::anyhow!("a bench thread panicked"))??;
            jobs += done;
            rungs.extend(took);
        }
        #[allow(clippy::cast_precision_loss)]
        let (all, busy) = (jobs as f64, busy_ns as f64);
        Ok(Rate {
            jobs_per_s: all / secs,
            io_busy: busy / 1e9 / secs,
            io_us_per_job: busy / 1e3 / all,
            rungs,
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
        (1..=20).contains(&args.rounds),
        "--rounds {}: give 1 to 20",
        args.rounds
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
    let io_threads = args
        .io_threads
        .first()
        .copied()
        .unwrap_or_else(|| poolipc::ParentOptions::default().tuning.io_threads);
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
        canary: args.prime.iter().any(|p| p == "canary"),
        tuning: poolipc::Tuning {
            io_threads,
            ..poolipc::Tuning::from_env()
        },
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
    if let Some(report) = workers.first().and_then(|&w| parent.canary_report(w)) {
        println!("  the first worker's canary battery: {report}");
    }
    prime(args, &parent, driver, &workers)?;
    // IO busy: the IO threads' working share of the time, per thread (their sum over the
    // threads); near 100 % they limit the rate.
    let rounds = args.rounds;
    println!(
        "  {:>8} {:>8} {:>12} {:>10} {:>12} {:>8} {:>10}{}",
        "size",
        "workers",
        "jobs/s",
        "× one",
        "µs/job/wkr",
        "IO busy",
        "IO µs/job",
        if rounds > 1 { "   × one, range" } else { "" }
    );
    let span = span_for(args);
    let legacy = args.caller_stream == "legacy";
    for bytes in SIZES {
        let ns = counts(max_workers);
        // measured[i][round]: count ns[i] in that round.
        let mut measured: Vec<Vec<Rate>> = ns.iter().map(|_| Vec::with_capacity(rounds)).collect();
        for _ in 0..rounds {
            for (i, &n) in ns.iter().enumerate() {
                let r = jobs_per_second(&parent, driver, &workers, n, bytes, span, legacy)
                    .with_context(|| format!("{n} workers, {bytes} bytes"))?;
                measured[i].push(r);
            }
        }
        for (i, &n) in ns.iter().enumerate() {
            let row = Summary::of(&measured[i], &measured[0]);
            #[allow(clippy::cast_precision_loss)]
            let (per, busy) = (1e6 * n as f64 / row.rate, row.io_busy / io_threads as f64);
            let range = if rounds > 1 {
                format!("  {:.2}–{:.2}×", row.vs_one_min, row.vs_one_max)
            } else {
                String::new()
            };
            println!(
                "  {:>8} {:>8} {:>12.0} {:>9.2}× {:>12.1} {:>7.0}% {:>10.2}{range}",
                human(bytes),
                n,
                row.rate,
                row.vs_one,
                per,
                100.0 * busy,
                row.io_us_per_job
            );
            if row
                .rungs
                .iter()
                .any(|k| *k != Rung::PoolPointer.to_string())
            {
                let took: Vec<&str> = row.rungs.iter().map(String::as_str).collect();
                println!("           (the inputs took: {})", took.join(", "));
            }
            rows.push(serde_json::json!({
                "bytes": bytes, "workers": n, "jobs_per_s": row.rate, "vs_one": row.vs_one,
                "vs_one_min": row.vs_one_min, "vs_one_max": row.vs_one_max, "rounds": rounds,
                "io_threads": io_threads, "io_busy": busy, "io_us_per_job": row.io_us_per_job,
                "rungs": row.rungs,
            }));
        }
    }
    // How many jobs' READY went on the IO thread's copy-engine stream (the caller's stream
    // idle) rather than the caller's: what the plain rows' cost follows (docs/facts.md).
    let st = parent.stats();
    println!(
        "  READY recorded aside (the caller's stream idle): {} of {} jobs",
        st.ready_recorded_aside, st.jobs_completed
    );
    if let Some(turn) = parent.gpu_turn() {
        #[allow(clippy::cast_precision_loss)]
        let mean_us = st.turn_wait_ns as f64 / 1e3 / st.turn_waits.max(1) as f64;
        println!(
            "  GPU turns of {} µs (POOLIPC_GPU_TURN_US; 0: none): {} of {} submits waited, {mean_us:.1} µs each on average; {} waits ran out",
            turn.as_micros(),
            st.turn_waits,
            st.jobs_submitted,
            st.turn_waits_ran_out
        );
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
        .arg(&args.caller_stream);
    // None given: the child takes the library's default, as this process would.
    if !io_threads.is_empty() {
        c.arg("--io-threads").arg(
            io_threads
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    if let Some(n) = args.iterations {
        c.arg("--iterations").arg(n.to_string());
    }
    c.arg("--rounds").arg(args.rounds.to_string());
    if !args.prime.is_empty() {
        c.arg("--prime").arg(args.prime.join(","));
        c.arg("--prime-bytes").arg(args.prime_bytes.to_string());
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
        .env_remove(poolipc::advanced::driver::mps_env::PIPE_DIRECTORY_ENV)
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

/// `--prime`'s steps other than `canary` (an option of the parent's), in the order given,
/// each of `--prime-bytes`: `staging` (one job on each worker by host staging), `fill` (a
/// memset in the parent: GPU work of its own), `host-copy` (a device → host → device copy in
/// the parent), `idle` (a second of nothing). The order is the experiment's: does the
/// stream's last engine (a copy, a memset) decide what its next handoffs pay?
fn prime(args: &Args, parent: &Parent, d: &Arc<dyn Driver>, workers: &[WorkerId]) -> Result<()> {
    if args.prime.iter().all(|p| p == "canary") {
        return Ok(());
    }
    let bytes = args.prime_bytes;
    let stream = poolipc::StreamHandle::NULL;
    let ptr = parent.pool().alloc(bytes, stream)?;
    d.stream_synchronize(stream)?;
    let input = Input {
        ptr,
        desc: Layout::contiguous(DType::U8, &[bytes]),
        read_only: false,
    };
    let steps = || -> Result<()> {
        for step in &args.prime {
            match step.as_str() {
                "staging" => crate::bench::host_staged(parent, || {
                    for &w in workers {
                        let out = parent.run_job(w, std::slice::from_ref(&input), stream)?;
                        anyhow::ensure!(
                            out.input_rungs == [poolipc::Rung::HostStaging],
                            "--prime staging: the job took {:?}",
                            out.input_rungs
                        );
                    }
                    Ok(())
                })?,
                "fill" => d.memset_d8_async(ptr, 0x5a, bytes, stream)?,
                "host-copy" => {
                    let mut host = vec![0u8; usize::try_from(bytes)?];
                    d.memcpy_dtoh(&mut host, ptr)?;
                    d.memcpy_htod(ptr, &host)?;
                }
                "idle" => {
                    d.stream_synchronize(stream)?;
                    std::thread::sleep(Duration::from_secs(1));
                }
                _ => {} // `canary`: the parent's option, run at each worker's handshake.
            }
        }
        Ok(())
    };
    let done = steps();
    parent.pool().free(ptr, stream)?;
    d.stream_synchronize(stream)?;
    done
}

#[cfg(test)]
mod tests {
    use super::{Rate, Summary, counts, median};

    fn rate(jobs_per_s: f64) -> Rate {
        Rate {
            jobs_per_s,
            io_busy: 0.5,
            io_us_per_job: 10.0,
            rungs: std::collections::BTreeSet::new(),
        }
    }

    #[test]
    fn a_median_is_the_middle_value_or_the_mean_of_the_middle_two() {
        assert!(median(std::iter::empty()).is_nan());
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), 2.5);
    }

    #[test]
    fn a_counts_ratio_to_one_worker_is_taken_within_each_round() {
        // One worker's rate moves between rounds; two workers' follows it: within each
        // round the ratio is 2, though the rates' medians alone would say 1.5.
        let ones = [rate(100.0), rate(200.0), rate(300.0)];
        let twos = [rate(200.0), rate(400.0), rate(600.0)];
        let s = Summary::of(&twos, &ones);
        assert_eq!((s.vs_one, s.vs_one_min, s.vs_one_max), (2.0, 2.0, 2.0));
        assert_eq!(s.rate, 400.0);
        let uneven = [rate(150.0), rate(500.0), rate(300.0)];
        let s = Summary::of(&uneven, &ones);
        assert_eq!((s.vs_one, s.vs_one_min, s.vs_one_max), (1.5, 1.0, 2.5));
    }

    #[test]
    fn worker_counts_double_up_to_the_maximum() {
        assert_eq!(counts(1), [1]);
        assert_eq!(counts(4), [1, 2, 4]);
        assert_eq!(counts(6), [1, 2, 4, 6]);
        assert_eq!(counts(8), [1, 2, 4, 8]);
    }
}
