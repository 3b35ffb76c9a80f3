//! `poolipc demo` redirected, as CI and a log file see it.

use std::process::Command;

#[test]
fn the_demos_log_redirected_is_plain_text_and_says_nothing_of_torch() {
    let bin = std::env::var_os("POOLIPC_BIN").map_or_else(
        || env!("CARGO_BIN_EXE_poolipc").into(),
        std::path::PathBuf::from,
    );
    let out = Command::new(bin)
        .args(["demo", "--sim"])
        .env("RUST_LOG", "info")
        .output()
        .expect("run poolipc demo");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    println!("{stdout}{stderr}");
    assert!(out.status.success(), "{}", out.status);
    assert!(stdout.contains("demo passed"));
    // The table explains its columns, and on the simulated driver its slow first 1 GiB row.
    assert!(
        stdout.contains("rung: how the tensor travelled"),
        "{stdout}"
    );
    assert!(
        stdout.contains("again ms: the same tensor lent once more"),
        "{stdout}"
    );
    assert!(
        stdout.contains("the first 1 GiB round trip pays"),
        "{stdout}"
    );
    assert!(stderr.contains(" INFO "), "the log is there, at info");
    assert!(!stderr.contains('\x1b'), "colour codes in a redirected log");
    assert!(!stdout.contains('\x1b'));
    let all = format!("{stdout}{stderr}").to_lowercase();
    assert!(
        !all.contains("torch"),
        "no torch here, yet the demo speaks of it"
    );
}
