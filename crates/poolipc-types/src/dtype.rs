//! A tensor's element type.

/// Element type of a tensor. The numbers are the wire values and never change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[non_exhaustive]
#[repr(u8)]
#[allow(missing_docs)] // the names say it
pub enum DType {
    Bool = 1,
    U8 = 2,
    I8 = 3,
    I16 = 4,
    U16 = 5,
    I32 = 6,
    U32 = 7,
    I64 = 8,
    U64 = 9,
    F16 = 10,
    BF16 = 11,
    F32 = 12,
    F64 = 13,
    F8E4M3FN = 14,
    F8E5M2 = 15,
    C64 = 16,
    C128 = 17,
}

impl DType {
    /// Every dtype, in wire order.
    pub const ALL: [DType; 17] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::U16,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::F8E4M3FN,
        DType::F8E5M2,
        DType::C64,
        DType::C128,
    ];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3FN | DType::F8E5M2 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }

    /// Bytes per element, as a `u64` for size arithmetic.
    #[must_use]
    pub fn size(self) -> u64 {
        self.size_bytes() as u64
    }

    /// The dtype with this wire value.
    pub fn from_wire(v: u8) -> Option<Self> {
        Self::ALL.iter().copied().find(|d| *d as u8 == v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_through_its_wire_number() {
        for d in DType::ALL {
            assert_eq!(DType::from_wire(d as u8), Some(d));
            assert_eq!(d.size(), d.size_bytes() as u64);
        }
        assert_eq!(DType::from_wire(0), None);
        assert_eq!(DType::from_wire(18), None);
    }
}
