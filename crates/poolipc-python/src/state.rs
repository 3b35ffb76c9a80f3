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

use std::sync::{Arc, Mutex};
use std::time::Duration;

use poolipc::driver::MACHINE_ENV;
use poolipc::{Driver, Parent, ParentOptions, ResultMemory};
use poolipc_driver::DriverKind;

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
    /// Makes the pool's device current on the calling thread (CUDA contexts are per thread).
    pub(crate) fn use_device(&self) -> Result<(), poolipc::Error> {
        self.driver.use_device(self.device).map_err(Into::into)
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

/// Deadlines asked for from Python, in seconds; `None`: not given (the default on first
/// creation, whatever the process's parent has afterwards).
#[derive(Clone, Debug, Default)]
pub(crate) struct Requested {
    pub(crate) handoff_timeout: Option<f64>,
    pub(crate) stop_timeout: Option<f64>,
    pub(crate) handshake_timeout: Option<f64>,
    pub(crate) frame_timeout: Option<f64>,
    /// Where results go when a job names no allocator: `"pool"` or `"arena"`.
    pub(crate) results: Option<String>,
    /// The result arena's first chunk (and growth step), in bytes.
    pub(crate) arena_bytes: Option<u64>,
    /// The result arena's cap, in bytes.
    pub(crate) arena_max_bytes: Option<u64>,
}

/// [`Requested::arena_bytes`]' default: the arena's first chunk, and its growth step.
pub(crate) const DEFAULT_ARENA_BYTES: u64 = 256 << 20;

/// What `results=` names: the shared pool or the result arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Results {
    Pool,
    Arena,
}

impl Results {
    pub(crate) fn parse(s: &str) -> Result<Results, String> {
        match s {
            "pool" => Ok(Results::Pool),
            "arena" => Ok(Results::Arena),
            other => Err(format!(
                "poolipc: results={other:?} is not a result memory; use \"pool\" or \"arena\""
            )),
        }
    }

    /// Which of the two a parent's options pick.
    pub(crate) fn of(memory: &ResultMemory) -> Results {
        match memory {
            ResultMemory::Arena { .. } => Results::Arena,
            _ => Results::Pool,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Results::Pool => "pool",
            Results::Arena => "arena",
        }
    }
}

/// A deadline's name, its requested value, and its field of [`ParentOptions`].
type Field = (
    &'static str,
    Option<f64>,
    fn(&mut ParentOptions) -> &mut Duration,
);

impl Requested {
    /// Each option with its name, the requested value and the field of [`ParentOptions`].
    fn fields(&self) -> [Field; 4] {
        [
            ("handoff_timeout", self.handoff_timeout, |o| {
                &mut o.handoff_timeout
            }),
            ("stop_timeout", self.stop_timeout, |o| &mut o.stop_timeout),
            ("handshake_timeout", self.handshake_timeout, |o| {
                &mut o.handshake_timeout
            }),
            ("frame_timeout", self.frame_timeout, |o| {
                &mut o.frame_timeout
            }),
        ]
    }

    /// The facade's options: the defaults, with what was asked for. Checks every value,
    /// whether or not this call creates the process's parent.
    fn options(&self, device: u32) -> Result<ParentOptions, String> {
        let mut o = ParentOptions {
            device,
            ..ParentOptions::default()
        };
        for (name, value, field) in self.fields() {
            if let Some(secs) = value {
                *field(&mut o) = seconds(name, secs)?;
            }
        }
        let results = self.results.as_deref().map(Results::parse).transpose()?;
        if self.arena_bytes == Some(0) {
            return Err(
                "poolipc: arena_bytes=0: the arena needs a first chunk of more than 0 \
                        bytes"
                    .into(),
            );
        }
        if let (Some(first), Some(max)) = (self.arena_bytes, self.arena_max_bytes)
            && max < first
        {
            return Err(format!(
                "poolipc: arena_max_bytes={max} is less than arena_bytes={first}: the cap must \
                 hold the first chunk"
            ));
        }
        if results == Some(Results::Arena) {
            o.results = ResultMemory::Arena {
                initial_bytes: self
                    .arena_bytes
                    .unwrap_or(match self.arena_max_bytes {
                        Some(max) => DEFAULT_ARENA_BYTES.min(max),
                        None => DEFAULT_ARENA_BYTES,
                    })
                    .max(1),
                max_bytes: self.arena_max_bytes,
            };
        }
        Ok(o)
    }

    /// On creation: arena sizes mean nothing without `results="arena"`.
    fn check_creation(&self) -> Result<(), String> {
        let arena = self.results.as_deref() == Some("arena");
        if !arena && (self.arena_bytes.is_some() || self.arena_max_bytes.is_some()) {
            return Err(
                "poolipc: arena_bytes and arena_max_bytes size the result arena: pass \
                 results=\"arena\" with them"
                    .into(),
            );
        }
        Ok(())
    }

    /// What in `self` differs from the options the process's parent was made with.
    fn clashes(&self, made: &ParentOptions) -> Vec<String> {
        let mut made = made.clone();
        let mut out = Vec::new();
        for (name, value, field) in self.fields() {
            if let Some(secs) = value {
                let have = *field(&mut made);
                let want = seconds(name, secs).unwrap_or(Duration::MAX);
                // Compared in the units Python gave them (a float of seconds round-trips
                // through Duration to within a nanosecond).
                if want.abs_diff(have) > Duration::from_micros(1) {
                    out.push(format!(
                        "{name}={secs:?} (the process's parent has {:?})",
                        have.as_secs_f64()
                    ));
                }
            }
        }
        let (have, first, max) = match made.results {
            ResultMemory::Arena {
                initial_bytes,
                max_bytes,
            } => (Results::Arena, Some(initial_bytes), max_bytes),
            _ => (Results::Pool, None, None),
        };
        if let Some(want) = self.results.as_deref().and_then(|r| Results::parse(r).ok())
            && want != have
        {
            out.push(format!(
                "results={:?} (the process's parent has {:?})",
                want.name(),
                have.name()
            ));
        }
        if let Some(b) = self.arena_bytes
            && Some(b) != first
        {
            out.push(format!(
                "arena_bytes={b} (the process's parent has {})",
                first.map_or("no arena".to_owned(), |f| f.to_string())
            ));
        }
        if let Some(m) = self.arena_max_bytes
            && (have != Results::Arena || Some(m) != max)
        {
            out.push(format!(
                "arena_max_bytes={m} (the process's parent has {})",
                match (have, max) {
                    (Results::Pool, _) => "no arena".to_owned(),
                    (Results::Arena, None) => "no cap".to_owned(),
                    (Results::Arena, Some(x)) => x.to_string(),
                }
            ));
        }
        out
    }
}

/// A deadline in seconds as a `Duration`: finite and more than zero.
fn seconds(name: &str, secs: f64) -> Result<Duration, String> {
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!(
            "poolipc: {name}={secs:?} is not a deadline: give seconds, more than 0"
        ));
    }
    Duration::try_from_secs_f64(secs)
        .map_err(|e| format!("poolipc: {name}={secs:?} is not a deadline: {e}"))
}

/// A driver, the environment a child needs to reach it (the simulated machine), and words.
pub(crate) type Opened = (Arc<dyn Driver>, Option<(&'static str, String)>, String);

/// The driver `POOLIPC_DRIVER` asks for (`cuda` when unset, `sim`, `auto`): the facade's
/// [`poolipc::driver::open`], whose simulated machine a child reaches through one variable.
pub(crate) fn open_driver() -> Result<Opened, String> {
    let o = poolipc::driver::open().map_err(|e| {
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
    requested: &Requested,
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
