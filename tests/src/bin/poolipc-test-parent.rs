//! A parent process that dies: it starts the facade test worker, runs one job with it, prints
//! the worker's pid, then kills itself with SIGKILL. The test checks the worker then exits by
//! itself (its parent went away mid-life).

use std::process::ExitCode;
use std::sync::Arc;

use poolipc::advanced::driver::{Driver, OwnedStream};
use poolipc::{DType, Input, Layout, Parent, ParentOptions};

fn run() -> anyhow::Result<()> {
    poolipc_tests::init_tracing();
    let driver: Arc<dyn Driver> = match poolipc::advanced::driver::sim::SimDriver::from_env() {
        Some(sim) => Arc::new(sim?),
        None => Arc::new(poolipc::advanced::driver::CudaDriver::new()?),
    };
    let parent = Parent::new(Arc::clone(&driver), ParentOptions::default())?;
    let mut cmd = std::process::Command::new(poolipc_tests::sibling_binary(
        "poolipc-test-worker",
        "POOLIPC_TEST_WORKER",
    )?);
    // The simulated machine's variable, if any, is inherited from our own environment.
    cmd.env_remove(poolipc::FAILPOINT_ENV);
    let worker = parent.spawn_worker(cmd)?;
    let owned_stream = OwnedStream::new(driver.clone())?;
    let stream = owned_stream.handle();
    let input = parent.pool().alloc(1 << 20, stream)?;
    let out = parent.run_job(
        worker,
        &[Input {
            ptr: input,
            desc: Layout::contiguous(DType::U8, &[1 << 20]),
            read_only: false,
        }],
        stream,
    )?;
    driver.stream_synchronize(stream)?;
    anyhow::ensure!(out.results.len() == 1, "one result expected");
    let pid = parent.worker(worker).and_then(|w| w.pid).unwrap_or(0);
    println!("worker {pid}");
    use std::io::Write as _;
    std::io::stdout().flush()?;
    nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL)?;
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("poolipc-test-parent: {e:#}");
            ExitCode::FAILURE
        }
    }
}
