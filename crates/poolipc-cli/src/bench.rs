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
    pub(crate) sim: bool,
    /// The device to use.
    #[arg(long, default_value_t = 0)]
    pub(crate) device: u32,
    /// Round trips per size (the median is reported); by default 400 up to 1 MiB, 200 at
    /// 64 MiB, 50 at 1 GiB and 20 above, so that the medians hold still from run to run.
    #[arg(long)]
    pub(crate) iterations: Option<usize>,
    /// The largest size to measure, in MiB (default 4096; 64 on the simulated driver, whose
    /// memory is host memory).
    #[arg(long)]
    max_mib: Option<u64>,
    /// The largest input to measure above the import limit (arena copy), in MiB (default
    /// 16384; 64 on the simulated driver).
    #[arg(long)]
    copy_max_mib: Option<u64>,
    /// The largest result to measure through the arena, in MiB (default 16384; 64 on the
    /// simulated driver).
    #[arg(long)]
    result_max_mib: Option<u64>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// Also write the JSON object to this file (the table still goes to stdout).
    #[arg(long)]
    pub(crate) json_out: Option<std::path::PathBuf>,
    /// Draw the round trips as an SVG chart (log–log, one line per rung and per peer; with
    /// `--mps`, both runs).
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// With --plot: draw the chart from a JSON file an earlier run wrote with --json-out
    /// (plain or --mps), measuring nothing.
    #[arg(long, requires = "plot")]
    from_json: Option<std::path::PathBuf>,
    /// Run the table twice, plainly and then under a private CUDA MPS daemon this command
    /// starts and stops (its own pipe and log directories; nothing system-wide changes), and
    /// print both with the ratios. The peers run under the same daemon. The bench's own
    /// processes are the only clients, so the daemon's fault sharing is accepted for them.
    #[arg(long)]
    pub(crate) mps: bool,
    /// (with a parent under MPS) Start the worker outside the MPS server: what a worker that
    /// is not a client costs. Used by `--mps`.
    #[arg(long, hide = true)]
    worker_outside_mps: bool,
    /// A build of `bench/floor.c` (the bare-driver handoff, `nvcc -O2 -o floor bench/floor.c
    /// -lcuda`), run after ours and reported beside it.
    #[arg(long)]
    floor: Option<std::path::PathBuf>,
    /// `bench/torchmp.py` (torch.multiprocessing's round trip, needs torch), run with
    /// `python3` after ours and reported beside it.
    #[arg(long)]
    torchmp: Option<std::path::PathBuf>,
    /// Measure jobs per second with 1, 2, 4, ... up to N workers served at once (4 KiB and
    /// 64 MiB, lent again), instead of the round-trip table; with `--mps`, plainly and under
    /// MPS.
    #[arg(long, value_name = "N")]
    pub(crate) workers: Option<usize>,
}

impl Args {
    /// `--max-mib`, or its default on this driver.
    fn max_mib(&self, sim: bool) -> u64 {
        self.max_mib.unwrap_or(if sim { 64 } else { 4096 })
    }

    /// `--copy-max-mib`, or its default on this driver.
    fn copy_max_mib(&self, sim: bool) -> u64 {
        self.copy_max_mib.unwrap_or(if sim { 64 } else { 16384 })
    }

    /// `--result-max-mib`, or its default on this driver.
    fn result_max_mib(&self, sim: bool) -> u64 {
        self.result_max_mib.unwrap_or(if sim { 64 } else { 16384 })
    }
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

/// A peer's median round trip at one size.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Peer {
    bytes: u64,
    us: f64,
    /// The floor's round trip without its export (`us_median - export_us`).
    no_export_us: Option<f64>,
    /// The floor's wait, after its child's reply, for the child's DONE on the GPU.
    gate_us: Option<f64>,
}

/// Runs `cmd` and gives the round trip of every line `parse` understands, or why not.
fn peer_runs(mut cmd: Command, parse: impl Fn(&str) -> Option<Peer>) -> Result<Vec<Peer>, String> {
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

fn floor_line(line: &str) -> Option<Peer> {
    if !line.contains("\"handoff_round_trip\"") {
        return None;
    }
    let us = json_number(line, "us_median")?;
    Some(Peer {
        bytes: json_number(line, "bytes")? as u64,
        us,
        no_export_us: json_number(line, "export_us").map(|e| us - e),
        gate_us: json_number(line, "parent_gate_us"),
    })
}

fn torchmp_line(line: &str) -> Option<Peer> {
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
    Some(Peer {
        bytes,
        us: json_number(line, "round_trip_ms_median")? * 1e3,
        no_export_us: None,
        gate_us: None,
    })
}

const KIB: u64 = 1 << 10;
/// The result sizes measured through the arena.
const RESULT_SIZES: [u64; 6] = [4 << 10, 1 << 20, 64 << 20, 1 << 30, 4 << 30, 16 << 30];
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
    /// The 90th percentile of the recycled round trips: how much the median can be trusted.
    recycled_p90_us: f64,
    /// Of the recycled round trip, the wait after the job returned (its DONE frame handled)
    /// until the caller's stream is done: the GPU's part, like the floor's gate.
    recycled_gpu_wait_us: f64,
    /// Recycled lends (after the first) served with the cached blob: no export (export
    /// reuse proven), out of `recycled_lends`.
    recycled_reused: u64,
    recycled_lends: u64,
    /// The same live allocation lent again: the export cache's hit.
    relend_us: f64,
    staging_us: f64,
    host_copy_us: f64,
}

