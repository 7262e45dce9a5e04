//! `kvpool.KVEvent` (R21, self-describing: docs/events.md) and the list `drain_events` and
//! `events_since` return. Every field an index needs travels on the event, so
//! `KVIndex.apply(instance, pool.drain_events())` takes the list as it is.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// A KV event for external KV-aware routers (R21).
#[pyclass(frozen, module = "kvpool", name = "KVEvent", get_all)]
pub struct PyKvEvent {
    /// Position in the (pool, dp rank) stream: 1, 2, 3, ... over every medium.
    sequence: u64,
    /// "stored", "removed" or "cleared".
    kind: &'static str,
    /// "device", "host" or "remote".
    medium: &'static str,
    /// The KV-cache group: 0 full attention, then the pool's other groups in the order of a
    /// sequence's tables (the linear-state checkpoints, R22; the sliding window, R25).
    group: u32,
    /// "full_attention", "sliding_window" or "linear_state".
    group_kind: &'static str,
    /// The group's window in tokens, for "sliding_window", else None.
    sliding_window: Option<u32>,
    /// 16-byte hashes of the blocks.
    block_hashes: Vec<Py<PyBytes>>,
    /// Hash of the parent of the first block, None for a chain's first block.
    parent_hash: Option<Py<PyBytes>>,
    /// Token ids of the stored blocks (empty otherwise).
    token_ids: Vec<u32>,
    /// Tokens per block.
    block_size: usize,
    /// The rank whose cache it happened in.
    dp_rank: usize,
    /// The chain's extra key, or None.
    extra_key: Option<Py<PyBytes>>,
}

#[pymethods]
impl PyKvEvent {
    fn __repr__(&self) -> String {
        format!(
            "KVEvent(sequence={}, kind={:?}, medium={:?}, blocks={}, dp_rank={}, block_size={})",
            self.sequence,
            self.kind,
            self.medium,
            self.block_hashes.len(),
            self.dp_rank,
            self.block_size
        )
    }
}

/// Core KV events as a list of `kvpool.KVEvent` (R21).
pub(crate) fn events_list<'py>(
    py: Python<'py>,
    events: Vec<kvpool::KvEvent>,
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for e in events {
        let event = PyKvEvent {
            sequence: e.sequence,
            kind: e.kind.as_str(),
            medium: e.medium.as_str(),
            group: e.group,
            group_kind: e.group_kind.as_str(),
            sliding_window: e.group_kind.window(),
            block_hashes: e
                .block_hashes
                .iter()
                .map(|h| PyBytes::new(py, &h.to_bytes()).unbind())
                .collect(),
            parent_hash: e
                .parent_hash
                .map(|h| PyBytes::new(py, &h.to_bytes()).unbind()),
            token_ids: e.token_ids,
            block_size: e.block_size,
            dp_rank: e.dp_rank,
            extra_key: e.extra_key.map(|k| PyBytes::new(py, &k).unbind()),
        };
        out.append(Bound::new(py, event)?)?;
    }
    Ok(out)
}
