//! The process's one shared pool: installed once (by `install_pool` or the first `Parent`),
//! held by a facade [`Parent`] that every Python `Parent` object shares.
//!
//! The facade's `Parent::new` installs the pool, so it is the only owner of it: a second
//! install would be refused (`AlreadyInstalled`). Keeping one facade parent for the process
//! is what lets the prestartup hook install the pool long before any node spawns a worker.
//!
//! The facade parent is `Send + Sync` with `&self` methods, so it is shared as an
//! `Arc<Global>`: the mutex here is held only to create it or to clone the `Arc`, never while a
//! job, a spawn or a stop runs. Jobs on different workers run at the same time.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use poolipc::Parent;
use poolipc::advanced::driver::Driver;
use poolipc::advanced::driver::DriverKind;
use poolipc::advanced::driver::sim::MACHINE_ENV;

use crate::options::ParentConfig;

/// A lock that a panic on another thread did not poison for us: what it guards is
/// consistent between statements, and a Python call must not fail for another's panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The environment variable that picks the driver: `sim` for the simulated driver (tests,
/// machines without a GPU), `cuda` or unset for the GPU, `auto` for the GPU when usable and
/// the simulation otherwise. Nothing falls back to the simulation unless asked to.
pub(crate) use poolipc::driver::DRIVER_ENV;

/// The installed pool and the parent that owns it.
pub(crate) struct Global {
    pub(crate) driver: Arc<dyn Driver>,
    pub(crate) parent: Parent,
    /// What a worker needs in its environment to reach the simulated machine.
    pub(crate) child_env: Option<(&'static str, String)>,
    pub(crate) device: u32,
    /// Which driver, in words.
    pub(crate) which: String,
    /// Who created it (`install_pool` or `Parent`), for the words of a clash.
    pub(crate) made_by: &'static str,
}

impl Global {
    /// Makes the pool's device current on the calling thread (CUDA contexts are per thread):
    /// for poolipc's own threads. A Python caller's thread takes [`Global::on_device`].
    pub(crate) fn use_device(&self) -> Result<(), poolipc::Error> {
        self.driver.use_device(self.device).map_err(Into::into)
    }

    /// Pushes the pool's device as the calling thread's current context until the guard is
    /// dropped: a call on a Python caller's thread leaves that thread's context (torch's,
    /// perhaps on another device) as it found it.
    pub(crate) fn on_device(&self) -> Result<OnDevice<'_>, poolipc::advanced::driver::DriverError> {
        OnDevice::push(&*self.driver, self.device)
    }
}

/// A device pushed as this thread's current context ([`Global::on_device`], and the
/// binding's other calls on a Python caller's thread); dropping it pops it. Not `Send`: it
/// must pop the stack of the thread that pushed.
pub(crate) struct OnDevice<'a> {
    driver: &'a dyn Driver,
    _thread: std::marker::PhantomData<*const ()>,
}

impl<'a> OnDevice<'a> {
    /// Pushes `device` (`Driver::push_device`) until the guard is dropped.
    pub(crate) fn push(
        driver: &'a dyn Driver,
        device: u32,
    ) -> Result<OnDevice<'a>, poolipc::advanced::driver::DriverError> {
        driver.push_device(device)?;
        Ok(OnDevice {
            driver,
            _thread: std::marker::PhantomData,
        })
    }
}

impl Drop for OnDevice<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.driver.pop_device() {
            tracing::warn!(error = %e, "restoring the caller's CUDA context failed");
        }
    }
}

static GLOBAL: Mutex<Option<Arc<Global>>> = Mutex::new(None);

