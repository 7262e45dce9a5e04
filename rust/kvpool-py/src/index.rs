//! `kvpool.KVIndex` (docs/events.md): thin bindings of `kvpool::KVIndex`.
//!
//! Each method converts its arguments with the GIL held, releases it (`py.detach`) for the one
//! core call (apply, lookup, dump, ...), and converts the answer back. Events are Python dicts
//! or objects with attributes of the same names (a `kvpool.KVEvent` works); the accepted shape
//! is documented in docs/events.md and in the stub.

use kvpool::{ApplyReport, EventKind, GroupKind, IndexConfig, IndexEvent, KVIndex, Medium};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use crate::convert;
use crate::errors::{type_error, value_error, IntoPyResult};

/// A prefix index over the KV events of many instances.
#[pyclass(frozen, module = "kvpool", name = "KVIndex")]
pub struct PyKVIndex {
    inner: KVIndex,
}

/// An unsigned integer argument of at most `max`, named in errors.
fn unsigned(obj: &Bound<'_, PyAny>, name: &str, max: u64) -> PyResult<u64> {
    in_range(convert::int(obj, name)?, name, max)
}

/// `value` if in `[0, max]`, else a ValueError naming `name`.
fn in_range(value: i128, name: &str, max: u64) -> PyResult<u64> {
    if value < 0 || value > i128::from(max) {
        return Err(value_error(
            name,
            format!("must be in [0, {max}], got {value}"),
        ));
    }
    Ok(value as u64)
}

/// A `dp_rank` argument (default 0, at most `u32::MAX`); None, a bool or a float is a
/// `TypeError` naming it (R29).
fn rank(dp_rank: &convert::Given<'_>) -> PyResult<u32> {
    match dp_rank.value() {
        Some(value) => Ok(unsigned(value, "dp_rank", u64::from(u32::MAX))? as u32),
        None => Ok(0),
    }
}

/// Field `name` of an event given as a dict or an object; `None` (or missing) is `None`.
fn field<'py>(event: &Bound<'py, PyAny>, name: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    let value = if let Ok(dict) = event.cast::<PyDict>() {
        dict.get_item(name)?
    } else {
        match event.getattr(name) {
            Ok(value) => Some(value),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(event.py()) => None,
            Err(e) => return Err(e),
        }
    };
    Ok(value.filter(|v| !v.is_none()))
}

fn text(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<String> {
    // A str subclass (a str-valued enum) is accepted too.
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.to_owned());
    }
    Err(type_error(
        name,
        format!("must be a str, got {}", crate::convert::type_name(obj)),
    ))
}

