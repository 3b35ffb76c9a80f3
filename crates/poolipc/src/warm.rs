//! Copy engines and the GPU's turn-taking without MPS (docs/facts.md, "Costs").
//!
//! - READY's record aside ([`aside_stream`], on by default, `POOLIPC_READY_ASIDE=0` turns it
//!   off): the parent's IO thread records a job's READY on a stream of its own, primed with a
//!   copy so that its records run on a copy engine, whenever the caller's stream has nothing
//!   left to run. Measured on the H100 (2026-12-05): a round trip to one worker 20–37 µs with
//!   it, 287–294 µs without.
//! - `POOLIPC_WARM_COPIES=1` (off by default), the experiment that led there: the parent (at
//!   `Parent::new`) and each worker (at its handshake) copy 1 MiB to the device and back
//!   through pageable host memory once, on the legacy stream. A copy that fails is logged and
//!   changes nothing else.

use std::sync::Arc;

use poolipc_driver::{DeviceAllocation, Driver, OwnedStream};

/// A stream of the IO thread's own whose last work is a copy of [`WARM_BYTES`] through
/// pageable memory, or `None` where `on` is false
/// ([`Tuning::ready_aside`](crate::Tuning::ready_aside)) or making it failed (logged).
///
/// Without MPS a stream's event records run on the engine of its last work (measured on
/// the H100, driver 580, 2026-12-05; docs/facts.md): after a kernel or a memset on the compute
/// engine, whose switch from one process's context to another's costs the round trip
/// ~290 µs when the worker's records need it too; after a copy of 1 MiB or more (not
/// 64 KiB) on a copy engine, where the same round trip took 20 µs, kernels in the worker or
/// not. The IO thread records a job's READY here instead of on the caller's stream when the
/// caller's stream has nothing left to run (`cuStreamQuery`): the job's inputs are complete
/// then, and any event orders nothing more. The engine a record runs on is the driver's
/// choice, not documented: on a driver that chooses otherwise the record costs what it cost
/// on the caller's stream.
pub(crate) fn aside_stream(driver: &Arc<dyn Driver>, on: bool) -> Option<OwnedStream> {
    if !on {
        return None;
    }
    let made = || -> poolipc_driver::Result<OwnedStream> {
        let stream = OwnedStream::new(Arc::clone(driver))?;
        let mem = DeviceAllocation::new(Arc::clone(driver), WARM_BYTES as u64)?;
        let mut host = vec![0x5au8; WARM_BYTES];
        driver.memcpy_dtoh_on(&mut host, mem.ptr(), stream.handle())?;
        driver.memcpy_htod_on(mem.ptr(), &host, stream.handle())?;
        mem.close()?;
        Ok(stream)
    };
    match made() {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "the IO thread's READY stream could not be made: every READY goes on the caller's stream");
            None
        }
    }
}

/// How much the warm-up copies: above the 64 KiB up to which a pageable copy goes with the
/// command (no copy engine).
pub(crate) const WARM_BYTES: usize = 1 << 20;

/// The copy, on the current device, where `asked`
/// ([`Tuning::warm_copies`](crate::Tuning::warm_copies)); `who` names the process in the log.
pub(crate) fn copies_if_asked(driver: &Arc<dyn Driver>, who: &str, asked: bool) {
    if !asked {
        return;
    }
    match copy(driver) {
        Ok(()) => tracing::info!(
            "POOLIPC_WARM_COPIES: the {who} copied {WARM_BYTES} bytes to the device and back"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "POOLIPC_WARM_COPIES: the {who}'s warm-up copy failed; going on without it")
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
