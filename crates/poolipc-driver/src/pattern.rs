//! A known byte pattern in device memory and the check of an echo answer to it: what the
//! canary battery, `poolipc demo` and the tests write into inputs and read back from results.
//! An echo answer to input `i` is a copy of it whose first 32-bit word is [`marker`]`(i)`.

use crate::{DevicePtr, Driver, Result, StreamHandle};

/// The word an echo answer writes at the start of result `i`.
#[must_use]
pub fn marker(i: usize) -> u32 {
    0xEC40_0000 | (i as u32 & 0xFFFF)
}

/// Fills `[ptr, ptr + bytes)` with the repeating little-endian bytes of `pattern` on
/// `stream`, byte `k` being `pattern.to_le_bytes()[k % 4]`, never touching a byte beyond (the
/// driver refuses a memset past the allocation's size). `ptr` must be 4-byte aligned.
pub fn fill_pattern(
    driver: &dyn Driver,
    ptr: DevicePtr,
    bytes: u64,
    pattern: u32,
    stream: StreamHandle,
) -> Result<()> {
    let words = bytes / 4;
    if words > 0 {
        driver.memset_d32_async(ptr, pattern, words, stream)?;
    }
    let tail = pattern.to_le_bytes();
    for k in words * 4..bytes {
        driver.memset_d8_async(ptr.offset(k), tail[(k % 4) as usize], 1, stream)?;
    }
    Ok(())
}

/// Checks that `[ptr, ptr + bytes)` holds an echo answer to input `i` when that input was
/// filled by [`fill_pattern`] with `pattern` starting `offset` bytes into its allocation: the
/// marker first, the pattern after, sampled (64 KiB) at both ends. The error names the first
/// wrong byte.
pub fn verify_echo(
    driver: &dyn Driver,
    ptr: DevicePtr,
    bytes: u64,
    i: usize,
    pattern: u32,
    offset: u64,
) -> std::result::Result<(), String> {
    let sample = bytes.min(64 * 1024) as usize;
    let pat = pattern.to_le_bytes();
    for start in [0, bytes - sample as u64] {
        let mut buf = vec![0u8; sample];
        driver
            .memcpy_dtoh(&mut buf, ptr.offset(start))
            .map_err(|e| e.to_string())?;
        for (k, b) in buf.iter().enumerate() {
            let at = start + k as u64;
            let want = if at < 4 {
                marker(i).to_le_bytes()[at as usize]
            } else {
                pat[((at + offset) % 4) as usize]
            };
            if *b != want {
                return Err(format!(
                    "byte {at} of result {i} is {b:#04x}, expected {want:#04x}"
                ));
            }
        }
    }
    Ok(())
}
