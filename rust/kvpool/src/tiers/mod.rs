//! Tiers below the device: a host-memory KV tier per rank (R26), and the remote tier behind it.
//!
//! A [`HostTier`] is a component of a pool (`BlockManagerPool` built with a host tier, the
//! public `HierarchyBlockManagerPool`). Each rank has a host [`BlockManagerImpl`] with its own ids
//! (1..host_num_blocks, 0 is padding) and its own prefix cache, same block size and hasher as the
//! device. Data moves in [`TransferPlan`]s (one per rank per direction per take, shaped for one
//! `swap_blocks` call):
//!
//! - **load** (host -> device), attached by an admission whose hit continues past the device
//!   match in the host cache (`host.rs`): the host hits get the fresh device blocks of their
//!   table entries. The pending record holds the chain from block 0 on both tiers (host: the hit;
//!   device: matched blocks plus destinations). `complete_loads` publishes the device chain in the
//!   device cache and marks the sequence's `LoadTicket` done.
//! - **offload** (device -> host), planned by `deallocate`: the sequence's full computed blocks
//!   after the longest prefix already on host (and before the first block already being
//!   offloaded) get host blocks (host LRU may evict; if the host is short, the longest prefix that
//!   fits). `complete_offloads` publishes the host chain in the host cache. Holding whole chains
//!   keeps R15 exact: no held block ever has a cache-only ancestor (R10).
//! - **fetch** (remote -> host, `remote.rs`): remote hits past the device+host reach get device
//!   blocks and fresh host *staging* blocks (never published in the host cache); the record
//!   becomes a load only after `complete_fetches`, truncated to the blocks that really arrived.
//!   The core does no I/O: the fetch plan names the chain hashes (`keys`) and host ids.
//!
//! Only full-attention blocks move between tiers: linear-state checkpoints and window blocks stay
//! on the device, and the pool trims a hit to the boundary every group can serve
//! (docs/host_tier.md).
//!
//! Invariants (checked by [`HostTier::check`], `check.rs`):
//! - the host manager of every rank keeps R1-R12;
//! - every block named by a pending plan (taken or not) is held by that plan's record until
//!   `complete_*`, on both tiers: a plan never names a block that is free or owned by someone else;
//! - the destinations of pending loads are distinct device blocks, those of pending offloads
//!   distinct host blocks that are not cached (published only at completion); host staging
//!   blocks of pending fetches are distinct and never cached;
//! - a pending load's ticket is not done and promises exactly the record's chain;
//! - `offloading` holds exactly the hashes of the blocks in pending offloads, so a block is never
//!   offloaded twice; a plan id is completed at most once, and only by the pool that made it.

mod check;
mod host;
mod plans;
mod remote;
mod stats;

use std::collections::{HashMap, HashSet};

use crate::error::{KvPoolError, Result};
use crate::hash::BlockHasher;
use crate::manager::{BlockManager, BlockManagerImpl, ManagerConfig};

pub(crate) use host::{ChainRef, HostPart};
pub(crate) use plans::{pending_len, Pending, Taken};
pub use plans::{RemoteHits, RemoteQuery, TransferDirection, TransferPlan};
pub use stats::HostStats;

/// When device blocks go to the host tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadPolicy {
    /// At `deallocate`: every full computed block of the sequence not yet on host (xLLM).
    #[default]
    OnDeallocate,
    /// At `deallocate`, but only blocks that this release makes evictable (held by nothing but
    /// the device cache afterwards); a block another sequence still holds goes to host when its
    /// last holder releases it. Nothing is copied for blocks that stay in use.
    OnEvict,
}

impl OffloadPolicy {
    /// Parses "on_deallocate" / "on_evict".
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "on_deallocate" => Ok(Self::OnDeallocate),
            "on_evict" => Ok(Self::OnEvict),
            other => Err(KvPoolError::invalid(
                "offload_policy",
                format!("must be 'on_deallocate' or 'on_evict', got {other:?}"),
            )),
        }
    }

    /// "on_deallocate" or "on_evict".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OnDeallocate => "on_deallocate",
            Self::OnEvict => "on_evict",
        }
    }
}

/// Options of a pool's host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostTierConfig {
    /// Host block ids per rank, padding block included (>= 2).
    pub num_blocks: usize,
    /// When blocks are offloaded.
    pub offload_policy: OffloadPolicy,
}

struct HostRank {
    host: BlockManagerImpl,
    /// Planned, not yet taken.
    loads: Vec<Pending>,
    offloads: Vec<Pending>,
    /// Loads with remote hits, planned, not yet taken.
    fetches: Vec<Pending>,
    /// Hashes of the blocks of every pending offload (taken or not).
    offloading: HashSet<u128>,
    /// Counters (the pending ones are computed by `stats`).
    stats: HostStats,
}

