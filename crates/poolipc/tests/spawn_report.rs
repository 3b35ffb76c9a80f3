//! What the parent says of a worker that dies before its handshake.

use std::process::Command;

use poolipc::advanced::driver::sim::SimConfig;
use poolipc::driver;
use poolipc::{Error, Parent, ParentOptions};

#[test]
fn a_worker_that_exits_before_its_handshake_is_reported_with_its_status_and_stderr() {
    let parent = Parent::on(
        driver::Opened::sim(SimConfig::default()).expect("SimDriver"),
        ParentOptions::default(),
    )
    .expect("parent");
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "echo 'Traceback (most recent call last):' >&2; echo 'ModuleNotFoundError: no module named nodes' >&2; exit 3",
    ]);
    let e = parent.spawn_worker(cmd).expect_err("the worker exits");
    match &e {
        Error::WorkerExited { status, stderr, .. } => {
            assert!(status.contains('3'), "{status}");
            // Marked as the worker's words; its second line indented under the first.
            assert!(
                stderr.ends_with("\n    ModuleNotFoundError: no module named nodes"),
                "{stderr}"
            );
            assert!(stderr.starts_with("worker says: Traceback"), "{stderr}");
        }
        other => panic!("expected WorkerExited, got {other:?}"),
    }
    let text = e.to_string();
    assert!(text.contains("exit status: 3"), "{text}");
}

#[test]
fn spawned_workers_get_the_simulated_machine_from_the_parent() {
    let opened = driver::Opened::sim(SimConfig::default()).expect("SimDriver");
    let (key, value) = opened.worker_env[0].clone();
    let parent = Parent::on(opened, ParentOptions::default()).expect("parent");
    // A worker that exits at once, saying what it was given: the error carries its words.
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        &format!("echo \"${}\" >&2; exit 1", key.to_string_lossy()),
    ]);
    let e = parent.spawn_worker(cmd).expect_err("the worker exits");
    let Error::WorkerExited { stderr, .. } = e else {
        panic!("expected WorkerExited, got {e:?}");
    };
    assert_eq!(stderr, format!("worker says: {}", value.to_string_lossy()));
}

#[test]
fn a_dead_workers_last_words_reach_the_error_without_control_characters() {
    let parent = Parent::on(
        driver::Opened::sim(SimConfig::default()).expect("SimDriver"),
        ParentOptions::default(),
    )
    .expect("parent");
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "printf 'fine\\033[2J\\033]0;title\\007\\rover\\n' >&2; exit 1",
    ]);
    let e = parent.spawn_worker(cmd).expect_err("the worker exits");
    let Error::WorkerExited { stderr, .. } = e else {
        panic!("expected WorkerExited, got {e:?}");
    };
    assert!(stderr.starts_with("worker says: fine"), "{stderr:?}");
    assert!(
        !stderr
            .chars()
            .any(|c| c.is_control() && c != '\n' && c != '\t'),
        "{stderr:?}"
    );
}
