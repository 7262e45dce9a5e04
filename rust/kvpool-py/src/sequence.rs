//! `kvpool.Sequence`: a request's tokens and the KV-cache state a pool gives it. Each method
//! locks the sequence alone (the pools lock their own lock first, then sequences).

use kvpool::Sequence;
use numpy::{IntoPyArray, PyArray1};
use parking_lot::Mutex;
use pyo3::exceptions::{PyIndexError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple, PyType};

use crate::convert;
use crate::errors::{type_error, value_error, IntoPyResult};

/// A request's tokens and KV-cache state (block table, computed tokens, dp rank).
///
/// Subclassable (an engine's own sequence class, with its own attributes: `dict`): a subclass's
/// constructor arguments past `token_ids` go to its `__init__`.
#[pyclass(frozen, subclass, dict, module = "kvpool", name = "Sequence")]
pub struct PySequence {
    pub(crate) inner: Mutex<Sequence>,
}

#[pymethods]
impl PySequence {
    #[new]
    #[classmethod]
    #[pyo3(signature = (token_ids, *args, seq_id = None, extra_key = None, **kwargs))]
    fn new(
        cls: &Bound<'_, PyType>,
        token_ids: &Bound<'_, PyAny>,
        args: &Bound<'_, PyTuple>,
        seq_id: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let extra = !args.is_empty() || kwargs.is_some_and(|k| !k.is_empty());
        if extra && cls.is(cls.py().get_type::<Self>()) {
            // Only a subclass's __init__ takes more arguments.
            return Err(PyTypeError::new_err(
                "Sequence() takes token_ids and the keywords seq_id and extra_key only",
            ));
        }
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

    /// Appends the items of `token_ids` past the sequence's length: `token_ids` is the whole
    /// token list of the request (its first `len(self)` items are this sequence's tokens, as
    /// an engine's growing list is; they are not read again). A list is read from there on,
    /// without a slice; shorter than the sequence is a ValueError.
    fn extend_to(&self, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let start = self.inner.lock().len();
        // Converted without the lock held: a non-list iterable runs Python code.
        let tokens = convert::tokens_from(token_ids, start, "token_ids")?;
        let mut seq = self.inner.lock();
        if seq.len() != start {
            return Err(value_error(
                "token_ids",
                "the sequence grew while its tokens were being read",
            ));
        }
        seq.append_tokens(&tokens);
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

    /// The last entry of the block table (the one may_append just added), or None.
    #[getter]
    fn last_block_id(&self) -> Option<u32> {
        self.inner.lock().blocks().last().map(|b| b.id())
    }

    /// Entry i of the block table (negative i counts from the end), without copying the table.
    fn block_id(&self, i: &Bound<'_, PyAny>) -> PyResult<u32> {
        let i = convert::int(i, "i")?;
        let seq = self.inner.lock();
        let blocks = seq.blocks();
        let n = blocks.len() as i128;
        let index = if i < 0 { i + n } else { i };
        if !(0..n).contains(&index) {
            return Err(PyIndexError::new_err(format!(
                "i: block index {i} out of range for a table of {n} entries"
            )));
        }
        Ok(blocks[index as usize].id())
    }

    /// The block table as a Python list of int (for engines that keep tables as lists).
    fn block_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ids: Vec<u32> = self.inner.lock().block_ids().collect();
        crate::id_list::id_list(py, &ids)
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

/// `obj` as a `kvpool.Sequence` (a TypeError naming `seq` otherwise).
pub(crate) fn seq_ref<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> PyResult<&'a Bound<'py, PySequence>> {
    obj.cast::<PySequence>().map_err(|_| {
        type_error(
            "seq",
            format!("must be a kvpool.Sequence, got {}", obj.get_type()),
        )
    })
}
