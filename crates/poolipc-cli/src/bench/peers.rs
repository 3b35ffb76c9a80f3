//! The other processes of a run: the demo workers the bench lends to, and the peers it is
//! compared with, measured after it (`bench/floor.c`, the bare-driver handoff, and
//! `bench/torchmp.py`, torch.multiprocessing's round trip), read from the JSON lines they
//! print.

use std::process::Command;

use anyhow::Result;

use super::{Args, KIB, MIB};

/// A `__demo-worker` of this binary on `args.device`, in `mode` (`touch`: writes 4 KiB into
/// each tensor it is lent; `result:BYTES`: answers each job with one result of that size).
pub(super) fn demo_worker(
    args: &Args,
    child_env: &Option<(&'static str, String)>,
    mode: &str,
) -> Result<Command> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("__demo-worker")
        .env("POOLIPC_DEMO_DEVICE", args.device.to_string())
        .env("POOLIPC_WORKER_MODE", mode);
    if let Some((k, v)) = child_env {
        cmd.env(k, v);
    }
    Ok(cmd)
}

/// The worker the table lends to (`--worker-mode`: `touch` unless asked), outside the MPS
/// server with `--worker-outside-mps`.
pub(super) fn touch_worker(
    args: &Args,
    child_env: &Option<(&'static str, String)>,
) -> Result<Command> {
    let mut cmd = demo_worker(args, child_env, &args.worker_mode)?;
    if args.worker_outside_mps {
        // No daemon there: the worker's CUDA runs outside the server.
        cmd.env(
            poolipc::advanced::driver::mps_env::PIPE_DIRECTORY_ENV,
            "/nonexistent/poolipc-worker-outside-mps",
        );
    }
    Ok(cmd)
}

/// This binary's `bench` in a child process, for `--mps` (a process joins MPS when it
/// initialises CUDA, so the parent of the runs never does): the table up to `max_mib`, its
/// JSON object written to `json_out`.
pub(super) fn bench_child(
    args: &Args,
    json_out: &std::path::Path,
    max_mib: u64,
) -> Result<Command> {
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
    if let Some(sizes) = &args.sizes {
        let list: Vec<String> = sizes.iter().map(u64::to_string).collect();
        c.arg("--sizes").arg(list.join(","));
    }
    c.arg("--worker-mode").arg(&args.worker_mode);
    if let Some(p) = &args.floor {
        c.arg("--floor").arg(p);
    }
    if let Some(p) = &args.torchmp {
        c.arg("--torchmp").arg(p);
    }
    c.arg("--json-out").arg(json_out);
    Ok(c)
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
pub(super) struct Peer {
    pub(super) bytes: u64,
    pub(super) us: f64,
    /// The floor's round trip without its export (`us_median - export_us`).
    pub(super) no_export_us: Option<f64>,
    /// The floor's wait, after its child's reply, for the child's DONE on the GPU.
    pub(super) gate_us: Option<f64>,
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

/// A peer's runs: `None` where it was not asked for, `Err` with why where it did not run.
pub(super) type PeerRuns = Option<Result<Vec<Peer>, String>>;

/// The peers asked for, measured in the same run after ours (they need the GPU too).
pub(super) struct Peers {
    pub(super) floor: PeerRuns,
    pub(super) torchmp: PeerRuns,
}

impl Peers {
    /// Runs the peers `--floor` and `--torchmp` name.
    pub(super) fn run(args: &Args) -> Peers {
        let floor = args
            .floor
            .as_ref()
            .map(|p| peer_runs(Command::new(p), floor_line));
        let torchmp = args.torchmp.as_ref().map(|p| {
            let mut c = Command::new("python3");
            c.arg(p);
            peer_runs(c, torchmp_line)
        });
        Peers { floor, torchmp }
    }
}

/// A peer's round trip at `bytes`, where it ran and measured that size.
pub(super) fn find(runs: &PeerRuns, bytes: u64) -> Option<Peer> {
    runs.as_ref()
        .and_then(|r| r.as_ref().ok())
        .and_then(|v| v.iter().find(|p| p.bytes == bytes).copied())
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
