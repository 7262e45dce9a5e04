//! Python exceptions and the mapping of core errors onto them (R29).

use kvpool::KvPoolError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    kvpool,
    KVPoolError,
    PyException,
    "Base class of kvpool's own errors."
);
create_exception!(
    kvpool,
    OutOfBlocksError,
    KVPoolError,
    "A manager cannot hand out the blocks asked for; nothing was changed."
);
create_exception!(
    kvpool,
    InvariantError,
    KVPoolError,
    "check() found a structure that breaks one of kvpool's rules."
);

/// Maps a core error onto its Python exception.
pub fn to_py(error: KvPoolError) -> PyErr {
    match &error {
        KvPoolError::OutOfBlocks { .. } => OutOfBlocksError::new_err(error.to_string()),
        KvPoolError::InvalidArgument { .. } => PyValueError::new_err(error.to_string()),
        KvPoolError::Invariant(_) => InvariantError::new_err(error.to_string()),
        KvPoolError::PageBackend(_) => KVPoolError::new_err(error.to_string()),
    }
}

/// `ValueError("name: message")`.
pub fn value_error(name: &str, message: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{name}: {message}"))
}

/// `TypeError("name: message")`.
pub fn type_error(name: &str, message: impl std::fmt::Display) -> PyErr {
    PyTypeError::new_err(format!("{name}: {message}"))
}

/// Extension trait: `.py()` maps a core result.
pub trait IntoPyResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for kvpool::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
