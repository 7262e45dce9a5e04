//! `kvpool.LinearStatePrefixCache` and `kvpool.LinearStatePlan` (R22-R24). A cache is its
//! own, or a live view of one rank of a pool holding the core pool's handle. Each method
//! validates, makes one core call and maps the error.

use std::sync::Arc;

use kvpool::{BlockManagerPool, LinearStatePlan, LinearStatePrefixCache};
use numpy::{IntoPyArray, PyArray1};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::convert;
use crate::errors::{value_error, IntoPyResult};

enum CacheRef {
    /// A cache of its own.
    Own(Box<Mutex<LinearStatePrefixCache>>),
    /// The cache of one rank of a pool (the core pool's handle, not the Python object).
    View {
        pool: Arc<Mutex<BlockManagerPool>>,
        rank: usize,
    },
}

/// Recurrent-state slots (GDN / Mamba) and their prefix checkpoints (R22). Slot 0 is padding.
#[pyclass(frozen, module = "kvpool", name = "LinearStatePrefixCache")]
pub struct PyLinearStatePrefixCache {
    inner: CacheRef,
}

impl PyLinearStatePrefixCache {
    pub(crate) fn view(pool: Arc<Mutex<BlockManagerPool>>, rank: usize) -> Self {
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
            CacheRef::View { pool, rank } => {
                // Waited for without the GIL (a page backend object may hold the pool's lock).
                let mut pool = Python::attach(|py| crate::pool_lock::lock_pool(py, pool))?;
                match pool.linear_state_cache_mut(*rank) {
                    Some(cache) => call(cache).py(),
                    // Views exist only for ranks with linear state: unreachable.
                    None => Err(crate::errors::InvariantError::new_err(
                        "the pool's rank has no linear state",
                    )),
                }
            }
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

/// What the worker does to the recurrent state before the next step (R24): first it zeroes
/// every slot of zero_slots, then every restore (restore_src -> restore_dst), then every save
/// (save_src -> save_dst). Arrays are int32 of equal length per kind; `dp_rank` lists the
/// restores' ranks, then the saves'.
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
    /// dp rank of each zeroed slot (int32).
    #[getter]
    fn zero_dp_rank<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.plan.zero_dp_rank)
    }
    /// Live slots to fill with zeros before anything else: taken without a restore (int32).
    #[getter]
    fn zero_slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        int32(py, &self.plan.zero_slots)
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
    /// Number of operations: zeroed slots, restores and saves.
    fn __len__(&self) -> usize {
        self.plan.len()
    }
    fn __bool__(&self) -> bool {
        !self.plan.is_empty()
    }
    fn __repr__(&self) -> String {
        format!(
            "LinearStatePlan(zeros={}, restores={}, saves={})",
            self.plan.zero_slots.len(),
            self.plan.restore_src.len(),
            self.plan.save_src.len()
        )
    }
}
