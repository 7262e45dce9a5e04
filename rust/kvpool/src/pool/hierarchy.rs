//! `HierarchyBlockManagerPool`: the public name of a [`BlockManagerPool`] built with a host tier
//! (R26, xLLM's `HierarchyBlockManagerPool`, which extends `BlockManagerPool`).
//!
//! It is the pool itself: it dereferences to the [`BlockManagerPool`] it wraps, so every method
//! of the pool (the batch calls, linear state, sliding windows, events, plans) is its method,
//! and adds only what is its own: a constructor from a [`HierarchyConfig`] and statistics of both
//! tiers ([`HierarchyStats`]).

use std::ops::{Deref, DerefMut};

use crate::error::Result;
use crate::sequence::Sequence;
use crate::tiers::{HostStats, HostTierConfig, OffloadPolicy};

use super::{BlockManagerPool, KvCacheManager, PoolConfig, PoolStats};

/// Options of a [`HierarchyBlockManagerPool`].
#[derive(Clone, Copy, Debug)]
pub struct HierarchyConfig {
    /// The device pool.
    pub pool: PoolConfig,
    /// Host block ids per rank, padding block included (>= 2).
    pub host_num_blocks: usize,
    /// When blocks are offloaded.
    pub offload_policy: OffloadPolicy,
}

impl HierarchyConfig {
    /// Defaults of the host tier (R26, docs/host_tier.md).
    pub fn new(num_blocks: usize, host_num_blocks: usize, block_size: usize) -> Self {
        Self {
            pool: PoolConfig::new(num_blocks, block_size),
            host_num_blocks,
            offload_policy: OffloadPolicy::default(),
        }
    }

    /// The pool's options with this host tier.
    pub fn pool_config(&self) -> PoolConfig {
        PoolConfig {
            host: Some(HostTierConfig {
                num_blocks: self.host_num_blocks,
                offload_policy: self.offload_policy,
            }),
            ..self.pool
        }
    }
}

/// Statistics of a hierarchy pool: the device pool's and the host tier's (totals and per rank).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HierarchyStats {
    /// Device tier (R20).
    pub device: PoolStats,
    /// Host tier, summed over ranks.
    pub host: HostStats,
    /// Host tier per rank.
    pub host_ranks: Vec<HostStats>,
}

/// A [`BlockManagerPool`] with a host-memory KV tier per rank (R26).
pub struct HierarchyBlockManagerPool {
    pool: BlockManagerPool,
}

impl HierarchyBlockManagerPool {
    /// A pool with a host tier per `config`.
    pub fn new(config: HierarchyConfig) -> Result<Self> {
        Ok(Self {
            pool: BlockManagerPool::new(config.pool_config())?,
        })
    }

    /// The pool (its device tier's structures are the pool's).
    pub fn device(&self) -> &BlockManagerPool {
        &self.pool
    }

    /// Tokens per block (both tiers).
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Statistics of both tiers.
    pub fn stats(&self) -> HierarchyStats {
        let host_ranks = self.pool.host_stats().unwrap_or_default();
        let mut host = HostStats::default();
        for r in &host_ranks {
            host.add(r);
        }
        HierarchyStats {
            device: self.pool.stats(),
            host,
            host_ranks,
        }
    }
}

impl Deref for HierarchyBlockManagerPool {
    type Target = BlockManagerPool;

    fn deref(&self) -> &BlockManagerPool {
        &self.pool
    }
}

impl DerefMut for HierarchyBlockManagerPool {
    fn deref_mut(&mut self) -> &mut BlockManagerPool {
        &mut self.pool
    }
}

impl KvCacheManager for HierarchyBlockManagerPool {
    fn can_allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool> {
        self.pool.can_allocate(seq, num_tokens)
    }
    fn allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool> {
        self.pool.allocate(seq, num_tokens)
    }
    fn allocate_shared(&mut self, seq: &mut Sequence) -> Result<bool> {
        self.pool.allocate_shared(seq)
    }
    fn can_append(&self, seq: &Sequence, lookahead: usize) -> Result<bool> {
        self.pool.can_append(seq, lookahead)
    }
    fn may_append(&mut self, seq: &mut Sequence, lookahead: usize) -> Result<bool> {
        self.pool.may_append(seq, lookahead)
    }
    fn cache(&mut self, seq: &mut Sequence) -> Result<()> {
        self.pool.cache(seq)
    }
    fn deallocate(&mut self, seq: &mut Sequence) -> Result<()> {
        self.pool.deallocate(seq)
    }
}
