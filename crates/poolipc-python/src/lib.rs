//! The Python module `poolipc` (its native part, `poolipc._native`): the pool swap for
//! ComfyUI's prestartup hook, the shared pool's statistics, `NativeParent` to spawn
//! workers and lend them tensors (`submit` gives a `NativeJobHandle` to wait on, from any
//! thread, with the GIL released), `NativeWorker` to take jobs whose views torch,
//! CuPy and JAX take by DLPack or `__cuda_array_interface__`, and the sharing of pool memory
//! with processes this one did not start (`torchshare`: torch.multiprocessing under
//! cudaMallocAsync). The pure-Python package
//! (`python/poolipc`) wraps these for torch.
//!
//! The driver is the GPU's unless `POOLIPC_DRIVER=sim` picks the simulated one (tests on
//! machines without a GPU); a worker follows its parent.
//!
//! Unsafe code: only in the `dlpack` module (the DLPack capsule is a C protocol over raw pointers).
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod arena;
mod dlpack;
mod dtype;
mod errors;
mod listen;
mod mps;
mod options;
mod parent;
mod pool;
mod probe;
mod state;
mod torchshare;
mod worker;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(pool::_install, m)?)?;
    m.add_function(wrap_pyfunction!(parent::wait_any, m)?)?;
    m.add_function(wrap_pyfunction!(pool::is_installed, m)?)?;
    m.add_function(wrap_pyfunction!(pool::memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(pool::reset_peak_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(pool::empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(pool::mem_get_info, m)?)?;
    m.add_function(wrap_pyfunction!(probe::probe_mark, m)?)?;
    m.add_function(wrap_pyfunction!(probe::probe_dump, m)?)?;
    m.add_class::<parent::NativeParent>()?;
    m.add_class::<parent::DeviceBuffer>()?;
    m.add_class::<arena::ArenaResult>()?;
    m.add_class::<parent::NativeJobHandle>()?;
    m.add_class::<worker::NativeWorker>()?;
    m.add_class::<worker::Job>()?;
    m.add_class::<worker::View>()?;
    m.add_class::<worker::LeaseHold>()?;
    m.add_class::<listen::NativeListener>()?;
    m.add_class::<torchshare::SharedMapping>()?;
    m.add_function(wrap_pyfunction!(torchshare::_share, m)?)?;
    m.add_function(wrap_pyfunction!(torchshare::_open, m)?)?;
    m.add_function(wrap_pyfunction!(torchshare::_kick, m)?)?;
    m.add_function(wrap_pyfunction!(torchshare::_release, m)?)?;
    m.add_function(wrap_pyfunction!(torchshare::_stats, m)?)?;
    m.add_function(wrap_pyfunction!(torchshare::_forget_kept, m)?)?;
    m.add_function(wrap_pyfunction!(torchshare::_interpreter_exiting, m)?)?;
    m.add_function(wrap_pyfunction!(torchshare::_child_env, m)?)?;
    m.add_function(wrap_pyfunction!(torchshare::_memcpy_dtoh, m)?)?;
    m.add_function(wrap_pyfunction!(torchshare::_memcpy_htod, m)?)?;
    m.add_function(wrap_pyfunction!(torchshare::_pool_device, m)?)?;
    m.add("ConnectError", py.get_type::<errors::ConnectError>())?;
    m.add("CONNECT_ENV", listen::CONNECT_ENV)?;
    m.add("CONNECT_TOKEN_ENV", listen::TOKEN_ENV)?;
    m.add("PoolipcError", py.get_type::<errors::PoolipcError>())?;
    m.add("JobFailedError", py.get_type::<errors::JobFailedError>())?;
    m.add("WorkerError", py.get_type::<errors::WorkerError>())?;
    m.add("UnknownWorkerError", errors::unknown_worker_type(py)?)?;
    m.add("ArenaFullError", errors::arena_full_type(py)?)?;
    m.add(
        "ExpiredViewError",
        py.get_type::<errors::ExpiredViewError>(),
    )?;
    m.add(
        "ContextLostError",
        py.get_type::<errors::ContextLostError>(),
    )?;
    m.add("MpsError", py.get_type::<errors::MpsError>())?;
    m.add(
        "SimViolationError",
        py.get_type::<errors::SimViolationError>(),
    )?;
    m.add_function(wrap_pyfunction!(pool::sim_report, m)?)?;
    m.add_function(wrap_pyfunction!(mps::start_mps, m)?)?;
    m.add_function(wrap_pyfunction!(mps::mps_status, m)?)?;
    m.add("DRIVER_ENV", state::DRIVER_ENV)?;
    // The crate's version is the package's (maturin takes it from Cargo.toml).
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