/// One event from a dict or an object (see docs/events.md); `at` names it in errors.
fn event_from_py(event: &Bound<'_, PyAny>, at: &str) -> PyResult<IndexEvent> {
    let name = |f: &str| format!("{at}.{f}");
    let get = |f: &str| field(event, f);
    let kind = match get("kind")? {
        Some(k) => text(&k, &name("kind"))?,
        None => return Err(value_error(&name("kind"), "is required")),
    };
    let kind = EventKind::parse(&kind).map_err(|e| value_error(&name("kind"), strip(&e)))?;
    let medium = match get("medium")? {
        Some(m) => Medium::parse(&text(&m, &name("medium"))?)
            .map_err(|e| value_error(&name("medium"), strip(&e)))?,
        None => Medium::Device,
    };
    let small = |f: &str, default: u32| -> PyResult<u32> {
        match get(f)? {
            Some(v) => Ok(unsigned(&v, &name(f), u64::from(u32::MAX))? as u32),
            None => Ok(default),
        }
    };
    let window = match get("sliding_window")? {
        Some(v) => Some(unsigned(&v, &name("sliding_window"), u64::from(u32::MAX))? as u32),
        None => None,
    };
    let group_kind = match get("group_kind")? {
        Some(g) => GroupKind::parse(&text(&g, &name("group_kind"))?, window),
        None if window.is_some() => GroupKind::parse("sliding_window", window),
        None => Ok(GroupKind::FullAttention),
    }
    .map_err(|e| value_error(&name("group_kind"), strip(&e)))?;
    let block_size = match get("block_size")? {
        Some(v) => unsigned(&v, &name("block_size"), u64::from(u32::MAX))? as u32,
        None => return Err(value_error(&name("block_size"), "is required")),
    };
    let block_hashes = match get("block_hashes")? {
        Some(list) => {
            let iter = list.try_iter().map_err(|_| {
                type_error(&name("block_hashes"), "must be a list of 16-byte bytes")
            })?;
            iter.map(|h| convert::block_hash(&h?, &name("block_hashes")))
                .collect::<PyResult<Vec<_>>>()?
        }
        None => Vec::new(),
    };
    let token_ids = match get("token_ids")? {
        Some(t) => Some(convert::tokens(&t, &name("token_ids"))?).filter(|t| !t.is_empty()),
        None => None,
    };
    let out = IndexEvent {
        sequence: match get("sequence")? {
            Some(s) => Some(unsigned(&s, &name("sequence"), u64::MAX)?),
            None => None,
        },
        kind,
        medium,
        dp_rank: small("dp_rank", 0)?,
        group: small("group", 0)?,
        group_kind,
        block_size,
        extra_key: convert::extra_key(get("extra_key")?.as_ref(), &name("extra_key"))?
            .map(Into::into),
        parent_hash: get("parent_hash")?
            .map(|h| convert::block_hash(&h, &name("parent_hash")))
            .transpose()?,
        block_hashes,
        token_ids,
    };
    out.validate().map_err(|e| match &e {
        kvpool::KvPoolError::InvalidArgument {
            name: field,
            message,
        } => value_error(&name(field), message),
        _ => crate::errors::to_py(e),
    })?;
    Ok(out)
}

/// The message of an `InvalidArgument` without its "name: " prefix.
fn strip(error: &kvpool::KvPoolError) -> String {
    match error {
        kvpool::KvPoolError::InvalidArgument { message, .. } => message.clone(),
        other => other.to_string(),
    }
}

fn events_from_py(events: &Bound<'_, PyAny>) -> PyResult<Vec<IndexEvent>> {
    if events.is_instance_of::<PyDict>() || events.is_instance_of::<PyString>() {
        return Err(type_error(
            "events",
            "must be an iterable of events (dicts or objects)",
        ));
    }
    let iter = events
        .try_iter()
        .map_err(|_| type_error("events", "must be an iterable of events (dicts or objects)"))?;
    let mut out = Vec::new();
    for (i, event) in iter.enumerate() {
        out.push(event_from_py(&event?, &format!("events[{i}]"))?);
    }
    Ok(out)
}

fn event_to_py<'py>(py: Python<'py>, e: &IndexEvent) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("sequence", e.sequence)?;
    d.set_item("kind", e.kind.as_str())?;
    d.set_item("medium", e.medium.as_str())?;
    d.set_item("dp_rank", e.dp_rank)?;
    d.set_item("group", e.group)?;
    d.set_item("group_kind", e.group_kind.as_str())?;
    d.set_item("sliding_window", e.group_kind.window())?;
    d.set_item("block_size", e.block_size)?;
    d.set_item(
        "extra_key",
        e.extra_key.as_ref().map(|k| PyBytes::new(py, k)),
    )?;
    d.set_item(
        "parent_hash",
        e.parent_hash.map(|h| PyBytes::new(py, &h.to_bytes())),
    )?;
    let hashes = PyList::empty(py);
    for h in &e.block_hashes {
        hashes.append(PyBytes::new(py, &h.to_bytes()))?;
    }
    d.set_item("block_hashes", hashes)?;
    d.set_item("token_ids", e.token_ids.clone())?;
    Ok(d)
}

