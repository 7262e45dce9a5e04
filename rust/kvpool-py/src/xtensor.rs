//! `kvpool.XTensorBlockManager`: the elastic allocator on virtual-memory pages (docs/xtensor.md).
//! Each method validates, makes one core call and maps the error.
//!
//! The page backend is the accounting one (`backend=None`), the host one (`backend="host"`) or
//! a Python object with `map_page(page)` / `unmap_page(page)` (the CUDA backend of
//! `kvpool.xtensor`, or a test's fake). A Python backend is called with the GIL held and the
//! manager's lock taken; the lock is therefore always taken with `lock_py_attached` (which
//! detaches from the interpreter while it waits), so a thread waiting for the manager never
//! holds the GIL that the backend's thread needs. A backend must not call its own manager
//! (that is a `RuntimeError`). A Python exception raised by the backend propagates as itself
//! when the core raises it (the call did nothing of its own); one the core deferred (met while
//! settling after the call's work) is dropped, and the next call retries and raises its own.
//! `MemoryError` means "no memory for this page now" (allocation then raises
//! `OutOfBlocksError`, `try_reserve` returns False).

use std::cell::Cell;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvpool::{
    AccountingBackend, BlockManager, HostPageBackend, KvPoolError, MemoryLimitReport, PageBackend,
    PageError, XTensorBlockManager, XTensorConfig, DEFAULT_PAGE_BYTES,
};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyDict, PyList, PyString};

use crate::block::{blocks_to_list, borrow_handles, take_handles};
use crate::convert;
use crate::convert::hasher;
use crate::errors::{to_py, type_error, value_error};
use crate::stats::counts_dict;

