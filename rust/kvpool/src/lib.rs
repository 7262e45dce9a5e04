//! kvpool core: the scheduler-side KV-cache block manager of an LLM serving engine.
//!
//! Pure Rust (no Python): free lists, `Block` handles whose last drop returns the id, a
//! hash-keyed prefix cache with prefix-closed LRU eviction, and the sequence-level pool. The
//! rules cited as "R<n>" are those of the project's DESIGN.md.

mod alloc;
pub mod block;
pub mod composite;
pub mod concurrent_manager;
pub mod error;
pub mod free_list;
pub mod hash;
pub mod hierarchy;
pub mod index;
pub mod linear_state;
pub mod manager;
pub mod pool;
pub mod prefix_cache;
pub mod sequence;
pub mod sliding_window;
mod sync;
pub mod xtensor;

pub use block::Block;
pub use composite::{CompositeBlockManager, GroupManager, GroupSpec, GroupTables};
pub use concurrent_manager::ConcurrentBlockManager;
pub use error::{KvPoolError, Result};
pub use free_list::FreeList;
pub use hash::{BlockHash, BlockHasher, DEFAULT_HASH_SEED};
pub use hierarchy::{
    HierarchyBlockManagerPool, HierarchyConfig, HierarchyStats, HostStats, OffloadPolicy,
    RemoteHits, RemoteQuery, TransferDirection, TransferPlan,
};
pub use index::{
    ApplyReport, EventKind, GroupKind, IndexConfig, IndexEvent, IndexStats, KVIndex, Match, Medium,
};
pub use linear_state::{LinearStatePrefixCache, LinearStateStats};
pub use manager::{
    BlockCounts, BlockManager, BlockManagerImpl, ManagerConfig, SingleBlockManager, MAX_BLOCKS,
};
pub use prefix_cache::{CacheEvent, CacheStats, ExtraKey, PrefixCache, Probe};
pub use sliding_window::{SlidingWindowBlockManager, WindowTable};
pub use xtensor::{
    AccountingBackend, MemoryLimitReport, PageBackend, PageError, PageStats, XTensorBlockManager,
    XTensorConfig,
};

/// The crate version.
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}
pub use pool::{
    BlockManagerPool, KvCacheManager, KvEvent, KvEventKind, LinearStateMatch, LinearStatePlan,
    LinearStateSave, PoolConfig, PoolStats, RankStats,
};
pub use sequence::Sequence;
