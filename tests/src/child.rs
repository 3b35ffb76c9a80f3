//! The child side of the test line protocol: a worker that does exactly what the test says.
//!
//! Commands (one per line; answers `ok ...` or `err <message>`):
//! - `import <export-hex>`: `cuMemPoolImportPointer`; answers the address and the microseconds.
//! - `free <ptr>`: frees the import (stream-ordered) and synchronizes.
//! - `free_nosync <ptr>`: frees the import (stream-ordered) without synchronizing.
//! - `open <event-hex>`: `cuIpcOpenEventHandle`; answers the local handle.
//! - `wait <event>`: `cuStreamWaitEvent` on the child's stream.
//! - `query <event>`: `cuEventQuery`; answers 1 or 0.
//! - `check <ptr> <offset> <bytes> <u32-hex>`: synchronizes, copies the range to the host and
//!   checks every word; answers the number of bad words and the first bad offset.
//! - `fill <ptr> <offset> <words> <u32-hex>`: `cuMemsetD32Async` on the child's stream.
//! - `record`: records the child's interprocess event on its stream; answers its handle.
//! - `pool`: what attaching the pool found (release threshold before, raised or not).
//! - `set_threshold`: `cuMemPoolSetAttribute` of the release threshold on the imported pool.
//! - `sync`: synchronizes the child's stream.
//! - `exit`.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use poolipc_driver::{DevicePtr, Driver, EventBlob, EventHandle, ExportBlob, StreamHandle};
use poolipc_pool::AttachedPool;
use poolipc_transport::{Capabilities, HandshakeConfig};

use crate::{hex, unhex};

fn parse(word: Option<&str>) -> Result<u64> {
    let w = word.ok_or_else(|| anyhow!("missing argument"))?;
    Ok(match w.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16)?,
        None => w.parse()?,
    })
}

/// The child's state.
struct Worker {
    driver: Box<dyn Driver>,
    pool: AttachedPool,
    stream: StreamHandle,
    event: Option<(EventHandle, EventBlob)>,
}

impl Worker {
    fn handle(&mut self, line: &str) -> Result<String> {
        let mut w = line.split_whitespace();
        let cmd = w.next().unwrap_or("");
        let d = &*self.driver;
        match cmd {
            "import" => {
                let data = ExportBlob(unhex::<64>(w.next().unwrap_or(""))?);
                let t = Instant::now();
                let ptr = d.mem_pool_import_pointer(self.pool.pool, &data)?;
                let micros = t.elapsed().as_secs_f64() * 1e6;
                Ok(format!("{:#x} {micros:.1}", ptr.0))
            }
            "free" => {
                let ptr = DevicePtr(parse(w.next())?);
                d.mem_pool_free_import(ptr, self.stream)?;
                d.stream_synchronize(self.stream)?;
                Ok(String::new())
            }
            "free_nosync" => {
                d.mem_pool_free_import(DevicePtr(parse(w.next())?), self.stream)?;
                Ok(String::new())
            }
            "open" => {
                let h = EventBlob(unhex::<64>(w.next().unwrap_or(""))?);
                Ok(format!("{:#x}", d.ipc_open_event_handle(&h)?.0))
            }
            "wait" => {
                d.stream_wait_event(self.stream, EventHandle(parse(w.next())?))?;
                Ok(String::new())
            }
            "query" => Ok(u8::from(d.event_query(EventHandle(parse(w.next())?))?).to_string()),
            "check" => {
                let ptr = DevicePtr(parse(w.next())?);
                let offset = parse(w.next())?;
                let bytes = usize::try_from(parse(w.next())?)?;
                let pattern = u32::from_str_radix(w.next().unwrap_or(""), 16)?;
                d.stream_synchronize(self.stream)?;
                let mut buf = vec![0u8; bytes];
                d.memcpy_dtoh(&mut buf, ptr.offset(offset))?;
                let (bad, first) = count_bad(&buf, pattern);
                Ok(format!("{bad} {first}"))
            }
            "fill" => {
                let ptr = DevicePtr(parse(w.next())?);
                let offset = parse(w.next())?;
                let words = parse(w.next())?;
                let pattern = u32::from_str_radix(w.next().unwrap_or(""), 16)?;
                d.memset_d32_async(ptr.offset(offset), pattern, words, self.stream)?;
                Ok(String::new())
            }
            "record" => {
                let (ev, h) = match self.event {
                    Some(e) => e,
                    None => {
                        let ev = d.event_create(true)?;
                        let h = d.ipc_get_event_handle(ev)?;
                        self.event = Some((ev, h));
                        (ev, h)
                    }
                };
                d.event_record(ev, self.stream)?;
                Ok(hex(&h.0))
            }
            "pool" => Ok(format!(
                "threshold_before={:?} keeps_mappings={} access_before={:?}",
                self.pool.initial_release_threshold,
                self.pool.keeps_mappings,
                self.pool.initial_access
            )),
            "set_threshold" => {
                d.mem_pool_set_attribute(
                    self.pool.pool,
                    poolipc_driver::PoolAttribute::ReleaseThreshold(u64::MAX),
                )?;
                Ok(String::new())
            }
            "sync" => {
                d.stream_synchronize(self.stream)?;
                Ok(String::new())
            }
            other => bail!("unknown command {other:?}"),
        }
    }
}

/// Counts the 32-bit words of `buf` that differ from `pattern`, and the first one's offset.
pub fn count_bad(buf: &[u8], pattern: u32) -> (usize, i64) {
    let want = pattern.to_le_bytes();
    let mut bad = 0;
    let mut first = -1i64;
    for (i, word) in buf.chunks_exact(4).enumerate() {
        if word != want {
            if first < 0 {
                first = (i * 4) as i64;
            }
            bad += 1;
        }
    }
    (bad, first)
}

/// The child's `main`: open the driver the parent chose, shake hands, attach the pool, serve.
pub fn main() -> Result<()> {
    crate::init_tracing();
    let device: u32 = std::env::var("POOLIPC_TEST_DEVICE")
        .unwrap_or_else(|_| "0".into())
        .parse()
        .context("POOLIPC_TEST_DEVICE")?;
    let driver: Box<dyn Driver> = match poolipc_driver::sim::SimDriver::from_env() {
        Some(sim) => Box::new(sim.context("attaching to the parent's simulated machine")?),
        None => Box::new(poolipc_driver::CudaDriver::new()?),
    };
    driver.use_device(device)?;
    let caps = Capabilities::POOL_POINTER | Capabilities::IPC_EVENTS;
    let identity = poolipc::identity(&*driver, device, caps)?;
    let mut conn = poolipc_transport::connection_from_env()?;
    let config = HandshakeConfig {
        identity,
        required: Capabilities::NONE,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let (_peer, pool_fd) = poolipc_transport::worker_handshake(&mut conn, &config, deadline)?;
    let pool = AttachedPool::attach(&*driver, pool_fd.as_fd(), device)?;
    let stream = driver.stream_create()?;
    let mut worker = Worker {
        driver,
        pool,
        stream,
        event: None,
    };

    let sock = UnixStream::from(conn.into_fd());
    let mut reader = BufReader::new(sock.try_clone()?);
    let mut writer = sock;
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(()); // the parent went away
        }
        let cmd = line.trim();
        if cmd == "exit" {
            return Ok(());
        }
        let answer = match worker.handle(cmd) {
            Ok(s) if s.is_empty() => "ok\n".to_owned(),
            Ok(s) => format!("ok {s}\n"),
            Err(e) => format!("err {}\n", format!("{e:#}").replace('\n', " ")),
        };
        writer.write_all(answer.as_bytes())?;
    }
}
