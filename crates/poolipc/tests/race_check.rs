//! What users get wrong, caught by the simulated GPU's race checker through the public API
//! only: a parent and a worker (this test binary, re-executed with `--exact <test>`) written
//! as a user would, each with one mistake, and the checker naming it in the job's error; and
//! the same programs written right, over many seeds, reporting nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::process::Command;
use std::time::Instant;

use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::sim::SimConfig;
use poolipc::advanced::driver::{OwnedEvent, OwnedStream};
use poolipc::check::{RaceReport, ViolationKind};
use poolipc::driver::Opened;
use poolipc::{DType, Error, Input, Layout, Parent, ParentOptions, ResultShape, Worker};

const ROLE: &str = "POOLIPC_RACE_CHECK_TEST_ROLE";
const MISTAKE: &str = "POOLIPC_RACE_CHECK_TEST_MISTAKE";
const N: u64 = 1024;

/// One mistake a user can make, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mistake {
    None,
    /// The worker reads its input on a stream of its own that never waited for READY.
    WrongStream,
    /// The worker reads its input again after it finished the job.
    ViewAfterJob,
    /// The worker writes its result again after it finished the job.
    ResultKept,
    /// The worker writes an input lent read-only.
    WriteReadOnly,
    /// The worker writes its result on a side stream the job's stream (where DONE is
    /// recorded) never waited for.
    DoneBeforeWrite,
    /// The parent frees its result and reads it afterwards.
    ParentReadsFreed,
}

impl Mistake {
    fn name(self) -> &'static str {
        match self {
            Mistake::None => "none",
            Mistake::WrongStream => "wrong-stream",
            Mistake::ViewAfterJob => "view-after-job",
            Mistake::ResultKept => "result-kept",
            Mistake::WriteReadOnly => "write-read-only",
            Mistake::DoneBeforeWrite => "done-before-write",
            Mistake::ParentReadsFreed => "parent-reads-freed",
        }
    }

    fn from_env() -> Mistake {
        let v = std::env::var(MISTAKE).unwrap();
        [
            Mistake::None,
            Mistake::WrongStream,
            Mistake::ViewAfterJob,
            Mistake::ResultKept,
            Mistake::WriteReadOnly,
            Mistake::DoneBeforeWrite,
            Mistake::ParentReadsFreed,
        ]
        .into_iter()
        .find(|m| m.name() == v)
        .unwrap()
    }
}

/// The worker: copies input 0 into a result of its shape, with `mistake`.
fn serve() -> ! {
    let mistake = Mistake::from_env();
    let mut worker = Worker::from_env(poolipc::driver::open_worker().unwrap(), 0).unwrap();
    while let Some(mut job) = worker.next_job().unwrap() {
        let (src, bytes, desc) = {
            let i = &job.inputs()[0];
            (i.ptr, i.byte_len, i.desc.clone())
        };
        let dst = job
            .request_results(&[ResultShape::new(desc.dtype, &desc.shape)])
            .unwrap()[0]
            .ptr;
        let (d, stream) = (job.driver().clone(), job.stream());
        match mistake {
            Mistake::WrongStream => {
                let owned_mine = OwnedStream::new(d.clone()).unwrap();
                let mine = owned_mine.handle();
                d.memcpy_dtod_async(dst, src, bytes, mine).unwrap();
                d.stream_synchronize(mine).unwrap();
            }
            Mistake::WriteReadOnly => {
                d.memset_d8_async(src, 0, bytes, stream).unwrap_or_default();
                d.memcpy_dtod_async(dst, src, bytes, stream)
                    .unwrap_or_default();
            }
            Mistake::DoneBeforeWrite => {
                let side = OwnedStream::new(d.clone()).unwrap().into_raw();
                let ready = OwnedEvent::new(d.clone(), false).unwrap().into_raw();
                d.event_record(ready, stream).unwrap();
                d.stream_wait_event(side, ready).unwrap();
                d.memcpy_dtod_async(dst, src, bytes, side).unwrap();
            }
            _ => d.memcpy_dtod_async(dst, src, bytes, stream).unwrap(),
        }
        job.finish().unwrap();
        match mistake {
            Mistake::ViewAfterJob => {
                let mut host = vec![0u8; usize::try_from(bytes).unwrap()];
                d.memcpy_dtoh_on(&mut host, src, stream).unwrap_or_default();
            }
            Mistake::ResultKept => {
                d.memset_d8_async(dst, 1, bytes, stream).unwrap_or_default();
            }
            _ => {}
        }
    }
    std::process::exit(0);
}

/// What a run gave: each job's outcome, and the report at the end.
struct Run {
    jobs: Vec<Result<(), Error>>,
    report: RaceReport,
}

