//! The echo worker `poolipc demo` and `poolipc bench` run: for each input, a result of the
//! same dtype and shape holding a copy of it, its first 32-bit word replaced by a marker. It
//! exercises inputs, the shape-first result request, a device copy and a write in place.
//! `touch` and `produce` are the workers the benchmark measures.

use poolipc::advanced::RawDriver;
use poolipc::{DType, Error, Job, ResultShape, Worker};

pub(crate) use poolipc::advanced::driver::pattern::{fill_pattern, marker, verify_echo};

/// Answers one job as the echo worker does: a result per input, a copy with a marker.
fn answer(job: &mut Job<'_>) -> Result<(), Error> {
    let shapes: Vec<ResultShape> = job
        .inputs()
        .iter()
        .map(|i| ResultShape::new(i.desc.dtype, &i.desc.shape))
        .collect();
    let copies: Vec<_> = job.inputs().iter().map(|i| (i.ptr, i.byte_len)).collect();
    if !shapes.is_empty() {
        job.request_results(&shapes)?;
    }
    let driver = job.driver().clone();
    let stream = job.stream();
    for (i, ((src, bytes), dst)) in copies.iter().zip(job.results()).enumerate() {
        driver.memcpy_dtod_async(dst.ptr, *src, (*bytes).min(dst.bytes), stream)?;
        if dst.bytes >= 4 {
            driver.memset_d32_async(dst.ptr, marker(i), 1, stream)?;
        }
    }
    Ok(())
}

/// Answers one job by writing in place: the first 4 KiB of every input (or all of a smaller
/// one) set to the input's marker, no results. What `poolipc bench` measures. Read-only
/// inputs (host-staged: a write would never reach the parent) are left alone.
fn touch(job: &mut Job<'_>) -> Result<(), Error> {
    let driver = job.driver().clone();
    let stream = job.stream();
    for (i, input) in job.inputs().iter().enumerate() {
        if input.read_only {
            continue;
        }
        let words = input.byte_len.min(4096) / 4;
        if words > 0 {
            driver.memset_d32_async(input.ptr, marker(i), words, stream)?;
        }
    }
    Ok(())
}

/// Answers one job with one result of `bytes` bytes (`u8`), its first 4 KiB (or all of a
/// smaller one) set to a marker on the job's stream; inputs are left alone. What `poolipc
/// bench` measures for results (the arena's round trip; with an arena slice, the result is
/// carved out of it when it fits, and the job costs no round trip for it).
fn produce(job: &mut Job<'_>, bytes: u64) -> Result<(), Error> {
    let results = job.request_results(&[ResultShape::new(DType::U8, &[bytes])])?;
    let (ptr, len) = (results[0].ptr, results[0].bytes);
    let driver = job.driver().clone();
    let words = len.min(4096) / 4;
    if words > 0 {
        driver.memset_d32_async(ptr, marker(0), words, job.stream())?;
    }
    Ok(())
}

/// Serves jobs with [`produce`] until the parent says goodbye.
pub(crate) fn serve_produce(worker: &mut Worker, bytes: u64) -> Result<usize, Error> {
    serve_with(worker, |job| produce(job, bytes))
}

/// Serves jobs with [`touch`] until the parent says goodbye.
pub(crate) fn serve_touch(worker: &mut Worker) -> Result<usize, Error> {
    serve_with(worker, touch)
}

/// Serves jobs until the parent says goodbye; returns how many it served.
pub(crate) fn serve(worker: &mut Worker) -> Result<usize, Error> {
    serve_with(worker, answer)
}

/// Serves jobs with `answer` until the parent says goodbye; returns how many it served. A
/// job that fails (a result the parent refused, say) fails alone: the parent is told why, and
/// the worker goes on to the next.
fn serve_with(
    worker: &mut Worker,
    mut answer: impl FnMut(&mut Job<'_>) -> Result<(), Error>,
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
