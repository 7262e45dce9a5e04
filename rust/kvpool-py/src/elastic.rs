//! The pool's `xtensor=` option (elastic pages per dp rank, docs/xtensor.md) and its figures: the option
//! is a dict `{"blocks_per_page": int, "page_bytes": int, "spare_pages": int,
//! "memory_limit": int | None, "backend": "accounting" | "host" | [object per rank]}` (only
//! `blocks_per_page` required), each key validated under `xtensor.<key>` (R29), an unknown key a
//! `TypeError`. Backend objects (`map_page(page)` / `unmap_page(page)`, e.g.
//! `kvpool.xtensor.CudaPageBackend`) are one per dp rank; their optional `page_bytes`,
//! `blocks_per_page` and `num_pages` attributes are checked against the option.

use kvpool::{PageBackendKind, XTensorOptions, XTensorRankStats};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

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
        let Ok(kind) = v.extract::<String>() else {
            options.backend = PageBackendKind::Custom; // objects: `python_backends`
            return Ok(Some(options));
        };
        options.backend = match kind.as_str() {
            "accounting" => PageBackendKind::Accounting,
            "host" => PageBackendKind::Host,
            other => {
                return Err(value_error(
                    "xtensor.backend",
                    format!(
                        "must be 'accounting', 'host' or a list of backend objects (one per dp \
                         rank), got {other:?}"
                    ),
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

/// The backend objects of an option whose backend is not a name (one per dp rank; one object
/// alone for `dp_size == 1`), checked; `options.page_bytes` taken from them unless the dict gave
/// it. Empty for a named backend.
pub(crate) fn python_backends<'py>(
    obj: Option<&Bound<'py, PyAny>>,
    options: &mut XTensorOptions,
    dp_size: usize,
    num_blocks: usize,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if options.backend != PageBackendKind::Custom {
        return Ok(Vec::new());
    }
    let Some(dict) = obj.and_then(|o| o.cast::<PyDict>().ok()) else {
        return Ok(Vec::new());
    };
    let Some(backend) = dict.get_item("backend")? else {
        return Ok(Vec::new());
    };
    let objects: Vec<Bound<'py, PyAny>> =
        if backend.is_instance_of::<PyList>() || backend.is_instance_of::<PyTuple>() {
            backend.try_iter()?.collect::<PyResult<_>>()?
        } else {
            vec![backend]
        };
    if objects.len() != dp_size {
        return Err(value_error(
            "xtensor.backend",
            format!(
                "needs one backend object per dp rank: {} for dp_size {dp_size}",
                objects.len()
            ),
        ));
    }
    let given_page_bytes = dict
        .get_item("page_bytes")?
        .filter(|v| !v.is_none())
        .is_some();
    let num_pages = num_blocks.div_ceil(options.blocks_per_page.max(1));
    let mut declared: Option<u64> = None;
    for (rank, b) in objects.iter().enumerate() {
        for method in ["map_page", "unmap_page"] {
            if !b.getattr(method).is_ok_and(|m| m.is_callable()) {
                return Err(type_error(
                    "xtensor.backend",
                    format!(
                        "backend of dp rank {rank} must have a callable {method}(page), got {}",
                        b.get_type().name()?
                    ),
                ));
            }
        }
        if let Ok(v) = b.getattr("page_bytes") {
            if !v.is_none() {
                let theirs = convert::uint64(&v, "xtensor.backend.page_bytes")?;
                match declared {
                    Some(first) if first != theirs => {
                        return Err(value_error(
                            "xtensor.backend",
                            format!("backends differ in page_bytes: {first} and {theirs}"),
                        ))
                    }
                    _ => declared = Some(theirs),
                }
            }
        }
        if let Ok(v) = b.getattr("blocks_per_page") {
            let theirs = convert::count(&v, "xtensor.backend.blocks_per_page")?;
            if theirs != options.blocks_per_page {
                return Err(value_error(
                    "xtensor.blocks_per_page",
                    format!(
                        "{} differs from dp rank {rank}'s backend's blocks_per_page {theirs}",
                        options.blocks_per_page
                    ),
                ));
            }
        }
        if let Ok(v) = b.getattr("num_pages") {
            let theirs = convert::count(&v, "xtensor.backend.num_pages")?;
            if theirs < num_pages {
                return Err(value_error(
                    "xtensor.backend",
                    format!("dp rank {rank}'s backend holds {theirs} pages but a rank needs {num_pages}"),
                ));
            }
        }
    }
    if let Some(declared) = declared {
        if !given_page_bytes {
            options.page_bytes = declared;
        } else if declared != options.page_bytes {
            return Err(value_error(
                "xtensor.page_bytes",
                format!(
                    "{} differs from the backends' page_bytes {declared}",
                    options.page_bytes
                ),
            ));
        }
    }
    Ok(objects)
}
