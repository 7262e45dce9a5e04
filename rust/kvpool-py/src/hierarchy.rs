//! `kvpool.HierarchyBlockManagerPool` and `kvpool.TransferPlan` (R26), with the optional remote
//! tier (issue 10): `allocate` asks the core what lies past the device+host reach, makes ONE
//! `remote.exists_many(keys, timeout=budget)` call with no lock held, and allocates with the
//! answer; any exception or a malformed answer is a miss (counted). Each other method validates,
//! makes one core call and maps the error. Lock order: pool, then sequences in argument order; no
//! lock is held while Python code runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvpool::{
    HierarchyBlockManagerPool, HierarchyConfig, HostStats, KvCacheManager, OffloadPolicy,
    RemoteHits, RemoteQuery, Sequence, TransferDirection, TransferPlan,
};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::batch::SeqsArg;
use crate::convert;
use crate::errors::{type_error, value_error, IntoPyResult};
use crate::manager::counts_dict;
use crate::pool::{events_list, group_arg, pool_config, rank_dict, seq_ref};

/// Block copies of one dp rank in one direction: copy block ``src[i]`` to block ``dst[i]``.
#[pyclass(frozen, module = "kvpool", name = "TransferPlan")]
pub struct PyTransferPlan {
    plan: TransferPlan,
}

#[pymethods]
impl PyTransferPlan {
    /// The dp rank whose caches the ids index.
    #[getter]
    fn dp_rank(&self) -> usize {
        self.plan.dp_rank
    }

    /// Source block ids (int32 array [n]): host ids for a load, device ids for an offload.
    #[getter]
    fn src<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.plan.src.clone().into_pyarray(py)
    }

    /// Destination block ids (int32 array [n], distinct): device ids for a load, host ids for an
    /// offload.
    #[getter]
    fn dst<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.plan.dst.clone().into_pyarray(py)
    }

    /// "load" (host -> device), "offload" (device -> host) or "fetch" (remote -> host; ``src``
    /// is empty, ``keys`` names the blocks).
    #[getter]
    fn direction(&self) -> &'static str {
        match self.plan.direction() {
            TransferDirection::Load => "load",
            TransferDirection::Offload => "offload",
            TransferDirection::Fetch => "fetch",
        }
    }

    /// Chain hashes (R6, 16 bytes each, as ``kvpool.hash_blocks`` returns) of the blocks, one
    /// per ``dst`` entry: the remote keys of a fetch, the blocks an offload puts on host.
    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.plan
                .keys
                .iter()
                .map(|h| PyBytes::new(py, &h.to_bytes())),
        )
    }

    fn __len__(&self) -> usize {
        self.plan.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "TransferPlan(direction={:?}, dp_rank={}, blocks={})",
            self.direction(),
            self.plan.dp_rank,
            self.plan.len()
        )
    }
}

fn host_dict<'py>(py: Python<'py>, h: &HostStats) -> PyResult<Bound<'py, PyDict>> {
    let d = counts_dict(py, &h.counts)?;
    d.set_item("prefix_query_tokens", h.query_tokens)?;
    d.set_item("prefix_hit_tokens", h.hit_tokens)?;
    d.set_item("num_evictions", h.evictions)?;
    d.set_item("num_loaded_blocks", h.loaded_blocks)?;
    d.set_item("num_offloaded_blocks", h.offloaded_blocks)?;
    d.set_item("num_pending_load_blocks", h.pending_load_blocks)?;
    d.set_item("num_pending_offload_blocks", h.pending_offload_blocks)?;
    Ok(d)
}

fn plan_list<'py>(py: Python<'py>, plans: Vec<TransferPlan>) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for plan in plans {
        out.append(Bound::new(py, PyTransferPlan { plan })?)?;
    }
    Ok(out)
}

/// The plans of a `plans` argument (any iterable of kvpool.TransferPlan).
fn plan_args<'py>(plans: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyTransferPlan>>> {
    plans
        .try_iter()
        .map_err(|_| type_error("plans", "must be an iterable of kvpool.TransferPlan"))?
        .map(|item| {
            let item = item?;
            item.cast_into::<PyTransferPlan>().map_err(|e| {
                type_error(
                    "plans",
                    format!(
                        "must contain kvpool.TransferPlan, got {}",
                        e.into_inner().get_type()
                    ),
                )
            })
        })
        .collect()
}

