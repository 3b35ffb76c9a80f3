//! Echo jobs through a [`Parent`], as the arena suites run them: inputs of the shared pool
//! filled with a pattern, one job, and every byte of the results checked against what
//! [`echo`] writes.

use anyhow::{Context, Result, bail, ensure};
use poolipc::advanced::RawDriver;
use poolipc::{DType, DevicePtr, Input, JobOutput, Layout, Parent, StreamHandle, WorkerId};

use crate::echo;

/// A pool allocation of `bytes` filled with `pattern`.
pub fn filled(p: &Parent, bytes: u64, pattern: u32, stream: StreamHandle) -> Result<DevicePtr> {
    let ptr = p.pool().alloc(bytes, stream)?;
    echo::fill_pattern(&**p.driver(), ptr, bytes, pattern, stream)?;
    Ok(ptr)
}

/// `bytes` of `u8` at `ptr`.
pub fn bytes_input(ptr: DevicePtr, bytes: u64) -> Input {
    Input {
        ptr,
        desc: Layout::contiguous(DType::U8, &[bytes]),
        read_only: false,
    }
}

/// What the echo worker makes of input `i` of `bytes` filled with `pattern`: the pattern,
/// its first word replaced by the marker where the result has one.
pub fn echoed(i: usize, bytes: u64, pattern: u32) -> Result<Vec<u8>> {
    let n = usize::try_from(bytes)?;
    let mut want: Vec<u8> = pattern
        .to_le_bytes()
        .iter()
        .copied()
        .cycle()
        .take(n)
        .collect();
    if n >= 4 {
        want[..4].copy_from_slice(&echo::marker(i).to_le_bytes());
    }
    Ok(want)
}

/// Every byte of result `i` is what the echo worker made of input `i` (`bytes` filled with
/// `pattern`): the worker read all of the input and wrote all of the result.
pub fn check_exact(p: &Parent, out: &JobOutput, i: usize, bytes: u64, pattern: u32) -> Result<()> {
    let r = out
        .results
        .get(i)
        .with_context(|| format!("no result {i}"))?;
    ensure!(
        r.bytes == bytes,
        "result {i} has {} bytes, not {bytes}",
        r.bytes
    );
    let mut got = vec![0u8; usize::try_from(bytes)?];
    p.driver().memcpy_dtoh(&mut got, r.ptr)?;
    let want = echoed(i, bytes, pattern)?;
    if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
        bail!(
            "byte {at} of result {i} ({bytes} bytes) is {:#04x}, expected {:#04x}",
            got[at],
            want[at]
        );
    }
    Ok(())
}

/// An echo job of one `u8` input per size on `worker`, each filled with `pattern`; the inputs
/// are freed before returning.
pub fn echo_job(
    p: &Parent,
    worker: WorkerId,
    sizes: &[u64],
    pattern: u32,
    stream: StreamHandle,
) -> Result<JobOutput> {
    let mut ptrs = Vec::new();
    for &n in sizes {
        ptrs.push(filled(p, n, pattern, stream)?);
    }
    let inputs: Vec<Input> = ptrs
        .iter()
        .zip(sizes)
        .map(|(&ptr, &n)| bytes_input(ptr, n))
        .collect();
    let out = p.run_job(worker, &inputs, stream);
    p.driver().stream_synchronize(stream)?;
    for ptr in ptrs {
        p.pool().free(ptr, stream)?;
    }
    p.driver().stream_synchronize(stream)?;
    Ok(out?)
}

/// Gives a job's results back: pool memory (the default allocator's) freed on `stream`,
/// arena blocks when `out` drops.
pub fn free_results(p: &Parent, out: JobOutput, stream: StreamHandle) -> Result<()> {
    for r in out.results {
        if !r.is_arena() {
            p.pool().free(r.ptr, stream)?;
        }
    }
    Ok(())
}

/// Lets the arena's returned blocks complete and be reclaimed; the live blocks left.
pub fn settle(p: &Parent, stream: StreamHandle) -> Result<usize> {
    p.driver().stream_synchronize(stream)?;
    p.reclaim_arena();
    let stats = p.arena_stats().context("no arena")?;
    ensure!(stats.pending_frees == 0, "{stats:?}");
    Ok(stats.alloc.live_blocks)
}
