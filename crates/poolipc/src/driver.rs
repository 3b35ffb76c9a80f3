//! The driver a program runs on, opened the way the Python module opens it.
//!
//! `POOLIPC_DRIVER` ([`DRIVER_ENV`]) picks it: `cuda` (the GPU, through libcuda loaded at run
//! time), `sim` (the simulated driver, [`SimDriver`]: real processes and real shared memory,
//! no GPU needed) or `auto` (the GPU when one is usable, else the simulation, and
//! [`Opened::which`] says which). In a parent, [`open_or`] creates the driver
//! (`POOLIPC_DRIVER` deciding, the given [`Choice`] where it is unset), and for the simulation
//! the machine; [`Opened::sim`] makes a simulated machine whatever the environment says.
//! [`Parent::open`](crate::Parent::open) (or [`Parent::on`](crate::Parent::on)) then hands
//! the machine's locator to every worker it spawns. In a worker, [`open_worker`] attaches to
//! the parent's simulated machine when the parent passed one, and opens the GPU otherwise.
//!
//! The driver's trait and types ([`SimConfig`], [`SimDriver`], the [`Driver`] trait that
//! [`Opened::driver`] is) live below the facade, in [`crate::advanced::driver`].

use std::ffi::OsString;
use std::sync::Arc;

use poolipc_driver::sim::{MACHINE_ENV, SimConfig, SimDriver};
use poolipc_driver::{CudaDriver, Driver, DriverError};

use crate::error::Error;

/// The environment variable that picks the driver: `cuda`, `sim` or `auto`.
pub const DRIVER_ENV: &str = "POOLIPC_DRIVER";

/// Which driver to open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The GPU, through libcuda; an error where there is none.
    Cuda,
    /// The simulated driver, whether or not there is a GPU.
    Sim,
    /// The GPU when one is usable, else the simulation.
    Auto,
}

impl std::str::FromStr for Choice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Choice, Error> {
        match s {
            "cuda" => Ok(Choice::Cuda),
            "sim" => Ok(Choice::Sim),
            "auto" => Ok(Choice::Auto),
            other => Err(Error::Config(format!(
                "{DRIVER_ENV}={other:?} is not a driver: use \"cuda\", \"sim\" or \"auto\""
            ))),
        }
    }
}

impl Choice {
    /// What [`DRIVER_ENV`] asks for; `default` when it is unset or empty.
    pub(crate) fn from_env_or(default: Choice) -> Result<Choice, Error> {
        match std::env::var(DRIVER_ENV) {
            Ok(s) if !s.is_empty() => s.parse(),
            _ => Ok(default),
        }
    }
}

/// An opened driver, what a worker's environment needs to reach it, and which it is.
#[derive(Clone)]
pub struct Opened {
    /// The driver.
    pub driver: Arc<dyn Driver>,
    /// Variables a worker process needs (the simulated machine's locator); empty on the GPU.
    /// [`Parent::on`](crate::Parent::on) sets them on every command it spawns.
    pub worker_env: Vec<(OsString, OsString)>,
    /// Which driver, in words (for a log line).
    pub which: String,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("driver", &self.driver.kind())
            .field("worker_env", &self.worker_env)
            .field("which", &self.which)
            .finish()
    }
}

impl Opened {
    /// A simulated machine with `config`, for a parent, whatever [`DRIVER_ENV`] says
    /// (`Opened::sim(SimConfig::default())` for the defaults).
    pub fn sim(config: SimConfig) -> Result<Opened, Error> {
        let sim = SimDriver::new(config)?;
        let (k, v) = sim.child_env();
        Ok(Opened {
            driver: Arc::new(sim),
            worker_env: vec![(k.into(), v.into())],
            which: "the SIMULATED driver (SimDriver)".into(),
        })
    }

    /// The GPU, through libcuda.
    pub(crate) fn cuda() -> Result<Opened, Error> {
        let d = CudaDriver::new()?;
        Ok(Opened {
            driver: Arc::new(d),
            worker_env: Vec::new(),
            which: "the CUDA driver".into(),
        })
    }
}

