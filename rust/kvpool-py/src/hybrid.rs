//! Hybrid models (R22-R25): `kvpool.LinearStatePrefixCache`, `kvpool.LinearStatePlan`,
//! `kvpool.SlidingWindowBlockManager`, `kvpool.CompositeBlockManager`.
//! Each method validates, makes one core call and maps the error.

use kvpool::{
    BlockManager, CompositeBlockManager, GroupSpec, LinearStatePlan, LinearStatePrefixCache,
    SlidingWindowBlockManager,
};
use numpy::{IntoPyArray, PyArray1};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::convert;
use crate::errors::{type_error, value_error, IntoPyResult};
use crate::manager::{allocate_list, blocks_to_list, counts_dict, deallocate_list, take_handles};
use crate::pool::PyBlockManagerPool;

enum CacheRef {
    /// A cache of its own.
    Own(Box<Mutex<LinearStatePrefixCache>>),
    /// The cache of one rank of a pool.
    View {
        pool: Py<PyBlockManagerPool>,
        rank: usize,
    },
}

/// Recurrent-state slots (GDN / Mamba) and their prefix checkpoints (R22). Slot 0 is padding.
#[pyclass(frozen, module = "kvpool", name = "LinearStatePrefixCache")]
pub struct PyLinearStatePrefixCache {
    inner: CacheRef,
}

impl PyLinearStatePrefixCache {
    pub(crate) fn view(pool: Py<PyBlockManagerPool>, rank: usize) -> Self {
        Self {
            inner: CacheRef::View { pool, rank },
        }
    }

    fn with<T>(
        &self,
        call: impl FnOnce(&mut LinearStatePrefixCache) -> kvpool::Result<T>,
    ) -> PyResult<T> {
        match &self.inner {
            CacheRef::Own(cache) => call(&mut cache.lock()).py(),
            CacheRef::View { pool, rank } => pool.get().with_pool(|pool| {
                let cache = pool
                    .linear_state_cache_mut(*rank)
                    .expect("views exist only for pools with linear state");
                call(cache)
            }),
        }
    }
}

#[pymethods]
impl PyLinearStatePrefixCache {
    #[new]
    fn new(num_slots: &Bound<'_, PyAny>) -> PyResult<Self> {
        let num_slots = convert::count(num_slots, "num_slots")?;
        Ok(Self {
            inner: CacheRef::Own(Box::new(Mutex::new(
                LinearStatePrefixCache::new(num_slots).py()?,
            ))),
        })
    }

    /// Slots including the padding slot 0.
    #[getter]
    fn num_slots(&self) -> PyResult<usize> {
        self.with(|c| Ok(c.num_slots()))
    }
    /// Free slots.
    #[getter]
    fn num_free_slots(&self) -> PyResult<usize> {
        self.with(|c| Ok(c.num_free_slots()))
    }
    /// Live slots (held by running sequences or acquired with acquire_live_slot).
    #[getter]
    fn num_live_slots(&self) -> PyResult<usize> {
        self.with(|c| Ok(c.num_live_slots()))
    }
    /// Pending checkpoints (reserved, not matchable).
    #[getter]
    fn num_pending_checkpoints(&self) -> PyResult<usize> {
        self.with(|c| Ok(c.num_pending_checkpoints()))
    }
    /// Committed checkpoints (matchable).
    #[getter]
    fn num_committed_checkpoints(&self) -> PyResult<usize> {
        self.with(|c| Ok(c.num_committed_checkpoints()))
    }
    /// Committed checkpoints pinned by planned restores (not evictable).
    #[getter]
    fn num_pinned_checkpoints(&self) -> PyResult<usize> {
        self.with(|c| Ok(c.num_pinned_checkpoints()))
    }

    /// Takes a live slot, evicting the least-recently-used unpinned checkpoint if none is
    /// free; OutOfBlocksError when every slot is live, pending or pinned.
    fn acquire_live_slot(&self) -> PyResult<u32> {
        self.with(|c| c.acquire_live_slot())
    }

