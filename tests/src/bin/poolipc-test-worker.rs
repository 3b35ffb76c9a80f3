//! A facade worker for the tests: `poolipc::echo`, dying (SIGKILL) at the step named by
//! `POOLIPC_FAILPOINT` if set (see `poolipc::failpoint`). It connects through the inherited
//! socket (`POOLIPC_FD`), or to the listening socket named by `POOLIPC_SOCKET`. Its device:
//! ordinal 0, the ordinal in `POOLIPC_TEST_DEVICE`, or, when that says `parent`, whichever of
//! its devices has the parent's UUID.

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
    let conn = match std::env::var_os("POOLIPC_SOCKET") {
        Some(path) => {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            poolipc_transport::connect_private(std::path::Path::new(&path), deadline)?
        }
        None => poolipc_transport::connection_from_env()?,
    };
    let mut worker = match std::env::var("POOLIPC_TEST_DEVICE").as_deref() {
        Ok("parent") => poolipc::Worker::connect_on_parent_device(driver, conn)?,
        Ok(ordinal) => {
            let device = ordinal
                .parse()
                .map_err(|_| anyhow::anyhow!("POOLIPC_TEST_DEVICE={ordinal:?}"))?;
            poolipc::Worker::connect(driver, device, conn)?
        }
        Err(_) => poolipc::Worker::connect(driver, 0, conn)?,
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
