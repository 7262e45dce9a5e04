//! The pool's `xtensor=` option (elastic pages per dp rank, issue 17) and its figures: the option
//! is a dict `{"blocks_per_page": int, "page_bytes": int, "spare_pages": int,
//! "memory_limit": int | None, "backend": "accounting" | "host"}` (only `blocks_per_page`
//! required), each key validated under `xtensor.<key>` (R29), an unknown key a `TypeError`.

use kvpool::{PageBackendKind, XTensorOptions, XTensorRankStats};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::convert;
use crate::errors::{type_error, value_error};

/// The keys the option takes.
const KEYS: &[&str] = &[
    "blocks_per_page",
    "page_bytes",
    "spare_pages",
    "memory_limit",
    "backend",
];

/// `xtensor=`: None (fixed memory) or the dict of the module doc.
pub(crate) fn xtensor_option(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<XTensorOptions>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let dict = obj.cast::<PyDict>().map_err(|_| {
        type_error(
            "xtensor",
            format!(
                "must be a dict with blocks_per_page (and page_bytes, spare_pages, memory_limit, \
                 backend), got {}",
                obj.get_type()
            ),
        )
    })?;
    for key in dict.keys() {
        let name = key
            .cast::<PyString>()
            .map(|k| k.to_string())
            .unwrap_or_default();
        if !KEYS.contains(&name.as_str()) {
            return Err(PyTypeError::new_err(format!(
                "xtensor: unexpected key {key:?}; the keys are {}",
                KEYS.join(", ")
            )));
        }
    }
    let get = |key: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        Ok(dict.get_item(key)?.filter(|v| !v.is_none()))
    };
    let Some(blocks_per_page) = get("blocks_per_page")? else {
        return Err(type_error("xtensor", "needs the key blocks_per_page"));
    };
    let mut options =
        XTensorOptions::new(convert::count(&blocks_per_page, "xtensor.blocks_per_page")?);
    if let Some(v) = get("page_bytes")? {
        options.page_bytes = convert::uint64(&v, "xtensor.page_bytes")?;
    }
    if let Some(v) = get("spare_pages")? {
        options.spare_pages = convert::count(&v, "xtensor.spare_pages")?;
    }
    if let Some(v) = get("memory_limit")? {
        options.memory_limit = Some(convert::uint64(&v, "xtensor.memory_limit")?);
    }
    if let Some(v) = get("backend")? {
        let kind: String = v.extract().map_err(|_| {
            type_error(
                "xtensor.backend",
                format!("must be 'accounting' or 'host', got {}", v.get_type()),
            )
        })?;
        options.backend = match kind.as_str() {
            "accounting" => PageBackendKind::Accounting,
            "host" => PageBackendKind::Host,
            other => {
                return Err(value_error(
                    "xtensor.backend",
                    format!("must be 'accounting' or 'host', got {other:?}"),
                ))
            }
        };
    }
    Ok(Some(options))
}

/// The option as the dict it was given as (defaults filled in).
pub(crate) fn options_dict<'py>(
    py: Python<'py>,
    options: &XTensorOptions,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("blocks_per_page", options.blocks_per_page)?;
    d.set_item("page_bytes", options.page_bytes)?;
    d.set_item("spare_pages", options.spare_pages)?;
    d.set_item("memory_limit", options.memory_limit)?;
    let backend = match options.backend {
        PageBackendKind::Accounting => "accounting",
        PageBackendKind::Host => "host",
        PageBackendKind::Custom => "custom",
    };
    d.set_item("backend", backend)?;
    Ok(d)
}

/// One rank's (or the total's) mapped-memory dict.
pub(crate) fn xtensor_dict<'py>(
    py: Python<'py>,
    stats: &XTensorRankStats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let mut result = Ok(());
    stats.visit(|key, value| {
        if result.is_ok() {
            result = d.set_item(key, value);
        }
    });
    result.map(|()| d)
}
