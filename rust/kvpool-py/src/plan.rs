//! `kvpool.AllocationPlan`: what `pool.plan(seq)` decided, to hand to `pool.allocate(seq,
//! plan=plan)` (docs/contract.md, "Plan once"). Read-only; `plan()` has no side effect.

use kvpool::AllocationPlan;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::type_error;

/// An allocation decided by ``BlockManagerPool.plan``, with no side effect.
#[pyclass(frozen, module = "kvpool", name = "AllocationPlan")]
pub struct PyAllocationPlan {
    pub(crate) plan: AllocationPlan,
    block_size: usize,
}

impl PyAllocationPlan {
    pub(crate) fn new(plan: AllocationPlan, block_size: usize) -> Self {
        Self { plan, block_size }
    }
}

/// The `plan` argument: an `AllocationPlan` or None (a TypeError naming `plan` otherwise).
pub(crate) fn plan_arg<'a, 'py>(
    plan: Option<&'a Bound<'py, PyAny>>,
) -> PyResult<Option<&'a Bound<'py, PyAllocationPlan>>> {
    match plan.filter(|p| !p.is_none()) {
        None => Ok(None),
        Some(p) => p.cast::<PyAllocationPlan>().map(Some).map_err(|_| {
            type_error(
                "plan",
                format!(
                    "must be a kvpool.AllocationPlan or None, got {}",
                    p.get_type()
                ),
            )
        }),
    }
}

#[pymethods]
impl PyAllocationPlan {
    /// The dp rank the sequence goes (or is) to (R13).
    #[getter]
    fn dp_rank(&self) -> usize {
        self.plan.dp_rank()
    }
    /// Tokens the table will hold.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.plan.num_tokens()
    }
    /// Whether the sequence already holds blocks (the plan grows its table).
    #[getter]
    fn is_growth(&self) -> bool {
        self.plan.is_growth()
    }
    /// Blocks of the prefix hit over every tier.
    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.plan.num_cached_blocks()
    }
    /// Tokens of the prefix hit over every tier.
    #[getter]
    fn num_cached_tokens(&self) -> usize {
        self.plan.num_cached_tokens()
    }
    /// Hit tokens already on the device.
    #[getter]
    fn device_hit_tokens(&self) -> usize {
        self.plan.device_hit_blocks() * self.block_size
    }
    /// Hit tokens loaded from the host tier.
    #[getter]
    fn host_hit_tokens(&self) -> usize {
        self.plan.host_hit_blocks() * self.block_size
    }
    /// Hit tokens fetched from the remote tier.
    #[getter]
    fn remote_hit_tokens(&self) -> usize {
        self.plan.remote_hit_blocks() * self.block_size
    }
    /// Fresh device blocks the allocation takes.
    #[getter]
    fn num_new_blocks(&self) -> usize {
        self.plan.num_new_blocks()
    }
    /// Entries of the block table after the allocation.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.plan.num_blocks()
    }
    /// Prefix hash (16 bytes) of the checkpoint the linear state is restored from, or None.
    #[getter]
    fn restore_checkpoint<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.plan
            .restore_checkpoint()
            .map(|h| PyBytes::new(py, &h.to_bytes()))
    }
    /// Tokens of the prefix the full-attention caches hold (device and host): the hit the
    /// full-attention group alone could serve, before the other groups' limits.
    #[getter]
    fn kv_hit_tokens(&self) -> usize {
        self.plan.num_kv_hit_blocks() * self.block_size
    }
    /// The group that cut the hit short of the prompt (0 full attention, then the pool's other
    /// groups in table order), or None (docs/hybrid.md "Why no hit").
    #[getter]
    fn miss_group(&self) -> Option<usize> {
        self.plan.miss().map(|m| m.group)
    }
    /// Why the hit stops short: "shorter_than_block", "no_shared_prefix", "evicted",
    /// "window_blocks_gone" or "no_checkpoint"; None for a full hit.
    #[getter]
    fn miss_reason(&self) -> Option<&'static str> {
        self.plan.miss().map(|m| m.reason.as_str())
    }
    fn __repr__(&self) -> String {
        format!(
            "AllocationPlan(dp_rank={}, num_cached_tokens={}, device_hit_tokens={}, host_hit_tokens={}, remote_hit_tokens={}, num_new_blocks={})",
            self.plan.dp_rank(),
            self.num_cached_tokens(),
            self.device_hit_tokens(),
            self.host_hit_tokens(),
            self.remote_hit_tokens(),
            self.plan.num_new_blocks()
        )
    }
}
