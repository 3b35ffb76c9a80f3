//! Work on memory: memsets, copies (synchronous ones on the legacy stream, asynchronous ones
//! into and out of the caller's host memory), the test kernels, and host memory registration.
//! Each is checked when issued (address, access, happens-before) and runs later on the
//! process's engine.

use std::sync::{Arc, Mutex};

use crate::api::Driver;
use crate::error::{CuCode, DriverError, Result};
use crate::sim::exec::Step;
use crate::sim::hb::{self, host_learns};
use crate::sim::local::{HostBuf, HostRegistration, Local};
use crate::sim::shm::backing_file;
use crate::sim::state::{self, State};
use crate::sim::{SimDriver, fail};
use crate::types::{DevicePtr, StreamHandle};

/// `cuMemsetD8Async`.
pub(super) fn memset_d8(
    d: &SimDriver,
    ptr: DevicePtr,
    value: u8,
    bytes: u64,
    stream: StreamHandle,
) -> Result<()> {
    d.check_context("cuMemsetD8Async")?;
    d.memset("cuMemsetD8Async", ptr, &[value], bytes, stream)
}

/// `cuMemsetD32Async` (4-byte aligned).
pub(super) fn memset_d32(
    d: &SimDriver,
    ptr: DevicePtr,
    value: u32,
    words: u64,
    stream: StreamHandle,
) -> Result<()> {
    d.check_context("cuMemsetD32Async")?;
    if !ptr.0.is_multiple_of(4) {
        return Err(fail("cuMemsetD32Async", CuCode::INVALID_VALUE));
    }
    d.memset("cuMemsetD32Async", ptr, &value.to_le_bytes(), words, stream)
}

/// A kernel that never ends: the stream stops there.
pub(super) fn launch_hang_kernel(d: &SimDriver, stream: StreamHandle) -> Result<()> {
    const CALL: &str = "cuLaunchKernel";
    d.check_context(CALL)?;
    let mut l = d.local();
    let l = &mut *l;
    let (s, seq) = d.machine.with(|st| {
        let s = d.stream_slot(l, st, CALL, stream)?;
        Ok((s, st.tick(s)))
    })?;
    d.issue(s, seq, Step::Hang);
    Ok(())
}

/// A kernel storing `value` at `address`, then `cuStreamSynchronize`; a store the GPU cannot
/// make loses the context (under MPS, every client's).
pub(super) fn launch_store_kernel(
    d: &SimDriver,
    address: DevicePtr,
    value: u32,
    stream: StreamHandle,
) -> Result<()> {
    const CALL: &str = "cuStreamSynchronize";
    d.check_context("cuLaunchKernel")?;
    let unaligned = !address.0.is_multiple_of(4);
    // What this process can reach (asked without recording an access violation: a
    // fault is the expected outcome here, not a bug of the caller's).
    let reachable = d
        .pointer_get_range(address)
        .is_ok_and(|(base, len)| address.0 + 4 <= base.0 + len);
    let stored = !unaligned
        && reachable
        && d.memset("cuLaunchKernel", address, &value.to_le_bytes(), 1, stream)
            .is_ok();
    if stored {
        return d.stream_synchronize(stream);
    }
    // A store the GPU cannot make: the context is lost, and under MPS every client's.
    d.local().context_lost = true;
    let mps = d.machine.with(|st| {
        if st.mps & state::MPS_ON != 0 {
            st.mps |= state::MPS_FAULTED;
            true
        } else {
            false
        }
    });
    tracing::debug!(?address, mps, "simulated GPU fault");
    Err(fail(
        CALL,
        if unaligned {
            CuCode::MISALIGNED_ADDRESS
        } else {
            CuCode::ILLEGAL_ADDRESS
        },
    ))
}

/// `cuMemcpyDtoH` (synchronous, on the legacy stream).
pub(super) fn dtoh(d: &SimDriver, dst: &mut [u8], src: DevicePtr) -> Result<()> {
    d.check_context("cuMemcpyDtoH")?;
    if dst.is_empty() {
        return Ok(());
    }
    let buf = Arc::new(Mutex::new(vec![0u8; dst.len()]));
    let (s, seq) = d.host_copy(
        "cuMemcpyDtoH",
        src,
        HostBuf::Owned(Arc::clone(&buf)),
        true,
        StreamHandle::NULL,
    )?;
    d.sync_on_legacy(s, seq);
    let got = buf
        .lock()
        .map_err(|_| fail("cuMemcpyDtoH", CuCode::UNKNOWN))?;
    dst.copy_from_slice(&got);
    Ok(())
}

/// `cuMemcpyHtoD` (synchronous, on the legacy stream).
pub(super) fn htod(d: &SimDriver, dst: DevicePtr, src: &[u8]) -> Result<()> {
    d.check_context("cuMemcpyHtoD")?;
    if src.is_empty() {
        return Ok(());
    }
    let buf = HostBuf::Owned(Arc::new(Mutex::new(src.to_vec())));
    let (s, seq) = d.host_copy("cuMemcpyHtoD", dst, buf, false, StreamHandle::NULL)?;
    d.sync_on_legacy(s, seq);
    Ok(())
}

