//! The harness of poolipc's multi-process and hardware tests.
//!
//! One test body, two drivers: every body takes an [`Env`] and runs once on `SimDriver` (always)
//! and once on `CudaDriver` (when this machine has a usable GPU; otherwise the test prints
//! plainly that it did not run on hardware and why). See [`both_drivers!`].
//!
//! Second processes are real: [`spawn_child`] starts `poolipc-test-child` on a socketpair,
//! runs the real handshake (which sends the pool FD by SCM_RIGHTS) and then drives the child
//! through a small line protocol ([`ChildLink`]) so a test can say exactly what the other
//! process does and when.
#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use poolipc::advanced::driver::sim::{SimConfig, SimDriver};
use poolipc::advanced::driver::{CudaDriver, Driver, DriverKind};
use poolipc::advanced::transport::{
    Capabilities, Connection, DeviceUuid, ExtraPool, HandshakeConfig, Identity, Message,
};

pub mod chaos;
pub mod child;
pub mod echo;
pub mod echo_jobs;

/// Which driver a test body runs on.
#[derive(Clone)]
pub struct Env {
    /// The driver, as the trait.
    pub driver: Arc<dyn Driver>,
    /// The simulation, when that is the driver (to read violations back).
    pub sim: Option<Arc<SimDriver>>,
    /// The device the test uses.
    pub device: u32,
}

impl std::fmt::Debug for Env {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Env({})", self.driver.kind())
    }
}

impl Env {
    /// The simulated driver, with memory enough for the 4 GiB tests (sparse, so free).
    pub fn sim() -> Result<Env> {
        Env::sim_with(SimConfig::default())
    }

    /// A simulated machine configured as given (an MPS server, more devices, ...).
    pub fn sim_with(config: SimConfig) -> Result<Env> {
        let sim = Arc::new(SimDriver::new(config).context("SimDriver::new")?);
        sim.use_device(0)?;
        Ok(Env {
            driver: sim.clone(),
            sim: Some(sim),
            device: 0,
        })
    }

    /// The real driver, or why this machine cannot run hardware tests.
    pub fn cuda() -> std::result::Result<Env, String> {
        let d = CudaDriver::new().map_err(|e| e.to_string())?;
        d.use_device(0).map_err(|e| e.to_string())?;
        Ok(Env {
            driver: Arc::new(d),
            sim: None,
            device: 0,
        })
    }

    /// Which driver.
    pub fn kind(&self) -> DriverKind {
        self.driver.kind()
    }

    /// Fails when the simulation recorded any contract violation.
    pub fn assert_no_violations(&self) {
        if let Some(sim) = &self.sim {
            let v = sim.violations();
            assert!(
                v.is_empty(),
                "the simulated driver recorded violations: {v:#?}"
            );
        }
    }

    /// The handshake identity of this side.
    pub fn identity(&self) -> Result<Identity> {
        let caps = Capabilities::POOL_POINTER | Capabilities::IPC_EVENTS;
        Ok(poolipc::advanced::identity(
            &*self.driver,
            self.device,
            caps,
        )?)
    }
}

/// Runs `body` on `SimDriver`, and on `CudaDriver` when the machine has a GPU.
///
/// ```text
/// both_drivers!(fn a_child_reads_the_parents_pattern(env) { ... });
/// ```
#[macro_export]
macro_rules! both_drivers {
    ($(#[$m:meta])* fn $name:ident($env:ident) $body:block) => {
        $(#[$m])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body($env: &$crate::Env) -> ::anyhow::Result<()> $body

            #[test]
            fn on_sim_driver() {
                $crate::init_tracing();
                let env = $crate::Env::sim().expect("SimDriver");
                body(&env).expect(concat!(stringify!($name), " on SimDriver"));
                env.assert_no_violations();
            }

            #[test]
            fn on_cuda_driver() {
                $crate::init_tracing();
                match $crate::Env::cuda() {
                    Ok(env) => {
                        body(&env).expect(concat!(stringify!($name), " on CudaDriver"));
                        println!("RAN on CudaDriver: {}", stringify!($name));
                    }
                    Err(why) => println!(
                        "NOT RUN on hardware: {} (no usable GPU: {why})",
                        stringify!($name)
                    ),
                }
            }
        }
    };
}

/// Installs a tracing subscriber once (RUST_LOG decides; warnings by default).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// Where the child binary is: `POOLIPC_TEST_CHILD`, else beside the test binary (a bundle),
/// else one directory up (cargo's `target/<profile>/deps/..`).
pub fn child_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("POOLIPC_TEST_CHILD") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow!("test binary has no directory"))?;
    for candidate in [
        dir.join("poolipc-test-child"),
        dir.join("../poolipc-test-child"),
    ] {
        if candidate.exists() {
            return Ok(candidate);
        }
    }
    bail!(
        "poolipc-test-child not found beside {} or one level up; build it (cargo build -p \
         poolipc-tests --bins) or set POOLIPC_TEST_CHILD",
        exe.display()
    )
}

