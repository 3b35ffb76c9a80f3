//! `doctor --probe-limit`: find where `cuMemPoolImportPointer` starts to kill the importer, by
//! importing growing allocations in sacrificial child processes.

use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use poolipc::advanced::driver::{DevicePtr, Driver, ImportedPointer, StreamHandle};
use poolipc::advanced::pool::{AttachedPool, ImportLimit, SharedPool};
use poolipc::advanced::transport::Layout;
use poolipc::advanced::transport::{
    Ack, Capabilities, DType, EventBlob, HandoffId, HandshakeConfig, JobId, Lend, LentTensor,
    Message, Rung, TensorMeta,
};

const MIB: u64 = 1 << 20;
const PATTERN: u32 = 0x600D_F00D;
/// The device ordinal a child uses, passed by the parent.
const DEVICE_ENV: &str = "POOLIPC_PROBE_DEVICE";

/// How one sacrificial import ended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Outcome {
    /// The child imported it and read the parent's pattern.
    Imported,
    /// The child died of a signal.
    Crashed(i32),
    /// The child reported an error, or exited without a signal.
    Failed(String),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Imported => write!(f, "imported, pattern read"),
            Outcome::Crashed(sig) => {
                write!(f, "importer killed by signal {sig}{}", signal_name(*sig))
            }
            Outcome::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        11 => " (SIGSEGV)",
        6 => " (SIGABRT)",
        7 => " (SIGBUS)",
        9 => " (SIGKILL)",
        _ => "",
    }
}

/// What the probe found.
#[derive(Debug, Clone)]
pub(crate) struct ProbeReport {
    /// The largest size that imported, in bytes.
    pub(crate) last_good: Option<u64>,
    /// The smallest size that did not.
    pub(crate) first_bad: Option<(u64, Outcome)>,
}

fn identity(driver: &dyn Driver, device: u32) -> Result<poolipc::advanced::transport::Identity> {
    let caps = Capabilities::POOL_POINTER | Capabilities::IPC_EVENTS;
    Ok(poolipc::advanced::identity(driver, device, caps)?)
}