    /// Releases a slot taken with acquire_live_slot (anything else is a ValueError).
    fn release_live_slot(&self, slot: &Bound<'_, PyAny>) -> PyResult<()> {
        let slot = slot_arg(slot, "slot")?;
        self.with(|c| c.release_live_slot(slot))
    }

    /// Reserves a slot for the checkpoint of prefix_hash (16 bytes): pending, not matchable.
    /// None if the hash is already pending or committed, or if no slot can be had.
    fn reserve_checkpoint(&self, prefix_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let hash = convert::block_hash(prefix_hash, "prefix_hash")?;
        self.with(|c| Ok(c.reserve_checkpoint(hash)))
    }

    /// Makes the pending checkpoint of prefix_hash matchable (the worker wrote it).
    fn commit_checkpoint(&self, prefix_hash: &Bound<'_, PyAny>) -> PyResult<()> {
        let hash = convert::block_hash(prefix_hash, "prefix_hash")?;
        self.with(|c| c.commit_checkpoint(hash).map(|_| ()))
    }

    /// Drops the pending checkpoint of prefix_hash; its slot is free again.
    fn cancel_checkpoint(&self, prefix_hash: &Bound<'_, PyAny>) -> PyResult<()> {
        let hash = convert::block_hash(prefix_hash, "prefix_hash")?;
        self.with(|c| c.cancel_checkpoint(hash))
    }

    /// Zero-copy save: live_slot becomes the committed checkpoint of prefix_hash; returns the
    /// fresh live slot the sequence continues in.
    fn promote(
        &self,
        live_slot: &Bound<'_, PyAny>,
        prefix_hash: &Bound<'_, PyAny>,
    ) -> PyResult<u32> {
        let slot = slot_arg(live_slot, "live_slot")?;
        let hash = convert::block_hash(prefix_hash, "prefix_hash")?;
        self.with(|c| c.promote(slot, hash))
    }

    /// Whether a committed checkpoint of prefix_hash exists (pending ones never match).
    fn contains(&self, prefix_hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        let hash = convert::block_hash(prefix_hash, "prefix_hash")?;
        self.with(|c| Ok(c.contains(hash)))
    }

    fn __contains__(&self, prefix_hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.contains(prefix_hash)
    }

    /// Slot of the committed checkpoint of prefix_hash (refreshes its recency), or None.
    fn lookup(&self, prefix_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let hash = convert::block_hash(prefix_hash, "prefix_hash")?;
        self.with(|c| Ok(c.lookup(hash)))
    }

    /// Evicts up to n committed checkpoints, least recently used first, never pinned ones.
    fn evict(&self, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = convert::count(n, "n")?;
        self.with(|c| Ok(c.evict(n)))
    }

    /// Drops every committed checkpoint that nothing pins.
    fn reset(&self) -> PyResult<()> {
        self.with(|c| {
            c.reset();
            Ok(())
        })
    }

    /// Unpinned committed checkpoint slots, least recently used first.
    fn lru_order(&self) -> PyResult<Vec<u32>> {
        self.with(|c| Ok(c.lru_order()))
    }

    /// Counters: hits, evictions, commits.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(|c| Ok(c.stats()))?;
        let d = PyDict::new(py);
        d.set_item("hits", s.hits)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("commits", s.commits)?;
        Ok(d)
    }

    /// Walks every structure; raises InvariantError if a rule is broken.
    fn check(&self) -> PyResult<()> {
        self.with(|c| c.check())
    }

    fn __repr__(&self) -> PyResult<String> {
        self.with(|c| Ok(format!("{c:?}")))
    }
}

fn slot_arg(value: &Bound<'_, PyAny>, name: &str) -> PyResult<u32> {
    let slot = convert::count(value, name)?;
    u32::try_from(slot).map_err(|_| value_error(name, format!("{slot} is out of range")))
}

/// The recurrent-state copies the worker makes before the next step (R24): first every
/// restore (restore_src -> restore_dst), then every save (save_src -> save_dst). Arrays are
/// int32 of equal length per kind; `dp_rank` lists the restores' ranks, then the saves'.
#[pyclass(frozen, module = "kvpool", name = "LinearStatePlan")]
pub struct PyLinearStatePlan {
    pub(crate) plan: LinearStatePlan,
}

