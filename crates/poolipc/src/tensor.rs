//! What a tensor is: its [`Layout`] (`poolipc-types`', the one description a lent tensor
//! carries from the caller's input to the worker's view), where it lies on the wire, a result's
//! shape, and the rungs (`poolipc-types`' [`Rung`], re-exported here).

use poolipc_transport::TensorMeta;
use poolipc_types::{DType, LayoutError};
pub use poolipc_types::{Layout, Rung};

use crate::error::Error;

/// Where a tensor of `layout` lies in its allocation, as the contract and the wire carry it:
/// the same [`Layout`], strides filled in.
pub(crate) fn meta(layout: &Layout, byte_offset: u64, byte_len: u64) -> TensorMeta {
    TensorMeta {
        layout: layout.clone().with_strides(),
        byte_offset,
        byte_len,
    }
}

impl From<LayoutError> for Error {
    fn from(e: LayoutError) -> Error {
        Error::InvalidTensor(e.to_string())
    }
}

/// A result the worker will produce, announced before the parent allocates it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResultShape {
    /// Element type.
    pub dtype: DType,
    /// Size of each dimension; results are contiguous.
    pub shape: Vec<u64>,
}

impl ResultShape {
    /// A result of this dtype and shape.
    #[must_use]
    pub fn new(dtype: DType, shape: &[u64]) -> ResultShape {
        ResultShape {
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// Its size in bytes, or an error on overflow.
    pub fn bytes(&self) -> Result<u64, Error> {
        self.shape
            .iter()
            .try_fold(self.dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| Error::InvalidTensor(format!("result shape {:?} overflows", self.shape)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_are_row_major() {
        assert_eq!(Layout::contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
    }

    #[test]
    fn the_extent_of_a_view_counts_its_last_element() {
        let t = Layout {
            dtype: DType::F32,
            shape: vec![2, 3],
            strides: vec![8, 1],
        };
        assert_eq!(t.extent_bytes().unwrap(), (8 + 2 + 1) * 4);
        let c = Layout::contiguous(DType::BF16, &[5, 7]);
        assert_eq!(c.extent_bytes().unwrap(), 70);
        assert_eq!(
            Layout::contiguous(DType::I64, &[0, 9])
                .extent_bytes()
                .unwrap(),
            0
        );
    }

    #[test]
    fn bad_layouts_are_clear_errors() {
        let neg = Layout {
            dtype: DType::F32,
            shape: vec![2],
            strides: vec![-1],
        };
        assert!(
            neg.extent_bytes()
                .unwrap_err()
                .to_string()
                .contains("negative strides")
        );
        let wrong = Layout {
            dtype: DType::F32,
            shape: vec![2, 2],
            strides: vec![1],
        };
        assert!(
            wrong
                .extent_bytes()
                .unwrap_err()
                .to_string()
                .contains("1 strides for 2")
        );
        let huge = ResultShape::new(DType::F64, &[u64::MAX, 2]);
        assert!(huge.bytes().is_err());
    }
}
