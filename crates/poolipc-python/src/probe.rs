//! Probe marks for Python (`POOLIPC_PROBE`, see [`poolipc::probe`]): the binding marks where
//! its own calls begin and end (`py.*`), so a round trip's time splits into the binding's,
//! the facade's and the caller's own code; `probe_mark` lets a benchmark mark its round trips
//! (`rt.begin` … `rt.synced`, as `poolipc bench` does) and its own work (`user.*`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The labels a Python caller may mark: the round trip's ends and its own work's.
const LABELS: [&str; 4] = ["rt.begin", "rt.synced", "user.begin", "user.end"];

/// Records `label` (one of `rt.begin`, `rt.synced`, `user.begin`, `user.end`) at the current
/// time when `POOLIPC_PROBE` is set; does nothing otherwise. `ValueError` for another label.
#[pyfunction]
pub(crate) fn probe_mark(label: &str) -> PyResult<()> {
    let Some(label) = LABELS.iter().find(|l| **l == label) else {
        return Err(PyValueError::new_err(format!(
            "poolipc: {label:?} is not a probe label; use one of {LABELS:?}"
        )));
    };
    poolipc::probe::mark(label);
    Ok(())
}

/// Writes this process's marks so far to a new file under `POOLIPC_PROBE` (what a Rust
/// `Parent` or `Worker` does when dropped; a Python parent lives as long as its process).
#[pyfunction]
pub(crate) fn probe_dump() {
    poolipc::probe::dump();
}
