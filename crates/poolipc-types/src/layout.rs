//! [`Layout`]: how a tensor lies in its memory, the one description a lent tensor carries from
//! the caller's input to the worker's view, through the contract and the wire, without being
//! rebuilt on the way.

use std::fmt;

use crate::DType;

/// How a tensor lies in its memory: element type, the size of each dimension, and the stride
/// of each dimension in elements (row-major when `strides` is empty). The same value travels
/// from the caller's input to the worker's view: the facade fills the strides in before it
/// goes on the wire, so a worker always sees as many strides as dimensions.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    /// Element type.
    pub dtype: DType,
    /// Size of each dimension.
    pub shape: Vec<u64>,
    /// Stride of each dimension in elements; empty means contiguous (row-major).
    pub strides: Vec<i64>,
}

/// Why a [`Layout`] has no extent: what a framework could not describe either.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayoutError {
    /// The strides are not one per dimension.
    StrideCount {
        /// Strides given.
        strides: usize,
        /// Dimensions.
        dims: usize,
    },
    /// A dimension above `i64::MAX` (frameworks hold sizes as `i64`: torch, DLPack).
    DimensionTooLarge {
        /// Which dimension.
        dim: usize,
        /// Its size.
        size: u64,
    },
    /// A negative stride (not supported).
    NegativeStride,
    /// The extent does not fit in 64 bits.
    Overflow,
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutError::StrideCount { strides, dims } => {
                write!(f, "{strides} strides for {dims} dimensions")
            }
            LayoutError::DimensionTooLarge { dim, size } => {
                write!(f, "dimension {dim} is {size}, above i64::MAX")
            }
            LayoutError::NegativeStride => f.write_str("negative strides are not supported"),
            LayoutError::Overflow => f.write_str("tensor extent overflows"),
        }
    }
}

impl std::error::Error for LayoutError {}

impl Layout {
    /// A contiguous (row-major) tensor.
    #[must_use]
    pub fn contiguous(dtype: DType, shape: &[u64]) -> Layout {
        Layout {
            dtype,
            shape: shape.to_vec(),
            strides: Vec::new(),
        }
    }

    /// Row-major strides for `shape`, in elements (saturating at `i64::MAX`).
    #[must_use]
    pub fn contiguous_strides(shape: &[u64]) -> Vec<i64> {
        let mut strides = vec![0i64; shape.len()];
        let mut acc: i64 = 1;
        for (s, &d) in strides.iter_mut().zip(shape).rev() {
            *s = acc;
            acc = acc.saturating_mul(i64::try_from(d).unwrap_or(i64::MAX));
        }
        strides
    }

    /// The strides, filled in when contiguous.
    #[must_use]
    pub fn strides_or_contiguous(&self) -> Vec<i64> {
        if self.strides.is_empty() {
            Self::contiguous_strides(&self.shape)
        } else {
            self.strides.clone()
        }
    }

    /// The same layout with its strides filled in (what goes on the wire).
    #[must_use]
    pub fn with_strides(mut self) -> Layout {
        if self.strides.is_empty() {
            self.strides = Self::contiguous_strides(&self.shape);
        }
        self
    }

    /// Bytes from the first element to one past the last one the tensor touches; 0 for a
    /// tensor with a dimension of 0. An error for strides not one per dimension, a dimension
    /// above `i64::MAX`, a negative stride, or an overflow.
    pub fn extent_bytes(&self) -> Result<u64, LayoutError> {
        let filled;
        let strides = if self.strides.is_empty() {
            filled = Self::contiguous_strides(&self.shape);
            &filled
        } else {
            &self.strides
        };
        if strides.len() != self.shape.len() {
            return Err(LayoutError::StrideCount {
                strides: strides.len(),
                dims: self.shape.len(),
            });
        }
        if let Some((dim, &size)) = self
            .shape
            .iter()
            .enumerate()
            .find(|(_, d)| **d > i64::MAX as u64)
        {
            return Err(LayoutError::DimensionTooLarge { dim, size });
        }
        if self.shape.contains(&0) {
            return Ok(0);
        }
        let elem = self.dtype.size_bytes() as u64;
        let mut last: u64 = 0;
        for (&d, &s) in self.shape.iter().zip(strides) {
            let s = u64::try_from(s).map_err(|_| LayoutError::NegativeStride)?;
            last = (d - 1)
                .checked_mul(s)
                .and_then(|x| x.checked_add(last))
                .ok_or(LayoutError::Overflow)?;
        }
        (last + 1).checked_mul(elem).ok_or(LayoutError::Overflow)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_extents_are_the_dense_size() {
        let l = Layout::contiguous(DType::F32, &[2, 3, 4]);
        assert_eq!(l.extent_bytes(), Ok(96));
        assert_eq!(l.strides_or_contiguous(), vec![12, 4, 1]);
        assert_eq!(l.clone().with_strides().strides, vec![12, 4, 1]);
        assert_eq!(Layout::contiguous(DType::U8, &[5, 0]).extent_bytes(), Ok(0));
    }

    #[test]
    fn strided_views_reach_their_last_element() {
        // A transposed 3x4 f32 matrix: last element at 2*1 + 3*3 = 11 elements in.
        let t = Layout {
            dtype: DType::F32,
            shape: vec![3, 4],
            strides: vec![1, 3],
        };
        assert_eq!(t.extent_bytes(), Ok(48));
        // A broadcast (stride 0) touches one row.
        let b = Layout {
            dtype: DType::U8,
            shape: vec![1000, 4],
            strides: vec![0, 1],
        };
        assert_eq!(b.extent_bytes(), Ok(4));
    }

    #[test]
    fn what_no_framework_can_describe_is_an_error_naming_it() {
        let bad = |shape: Vec<u64>, strides: Vec<i64>| Layout {
            dtype: DType::F32,
            shape,
            strides,
        };
        assert_eq!(
            bad(vec![2, 2], vec![1]).extent_bytes(),
            Err(LayoutError::StrideCount {
                strides: 1,
                dims: 2
            })
        );
        assert_eq!(
            bad(vec![2, u64::MAX], vec![]).extent_bytes(),
            Err(LayoutError::DimensionTooLarge {
                dim: 1,
                size: u64::MAX
            })
        );
        assert_eq!(
            bad(vec![2, 2], vec![-2, 1]).extent_bytes(),
            Err(LayoutError::NegativeStride)
        );
        assert_eq!(
            bad(vec![1 << 40, 1 << 40], vec![1 << 40, 1]).extent_bytes(),
            Err(LayoutError::Overflow)
        );
        assert_eq!(
            LayoutError::DimensionTooLarge { dim: 1, size: 9 }.to_string(),
            "dimension 1 is 9, above i64::MAX"
        );
    }
}
