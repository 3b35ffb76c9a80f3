//! A facade worker for the tests: `poolipc_tests::echo`, dying (SIGKILL) at the step named by
//! `POOLIPC_FAILPOINT` if set (see `poolipc::failpoint`). It connects through the inherited
//! socket (`POOLIPC_FD`), or to the listening socket named by `POOLIPC_SOCKET`. Its device:
//! ordinal 0, the ordinal in `POOLIPC_TEST_DEVICE`; when that says `parent`, whichever of its
//! devices has the parent's UUID; when it says `any:N`, ordinal N wherever the parent's pool is
//! (`poolipc::WorkerDevice`).
//!
//! For the tests of concurrency and of the views: with `POOLIPC_TEST_GATE=DIR` it creates
//! `DIR/started-<pid>-<job>` when a job starts and waits for `DIR/go` before answering it;
//! with `POOLIPC_TEST_REPORT=FILE` it appends one line per input, `<job> <rung> <read-only>`.
//!
//! With `POOLIPC_TEST_LATE=1` it answers as `poolipc_tests::echo::answer_late` does: one result
//! request per input (results carved out of the job's arena slice when they fit).
//!
//! With `POOLIPC_TEST_HOLD=1` it holds jobs open, two at a time (`Job::hold`): it looks for
//! jobs with `Worker::next_job_within`, answers each, sets it aside, and once it holds two it
//! finishes the later one first, then takes the earlier up again (`Worker::resume`) and
//! finishes it; it prints how many times it found no job (`idle <n>`) on stderr.
//!
//! With `POOLIPC_TEST_COMPUTE_MS=N` each job computes (sleeps) N ms before its answer,
//! calling `Job::heartbeat` every 200 ms, or never with `POOLIPC_TEST_COMPUTE_SILENT=1`.
//!
//! With `POOLIPC_TEST_GPU_FAULT=1` its first job's kernel faults: a store through an address
//! nothing maps (`Driver::launch_store_kernel`); the job fails with the driver's error and
//! the worker, its context gone, goes on answering as a real worker whose code raised would.

use std::process::ExitCode;
use std::sync::Arc;

use poolipc::WorkerDevice;
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::Driver;

