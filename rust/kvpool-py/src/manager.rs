//! `kvpool.BlockManager`, `kvpool.ConcurrentBlockManager` (one method set for both, R27),
//! `kvpool.SingleBlockManager` and `kvpool.hash_blocks`. Each method validates, makes one core
//! call and maps the error.
//!
//! The two managers share their Python API exactly: [`manager_class!`] writes it once over a
//! [`Backend`], the core manager behind a lock (`BlockManager`) or the thread-safe one
//! (`ConcurrentBlockManager`, which releases the GIL around every core call, R28). A
//! `kvpool.Block` handle knows its manager through its store, so a handle of the other kind is
//! rejected by name.

use std::sync::Arc;

use kvpool::{
    Block, BlockCounts, BlockHasher, BlockManager, BlockManagerImpl, CacheStats,
    ConcurrentBlockManager, ManagerConfig, SingleBlockManager,
};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::block::{allocate_list, blocks_to_list, borrow_handles, deallocate_list, take_handles};
use crate::convert;
use crate::errors::{value_error, IntoPyResult};
use crate::prefix_cache::{CacheOwner, PyPrefixCache};
use crate::stats::counts_dict;

/// A manager the shared method set drives.
pub(crate) trait Backend: Send + Sync + Sized {
    /// Whether every call releases the GIL (the thread-safe manager, R28).
    const DETACH_ALL: bool;
    fn build(config: ManagerConfig) -> kvpool::Result<Self>;
    fn counts(&self) -> BlockCounts;
    fn owns(&self, block: &Block) -> bool;
    fn allocate(&self, n: usize) -> kvpool::Result<Vec<Block>>;
    fn deallocate(&self, blocks: Vec<Block>) -> kvpool::Result<()>;
    fn allocate_shared(&self, tokens: &[u32], extra_key: Option<&[u8]>) -> Vec<Block>;
    fn cache(
        &self,
        tokens: &[u32],
        blocks: &[Block],
        extra_key: Option<&[u8]>,
    ) -> kvpool::Result<usize>;
    fn evict(&self, n: usize) -> usize;
    fn reset_prefix_cache(&self);
    fn check(&self) -> kvpool::Result<()>;
    /// Prefix-cache counters and entries (zeros without a cache).
    fn cache_stats(&self) -> (CacheStats, usize);
    fn eviction_order(&self) -> Vec<u32>;
    fn view(self: &Arc<Self>) -> CacheOwner;
}

impl Backend for Mutex<BlockManagerImpl> {
    const DETACH_ALL: bool = false;
    fn build(config: ManagerConfig) -> kvpool::Result<Self> {
        BlockManagerImpl::new(config).map(Mutex::new)
    }
    fn counts(&self) -> BlockCounts {
        self.lock().counts()
    }
    fn owns(&self, block: &Block) -> bool {
        self.lock().owns(block)
    }
    fn allocate(&self, n: usize) -> kvpool::Result<Vec<Block>> {
        self.lock().allocate(n)
    }
    fn deallocate(&self, blocks: Vec<Block>) -> kvpool::Result<()> {
        self.lock().deallocate(blocks)
    }
    fn allocate_shared(&self, tokens: &[u32], extra_key: Option<&[u8]>) -> Vec<Block> {
        self.lock().allocate_shared(tokens, extra_key)
    }
    fn cache(
        &self,
        tokens: &[u32],
        blocks: &[Block],
        extra_key: Option<&[u8]>,
    ) -> kvpool::Result<usize> {
        self.lock().cache(tokens, blocks, extra_key)
    }
    fn evict(&self, n: usize) -> usize {
        self.lock().evict(n)
    }
    fn reset_prefix_cache(&self) {
        self.lock().reset_prefix_cache();
    }
    fn check(&self) -> kvpool::Result<()> {
        self.lock().check()
    }
    fn cache_stats(&self) -> (CacheStats, usize) {
        let m = self.lock();
        m.prefix_cache()
            .map(|c| (c.stats(), c.len()))
            .unwrap_or_default()
    }
    fn eviction_order(&self) -> Vec<u32> {
        let mut m = self.lock();
        match m.prefix_cache_mut() {
            Some(cache) => {
                cache.drain_released();
                cache.lru_order()
            }
            None => Vec::new(),
        }
    }
    fn view(self: &Arc<Self>) -> CacheOwner {
        CacheOwner::Plain(Arc::clone(self))
    }
}

