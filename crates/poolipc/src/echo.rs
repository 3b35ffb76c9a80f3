//! The echo worker: for each input, a result of the same dtype and shape holding a copy of it,
//! its first 32-bit word replaced by a marker. `poolipc demo`, the tests and the benchmark use
//! it as the worker side; it exercises inputs, the shape-first result request, a device copy
//! and a write in place.

use crate::error::Error;
use crate::tensor::ResultShape;
use crate::worker::{Job, Worker};
use poolipc_types::DType;

/// The word the echo worker writes at the start of result `i`.
#[must_use]
pub fn marker(i: usize) -> u32 {
    0xEC40_0000 | (i as u32 & 0xFFFF)
}

/// Fills `[ptr, ptr + bytes)` with the repeating little-endian bytes of `pattern` on
/// `stream`, byte `k` being `pattern.to_le_bytes()[k % 4]`, never touching a byte beyond (the
/// driver refuses a memset past the allocation's size). `ptr` must be 4-byte aligned.
pub fn fill_pattern(
    driver: &dyn poolipc_driver::Driver,
    ptr: crate::DevicePtr,
    bytes: u64,
    pattern: u32,
    stream: crate::StreamHandle,
) -> Result<(), Error> {
    let words = bytes / 4;
    if words > 0 {
        driver.memset_d32_async(ptr, pattern, words, stream)?;
    }
    let tail = pattern.to_le_bytes();
    for k in words * 4..bytes {
        driver.memset_d8_async(ptr.offset(k), tail[(k % 4) as usize], 1, stream)?;
    }
    Ok(())
}

/// Checks that `[ptr, ptr + bytes)` holds what [`answer`] makes of input `i` when that input
/// was filled by [`fill_pattern`] with `pattern` starting `offset` bytes into its allocation:
/// the marker first, the pattern after, sampled (64 KiB) at both ends.
pub fn verify_echo(
    driver: &dyn poolipc_driver::Driver,
    ptr: crate::DevicePtr,
    bytes: u64,
    i: usize,
    pattern: u32,
    offset: u64,
) -> Result<(), String> {
    let sample = bytes.min(64 * 1024) as usize;
    let pat = pattern.to_le_bytes();
    for start in [0, bytes - sample as u64] {
        let mut buf = vec![0u8; sample];
        driver
            .memcpy_dtoh(&mut buf, ptr.offset(start))
            .map_err(|e| e.to_string())?;
        for (k, b) in buf.iter().enumerate() {
            let at = start + k as u64;
            let want = if at < 4 {
                marker(i).to_le_bytes()[at as usize]
            } else {
                pat[((at + offset) % 4) as usize]
            };
            if *b != want {
                return Err(format!(
                    "byte {at} of result {i} is {b:#04x}, expected {want:#04x}"
                ));
            }
        }
    }
    Ok(())
}

/// A point in a job at which [`serve`] can be told to die, to test what the parent does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)] // each names the moment after which the worker dies
pub enum DieAt {
    /// After the inputs were imported, before asking for results.
    AfterImport,
    /// After the results were granted and imported, before writing them.
    AfterGrant,
    /// After writing, before finishing (no DONE, no ACK).
    AfterWrite,
    /// When the parent refused the results (a worker that cannot go on without them).
    AfterRefusal,
}

impl std::str::FromStr for DieAt {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "after-import" => DieAt::AfterImport,
            "after-grant" => DieAt::AfterGrant,
            "after-write" => DieAt::AfterWrite,
            "after-refusal" => DieAt::AfterRefusal,
            other => return Err(format!("unknown step {other:?}")),
        })
    }
}

fn die_here(at: Option<DieAt>, here: DieAt) {
    if at == Some(here) {
        tracing::warn!(?here, "echo worker dying on purpose (SIGKILL)");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
    }
    crate::worker::failpoint(match here {
        DieAt::AfterImport => "after-import",
        DieAt::AfterGrant => "after-grant",
        DieAt::AfterWrite => "after-write",
        DieAt::AfterRefusal => "after-refusal",
    });
}

/// Answers one job as the echo worker does: a result per input, a copy with a marker.
pub fn answer(job: &mut Job<'_>, die_at: Option<DieAt>) -> Result<(), Error> {
    let shapes: Vec<ResultShape> = job
        .inputs()
        .iter()
        .map(|i| ResultShape::new(i.desc().dtype, &i.desc().shape))
        .collect();
    die_here(die_at, DieAt::AfterImport);
    let copies: Vec<_> = job
        .inputs()
        .iter()
        .map(|i| (i.ptr(), i.byte_len()))
        .collect();
    if !shapes.is_empty()
        && let Err(e) = job.request_results(&shapes)
    {
        die_here(die_at, DieAt::AfterRefusal);
        return Err(e);
    }
    die_here(die_at, DieAt::AfterGrant);
    let driver = job.driver().clone();
    let stream = job.stream();
    for (i, ((src, bytes), dst)) in copies.iter().zip(job.results()).enumerate() {
        driver.memcpy_dtod_async(dst.ptr(), *src, (*bytes).min(dst.bytes()), stream)?;
        if dst.bytes() >= 4 {
            driver.memset_d32_async(dst.ptr(), marker(i), 1, stream)?;
        }
    }
    die_here(die_at, DieAt::AfterWrite);
    Ok(())
}

