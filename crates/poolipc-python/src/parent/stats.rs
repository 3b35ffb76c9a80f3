//! `Parent.stats()`: the facade's [`ParentStats`] as the dict Python reads.

use poolipc::ParentStats;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Every counter of `s` under its field's name; `export_reuse` in words.
pub(super) fn to_dict<'py>(py: Python<'py>, s: &ParentStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("workers_connected", s.workers_connected)?;
    d.set_item("workers_lost", s.workers_lost)?;
    d.set_item("jobs_submitted", s.jobs_submitted)?;
    d.set_item("jobs_completed", s.jobs_completed)?;
    d.set_item("jobs_failed", s.jobs_failed)?;
    d.set_item("pool_pointer_tensors", s.pool_pointer_tensors)?;
    d.set_item("host_staged_tensors", s.host_staged_tensors)?;
    d.set_item("arena_results", s.arena_results)?;
    d.set_item("arena_copied_inputs", s.arena_copied_inputs)?;
    d.set_item("arena_slices_lent", s.arena_slices_lent)?;
    d.set_item("arena_results_carved", s.arena_results_carved)?;
    d.set_item("vmm_handle_tensors", s.vmm_handle_tensors)?;
    d.set_item("vmm_handles_shared", s.vmm_handles_shared)?;
    d.set_item("io_busy_ns", s.io_busy_ns)?;
    d.set_item("inputs_copied_back", s.inputs_copied_back)?;
    d.set_item("jobs_held_for_done", s.jobs_held_for_done)?;
    d.set_item("ready_recorded_aside", s.ready_recorded_aside)?;
    d.set_item("direct_lends", s.direct_lends)?;
    d.set_item("direct_reads", s.direct_reads)?;
    d.set_item("workers_busy", s.workers_busy)?;
    d.set_item("most_workers_busy", s.most_workers_busy)?;
    d.set_item("turn_waits", s.turn_waits)?;
    d.set_item("turn_wait_ns", s.turn_wait_ns)?;
    d.set_item("turn_waits_ran_out", s.turn_waits_ran_out)?;
    d.set_item("done_events_open", s.done_events_open)?;
    d.set_item("export_reuse", export_reuse_name(s.export_reuse))?;
    Ok(d)
}

/// `ParentStats::export_reuse` as `stats()` names it.
fn export_reuse_name(reuse: poolipc::advanced::pool::ExportReuse) -> &'static str {
    use poolipc::advanced::pool::ExportReuse;
    match reuse {
        ExportReuse::Unchecked => "unchecked",
        ExportReuse::Checking => "checking",
        ExportReuse::Proven => "proven",
        ExportReuse::NotProven => "not_proven",
        // A state a later poolipc-pool adds: said as it says it.
        _ => "unknown",
    }
}
