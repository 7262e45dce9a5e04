//! [`lock_pool`]: how a thread holding the GIL takes a pool's lock. A page backend object (the
//! pool's `xtensor` option) runs under the pool's lock and needs the GIL, so nobody may wait for
//! that lock while holding the GIL: the wait is made without it.

use kvpool::BlockManagerPool;
use parking_lot::{Mutex, MutexGuard};
use pyo3::prelude::*;

use crate::xtensor::in_backend;

/// Locks `pool` from a thread that holds the GIL, waiting for it without the GIL (a page backend
/// object running under the lock on another thread needs the GIL to finish). A page backend
/// calling its own pool is a `RuntimeError`.
pub(crate) fn lock_pool<'a>(
    py: Python<'_>,
    pool: &'a Mutex<BlockManagerPool>,
) -> PyResult<MutexGuard<'a, BlockManagerPool>> {
    if in_backend() {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(
            "BlockManagerPool: a page backend must not call its pool",
        ));
    }
    loop {
        if let Some(guard) = pool.try_lock() {
            return Ok(guard);
        }
        py.detach(|| drop(pool.lock())); // wait without the GIL, then take it with the GIL
    }
}