/// Remote-tier lookups made by `allocate` (the I/O counters live in the tier's own `stats()`).
#[derive(Default)]
struct LookupCounters {
    lookups: AtomicU64,
    keys: AtomicU64,
    failures: AtomicU64,
    over_budget: AtomicU64,
    nanos: AtomicU64,
}

/// A BlockManagerPool with a host-memory KV tier per dp rank (R26) and an optional remote tier.
#[pyclass(frozen, module = "kvpool", name = "HierarchyBlockManagerPool")]
pub struct PyHierarchyBlockManagerPool {
    inner: Mutex<HierarchyBlockManagerPool>,
    num_blocks: usize,
    host_num_blocks: usize,
    block_size: usize,
    dp_size: usize,
    enable_prefix_cache: bool,
    offload_policy: OffloadPolicy,
    remote: Option<Py<PyAny>>,
    remote_policy: &'static str,
    remote_budget_s: f64,
    lookups: LookupCounters,
}

/// Default scheduler budget of one remote lookup.
const DEFAULT_REMOTE_BUDGET_MS: f64 = 50.0;

impl PyHierarchyBlockManagerPool {
    /// Locks the pool, then `seq` (the lock order everywhere), and makes one core call.
    fn with_seq<T>(
        &self,
        seq: &Bound<'_, PyAny>,
        call: impl FnOnce(&mut HierarchyBlockManagerPool, &mut Sequence) -> kvpool::Result<T>,
    ) -> PyResult<T> {
        let seq = seq_ref(seq)?;
        let mut pool = self.inner.lock();
        let mut seq = seq.get().inner.lock();
        call(&mut pool, &mut seq).py()
    }
}