thread_local! {
    /// Set while this thread runs a Python backend's method (reentrancy guard).
    static IN_BACKEND: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is running a Python backend's method (a backend must not call the
/// manager or pool that called it: that is a `RuntimeError`, not a deadlock).
pub(crate) fn in_backend() -> bool {
    IN_BACKEND.with(Cell::get)
}

/// The exception a Python backend raised, kept for the binding to re-raise.
pub(crate) type ErrorSlot = Arc<parking_lot::Mutex<Option<PyErr>>>;

/// A Python object with `map_page(page)` / `unmap_page(page)` as a page backend.
///
/// The slot keeps the first exception of a call (the binding takes it when the call ends); a
/// later failure in the same call does not replace it, and [`PageBackend::deferred`] drops the
/// exception only if the last operation is the one that put it there.
pub(crate) struct PythonBackend {
    object: Py<PyAny>,
    error: ErrorSlot,
    /// The last operation's exception is the one in the slot.
    last_in_slot: bool,
}

impl PythonBackend {
    /// `object` as a backend whose exceptions land in `error`.
    pub(crate) fn new(object: Py<PyAny>, error: ErrorSlot) -> Self {
        Self {
            object,
            error,
            last_in_slot: false,
        }
    }

    fn call(&mut self, method: &'static str, page: usize) -> Result<(), PageError> {
        self.last_in_slot = false;
        Python::attach(|py| {
            IN_BACKEND.with(|flag| flag.set(true));
            let result = self.object.bind(py).call_method1(method, (page,));
            IN_BACKEND.with(|flag| flag.set(false));
            match result {
                Ok(_) => Ok(()),
                Err(error) if error.is_instance_of::<PyMemoryError>(py) => {
                    Err(PageError::OutOfMemory { page })
                }
                Err(error) => {
                    let message = error.to_string();
                    let mut slot = self.error.lock();
                    if slot.is_none() {
                        *slot = Some(error);
                        self.last_in_slot = true;
                    }
                    Err(PageError::Failed {
                        page,
                        operation: method,
                        message,
                    })
                }
            }
        })
    }
}

impl PageBackend for PythonBackend {
    fn map_page(&mut self, page: usize) -> Result<(), PageError> {
        self.call("map_page", page)
    }

    fn unmap_page(&mut self, page: usize) -> Result<(), PageError> {
        self.call("unmap_page", page)
    }

    /// The manager deferred the failure: its next call retries and raises then (the exception
    /// of this one is not raised; an earlier one of the same call still is).
    fn deferred(&mut self) {
        if std::mem::take(&mut self.last_in_slot) {
            *self.error.lock() = None;
        }
    }

    fn resident_bytes(&self) -> Option<u64> {
        Python::attach(|py| {
            let value = self.object.bind(py).getattr("resident_bytes").ok()?;
            let value = if value.is_callable() {
                value.call0().ok()?
            } else {
                value
            };
            value.extract::<u64>().ok()
        })
    }
}

/// An optional non-negative integer of bytes, named in errors.
fn optional_bytes(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<u64>> {
    match obj {
        Some(obj) if !obj.is_none() => convert::uint64(obj, name).map(Some),
        _ => Ok(None),
    }
}

/// Elastic block allocator on virtual-memory pages (xLLM's XTensorBlockManagerImpl).
#[pyclass(frozen, module = "kvpool", name = "XTensorBlockManager")]
pub struct PyXTensorBlockManager {
    inner: Mutex<XTensorBlockManager>,
    backend_error: ErrorSlot,
    backend: Py<PyAny>,
    num_blocks: usize,
    block_size: usize,
    enable_prefix_cache: bool,
}

impl PyXTensorBlockManager {
    fn lock(&self, py: Python<'_>) -> PyResult<MutexGuard<'_, XTensorBlockManager>> {
        if IN_BACKEND.with(Cell::get) {
            return Err(PyRuntimeError::new_err(
                "XTensorBlockManager: a page backend must not call its manager",
            ));
        }
        // A panic cannot happen inside (no core path panics); a poisoned lock still guards
        // consistent data, so it is used as is.
        Ok(self
            .inner
            .lock_py_attached(py)
            .unwrap_or_else(PoisonError::into_inner))
    }

    /// Maps a core error, re-raising a Python backend's own exception.
    fn error(&self, error: KvPoolError) -> PyErr {
        if let KvPoolError::PageBackend(_) = error {
            if let Some(raised) = self.backend_error.lock().take() {
                return raised;
            }
        }
        to_py(error)
    }

    fn py<T>(&self, result: kvpool::Result<T>) -> PyResult<T> {
        result.map_err(|e| self.error(e))
    }
}

pub(crate) fn report_dict<'py>(
    py: Python<'py>,
    report: &MemoryLimitReport,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("limit_bytes", report.limit_bytes)?;
    dict.set_item("limit_pages", report.limit_pages)?;
    dict.set_item("mapped_pages", report.mapped_pages)?;
    dict.set_item("mapped_bytes", report.mapped_bytes)?;
    dict.set_item("evicted_blocks", report.evicted_blocks)?;
    dict.set_item("unmapped_pages", report.unmapped_pages)?;
    dict.set_item("mapped_new_pages", report.mapped_new_pages)?;
    dict.set_item("released_reserved_blocks", report.released_reserved_blocks)?;
    dict.set_item("excess_bytes", report.excess_bytes)?;
    dict.set_item("held_pages", report.held_pages)?;
    Ok(dict)
}

#[pymethods]
impl PyXTensorBlockManager {
    #[new]
    #[pyo3(
        signature = (num_blocks, block_size, *, blocks_per_page, page_bytes = None, spare_pages = convert::Given::Missing, memory_limit = None, backend = None, enable_prefix_cache = convert::Given::Missing, hash_seed = None, debug_hash_bits = None),
        text_signature = "(num_blocks, block_size, *, blocks_per_page, page_bytes=None, spare_pages=1, memory_limit=None, backend=None, enable_prefix_cache=True, hash_seed=None, debug_hash_bits=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        blocks_per_page: &Bound<'_, PyAny>,
        page_bytes: Option<&Bound<'_, PyAny>>,
        spare_pages: convert::Given<'_>,
        memory_limit: Option<&Bound<'_, PyAny>>,
        backend: Option<&Bound<'_, PyAny>>,
        enable_prefix_cache: convert::Given<'_>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        debug_hash_bits: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut config = XTensorConfig::new(
            convert::count(num_blocks, "num_blocks")?,
            convert::count(block_size, "block_size")?,
            convert::count(blocks_per_page, "blocks_per_page")?,
        );
        config.enable_prefix_cache = enable_prefix_cache.flag("enable_prefix_cache", true)?;
        config.spare_pages = spare_pages.count("spare_pages", 1)?;
        config.memory_limit = optional_bytes(memory_limit, "memory_limit")?;
        config.hasher = hasher(hash_seed, debug_hash_bits)?;
        let backend = backend.filter(|b| !b.is_none());
        let kind = match backend {
            None => "accounting",
            Some(b) if b.is_instance_of::<PyString>() => match b.extract::<String>()?.as_str() {
                "accounting" => "accounting",
                "host" => "host",
                other => {
                    return Err(value_error(
                        "backend",
                        format!("must be 'accounting', 'host' or an object with map_page and unmap_page, got {other:?}"),
                    ))
                }
            },
            Some(b) => {
                for method in ["map_page", "unmap_page"] {
                    if !b.getattr(method).is_ok_and(|m| m.is_callable()) {
                        return Err(type_error(
                            "backend",
                            format!("must have a callable {method}(page), got {}", b.get_type().name()?),
                        ));
                    }
                }
                "python"
            }
        };
        // page_bytes: given, else the backend's own, else 2 MiB.
        let declared = match (kind, backend) {
            ("python", Some(b)) => match b.getattr("page_bytes") {
                Ok(v) if !v.is_none() => Some(convert::uint64(&v, "backend.page_bytes")?),
                _ => None,
            },
            _ => None,
        };
        config.page_bytes = optional_bytes(page_bytes, "page_bytes")?
            .or(declared)
            .unwrap_or(DEFAULT_PAGE_BYTES);
        if let (Some(declared), Some(_)) = (declared, page_bytes.filter(|p| !p.is_none())) {
            if declared != config.page_bytes {
                return Err(value_error(
                    "page_bytes",
                    format!(
                        "{} differs from the backend's page_bytes {declared}",
                        config.page_bytes
                    ),
                ));
            }
        }
        if let ("python", Some(b)) = (kind, backend) {
            if let Ok(v) = b.getattr("blocks_per_page") {
                let theirs = convert::count(&v, "backend.blocks_per_page")?;
                if theirs != config.blocks_per_page {
                    return Err(value_error(
                        "blocks_per_page",
                        format!(
                            "{} differs from the backend's blocks_per_page {theirs}",
                            config.blocks_per_page
                        ),
                    ));
                }
            }
            if let Ok(v) = b.getattr("num_pages") {
                let theirs = convert::count(&v, "backend.num_pages")?;
                if theirs < config.num_pages() {
                    return Err(value_error(
                        "backend",
                        format!(
                            "holds {theirs} pages but the manager needs {}",
                            config.num_pages()
                        ),
                    ));
                }
            }
        }
        config.validate().map_err(to_py)?;
        let backend_error: ErrorSlot = Arc::new(parking_lot::Mutex::new(None));
        let page_backend: Box<dyn PageBackend> = match (kind, backend) {
            ("host", _) => {
                let bytes = usize::try_from(config.page_bytes)
                    .map_err(|_| value_error("page_bytes", "does not fit the address space"))?;
                Box::new(HostPageBackend::new(config.num_pages(), bytes).map_err(to_py)?)
            }
            ("python", Some(b)) => Box::new(PythonBackend::new(
                b.clone().unbind(),
                Arc::clone(&backend_error),
            )),
            _ => Box::new(AccountingBackend::new(config.num_pages())),
        };
        let manager =
            XTensorBlockManager::with_backend(config, page_backend).map_err(|e| {
                match (&e, backend_error.lock().take()) {
                    (KvPoolError::PageBackend(_), Some(raised)) => raised,
                    _ => to_py(e),
                }
            })?;
        let backend_object = match backend {
            Some(b) if kind == "python" => b.clone().unbind(),
            _ => PyString::new(py, kind).into_any().unbind(),
        };
        Ok(Self {
            inner: Mutex::new(manager),
            backend_error,
            backend: backend_object,
            num_blocks: config.num_blocks,
            block_size: config.block_size,
            enable_prefix_cache: config.enable_prefix_cache,
        })
    }

    /// Ids in the pool, padding block 0 included.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }
    /// Whether a prefix cache is kept.
    #[getter]
    fn enable_prefix_cache(&self) -> bool {
        self.enable_prefix_cache
    }
    /// The page backend: "accounting", "host" or the Python object given.
    #[getter]
    fn backend(&self, py: Python<'_>) -> Py<PyAny> {
        self.backend.clone_ref(py)
    }
    /// Blocks per page (the last page may hold fewer).
    #[getter]
    fn blocks_per_page(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.blocks_per_page())
    }
    /// Pages of the range: ceil(num_blocks / blocks_per_page).
    #[getter]
    fn num_pages(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.num_pages())
    }
    /// Bytes one mapped page costs.
    #[getter]
    fn page_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.lock(py)?.page_bytes())
    }
    /// Empty pages kept mapped: mapped ahead below this, unmapped above twice this.
    #[getter]
    fn spare_pages(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.spare_pages())
    }
    /// Allocatable ids: num_blocks - 1 (R1).
    #[getter]
    fn num_total_blocks(&self) -> usize {
        self.num_blocks - 1
    }
    /// Ids not handed out (R2), on unmapped pages too.
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.counts().free)
    }
    /// Ids held only by the prefix cache (evictable, R2).
    #[getter]
    fn num_cached_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.counts().cached)
    }
    /// Ids held by a handle outside the cache (R2).
    #[getter]
    fn num_used_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.counts().used)
    }
    /// Exactly what allocate can hand out: free ids on mapped pages, cached blocks, and the ids
    /// of the unmapped pages the memory limit allows.
    #[getter]
    fn num_available_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.num_available_blocks())
    }
    /// Pages mapped now, page 0 included.
    #[getter]
    fn mapped_pages(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.mapped_pages())
    }
    /// Bytes mapped now (mapped_pages * page_bytes).
    #[getter]
    fn mapped_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.lock(py)?.mapped_bytes())
    }
    /// The memory limit in bytes, or None (the whole range).
    #[getter]
    fn memory_limit(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        Ok(self.lock(py)?.memory_limit())
    }
    /// Pages the memory limit allows.
    #[getter]
    fn limit_pages(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.limit_pages())
    }
    /// Blocks promised by try_reserve and not yet allocated.
    #[getter]
    fn reserved_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.reserved())
    }
    /// Physical bytes the backend holds, where it can measure them (host backend: mincore).
    #[getter]
    fn resident_bytes(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        Ok(self.lock(py)?.resident_bytes())
    }

    /// n fresh blocks (R3), packed into the fullest mapped pages; OutOfBlocksError if fewer
    /// than n are available, changing nothing.
    fn allocate<'py>(&self, py: Python<'py>, n: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let n = convert::count(n, "n")?;
        let blocks = {
            let mut manager = self.lock(py)?;
            let result = manager.allocate(n);
            self.py(result)?
        };
        blocks_to_list(py, blocks)
    }

    /// Releases these handles (R5); pages whose blocks are all free unmap (beyond the spares).
    fn deallocate(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut manager = self.lock(py)?;
        let handles = take_handles(blocks, "blocks", |b| manager.owns(b))?;
        let result = manager.deallocate(handles);
        self.py(result)
    }

    /// Handles of the longest cached prefix of token_ids (R7).
    #[pyo3(signature = (token_ids, *, extra_key = None))]
    fn allocate_shared<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        extra_key: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let tokens = convert::tokens(token_ids, "token_ids")?;
        let key = convert::extra_key(extra_key, "extra_key")?;
        let blocks = self.lock(py)?.allocate_shared(&tokens, key.as_deref());
        blocks_to_list(py, blocks)
    }

    /// Publishes the full blocks of token_ids held in blocks (R9); returns how many are new.
    #[pyo3(signature = (token_ids, blocks, *, extra_key = None))]
    fn cache(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let tokens = convert::tokens(token_ids, "token_ids")?;
        let key = convert::extra_key(extra_key, "extra_key")?;
        let mut manager = self.lock(py)?;
        let handles = borrow_handles(blocks, "blocks", |b| manager.owns(b))?;
        let result = manager.cache(&tokens, &handles, key.as_deref());
        self.py(result)
    }

    /// Evicts up to n cached blocks, whole pages first (their memory comes back), then least
    /// recently used leaves (R10); returns how many.
    fn evict(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = convert::count(n, "n")?;
        let mut manager = self.lock(py)?;
        let result = manager.try_evict(n);
        self.py(result)
    }

    /// Drops every cached entry; held blocks stay with their holders (R12).
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<()> {
        let mut manager = self.lock(py)?;
        let result = manager.try_reset_prefix_cache();
        self.py(result)
    }

    /// Walks every structure (R1-R5, R10 and the page rules); raises InvariantError if a rule
    /// is broken.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let manager = self.lock(py)?;
        self.py(manager.check())
    }

    /// Promises n more blocks to the coming allocations, mapping the pages they need now
    /// (within the memory limit; never evicts). False, changing nothing, if it cannot.
    fn try_reserve(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<bool> {
        let n = convert::count(n, "n")?;
        let mut manager = self.lock(py)?;
        let result = manager.try_reserve(n);
        self.py(result)
    }

    /// Drops what is left of the reservation; returns how many blocks were still promised.
    fn free_reserved(&self, py: Python<'_>) -> PyResult<usize> {
        let mut manager = self.lock(py)?;
        let result = manager.free_reserved();
        self.py(result)
    }

    /// Sets the memory limit in bytes (None: the whole range; page 0 counts). Lowering it
    /// unmaps spares, evicts cached blocks page by page and unmaps the pages that empty; returns
    /// a dict saying what it did and what sequences still hold (excess_bytes, held_pages).
    fn set_memory_limit<'py>(
        &self,
        py: Python<'py>,
        limit: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let limit = optional_bytes(limit, "limit")?;
        let report = {
            let mut manager = self.lock(py)?;
            let result = manager.set_memory_limit(limit);
            self.py(result)?
        };
        report_dict(py, &report)
    }

    /// Takes in handles dropped outside deallocate and unmaps the pages they emptied; returns
    /// how many pages were unmapped.
    fn trim(&self, py: Python<'_>) -> PyResult<usize> {
        let mut manager = self.lock(py)?;
        let result = manager.trim();
        self.py(result)
    }

    /// The page holding block block_id.
    fn page_of(&self, py: Python<'_>, block_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = convert::count(block_id, "block_id")?;
        let manager = self.lock(py)?;
        u32::try_from(id)
            .ok()
            .and_then(|id| manager.page_of(id))
            .ok_or_else(|| {
                value_error(
                    "block_id",
                    format!("must be below num_blocks ({}), got {id}", self.num_blocks),
                )
            })
    }

    /// Whether page is mapped.
    fn is_page_mapped(&self, py: Python<'_>, page: &Bound<'_, PyAny>) -> PyResult<bool> {
        let page = convert::count(page, "page")?;
        let manager = self.lock(py)?;
        if page >= manager.num_pages() {
            return Err(value_error(
                "page",
                format!(
                    "must be below num_pages ({}), got {page}",
                    manager.num_pages()
                ),
            ));
        }
        Ok(manager.is_page_mapped(page))
    }

    /// The mapped pages, ascending.
    fn mapped_page_ids(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        Ok(self.lock(py)?.mapped_page_ids())
    }

    /// Counts, prefix-cache statistics and page counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let manager = self.lock(py)?;
        let dict = counts_dict(py, &manager.counts())?;
        let cache = manager
            .prefix_cache()
            .map(|c| c.stats())
            .unwrap_or_default();
        dict.set_item("num_available_blocks", manager.num_available_blocks())?;
        dict.set_item("prefix_query_tokens", cache.query_tokens)?;
        dict.set_item("prefix_hit_tokens", cache.hit_tokens)?;
        dict.set_item("num_evictions", cache.evictions)?;
        dict.set_item(
            "num_cache_entries",
            manager.prefix_cache().map_or(0, |c| c.len()),
        )?;
        let pages = manager.page_stats();
        dict.set_item("mapped_pages", manager.mapped_pages())?;
        dict.set_item("mapped_bytes", manager.mapped_bytes())?;
        dict.set_item("peak_mapped_pages", pages.peak_mapped_pages)?;
        dict.set_item("num_page_maps", pages.maps)?;
        dict.set_item("num_page_unmaps", pages.unmaps)?;
        dict.set_item("num_map_failures", pages.map_failures)?;
        dict.set_item("memory_limit", manager.memory_limit())?;
        dict.set_item("reserved_blocks", manager.reserved())?;
        Ok(dict)
    }

    /// Block ids on the eviction list, oldest first (for tests and debugging).
    fn eviction_order(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let manager = self.lock(py)?;
        Ok(manager
            .prefix_cache()
            .map(|c| c.eviction_order())
            .unwrap_or_default())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let manager = self.lock(py)?;
        let c = manager.counts();
        Ok(format!(
            "XTensorBlockManager(num_blocks={}, block_size={}, blocks_per_page={}, mapped_pages={}/{}, free={}, cached={}, used={})",
            self.num_blocks,
            self.block_size,
            manager.blocks_per_page(),
            manager.mapped_pages(),
            manager.num_pages(),
            c.free,
            c.cached,
            c.used
        ))
    }
}
