//! Modules and kernel launches: `cuModuleLoadData`, `cuModuleGetFunction`, `cuLaunchKernel`
//! (the test kernels only).
//!
//! Modules and functions are addresses of libcuda's objects: the wrappers that take one are
//! `unsafe fn`s whose caller guarantees it is live.

use std::ffi::{CStr, c_void};

use cudarc::driver::sys;

use super::check;
use crate::error::Result;

/// `cuModuleLoadData`: loads `image` into the current context.
///
/// # Safety
/// 1. `image` is NUL-terminated PTX text (libcuda reads it up to its NUL).
pub(crate) unsafe fn load_data(image: &[u8]) -> Result<sys::CUmodule> {
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: the caller guarantees (1) that the image is NUL-terminated, and it is borrowed
    // for the call; `module` is a live local, a valid place for the one handle the driver
    // writes.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&raw mut module, image.as_ptr().cast::<c_void>())
    })?;
    Ok(module)
}

/// `cuModuleGetFunction`: the kernel `name` of `module`.
///
/// # Safety
/// 1. `module` was loaded with [`load_data`] in a context of this process that is still live.
pub(crate) unsafe fn get_function(module: sys::CUmodule, name: &CStr) -> Result<sys::CUfunction> {
    let mut function: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: the caller guarantees (1) that `module` is loaded and live; the name is
    // NUL-terminated (a CStr); `function` is a live local, a valid place for the one handle
    // the driver writes.
    check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&raw mut function, module, name.as_ptr())
    })?;
    Ok(function)
}

/// `cuLaunchKernel` of one block of one thread, without shared memory or extra arguments.
/// No parameters (`params` empty) are passed as a null parameter list.
///
/// # Safety
/// 1. `function` came from [`get_function`] for a module loaded in the context current on
///    this thread.
/// 2. `stream` is a live stream of this process, or one of the default streams (0, 1, 2).
/// 3. `params` holds one pointer per parameter of the kernel, each to a live value of the
///    parameter's type (the driver copies them at launch).
pub(crate) unsafe fn launch_one_thread(
    function: sys::CUfunction,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    let params = if params.is_empty() {
        std::ptr::null_mut()
    } else {
        params.as_mut_ptr()
    };
    // SAFETY: the caller guarantees (1) that `function` is loaded and live, (2) that `stream`
    // is live and (3) that the parameters match the kernel's; there are no extra arguments.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            function,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            stream,
            params,
            std::ptr::null_mut(),
        )
    })
}