/// Answers one job as [`answer`] does, but as a worker that learns its results' shapes one
/// at a time (a sampler, a variable-length decoder): one result request per input, each
/// written before the next is asked for. With an arena slice
/// ([`ParentOptions::arena_slice_bytes`](crate::ParentOptions::arena_slice_bytes)) the
/// results that fit are carved out of it without a round trip; the others are asked for.
pub fn answer_late(job: &mut Job<'_>, die_at: Option<DieAt>) -> Result<(), Error> {
    let inputs: Vec<_> = job
        .inputs()
        .iter()
        .map(|i| {
            (
                ResultShape::new(i.desc().dtype, &i.desc().shape),
                i.ptr(),
                i.byte_len(),
            )
        })
        .collect();
    die_here(die_at, DieAt::AfterImport);
    let driver = job.driver().clone();
    let stream = job.stream();
    for (i, (shape, src, bytes)) in inputs.into_iter().enumerate() {
        let dst = &job.request_results(std::slice::from_ref(&shape))?[0];
        let (ptr, len) = (dst.ptr(), dst.bytes());
        driver.memcpy_dtod_async(ptr, src, bytes.min(len), stream)?;
        if len >= 4 {
            driver.memset_d32_async(ptr, marker(i), 1, stream)?;
        }
    }
    die_here(die_at, DieAt::AfterGrant);
    die_here(die_at, DieAt::AfterWrite);
    Ok(())
}

/// Serves jobs with [`answer_late`] until the parent says goodbye.
pub fn serve_late(worker: &mut Worker, die_at: Option<DieAt>) -> Result<usize, Error> {
    let mut served = 0;
    while let Some(mut job) = worker.next_job()? {
        match answer_late(&mut job, die_at) {
            Ok(()) => job.finish()?,
            Err(e) => job.fail(&e.to_string())?,
        }
        served += 1;
    }
    Ok(served)
}

/// Answers one job by writing in place: the first 4 KiB of every input (or all of a smaller
/// one) set to the input's marker, no results. What `poolipc bench` measures. Read-only
/// inputs (host-staged: a write would never reach the parent) are left alone.
pub fn touch(job: &mut Job<'_>) -> Result<(), Error> {
    let driver = job.driver().clone();
    let stream = job.stream();
    for (i, input) in job.inputs().iter().enumerate() {
        if input.read_only() {
            continue;
        }
        let words = input.byte_len().min(4096) / 4;
        if words > 0 {
            driver.memset_d32_async(input.ptr(), marker(i), words, stream)?;
        }
    }
    Ok(())
}

/// Answers one job with one result of `bytes` bytes (`u8`), its first 4 KiB (or all of a
/// smaller one) set to a marker on the job's stream; inputs are left alone. What `poolipc
/// bench` measures for results (the arena's round trip; with an arena slice, the result is
/// carved out of it when it fits, and the job costs no round trip for it).
pub fn produce(job: &mut Job<'_>, bytes: u64) -> Result<(), Error> {
    let results = job.request_results(&[ResultShape::new(DType::U8, &[bytes])])?;
    let (ptr, len) = (results[0].ptr(), results[0].bytes());
    let driver = job.driver().clone();
    let words = len.min(4096) / 4;
    if words > 0 {
        driver.memset_d32_async(ptr, marker(0), words, job.stream())?;
    }
    Ok(())
}

/// Serves jobs with [`produce`] until the parent says goodbye.
pub fn serve_produce(worker: &mut Worker, bytes: u64) -> Result<usize, Error> {
    let mut served = 0;
    while let Some(mut job) = worker.next_job()? {
        match produce(&mut job, bytes) {
            Ok(()) => job.finish()?,
            Err(e) => job.fail(&e.to_string())?,
        }
        served += 1;
    }
    Ok(served)
}

/// Serves jobs with [`touch`] until the parent says goodbye.
pub fn serve_touch(worker: &mut Worker) -> Result<usize, Error> {
    let mut served = 0;
    while let Some(mut job) = worker.next_job()? {
        match touch(&mut job) {
            Ok(()) => job.finish()?,
            Err(e) => job.fail(&e.to_string())?,
        }
        served += 1;
    }
    Ok(served)
}

/// Serves jobs until the parent says goodbye; returns how many it served.
pub fn serve(worker: &mut Worker, die_at: Option<DieAt>) -> Result<usize, Error> {
    let mut served = 0;
    while let Some(mut job) = worker.next_job()? {
        // A job that fails (a result the parent refused, say) fails alone: the parent is
        // told why, and the worker goes on to the next.
        match answer(&mut job, die_at) {
            Ok(()) => job.finish()?,
            Err(e) => job.fail(&e.to_string())?,
        }
        served += 1;
    }
    Ok(served)
}
