//! `poolipc mps -- CMD` as a user runs it, with a stand-in for `nvidia-cuda-mps-control`
//! (the real daemon runs on the GPU machine): the command is the daemon's client, its exit
//! status is ours, and the daemon quits afterwards, also when `poolipc` itself is killed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn poolipc() -> Command {
    let bin = std::env::var_os("POOLIPC_BIN")
        .map_or_else(|| env!("CARGO_BIN_EXE_poolipc").into(), PathBuf::from);
    let mut c = Command::new(bin);
    c.env("RUST_LOG", "warn")
        .env_remove("CUDA_MPS_PIPE_DIRECTORY");
    c
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("poolipc-cli-mps-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn stand_in(dir: &Path) -> (PathBuf, PathBuf) {
    let record = dir.join("record.txt");
    let script = dir.join("nvidia-cuda-mps-control");
    std::fs::write(
        &script,
        format!(
            r#"#!/bin/sh
if [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read cmd rest
echo "$cmd" >> "{}"
case "$cmd" in
  start_server) echo 7 > "$CUDA_MPS_PIPE_DIRECTORY/server" ;;
  get_server_list) cat "$CUDA_MPS_PIPE_DIRECTORY/server" ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;;
esac
"#,
            record.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    (script, record)
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_command_runs_as_a_client_and_its_status_is_ours() {
    let dir = scratch("status");
    let (control, record) = stand_in(&dir);
    let seen = dir.join("seen.txt");
    let out = poolipc()
        .env("TMPDIR", &dir)
        .args(["mps", "--accept-shared-gpu-faults", "--control"])
        .arg(&control)
        .args(["--", "sh", "-c"])
        .arg(format!(
            "echo \"$CUDA_MPS_PIPE_DIRECTORY\" > {}; exit 3",
            seen.display()
        ))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pipe = std::fs::read_to_string(&seen).unwrap();
    assert!(pipe.trim().starts_with(dir.to_str().unwrap()), "{pipe}");
    assert!(std::fs::read_to_string(&record).unwrap().contains("quit"));
    assert!(!Path::new(pipe.trim()).exists(), "{pipe} left behind");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_the_flag_it_refuses_and_says_what_mps_costs() {
    let dir = scratch("refuse");
    let (control, record) = stand_in(&dir);
    let out = poolipc()
        .args(["mps", "--control"])
        .arg(&control)
        .args(["--", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--accept-shared-gpu-faults"), "{err}");
    assert!(err.contains("every client"), "{err}");
    assert!(!record.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_daemon_quits_even_when_poolipc_is_killed() {
    let dir = scratch("killed");
    let (control, record) = stand_in(&dir);
    let seen = dir.join("seen.txt");
    let mut child = poolipc()
        .env("TMPDIR", &dir)
        .args(["mps", "--accept-shared-gpu-faults", "--control"])
        .arg(&control)
        .args(["--", "sh", "-c"])
        .arg(format!(
            "echo \"$CUDA_MPS_PIPE_DIRECTORY\" > {}; exec sleep 2",
            seen.display()
        ))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the command started", || {
        std::fs::read_to_string(&seen).is_ok_and(|s| s.ends_with('\n'))
    });
    let pipe = PathBuf::from(std::fs::read_to_string(&seen).unwrap().trim());
    child.kill().unwrap();
    child.wait().unwrap();
    wait_for("the watchdog quit the daemon and cleaned up", || {
        std::fs::read_to_string(&record).is_ok_and(|r| r.contains("quit")) && !pipe.exists()
    });
    let _ = std::fs::remove_dir_all(&dir);
}