fn optional_count(value: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<usize>> {
    convert::optional_count(value, name)
}

impl PyHierarchyBlockManagerPool {
    /// One batched existence query for `query`; a failure (an `Exception`) or a malformed
    /// answer is a miss. A `BaseException` that is not an `Exception` (KeyboardInterrupt,
    /// SystemExit) is the caller's to handle: it propagates, before the pool or the counters
    /// changed (F12).
    fn lookup(
        &self,
        py: Python<'_>,
        remote: &Py<PyAny>,
        query: &RemoteQuery,
    ) -> PyResult<Option<RemoteHits>> {
        let c = &self.lookups;
        let start = Instant::now();
        let answer = (|| -> PyResult<usize> {
            let keys = PyList::new(
                py,
                query.hashes.iter().map(|h| PyBytes::new(py, &h.to_bytes())),
            )?;
            let kwargs = PyDict::new(py);
            kwargs.set_item("timeout", self.remote_budget_s)?;
            let found = remote
                .bind(py)
                .call_method("exists_many", (keys,), Some(&kwargs))?;
            let mut hits = 0;
            for item in found.try_iter()? {
                if !item?.is_truthy()? || hits == query.hashes.len() {
                    break;
                }
                hits += 1;
            }
            Ok(hits)
        })();
        if let Err(e) = &answer {
            if !e.is_instance_of::<pyo3::exceptions::PyException>(py) {
                return Err(answer.unwrap_err());
            }
        }
        let elapsed = start.elapsed();
        // Relaxed: independent counters.
        c.lookups.fetch_add(1, Ordering::Relaxed);
        c.keys
            .fetch_add(query.hashes.len() as u64, Ordering::Relaxed);
        c.nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        if elapsed.as_secs_f64() > self.remote_budget_s {
            c.over_budget.fetch_add(1, Ordering::Relaxed);
        }
        Ok(match answer {
            Ok(hits) if hits > 0 => Some(RemoteHits {
                from: query.from,
                to: query.from + hits,
            }),
            Ok(_) => None,
            Err(_) => {
                c.failures.fetch_add(1, Ordering::Relaxed);
                None
            }
        })
    }
}

#[pymethods]
impl PyHierarchyBlockManagerPool {
    #[new]
    #[pyo3(signature = (
        num_blocks, host_num_blocks, block_size, *, dp_size = None, enable_prefix_cache = None,
        num_single_blocks = None, offload_policy = None, linear_state_slots = None,
        checkpoint_interval = None, linear_state_match = None, concurrent = None,
        enable_events = None, hash_seed = None, sliding_window = None, swa_num_blocks = None,
        debug_hash_bits = None, remote = None, remote_policy = None, remote_budget_ms = None
    ), text_signature = "(num_blocks, host_num_blocks, block_size, *, dp_size=1, enable_prefix_cache=True, num_single_blocks=None, offload_policy='on_deallocate', linear_state_slots=0, checkpoint_interval=None, linear_state_match='deepest', concurrent=False, enable_events=False, hash_seed=None, sliding_window=None, swa_num_blocks=None, debug_hash_bits=None, remote=None, remote_policy='write_through', remote_budget_ms=50.0)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        host_num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        dp_size: Option<&Bound<'_, PyAny>>,
        enable_prefix_cache: Option<&Bound<'_, PyAny>>,
        num_single_blocks: Option<&Bound<'_, PyAny>>,
        offload_policy: Option<&Bound<'_, PyAny>>,
        linear_state_slots: Option<&Bound<'_, PyAny>>,
        checkpoint_interval: Option<&Bound<'_, PyAny>>,
        linear_state_match: Option<&Bound<'_, PyAny>>,
        concurrent: Option<&Bound<'_, PyAny>>,
        enable_events: Option<&Bound<'_, PyAny>>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        sliding_window: Option<&Bound<'_, PyAny>>,
        swa_num_blocks: Option<&Bound<'_, PyAny>>,
        debug_hash_bits: Option<&Bound<'_, PyAny>>,
        remote: Option<&Bound<'_, PyAny>>,
        remote_policy: Option<&Bound<'_, PyAny>>,
        remote_budget_ms: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let enable_prefix_cache = convert::flag(enable_prefix_cache, "enable_prefix_cache", true)?;
        convert::flag(concurrent, "concurrent", false)?; // every Python pool is thread-safe (R28)
        let enable_events = convert::flag(enable_events, "enable_events", false)?;
        let remote = remote.filter(|r| !r.is_none());
        if let Some(r) = remote {
            for method in ["exists_many", "get_many", "put_many"] {
                if !r.hasattr(method)? {
                    return Err(type_error(
                        "remote",
                        format!("must be a kvpool.remote.RemoteTier (no {method} method)"),
                    ));
                }
            }
        }
        let remote_policy = match remote_policy.filter(|p| !p.is_none()) {
            None => "write_through",
            Some(p) => {
                let name: String = p
                    .extract()
                    .map_err(|_| type_error("remote_policy", "must be a str"))?;
                match name.as_str() {
                    "write_through" => "write_through",
                    "on_host_evict" => "on_host_evict",
                    other => {
                        return Err(value_error(
                            "remote_policy",
                            format!("must be 'write_through' or 'on_host_evict', got {other:?}"),
                        ))
                    }
                }
            }
        };
        let remote_budget_ms = match remote_budget_ms.filter(|b| !b.is_none()) {
            None => DEFAULT_REMOTE_BUDGET_MS,
            Some(b) => {
                if b.is_instance_of::<pyo3::types::PyBool>() {
                    return Err(type_error("remote_budget_ms", "must be a number"));
                }
                let ms: f64 = b
                    .extract()
                    .map_err(|_| type_error("remote_budget_ms", "must be a number"))?;
                if !(ms.is_finite() && ms > 0.0) {
                    return Err(value_error(
                        "remote_budget_ms",
                        format!("must be a finite number > 0, got {ms}"),
                    ));
                }
                ms
            }
        };
        let host_num_blocks = convert::count(host_num_blocks, "host_num_blocks")?;
        let offload_policy = match offload_policy {
            Some(p) if !p.is_none() => {
                let name: String = p
                    .extract()
                    .map_err(|_| type_error("offload_policy", "must be a str"))?;
                OffloadPolicy::parse(&name).py()?
            }
            _ => OffloadPolicy::OnDeallocate,
        };
        let pool = pool_config(
            num_blocks,
            block_size,
            dp_size,
            enable_prefix_cache,
            num_single_blocks,
            linear_state_slots,
            checkpoint_interval,
            linear_state_match,
            enable_events,
            hash_seed,
            sliding_window,
            swa_num_blocks,
            None,
            debug_hash_bits,
        )?;
        let (num_blocks, block_size, dp_size) = (pool.num_blocks, pool.block_size, pool.dp_size);
        let config = HierarchyConfig {
            pool,
            host_num_blocks,
            offload_policy,
        };
        let pool = HierarchyBlockManagerPool::new(config).py()?;
        Ok(Self {
            inner: Mutex::new(pool),
            num_blocks,
            host_num_blocks,
            block_size,
            dp_size,
            enable_prefix_cache,
            offload_policy,
            remote: remote.map(|r| r.clone().unbind()),
            remote_policy,
            remote_budget_s: remote_budget_ms / 1000.0,
            lookups: LookupCounters::default(),
        })
    }

    /// The remote tier (a ``kvpool.remote.RemoteTier``), or None.
    #[getter]
    fn remote(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.remote.as_ref().map(|r| r.clone_ref(py))
    }
    /// When offloaded host blocks go to the remote tier: "write_through" (after each confirmed
    /// offload) or "on_host_evict" (before their host block is reused); the executor applies it.
    #[getter]
    fn remote_policy(&self) -> &'static str {
        self.remote_policy
    }
    /// Scheduler budget of the one remote lookup per allocate, in milliseconds (passed to
    /// ``exists_many`` as ``timeout`` in seconds; slower lookups are counted).
    #[getter]
    fn remote_budget_ms(&self) -> f64 {
        self.remote_budget_s * 1000.0
    }

    /// Device block ids per rank, padding block included.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Host block ids per rank, padding block included.
    #[getter]
    fn host_num_blocks(&self) -> usize {
        self.host_num_blocks
    }
    /// Tokens per block (both tiers).
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }
    /// Number of data-parallel ranks.
    #[getter]
    fn dp_size(&self) -> usize {
        self.dp_size
    }
    /// Whether each rank keeps a device prefix cache (without it the host tier stays idle).
    #[getter]
    fn enable_prefix_cache(&self) -> bool {
        self.enable_prefix_cache
    }
    /// "on_deallocate" or "on_evict".
    #[getter]
    fn offload_policy(&self) -> &'static str {
        self.offload_policy.as_str()
    }

    /// What allocate(seq, num_tokens) would return, with no side effect on either tier (R15).
    #[pyo3(signature = (seq, num_tokens = None))]
    fn can_allocate(
        &self,
        seq: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let n = optional_count(num_tokens, "num_tokens")?;
        self.with_seq(seq, |pool, seq| pool.can_allocate(seq, n))
    }

    /// Device match, then host match past it (load plans for the host hits), then, with a
    /// remote tier, one batched ``exists_many`` for the rest of the prompt (fetch plans for the
    /// remote hits), then new blocks (R14, R26). On a sequence that holds blocks, grows its table.
    #[pyo3(signature = (seq, num_tokens = None))]
    fn allocate(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let n = optional_count(num_tokens, "num_tokens")?;
        let Some(remote) = &self.remote else {
            return self.with_seq(seq, |pool, seq| pool.allocate(seq, n));
        };
        let query = self.with_seq(seq, |pool, seq| pool.remote_query(seq, n))?;
        let hits = match query {
            Some(q) => self.lookup(py, remote, &q)?,
            None => None,
        };
        self.with_seq(seq, |pool, seq| pool.allocate_with_remote(seq, n, hits))
    }

    /// Whether the blocks for len(seq) + lookahead tokens can be had (R16).
    #[pyo3(signature = (seq, lookahead = None), text_signature = "(self, seq, lookahead=0)")]
    fn can_append(
        &self,
        seq: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let lookahead = optional_count(lookahead, "lookahead")?.unwrap_or(0);
        self.with_seq(seq, |pool, seq| pool.can_append(seq, lookahead))
    }

    /// Takes the blocks can_append asks about (all-or-nothing, R16).
    #[pyo3(signature = (seq, lookahead = None), text_signature = "(self, seq, lookahead=0)")]
    fn may_append(
        &self,
        seq: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let lookahead = optional_count(lookahead, "lookahead")?.unwrap_or(0);
        self.with_seq(seq, |pool, seq| pool.may_append(seq, lookahead))
    }

    /// Publishes the full computed blocks in the device prefix cache (R17).
    fn cache(&self, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_seq(seq, |pool, seq| pool.cache(seq))
    }

    /// cache(seq), plans the offload of its full computed blocks not yet on host, then releases
    /// it (R18, R26). Offloaded device blocks stay held until complete_offloads.
    fn deallocate(&self, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_seq(seq, |pool, seq| pool.deallocate(seq))
    }

    /// Load plans (host -> device) made since the last call, one per rank that has any.
    fn take_load_plans<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let plans = self.inner.lock().take_load_plans();
        plan_list(py, plans)
    }

    /// Offload plans (device -> host) made since the last call, one per rank that has any.
    fn take_offload_plans<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let plans = self.inner.lock().take_offload_plans();
        plan_list(py, plans)
    }

    /// Fetch plans (remote -> host staging) made since the last call, one per rank that has any.
    fn take_fetch_plans<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let plans = self.inner.lock().take_fetch_plans();
        plan_list(py, plans)
    }

    /// Reports which fetched blocks arrived intact: ``arrived[i][j]`` for block j of plans[i]
    /// (None: all). Each sequence keeps the leading run and its load becomes takeable; the rest
    /// is recomputed. Foreign or repeated plans, or arrived of the wrong shape: ValueError.
    #[pyo3(signature = (plans, arrived = None))]
    fn complete_fetches(
        &self,
        plans: &Bound<'_, PyAny>,
        arrived: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let plans = plan_args(plans)?;
        let arrived = match arrived.filter(|a| !a.is_none()) {
            None => None,
            Some(a) => {
                let rows = a.try_iter().map_err(|_| {
                    type_error("arrived", "must be a list (per plan) of lists of bool")
                })?;
                let mut out = Vec::new();
                for row in rows {
                    let row = row?;
                    let items = row.try_iter().map_err(|_| {
                        type_error("arrived", "must be a list (per plan) of lists of bool")
                    })?;
                    out.push(
                        items
                            .map(|x| x.and_then(|x| x.is_truthy()))
                            .collect::<PyResult<Vec<bool>>>()?,
                    );
                }
                Some(out)
            }
        };
        let refs: Vec<&TransferPlan> = plans.iter().map(|p| &p.get().plan).collect();
        self.inner
            .lock()
            .complete_fetches(&refs, arrived.as_deref())
            .py()
    }

    /// complete_fetches with nothing arrived (the remote tier failed): host hits still load,
    /// remote hits are recomputed.
    fn fail_fetches(&self, plans: &Bound<'_, PyAny>) -> PyResult<()> {
        let plans = plan_args(plans)?;
        let refs: Vec<&TransferPlan> = plans.iter().map(|p| &p.get().plan).collect();
        self.inner.lock().fail_fetches(&refs).py()
    }

    /// Confirms that load plans ran: loaded tokens count as cached and computed, loaded blocks
    /// are published in the device cache (R26). Foreign or repeated plans: ValueError.
    fn complete_loads(&self, plans: &Bound<'_, PyAny>) -> PyResult<()> {
        let plans = plan_args(plans)?;
        let refs: Vec<&TransferPlan> = plans.iter().map(|p| &p.get().plan).collect();
        self.inner.lock().complete_loads(&refs).py()
    }

    /// Confirms that offload plans ran: the host blocks become matchable, the device blocks are
    /// released (R26). Foreign or repeated plans: ValueError.
    fn complete_offloads(&self, plans: &Bound<'_, PyAny>) -> PyResult<()> {
        let plans = plan_args(plans)?;
        let refs: Vec<&TransferPlan> = plans.iter().map(|p| &p.get().plan).collect();
        self.inner.lock().complete_offloads(&refs).py()
    }

    /// Block tables of seqs: int32 array [len(seqs), max_blocks], padded with 0 (R19).
    #[pyo3(signature = (seqs, group = None), text_signature = "(self, seqs, group=0)")]
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        seqs: &Bound<'py, PyAny>,
        group: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        if group_arg(group)? != 0 {
            return Err(value_error("group", "a hierarchy pool has 1 group (0)"));
        }
        let seqs = SeqsArg::extract(seqs)?;
        let view = seqs.view();
        let (rows, table, width) = py
            .detach(|| {
                view.with_locked(&self.inner, |pool, locked| {
                    let refs = locked.refs();
                    pool.block_tables(&refs).map(|(t, w)| (refs.len(), t, w))
                })
            })
            .py()?;
        let array = Array2::from_shape_vec((rows, width), table).expect("shape matches");
        Ok(array.into_pyarray(py))
    }

    /// Cache slots (int64) of tokens [num_computed_tokens, len) of every sequence (R19).
    #[pyo3(signature = (seqs, group = None), text_signature = "(self, seqs, group=0)")]
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seqs: &Bound<'py, PyAny>,
        group: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        if group_arg(group)? != 0 {
            return Err(value_error("group", "a hierarchy pool has 1 group (0)"));
        }
        let seqs = SeqsArg::extract(seqs)?;
        let view = seqs.view();
        let slots = py
            .detach(|| {
                view.with_locked(&self.inner, |pool, locked| {
                    pool.slot_mapping(&locked.refs())
                })
            })
            .py()?;
        Ok(slots.into_pyarray(py))
    }

    /// Device counts and statistics (R20), with ``host``: the host tier's block counts plus
    /// prefix_query_tokens / prefix_hit_tokens (host lookups past the device hit),
    /// num_evictions, num_loaded_blocks, num_offloaded_blocks, num_pending_load_blocks and
    /// num_pending_offload_blocks; totals and per rank.
    /// With a remote tier, ``remote``: lookups, lookup_keys, lookup_failures,
    /// lookups_over_budget, lookup_seconds (allocate's queries), hit_blocks, miss_blocks,
    /// fetched_blocks, failed_fetch_blocks, pending_fetch_blocks, plus the tier's own
    /// ``stats()`` (errors, timeouts, bytes_in, bytes_out, ...).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.inner.lock().stats();
        let dict = rank_dict(py, &stats.device.total)?;
        dict.set_item("host", host_dict(py, &stats.host)?)?;
        if let Some(remote) = &self.remote {
            let c = &self.lookups;
            let r = PyDict::new(py);
            let keys = c.keys.load(Ordering::Relaxed);
            r.set_item("policy", self.remote_policy)?;
            r.set_item("lookups", c.lookups.load(Ordering::Relaxed))?;
            r.set_item("lookup_keys", keys)?;
            r.set_item("lookup_failures", c.failures.load(Ordering::Relaxed))?;
            r.set_item("lookups_over_budget", c.over_budget.load(Ordering::Relaxed))?;
            r.set_item(
                "lookup_seconds",
                c.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            )?;
            let h = &stats.host;
            r.set_item("hit_blocks", h.remote_hit_blocks)?;
            r.set_item("miss_blocks", keys.saturating_sub(h.remote_hit_blocks))?;
            r.set_item("fetched_blocks", h.fetched_blocks)?;
            r.set_item("failed_fetch_blocks", h.failed_fetch_blocks)?;
            r.set_item("pending_fetch_blocks", h.pending_fetch_blocks)?;
            let tier = remote.bind(py);
            if tier.hasattr("stats")? {
                if let Ok(extra) = tier.call_method0("stats")?.cast_into::<PyDict>() {
                    for (k, v) in extra.iter() {
                        if !r.contains(&k)? {
                            r.set_item(k, v)?;
                        }
                    }
                }
            }
            dict.set_item("remote", r)?;
        }
        let ranks = PyList::empty(py);
        for (r, h) in stats.device.ranks.iter().zip(&stats.host_ranks) {
            let d = rank_dict(py, r)?;
            d.set_item("host", host_dict(py, h)?)?;
            ranks.append(d)?;
        }
        dict.set_item("ranks", ranks)?;
        Ok(dict)
    }

    /// Walks both tiers of every rank and every pending plan; raises InvariantError (R20, R26).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| inner.lock().check()).py()
    }

    /// Returns and clears the device tier's KV events (R21); [] unless enable_events.
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.inner.lock().drain_events();
        events_list(py, events)
    }

    /// Drops every cached entry of both tiers; blocks that sequences or pending plans hold stay
    /// with them (R12, R26).
    fn reset_prefix_cache(&self) {
        self.inner.lock().reset_prefix_cache();
    }

    fn __repr__(&self) -> String {
        let stats = self.inner.lock().stats();
        let (d, h) = (stats.device.total.counts, stats.host.counts);
        format!(
            "HierarchyBlockManagerPool(num_blocks={}, host_num_blocks={}, block_size={}, dp_size={}, free={}, cached={}, used={}, host_free={}, host_cached={}, host_used={})",
            self.num_blocks, self.host_num_blocks, self.block_size, self.dp_size,
            d.free, d.cached, d.used, h.free, h.cached, h.used
        )
    }
}
