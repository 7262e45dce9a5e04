//! Statistics of a pool (R20): per rank, from one field list ([`RankStats`]).

use crate::counters::counters;
use crate::groups::GroupCounters;
use crate::manager::{BlockCounts, BlockManager};

use super::elastic::XTensorRankStats;
use super::BlockManagerPool;
use super::MissReason;

counters! {
    /// Statistics of one rank (R20). Section `rank` is the rank's dict, `window` the window
    /// group's dict (with its block counts, `window`).
    pub struct RankStats {
        + /// Block counts of the sliding-window group (R25), when there is one.
        window: Option<BlockCounts>;
        + /// Mapped memory, when the pool is on elastic pages (`xtensor`).
        xtensor: Option<XTensorRankStats>;
        rank {
            /// Tokens of the full blocks successful allocations looked up.
            prefix_query_tokens: u64 => "prefix_query_tokens",
            /// Tokens of those they got from the device cache.
            prefix_hit_tokens: u64 => "prefix_hit_tokens",
            /// Device blocks evicted.
            num_evictions: u64 => "num_evictions",
            /// Free single blocks.
            num_free_single_blocks: usize => "num_free_single_blocks",
            /// Live recurrent-state slots (R22).
            num_live_slots: usize => "num_live_slots",
            /// Pending checkpoints.
            num_pending_checkpoints: usize => "num_pending_checkpoints",
            /// Committed checkpoints.
            num_committed_checkpoints: usize => "num_committed_checkpoints",
            /// Free recurrent-state slots (R22).
            num_free_linear_state_slots: usize => "num_free_linear_state_slots",
            /// Allocations whose state is restored from a checkpoint (R23).
            linear_state_hits: u64 => "linear_state_hits",
            /// Committed checkpoints evicted.
            num_checkpoint_evictions: u64 => "num_checkpoint_evictions",
            /// Checkpoints committed.
            num_checkpoint_commits: u64 => "num_checkpoint_commits",
            /// Blocks of the store held for recurrent states (linear state in the one store).
            num_linear_state_blocks: usize => "num_linear_state_blocks",
        }
        memory {
            /// Bytes of the store's free blocks (0 unless the pool knows `block_bytes`).
            free_bytes: u64 => "free_bytes",
            /// Bytes of its cached (evictable) KV blocks.
            cached_bytes: u64 => "cached_bytes",
            /// Bytes of its KV blocks in use (every group's, the states' excluded).
            kv_bytes: u64 => "kv_bytes",
            /// Bytes of its blocks held for recurrent states (linear state in the one store).
            state_bytes: u64 => "state_bytes",
        }
        window {
            /// Window blocks released behind the window.
            num_window_releases: u64 => "num_releases",
        }
        misses {
            /// Admissions of a prompt without a full block to look up (full attention).
            miss_shorter_than_block: u64 => "shorter_than_block",
            /// Admissions whose chain the cache never held past the hit (full attention).
            miss_no_shared_prefix: u64 => "no_shared_prefix",
            /// Admissions whose next block was evicted (full attention).
            miss_evicted: u64 => "evicted",
            /// Admissions a sliding-window group cut: its run was gone (R25).
            miss_window_blocks_gone: u64 => "window_blocks_gone",
            /// Admissions the linear-state group cut: no checkpoint at the boundary (R23).
            miss_no_checkpoint: u64 => "no_checkpoint",
        }
    }
}

impl RankStats {
    fn add(&mut self, other: &RankStats) {
        self.add_counters(other);
        if let Some(w) = &other.window {
            self.window.get_or_insert_with(BlockCounts::default).add(w);
        }
        if let Some(x) = &other.xtensor {
            self.xtensor
                .get_or_insert_with(XTensorRankStats::default)
                .add(x);
        }
    }
}

/// Statistics of a pool: totals and one entry per rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolStats {
    /// Sums over the ranks.
    pub total: RankStats,
    /// One entry per rank.
    pub ranks: Vec<RankStats>,
}

