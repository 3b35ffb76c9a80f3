//! `poolipc doctor`: a table of what this machine can do, and a verdict.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Result;
use poolipc::advanced::driver::sim::{SimConfig, SimDriver};
use poolipc::advanced::driver::{
    CuCode, CudaDriver, DeviceAllocation, Driver, Granularity, OwnedEvent, OwnedPool, OwnedStream,
    PoolAllocation, PoolSharing, VmmAllocation, VmmMapping, VmmReservation, platform,
};
use poolipc::advanced::pool::{ImportLimit, SharedPool};

use crate::probe;

/// Options of `poolipc doctor`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Also find the import crash boundary, importing growing allocations in sacrificial
    /// child processes (takes a few seconds per probe).
    #[arg(long)]
    probe_limit: bool,
    /// Examine the simulated driver instead of the GPU (for machines without one).
    #[arg(long)]
    sim: bool,
    /// The device to examine.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// With --sim: how many simulated devices.
    #[arg(long, default_value_t = 1)]
    sim_devices: u32,
    /// With --sim: simulated devices that cannot reach each other (no peer path).
    #[arg(long)]
    sim_no_peer: bool,
    /// With --sim: a simulated driver whose pointer exports name the allocation, so an old
    /// allocation's export does not reach a new one at its address (export reuse not
    /// proven, every allocation exported).
    #[arg(long)]
    sim_blob_per_allocation: bool,
    /// Print one JSON object instead of the table (for scripts): every row by its label, the
    /// devices, the peer-access matrix, the failures and the verdict.
    #[arg(long)]
    json: bool,
}

struct Table {
    failures: Vec<String>,
    /// `--json`: rows are kept for the object printed at the end, not printed.
    json: bool,
    rows: serde_json::Map<String, serde_json::Value>,
}

impl Table {
    fn row(&mut self, what: &str, value: impl std::fmt::Display) {
        if self.json {
            self.rows.insert(
                what.to_owned(),
                serde_json::Value::String(value.to_string()),
            );
        } else {
            println!("  {what:<24} {value}");
        }
    }

    /// A line of the table's prose (headings, the verdict): not part of the JSON.
    fn say(&self, line: impl std::fmt::Display) {
        if !self.json {
            println!("{line}");
        }
    }

    /// Prints the JSON object (`--json`): the rows, then `extra`'s fields.
    fn print_json(&self, extra: serde_json::Value) {
        let mut out = serde_json::Map::new();
        out.insert("rows".into(), serde_json::Value::Object(self.rows.clone()));
        out.insert("failures".into(), serde_json::json!(self.failures));
        if let serde_json::Value::Object(fields) = extra {
            out.extend(fields);
        }
        println!("{}", serde_json::Value::Object(out));
    }

    fn check<T>(&mut self, what: &str, result: Result<T>, show: impl FnOnce(&T) -> String) {
        match result {
            Ok(v) => self.row(what, format!("yes — {}", show(&v))),
            Err(e) => {
                self.row(what, format!("NO — {e:#}"));
                self.failures.push(format!("{what}: {e:#}"));
            }
        }
    }
}

pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let mut t = Table {
        failures: Vec::new(),
        json: args.json,
        rows: serde_json::Map::new(),
    };
    t.say("poolipc doctor");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    t.row("kernel", release.trim());
    t.row(
        "WSL2",
        if platform::is_wsl2() {
            "yes (no interprocess events or pool FD export there)"
        } else {
            "no"
        },
    );
    t.row(
        "libcuda",
        if CudaDriver::library_present() {
            "found"
        } else {
            "not found"
        },
    );

    let mps = poolipc::mps::MpsProbe::detect();
    t.row(
        "MPS control program",
        mps.control_binary
            .as_ref()
            .map_or_else(|| "not installed".to_owned(), |p| p.display().to_string()),
    );
    t.row(
        "MPS control daemon",
        format!(
            "{} at {} ({})",
            if mps.daemon_reachable {
                "reachable"
            } else {
                "none"
            },
            mps.pipe_directory.display(),
            if mps.pipe_directory_from_env {
                "CUDA_MPS_PIPE_DIRECTORY"
            } else {
                "the default"
            }
        ),
    );
    tuning_rows(&mut t);
    let mps_json = |client: Option<bool>| {
        serde_json::json!({
            "control_binary": mps.control_binary.as_ref().map(|p| p.display().to_string()),
            "pipe_directory": mps.pipe_directory.display().to_string(),
            "pipe_directory_from_env": mps.pipe_directory_from_env,
            "daemon_reachable": mps.daemon_reachable,
            "client": client,
        })
    };

    let (driver, child_env): (Arc<dyn Driver>, _) = if args.sim {
        let sim = SimDriver::new(SimConfig {
            devices: args.sim_devices,
            peer_access: !args.sim_no_peer,
            blob_per_allocation: args.sim_blob_per_allocation,
            ..SimConfig::default()
        })?;
        let env = sim.child_env();
        t.row("driver", "SIMULATED (--sim): no GPU is examined");
        (Arc::new(sim), Some(env))
    } else {
        match CudaDriver::new() {
            Ok(d) => (Arc::new(d), None),
            Err(e) => {
                t.row("CUDA driver", format!("unusable: {e}"));
                t.say("");
                t.say("verdict: no usable GPU here, so nothing can be shared on hardware.");
                t.say(
                    "         `poolipc doctor --sim` examines the simulated driver the tests use.",
                );
                if t.json {
                    t.print_json(serde_json::json!({
                        "usable_gpu": false,
                        "mps": mps_json(None),
                        "pool_pointer": false,
                        "verdict": "no usable GPU here",
                    }));
                }
                return Ok(ExitCode::SUCCESS);
            }
        }
    };
    let d = &*driver;
    let v = d.driver_version()?;
    t.row(
        "driver API version",
        format!("{}.{} ({v})", v / 1000, v % 1000 / 10),
    );
    let count = d.device_count()?;
    t.row("devices", count);
    let mut devices = Vec::new();
    for i in 0..count {
        let info = d.device_info(i)?;
        devices.push(serde_json::json!({
            "ordinal": i,
            "name": info.name,
            "uuid": info.uuid.to_string(),
            "total_mib": info.total_memory >> 20,
        }));
        t.row(
            &format!("device {i}"),
            format!(
                "{} {} {} MiB",
                info.name,
                info.uuid,
                info.total_memory >> 20
            ),
        );
    }
    // Row i, column j: whether device i can access device j (null on the diagonal or when
    // the driver could not say).
    let peers: Vec<Vec<Option<bool>>> = (0..count)
        .map(|i| {
            (0..count)
                .map(|j| {
                    (i != j)
                        .then(|| d.device_can_access_peer(i, j).ok())
                        .flatten()
                })
                .collect()
        })
        .collect();
    if count > 1 {
        t.say("  peer access (row can access column; cuDeviceCanAccessPeer):");
        let header: String = (0..count).map(|j| format!("{j:>4}")).collect();
        t.say(format!("  {:<24} {header}", ""));
        for (i, cells) in peers.iter().enumerate() {
            let row: String = cells
                .iter()
                .enumerate()
                .map(|(j, cell)| {
                    let cell = match cell {
                        _ if i == j => "-",
                        Some(true) => "yes",
                        Some(false) => "no",
                        None => "err",
                    };
                    format!("{cell:>4}")
                })
                .collect();
            t.say(format!("  {:<24} {row}", format!("device {i}")));
        }
    }
    if args.device >= count {
        anyhow::bail!("device {} does not exist ({count} visible)", args.device);
    }
    let dev = args.device;
    d.use_device(dev)?;
    let info = d.device_info(dev)?;
    t.row("MPS client", mps_meaning(info.mps_client));
    t.row("memory pools", yes_no(info.memory_pools));
    t.row("pool export by POSIX FD", yes_no(info.pool_posix_fd));
    t.check("job bounds (defaults)", job_bounds(d), |s| s.clone());

    t.check("pool swap possible", swap_check(&driver, dev), |s| {
        s.clone()
    });
    t.check("pointer export order", export_order_check(d, dev), |s| {
        s.clone()
    });
    t.check("interprocess events", events_check(d), |s| s.clone());
    let vmm = vmm_check(d, dev, info.vmm && info.vmm_posix_fd);
    let arena = vmm.is_ok();
    match vmm {
        Ok(s) => t.row("VMM (for the arena)", format!("yes — {s}")),
        Err(e) => t.row(
            "VMM (for the arena)",
            format!("no — {e:#} (the arena rung is unavailable)"),
        ),
    }
    t.say("  how each kind of device memory is lent from here (each made and asked once):");
    let pointer = if t.failures.is_empty() {
        "pool pointer (no copy), within the import limit; above it: arena copy"
    } else {
        "not by pool pointer (see the failures): arena copy or host staging"
    };
    t.row("lend: pool memory", pointer);
    for (what, how) in memory_kinds(d, dev, arena) {
        t.row(what, how);
    }
    let limit = ImportLimit::default();
    t.row(
        "import limit (rule)",
        format!(
            "≤ {} chunks of {} MiB per allocation ({} MiB when chunk-aligned)",
            limit.max_chunks(),
            limit.chunk_bytes() >> 20,
            limit.max_bytes_at(0) >> 20
        ),
    );
    let reuse_env = child_env.clone();
    if args.probe_limit {
        t.say("  probing the import crash boundary in sacrificial children:");
        let report = probe::probe_limit(Arc::clone(&driver), dev, child_env, args.json)?;
        match report.last_good {
            Some(b) => t.row("last good import size", format!("{} MiB", b >> 20)),
            None => t.row("last good import size", "none at or above 4096 MiB"),
        }
        match report.first_bad {
            Some((b, outcome)) => t.row(
                "first bad import size",
                format!("{} MiB: {outcome}", b >> 20),
            ),
            None => t.row("first bad import size", "none up to 8192 MiB"),
        }
        t.row("parent after the probes", "alive");
    }
    // Last: the parent it starts leaves its pool installed in this process.
    let reuse = if t.failures.is_empty() {
        export_reuse_check(&driver, dev, reuse_env)
    } else {
        Err(anyhow::anyhow!(
            "not checked: pool pointers do not work here"
        ))
    };
    let reuse_json = match &reuse {
        Ok((verdict, why)) => serde_json::json!({
            "verdict": format!("{verdict:?}"),
            "why_not": why,
        }),
        Err(e) => serde_json::json!({ "verdict": "NotChecked", "why_not": format!("{e:#}") }),
    };
    match reuse {
        Ok((poolipc::ExportReuse::Proven, _)) => t.row(
            "export reuse (recycled address)",
            "proven — a worker imported an old allocation's blob and reached the new allocation \
             of the same size at its address: recycled allocations of the same size are lent \
             without a new export (about 0.4 ms/GiB saved)",
        ),
        Ok((verdict, why)) => t.row(
            "export reuse (recycled address)",
            format!(
                "{verdict} — {}; every new allocation is exported (about 0.4 ms/GiB)",
                why.unwrap_or_else(|| "no verdict".into())
            ),
        ),
        Err(e) => t.row(
            "export reuse (recycled address)",
            format!("not checked — {e:#}; every new allocation is exported"),
        ),
    }
    t.say("");
    let verdict = if t.failures.is_empty() {
        format!(
            "poolipc can hand tensors over by pool pointer on device {dev} ({})",
            d.kind()
        )
    } else {
        format!(
            "poolipc cannot use pool pointers on device {dev}: handoffs would take the host-staging rung"
        )
    };
    if t.failures.is_empty() {
        t.say(format!("verdict: {verdict}."));
    } else {
        t.say(format!(
            "verdict: poolipc cannot use pool pointers on device {dev}:"
        ));
        for f in &t.failures {
            t.say(format!("         - {f}"));
        }
        t.say("         handoffs would take the host-staging rung.");
    }
    if t.json {
        t.print_json(serde_json::json!({
            "usable_gpu": !args.sim,
            "driver": d.kind().to_string(),
            "device": dev,
            "devices": devices,
            "peer_access": peers,
            "mps": mps_json(info.mps_client),
            "pool_pointer": t.failures.is_empty(),
            "export_reuse": reuse_json,
            "verdict": verdict,
        }));
    }
    Ok(ExitCode::SUCCESS)
}