fn int32<'py>(py: Python<'py>, values: &[i32]) -> Bound<'py, PyArray1<i32>> {
    values.to_vec().into_pyarray(py)
}

#[pymethods]
impl PyLinearStatePlan {
    /// dp rank of every copy: the restores' ranks, then the saves' (int32).
    #[getter]
    fn dp_rank<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        let mut ranks = self.plan.restore_dp_rank.clone();
        ranks.extend_from_slice(&self.plan.save_dp_rank);
        ranks.into_pyarray(py)
    }
    /// dp rank of each restore (int32).
    #[getter]
    fn restore_dp_rank<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.plan.restore_dp_rank)
    }
    /// Checkpoint slots to read (int32).
    #[getter]
    fn restore_src<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.plan.restore_src)
    }
    /// Live slots to write (int32).
    #[getter]
    fn restore_dst<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.plan.restore_dst)
    }
    /// dp rank of each save (int32).
    #[getter]
    fn save_dp_rank<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.plan.save_dp_rank)
    }
    /// Live slots to read (int32).
    #[getter]
    fn save_src<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.plan.save_src)
    }
    /// Pending checkpoint slots to write (int32).
    #[getter]
    fn save_dst<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.plan.save_dst)
    }
    /// Prefix hash (16 bytes) of each saved checkpoint.
    #[getter]
    fn save_hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.plan
                .save_hashes
                .iter()
                .map(|h| PyBytes::new(py, &h.to_bytes())),
        )
    }
    /// Number of copies.
    fn __len__(&self) -> usize {
        self.plan.len()
    }
    fn __bool__(&self) -> bool {
        !self.plan.is_empty()
    }
    fn __repr__(&self) -> String {
        format!(
            "LinearStatePlan(restores={}, saves={})",
            self.plan.restore_src.len(),
            self.plan.save_src.len()
        )
    }
}

/// Block allocator of a sliding-window group (R25): blocks whose tokens all lie before
/// num_computed_tokens - window + 1 can be released.
#[pyclass(frozen, module = "kvpool", name = "SlidingWindowBlockManager")]
pub struct PySlidingWindowBlockManager {
    inner: Mutex<SlidingWindowBlockManager>,
    num_blocks: usize,
}

#[pymethods]
impl PySlidingWindowBlockManager {
    #[new]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        window: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let num_blocks = convert::count(num_blocks, "num_blocks")?;
        let block_size = convert::count(block_size, "block_size")?;
        let window = convert::count(window, "window")?;
        Ok(Self {
            inner: Mutex::new(
                SlidingWindowBlockManager::new(num_blocks, block_size, window, false).py()?,
            ),
            num_blocks,
        })
    }
    /// Ids in the pool, padding id 0 included.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.lock().block_size()
    }
    /// The window, in tokens.
    #[getter]
    fn window(&self) -> usize {
        self.inner.lock().window()
    }
    #[getter]
    fn num_total_blocks(&self) -> usize {
        self.inner.lock().counts().total
    }
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.lock().counts().free
    }
    #[getter]
    fn num_used_blocks(&self) -> usize {
        self.inner.lock().counts().used
    }
    /// Index of the first block the query at position num_computed_tokens can attend to; the
    /// blocks before it can be released.
    fn first_needed_block(&self, num_computed_tokens: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = convert::count(num_computed_tokens, "num_computed_tokens")?;
        Ok(self.inner.lock().first_needed_block(n))
    }
    /// n fresh blocks; OutOfBlocksError if fewer are free, changing nothing.
    fn allocate<'py>(&self, py: Python<'py>, n: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyList>> {
        allocate_list(py, &self.inner, n)
    }
    /// Releases these handles; a released handle again is a ValueError.
    fn deallocate(&self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        deallocate_list(&self.inner, blocks)
    }
    /// Walks every structure; raises InvariantError if a rule is broken.
    fn check(&self) -> PyResult<()> {
        self.inner.lock().check().py()
    }
    fn __repr__(&self) -> String {
        let m = self.inner.lock();
        let c = m.counts();
        format!(
            "SlidingWindowBlockManager(num_blocks={}, block_size={}, window={}, free={}, used={})",
            self.num_blocks,
            m.block_size(),
            m.window(),
            c.free,
            c.used
        )
    }
}

