//! The echo worker the tests run: for each input, a result of the same dtype and shape holding
//! a copy of it, its first 32-bit word replaced by a marker ([`marker`]). It exercises inputs,
//! the shape-first result request, a device copy and a write in place, and dies at the step
//! `POOLIPC_FAILPOINT` names. [`fill_pattern`] and [`verify_echo`] are the parent's side.

use poolipc::advanced::RawDriver;
use poolipc::{Error, Job, ResultShape, Worker};

pub use poolipc::advanced::driver::pattern::{fill_pattern, marker, verify_echo};

/// Dies here (SIGKILL) when `POOLIPC_FAILPOINT` ([`poolipc::FAILPOINT_ENV`]) names `step`:
/// `after-import`, `after-grant`, `after-write` or `after-refusal`, the steps of the echo
/// worker's own code (the library's failpoints cover the others). For the tests of what the
/// parent does when a worker dies mid-handoff.
fn failpoint(step: &str) {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let armed = AT.get_or_init(|| std::env::var(poolipc::FAILPOINT_ENV).ok());
    if armed.as_deref() == Some(step) {
        tracing::warn!(step, "echo worker dying on purpose (SIGKILL)");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
    }
}

/// Answers one job as the echo worker does: a result per input, a copy with a marker.
pub fn answer(job: &mut Job<'_>) -> Result<(), Error> {
    let shapes: Vec<ResultShape> = job
        .inputs()
        .iter()
        .map(|i| ResultShape::new(i.desc.dtype, &i.desc.shape))
        .collect();
    failpoint("after-import");
    let copies: Vec<_> = job.inputs().iter().map(|i| (i.ptr, i.byte_len)).collect();
    if !shapes.is_empty()
        && let Err(e) = job.request_results(&shapes)
    {
        failpoint("after-refusal");
        return Err(e);
    }
    failpoint("after-grant");
    let driver = job.driver().clone();
    let stream = job.stream();
    for (i, ((src, bytes), dst)) in copies.iter().zip(job.results()).enumerate() {
        driver.memcpy_dtod_async(dst.ptr, *src, (*bytes).min(dst.bytes), stream)?;
        if dst.bytes >= 4 {
            driver.memset_d32_async(dst.ptr, marker(i), 1, stream)?;
        }
    }
    failpoint("after-write");
    Ok(())
}

/// Answers one job as [`answer`] does, but as a worker that learns its results' shapes one
/// at a time (a sampler, a variable-length decoder): one result request per input, each
/// written before the next is asked for. With an arena slice
/// ([`ParentOptions::arena_slice_bytes`](poolipc::ParentOptions::arena_slice_bytes)) the
/// results that fit are carved out of it without a round trip; the others are asked for.
pub fn answer_late(job: &mut Job<'_>) -> Result<(), Error> {
    let inputs: Vec<_> = job
        .inputs()
        .iter()
        .map(|i| {
            (
                ResultShape::new(i.desc.dtype, &i.desc.shape),
                i.ptr,
                i.byte_len,
            )
        })
        .collect();
    failpoint("after-import");
    let driver = job.driver().clone();
    let stream = job.stream();
    for (i, (shape, src, bytes)) in inputs.into_iter().enumerate() {
        let dst = &job.request_results(std::slice::from_ref(&shape))?[0];
        let (ptr, len) = (dst.ptr, dst.bytes);
        driver.memcpy_dtod_async(ptr, src, bytes.min(len), stream)?;
        if len >= 4 {
            driver.memset_d32_async(ptr, marker(i), 1, stream)?;
        }
    }
    failpoint("after-grant");
    failpoint("after-write");
    Ok(())
}

/// Serves jobs with [`answer_late`] until the parent says goodbye.
pub fn serve_late(worker: &mut Worker) -> Result<usize, Error> {
    serve_with(worker, answer_late)
}

/// Serves jobs until the parent says goodbye; returns how many it served.
pub fn serve(worker: &mut Worker) -> Result<usize, Error> {
    serve_with(worker, answer)
}

/// Serves jobs with `answer` until the parent says goodbye; returns how many it served. A
/// job that fails (a result the parent refused, say) fails alone: the parent is told why, and
/// the worker goes on to the next.
fn serve_with(
    worker: &mut Worker,
    answer: impl Fn(&mut Job<'_>) -> Result<(), Error>,
) -> Result<usize, Error> {
    let mut served = 0;
    while let Some(mut job) = worker.next_job()? {
        match answer(&mut job) {
            Ok(()) => job.finish()?,
            Err(e) => job.fail(&e.to_string())?,
        }
        served += 1;
    }
    Ok(served)
}