/// The facade's export reuse check (see `poolipc::canary`) with a real worker process: a
/// parent without the canary battery, one demo worker, `Parent::check_export_reuse`.
fn export_reuse_check(
    driver: &Arc<dyn Driver>,
    dev: u32,
    child_env: Option<(&'static str, String)>,
) -> Result<(poolipc::ExportReuse, Option<String>)> {
    use anyhow::Context as _;
    let options = poolipc::ParentOptions {
        device: dev,
        canary: false,
        ..poolipc::ParentOptions::default()
    };
    let parent = poolipc::Parent::new(Arc::clone(driver), options).context("starting a parent")?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.arg("__demo-worker")
        .env("POOLIPC_DEMO_DEVICE", dev.to_string());
    if let Some((k, v)) = &child_env {
        cmd.env(k, v);
    }
    let worker = parent.spawn_worker(cmd).context("starting a worker")?;
    let verdict = parent.check_export_reuse(worker);
    let _ = parent.stop_worker(worker);
    Ok(verdict?)
}

/// What a parent made here would use for its IO threads and its spins (the CPU it burns to
/// save wake-ups), and which environment variable set each.
fn tuning_rows(t: &mut Table) {
    let defaults = poolipc::ParentOptions::default();
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let spin_rule = format!("the default with {cpus} CPUs: none below 4");
    let io_rule = format!("the default with {cpus} CPUs: one per 4, 1 to 4");
    let turn = match defaults.tuning.gpu_turn {
        Some(t) if !t.is_zero() => format!("{} µs", t.as_micros()),
        _ => "none".to_owned(),
    };
    let rows = [
        (
            "parent IO threads",
            defaults.tuning.io_threads.to_string(),
            "POOLIPC_IO_THREADS",
            io_rule.as_str(),
        ),
        (
            "parent spin when idle",
            format!("{} µs", defaults.tuning.spin.as_micros()),
            "POOLIPC_SPIN_US",
            spin_rule.as_str(),
        ),
        (
            "parent spin in flight",
            format!("{} µs", defaults.tuning.spin_in_flight.as_micros()),
            "POOLIPC_SPIN_IN_FLIGHT_US",
            spin_rule.as_str(),
        ),
        (
            "spins yield",
            yes_no(poolipc::Tuning::spin_yields()).to_owned(),
            "POOLIPC_SPIN_YIELD",
            "yes by default",
        ),
        (
            "startup copy of 1 MiB",
            yes_no(defaults.tuning.warm_copies).to_owned(),
            "POOLIPC_WARM_COPIES",
            "no by default, an experiment on the plain turn-taking, docs/facts.md",
        ),
        (
            "GPU turns without MPS",
            turn,
            "POOLIPC_GPU_TURN_US",
            "none by default; 2000 µs measured: workers running many small GPU jobs from threads of their own take the GPU in turns, docs/facts.md",
        ),
        (
            "direct path (caller lends itself)",
            yes_no(defaults.tuning.direct).to_owned(),
            "POOLIPC_DIRECT",
            "yes by default where the parent's idle spin is 0 (below 4 CPUs), else no: a submitting or waiting thread does the IO thread's work for its job while that thread sleeps, docs/performance.md",
        ),
        (
            "READY aside when idle",
            yes_no(defaults.tuning.ready_aside).to_owned(),
            "POOLIPC_READY_ASIDE",
            "yes by default: without MPS it spares a context switch each way, docs/facts.md",
        ),
        (
            "arena copies through the host up to",
            format!("{} KiB", defaults.tuning.copy_through_host >> 10),
            "POOLIPC_COPY_THROUGH_HOST_BYTES",
            "2 MiB by default, without MPS only: pinned host copies spare the GPU a change of context each way, docs/facts.md",
        ),
    ];
    for (what, value, env, rule) in rows {
        let source = match std::env::var_os(env) {
            Some(v) if v.to_str().is_some_and(|v| v.trim().parse::<u64>().is_ok()) => {
                format!("set by {env}")
            }
            Some(v) => format!("{rule}: {env}={v:?} is not a whole number"),
            None => format!("{rule}; {env} sets it"),
        };
        t.row(what, format!("{value} ({source})"));
    }
}

/// The parent's default bounds on one job and one worker on this device: the result bytes
/// (fractions of the device's memory, clamped), the arenas' cap, the handoff deadline, the
/// messages without progress and the cancel grace.
fn job_bounds(d: &dyn Driver) -> Result<String> {
    let (_, total) = d.mem_get_info()?;
    let o = poolipc::ParentOptions::default();
    let l = o.limits_for(total).map_err(|e| anyhow::anyhow!(e))?;
    let gib = |b: u64| {
        #[allow(clippy::cast_precision_loss)]
        let g = b as f64 / f64::from(1u32 << 30);
        format!("{g:.1} GiB")
    };
    Ok(format!(
        "device {}: result bytes per job {} (0.5 of it, 256 MiB to 32 GiB), per worker {} \
         (0.6, 256 MiB to 48 GiB), arenas' cap {} (0.5); a job fails after {} s without \
         progress or {} messages that are not progress; a cancelled job's worker is killed \
         after {} s (ParentOptions)",
        gib(total),
        gib(l.max_result_bytes_per_job),
        gib(l.max_result_bytes_per_worker),
        gib(l.arena_cap),
        o.handoff_timeout.as_secs(),
        o.max_idle_messages,
        o.cancel_grace.as_secs()
    ))
}

/// What being (or not being) an MPS client means for a handoff, in one row.
fn mps_meaning(client: Option<bool>) -> &'static str {
    match client {
        Some(true) => {
            "yes — processes share one GPU context: a handoff skips the GPU's turn-taking (about 40 µs round trip instead of 320 µs on an H200), and a GPU fault in any client ends every client's context, this one's too"
        }
        Some(false) => {
            "no — a handoff whose READY must go on a stream that is still computing waits while two processes take turns on the GPU (about 260 µs of a 330 µs round trip on an H200), and several workers computing at once make the GPU change between their contexts (the parent gives them turns: GPU turns below); for trusted workers, `poolipc mps --accept-shared-gpu-faults -- CMD` or poolipc.start_mps(accept_shared_gpu_faults=True) removes it (docs/guide.md: MPS)"
        }
        None => "unknown (the driver does not report CU_DEVICE_ATTRIBUTE_MPS_ENABLED)",
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn swap_check(driver: &Arc<dyn Driver>, dev: u32) -> Result<String> {
    let pool = SharedPool::install(Arc::clone(driver), dev)?;
    let d = &**driver;
    let stream = OwnedStream::new(d)?;
    let alloc = PoolAllocation::new(d, 1 << 20, stream.handle())?;
    let ours = d.pointer_get_mempool(alloc.ptr())? == pool.handle();
    alloc.free(stream.handle())?;
    d.stream_synchronize(stream.handle())?;
    stream.close()?;
    pool.uninstall()?;
    anyhow::ensure!(
        ours,
        "an allocation after the swap did not come from the swapped pool"
    );
    Ok("cuDeviceSetMemPool took; stream-ordered allocations came from the shareable pool".into())
}

fn export_order_check(d: &dyn Driver, dev: u32) -> Result<String> {
    // Torn down in this order below: the allocation, then its pool, then the stream.
    let stream = OwnedStream::new(d)?;
    let pool = OwnedPool::create(d, dev, PoolSharing::PosixFd)?;
    let alloc = PoolAllocation::from_pool(d, 1 << 20, pool.handle(), stream.handle())?;
    let ptr = alloc.ptr();
    d.stream_synchronize(stream.handle())?;
    let before = d.mem_pool_export_pointer(ptr);
    let _fd = d.mem_pool_export_fd(pool.handle())?;
    let after = d.mem_pool_export_pointer(ptr);
    alloc.free(stream.handle())?;
    d.stream_synchronize(stream.handle())?;
    pool.close()?;
    stream.close()?;
    after?;
    Ok(match before {
        Err(e) if e.code() == Some(CuCode::INVALID_VALUE) => {
            "pointer export needs the pool FD exported first (INVALID_VALUE before); poolipc does that".into()
        }
        Err(e) => format!("pointer export before the FD export failed otherwise: {e}"),
        Ok(_) => "pointer export works even before the pool FD export".into(),
    })
}

fn events_check(d: &dyn Driver) -> Result<String> {
    let ev = OwnedEvent::new(d, true)?;
    let h = ev.ipc_handle();
    ev.close()?;
    h?;
    Ok("cuIpcGetEventHandle works".into())
}

/// How a tensor of each kind of device memory outside the shared pool would be lent from this
/// process, found by making one of each (2 MiB or a granule) and asking the driver what the
/// parent asks at a lend: the pointer's device and pool, whether a VMM handle can be retained,
/// whether it has the POSIX FD handle type and exports, whether it has a buffer id.
fn memory_kinds(d: &dyn Driver, dev: u32, arena: bool) -> Vec<(&'static str, String)> {
    let copy = if arena {
        "arena copy (one device-to-device copy)"
    } else {
        "host staging (no arena on this device)"
    };
    let mut rows = Vec::new();
    let plain = DeviceAllocation::new(d, 2 << 20)
        .map_err(anyhow::Error::from)
        .and_then(|mem| {
            let p = mem.ptr();
            let info = d.pointer_info(p);
            // A retained handle (unexpected) is released when dropped here.
            let retained = VmmAllocation::retain(d, p).map(drop);
            mem.close()?;
            let info = info?;
            anyhow::ensure!(
                info.device == Some(dev) && info.pool.is_none(),
                "the driver places it on {:?}, pool {:?}",
                info.device,
                info.pool
            );
            Ok(if retained.is_ok() {
                "arena copy (a handle was retained from it, unexpectedly)".to_owned()
            } else {
                copy.to_owned()
            })
        });
    rows.push((
        "lend: cuMemAlloc memory",
        plain.unwrap_or_else(|e| format!("host staging ({e:#})")),
    ));
    for (what, exportable) in [
        ("lend: VMM with POSIX FD", true),
        ("lend: VMM without", false),
    ] {
        let how = vmm_kind(d, dev, exportable).map(|by_handle| match by_handle {
            Ok(()) => "VMM handle (no copy; mapped once per worker)".to_owned(),
            Err(why) => format!("{copy}: {why}"),
        });
        rows.push((what, how.unwrap_or_else(|e| format!("{copy} ({e:#})"))));
    }
    rows
}

/// Makes a VMM allocation of one granule with or without the POSIX FD handle type, maps it,
/// and says whether the parent could lend it by handle (`Ok(Ok(()))`) or why not.
fn vmm_kind(d: &dyn Driver, dev: u32, exportable: bool) -> Result<Result<(), String>> {
    let g = d.vmm_granularity(dev, Granularity::Minimum)?;
    let h = if exportable {
        VmmAllocation::create(d, dev, g)?
    } else {
        VmmAllocation::create_unshared(d, dev, g)?
    };
    let answer = (|| -> Result<Result<(), String>> {
        let range = VmmReservation::reserve(d, g, 0)?;
        let va = range.ptr();
        // Unmapped (then its range freed) before the handle is released below.
        let mapping = VmmMapping::map(range, h.handle())?;
        let asked = (|| -> Result<Result<(), String>> {
            mapping.set_access(dev, poolipc::advanced::driver::Access::ReadWrite)?;
            let info = d.pointer_info(va)?;
            let retained = match VmmAllocation::retain(d, va) {
                Ok(r) => r,
                Err(e) => return Ok(Err(format!("no handle retained: {e}"))),
            };
            let fd = match d.vmm_exports_fd(retained.handle()) {
                Ok(true) => d
                    .vmm_export_fd(retained.handle())
                    .map(drop)
                    .map_err(|e| e.to_string()),
                Ok(false) => Err("made without the POSIX FD handle type".to_owned()),
                Err(e) => Err(e.to_string()),
            };
            retained.close()?;
            // The parent sends the pointer's range as the length the worker maps: it must be
            // the mapping, from its first byte.
            let range = if info.base == va && info.size == g {
                Ok(())
            } else {
                Err(format!(
                    "the driver's range of the mapping is {} bytes at {:#x}, not the {g} \
                     mapped at {:#x}",
                    info.size, info.base.0, va.0
                ))
            };
            Ok(fd.and(range).and_then(|()| match info.buffer_id {
                Some(_) => Ok(()),
                None => Err("the driver gives it no buffer id".to_owned()),
            }))
        })();
        mapping.close()?;
        asked
    })();
    h.close()?;
    answer
}

fn vmm_check(d: &dyn Driver, dev: u32, supported: bool) -> Result<String> {
    anyhow::ensure!(
        supported,
        "the device does not report VMM with POSIX FD handles"
    );
    let g = d.vmm_granularity(dev, Granularity::Minimum)?;
    let h = VmmAllocation::create(d, dev, g)?;
    let fd = d.vmm_export_fd(h.handle());
    h.close()?;
    fd?;
    Ok(format!(
        "cuMemCreate + FD export work, granularity {} KiB",
        g >> 10
    ))
}
