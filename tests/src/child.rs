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
//! - `arena_map <chunk> <len>`: maps a chunk of the parent's result arena. The child answers
//!   `ready-fd`, then takes the chunk's FD from the next transport frame (see
//!   [`Child::call_with_fd`](crate::Child::call_with_fd)), imports and maps it
//!   (`ArenaMapping::map_chunk`); answers the local base address and the microseconds.
//! - `arena_resolve <chunk> <offset> <len>`: `ArenaMapping::resolve`; answers the address.
//! - `arena_fill <chunk> <offset> <len> <u32-hex>`: resolves the range, `cuMemsetD32Async` of
//!   all of it on the child's stream, then synchronizes; answers the address.
//! - `arena_check <chunk> <offset> <len> <u32-hex>`: resolves the range, synchronizes, copies
//!   it to the host and checks every word; answers the number of bad words and the first bad
//!   offset.
//! - `arena_unmap <chunk>`: `ArenaMapping::unmap_chunk`.
//! - `exit`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read as _, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use poolipc::advanced::driver::{
    DevicePtr, Driver, EventBlob, EventHandle, ExportBlob, ImportedPointer, OwnedEvent,
    OwnedStream, StreamHandle,
};
use poolipc::advanced::pool::{ArenaMapping, AttachedPool};
use poolipc::advanced::transport::{Capabilities, Connection, HandshakeConfig, Message};

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
    driver: Arc<dyn Driver>,
    pool: AttachedPool,
    stream: StreamHandle,
    event: Option<(EventHandle, EventBlob)>,
    /// Imports made by `import`, by address, until `free` frees them (two imports of one
    /// export share an address: `free` frees the latest).
    imports: HashMap<u64, Vec<ImportedPointer>>,
    /// Events opened by `open`, by the handle answered, which `wait` and `query` name.
    opened: HashMap<u64, OwnedEvent>,
    arena: ArenaMapping<dyn Driver>,
    /// The command socket again, as a transport connection: FDs arrive on it in frames.
    fds: Connection,
}

impl Worker {
    /// Says `ready-fd` on `writer` and takes the one FD of the next frame (a one-FD frame
    /// kind serves as the carrier; its fields are ignored).
    fn receive_fd(&mut self, writer: &mut UnixStream) -> Result<OwnedFd> {
        writer.write_all(b"ready-fd\n")?;
        let (msg, mut fds) = self.fds.recv(Instant::now() + Duration::from_secs(60))?;
        if !matches!(msg, Message::ExtraPool(_)) || fds.len() != 1 {
            bail!(
                "expected one FD in an ExtraPool frame, got {:?}",
                msg.kind()
            );
        }
        fds.pop().ok_or_else(|| anyhow!("no FD"))
    }

    /// The import at the address `word` names, taken out of the table (to be freed).
    fn import(&mut self, word: Option<&str>) -> Result<ImportedPointer> {
        let ptr = parse(word)?;
        self.imports
            .get_mut(&ptr)
            .and_then(Vec::pop)
            .ok_or_else(|| anyhow!("{ptr:#x} is not a live import of this child"))
    }

    /// The event `open` answered `word` for.
    fn opened(&self, word: Option<&str>) -> Result<EventHandle> {
        let raw = parse(word)?;
        self.opened
            .get(&raw)
            .map(OwnedEvent::handle)
            .ok_or_else(|| anyhow!("{raw:#x} is not an event this child opened"))
    }

