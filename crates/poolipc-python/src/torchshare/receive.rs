//! The receiver's half: one connection per sender, each sender's pool imported once, each
//! exported allocation (or copy) mapped once and shared by every tensor over it.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use poolipc::advanced::driver::Driver;
use poolipc::advanced::driver::ImportedPointer;
use poolipc::advanced::pool::AttachedPool;
use poolipc::advanced::transport::rendezvous::{connect_abstract, recv_with_fd, send_all};
use poolipc::{DevicePtr, StreamHandle};
use pyo3::prelude::*;

use super::copy::CopyMapping;
use super::server::FD_TIMEOUT;
use super::wire::{Handle, OP_COPY, OP_POOL, Source, frame};
use crate::errors::err;
use crate::state::{self, OnDevice, lock};

pub(super) struct Peer {
    pub(super) stream: Mutex<UnixStream>,
}

impl Peer {
    pub(super) fn send(&self, op: u8, arg: u64) -> std::io::Result<()> {
        send_all(&lock(&self.stream), &frame(op, arg))
    }
}

type PeerMap = (u32, HashMap<String, Arc<Peer>>);
static PEERS: Mutex<Option<PeerMap>> = Mutex::new(None);

pub(super) fn peer(name: &str) -> PyResult<Arc<Peer>> {
    let mut slot = lock(&PEERS);
    let pid = std::process::id();
    if slot.as_ref().is_none_or(|(p, _)| *p != pid) {
        *slot = Some((pid, HashMap::new()));
    }
    let Some((_, map)) = slot.as_mut() else {
        return Err(err("poolipc: the peer table is missing"));
    };
    if let Some(p) = map.get(name) {
        return Ok(Arc::clone(p));
    }
    let stream = connect_abstract(name).map_err(|e| {
        err(format!(
            "poolipc: cannot reach the process that shared this tensor (@{name}): {e}. The \
             sender must stay alive until the receiver has rebuilt the tensor"
        ))
    })?;
    let p = Arc::new(Peer {
        stream: Mutex::new(stream),
    });
    map.insert(name.to_owned(), Arc::clone(&p));
    Ok(p)
}

pub(super) type Attached = AttachedPool<Arc<dyn Driver>>;
pub(super) type PoolMap = HashMap<(String, u64), Arc<Attached>>;
pub(super) static POOLS: Mutex<Option<PoolMap>> = Mutex::new(None);

pub(super) fn driver() -> PyResult<Arc<dyn Driver>> {
    static OWN: OnceLock<Result<Arc<dyn Driver>, String>> = OnceLock::new();
    if let Some(g) = state::installed() {
        return Ok(Arc::clone(&g.driver));
    }
    OWN.get_or_init(state::open_worker_driver)
        .clone()
        .map_err(err)
}

/// Asks `owner` for an FD (`op` with `arg`): `None` when it has none to give.
fn ask_fd(owner: &str, op: u8, arg: u64, what: &str) -> PyResult<Option<std::os::fd::OwnedFd>> {
    let p = peer(owner)?;
    let s = lock(&p.stream);
    send_all(&s, &frame(op, arg))
        .map_err(|e| err(format!("poolipc: asking @{owner} for {what}: {e}")))?;
    let mut reply = [0u8; 1];
    let fd = recv_with_fd(&s, &mut reply, FD_TIMEOUT)
        .map_err(|e| err(format!("poolipc: receiving {what} from @{owner}: {e}")))?;
    Ok(match (reply[0], fd) {
        (1, Some(fd)) => Some(fd),
        _ => None,
    })
}

fn attached(
    driver: &Arc<dyn Driver>,
    owner: &str,
    generation: u64,
    device: u32,
) -> PyResult<Arc<Attached>> {
    let key = (owner.to_owned(), generation);
    if let Some(p) = lock(&POOLS).get_or_insert_with(HashMap::new).get(&key) {
        return Ok(Arc::clone(p));
    }
    let Some(fd) = ask_fd(owner, OP_POOL, generation, "its pool")? else {
        return Err(err(format!(
            "poolipc: @{owner} no longer has the pool this tensor came from (its pool was \
             rotated by empty_cache, or it uninstalled it)"
        )));
    };
    let pool = AttachedPool::attach(Arc::clone(driver), fd.as_fd(), device)
        .map_err(|e| err(format!("poolipc: importing @{owner}'s pool: {e}")))?;
    let pool = Arc::new(pool);
    lock(&POOLS)
        .get_or_insert_with(HashMap::new)
        .insert(key, Arc::clone(&pool));
    Ok(pool)
}

