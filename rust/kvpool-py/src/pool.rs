//! `kvpool.Sequence`, `kvpool.BlockManagerPool`, `kvpool.KVEvent`.
//! Each method validates, makes one core call and maps the error. Lock order: a
//! `SequenceBatch` argument, the pool, then the sequences (see `batch.rs`); no lock is held
//! while Python code runs.

use kvpool::{
    BlockManagerPool, KvCacheManager, LinearStateMatch, LinearStateSave, PoolConfig, RankStats,
    Sequence,
};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::batch::SeqsArg;
use crate::convert;
use crate::errors::{type_error, value_error, IntoPyResult};
use crate::hybrid::{PyLinearStatePlan, PyLinearStatePrefixCache};
use crate::manager::{counts_dict, hasher};

/// A request's tokens and KV-cache state (block table, computed tokens, dp rank).
#[pyclass(frozen, module = "kvpool", name = "Sequence")]
pub struct PySequence {
    pub(crate) inner: Mutex<Sequence>,
}

#[pymethods]
impl PySequence {
    #[new]
    #[pyo3(signature = (token_ids, *, seq_id = None, extra_key = None))]
    fn new(
        token_ids: &Bound<'_, PyAny>,
        seq_id: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let seq_id = match seq_id.filter(|s| !s.is_none()) {
            Some(id) => Some(convert::uint64(id, "seq_id")?),
            None => None,
        };
        let tokens = convert::tokens(token_ids, "token_ids")?;
        let key = convert::extra_key(extra_key, "extra_key")?;
        Ok(Self {
            inner: Mutex::new(Sequence::new(tokens, seq_id, key.as_deref())),
        })
    }

    /// Caller-visible id (a process-unique counter unless given).
    #[getter]
    fn seq_id(&self) -> u64 {
        self.inner.lock().seq_id()
    }

    /// The extra key (cache salt) as bytes, or None.
    #[getter]
    fn extra_key<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.lock().extra_key().map(|k| PyBytes::new(py, k))
    }

    fn __len__(&self) -> usize {
        self.inner.lock().len()
    }

    /// Token ids (prompt plus appended), as a list of int.
    #[getter]
    fn token_ids(&self) -> Vec<u32> {
        self.inner.lock().tokens().to_vec()
    }

    /// Appends one token (append the sampled token, then call may_append: R16).
    fn append_token(&self, token: &Bound<'_, PyAny>) -> PyResult<()> {
        let token = convert::int(token, "token")?;
        let token = u32::try_from(token)
            .map_err(|_| value_error("token", format!("must be in [0, 2**32), got {token}")))?;
        self.inner.lock().append_token(token);
        Ok(())
    }

    /// Appends several tokens (a list of int or a 1-D integer numpy array).
    fn append_tokens(&self, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let tokens = convert::tokens(token_ids, "token_ids")?;
        self.inner.lock().append_tokens(&tokens);
        Ok(())
    }

    /// The block table: int32 array of physical block ids, one per logical block.
    #[getter]
    fn block_table<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        let ids: Vec<i32> = self.inner.lock().block_ids().map(|id| id as i32).collect();
        ids.into_pyarray(py)
    }

    /// The block table of group g (int32): 0 is the full-attention table, 1 the sliding-window
    /// table of a pool built with sliding_window (released entries are 0).
    fn group_block_table<'py>(
        &self,
        py: Python<'py>,
        group: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let g = convert::count(group, "group")?;
        let seq = self.inner.lock();
        let ids = seq.group_block_ids(g).ok_or_else(|| {
            value_error(
                "group",
                format!("this sequence has {} group(s), got {g}", seq.num_groups()),
            )
        })?;
        drop(seq);
        let ids: Vec<i32> = ids.into_iter().map(|id| id as i32).collect();
        Ok(ids.into_pyarray(py))
    }

    /// Number of entries of the block table.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.lock().blocks().len()
    }

    /// Tokens whose KV came from the prefix cache at allocation.
    #[getter]
    fn num_cached_tokens(&self) -> usize {
        self.inner.lock().num_cached_tokens()
    }

    /// Tokens whose KV exists; the engine advances it after each step (R17). Lowering it, or
    /// setting it past len(seq) or past what the block table holds, is a ValueError.
    #[getter]
    fn num_computed_tokens(&self) -> usize {
        self.inner.lock().num_computed_tokens()
    }

    #[setter]
    fn set_num_computed_tokens(&self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = convert::count(value, "num_computed_tokens")?;
        self.inner.lock().set_num_computed_tokens(n).py()
    }

    /// Data-parallel rank once allocated (kept across deallocate: R13), else None.
    #[getter]
    fn dp_rank(&self) -> Option<usize> {
        self.inner.lock().dp_rank()
    }

    /// The sequence's single block id while allocated, else None.
    #[getter]
    fn single_block_id(&self) -> Option<u32> {
        self.inner.lock().single_block_id()
    }

    /// Live linear-state slot (hybrid models), else None.
    #[getter]
    fn linear_state_slot(&self) -> Option<u32> {
        self.inner.lock().linear_state_slot()
    }

    /// Checkpoint slot the live state is restored from at allocation (R23), else None (the
    /// sequence starts from an empty state).
    #[getter]
    fn linear_state_restore_slot(&self) -> Option<u32> {
        self.inner.lock().linear_state_restore_slot()
    }

    /// Prompt tokens (those given at construction).
    #[getter]
    fn num_prompt_tokens(&self) -> usize {
        self.inner.lock().num_prompt_tokens()
    }

    /// Whether the sequence holds blocks of a pool.
    #[getter]
    fn is_allocated(&self) -> bool {
        self.inner.lock().is_allocated()
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner.lock())
    }
}

