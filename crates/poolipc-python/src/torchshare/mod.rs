//! Sharing pool memory with processes this one did not start: the native half of
//! `poolipc.torch_sharing` (torch.multiprocessing under `backend:cudaMallocAsync`).
//!
//! The sender exports the allocation's base (`cuMemPoolExportPointer`) and serves a Unix
//! socket in the abstract namespace from a thread of its own: a receiver of the same uid
//! connects, asks for the pool of a generation and gets its FD once (`SCM_RIGHTS`), then
//! keeps the connection open and claims and releases shares over it. Each share (one pickled
//! handle) holds a Python object (the sender's storage and event) alive until it is released;
//! a receiver that dies releases all it claimed at end of stream.
//!
//! The receiver imports each sender's pool once, each exported allocation once (the driver
//! aliases a second import of the same pointer, and the first free unmaps both), and frees
//! the import before it tells the sender, as CUDA requires.
//!
//! The bytes a share travels as are [`Handle`] (which allocation, from whom) and [`Ref`]
//! (which share to release, with whom).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use poolipc::advanced::driver::Driver;
use poolipc::{DevicePtr, StreamHandle};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::errors::{err, value_err};
use crate::state::{self, OnDevice, lock};

mod copy;
mod receive;
mod release;
mod server;
mod wire;
use copy::VmmCopy;
use receive::{IMPORTS, Import, POOLS, Peer, driver, import, peer};
use release::{pending_releases, release_mapping};
pub(crate) use server::_interpreter_exiting;
use server::{Kept, SERVER, Server, server};
use wire::{Handle, OP_CLAIM, OP_RELEASE, Ref, Source};

/// What a live mapping says for re-sharing (A → B → C): its start, end, handle and offset in
/// the allocation.
struct Live {
    end: u64,
    handle: Vec<u8>,
    offset: u64,
}

static LIVE: Mutex<BTreeMap<(u64, u64), Live>> = Mutex::new(BTreeMap::new());
static SERIAL: AtomicU64 = AtomicU64::new(1);

fn live_lookup(ptr: u64) -> Option<(Vec<u8>, u64)> {
    let t = lock(&LIVE);
    t.range(..=(ptr, u64::MAX))
        .rev()
        .find(|((start, _), l)| *start <= ptr && ptr < l.end)
        .map(|((start, _), l)| (l.handle.clone(), l.offset + (ptr - start)))
}

struct Held {
    import: Arc<Import>,
    keeper: Option<(Arc<Peer>, u64)>,
    live: (u64, u64),
}

/// A received share: `nbytes` of another process's pool memory mapped here at `ptr`. The
/// memory stays valid while this object lives; freed (or `release()`d), the import goes and
/// the sender is told. torch takes it by `__cuda_array_interface__`; `read`/`write` work
/// without torch.
#[pyclass(module = "poolipc", frozen)]
pub(crate) struct SharedMapping {
    held: Mutex<Option<Held>>,
    /// The device address in this process.
    #[pyo3(get)]
    ptr: u64,
    /// Its size in bytes.
    #[pyo3(get)]
    nbytes: u64,
    /// The device ordinal it is mapped on.
    #[pyo3(get)]
    device: u32,
}

impl SharedMapping {
    fn release_now(&self) {
        let Some(h) = lock(&self.held).take() else {
            return;
        };
        lock(&LIVE).remove(&h.live);
        // The import first (CUDA: the importer frees before the exporter), then the word,
        // once this process's work queued so far is done (the sender reuses the block).
        release_mapping(self.device, h.import, h.keeper);
    }

