//! Counters of a host tier (and the remote tier behind it), per rank.

use crate::counters::counters;

counters! {
    /// Counters of one rank's host tier. Section `host` is the host dict of `stats()`, section
    /// `remote` the core's part of its `remote` dict.
    pub struct HostStats {
        host {
            /// Tokens of full blocks looked up in the host cache (past the device hit).
            query_tokens: u64 => "prefix_query_tokens",
            /// Tokens of those that hit (and were planned for loading).
            hit_tokens: u64 => "prefix_hit_tokens",
            /// Host blocks evicted from the host cache.
            evictions: u64 => "num_evictions",
            /// Blocks whose load was confirmed.
            loaded_blocks: u64 => "num_loaded_blocks",
            /// Blocks whose offload was confirmed.
            offloaded_blocks: u64 => "num_offloaded_blocks",
            /// Blocks in loads planned but not confirmed.
            pending_load_blocks: usize => "num_pending_load_blocks",
            /// Blocks in offloads planned but not confirmed.
            pending_offload_blocks: usize => "num_pending_offload_blocks",
        }
        remote {
            /// Blocks planned for fetching (remote hits past the device+host reach).
            remote_hit_blocks: u64 => "hit_blocks",
            /// Blocks whose fetch was confirmed (arrived and verified).
            fetched_blocks: u64 => "fetched_blocks",
            /// Blocks whose fetch failed (the sequence recomputes them).
            failed_fetch_blocks: u64 => "failed_fetch_blocks",
            /// Blocks in fetches planned but not confirmed.
            pending_fetch_blocks: usize => "pending_fetch_blocks",
        }
    }
}

impl HostStats {
    /// Adds `other` (totals over ranks).
    pub fn add(&mut self, other: &HostStats) {
        self.add_counters(other);
    }
}
