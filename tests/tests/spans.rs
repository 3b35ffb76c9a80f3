//! The IO thread's logs name the worker and the job they are about (tracing spans), so that a
//! log of many workers at once can be read one job at a time.

use std::io::Write;
use std::sync::{Arc, Mutex};

use anyhow::{Result, ensure};
use poolipc::{DType, Input, Layout, Parent, ParentOptions};
use poolipc_tests::{Env, worker_command};

const MIB: u64 = 1 << 20;

/// What the subscriber wrote, shared with the test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn one_job(env: &Env) -> Result<(poolipc::WorkerId, poolipc::JobId)> {
    let options = ParentOptions {
        device: env.device,
        ..ParentOptions::default()
    };
    let p = Parent::new(Arc::clone(&env.driver), options)?;
    let d = Arc::clone(p.driver());
    let stream = d.stream_create()?;
    let x = p.pool().alloc(MIB, stream)?;
    d.memset_d32_async(x, 0x1234_5678, MIB / 4, stream)?;
    let worker = p.spawn_worker(worker_command(env, None)?)?;
    let input = [Input {
        ptr: x,
        desc: Layout::contiguous(DType::F32, &[MIB / 4]),
        read_only: true,
    }];
    let handle = p.submit(worker, &input, stream)?;
    let job = handle.id();
    let out = handle.wait()?;
    for r in &out.results {
        p.pool().free(r.ptr, stream)?;
    }
    p.pool().free(x, stream)?;
    d.stream_synchronize(stream)?;
    Ok((worker, job))
}

/// One job on SimDriver with every event logged: the lines logged while the IO thread carried
/// out the job's actions sit in a `job` span with the worker's and the job's ids, and the
/// frames it received in a `received` span with the worker's. (The spans are the facade's,
/// not the driver's: one driver shows it.)
#[test]
fn the_io_threads_lines_name_their_worker_and_job() -> Result<()> {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .try_init()
        .map_err(|e| anyhow::anyhow!("installing the subscriber: {e}"))?;
    let env = Env::sim()?;
    let (worker, job) = one_job(&env)?;
    env.assert_no_violations();
    let text = String::from_utf8_lossy(&captured.0.lock().expect("the log")).into_owned();
    let in_job = format!("job{{worker={worker} job={job}}}");
    let received = format!("received{{worker={worker}}}");
    ensure!(
        text.lines().any(|l| l.contains(&in_job)),
        "no line in the span `{in_job}`:\n{text}"
    );
    ensure!(
        text.lines().any(|l| l.contains(&received)),
        "no line in the span `{received}`:\n{text}"
    );
    Ok(())
}