/// The host tier of a pool: one host manager per rank and the pending transfers.
pub(crate) struct HostTier {
    /// The pool this tier belongs to (plans name it).
    pool: u64,
    block_size: usize,
    policy: OffloadPolicy,
    num_blocks: usize,
    ranks: Vec<HostRank>,
    taken: HashMap<u64, Taken>,
    next_plan: u64,
}

fn host_error(error: KvPoolError) -> KvPoolError {
    error.renamed_all("host_num_blocks")
}

impl HostTier {
    /// The host tier of pool `pool` (`dp_size` ranks, same block size and hasher as the device).
    pub(crate) fn new(
        config: HostTierConfig,
        pool: u64,
        dp_size: usize,
        block_size: usize,
        hasher: BlockHasher,
    ) -> Result<Self> {
        let manager = ManagerConfig {
            num_blocks: config.num_blocks,
            block_size,
            enable_prefix_cache: true,
            hasher,
        };
        manager.validate().map_err(host_error)?;
        crate::alloc::probe(dp_size as u128 * manager.footprint(), "host_num_blocks")?;
        let mut ranks = Vec::with_capacity(dp_size);
        for _ in 0..dp_size {
            ranks.push(HostRank {
                host: BlockManagerImpl::new(manager).map_err(host_error)?,
                loads: Vec::new(),
                offloads: Vec::new(),
                fetches: Vec::new(),
                offloading: HashSet::new(),
                stats: HostStats::default(),
            });
        }
        Ok(Self {
            pool,
            block_size,
            policy: config.offload_policy,
            num_blocks: config.num_blocks,
            ranks,
            taken: HashMap::new(),
            next_plan: 0,
        })
    }

    /// Host block ids per rank, padding included.
    pub(crate) fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub(crate) fn policy(&self) -> OffloadPolicy {
        self.policy
    }

    /// The host block manager of `rank`.
    pub(crate) fn manager(&self, rank: usize) -> Option<&BlockManagerImpl> {
        self.ranks.get(rank).map(|h| &h.host)
    }

    /// The host cache of `rank`.
    pub(crate) fn cache(&self, rank: usize) -> Option<&crate::prefix_cache::PrefixCache> {
        self.ranks.get(rank).and_then(|h| h.host.prefix_cache())
    }

    /// The host cache of `rank`, to take its events.
    pub(crate) fn cache_mut(
        &mut self,
        rank: usize,
    ) -> Option<&mut crate::prefix_cache::PrefixCache> {
        self.ranks
            .get_mut(rank)
            .and_then(|h| h.host.prefix_cache_mut())
    }

    /// Whether the host caches record KV events (R21, medium "host").
    pub(crate) fn set_record_events(&mut self, on: bool) {
        for rank in &mut self.ranks {
            if let Some(cache) = rank.host.prefix_cache_mut() {
                cache.set_record_events(on);
            }
        }
    }

    /// Whether the host caches keep graves of their anchored entries (`prefix_cache/graves.rs`).
    pub(crate) fn keep_graves(&mut self, on: bool) {
        for rank in &mut self.ranks {
            if let Some(cache) = rank.host.prefix_cache_mut() {
                cache.keep_graves(on);
            }
        }
    }

    /// Chain walks of the host caches (a debug counter).
    pub(crate) fn num_walks(&self) -> u64 {
        self.ranks
            .iter()
            .filter_map(|r| r.host.prefix_cache())
            .map(|c| c.num_walks())
            .sum()
    }

    /// Puts the host blocks whose last outside handle went onto the host LRU.
    fn drain(&mut self, rank: usize) {
        if let Some(cache) = self.ranks[rank].host.prefix_cache_mut() {
            cache.drain_released();
        }
    }

    /// Drops every cached host entry (R12, R26); pinned blocks stay with their records.
    pub(crate) fn reset(&mut self) {
        for rank in &mut self.ranks {
            rank.host.reset_prefix_cache();
        }
    }

    /// Counters per rank (pending counts included).
    pub(crate) fn stats(&self) -> Vec<HostStats> {
        let n = self.ranks.len();
        let mut pending = vec![[0usize; 3]; n];
        let slot = |d: TransferDirection| match d {
            TransferDirection::Load => 0,
            TransferDirection::Offload => 1,
            TransferDirection::Fetch => 2,
        };
        for taken in self.taken.values() {
            pending[taken.rank][slot(taken.direction)] +=
                pending_len(&taken.records, taken.direction);
        }
        self.ranks
            .iter()
            .zip(pending)
            .map(|(rank, [loads, offloads, fetches])| {
                let mut s = rank.stats;
                s.counts = rank.host.counts();
                s.evictions = rank.host.prefix_cache().map_or(0, |c| c.stats().evictions);
                s.pending_load_blocks = loads + pending_len(&rank.loads, TransferDirection::Load);
                s.pending_offload_blocks =
                    offloads + pending_len(&rank.offloads, TransferDirection::Offload);
                s.pending_fetch_blocks =
                    fetches + pending_len(&rank.fetches, TransferDirection::Fetch);
                s
            })
            .collect()
    }
}
