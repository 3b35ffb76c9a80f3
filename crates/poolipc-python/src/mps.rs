//! `start_mps` and `mps_status`: CUDA MPS for trusted workers, from Python. See the Rust
//! `poolipc::mps` module for what MPS gives and costs.

use std::sync::Mutex;

use poolipc::mps::{MpsOptions, MpsProbe, PrivateMps};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::MpsError;

/// The daemon this process started: kept until the process exits (its watchdog quits the
/// daemon then, once the last client is gone).
static STARTED: Mutex<Option<PrivateMps>> = Mutex::new(None);

/// start_mps(*, accept_shared_gpu_faults=False, control=None) -> str
///
/// Start a private CUDA MPS daemon for this process and the workers it starts from now on,
/// and make this process its client. Returns the daemon's pipe directory. Call it first
/// thing, before anything initialises CUDA (before torch touches the GPU).
///
/// Under MPS a handoff skips the GPU's turn-taking between processes (about 60 µs round
/// trip instead of 330 µs on an H200). The price: **a GPU fault in any worker ends the CUDA
/// context of every client, this process included**; so it refuses unless
/// `accept_shared_gpu_faults=True`. Use it only for workers you trust.
///
/// Nothing system-wide changes: the daemon has private pipe and log directories and quits
/// when this process has exited and its workers with it. Calling it again returns the same
/// directory.
///
/// Raises `MpsError` when not acknowledged, when MPS is not installed
/// (`nvidia-cuda-mps-control`), when CUDA is already initialised here, when another MPS
/// daemon is reachable, or when the daemon does not start.
#[pyfunction]
#[pyo3(signature = (*, accept_shared_gpu_faults = false, control = None))]
pub(crate) fn start_mps(
    py: Python<'_>,
    accept_shared_gpu_faults: bool,
    control: Option<std::path::PathBuf>,
) -> PyResult<String> {
    let mut started = STARTED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(mps) = started.as_ref() {
        return Ok(mps.pipe_directory().display().to_string());
    }
    let options = MpsOptions {
        accept_shared_gpu_faults,
        control_binary: control,
        ..MpsOptions::default()
    };
    let mps = py
        .detach(|| {
            let mps = PrivateMps::start(&options)?;
            mps.connect_this_process()?;
            Ok::<_, poolipc::mps::MpsError>(mps)
        })
        .map_err(|e| MpsError::new_err(e.to_string()))?;
    let dir = mps.pipe_directory().display().to_string();
    *started = Some(mps);
    Ok(dir)
}

/// mps_status() -> dict
///
/// What this machine and process say about MPS, without touching CUDA: `control_binary`
/// (path or None), `pipe_directory`, `pipe_directory_from_env`, `daemon_reachable` (CUDA
/// initialised from now on here would be its client), `started_here` (start_mps ran in this
/// process).
#[pyfunction]
pub(crate) fn mps_status(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let p = MpsProbe::detect();
    let d = PyDict::new(py);
    d.set_item(
        "control_binary",
        p.control_binary.map(|b| b.display().to_string()),
    )?;
    d.set_item("pipe_directory", p.pipe_directory.display().to_string())?;
    d.set_item("pipe_directory_from_env", p.pipe_directory_from_env)?;
    d.set_item("daemon_reachable", p.daemon_reachable)?;
    d.set_item(
        "started_here",
        STARTED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some(),
    )?;
    Ok(d)
}