/// Where a binary of this package is: `var` if set, else beside the test binary, else one
/// directory up.
pub fn sibling_binary(name: &str, var: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow!("test binary has no directory"))?;
    for candidate in [dir.join(name), dir.join("..").join(name)] {
        if candidate.exists() {
            return Ok(candidate);
        }
    }
    bail!(
        "{name} not found beside {} or one level up; set {var}",
        exe.display()
    )
}

/// A command starting the facade test worker ([`echo`]), attached to `env`'s driver.
pub fn worker_command(env: &Env, die_at: Option<&str>) -> Result<Command> {
    let mut cmd = attached_command(env, "poolipc-test-worker", "POOLIPC_TEST_WORKER")?;
    if let Some(step) = die_at {
        cmd.env(poolipc::FAILPOINT_ENV, step);
    }
    Ok(cmd)
}

/// A fresh directory under the system's temporary directory, `poolipc-<what>-<pid>-<n>`
/// (`n` counts this process's calls): emptied if a run before left one there.
pub fn tempdir(what: &str) -> Result<PathBuf> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("poolipc-{what}-{}-{n}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A command starting the rogue test worker, which breaks the protocol in `mode` (see
/// `src/bin/poolipc-test-rogue.rs`).
pub fn rogue_command(env: &Env, mode: &str) -> Result<Command> {
    let mut cmd = attached_command(env, "poolipc-test-rogue", "POOLIPC_TEST_ROGUE_BIN")?;
    cmd.env("POOLIPC_TEST_ROGUE", mode);
    Ok(cmd)
}

/// A command starting this package's binary `name` (found as [`sibling_binary`] does),
/// attached to `env`'s driver: the simulated machine's variables where `env` is simulated.
fn attached_command(env: &Env, name: &str, var: &str) -> Result<Command> {
    let mut cmd = Command::new(sibling_binary(name, var)?);
    if let Some(sim) = &env.sim {
        let (k, v) = sim.child_env();
        cmd.env(k, v);
    }
    Ok(cmd)
}

/// A live child process and the line protocol to drive it.
#[derive(Debug)]
pub struct Child {
    process: std::process::Child,
    link: ChildLink,
}

/// The test-only line protocol to a child: one command line out, one answer line back.
#[derive(Debug)]
pub struct ChildLink {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl ChildLink {
    /// Wraps a connected stream.
    pub fn new(stream: UnixStream, timeout: Duration) -> Result<ChildLink> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(ChildLink {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        })
    }

    /// Sends a line.
    pub fn send(&mut self, line: &str) -> Result<()> {
        self.writer.write_all(line.as_bytes())?;
        self.writer.write_all(b"\n")?;
        Ok(())
    }

    /// Reads a line; EOF is an error.
    pub fn recv(&mut self) -> Result<String> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            bail!("the other process closed the connection");
        }
        Ok(line.trim_end().to_owned())
    }
}

