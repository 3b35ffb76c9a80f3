//! Element types as Python names them, and as DLPack and `__cuda_array_interface__` do.

use poolipc::DType;
use pyo3::PyResult;
use pyo3::exceptions::PyValueError;

/// Every dtype with the name torch gives it (`str(torch.float32)` without `torch.`).
const NAMES: [(DType, &str); 17] = [
    (DType::Bool, "bool"),
    (DType::U8, "uint8"),
    (DType::I8, "int8"),
    (DType::I16, "int16"),
    (DType::U16, "uint16"),
    (DType::I32, "int32"),
    (DType::U32, "uint32"),
    (DType::I64, "int64"),
    (DType::U64, "uint64"),
    (DType::F16, "float16"),
    (DType::BF16, "bfloat16"),
    (DType::F32, "float32"),
    (DType::F64, "float64"),
    (DType::F8E4M3FN, "float8_e4m3fn"),
    (DType::F8E5M2, "float8_e5m2"),
    (DType::C64, "complex64"),
    (DType::C128, "complex128"),
];

/// The dtype a Python name means; `torch.` prefixes are accepted.
pub(crate) fn parse(name: &str) -> PyResult<DType> {
    let bare = name.strip_prefix("torch.").unwrap_or(name);
    NAMES
        .iter()
        .find(|(_, n)| *n == bare)
        .map(|(d, _)| *d)
        .ok_or_else(|| {
            let known: Vec<&str> = NAMES.iter().map(|(_, n)| *n).collect();
            PyValueError::new_err(format!(
                "poolipc: unknown dtype {name:?}; known: {}",
                known.join(", ")
            ))
        })
}

/// A dtype as Python gets it: the member of `poolipc.DType` (a `str` enum: equal to its name,
/// printed and `json.dumps`ed as it).
pub(crate) fn value(py: pyo3::Python<'_>, d: DType) -> PyResult<pyo3::Bound<'_, pyo3::PyAny>> {
    use pyo3::types::PyAnyMethods as _;
    // The class, imported once (every view's `dtype` asks for it).
    static CLASS: pyo3::sync::PyOnceLock<pyo3::Py<pyo3::types::PyType>> =
        pyo3::sync::PyOnceLock::new();
    CLASS
        .import(py, "poolipc._types", "DType")?
        .call1((name(d),))
}

/// The Python name of a dtype.
pub(crate) fn name(d: DType) -> &'static str {
    NAMES
        .iter()
        .find(|(x, _)| *x == d)
        .map_or("unknown", |(_, n)| n)
}

/// DLPack type codes (`DLDataTypeCode` in dlpack.h).
const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;
const DL_COMPLEX: u8 = 5;
const DL_BOOL: u8 = 6;

/// `(code, bits)` of the dtype in DLPack, or `None` where this module does not export it
/// (the float8 codes differ between DLPack versions and consumers).
pub(crate) fn dlpack(d: DType) -> Option<(u8, u8)> {
    let bits = u8::try_from(d.size_bytes() * 8).ok()?;
    let code = match d {
        DType::Bool => DL_BOOL,
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => DL_UINT,
        DType::I8 | DType::I16 | DType::I32 | DType::I64 => DL_INT,
        DType::F16 | DType::F32 | DType::F64 => DL_FLOAT,
        DType::BF16 => DL_BFLOAT,
        DType::C64 | DType::C128 => DL_COMPLEX,
        _ => return None,
    };
    Some((code, bits))
}

/// The `__cuda_array_interface__` typestr, or `None` for types numpy has no code for
/// (bfloat16, float8): those go by DLPack only.
pub(crate) fn typestr(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::Bool => "|b1",
        DType::U8 => "|u1",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::U16 => "<u2",
        DType::I32 => "<i4",
        DType::U32 => "<u4",
        DType::I64 => "<i8",
        DType::U64 => "<u8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::C64 => "<c8",
        DType::C128 => "<c16",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_has_a_name_that_parses_back() {
        for d in DType::ALL {
            assert_eq!(parse(name(d)).ok(), Some(d));
        }
        assert_eq!(parse("torch.bfloat16").ok(), Some(DType::BF16));
    }

    #[test]
    fn dlpack_codes_follow_dlpack_h() {
        assert_eq!(dlpack(DType::F32), Some((2, 32)));
        assert_eq!(dlpack(DType::BF16), Some((4, 16)));
        assert_eq!(dlpack(DType::I64), Some((0, 64)));
        assert_eq!(dlpack(DType::Bool), Some((6, 8)));
        assert_eq!(dlpack(DType::F8E5M2), None);
    }
}
