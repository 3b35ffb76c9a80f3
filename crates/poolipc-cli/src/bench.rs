//! `poolipc bench`: the handoff's round trip against the copy it replaces, in one run.

use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use poolipc::{DType, Input, Parent, ParentOptions, Rung, TensorDesc};
use poolipc_driver::Driver;
use poolipc_pool::ImportLimit;

/// Options of `poolipc bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Use the simulated driver even when a GPU is present.
    #[arg(long)]
    sim: bool,
    /// The device to use.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// Round trips per size (the median is reported).
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// The largest size to measure, in MiB.
    #[arg(long, default_value_t = 4096)]
    max_mib: u64,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// A build of `bench/floor.c` (the bare-driver handoff, `nvcc -O2 -o floor bench/floor.c
    /// -lcuda`), run after ours and reported beside it.
    #[arg(long)]
    floor: Option<std::path::PathBuf>,
    /// `bench/torchmp.py` (torch.multiprocessing's round trip, needs torch), run with
    /// `python3` after ours and reported beside it.
    #[arg(long)]
    torchmp: Option<std::path::PathBuf>,
}

/// The number after `"key": ` in a JSON line (the probes print flat objects).
fn json_number(line: &str, key: &str) -> Option<f64> {
    let at = line.find(&format!("\"{key}\": "))? + key.len() + 4;
    let rest = &line[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim().parse().ok()
}

/// The string after `"key": ` in a JSON line.
fn json_string<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!("\"{key}\": \""))? + key.len() + 5;
    let rest = &line[at..];
    Some(&rest[..rest.find('"')?])
}

/// Runs `cmd` and gives (bytes, median µs) of every line `parse` understands, or why not.
fn peer_runs(
    mut cmd: Command,
    parse: impl Fn(&str) -> Option<(u64, f64)>,
) -> Result<Vec<(u64, f64)>, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("could not run {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(parse)
        .collect())
}

fn floor_line(line: &str) -> Option<(u64, f64)> {
    if !line.contains("\"handoff_round_trip\"") {
        return None;
    }
    Some((
        json_number(line, "bytes")? as u64,
        json_number(line, "us_median")?,
    ))
}

