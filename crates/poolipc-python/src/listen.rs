//! Workers the parent did not start: a listening socket in a private directory, whose
//! connections a background thread hands to the facade's `Parent::accept_worker` (handshake,
//! extra pools, canary battery). The host learns each accepted worker's id from
//! `NativeListener.accept`.
//!
//! The transport's `PrivateListener` keeps other users out twice: the directory is mode 0700
//! and ours, and every peer's `SO_PEERCRED` uid must be ours. A refused peer never reaches
//! the handshake; it is counted and named in `refused`.
//!
//! A listener made with a token (pyisolate's channels) also keeps out processes of our own
//! uid that were not given it: each connection must send the token first, raw, within
//! [`TOKEN_TIMEOUT`]; one that does not is dropped before the parent sends anything (the
//! pool FD travels in the handshake's first frame). With `once`, the first connection that
//! presents the token is the only one: the listener then stops accepting and its socket file
//! goes, so the channel serves one worker.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use crate::state::lock;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use poolipc::advanced::transport::{PrivateListener, SetupError};
use pyo3::exceptions::{PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{err, to_py_for};
use crate::state::Global;

/// The variable a worker started by someone else reads the listener's path from
/// (`poolipc.Worker.connect()` without a path).
pub(crate) const CONNECT_ENV: &str = "POOLIPC_CONNECT";

/// The variable a worker reads the listener's token from (`poolipc.Worker.connect()`
/// without a token), set by `env()` when the listener demands one.
pub(crate) const TOKEN_ENV: &str = "POOLIPC_CONNECT_TOKEN";

/// How long a connection to a listener with a token may take to present it. Connections are
/// taken one at a time, so this bounds how long a silent one holds up the next.
const TOKEN_TIMEOUT: Duration = Duration::from_secs(2);

type Token = [u8; poolipc::advanced::transport::TOKEN_LEN];

/// A token given as text: exactly [`poolipc::advanced::transport::TOKEN_LEN`] ASCII characters (a
/// `uuid4().hex`, say).
pub(crate) fn parse_token(text: &str) -> PyResult<Token> {
    if !text.is_ascii() {
        return Err(PyValueError::new_err(
            "poolipc: a connect token must be ASCII text",
        ));
    }
    text.as_bytes().try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "poolipc: a connect token has {} characters, not {} (uuid.uuid4().hex has that many)",
            text.len(),
            poolipc::advanced::transport::TOKEN_LEN
        ))
    })
}

/// How many refusals `refused` keeps in words (the count goes on).
const MAX_REFUSED_KEPT: usize = 32;

/// How often the accept thread looks at its stop flag.
const ACCEPT_SLICE: Duration = Duration::from_millis(100);

/// What the accept thread found, for `accept` to hand out in order.
enum Accepted {
    Worker(u32),
    /// A peer of our uid that did not become a worker (handshake refused, canary failed).
    Failed(poolipc::Error),
}

#[derive(Default)]
struct Queue {
    accepted: VecDeque<Accepted>,
    /// Peers dropped before the handshake (another uid, no token), in words: the first
    /// [`MAX_REFUSED_KEPT`].
    refused: Vec<String>,
    /// How many peers were dropped before the handshake.
    refused_count: u64,
    /// The thread ended (closed, or the socket failed): why, when it was not `close`.
    ended: Option<Option<String>>,
}

struct Shared {
    queue: Mutex<Queue>,
    changed: Condvar,
    stop: AtomicBool,
}

/// A private listening socket of the process's parent (`Parent.listen`). Its path goes to
/// the worker process (`POOLIPC_CONNECT`, see `env`), which connects with
/// `Worker.connect(path)`; a thread accepts, checks the peer's uid, shakes hands and runs the
/// canary battery. `accept(timeout)` returns the next accepted worker's id.
#[pyclass(module = "poolipc", name = "NativeListener", frozen)]
pub(crate) struct NativeListener {
    path: PathBuf,
    g: Arc<Global>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The directory we made for it (removed at close), if we made one.
    made_dir: Option<PathBuf>,
    /// The token each connection must present first, if any.
    token: Option<String>,
}

