//! A facade worker for the tests: `poolipc::echo`, dying (SIGKILL) at the step named by
//! `POOLIPC_FAILPOINT` if set (see `poolipc::failpoint`). It connects through the inherited
//! socket (`POOLIPC_FD`), or to the listening socket named by `POOLIPC_SOCKET`. Its device:
//! ordinal 0, the ordinal in `POOLIPC_TEST_DEVICE`; when that says `parent`, whichever of its
//! devices has the parent's UUID; when it says `any:N`, ordinal N wherever the parent's pool is
//! (`poolipc::WorkerDevice`).

use std::process::ExitCode;
use std::sync::Arc;

use poolipc::{Driver, WorkerDevice};

fn run() -> anyhow::Result<usize> {
    poolipc_tests::init_tracing();
    let driver: Arc<dyn Driver> = match poolipc_driver::sim::SimDriver::from_env() {
        Some(sim) => Arc::new(sim?),
        None => Arc::new(poolipc_driver::CudaDriver::new()?),
    };
    // Started by someone else: connect to the parent's private listening socket.
    let conn = match std::env::var_os("POOLIPC_SOCKET") {
        Some(path) => {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            poolipc_transport::connect_private(std::path::Path::new(&path), deadline)?
        }
        None => poolipc_transport::connection_from_env()?,
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
    let mut worker = poolipc::Worker::connect_with(driver, choice, conn)?;
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
