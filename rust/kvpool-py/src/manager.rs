//! `kvpool.Block`, `kvpool.BlockManager`, `kvpool.SingleBlockManager`, `kvpool.PrefixCache`.
//! Each method validates, makes one core call and maps the error.

use std::sync::Arc;

use kvpool::{
    Block, BlockCounts, BlockHasher, BlockManager, BlockManagerImpl, ManagerConfig,
    SingleBlockManager,
};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::convert;
use crate::errors::{type_error, value_error, IntoPyResult};

/// One handle of a physical KV block (R4).
#[pyclass(frozen, module = "kvpool", name = "Block")]
pub struct PyBlock {
    handle: Mutex<Option<Block>>,
    id: u32,
    block_size: usize,
}

impl PyBlock {
    pub fn new(block: Block) -> Self {
        Self {
            id: block.id(),
            block_size: block.block_size(),
            handle: Mutex::new(Some(block)),
        }
    }
}

#[pymethods]
impl PyBlock {
    /// Physical block id (never 0, the padding block).
    #[getter]
    fn id(&self) -> u32 {
        self.id
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    /// Handles of this block alive now, the prefix cache's included (0 once this one is released
    /// and the block went back to the free list).
    #[getter]
    fn ref_count(&self) -> u32 {
        self.handle.lock().as_ref().map_or(0, Block::ref_count)
    }

    /// The block's chained hash (16 bytes) while it is in the prefix cache, else None.
    #[getter]
    fn hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        let hash = self.handle.lock().as_ref().and_then(Block::hash)?;
        Some(PyBytes::new(py, &hash.to_bytes()))
    }

    /// Whether this handle was released (deallocate).
    #[getter]
    fn released(&self) -> bool {
        self.handle.lock().is_none()
    }

    fn __repr__(&self) -> String {
        match self.handle.lock().as_ref() {
            Some(b) => format!(
                "Block(id={}, ref_count={}, cached={})",
                self.id,
                b.ref_count(),
                b.is_cached()
            ),
            None => format!("Block(id={}, released)", self.id),
        }
    }

    fn __int__(&self) -> u32 {
        self.id
    }

    fn __index__(&self) -> u32 {
        self.id
    }
}

/// Takes the handles out of `blocks` (an iterable of `kvpool.Block`), all or nothing: every item
/// is checked (type, not released, not listed twice, accepted by `owns`) before any is taken.
pub fn take_handles(
    blocks: &Bound<'_, PyAny>,
    name: &str,
    owns: impl Fn(&Block) -> bool,
) -> PyResult<Vec<Block>> {
    let items: Vec<Bound<'_, PyBlock>> = blocks
        .try_iter()
        .map_err(|_| type_error(name, "must be an iterable of kvpool.Block"))?
        .map(|item| {
            let item = item?;
            item.cast_into::<PyBlock>().map_err(|e| {
                type_error(
                    name,
                    format!(
                        "must contain kvpool.Block, got {}",
                        e.into_inner().get_type()
                    ),
                )
            })
        })
        .collect::<PyResult<_>>()?;
    // The same object twice would lock its mutex twice: find repeats first (O(n log n)).
    let mut objects: Vec<(usize, u32)> = items
        .iter()
        .map(|i| (i.as_ptr() as usize, i.get().id))
        .collect();
    objects.sort_unstable();
    if let Some(pair) = objects.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        return Err(value_error(
            name,
            format!("block {} is listed twice", pair[0].1),
        ));
    }
    let mut guards = Vec::with_capacity(items.len());
    for item in &items {
        let guard = item.get().handle.lock();
        match guard.as_ref() {
            None => {
                return Err(value_error(
                    name,
                    format!("block {} was already released", item.get().id),
                ))
            }
            Some(block) if !owns(block) => {
                return Err(value_error(
                    name,
                    format!("block {} belongs to another manager", block.id()),
                ))
            }
            Some(_) => {}
        }
        guards.push(guard);
    }
    Ok(guards
        .into_iter()
        .map(|mut g| g.take().expect("checked above"))
        .collect())
}

/// Clones the handles out of `blocks` without releasing them.
pub fn borrow_handles(
    blocks: &Bound<'_, PyAny>,
    name: &str,
    owns: impl Fn(&Block) -> bool,
) -> PyResult<Vec<Block>> {
    let mut out = Vec::new();
    for item in blocks
        .try_iter()
        .map_err(|_| type_error(name, "must be an iterable of kvpool.Block"))?
    {
        let item = item?;
        let block = item.cast::<PyBlock>().map_err(|_| {
            type_error(
                name,
                format!("must contain kvpool.Block, got {}", item.get_type()),
            )
        })?;
        let guard = block.get().handle.lock();
        let handle = guard.as_ref().ok_or_else(|| {
            value_error(
                name,
                format!("block {} was already released", block.get().id),
            )
        })?;
        if !owns(handle) {
            return Err(value_error(
                name,
                format!("block {} belongs to another manager", handle.id()),
            ));
        }
        out.push(handle.clone());
    }
    Ok(out)
}

pub(crate) fn blocks_to_list(py: Python<'_>, blocks: Vec<Block>) -> PyResult<Bound<'_, PyList>> {
    let objects = blocks
        .into_iter()
        .map(|b| Bound::new(py, PyBlock::new(b)))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, objects)
}

pub fn counts_dict<'py>(py: Python<'py>, counts: &BlockCounts) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("num_total_blocks", counts.total)?;
    dict.set_item("num_free_blocks", counts.free)?;
    dict.set_item("num_cached_blocks", counts.cached)?;
    dict.set_item("num_used_blocks", counts.used)?;
    dict.set_item("usage", counts.usage())?;
    Ok(dict)
}

