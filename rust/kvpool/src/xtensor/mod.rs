//! Elastic KV memory on virtual-memory pages: xLLM's `XTensorBlockManagerImpl`, with the
//! prefix cache on top.
//!
//! - [`pages`]: the free ids grouped by page, fullest page first (O(1) allocation and free);
//! - [`manager`]: [`XTensorBlockManager`], the `BlockManager` that maps pages as blocks are
//!   handed out and unmaps them as they empty, under a memory limit changeable at run time;
//! - [`reclaim`]: page-aware eviction, so memory comes back in whole pages;
//! - [`backend`]: the [`PageBackend`] trait and the accounting-only backend; [`host`]: pages of
//!   one reserved anonymous mapping, so the process's resident memory follows the load.
//!   (A CUDA backend lives in Python, `kvpool.xtensor`, plugged in through the bindings.)
//!
//! docs/xtensor.md describes the policy, the backends and the accounting.

pub(crate) mod backend;
mod buckets;
pub(crate) mod config;
#[cfg(unix)]
pub(crate) mod host;
pub(crate) mod manager;
pub(crate) mod pages;
pub(crate) mod reclaim;

pub use backend::{AccountingBackend, PageBackend, PageError};
pub use config::{
    MemoryLimitReport, PageStats, XTensorConfig, DEFAULT_PAGE_BYTES, MAX_BLOCKS_PER_PAGE,
};
#[cfg(unix)]
pub use host::HostPageBackend;
pub use manager::XTensorBlockManager;
