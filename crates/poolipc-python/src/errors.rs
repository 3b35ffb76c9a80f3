//! The Python exceptions, and how the facade's errors become them.

use pyo3::PyErr;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};

create_exception!(
    poolipc,
    PoolipcError,
    PyRuntimeError,
    "A poolipc operation failed; the message names the call and the reason."
);
create_exception!(
    poolipc,
    JobFailedError,
    PoolipcError,
    "A job failed because its worker died, hung up, missed a deadline or reported an error. \
     The parent released what the job held and goes on serving other workers."
);
create_exception!(
    poolipc,
    ExpiredViewError,
    PoolipcError,
    "A view or result buffer was used after its job ended: the memory belongs to the parent again."
);

/// The Python exception for a facade error.
pub(crate) fn to_py(e: poolipc::Error) -> PyErr {
    let text = format!("poolipc: {e}");
    match e {
        poolipc::Error::JobFailed { .. } | poolipc::Error::Worker { .. } => {
            JobFailedError::new_err(text)
        }
        poolipc::Error::InvalidTensor(_) => PyValueError::new_err(text),
        _ => PoolipcError::new_err(text),
    }
}

/// A [`PoolipcError`] with this message.
pub(crate) fn err(msg: impl Into<String>) -> PyErr {
    PoolipcError::new_err(msg.into())
}
