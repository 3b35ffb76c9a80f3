//! The test kernels ([`Driver::launch_store_kernel`], [`Driver::launch_hang_kernel`]): their
//! PTX, and the functions loaded from it, one per context.
//!
//! [`Driver::launch_store_kernel`]: crate::Driver::launch_store_kernel
//! [`Driver::launch_hang_kernel`]: crate::Driver::launch_hang_kernel

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::Mutex;

use cudarc::driver::sys;

use super::result;
use crate::error::{DriverError, Result};

/// The kernel of [`Driver::launch_store_kernel`](crate::Driver::launch_store_kernel), as PTX the driver compiles for the device
/// (no nvrtc, no toolkit): one thread stores a 32-bit value through a pointer.
pub(super) const STORE_KERNEL_PTX: &[u8] = b".version 7.0
.target sm_50
.address_size 64
.visible .entry poolipc_store(.param .u64 p, .param .u32 v)
{
  .reg .u64 %rd<2>;
  .reg .u32 %r<2>;
  ld.param.u64 %rd1, [p];
  ld.param.u32 %r1, [v];
  st.global.u32 [%rd1], %r1;
  ret;
}
\0";

/// The kernel of [`Driver::launch_hang_kernel`](crate::Driver::launch_hang_kernel): one
/// thread spins reading the GPU's nanosecond clock (`%globaltimer`, a special register: the
/// compiler can neither hoist the read nor prove that the loop ends) until
/// 120 s have passed (the literal in the PTX, ns): far beyond any deadline a test holds, yet bounded, so that
/// a process left behind by a test run that was cut short does not spin on the GPU for
/// ever (a process that exits normally waits for it; a killed one's goes at once). In a
/// module of its own (a fault in it leaves the store kernel's loading alone).
pub(super) const HANG_KERNEL_PTX: &[u8] = b".version 7.0
.target sm_50
.address_size 64
.visible .entry poolipc_hang()
{
  .reg .u64 %rd<4>;
  .reg .pred %p<2>;
  mov.u64 %rd1, %globaltimer;
  add.u64 %rd2, %rd1, 120000000000;
$spin:
  mov.u64 %rd3, %globaltimer;
  setp.lt.u64 %p1, %rd3, %rd2;
  @%p1 bra $spin;
  ret;
}
\0";

/// The test kernels' functions, by the context they were loaded in (its address) and their
/// name.
#[derive(Debug, Default)]
pub(super) struct Kernels(Mutex<HashMap<(usize, &'static CStr), usize>>);

impl Kernels {
    /// The kernel `name` of the PTX `image` in the current context, loaded the first time.
    pub(super) fn get(&self, image: &'static [u8], name: &'static CStr) -> Result<sys::CUfunction> {
        let ctx = result::device::ctx_get_current()?;
        let mut kernels = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (ctx.expose_provenance(), name);
        if let Some(&f) = kernels.get(&key) {
            return Ok(std::ptr::with_exposed_provenance_mut(f));
        }
        if image.last() != Some(&0) {
            return Err(DriverError::InvalidArgument {
                call: "cuModuleLoadData",
                reason: "the PTX image is not NUL-terminated".into(),
            });
        }
        // SAFETY: the image is NUL-terminated (checked above) PTX text, static. The module
        // stays loaded while the context lives.
        let module = unsafe { result::module::load_data(image)? };
        // SAFETY: `module` was just loaded, in the context current on this thread, which is
        // still current (nothing ran in between).
        let function = unsafe { result::module::get_function(module, name)? };
        kernels.insert(key, function.expose_provenance());
        Ok(function)
    }
}
