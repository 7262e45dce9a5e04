//! `kvpool.SequenceBatch` (a persistent batch of running sequences) and the `seqs` argument of
//! the pools' batch calls: a `SequenceBatch` or any iterable of `kvpool.Sequence`.
//!
//! Invariants: a batch holds each sequence at most once, in insertion order; removing keeps the
//! order of the rest. A batch call locks, in this order, the batch (keeping its members alive
//! and in place for the call), the pool, then every distinct sequence once. Sequences are taken
//! with `try_lock` in argument order first (no sort, no wait); if one is busy, or a list names
//! it twice, everything is let go and they are locked in address order instead, so two calls
//! never wait on each other in opposite orders. Batch methods take only the batch's lock.

use std::collections::HashSet;

use kvpool::Sequence;
use numpy::{IntoPyArray, PyArray1};
use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::convert;
use crate::errors::{type_error, value_error};
use crate::sequence::PySequence;

/// An ordered set of sequences kept from step to step: the running batch of an engine.
///
/// Pass it wherever a pool takes ``seqs`` (``may_append_all``, ``advance``, ``block_tables``,
/// ``slot_mapping``): the pool then reads the members without a Python loop, converting or
/// checking nothing per call, so a step costs the core's work per sequence. Add sequences when
/// they start running and remove them when they stop; ``token_ids`` arrays line up with the
/// batch's order (insertion order; ``seq_ids`` gives it).
#[pyclass(frozen, module = "kvpool", name = "SequenceBatch")]
pub struct PySequenceBatch {
    members: Mutex<Members>,
}

#[derive(Default)]
struct Members {
    seqs: Vec<Py<PySequence>>,
    /// Addresses of `seqs`' objects (membership in O(1)).
    index: HashSet<usize>,
}

impl Members {
    /// The addresses of `seqs`, checking that each is listed once and is (`members`) or is not
    /// (`!members`) in the batch; a ValueError naming `seqs` with `problem` otherwise.
    fn distinct_keys(
        &self,
        seqs: &[Bound<'_, PySequence>],
        members: bool,
        problem: &str,
    ) -> PyResult<HashSet<usize>> {
        let mut keys = HashSet::with_capacity(seqs.len());
        for seq in seqs {
            let key = address(seq.get());
            if self.index.contains(&key) != members || !keys.insert(key) {
                let id = seq.get().inner.lock().seq_id();
                return Err(value_error("seqs", format!("sequence {id} {problem}")));
            }
        }
        Ok(keys)
    }
}

fn address(seq: &PySequence) -> usize {
    std::ptr::from_ref(seq) as usize
}

/// The sequences of `seqs` (an iterable of `kvpool.Sequence`); a TypeError naming `name` otherwise.
fn sequences<'py>(seqs: &Bound<'py, PyAny>, name: &str) -> PyResult<Vec<Bound<'py, PySequence>>> {
    let cast = |item: Bound<'py, PyAny>| {
        item.cast_into::<PySequence>().map_err(|e| {
            type_error(
                name,
                format!(
                    "must contain kvpool.Sequence, got {}",
                    e.into_inner().get_type()
                ),
            )
        })
    };
    // Lists and tuples are read directly (no iterator protocol per item).
    if let Ok(list) = seqs.cast::<PyList>() {
        return list.iter().map(cast).collect();
    }
    if let Ok(tuple) = seqs.cast::<PyTuple>() {
        return tuple.iter().map(cast).collect();
    }
    seqs.try_iter()
        .map_err(|_| type_error(name, "must be an iterable of kvpool.Sequence"))?
        .map(|item| cast(item?))
        .collect()
}

fn one_sequence<'a, 'py>(
    seq: &'a Bound<'py, PyAny>,
    name: &str,
) -> PyResult<&'a Bound<'py, PySequence>> {
    seq.cast::<PySequence>().map_err(|_| {
        type_error(
            name,
            format!("must be a kvpool.Sequence, got {}", seq.get_type()),
        )
    })
}

#[pymethods]
impl PySequenceBatch {
    #[new]
    #[pyo3(signature = (seqs = None))]
    fn new(seqs: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let batch = Self {
            members: Mutex::new(Members::default()),
        };
        if let Some(seqs) = seqs.filter(|s| !s.is_none()) {
            batch.extend(seqs)?;
        }
        Ok(batch)
    }

    /// Appends seq (a ValueError if it is already in the batch).
    fn add(&self, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        let seq = one_sequence(seq, "seq")?;
        let mut members = self.members.lock();
        if !members.index.insert(address(seq.get())) {
            return Err(value_error("seq", "is already in the batch"));
        }
        members.seqs.push(seq.clone().unbind());
        Ok(())
    }

