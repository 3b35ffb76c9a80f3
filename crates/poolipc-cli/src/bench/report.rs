//! What a run prints and writes: the tables and their ratios, the JSON object other tools
//! read (`--json`, `--json-out`), the chart's lines (`--plot`), and the plain-against-MPS
//! comparison of `--mps`.

use std::process::ExitCode;

use anyhow::{Context, Result};
use poolipc::ExportReuse;
use poolipc::advanced::pool::ExportCacheStats;

use super::peers::{Peers, find};
use super::scenarios::{ArenaRow, Batch, CopyRow, DevMemRow, IsolationRow, Row};
use super::{MIB, human};

/// Everything one run of the table measured, for the report.
pub(super) struct Measured {
    /// The driver's kind, as the JSON names it.
    pub(super) driver: String,
    pub(super) mps_client: Option<bool>,
    pub(super) reuse: ExportReuse,
    /// Why export reuse is not proven, where it is not.
    pub(super) reuse_why: Option<String>,
    pub(super) rows: Vec<Row>,
    pub(super) copy_rows: Vec<CopyRow>,
    pub(super) devmem_rows: Vec<DevMemRow>,
    pub(super) arena_rows: Vec<ArenaRow>,
    pub(super) isolation_rows: Vec<IsolationRow>,
    pub(super) batch: Batch,
    pub(super) cache: ExportCacheStats,
    pub(super) counts: poolipc::ParentStats,
    /// Rows the device could not hold, and why.
    pub(super) skipped: Vec<String>,
}