impl Backend for ConcurrentBlockManager {
    const DETACH_ALL: bool = true;
    fn build(config: ManagerConfig) -> kvpool::Result<Self> {
        ConcurrentBlockManager::new(config)
    }
    fn counts(&self) -> BlockCounts {
        ConcurrentBlockManager::counts(self)
    }
    fn owns(&self, block: &Block) -> bool {
        ConcurrentBlockManager::owns(self, block)
    }
    fn allocate(&self, n: usize) -> kvpool::Result<Vec<Block>> {
        ConcurrentBlockManager::allocate(self, n)
    }
    fn deallocate(&self, blocks: Vec<Block>) -> kvpool::Result<()> {
        ConcurrentBlockManager::deallocate(self, blocks)
    }
    fn allocate_shared(&self, tokens: &[u32], extra_key: Option<&[u8]>) -> Vec<Block> {
        ConcurrentBlockManager::allocate_shared(self, tokens, extra_key)
    }
    fn cache(
        &self,
        tokens: &[u32],
        blocks: &[Block],
        extra_key: Option<&[u8]>,
    ) -> kvpool::Result<usize> {
        ConcurrentBlockManager::cache(self, tokens, blocks, extra_key)
    }
    fn evict(&self, n: usize) -> usize {
        ConcurrentBlockManager::evict(self, n)
    }
    fn reset_prefix_cache(&self) {
        ConcurrentBlockManager::reset_prefix_cache(self);
    }
    fn check(&self) -> kvpool::Result<()> {
        ConcurrentBlockManager::check(self)
    }
    fn cache_stats(&self) -> (CacheStats, usize) {
        self.with_prefix_cache(|c| (c.stats(), c.len()))
            .unwrap_or_default()
    }
    fn eviction_order(&self) -> Vec<u32> {
        self.with_prefix_cache(kvpool::PrefixCache::lru_order)
            .unwrap_or_default()
    }
    fn view(self: &Arc<Self>) -> CacheOwner {
        CacheOwner::Concurrent(Arc::clone(self))
    }
}

/// Runs `call` with the GIL released when `detach` (R28).
fn maybe_detach<T: Send>(py: Python<'_>, detach: bool, call: impl FnOnce() -> T + Send) -> T {
    if detach {
        py.detach(call)
    } else {
        call()
    }
}

