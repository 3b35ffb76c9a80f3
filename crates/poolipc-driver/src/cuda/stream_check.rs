//! `stream_check`: whether a stream handle from outside (a Python int, torch's
//! `cuda_stream`) names a stream of this process, before any other call dereferences it.

use super::{result, stream_raw};
use crate::error::{DriverError, Result};
use crate::types::StreamHandle;

/// See [`Driver::stream_check`](crate::api::Driver::stream_check).
pub(super) fn check(stream: StreamHandle) -> Result<()> {
    const CALL: &str = "cuStreamQuery";
    if stream.0 <= 2 {
        return Ok(());
    }
    let bad = |reason: String| DriverError::InvalidArgument { call: CALL, reason };
    if !stream.0.is_multiple_of(8) {
        return Err(bad(format!(
            "{:#x} is not a stream handle (misaligned)",
            stream.0
        )));
    }
    // A stream handle points at the driver's object in this process: the handle must be
    // readable memory here before libcuda dereferences it (a made-up number would crash
    // the process instead of failing the call). process_vm_readv on ourselves reads
    // without faulting: EFAULT for an unmapped address.
    let mut word = [0u8; 8];
    let readable = usize::try_from(stream.0).is_ok_and(|addr| {
        let local = [std::io::IoSliceMut::new(&mut word)];
        let remote = [nix::sys::uio::RemoteIoVec { base: addr, len: 8 }];
        nix::sys::uio::process_vm_readv(nix::unistd::Pid::this(), &mut { local }, &remote)
            .is_ok_and(|n| n == 8)
    });
    if !readable {
        return Err(bad(format!(
            "{:#x} is not a stream handle of this process (no memory there)",
            stream.0
        )));
    }
    // SAFETY: the handle points at readable memory of this process (checked above); the
    // driver validates that it is one of its streams and answers INVALID_HANDLE or
    // INVALID_CONTEXT otherwise.
    unsafe { result::stream::query(stream_raw(stream)) }.map(drop)
}
