//! Statistics of a pool (R20): per rank, from one field list ([`RankStats`]).

use crate::counters::counters;
use crate::groups::GroupCounters;
use crate::manager::{BlockCounts, BlockManager};

use super::elastic::XTensorRankStats;
use super::BlockManagerPool;

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
        }
        window {
            /// Window blocks released behind the window.
            num_window_releases: u64 => "num_releases",
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
                window: g.window,
                xtensor: rank.full.elastic_manager().map(XTensorRankStats::of),
            };
            stats.total.add(&r);
            stats.ranks.push(r);
        }
        stats
    }
}
