//! The private MPS daemon's lifecycle and refusals, with a stand-in for
//! `nvidia-cuda-mps-control` (a shell script that behaves like it: `-d` creates the control
//! pipe, commands arrive on stdin, `quit` removes the pipe). The real daemon runs on the GPU
//! machine (`poolipc bench --mps`, the bundle's MPS pass).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use poolipc_mps::{MpsError, MpsOptions, PrivateMps};

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("poolipc-mps-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a stand-in control program that records every command in `record`; `daemon` is
/// the shell run for `-d`.
fn stand_in(dir: &Path, daemon: &str) -> (PathBuf, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let record = dir.join("record.txt");
    let script = dir.join("nvidia-cuda-mps-control");
    let body = format!(
        r#"#!/bin/sh
if [ "$1" = "-d" ]; then
  echo "-d $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "{record}"
  {daemon}
fi
read cmd rest
echo "$cmd $rest" >> "{record}"
case "$cmd" in
  start_server) echo 4242 > "$CUDA_MPS_PIPE_DIRECTORY/server" ;;
  get_server_list) cat "$CUDA_MPS_PIPE_DIRECTORY/server" 2>/dev/null ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;;
esac
exit 0
"#,
        record = record.display()
    );
    std::fs::write(&script, body).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    (script, record)
}

const GOOD_DAEMON: &str = r#"touch "$CUDA_MPS_PIPE_DIRECTORY/control"; echo started >> "$CUDA_MPS_LOG_DIRECTORY/control.log"; exit 0"#;

fn options(scratch: &Scratch, control: PathBuf) -> MpsOptions {
    MpsOptions {
        accept_shared_gpu_faults: true,
        control_binary: Some(control),
        root: Some(scratch.0.clone()),
        system_pipe_directory: scratch.0.join("no-system-daemon"),
        ready_timeout: Duration::from_secs(5),
    }
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_private_daemon_starts_its_server_and_quits_when_dropped() {
    let s = Scratch::new("lifecycle");
    let (control, record) = stand_in(&s.0, GOOD_DAEMON);
    let mps = PrivateMps::start(&options(&s, control)).expect("start");
    let pipe = mps.pipe_directory().to_path_buf();
    assert!(pipe.starts_with(&s.0), "{}", pipe.display());
    assert!(pipe.join("control").exists());
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(pipe.parent().unwrap())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "the private directory is {mode:o}");
    let env = mps.env();
    assert_eq!(env[0].0, "CUDA_MPS_PIPE_DIRECTORY");
    assert_eq!(env[0].1, pipe.as_path());
    let said = std::fs::read_to_string(&record).unwrap();
    assert!(said.contains(&format!("-d {}", pipe.display())), "{said}");
    assert!(said.contains("start_server -uid"), "{said}");
    assert!(said.contains("get_server_list"), "{said}");
    assert!(!said.contains("quit"), "quit before the drop: {said}");
    let root = pipe.parent().unwrap().to_path_buf();
    drop(mps);
    wait_for(
        "quit sent and directories removed",
        Duration::from_secs(10),
        || std::fs::read_to_string(&record).unwrap().contains("quit") && !root.exists(),
    );
}

#[test]
fn shutdown_waits_until_the_daemon_is_gone() {
    let s = Scratch::new("shutdown");
    let (control, record) = stand_in(&s.0, GOOD_DAEMON);
    let mps = PrivateMps::start(&options(&s, control)).expect("start");
    let root = mps.pipe_directory().parent().unwrap().to_path_buf();
    assert!(mps.shutdown(Duration::from_secs(10)));
    assert!(!root.exists(), "{} left behind", root.display());
    assert!(std::fs::read_to_string(&record).unwrap().contains("quit"));
}

#[test]
fn without_the_acknowledgement_nothing_starts_and_the_error_says_why() {
    let s = Scratch::new("ack");
    let (control, record) = stand_in(&s.0, GOOD_DAEMON);
    let mut o = options(&s, control);
    o.accept_shared_gpu_faults = false;
    let e = PrivateMps::start(&o).unwrap_err();
    assert!(matches!(e, MpsError::NotAcknowledged), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("ends the CUDA context of every client"),
        "{text}"
    );
    assert!(text.contains("accept_shared_gpu_faults"), "{text}");
    assert!(!record.exists(), "the daemon was started anyway");
}

#[test]
fn a_missing_control_program_is_named() {
    let s = Scratch::new("missing");
    let e = PrivateMps::start(&options(&s, s.0.join("nope/nvidia-cuda-mps-control"))).unwrap_err();
    assert!(matches!(e, MpsError::NotInstalled { .. }), "{e:?}");
    assert!(
        e.to_string().contains("nope/nvidia-cuda-mps-control"),
        "{e}"
    );
}

#[test]
fn another_reachable_daemon_is_never_joined_by_a_second() {
    let s = Scratch::new("another");
    let (control, record) = stand_in(&s.0, GOOD_DAEMON);
    let system = s.0.join("system-mps");
    std::fs::create_dir_all(&system).unwrap();
    std::fs::write(system.join("control"), b"").unwrap();
    let mut o = options(&s, control);
    o.system_pipe_directory = system.clone();
    match PrivateMps::start(&o) {
        Err(MpsError::AnotherDaemon { pipe_directory }) => assert_eq!(pipe_directory, system),
        other => panic!("expected AnotherDaemon, got {other:?}"),
    }
    assert!(!record.exists(), "the daemon was started anyway");
}

#[test]
fn a_daemon_that_fails_to_start_is_reported_with_its_log() {
    let s = Scratch::new("fails");
    let (control, _) = stand_in(
        &s.0,
        r#"echo "fatal: no GPU for MPS" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"; echo refused >&2; exit 1"#,
    );
    let e = PrivateMps::start(&options(&s, control)).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, MpsError::DaemonFailed { .. }), "{e:?}");
    assert!(text.contains("refused"), "{text}");
    assert!(text.contains("fatal: no GPU for MPS"), "{text}");
}

#[test]
fn a_daemon_that_never_opens_its_pipe_times_out_and_is_cleaned_up() {
    let s = Scratch::new("silent");
    let (control, _) = stand_in(&s.0, "exit 0");
    let mut o = options(&s, control);
    o.ready_timeout = Duration::from_millis(300);
    let e = PrivateMps::start(&o).unwrap_err();
    assert!(e.to_string().contains("no control pipe"), "{e}");
    wait_for(
        "the private directories removed",
        Duration::from_secs(10),
        || {
            std::fs::read_dir(&s.0)
                .unwrap()
                .filter_map(Result::ok)
                .all(|e| !e.file_name().to_string_lossy().starts_with("poolipc-mps-"))
        },
    );
}
