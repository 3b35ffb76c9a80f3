//! `poolipc doctor` as a user runs it: the real binary, its output and exit status.

use std::process::{Command, Output};

fn poolipc() -> Command {
    let bin = std::env::var_os("POOLIPC_BIN").map_or_else(
        || env!("CARGO_BIN_EXE_poolipc").into(),
        std::path::PathBuf::from,
    );
    let mut c = Command::new(bin);
    c.env("RUST_LOG", "warn");
    c
}

fn run(args: &[&str]) -> (Output, String) {
    let out = poolipc().args(args).output().expect("run poolipc");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    (out, text)
}

fn gpu() -> Result<(), String> {
    poolipc::advanced::driver::CudaDriver::new()
        .map(drop)
        .map_err(|e| e.to_string())
}

#[test]
fn doctor_without_a_gpu_says_so_plainly_and_exits_0() {
    if let Ok(()) = gpu() {
        println!("NOT RUN: this machine has a GPU; the no-GPU path is exercised in CI");
        return;
    }
    let (out, text) = run(&["doctor"]);
    assert!(out.status.success(), "exit status {}", out.status);
    assert!(text.contains("verdict: no usable GPU here"), "{text}");
}

#[test]
fn doctor_on_the_gpu_gives_a_positive_verdict() {
    if let Err(why) = gpu() {
        println!("NOT RUN on hardware: doctor_on_the_gpu_gives_a_positive_verdict ({why})");
        return;
    }
    let (out, text) = run(&["doctor"]);
    assert!(out.status.success(), "exit status {}", out.status);
    assert!(text.contains("pool swap possible       yes"), "{text}");
    assert!(
        text.contains("verdict: poolipc can hand tensors over by pool pointer"),
        "{text}"
    );
}

#[test]
fn doctor_examines_the_simulated_driver_when_asked() {
    let (out, text) = run(&["doctor", "--sim"]);
    assert!(out.status.success(), "exit status {}", out.status);
    assert!(text.contains("SIMULATED"), "{text}");
    assert!(
        text.contains(
            "pointer export order     yes — pointer export needs the pool FD exported first"
        ),
        "{text}"
    );
    assert!(
        text.contains("verdict: poolipc can hand tensors over by pool pointer on device 0 (sim)"),
        "{text}"
    );
}

#[test]
fn doctor_says_what_sets_the_parents_io_threads_and_spins_and_warns_of_a_bad_value() {
    let out = poolipc()
        .args(["doctor", "--sim"])
        .env("POOLIPC_IO_THREADS", "3")
        .env("POOLIPC_SPIN_US", "250")
        .env("POOLIPC_SPIN_IN_FLIGHT_US", "lots")
        .env("POOLIPC_SPIN_YIELD", "0")
        .env("POOLIPC_WARM_COPIES", "1")
        .env("POOLIPC_READY_ASIDE", "0")
        .output()
        .expect("run poolipc doctor");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}{err}");
    assert!(
        text.contains("parent IO threads        3 (set by POOLIPC_IO_THREADS)"),
        "{text}"
    );
    assert!(
        text.contains("parent spin when idle    250 µs (set by POOLIPC_SPIN_US)"),
        "{text}"
    );
    assert!(
        text.contains("spins yield              no (set by POOLIPC_SPIN_YIELD)"),
        "{text}"
    );
    assert!(
        text.contains("startup copy of 1 MiB    yes (set by POOLIPC_WARM_COPIES)"),
        "{text}"
    );
    assert!(
        text.contains("READY aside when idle    no (set by POOLIPC_READY_ASIDE)"),
        "{text}"
    );
    // Not a number: the default applies, and the warning names the variable and its value.
    assert!(
        text.contains("POOLIPC_SPIN_IN_FLIGHT_US=\"lots\" is not a whole number)"),
        "{text}"
    );
    assert!(
        err.contains("POOLIPC_SPIN_IN_FLIGHT_US=\"lots\" is not a whole number"),
        "{err}"
    );
    assert_eq!(
        err.matches("POOLIPC_SPIN_IN_FLIGHT_US=").count(),
        1,
        "warned once: {err}"
    );
}