    fn check(&self, offset: u64, n: u64) -> PyResult<()> {
        if lock(&self.held).is_none() {
            return Err(crate::errors::ExpiredViewError::new_err(
                "poolipc: this shared mapping was released",
            ));
        }
        if offset.checked_add(n).is_none_or(|e| e > self.nbytes) {
            return Err(value_err(format!(
                "poolipc: {n} bytes at offset {offset} pass the end of a {}-byte mapping",
                self.nbytes
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl SharedMapping {
    /// `__cuda_array_interface__` (version 3): `nbytes` unsigned bytes at `ptr`, no stream.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.nbytes,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.ptr, false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        Ok(d)
    }

    /// Copies `n` bytes (all by default) from `offset` to the host (synchronous).
    #[pyo3(signature = (offset = 0, n = None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        n: Option<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let n = n.unwrap_or(self.nbytes.saturating_sub(offset));
        self.check(offset, n)?;
        let mut buf = vec![0u8; usize::try_from(n).map_err(|_| value_err("too large"))?];
        let d = driver()?;
        {
            let _on = OnDevice::push(&*d, self.device).map_err(|e| err(e.to_string()))?;
            d.memcpy_dtoh(&mut buf, DevicePtr(self.ptr + offset))
                .map_err(|e| err(format!("poolipc: reading a shared mapping: {e}")))?;
        }
        Ok(PyBytes::new(py, &buf))
    }

    /// Copies `data` from the host to `offset` (synchronous).
    #[pyo3(signature = (data, offset = 0))]
    fn write(&self, data: &[u8], offset: u64) -> PyResult<()> {
        self.check(offset, data.len() as u64)?;
        let d = driver()?;
        let _on = OnDevice::push(&*d, self.device).map_err(|e| err(e.to_string()))?;
        d.memcpy_htod(DevicePtr(self.ptr + offset), data)
            .map_err(|e| err(format!("poolipc: writing a shared mapping: {e}")))
    }

    /// Lets go now: the mapping is unusable from here on, and the sender is told once this
    /// process's work on the memory is done (a small allocation stays imported up to 20 ms
    /// longer, for a new share of it). Idempotent.
    fn release(&self) {
        self.release_now();
    }

    /// Whether it was released.
    #[getter]
    fn released(&self) -> bool {
        lock(&self.held).is_none()
    }

    fn __repr__(&self) -> String {
        format!(
            "SharedMapping(ptr={:#x}, nbytes={}, device={}, released={})",
            self.ptr,
            self.nbytes,
            self.device,
            self.released()
        )
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        self.release_now();
    }
}

// ----- the module functions ------------------------------------------------------------

/// Shares `nbytes` at `ptr` on `device`, keeping `keep` alive until the receiver releases
/// the share. Returns `(handle, offset, ref, idle)`: the handle names the allocation,
/// `offset` is `ptr`'s offset in it, `ref` the share to release, and `idle` whether
/// everything queued on `stream` had run once the share was made (`cuStreamQuery`; None
/// without a stream, or where the query failed): the caller then needs no event. Returns a `str` (why) instead when the
/// memory is not poolipc's to share (no pool installed, another pool, another device): the
/// caller falls back to torch's own path. `ValueError` for an allocation above the import
/// limit.
///
/// `device` None: the pool's device.
#[pyfunction]
#[pyo3(signature = (ptr, nbytes, device, keep, stream = None))]
pub(crate) fn _share(
    py: Python<'_>,
    ptr: u64,
    nbytes: u64,
    device: Option<u32>,
    keep: Py<PyAny>,
    stream: Option<u64>,
) -> PyResult<Py<PyAny>> {
    let device = match (device, state::installed()) {
        (Some(d), _) => d,
        (None, Some(g)) => g.device,
        (None, None) => 0,
    };
    let found = match live_lookup(ptr) {
        Some((handle, offset)) => (handle, offset, None),
        None => match export(py, ptr, nbytes, device, stream)? {
            Ok(found) => found,
            Err(why) => return Ok(why.into_pyobject(py)?.into_any().unbind()),
        },
    };
    let s = server()?;
    let id = {
        let mut shares = lock(&s.shares);
        let mut id = s.new_id();
        while shares.contains_key(&id) {
            id = s.new_id();
        }
        shares.insert(
            id,
            Kept {
                _obj: keep,
                _copy: found.2,
            },
        );
        id
    };
    let r = Ref {
        keeper: s.name.clone(),
        share: id,
    };
    // After the export, which may have queued a copy on the stream: a stream that ran
    // everything has run the sender's writes and that copy.
    let idle = stream.and_then(|raw| {
        let g = state::installed()?;
        let _on = g.on_device().ok()?;
        g.driver
            .stream_query(crate::dlpack::python_stream(raw))
            .ok()
    });
    let t = PyTuple::new(
        py,
        [
            PyBytes::new(py, &found.0).into_any(),
            found.1.into_pyobject(py)?.into_any(),
            PyBytes::new(py, &r.encode()).into_any(),
            idle.into_pyobject(py)?.to_owned().into_any(),
        ],
    )?;
    Ok(t.into_any().unbind())
}

/// What a share names: the handle's bytes, the offset in the allocation, and the copy where
/// the allocation crossed as one.
type Found = (Vec<u8>, u64, Option<Arc<VmmCopy>>);

/// The handle and offset of pool memory at `ptr`, or why it is not poolipc's to share. An
/// allocation above the pool-pointer import limit is copied (`nbytes` at `ptr`, on `stream`,
/// or on the legacy stream and waited for when None) into a VMM allocation the handle names.
fn export(
    py: Python<'_>,
    ptr: u64,
    nbytes: u64,
    device: u32,
    stream: Option<u64>,
) -> PyResult<Result<Found, String>> {
    let Some(g) = state::installed() else {
        return Ok(Err(
            "no poolipc pool in this process (poolipc.install_pool() never ran \
                       before torch was imported)"
                .into(),
        ));
    };
    if g.device != device {
        return Ok(Err(format!(
            "the tensor is on device {device}, poolipc's pool on device {}",
            g.device
        )));
    }
    let r = py.detach(|| {
        let _on = g.on_device().map_err(|e| e.to_string())?;
        let d = &g.driver;
        let pool = match d.pointer_get_mempool(DevicePtr(ptr)) {
            Ok(p) if g.parent.pool().is_generation(p) => p,
            _ => {
                return Ok(Err(
                    "the memory is not from poolipc's pool (torch's default pool, \
                               its native allocator or a cuMemAlloc buffer)"
                        .to_owned(),
                ));
            }
        };
        let (base, bytes) = d
            .pointer_get_range(DevicePtr(ptr))
            .map_err(|e| format!("poolipc: the allocation's range: {e}"))?;
        if ptr + nbytes > base.0 + bytes {
            return Err(format!(
                "poolipc: {nbytes} bytes at {ptr:#x} pass the end of their allocation"
            ));
        }
        let s = server().map_err(|e| e.to_string())?;
        if let Err(e) = g.parent.limits().import.check(base.0, bytes) {
            return copy_for_sharing(&s, d, device, ptr, nbytes, stream).map_err(|why| {
                format!(
                    "poolipc: this tensor's allocation ({} MiB) is above what a receiving \
                     process can import by pool pointer ({e}), and copying it for sharing \
                     failed: {why}",
                    bytes >> 20
                )
            });
        }
        let blob = export_pointer(g.parent.pool(), base, bytes)
            .map_err(|e| format!("poolipc: exporting the allocation: {e}"))?;
        let h = Handle {
            owner: s.name.clone(),
            source: Source::Pool {
                generation: pool.as_raw(),
                blob,
            },
            alloc_bytes: bytes,
        };
        Ok(Ok((h.encode(), ptr - base.0, None)))
    });
    r.map_err(err)
}

/// `nbytes` at `ptr` copied into a VMM allocation this process serves as a copy (see
/// [`copy`]): on `stream`, or on the legacy stream and waited for.
fn copy_for_sharing(
    s: &Server,
    driver: &Arc<dyn Driver>,
    device: u32,
    ptr: u64,
    nbytes: u64,
    stream: Option<u64>,
) -> Result<Result<Found, String>, String> {
    let on = stream.map_or(StreamHandle::NULL, crate::dlpack::python_stream);
    let copy = VmmCopy::make(driver, device, DevicePtr(ptr), nbytes, on)?;
    if stream.is_none() {
        driver
            .stream_synchronize(on)
            .map_err(|e| format!("waiting for the copy: {e}"))?;
    }
    let copy = Arc::new(copy);
    let id = {
        let mut copies = lock(&s.copies);
        let mut id = s.new_id();
        while copies.contains_key(&id) {
            id = s.new_id();
        }
        copies.insert(id, Arc::downgrade(&copy));
        id
    };
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        tracing::warn!(
            mib = nbytes >> 20,
            "poolipc: a tensor whose allocation is above the pool-pointer import limit crosses \
             as a copy (one device-to-device copy per share; writes after the share are not \
             seen across)"
        );
    });
    let h = Handle {
        owner: s.name.clone(),
        source: Source::Copy { id },
        alloc_bytes: copy.bytes,
    };
    Ok(Ok((h.encode(), 0, Some(copy))))
}

/// The export of the allocation of `bytes` at `base`. Until the pool knows whether a
/// recycled address of the same size may lend its old blob (a `Parent`'s canary battery
/// proves it with a worker; torch sharing runs none), the first recycled address is exported
/// afresh and compared with its old blob: the same bytes prove it, and from then on a new
/// tensor at a recycled address costs no `cuMemPoolExportPointer` (about 0.4 ms/GiB).
fn export_pointer(
    pool: &poolipc::advanced::pool::SharedPool<dyn Driver>,
    base: DevicePtr,
    bytes: u64,
) -> Result<poolipc::advanced::driver::ExportBlob, poolipc::advanced::pool::PoolError> {
    let check = if pool.export_reuse().0 == poolipc::ExportReuse::Unchecked {
        pool.begin_export_reuse_check()
    } else {
        None
    };
    if let Some(c) = &check {
        c.trial(base, bytes);
    }
    let blob = pool.export(base)?;
    match check {
        Some(c) if c.trial_used() => c.finish_by_identity(base, &blob),
        _ => Ok(blob),
    }
}

/// Maps a share: `nbytes` at `offset` in the allocation `handle` names, on `device`; claims
/// `ref` with its keeper (a `ref` of None claims nothing). Returns a `SharedMapping`.
#[pyfunction]
#[pyo3(signature = (handle, offset, nbytes, r#ref, device))]
pub(crate) fn _open(
    py: Python<'_>,
    handle: &[u8],
    offset: u64,
    nbytes: u64,
    r#ref: Option<&[u8]>,
    device: u32,
) -> PyResult<SharedMapping> {
    let h = Handle::decode(handle).map_err(value_err)?;
    let r = r#ref.map(Ref::decode).transpose().map_err(value_err)?;
    if offset.checked_add(nbytes).is_none_or(|e| e > h.alloc_bytes) {
        return Err(value_err(format!(
            "poolipc: a share of {nbytes} bytes at offset {offset} passes the end of its \
             {}-byte allocation",
            h.alloc_bytes
        )));
    }
    let handle = handle.to_vec();
    py.detach(move || {
        let import = import(&h, device)?;
        let keeper = match r {
            Some(r) => {
                let p = peer(&r.keeper)?;
                p.send(OP_CLAIM, r.share).map_err(|e| {
                    err(format!("poolipc: claiming a share with @{}: {e}", r.keeper))
                })?;
                Some((p, r.share))
            }
            None => None,
        };
        let ptr = import.ptr.0 + offset;
        let live = (ptr, SERIAL.fetch_add(1, Ordering::Relaxed));
        lock(&LIVE).insert(
            live,
            Live {
                end: ptr + nbytes,
                handle,
                offset,
            },
        );
        Ok(SharedMapping {
            held: Mutex::new(Some(Held {
                import,
                keeper,
                live,
            })),
            ptr,
            nbytes,
            device,
        })
    })
}

/// Queues a 4-byte memset of this process's scratch word on `device` on `stream`: the
/// receiver's first GPU work, made as a tensor arrives and before its mapping is opened, so
/// that without MPS the GPU's change from the sender's context to this one runs while the
/// receiver still rebuilds the tensor on the host instead of after, when the receiver's own
/// first kernel would wait for it. Whether it was queued; a failure is logged, never raised
/// (nothing depends on it).
#[pyfunction]
pub(crate) fn _kick(py: Python<'_>, device: u32, stream: u64) -> bool {
    static SCRATCH: Mutex<BTreeMap<u32, poolipc::advanced::driver::DeviceAllocation>> =
        Mutex::new(BTreeMap::new());
    let queued = py.detach(move || -> Result<(), String> {
        let driver = driver().map_err(|e| e.to_string())?;
        let _on = OnDevice::push(&*driver, device).map_err(|e| e.to_string())?;
        let mut scratch = lock(&SCRATCH);
        let word = match scratch.get(&device) {
            Some(m) => m.ptr(),
            None => {
                let m = poolipc::advanced::driver::DeviceAllocation::new(Arc::clone(&driver), 4)
                    .map_err(|e| e.to_string())?;
                let p = m.ptr();
                scratch.insert(device, m);
                p
            }
        };
        driver
            .memset_d32_async(word, 0, 1, crate::dlpack::python_stream(stream))
            .map_err(|e| e.to_string())
    });
    match queued {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, "poolipc: the receiver's early memset was not queued");
            false
        }
    }
}

