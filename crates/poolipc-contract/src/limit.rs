//! The rung decision input: whether an allocation may go by pool pointer at all.

use crate::types::Span;

/// The rule that decides whether an allocation may be offered for pointer import
/// ([`crate::Invariant::ImportLimit`]): the `chunk_bytes` chunks that `[ptr, ptr + bytes)`
/// touches must number at most `max_chunks`. libcuda's pointer import overflows a 128-entry
/// stack array beyond that (DESIGN.md, FACTS.md).
///
/// This mirrors `poolipc_pool::ImportLimit` without depending on it: the facade builds one
/// from the other, so the contract crate stays free of the rest of poolipc.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct PointerLimit {
    chunk_bytes: u64,
    max_chunks: u64,
}

/// 32 MiB, the pool's chunk size.
pub const CHUNK_BYTES: u64 = 32 << 20;
/// 128 chunks, the most one pointer import may touch.
pub const MAX_CHUNKS: u64 = 128;

impl Default for PointerLimit {
    /// 32 MiB chunks, at most 128 of them.
    fn default() -> Self {
        PointerLimit {
            chunk_bytes: CHUNK_BYTES,
            max_chunks: MAX_CHUNKS,
        }
    }
}

impl PointerLimit {
    /// A rule with another chunk size or maximum. `None` when `chunk_bytes` is zero.
    #[must_use]
    pub fn new(chunk_bytes: u64, max_chunks: u64) -> Option<PointerLimit> {
        (chunk_bytes > 0).then_some(PointerLimit {
            chunk_bytes,
            max_chunks,
        })
    }

    /// The chunk size of the rule.
    #[must_use]
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes.max(1)
    }

    /// The most chunks an importable allocation may touch.
    #[must_use]
    pub fn max_chunks(&self) -> u64 {
        self.max_chunks
    }

    /// The chunks that `span` touches; an empty span touches none. `None` when the span
    /// wraps the address space (such a span is never importable).
    #[must_use]
    pub fn chunks_touched(&self, span: Span) -> Option<u64> {
        if span.bytes == 0 {
            return Some(0);
        }
        let last = span.ptr.checked_add(span.bytes - 1)?;
        let chunk = self.chunk_bytes();
        Some(last / chunk - span.ptr / chunk + 1)
    }

    /// Whether an allocation covering `span` may be offered for pointer import.
    #[must_use]
    pub fn admits(&self, span: Span) -> bool {
        self.chunks_touched(span)
            .is_some_and(|chunks| chunks <= self.max_chunks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn an_aligned_allocation_of_exactly_128_chunks_is_admitted() {
        let limit = PointerLimit::default();
        assert!(limit.admits(Span {
            ptr: 0,
            bytes: 128 * 32 * MIB
        }));
    }

    #[test]
    fn an_unaligned_allocation_of_128_chunks_touches_129_and_is_refused() {
        let limit = PointerLimit::default();
        let span = Span {
            ptr: 4096,
            bytes: 128 * 32 * MIB,
        };
        assert_eq!(limit.chunks_touched(span), Some(129));
        assert!(!limit.admits(span));
    }

    #[test]
    fn a_span_that_wraps_the_address_space_is_refused() {
        let limit = PointerLimit::default();
        assert!(!limit.admits(Span {
            ptr: u64::MAX,
            bytes: 2
        }));
    }

    #[test]
    fn a_zero_chunk_size_is_no_rule() {
        assert!(PointerLimit::new(0, 128).is_none());
    }
}