fn torchmp_line(line: &str) -> Option<(u64, f64)> {
    if !line.contains("\"torch_mp_round_trip\"") {
        return None;
    }
    let bytes = match json_string(line, "size")? {
        "4KiB" => 4 * KIB,
        "1MiB" => MIB,
        "1GiB" => 1024 * MIB,
        "4GiB" => 4096 * MIB,
        _ => return None,
    };
    Some((bytes, json_number(line, "round_trip_ms_median")? * 1e3))
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

struct Row {
    bytes: u64,
    first_us: f64,
    recycled_us: f64,
    staging_us: f64,
    host_copy_us: f64,
}

pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let (driver, child_env, which) = crate::demo::open_driver(args.sim, args.device)?;
    if !args.json {
        println!("poolipc bench {which}");
    }
    let options = ParentOptions {
        device: args.device,
        canary: false,
        ..ParentOptions::default()
    };
    let parent = Parent::new(Arc::clone(&driver), options).context("starting the parent")?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("__demo-worker")
        .env("POOLIPC_DEMO_DEVICE", args.device.to_string())
        .env("POOLIPC_WORKER_MODE", "touch");
    if let Some((k, v)) = &child_env {
        cmd.env(k, v);
    }
    let worker = parent.spawn_worker(cmd).context("starting the worker")?;
    let d: Arc<dyn Driver> = Arc::clone(&driver);
    let stream = d.stream_create()?;
    let mut rows = Vec::new();
    for bytes in [4 * KIB, MIB, 64 * MIB, 1024 * MIB, 4096 * MIB] {
        if bytes > args.max_mib * MIB {
            continue;
        }
        let desc = TensorDesc::contiguous(DType::U8, &[bytes]);
        let mut times = Vec::with_capacity(args.iterations);
        let mut first = f64::NAN;
        for i in 0..=args.iterations {
            // The same size allocated and freed each time: the first is fresh pool memory,
            // the rest recycled.
            let ptr = parent.pool().alloc(bytes, stream)?;
            d.stream_synchronize(stream)?;
            let t = Instant::now();
            parent.run_job(
                worker,
                &[Input {
                    ptr,
                    desc: desc.clone(),
                }],
                stream,
            )?;
            d.stream_synchronize(stream)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            if i == 0 {
                first = us
            } else {
                times.push(us)
            }
            parent.pool().free(ptr, stream)?;
            d.stream_synchronize(stream)?;
        }
        // The host-staging rung, the same round trip through pinned shared memory.
        let pointer_limit = parent.options().limit;
        parent.lower_import_limit(
            ImportLimit::new(pointer_limit.chunk_bytes(), 0).context("limit")?,
        )?;
        let ptr = parent.pool().alloc(bytes, stream)?;
        d.stream_synchronize(stream)?;
        let mut staged = Vec::new();
        for _ in 0..args.iterations.clamp(1, 5) {
            let t = Instant::now();
            let out = parent.run_job(
                worker,
                &[Input {
                    ptr,
                    desc: desc.clone(),
                }],
                stream,
            )?;
            d.stream_synchronize(stream)?;
            staged.push(t.elapsed().as_secs_f64() * 1e6);
            anyhow::ensure!(
                out.input_rungs == [Rung::HostStaging],
                "staging was not used"
            );
        }
        parent.lower_import_limit(pointer_limit)?;
        parent.pool().free(ptr, stream)?;
        d.stream_synchronize(stream)?;
        // What the handoff replaces: device → host → device through pageable host memory.
        let src = parent.pool().alloc(bytes, stream)?;
        let dst = parent.pool().alloc(bytes, stream)?;
        d.stream_synchronize(stream)?;
        let mut host = vec![0u8; usize::try_from(bytes)?];
        let mut copies = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            d.memcpy_dtoh(&mut host, src)?;
            d.memcpy_htod(dst, &host)?;
            copies.push(t.elapsed().as_secs_f64() * 1e6);
        }
        parent.pool().free(src, stream)?;
        parent.pool().free(dst, stream)?;
        d.stream_synchronize(stream)?;
        rows.push(Row {
            bytes,
            first_us: first,
            recycled_us: median(&mut times),
            staging_us: median(&mut staged),
            host_copy_us: median(&mut copies),
        });
    }
    // A batch of 1000 small tensors, each its own allocation, in one job.
    let n = 1000;
    let small: Vec<_> = (0..n)
        .map(|_| parent.pool().alloc(4 * KIB, stream))
        .collect::<Result<_, _>>()?;
    d.stream_synchronize(stream)?;
    let inputs: Vec<Input> = small
        .iter()
        .map(|&ptr| Input {
            ptr,
            desc: TensorDesc::contiguous(DType::U8, &[4 * KIB]),
        })
        .collect();
    let mut batch = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        parent.run_job(worker, &inputs, stream)?;
        d.stream_synchronize(stream)?;
        batch.push(t.elapsed().as_secs_f64());
    }
    let batch_s = median(&mut batch);
    for p in small {
        parent.pool().free(p, stream)?;
    }
    d.stream_synchronize(stream)?;
    parent.stop_worker(worker)?;

    let tensors_per_s = n as f64 / batch_s;
    // The peers, measured in the same run, after ours (they need the GPU too).
    let floor = args
        .floor
        .as_ref()
        .map(|p| peer_runs(Command::new(p), floor_line));
    let torchmp = args.torchmp.as_ref().map(|p| {
        let mut c = Command::new("python3");
        c.arg(p);
        peer_runs(c, torchmp_line)
    });
    let find = |runs: &Option<Result<Vec<(u64, f64)>, String>>, bytes: u64| {
        runs.as_ref()
            .and_then(|r| r.as_ref().ok())
            .and_then(|v| v.iter().find(|(b, _)| *b == bytes).map(|(_, us)| *us))
    };
    if args.json {
        let mut s = String::from("{\"driver\":\"");
        s.push_str(&d.kind().to_string());
        s.push_str("\",\"round_trip\":[");
        for (i, r) in rows.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str(&format!(
                "{{\"bytes\":{},\"first_us\":{:.1},\"recycled_median_us\":{:.1},\"host_staging_median_us\":{:.1},\"host_copy_median_us\":{:.1},\"speedup_vs_host_staging\":{:.2},\"speedup_vs_host_copy\":{:.2}}}",
                r.bytes, r.first_us, r.recycled_us, r.staging_us, r.host_copy_us, r.staging_us / r.recycled_us, r.host_copy_us / r.recycled_us
            ));
            s.pop();
            for (key, v) in [
                ("floor_us", find(&floor, r.bytes)),
                ("torch_mp_us", find(&torchmp, r.bytes)),
            ] {
                if let Some(v) = v {
                    s.push_str(&format!(
                        ",\"{key}\":{v:.1},\"ratio_to_{key}\":{:.3}",
                        r.recycled_us / v
                    ));
                }
            }
            s.push('}');
        }
        s.push_str(&format!("],\"batch\":{{\"tensors\":{n},\"tensor_bytes\":4096,\"median_s\":{batch_s:.6},\"tensors_per_s\":{tensors_per_s:.0}}}}}"));
        println!("{s}");
    } else {
        println!();
        println!(
            "  one tensor: lend, worker writes 4 KiB in place, DONE, ACK, release (median of {}):",
            args.iterations
        );
        println!(
            "  {:>10} {:>12} {:>14} {:>14} {:>10} {:>16} {:>10}",
            "size", "first µs", "recycled µs", "staging µs", "vs stag.", "host copy µs", "vs copy"
        );
        for r in &rows {
            println!(
                "  {:>10} {:>12.1} {:>14.1} {:>14.1} {:>9.1}× {:>16.1} {:>9.1}×",
                human(r.bytes),
                r.first_us,
                r.recycled_us,
                r.staging_us,
                r.staging_us / r.recycled_us,
                r.host_copy_us,
                r.host_copy_us / r.recycled_us
            );
        }
        println!(
            "  staging: the same round trip on the host-staging rung (pinned shared memory, double-buffered)"
        );
        println!(
            "  host copy: device → pageable host → device in this process, the path the handoff replaces"
        );
        if floor.is_some() || torchmp.is_some() {
            println!();
            println!(
                "  against the peers, measured in the same run after ours (recycled medians):"
            );
            println!(
                "  {:>10} {:>14} {:>12} {:>11} {:>16} {:>11}",
                "size", "ours µs", "floor µs", "ours/floor", "torch.mp µs", "ours/t.mp"
            );
            let cell = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
            let ratio = |ours: f64, v: Option<f64>| {
                v.map_or_else(|| "-".to_owned(), |v| format!("{:.2}", ours / v))
            };
            for r in &rows {
                let (f, t) = (find(&floor, r.bytes), find(&torchmp, r.bytes));
                println!(
                    "  {:>10} {:>14.1} {:>12} {:>11} {:>16} {:>11}",
                    human(r.bytes),
                    r.recycled_us,
                    cell(f),
                    ratio(r.recycled_us, f),
                    cell(t),
                    ratio(r.recycled_us, t)
                );
            }
            for (name, runs) in [("floor", &floor), ("torch.multiprocessing", &torchmp)] {
                if let Some(Err(why)) = runs {
                    println!("  {name}: NOT MEASURED: {why}");
                }
            }
            println!(
                "  floor: bench/floor.c, the bare-driver handoff (its child memsets 4 KiB in place)"
            );
            println!(
                "  torch.mp: bench/torchmp.py, native allocator, legacy CUDA IPC, worker writes one element"
            );
        }
        println!(
            "  batch: {n} tensors of 4 KiB, each its own allocation, in one job: {:.2} ms, {tensors_per_s:.0} tensors/s",
            batch_s * 1e3
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{} GiB", bytes >> 30)
    } else if bytes >= MIB {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_lines_give_size_and_median() {
        let line = r#"{"event": "handoff_round_trip", "free": "async", "wait": "stream", "ready": "wait", "bytes": 67108864, "first_us": 541.7, "us_median": 332.65, "child_import_us": 2.10, "reps": 2000}"#;
        assert_eq!(floor_line(line), Some((64 * MIB, 332.65)));
        assert_eq!(
            floor_line(r#"{"event": "uds_ping_pong", "bytes": 80, "us_median": 13.17}"#),
            None
        );
        assert_eq!(floor_line("not json"), None);
    }

    #[test]
    fn torchmp_lines_give_size_and_median_in_microseconds() {
        let line = r#"{"event": "torch_mp_round_trip", "size": "4GiB", "round_trip_ms_median": 1.47, "first_ms": 3.2}"#;
        let (bytes, us) = torchmp_line(line).unwrap();
        assert_eq!(bytes, 4096 * MIB);
        assert!((us - 1470.0).abs() < 1e-6);
        assert_eq!(
            torchmp_line(
                r#"{"event": "torch_mp_round_trip", "size": "2KiB", "round_trip_ms_median": 1}"#
            ),
            None
        );
    }

    #[test]
    fn a_failing_peer_says_why() {
        let mut c = Command::new("sh");
        c.args(["-c", "echo broken >&2; exit 3"]);
        let e = peer_runs(c, floor_line).unwrap_err();
        assert!(e.contains("broken"), "{e}");
    }
}
