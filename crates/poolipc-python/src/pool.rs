//! The process's shared pool for Python: the module functions that install it (the
//! prestartup hook's `install_pool`) and read or trim it (`memory_stats`, `mem_get_info`,
//! `reset_peak_memory_stats`, `empty_cache`), each on the process's one parent.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{err, to_py_for};
use crate::options::ParentConfig;
use crate::state::{self, Global};

fn installed() -> PyResult<Arc<Global>> {
    state::installed()
        .ok_or_else(|| err("poolipc: no pool is installed (call poolipc.install_pool() first)"))
}

/// Installs the shared pool on `device` (the driver `POOLIPC_DRIVER` picks) by creating the
/// process's parent with these `options` (a `ParentConfig` with every key: the deadlines in
/// seconds and the result memory, each None for the default; None: all defaults). Returns a
/// dict: `installed` (False when it already was), `driver` (in words), `device`. A later call,
/// or a `Parent`, with other deadlines or result memory is a `ValueError` naming the clash.
/// The checks around torch and `PYTORCH_CUDA_ALLOC_CONF` live in the Python wrapper,
/// `poolipc.install_pool`.
#[pyfunction]
#[pyo3(signature = (device = 0, options = None))]
pub(crate) fn _install(
    py: Python<'_>,
    device: u32,
    options: Option<ParentConfig>,
) -> PyResult<Bound<'_, PyDict>> {
    let requested = options.unwrap_or_default();
    let (g, installed) = py
        .detach(|| state::ensure(device, &requested, "install_pool"))
        .map_err(state::EnsureError::into_py)?;
    let d = PyDict::new(py);
    d.set_item("installed", installed)?;
    d.set_item("driver", g.which.clone())?;
    d.set_item("device", device)?;
    Ok(d)
}

/// Whether a pool is installed in this process.
#[pyfunction]
pub(crate) fn is_installed() -> bool {
    state::installed().is_some()
}

/// The shared pool's true figures (torch's own `memory_allocated()`/`memory_reserved()` read 0
/// after the swap; `install_pool` makes them report these): a dict of `used_current`, `used_high`, `reserved_current`,
/// `reserved_high` in bytes, plus `device` and `driver`.
#[pyfunction]
pub(crate) fn memory_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let g = installed()?;
    // Every live generation of the pool, summed: after `empty_cache` rotated it, the handle
    // captured at install may be destroyed.
    let s = {
        let g = Arc::clone(&g);
        py.detach(move || {
            let _on = g.on_device()?;
            Ok::<_, poolipc::Error>(g.parent.pool().stats()?)
        })
        .map_err(|e| to_py_for(py, e, None))?
    };
    let d = PyDict::new(py);
    d.set_item("used_current", s.used_current)?;
    d.set_item("used_high", s.used_high)?;
    d.set_item("reserved_current", s.reserved_current)?;
    d.set_item("reserved_high", s.reserved_high)?;
    d.set_item("device", g.device)?;
    d.set_item("driver", g.which.clone())?;
    Ok(d)
}

/// The device's free and total memory in bytes (`cuMemGetInfo`, what
/// `torch.cuda.mem_get_info()` reads): what `empty_cache` gives back shows here, including
/// memory lent by pool pointer, which the pool's own figures stop counting at its free.
/// `PoolipcError` before `install_pool` or when the driver refuses.
#[pyfunction]
pub(crate) fn mem_get_info(py: Python<'_>) -> PyResult<(u64, u64)> {
    let g = installed()?;
    py.detach(move || {
        let _on = g.on_device()?;
        Ok::<_, poolipc::Error>(g.driver.mem_get_info()?)
    })
    .map_err(|e| to_py_for(py, e, None))
}

/// Restarts the shared pool's high-water marks (`used_high`, `reserved_high`) from the
/// current figures: what `torch.cuda.reset_peak_memory_stats()` does for torch's own pool,
/// and with the pool installed, that call does this too. `PoolipcError` before
/// `install_pool` or when the driver refuses.
#[pyfunction]
pub(crate) fn reset_peak_memory_stats(py: Python<'_>) -> PyResult<()> {
    let g = installed()?;
    py.detach(move || {
        let _on = g.on_device()?;
        Ok::<_, poolipc::Error>(g.parent.pool().reset_high()?)
    })
    .map_err(|e| to_py_for(py, e, None))
}

/// On the simulated driver, what its race checker found so far on the machine, by this
/// process or any worker: `(text, seed, violations)`, the report in words, the seed that
/// replays the run, one sentence per violation (empty when every rule was kept). `None` on
/// the GPU, where nothing is checked, or before the process's parent was made.
#[pyfunction]
pub(crate) fn sim_report(py: Python<'_>) -> Option<(String, u64, Vec<String>)> {
    let g = crate::state::installed()?;
    py.detach(move || {
        g.parent
            .sim_report()
            .map(|r| (r.to_string(), r.seed, r.lines()))
    })
}

/// Gives memory the process parent does not use back to the device (what
/// `torch.cuda.empty_cache()` does for torch's own pool, and with the pool installed,
/// `torch.cuda.empty_cache()` calls this too): the result arena's chunks with nothing in them
/// (each worker unmaps them; a busy worker's share follows when it answers), then the shared
/// pool, trimmed after waiting for all of this process's GPU work. Returns the bytes given
/// back. `PoolipcError` when the driver refuses.
#[pyfunction]
pub(crate) fn empty_cache(py: Python<'_>) -> PyResult<u64> {
    let g = installed()?;
    py.detach(move || {
        let _on = g.on_device()?;
        let out = g.parent.empty_cache()?;
        Ok::<_, poolipc::Error>(out.arena_bytes + out.pool_bytes)
    })
    .map_err(|e| to_py_for(py, e, None))
}
