//! `kvpool.PrefixCache`: a read-only view of a manager's prefix cache (R6-R12).

use std::sync::Arc;

use kvpool::BlockManagerImpl;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert;

/// The manager whose prefix cache a `PrefixCache` view shows.
pub(crate) enum CacheOwner {
    Plain(Arc<Mutex<BlockManagerImpl>>),
    Concurrent(Arc<kvpool::ConcurrentBlockManager>),
}

/// Read-only view of a BlockManager's (or ConcurrentBlockManager's) prefix cache.
#[pyclass(frozen, module = "kvpool", name = "PrefixCache")]
pub struct PyPrefixCache {
    manager: CacheOwner,
}

impl PyPrefixCache {
    pub(crate) fn new(manager: CacheOwner) -> Self {
        Self { manager }
    }

    fn with<T: Default>(&self, f: impl FnOnce(&kvpool::PrefixCache) -> T) -> T {
        match &self.manager {
            CacheOwner::Plain(manager) => manager.lock().prefix_cache().map(f),
            CacheOwner::Concurrent(manager) => manager.with_prefix_cache(f),
        }
        .unwrap_or_default()
    }
}

#[pymethods]
impl PyPrefixCache {
    /// Number of cached blocks (entries), held or not.
    fn __len__(&self) -> usize {
        self.with(|c| c.len())
    }
    /// Tokens of full blocks looked up by allocate_shared.
    #[getter]
    fn query_tokens(&self) -> u64 {
        self.with(|c| c.stats().query_tokens)
    }
    /// Tokens of those that hit.
    #[getter]
    fn hit_tokens(&self) -> u64 {
        self.with(|c| c.stats().hit_tokens)
    }
    /// hit_tokens / query_tokens (0.0 before any query).
    #[getter]
    fn hit_rate(&self) -> f64 {
        self.with(|c| {
            let s = c.stats();
            if s.query_tokens == 0 {
                0.0
            } else {
                s.hit_tokens as f64 / s.query_tokens as f64
            }
        })
    }
    /// Blocks evicted so far.
    #[getter]
    fn num_evictions(&self) -> u64 {
        self.with(|c| c.stats().evictions)
    }
    /// Whether block_hash (16 bytes) is cached.
    fn contains(&self, block_hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        let hash = convert::block_hash(block_hash, "block_hash")?;
        Ok(self.with(|c| c.contains(hash)))
    }
    /// The block id cached under block_hash, or None.
    fn block_id(&self, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let hash = convert::block_hash(block_hash, "block_hash")?;
        Ok(self.with(|c| c.block_id(hash)))
    }
    /// Every cached hash (unordered).
    fn hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let hashes = self.with(|c| c.hashes());
        PyList::new(
            py,
            hashes.into_iter().map(|h| PyBytes::new(py, &h.to_bytes())),
        )
    }
    fn __repr__(&self) -> String {
        self.with(|c| {
            format!(
                "PrefixCache(entries={}, hit_tokens={}/{})",
                c.len(),
                c.stats().hit_tokens,
                c.stats().query_tokens
            )
        })
    }
}