/// Round trips per size: enough for a steady median, bounded for the large sizes.
fn iterations_for(args: &Args, bytes: u64) -> usize {
    args.iterations.unwrap_or(match bytes {
        b if b <= MIB => 400,
        b if b <= 64 * MIB => 200,
        b if b <= 1024 * MIB => 50,
        _ => 20,
    })
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Whether a row of `bytes` that needs `need` bytes of device memory fits in what the
/// device has free now (with 256 MiB to spare); if not, says so in `skipped`.
fn fits(
    d: &dyn Driver,
    what: &str,
    bytes: u64,
    need: u64,
    skipped: &mut Vec<String>,
) -> Result<bool> {
    let (free, _total) = d
        .mem_get_info()
        .context("asking the device's free memory")?;
    if need.saturating_add(256 * MIB) <= free {
        return Ok(true);
    }
    skipped.push(format!(
        "{what} of {}: needs {} of device memory, {} free",
        human(bytes),
        human(need),
        human(free)
    ));
    Ok(false)
}

/// One round trip of `input` on `worker`, timed from submit to the caller's stream done.
fn round_trip(
    parent: &Parent,
    d: &dyn Driver,
    worker: poolipc::WorkerId,
    input: &Input,
    stream: poolipc::StreamHandle,
) -> Result<(f64, poolipc::JobOutput)> {
    let (us, _wait, out) = round_trip_split(parent, d, worker, input, stream)?;
    Ok((us, out))
}

/// [`round_trip`], and of it the wait after the job returned until the stream is done.
fn round_trip_split(
    parent: &Parent,
    d: &dyn Driver,
    worker: poolipc::WorkerId,
    input: &Input,
    stream: poolipc::StreamHandle,
) -> Result<(f64, f64, poolipc::JobOutput)> {
    poolipc::probe::mark("rt.begin");
    let t = Instant::now();
    let out = parent.run_job(worker, std::slice::from_ref(input), stream)?;
    let returned = Instant::now();
    d.stream_synchronize(stream)?;
    poolipc::probe::mark("rt.synced");
    Ok((
        t.elapsed().as_secs_f64() * 1e6,
        returned.elapsed().as_secs_f64() * 1e6,
        out,
    ))
}

pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    if let (Some(from), Some(to)) = (&args.from_json, &args.plot) {
        let text =
            std::fs::read_to_string(from).with_context(|| format!("reading {}", from.display()))?;
        let run: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", from.display()))?;
        let series = if run.get("plain").is_some() {
            let mut s = series_from_json("", &run["plain"]);
            s.extend(series_from_json("MPS: ", &run["mps"]));
            s
        } else {
            series_from_json("", &run)
        };
        anyhow::ensure!(
            !series.is_empty(),
            "{} holds no round trips",
            from.display()
        );
        crate::plot::plot_round_trips(to, "poolipc bench: round trip against size", &series)?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(n) = args.workers {
        return crate::throughput::run(args, n);
    }
    if args.mps {
        return run_plain_and_mps(args);
    }
    let (driver, child_env, which) = crate::demo::open_driver(args.sim, args.device)?;
    // The simulated driver's device memory is this machine's memory: smaller sizes by default.
    let sim = child_env.is_some();
    if !args.json {
        println!("poolipc bench {which}");
    }
    let options = ParentOptions {
        device: args.device,
        canary: false,
        results: poolipc::ResultMemory::Arena {
            initial_bytes: 1 << 30,
            max_bytes: None,
        },
        // The bench sizes its rows to the device itself (a row that does not fit is
        // skipped) and keeps its arena between rows: no cap below the device, no idle
        // release in the middle of a measurement.
        arena_cap_fraction: 1.0,
        arena_idle_release: None,
        ..ParentOptions::default()
    };
    let parent = Parent::new(Arc::clone(&driver), options).context("starting the parent")?;
    let mps_client = parent.mps_client();
    if !args.json && mps_client == Some(true) {
        println!(
            "  (this process is an MPS client: the GPU's turn-taking between processes is gone)"
        );
    }
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("__demo-worker")
        .env("POOLIPC_DEMO_DEVICE", args.device.to_string())
        .env("POOLIPC_WORKER_MODE", "touch");
    if let Some((k, v)) = &child_env {
        cmd.env(k, v);
    }
    if args.worker_outside_mps {
        // No daemon there: the worker's CUDA runs outside the server.
        cmd.env(
            poolipc_driver::mps_env::PIPE_DIRECTORY_ENV,
            "/nonexistent/poolipc-worker-outside-mps",
        );
    }
    let worker = parent.spawn_worker(cmd).context("starting the worker")?;
    // No canary battery here, so the export reuse check is made on its own: recycled
    // allocations of the same size are then lent with their cached blob.
    let (reuse, reuse_why) = parent
        .check_export_reuse(worker)
        .context("the export reuse check")?;
    if !args.json {
        match &reuse_why {
            Some(why) => println!("  export reuse: {reuse}: {why}"),
            None => println!("  export reuse: {reuse}"),
        }
    }
    let d: Arc<dyn Driver> = Arc::clone(&driver);
    let stream = d.stream_create()?;
    let mut rows = Vec::new();
    // Rows the device cannot hold are skipped, and said so, instead of ending the run.
    let mut skipped = Vec::new();
    for bytes in [4 * KIB, MIB, 64 * MIB, 1024 * MIB, 4096 * MIB] {
        if bytes > args.max_mib(sim) * MIB
            || !fits(&*d, "round trip", bytes, 2 * bytes, &mut skipped)?
        {
            continue;
        }
        let iterations = iterations_for(args, bytes);
        let desc = TensorDesc::contiguous(DType::U8, &[bytes]);
        let mut times = Vec::with_capacity(iterations);
        let mut first = f64::NAN;
        let mut waits = Vec::with_capacity(iterations);
        let mut recycled_reused = 0;
        for i in 0..=iterations {
            // The same size allocated and freed each time: the first is fresh pool memory,
            // the rest recycled (a new allocation at the same address: its cached blob
            // reused once export reuse is proven, else exported again).
            let reused_before = parent.pool().export_cache_stats().reused;
            let ptr = parent
                .pool()
                .alloc(bytes, stream)
                .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
            d.stream_synchronize(stream)?;
            let input = Input {
                ptr,
                desc: desc.clone(),
                read_only: false,
            };
            let (us, wait, _) = round_trip_split(&parent, &*d, worker, &input, stream)?;
            if i == 0 {
                first = us;
            } else {
                times.push(us);
                waits.push(wait);
                recycled_reused += parent.pool().export_cache_stats().reused - reused_before;
            }
            parent.pool().free(ptr, stream)?;
            d.stream_synchronize(stream)?;
        }
        // One live allocation lent again and again: its export comes from the cache.
        let ptr = parent
            .pool()
            .alloc(bytes, stream)
            .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
        d.stream_synchronize(stream)?;
        let input = Input {
            ptr,
            desc: desc.clone(),
            read_only: false,
        };
        let mut relends = Vec::with_capacity(iterations);
        for i in 0..=iterations {
            let (us, _) = round_trip(&parent, &*d, worker, &input, stream)?;
            if i > 0 {
                relends.push(us);
            }
        }
        // The host-staging rung, the same round trip through pinned shared memory (the
        // arena-copy rung kept out of its way).
        parent.set_arena_copy(false);
        let pointer_limit = parent.options().limit;
        parent.lower_import_limit(
            ImportLimit::new(pointer_limit.chunk_bytes(), 0).context("limit")?,
        )?;
        let mut staged = Vec::new();
        for _ in 0..iterations.clamp(1, 5) {
            let (us, out) = round_trip(&parent, &*d, worker, &input, stream)?;
            staged.push(us);
            anyhow::ensure!(
                out.input_rungs == [Rung::HostStaging],
                "staging was not used"
            );
        }
        parent.lower_import_limit(pointer_limit)?;
        parent.set_arena_copy(true);
        parent.pool().free(ptr, stream)?;
        d.stream_synchronize(stream)?;
        // What the handoff replaces: device → host → device through pageable host memory.
        let src = parent
            .pool()
            .alloc(bytes, stream)
            .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
        let dst = parent
            .pool()
            .alloc(bytes, stream)
            .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
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
            recycled_p90_us: percentile(&mut times, 0.9),
            recycled_gpu_wait_us: median(&mut waits),
            recycled_reused,
            recycled_lends: iterations as u64,
            relend_us: median(&mut relends),
            staging_us: median(&mut staged),
            host_copy_us: median(&mut copies),
        });
    }
    // Inputs above the import limit: the arena-copy rung (one device-to-device copy into the
    // arena on the job's stream), beside host staging. Sizes up to 4 GiB are put above the
    // limit by lowering it; larger ones are above the real one.
    let mut copy_rows = Vec::new();
    for bytes in RESULT_SIZES {
        if bytes > args.copy_max_mib(sim) * MIB
            || !fits(&*d, "arena copy", bytes, 2 * bytes, &mut skipped)?
        {
            continue;
        }
        let desc = TensorDesc::contiguous(DType::U8, &[bytes]);
        let ptr = parent
            .pool()
            .alloc(bytes, stream)
            .with_context(|| format!("allocating {} from the pool", human(bytes)))?;
        d.stream_synchronize(stream)?;
        // Read-only: the worker's view is mapped read-only and nothing is copied back (what
        // this row measured before copy-back existed). The writable lend below adds the copy
        // back into the tensor after the job (one more device-to-device copy of `bytes`).
        let input = Input::new(ptr, desc).read_only();
        let writable = Input {
            read_only: false,
            ..input.clone()
        };
        let pointer_limit = parent.options().limit;
        parent.lower_import_limit(
            ImportLimit::new(pointer_limit.chunk_bytes(), 0).context("limit")?,
        )?;
        let mut copied = Vec::new();
        let mut copied_back = Vec::new();
        let mut rung = None;
        for i in 0..=iterations_for(args, bytes).min(50) {
            let (us, out) = round_trip(&parent, &*d, worker, &input, stream)?;
            rung = out.input_rungs.first().copied();
            let (back_us, _) = round_trip(&parent, &*d, worker, &writable, stream)?;
            if i > 0 {
                copied.push(us);
                copied_back.push(back_us);
            }
        }
        // Host staging of the same tensor, for the sizes the main table does not have.
        let mut staged = Vec::new();
        if bytes > 4096 * MIB {
            parent.set_arena_copy(false);
            for _ in 0..3 {
                staged.push(round_trip(&parent, &*d, worker, &input, stream)?.0);
            }
            parent.set_arena_copy(true);
        }
        parent.lower_import_limit(pointer_limit)?;
        parent.pool().free(ptr, stream)?;
        d.stream_synchronize(stream)?;
        parent.reclaim_arena();
        copy_rows.push(CopyRow {
            bytes,
            read_only_us: median(&mut copied),
            copy_back_us: median(&mut copied_back),
            rung,
            staged_us: median(&mut staged),
        });
    }
    // Device memory outside the pool (issue 23): a cuMemAlloc tensor (the arena copy) and a
    // VMM allocation made with the POSIX FD handle type (lent by handle, the worker's mapping
    // cached after the first job; writable, as the pool pointer's re-lend of the same size
    // from the table above that it is compared with). The cuMemAlloc tensor is lent
    // read-only: one device-to-device copy, none back.
    let mut devmem_rows = Vec::new();
    for bytes in [4 * KIB, 64 * MIB, 4096 * MIB] {
        if bytes > args.max_mib(sim) * MIB
            || !fits(
                &*d,
                "device memory outside the pool",
                bytes,
                2 * bytes,
                &mut skipped,
            )?
        {
            continue;
        }
        let iterations = iterations_for(args, bytes).min(50);
        let desc = TensorDesc::contiguous(DType::U8, &[bytes]);
        let plain = poolipc_driver::DeviceAllocation::new(&*d, bytes)
            .with_context(|| format!("cuMemAlloc of {}", human(bytes)))?;
        let mut copied = Vec::new();
        let mut copy_rung = None;
        let lent = (|| -> Result<()> {
            let input = Input::new(plain.ptr(), desc.clone()).read_only();
            for i in 0..=iterations {
                let (us, out) = round_trip(&parent, &*d, worker, &input, stream)?;
                copy_rung = out.input_rungs.first().copied();
                if i > 0 {
                    copied.push(us);
                }
            }
            Ok(())
        })();
        d.ctx_synchronize()?;
        plain.close()?;
        lent?;
        parent.reclaim_arena();
        let vmm = VmmTensor::new(&*d, args.device, bytes)?;
        let mut by_handle = Vec::new();
        let mut first_handle = f64::NAN;
        let mut handle_rung = None;
        let lent = (|| -> Result<()> {
            // Writable, as the pool pointer's re-lend it is compared with: the worker writes
            // its 4 KiB into the parent's memory itself, nothing is copied back.
            let input = Input::new(vmm.ptr, desc.clone());
            for i in 0..=iterations {
                let (us, out) = round_trip(&parent, &*d, worker, &input, stream)?;
                handle_rung = out.input_rungs.first().copied();
                if i == 0 {
                    first_handle = us;
                } else {
                    by_handle.push(us);
                }
            }
            Ok(())
        })();
        d.ctx_synchronize()?;
        vmm.free()?;
        lent?;
        let pointer_us = rows
            .iter()
            .find(|r| r.bytes == bytes)
            .map_or(f64::NAN, |r| r.relend_us);
        devmem_rows.push(DevMemRow {
            bytes,
            copy_us: median(&mut copied),
            copy_rung,
            handle_first_us: first_handle,
            handle_us: median(&mut by_handle),
            handle_rung,
            pointer_us,
        });
    }
    // Results through the arena: a worker answering each job with one result of the size,
    // writing its first 4 KiB; the block goes back (stream-ordered) when the result drops.
    let mut arena_rows = Vec::new();
    for bytes in RESULT_SIZES {
        if bytes > args.result_max_mib(sim) * MIB
            || !fits(&*d, "arena result", bytes, bytes, &mut skipped)?
        {
            continue;
        }
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("__demo-worker")
            .env("POOLIPC_DEMO_DEVICE", args.device.to_string())
            .env("POOLIPC_WORKER_MODE", format!("result:{bytes}"));
        if let Some((k, v)) = &child_env {
            cmd.env(k, v);
        }
        let producer = parent
            .spawn_worker(cmd)
            .context("starting the result worker")?;
        let iterations = iterations_for(args, bytes);
        let mut times = Vec::with_capacity(iterations);
        let mut rung = None;
        for i in 0..=iterations {
            let t = Instant::now();
            let out = parent.run_job(producer, &[], stream)?;
            d.stream_synchronize(stream)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            anyhow::ensure!(out.results.len() == 1, "{} results", out.results.len());
            anyhow::ensure!(out.results[0].bytes >= bytes, "a short result");
            rung = Some(out.results[0].rung);
            if i > 0 {
                times.push(us);
            }
            drop(out);
        }
        // The same result, its shape learned late, with an arena slice of its size lent with
        // each job: the worker carves it and skips the ResultRequest round trip.
        parent.set_arena_slice_bytes(bytes);
        let carved_before = parent.stats().arena_results_carved;
        let mut sliced = Vec::with_capacity(iterations);
        for i in 0..=iterations {
            let t = Instant::now();
            let out = parent.run_job(producer, &[], stream)?;
            d.stream_synchronize(stream)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            anyhow::ensure!(out.results.len() == 1, "{} results", out.results.len());
            anyhow::ensure!(out.results[0].bytes >= bytes, "a short result");
            if i > 0 {
                sliced.push(us);
            }
            drop(out);
        }
        parent.set_arena_slice_bytes(0);
        let carved = parent.stats().arena_results_carved - carved_before;
        parent.stop_worker(producer)?;
        arena_rows.push((bytes, median(&mut times), rung, median(&mut sliced), carved));
    }
    // A batch of 1000 small tensors, each its own allocation, in one job: fresh exports the
    // first time, the export cache's hits after.
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
            read_only: false,
        })
        .collect();
    let mut batch = Vec::new();
    for _ in 0..10 {
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
    let cache = parent.pool().export_cache_stats();
    let counts = parent.stats();
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
    let find = |runs: &Option<Result<Vec<Peer>, String>>, bytes: u64| {
        runs.as_ref()
            .and_then(|r| r.as_ref().ok())
            .and_then(|v| v.iter().find(|p| p.bytes == bytes).copied())
    };
    let json_rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let mut o = serde_json::json!({
                "bytes": r.bytes,
                "first_us": r.first_us,
                "recycled_median_us": r.recycled_us,
                "recycled_p90_us": r.recycled_p90_us,
                "recycled_gpu_wait_us": r.recycled_gpu_wait_us,
                "relend_median_us": r.relend_us,
                "recycled_to_relend": r.recycled_us / r.relend_us,
                "recycled_blob_reused": r.recycled_reused,
                "recycled_lends": r.recycled_lends,
                "host_staging_median_us": r.staging_us,
                "host_copy_median_us": r.host_copy_us,
                "speedup_vs_host_staging": r.staging_us / r.recycled_us,
                "speedup_vs_host_copy": r.host_copy_us / r.recycled_us,
            });
            if let Some(f) = find(&floor, r.bytes) {
                o["floor_us"] = f.us.into();
                o["ratio_to_floor"] = (r.recycled_us / f.us).into();
                if let Some(ne) = f.no_export_us {
                    o["floor_no_export_us"] = ne.into();
                    o["relend_ratio_to_floor_no_export"] = (r.relend_us / ne).into();
                }
            }
            if let Some(t) = find(&torchmp, r.bytes) {
                o["torch_mp_us"] = t.us.into();
                o["ratio_to_torch_mp"] = (r.recycled_us / t.us).into();
                o["relend_ratio_to_torch_mp"] = (r.relend_us / t.us).into();
            }
            o
        })
        .collect();
    let json = serde_json::json!({
        "driver": d.kind().to_string(),
        "mps_client": mps_client,
        "round_trip": json_rows,
        "skipped": skipped,
        "batch": {
            "tensors": n,
            "tensor_bytes": 4096,
            "median_s": batch_s,
            "tensors_per_s": tensors_per_s,
        },
        "above_limit_inputs": copy_rows.iter().map(|r| serde_json::json!({
            "bytes": r.bytes,
            "median_us": r.read_only_us,
            "copy_back_median_us": r.copy_back_us,
            "rung": r.rung.map(|r| r.to_string()),
            "host_staging_median_us": if r.staged_us.is_nan() { None } else { Some(r.staged_us) },
        })).collect::<Vec<_>>(),
        "device_memory": devmem_rows.iter().map(|r| serde_json::json!({
            "bytes": r.bytes,
            "cu_mem_alloc_median_us": r.copy_us,
            "cu_mem_alloc_rung": r.copy_rung.map(|r| r.to_string()),
            "vmm_handle_first_us": r.handle_first_us,
            "vmm_handle_median_us": r.handle_us,
            "vmm_handle_rung": r.handle_rung.map(|r| r.to_string()),
            "pool_pointer_relend_median_us": if r.pointer_us.is_nan() { None } else { Some(r.pointer_us) },
            "vmm_handle_vs_pool_pointer": if r.pointer_us.is_nan() { None } else { Some(r.handle_us / r.pointer_us) },
        })).collect::<Vec<_>>(),
        "arena_results": arena_rows.iter().map(|(b, us, rung, _, _)| serde_json::json!({
            "bytes": b,
            "median_us": us,
            "rung": rung.map(|r| r.to_string()),
        })).collect::<Vec<_>>(),
        "arena_results_late_with_slice": arena_rows.iter().map(|(b, us, _, sliced, carved)| serde_json::json!({
            "bytes": b,
            "median_us": sliced,
            "round_trip_median_us": us,
            "ratio": sliced / us,
            "carved": carved,
        })).collect::<Vec<_>>(),
        "done_on_host": {
            "jobs_held": counts.jobs_held_for_done,
            "jobs_completed": counts.jobs_completed,
        },
        "export_cache": {
            "hits": cache.hits,
            "misses": cache.misses,
            "stale": cache.stale,
            "bytes_saved": cache.bytes_saved,
            "reused": cache.reused,
            "reused_bytes": cache.reused_bytes,
        },
        "export_reuse": {
            "verdict": format!("{reuse:?}"),
            "why_not": reuse_why,
        },
    });
    if let Some(path) = &args.json_out {
        std::fs::write(path, json.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let title = format!("poolipc bench ({}): round trip against size", d.kind());
        crate::plot::plot_round_trips(path, &title, &series_from_json("", &json))?;
    }
    if args.json {
        println!("{json}");
        return Ok(ExitCode::SUCCESS);
    }
    println!();
    println!(
        "  one tensor: lend, worker writes 4 KiB in place, DONE, ACK, release (medians; iterations: {}):",
        args.iterations.map_or_else(
            || "400 to 1 MiB, 200 at 64 MiB, 50 at 1 GiB, 20 above".to_owned(),
            |n| n.to_string()
        )
    );
    println!(
        "  {:>10} {:>10} {:>12} {:>9} {:>11} {:>12} {:>9} {:>14} {:>9}",
        "size",
        "first µs",
        "recycled µs",
        "p90 µs",
        "re-lend µs",
        "staging µs",
        "vs stag.",
        "host copy µs",
        "vs copy"
    );
    for r in &rows {
        println!(
            "  {:>10} {:>10.1} {:>12.1} {:>9.1} {:>11.1} {:>12.1} {:>8.1}× {:>14.1} {:>8.1}×",
            human(r.bytes),
            r.first_us,
            r.recycled_us,
            r.recycled_p90_us,
            r.relend_us,
            r.staging_us,
            r.staging_us / r.recycled_us,
            r.host_copy_us,
            r.host_copy_us / r.recycled_us
        );
    }
    if reuse == poolipc::ExportReuse::Proven {
        println!(
            "  recycled: a new allocation at a recycled address each time (export reuse proven: \
             its cached blob is lent, no new export)"
        );
    } else {
        println!(
            "  recycled: a new allocation at a recycled address each time (export reuse {reuse}: \
             exported again)"
        );
    }
    for r in &rows {
        println!(
            "    {:>10}: recycled / re-lend {:.2}×; {} of {} recycled lends reused the blob",
            human(r.bytes),
            r.recycled_us / r.relend_us,
            r.recycled_reused,
            r.recycled_lends
        );
    }
    println!("  re-lend: the same live allocation lent again (its export comes from the cache)");
    println!(
        "  staging: the same round trip on the host-staging rung (pinned shared memory, double-buffered)"
    );
    println!(
        "  host copy: device → pageable host → device in this process, the path the handoff replaces"
    );
    if floor.is_some() || torchmp.is_some() {
        println!();
        println!("  against the peers, measured in the same run after ours (medians):");
        println!(
            "  {:>10} {:>12} {:>10} {:>11} {:>11} {:>13} {:>12} {:>12} {:>13}",
            "size",
            "recycled µs",
            "floor µs",
            "rec/floor",
            "re-lend µs",
            "floor-exp µs",
            "relend/f-e",
            "torch.mp µs",
            "best/t.mp"
        );
        let cell = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
        let ratio = |ours: f64, v: Option<f64>| {
            v.map_or_else(|| "-".to_owned(), |v| format!("{:.2}", ours / v))
        };
        for r in &rows {
            let (f, t) = (find(&floor, r.bytes), find(&torchmp, r.bytes));
            let fne = f.and_then(|f| f.no_export_us);
            println!(
                "  {:>10} {:>12.1} {:>10} {:>11} {:>11.1} {:>13} {:>12} {:>12} {:>13}",
                human(r.bytes),
                r.recycled_us,
                cell(f.map(|f| f.us)),
                ratio(r.recycled_us, f.map(|f| f.us)),
                r.relend_us,
                cell(fne),
                ratio(r.relend_us, fne),
                cell(t.map(|t| t.us)),
                ratio(r.recycled_us.min(r.relend_us), t.map(|t| t.us))
            );
        }
        // Where the time goes: up to the worker's answer (CPU, socket, driver calls) and
        // after it (the GPU finishing the worker's work: without MPS, its turn-taking).
        for r in rows.iter().filter(|r| r.bytes <= MIB) {
            if let Some(f) = find(&floor, r.bytes)
                && let Some(gate) = f.gate_us
            {
                println!(
                    "  {} recycled, split: ours {:.1} µs to the job's answer + {:.1} µs GPU wait; floor {:.1} + {:.1} (gate)",
                    human(r.bytes),
                    r.recycled_us - r.recycled_gpu_wait_us,
                    r.recycled_gpu_wait_us,
                    f.us - gate,
                    gate
                );
            }
        }
        for (name, runs) in [("floor", &floor), ("torch.multiprocessing", &torchmp)] {
            if let Some(Err(why)) = runs {
                println!("  {name}: NOT MEASURED: {why}");
            }
        }
        println!(
            "  floor: bench/floor.c, the bare-driver handoff (its child memsets 4 KiB in place); floor-exp: the same without its export"
        );
        println!(
            "  torch.mp: bench/torchmp.py, native allocator, legacy CUDA IPC, worker writes one element; best: the better of recycled and re-lend"
        );
    }
    if !copy_rows.is_empty() {
        println!();
        println!(
            "  one input above the import limit (limit lowered to 0 up to 4 GiB; the real one above), medians:"
        );
        println!(
            "  (read-only: lent read_only, mapped read-only, nothing copied back; copy-back: lent \
             writable, the worker writes its first 4 KiB, the block is copied back after DONE)"
        );
        println!(
            "  {:>10} {:>14} {:>14} {:>8} {:>14} {:>16}",
            "size", "read-only µs", "copy-back µs", "ratio", "rung", "host staging µs"
        );
        for r in &copy_rows {
            println!(
                "  {:>10} {:>14.1} {:>14.1} {:>7.2}x {:>14} {:>16}",
                human(r.bytes),
                r.read_only_us,
                r.copy_back_us,
                r.copy_back_us / r.read_only_us,
                r.rung.map_or_else(|| "-".to_owned(), |r| r.to_string()),
                if r.staged_us.is_nan() {
                    "see table".to_owned()
                } else {
                    format!("{:.1}", r.staged_us)
                }
            );
        }
    }
    if !devmem_rows.is_empty() {
        println!();
        println!(
            "  one input of device memory outside the pool (medians; cuMemAlloc lent read-only; \
             VMM lent writable like the pool pointer; first: the VMM handle's first lend, FD \
             sent and mapped):"
        );
        println!(
            "  {:>10} {:>14} {:>12} {:>14} {:>14} {:>12} {:>14} {:>9}",
            "size",
            "cuMemAlloc µs",
            "rung",
            "VMM first µs",
            "VMM again µs",
            "rung",
            "pool ptr µs",
            "VMM/ptr"
        );
        for r in &devmem_rows {
            println!(
                "  {:>10} {:>14.1} {:>12} {:>14.1} {:>14.1} {:>12} {:>14.1} {:>8.2}×",
                human(r.bytes),
                r.copy_us,
                r.copy_rung
                    .map_or_else(|| "-".to_owned(), |r| r.to_string()),
                r.handle_first_us,
                r.handle_us,
                r.handle_rung
                    .map_or_else(|| "-".to_owned(), |r| r.to_string()),
                r.pointer_us,
                r.handle_us / r.pointer_us
            );
        }
        println!(
            "  targets: cuMemAlloc 4 GiB ≤ 5 ms (arena copy); VMM again ≤ 1.1× the pool pointer's re-lend (same size, same run)"
        );
    }
    if !arena_rows.is_empty() {
        println!();
        println!(
            "  one result through the arena: worker writes its first 4 KiB, DONE, ACK, block back (medians):"
        );
        println!("  {:>10} {:>12} {:>14}", "size", "round µs", "rung");
        for (b, us, rung, _, _) in &arena_rows {
            println!(
                "  {:>10} {:>12.1} {:>14}",
                human(*b),
                us,
                rung.map_or_else(|| "-".to_owned(), |r| r.to_string())
            );
        }
        println!();
        println!(
            "  arena result, shape learned late: carved out of the job's arena slice vs asked for (round trip), medians:"
        );
        println!(
            "  {:>10} {:>12} {:>12} {:>8} {:>8}",
            "size", "slice µs", "request µs", "ratio", "carved"
        );
        for (b, us, _, sliced, carved) in &arena_rows {
            println!(
                "  {:>10} {:>12.1} {:>12.1} {:>7.2}× {:>8}",
                human(*b),
                sliced,
                us,
                sliced / us,
                carved
            );
        }
    }
    println!(
        "  batch: {n} tensors of 4 KiB, each its own allocation, in one job: {:.2} ms, {tensors_per_s:.0} tensors/s",
        batch_s * 1e3
    );
    println!("  {cache}");
    println!(
        "  DONE on the host: {} of {} jobs were held until their DONE completed (the others' had when their frames came)",
        counts.jobs_held_for_done, counts.jobs_completed
    );
    for why in &skipped {
        println!("  skipped: {why}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `--mps`: the table plainly, then under a private MPS daemon, each in a child of ours (a
/// process joins MPS when it initialises CUDA, so this one never does), then the ratios.
fn run_plain_and_mps(args: &Args) -> Result<ExitCode> {
    let dir = std::env::temp_dir().join(format!("poolipc-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let child = |json_out: &std::path::Path, max_mib: u64| -> Result<Command> {
        let mut c = Command::new(std::env::current_exe()?);
        c.arg("bench").arg("--device").arg(args.device.to_string());
        c.arg("--max-mib").arg(max_mib.to_string());
        let results = if max_mib < args.max_mib(false) {
            max_mib
        } else {
            args.result_max_mib(false)
        };
        c.arg("--result-max-mib").arg(results.to_string());
        c.arg("--copy-max-mib")
            .arg(results.min(args.copy_max_mib(false)).to_string());
        if let Some(n) = args.iterations {
            c.arg("--iterations").arg(n.to_string());
        }
        if args.sim {
            c.arg("--sim");
        }
        if let Some(p) = &args.floor {
            c.arg("--floor").arg(p);
        }
        if let Some(p) = &args.torchmp {
            c.arg("--torchmp").arg(p);
        }
        c.arg("--json-out").arg(json_out);
        Ok(c)
    };
    let plain_json = dir.join("plain.json");
    let mps_json = dir.join("mps.json");
    println!("== poolipc bench, plain (no MPS)");
    let status = child(&plain_json, args.max_mib(false))?
        .env_remove(poolipc_driver::mps_env::PIPE_DIRECTORY_ENV)
        .status()?;
    anyhow::ensure!(status.success(), "the plain bench failed: {status}");
    let mps = poolipc::mps::PrivateMps::start(&poolipc::mps::MpsOptions {
        // Only this bench's own processes (ours, the worker, the peers) are its clients.
        accept_shared_gpu_faults: true,
        ..Default::default()
    })?;
    println!();
    println!(
        "== poolipc bench under a private MPS daemon ({})",
        mps.pipe_directory().display()
    );
    let status = child(&mps_json, args.max_mib(false))?
        .envs(mps.env())
        .status()?;
    anyhow::ensure!(status.success(), "the bench under MPS failed: {status}");
    // A parent under MPS with a worker outside it: pool IPC crosses, the turn-taking returns.
    let mixed_json = dir.join("mixed.json");
    println!();
    println!("== poolipc bench, the parent under MPS, its worker outside it (no peers)");
    let mut mixed = child(&mixed_json, args.max_mib(false).min(64))?;
    mixed.arg("--worker-outside-mps");
    let mixed_ok = mixed.envs(mps.env()).status()?.success();
    mps.shutdown(std::time::Duration::from_secs(30));
    let read = |p: &std::path::Path| -> Result<serde_json::Value> {
        Ok(serde_json::from_str(&std::fs::read_to_string(p)?)?)
    };
    let (plain, under) = (read(&plain_json)?, read(&mps_json)?);
    let mixed = if mixed_ok {
        read(&mixed_json).ok()
    } else {
        None
    };
    let _ = std::fs::remove_dir_all(&dir);
    println!();
    println!(
        "== plain against MPS (recycled medians; the peers under the same daemon; MPS client: {})",
        under["mps_client"]
    );
    println!(
        "  {:>10} {:>11} {:>10} {:>11} {:>10} {:>11} {:>12} {:>11} {:>12}",
        "size",
        "plain µs",
        "MPS µs",
        "plain/MPS",
        "floor µs",
        "MPS/floor",
        "re-lend µs",
        "t.mp µs",
        "t.mp/MPS"
    );
    let rows = |v: &serde_json::Value| v["round_trip"].as_array().cloned().unwrap_or_default();
    let num = |v: &serde_json::Value, k: &str| v[k].as_f64();
    let cell = |v: Option<f64>, p: usize| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.p$}"));
    for (p, m) in rows(&plain).iter().zip(rows(&under).iter()) {
        let (pu, mu) = (num(p, "recycled_median_us"), num(m, "recycled_median_us"));
        let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
        println!(
            "  {:>10} {:>11} {:>10} {:>11} {:>10} {:>11} {:>12} {:>11} {:>12}",
            human(p["bytes"].as_u64().unwrap_or(0)),
            cell(pu, 1),
            cell(mu, 1),
            cell(ratio(pu, mu), 2),
            cell(num(m, "floor_us"), 1),
            cell(ratio(mu, num(m, "floor_us")), 2),
            cell(num(m, "relend_median_us"), 1),
            cell(num(m, "torch_mp_us"), 1),
            cell(ratio(num(m, "torch_mp_us"), mu), 1),
        );
    }
    println!(
        "  export reuse: plain {}, MPS {} (recycled / re-lend, and recycled lends that reused the blob):",
        plain["export_reuse"]["verdict"], under["export_reuse"]["verdict"]
    );
    for (p, m) in rows(&plain).iter().zip(rows(&under).iter()) {
        println!(
            "  {:>10}  plain {}× ({}/{}), MPS {}× ({}/{})",
            human(p["bytes"].as_u64().unwrap_or(0)),
            cell(num(p, "recycled_to_relend"), 2),
            p["recycled_blob_reused"],
            p["recycled_lends"],
            cell(num(m, "recycled_to_relend"), 2),
            m["recycled_blob_reused"],
            m["recycled_lends"],
        );
    }
    match &mixed {
        Some(m) => {
            for r in rows(m) {
                println!(
                    "  worker outside MPS, parent inside: {} {} µs",
                    human(r["bytes"].as_u64().unwrap_or(0)),
                    cell(num(&r, "recycled_median_us"), 1)
                );
            }
        }
        None => println!("  worker outside MPS, parent inside: did not run (see above)"),
    }
    println!(
        "  batch: plain {:.0} tensors/s, MPS {:.0} tensors/s",
        plain["batch"]["tensors_per_s"].as_f64().unwrap_or(f64::NAN),
        under["batch"]["tensors_per_s"].as_f64().unwrap_or(f64::NAN)
    );
    if let Some(path) = &args.plot {
        let mut series = series_from_json("", &plain);
        series.extend(series_from_json("MPS: ", &under));
        crate::plot::plot_round_trips(path, "poolipc bench: plain and under MPS", &series)?;
    }
    if let Some(path) = &args.json_out {
        let both =
            serde_json::json!({"plain": plain, "mps": under, "mps_parent_worker_outside": mixed});
        std::fs::write(path, both.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The chart's lines from one run's JSON: our rungs, then the peers measured beside them.
fn series_from_json(prefix: &str, run: &serde_json::Value) -> Vec<crate::plot::Series> {
    let rows = run["round_trip"].as_array().cloned().unwrap_or_default();
    let line = |name: &str, key: &str, rows: &[serde_json::Value]| crate::plot::Series {
        name: format!("{prefix}{name}"),
        points: rows
            .iter()
            .filter_map(|r| Some((r["bytes"].as_u64()?, r[key].as_f64()?)))
            .collect(),
    };
    let mut out = vec![
        line("pool pointer (recycled)", "recycled_median_us", &rows),
        line(
            "pool pointer, lent again (cached)",
            "relend_median_us",
            &rows,
        ),
        line("host staging", "host_staging_median_us", &rows),
        line("host copy (what it replaces)", "host_copy_median_us", &rows),
        line("floor (bare driver)", "floor_us", &rows),
        line("torch.multiprocessing", "torch_mp_us", &rows),
    ];
    let arena = run["arena_results"].as_array().cloned().unwrap_or_default();
    out.push(line("arena result", "median_us", &arena));
    let copies = run["above_limit_inputs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    out.push(line("above the limit: arena copy", "median_us", &copies));
    out.retain(|s| !s.points.is_empty());
    out
}

/// One size of the above-the-limit table: an input lent by arena copy, read-only and with
/// copy-back, and (above 4 GiB) host staging of the same tensor.
struct CopyRow {
    bytes: u64,
    /// Median round trip lent read-only (no copy-back).
    read_only_us: f64,
    /// Median round trip lent writable: the block copied back after DONE.
    copy_back_us: f64,
    rung: Option<Rung>,
    /// Median round trip by host staging; NaN where the main table has it.
    staged_us: f64,
}

/// One size of the device-memory table: a `cuMemAlloc` tensor and a VMM tensor with an
/// exportable handle, each lent read-only again and again.
struct DevMemRow {
    bytes: u64,
    /// Median round trip of the `cuMemAlloc` tensor.
    copy_us: f64,
    copy_rung: Option<Rung>,
    /// The VMM tensor's first round trip (its FD sent, imported and mapped).
    handle_first_us: f64,
    /// Median round trip of the VMM tensor lent again (the worker's mapping cached).
    handle_us: f64,
    handle_rung: Option<Rung>,
    /// The pool pointer's re-lend of the same size in this run; NaN where the table lacks it.
    pointer_us: f64,
}

/// A VMM allocation made with the POSIX FD handle type and mapped read-write here, as a
/// library that maps its own memory (ComfyUI's weights) makes one.
/// Dropped, or [`free`](VmmTensor::free)d, it unmaps (and frees the range) before it
/// releases the handle: the fields' order.
struct VmmTensor<'d> {
    mapping: poolipc_driver::VmmMapping<&'d dyn Driver>,
    handle: poolipc_driver::VmmAllocation<&'d dyn Driver>,
    ptr: poolipc::DevicePtr,
}

impl<'d> VmmTensor<'d> {
    fn new(d: &'d dyn Driver, device: u32, bytes: u64) -> Result<VmmTensor<'d>> {
        let g = d.vmm_granularity(device, poolipc_driver::Granularity::Minimum)?;
        let len = bytes.next_multiple_of(g.max(1));
        // What fails below undoes what succeeded: the owning values' drops.
        let handle =
            poolipc_driver::VmmAllocation::create(d, device, len).context("cuMemCreate")?;
        let range = poolipc_driver::VmmReservation::reserve(d, len, 0)?;
        let mapping = poolipc_driver::VmmMapping::map(range, handle.handle())?;
        mapping.set_access(device, poolipc_driver::Access::ReadWrite)?;
        let ptr = mapping.ptr();
        Ok(VmmTensor {
            mapping,
            handle,
            ptr,
        })
    }

    fn free(self) -> Result<()> {
        self.mapping.close()?;
        self.handle.close()?;
        Ok(())
    }
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
        let p = floor_line(line).unwrap();
        assert_eq!((p.bytes, p.us, p.no_export_us), (64 * MIB, 332.65, None));
        let line = r#"{"event": "handoff_round_trip", "bytes": 4096, "us_median": 320.0, "export_us": 20.5}"#;
        assert_eq!(floor_line(line).unwrap().no_export_us, Some(299.5));
        assert_eq!(
            floor_line(r#"{"event": "uds_ping_pong", "bytes": 80, "us_median": 13.17}"#),
            None
        );
        assert_eq!(floor_line("not json"), None);
    }

    #[test]
    fn torchmp_lines_give_size_and_median_in_microseconds() {
        let line = r#"{"event": "torch_mp_round_trip", "size": "4GiB", "round_trip_ms_median": 1.47, "first_ms": 3.2}"#;
        let p = torchmp_line(line).unwrap();
        assert_eq!(p.bytes, 4096 * MIB);
        assert!((p.us - 1470.0).abs() < 1e-6);
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
