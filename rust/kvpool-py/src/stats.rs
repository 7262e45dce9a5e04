//! The stats dicts, built from the core's field lists (`RankStats::visit`, `HostStats::visit`):
//! a counter added in the core appears here, and `tests/pool/test_stats_keys.py` checks the
//! stubs' TypedDicts name the same keys.

use kvpool::{BlockCounts, HostStats, RankStats};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// Block counts of one manager (R2).
pub(crate) fn counts_dict<'py>(
    py: Python<'py>,
    counts: &BlockCounts,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("num_total_blocks", counts.total)?;
    dict.set_item("num_free_blocks", counts.free)?;
    dict.set_item("num_cached_blocks", counts.cached)?;
    dict.set_item("num_used_blocks", counts.used)?;
    dict.set_item("usage", counts.usage())?;
    Ok(dict)
}

/// One rank's dict (R20): its counts and counters, `window` (or None) and `host` (or None).
pub(crate) fn rank_dict<'py>(
    py: Python<'py>,
    r: &RankStats,
    host: Option<&HostStats>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = counts_dict(py, &r.counts)?;
    let window = r.window.as_ref().map(|w| counts_dict(py, w)).transpose()?;
    let misses = PyDict::new(py);
    let memory = PyDict::new(py);
    let mut result = Ok(());
    r.visit(|section, key, value| {
        let target = match section {
            "window" => window.as_ref(),
            "misses" => Some(&misses),
            "memory" => Some(&memory),
            _ => Some(&d),
        };
        if let (Some(target), Ok(())) = (target, &result) {
            result = target.set_item(key, value);
        }
    });
    result?;
    d.set_item("window", window)?;
    d.set_item("misses", misses)?;
    d.set_item("memory", memory)?;
    match &r.xtensor {
        Some(x) => d.set_item("xtensor", crate::elastic::xtensor_dict(py, x)?)?,
        None => d.set_item("xtensor", py.None())?,
    }
    match host {
        Some(h) => d.set_item("host", host_dict(py, h)?)?,
        None => d.set_item("host", py.None())?,
    }
    Ok(d)
}

/// The counters of `h` in `section` ("host" or "remote"), into `into`.
fn host_section(h: &HostStats, section: &str, into: &Bound<'_, PyDict>) -> PyResult<()> {
    let mut result = Ok(());
    h.visit(|s, key, value| {
        if s == section && result.is_ok() {
            result = into.set_item(key, value);
        }
    });
    result
}

/// The host tier's dict of one rank or the totals (R26).
pub(crate) fn host_dict<'py>(py: Python<'py>, h: &HostStats) -> PyResult<Bound<'py, PyDict>> {
    let d = counts_dict(py, &h.counts)?;
    host_section(h, "host", &d)?;
    Ok(d)
}

/// The core's part of the remote tier's dict (the lookup policy adds its own counters).
pub(crate) fn remote_dict<'py>(py: Python<'py>, h: &HostStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    host_section(h, "remote", &d)?;
    Ok(d)
}

/// A pool's stats: the totals' dict with `ranks`, one dict per rank (with a host tier, each
/// with its `host` dict). Returns the host totals too.
pub(crate) fn pool_dict<'py>(
    py: Python<'py>,
    stats: &kvpool::PoolStats,
    hosts: Option<&[HostStats]>,
) -> PyResult<(Bound<'py, PyDict>, Option<HostStats>)> {
    let total_host = hosts.map(|hs| {
        let mut total = HostStats::default();
        for h in hs {
            total.add(h);
        }
        total
    });
    let dict = rank_dict(py, &stats.total, total_host.as_ref())?;
    let ranks = PyList::empty(py);
    for (i, r) in stats.ranks.iter().enumerate() {
        ranks.append(rank_dict(py, r, hosts.and_then(|hs| hs.get(i)))?)?;
    }
    dict.set_item("ranks", ranks)?;
    Ok((dict, total_host))
}
