//! Argument conversion shared by every binding: token ids, extra keys, counts, flags.
//!
//! One rule for bools (F10): a bool is never an integer argument (a count, a token id, an id,
//! a seed: `TypeError`), and a flag (`enable_prefix_cache`, `concurrent`, ...) must be a bool.
//! Every error names its argument (R29); an int out of range is a `ValueError` (negative) or an
//! `OverflowError` (too large), never a `TypeError`.

use numpy::{PyArrayDescrMethods, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString};

use crate::errors::{type_error, value_error};

const TOKENS_TYPE: &str = "must be a sequence of ints or a 1-D integer numpy array";

/// An integer element type a token array may have.
trait TokenElement: numpy::Element + Copy {
    /// The value as u64; a negative value sign-extends, so its high bits are set.
    fn widen(self) -> u64;
}

macro_rules! token_element {
    ($($t:ty),*) => {$(
        impl TokenElement for $t {
            #[inline]
            fn widen(self) -> u64 {
                // Signed types sign-extend through i64 (negative -> high bits set).
                self as i64 as u64
            }
        }
    )*};
}
token_element!(i64, i32, i16, i8, u32, u16, u8);

impl TokenElement for u64 {
    #[inline]
    fn widen(self) -> u64 {
        self
    }
}

fn from_array<T: TokenElement>(obj: &Bound<'_, PyAny>, name: &str) -> Option<PyResult<Vec<u32>>> {
    let array = obj.cast::<numpy::PyArray1<T>>().ok()?;
    let array = match array.try_readonly() {
        Ok(array) => array,
        Err(e) => return Some(Err(value_error(name, e.to_string()))),
    };
    let out_of_range = || value_error(name, "token ids must be in [0, 2**32)");
    Some(match array.as_slice() {
        // Contiguous: an OR over the values has high bits set iff one is out of range; both
        // loops vectorize.
        Ok(values) => {
            if values.iter().fold(0u64, |bits, v| bits | v.widen()) >> 32 == 0 {
                Ok(values.iter().map(|v| v.widen() as u32).collect())
            } else {
                Err(out_of_range())
            }
        }
        Err(_) => array
            .as_array()
            .iter()
            .map(|v| u32::try_from(v.widen()).map_err(|_| out_of_range()))
            .collect(),
    })
}

/// Token ids from a list/tuple of ints or a 1-D integer numpy array (u32 range, R6).
pub fn tokens(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    // Lists first: the common case. A list of Python ints is read item by item.
    if let Ok(list) = obj.cast::<PyList>() {
        if let Some(tokens) = tokens_from_list(list, 0) {
            return Ok(tokens);
        }
        return tokens_fallback(obj, name);
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_error(name, TOKENS_TYPE));
    }
    if let Ok(array) = obj.cast::<numpy::PyUntypedArray>() {
        let dtype = array.dtype();
        if matches!(dtype.kind(), b'i' | b'u') && dtype.is_native_byteorder() == Some(false) {
            // A big-endian (non-native) integer array: read it in native order (F10).
            let native_dtype = dtype.call_method1("newbyteorder", ("=",))?;
            let native = obj.call_method1("astype", (native_dtype,))?;
            return tokens(&native, name);
        }
        // Dispatch on the dtype with casts (no Python exception built per failed try).
        let converted = from_array::<i32>(obj, name)
            .or_else(|| from_array::<i64>(obj, name))
            .or_else(|| from_array::<u32>(obj, name))
            .or_else(|| from_array::<u64>(obj, name))
            .or_else(|| from_array::<i16>(obj, name))
            .or_else(|| from_array::<u16>(obj, name))
            .or_else(|| from_array::<u8>(obj, name))
            .or_else(|| from_array::<i8>(obj, name));
        return converted.unwrap_or_else(|| {
            Err(type_error(
                name,
                format!(
                    "numpy array must be 1-D with an integer dtype, got {}-D {}",
                    array.ndim(),
                    array.dtype()
                ),
            ))
        });
    }
    tokens_fallback(obj, name)
}