fn report_to_py<'py>(py: Python<'py>, r: &ApplyReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("applied", r.applied)?;
    d.set_item("duplicates", r.duplicates)?;
    d.set_item("dropped", r.dropped)?;
    d.set_item("evicted", r.evicted)?;
    let gaps = PyList::empty(py);
    for g in &r.gaps {
        let gap = PyDict::new(py);
        gap.set_item("instance", g.instance)?;
        gap.set_item("dp_rank", g.dp_rank)?;
        gap.set_item("expected", g.expected)?;
        gap.set_item("got", g.got)?;
        gaps.append(gap)?;
    }
    d.set_item("gaps", gaps)?;
    Ok(d)
}

/// Hashes given as a list of 16-byte bytes.
pub(crate) fn hashes_from_py(
    obj: &Bound<'_, PyAny>,
    name: &str,
) -> PyResult<Vec<kvpool::BlockHash>> {
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyString>() {
        return Err(type_error(name, "must be a list of 16-byte bytes"));
    }
    let iter = obj
        .try_iter()
        .map_err(|_| type_error(name, "must be a list of 16-byte bytes"))?;
    iter.map(|h| convert::block_hash(&h?, name)).collect()
}

/// A request given as token ids or as its hash chain (exactly one).
enum Request {
    Tokens(Vec<u32>, Option<Vec<u8>>),
    Chain(Vec<kvpool::BlockHash>, u32),
}

fn request(
    token_ids: Option<&Bound<'_, PyAny>>,
    extra_key: Option<&Bound<'_, PyAny>>,
    block_hashes: Option<&Bound<'_, PyAny>>,
    block_size: Option<&Bound<'_, PyAny>>,
) -> PyResult<Request> {
    let token_ids = token_ids.filter(|t| !t.is_none());
    let block_hashes = block_hashes.filter(|h| !h.is_none());
    let block_size = block_size.filter(|b| !b.is_none());
    match (token_ids, block_hashes) {
        (Some(tokens), None) => Ok(Request::Tokens(
            convert::tokens(tokens, "token_ids")?,
            convert::extra_key(extra_key, "extra_key")?,
        )),
        (None, Some(hashes)) => {
            let size = block_size
                .ok_or_else(|| value_error("block_size", "is required with block_hashes"))?;
            let size = unsigned(size, "block_size", u64::from(u32::MAX))? as u32;
            if size == 0 {
                return Err(value_error("block_size", "must be >= 1, got 0"));
            }
            Ok(Request::Chain(
                hashes_from_py(hashes, "block_hashes")?,
                size,
            ))
        }
        _ => Err(type_error(
            "token_ids",
            "give exactly one of token_ids and block_hashes",
        )),
    }
}

