//! A facade worker for the tests: `poolipc::echo`, dying (SIGKILL) at the step named by
//! `POOLIPC_FAILPOINT` if set (see `poolipc::failpoint`). It connects through the inherited
//! socket (`POOLIPC_FD`), or to the listening socket named by `POOLIPC_SOCKET`.

use std::process::ExitCode;
use std::sync::Arc;

use poolipc::Driver;

fn run() -> anyhow::Result<usize> {
    poolipc_tests::init_tracing();
    let driver: Arc<dyn Driver> = match poolipc_driver::sim::SimDriver::from_env() {
        Some(sim) => Arc::new(sim?),
        None => Arc::new(poolipc_driver::CudaDriver::new()?),
    };
    // Started by someone else: connect to the parent's private listening socket.
    let mut worker = match std::env::var_os("POOLIPC_SOCKET") {
        Some(path) => {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            let conn = poolipc_transport::connect_private(std::path::Path::new(&path), deadline)?;
            poolipc::Worker::connect(driver, 0, conn)?
        }
        None => poolipc::Worker::from_env(driver, 0)?,
    };
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
