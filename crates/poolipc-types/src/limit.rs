//! The import limit: which allocations may be offered for pointer import at all.
//!
//! libcuda's `cuMemPoolImportPointer` copies the allocation's whole list of 32 MiB chunk
//! objects into an on-stack array of 128 entries (docs/facts.md, "The import limit"). An
//! allocation touching more than 128 chunks overwrites the importer's stack: silently up to
//! 164 chunks, with a crash above. The safe rule: the 32 MiB chunks that `[ptr, ptr + size)`
//! touches must number at most 128. Chunks are counted from the pointer, not the size alone:
//! an allocation that does not start on a chunk boundary touches one chunk more.
//!
//! The pool enforces it, the contract checks it (its `Invariant::ImportLimit`), and the
//! facade picks the rung by it: one rule, here.

use std::fmt;

use crate::span::Span;

/// A chunk of the pool's physical backing: 32 MiB.
pub const CHUNK_BYTES: u64 = 32 << 20;
/// The most chunks one imported allocation may touch: 128.
pub const MAX_CHUNKS: u64 = 128;

/// The rule deciding whether an allocation may go by pool pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct ImportLimit {
    // Never zero when made by `new` or `default`; read through `chunk_bytes()`, which treats a
    // zero (only `arbitrary` can make one) as one byte so that no division panics.
    chunk_bytes: u64,
    max_chunks: u64,
}

impl Default for ImportLimit {
    /// 32 MiB chunks, at most 128 of them: the rule measured on driver 580.
    fn default() -> Self {
        ImportLimit {
            chunk_bytes: CHUNK_BYTES,
            max_chunks: MAX_CHUNKS,
        }
    }
}

/// An allocation the limit refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitExceeded {
    /// The allocation's start.
    pub ptr: u64,
    /// Its size.
    pub bytes: u64,
    /// The chunks it touches.
    pub chunks: u64,
    /// The chunk size of the rule.
    pub chunk_bytes: u64,
    /// The rule's maximum.
    pub max_chunks: u64,
}

impl fmt::Display for LimitExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "an allocation of {} bytes at {:#x} touches {} chunks of {} bytes; pointer import \
             allows at most {} (libcuda's import overflows its stack beyond)",
            self.bytes, self.ptr, self.chunks, self.chunk_bytes, self.max_chunks
        )
    }
}

impl std::error::Error for LimitExceeded {}

impl ImportLimit {
    /// A rule with another chunk size or maximum (a different driver, a test). Returns `None`
    /// when `chunk_bytes` is zero.
    #[must_use]
    pub fn new(chunk_bytes: u64, max_chunks: u64) -> Option<ImportLimit> {
        (chunk_bytes > 0).then_some(ImportLimit {
            chunk_bytes,
            max_chunks,
        })
    }

    /// No limit at all (a driver where the bug is fixed).
    #[must_use]
    pub fn unlimited() -> ImportLimit {
        ImportLimit {
            chunk_bytes: CHUNK_BYTES,
            max_chunks: u64::MAX,
        }
    }

