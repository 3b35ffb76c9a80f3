//! The IO thread's logs name the worker and the job they are about (tracing spans), so that a
//! log of many workers at once can be read one job at a time.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use poolipc::advanced::RawDriver;
use poolipc::advanced::driver::OwnedStream;
use poolipc::{DType, Input, Layout, Parent, ParentOptions};
use poolipc_tests::{Env, tempdir, worker_command};

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

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("the log")).into_owned()
    }
}

/// The process's subscriber, every event of every thread written to one buffer: installed
/// by the first test that asks (the tests of this file may share a process).
fn captured() -> Result<&'static Captured> {
    static CAPTURED: OnceLock<Captured> = OnceLock::new();
    let mut installed = Ok(());
    let c = CAPTURED.get_or_init(|| {
        let captured = Captured::default();
        let writer = captured.clone();
        installed = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .try_init()
            .map_err(|e| anyhow::anyhow!("installing the subscriber: {e}"));
        captured
    });
    installed.map(|()| c)
}

fn one_job(env: &Env) -> Result<(poolipc::WorkerId, poolipc::JobId)> {
    let options = ParentOptions {
        device: env.device,
        ..ParentOptions::default()
    };
    let p = Parent::new(Arc::clone(&env.driver), options)?;
    let d = Arc::clone(p.driver());
    let owned_stream = OwnedStream::new(d.clone())?;
    let stream = owned_stream.handle();
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
    let captured = captured()?;
    let env = Env::sim()?;
    let (worker, job) = one_job(&env)?;
    env.assert_no_violations();
    let text = captured.text();
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

/// The words of the log line that says busy workers take turns without MPS.
const TURNS: &str = "workers have jobs at once and this process is not an MPS client";

/// Two workers of one parent each hold a job (gated: neither answers before `go`), twice.
/// Returns the parent's most workers busy at once.
fn two_at_once(env: &Env) -> Result<u64> {
    let p = Parent::new(
        Arc::clone(&env.driver),
        ParentOptions {
            device: env.device,
            ..ParentOptions::default()
        },
    )?;
    let d = Arc::clone(p.driver());
    let owned_stream = OwnedStream::new(d.clone())?;
    let stream = owned_stream.handle();
    let x = p.pool().alloc(MIB, stream)?;
    let input = [Input {
        ptr: x,
        desc: Layout::contiguous(DType::U8, &[MIB]),
        read_only: true,
    }];
    for _ in 0..2 {
        let dir = tempdir("turns")?;
        let mut workers = Vec::new();
        for _ in 0..2 {
            let mut cmd = worker_command(env, None)?;
            cmd.env("POOLIPC_TEST_GATE", &dir);
            workers.push(p.spawn_worker(cmd)?);
        }
        let handles = workers
            .iter()
            .map(|&w| p.submit(w, &input, stream))
            .collect::<Result<Vec<_>, _>>()?;
        let until = Instant::now() + Duration::from_secs(60);
        while std::fs::read_dir(&dir)?.count() < 2 {
            ensure!(Instant::now() < until, "the two jobs did not both start");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::write(dir.join("go"), b"")?;
        for h in handles {
            for r in h.wait()?.results {
                p.pool().free(r.ptr, stream)?;
            }
        }
        for w in workers {
            p.stop_worker(w)?;
        }
        std::fs::remove_dir_all(&dir)?;
    }
    p.pool().free(x, stream)?;
    d.stream_synchronize(stream)?;
    Ok(p.stats().most_workers_busy)
}

/// Without MPS, workers that compute at once take turns on the GPU: the first time two
/// workers have jobs at once, a parent that is not an MPS client says so once (not again at
/// the second time, nor for another round); an MPS client says nothing.
#[test]
fn two_busy_workers_without_mps_are_logged_once_and_under_mps_not_at_all() -> Result<()> {
    let captured = captured()?;
    let said = || captured.text().matches(TURNS).count();
    let mps = Env::sim_with(poolipc::advanced::driver::sim::SimConfig {
        mps: true,
        ..Default::default()
    })?;
    ensure!(two_at_once(&mps)? == 2, "under MPS: not two busy at once");
    mps.assert_no_violations();
    ensure!(said() == 0, "an MPS client said it:\n{}", captured.text());
    let plain = Env::sim()?;
    ensure!(two_at_once(&plain)? == 2, "plainly: not two busy at once");
    plain.assert_no_violations();
    ensure!(
        said() == 1,
        "said {} times, not once:\n{}",
        said(),
        captured.text()
    );
    let line = captured
        .text()
        .lines()
        .find(|l| l.contains(TURNS))
        .unwrap_or_default()
        .to_owned();
    ensure!(
        line.contains("poolipc mps"),
        "the line names no remedy: {line}"
    );
    Ok(())
}