/// The token ids of `obj` (as [`tokens`] reads them) from index `start` on: a list is read
/// from `start` only (an engine's growing token list, synced without a slice); `obj` shorter
/// than `start` is a `ValueError` naming `name`.
pub fn tokens_from(obj: &Bound<'_, PyAny>, start: usize, name: &str) -> PyResult<Vec<u32>> {
    let short = |len: usize| {
        value_error(
            name,
            format!("must hold at least the sequence's {start} tokens, got {len}"),
        )
    };
    if let Ok(list) = obj.cast::<PyList>() {
        if list.len() < start {
            return Err(short(list.len()));
        }
        if let Some(tokens) = tokens_from_list(list, start) {
            return Ok(tokens);
        }
    }
    let mut all = tokens(obj, name)?;
    if all.len() < start {
        return Err(short(all.len()));
    }
    all.drain(..start);
    Ok(all)
}

/// The ints of `list` from index `start` on if every one is an int (not a bool) in the u32
/// range, else `None` (the caller then finds which error to raise). This loop runs once per
/// token of every batch call, so it reads the list through the C API directly instead of
/// pyo3's iterator and `extract`.
fn tokens_from_list(list: &Bound<'_, PyList>, start: usize) -> Option<Vec<u32>> {
    let py = list.py();
    let len = list.len();
    let mut out = Vec::with_capacity(len.saturating_sub(start));
    for i in start..len {
        // SAFETY: the GIL is held (`Bound`) and `i < len(list)`: nothing in this loop runs
        // Python code (PyLong_AsUnsignedLong reads an int's digits and never calls `__index__`;
        // on a non-int it only sets TypeError), so the list cannot change under us and the
        // borrowed item stays alive until we are done with it. Index conversion: `len` came
        // from the list, so it fits a Py_ssize_t.
        let value = unsafe {
            let item = pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t);
            if item.is_null() {
                let _ = PyErr::take(py);
                return None;
            }
            if pyo3::ffi::PyBool_Check(item) != 0 {
                return None; // a bool is not a token id (F10)
            }
            pyo3::ffi::PyLong_AsUnsignedLong(item)
        };
        if value == std::os::raw::c_ulong::MAX && PyErr::take(py).is_some() {
            return None; // not an int, negative, or beyond an unsigned long
        }
        out.push(u32::try_from(value).ok()?);
    }
    Some(out)
}

