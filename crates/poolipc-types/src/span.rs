//! The description of memory both sides speak of.

/// An allocation's device address range `[ptr, ptr + bytes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Span {
    /// The allocation's start address.
    pub ptr: u64,
    /// Its size in bytes.
    pub bytes: u64,
}