/// A fresh private directory under the runtime or temporary directory.
fn fresh_dir() -> Result<PathBuf, String> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let dir = base.join(format!("poolipc-{}-{n}", std::process::id()));
    // A leftover of a process that had our pid is replaced only if it is ours and private.
    poolipc::advanced::transport::ensure_private_dir(&dir)
        .map_err(|e| format!("poolipc: making a private socket directory: {e}"))?;
    Ok(dir)
}

impl NativeListener {
    pub(crate) fn open(
        g: Arc<Global>,
        directory: Option<PathBuf>,
        token: Option<String>,
        once: bool,
    ) -> PyResult<NativeListener> {
        let wanted = token.as_deref().map(parse_token).transpose()?;
        let (dir, made_dir) = match directory {
            Some(d) => (d, None),
            None => {
                let d = fresh_dir().map_err(err)?;
                (d.clone(), Some(d))
            }
        };
        let listener = PrivateListener::bind(&dir, "worker.sock").map_err(|e| match e {
            SetupError::InsecureDir { .. } | SetupError::PathOccupied { .. } => {
                PyValueError::new_err(format!("poolipc: cannot listen in {}: {e}", dir.display()))
            }
            e => err(format!("poolipc: cannot listen in {}: {e}", dir.display())),
        })?;
        let path = listener.path().to_owned();
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let thread = {
            let (g, shared) = (Arc::clone(&g), Arc::clone(&shared));
            std::thread::Builder::new()
                .name("poolipc-listener".into())
                .spawn(move || accept_loop(&listener, &g, &shared, wanted, once))
                .map_err(|e| err(format!("poolipc: starting the accept thread: {e}")))?
        };
        Ok(NativeListener {
            path,
            g,
            shared,
            thread: Mutex::new(Some(thread)),
            made_dir,
            token,
        })
    }

    fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
        if let Some(d) = &self.made_dir {
            // The socket file went with the listener; the directory is ours and empty.
            let _ = std::fs::remove_dir(d);
        }
    }
}

fn accept_loop(
    listener: &PrivateListener,
    g: &Arc<Global>,
    shared: &Shared,
    token: Option<Token>,
    once: bool,
) {
    let end = |why: Option<String>| {
        lock(&shared.queue).ended = Some(why);
        shared.changed.notify_all();
    };
    while !shared.stop.load(Ordering::Acquire) {
        let conn = match listener.accept(Instant::now() + ACCEPT_SLICE) {
            Ok((conn, _peer)) => conn,
            Err(SetupError::Timeout { .. }) => continue,
            Err(e @ SetupError::PeerUidMismatch { .. }) => {
                tracing::warn!(error = %e, path = %listener.path().display(), "refused a connection");
                let mut q = lock(&shared.queue);
                if q.refused.len() < MAX_REFUSED_KEPT {
                    q.refused.push(e.to_string());
                }
                q.refused_count += 1;
                drop(q);
                shared.changed.notify_all();
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the listening socket failed");
                return end(Some(format!("the listening socket failed: {e}")));
            }
        };
        let mut conn = conn;
        if let Some(t) = &token
            && let Err(e) = conn.expect_token(t, Instant::now() + TOKEN_TIMEOUT)
        {
            // Dropped here, before the parent sent anything: no handshake, no pool FD.
            let why = format!("a connection without this listener's token: {e}");
            tracing::warn!(path = %listener.path().display(), "{why}");
            let mut q = lock(&shared.queue);
            // Bounded: a flood of connections keeps the first entries and a count.
            if q.refused.len() < MAX_REFUSED_KEPT {
                q.refused.push(why);
            }
            q.refused_count += 1;
            drop(q);
            shared.changed.notify_all();
            continue;
        }
        let accepted = g
            .use_device()
            .and_then(|()| g.parent.accept_worker(conn, g.parent.default_trust()));
        let item = match accepted {
            Ok(id) => Accepted::Worker(id.0),
            Err(e) => {
                tracing::warn!(error = %e, "a connected worker was not taken");
                Accepted::Failed(e)
            }
        };
        lock(&shared.queue).accepted.push_back(item);
        shared.changed.notify_all();
        if once {
            // One worker per listener: the socket goes with `listener` when this returns.
            return end(Some(
                "it serves one worker, and one connected (a listener made with once=True)".into(),
            ));
        }
    }
    end(None);
}

