//! What the cache knows of one cached block, for the KV events of tiers that do not keep a
//! cache of their own (the remote tier's stores and removals, recorded by the pool).
//!
//! Read-only: nothing here changes the cache.

use crate::hash::BlockHash;

use super::{ExtraKey, PrefixCache, NIL};

/// A cached block as a KV event describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CachedBlock {
    /// Hash of its parent; `None` for a chain's first block.
    pub(crate) parent_hash: Option<BlockHash>,
    /// Its tokens.
    pub(crate) token_ids: Vec<u32>,
    /// Its chain's extra key.
    pub(crate) extra_key: Option<ExtraKey>,
}

impl PrefixCache {
    /// The parent, tokens and chain extra key of cached block `hash`, or `None` if it is not
    /// cached.
    pub(crate) fn describe(&self, hash: BlockHash) -> Option<CachedBlock> {
        let id = self.block_id(hash)?;
        let entry = &self.entries[id as usize];
        let parent_hash = (entry.parent != NIL).then(|| self.entries[entry.parent as usize].hash);
        Some(CachedBlock {
            parent_hash,
            token_ids: self.block_tokens(id).to_vec(),
            extra_key: entry.extra_key.clone(),
        })
    }
}
