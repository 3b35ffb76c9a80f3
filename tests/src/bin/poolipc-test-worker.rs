//! A facade worker for the tests: `poolipc::echo`, optionally dying at a chosen step
//! (`POOLIPC_TEST_DIE_AT=after-import|after-grant|after-write`).

use std::process::ExitCode;
use std::sync::Arc;

use poolipc::Driver;

fn run() -> anyhow::Result<usize> {
    poolipc_tests::init_tracing();
    let driver: Arc<dyn Driver> = match poolipc_driver::sim::SimDriver::from_env() {
        Some(sim) => Arc::new(sim?),
        None => Arc::new(poolipc_driver::CudaDriver::new()?),
    };
    let die_at = match std::env::var("POOLIPC_TEST_DIE_AT") {
        Ok(s) => Some(s.parse().map_err(anyhow::Error::msg)?),
        Err(_) => None,
    };
    let mut worker = poolipc::Worker::from_env(driver, 0)?;
    Ok(poolipc::echo::serve(&mut worker, die_at)?)
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