/// Python-visible KV event (R21).
#[pyclass(frozen, module = "kvpool", name = "KVEvent", get_all)]
pub struct PyKvEvent {
    /// "stored", "removed" or "cleared".
    kind: String,
    /// 16-byte hashes of the blocks.
    block_hashes: Vec<Py<PyBytes>>,
    /// Hash of the parent of the first block, None for a chain's first block.
    parent_hash: Option<Py<PyBytes>>,
    /// Token ids of the stored blocks (empty otherwise).
    token_ids: Vec<u32>,
    block_size: usize,
    dp_rank: usize,
    extra_key: Option<Py<PyBytes>>,
}

#[pymethods]
impl PyKvEvent {
    fn __repr__(&self) -> String {
        format!(
            "KVEvent(kind={:?}, blocks={}, dp_rank={}, block_size={})",
            self.kind,
            self.block_hashes.len(),
            self.dp_rank,
            self.block_size
        )
    }
}

pub(crate) fn rank_dict<'py>(py: Python<'py>, r: &RankStats) -> PyResult<Bound<'py, PyDict>> {
    let d = counts_dict(py, &r.counts)?;
    d.set_item("prefix_query_tokens", r.prefix_query_tokens)?;
    d.set_item("prefix_hit_tokens", r.prefix_hit_tokens)?;
    d.set_item("num_evictions", r.num_evictions)?;
    d.set_item("num_free_single_blocks", r.num_free_single_blocks)?;
    d.set_item("num_live_slots", r.num_live_slots)?;
    d.set_item("num_pending_checkpoints", r.num_pending_checkpoints)?;
    d.set_item("num_committed_checkpoints", r.num_committed_checkpoints)?;
    d.set_item("num_free_linear_state_slots", r.num_free_linear_state_slots)?;
    d.set_item("linear_state_hits", r.linear_state_hits)?;
    d.set_item("num_checkpoint_evictions", r.num_checkpoint_evictions)?;
    d.set_item("num_checkpoint_commits", r.num_checkpoint_commits)?;
    match &r.window {
        Some(w) => {
            let window = counts_dict(py, w)?;
            window.set_item("num_releases", r.num_window_releases)?;
            d.set_item("window", window)?;
        }
        None => d.set_item("window", py.None())?,
    }
    d.set_item("host", py.None())?;
    Ok(d)
}