pub fn hasher(
    hash_seed: Option<&Bound<'_, PyAny>>,
    debug_hash_bits: Option<usize>,
) -> PyResult<BlockHasher> {
    let seed = convert::hash_seed(hash_seed)?;
    match debug_hash_bits {
        None => Ok(BlockHasher::new(seed)),
        Some(bits) if (1..=128).contains(&bits) => {
            Ok(BlockHasher::with_debug_bits(seed, bits as u32))
        }
        Some(bits) => Err(value_error(
            "debug_hash_bits",
            format!("must be in 1..=128, got {bits}"),
        )),
    }
}

/// `allocate(n)` of either manager, as a list of `kvpool.Block`.
pub(crate) fn allocate_list<'py, M: BlockManager>(
    py: Python<'py>,
    manager: &Mutex<M>,
    n: &Bound<'_, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    let n = convert::count(n, "n")?;
    let blocks = manager.lock().allocate(n).py()?;
    blocks_to_list(py, blocks)
}

/// `deallocate(blocks)` of either manager: all handles checked before any is released.
pub(crate) fn deallocate_list<M: BlockManager>(
    manager: &Mutex<M>,
    blocks: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut manager = manager.lock();
    let handles = take_handles(blocks, "blocks", |b| manager.owns(b))?;
    manager.deallocate(handles).py()
}

/// `debug_hash_bits` as given (validated by [`hasher`], which names the value given: F10).
pub fn debug_bits(bits: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    convert::optional_count(bits, "debug_hash_bits")
}

/// Plain block allocator with a prefix cache (the seed's BlockManagerImpl).
#[pyclass(frozen, module = "kvpool", name = "BlockManager")]
pub struct PyBlockManager {
    inner: Arc<Mutex<BlockManagerImpl>>,
    num_blocks: usize,
    block_size: usize,
    enable_prefix_cache: bool,
}

#[pymethods]
impl PyBlockManager {
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
        let manager = BlockManagerImpl::new(config).py()?;
        Ok(Self {
            inner: Arc::new(Mutex::new(manager)),
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
        self.inner.lock().counts().free
    }
    /// Ids held only by the prefix cache (evictable, R2).
    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.inner.lock().counts().cached
    }
    /// Ids held by a handle outside the cache (R2).
    #[getter]
    fn num_used_blocks(&self) -> usize {
        self.inner.lock().counts().used
    }
    /// free + cached: what allocate can hand out (R2).
    #[getter]
    fn num_available_blocks(&self) -> usize {
        self.inner.lock().counts().available()
    }

    /// n fresh blocks (R3); OutOfBlocksError if free + cached < n, changing nothing.
    fn allocate<'py>(&self, py: Python<'py>, n: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyList>> {
        allocate_list(py, &self.inner, n)
    }

    /// Releases these handles (R5); a released handle again is a ValueError.
    fn deallocate(&self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        deallocate_list(&self.inner, blocks)
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
        let blocks = py.detach(|| inner.lock().allocate_shared(&tokens, key.as_deref()));
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
        let handles = {
            let manager = self.inner.lock();
            borrow_handles(blocks, "blocks", |b| manager.owns(b))?
        };
        let inner = &self.inner;
        py.detach(|| inner.lock().cache(&tokens, &handles, key.as_deref()))
            .py()
    }

    /// Evicts up to n cached blocks, least recently used leaves first (R10).
    fn evict(&self, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = convert::count(n, "n")?;
        Ok(self.inner.lock().evict(n))
    }

    /// Drops every cached entry; held blocks stay with their holders (R12).
    fn reset_prefix_cache(&self) {
        self.inner.lock().reset_prefix_cache();
    }

    /// Walks every structure; raises InvariantError if a rule is broken.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| inner.lock().check()).py()
    }

    /// Counts and prefix-cache statistics.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let manager = self.inner.lock();
        let dict = counts_dict(py, &manager.counts())?;
        let cache = manager
            .prefix_cache()
            .map(|c| c.stats())
            .unwrap_or_default();
        dict.set_item("prefix_query_tokens", cache.query_tokens)?;
        dict.set_item("prefix_hit_tokens", cache.hit_tokens)?;
        dict.set_item("num_evictions", cache.evictions)?;
        dict.set_item(
            "num_cache_entries",
            manager.prefix_cache().map_or(0, |c| c.len()),
        )?;
        Ok(dict)
    }

    /// Read-only view of the prefix cache, or None when disabled.
    #[getter]
    fn prefix_cache(&self) -> Option<PyPrefixCache> {
        self.enable_prefix_cache
            .then(|| PyPrefixCache::new(CacheOwner::Plain(Arc::clone(&self.inner))))
    }

    /// Block ids on the eviction list, oldest first (for tests and debugging).
    fn eviction_order(&self) -> Vec<u32> {
        let mut manager = self.inner.lock();
        match manager.prefix_cache_mut() {
            Some(cache) => {
                cache.drain_released();
                cache.lru_order()
            }
            None => Vec::new(),
        }
    }

    fn __repr__(&self) -> String {
        let c = self.inner.lock().counts();
        format!(
            "BlockManager(num_blocks={}, block_size={}, free={}, cached={}, used={})",
            self.num_blocks, self.block_size, c.free, c.cached, c.used
        )
    }
}

/// The manager whose prefix cache a `PrefixCache` view shows.
pub enum CacheOwner {
    Plain(Arc<Mutex<BlockManagerImpl>>),
    Concurrent(Arc<kvpool::ConcurrentBlockManager>),
}

/// Read-only view of a BlockManager's (or ConcurrentBlockManager's) prefix cache.
#[pyclass(frozen, module = "kvpool", name = "PrefixCache")]
pub struct PyPrefixCache {
    manager: CacheOwner,
}

impl PyPrefixCache {
    pub fn new(manager: CacheOwner) -> Self {
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
