//! `kvpool.BlockManagerPool`: the sequence-level pool (R13-R25), the base class of
//! `kvpool.HierarchyBlockManagerPool`. Each method validates, makes one core call and maps the
//! error. Lock order: a `SequenceBatch` argument, the pool, then the sequences (see
//! `batch.rs`); no lock is held while Python code runs, except a page backend object's
//! `map_page` / `unmap_page` (the `xtensor` option), which runs under the pool's lock: such a pool
//! releases the GIL in every call, and every lock of the pool is waited for without the GIL
//! ([`lock_pool`]), so the backend's thread can always take it. A pool built with
//! `concurrent=True` releases the GIL in every call (R28).

use std::sync::Arc;

use kvpool::{BlockManagerPool, KvCacheManager, PoolConfig, Sequence, TableExtent};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::batch::SeqsArg;
use crate::convert;
use crate::errors::{to_py, type_error, value_error, IntoPyResult};
use crate::events::events_list;
use crate::linear_state::{PyLinearStatePlan, PyLinearStatePrefixCache};
use crate::options::Options;
use crate::plan::{plan_arg, PyAllocationPlan};
use crate::pool_lock::lock_pool;
use crate::sequence::seq_ref;
use crate::stats::pool_dict;
use crate::xtensor::{in_backend, ErrorSlot, PythonBackend};

/// Sequence-level KV-cache manager: per dp rank a BlockManager and a SingleBlockManager.
#[pyclass(subclass, frozen, module = "kvpool", name = "BlockManagerPool")]
pub struct PyBlockManagerPool {
    pub(crate) inner: Arc<Mutex<BlockManagerPool>>,
    num_blocks: usize,
    block_size: usize,
    dp_size: usize,
    enable_prefix_cache: bool,
    concurrent: bool,
    /// Release the GIL in every call: `concurrent`, or page backend objects (which need it).
    detach: bool,
    /// Where each rank's page backend object leaves the exception it raised (empty without).
    backend_errors: Vec<ErrorSlot>,
}

