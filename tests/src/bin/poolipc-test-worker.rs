//! A facade worker for the tests: `poolipc::echo`, dying (SIGKILL) at the step named by
//! `POOLIPC_FAILPOINT` if set (see `poolipc::failpoint`).

use std::process::ExitCode;
use std::sync::Arc;

use poolipc::Driver;

fn run() -> anyhow::Result<usize> {
    poolipc_tests::init_tracing();
    let driver: Arc<dyn Driver> = match poolipc_driver::sim::SimDriver::from_env() {
        Some(sim) => Arc::new(sim?),
        None => Arc::new(poolipc_driver::CudaDriver::new()?),
    };
    let mut worker = poolipc::Worker::from_env(driver, 0)?;
    Ok(poolipc::echo::serve(&mut worker, None)?)
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