/// `cuMemcpyDtoDAsync`.
pub(super) fn dtod_async(
    d: &SimDriver,
    dst: DevicePtr,
    src: DevicePtr,
    bytes: u64,
    stream: StreamHandle,
) -> Result<()> {
    d.check_context("cuMemcpyDtoDAsync")?;
    const CALL: &str = "cuMemcpyDtoDAsync";
    if bytes == 0 {
        return Ok(());
    }
    let n = SimDriver::host_len(CALL, bytes)?;
    let mut l = d.local();
    let l = &mut *l;
    let (s, seq, from, to) = d.machine.with(|st| {
        let s = d.stream_slot(l, st, CALL, stream)?;
        let from = d.touch(l, st, CALL, src, bytes, false)?;
        let to = d.touch(l, st, CALL, dst, bytes, true)?;
        if !l.lent.is_empty() {
            d.lent_check(l, st, CALL, src, bytes, false, s);
            d.lent_check(l, st, CALL, dst, bytes, true, s);
        }
        SimDriver::mapping(l, &from.0).ok_or(fail(CALL, CuCode::ILLEGAL_ADDRESS))?;
        SimDriver::mapping(l, &to.0).ok_or(fail(CALL, CuCode::ILLEGAL_ADDRESS))?;
        let seq = st.tick(s);
        hb::access(st, d.process(), CALL, s, seq, &from.1, false);
        hb::access(st, d.process(), CALL, s, seq, &to.1, true);
        Ok((s, seq, from, to))
    })?;
    let pid = d.pid;
    d.issue(
        s,
        seq,
        Step::Run(Box::new(move |l: &mut Local, st: &mut State| {
            let Some((fm, fo)) = SimDriver::at_run(l, st, CALL, pid, &from.0, &from.1) else {
                return;
            };
            let Some((tm, to)) = SimDriver::at_run(l, st, CALL, pid, &to.0, &to.1) else {
                return;
            };
            // Through a bounce buffer: the two ranges may be two mappings of the same
            // bytes.
            let mut buf = vec![0u8; n.min(8 << 20)];
            let mut done = 0;
            while done < n {
                let k = buf.len().min(n - done);
                fm.read(fo + done, &mut buf[..k]);
                tm.write(to + done, &buf[..k]);
                done += k;
            }
        })),
    );
    Ok(())
}

