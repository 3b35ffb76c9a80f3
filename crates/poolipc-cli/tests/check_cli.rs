//! `poolipc check --seeds N -- CMD` as a user runs it: every seed in turn on the simulated
//! driver, strict, stopping at the first that fails with the line that replays it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::Command;

fn poolipc() -> Command {
    let bin = std::env::var_os("POOLIPC_BIN")
        .map_or_else(|| env!("CARGO_BIN_EXE_poolipc").into(), PathBuf::from);
    let mut c = Command::new(bin);
    c.env("RUST_LOG", "warn");
    c
}

#[test]
fn check_stops_at_the_first_failing_seed_and_says_how_to_replay_it() {
    // Fails under seed 3 only, and checks what every run is given.
    let script = r#"test "$POOLIPC_DRIVER" = sim && test "$POOLIPC_SIM_STRICT" = 1 && echo "ran $POOLIPC_SIM_SEED" && test "$POOLIPC_SIM_SEED" != 3"#;
    let out = poolipc()
        .args(["check", "--seeds", "10", "--", "sh", "-c", script])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout, "ran 0\nran 1\nran 2\nran 3\n", "{stderr}");
    assert!(stderr.contains("seed 3 failed"), "{stderr}");
    assert!(
        stderr.contains("POOLIPC_DRIVER=sim POOLIPC_SIM_SEED=3 POOLIPC_SIM_STRICT=1 sh -c"),
        "{stderr}"
    );
}

#[test]
fn check_passes_when_every_seed_runs_clean() {
    let out = poolipc()
        .args(["check", "--seeds", "5", "--", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("5 seeds (0..5) ran clean"), "{stderr}");
}