/// The Python class `$name` over the backend `$backend`, with the shared method set.
macro_rules! manager_class {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $backend:ty) => {
        $(#[$doc])*
        #[pyclass(frozen, module = "kvpool", name = $name)]
        pub struct $ty {
            inner: Arc<$backend>,
            num_blocks: usize,
            block_size: usize,
            enable_prefix_cache: bool,
        }

        #[pymethods]
        impl $ty {
            #[new]
            #[pyo3(
                signature = (num_blocks, block_size, *, enable_prefix_cache = convert::Given::Missing, hash_seed = None, debug_hash_bits = None),
                text_signature = "(num_blocks, block_size, *, enable_prefix_cache=True, hash_seed=None, debug_hash_bits=None)"
            )]
            fn new(
                num_blocks: &Bound<'_, PyAny>,
                block_size: &Bound<'_, PyAny>,
                enable_prefix_cache: convert::Given<'_>,
                hash_seed: Option<&Bound<'_, PyAny>>,
                debug_hash_bits: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<Self> {
                let enable_prefix_cache = enable_prefix_cache.flag("enable_prefix_cache", true)?;
                let num_blocks = convert::count(num_blocks, "num_blocks")?;
                let block_size = convert::count(block_size, "block_size")?;
                let config = ManagerConfig {
                    num_blocks,
                    block_size,
                    enable_prefix_cache,
                    hasher: convert::hasher(hash_seed, debug_hash_bits)?,
                };
                Ok(Self {
                    inner: Arc::new(<$backend as Backend>::build(config).py()?),
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
            /// Ids in the free list (R2).
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
                let blocks = maybe_detach(py, <$backend as Backend>::DETACH_ALL, || inner.allocate(n)).py()?;
                blocks_to_list(py, blocks)
            }

            /// Releases these handles (R5); a released handle again is a ValueError.
            fn deallocate(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
                let inner = &self.inner;
                let handles = take_handles(blocks, "blocks", |b| inner.owns(b))?;
                maybe_detach(py, <$backend as Backend>::DETACH_ALL, || inner.deallocate(handles)).py()
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
                py.detach(|| inner.cache(&tokens, &handles, key.as_deref())).py()
            }

            /// Evicts up to n cached blocks, least recently used leaves first (R10).
            fn evict(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<usize> {
                let n = convert::count(n, "n")?;
                let inner = &self.inner;
                Ok(maybe_detach(py, <$backend as Backend>::DETACH_ALL, || inner.evict(n)))
            }

            /// Drops every cached entry; held blocks stay with their holders (R12).
            fn reset_prefix_cache(&self, py: Python<'_>) {
                let inner = &self.inner;
                maybe_detach(py, <$backend as Backend>::DETACH_ALL, || inner.reset_prefix_cache());
            }

            /// Walks every structure; raises InvariantError if a rule is broken.
            fn check(&self, py: Python<'_>) -> PyResult<()> {
                let inner = &self.inner;
                py.detach(|| inner.check()).py()
            }

            /// Counts and prefix-cache statistics.
            fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                let dict = counts_dict(py, &self.inner.counts())?;
                let (cache, entries) = Backend::cache_stats(&*self.inner);
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
                    .then(|| PyPrefixCache::new(Backend::view(&self.inner)))
            }

            /// Block ids on the eviction list, oldest first (for tests and debugging).
            fn eviction_order(&self) -> Vec<u32> {
                self.inner.eviction_order()
            }

            fn __repr__(&self) -> String {
                let c = self.inner.counts();
                format!(
                    "{}(num_blocks={}, block_size={}, free={}, cached={}, used={})",
                    $name, self.num_blocks, self.block_size, c.free, c.cached, c.used
                )
            }
        }
    };
}

manager_class!(
    /// Plain block allocator with a prefix cache (xLLM's BlockManagerImpl).
    PyBlockManager,
    "BlockManager",
    Mutex<BlockManagerImpl>
);

manager_class!(
    /// Thread-safe block allocator with a prefix cache (xLLM's ConcurrentBlockManagerImpl).
    PyConcurrentBlockManager,
    "ConcurrentBlockManager",
    ConcurrentBlockManager
);

/// One id per sequence: block size 1, id 0 reserved, no prefix cache.
#[pyclass(frozen, module = "kvpool", name = "SingleBlockManager")]
pub struct PySingleBlockManager {
    inner: Mutex<SingleBlockManager>,
    num_slots: usize,
}

#[pymethods]
impl PySingleBlockManager {
    #[new]
    fn new(num_slots: &Bound<'_, PyAny>) -> PyResult<Self> {
        let num_slots = convert::count(num_slots, "num_slots")?;
        Ok(Self {
            inner: Mutex::new(SingleBlockManager::new(num_slots).py()?),
            num_slots,
        })
    }
    /// Ids in the pool, padding id 0 included.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_slots
    }
    /// Always 1.
    #[getter]
    fn block_size(&self) -> usize {
        1
    }
    #[getter]
    fn num_total_blocks(&self) -> usize {
        self.num_slots - 1
    }
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.lock().counts().free
    }
    #[getter]
    fn num_cached_blocks(&self) -> usize {
        0
    }
    #[getter]
    fn num_used_blocks(&self) -> usize {
        self.inner.lock().counts().used
    }
    #[getter]
    fn num_available_blocks(&self) -> usize {
        self.inner.lock().counts().free
    }
    /// n fresh slots; OutOfBlocksError if fewer are free, changing nothing.
    fn allocate<'py>(&self, py: Python<'py>, n: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyList>> {
        allocate_list(py, &self.inner, n)
    }
    /// Releases these handles; a released handle again is a ValueError.
    fn deallocate(&self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        deallocate_list(&self.inner, blocks)
    }
    /// No prefix cache: always [].
    #[pyo3(signature = (token_ids, *, extra_key = None))]
    fn allocate_shared<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        extra_key: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        convert::tokens(token_ids, "token_ids")?;
        convert::extra_key(extra_key, "extra_key")?;
        Ok(PyList::empty(py))
    }
    /// No prefix cache: always 0.
    #[pyo3(signature = (token_ids, blocks, *, extra_key = None))]
    fn cache(
        &self,
        token_ids: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        convert::tokens(token_ids, "token_ids")?;
        convert::extra_key(extra_key, "extra_key")?;
        let manager = self.inner.lock();
        borrow_handles(blocks, "blocks", |b| manager.owns(b))?;
        Ok(0)
    }
    /// No prefix cache: always 0.
    fn evict(&self, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        convert::count(n, "n")?;
        Ok(0)
    }
    fn reset_prefix_cache(&self) {}
    /// Walks every structure; raises InvariantError if a rule is broken.
    fn check(&self) -> PyResult<()> {
        self.inner.lock().check().py()
    }
    fn __repr__(&self) -> String {
        let c = self.inner.lock().counts();
        format!(
            "SingleBlockManager(num_slots={}, free={}, used={})",
            self.num_slots, c.free, c.used
        )
    }
}

/// Chained hashes (R6) of the full blocks of token_ids: a list of 16-byte digests.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, *, extra_key = None, hash_seed = None))]
pub fn hash_blocks<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
    block_size: &Bound<'py, PyAny>,
    extra_key: Option<&Bound<'py, PyAny>>,
    hash_seed: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyList>> {
    let tokens = convert::tokens(token_ids, "token_ids")?;
    let block_size = convert::count(block_size, "block_size")?;
    if block_size < 1 {
        return Err(value_error(
            "block_size",
            format!("must be at least 1, got {block_size}"),
        ));
    }
    let key = convert::extra_key(extra_key, "extra_key")?;
    let hasher = BlockHasher::new(convert::hash_seed(hash_seed)?);
    let hashes = py.detach(|| hasher.chain(&tokens, block_size, key.as_deref()));
    PyList::new(
        py,
        hashes.into_iter().map(|h| PyBytes::new(py, &h.to_bytes())),
    )
}
