//! What `NativeParent` takes from Python to lend or to allocate: the objects lent, read
//! into the facade's [`Input`]s, and the shape of a buffer.

use poolipc::{DType, DevicePtr, Input, Layout, ResultShape};
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

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

/// The inputs the caller lends, each read once from its object into the facade's [`Input`],
/// lent read-only where `read_only` says so (None: all writable; else one flag per input, a
/// `ValueError` when the counts differ).
///
/// An input is a torch tensor (a CUDA one: `data_ptr()`, which counts the storage offset,
/// `dtype`, `shape`, `stride()` in elements), or any object with `ptr` or `data_ptr()`,
/// `dtype`, `shape` and `strides` (None or absent: contiguous), such as a `poolipc.TensorRef`
/// or a `View`. `dtype` is a `poolipc.DType`, a torch dtype or a name: whatever `str()` makes
/// a name of. Raises `TypeError` for an object that is none of these, `ValueError` for a CPU
/// tensor, an unknown dtype, strides that do not match the shape or are negative.
pub(super) fn read_inputs(
    objects: &[Bound<'_, PyAny>],
    read_only: Option<Vec<bool>>,
) -> PyResult<Vec<Input>> {
    let flags = match read_only {
        None => vec![false; objects.len()],
        Some(f) if f.len() == objects.len() => f,
        Some(f) => {
            return Err(value_err(format!(
                "poolipc: read_only has {} flags for {} inputs",
                f.len(),
                objects.len()
            )));
        }
    };
    let Some(py) = objects.first().map(Bound::py) else {
        return Ok(Vec::new());
    };
    let known = Known {
        tensor: imported_class(py, &TORCH_TENSOR, "torch", "Tensor")?,
        tensor_ref: imported_class(py, &TENSOR_REF, "poolipc._parent", "TensorRef")?,
    };
    objects
        .iter()
        .zip(flags)
        .enumerate()
        .map(|(i, (x, read_only))| read_input(i, x, &known, read_only))
        .collect()
}

/// The classes an input is told apart by, where their modules are imported (an input cannot
/// be an instance of a class whose module is not).
struct Known<'py> {
    /// `torch.Tensor`: read by `data_ptr()`, `stride()`, `is_cuda`.
    tensor: Option<Bound<'py, PyType>>,
    /// `poolipc.TensorRef`: read by its attributes, without looking for a `data_ptr`.
    tensor_ref: Option<Bound<'py, PyType>>,
}

static TORCH_TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static TENSOR_REF: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `module.name`, a class, once `module` is imported (None before); looked up in
/// `sys.modules`, never imported here, and kept in `cache` once found.
fn imported_class<'py>(
    py: Python<'py>,
    cache: &PyOnceLock<Py<PyType>>,
    module: &str,
    name: &str,
) -> PyResult<Option<Bound<'py, PyType>>> {
    if let Some(t) = cache.get(py) {
        return Ok(Some(t.bind(py).clone()));
    }
    // `sys.modules` itself, kept: importing `sys` on every call costs more than the lookup.
    static MODULES: PyOnceLock<Py<PyDict>> = PyOnceLock::new();
    let modules = MODULES.get_or_try_init(py, || {
        let m = py
            .import(intern!(py, "sys"))?
            .getattr(intern!(py, "modules"))?;
        Ok::<_, PyErr>(m.cast_into::<PyDict>()?.unbind())
    })?;
    let Some(m) = modules.bind(py).get_item(module)? else {
        return Ok(None);
    };
    // A module still being imported may not have the class yet: nothing is one then.
    let Some(class) = m.getattr_opt(name)? else {
        return Ok(None);
    };
    let class = class.cast_into::<PyType>()?;
    Ok(Some(
        cache.get_or_init(py, || class.unbind()).bind(py).clone(),
    ))
}