/// Opens the driver [`DRIVER_ENV`] names in a parent, `default` when it is unset or empty.
///
/// `open_or(Choice::Cuda)` is what [`Parent::open`](crate::Parent::open) does (as the Python
/// module does: nothing falls back to the simulation unless asked to); without a usable GPU it
/// fails, and the error says how to run on the simulated driver. For a program that must run
/// anywhere (an example, a demo, a test), use `open_or(`[`Choice::Auto`]`)`: the GPU where one
/// is usable, else the simulation. For a simulated machine whatever the environment says, use
/// [`Opened::sim`].
pub fn open_or(default: Choice) -> Result<Opened, Error> {
    match Choice::from_env_or(default)? {
        Choice::Cuda => Opened::cuda(),
        Choice::Sim => {
            let mut o = Opened::sim(SimConfig::default())?;
            o.which = format!("the SIMULATED driver ({DRIVER_ENV}=sim)");
            Ok(o)
        }
        Choice::Auto => Opened::cuda().or_else(|e| {
            let mut o = Opened::sim(SimConfig::default())?;
            o.which = format!(
                "the SIMULATED driver: no usable GPU here ({})",
                why_no_gpu(&e)
            );
            Ok(o)
        }),
    }
}

/// Why the GPU could not be opened, in a few words: the errors that mean "no GPU here" say
/// how to run on the simulated driver, which `auto` has just chosen.
fn why_no_gpu(e: &Error) -> String {
    match e {
        Error::Driver(DriverError::LibraryNotFound { .. }) => "libcuda was not found".into(),
        Error::Driver(DriverError::NoDevice) => "no CUDA device is visible".into(),
        other => other.to_string(),
    }
}

/// Opens the driver in a worker process: the parent's simulated machine when the parent
/// passed one ([`MACHINE_ENV`]), the GPU otherwise. A worker told `POOLIPC_DRIVER=sim` that
/// was given no machine is an error, not a silent switch to the GPU.
pub fn open_worker() -> Result<Arc<dyn Driver>, Error> {
    if let Some(sim) = SimDriver::from_env() {
        return Ok(Arc::new(sim?));
    }
    if std::env::var(DRIVER_ENV).as_deref() == Ok("sim") {
        return Err(Error::Config(format!(
            "{DRIVER_ENV}=sim but no simulated machine was passed ({MACHINE_ENV} is unset): a \
             simulated worker must be spawned by a parent on the simulated driver"
        )));
    }
    Ok(Arc::new(CudaDriver::new()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use poolipc_driver::DriverKind;

    #[test]
    fn choices_parse_and_anything_else_is_refused_by_name() {
        assert_eq!("sim".parse::<Choice>().ok(), Some(Choice::Sim));
        assert_eq!("cuda".parse::<Choice>().ok(), Some(Choice::Cuda));
        assert_eq!("auto".parse::<Choice>().ok(), Some(Choice::Auto));
        let e = "gpu".parse::<Choice>().expect_err("not a driver");
        assert!(e.to_string().contains("\"gpu\""), "{e}");
    }

    #[test]
    fn auto_names_the_missing_gpu_in_a_few_words() {
        let missing = Error::Driver(DriverError::LibraryNotFound {
            searched: "libcuda.so.1".into(),
        });
        assert_eq!(why_no_gpu(&missing), "libcuda was not found");
        assert_eq!(
            why_no_gpu(&Error::Driver(DriverError::NoDevice)),
            "no CUDA device is visible"
        );
    }

    #[test]
    fn a_simulated_parent_hands_its_machine_to_workers() {
        let o = Opened::sim(SimConfig::default()).expect("SimDriver");
        assert_eq!(o.driver.kind(), DriverKind::Sim);
        assert_eq!(o.worker_env.len(), 1);
        assert_eq!(o.worker_env[0].0, MACHINE_ENV);
        // What a worker does with it: attach to the same machine.
        let v = o.worker_env[0].1.to_str().expect("utf-8");
        let peer = SimDriver::attach(v).expect("attach");
        assert_eq!(peer.kind(), DriverKind::Sim);
    }
}
