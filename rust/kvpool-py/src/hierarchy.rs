//! `kvpool._core.HierarchyBlockManagerPool` (a `kvpool.BlockManagerPool` built with a host tier,
//! R26) and `kvpool.TransferPlan`. It is a subclass: every pool method is the pool's, and it adds
//! the tier's plans and completions, and the core's half of a remote lookup: `remote_query`
//! (what lies past the device+host reach) and `allocate_with_remote` (an allocation with the
//! answer). The remote tier itself is composed in Python: `kvpool.HierarchyBlockManagerPool`
//! (python/kvpool/tiers/hierarchy.py) subclasses this class and runs the lookup policy
//! (budget, timing, counters, what a failure means). The bindings never import the Python
//! package. Each method validates, makes one core call and maps the error.

use kvpool::{OffloadPolicy, RemoteHits, TransferPlan};
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::convert;
use crate::errors::{type_error, IntoPyResult};
use crate::options::Options;
use crate::plan::plan_arg;
use crate::pool::PyBlockManagerPool;
use crate::stats::remote_dict;

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
        self.plan.direction().as_str()
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

/// The `arrived` argument of `complete_fetches`: a list (per plan) of lists of bool, or None.
fn arrived_arg(arrived: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<Vec<bool>>>> {
    let Some(a) = arrived.filter(|a| !a.is_none()) else {
        return Ok(None);
    };
    let shape = || type_error("arrived", "must be a list (per plan) of lists of bool");
    let mut out = Vec::new();
    for row in a.try_iter().map_err(|_| shape())? {
        let row = row?;
        let items = row.try_iter().map_err(|_| shape())?;
        out.push(
            items
                .map(|x| x.and_then(|x| x.is_truthy()))
                .collect::<PyResult<Vec<bool>>>()?,
        );
    }
    Ok(Some(out))
}

/// The options only a hierarchy pool takes.
const HIERARCHY_OPTIONS: &[&str] = &["offload_policy"];

/// A BlockManagerPool with a host-memory KV tier per dp rank (R26); subclassable: the remote
/// tier is added by `kvpool.HierarchyBlockManagerPool`, a Python subclass.
#[pyclass(
    extends = PyBlockManagerPool,
    subclass,
    frozen,
    module = "kvpool._core",
    name = "HierarchyBlockManagerPool"
)]
pub struct PyHierarchyBlockManagerPool {
    host_num_blocks: usize,
    offload_policy: OffloadPolicy,
}

impl PyHierarchyBlockManagerPool {
    fn with_plans<T: Send>(
        slf: &Bound<'_, Self>,
        plans: &Bound<'_, PyAny>,
        call: impl FnOnce(&mut kvpool::BlockManagerPool, &[&TransferPlan]) -> kvpool::Result<T> + Send,
    ) -> PyResult<T> {
        let plans = plan_args(plans)?;
        let refs: Vec<&TransferPlan> = plans.iter().map(|p| &p.get().plan).collect();
        slf.as_super()
            .get()
            .with_pool(slf.py(), |pool| call(pool, &refs))
    }

    fn take<'py>(
        slf: &Bound<'py, Self>,
        take: impl FnOnce(&mut kvpool::BlockManagerPool) -> Vec<TransferPlan> + Send,
    ) -> PyResult<Bound<'py, PyList>> {
        let plans = slf
            .as_super()
            .get()
            .with_pool(slf.py(), |pool| Ok(take(pool)))?;
        plan_list(slf.py(), plans)
    }
}