/// Releases a share without mapping it (torch's `_release_ipc_counter`: the receiver
/// already holds the same storage under an earlier share).
#[pyfunction]
pub(crate) fn _release(py: Python<'_>, r#ref: &[u8]) -> PyResult<()> {
    let r = Ref::decode(r#ref).map_err(value_err)?;
    py.detach(move || {
        let p = peer(&r.keeper)?;
        p.send(OP_RELEASE, r.share).map_err(|e| {
            err(format!(
                "poolipc: releasing a share with @{}: {e}",
                r.keeper
            ))
        })
    })
}

/// The sharing's figures in this process: `kept` (shares the sender keeps alive for
/// receivers), `receivers` (connected receiving processes), `imports` (allocations of other
/// processes imported here), `mappings` (live received shares), `pools` (other processes'
/// pools imported here), `address` (this process's socket name, None before it shared).
#[pyfunction]
pub(crate) fn _stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    let s = lock(&SERVER)
        .as_ref()
        .filter(|s| s.pid == std::process::id())
        .cloned();
    d.set_item("kept", s.as_ref().map_or(0, |s| lock(&s.shares).len()))?;
    d.set_item(
        "receivers",
        s.as_ref()
            .map_or(0, |s| s.receivers.load(Ordering::Relaxed)),
    )?;
    d.set_item("address", s.as_ref().map(|s| s.name.clone()))?;
    d.set_item(
        "imports",
        lock(&IMPORTS)
            .as_ref()
            .map_or(0, |m| m.values().filter(|w| w.strong_count() > 0).count()),
    )?;
    d.set_item("mappings", lock(&LIVE).len())?;
    d.set_item("pending_releases", pending_releases())?;
    d.set_item("pools", lock(&POOLS).as_ref().map_or(0, HashMap::len))?;
    Ok(d)
}