#[pymethods]
impl PyKVIndex {
    #[new]
    #[pyo3(
        signature = (*, max_entries = convert::Given::Missing, hash_seed = None, writers = convert::Given::Missing),
        text_signature = "(*, max_entries=16777216, hash_seed=None, writers=1)"
    )]
    fn new(
        max_entries: convert::Given<'_>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        writers: convert::Given<'_>,
    ) -> PyResult<Self> {
        let max_entries = match max_entries.value() {
            Some(value) => unsigned(value, "max_entries", u64::MAX)?,
            None => 16_777_216,
        };
        let config = IndexConfig {
            max_entries: usize::try_from(max_entries).unwrap_or(usize::MAX),
            hash_seed: convert::hash_seed(hash_seed)?,
            writers: writers.count("writers", 1)?,
        };
        Ok(Self {
            inner: KVIndex::new(config).py()?,
        })
    }

    /// Applies a batch of `instance`'s events (dicts or objects, see docs/events.md) in order.
    /// Returns {"applied", "duplicates", "dropped", "evicted", "gaps": [{"instance",
    /// "dp_rank", "expected", "got"}]}. A bad event raises (naming `events[i].field`) and
    /// applies nothing.
    fn apply<'py>(
        &self,
        py: Python<'py>,
        instance: &Bound<'py, PyAny>,
        events: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let instance = unsigned(instance, "instance", u64::MAX)?;
        let events = events_from_py(events)?;
        let report = py.detach(|| self.inner.apply(instance, events)).py()?;
        report_to_py(py, &report)
    }

    /// Applies a msgpack batch (the wire format of docs/events.md) of `instance`'s events.
    fn apply_msgpack<'py>(
        &self,
        py: Python<'py>,
        instance: &Bound<'py, PyAny>,
        data: &[u8],
    ) -> PyResult<Bound<'py, PyDict>> {
        let instance = unsigned(instance, "instance", u64::MAX)?;
        let report = py
            .detach(|| {
                let events = kvpool::decode_index_events(data)?;
                self.inner.apply(instance, events)
            })
            .py()?;
        report_to_py(py, &report)
    }

    /// The matched prefix of a request on every (instance, dp rank, medium) holding at least
    /// its first block: a list of `(instance, dp_rank, medium, blocks, tokens)`, unordered.
    /// With `depths=True`, `(instance, dp_rank, medium, blocks, tokens, kv_blocks, kv_tokens)`
    /// on every location holding KV of the request's first block: `blocks` a hit restores,
    /// `kv_blocks >= blocks` whose KV is held (past `blocks`, a hit recomputes from the
    /// deepest checkpoint; docs/events.md).
    #[pyo3(signature = (token_ids = None, *, extra_key = None, block_hashes = None, block_size = None, now = 0.0, depths = convert::Given::Missing))]
    #[allow(clippy::too_many_arguments)]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        token_ids: Option<&Bound<'py, PyAny>>,
        extra_key: Option<&Bound<'py, PyAny>>,
        block_hashes: Option<&Bound<'py, PyAny>>,
        block_size: Option<&Bound<'py, PyAny>>,
        now: f64,
        depths: convert::Given<'py>,
    ) -> PyResult<Bound<'py, PyList>> {
        let depths = depths.flag("depths", false)?;
        let request = request(token_ids, extra_key, block_hashes, block_size)?;
        let matches = py.detach(|| match &request {
            Request::Tokens(tokens, key) => self.inner.lookup_tokens(tokens, key.as_deref(), now),
            Request::Chain(chain, size) => self.inner.lookup_chain(chain, *size, now),
        });
        let media = [
            intern!(py, "device"),
            intern!(py, "host"),
            intern!(py, "remote"),
        ];
        let out = PyList::empty(py);
        for m in matches {
            let medium = media[usize::from(m.medium.code())].clone();
            if depths {
                let kv_tokens = u64::from(m.kv_blocks) * u64::from(m.block_size);
                out.append((
                    m.instance,
                    m.dp_rank,
                    medium,
                    m.blocks,
                    m.tokens,
                    m.kv_blocks,
                    kv_tokens,
                ))?;
            } else if m.blocks > 0 {
                out.append((m.instance, m.dp_rank, medium, m.blocks, m.tokens))?;
            }
        }
        Ok(out)
    }

    /// Marks a routed request's blocks as held on the device of (`instance`, `dp_rank`) until
    /// `now + ttl` unless a stored event confirms them. Returns how many were marked or
    /// extended.
    #[pyo3(
        signature = (instance, token_ids = None, *, block_size, now, ttl, extra_key = None, block_hashes = None, dp_rank = convert::Given::Missing),
        text_signature = "(self, instance, token_ids=None, *, block_size, now, ttl, extra_key=None, block_hashes=None, dp_rank=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn insert_speculative(
        &self,
        py: Python<'_>,
        instance: &Bound<'_, PyAny>,
        token_ids: Option<&Bound<'_, PyAny>>,
        block_size: &Bound<'_, PyAny>,
        now: &Bound<'_, PyAny>,
        ttl: &Bound<'_, PyAny>,
        extra_key: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        dp_rank: convert::Given<'_>,
    ) -> PyResult<usize> {
        let instance = unsigned(instance, "instance", u64::MAX)?;
        let dp_rank = rank(&dp_rank)?;
        let size = unsigned(block_size, "block_size", u64::from(u32::MAX))? as u32;
        let (now, ttl) = (
            crate::convert::seconds(now, "now")?,
            crate::convert::seconds(ttl, "ttl")?,
        );
        let request = request(token_ids, extra_key, block_hashes, Some(block_size))?;
        py.detach(|| match request {
            Request::Tokens(tokens, key) => self.inner.insert_speculative_tokens(
                instance,
                dp_rank,
                size,
                &tokens,
                key.as_deref(),
                now,
                ttl,
            ),
            Request::Chain(chain, _) => self
                .inner
                .insert_speculative(instance, dp_rank, size, chain, now, ttl),
        })
        .py()
    }

    /// The chained hashes (R6, the index's seed) of the full `block_size`-token blocks of
    /// `token_ids`, continuing from `parent_hash` when given (else rooted at `extra_key`).
    #[pyo3(signature = (token_ids, block_size, *, parent_hash = None, extra_key = None))]
    fn hash_blocks<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        block_size: &Bound<'py, PyAny>,
        parent_hash: Option<&Bound<'py, PyAny>>,
        extra_key: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let size = unsigned(block_size, "block_size", u64::from(u32::MAX))? as usize;
        let tokens = convert::tokens(token_ids, "token_ids")?;
        if size == 0 {
            return Err(value_error("block_size", "must be >= 1, got 0"));
        }
        let key = convert::extra_key(extra_key, "extra_key")?;
        let parent = parent_hash
            .filter(|p| !p.is_none())
            .map(|p| convert::block_hash(p, "parent_hash"))
            .transpose()?;
        let hasher = self.inner.hasher();
        let chain = py.detach(|| match parent {
            None => hasher.chain(&tokens, size, key.as_deref()),
            Some(mut parent) => tokens
                .chunks_exact(size)
                .map(|block| {
                    parent = hasher.hash_block(parent, block);
                    parent
                })
                .collect(),
        });
        let out = PyList::empty(py);
        for h in chain {
            out.append(PyBytes::new(py, &h.to_bytes()))?;
        }
        Ok(out)
    }

    /// Drops the speculative entries lapsing at or before `now`; returns how many.
    fn expire(&self, py: Python<'_>, now: &Bound<'_, PyAny>) -> PyResult<usize> {
        let now = crate::convert::seconds(now, "now")?;
        py.detach(|| self.inner.expire(now)).py()
    }

    /// Drops every entry of (`instance`, `dp_rank`) and forgets its sequence number (after a
    /// gap a replay cannot fill). Returns the entries dropped.
    #[pyo3(
        signature = (instance, dp_rank = convert::Given::Missing),
        text_signature = "(self, instance, dp_rank=0)"
    )]
    fn resync(
        &self,
        py: Python<'_>,
        instance: &Bound<'_, PyAny>,
        dp_rank: convert::Given<'_>,
    ) -> PyResult<usize> {
        let instance = unsigned(instance, "instance", u64::MAX)?;
        let dp_rank = rank(&dp_rank)?;
        Ok(py.detach(|| self.inner.resync(instance, dp_rank)))
    }

    /// Whether `apply` would now apply an event of (`instance`, `dp_rank`) numbered
    /// `sequence`: not a duplicate, not dropped by a gap or a stall. Changes nothing.
    #[pyo3(
        signature = (instance, sequence, *, dp_rank = convert::Given::Missing),
        text_signature = "(self, instance, sequence, *, dp_rank=0)"
    )]
    fn can_apply(
        &self,
        instance: &Bound<'_, PyAny>,
        sequence: &Bound<'_, PyAny>,
        dp_rank: convert::Given<'_>,
    ) -> PyResult<bool> {
        let instance = unsigned(instance, "instance", u64::MAX)?;
        let sequence = unsigned(sequence, "sequence", u64::MAX)?;
        let dp_rank = rank(&dp_rank)?;
        Ok(self.inner.can_apply(instance, dp_rank, sequence))
    }

    /// The writer (in `range(writers)`) that applies `instance`'s events: batches of
    /// instances of different writers apply concurrently (from threads; `apply` releases the
    /// GIL), so a consumer with several threads gives each the instances of its writers.
    fn writer_of(&self, instance: &Bound<'_, PyAny>) -> PyResult<usize> {
        let instance = unsigned(instance, "instance", u64::MAX)?;
        Ok(self.inner.writer_of(instance))
    }

    /// Drops every entry and source of `instance`. Returns the entries dropped.
    fn remove_instance(&self, py: Python<'_>, instance: &Bound<'_, PyAny>) -> PyResult<usize> {
        let instance = unsigned(instance, "instance", u64::MAX)?;
        Ok(py.detach(|| self.inner.remove_instance(instance)))
    }

    /// Every source: [{"instance", "dp_rank", "last", "stalled"}] ("stalled": the number
    /// that opened a gap, or None), sorted.
    fn sources<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for s in self.inner.sources() {
            let d = PyDict::new(py);
            d.set_item("instance", s.instance)?;
            d.set_item("dp_rank", s.dp_rank)?;
            d.set_item("last", s.last)?;
            d.set_item("stalled", s.stalled)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Sizes and counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("entries", s.entries)?;
        d.set_item("speculative_entries", s.speculative_entries)?;
        d.set_item("blocks", s.blocks)?;
        d.set_item("locations", s.locations)?;
        d.set_item("sources", s.sources)?;
        d.set_item("stalled_sources", s.stalled_sources)?;
        d.set_item("max_entries", s.max_entries)?;
        d.set_item("writers", self.inner.config().writers)?;
        let c = s.counters;
        d.set_item("events_applied", c.events_applied)?;
        d.set_item("duplicates", c.duplicates)?;
        d.set_item("dropped", c.dropped)?;
        d.set_item("gaps", c.gaps)?;
        d.set_item("evicted_entries", c.evicted_entries)?;
        d.set_item("expired_entries", c.expired_entries)?;
        d.set_item("speculative_inserted", c.speculative_inserted)?;
        Ok(d)
    }

    /// The index's compact binary dump (versioned), for a warm restart with `load`.
    fn dump<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let data = py.detach(|| self.inner.dump());
        PyBytes::new(py, &data)
    }

    /// An index from a `dump`; `max_entries` overrides the dumped bound.
    #[staticmethod]
    #[pyo3(signature = (data, *, max_entries = None))]
    fn load(py: Python<'_>, data: &[u8], max_entries: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let max = convert::optional_count(max_entries, "max_entries")?;
        let inner = py.detach(|| KVIndex::load(data, max)).py()?;
        Ok(Self { inner })
    }

    /// Raises `kvpool.InvariantError` if a rule of the index is broken (for tests).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.check()).py()
    }

    /// Entries held (one block hash at one location).
    fn __len__(&self) -> usize {
        self.inner.stats().entries
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}

/// The msgpack bytes of a batch of events (dicts or objects, see docs/events.md).
#[pyfunction]
pub fn encode_events<'py>(
    py: Python<'py>,
    events: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let events = events_from_py(events)?;
    let data = py.detach(|| kvpool::encode_index_events(&events));
    Ok(PyBytes::new(py, &data))
}

/// The events of a msgpack batch, as dicts of the documented shape.
#[pyfunction]
pub fn decode_events<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyList>> {
    let events = py.detach(|| kvpool::decode_index_events(data)).py()?;
    let out = PyList::empty(py);
    for e in &events {
        out.append(event_to_py(py, e)?)?;
    }
    Ok(out)
}
