//! `kvpool.ConcurrentBlockManager`: the thread-safe allocator (R27, R28), with exactly the API
//! of `kvpool.BlockManager`. Each method validates its arguments under the GIL, then releases it
//! (`py.detach`) around the core call, so that Python threads can allocate, release, match,
//! insert and evict in parallel. `kvpool.Block` handles are shared with `BlockManager` (a
//! handle knows its manager through its store, so a foreign handle is rejected by name).

use std::sync::Arc;

use kvpool::{ConcurrentBlockManager, ManagerConfig};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::convert;
use crate::errors::IntoPyResult;
use crate::manager::{
    blocks_to_list, borrow_handles, counts_dict, debug_bits, hasher, take_handles, CacheOwner,
    PyPrefixCache,
};

/// Thread-safe block allocator with a prefix cache (the seed's ConcurrentBlockManagerImpl).
#[pyclass(frozen, module = "kvpool", name = "ConcurrentBlockManager")]
pub struct PyConcurrentBlockManager {
    inner: Arc<ConcurrentBlockManager>,
    num_blocks: usize,
    block_size: usize,
    enable_prefix_cache: bool,
}

#[pymethods]
impl PyConcurrentBlockManager {
    #[new]
    #[pyo3(
        signature = (num_blocks, block_size, *, enable_prefix_cache = None, hash_seed = None, debug_hash_bits = None),
        text_signature = "(num_blocks, block_size, *, enable_prefix_cache=True, hash_seed=None, debug_hash_bits=None)"
    )]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        enable_prefix_cache: Option<&Bound<'_, PyAny>>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        debug_hash_bits: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let enable_prefix_cache = convert::flag(enable_prefix_cache, "enable_prefix_cache", true)?;
        let num_blocks = convert::count(num_blocks, "num_blocks")?;
        let block_size = convert::count(block_size, "block_size")?;
        let config = ManagerConfig {
            num_blocks,
            block_size,
            enable_prefix_cache,
            hasher: hasher(hash_seed, debug_bits(debug_hash_bits)?)?,
        };
        let manager = ConcurrentBlockManager::new(config).py()?;
        Ok(Self {
            inner: Arc::new(manager),
            num_blocks,
            block_size,
            enable_prefix_cache,
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
    /// Allocatable ids: num_blocks - 1 (R1).
    #[getter]
    fn num_total_blocks(&self) -> usize {
        self.num_blocks - 1
    }
    /// Ids in the free list (R2; a snapshot while other threads work).
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.counts().free
    }
    /// Ids held only by the prefix cache (evictable, R2).
    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.inner.counts().cached
    }
    /// Ids held by a handle outside the cache (R2).
    #[getter]
    fn num_used_blocks(&self) -> usize {
        self.inner.counts().used
    }
    /// free + cached: what allocate can hand out (R2).
    #[getter]
    fn num_available_blocks(&self) -> usize {
        self.inner.counts().available()
    }

    /// n fresh blocks (R3); OutOfBlocksError if they cannot be had, changing nothing.
    fn allocate<'py>(&self, py: Python<'py>, n: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let n = convert::count(n, "n")?;
        let inner = &self.inner;
        let blocks = py.detach(|| inner.allocate(n)).py()?;
        blocks_to_list(py, blocks)
    }

    /// Releases these handles (R5); a released handle again is a ValueError.
    fn deallocate(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let inner = &self.inner;
        let handles = take_handles(blocks, "blocks", |b| inner.owns(b))?;
        py.detach(|| inner.deallocate(handles)).py()
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
        let inner = &self.inner;
        let blocks = py.detach(|| inner.allocate_shared(&tokens, key.as_deref()));
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
        let inner = &self.inner;
        let handles = borrow_handles(blocks, "blocks", |b| inner.owns(b))?;
        py.detach(|| inner.cache(&tokens, &handles, key.as_deref()))
            .py()
    }

    /// Evicts up to n cached blocks, least recently used leaves first (R10).
    fn evict(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = convert::count(n, "n")?;
        let inner = &self.inner;
        Ok(py.detach(|| inner.evict(n)))
    }

    /// Drops every cached entry; held blocks stay with their holders (R12).
    fn reset_prefix_cache(&self, py: Python<'_>) {
        let inner = &self.inner;
        py.detach(|| inner.reset_prefix_cache());
    }

    /// Walks every structure; raises InvariantError if a rule is broken. Exact only when no
    /// other thread is using the manager.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| inner.check()).py()
    }

    /// Counts and prefix-cache statistics.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = counts_dict(py, &self.inner.counts())?;
        let (cache, entries) = self
            .inner
            .with_prefix_cache(|c| (c.stats(), c.len()))
            .unwrap_or_default();
        dict.set_item("prefix_query_tokens", cache.query_tokens)?;
        dict.set_item("prefix_hit_tokens", cache.hit_tokens)?;
        dict.set_item("num_evictions", cache.evictions)?;
        dict.set_item("num_cache_entries", entries)?;
        Ok(dict)
    }

    /// Read-only view of the prefix cache, or None when disabled.
    #[getter]
    fn prefix_cache(&self) -> Option<PyPrefixCache> {
        self.enable_prefix_cache
            .then(|| PyPrefixCache::new(CacheOwner::Concurrent(Arc::clone(&self.inner))))
    }

    /// Block ids on the eviction list, oldest first (for tests and debugging).
    fn eviction_order(&self) -> Vec<u32> {
        self.inner
            .with_prefix_cache(kvpool::PrefixCache::lru_order)
            .unwrap_or_default()
    }

    fn __repr__(&self) -> String {
        let c = self.inner.counts();
        format!(
            "ConcurrentBlockManager(num_blocks={}, block_size={}, free={}, cached={}, used={})",
            self.num_blocks, self.block_size, c.free, c.cached, c.used
        )
    }
}