#[pymethods]
impl NativeListener {
    /// The socket's path.
    #[getter]
    fn path(&self) -> String {
        self.path.display().to_string()
    }

    /// The next accepted worker's id, waiting at most `timeout` seconds (None: until one
    /// comes or the listener is closed). Workers are handed out in the order they were
    /// taken. Raises `TimeoutError` when none came in time, `PoolipcError` for a peer that
    /// connected but was not taken (its handshake or canary battery failed: the message says
    /// why) or a listener that is closed, `ValueError` for a negative timeout. The GIL is
    /// released while it waits.
    #[pyo3(signature = (timeout = None))]
    fn accept(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u32> {
        let deadline = match timeout {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => {
                Some(Instant::now() + Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX))
            }
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "poolipc: timeout={t} is not a timeout: give seconds, 0 or more, or None"
                )));
            }
        };
        loop {
            let shared = &self.shared;
            let got = py.detach(move || {
                let mut q = lock(&shared.queue);
                if let Some(a) = q.accepted.pop_front() {
                    return Some(Ok(a));
                }
                if let Some(why) = &q.ended {
                    return Some(Err(why.clone()));
                }
                let slice = deadline.map_or(ACCEPT_SLICE, |d| {
                    ACCEPT_SLICE.min(d.saturating_duration_since(Instant::now()))
                });
                let (mut q, _) = shared
                    .changed
                    .wait_timeout(q, slice)
                    .unwrap_or_else(PoisonError::into_inner);
                q.accepted.pop_front().map(Ok)
            });
            match got {
                Some(Ok(Accepted::Worker(id))) => return Ok(id),
                Some(Ok(Accepted::Failed(e))) => return Err(to_py_for(py, e, None)),
                Some(Err(why)) => {
                    return Err(err(format!(
                        "poolipc: the listener at {} is closed{}",
                        self.path.display(),
                        why.map(|w| format!(": {w}")).unwrap_or_default()
                    )));
                }
                None => {}
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(PyTimeoutError::new_err(format!(
                    "poolipc: no worker connected to {} in time",
                    self.path.display()
                )));
            }
        }
    }

    /// What a worker process needs in its environment to connect: `POOLIPC_CONNECT` (the
    /// path), `POOLIPC_CONNECT_TOKEN` when the listener demands a token, and, on the
    /// simulated driver, the simulated machine. Pass it to whatever starts
    /// the worker (pyisolate: the extension config's `env`).
    fn env<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item(CONNECT_ENV, self.path.as_os_str())?;
        if let Some(t) = &self.token {
            d.set_item(TOKEN_ENV, t)?;
        }
        if let Some((k, v)) = &self.g.child_env {
            d.set_item(*k, v)?;
        }
        Ok(d)
    }

    /// The peers refused before the handshake (another uid, no token), in words: the first
    /// 32 of them (`refused_count` counts them all).
    #[getter]
    fn refused(&self) -> Vec<String> {
        lock(&self.shared.queue).refused.clone()
    }

    /// How many peers were refused before the handshake.
    #[getter]
    fn refused_count(&self) -> u64 {
        lock(&self.shared.queue).refused_count
    }

    /// Whether the listener is closed.
    #[getter]
    fn closed(&self) -> bool {
        lock(&self.shared.queue).ended.is_some()
    }

    /// Stops accepting and removes the socket (and the directory `listen` made). Workers
    /// already taken go on. A handshake under way is let finish first (the parent's
    /// `handshake_timeout` bounds it); `accept` then raises `PoolipcError`.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.stop());
    }

    fn __repr__(&self) -> String {
        format!(
            "Listener(path={:?}, closed={})",
            self.path.display().to_string(),
            self.closed()
        )
    }
}

impl Drop for NativeListener {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether `path` could be a listener's socket path (for early, clear errors).
pub(crate) fn check_socket_path(path: &Path) -> PyResult<()> {
    if path.as_os_str().is_empty() {
        return Err(PyValueError::new_err("poolipc: an empty socket path"));
    }
    // sun_path holds 108 bytes with the terminating NUL.
    if path.as_os_str().len() > 107 {
        return Err(PyValueError::new_err(format!(
            "poolipc: socket path {} is longer than a Unix socket path may be (107 bytes)",
            path.display()
        )));
    }
    Ok(())
}
