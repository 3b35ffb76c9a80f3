//! `poolipc bench`: the handoff's round trip against the copy it replaces, in one run.
//!
//! [`run`] picks the mode; a run of the table starts a parent and its worker, measures each
//! section in turn (`scenarios`), then the peers and the other processes (`peers`), and
//! reports (`report`).

mod peers;
mod report;
mod scenarios;
mod throughput;

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use poolipc::advanced::driver::{Driver, OwnedStream};

use peers::Peers;
use report::Measured;
use scenarios::Bench;

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
    /// The round-trip table's sizes instead of 4 KiB, 1 MiB, 64 MiB, 1 GiB and 4 GiB, as
    /// bytes or with K, M or G (KiB, MiB, GiB): `--sizes 4K,64K,1M,2M,8M,32M,64M` (how the
    /// round trip changes with the allocation's size). `--max-mib` still caps them.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, value_name = "SIZE,..")]
    pub(crate) sizes: Option<Vec<u64>>,
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
    /// What the workers do with a job: `touch` (a write of the first 4 KiB of each input on
    /// the job's stream, the default) or `noop` (finish it at once: `bench/pysplit.py`, and
    /// what the round trip costs without the worker's GPU work).
    #[arg(long, hide = true, default_value = "touch", value_parser = ["touch", "noop"])]
    pub(crate) worker_mode: String,
    /// (with --workers) The stream each caller thread lends on: `own` (a stream of its own,
    /// the default) or `legacy` (the legacy default stream, which `bench/pysplit.py`'s Python
    /// parent lends on; shared by every thread, so compare it with one worker). Without MPS
    /// the Rust loop paid the GPU's turn-taking at 4 KiB (296 µs) where pysplit's Python
    /// parent did not (27 µs, H100, 2026-12-05): this tells whether the stream is why.
    #[arg(long, hide = true, default_value = "own", value_parser = ["own", "legacy"])]
    pub(crate) caller_stream: String,
    /// (with --workers) What the parent does before it measures, comma-separated: `canary`
    /// (each worker's canary battery, as `ParentOptions::default()` runs it; the bench skips
    /// it otherwise), `staging` (one job on each worker by host staging), `fill` (a memset in
    /// the parent), `host-copy` (a device → host → device copy in the parent), each of
    /// `--prime-bytes`, and `idle` (a second with no GPU work: does what they changed last?),
    /// in the order given (`host-copy,fill` and `fill,host-copy` differ). Without MPS a 4 KiB job lent again to a noop worker took 286 µs without the battery
    /// and 21 µs with it (H100, 2026-12-05; docs/facts.md): the other steps tell which part
    /// of the battery's work makes the difference.
    #[arg(long, requires = "workers", value_delimiter = ',', value_parser = ["canary", "staging", "host-copy", "fill", "idle"], value_name = "STEP,..")]
    pub(crate) prime: Vec<String>,
    /// (with --prime) The size of its staging job, fill and host copy.
    #[arg(long, requires = "prime", value_parser = parse_size, default_value = "4K")]
    pub(crate) prime_bytes: u64,
    /// (with --workers) The parent's IO threads (`Tuning::io_threads`), one table
    /// each, in the same run (each from a process of its own): `--io-threads 1,2,4`.
    /// Default: the library's (`POOLIPC_IO_THREADS`, else one per 4 CPUs, 1 to 4). With
    /// `--json-out PATH` and several counts, each writes `PATH.io<n>`.
    #[arg(long, value_delimiter = ',', value_name = "N,..")]
    pub(crate) io_threads: Vec<usize>,
    /// (with --workers) Measure every worker count this many times, in rounds (1, 2, 4, ..
    /// then again), and print each count's median jobs/s and the median and range of its
    /// ratio to one worker taken within each round: one worker's rate, the ratios' base,
    /// moves by a third between measurements (H100, 2026-12-05). 1 to 20.
    #[arg(long, requires = "workers", default_value_t = 1, value_name = "R")]
    pub(crate) rounds: usize,
}

impl Args {
    /// The round-trip table's sizes: `--sizes`, or the five defaults.
    fn round_trip_sizes(&self) -> Vec<u64> {
        self.sizes
            .clone()
            .unwrap_or_else(|| vec![4 * KIB, MIB, 64 * MIB, 1024 * MIB, 4096 * MIB])
    }

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

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The largest size `--sizes` takes: 64 GiB.
const MAX_SIZE: u64 = 64 << 30;

/// A size of `--sizes`: bytes, or a number with `K`, `M` or `G` (KiB, MiB, GiB; `KiB` and
/// the like too), from one byte to 64 GiB.
fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(digits);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (bytes, or a number with K, M or G)"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => return Err(format!("{text:?}: the unit {unit:?} is not K, M or G")),
    };
    let bytes = n
        .checked_mul(1 << shift)
        .filter(|b| (1..=MAX_SIZE).contains(b))
        .ok_or_else(|| format!("{text:?} is not between one byte and 64 GiB"))?;
    Ok(bytes)
}

/// Runs `f` with `parent`'s tensors sent by host staging (the import limit lowered to nothing,
/// the arena-copy rung kept out of its way), then puts both back, also when `f` failed.
pub(crate) fn host_staged<T>(parent: &poolipc::Parent, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let pointer_limit = parent.options().limit;
    parent.set_arena_copy(false);
    let out = poolipc::advanced::pool::ImportLimit::new(pointer_limit.chunk_bytes(), 0)
        .context("limit")
        .and_then(|none| Ok(parent.lower_import_limit(none)?))
        .and_then(|()| f());
    let restored = parent.lower_import_limit(pointer_limit);
    parent.set_arena_copy(true);
    let out = out?;
    restored?;
    Ok(out)
}

