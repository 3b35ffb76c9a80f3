//! CUDA MPS for trusted workers: a private control daemon for one parent's process tree.
//!
//! Without MPS, every handoff pays two processes taking turns on the GPU (about 260 µs of a
//! 330 µs round trip on the H200). Under an MPS server the processes share one GPU context
//! and the round trip falls to about 40 µs. The price: **a GPU fault in any client (a
//! worker's kernel writing through a bad pointer) ends every client's context**, the
//! parent's included; measured on the H200 (driver 580), and NVIDIA documents the same for
//! Volta and later MPS. Process isolation no longer contains a faulty worker's GPU code.
//! So MPS is an opt-in, only for workers you trust, and [`PrivateMps::start`] refuses
//! unless the caller says it accepts that ([`MpsOptions::accept_shared_gpu_faults`]).
//!
//! What it does: starts `nvidia-cuda-mps-control -d` with private pipe and log directories
//! (mode 0700, under the temporary directory, never the system-wide `/tmp/nvidia-mps`),
//! starts the server for this user, and leaves a watchdog (`sh`) that tells the daemon to
//! quit once this handle is dropped or this process exits, however it exits; the daemon
//! then stops when its last client is gone. It changes no system setting (no compute-mode
//! change, no `nvidia-smi`). It refuses where MPS is not installed, where CUDA is already
//! initialised in this process (the process would stay outside the server), and where
//! another MPS daemon is already reachable.
//!
//! Workers join by inheriting `CUDA_MPS_PIPE_DIRECTORY` (after
//! [`PrivateMps::connect_this_process`], every child does; or pass [`PrivateMps::env`] to
//! a `Command`). A worker that is not a client still works with an MPS parent: pool IPC
//! and interprocess events cross the boundary, but that handoff pays the turn-taking again.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use poolipc_driver::mps_env::{self, LOG_DIRECTORY_ENV, PIPE_DIRECTORY_ENV};

/// The MPS control program, looked up on `PATH`.
pub(crate) const CONTROL_BINARY: &str = "nvidia-cuda-mps-control";
/// Where a system-wide MPS daemon listens when `CUDA_MPS_PIPE_DIRECTORY` is not set.
pub(crate) const DEFAULT_PIPE_DIRECTORY: &str = "/tmp/nvidia-mps";
/// Overrides the control program's path (tests use a stand-in).
pub const CONTROL_ENV: &str = "POOLIPC_MPS_CONTROL";

/// What this machine says about MPS, read without touching CUDA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpsProbe {
    /// The control program, if installed ([`CONTROL_ENV`] or `PATH`).
    pub control_binary: Option<PathBuf>,
    /// Where a client of this process would look for a daemon.
    pub pipe_directory: PathBuf,
    /// Whether that came from `CUDA_MPS_PIPE_DIRECTORY` (else the default).
    pub pipe_directory_from_env: bool,
    /// Whether a daemon's control pipe is there: CUDA initialised from now on in this
    /// process would become its client.
    pub daemon_reachable: bool,
}

impl MpsProbe {
    /// Looks at this process's environment and the file system.
    #[must_use]
    pub fn detect() -> MpsProbe {
        let from_env = std::env::var_os(PIPE_DIRECTORY_ENV).filter(|v| !v.is_empty());
        let pipe_directory = from_env
            .clone()
            .map_or_else(|| PathBuf::from(DEFAULT_PIPE_DIRECTORY), PathBuf::from);
        MpsProbe {
            control_binary: control_binary(None),
            daemon_reachable: pipe_directory.join("control").exists(),
            pipe_directory,
            pipe_directory_from_env: from_env.is_some(),
        }
    }
}