    /// Appends every sequence of seqs, in order. All-or-nothing: a ValueError if one is already
    /// in the batch or listed twice, a TypeError if one is not a kvpool.Sequence.
    fn extend(&self, seqs: &Bound<'_, PyAny>) -> PyResult<()> {
        let seqs = sequences(seqs, "seqs")?;
        let mut members = self.members.lock();
        let added =
            members.distinct_keys(&seqs, false, "is already in the batch or listed twice")?;
        members.index.extend(added);
        members.seqs.extend(seqs.into_iter().map(Bound::unbind));
        Ok(())
    }

    /// Removes seq, keeping the order of the others (a ValueError if it is not in the batch).
    fn remove(&self, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        let seq = one_sequence(seq, "seq")?;
        let key = address(seq.get());
        let mut members = self.members.lock();
        if !members.index.remove(&key) {
            return Err(value_error("seq", "is not in the batch"));
        }
        members.seqs.retain(|s| address(s.get()) != key);
        Ok(())
    }

    /// Removes every sequence of seqs in one pass, keeping the order of the others.
    /// All-or-nothing: a ValueError if one is not in the batch or is listed twice.
    fn remove_all(&self, seqs: &Bound<'_, PyAny>) -> PyResult<()> {
        let seqs = sequences(seqs, "seqs")?;
        let mut members = self.members.lock();
        let gone = members.distinct_keys(&seqs, true, "is not in the batch or is listed twice")?;
        let members = &mut *members;
        members.seqs.retain(|s| !gone.contains(&address(s.get())));
        for key in &gone {
            members.index.remove(key);
        }
        Ok(())
    }

    /// Checks the batch's invariants: each member once, and the membership index naming
    /// exactly the members. Raises InvariantError otherwise.
    fn check(&self) -> PyResult<()> {
        let members = self.members.lock();
        let addresses: HashSet<usize> = members.seqs.iter().map(|s| address(s.get())).collect();
        if addresses.len() != members.seqs.len() || addresses != members.index {
            return Err(crate::errors::InvariantError::new_err(format!(
                "SequenceBatch: {} members, {} distinct, index of {}",
                members.seqs.len(),
                addresses.len(),
                members.index.len()
            )));
        }
        Ok(())
    }

    /// Removes every sequence.
    fn clear(&self) {
        let mut members = self.members.lock();
        members.seqs.clear();
        members.index.clear();
    }

    /// The members' seq_id values in batch order (uint64 array, shape [len(batch)]).
    #[getter]
    fn seq_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        let ids: Vec<u64> = self
            .members
            .lock()
            .seqs
            .iter()
            .map(|s| s.get().inner.lock().seq_id())
            .collect();
        ids.into_pyarray(py)
    }

    fn __len__(&self) -> usize {
        self.members.lock().seqs.len()
    }

    /// The member at position index (negative counts from the end), e.g. the sequence behind
    /// an index that advance or may_append_all returned.
    fn __getitem__(&self, py: Python<'_>, index: &Bound<'_, PyAny>) -> PyResult<Py<PySequence>> {
        let index = convert::int(index, "index")?; // any int: out of range is an IndexError
        let members = self.members.lock();
        let len = members.seqs.len() as i128;
        let position = if index < 0 { index + len } else { index };
        if !(0..len).contains(&position) {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "index: {index} is out of range for a batch of {len}"
            )));
        }
        Ok(members.seqs[position as usize].clone_ref(py))
    }

    fn __contains__(&self, seq: &Bound<'_, PyAny>) -> bool {
        seq.cast::<PySequence>()
            .is_ok_and(|s| self.members.lock().index.contains(&address(s.get())))
    }

    /// The members in batch order (a snapshot: changing the batch while iterating is safe).
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let list = PyList::new(py, self.members.lock().seqs.iter().map(|s| s.clone_ref(py)))?;
        Ok(list.as_any().try_iter()?.into_any())
    }

    fn __repr__(&self) -> String {
        format!("SequenceBatch(len={})", self.members.lock().seqs.len())
    }
}

