//! Python bindings of the kvpool core (`kvpool._core`): thin wrappers that validate, make one
//! core call and map the error; one file per exposed family, mirroring the core. Every class is
//! frozen with a lock inside (R28). The Python docs of every class live in `_core.pyi`; a
//! binding's own doc is one line. The bindings never import the Python package: every call walks
//! Python -> bindings -> core (a Python policy subclasses a class here instead, as
//! `kvpool.HierarchyBlockManagerPool` does; docs/architecture.md).

mod batch;
mod block;
mod convert;
mod elastic; // the pool's xtensor option
mod errors;
mod events;
mod hierarchy;
mod id_list; // block-id lists of shared ints
mod index; // prefix index over KV events
mod linear_state;
mod manager;
mod options;
mod plan;
mod pool;
mod pool_lock; // waiting for a pool's lock without the GIL
mod prefix_cache;
mod sequence;
mod stats;
mod window;
mod xtensor; // elastic pages

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", kvpool::version())?;
    m.add("DEFAULT_HASH_SEED", kvpool::DEFAULT_HASH_SEED)?;
    m.add("KVPoolError", py.get_type::<errors::KVPoolError>())?;
    m.add(
        "OutOfBlocksError",
        py.get_type::<errors::OutOfBlocksError>(),
    )?;
    m.add("InvariantError", py.get_type::<errors::InvariantError>())?;
    m.add_class::<block::PyBlock>()?;
    m.add_class::<manager::PyBlockManager>()?;
    m.add_class::<manager::PyConcurrentBlockManager>()?;
    m.add_class::<manager::PySingleBlockManager>()?;
    m.add_class::<prefix_cache::PyPrefixCache>()?;
    m.add_function(wrap_pyfunction!(manager::hash_blocks, m)?)?;
    m.add_class::<sequence::PySequence>()?;
    m.add_class::<pool::PyBlockManagerPool>()?;
    m.add_class::<plan::PyAllocationPlan>()?;
    m.add_class::<batch::PySequenceBatch>()?;
    m.add_class::<events::PyKvEvent>()?;
    m.add_class::<linear_state::PyLinearStatePrefixCache>()?;
    m.add_class::<linear_state::PyLinearStatePlan>()?;
    m.add_class::<window::PySlidingWindowBlockManager>()?;
    m.add_class::<window::PyCompositeBlockManager>()?;
    m.add_class::<hierarchy::PyHierarchyBlockManagerPool>()?;
    m.add_class::<hierarchy::PyTransferPlan>()?;
    m.add_class::<index::PyKVIndex>()?;
    m.add_function(wrap_pyfunction!(index::encode_events, m)?)?;
    m.add_function(wrap_pyfunction!(index::decode_events, m)?)?;
    m.add_class::<xtensor::PyXTensorBlockManager>()?;
    Ok(())
}
