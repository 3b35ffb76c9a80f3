//! A worker's answer to the parent's canary battery: what the echo worker does, answered
//! inside [`Worker::next_job`] so that user code never sees a canary job.

use super::failpoint::CanaryScope;
use super::{Job, Started, Worker};
use crate::canary::{CANARY_IN_PLACE_BIT, marker};
use crate::error::Error;
use crate::tensor::{ResultShape, Rung};

impl Worker {
    /// Answers one job of the parent's canary battery as the echo worker does ([`echo`]); a job whose
    /// id carries [`CANARY_IN_PLACE_BIT`] also writes
    /// [`marker`]`(i)` into the first word of each writable
    /// pool-pointer input `i`, after the copy, for the parent to read back. A job whose
    /// tensors cannot be viewed (an import the driver refused) was failed with the reason
    /// already: the worker goes on.
    pub(super) fn answer_canary(&mut self, started: Started) -> Result<(), Error> {
        let _canary = CanaryScope::enter();
        let in_place = started.job.0 & CANARY_IN_PLACE_BIT != 0;
        let mut job = match self.job(started) {
            Ok(job) => job,
            Err(e) => {
                tracing::warn!(error = %e, "a canary job failed before it started");
                return Ok(());
            }
        };
        let answered = echo(&mut job).and_then(|()| {
            if !in_place {
                return Ok(());
            }
            let (driver, stream) = (job.driver_ref().clone(), job.stream());
            for (i, input) in job.inputs().iter().enumerate() {
                if input.rung == Rung::PoolPointer && !input.read_only && input.byte_len >= 4 {
                    driver.memset_d32_async(input.ptr, marker(i), 1, stream)?;
                }
            }
            Ok(())
        });
        match answered {
            Ok(()) => job.finish(),
            Err(e) => job.fail(&e.to_string()),
        }
    }
}

/// For each input of `job`, a result of the same dtype and shape holding a copy of it, its
/// first 32-bit word replaced by [`marker`]`(i)`: what the battery checks.
fn echo(job: &mut Job<'_>) -> Result<(), Error> {
    let shapes: Vec<ResultShape> = job
        .inputs()
        .iter()
        .map(|i| ResultShape::new(i.desc.dtype, &i.desc.shape))
        .collect();
    let copies: Vec<_> = job.inputs().iter().map(|i| (i.ptr, i.byte_len)).collect();
    if !shapes.is_empty() {
        job.request_results(&shapes)?;
    }
    let driver = job.driver_ref().clone();
    let stream = job.stream();
    for (i, ((src, bytes), dst)) in copies.iter().zip(job.results()).enumerate() {
        driver.memcpy_dtod_async(dst.ptr, *src, (*bytes).min(dst.bytes), stream)?;
        if dst.bytes >= 4 {
            driver.memset_d32_async(dst.ptr, marker(i), 1, stream)?;
        }
    }
    Ok(())
}