/// How to start a private MPS daemon.
#[derive(Clone, Debug)]
pub struct MpsOptions {
    /// Says that you accept what MPS costs: **a GPU fault in any worker ends the CUDA
    /// context of every client, this process included** (all later CUDA calls fail; the
    /// process must restart). Start refuses while this is false. Set it only for workers
    /// whose GPU code you trust.
    pub accept_shared_gpu_faults: bool,
    /// The control program; default [`CONTROL_ENV`], else `nvidia-cuda-mps-control` on
    /// `PATH`.
    pub control_binary: Option<PathBuf>,
    /// Where the private directories go; default the temporary directory.
    pub root: Option<PathBuf>,
    /// Where a system-wide daemon would listen (checked so as never to start a second).
    pub system_pipe_directory: PathBuf,
    /// How long the daemon and its server may take to come up.
    pub ready_timeout: Duration,
}

impl Default for MpsOptions {
    /// Not accepted (so start refuses until you set it), the control program from `PATH`,
    /// the temporary directory, `/tmp/nvidia-mps`, ten seconds.
    fn default() -> MpsOptions {
        MpsOptions {
            accept_shared_gpu_faults: false,
            control_binary: None,
            root: None,
            system_pipe_directory: PathBuf::from(DEFAULT_PIPE_DIRECTORY),
            ready_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a private MPS daemon was not started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MpsError {
    /// The caller did not accept what MPS costs.
    #[error(
        "MPS not started: under MPS a GPU fault in any worker (a kernel writing through a bad pointer) ends the CUDA context of every client, this process included, so process isolation no longer protects you from a worker's GPU code; set accept_shared_gpu_faults (Python: start_mps(accept_shared_gpu_faults=True), CLI: --accept-shared-gpu-faults) only for workers you trust"
    )]
    NotAcknowledged,
    /// The control program is not installed.
    #[error(
        "MPS is not available here: {binary} was not found (it comes with the NVIDIA driver's utilities; set {CONTROL_ENV} to its path if it is elsewhere)"
    )]
    NotInstalled {
        /// What was looked for.
        binary: String,
    },
    /// CUDA is already initialised in this process, which would stay outside the server.
    #[error(
        "MPS not started: CUDA is already initialised in this process, which would stay outside the MPS server; start MPS first thing, before anything touches the GPU (before CudaDriver::new, before a framework initialises CUDA)"
    )]
    TooLate,
    /// Another MPS daemon is reachable: this process's CUDA would already use it.
    #[error(
        "MPS not started: another MPS control daemon is reachable at {} (CUDA here would already be its client); poolipc starts only a private daemon and never a second one beside another", pipe_directory.display()
    )]
    AnotherDaemon {
        /// Its pipe directory.
        pipe_directory: PathBuf,
    },
    /// The daemon or its server did not come up.
    #[error("the MPS control daemon did not start: {detail}")]
    DaemonFailed {
        /// What it said (the end of its log), or what timed out.
        detail: String,
    },
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> MpsError {
    let what = what.into();
    move |source| MpsError::Io { what, source }
}

/// The control program: `explicit`, else [`CONTROL_ENV`], else the first on `PATH`.
fn control_binary(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return p.is_file().then(|| p.to_path_buf());
    }
    if let Some(p) = std::env::var_os(CONTROL_ENV).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(CONTROL_BINARY))
        .find(|p| p.is_file())
}