/// Any other iterable (tuples included), item by item: bools and non-ints are a `TypeError`,
/// ints out of range a `ValueError`.
fn tokens_fallback(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    if !obj.hasattr("__iter__")? {
        return Err(type_error(name, TOKENS_TYPE));
    }
    let iter = obj.try_iter().map_err(|_| type_error(name, TOKENS_TYPE))?;
    let mut out = Vec::new();
    for item in iter {
        let item = item?;
        if item.is_instance_of::<PyBool>() {
            return Err(type_error(name, "token ids must be ints, got bool"));
        }
        if !(item.is_instance_of::<PyInt>() || item.hasattr("__index__")?) {
            return Err(type_error(name, TOKENS_TYPE));
        }
        match item.extract::<u32>() {
            Ok(token) => out.push(token),
            Err(_) => return Err(value_error(name, "token ids must be in [0, 2**32)")),
        }
    }
    Ok(out)
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
            if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
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
    if obj.is_instance_of::<PyBool>()
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

/// An integer in `[0, 2**bits)` of an unsigned type: `ValueError` below 0, `OverflowError`
/// above (both naming the argument).
fn unsigned<T: TryFrom<i128>>(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<T> {
    let value = int(obj, name)?;
    if value < 0 {
        return Err(value_error(name, format!("must be >= 0, got {value}")));
    }
    T::try_from(value).map_err(|_| {
        pyo3::exceptions::PyOverflowError::new_err(format!("{name}: {value} is too large"))
    })
}

/// A count (`>= 0`), named in errors.
pub fn count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    unsigned(obj, name)
}

/// A 64-bit unsigned id (`seq_id`), named in errors.
pub fn uint64(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    unsigned(obj, name)
}

/// An optional count: None stays None.
pub fn optional_count(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<usize>> {
    match obj {
        Some(obj) if !obj.is_none() => count(obj, name).map(Some),
        _ => Ok(None),
    }
}

/// A parameter with a default whose value, when given, is always checked, None included.
///
/// pyo3 hands an `Option` parameter `None` both when the argument is missing and when it is
/// Python's None, so a flag or a count whose default is not None (its stub says `bool = True`,
/// `int = 0`) takes this instead: a None given there is a `TypeError` naming it, as a bool given
/// for a count is (R29, "One rule for bools").
pub enum Given<'py> {
    /// Not passed: the default applies.
    Missing,
    /// Passed (None included).
    Value(Bound<'py, PyAny>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Given<'py> {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self::Value(obj.to_owned()))
    }
}

impl<'py> Given<'py> {
    /// The value given, if any (a given None is `Some`).
    pub fn value(&self) -> Option<&Bound<'py, PyAny>> {
        match self {
            Self::Missing => None,
            Self::Value(value) => Some(value),
        }
    }

    /// A count (`>= 0`), `default` when not given; None, a bool or a float given is a
    /// `TypeError` naming `name`.
    pub fn count(&self, name: &str, default: usize) -> PyResult<usize> {
        self.value().map_or(Ok(default), |value| count(value, name))
    }

    /// A flag, `default` when not given ([`flag`]; None given is a `TypeError`).
    pub fn flag(&self, name: &str, default: bool) -> PyResult<bool> {
        flag(self.value(), name, default)
    }
}

/// A flag: a bool (or numpy bool), `default` when not given; anything else (None included) is
/// a `TypeError` naming the option (F10).
pub fn flag(obj: Option<&Bound<'_, PyAny>>, name: &str, default: bool) -> PyResult<bool> {
    let Some(obj) = obj else {
        return Ok(default);
    };
    let numpy_bool = || -> PyResult<bool> {
        let kind = obj.get_type();
        Ok(kind.module()?.to_str()? == "numpy" && kind.name()?.to_str()?.starts_with("bool"))
    };
    if obj.is_instance_of::<PyBool>() || numpy_bool()? {
        return obj.extract::<bool>();
    }
    Err(type_error(
        name,
        format!("must be a bool, got {}", obj.get_type().name()?),
    ))
}

/// The hasher of `hash_seed` (None: the default seed) truncated to `debug_hash_bits` (1..=128)
/// when given.
pub fn hasher(
    hash_seed: Option<&Bound<'_, PyAny>>,
    debug_hash_bits: Option<&Bound<'_, PyAny>>,
) -> PyResult<kvpool::BlockHasher> {
    let seed = self::hash_seed(hash_seed)?;
    // Validated below, naming the value given (F10).
    match optional_count(debug_hash_bits, "debug_hash_bits")? {
        None => Ok(kvpool::BlockHasher::new(seed)),
        Some(bits) if (1..=128).contains(&bits) => {
            Ok(kvpool::BlockHasher::with_debug_bits(seed, bits as u32))
        }
        Some(bits) => Err(value_error(
            "debug_hash_bits",
            format!("must be in 1..=128, got {bits}"),
        )),
    }
}

/// A str option (`name` in errors), `default` when not given or None.
pub fn choice(value: Option<&Bound<'_, PyAny>>, name: &str, default: &str) -> PyResult<String> {
    match value {
        Some(v) if !v.is_none() => v
            .extract::<String>()
            .map_err(|_| type_error(name, "must be a str")),
        _ => Ok(default.to_owned()),
    }
}

/// A float argument (a clock), named in errors.
pub fn seconds(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(crate::errors::type_error(
            name,
            "must be a number, got bool",
        ));
    }
    obj.extract::<f64>().map_err(|_| {
        crate::errors::type_error(name, format!("must be a number, got {}", type_name(obj)))
    })
}

pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}
