//! `POOLIPC_WARM_COPIES=1` (off by default): an experiment of issue 24's. Without MPS a parent
//! whose workers ran the canary battery paid none of the GPU's turn-taking between processes
//! (a 4 KiB job 21 µs, against 286 µs without the battery: H100, 2026-12-05), and in one
//! `bench --sizes` process the rows turned fast after a 64 KiB row whose staging took four
//! times the 4 KiB row's, as if a first copy large enough for a copy engine changed the
//! process for good. With the variable set, the parent (at `Parent::new`) and each worker (at
//! its handshake) copy 1 MiB to the device and back through pageable host memory once, so the
//! bundle's `prime` part can tell whether that alone is the battery's effect. A copy that
//! fails is logged and changes nothing else.

use std::sync::Arc;

use poolipc_driver::{DeviceAllocation, Driver};

/// The environment variable: `1` makes the parent and each worker copy 1 MiB to the device
/// and back once at startup; anything else (or unset), not.
pub const WARM_COPIES_ENV: &str = "POOLIPC_WARM_COPIES";

/// How much the warm-up copies: above the 64 KiB up to which a pageable copy goes with the
/// command (no copy engine).
pub(crate) const WARM_BYTES: usize = 1 << 20;

/// Whether [`WARM_COPIES_ENV`] asks for the copy (read once): what `poolipc doctor` shows.
#[must_use]
pub fn asked() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::parent::env_number::<u8>(WARM_COPIES_ENV) == Some(1))
}

/// The copy, on the current device, where [`asked`]; `who` names the process in the log.
pub(crate) fn copies_if_asked(driver: &Arc<dyn Driver>, who: &str) {
    if !asked() {
        return;
    }
    match copy(driver) {
        Ok(()) => tracing::info!(
            "{WARM_COPIES_ENV}: the {who} copied {WARM_BYTES} bytes to the device and back"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "{WARM_COPIES_ENV}: the {who}'s warm-up copy failed; going on without it")
        }
    }
}

fn copy(driver: &Arc<dyn Driver>) -> poolipc_driver::Result<()> {
    let mem = DeviceAllocation::new(Arc::clone(driver), WARM_BYTES as u64)?;
    let mut host = vec![0x5au8; WARM_BYTES];
    driver.memcpy_htod(mem.ptr(), &host)?;
    driver.memcpy_dtoh(&mut host, mem.ptr())?;
    mem.close()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_warm_up_copy_runs_on_the_simulated_driver_and_frees_what_it_took() {
        let d: Arc<dyn Driver> = Arc::new(
            poolipc_driver::sim::SimDriver::new(poolipc_driver::sim::SimConfig::default())
                .expect("SimDriver"),
        );
        d.use_device(0).expect("device");
        let before = d.mem_get_info().expect("info").0;
        copy(&d).expect("the copy");
        assert_eq!(
            d.mem_get_info().expect("info").0,
            before,
            "the 1 MiB went back"
        );
    }
}