/// Sequence-level KV-cache manager: per dp rank one BlockManager and one SingleBlockManager.
#[pyclass(frozen, module = "kvpool", name = "BlockManagerPool")]
pub struct PyBlockManagerPool {
    inner: Mutex<BlockManagerPool>,
    num_blocks: usize,
    block_size: usize,
    dp_size: usize,
    enable_prefix_cache: bool,
    concurrent: bool,
}

pub(crate) fn seq_ref<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> PyResult<&'a Bound<'py, PySequence>> {
    obj.cast::<PySequence>().map_err(|_| {
        type_error(
            "seq",
            format!("must be a kvpool.Sequence, got {}", obj.get_type()),
        )
    })
}

impl PyBlockManagerPool {
    /// Locks the pool, then `seq` (the lock order everywhere), and makes one core call. A
    /// concurrent pool releases the GIL first (R28): no lock is ever awaited while holding it.
    fn with_seq<T: Send>(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        call: impl FnOnce(&mut BlockManagerPool, &mut Sequence) -> kvpool::Result<T> + Send,
    ) -> PyResult<T> {
        let seq = seq_ref(seq)?.get();
        let run = || {
            let mut pool = self.inner.lock();
            let mut seq = seq.inner.lock();
            call(&mut pool, &mut seq)
        };
        if self.concurrent {
            py.detach(run).py()
        } else {
            run().py()
        }
    }

    /// Locks the pool and makes one core call.
    pub(crate) fn with_pool<T>(
        &self,
        call: impl FnOnce(&mut BlockManagerPool) -> kvpool::Result<T>,
    ) -> PyResult<T> {
        call(&mut self.inner.lock()).py()
    }

    /// Locks the pool and `seqs` (GIL released) for a batch export, each distinct sequence
    /// once (a list may name one twice), and makes one core call on them in argument order.
    fn with_seqs<T: Send>(
        &self,
        py: Python<'_>,
        seqs: &SeqsArg<'_>,
        call: impl FnOnce(&BlockManagerPool, &[&Sequence]) -> kvpool::Result<T> + Send,
    ) -> PyResult<T> {
        let view = seqs.view();
        py.detach(|| view.with_locked(&self.inner, |pool, locked| call(pool, &locked.refs())))
            .py()
    }
}

pub(crate) fn group_arg(group: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    match group {
        Some(g) if !g.is_none() => convert::count(g, "group"),
        _ => Ok(0),
    }
}

/// The `PoolConfig` of the keyword options shared by `BlockManagerPool` and
/// `HierarchyBlockManagerPool`, each argument validated under its own name.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pool_config(
    num_blocks: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
    dp_size: Option<&Bound<'_, PyAny>>,
    enable_prefix_cache: bool,
    num_single_blocks: Option<&Bound<'_, PyAny>>,
    linear_state_slots: Option<&Bound<'_, PyAny>>,
    checkpoint_interval: Option<&Bound<'_, PyAny>>,
    linear_state_match: Option<&Bound<'_, PyAny>>,
    enable_events: bool,
    hash_seed: Option<&Bound<'_, PyAny>>,
    sliding_window: Option<&Bound<'_, PyAny>>,
    swa_num_blocks: Option<&Bound<'_, PyAny>>,
    linear_state_save: Option<&Bound<'_, PyAny>>,
    debug_hash_bits: Option<&Bound<'_, PyAny>>,
) -> PyResult<PoolConfig> {
    let num_blocks = convert::count(num_blocks, "num_blocks")?;
    let block_size = convert::count(block_size, "block_size")?;
    let dp_size = optional_count(dp_size, "dp_size")?.unwrap_or(1);
    let num_single_blocks = optional_count(num_single_blocks, "num_single_blocks")?;
    let linear_state_match = LinearStateMatch::parse(&choice(
        linear_state_match,
        "linear_state_match",
        "deepest",
    )?)
    .py()?;
    let linear_state_save =
        LinearStateSave::parse(&choice(linear_state_save, "linear_state_save", "copy")?).py()?;
    Ok(PoolConfig {
        num_blocks,
        block_size,
        dp_size,
        enable_prefix_cache,
        num_single_blocks,
        hasher: hasher(hash_seed, crate::manager::debug_bits(debug_hash_bits)?)?,
        enable_events,
        linear_state_slots: optional_count(linear_state_slots, "linear_state_slots")?.unwrap_or(0),
        checkpoint_interval: optional_count(checkpoint_interval, "checkpoint_interval")?,
        linear_state_match,
        linear_state_save,
        sliding_window: optional_count(sliding_window, "sliding_window")?,
        swa_num_blocks: optional_count(swa_num_blocks, "swa_num_blocks")?,
    })
}