/// The parent: one worker running `test` with `mistake`, `jobs` jobs, each lending a fresh
/// input filled on the parent's stream and reading the result back on it.
fn run(parent: &Parent, test: &str, mistake: Mistake, seed: Option<u64>, jobs: usize) -> Run {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture"])
        .env(ROLE, "worker")
        .env(MISTAKE, mistake.name());
    if let Some(seed) = seed {
        cmd.env(poolipc::check::SEED_ENV, seed.to_string());
    }
    let worker = parent.spawn_worker(cmd).unwrap();
    let d = parent.driver().clone();
    // Owned: destroyed when the run ends, so a thousand runs on one parent do not use up the
    // device's streams.
    let owned = poolipc::advanced::driver::OwnedStream::new(std::sync::Arc::clone(&d)).unwrap();
    let stream = owned.handle();
    let mut outcomes = Vec::new();
    for _ in 0..jobs {
        let input = parent.pool().alloc(4 * N, stream).unwrap();
        d.memset_d32_async(input, 7, N, stream).unwrap();
        let mut lent = Input::new(input, Layout::contiguous(DType::U32, &[N]));
        if mistake == Mistake::WriteReadOnly {
            lent = lent.read_only();
        }
        let out = parent.run_job(worker, &[lent], stream);
        let outcome = match out {
            Ok(out) => {
                let result = out.results[0].ptr;
                let mut bytes = vec![0u8; 4 * N as usize];
                if mistake == Mistake::ParentReadsFreed {
                    parent.pool().free(result, stream).unwrap();
                    d.memcpy_dtoh_on(&mut bytes, result, stream)
                        .unwrap_or_default();
                } else {
                    d.memcpy_dtoh_on(&mut bytes, result, stream).unwrap();
                    parent.pool().free(result, stream).unwrap();
                }
                Ok(())
            }
            Err(e) => {
                if let Error::SimViolation { results, .. } = &e {
                    for r in results {
                        parent.pool().free(*r, stream).unwrap();
                    }
                }
                Err(e)
            }
        };
        parent.pool().free(input, stream).unwrap();
        d.stream_synchronize(stream).unwrap();
        outcomes.push(outcome);
    }
    parent.stop_worker(worker).unwrap();
    Run {
        jobs: outcomes,
        report: RaceReport {
            violations: Vec::new(),
            processes: Vec::new(),
            seed: 0,
        },
    }
}

fn sim_parent() -> Parent {
    Parent::on(
        Opened::sim(SimConfig {
            memory_per_device: 1 << 30,
            ..SimConfig::default()
        })
        .unwrap(),
        ParentOptions::default(),
    )
    .unwrap()
}

/// Runs `mistake` in a fresh parent and returns the first failed job's error text and the
/// violations it named.
fn caught(test: &str, mistake: Mistake, jobs: usize) -> (String, RaceReport) {
    if std::env::var_os(ROLE).is_some() {
        serve();
    }
    let parent = sim_parent();
    let mut run = run(&parent, test, mistake, None, jobs);
    run.report = parent.sim_report().expect("the simulated driver checks");
    let failed = run.jobs.iter().find_map(|j| j.as_ref().err());
    let text = match failed {
        Some(e @ Error::SimViolation { report, .. }) => {
            assert!(!report.is_empty());
            let text = e.to_string();
            eprintln!("--- {}:\n{text}", mistake.name());
            return (text, report.clone());
        }
        Some(other) => format!("not a violation: {other}"),
        None => format!("no job failed; report at the end: {}", run.report),
    };
    panic!("{}: {text}", mistake.name());
}

/// `report` names a violation of one of `kinds`; `text` (the job's error) is the message.
fn assert_names(text: &str, report: &RaceReport, kinds: &[ViolationKind]) {
    assert!(
        report.violations.iter().any(|v| kinds.contains(&v.kind)),
        "{text}"
    );
}

#[test]
fn wrong_stream_fails_the_job_naming_both_calls() {
    let (text, report) = caught(
        "wrong_stream_fails_the_job_naming_both_calls",
        Mistake::WrongStream,
        1,
    );
    let v = &report.violations[0];
    assert_eq!(v.kind, ViolationKind::NotAfterReady);
    assert!(text.contains("worker 1 (pid"), "{text}");
    assert!(text.contains("read input 0 of job 1"), "{text}");
    assert!(text.contains("without waiting for READY"), "{text}");
    assert!(text.contains("the parent (pid"), "{text}");
    assert!(text.contains("cuMemcpyDtoDAsync"), "{text}");
    assert!(
        text.contains("cuMemsetD32Async on the stream job 1 was submitted on"),
        "{text}"
    );
    assert!(text.contains("POOLIPC_SIM_SEED="), "{text}");
}

#[test]
fn a_view_used_after_its_job_is_named() {
    let (text, report) = caught(
        "a_view_used_after_its_job_is_named",
        Mistake::ViewAfterJob,
        3,
    );
    assert_names(
        &text,
        &report,
        &[
            ViolationKind::UnmappedAccess,
            ViolationKind::StaleGeneration,
        ],
    );
}

