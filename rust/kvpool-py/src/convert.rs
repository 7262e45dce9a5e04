//! Argument conversion shared by every binding: token ids, extra keys, counts.

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};

use crate::errors::{type_error, value_error};

const TOKENS_TYPE: &str = "must be a sequence of ints or a 1-D integer numpy array";

fn from_array<'py, T>(array: PyReadonlyArray1<'py, T>, name: &str) -> PyResult<Vec<u32>>
where
    T: numpy::Element + Copy + TryInto<u32>,
{
    let view = array.as_array();
    let mut out = Vec::with_capacity(view.len());
    for &value in view.iter() {
        out.push(
            value
                .try_into()
                .map_err(|_| value_error(name, "token ids must be in [0, 2**32)"))?,
        );
    }
    Ok(out)
}

/// Token ids from a list/tuple of ints or a 1-D integer numpy array (u32 range, R6).
pub fn tokens(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_error(name, TOKENS_TYPE));
    }
    // Lists and tuples first: the common case, and cheap to recognise.
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        if let Ok(tokens) = obj.extract::<Vec<u32>>() {
            return Ok(tokens);
        }
    } else if obj.cast::<numpy::PyUntypedArray>().is_ok() {
        return tokens_from_array(obj, name);
    }
    if let Ok(tokens) = obj.extract::<Vec<u32>>() {
        return Ok(tokens);
    }
    tokens_fallback(obj, name)
}

fn tokens_from_array(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return from_array(array, name);
    }
    if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return from_array(array, name);
    }
    if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, u32>>() {
        return from_array(array, name);
    }
    if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, u64>>() {
        return from_array(array, name);
    }
    if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, i16>>() {
        return from_array(array, name);
    }
    if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, u16>>() {
        return from_array(array, name);
    }
    if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, u8>>() {
        return from_array(array, name);
    }
    if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, i8>>() {
        return from_array(array, name);
    }
    if let Ok(array) = obj.cast::<numpy::PyUntypedArray>() {
        return Err(type_error(
            name,
            format!(
                "numpy array must be 1-D with an integer dtype, got {}-D {}",
                array.ndim(),
                array.dtype()
            ),
        ));
    }
    Err(type_error(name, TOKENS_TYPE))
}

fn tokens_fallback(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    // Tell out-of-range ints (ValueError) from non-ints (TypeError).
    let iter = obj.try_iter().map_err(|_| type_error(name, TOKENS_TYPE))?;
    for item in iter {
        let item = item?;
        if item.extract::<u32>().is_ok() {
            continue;
        }
        if item.is_instance_of::<PyInt>() || item.hasattr("__index__")? {
            return Err(value_error(name, "token ids must be in [0, 2**32)"));
        }
        return Err(type_error(name, TOKENS_TYPE));
    }
    Err(type_error(name, TOKENS_TYPE))
}

/// An extra key (cache salt): bytes, or str (UTF-8), or None.
pub fn extra_key(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<Vec<u8>>> {
    let Some(obj) = obj else { return Ok(None) };
    if obj.is_none() {
        return Ok(None);
    }
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        return Ok(Some(bytes.as_bytes().to_vec()));
    }
    if let Ok(text) = obj.cast::<PyString>() {
        return Ok(Some(text.to_str()?.as_bytes().to_vec()));
    }
    Err(type_error(
        name,
        format!("must be bytes, str or None, got {}", obj.get_type().name()?),
    ))
}

/// A 64-bit hash seed.
pub fn hash_seed(seed: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
    match seed {
        None => Ok(kvpool::DEFAULT_HASH_SEED),
        Some(obj) if obj.is_none() => Ok(kvpool::DEFAULT_HASH_SEED),
        Some(obj) => {
            if !obj.is_instance_of::<PyInt>() {
                return Err(type_error("hash_seed", "must be an int or None"));
            }
            obj.extract::<u64>()
                .map_err(|_| value_error("hash_seed", "must be in [0, 2**64)"))
        }
    }
}

/// A 16-byte block hash.
pub fn block_hash(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<kvpool::BlockHash> {
    let bytes = obj
        .cast::<PyBytes>()
        .map_err(|_| type_error(name, "must be 16 bytes"))?;
    let array: [u8; 16] = bytes
        .as_bytes()
        .try_into()
        .map_err(|_| value_error(name, "must be exactly 16 bytes"))?;
    Ok(kvpool::BlockHash::from_bytes(array))
}

/// An integer argument (int or anything with `__index__`, bool excluded), named in errors.
pub fn int(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i128> {
    if obj.is_instance_of::<pyo3::types::PyBool>()
        || !(obj.is_instance_of::<PyInt>() || obj.hasattr("__index__")?)
    {
        return Err(type_error(
            name,
            format!("must be an int, got {}", obj.get_type().name()?),
        ));
    }
    obj.extract::<i128>().map_err(|_| {
        pyo3::exceptions::PyOverflowError::new_err(format!("{name}: integer out of range"))
    })
}

/// A count (`>= 0`), named in errors.
pub fn count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let value = int(obj, name)?;
    if value < 0 {
        return Err(value_error(name, format!("must be >= 0, got {value}")));
    }
    usize::try_from(value).map_err(|_| {
        pyo3::exceptions::PyOverflowError::new_err(format!("{name}: {value} is too large"))
    })
}

/// An optional count: None stays None.
pub fn optional_count(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<usize>> {
    match obj {
        Some(obj) if !obj.is_none() => count(obj, name).map(Some),
        _ => Ok(None),
    }
}
