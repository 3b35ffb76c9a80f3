//! What a side says of itself in the handshake.

use poolipc_driver::Driver;
use poolipc_transport::{Capabilities, Identity};

use crate::error::Error;

/// The handshake identity of a side using `device` through `driver`: the device's UUID (stable
/// across processes, unlike its ordinal), the driver version, and `capabilities`.
pub fn identity(
    driver: &dyn Driver,
    device: u32,
    capabilities: Capabilities,
) -> Result<Identity, Error> {
    let info = driver.device_info(device)?;
    Ok(Identity {
        device: info.uuid,
        driver_version: driver.driver_version()?,
        capabilities,
        devices: Vec::new(),
    })
}

/// How many of a worker's last stderr bytes are kept for the report of a worker that died
/// before its handshake.
const TAIL_BYTES: usize = 4096;

/// How many of those lines the report quotes.
const TAIL_LINES: usize = 20;

/// The worker's last words as [`poolipc_contract::worker_text`] shows them: marked as the
/// worker's, control characters replaced, bounded. The bound keeps the end (the last lines
/// say why it died), so the start is dropped first.
fn shown_tail(tail: &str) -> String {
    // Room for the marker and a few indents and replacement characters; a tail made mostly
    // of control characters loses its end to the bound instead, which is its writer's loss.
    let keep = poolipc_contract::text::MAX_SHOWN_LEN * 3 / 4;
    let mut start = tail.len().saturating_sub(keep);
    while !tail.is_char_boundary(start) {
        start += 1;
    }
    poolipc_contract::worker_text(&tail[start..])
}

/// A spawned worker's stderr, copied to ours as it comes, its last bytes kept: what a worker
/// that dies before its handshake said (an import error, a missing library) goes into the
/// parent's error instead of a bare "peer is gone".
#[derive(Debug)]
pub(crate) struct StderrTail {
    kept: std::sync::Arc<std::sync::Mutex<(Vec<u8>, bool)>>,
}

impl StderrTail {
    /// Starts the thread that copies `from` to this process's stderr until the worker closes
    /// it (it exits).
    pub(crate) fn start(mut from: std::process::ChildStderr) -> StderrTail {
        use std::io::{Read, Write};
        let kept = std::sync::Arc::new(std::sync::Mutex::new((Vec::new(), false)));
        let k = std::sync::Arc::clone(&kept);
        let spawned = std::thread::Builder::new()
            .name("poolipc-worker-stderr".into())
            .spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    let n = match from.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let _ = std::io::stderr().write_all(&buf[..n]);
                    let mut g = k.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    g.0.extend_from_slice(&buf[..n]);
                    let over = g.0.len().saturating_sub(TAIL_BYTES);
                    g.0.drain(..over);
                }
                k.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .1 = true;
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to copy the worker's stderr");
        }
        StderrTail { kept }
    }

    /// The last lines the worker wrote, waiting up to `wait` for it to close its stderr (a
    /// dead worker's last words may still be in the pipe).
    pub(crate) fn last_lines(&self, wait: std::time::Duration) -> String {
        let until = std::time::Instant::now() + wait;
        loop {
            let g = self
                .kept
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if g.1 || std::time::Instant::now() >= until {
                let text = String::from_utf8_lossy(&g.0);
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n");
                return shown_tail(&tail);
            }
            drop(g);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}