#[test]
fn result_memory_kept_past_release_is_named() {
    let (text, report) = caught(
        "result_memory_kept_past_release_is_named",
        Mistake::ResultKept,
        3,
    );
    assert_names(
        &text,
        &report,
        &[
            ViolationKind::UnmappedAccess,
            ViolationKind::StaleGeneration,
        ],
    );
}

#[test]
fn writing_a_read_only_input_is_named() {
    let (text, report) = caught(
        "writing_a_read_only_input_is_named",
        Mistake::WriteReadOnly,
        1,
    );
    assert_names(&text, &report, &[ViolationKind::ReadOnlyWritten]);
}

#[test]
fn done_before_the_last_write_is_named() {
    let (text, report) = caught(
        "done_before_the_last_write_is_named",
        Mistake::DoneBeforeWrite,
        1,
    );
    assert_names(&text, &report, &[ViolationKind::WriteAfterDone]);
    assert!(text.contains("wrote result 0 of job 1"), "{text}");
}

#[test]
fn the_parent_reading_a_freed_result_is_named() {
    // The read comes after the job: the next job of the same parent carries it.
    let (text, report) = caught(
        "the_parent_reading_a_freed_result_is_named",
        Mistake::ParentReadsFreed,
        2,
    );
    assert!(!report.violations.is_empty(), "{text}");
}

/// The same program written right: nothing over as many seeds as fit in about 20 s (each
/// seed a worker process of its own).
#[test]
fn the_program_written_right_reports_nothing_over_many_seeds() {
    const TEST: &str = "the_program_written_right_reports_nothing_over_many_seeds";
    if std::env::var_os(ROLE).is_some() {
        serve();
    }
    // 20 s by default (CI's two cores); `POOLIPC_RACE_CONTROL_SECS=600` runs all 1 000 seeds.
    let budget: u64 = std::env::var("POOLIPC_RACE_CONTROL_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let parent = sim_parent();
    let start = Instant::now();
    let mut seeds = 0u64;
    while seeds < 1000 && start.elapsed().as_secs() < budget {
        let mut run = run(&parent, TEST, Mistake::None, Some(seeds + 1), 2);
        run.report = parent.sim_report().expect("the simulated driver checks");
        for j in &run.jobs {
            assert!(j.is_ok(), "seed {}: {:?}", seeds + 1, j);
        }
        assert!(run.report.is_empty(), "seed {}: {}", seeds + 1, run.report);
        seeds += 1;
    }
    eprintln!("{seeds} seeds, nothing reported, in {:?}", start.elapsed());
    assert!(seeds >= 10, "only {seeds} seeds ran in {budget} s");
}

/// `POOLIPC_SIM_STRICT=1`: the first violation panics with the report, so a program that
/// never looks at its jobs' errors still fails. This test runs the wrong-stream program as a
/// child of its own (this binary, strict) and reads how it ended.
#[test]
fn strict_mode_panics_at_the_first_violation() {
    const TEST: &str = "strict_mode_panics_at_the_first_violation";
    const CHILD: &str = "POOLIPC_RACE_CHECK_TEST_STRICT_CHILD";
    if std::env::var_os(ROLE).is_some() {
        serve();
    }
    if std::env::var_os(CHILD).is_some() {
        // The strict program: the job's wait panics with the report.
        let parent = sim_parent();
        let _ = run(&parent, TEST, Mistake::WrongStream, None, 1);
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture"])
        .env(CHILD, "1")
        .env(poolipc::check::STRICT_ENV, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("POOLIPC_SIM_STRICT=1: the simulated GPU's race checker found"),
        "{stderr}"
    );
    assert!(stderr.contains("without waiting for READY"), "{stderr}");
}

/// A violation no job reported (the parent read a result it had freed, after its last job)
/// is summarized on stderr when the parent is dropped.
#[test]
fn the_parent_summarizes_what_no_job_reported_when_dropped() {
    const TEST: &str = "the_parent_summarizes_what_no_job_reported_when_dropped";
    const CHILD: &str = "POOLIPC_RACE_CHECK_TEST_SUMMARY_CHILD";
    if std::env::var_os(ROLE).is_some() {
        serve();
    }
    if std::env::var_os(CHILD).is_some() {
        let parent = sim_parent();
        let run = run(&parent, TEST, Mistake::ParentReadsFreed, None, 1);
        assert!(run.jobs.iter().all(Result::is_ok));
        drop(parent);
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("poolipc: the simulated GPU's race checker found 1 violation"),
        "{stderr}"
    );
    assert!(
        stderr.contains("use after free: the parent (pid"),
        "{stderr}"
    );
    assert!(stderr.contains("result 0 of job 1"), "{stderr}");
}
