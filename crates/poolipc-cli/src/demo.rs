//! `poolipc demo`: a parent and a worker process handing tensors both ways, verified, timed.

use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use poolipc::advanced::driver::sim::{MACHINE_ENV, SimConfig};
use poolipc::advanced::driver::{Driver, OwnedStream};
use poolipc::driver::Choice;
use poolipc::{DType, Input, Layout, Parent, ParentOptions};

use crate::echo;

/// Options of `poolipc demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Use the simulated driver even when a GPU is present. Without it, POOLIPC_DRIVER decides
    /// where it is set, else the GPU where one is usable, else the simulated driver.
    #[arg(long)]
    sim: bool,
    /// The device to use.
    #[arg(long, default_value_t = 0)]
    device: u32,
}

const MIB: u64 = 1 << 20;

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
            name: "f32 4 KiB",
            alloc: 4096,
            offset: 0,
            desc: Layout::contiguous(DType::F32, &[1024]),
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
            name: "i64 view at +1 MiB+8",
            alloc: 3 * MIB,
            offset: MIB + 8,
            desc: Layout::contiguous(DType::I64, &[1000]),
            pattern: 7,
        },
        Case {
            name: "f32 64 MiB",
            alloc: 64 * MIB,
            offset: 0,
            desc: Layout::contiguous(DType::F32, &[4096, 4096]),
            pattern: 0x4040_0000,
        },
        Case {
            name: "u8 1 GiB",
            alloc: 1024 * MIB,
            offset: 0,
            desc: Layout::contiguous(DType::U8, &[1024 * MIB]),
            pattern: 0x0102_0304,
        },
    ]
}

/// What the table's columns mean, printed above it.
const LEGEND: &str = "\
rung: how the tensor travelled (pool pointer: no copy; arena copy or host staging: memory
that cannot go by pointer). first ms: its first round trip (the export, the worker's first
import); again ms: the same tensor lent once more (its export comes from the cache).";

/// Why the first large row is slow on the simulated driver, printed there only.
const SIM_FIRST_TOUCH: &str = "\
On the simulated driver device memory is shared host memory: the first 1 GiB round trip pays
for the pool growing by 1 GiB and the kernel zeroing those pages as they are first touched
(seconds); a GPU pays nothing of the kind.";