/// Spawns `poolipc-test-child`, shakes hands (the pool FD travels by SCM_RIGHTS) and returns
/// it ready for commands.
pub fn spawn_child(env: &Env, pool_fd: BorrowedFd<'_>) -> Result<Child> {
    let mut cmd = Command::new(child_binary()?);
    if let Some(sim) = &env.sim {
        let (k, v) = sim.child_env();
        cmd.env(k, v);
    }
    cmd.env("POOLIPC_TEST_DEVICE", env.device.to_string());
    let (process, mut conn) = poolipc::advanced::transport::spawn_worker(cmd)?;
    let config = HandshakeConfig {
        identity: env.identity()?,
        required: Capabilities::NONE,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    poolipc::advanced::transport::parent_handshake(&mut conn, &config, pool_fd, deadline)?;
    let (sock, unread) = conn.into_parts();
    // The child answers only commands: nothing can have come past the handshake.
    ensure!(
        unread.is_empty(),
        "the child sent {} bytes past its handshake",
        unread.len()
    );
    let link = ChildLink::new(UnixStream::from(sock), Duration::from_secs(120))?;
    Ok(Child { process, link })
}

impl Child {
    /// Sends a command and returns the answer's words after `ok`; an `err` answer is an error.
    pub fn call(&mut self, command: &str) -> Result<Vec<String>> {
        self.link.send(command)?;
        self.answer(command)
    }

    fn answer(&mut self, command: &str) -> Result<Vec<String>> {
        let answer = self
            .link
            .recv()
            .with_context(|| format!("answer to {command:?}"))?;
        let mut words = answer.split_whitespace().map(str::to_owned);
        match words.next().as_deref() {
            Some("ok") => Ok(words.collect()),
            _ => bail!("child answered {answer:?} to {command:?}"),
        }
    }

    /// Sends a command that takes a file descriptor (`arena_map`): the command line; then,
    /// once the child answered `ready-fd`, `fd` by SCM_RIGHTS in a one-FD transport frame
    /// (an `ExtraPool` frame serves as the carrier: the line protocol has no FD frame of its
    /// own); then the answer, as [`call`](Child::call) reads it.
    pub fn call_with_fd(&mut self, command: &str, fd: BorrowedFd<'_>) -> Result<Vec<String>> {
        self.link.send(command)?;
        let ready = self
            .link
            .recv()
            .with_context(|| format!("readiness for {command:?}"))?;
        if ready != "ready-fd" {
            bail!("child answered {ready:?} to {command:?} instead of ready-fd");
        }
        let mut conn = Connection::new(OwnedFd::from(self.link.writer.try_clone()?));
        let carrier = Message::ExtraPool(ExtraPool {
            index: 1,
            device: DeviceUuid([0; 16]),
        });
        conn.send(&carrier, &[fd], Instant::now() + Duration::from_secs(60))?;
        self.answer(command)
    }

    /// Sends a command whose answer must be an error, returning its text.
    pub fn call_err(&mut self, command: &str) -> Result<String> {
        self.link.send(command)?;
        let answer = self.link.recv()?;
        match answer.strip_prefix("err ") {
            Some(e) => Ok(e.to_owned()),
            None => bail!("expected an error for {command:?}, got {answer:?}"),
        }
    }

    /// Asks the child to exit and waits for it.
    pub fn finish(mut self) -> Result<ExitStatus> {
        self.link.send("exit")?;
        Ok(self.process.wait()?)
    }

    /// Sends a command after which the child is expected to die; returns how it ended.
    pub fn call_expecting_death(mut self, command: &str) -> Result<ExitStatus> {
        self.link.send(command)?;
        let _ = self.link.recv();
        Ok(self.process.wait()?)
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.process.id()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Ok(None) = self.process.try_wait() {
            let _ = self.process.kill();
            let _ = self.process.wait();
        }
    }
}

/// How many descriptors this process has open.
pub fn open_fds() -> Result<usize> {
    Ok(std::fs::read_dir("/proc/self/fd")?.count())
}

/// This process's open descriptors, each with what it refers to (the `readlink` of its
/// `/proc/self/fd` entry), so that a check finding more open than before can say which.
pub fn fd_targets() -> Result<std::collections::BTreeMap<i32, String>> {
    let mut out = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let entry = entry?;
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        // The directory's own descriptor is gone by the time it is read: say so.
        let target = std::fs::read_link(entry.path())
            .map(|t| t.display().to_string())
            .unwrap_or_else(|e| format!("({e})"));
        out.insert(fd, target);
    }
    Ok(out)
}

/// The descriptors of `now` that `before` did not have (or had for something else), as
/// `fd -> target` text: what a check that found more descriptors open prints.
pub fn fds_added(
    before: &std::collections::BTreeMap<i32, String>,
    now: &std::collections::BTreeMap<i32, String>,
) -> String {
    let added: Vec<String> = now
        .iter()
        .filter(|(fd, t)| before.get(fd) != Some(t))
        .map(|(fd, t)| format!("{fd} -> {t}"))
        .collect();
    if added.is_empty() {
        "none listed".to_owned()
    } else {
        added.join(", ")
    }
}

/// A `kB` field of `/proc/self/status` (`VmRSS`, `RssAnon`, ...), in KiB.
pub fn proc_status_kib(field: &str) -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .with_context(|| format!("no {field} in /proc/self/status"))?;
    Ok(line.trim().trim_end_matches("kB").trim().parse()?)
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Parses [`hex`] back into exactly `N` bytes.
pub fn unhex<const N: usize>(s: &str) -> Result<[u8; N]> {
    if s.len() != 2 * N {
        bail!("expected {} hex digits, got {}", 2 * N, s.len());
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).context("bad hex")?;
    }
    Ok(out)
}

/// Parses a number the child sent.
pub fn num(words: &[String], i: usize) -> Result<u64> {
    let w = words
        .get(i)
        .ok_or_else(|| anyhow!("answer has no word {i}: {words:?}"))?;
    let parsed = match w.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => w.parse(),
    };
    parsed.with_context(|| format!("not a number: {w}"))
}
