//! Fuzzes the frame decoder of `poolipc-transport`.
//!
//! Checks, for any input:
//! - decoding returns `Ok` or a typed error, never panics;
//! - what the decoder allocates stays proportional to the input (at most `ALLOC_FACTOR` bytes
//!   per input byte, plus a little): counts are checked against the bytes that remain before
//!   anything is allocated, so a short input cannot claim a huge list;
//! - a frame that decodes re-encodes to exactly the same bytes (the encoding is canonical);
//! - the header path that `Connection::recv` takes agrees with whole-frame decoding.
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use libfuzzer_sys::fuzz_target;
use poolipc_transport::FrameLimits;
use poolipc_transport::codec::{FrameHeader, HEADER_LEN, decode, decode_payload, encode};

/// The in-memory form of an item may be larger than its wire form (a refused grant: 5 bytes on
/// the wire, ~144 in memory), so the bound is a factor, not equality.
const ALLOC_FACTOR: usize = 32;
const ALLOC_SLACK: usize = 1024;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the
// counters are side bookkeeping and never affect what is returned.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as is; `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result with the most bytes it had allocated at once.
fn measured<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (out, peak)
}

fuzz_target!(|data: &[u8]| {
    let limits = FrameLimits::default();
    let (decoded, peak) = measured(|| decode(data, limits));
    assert!(
        peak <= ALLOC_FACTOR * data.len() + ALLOC_SLACK,
        "decoding {} bytes allocated {peak} bytes",
        data.len()
    );

    if let Ok(msg) = &decoded {
        let again = encode(msg, limits).expect("a decoded message re-encodes");
        assert_eq!(again, data, "decode then encode changed the bytes of {msg:?}");
    }

    // The path Connection::recv takes: header first, then the payload it announces.
    if let Some((header, rest)) = data.split_first_chunk::<HEADER_LEN>() {
        if let Ok(h) = FrameHeader::parse(header, limits) {
            if rest.len() == h.payload_len {
                let split = decode_payload(h.tag, rest);
                assert_eq!(split.is_ok(), decoded.is_ok());
            }
        }
    }
});