fn choice(value: Option<&Bound<'_, PyAny>>, name: &str, default: &str) -> PyResult<String> {
    match value {
        Some(v) if !v.is_none() => v
            .extract::<String>()
            .map_err(|_| type_error(name, "must be a str")),
        _ => Ok(default.to_owned()),
    }
}

fn optional_count(value: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<usize>> {
    convert::optional_count(value, name)
}

#[pymethods]
impl PyBlockManagerPool {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size, *, dp_size = None, enable_prefix_cache = None, num_single_blocks = None,
        linear_state_slots = None, checkpoint_interval = None, linear_state_match = None,
        concurrent = None, enable_events = None, hash_seed = None, sliding_window = None,
        swa_num_blocks = None, linear_state_save = None, debug_hash_bits = None
    ), text_signature = "(num_blocks, block_size, *, dp_size=1, enable_prefix_cache=True, num_single_blocks=None, linear_state_slots=0, checkpoint_interval=None, linear_state_match='deepest', concurrent=False, enable_events=False, hash_seed=None, sliding_window=None, swa_num_blocks=None, linear_state_save='copy', debug_hash_bits=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        dp_size: Option<&Bound<'_, PyAny>>,
        enable_prefix_cache: Option<&Bound<'_, PyAny>>,
        num_single_blocks: Option<&Bound<'_, PyAny>>,
        linear_state_slots: Option<&Bound<'_, PyAny>>,
        checkpoint_interval: Option<&Bound<'_, PyAny>>,
        linear_state_match: Option<&Bound<'_, PyAny>>,
        concurrent: Option<&Bound<'_, PyAny>>,
        enable_events: Option<&Bound<'_, PyAny>>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        sliding_window: Option<&Bound<'_, PyAny>>,
        swa_num_blocks: Option<&Bound<'_, PyAny>>,
        linear_state_save: Option<&Bound<'_, PyAny>>,
        debug_hash_bits: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let enable_prefix_cache = convert::flag(enable_prefix_cache, "enable_prefix_cache", true)?;
        let concurrent = convert::flag(concurrent, "concurrent", false)?;
        let enable_events = convert::flag(enable_events, "enable_events", false)?;
        let config = pool_config(
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
            linear_state_save,
            debug_hash_bits,
        )?;
        let (num_blocks, block_size, dp_size) =
            (config.num_blocks, config.block_size, config.dp_size);
        let pool = BlockManagerPool::new(config).py()?;
        Ok(Self {
            inner: Mutex::new(pool),
            num_blocks,
            block_size,
            dp_size,
            enable_prefix_cache,
            concurrent,
        })
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

    /// What allocate(seq, num_tokens) would return, with no side effect (R15).
    #[pyo3(signature = (seq, num_tokens = None))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let n = optional_count(num_tokens, "num_tokens")?;
        self.with_seq(py, seq, |pool, seq| pool.can_allocate(seq, n))
    }

    /// Gives seq blocks for num_tokens tokens (default len(seq)) after a prefix-cache match
    /// (R8, R13, R14); on a sequence that holds blocks, grows its table (chunked prefill).
    /// All-or-nothing: False leaves the pool and the sequence exactly as they were.
    #[pyo3(signature = (seq, num_tokens = None))]
    fn allocate(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let n = optional_count(num_tokens, "num_tokens")?;
        self.with_seq(py, seq, |pool, seq| pool.allocate(seq, n))
    }

    /// Whether the blocks for len(seq) + lookahead tokens can be had (R16).
    ///
    /// len(seq) already counts the token whose KV the next step writes: append the sampled
    /// token first, then ask. With block_size 4: 4 tokens fill one block; after append_token
    /// (5 tokens) one more block is needed; at 6 tokens nothing is. lookahead reserves room for
    /// speculative tokens.
    #[pyo3(signature = (seq, lookahead = None), text_signature = "(self, seq, lookahead=0)")]
    fn can_append(
        &self,
        py: Python<'_>,
        seq: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let lookahead = optional_count(lookahead, "lookahead")?.unwrap_or(0);
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
        let lookahead = optional_count(lookahead, "lookahead")?.unwrap_or(0);
        self.with_seq(py, seq, |pool, seq| pool.may_append(seq, lookahead))
    }

    /// Publishes the full blocks inside seq.num_computed_tokens in the prefix cache (R17).
    fn cache(&self, py: Python<'_>, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_seq(py, seq, |pool, seq| pool.cache(seq))
    }

    /// cache(seq), then releases its blocks and single block and resets it (R18).
    fn deallocate(&self, py: Python<'_>, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        self.with_seq(py, seq, |pool, seq| pool.deallocate(seq))
    }

    /// Block tables of seqs (a SequenceBatch or an iterable of Sequence): int32 array
    /// [len(seqs), max_blocks], padded with 0 (R19).
    #[pyo3(signature = (seqs, group = None), text_signature = "(self, seqs, group=0)")]
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        seqs: &Bound<'py, PyAny>,
        group: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let group = group_arg(group)?;
        let seqs = SeqsArg::extract(seqs)?;
        let (rows, table, width) = self.with_seqs(py, &seqs, |pool, refs| {
            pool.block_tables(refs, group)
                .map(|(t, w)| (refs.len(), t, w))
        })?;
        let array = Array2::from_shape_vec((rows, width), table).expect("shape matches");
        Ok(array.into_pyarray(py))
    }

    /// Cache slots (int64) of tokens [num_computed_tokens, len) of every sequence, concatenated:
    /// slot = block_id * block_size + position % block_size (R19).
    #[pyo3(signature = (seqs, group = None), text_signature = "(self, seqs, group=0)")]
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seqs: &Bound<'py, PyAny>,
        group: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let group = group_arg(group)?;
        let seqs = SeqsArg::extract(seqs)?;
        let slots = self.with_seqs(py, &seqs, |pool, refs| pool.slot_mapping(refs, group))?;
        Ok(slots.into_pyarray(py))
    }

    /// Counts, prefix-cache and slot statistics, totals and per rank (R20).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.inner.lock().stats();
        let dict = rank_dict(py, &stats.total)?;
        let ranks = PyList::empty(py);
        for r in &stats.ranks {
            ranks.append(rank_dict(py, r)?)?;
        }
        dict.set_item("ranks", ranks)?;
        Ok(dict)
    }

    /// Walks every structure; raises InvariantError if a rule is broken (R20).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| inner.lock().check()).py()
    }

    /// Returns and clears the recorded KV events (R21); [] unless enable_events.
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.inner.lock().drain_events();
        events_list(py, events)
    }

    /// Drops every cached entry of every rank, every committed checkpoint nothing pins and
    /// every sliding-window publication; blocks sequences hold stay with them (R12, R24).
    fn reset_prefix_cache(&self, py: Python<'_>) {
        let inner = &self.inner;
        py.detach(|| inner.lock().reset_prefix_cache());
    }

    /// After a forward step, for every sequence in one call (GIL released): marks every token
    /// computed (R17), publishes the full blocks (cache) and appends token_ids[i] to seqs[i].
    /// The same as those three calls per sequence without the Python loop. seqs: a
    /// SequenceBatch (no per-sequence Python work) or an iterable of Sequence.
    ///
    /// Take the new tokens' slots with may_append_all before the next step, or pass lookahead
    /// (an int >= 0) to take them in this call: advance then returns the indices of the
    /// sequences that got no room (as may_append_all does); without it, None.
    #[pyo3(signature = (seqs, token_ids, *, lookahead = None))]
    fn advance(
        &self,
        py: Python<'_>,
        seqs: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Vec<usize>>> {
        let lookahead = optional_count(lookahead, "lookahead")?;
        let seqs = SeqsArg::extract(seqs)?;
        let tokens = convert::tokens(token_ids, "token_ids")?;
        let view = seqs.view();
        py.detach(|| {
            view.with_locked(&self.inner, |pool, locked| {
                let mut args = locked.args_mut()?;
                match lookahead {
                    None => pool.advance_all(&mut args, &tokens).map(|()| None),
                    Some(n) => pool
                        .advance_and_reserve_all(&mut args, &tokens, n)
                        .map(Some),
                }
            })
        })
        .py()
    }

    /// may_append(seq, lookahead) for every sequence in one call (GIL released, R16). Returns
    /// the indices (into seqs) of the sequences whose blocks could not be had, a list of int
    /// that is empty when every sequence got room (those listed are unchanged: preempt them).
    #[pyo3(signature = (seqs, lookahead = None), text_signature = "(self, seqs, lookahead=0)")]
    fn may_append_all(
        &self,
        py: Python<'_>,
        seqs: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<usize>> {
        let lookahead = optional_count(lookahead, "lookahead")?.unwrap_or(0);
        let seqs = SeqsArg::extract(seqs)?;
        let view = seqs.view();
        py.detach(|| {
            view.with_locked(&self.inner, |pool, locked| {
                pool.may_append_all(&mut locked.args_mut()?, lookahead)
            })
        })
        .py()
    }

    /// Whether the pool releases the GIL in every call (built with concurrent=True, R28).
    #[getter]
    fn concurrent(&self) -> bool {
        self.concurrent
    }

    /// Block groups of every sequence: 1, or 2 with sliding_window (R25).
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.lock().num_groups()
    }

    /// The linear-state cache of dp rank dp_rank (a live view, R22).
    fn linear_state_cache(
        slf: &Bound<'_, Self>,
        dp_rank: &Bound<'_, PyAny>,
    ) -> PyResult<PyLinearStatePrefixCache> {
        let rank = convert::count(dp_rank, "dp_rank")?;
        let this = slf.get();
        if rank >= this.dp_size {
            return Err(value_error(
                "dp_rank",
                format!("must be < dp_size {}, got {rank}", this.dp_size),
            ));
        }
        if this.inner.lock().linear_state_cache(rank).is_none() {
            return Err(value_error(
                "dp_rank",
                "this pool has no linear state (build it with linear_state_slots > 0)",
            ));
        }
        Ok(PyLinearStatePrefixCache::view(slf.clone().unbind(), rank))
    }

    /// The recurrent-state copies planned since the last call, for every rank (R24). Execute
    /// them before the sequences' next forward step, then commit_linear_state_plan(plan).
    fn take_linear_state_plan(&self) -> PyLinearStatePlan {
        PyLinearStatePlan {
            plan: self.inner.lock().take_linear_state_plan(),
        }
    }

    /// Confirms that the worker made the copies of plan: saved checkpoints become matchable and
    /// restored ones unpinned (R24). A plan twice, or of another pool, is a ValueError.
    fn commit_linear_state_plan(&self, plan: &Bound<'_, PyAny>) -> PyResult<()> {
        let plan = plan.cast::<PyLinearStatePlan>().map_err(|_| {
            type_error(
                "plan",
                format!("must be a kvpool.LinearStatePlan, got {}", plan.get_type()),
            )
        })?;
        self.with_pool(|pool| pool.commit_linear_state_plan(&plan.get().plan))
    }

    fn __repr__(&self) -> String {
        let stats = self.inner.lock().stats();
        format!(
            "BlockManagerPool(num_blocks={}, block_size={}, dp_size={}, free={}, cached={}, used={})",
            self.num_blocks, self.block_size, self.dp_size, stats.total.counts.free, stats.total.counts.cached, stats.total.counts.used
        )
    }
}

// host tier (R26): helpers shared with hierarchy.rs (additive; the pool above is unchanged).

/// Core KV events as a list of `kvpool.KVEvent` (R21).
pub(crate) fn events_list<'py>(
    py: Python<'py>,
    events: Vec<kvpool::KvEvent>,
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for e in events {
        let event = PyKvEvent {
            kind: e.kind.as_str().to_owned(),
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
