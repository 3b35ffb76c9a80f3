//! What `NativeParent` takes from Python to lend or to allocate: the inputs as the Python
//! wrapper describes them, checked into the facade's [`Input`]s, and the shape of a buffer.

use poolipc::{DType, DevicePtr, Input, Layout, ResultShape};
use pyo3::prelude::*;

use crate::dtype;
use crate::errors::value_err;

/// The shape of a buffer of `nbytes` of `dtype`: `shape` when its elements take exactly
/// `nbytes`, one dimension when none is given; a `ValueError` otherwise.
pub(super) fn buffer_shape(
    nbytes: u64,
    dtype: DType,
    shape: Option<Vec<u64>>,
) -> PyResult<Vec<u64>> {
    let elem = dtype.size_bytes() as u64;
    let name = dtype::name(dtype);
    if nbytes == 0 {
        return Err(value_err("poolipc: nbytes=0: nothing to allocate"));
    }
    match shape {
        None if nbytes.is_multiple_of(elem) => Ok(vec![nbytes / elem]),
        None => Err(value_err(format!(
            "poolipc: {nbytes} bytes are no whole number of {name} elements ({elem} bytes each)"
        ))),
        Some(shape) => {
            let covers = ResultShape::new(dtype, &shape).bytes().ok() == Some(nbytes);
            if covers {
                Ok(shape)
            } else {
                Err(value_err(format!(
                    "poolipc: shape {shape:?} of {name} does not take {nbytes} bytes"
                )))
            }
        }
    }
}

/// One input as the Python wrapper describes it: `(ptr, dtype, shape, strides or None)`.
pub(super) type InputSpec = (u64, String, Vec<u64>, Option<Vec<i64>>);

/// The inputs, each lent read-only where `read_only` says so (None: all writable; else one
/// flag per input, a `ValueError` when the counts differ).
pub(super) fn parse_inputs(
    specs: Vec<InputSpec>,
    read_only: Option<Vec<bool>>,
) -> PyResult<Vec<Input>> {
    let flags = match read_only {
        None => vec![false; specs.len()],
        Some(f) if f.len() == specs.len() => f,
        Some(f) => {
            return Err(value_err(format!(
                "poolipc: read_only has {} flags for {} inputs",
                f.len(),
                specs.len()
            )));
        }
    };
    specs
        .into_iter()
        .zip(flags)
        .enumerate()
        .map(|(i, ((ptr, dt, shape, strides), read_only))| {
            let dtype = dtype::parse(&dt)
                .map_err(|e| value_err(format!("poolipc: input {i}: {}", e_text(&e))))?;
            if let Some(s) = &strides {
                if s.len() != shape.len() {
                    return Err(value_err(format!(
                        "poolipc: input {i}: {} strides for {} dimensions",
                        s.len(),
                        shape.len()
                    )));
                }
                if s.iter().any(|&x| x < 0) {
                    return Err(value_err(format!(
                        "poolipc: input {i}: negative strides are not supported (a flip() \
                         view, strides {s:?}); pass a .contiguous() copy"
                    )));
                }
            }
            Ok(Input {
                ptr: DevicePtr(ptr),
                desc: Layout {
                    dtype,
                    shape,
                    strides: strides.unwrap_or_default(),
                },
                read_only,
            })
        })
        .collect()
}

/// An exception's text without the `poolipc: ` its message starts with.
fn e_text(e: &PyErr) -> String {
    Python::attach(|py| {
        let s = e.value(py).to_string();
        s.strip_prefix("poolipc: ").map(str::to_owned).unwrap_or(s)
    })
}