    /// `(chunk, offset, len)` from the command's words, resolved in the arena mapping.
    fn arena_range<'a>(&self, w: &mut impl Iterator<Item = &'a str>) -> Result<(DevicePtr, u64)> {
        let chunk = u32::try_from(parse(w.next())?)?;
        let offset = parse(w.next())?;
        let len = parse(w.next())?;
        Ok((self.arena.resolve(chunk, offset, len)?, len))
    }

    fn handle(&mut self, line: &str, writer: &mut UnixStream) -> Result<String> {
        let mut w = line.split_whitespace();
        let cmd = w.next().unwrap_or("");
        if cmd == "arena_map" {
            let chunk = u32::try_from(parse(w.next())?)?;
            let len = parse(w.next())?;
            let fd = self.receive_fd(writer)?;
            let t = Instant::now();
            let base = self.arena.map_chunk(chunk, len, fd.as_fd())?;
            let micros = t.elapsed().as_secs_f64() * 1e6;
            return Ok(format!("{:#x} {micros:.1}", base.0));
        }
        let d = &*self.driver;
        match cmd {
            "arena_resolve" => Ok(format!("{:#x}", self.arena_range(&mut w)?.0.0)),
            "arena_fill" => {
                let (ptr, len) = self.arena_range(&mut w)?;
                let pattern = u32::from_str_radix(w.next().unwrap_or(""), 16)?;
                if len % 4 != 0 {
                    bail!("arena_fill needs whole 32-bit words, not {len} bytes");
                }
                d.memset_d32_async(ptr, pattern, len / 4, self.stream)?;
                d.stream_synchronize(self.stream)?;
                Ok(format!("{:#x}", ptr.0))
            }
            "arena_check" => {
                let (ptr, len) = self.arena_range(&mut w)?;
                let pattern = u32::from_str_radix(w.next().unwrap_or(""), 16)?;
                d.stream_synchronize(self.stream)?;
                let mut buf = vec![0u8; usize::try_from(len)?];
                d.memcpy_dtoh(&mut buf, ptr)?;
                let (bad, first) = count_bad(&buf, pattern);
                Ok(format!("{bad} {first}"))
            }
            "arena_unmap" => {
                self.arena.unmap_chunk(u32::try_from(parse(w.next())?)?)?;
                Ok(String::new())
            }
            "import" => {
                let data = ExportBlob(unhex::<64>(w.next().unwrap_or(""))?);
                let t = Instant::now();
                let import = ImportedPointer::import(
                    Arc::clone(&self.driver),
                    self.pool.pool.handle(),
                    &data,
                )?;
                let micros = t.elapsed().as_secs_f64() * 1e6;
                let ptr = import.ptr();
                self.imports.entry(ptr.0).or_default().push(import);
                Ok(format!("{:#x} {micros:.1}", ptr.0))
            }
            "free" => {
                self.import(w.next())?.free(self.stream)?;
                self.driver.stream_synchronize(self.stream)?;
                Ok(String::new())
            }
            "free_nosync" => {
                self.import(w.next())?.free(self.stream)?;
                Ok(String::new())
            }
            "open" => {
                let h = EventBlob(unhex::<64>(w.next().unwrap_or(""))?);
                let event = OwnedEvent::open_ipc(Arc::clone(&self.driver), &h)?;
                let raw = event.handle().as_raw();
                self.opened.insert(raw, event);
                Ok(format!("{raw:#x}"))
            }
            "wait" => {
                d.stream_wait_event(self.stream, self.opened(w.next())?)?;
                Ok(String::new())
            }
            "query" => Ok(u8::from(d.event_query(self.opened(w.next())?)?).to_string()),
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
                        let ev = OwnedEvent::new(d, true)?.into_raw();
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
                    self.pool.pool.handle(),
                    poolipc::advanced::driver::PoolAttribute::ReleaseThreshold(u64::MAX),
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
    let driver: Arc<dyn Driver> = match poolipc::advanced::driver::sim::SimDriver::from_env() {
        Some(sim) => Arc::new(sim.context("attaching to the parent's simulated machine")?),
        None => Arc::new(poolipc::advanced::driver::CudaDriver::new()?),
    };
    driver.use_device(device)?;
    let caps = Capabilities::POOL_POINTER | Capabilities::IPC_EVENTS;
    let identity = poolipc::advanced::identity(&*driver, device, caps)?;
    let mut conn = poolipc::advanced::transport::connection_from_env()?;
    let config = HandshakeConfig {
        identity,
        required: Capabilities::NONE,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let (_peer, pool_fd) =
        poolipc::advanced::transport::worker_handshake(&mut conn, &config, deadline)?;
    let pool = AttachedPool::attach(Arc::clone(&driver), pool_fd.as_fd(), device)?;
    let owned_stream = OwnedStream::new(driver.clone())?;
    let stream = owned_stream.handle();
    // What the handshake read past its last frame (the parent's first command may have
    // come with it) is read before the socket.
    let (sock, unread) = conn.into_parts();
    let sock = UnixStream::from(sock);
    let fds = Connection::new(OwnedFd::from(sock.try_clone()?));
    let mut worker = Worker {
        arena: ArenaMapping::new(Arc::clone(&driver), device),
        driver,
        pool,
        stream,
        event: None,
        imports: HashMap::new(),
        opened: HashMap::new(),
        fds,
    };

    let mut reader = BufReader::new(std::io::Cursor::new(unread).chain(sock.try_clone()?));
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
        let answer = match worker.handle(cmd, &mut writer) {
            Ok(s) if s.is_empty() => "ok\n".to_owned(),
            Ok(s) => format!("ok {s}\n"),
            Err(e) => format!("err {}\n", format!("{e:#}").replace('\n', " ")),
        };
        writer.write_all(answer.as_bytes())?;
    }
}
