//! `poolipc bench` as a newcomer runs it on a machine without a GPU: the real binary on the
//! simulated driver, to the end.

use std::path::PathBuf;
use std::process::Command;

/// The binary under test: the bundle's on the GPU machine (`POOLIPC_BIN`), else cargo's.
fn poolipc() -> Command {
    let bin = std::env::var_os("POOLIPC_BIN")
        .map_or_else(|| env!("CARGO_BIN_EXE_poolipc").into(), PathBuf::from);
    Command::new(bin)
}

#[test]
fn bench_on_the_simulated_driver_runs_to_the_end_within_its_memory() {
    let out = poolipc()
        .args(["bench", "--sim", "--iterations", "3"])
        .env("RUST_LOG", "warn")
        .output()
        .expect("run poolipc bench");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {}:\n{text}\n{err}", out.status);
    assert!(text.contains("on the SIMULATED driver"), "{text}");
    // Every part of the table ran, on the simulated driver's smaller default sizes.
    for part in [
        "64 MiB",
        "arena copy",
        "through the arena",
        "batch: 1000 tensors",
    ] {
        assert!(text.contains(part), "no {part:?} in:\n{text}");
    }
    assert!(
        !text.contains("1 GiB"),
        "sizes past the simulated default:\n{text}"
    );
}

#[test]
fn bench_skips_a_size_the_device_cannot_hold_and_says_so() {
    // The simulated device has far less than 2 × 16 GiB: the row is skipped, not fatal.
    let out = poolipc()
        .args([
            "bench",
            "--sim",
            "--iterations",
            "1",
            "--max-mib",
            "1",
            "--copy-max-mib",
            "1",
            "--result-max-mib",
            "16384",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .expect("run poolipc bench");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {}:\n{text}\n{err}", out.status);
    assert!(
        text.contains("skipped: arena result of 16 GiB: needs 16 GiB of device memory"),
        "{text}"
    );
}
