//! What a tensor is on the wire: dtype, shape, strides, offset, bytes; and the rungs
//! (`poolipc-types`' [`Rung`], re-exported here).

use poolipc_transport::TensorMeta;
use poolipc_types::DType;
pub use poolipc_types::Rung;

use crate::error::Error;

/// The layout of a tensor in its allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// Element type.
    pub dtype: DType,
    /// Size of each dimension.
    pub shape: Vec<u64>,
    /// Stride of each dimension in elements; empty means contiguous (row-major).
    pub strides: Vec<i64>,
}

impl TensorDesc {
    /// A contiguous tensor.
    #[must_use]
    pub fn contiguous(dtype: DType, shape: &[u64]) -> TensorDesc {
        TensorDesc {
            dtype,
            shape: shape.to_vec(),
            strides: Vec::new(),
        }
    }

    /// Row-major strides for the shape.
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

    /// Bytes from the first element to one past the last one the tensor touches, or an error
    /// for a dimension above `i64::MAX`, negative strides, overflow, or a stride list of the
    /// wrong length.
    pub fn extent_bytes(&self) -> Result<u64, Error> {
        let strides = self.strides_or_contiguous();
        if strides.len() != self.shape.len() {
            return Err(Error::InvalidTensor(format!(
                "{} strides for {} dimensions",
                strides.len(),
                self.shape.len()
            )));
        }
        // Frameworks hold sizes as i64 (torch, DLPack): a larger one cannot be described.
        if let Some((k, d)) = self
            .shape
            .iter()
            .enumerate()
            .find(|(_, d)| **d > i64::MAX as u64)
        {
            return Err(Error::InvalidTensor(format!(
                "dimension {k} is {d}, above i64::MAX"
            )));
        }
        if self.shape.contains(&0) {
            return Ok(0);
        }
        let elem = self.dtype.size_bytes() as u64;
        let mut last: u64 = 0;
        for (&d, &s) in self.shape.iter().zip(&strides) {
            let s = u64::try_from(s)
                .map_err(|_| Error::InvalidTensor("negative strides are not supported".into()))?;
            last = (d - 1)
                .checked_mul(s)
                .and_then(|x| x.checked_add(last))
                .ok_or_else(|| Error::InvalidTensor("tensor extent overflows".into()))?;
        }
        (last + 1)
            .checked_mul(elem)
            .ok_or_else(|| Error::InvalidTensor("tensor extent overflows".into()))
    }

    pub(crate) fn meta(&self, byte_offset: u64, byte_len: u64) -> TensorMeta {
        TensorMeta {
            dtype: self.dtype,
            shape: self.shape.clone(),
            strides: self.strides_or_contiguous(),
            byte_offset,
            byte_len,
        }
    }

    pub(crate) fn from_meta(m: &TensorMeta) -> TensorDesc {
        TensorDesc {
            dtype: m.dtype,
            shape: m.shape.clone(),
            strides: m.strides.clone(),
        }
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
        assert_eq!(TensorDesc::contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
    }

    #[test]
    fn the_extent_of_a_view_counts_its_last_element() {
        let t = TensorDesc {
            dtype: DType::F32,
            shape: vec![2, 3],
            strides: vec![8, 1],
        };
        assert_eq!(t.extent_bytes().unwrap(), (8 + 2 + 1) * 4);
        let c = TensorDesc::contiguous(DType::BF16, &[5, 7]);
        assert_eq!(c.extent_bytes().unwrap(), 70);
        assert_eq!(
            TensorDesc::contiguous(DType::I64, &[0, 9])
                .extent_bytes()
                .unwrap(),
            0
        );
    }

    #[test]
    fn bad_layouts_are_clear_errors() {
        let neg = TensorDesc {
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
        let wrong = TensorDesc {
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
