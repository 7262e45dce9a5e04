//! Switch between `std` and `loom` synchronisation types.
//!
//! Build with `RUSTFLAGS="--cfg kvpool_loom"` to run the loom models in `tests/loom.rs`: every
//! atomic of the lock-free paths (free list, reference counts) then comes from loom, which
//! explores their interleavings. Nothing else in the crate names `std::sync::atomic` directly.

#[cfg(kvpool_loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(kvpool_loom)]
pub(crate) use loom::sync::Arc;

#[cfg(not(kvpool_loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(kvpool_loom))]
pub(crate) use std::sync::Arc;