pub(super) type ImportKey = (String, Source);

/// How an allocation of another process is mapped here.
pub(super) enum Mapped {
    /// Imported from its pool by pointer (the pool kept while the import lives).
    Pointer(ImportedPointer<Arc<dyn Driver>>, Arc<Attached>),
    /// The sender's copy of it, mapped by FD (unmapped when dropped).
    Copy { _mapping: CopyMapping },
}

/// One import of one exported allocation, shared by every mapping of it in this process.
pub(super) struct Import {
    pub(super) key: ImportKey,
    pub(super) ptr: DevicePtr,
    /// The allocation's size.
    pub(super) bytes: u64,
    pub(super) imp: Option<Mapped>,
    pub(super) device: u32,
    pub(super) driver: Arc<dyn Driver>,
}

pub(super) static IMPORTS: Mutex<Option<HashMap<ImportKey, Weak<Import>>>> = Mutex::new(None);

impl Import {
    /// Whether it may stay mapped a little after its last mapping went (an import by pool
    /// pointer; a copy is the sender's to give back as soon as it can).
    pub(super) fn lingers(&self) -> bool {
        matches!(self.imp, Some(Mapped::Pointer(..)))
    }
}

impl Drop for Import {
    fn drop(&mut self) {
        // Under the table's lock, so that no new import of the same allocation is made while
        // this one is being freed (the driver would alias them).
        let mut t = lock(&IMPORTS);
        if let Some(map) = t.as_mut()
            && map.get(&self.key).is_some_and(|w| w.strong_count() == 0)
        {
            map.remove(&self.key);
        }
        if let Some(Mapped::Pointer(imp, _pool)) = self.imp.take() {
            let on = OnDevice::push(&*self.driver, self.device);
            if let Err(e) = on
                .map_err(|e| e.to_string())
                .and_then(|_on| imp.free(StreamHandle::NULL).map_err(|e| e.to_string()))
            {
                tracing::warn!(ptr = ?self.ptr, error = %e, "freeing a received share failed");
            }
        }
    }
}

pub(super) fn import(h: &Handle, device: u32) -> PyResult<Arc<Import>> {
    // The sender first: a sender that is gone is the error to report, whatever the driver.
    peer(&h.owner)?;
    let driver = driver()?;
    let on_driver = Arc::clone(&driver);
    let _on = OnDevice::push(&*on_driver, device)
        .map_err(|e| err(format!("poolipc: making device {device} current: {e}")))?;
    let key = (h.owner.clone(), h.source);
    if let Some(i) = lock(&IMPORTS)
        .get_or_insert_with(HashMap::new)
        .get(&key)
        .and_then(Weak::upgrade)
    {
        return Ok(i);
    }
    let pool = match h.source {
        Source::Pool { generation, .. } => Some(attached(&driver, &h.owner, generation, device)?),
        Source::Copy { .. } => None,
    };
    let mut t = lock(&IMPORTS);
    let map = t.get_or_insert_with(HashMap::new);
    if let Some(i) = map.get(&key).and_then(Weak::upgrade) {
        return Ok(i);
    }
    let (ptr, mapped) = match (h.source, pool) {
        (Source::Pool { blob, .. }, Some(pool)) => {
            let imp = ImportedPointer::import(Arc::clone(&driver), pool.pool.handle(), &blob)
                .map_err(|e| err(format!("poolipc: importing a shared allocation: {e}")))?;
            (imp.ptr(), Mapped::Pointer(imp, pool))
        }
        (Source::Copy { id }, _) => {
            let Some(fd) = ask_fd(&h.owner, OP_COPY, id, "a copy")? else {
                return Err(err(format!(
                    "poolipc: @{} no longer keeps the copy this tensor crossed as (its share \
                     was released)",
                    h.owner
                )));
            };
            let m = CopyMapping::map(&driver, device, &fd, h.alloc_bytes)
                .map_err(|e| err(format!("poolipc: mapping a shared copy: {e}")))?;
            (m.ptr(), Mapped::Copy { _mapping: m })
        }
        (Source::Pool { .. }, None) => return Err(err("poolipc: the sender's pool is missing")),
    };
    let i = Arc::new(Import {
        key: key.clone(),
        ptr,
        bytes: h.alloc_bytes,
        imp: Some(mapped),
        device,
        driver,
    });
    map.insert(key, Arc::downgrade(&i));
    Ok(i)
}
