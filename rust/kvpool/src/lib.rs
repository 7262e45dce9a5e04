//! kvpool core: the scheduler-side KV-cache block manager of an LLM serving engine.
//!
//! Pure Rust (no Python). Bottom up: free lists and `Block` handles whose last drop returns the
//! id (`free_list`, `block`); chained block hashes (`hash`); the hash-keyed prefix cache with
//! prefix-closed LRU eviction (`prefix_cache`); the physical managers (`manager`,
//! `concurrent_manager`, `sliding_window`, `linear_state`, `composite`); a request's tokens and
//! allocation (`sequence`); the block groups of a rank behind one interface (`groups`); the tiers
//! below the device (`tiers`); and the sequence-level pool that coordinates them (`pool`).
//!
//! Modules are private; the items below are the crate's API, each with one path. The rules cited
//! as "R<n>" are those of the project's contract (docs/contract.md).
#![warn(missing_docs, unreachable_pub)]

mod alloc;
mod block;
mod bulk_arc;
mod chain;
mod composite;
mod concurrent_manager;
mod counters;
mod error;
mod free_list;
mod groups;
mod hash;
mod index;
mod linear_state;
mod manager;
mod pool;
mod prefetch;
mod prefix_cache;
mod release;
mod sequence;
mod sliding_window;
mod sync;
mod tiers;
mod xtensor;

pub use block::Block;
pub use composite::{CompositeBlockManager, GroupManager, GroupSpec, GroupTables};
pub use concurrent_manager::ConcurrentBlockManager;
pub use error::{KvPoolError, Result};
pub use hash::{BlockHash, BlockHasher, DEFAULT_HASH_SEED};
pub use index::wire::{decode_batch as decode_index_events, encode_batch as encode_index_events};
pub use index::{
    ApplyReport, EventKind, Gap, GroupKind, IndexConfig, IndexCounters, IndexEvent, IndexStats,
    KVIndex, LocationKey, Match, Matches, Medium, Row, Snapshot, SourceState, MAX_GROUPS,
    MAX_WRITERS,
};
pub use linear_state::{LinearStatePrefixCache, LinearStateStats};
pub use manager::{
    BlockCounts, BlockManager, BlockManagerImpl, ManagerConfig, SingleBlockManager, MAX_BLOCKS,
};
pub use pool::{
    AllocationPlan, BlockManagerPool, DebugCounters, HierarchyBlockManagerPool, HierarchyConfig,
    HierarchyStats, KvCacheManager, KvEvent, KvEventKind, LinearStateMatch, LinearStatePlan,
    LinearStateSave, Miss, MissReason, PageBackendKind, PoolConfig, PoolStats, RankMemory,
    RankStats, TableExtent, XTensorOptions, XTensorRankStats, DEFAULT_EVENT_REPLAY,
    DEFAULT_RETENTION_TOKENS,
};
pub use prefix_cache::{
    CacheEvent, CacheStats, Eviction, ExtraKey, PrefixCache, Probe, DEFAULT_PROTECTED_PERCENT,
};
pub use sequence::Sequence;
pub use sliding_window::{SlidingWindowBlockManager, WindowTable};
pub use tiers::{
    HostStats, HostTierConfig, OffloadPolicy, RemoteHits, RemoteQuery, TransferDirection,
    TransferPlan,
};
#[cfg(unix)]
pub use xtensor::HostPageBackend;
pub use xtensor::{
    AccountingBackend, MemoryLimitReport, PageBackend, PageError, PageStats, XTensorBlockManager,
    XTensorConfig, DEFAULT_PAGE_BYTES, MAX_BLOCKS_PER_PAGE,
};

/// The crate version.
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}