    /// The chunk size.
    #[must_use]
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes.max(1)
    }

    /// The maximum number of chunks.
    #[must_use]
    pub fn max_chunks(&self) -> u64 {
        self.max_chunks
    }

    /// How many chunks `[ptr, ptr + bytes)` touches. Zero bytes touch none; a range that
    /// would run past the end of the address space counts as touching every chunk to the end.
    #[must_use]
    pub fn chunks_spanned(&self, ptr: u64, bytes: u64) -> u64 {
        if bytes == 0 {
            return 0;
        }
        let chunk = self.chunk_bytes();
        let last = ptr.saturating_add(bytes - 1);
        last / chunk - ptr / chunk + 1
    }

    /// Whether `[ptr, ptr + bytes)` may be offered for pointer import.
    #[must_use]
    pub fn allows(&self, ptr: u64, bytes: u64) -> bool {
        self.chunks_spanned(ptr, bytes) <= self.max_chunks
    }

    /// Whether an allocation covering `span` may be offered for pointer import: as
    /// [`allows`](ImportLimit::allows), and a span that wraps the address space never is.
    #[must_use]
    pub fn admits(&self, span: Span) -> bool {
        let wraps = span.bytes > 0 && span.ptr.checked_add(span.bytes - 1).is_none();
        !wraps && self.allows(span.ptr, span.bytes)
    }

    /// [`allows`](ImportLimit::allows), with the reason when it does not.
    pub fn check(&self, ptr: u64, bytes: u64) -> Result<(), LimitExceeded> {
        let chunks = self.chunks_spanned(ptr, bytes);
        if chunks <= self.max_chunks {
            Ok(())
        } else {
            Err(LimitExceeded {
                ptr,
                bytes,
                chunks,
                chunk_bytes: self.chunk_bytes(),
                max_chunks: self.max_chunks,
            })
        }
    }

    /// The largest allocation starting at `ptr` that the rule allows.
    #[must_use]
    pub fn max_bytes_at(&self, ptr: u64) -> u64 {
        let chunk = self.chunk_bytes();
        let into_chunk = ptr % chunk;
        self.max_chunks
            .saturating_mul(chunk)
            .saturating_sub(into_chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rstest::rstest;

    const MIB: u64 = 1 << 20;
    /// A chunk-aligned address, as pool allocations of 2 MiB and up usually are.
    const ALIGNED: u64 = 0x7f00_0000_0000;

    #[rstest]
    #[case::aligned_4096_mib(ALIGNED, 4096 * MIB, 128, true)]
    #[case::aligned_4097_mib(ALIGNED, 4097 * MIB, 129, false)]
    #[case::unaligned_4096_mib_at_16_mib(ALIGNED + 16 * MIB, 4096 * MIB, 129, false)]
    #[case::unaligned_4080_mib_at_16_mib(ALIGNED + 16 * MIB, 4080 * MIB, 128, true)]
    #[case::aligned_5248_mib_last_measured_good(ALIGNED, 5248 * MIB, 164, false)]
    #[case::a_5248_mib_allocation_at_16_mib(ALIGNED + 16 * MIB, 5248 * MIB, 165, false)]
    #[case::one_byte(ALIGNED + 5, 1, 1, true)]
    #[case::one_byte_across_a_boundary(ALIGNED + 32 * MIB - 1, 2, 2, true)]
    #[case::nothing(ALIGNED, 0, 0, true)]
    fn chunks_are_counted_from_pointer_and_size(
        #[case] ptr: u64,
        #[case] bytes: u64,
        #[case] chunks: u64,
        #[case] allowed: bool,
    ) {
        let limit = ImportLimit::default();
        assert_eq!(limit.chunks_spanned(ptr, bytes), chunks);
        assert_eq!(limit.allows(ptr, bytes), allowed);
        assert_eq!(limit.check(ptr, bytes).is_ok(), allowed);
        assert_eq!(limit.admits(Span { ptr, bytes }), allowed);
    }

    #[test]
    fn the_refusal_says_how_many_chunks_and_why() {
        let e = ImportLimit::default()
            .check(ALIGNED + 16 * MIB, 5248 * MIB)
            .unwrap_err();
        assert_eq!(e.chunks, 165);
        let text = e.to_string();
        assert!(
            text.contains("165 chunks") && text.contains("at most 128"),
            "{text}"
        );
    }

    #[test]
    fn the_limit_is_configurable() {
        let small = ImportLimit::new(MIB, 4).unwrap();
        assert!(small.allows(0, 4 * MIB));
        assert!(!small.allows(0, 4 * MIB + 1));
        assert!(ImportLimit::new(0, 4).is_none());
        assert!(ImportLimit::unlimited().allows(ALIGNED, 64 << 30));
    }

    #[test]
    fn max_bytes_at_depends_on_the_offset_into_the_chunk() {
        let limit = ImportLimit::default();
        assert_eq!(limit.max_bytes_at(ALIGNED), 4096 * MIB);
        assert_eq!(limit.max_bytes_at(ALIGNED + 16 * MIB), 4080 * MIB);
    }

    #[test]
    fn a_range_at_the_end_of_the_address_space_does_not_overflow() {
        let limit = ImportLimit::default();
        assert!(limit.chunks_spanned(u64::MAX - 10, 100) >= 1);
    }

    // From the contract's former `ImportLimit`, now this type.

    #[test]
    fn an_aligned_allocation_of_exactly_128_chunks_is_admitted() {
        let limit = ImportLimit::default();
        assert!(limit.admits(Span {
            ptr: 0,
            bytes: 128 * 32 * MIB
        }));
    }

    #[test]
    fn an_unaligned_allocation_of_128_chunks_touches_129_and_is_refused() {
        let limit = ImportLimit::default();
        let span = Span {
            ptr: 4096,
            bytes: 128 * 32 * MIB,
        };
        assert_eq!(limit.chunks_spanned(span.ptr, span.bytes), 129);
        assert!(!limit.admits(span));
    }

    #[test]
    fn a_span_that_wraps_the_address_space_is_refused() {
        let limit = ImportLimit::default();
        assert!(!limit.admits(Span {
            ptr: u64::MAX,
            bytes: 2
        }));
    }

    #[test]
    fn a_zero_chunk_size_is_no_rule() {
        assert!(ImportLimit::new(0, 128).is_none());
    }

    proptest! {
        #[test]
        fn allowed_ranges_never_touch_more_than_the_maximum(ptr in 0u64..(1 << 48), bytes in 0u64..(8u64 << 30)) {
            let limit = ImportLimit::default();
            let chunks = limit.chunks_spanned(ptr, bytes);
            // Brute force: the first and last chunk indices.
            if bytes > 0 {
                prop_assert_eq!(chunks, (ptr + bytes - 1) / CHUNK_BYTES - ptr / CHUNK_BYTES + 1);
            }
            prop_assert_eq!(limit.allows(ptr, bytes), chunks <= MAX_CHUNKS);
            prop_assert_eq!(limit.allows(ptr, bytes), bytes <= limit.max_bytes_at(ptr));
            prop_assert_eq!(limit.admits(Span { ptr, bytes }), limit.allows(ptr, bytes));
        }
    }
}