/// The driver the demo runs on, the environment its worker needs (the simulated machine),
/// and a line saying which.
pub(crate) type Opened = (Arc<dyn Driver>, Option<(&'static str, String)>, String);

pub(crate) fn open_driver(sim: bool, device: u32) -> Result<Opened> {
    let args = Args { sim, device };
    open(&args)
}

fn open(args: &Args) -> Result<Opened> {
    let o = if args.sim {
        poolipc::driver::Opened::sim(SimConfig::default())?
    } else {
        poolipc::driver::open_or(Choice::Auto)?
    };
    let which = if o.driver.kind() == poolipc::advanced::driver::DriverKind::Cuda {
        let name = o
            .driver
            .device_info(args.device)
            .map(|i| i.name)
            .unwrap_or_default();
        format!("on the GPU: {name} (CudaDriver)")
    } else if args.sim {
        "on the SIMULATED driver (--sim)".into()
    } else {
        format!("on {}", o.which)
    };
    let env = o
        .worker_env
        .first()
        .map(|(_, v)| (MACHINE_ENV, v.to_string_lossy().into_owned()));
    Ok((o.driver, env, which))
}

pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let (driver, child_env, which) = open(args)?;
    println!("poolipc demo {which}");
    let options = ParentOptions {
        device: args.device,
        ..ParentOptions::default()
    };
    let parent = Parent::new(Arc::clone(&driver), options).context("starting the parent")?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("__demo-worker")
        .env("POOLIPC_DEMO_DEVICE", args.device.to_string());
    if let Some((k, v)) = &child_env {
        cmd.env(k, v);
    }
    let t = Instant::now();
    let worker = parent.spawn_worker(cmd).context("starting the worker")?;
    let pid = parent.worker(worker).and_then(|w| w.pid).unwrap_or(0);
    println!(
        "worker pid {pid} connected in {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    if let Some(report) = parent.canary_report(worker) {
        println!("canary battery: {report}");
    }
    let d = &*driver;
    let owned_stream = OwnedStream::new(d)?;
    let stream = owned_stream.handle();
    println!();
    println!("{LEGEND}");
    if d.kind() == poolipc::advanced::driver::DriverKind::Sim {
        println!("{SIM_FIRST_TOUCH}");
    }
    println!();
    println!(
        "  {:<22} {:>12} {:<14} {:>10} {:>10}  verified",
        "tensor", "bytes", "rung", "first ms", "again ms"
    );
    let mut failures = 0;
    let mut cases = cases();
    if d.kind() == poolipc::advanced::driver::DriverKind::Cuda {
        // Over the 128-chunk import limit: host staging, both ways.
        cases.push(Case {
            name: "u8 5 GiB (staged)",
            alloc: 5 * 1024 * MIB,
            offset: 0,
            desc: Layout::contiguous(DType::U8, &[5 * 1024 * MIB]),
            pattern: 0x5555_AAAA,
        });
    }
    for c in cases {
        let base = parent.pool().alloc(c.alloc, stream)?;
        echo::fill_pattern(d, base, c.alloc, c.pattern, stream)?;
        let inputs = [Input {
            ptr: base.offset(c.offset),
            desc: c.desc.clone(),
            read_only: false,
        }];
        let mut times = Vec::new();
        let mut verdict = String::from("yes");
        let mut rung = String::new();
        for _ in 0..2 {
            // Marked like the bench's round trips, so that `POOLIPC_PROBE=DIR poolipc demo`
            // and `bench/probe_report.py DIR --skip 0 --count 12` say where a row's time goes.
            poolipc::probe::mark("rt.begin");
            let t = Instant::now();
            let out = parent.run_job(worker, &inputs, stream)?;
            d.stream_synchronize(stream)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            poolipc::probe::mark("rt.synced");
            rung = out
                .input_rungs
                .first()
                .map(ToString::to_string)
                .unwrap_or_default();
            for (i, r) in out.results.iter().enumerate() {
                if let Err(e) = echo::verify_echo(d, r.ptr, r.bytes, i, c.pattern, c.offset) {
                    verdict = format!("NO: {e}");
                    failures += 1;
                }
                parent.pool().free(r.ptr, stream)?;
            }
        }
        parent.pool().free(base, stream)?;
        d.stream_synchronize(stream)?;
        println!(
            "  {:<22} {:>12} {:<14} {:>10.3} {:>10.3}  {verdict}",
            c.name,
            c.desc.extent_bytes()?,
            rung,
            times[0],
            times[1]
        );
    }
    println!();
    println!(
        "each row: the parent lends the tensor, the worker asks for a result of the same shape,"
    );
    println!(
        "copies the input into it and marks it, UNIMPORT, DONE, ACK; the parent checks the result."
    );
    println!("pool after the demo: {}", parent.pool().stats()?);
    let status = parent.stop_worker(worker)?;
    println!(
        "worker exited: {}",
        status.map_or_else(|| "?".into(), |s| s.to_string())
    );
    if failures > 0 {
        println!("demo FAILED: {failures} result(s) wrong");
        return Ok(ExitCode::FAILURE);
    }
    println!("demo passed");
    Ok(ExitCode::SUCCESS)
}

/// The demo's worker process.
pub(crate) fn worker_main() -> Result<ExitCode> {
    let device: u32 = std::env::var("POOLIPC_DEMO_DEVICE")
        .unwrap_or_else(|_| "0".into())
        .parse()?;
    let driver = poolipc::driver::open_worker()?;
    let mut worker = poolipc::Worker::from_env(driver, device)?;
    let mode = std::env::var("POOLIPC_WORKER_MODE").unwrap_or_default();
    if mode == "touch" {
        echo::serve_touch(&mut worker)?;
    } else if mode == "noop" {
        // Takes each job and finishes it: what a worker costs with no work of its own
        // (`bench/pysplit.py`'s Rust side).
        while let Some(job) = worker.next_job()? {
            job.finish()?;
        }
    } else if let Some(bytes) = mode.strip_prefix("result:") {
        let bytes: u64 = bytes
            .parse()
            .with_context(|| format!("POOLIPC_WORKER_MODE={mode}"))?;
        echo::serve_produce(&mut worker, bytes)?;
    } else {
        echo::serve(&mut worker)?;
    }
    Ok(ExitCode::SUCCESS)
}
