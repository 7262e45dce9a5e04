//! Block-id lists for Python (`Sequence.block_ids`) built from shared int objects.
//!
//! A request's table of a few hundred ids becomes a `list[int]` at every admission of an
//! engine that keeps its tables as lists (vLLM's manager). Ids past 256 are not CPython's
//! cached small ints, so each would be a fresh int object, allocated for the list and freed
//! with it: most of the call's time. Here the ids below [`SHARED_IDS`] are made once per
//! process, on first use and as far as the largest id asked for, and every list holds new
//! references to them (an INCREF each); larger ids are made fresh. Invariant: `ids[i]` is the
//! int `i` (ints are immutable, so sharing them is invisible to Python).

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyInt, PyList};

/// Ids below this share their int objects (at most 64Ki ints, about 2 MiB, ever made).
const SHARED_IDS: u32 = 1 << 16;

static IDS: PyOnceLock<Mutex<Vec<Py<PyInt>>>> = PyOnceLock::new();

/// `ids` as a Python list of int.
pub fn id_list<'py>(py: Python<'py>, ids: &[u32]) -> PyResult<Bound<'py, PyList>> {
    let shared = IDS.get_or_init(py, || Mutex::new(Vec::new()));
    let mut made = shared.lock();
    let needed = ids
        .iter()
        .copied()
        .filter(|&id| id < SHARED_IDS)
        .max()
        .map_or(0, |id| id + 1);
    if made.len() < needed as usize {
        // grown to the next power of two, so a pool's ids are made in a few steps
        let target = needed.next_power_of_two().min(SHARED_IDS);
        for id in made.len() as u32..target {
            made.push(PyInt::new(py, id).unbind());
        }
    }
    let items = ids.iter().map(|&id| match made.get(id as usize) {
        Some(int) => int.bind(py).clone(),
        None => PyInt::new(py, id),
    });
    PyList::new(py, items)
}
