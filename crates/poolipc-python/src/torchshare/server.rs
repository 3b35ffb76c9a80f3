//! The sender's half: a server on an abstract-namespace socket that hands out its pools'
//! and copies' FDs to receivers of the same uid, and keeps every share's object alive until
//! the receiver releases it (or goes away).

use std::collections::{HashMap, HashSet};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use poolipc::advanced::transport::rendezvous::{AbstractListener, recv_exact, send_with_fd};
use pyo3::prelude::*;

use super::copy::VmmCopy;
use super::wire::{OP_CLAIM, OP_COPY, OP_POOL, OP_RELEASE};
use crate::errors::err;
use crate::state::{self, lock};

pub(super) const FD_TIMEOUT: Duration = Duration::from_secs(30);

/// Set by an `atexit` hook ([`_interpreter_exiting`]): the interpreter is exiting, and no
/// thread of the server takes the GIL from then on.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Registered with `atexit` by `poolipc.torch_sharing`: from now on the share server takes
/// no GIL (the interpreter ends threads that wait for it while it exits).
#[pyfunction]
pub(crate) fn _interpreter_exiting() {
    EXITING.store(true, Ordering::Release);
}

pub(super) struct Server {
    pub(super) name: String,
    pub(super) pid: u32,
    /// Share ids are this counter keyed through SipHash with the process's secret keys: a
    /// process that did not see the pickle cannot name a share to release it.
    next: AtomicU64,
    ids: std::collections::hash_map::RandomState,
    pub(super) shares: Mutex<HashMap<u64, Kept>>,
    /// The copies made for allocations above the import limit, by id, while a share keeps
    /// them.
    pub(super) copies: Mutex<HashMap<u64, Weak<VmmCopy>>>,
    pub(super) receivers: AtomicUsize,
}

/// What one share keeps alive: the sharer's object (a torch storage and its event), and the
/// copy where the allocation crossed as one.
pub(super) struct Kept {
    pub(super) _obj: Py<PyAny>,
    pub(super) _copy: Option<Arc<VmmCopy>>,
}

pub(super) static SERVER: Mutex<Option<Arc<Server>>> = Mutex::new(None);

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// This process's server, started on first use (again in a forked child, whose copy of the
/// parent's has no thread behind it).
pub(super) fn server() -> PyResult<Arc<Server>> {
    let mut slot = lock(&SERVER);
    let pid = std::process::id();
    if let Some(s) = slot.as_ref().filter(|s| s.pid == pid) {
        return Ok(Arc::clone(s));
    }
    let name = format!("poolipc-torch.{pid}.{:016x}", random_u64());
    let listener = AbstractListener::bind(&name)
        .map_err(|e| err(format!("poolipc: serving shares at @{name}: {e}")))?;
    let s = Arc::new(Server {
        name,
        pid,
        next: AtomicU64::new(1),
        ids: std::collections::hash_map::RandomState::new(),
        shares: Mutex::new(HashMap::new()),
        copies: Mutex::new(HashMap::new()),
        receivers: AtomicUsize::new(0),
    });
    let s2 = Arc::clone(&s);
    std::thread::Builder::new()
        .name("poolipc-share".into())
        .spawn(move || accept_loop(&s2, &listener))
        .map_err(|e| err(format!("poolipc: starting the share server thread: {e}")))?;
    *slot = Some(Arc::clone(&s));
    Ok(s)
}

fn accept_loop(s: &Arc<Server>, l: &AbstractListener) {
    loop {
        match l.accept() {
            Ok((stream, peer)) => {
                let s = Arc::clone(s);
                let spawned = std::thread::Builder::new()
                    .name("poolipc-share-peer".into())
                    .spawn(move || serve_peer(&s, &stream, peer.pid));
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "share server: no thread for a receiver");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "share server: accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn pool_fd(generation: u64) -> Option<Arc<std::os::fd::OwnedFd>> {
    let g = state::installed()?;
    let pool = g.parent.pool();
    let h = pool
        .handles()
        .into_iter()
        .find(|h| h.as_raw() == generation)?;
    pool.fd_of(h)
}

fn serve_peer(s: &Server, stream: &UnixStream, pid: i32) {
    s.receivers.fetch_add(1, Ordering::Relaxed);
    let mut claimed: HashSet<u64> = HashSet::new();
    let mut f = [0u8; 9];
    loop {
        match recv_exact(stream, &mut f) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                tracing::debug!(pid, error = %e, "share server: receiver gone");
                break;
            }
        }
        let mut a = [0u8; 8];
        a.copy_from_slice(&f[1..]);
        let arg = u64::from_le_bytes(a);
        match f[0] {
            OP_POOL => {
                let fd = pool_fd(arg);
                let reply: &[u8] = if fd.is_some() { &[1] } else { &[0] };
                let sent = send_with_fd(stream, reply, fd.as_ref().map(|f| f.as_fd()), FD_TIMEOUT);
                if let Err(e) = sent {
                    tracing::debug!(pid, error = %e, "share server: sending the pool failed");
                    break;
                }
            }
            OP_COPY => {
                let copy = lock(&s.copies).get(&arg).and_then(Weak::upgrade);
                let fd = copy.as_ref().and_then(|c| match c.fd() {
                    Ok(fd) => Some(fd),
                    Err(e) => {
                        tracing::warn!(pid, error = %e, "share server: a copy's FD");
                        None
                    }
                });
                let reply: &[u8] = if fd.is_some() { &[1] } else { &[0] };
                let sent = send_with_fd(stream, reply, fd.as_ref().map(|f| f.as_fd()), FD_TIMEOUT);
                if let Err(e) = sent {
                    tracing::debug!(pid, error = %e, "share server: sending a copy failed");
                    break;
                }
            }
            OP_CLAIM => {
                claimed.insert(arg);
            }
            OP_RELEASE => {
                claimed.remove(&arg);
                s.release([arg]);
            }
            other => {
                tracing::warn!(pid, op = other, "share server: unknown request; closing");
                break;
            }
        }
    }
    // A receiver that went away (exit, crash, SIGKILL) releases everything it held.
    s.release(claimed);
    s.receivers.fetch_sub(1, Ordering::Relaxed);
}

impl Server {
    /// A fresh share id: unguessable, never 0.
    pub(super) fn new_id(&self) -> u64 {
        use std::hash::BuildHasher;
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        self.ids.hash_one(n).max(1)
    }

    pub(super) fn release(&self, ids: impl IntoIterator<Item = u64>) {
        let gone: Vec<Kept> = {
            let mut m = lock(&self.shares);
            ids.into_iter().filter_map(|id| m.remove(&id)).collect()
        };
        if !gone.is_empty() {
            // The kept objects (torch storages) are freed with the GIL held; never under
            // the table's lock. A receiver may hang up while this interpreter exits: a thread
            // that waits for the GIL then is ended by Python under Rust's frames (a crash),
            // so none is taken once the exit began, and what it kept is left to the exit.
            let mut gone = Some(gone);
            if !EXITING.load(Ordering::Acquire) {
                Python::try_attach(|_| drop(gone.take()));
            }
            if let Some(left) = gone {
                std::mem::forget(left);
            }
            lock(&self.copies).retain(|_, w| w.strong_count() > 0);
        }
    }
}