/// Imports `bytes` from `pool` in a fresh child; the parent survives whatever happens there.
fn probe_once(
    pool: &SharedPool<dyn Driver>,
    stream: StreamHandle,
    child_env: Option<&(&'static str, String)>,
    bytes: u64,
) -> Result<(Outcome, DevicePtr)> {
    let d = &**pool.driver();
    let ptr = pool.alloc(bytes, stream)?;
    let result = (|| -> Result<Outcome> {
        // The child reads the first word; filling 1 MiB keeps the simulation's probes cheap.
        d.memset_d32_async(ptr, PATTERN, (1 << 20) / 4, stream)?;
        d.stream_synchronize(stream)?;
        let blob = pool.export(ptr)?;
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("__import-child")
            .env(DEVICE_ENV, pool.device().to_string());
        if let Some((k, v)) = child_env {
            cmd.env(k, v);
        }
        let (mut child, mut conn) = poolipc::advanced::transport::spawn_worker(cmd)?;
        let deadline = Instant::now() + Duration::from_secs(120);
        let config = HandshakeConfig {
            identity: identity(d, pool.device())?,
            required: Capabilities::NONE,
        };
        let fd = pool.fd();
        let answer = poolipc::advanced::transport::parent_handshake(
            &mut conn,
            &config,
            fd.as_fd(),
            deadline,
        )
        .map_err(anyhow::Error::from)
        .and_then(|_| {
            let lend = Lend {
                job: JobId(1),
                tensors: vec![LentTensor {
                    handle: HandoffId(1),
                    alloc: poolipc::advanced::transport::AllocId(1),
                    rung: Rung::PoolPointer,
                    pool: 0,
                    export: blob,
                    ready_event: EventBlob([0; 64]),
                    meta: TensorMeta {
                        layout: Layout {
                            dtype: DType::U8,
                            shape: vec![bytes],
                            strides: vec![1],
                        },
                        byte_offset: 0,
                        byte_len: bytes,
                    },
                    read_only: false,
                    arena: None,
                }],
                slice: None,
            };
            conn.send(&Message::Lend(lend), &[], deadline)?;
            Ok(conn.recv(deadline)?.0)
        });
        let status = child.wait()?;
        if let Some(sig) = status.signal() {
            return Ok(Outcome::Crashed(sig));
        }
        Ok(match answer {
            Ok(Message::Ack(_)) if status.success() => Outcome::Imported,
            Ok(Message::Error { message, .. }) => Outcome::Failed(message),
            Ok(other) => Outcome::Failed(format!("unexpected answer {:?}", other.kind())),
            Err(e) => Outcome::Failed(format!("{e:#} (child {status})")),
        })
    })();
    // The child is gone, and with it its import: the allocation may be freed.
    pool.free(ptr, stream)?;
    d.stream_synchronize(stream)?;
    Ok((result?, ptr))
}

/// Finds the largest importable allocation between `lo` and `hi` in `step` increments,
/// printing each probe as it goes (on stderr when `stdout_is_data`, e.g. `doctor --json`).
pub(crate) fn probe_limit(
    driver: Arc<dyn Driver>,
    device: u32,
    child_env: Option<(&'static str, String)>,
    stdout_is_data: bool,
) -> Result<ProbeReport> {
    let pool = SharedPool::install(driver, device).context("installing the shared pool")?;
    let d = Arc::clone(pool.driver());
    let stream = poolipc::advanced::driver::OwnedStream::new(d)?;
    let report = search(&pool, stream.handle(), child_env.as_ref(), stdout_is_data);
    // Put the device's own pool back: a parent started after the probes (the export reuse
    // check) installs a pool of its own, and one already installed here refuses it.
    let closed = stream.close().map_err(anyhow::Error::from).and_then(|()| {
        pool.uninstall()
            .context("uninstalling the shared pool after the probes")
    });
    let report = report?;
    closed?;
    Ok(report)
}

/// The binary search of [`probe_limit`], on `pool` and `stream`.
fn search(
    pool: &SharedPool<dyn Driver>,
    stream: StreamHandle,
    child_env: Option<&(&'static str, String)>,
    stdout_is_data: bool,
) -> Result<ProbeReport> {
    let (lo_start, hi_start, step) = (4096 * MIB, 8192 * MIB, 16 * MIB);
    let limit = ImportLimit::default();
    let run = |bytes: u64| -> Result<Outcome> {
        let t = Instant::now();
        let (outcome, ptr) = probe_once(pool, stream, child_env, bytes)?;
        let line = format!(
            "  probe {:>6} MiB at {:#x} ({} chunks of 32 MiB): {outcome} [{:.1} s]",
            bytes / MIB,
            ptr.0,
            limit.chunks_spanned(ptr.0, bytes),
            t.elapsed().as_secs_f64()
        );
        if stdout_is_data {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
        Ok(outcome)
    };
    let lo_outcome = run(lo_start)?;
    if lo_outcome != Outcome::Imported {
        return Ok(ProbeReport {
            last_good: None,
            first_bad: Some((lo_start, lo_outcome)),
        });
    }
    let hi_outcome = run(hi_start)?;
    if hi_outcome == Outcome::Imported {
        return Ok(ProbeReport {
            last_good: Some(hi_start),
            first_bad: None,
        });
    }
    let (mut lo, mut hi, mut hi_outcome) = (lo_start, hi_start, hi_outcome);
    while hi - lo > step {
        let mid = lo + (hi - lo) / 2 / step * step;
        let outcome = run(mid)?;
        if outcome == Outcome::Imported {
            lo = mid;
        } else {
            hi = mid;
            hi_outcome = outcome;
        }
    }
    Ok(ProbeReport {
        last_good: Some(lo),
        first_bad: Some((hi, hi_outcome)),
    })
}

/// The sacrificial child: attach the pool, import the one lent tensor, read its first word.
pub(crate) fn child_main() -> Result<ExitCode> {
    let device: u32 = std::env::var(DEVICE_ENV)
        .unwrap_or_else(|_| "0".into())
        .parse()?;
    let driver = open_driver_for_child()?;
    driver.use_device(device)?;
    let mut conn = poolipc::advanced::transport::connection_from_env()?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let config = HandshakeConfig {
        identity: identity(&*driver, device)?,
        required: Capabilities::NONE,
    };
    let (_peer, pool_fd) =
        poolipc::advanced::transport::worker_handshake(&mut conn, &config, deadline)?;
    let pool = AttachedPool::attach(&*driver, pool_fd.as_fd(), device)?;
    let Message::Lend(lend) = conn.recv(deadline)?.0 else {
        bail!("expected a Lend")
    };
    let Some(t) = lend.tensors.first() else {
        bail!("the Lend holds no tensor")
    };
    let data = t.export;
    // This is the call that may not return.
    let import = ImportedPointer::import(&*driver, pool.pool.handle(), &data)?;
    let mut word = [0u8; 4];
    driver.memcpy_dtoh(&mut word, import.ptr())?;
    import.free(StreamHandle::NULL)?;
    driver.stream_synchronize(StreamHandle::NULL)?;
    let answer = if u32::from_le_bytes(word) == PATTERN {
        Message::Ack(Ack {
            job: lend.job,
            handles: vec![t.handle],
        })
    } else {
        Message::Error {
            code: poolipc::advanced::transport::ErrorCode::OTHER,
            message: format!(
                "read {:#x}, expected {PATTERN:#x}",
                u32::from_le_bytes(word)
            ),
        }
    };
    conn.send(&answer, &[], deadline)?;
    Ok(ExitCode::SUCCESS)
}

/// The driver a child of ours uses: the parent's simulated machine when it handed one over,
/// else the real driver.
fn open_driver_for_child() -> Result<Box<dyn Driver>> {
    Ok(
        match poolipc::advanced::driver::sim::SimDriver::from_env() {
            Some(sim) => Box::new(sim?),
            None => Box::new(poolipc::advanced::driver::CudaDriver::new()?),
        },
    )
}