/// Drops every share this process keeps alive for receivers, whatever they hold (for a
/// receiver that will never release: it must no longer touch the memory). Returns how many.
#[pyfunction]
pub(crate) fn _forget_kept() -> usize {
    let Some(s) = lock(&SERVER).clone() else {
        return 0;
    };
    let ids: Vec<u64> = lock(&s.shares).keys().copied().collect();
    let n = ids.len();
    s.release(ids);
    n
}

/// The installed pool's device (0 before `install_pool`).
#[pyfunction]
pub(crate) fn _pool_device() -> u32 {
    state::installed().map_or(0, |g| g.device)
}

/// What a receiving child needs in its environment to reach this process's simulated
/// machine (`(name, value)`), None on the GPU or before a pool is installed.
#[pyfunction]
pub(crate) fn _child_env() -> Option<(&'static str, String)> {
    state::installed().and_then(|g| g.child_env.clone())
}

/// Copies `n` bytes at `ptr` (device memory of this process, on the pool's device) to the
/// host: for tests and tools without torch. `PoolipcError` when the driver refuses (an
/// address that is not device memory is refused, not read).
#[pyfunction]
pub(crate) fn _memcpy_dtoh<'py>(
    py: Python<'py>,
    ptr: u64,
    n: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let g = state::installed().ok_or_else(|| err("poolipc: no pool is installed"))?;
    let mut buf = vec![0u8; n];
    {
        let _on = g.on_device().map_err(|e| err(e.to_string()))?;
        g.driver
            .memcpy_dtoh(&mut buf, DevicePtr(ptr))
            .map_err(|e| err(format!("poolipc: reading device memory: {e}")))?;
    }
    Ok(PyBytes::new(py, &buf))
}

/// Copies `data` to `ptr` (device memory of this process, on the pool's device): for tests
/// and tools without torch.
#[pyfunction]
pub(crate) fn _memcpy_htod(ptr: u64, data: &[u8]) -> PyResult<()> {
    let g = state::installed().ok_or_else(|| err("poolipc: no pool is installed"))?;
    let _on = g.on_device().map_err(|e| err(e.to_string()))?;
    g.driver
        .memcpy_htod(DevicePtr(ptr), data)
        .map_err(|e| err(format!("poolipc: writing device memory: {e}")))
}