fn run() -> anyhow::Result<usize> {
    poolipc_tests::init_tracing();
    let driver: Arc<dyn Driver> = match poolipc::advanced::driver::sim::SimDriver::from_env() {
        Some(sim) => Arc::new(sim?),
        None => Arc::new(poolipc::advanced::driver::CudaDriver::new()?),
    };
    // Started by someone else: connect to the parent's private listening socket.
    let conn = match std::env::var_os("POOLIPC_SOCKET") {
        Some(path) => {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            poolipc::advanced::transport::connect_private(std::path::Path::new(&path), deadline)?
        }
        None => poolipc::advanced::transport::connection_from_env()?,
    };
    let choice = match std::env::var("POOLIPC_TEST_DEVICE").as_deref() {
        Ok("parent") => WorkerDevice::Parent,
        Ok(value) => {
            let bad = || anyhow::anyhow!("POOLIPC_TEST_DEVICE={value:?}");
            match value.strip_prefix("any:") {
                Some(n) => WorkerDevice::Any(n.parse().map_err(|_| bad())?),
                None => WorkerDevice::Exactly(value.parse().map_err(|_| bad())?),
            }
        }
        Err(_) => WorkerDevice::Exactly(0),
    };
    let mut worker = poolipc::Worker::connect(driver, choice, conn)?;
    let gate = std::env::var_os("POOLIPC_TEST_GATE").map(std::path::PathBuf::from);
    let report = std::env::var_os("POOLIPC_TEST_REPORT").map(std::path::PathBuf::from);
    let mut fault = std::env::var_os("POOLIPC_TEST_GPU_FAULT").is_some();
    let compute = std::env::var("POOLIPC_TEST_COMPUTE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(std::time::Duration::from_millis);
    let silent = std::env::var_os("POOLIPC_TEST_COMPUTE_SILENT").is_some();
    if std::env::var_os("POOLIPC_TEST_HOLD").is_some() {
        return serve_holding(&mut worker);
    }
    if std::env::var_os("POOLIPC_TEST_LATE").is_some() {
        return Ok(poolipc_tests::echo::serve_late(&mut worker)?);
    }
    if std::env::var_os("POOLIPC_TEST_WRITE_INPUTS").is_some() {
        return serve_writing_inputs(&mut worker);
    }
    if gate.is_none() && report.is_none() && !fault && compute.is_none() {
        return Ok(poolipc_tests::echo::serve(&mut worker)?);
    }
    let mut served = 0;
    while let Some(mut job) = worker.next_job()? {
        if let Some(file) = &report {
            use std::io::Write as _;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(file)?;
            for input in job.inputs() {
                writeln!(f, "{} {:?} {}", job.id().0, input.rung, input.read_only)?;
            }
        }
        if std::mem::take(&mut fault) {
            let stream = job.stream();
            let r = job
                .driver()
                .launch_store_kernel(poolipc::DevicePtr(16), 1, stream);
            let message = match r {
                Ok(()) => "the faulting kernel did not fault".to_owned(),
                Err(e) => format!("the job's kernel faulted: {e}"),
            };
            eprintln!("poolipc-test-worker: {message}");
            job.fail(&message)?;
            continue;
        }
        if let Some(dir) = &gate {
            let started = dir.join(format!("started-{}-{}", std::process::id(), job.id().0));
            std::fs::write(started, b"")?;
            let go = dir.join("go");
            let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !go.exists() {
                anyhow::ensure!(
                    std::time::Instant::now() < until,
                    "no {} within 60 s",
                    go.display()
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        if let Some(compute) = compute {
            let until = std::time::Instant::now() + compute;
            while std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(200));
                if !silent {
                    job.heartbeat()?;
                }
            }
        }
        // A job that fails (a result refused, a cancelled job's) fails alone, as in
        // `echo::serve`: the worker goes on to the next.
        match poolipc_tests::echo::answer(&mut job) {
            Ok(()) => job.finish()?,
            Err(e) => job.fail(&e.to_string())?,
        }
        served += 1;
    }
    Ok(served)
}

/// `POOLIPC_TEST_WRITE_INPUTS`: every job writes the first 4 KiB of every input (all of a
/// smaller one) with the input's marker ([`poolipc_tests::echo::marker`]), **whether or not it was
/// lent read-only** (a worker that ignores the flag), then waits for its stream so that a
/// write the hardware refused (a read-only mapping) surfaces in this job; a failed write
/// fails the job with the error. `POOLIPC_TEST_REPORT` gets `<job> <rung> <read_only>` per
/// input.
fn serve_writing_inputs(worker: &mut poolipc::Worker) -> anyhow::Result<usize> {
    let report = std::env::var_os("POOLIPC_TEST_REPORT").map(std::path::PathBuf::from);
    let mut served = 0;
    while let Some(job) = worker.next_job()? {
        if let Some(file) = &report {
            use std::io::Write as _;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(file)?;
            for input in job.inputs() {
                writeln!(f, "{} {:?} {}", job.id().0, input.rung, input.read_only)?;
            }
        }
        let (driver, stream) = (job.driver().clone(), job.stream());
        let wrote = job
            .inputs()
            .iter()
            .enumerate()
            .try_for_each(|(i, input)| {
                let words = input.byte_len.min(4096) / 4;
                driver
                    .memset_d32_async(input.ptr, poolipc_tests::echo::marker(i), words, stream)
                    .map_err(|e| format!("writing input {i} failed: {e}"))
            })
            .and_then(|()| {
                driver
                    .stream_synchronize(stream)
                    .map_err(|e| format!("the writes failed: {e}"))
            });
        match wrote {
            Ok(()) => job.finish()?,
            Err(why) => {
                eprintln!("poolipc-test-worker: {why}");
                job.fail(&why)?;
            }
        }
        served += 1;
    }
    Ok(served)
}

/// `POOLIPC_TEST_HOLD`: two jobs open at once, finished in the reverse of their order.
fn serve_holding(worker: &mut poolipc::Worker) -> anyhow::Result<usize> {
    let mut held: Vec<poolipc::HeldJob> = Vec::new();
    let (mut served, mut idle) = (0, 0usize);
    loop {
        let mut job = match worker.next_job_within(std::time::Duration::from_millis(20))? {
            poolipc::NextJob::Idle => {
                idle += 1;
                continue;
            }
            poolipc::NextJob::Gone => break,
            poolipc::NextJob::Job(job) => job,
        };
        poolipc_tests::echo::answer(&mut job)?;
        if held.is_empty() {
            held.push(job.hold());
            continue;
        }
        // The later job first, then the earlier one, taken up again.
        job.finish()?;
        for h in held.drain(..) {
            worker.resume(h)?.finish()?;
        }
        served += 2;
    }
    anyhow::ensure!(
        held.is_empty(),
        "{} jobs still held when the parent left",
        held.len()
    );
    eprintln!("poolipc-test-worker: idle {idle}");
    Ok(served)
}

fn main() -> ExitCode {
    match run() {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("poolipc-test-worker: {e:#}");
            ExitCode::FAILURE
        }
    }
}