/// The installed pool, if any. Never blocks on a running job (the lock is held only to
/// create the parent or to clone the `Arc`).
pub(crate) fn installed() -> Option<Arc<Global>> {
    GLOBAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// A driver, the environment a child needs to reach it (the simulated machine), and words.
pub(crate) type Opened = (Arc<dyn Driver>, Option<(&'static str, String)>, String);

/// The driver `POOLIPC_DRIVER` asks for (`cuda` when unset, `sim`, `auto`): the facade's
/// [`poolipc::driver::open_or`] with [`Choice::Cuda`](poolipc::driver::Choice::Cuda), whose
/// simulated machine a child reaches through one variable.
pub(crate) fn open_driver() -> Result<Opened, String> {
    let o = poolipc::driver::open_or(poolipc::driver::Choice::Cuda).map_err(|e| {
        format!("poolipc: opening the driver: {e} (set {DRIVER_ENV}=sim for the simulation)")
    })?;
    let child_env = o
        .worker_env
        .iter()
        .find(|(k, _)| k == MACHINE_ENV)
        .map(|(_, v)| (MACHINE_ENV, v.to_string_lossy().into_owned()));
    Ok((o.driver, child_env, o.which))
}

/// The driver a worker process uses: the parent's simulated machine when the parent passed
/// one, the CUDA driver otherwise ([`poolipc::driver::open_worker`]).
pub(crate) fn open_worker_driver() -> Result<Arc<dyn Driver>, String> {
    poolipc::driver::open_worker().map_err(|e| format!("poolipc: opening the worker's driver: {e}"))
}

/// Why [`ensure`] failed.
pub(crate) enum EnsureError {
    /// Options that cannot work, or that clash with the process's parent: a `ValueError`.
    Config(String),
    /// The driver could not be opened: a `PoolipcError`.
    Driver(String),
    /// The facade refused.
    Facade(poolipc::Error),
}

impl EnsureError {
    pub(crate) fn into_py(self) -> pyo3::PyErr {
        match self {
            EnsureError::Config(m) => crate::errors::value_err(m),
            EnsureError::Driver(m) => crate::errors::err(m),
            EnsureError::Facade(e) => crate::errors::to_py(e),
        }
    }
}

/// Creates the process's parent (and so installs the pool) on `device` if nothing did, or
/// checks that the one there is on `device` with the deadlines asked for. Returns it, and
/// whether this call created it. Call it with the GIL released: creating the parent starts
/// its IO thread and installs the pool.
pub(crate) fn ensure(
    device: u32,
    requested: &ParentConfig,
    by: &'static str,
) -> Result<(Arc<Global>, bool), EnsureError> {
    let options = requested.options(device).map_err(EnsureError::Config)?;
    let mut slot = GLOBAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(g) = slot.as_ref() {
        if g.device != device {
            return Err(EnsureError::Config(format!(
                "poolipc: the process's parent (made by {}) has its pool on device {}, not \
                 {device}; one device per process",
                g.made_by, g.device
            )));
        }
        let clashes = requested.clashes(g.parent.options());
        if !clashes.is_empty() {
            return Err(EnsureError::Config(format!(
                "poolipc: {by}({}) clashes with the process's parent, made by {} with other \
                 options; there is one parent per process and the first creation sets them \
                 (pass the deadlines and the result memory there, or leave them out here)",
                clashes.join(", "),
                g.made_by
            )));
        }
        return Ok((Arc::clone(g), false));
    }
    requested.check_creation().map_err(EnsureError::Config)?;
    let (driver, child_env, which) = open_driver().map_err(EnsureError::Driver)?;
    let parent = Parent::new(Arc::clone(&driver), options).map_err(|e| match e {
        poolipc::Error::Config(m) => EnsureError::Config(format!("poolipc: {m}")),
        e => EnsureError::Facade(e),
    })?;
    let g = Arc::new(Global {
        driver,
        parent,
        child_env,
        device,
        which,
        made_by: by,
    });
    *slot = Some(Arc::clone(&g));
    Ok((g, true))
}

/// Whether the driver is the simulation.
pub(crate) fn is_sim(driver: &dyn Driver) -> bool {
    driver.kind() == DriverKind::Sim
}
