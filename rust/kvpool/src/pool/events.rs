//! KV events for external KV-aware routers (R21): the device caches' events of every rank,
//! collected in the pool's list after each mutation that can make them.

use crate::hash::BlockHash;
use crate::prefix_cache::{CacheEvent, ExtraKey};

use super::BlockManagerPool;

/// Kind of a [`KvEvent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEventKind {
    /// Blocks became matchable.
    Stored,
    /// Blocks left the cache.
    Removed,
    /// The cache was reset.
    Cleared,
}

impl KvEventKind {
    /// "stored", "removed" or "cleared".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::Removed => "removed",
            Self::Cleared => "cleared",
        }
    }
}

/// A KV event for external KV-aware routers (R21).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    /// What happened.
    pub kind: KvEventKind,
    /// The chain hashes of the blocks (R6).
    pub block_hashes: Vec<BlockHash>,
    /// Hash of the parent of the first block; `None` for a chain's first block.
    pub parent_hash: Option<BlockHash>,
    /// Tokens of the stored blocks (empty otherwise).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// The rank whose cache it happened in.
    pub dp_rank: usize,
    /// The chain's extra key.
    pub extra_key: Option<ExtraKey>,
}

impl KvEvent {
    fn new(kind: KvEventKind, block_size: usize, dp_rank: usize) -> Self {
        Self {
            kind,
            block_hashes: Vec::new(),
            parent_hash: None,
            token_ids: Vec::new(),
            block_size,
            dp_rank,
            extra_key: None,
        }
    }
}

impl BlockManagerPool {
    /// Moves the events of `rank`'s device cache into the pool's list (R21).
    pub(crate) fn collect_events(&mut self, rank: usize) {
        let Some(events) = self.events.as_mut() else {
            return;
        };
        let block_size = self.config.block_size;
        let Some(cache) = self.ranks[rank].full.cache_mut() else {
            return;
        };
        for event in cache.take_events() {
            events.push(match event {
                CacheEvent::Stored {
                    block_hashes,
                    parent_hash,
                    token_ids,
                    extra_key,
                } => KvEvent {
                    block_hashes,
                    parent_hash,
                    token_ids,
                    extra_key,
                    ..KvEvent::new(KvEventKind::Stored, block_size, rank)
                },
                CacheEvent::Removed {
                    block_hashes,
                    extra_key,
                } => KvEvent {
                    block_hashes,
                    extra_key,
                    ..KvEvent::new(KvEventKind::Removed, block_size, rank)
                },
                CacheEvent::Cleared => KvEvent::new(KvEventKind::Cleared, block_size, rank),
            });
        }
    }

    /// Takes the recorded KV events (R21); empty unless `enable_events`.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }
}
