//! Making this process an MPS client: what libcuda reads when it initialises.
//!
//! libcuda finds an MPS control daemon through `CUDA_MPS_PIPE_DIRECTORY` (default
//! `/tmp/nvidia-mps`) when the process initialises CUDA; a process that initialised CUDA
//! before the variable was set stays a plain client of the GPU. The facade's `mps` module
//! runs the daemon; this module only answers whether it is too late and sets the variables,
//! because setting the environment is `unsafe` and unsafe code lives in the driver layer.

use std::path::Path;

use cudarc::driver::sys;

use crate::CudaDriver;

/// The variable naming the MPS control daemon's pipe directory.
pub const PIPE_DIRECTORY_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// The variable naming the MPS log directory.
pub const LOG_DIRECTORY_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";

/// Whether libcuda is loaded and initialised in this process (`cuInit` ran): after that,
/// pointing the process at an MPS daemon no longer changes it. `false` without libcuda.
#[must_use]
pub fn cuda_initialised() -> bool {
    if !CudaDriver::library_present() {
        return false;
    }
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: libcuda is present (checked above, so cudarc's loader finds the symbol);
    // `ctx` is a valid place to write. Before cuInit the call returns NOT_INITIALIZED and
    // initialises nothing.
    let r = unsafe { sys::cuCtxGetCurrent(&raw mut ctx) };
    r != sys::CUresult::CUDA_ERROR_NOT_INITIALIZED
}

/// Points this process (and the children it starts from now on) at the MPS daemon whose
/// pipe and log directories these are, by setting [`PIPE_DIRECTORY_ENV`] and
/// [`LOG_DIRECTORY_ENV`].
///
/// Call it before CUDA is initialised (see [`cuda_initialised`]) and before other threads
/// read the environment: the environment is process-wide and not synchronised with C's
/// `getenv` in other threads (libcuda's, a Python interpreter's).
pub fn set_client_env(pipe_directory: &Path, log_directory: &Path) {
    // SAFETY: the caller is told to call this early, before threads that read the
    // environment run (the documented precondition of `set_var`); poolipc calls it from
    // `mps::PrivateMps::connect_this_process`, whose callers start it first thing.
    unsafe {
        std::env::set_var(PIPE_DIRECTORY_ENV, pipe_directory);
        std::env::set_var(LOG_DIRECTORY_ENV, log_directory);
    }
}