fn probe_limit(extra: &[&str]) {
    let mut args = vec!["doctor", "--probe-limit"];
    args.extend_from_slice(extra);
    let (out, text) = run(&args);
    assert!(out.status.success(), "exit status {}", out.status);
    assert!(text.contains("last good import size    5248 MiB"), "{text}");
    assert!(
        text.contains("first bad import size    5264 MiB: importer killed by signal 11 (SIGSEGV)"),
        "{text}"
    );
    assert!(text.contains("parent after the probes  alive"), "{text}");
    // The probes' pool is uninstalled again, so the export reuse check after them can start
    // a parent of its own (on the H200 it said "not checked: the pool is already installed").
    assert!(
        text.contains("export reuse (recycled address) proven"),
        "{text}"
    );
}

#[test]
fn probe_limit_finds_5248_mib_on_the_simulated_driver_and_survives_the_crashes() {
    probe_limit(&["--sim"]);
}

#[test]
fn probe_limit_finds_5248_mib_on_the_gpu_and_survives_the_crashes() {
    if let Err(why) = gpu() {
        println!("NOT RUN on hardware: probe_limit_finds_5248_mib_on_the_gpu ({why})");
        return;
    }
    probe_limit(&[]);
}

#[test]
fn doctor_lists_every_device_and_the_peer_access_matrix() {
    let (out, text) = run(&["doctor", "--sim", "--sim-devices", "3"]);
    assert!(out.status.success(), "exit status {}", out.status);
    for i in 0..3 {
        assert!(
            text.contains(&format!("poolipc simulated device {i} GPU-")),
            "{text}"
        );
    }
    assert!(
        text.contains("peer access (row can access column"),
        "{text}"
    );
    assert!(
        text.contains("  device 1                  yes   - yes"),
        "{text}"
    );
}

#[test]
fn doctor_shows_devices_without_a_peer_path() {
    let (out, text) = run(&["doctor", "--sim", "--sim-devices", "2", "--sim-no-peer"]);
    assert!(out.status.success(), "exit status {}", out.status);
    assert!(
        text.contains("  device 0                    -  no"),
        "{text}"
    );
    assert!(
        text.contains("  device 1                   no   -"),
        "{text}"
    );
}

fn json(args: &[&str]) -> serde_json::Value {
    let (out, text) = run(args);
    assert!(out.status.success(), "exit status {}", out.status);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not one JSON object ({e}): {text}"))
}

#[test]
fn doctor_json_is_one_object_with_the_devices_the_peer_matrix_and_the_verdict() {
    let v = json(&[
        "doctor",
        "--sim",
        "--sim-devices",
        "2",
        "--sim-no-peer",
        "--json",
    ]);
    assert_eq!(v["driver"], "sim", "{v}");
    assert_eq!(v["pool_pointer"], true, "{v}");
    assert_eq!(v["devices"].as_array().map(Vec::len), Some(2), "{v}");
    assert!(
        v["devices"][1]["uuid"]
            .as_str()
            .is_some_and(|u| u.starts_with("GPU-")),
        "{v}"
    );
    assert_eq!(
        v["peer_access"],
        serde_json::json!([[null, false], [false, null]]),
        "{v}"
    );
    assert_eq!(v["rows"]["pool export by POSIX FD"], "yes", "{v}");
    assert_eq!(v["failures"], serde_json::json!([]), "{v}");
}

#[test]
fn doctor_json_says_whether_there_is_a_usable_gpu() {
    let v = json(&["doctor", "--json"]);
    match gpu() {
        Err(_) => {
            assert_eq!(v["usable_gpu"], false, "{v}");
            assert_eq!(v["pool_pointer"], false, "{v}");
            assert!(
                v["rows"]["CUDA driver"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("unusable")),
                "{v}"
            );
        }
        Ok(()) => {
            assert_eq!(v["usable_gpu"], true, "{v}");
            assert_eq!(v["pool_pointer"], true, "{v}");
            println!("RAN on CudaDriver: doctor_json_says_whether_there_is_a_usable_gpu");
        }
    }
}
