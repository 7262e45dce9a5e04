//! Python bindings of the kvpool core (`kvpool._core`): thin wrappers that validate, make one
//! core call and map the error. Every class is frozen with a lock inside (R28).

mod batch;
mod concurrent;
mod convert;
mod errors;
mod hierarchy; // host tier (R26)
mod hybrid;
mod index; // prefix index over KV events (issue "Beyond one instance")
mod manager;
mod pool;
mod xtensor; // elastic pages (issue 17)

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
    m.add_class::<manager::PyBlock>()?;
    m.add_class::<manager::PyBlockManager>()?;
    m.add_class::<concurrent::PyConcurrentBlockManager>()?;
    m.add_class::<manager::PySingleBlockManager>()?;
    m.add_class::<manager::PyPrefixCache>()?;
    m.add_function(wrap_pyfunction!(manager::hash_blocks, m)?)?;
    m.add_class::<pool::PySequence>()?;
    m.add_class::<pool::PyBlockManagerPool>()?;
    m.add_class::<batch::PySequenceBatch>()?;
    m.add_class::<pool::PyKvEvent>()?;
    m.add_class::<hybrid::PyLinearStatePrefixCache>()?;
    m.add_class::<hybrid::PyLinearStatePlan>()?;
    m.add_class::<hybrid::PySlidingWindowBlockManager>()?;
    m.add_class::<hybrid::PyCompositeBlockManager>()?;
    m.add_class::<hierarchy::PyHierarchyBlockManagerPool>()?; // host tier (R26)
    m.add_class::<hierarchy::PyTransferPlan>()?; // host tier (R26)
    m.add_class::<index::PyKVIndex>()?;
    m.add_function(wrap_pyfunction!(index::encode_events, m)?)?;
    m.add_function(wrap_pyfunction!(index::decode_events, m)?)?;
    m.add_class::<xtensor::PyXTensorBlockManager>()?; // elastic pages (issue 17)
    Ok(())
}