#[pymethods]
impl PyHierarchyBlockManagerPool {
    #[new]
    #[pyo3(signature = (num_blocks, host_num_blocks, block_size, **options))]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        host_num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let options = Options::new("HierarchyBlockManagerPool", options, HIERARCHY_OPTIONS)?;
        let host_num_blocks = convert::count(host_num_blocks, "host_num_blocks")?;
        let offload_policy =
            OffloadPolicy::parse(&options.choice("offload_policy", "on_deallocate")?).py()?;
        let (mut config, concurrent) = options.pool_config(num_blocks, block_size)?;
        config.host = Some(kvpool::HostTierConfig {
            num_blocks: host_num_blocks,
            offload_policy,
        });
        let base = PyBlockManagerPool::build(config, concurrent)?;
        Ok(PyClassInitializer::from(base).add_subclass(Self {
            host_num_blocks,
            offload_policy,
        }))
    }

    /// Host block ids per rank, padding block included.
    #[getter]
    fn host_num_blocks(&self) -> usize {
        self.host_num_blocks
    }
    /// "on_deallocate" or "on_evict".
    #[getter]
    fn offload_policy(&self) -> &'static str {
        self.offload_policy.as_str()
    }

    /// What to ask the remote tier before allocating seq: (from, keys) past the local reach.
    #[pyo3(signature = (seq, num_tokens = None, *, plan = None))]
    fn remote_query<'py>(
        slf: &Bound<'py, Self>,
        seq: &Bound<'py, PyAny>,
        num_tokens: Option<&Bound<'py, PyAny>>,
        plan: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = slf.py();
        let n = convert::optional_count(num_tokens, "num_tokens")?;
        let plan = plan_arg(plan)?;
        let plan = plan.map(|p| &p.get().plan);
        let base = slf.as_super().get();
        let query = base.with_seq(py, seq, |pool, seq| match plan {
            Some(plan) => Ok(pool.remote_query_of(seq, plan)),
            None => pool.remote_query(seq, n),
        })?;
        let Some(query) = query else {
            return Ok(None);
        };
        let keys = PyList::new(
            py,
            query.hashes.iter().map(|h| PyBytes::new(py, &h.to_bytes())),
        )?;
        Ok(Some(PyTuple::new(
            py,
            [query.from.into_pyobject(py)?.into_any(), keys.into_any()],
        )?))
    }

    /// allocate(seq, num_tokens) where chain blocks from..to exist on the remote tier.
    #[pyo3(signature = (seq, num_tokens = None, *, remote_hits = None, plan = None))]
    fn allocate_with_remote(
        slf: &Bound<'_, Self>,
        seq: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
        remote_hits: Option<&Bound<'_, PyAny>>,
        plan: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let hits = match remote_hits.filter(|h| !h.is_none()) {
            None => None,
            Some(h) => {
                let (from, to): (Bound<'_, PyAny>, Bound<'_, PyAny>) = h
                    .extract()
                    .map_err(|_| type_error("remote_hits", "must be a (from, to) pair of ints"))?;
                Some(RemoteHits {
                    from: convert::count(&from, "remote_hits")?,
                    to: convert::count(&to, "remote_hits")?,
                })
            }
        };
        slf.as_super()
            .get()
            .allocate_with(slf.py(), seq, num_tokens, plan, hits)
    }

    /// Load plans (host -> device) made since the last call, one per rank that has any.
    fn take_load_plans<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        Self::take(slf, |pool| pool.take_load_plans())
    }

    /// Offload plans (device -> host) made since the last call, one per rank that has any.
    fn take_offload_plans<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        Self::take(slf, |pool| pool.take_offload_plans())
    }

    /// Fetch plans (remote -> host staging) made since the last call, one per rank that has any.
    fn take_fetch_plans<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        Self::take(slf, |pool| pool.take_fetch_plans())
    }

    /// Reports which fetched blocks arrived intact (arrived[i][j]; None: all of them).
    #[pyo3(signature = (plans, arrived = None))]
    fn complete_fetches(
        slf: &Bound<'_, Self>,
        plans: &Bound<'_, PyAny>,
        arrived: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let arrived = arrived_arg(arrived)?;
        Self::with_plans(slf, plans, |pool, refs| {
            pool.complete_fetches(refs, arrived.as_deref())
        })
    }

    /// complete_fetches with nothing arrived (the remote tier failed).
    fn fail_fetches(slf: &Bound<'_, Self>, plans: &Bound<'_, PyAny>) -> PyResult<()> {
        Self::with_plans(slf, plans, |pool, refs| pool.fail_fetches(refs))
    }

    /// Confirms that load plans ran: loaded tokens count as cached and computed (R26).
    fn complete_loads(slf: &Bound<'_, Self>, plans: &Bound<'_, PyAny>) -> PyResult<()> {
        Self::with_plans(slf, plans, |pool, refs| pool.complete_loads(refs))
    }

    /// Confirms that offload plans ran: host blocks become matchable, device blocks go (R26).
    fn complete_offloads(slf: &Bound<'_, Self>, plans: &Bound<'_, PyAny>) -> PyResult<()> {
        Self::with_plans(slf, plans, |pool, refs| pool.complete_offloads(refs))
    }

    /// The pool's statistics (R20, with host) and the core's remote counters (hit, fetched,
    /// failed and pending blocks), from one snapshot: the subclass with a remote tier merges
    /// them with its lookup's counters into stats()["remote"] (R26).
    fn stats_with_remote<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
        let py = slf.py();
        let (dict, host) = slf.as_super().get().stats_dict(py)?;
        Ok((dict, remote_dict(py, &host.unwrap_or_default())?))
    }

    fn __repr__(slf: &Bound<'_, Self>) -> String {
        let pool = slf.as_super().get().inner.lock();
        let d = pool.stats().total.counts;
        let (mut free, mut cached, mut used) = (0, 0, 0);
        for h in pool.host_stats().unwrap_or_default() {
            (free, cached, used) = (
                free + h.counts.free,
                cached + h.counts.cached,
                used + h.counts.used,
            );
        }
        format!(
            "HierarchyBlockManagerPool(num_blocks={}, host_num_blocks={}, block_size={}, dp_size={}, free={}, cached={}, used={}, host_free={free}, host_cached={cached}, host_used={used})",
            pool.config().num_blocks,
            slf.get().host_num_blocks,
            pool.block_size(),
            pool.dp_size(),
            d.free,
            d.cached,
            d.used,
        )
    }
}