/// `num_tokens` / `num_new_tokens` of `allocate`, `plan` and `can_allocate` (R14).
pub(crate) fn extent_arg(
    num_tokens: Option<&Bound<'_, PyAny>>,
    num_new_tokens: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<TableExtent>> {
    let n = convert::optional_count(num_tokens, "num_tokens")?;
    let new = convert::optional_count(num_new_tokens, "num_new_tokens")?;
    TableExtent::from_args(n, new).py()
}

pub(crate) fn group_arg(group: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    match group {
        Some(g) if !g.is_none() => convert::count(g, "group"),
        _ => Ok(0),
    }
}

impl PyBlockManagerPool {
    /// A pool per `config` (the constructor of both pool classes).
    pub(crate) fn build(config: PoolConfig, concurrent: bool) -> PyResult<Self> {
        Self::build_with(config, concurrent, Vec::new())
    }

    /// A pool whose rank `r` maps its pages through `backends[r]` (a Python object), if any.
    fn build_with(
        config: PoolConfig,
        concurrent: bool,
        backends: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let (num_blocks, block_size, dp_size) =
            (config.num_blocks, config.block_size, config.dp_size);
        let enable_prefix_cache = config.enable_prefix_cache;
        let backend_errors: Vec<ErrorSlot> =
            backends.iter().map(|_| ErrorSlot::default()).collect();
        let pool = match backends.is_empty() {
            true => BlockManagerPool::new(config).py()?,
            false => {
                let boxes: Vec<Box<dyn kvpool::PageBackend>> = backends
                    .iter()
                    .zip(&backend_errors)
                    .map(|(b, slot)| {
                        Box::new(PythonBackend::new(b.clone().unbind(), Arc::clone(slot)))
                            as Box<dyn kvpool::PageBackend>
                    })
                    .collect();
                BlockManagerPool::with_page_backends(config, boxes)
                    .map_err(|e| Self::raised(&backend_errors, e))?
            }
        };
        Ok(Self {
            inner: Arc::new(Mutex::new(pool)),
            num_blocks,
            block_size,
            dp_size,
            enable_prefix_cache,
            concurrent,
            detach: concurrent || !backend_errors.is_empty(),
            backend_errors,
        })
    }

    /// Maps a core error, re-raising a page backend object's own exception.
    fn raised(slots: &[ErrorSlot], error: kvpool::KvPoolError) -> PyErr {
        slots
            .iter()
            .find_map(|slot| slot.lock().take())
            .unwrap_or_else(|| to_py(error))
    }

    /// `.py()` of a core result; a page backend object's exception raised during the call is
    /// raised as itself, also where the core turned it into "no room" (a failed growth changes
    /// nothing). One the core deferred (met while settling after the call's own work: the page
    /// stays as it was and the next call retries first) was dropped from its slot
    /// (`PageBackend::deferred`), so the call's result stands.
    fn result<T>(&self, result: kvpool::Result<T>) -> PyResult<T> {
        let mut raised = None;
        for slot in &self.backend_errors {
            if let Some(error) = slot.lock().take() {
                raised.get_or_insert(error);
            }
        }
        match (result, raised) {
            (_, Some(error)) => Err(error),
            (Ok(value), None) => Ok(value),
            (Err(error), None) => Err(to_py(error)),
        }
    }

    /// Locks the pool (the GIL held; see [`lock_pool`]).
    fn lock(&self, py: Python<'_>) -> PyResult<MutexGuard<'_, BlockManagerPool>> {
        lock_pool(py, &self.inner)
    }

    /// A `RuntimeError` if a page backend calls its pool (it runs under the pool's lock).
    fn not_in_backend() -> PyResult<()> {
        match in_backend() {
            true => Err(pyo3::exceptions::PyRuntimeError::new_err(
                "BlockManagerPool: a page backend must not call its pool",
            )),
            false => Ok(()),
        }
    }

    /// Runs `call` with the GIL released if the pool is concurrent (R28) or has page backend
    /// objects.
    fn run<T: Send>(&self, py: Python<'_>, call: impl FnOnce() -> T + Send) -> T {
        if self.detach {
            py.detach(call)
        } else {
            call()
        }
    }

    /// Locks the pool, then `seq` (the lock order everywhere), and makes one core call.
    pub(crate) fn with_seq<T: Send>(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        call: impl FnOnce(&mut BlockManagerPool, &mut Sequence) -> kvpool::Result<T> + Send,
    ) -> PyResult<T> {
        Self::not_in_backend()?;
        let seq = seq_ref(seq)?.get();
        let inner = &self.inner;
        let result = self.run(py, || {
            let mut pool = inner.lock();
            let mut seq = seq.inner.lock();
            call(&mut pool, &mut seq)
        });
        self.result(result)
    }

    /// Locks the pool and makes one core call.
    pub(crate) fn with_pool<T: Send>(
        &self,
        py: Python<'_>,
        call: impl FnOnce(&mut BlockManagerPool) -> kvpool::Result<T> + Send,
    ) -> PyResult<T> {
        Self::not_in_backend()?;
        let inner = &self.inner;
        let result = self.run(py, || call(&mut inner.lock()));
        self.result(result)
    }

    /// Locks the pool and `seqs` (GIL released) for a batch call, each distinct sequence once
    /// (a list may name one twice), and makes one core call on them in argument order.
    fn with_seqs<T: Send>(
        &self,
        py: Python<'_>,
        seqs: &SeqsArg<'_>,
        call: impl FnOnce(&mut BlockManagerPool, &mut crate::batch::Locked<'_>) -> kvpool::Result<T>
            + Send,
    ) -> PyResult<T> {
        Self::not_in_backend()?;
        let view = seqs.view();
        let result = py.detach(|| view.with_locked(&self.inner, call));
        self.result(result)
    }

    /// `allocate(seq, num_tokens, plan=plan)` (R14), shared with the subclass.
    pub(crate) fn allocate_with(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
        plan: Option<&Bound<'_, PyAny>>,
        remote: Option<kvpool::RemoteHits>,
    ) -> PyResult<bool> {
        let extent = extent_arg(num_tokens, None)?;
        self.allocate_extent(py, seq, extent, plan, remote)
    }

    /// `allocate(seq, num_tokens | num_new_tokens, plan=plan)` (R14), shared with the subclass.
    pub(crate) fn allocate_extent(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        extent: Option<TableExtent>,
        plan: Option<&Bound<'_, PyAny>>,
        remote: Option<kvpool::RemoteHits>,
    ) -> PyResult<bool> {
        let plan = plan_arg(plan)?;
        let plan = plan.map(|p| &p.get().plan);
        self.with_seq(py, seq, |pool, seq| {
            pool.allocate_extent(seq, extent, plan, remote)
        })
    }

    /// `plan(seq, num_tokens | num_new_tokens)`.
    pub(crate) fn plan_extent(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        extent: Option<TableExtent>,
    ) -> PyResult<Option<PyAllocationPlan>> {
        let plan = self.with_seq(py, seq, |pool, seq| pool.plan_extent(seq, extent))?;
        Ok(plan.map(|p| PyAllocationPlan::new(p, self.block_size)))
    }

    /// The stats dict and the host totals (the hierarchy subclass reads their remote counters).
    pub(crate) fn stats_dict<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyDict>, Option<kvpool::HostStats>)> {
        let (stats, hosts) = {
            let pool = self.lock(py)?;
            (pool.stats(), pool.host_stats())
        };
        pool_dict(py, &stats, hosts.as_deref())
    }
}

#[pymethods]
impl PyBlockManagerPool {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, **options))]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let options = Options::new("BlockManagerPool", options, &["xtensor"])?;
        let (mut config, concurrent) = options.pool_config(num_blocks, block_size)?;
        let backends = match config.xtensor.as_mut() {
            Some(x) => crate::elastic::python_backends(
                options.get("xtensor")?.as_ref(),
                x,
                config.dp_size,
                config.num_blocks,
            )?,
            None => Vec::new(),
        };
        Self::build_with(config, concurrent, backends)
    }

    /// Block ids per rank, padding block included.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }
    /// Number of data-parallel ranks.
    #[getter]
    fn dp_size(&self) -> usize {
        self.dp_size
    }
    /// Whether each rank keeps a prefix cache.
    #[getter]
    fn enable_prefix_cache(&self) -> bool {
        self.enable_prefix_cache
    }
    /// Whether the pool releases the GIL in every call (built with concurrent=True, R28).
    #[getter]
    fn concurrent(&self) -> bool {
        self.concurrent
    }
    /// Free blocks over all ranks (`stats()["num_free_blocks"]`, without building the dict).
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.total_counts().free)
    }
    /// Cache-only blocks over all ranks (`stats()["num_cached_blocks"]`).
    #[getter]
    fn num_cached_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.total_counts().cached)
    }
    /// Blocks held by sequences over all ranks (`stats()["num_used_blocks"]`).
    #[getter]
    fn num_used_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.total_counts().used)
    }
    /// Block groups of every sequence: 1, or 1 + window_groups with sliding_window (R25).
    #[getter]
    fn num_groups(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.num_groups())
    }

    /// What allocate(seq, num_tokens) would return, with no side effect (R15).
    #[pyo3(signature = (seq, num_tokens = None, *, num_new_tokens = None))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
        num_new_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let extent = extent_arg(num_tokens, num_new_tokens)?;
        self.with_seq(py, seq, |pool, seq| {
            pool.plan_extent(seq, extent).map(|p| p.is_some())
        })
    }

    /// The allocation allocate(seq, num_tokens) would make, with no side effect, or None.
    #[pyo3(signature = (seq, num_tokens = None, *, num_new_tokens = None))]
    fn plan(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
        num_new_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<PyAllocationPlan>> {
        let extent = extent_arg(num_tokens, num_new_tokens)?;
        self.plan_extent(py, seq, extent)
    }

    /// Blocks for num_tokens tokens (or the hit plus num_new_tokens) after a prefix-cache match
    /// (R8, R13, R14); consumes plan.
    #[pyo3(signature = (seq, num_tokens = None, *, plan = None, num_new_tokens = None))]
    fn allocate(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
        plan: Option<&Bound<'_, PyAny>>,
        num_new_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let extent = extent_arg(num_tokens, num_new_tokens)?;
        self.allocate_extent(py, seq, extent, plan, None)
    }

    /// R24: the smallest computed-token count past seq.num_computed_tokens, at most len(seq),
    /// at which cache(seq) plans a checkpoint save; None without linear state or when none is
    /// left. A prefill chunk ends there, or the boundary is not saved.
    fn next_checkpoint_boundary(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
    ) -> PyResult<Option<usize>> {
        self.with_seq(py, seq, |pool, seq| pool.next_checkpoint_boundary(seq))
    }

    /// The prefix hit only (its blocks, the single block, the live slot), into a free seq.
    fn allocate_shared(&self, py: Python<'_>, seq: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.with_seq(py, seq, |pool, seq| pool.allocate_shared(seq))
    }

    /// Whether the blocks for len(seq) + lookahead tokens can be had (R16).
    #[pyo3(signature = (seq, lookahead = None), text_signature = "(self, seq, lookahead=0)")]
    fn can_append(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let lookahead = convert::optional_count(lookahead, "lookahead")?.unwrap_or(0);
        self.with_seq(py, seq, |pool, seq| pool.can_append(seq, lookahead))
    }

    /// Takes the blocks can_append asks about (all-or-nothing; False if they cannot be had, R16).
    #[pyo3(signature = (seq, lookahead = None), text_signature = "(self, seq, lookahead=0)")]
    fn may_append(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let lookahead = convert::optional_count(lookahead, "lookahead")?.unwrap_or(0);
        self.with_seq(py, seq, |pool, seq| pool.may_append(seq, lookahead))
    }

    /// Publishes the full blocks inside seq.num_computed_tokens in the prefix cache (R17).
    fn cache(&self, py: Python<'_>, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_seq(py, seq, |pool, seq| pool.cache(seq))
    }

    /// cache(seq), then releases what it holds and resets it (R18; with a host tier, R26).
    fn deallocate(&self, py: Python<'_>, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_seq(py, seq, |pool, seq| pool.deallocate(seq))
    }

    /// Session hint: keeps seq's published prefix from eviction until now + ttl (the caller's
    /// clock) or release_retained (docs/sessions.md).
    fn retain(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        ttl: &Bound<'_, PyAny>,
        now: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let ttl = convert::seconds(ttl, "ttl")?;
        let now = convert::seconds(now, "now")?;
        self.with_seq(py, seq, |pool, seq| pool.retain(seq, ttl, now))
    }

    /// Ends the session hint of the sequence with this id (or of this Sequence).
    fn release_retained(&self, py: Python<'_>, seq: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = match seq.cast::<crate::sequence::PySequence>() {
            Ok(s) => s.get().inner.lock().seq_id(),
            Err(_) => convert::uint64(seq, "seq")?,
        };
        self.with_pool(py, |pool| Ok(pool.release_retained(id)))
    }

    /// Drops the session hints whose time to live ran out by now; returns how many.
    fn expire_retained(&self, py: Python<'_>, now: &Bound<'_, PyAny>) -> PyResult<usize> {
        let now = convert::seconds(now, "now")?;
        self.with_pool(py, |pool| pool.expire_retained(now))
    }

    /// Session hints held now.
    #[getter]
    fn num_retained(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.num_retained())
    }

    /// Blocks session hints hold, over all ranks (each counted once).
    #[getter]
    fn num_retained_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        let pool = self.lock(py)?;
        Ok((0..pool.dp_size())
            .map(|r| pool.num_retained_blocks(r))
            .sum())
    }

    /// Block tables of seqs: int32 [len(seqs), max_blocks], padded with pad (R19).
    #[pyo3(
        signature = (seqs, group = None, *, pad = None),
        text_signature = "(self, seqs, group=0, *, pad=0)"
    )]
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        seqs: &Bound<'py, PyAny>,
        group: Option<&Bound<'py, PyAny>>,
        pad: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let group = group_arg(group)?;
        let pad = match pad.filter(|p| !p.is_none()) {
            None => 0,
            Some(p) => {
                let value = convert::int(p, "pad")?;
                i32::try_from(value)
                    .map_err(|_| value_error("pad", format!("must fit in int32, got {value}")))?
            }
        };
        let seqs = SeqsArg::extract(seqs)?;
        let (rows, table, width) = self.with_seqs(py, &seqs, |pool, locked| {
            let refs = locked.refs();
            pool.block_tables_padded(&refs, group, pad)
                .map(|(t, w)| (refs.len(), t, w))
        })?;
        let array = Array2::from_shape_vec((rows, width), table)
            .map_err(|e| value_error("seqs", e.to_string()))?;
        Ok(array.into_pyarray(py))
    }

    /// Cache slots (int64) of tokens [num_computed_tokens, len) of every sequence (R19), or of
    /// the next num_tokens[i] tokens of seqs[i] (chunked prefill).
    #[pyo3(
        signature = (seqs, group = None, *, num_tokens = None),
        text_signature = "(self, seqs, group=0, *, num_tokens=None)"
    )]
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seqs: &Bound<'py, PyAny>,
        group: Option<&Bound<'py, PyAny>>,
        num_tokens: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let group = group_arg(group)?;
        let counts = match num_tokens.filter(|n| !n.is_none()) {
            None => None,
            Some(n) => Some(convert::tokens(n, "num_tokens")?),
        };
        let seqs = SeqsArg::extract(seqs)?;
        let slots = self.with_seqs(py, &seqs, |pool, locked| {
            pool.slot_mapping_counts(&locked.refs(), group, counts.as_deref())
        })?;
        Ok(slots.into_pyarray(py))
    }

    /// Counts, prefix-cache, slot and host-tier statistics, totals and per rank (R20).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        Ok(self.stats_dict(py)?.0)
    }

    /// Memory per group of every rank (docs/hybrid.md "One block store"): a census of the
    /// store, O(blocks); `stats()` has the totals.
    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        let ranks = self.lock(py)?.memory();
        let out = pyo3::types::PyList::empty(py);
        for rank in ranks {
            let d = PyDict::new(py);
            d.set_item("num_blocks", rank.num_blocks)?;
            d.set_item("free_blocks", rank.free_blocks)?;
            d.set_item("block_bytes", rank.block_bytes)?;
            let groups = pyo3::types::PyList::empty(py);
            for (position, cached, used) in rank.shared {
                let g = PyDict::new(py);
                g.set_item("group", position)?;
                g.set_item("cached_blocks", cached)?;
                g.set_item("used_blocks", used)?;
                groups.append(g)?;
            }
            d.set_item("shared", groups)?;
            match rank.own_window {
                Some((position, counts)) => {
                    let w = crate::stats::counts_dict(py, &counts)?;
                    w.set_item("group", position)?;
                    d.set_item("own_window", w)?;
                }
                None => d.set_item("own_window", py.None())?,
            }
            match rank.linear_slots {
                Some((position, in_use, total)) => {
                    let l = PyDict::new(py);
                    l.set_item("group", position)?;
                    l.set_item("slots_in_use", in_use)?;
                    l.set_item("slots", total)?;
                    d.set_item("linear_state", l)?;
                }
                None => d.set_item("linear_state", py.None())?,
            }
            out.append(d)?;
        }
        Ok(out)
    }

    /// Chain walks of the device and host caches so far (a debug counter, for tests).
    fn debug_counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.lock(py)?.debug_counters();
        let d = PyDict::new(py);
        d.set_item("device_chain_walks", c.device_chain_walks)?;
        d.set_item("host_chain_walks", c.host_chain_walks)?;
        Ok(d)
    }

    /// Walks every structure; raises InvariantError if a rule is broken (R20).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        Self::not_in_backend()?;
        let inner = &self.inner;
        py.detach(|| inner.lock().check()).py()
    }

    /// Returns and clears the recorded KV events (R21); [] unless enable_events.
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.lock(py)?.drain_events();
        events_list(py, events)
    }

    /// Returns and clears the table entries dedup on publish switched (R9 revised): a list of
    /// (seq_id, old block id, new block id), or with with_group=True of (seq_id, group, old,
    /// new); [] with dedup=False.
    /// `with_group` is a bool (pyo3's conversion: None or an int is a TypeError naming it).
    #[pyo3(signature = (*, with_group = false))]
    fn drain_block_switches<'py>(
        &self,
        py: Python<'py>,
        with_group: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let switches = self.lock(py)?.drain_block_switches_by_group();
        match with_group {
            true => PyList::new(py, switches),
            false => PyList::new(
                py,
                switches
                    .into_iter()
                    .map(|(seq, _, old, new)| (seq, old, new)),
            ),
        }
    }

    /// Whether the pool dedups on publish (R9 revised; built with dedup=True, the default).
    #[getter]
    fn dedup(&self) -> bool {
        self.inner.lock().config().dedup
    }

    /// The prefix cache's eviction policy (R11a): "lru" (the default), "slru" or "ghost_slru".
    #[getter]
    fn eviction(&self) -> &'static str {
        self.inner.lock().config().eviction.name()
    }

    /// The share of the blocks, in percent, SLRU's protected segment may hold (R11a).
    #[getter]
    fn protected_percent(&self) -> usize {
        self.inner.lock().config().protected_percent
    }

    /// The last event sequence number of dp_rank (0 before its first event).
    fn last_event_sequence(&self, dp_rank: &Bound<'_, PyAny>) -> PyResult<u64> {
        let rank = convert::count(dp_rank, "dp_rank")?;
        self.inner.lock().last_event_sequence(rank).py()
    }

    /// Replay: dp_rank's events numbered sequence and later from the bounded buffer, or None
    /// when the buffer no longer reaches back that far (the consumer resyncs).
    fn events_since<'py>(
        &self,
        py: Python<'py>,
        dp_rank: &Bound<'_, PyAny>,
        sequence: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let rank = convert::count(dp_rank, "dp_rank")?;
        let from = convert::uint64(sequence, "sequence")?;
        let events = self.inner.lock().events_since(rank, from).py()?;
        events.map(|e| events_list(py, e)).transpose()
    }

    /// Records the remote tier's stores or removals of dp_rank's blocks as "remote" events;
    /// returns the number of events recorded (0 without enable_events).
    fn record_remote_events(
        &self,
        dp_rank: &Bound<'_, PyAny>,
        kind: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let rank = convert::count(dp_rank, "dp_rank")?;
        let kind = match convert::choice(Some(kind), "kind", "")?.as_str() {
            "stored" => kvpool::KvEventKind::Stored,
            "removed" => kvpool::KvEventKind::Removed,
            other => {
                return Err(value_error(
                    "kind",
                    format!("must be 'stored' or 'removed', got {other:?}"),
                ))
            }
        };
        let hashes = crate::index::hashes_from_py(block_hashes, "block_hashes")?;
        self.inner
            .lock()
            .record_remote_events(rank, kind, &hashes)
            .py()
    }

    /// Drops every cached entry nothing holds, of every rank and tier (R12, R24, R26).
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<()> {
        Self::not_in_backend()?;
        let inner = &self.inner;
        py.detach(|| inner.lock().reset_prefix_cache());
        self.result(Ok(()))
    }

    /// After a forward step, for every sequence: computed, cache, append token_ids[i] (R17).
    #[pyo3(signature = (seqs, token_ids, *, lookahead = None))]
    fn advance(
        &self,
        py: Python<'_>,
        seqs: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Vec<usize>>> {
        let lookahead = convert::optional_count(lookahead, "lookahead")?;
        let seqs = SeqsArg::extract(seqs)?;
        let tokens = convert::tokens(token_ids, "token_ids")?;
        self.with_seqs(py, &seqs, |pool, locked| {
            let mut args = locked.args_mut()?;
            match lookahead {
                None => pool.advance_all(&mut args, &tokens).map(|()| None),
                Some(n) => pool
                    .advance_and_reserve_all(&mut args, &tokens, n)
                    .map(Some),
            }
        })
    }

    /// may_append(seq, lookahead) for every sequence; the indices of those that got no room.
    #[pyo3(signature = (seqs, lookahead = None), text_signature = "(self, seqs, lookahead=0)")]
    fn may_append_all(
        &self,
        py: Python<'_>,
        seqs: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<usize>> {
        let lookahead = convert::optional_count(lookahead, "lookahead")?.unwrap_or(0);
        let seqs = SeqsArg::extract(seqs)?;
        self.with_seqs(py, &seqs, |pool, locked| {
            pool.may_append_all(&mut locked.args_mut()?, lookahead)
        })
    }

    /// The xtensor option (elastic pages per dp rank, defaults filled in), or None.
    #[getter]
    fn xtensor<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let options = self.lock(py)?.config().xtensor;
        options
            .map(|o| crate::elastic::options_dict(py, &o))
            .transpose()
    }

    /// Sets the memory limit in bytes (None: the whole range) of dp rank dp_rank, or of every
    /// rank; one report per rank set (docs/xtensor.md). Needs the xtensor option.
    #[pyo3(signature = (limit, *, dp_rank = None))]
    fn set_memory_limit<'py>(
        &self,
        py: Python<'py>,
        limit: Option<&Bound<'py, PyAny>>,
        dp_rank: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let limit = match limit {
            Some(l) if !l.is_none() => Some(convert::uint64(l, "limit")?),
            _ => None,
        };
        let rank = convert::optional_count(dp_rank, "dp_rank")?;
        if let Some(rank) = rank.filter(|&r| r >= self.dp_size) {
            return Err(value_error(
                "dp_rank",
                format!("must be < dp_size {}, got {rank}", self.dp_size),
            ));
        }
        let reports = self.with_pool(py, |pool| pool.set_memory_limit(limit, rank))?;
        let list = PyList::empty(py);
        for report in &reports {
            list.append(crate::xtensor::report_dict(py, report)?)?;
        }
        Ok(list)
    }

    /// The mapped pages of dp rank dp_rank, ascending (elastic pages; [] without xtensor).
    #[pyo3(signature = (dp_rank = None), text_signature = "(self, dp_rank=0)")]
    fn mapped_page_ids(
        &self,
        py: Python<'_>,
        dp_rank: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<usize>> {
        let rank = convert::optional_count(dp_rank, "dp_rank")?.unwrap_or(0);
        if rank >= self.dp_size {
            return Err(value_error(
                "dp_rank",
                format!("must be < dp_size {}, got {rank}", self.dp_size),
            ));
        }
        let pool = self.lock(py)?;
        Ok(pool
            .xtensor_manager(rank)
            .map(|m| m.mapped_page_ids())
            .unwrap_or_default())
    }

    /// The linear-state cache of dp rank dp_rank (a live view, R22).
    fn linear_state_cache(
        &self,
        py: Python<'_>,
        dp_rank: &Bound<'_, PyAny>,
    ) -> PyResult<PyLinearStatePrefixCache> {
        let rank = convert::count(dp_rank, "dp_rank")?;
        if rank >= self.dp_size {
            return Err(value_error(
                "dp_rank",
                format!("must be < dp_size {}, got {rank}", self.dp_size),
            ));
        }
        if self.lock(py)?.linear_state_cache(rank).is_none() {
            return Err(value_error(
                "dp_rank",
                "this pool has no linear state (build it with linear_state_slots > 0)",
            ));
        }
        Ok(PyLinearStatePrefixCache::view(
            Arc::clone(&self.inner),
            rank,
        ))
    }

    /// The recurrent-state copies planned since the last call, for every rank (R24).
    fn take_linear_state_plan(&self, py: Python<'_>) -> PyResult<PyLinearStatePlan> {
        Ok(PyLinearStatePlan {
            plan: self.lock(py)?.take_linear_state_plan(),
        })
    }

    /// Confirms that the worker made the copies of plan (R24).
    fn commit_linear_state_plan(&self, py: Python<'_>, plan: &Bound<'_, PyAny>) -> PyResult<()> {
        let plan = plan.cast::<PyLinearStatePlan>().map_err(|_| {
            type_error(
                "plan",
                format!("must be a kvpool.LinearStatePlan, got {}", plan.get_type()),
            )
        })?;
        let plan = &plan.get().plan;
        self.with_pool(py, |pool| pool.commit_linear_state_plan(plan))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let c = self.lock(py)?.stats().total.counts;
        Ok(format!(
            "BlockManagerPool(num_blocks={}, block_size={}, dp_size={}, free={}, cached={}, used={})",
            self.num_blocks, self.block_size, self.dp_size, c.free, c.cached, c.used
        ))
    }
}
