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
    let mut parent = Parent::new(Arc::clone(&driver), options).context("starting the parent")?;
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