/// The run as one JSON object (what `--json` prints and `--json-out` writes).
pub(super) fn json(m: &Measured, peers: &Peers) -> serde_json::Value {
    let Measured {
        driver,
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
    } = m;
    let Batch {
        n,
        batch_s,
        tensors_per_s,
    } = batch;
    let Peers { floor, torchmp } = peers;
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
            if let Some(f) = find(floor, r.bytes) {
                o["floor_us"] = f.us.into();
                o["ratio_to_floor"] = (r.recycled_us / f.us).into();
                if let Some(ne) = f.no_export_us {
                    o["floor_no_export_us"] = ne.into();
                    o["relend_ratio_to_floor_no_export"] = (r.relend_us / ne).into();
                }
            }
            if let Some(t) = find(torchmp, r.bytes) {
                o["torch_mp_us"] = t.us.into();
                o["ratio_to_torch_mp"] = (r.recycled_us / t.us).into();
                o["relend_ratio_to_torch_mp"] = (r.relend_us / t.us).into();
            }
            o
        })
        .collect();
    let json = serde_json::json!({
        "driver": driver,
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
        "isolation_cost": isolation_rows.iter().map(|r| {
            let vs = |us: f64| if r.pointer_us.is_nan() { None } else { Some(us / r.pointer_us) };
            serde_json::json!({
                "bytes": r.bytes,
                "isolated_writable_median_us": r.writable_us,
                "isolated_read_only_median_us": r.read_only_us,
                "isolated_rung": r.rung.map(|r| r.to_string()),
                "pool_pointer_relend_median_us": if r.pointer_us.is_nan() { None } else { Some(r.pointer_us) },
                "writable_vs_pool_pointer": vs(r.writable_us),
                "read_only_vs_pool_pointer": vs(r.read_only_us),
            })
        }).collect::<Vec<_>>(),
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
    json
}

/// The tables, for people.
pub(super) fn print(m: &Measured, peers: &Peers, iterations: Option<usize>, worker_mode: &str) {
    print_round_trips(m, iterations, worker_mode);
    print_peers(&m.rows, peers);
    print_arena_copies(&m.copy_rows);
    print_device_memory(&m.devmem_rows);
    print_arena_results(&m.arena_rows);
    print_isolation(&m.isolation_rows);
    print_totals(m);
}

/// The round-trip table, and how the recycled lends went.
fn print_round_trips(m: &Measured, iterations: Option<usize>, worker_mode: &str) {
    let Measured { reuse, rows, .. } = m;
    let work = if worker_mode == "noop" {
        "worker finishes at once (--worker-mode noop: no GPU work of its own)"
    } else {
        "worker writes 4 KiB in place"
    };
    println!();
    println!(
        "  one tensor: lend, {work}, DONE, ACK, release (medians; iterations: {}):",
        iterations.map_or_else(
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
    for r in rows {
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
    if *reuse == poolipc::ExportReuse::Proven {
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
    for r in rows {
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
}

/// The peers beside our round trips, where any was asked for.
fn print_peers(rows: &[Row], peers: &Peers) {
    let Peers { floor, torchmp } = peers;
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
        for r in rows {
            let (f, t) = (find(floor, r.bytes), find(torchmp, r.bytes));
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
            if let Some(f) = find(floor, r.bytes)
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
        for (name, runs) in [("floor", floor), ("torch.multiprocessing", torchmp)] {
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
}

/// Inputs above the import limit (arena copy), where any were measured.
fn print_arena_copies(copy_rows: &[CopyRow]) {
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
        for r in copy_rows {
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
}

/// Device memory outside the pool, where any was measured.
fn print_device_memory(devmem_rows: &[DevMemRow]) {
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
        for r in devmem_rows {
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
}

/// Results through the arena, asked for and carved, where any were measured.
fn print_arena_results(arena_rows: &[ArenaRow]) {
    if !arena_rows.is_empty() {
        println!();
        println!(
            "  one result through the arena: worker writes its first 4 KiB, DONE, ACK, block back (medians):"
        );
        println!("  {:>10} {:>12} {:>14}", "size", "round µs", "rung");
        for (b, us, rung, _, _) in arena_rows {
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
        for (b, us, _, sliced, carved) in arena_rows {
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
}

/// Isolation's cost, where it was measured.
fn print_isolation(isolation_rows: &[IsolationRow]) {
    if !isolation_rows.is_empty() {
        println!();
        println!("  isolation's cost (medians):");
        println!(
            "  (one live pool tensor lent to a second touch worker spawned Trust::Isolated: arena \
             copy in; writable: the worker writes its 4 KiB, the block is copied back after DONE; \
             against the trusted worker's pool-pointer re-lend of the same size, writable, no copy)"
        );
        println!(
            "  {:>10} {:>16} {:>16} {:>12} {:>14} {:>9} {:>9}",
            "size", "isolated rw µs", "isolated ro µs", "rung", "pool ptr µs", "rw/ptr", "ro/ptr"
        );
        for r in isolation_rows {
            println!(
                "  {:>10} {:>16.1} {:>16.1} {:>12} {:>14.1} {:>8.2}× {:>8.2}×",
                human(r.bytes),
                r.writable_us,
                r.read_only_us,
                r.rung.map_or_else(|| "-".to_owned(), |r| r.to_string()),
                r.pointer_us,
                r.writable_us / r.pointer_us,
                r.read_only_us / r.pointer_us
            );
        }
    }
}

/// The batch, the export cache, DONE on the host, and what was skipped.
fn print_totals(m: &Measured) {
    let Measured {
        batch,
        cache,
        counts,
        skipped,
        ..
    } = m;
    let Batch {
        n,
        batch_s,
        tensors_per_s,
    } = batch;
    println!(
        "  batch: {n} tensors of 4 KiB, each its own allocation, in one job: {:.2} ms, {tensors_per_s:.0} tensors/s",
        batch_s * 1e3
    );
    println!("  {cache}");
    println!(
        "  DONE on the host: {} of {} jobs were held until their DONE completed (the others' had when their frames came)",
        counts.jobs_held_for_done, counts.jobs_completed
    );
    for why in skipped {
        println!("  skipped: {why}");
    }
}

/// `--mps`: the plain run against the one under MPS (and the mixed one, where it ran), from
/// their JSON objects.
pub(super) fn print_plain_against_mps(
    plain: &serde_json::Value,
    under: &serde_json::Value,
    mixed: &Option<serde_json::Value>,
) {
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
    for (p, m) in rows(plain).iter().zip(rows(under).iter()) {
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
    for (p, m) in rows(plain).iter().zip(rows(under).iter()) {
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
    match mixed {
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
}

/// `--from-json` with `--plot`: the chart of an earlier run's JSON (plain or `--mps`),
/// measuring nothing.
pub(super) fn plot_from_json(from: &std::path::Path, to: &std::path::Path) -> Result<ExitCode> {
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
    Ok(ExitCode::SUCCESS)
}

/// The chart's lines from one run's JSON: our rungs, then the peers measured beside them.
pub(super) fn series_from_json(prefix: &str, run: &serde_json::Value) -> Vec<crate::plot::Series> {
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