/// Several block groups in one manager (R25), each with its own ids and block size: full
/// attention groups keep their blocks, sliding-window groups release the ones behind the window.
#[pyclass(frozen, module = "kvpool", name = "CompositeBlockManager")]
pub struct PyCompositeBlockManager {
    inner: Mutex<CompositeBlockManager>,
}

fn group_arg(group: &Bound<'_, PyAny>, num_groups: usize) -> PyResult<usize> {
    let g = convert::count(group, "group")?;
    if g >= num_groups {
        return Err(value_error(
            "group",
            format!("must be < {num_groups}, got {g}"),
        ));
    }
    Ok(g)
}

#[pymethods]
impl PyCompositeBlockManager {
    /// `groups`: a list of `(num_blocks, block_size, window)` tuples, window None for full
    /// attention.
    #[new]
    fn new(groups: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut specs = Vec::new();
        for item in groups.try_iter().map_err(|_| {
            type_error(
                "groups",
                "must be a list of (num_blocks, block_size, window)",
            )
        })? {
            let item = item?;
            let (num_blocks, block_size, window): (
                Bound<'_, PyAny>,
                Bound<'_, PyAny>,
                Bound<'_, PyAny>,
            ) = item.extract().map_err(|_| {
                type_error(
                    "groups",
                    "each group must be a (num_blocks, block_size, window) tuple",
                )
            })?;
            specs.push(GroupSpec {
                num_blocks: convert::count(&num_blocks, "groups")?,
                block_size: convert::count(&block_size, "groups")?,
                window: convert::optional_count(Some(&window), "groups")?,
            });
        }
        Ok(Self {
            inner: Mutex::new(CompositeBlockManager::new(&specs).py()?),
        })
    }
    /// Number of groups.
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.lock().num_groups()
    }
    /// Tokens per block of group g.
    fn block_size(&self, group: &Bound<'_, PyAny>) -> PyResult<usize> {
        let m = self.inner.lock();
        let g = group_arg(group, m.num_groups())?;
        Ok(m.group(g).py()?.as_manager().block_size())
    }
    /// Sliding window of group g in tokens, None for full attention.
    fn window(&self, group: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let m = self.inner.lock();
        let g = group_arg(group, m.num_groups())?;
        Ok(m.group(g).py()?.window())
    }
    /// Block counts of group g as a dict.
    fn counts<'py>(
        &self,
        py: Python<'py>,
        group: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let counts = {
            let m = self.inner.lock();
            let g = group_arg(group, m.num_groups())?;
            m.counts(g).py()?
        };
        counts_dict(py, &counts)
    }
    /// n fresh blocks of group g; OutOfBlocksError if fewer are free, changing nothing.
    fn allocate<'py>(
        &self,
        py: Python<'py>,
        group: &Bound<'_, PyAny>,
        n: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = convert::count(n, "n")?;
        let blocks = {
            let mut m = self.inner.lock();
            let g = group_arg(group, m.num_groups())?;
            m.group_mut(g).py()?.as_manager_mut().allocate(n).py()?
        };
        blocks_to_list(py, blocks)
    }
    /// Releases these handles (of any group); a released handle again is a ValueError.
    fn deallocate(&self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let m = self.inner.lock();
        let handles = take_handles(blocks, "blocks", |b| m.owner_of(b).is_some())?;
        drop(handles);
        Ok(())
    }
    /// Walks every group; raises InvariantError if a rule is broken.
    fn check(&self) -> PyResult<()> {
        self.inner.lock().check().py()
    }
    fn __repr__(&self) -> String {
        format!("CompositeBlockManager(num_groups={})", self.num_groups())
    }
}
