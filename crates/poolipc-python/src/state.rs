//! The process's one shared pool: installed once (by `install_pool` or the first `Parent`),
//! held by a facade [`Parent`] that every Python `Parent` object shares.
//!
//! The facade's `Parent::new` installs the pool, so it is the only owner of it: a second
//! install would be refused (`AlreadyInstalled`). Keeping one facade parent for the process
//! is what lets the prestartup hook install the pool long before any node spawns a worker.

use std::sync::{Arc, Mutex, MutexGuard};

use poolipc::{Driver, Parent, ParentOptions};
use poolipc_driver::sim::{SimConfig, SimDriver};
use poolipc_driver::{CudaDriver, DriverKind, PoolHandle};
use pyo3::PyResult;

use crate::errors::{err, to_py};

/// The environment variable that picks the driver: `sim` for the simulated driver (tests,
/// machines without a GPU), `cuda` or unset for the GPU. Nothing falls back to the simulation
/// silently.
pub(crate) const DRIVER_ENV: &str = "POOLIPC_DRIVER";

/// The installed pool and the parent that owns it.
pub(crate) struct Global {
    pub(crate) driver: Arc<dyn Driver>,
    pub(crate) parent: Parent,
    /// What a worker needs in its environment to reach the simulated machine.
    pub(crate) child_env: Option<(&'static str, String)>,
    pub(crate) device: u32,
    /// Which driver, in words.
    pub(crate) which: String,
}

static GLOBAL: Mutex<Option<Global>> = Mutex::new(None);

/// What may be used without the global lock (from inside a result allocator, from drops):
/// the driver, the pool's handle, the device, the driver in words. Set once, with the pool.
#[derive(Clone)]
pub(crate) struct Installed {
    pub(crate) driver: Arc<dyn Driver>,
    pub(crate) pool: PoolHandle,
    pub(crate) device: u32,
    pub(crate) which: String,
}

static INSTALLED: Mutex<Option<Installed>> = Mutex::new(None);

/// The installed pool, if any. Never blocks on a running job.
pub(crate) fn installed() -> Option<Installed> {
    INSTALLED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// Locks the global state. Call it only with the GIL released (`py.detach`): a Python
/// callback made under the lock (the result allocator) needs the GIL.
pub(crate) fn lock() -> MutexGuard<'static, Option<Global>> {
    GLOBAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The driver `POOLIPC_DRIVER` asks for, a child environment for the simulation, and words.
/// A driver, the environment a child needs to reach it (the simulated machine), and words.
pub(crate) type Opened = (Arc<dyn Driver>, Option<(&'static str, String)>, String);

pub(crate) fn open_driver() -> PyResult<Opened> {
    let choice = std::env::var(DRIVER_ENV).unwrap_or_default();
    match choice.as_str() {
        "sim" => {
            let sim = SimDriver::new(SimConfig::default())
                .map_err(|e| err(format!("poolipc: starting the simulated driver: {e}")))?;
            let env = sim.child_env();
            Ok((
                Arc::new(sim),
                Some(env),
                format!("the SIMULATED driver ({DRIVER_ENV}=sim)"),
            ))
        }
        "" | "cuda" => {
            let d = CudaDriver::new().map_err(|e| {
                err(format!(
                    "poolipc: no usable CUDA driver: {e} (set {DRIVER_ENV}=sim for the simulation)"
                ))
            })?;
            Ok((Arc::new(d), None, "the CUDA driver".into()))
        }
        other => Err(err(format!(
            "poolipc: {DRIVER_ENV}={other:?} is not a driver; use \"cuda\" (default) or \"sim\""
        ))),
    }
}

/// The driver a worker process uses: the parent's simulated machine when the parent passed
/// one, the CUDA driver otherwise.
pub(crate) fn open_worker_driver() -> Result<Arc<dyn Driver>, String> {
    if let Some(sim) = SimDriver::from_env() {
        return sim
            .map(|s| Arc::new(s) as Arc<dyn Driver>)
            .map_err(|e| format!("poolipc: attaching to the parent's simulated machine: {e}"));
    }
    if std::env::var(DRIVER_ENV).as_deref() == Ok("sim") {
        return Err(format!(
            "poolipc: {DRIVER_ENV}=sim but no simulated machine was passed; a simulated worker \
             must be spawned by a simulated parent"
        ));
    }
    CudaDriver::new()
        .map(|d| Arc::new(d) as Arc<dyn Driver>)
        .map_err(|e| format!("poolipc: no usable CUDA driver: {e}"))
}

/// Installs the pool on `device` if nothing did, or checks that it is on `device`. Returns
/// whether this call installed it.
pub(crate) fn ensure(slot: &mut Option<Global>, device: u32) -> PyResult<bool> {
    if let Some(g) = slot.as_ref() {
        if g.device != device {
            return Err(err(format!(
                "poolipc: the shared pool is installed on device {}, not {device}; one device \
                 per process",
                g.device
            )));
        }
        g.driver.use_device(device).map_err(|e| to_py(e.into()))?;
        return Ok(false);
    }
    let (driver, child_env, which) = open_driver()?;
    let options = ParentOptions {
        device,
        ..ParentOptions::default()
    };
    let parent = Parent::new(Arc::clone(&driver), options).map_err(to_py)?;
    *INSTALLED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Installed {
        driver: Arc::clone(&driver),
        pool: parent.pool().handle(),
        device,
        which: which.clone(),
    });
    *slot = Some(Global {
        driver,
        parent,
        child_env,
        device,
        which,
    });
    Ok(true)
}

/// Whether the driver is the simulation.
pub(crate) fn is_sim(driver: &dyn Driver) -> bool {
    driver.kind() == DriverKind::Sim
}
