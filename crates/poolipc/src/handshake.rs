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

/// The variable that says how a spawned worker's stderr reaches the parent's:
/// `marked` (the default: line by line, each line `[worker <pid>] ` and the line with its
/// control characters replaced, as [`poolipc_contract::worker_text`] does) or `raw` (the
/// bytes as they come, escape sequences and all: for a developer's own trusted worker).
pub(crate) const WORKER_STDERR_ENV: &str = "POOLIPC_WORKER_STDERR";

/// The longest line the marked copy holds back waiting for its end; a longer one goes out in
/// pieces of this size.
const MAX_MARKED_LINE: usize = 4096;

/// A worker's stderr, copied to the parent's a line at a time: each line marked as that
/// worker's and made safe to print, so that a worker cannot forge a line that reads as the
/// parent's own, move the cursor or clear the terminal. A carriage return starts the line
/// over (a progress bar shows its last state), except in `\r\n`.
struct MarkedLines {
    prefix: String,
    line: Vec<u8>,
    /// A carriage return came last: the line starts over at the next byte, unless that byte
    /// ends the line (`\r\n`).
    cr: bool,
}

impl MarkedLines {
    fn new(pid: u32) -> MarkedLines {
        MarkedLines {
            prefix: format!("[worker {pid}] "),
            line: Vec::new(),
            cr: false,
        }
    }

    /// What `bytes` complete, as the text to write (whole marked lines).
    fn take(&mut self, bytes: &[u8]) -> String {
        let mut out = String::new();
        for &b in bytes {
            if std::mem::take(&mut self.cr) && b != b'\n' {
                self.line.clear();
            }
            match b {
                b'\n' => self.flush_into(&mut out),
                b'\r' => self.cr = true,
                _ => {
                    self.line.push(b);
                    if self.line.len() >= MAX_MARKED_LINE {
                        self.flush_into(&mut out);
                    }
                }
            }
        }
        out
    }

    /// The line held back, if any, as the text to write (at the worker's end).
    fn finish(&mut self) -> String {
        let mut out = String::new();
        if !self.line.is_empty() {
            self.flush_into(&mut out);
        }
        out
    }

    fn flush_into(&mut self, out: &mut String) {
        out.push_str(&self.prefix);
        for c in String::from_utf8_lossy(&self.line).chars() {
            out.push(if poolipc_contract::text::is_unsafe_char(c) {
                '\u{FFFD}'
            } else {
                c
            });
        }
        out.push('\n');
        self.line.clear();
    }
}

/// A spawned worker's stderr, copied to ours as it comes (marked, unless
/// [`WORKER_STDERR_ENV`] says `raw`), its last bytes kept: what a worker that dies before its
/// handshake said (an import error, a missing library) goes into the parent's error instead
/// of a bare "peer is gone".
#[derive(Debug)]
pub(crate) struct StderrTail {
    kept: std::sync::Arc<std::sync::Mutex<(Vec<u8>, bool)>>,
}

impl StderrTail {
    /// Starts the thread that copies `from`, the stderr of the worker of process `pid`, to
    /// this process's stderr until the worker closes it (it exits).
    pub(crate) fn start(mut from: std::process::ChildStderr, pid: u32) -> StderrTail {
        use std::io::{Read, Write};
        let kept = std::sync::Arc::new(std::sync::Mutex::new((Vec::new(), false)));
        let k = std::sync::Arc::clone(&kept);
        let mut marked = match std::env::var(WORKER_STDERR_ENV).as_deref() {
            Ok("raw") => None,
            Ok("marked") | Err(_) => Some(MarkedLines::new(pid)),
            Ok(other) => {
                tracing::warn!(
                    "{WORKER_STDERR_ENV}={other:?} is neither \"marked\" nor \"raw\": the worker's stderr is marked"
                );
                Some(MarkedLines::new(pid))
            }
        };
        let spawned = std::thread::Builder::new()
            .name("poolipc-worker-stderr".into())
            .spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    let n = match from.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let _ = match marked.as_mut() {
                        Some(m) => std::io::stderr().write_all(m.take(&buf[..n]).as_bytes()),
                        None => std::io::stderr().write_all(&buf[..n]),
                    };
                    let mut g = k.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    g.0.extend_from_slice(&buf[..n]);
                    let over = g.0.len().saturating_sub(TAIL_BYTES);
                    g.0.drain(..over);
                }
                if let Some(m) = marked.as_mut() {
                    let _ = std::io::stderr().write_all(m.finish().as_bytes());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_stderr_lines_are_marked_and_made_safe_to_print() {
        let mut m = MarkedLines::new(42);
        // A forged log line (ending \r\n), a terminal clear, a progress bar redrawn with
        // carriage returns, a bidirectional override, a line split across reads and one left
        // open at the end.
        let out = m.take(b"INFO parent: all good\r\n\x1b[2Jcleared\n10%\r50%\r100%\r\nab");
        let out = out + &m.take("c\u{202e}d\nlast".as_bytes()) + &m.finish();
        assert_eq!(
            out,
            "[worker 42] INFO parent: all good\n\
             [worker 42] \u{FFFD}[2Jcleared\n\
             [worker 42] 100%\n\
             [worker 42] abc\u{FFFD}d\n\
             [worker 42] last\n"
        );
    }

    #[test]
    fn a_line_without_an_end_goes_out_in_bounded_pieces() {
        let mut m = MarkedLines::new(7);
        let out = m.take(&vec![b'x'; MAX_MARKED_LINE * 2 + 10]);
        assert_eq!(out.lines().count(), 2);
        assert!(
            out.lines()
                .all(|l| l.len() == "[worker 7] ".len() + MAX_MARKED_LINE)
        );
        assert_eq!(m.finish(), format!("[worker 7] {}\n", "x".repeat(10)));
    }
}
