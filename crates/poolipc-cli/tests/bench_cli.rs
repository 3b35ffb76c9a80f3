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

/// `poolipc bench` with `args` (warnings only on stderr), which must succeed; its stdout.
fn bench_ok(args: &[&str]) -> String {
    let out = poolipc()
        .arg("bench")
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run poolipc bench");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "poolipc bench {}: exit {}:\n{text}\n{err}",
        args.join(" "),
        out.status
    );
    text
}

/// `poolipc bench` with `args`, which must be refused (a non-zero exit); its stderr.
fn bench_refused(args: &[&str]) -> String {
    let out = poolipc()
        .arg("bench")
        .args(args)
        .output()
        .expect("run poolipc bench");
    assert!(
        !out.status.success(),
        "poolipc bench {} was not refused",
        args.join(" ")
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bench_on_the_simulated_driver_runs_to_the_end_within_its_memory() {
    let text = bench_ok(&["--sim", "--iterations", "3"]);
    assert!(text.contains("on the SIMULATED driver"), "{text}");
    // Every part of the table ran, on the simulated driver's smaller default sizes.
    for part in [
        "64 MiB",
        "arena copy",
        "through the arena",
        "isolation's cost",
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
fn bench_sizes_sets_the_round_trip_rows_and_a_noop_worker_is_named_in_the_table() {
    let text = bench_ok(&[
        "--sim",
        "--sizes",
        "64K,2M",
        "--worker-mode",
        "noop",
        "--iterations",
        "2",
        "--copy-max-mib",
        "0",
        "--result-max-mib",
        "0",
    ]);
    let table: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.contains("one tensor:"))
        .take_while(|l| !l.contains("recycled: a new allocation"))
        .collect();
    assert!(
        table[0].contains("worker finishes at once"),
        "{}",
        table.join("\n")
    );
    let sizes: Vec<&str> = table[2..]
        .iter()
        .filter_map(|l| l.split_whitespace().take(2).last())
        .collect();
    assert_eq!(sizes, ["KiB", "MiB"], "{}", table.join("\n"));
    assert!(
        table[2].trim_start().starts_with("64 KiB") && table[3].trim_start().starts_with("2 MiB"),
        "{}",
        table.join("\n")
    );
    // A size that is not one is refused before anything runs, naming it.
    let err = bench_refused(&["--sim", "--sizes", "4K,twelve"]);
    assert!(err.contains("\"twelve\""), "{err}");
}

#[test]
fn bench_skips_a_size_the_device_cannot_hold_and_says_so() {
    // The simulated device has far less than 2 × 16 GiB: the row is skipped, not fatal.
    let text = bench_ok(&[
        "--sim",
        "--iterations",
        "1",
        "--max-mib",
        "1",
        "--copy-max-mib",
        "1",
        "--result-max-mib",
        "16384",
    ]);
    assert!(
        text.contains("skipped: arena result of 16 GiB: needs 16 GiB of device memory"),
        "{text}"
    );
}

#[test]
fn bench_with_the_probe_on_leaves_parent_and_worker_marks_that_the_report_reads() {
    let dir = std::env::temp_dir().join(format!("poolipc-probe-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = poolipc()
        .args([
            "bench",
            "--sim",
            "--iterations",
            "4",
            "--max-mib",
            "1",
            "--copy-max-mib",
            "1",
            "--result-max-mib",
            "1",
        ])
        .env("RUST_LOG", "warn")
        .env("POOLIPC_PROBE", &dir)
        .output()
        .expect("run poolipc bench");
    assert!(
        out.status.success(),
        "exit {}:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut labels = std::collections::BTreeSet::new();
    let files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the probe's directory")
        .map(|e| e.expect("entry").path())
        .collect();
    assert!(
        files.len() >= 2,
        "one file per process, parent and worker: {files:?}"
    );
    for f in &files {
        for line in std::fs::read_to_string(f).expect("marks").lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let [ns, label, tid] = fields[..] else {
                panic!("not <ns> <label> <tid>: {line:?}");
            };
            assert!(ns.parse::<u64>().is_ok_and(|t| t > 0), "{line}");
            assert!(tid.parse::<u32>().is_ok_and(|t| t > 0), "{line}");
            labels.insert(label.to_owned());
        }
    }
    for want in [
        "rt.begin",
        "c.submit",
        "io.send_lend",
        "w.recv",
        "w.send_done",
        "io.wait_done",
        "rt.synced",
    ] {
        assert!(labels.contains(want), "no {want:?} among {labels:?}");
    }
    // The report merges them: the first round trips (4 KiB, recycled) share one sequence.
    // The report (where python3 runs): its output, checked to have succeeded.
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/probe_report.py");
    let report = |args: &[&str]| -> Option<String> {
        let out = Command::new("python3")
            .arg(&script)
            .arg(&dir)
            .args(args)
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(text)
    };
    if let Some(text) = report(&["--skip", "1", "--count", "4"]) {
        // Steps of both processes on one timeline (their order varies with the machine's
        // load: a mark is taken after its step, and the other process may have moved on).
        assert!(
            text.contains("io.send_lend → ")
                && text.contains(" worker ")
                && text.contains(" parent ")
                && text.contains("total"),
            "{text}"
        );
        // Per thread: the IO thread's waiting is told from its work.
        let text = report(&["--threads"]).expect("python3 ran once already");
        assert!(
            text.contains("(IO thread)")
                && text.contains(", busy ")
                && text.contains("io.wait → io.woke")
                && text.contains("(worker)")
                && text.contains("caller"),
            "{text}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_workers_measures_jobs_per_second_with_one_two_and_three_workers() {
    let text = bench_ok(&["--sim", "--workers", "3", "--iterations", "10"]);
    for size in ["4 KiB", "64 MiB"] {
        for n in 1..=3 {
            // A row per size and worker count:
            // "  4 KiB  2  <jobs/s>  <ratio>×  <µs>  <IO busy>%  <IO µs/job>".
            let row = text.lines().any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() == 8
                    && format!("{} {}", cols[0], cols[1]) == size
                    && cols[2] == n.to_string()
                    && cols[3].parse::<f64>().is_ok_and(|r| r > 0.0)
                    && cols[6]
                        .strip_suffix('%')
                        .and_then(|b| b.parse::<f64>().ok())
                        .is_some_and(|b| b >= 0.0)
                    && cols[7].parse::<f64>().is_ok_and(|us| us > 0.0)
            });
            assert!(row, "no row for {size} with {n} workers:\n{text}");
        }
    }
    // One table per IO-thread count, in the same run.
    let text = bench_ok(&[
        "--sim",
        "--workers",
        "2",
        "--iterations",
        "5",
        "--io-threads",
        "1,2",
    ]);
    assert!(
        text.contains(", 1 IO thread\n") && text.contains(", 2 IO threads\n"),
        "{text}"
    );
    let rows = text
        .lines()
        .filter(|l| l.trim_start().starts_with("4 KiB"))
        .count();
    assert_eq!(rows, 4, "two rows of 4 KiB per table:\n{text}");
    let err = bench_refused(&["--sim", "--workers", "0"]);
    assert!(err.contains("--workers 0: give 1 to 64"), "{err}");
    // The callers on the legacy stream: said in the header, rows as before. One IO thread
    // named: the default depends on the machine's CPUs (4 on a 16-core GPU host).
    let text = bench_ok(&[
        "--sim",
        "--workers",
        "1",
        "--io-threads",
        "1",
        "--iterations",
        "5",
        "--worker-mode",
        "noop",
        "--caller-stream",
        "legacy",
    ]);
    assert!(
        text.contains(", 1 IO thread, callers on the legacy stream\n"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("4 KiB")),
        "{text}"
    );
    let err = bench_refused(&["--sim", "--workers", "1", "--caller-stream", "mine"]);
    assert!(
        err.contains("invalid value 'mine' for '--caller-stream"),
        "{err}"
    );
}

#[test]
fn bench_workers_in_rounds_prints_each_counts_ratio_and_its_range() {
    // Three rounds: a row per size and count, as ever, with the range of the count's ratio to
    // one worker over the rounds; one worker's is 1.00–1.00× by construction.
    let text = bench_ok(&[
        "--sim",
        "--workers",
        "2",
        "--iterations",
        "5",
        "--io-threads",
        "1",
        "--rounds",
        "3",
    ]);
    assert!(text.contains("× one, range"), "{text}");
    for size in ["4 KiB", "64 MiB"] {
        for n in 1..=2 {
            let row = text.lines().find(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() == 9
                    && format!("{} {}", cols[0], cols[1]) == size
                    && cols[2] == n.to_string()
            });
            let row = row.unwrap_or_else(|| panic!("no row for {size} with {n} workers:\n{text}"));
            let range = row.split_whitespace().last().unwrap_or_default();
            let (lo, hi) = range
                .trim_end_matches('×')
                .split_once('–')
                .and_then(|(a, b)| Some((a.parse::<f64>().ok()?, b.parse::<f64>().ok()?)))
                .unwrap_or_else(|| panic!("no range in {row:?}"));
            assert!(0.0 < lo && lo <= hi, "{row}");
            if n == 1 {
                assert_eq!((lo, hi), (1.0, 1.0), "{row}");
            }
        }
    }
    let err = bench_refused(&["--sim", "--workers", "2", "--rounds", "0"]);
    assert!(err.contains("--rounds 0: give 1 to 20"), "{err}");
}

#[test]
fn bench_workers_primes_the_parent_as_asked_and_says_what_the_battery_found() {
    // Every step at once, 1 MiB: the battery's verdict printed, the staging job taken by
    // host staging (the bench fails otherwise), the table's rows as ever.
    let text = bench_ok(&[
        "--sim",
        "--workers",
        "1",
        "--iterations",
        "5",
        "--worker-mode",
        "noop",
        "--prime",
        "canary,staging,fill,host-copy",
        "--prime-bytes",
        "1M",
    ]);
    assert!(
        text.contains("the first worker's canary battery: 7 of 7 canaries passed"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("4 KiB")),
        "{text}"
    );
    // The inputs went by pool pointer: no line naming another rung.
    assert!(!text.contains("the inputs took"), "{text}");
    // Without the battery (the bench's default) no verdict line; without --iterations each
    // measurement runs for its time window and still gives its rows.
    let text = bench_ok(&["--sim", "--workers", "1", "--worker-mode", "noop"]);
    assert!(!text.contains("canary battery"), "{text}");
    assert_eq!(
        text.lines()
            .filter(|l| l.trim_start().starts_with("4 KiB") || l.trim_start().starts_with("64 MiB"))
            .count(),
        2,
        "{text}"
    );
    let err = bench_refused(&["--sim", "--workers", "1", "--prime", "warm"]);
    assert!(err.contains("invalid value 'warm' for '--prime"), "{err}");
    // The table mode has no use for it: said, not ignored.
    let err = bench_refused(&["--sim", "--prime", "canary"]);
    assert!(
        err.contains("required arguments were not provided") && err.contains("--workers"),
        "{err}"
    );
}

#[test]
fn with_poolipc_warm_copies_the_parent_and_each_worker_copy_once_and_say_so() {
    let out = poolipc()
        .args([
            "bench",
            "--sim",
            "--workers",
            "2",
            "--iterations",
            "3",
            "--worker-mode",
            "noop",
        ])
        .env("RUST_LOG", "info")
        .env("POOLIPC_WARM_COPIES", "1")
        .output()
        .expect("run poolipc bench");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let said = |who: &str| {
        err.lines()
            .filter(|l| {
                l.contains(&format!(
                    "the {who} copied 1048576 bytes to the device and back"
                ))
            })
            .count()
    };
    assert_eq!(said("parent"), 1, "{err}");
    assert_eq!(said("worker"), 2, "one line per worker:\n{err}");
    // Unset (or anything but 1), nothing is copied.
    let out = poolipc()
        .args(["bench", "--sim", "--workers", "1", "--iterations", "3"])
        .env("RUST_LOG", "info")
        .env("POOLIPC_WARM_COPIES", "0")
        .output()
        .expect("run poolipc bench");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !err.contains("POOLIPC_WARM_COPIES"),
        "{err}"
    );
}