/// The `seqs` argument of a batch call, extracted with the GIL held.
pub(crate) enum SeqsArg<'py> {
    Batch(Bound<'py, PySequenceBatch>),
    List(Vec<Bound<'py, PySequence>>),
}

impl<'py> SeqsArg<'py> {
    /// A `SequenceBatch`, or an iterable of `kvpool.Sequence` (a TypeError naming `seqs`).
    pub(crate) fn extract(seqs: &Bound<'py, PyAny>) -> PyResult<Self> {
        match seqs.cast::<PySequenceBatch>() {
            Ok(batch) => Ok(Self::Batch(batch.clone())),
            Err(_) => sequences(seqs, "seqs").map(Self::List),
        }
    }

    /// What the call reads with the GIL released.
    pub(crate) fn view(&self) -> SeqsView<'_> {
        match self {
            Self::Batch(batch) => SeqsView::Batch(batch.get()),
            Self::List(list) => SeqsView::List(list.iter().map(|s| s.get()).collect()),
        }
    }
}

/// [`SeqsArg`] without the GIL (`Send`).
pub(crate) enum SeqsView<'a> {
    Batch(&'a PySequenceBatch),
    List(Vec<&'a PySequence>),
}

impl SeqsView<'_> {
    /// Locks the batch (if any), then `pool`, then every distinct sequence once, and runs
    /// `call` on them (see the module doc for the order).
    pub(crate) fn with_locked<P, T>(
        &self,
        pool: &Mutex<P>,
        call: impl FnOnce(&mut P, &mut Locked<'_>) -> T,
    ) -> T {
        match self {
            Self::Batch(batch) => {
                let members = batch.members.lock();
                let objects: Vec<&PySequence> = members.seqs.iter().map(|s| s.get()).collect();
                let mut pool = pool.lock();
                let mut locked = Locked::new(&objects);
                let result = call(&mut pool, &mut locked);
                drop(locked);
                result
            }
            Self::List(objects) => {
                let mut pool = pool.lock();
                let mut locked = Locked::new(objects);
                call(&mut pool, &mut locked)
            }
        }
    }
}

/// The locked sequences of one batch call: `len` arguments, each distinct sequence locked once.
pub(crate) struct Locked<'a> {
    guards: Vec<MutexGuard<'a, Sequence>>,
    /// `slot[i]`: the guard of argument `i`; empty when the guards are in argument order.
    slot: Vec<usize>,
    len: usize,
}

impl<'a> Locked<'a> {
    fn new(objects: &[&'a PySequence]) -> Self {
        let mut guards = Vec::with_capacity(objects.len());
        for seq in objects {
            match seq.inner.try_lock() {
                Some(guard) => guards.push(guard),
                // Busy (another thread, or this list names it twice): start over in order.
                None => {
                    drop(guards);
                    return Self::in_address_order(objects);
                }
            }
        }
        Self {
            guards,
            slot: Vec::new(),
            len: objects.len(),
        }
    }

    fn in_address_order(objects: &[&'a PySequence]) -> Self {
        let mut order: Vec<usize> = (0..objects.len()).collect();
        order.sort_unstable_by_key(|&i| address(objects[i]));
        let mut guards = Vec::with_capacity(objects.len());
        let mut slot = vec![0; objects.len()];
        let mut previous: Option<&PySequence> = None;
        for i in order {
            if !previous.is_some_and(|p| std::ptr::eq(p, objects[i])) {
                guards.push(objects[i].inner.lock());
                previous = Some(objects[i]);
            }
            slot[i] = guards.len() - 1;
        }
        Self {
            guards,
            slot,
            len: objects.len(),
        }
    }

    fn guard_of(&self, i: usize) -> usize {
        if self.slot.is_empty() {
            i
        } else {
            self.slot[i]
        }
    }

    /// The sequences in argument order (repeats included).
    pub(crate) fn refs(&self) -> Vec<&Sequence> {
        (0..self.len)
            .map(|i| &*self.guards[self.guard_of(i)])
            .collect()
    }

    /// The sequences in argument order, mutably: for calls that change them, so naming one
    /// twice is an error (`seqs`).
    pub(crate) fn args_mut(&mut self) -> kvpool::Result<Vec<&mut Sequence>> {
        self.require_distinct()?;
        if self.slot.is_empty() {
            return Ok(self.guards.iter_mut().map(|g| &mut **g).collect());
        }
        let mut by_guard: Vec<Option<&mut Sequence>> =
            self.guards.iter_mut().map(|g| Some(&mut **g)).collect();
        Ok(self
            .slot
            .iter()
            .map(|&g| {
                by_guard[g]
                    .take()
                    .expect("distinct: one argument per guard")
            })
            .collect())
    }

    /// For calls that change the sequences: naming one twice is an error (`seqs`).
    fn require_distinct(&self) -> kvpool::Result<()> {
        if self.guards.len() == self.len {
            Ok(())
        } else {
            Err(kvpool::KvPoolError::invalid(
                "seqs",
                "lists a sequence twice",
            ))
        }
    }
}
