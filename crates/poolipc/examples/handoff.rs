//! A parent lends a tensor to a worker process; the worker answers with a result of the same
//! shape (a copy of the input, its first element replaced); the parent checks it.
//!
//! One program plays both parts: the parent spawns this same executable as its worker.
//! `cargo run -p poolipc --example handoff` runs on the GPU where there is one and on the
//! simulated driver otherwise; `POOLIPC_DRIVER=sim` (or `cuda`) decides.
use std::process::Command;

use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::OwnedStream;
use poolipc::driver::{self, Choice};
use poolipc::{DType, Input, Layout, Parent, ParentOptions, ResultShape, Worker};

const ROLE: &str = "HANDOFF_EXAMPLE_ROLE";
const ANSWER: u32 = 0xC0FFEE;

fn main() -> std::process::ExitCode {
    let role = std::env::var_os(ROLE);
    let done = if role.is_some() { worker() } else { parent() };
    if let Err(e) = done {
        // The error's words (Display), not its structure.
        eprintln!("handoff: {e}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

fn parent() -> Result<(), Box<dyn std::error::Error>> {
    // The parent: the driver POOLIPC_DRIVER names (here: the GPU if usable, else SimDriver).
    let parent = Parent::on(driver::open_or(Choice::Auto)?, ParentOptions::default())?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.env(ROLE, "worker");
    // spawn_worker passes the socket, and the simulated machine when there is one.
    let worker = parent.spawn_worker(cmd)?;

    let d = parent.driver().clone();
    // A stream of the parent's own, destroyed when `owned_stream` drops.
    let owned_stream = OwnedStream::new(d.clone())?;
    let stream = owned_stream.handle();
    let n = 1024;
    let input = parent.pool().alloc(4 * n, stream)?;
    d.memset_d32_async(input, 7, n, stream)?;
    let out = parent.run_job(
        worker,
        &[Input::new(input, Layout::contiguous(DType::U32, &[n]))],
        stream,
    )?;
    let result = &out.results[0];
    let mut bytes = vec![0u8; 4 * n as usize];
    // On the job's stream: the result is ordered after the worker's DONE there.
    d.memcpy_dtoh_on(&mut bytes, result.ptr, stream)?;
    let words: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect();
    assert_eq!(words[0], ANSWER);
    assert!(words[1..].iter().all(|&w| w == 7));
    println!(
        "on {}: lent {n} u32 by {}, got back [{:#x}, {}, {}, ...]",
        d.kind(),
        out.input_rungs[0],
        words[0],
        words[1],
        words[2]
    );
    parent.pool().free(result.ptr, stream)?;
    parent.pool().free(input, stream)?;
    d.stream_synchronize(stream)?;
    parent.stop_worker(worker)?;
    Ok(())
}

/// The worker: the parent's driver (its simulated machine, or the GPU), its socket, its pool.
fn worker() -> Result<(), Box<dyn std::error::Error>> {
    let mut worker = Worker::from_env(driver::open_worker()?, 0)?;
    while let Some(mut job) = worker.next_job()? {
        let (src, bytes, desc) = {
            let i = &job.inputs()[0];
            (i.ptr, i.byte_len, i.desc.clone())
        };
        let dst = job.request_results(&[ResultShape::new(desc.dtype, &desc.shape)])?[0].ptr;
        let (d, stream) = (job.driver().clone(), job.stream());
        d.memcpy_dtod_async(dst, src, bytes, stream)?;
        d.memset_d32_async(dst, ANSWER, 1, stream)?;
        job.finish()?;
    }
    Ok(())
}
