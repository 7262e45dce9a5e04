//! The physical-level calls every `BlockManager` with a prefix cache makes the same way
//! (`allocate_shared` and `cache` of R7 and R9, first writer wins), so the plain and the elastic
//! managers share them.

use super::{ExtraKey, PrefixCache};
use crate::block::Block;

impl PrefixCache {
    /// Handles of the longest cached prefix of `tokens` (R7), counted as one query.
    pub(crate) fn share_prefix(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        extra_key: Option<&[u8]>,
    ) -> Vec<Block> {
        let hashes = self.hasher().chain(tokens, block_size, extra_key);
        let mut out = Vec::with_capacity(hashes.len());
        let hit = self.match_prefix(&hashes, tokens, extra_key, hashes.len(), &mut out);
        self.record_query(hashes.len(), hit);
        out
    }

    /// Publishes the full blocks of `tokens` held in `blocks` (R9, first writer wins); returns
    /// how many were inserted.
    pub(crate) fn publish_tokens(
        &mut self,
        tokens: &[u32],
        blocks: &[Block],
        block_size: usize,
        extra_key: Option<&[u8]>,
    ) -> usize {
        let full = (tokens.len() / block_size).min(blocks.len());
        let hashes = self
            .hasher()
            .chain(&tokens[..full * block_size], block_size, extra_key);
        let key: Option<ExtraKey> = extra_key.map(ExtraKey::from);
        self.insert(&hashes, tokens, blocks, 0, key.as_ref(), false)
            .0
    }
}