impl BlockManagerPool {
    /// Statistics (R20).
    pub fn stats(&self) -> PoolStats {
        let mut stats = PoolStats::default();
        for rank in &self.ranks {
            let cache = rank.full.cache().map(|c| c.stats()).unwrap_or_default();
            let mut g = GroupCounters::default();
            for group in &rank.groups {
                group.count(&mut g);
            }
            let r = RankStats {
                counts: rank.full.counts(),
                prefix_query_tokens: rank.query_tokens,
                prefix_hit_tokens: rank.hit_tokens,
                num_evictions: cache.evictions,
                num_free_single_blocks: rank.single.counts().free,
                num_live_slots: g.live_slots,
                num_pending_checkpoints: g.pending_checkpoints,
                num_committed_checkpoints: g.committed_checkpoints,
                num_free_linear_state_slots: g.free_slots,
                linear_state_hits: g.linear_hits,
                num_checkpoint_evictions: g.checkpoint_evictions,
                num_checkpoint_commits: g.checkpoint_commits,
                num_window_releases: g.window_releases,
                num_linear_state_blocks: g.state_blocks,
                miss_shorter_than_block: rank.misses[MissReason::ShorterThanBlock.index()],
                miss_no_shared_prefix: rank.misses[MissReason::NoSharedPrefix.index()],
                miss_evicted: rank.misses[MissReason::Evicted.index()],
                miss_window_blocks_gone: rank.misses[MissReason::WindowBlocksGone.index()],
                miss_no_checkpoint: rank.misses[MissReason::NoCheckpoint.index()],
                window: g.window,
                xtensor: rank.full.elastic_manager().map(XTensorRankStats::of),
                ..RankStats::default()
            };
            let counts = r.counts;
            let bytes = |blocks: usize| blocks as u64 * self.config.block_bytes;
            let r = RankStats {
                free_bytes: bytes(counts.free),
                cached_bytes: bytes(counts.cached),
                kv_bytes: bytes(counts.used - g.state_blocks),
                state_bytes: bytes(g.state_blocks),
                ..r
            };
            stats.total.add(&r);
            stats.ranks.push(r);
        }
        stats
    }
}

/// A rank's memory per group (docs/hybrid.md "One block store"): what [`BlockManagerPool::memory`]
/// returns per rank. Blocks of the full-attention group's store, counted by the group each was
/// handed out to; a group with a store of its own (a sliding window sized by `swa_num_blocks`)
/// and the linear-state slots are counted in their own units.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankMemory {
    /// Ids of the full-attention group's store (padding excluded).
    pub num_blocks: usize,
    /// Free ids of that store.
    pub free_blocks: usize,
    /// Per group of that store (full attention first, then the groups sharing it, in table
    /// order): (group position, cached blocks, used blocks).
    pub shared: Vec<(usize, usize, usize)>,
    /// A sliding-window group with its own store: (group position, its counts).
    pub own_window: Option<(usize, BlockCounts)>,
    /// The linear-state group: (group position, slots in use: live, pending and committed;
    /// slots in all, padding excluded).
    pub linear_slots: Option<(usize, usize, usize)>,
    /// Bytes of one block of the store (the pool's `block_bytes`; 0: unknown).
    pub block_bytes: u64,
}

impl BlockManagerPool {
    /// The memory of every rank per group (O(blocks): a census of the store, not for every
    /// step; `stats()` has the totals).
    pub fn memory(&self) -> Vec<RankMemory> {
        self.ranks
            .iter()
            .map(|rank| {
                let owners = 1 + rank.groups.len();
                let (free, per_group) = rank.full.census(owners);
                let mut memory = RankMemory {
                    num_blocks: rank.full.counts().total,
                    free_blocks: free,
                    block_bytes: self.config.block_bytes,
                    ..RankMemory::default()
                };
                memory.shared.push((0, per_group[0][0], per_group[0][1]));
                for (i, group) in rank.groups.iter().enumerate() {
                    let position = i + 1;
                    if group.as_shared_window().is_some() {
                        let [cached, used] = per_group[position];
                        memory.shared.push((position, cached, used));
                    } else if let Some(window) = group.as_window() {
                        memory.own_window = Some((position, window.counts()));
                    } else if let Some(linear) = group.as_linear() {
                        if linear.blocks_per_state() > 0 {
                            let [cached, used] = per_group[position];
                            memory.shared.push((position, cached, used));
                        }
                        let cache = linear.cache();
                        let total = cache.num_slots().saturating_sub(1);
                        let in_use = total - cache.num_free_slots();
                        memory.linear_slots = Some((position, in_use, total));
                    }
                }
                memory
            })
            .collect()
    }
}