/// Input `i`: its object read into an [`Input`] (see [`read_inputs`]).
fn read_input(
    i: usize,
    x: &Bound<'_, PyAny>,
    known: &Known<'_>,
    read_only: bool,
) -> PyResult<Input> {
    let py = x.py();
    if let Ok(buffer) = x.cast::<super::DeviceBuffer>() {
        // Our own buffer: its fields, without a Python call.
        let b = buffer.get();
        return Ok(Input {
            ptr: DevicePtr(b.ptr()?),
            desc: Layout::contiguous(b.dtype, &b.shape),
            read_only,
        });
    }
    let is_a = |class: &Option<Bound<'_, PyType>>| match class {
        Some(c) => x.is_instance(c),
        None => Ok(false),
    };
    let is_tensor = is_a(&known.tensor)?;
    let (ptr, dtype, shape, strides) = if is_tensor {
        if !x.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
            let device = x.getattr(intern!(py, "device"))?;
            return Err(value_err(format!(
                "poolipc: a {device} tensor cannot be lent; lend CUDA tensors"
            )));
        }
        (
            x.call_method0(intern!(py, "data_ptr"))?.extract::<u64>()?,
            dtype_of(i, &x.getattr(intern!(py, "dtype"))?)?,
            x.getattr(intern!(py, "shape"))?.extract::<Vec<u64>>()?,
            Some(
                x.call_method0(intern!(py, "stride"))?
                    .extract::<Vec<i64>>()?,
            ),
        )
    } else {
        let ptr = if is_a(&known.tensor_ref)? {
            Some(x.getattr(intern!(py, "ptr"))?)
        } else {
            match x.getattr_opt(intern!(py, "data_ptr"))? {
                Some(f) if f.is_callable() => Some(f.call0()?),
                _ => x.getattr_opt(intern!(py, "ptr"))?,
            }
        };
        let Some(ptr) = ptr.filter(|p| !p.is_none()) else {
            return Err(PyTypeError::new_err(format!(
                "poolipc: cannot lend {}: give a torch tensor or a TensorRef",
                x.get_type().name()?
            )));
        };
        let dtype = x.getattr(intern!(py, "dtype"))?;
        let strides = x
            .getattr_opt(intern!(py, "strides"))?
            .filter(|s| !s.is_none())
            .map(|s| s.extract::<Vec<i64>>())
            .transpose()?;
        (
            ptr.extract::<u64>()?,
            dtype_of(i, &dtype)?,
            x.getattr(intern!(py, "shape"))?.extract::<Vec<u64>>()?,
            strides,
        )
    };
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
}

/// The dtype object `dtype` of input `i` names (whatever `str()` makes a name of).
///
/// torch's dtypes and `poolipc.DType`'s members are singletons: each is read by name once
/// and then known by identity ([`DTYPE_OBJECTS`]), which saves building and parsing its
/// string for every tensor lent (a microsecond of a round trip's).
fn dtype_of(i: usize, dtype: &Bound<'_, PyAny>) -> PyResult<DType> {
    let mut known = DTYPE_OBJECTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, d)) = known.iter().find(|(o, _)| dtype.is(o)) {
        return Ok(*d);
    }
    let name = dtype.str()?;
    let name = name.to_cow()?;
    let d = dtype::parse(name.strip_prefix("torch.").unwrap_or(&name))
        .map_err(|e| value_err(format!("poolipc: input {i}: {}", e_text(&e))))?;
    // Kept alive by the cache, so no other object can take its address. Strings (a name
    // given as `"float32"`) are not kept: a new one each time would fill it.
    if known.len() < DTYPE_OBJECTS_MAX && !dtype.is_instance_of::<pyo3::types::PyString>() {
        known.push((dtype.clone().unbind(), d));
    }
    Ok(d)
}

/// dtype objects already read (see [`dtype_of`]), at most [`DTYPE_OBJECTS_MAX`].
static DTYPE_OBJECTS: std::sync::Mutex<Vec<(Py<PyAny>, DType)>> = std::sync::Mutex::new(Vec::new());

/// Room for torch's dtypes and `poolipc.DType`'s members with plenty to spare.
const DTYPE_OBJECTS_MAX: usize = 64;

/// An exception's text without the `poolipc: ` its message starts with.
fn e_text(e: &PyErr) -> String {
    Python::attach(|py| {
        let s = e.value(py).to_string();
        s.strip_prefix("poolipc: ").map(str::to_owned).unwrap_or(s)
    })
}