/// `bytes` in KiB, MiB or GiB, rounded down.
pub(crate) fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{} GiB", bytes >> 30)
    } else if bytes >= MIB {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    if let (Some(from), Some(to)) = (&args.from_json, &args.plot) {
        return report::plot_from_json(from, to);
    }
    if let Some(n) = args.workers {
        return throughput::run(args, n);
    }
    if args.mps {
        return run_plain_and_mps(args);
    }
    run_table(args)
}

/// The round-trip table and the sections after it, on one parent and its worker.
fn run_table(args: &Args) -> Result<ExitCode> {
    let (driver, child_env, which) = crate::demo::open_driver(args.sim, args.device)?;
    // The simulated driver's device memory is this machine's memory: smaller sizes by default.
    let sim = child_env.is_some();
    if !args.json {
        println!("poolipc bench {which}");
    }
    let parent = scenarios::parent(&driver, args.device)?;
    let mps_client = parent.mps_client();
    if !args.json && mps_client == Some(true) {
        println!(
            "  (this process is an MPS client: the GPU's turn-taking between processes is gone)"
        );
    }
    let cmd = peers::touch_worker(args, &child_env)?;
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
    let owned_stream = OwnedStream::new(d.clone())?;
    let stream = owned_stream.handle();
    // Rows the device cannot hold are skipped, and said so, instead of ending the run.
    let mut skipped = Vec::new();
    let b = Bench {
        args,
        sim,
        parent: &parent,
        d: &*d,
        worker,
        stream,
        child_env: &child_env,
    };
    let rows = scenarios::round_trips(&b, &mut skipped)?;
    let copy_rows = scenarios::arena_copies(&b, &mut skipped)?;
    let devmem_rows = scenarios::device_memory(&b, &rows, &mut skipped)?;
    let arena_rows = scenarios::arena_results(&b, &mut skipped)?;
    let isolation_rows = scenarios::isolation(&b, &rows, &mut skipped)?;
    let batch = scenarios::batch(&b)?;
    let cache = parent.pool().export_cache_stats();
    let counts = parent.stats();
    parent.stop_worker(worker)?;
    // The peers, measured in the same run, after ours (they need the GPU too).
    let peers = Peers::run(args);
    let measured = Measured {
        driver: d.kind().to_string(),
        mps_client,
        reuse,
        reuse_why,
        rows,
        copy_rows,
        devmem_rows,
        arena_rows,
        isolation_rows,
        batch,
        cache,
        counts,
        skipped,
    };
    let json = report::json(&measured, &peers);
    if let Some(path) = &args.json_out {
        std::fs::write(path, json.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let title = format!("poolipc bench ({}): round trip against size", d.kind());
        crate::plot::plot_round_trips(path, &title, &report::series_from_json("", &json))?;
    }
    if args.json {
        println!("{json}");
        return Ok(ExitCode::SUCCESS);
    }
    report::print(&measured, &peers, args.iterations, &args.worker_mode);
    Ok(ExitCode::SUCCESS)
}

/// `--mps`: the table plainly, then under a private MPS daemon, each in a child of ours (a
/// process joins MPS when it initialises CUDA, so this one never does), then the ratios.
fn run_plain_and_mps(args: &Args) -> Result<ExitCode> {
    let dir = std::env::temp_dir().join(format!("poolipc-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let plain_json = dir.join("plain.json");
    let mps_json = dir.join("mps.json");
    println!("== poolipc bench, plain (no MPS)");
    let status = peers::bench_child(args, &plain_json, args.max_mib(false))?
        .env_remove(poolipc::advanced::driver::mps_env::PIPE_DIRECTORY_ENV)
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
    let status = peers::bench_child(args, &mps_json, args.max_mib(false))?
        .envs(mps.env())
        .status()?;
    anyhow::ensure!(status.success(), "the bench under MPS failed: {status}");
    // A parent under MPS with a worker outside it: pool IPC crosses, the turn-taking returns.
    let mixed_json = dir.join("mixed.json");
    println!();
    println!(
        "== poolipc bench, the parent under MPS, its worker outside it: measured; its round \
         trips are the \"worker outside MPS\" rows below"
    );
    let mut mixed = peers::bench_child(args, &mixed_json, args.max_mib(false).min(64))?;
    mixed.arg("--worker-outside-mps");
    // Its own tables stay unprinted: every row of them has a worker outside MPS, which a
    // reader looking for the MPS figures would take for them. Its errors still show.
    let mixed_ok = mixed
        .envs(mps.env())
        .stdout(std::process::Stdio::null())
        .status()?
        .success();
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
    report::print_plain_against_mps(&plain, &under, &mixed);
    if let Some(path) = &args.plot {
        let mut series = report::series_from_json("", &plain);
        series.extend(report::series_from_json("MPS: ", &under));
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

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_read_as_bytes_or_with_a_binary_unit() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4 << 10));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("32MiB"), Ok(32 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("64G"), Ok(64 << 30));
    }

    #[test]
    fn a_size_that_is_not_one_is_refused_with_its_text() {
        for bad in [
            "",
            "K",
            "4X",
            "-4K",
            "0",
            "65G",
            "99999999999999999999",
            "4 K",
        ] {
            let e = parse_size(bad).expect_err(bad);
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }
}