/// `cuMemcpyDtoHAsync`: queued; the engine writes `dst` when the copy runs.
///
/// # Safety
/// 1. `dst` is valid for `bytes` writes until the copy completed on `stream`, and nothing
///    else accesses it meanwhile (the trait's contract).
pub(super) unsafe fn dtoh_async(
    d: &SimDriver,
    dst: *mut u8,
    src: DevicePtr,
    bytes: u64,
    stream: StreamHandle,
) -> Result<()> {
    const CALL: &str = "cuMemcpyDtoHAsync";
    let n = SimDriver::host_len(CALL, bytes)?;
    if dst.is_null() {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    if n == 0 {
        return Ok(());
    }
    // The caller promises `dst` is valid for `bytes` writes and untouched by anything
    // else until the copy completed: the engine writes it when the copy runs.
    d.host_copy(CALL, src, HostBuf::Raw(dst as usize, n), true, stream)
        .map(drop)
}

/// `cuMemcpyHtoDAsync`: queued; the engine reads `src` when the copy runs.
///
/// # Safety
/// 1. `src` is valid for `bytes` reads until the copy completed on `stream`, and nothing
///    writes it meanwhile (the trait's contract).
pub(super) unsafe fn htod_async(
    d: &SimDriver,
    dst: DevicePtr,
    src: *const u8,
    bytes: u64,
    stream: StreamHandle,
) -> Result<()> {
    const CALL: &str = "cuMemcpyHtoDAsync";
    let n = SimDriver::host_len(CALL, bytes)?;
    if src.is_null() {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    if n == 0 {
        return Ok(());
    }
    // The caller promises `src` is valid for `bytes` reads and not written until the copy
    // completed: the engine reads it when the copy runs.
    d.host_copy(CALL, dst, HostBuf::Raw(src as usize, n), false, stream)
        .map(drop)
}

/// `cuMemHostRegister`: remembered, with the shared file behind the range when there is one (so
/// the race detector sees both processes' copies of it).
pub(super) fn host_register(d: &SimDriver, ptr: *mut u8, bytes: usize) -> Result<()> {
    const CALL: &str = "cuMemHostRegister_v2";
    if ptr.is_null() || bytes == 0 {
        return Err(fail(CALL, CuCode::INVALID_VALUE));
    }
    let start = ptr as usize;
    let end = start
        .checked_add(bytes)
        .ok_or(fail(CALL, CuCode::INVALID_VALUE))?;
    let mut l = d.local();
    let overlaps = l
        .host_registered
        .range(..end)
        .next_back()
        .is_some_and(|(&s, r)| s + r.bytes > start);
    if overlaps {
        return Err(fail(CALL, CuCode::HOST_MEMORY_ALREADY_REGISTERED));
    }
    let file = backing_file(start, bytes);
    l.host_registered
        .insert(start, HostRegistration { bytes, file });
    Ok(())
}

/// `cuMemHostUnregister`.
pub(super) fn host_unregister(d: &SimDriver, ptr: *mut u8) -> Result<()> {
    d.local()
        .host_registered
        .remove(&(ptr as usize))
        .map(drop)
        .ok_or(fail(
            "cuMemHostUnregister",
            CuCode::HOST_MEMORY_NOT_REGISTERED,
        ))
}

impl SimDriver {
    fn memset(
        &self,
        call: &'static str,
        ptr: DevicePtr,
        pattern: &[u8],
        count: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let bytes = count
            .checked_mul(pattern.len() as u64)
            .ok_or(fail(call, CuCode::INVALID_VALUE))?;
        if bytes == 0 {
            return Ok(());
        }
        let n = usize::try_from(bytes).map_err(|_| fail(call, CuCode::INVALID_VALUE))?;
        let mut l = self.local();
        let l = &mut *l;
        let (s, seq, place, mem) = self.machine.with(|st| {
            let s = self.stream_slot(l, st, call, stream)?;
            let (place, mem) = self.touch(l, st, call, ptr, bytes, true)?;
            if !l.lent.is_empty() {
                self.lent_check(l, st, call, ptr, bytes, true, s);
            }
            Self::mapping(l, &place).ok_or(fail(call, CuCode::ILLEGAL_ADDRESS))?;
            let seq = st.tick(s);
            hb::access(st, self.process(), call, s, seq, &mem, true);
            Ok((s, seq, place, mem))
        })?;
        let pattern = pattern.to_vec();
        let pid = self.pid;
        self.issue(
            s,
            seq,
            Step::Run(Box::new(move |l: &mut Local, st: &mut State| {
                let Some((map, off)) = Self::at_run(l, st, call, pid, &place, &mem) else {
                    return;
                };
                if pattern.iter().all(|b| *b == pattern[0]) {
                    map.fill(off, pattern[0], n);
                } else {
                    let chunk: Vec<u8> = pattern
                        .iter()
                        .copied()
                        .cycle()
                        .take(pattern.len() * 4096)
                        .collect();
                    let mut done = 0;
                    while done < n {
                        let k = chunk.len().min(n - done);
                        map.write(off + done, &chunk[..k]);
                        done += k;
                    }
                }
            })),
        );
        Ok(())
    }

    /// A copy between device memory at `dev` and the host bytes `host` on `stream`, device
    /// to host when `to_host`: queued, and, for a registered shared host range, checked as an
    /// access of those host bytes too (written by a copy out, read by a copy in). Returns the
    /// stream slot and the operation's sequence number.
    fn host_copy(
        &self,
        call: &'static str,
        dev: DevicePtr,
        host: HostBuf,
        to_host: bool,
        stream: StreamHandle,
    ) -> Result<(usize, u64)> {
        let mut l = self.local();
        let l = &mut *l;
        let shared = match &host {
            HostBuf::Raw(p, n) => Self::host_range(l, *p, *n),
            HostBuf::Owned(_) => None,
        };
        let len = host.len() as u64;
        let (s, seq, place, mem) = self.machine.with(|st| {
            let s = self.stream_slot(l, st, call, stream)?;
            let (place, mem) = self.touch(l, st, call, dev, len, !to_host)?;
            if !l.lent.is_empty() {
                self.lent_check(l, st, call, dev, len, !to_host, s);
            }
            Self::mapping(l, &place).ok_or(fail(call, CuCode::ILLEGAL_ADDRESS))?;
            let seq = st.tick(s);
            hb::access(st, self.process(), call, s, seq, &mem, !to_host);
            if let Some(h) = shared {
                hb::access(st, self.process(), call, s, seq, &h, to_host);
            }
            Ok((s, seq, place, mem))
        })?;
        let pid = self.pid;
        self.issue(
            s,
            seq,
            Step::Run(Box::new(move |l: &mut Local, st: &mut State| {
                let Some((map, off)) = Self::at_run(l, st, call, pid, &place, &mem) else {
                    return;
                };
                if to_host {
                    host.fill_from(map, off);
                } else {
                    host.store_into(map, off);
                }
            })),
        );
        Ok((s, seq))
    }

    /// A synchronous copy on the legacy stream: queued, then waited for (that copy alone:
    /// the legacy stream does not wait for the non-blocking streams); what the host learned
    /// flows into its clock.
    fn sync_on_legacy(&self, s: usize, seq: u64) {
        self.engine.wait_executed(s, seq);
        let mut l = self.local();
        let l = &mut *l;
        self.machine.with(|st| {
            let clock = st.streams[s].clock;
            host_learns(&mut l.host_clock, &mut st.observed, &clock);
        });
    }

    fn host_len(call: &'static str, bytes: u64) -> Result<usize> {
        usize::try_from(bytes).map_err(|_| DriverError::InvalidArgument {
            call,
            reason: format!("{bytes} bytes do not fit usize"),
        })
    }
}