/// Runs the watchdog: waits for EOF on its stdin (this handle dropped, or this process
/// gone), tells the daemon to quit (it stops once its last client leaves), waits for the
/// control pipe to go, and removes the private directories.
const WATCHDOG: &str = r#"cat >/dev/null
echo quit | "$1"
i=0
while [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done
rm -rf "$2"
"#;

/// A private MPS control daemon for this parent's process tree; see the [module docs](self).
///
/// Dropping it lets the daemon go: it quits once its last client (this process included,
/// if it connected) has exited.
#[derive(Debug)]
pub struct PrivateMps {
    root: PathBuf,
    pipe_directory: PathBuf,
    log_directory: PathBuf,
    /// The watchdog's stdin; closing it (drop, or process exit) starts the shutdown.
    watchdog_stdin: Option<io::PipeWriter>,
    watchdog: Option<Child>,
}

impl PrivateMps {
    /// Starts the daemon and its server, or says why not (see [`MpsError`]).
    pub fn start(options: &MpsOptions) -> Result<PrivateMps, MpsError> {
        if !options.accept_shared_gpu_faults {
            return Err(MpsError::NotAcknowledged);
        }
        let control = control_binary(options.control_binary.as_deref()).ok_or_else(|| {
            MpsError::NotInstalled {
                binary: options.control_binary.as_ref().map_or_else(
                    || format!("{CONTROL_BINARY} (on PATH)"),
                    |p| p.display().to_string(),
                ),
            }
        })?;
        let env_dir = std::env::var_os(PIPE_DIRECTORY_ENV).filter(|v| !v.is_empty());
        for dir in env_dir
            .map(PathBuf::from)
            .into_iter()
            .chain([options.system_pipe_directory.clone()])
        {
            if dir.join("control").exists() {
                return Err(MpsError::AnotherDaemon {
                    pipe_directory: dir,
                });
            }
        }
        let base = options.root.clone().unwrap_or_else(std::env::temp_dir);
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let root = base.join(format!("poolipc-mps-{}-{stamp:08x}", std::process::id()));
        let (pipe_directory, log_directory) = (root.join("pipe"), root.join("log"));
        for dir in [&root, &pipe_directory, &log_directory] {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .map_err(io_err(format!("creating {}", dir.display())))?;
        }
        let mut mps = PrivateMps {
            root,
            pipe_directory,
            log_directory,
            watchdog_stdin: None,
            watchdog: None,
        };
        // From here on, a failure drops `mps`, whose watchdog (once started) or Drop cleans up.
        mps.start_watchdog(&control)?;
        mps.start_daemon(&control, options.ready_timeout)?;
        tracing::info!(
            pipe = %mps.pipe_directory.display(),
            "poolipc: started a private MPS daemon; processes started with its environment share one GPU context (a GPU fault in any of them ends all of them)"
        );
        Ok(mps)
    }

    fn command(&self, control: &Path) -> Command {
        let mut c = Command::new(control);
        c.envs(self.env());
        c
    }

    fn start_watchdog(&mut self, control: &Path) -> Result<(), MpsError> {
        let (reader, writer) = io::pipe().map_err(io_err("creating the watchdog's pipe"))?;
        let log = std::fs::File::create(self.log_directory.join("poolipc-watchdog.txt"))
            .map_err(io_err("creating the watchdog's log"))?;
        let err = log.try_clone().map_err(io_err("cloning a log handle"))?;
        let child = Command::new("/bin/sh")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("poolipc-mps-watchdog")
            .arg(control)
            .arg(&self.root)
            .envs(self.env())
            .stdin(reader)
            .stdout(log)
            .stderr(err)
            // Its own process group: a Ctrl-C to ours must not kill it before it cleans up.
            .process_group(0)
            .spawn()
            .map_err(io_err("starting the MPS watchdog (/bin/sh)"))?;
        self.watchdog_stdin = Some(writer);
        self.watchdog = Some(child);
        Ok(())
    }

    fn start_daemon(&self, control: &Path, timeout: Duration) -> Result<(), MpsError> {
        let out = self
            .command(control)
            .arg("-d")
            .stdin(Stdio::null())
            .output()
            .map_err(io_err(format!("running {} -d", control.display())))?;
        if !out.status.success() {
            return Err(MpsError::DaemonFailed {
                detail: format!(
                    "{} -d exited with {}: {}{}",
                    control.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim(),
                    self.log_tail()
                ),
            });
        }
        let deadline = Instant::now() + timeout;
        let control_pipe = self.pipe_directory.join("control");
        while !control_pipe.exists() {
            if Instant::now() > deadline {
                return Err(MpsError::DaemonFailed {
                    detail: format!(
                        "no control pipe at {} after {timeout:?}{}",
                        control_pipe.display(),
                        self.log_tail()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // Start this user's server now: a client connecting while the server is still
        // starting is refused (CUDA_ERROR_MPS_SERVER_NOT_READY, seen on the H200).
        let uid = std::fs::metadata(&self.root)
            .map_err(io_err("reading the private directory's owner"))?
            .uid();
        let started = self.ask(control, &format!("start_server -uid {uid}"))?;
        loop {
            let servers = self.ask(control, "get_server_list")?;
            if !servers.trim().is_empty() {
                tracing::debug!(
                    servers = servers.trim(),
                    started = started.trim(),
                    "MPS server up"
                );
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(MpsError::DaemonFailed {
                    detail: format!(
                        "the daemon started no server within {timeout:?} (start_server said {:?}){}",
                        started.trim(),
                        self.log_tail()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends one command to the daemon; what it printed.
    fn ask(&self, control: &Path, line: &str) -> Result<String, MpsError> {
        let mut child = self
            .command(control)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(io_err(format!("running {}", control.display())))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(format!("{line}\n").as_bytes())
                .map_err(io_err(format!("sending {line:?} to the MPS daemon")))?;
        }
        let mut out = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            stdout
                .read_to_string(&mut out)
                .map_err(io_err("reading the MPS daemon's answer"))?;
        }
        child
            .wait()
            .map_err(io_err("waiting for the control program"))?;
        Ok(out)
    }

    fn log_tail(&self) -> String {
        let log =
            std::fs::read_to_string(self.log_directory.join("control.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        if tail.is_empty() {
            String::new()
        } else {
            let lines: Vec<&str> = tail.into_iter().rev().collect();
            format!(" (control.log: {})", lines.join(" | "))
        }
    }

    /// The daemon's pipe directory (`CUDA_MPS_PIPE_DIRECTORY` of its clients).
    #[must_use]
    pub fn pipe_directory(&self) -> &Path {
        &self.pipe_directory
    }

    /// The daemon's log directory (`CUDA_MPS_LOG_DIRECTORY`).
    #[must_use]
    pub fn log_directory(&self) -> &Path {
        &self.log_directory
    }

    /// The environment that makes a process this daemon's client, for `Command::envs`.
    #[must_use]
    pub fn env(&self) -> [(&'static str, &Path); 2] {
        [
            (PIPE_DIRECTORY_ENV, self.pipe_directory.as_path()),
            (LOG_DIRECTORY_ENV, self.log_directory.as_path()),
        ]
    }

    /// Makes this process, and every child it starts from now on, a client: sets the two
    /// variables in the process environment. Refused once CUDA is initialised here.
    ///
    /// Call it first thing, before other threads run (the environment is process-wide).
    pub fn connect_this_process(&self) -> Result<(), MpsError> {
        if mps_env::cuda_initialised() {
            return Err(MpsError::TooLate);
        }
        mps_env::set_client_env(&self.pipe_directory, &self.log_directory);
        Ok(())
    }
}

impl PrivateMps {
    /// Lets the daemon go and waits (at most `timeout`) until it has: it quits once its last
    /// client exited, so call this after the clients you started are gone; this process
    /// must not be a client itself (it would be waiting for itself). Returns whether the
    /// daemon is gone; it goes on its own later otherwise.
    pub fn shutdown(mut self, timeout: Duration) -> bool {
        drop(self.watchdog_stdin.take());
        let Some(mut child) = self.watchdog.take() else {
            return true;
        };
        let deadline = Instant::now() + timeout;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => return true,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(None) => {
                    tracing::warn!(
                        pipe = %self.pipe_directory.display(),
                        "the MPS daemon has not quit yet (clients still running?); it will once they exit"
                    );
                    self.watchdog = Some(child);
                    return false;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "waiting for the MPS watchdog");
                    return false;
                }
            }
        }
    }
}

impl Drop for PrivateMps {
    fn drop(&mut self) {
        // EOF on the watchdog's stdin: it tells the daemon to quit and cleans up.
        drop(self.watchdog_stdin.take());
        if let Some(mut child) = self.watchdog.take() {
            // Reap it when it is done, without holding anyone up.
            let spawned = std::thread::Builder::new()
                .name("poolipc-mps-reap".into())
                .spawn(move || child.wait());
            if let Err(e) = spawned {
                tracing::debug!(error = %e, "could not start a thread to reap the MPS watchdog");
            }
        } else if let Err(e) = std::fs::remove_dir_all(&self.root) {
            tracing::debug!(error = %e, "removing the MPS directories");
        }
    }
}
