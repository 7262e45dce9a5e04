//! The links of a pool's checkpoints (R7, `crate::chain`): the link and last block each pool
//! save records, the tickets that stand in for a link not known yet, and the evictions that
//! make way for a save under a hash whose checkpoint is linked elsewhere.
//!
//! Invariants (checked by `check.rs`): only pending and committed slots carry a link or a
//! last block; a checkpoint made through the cache's own API carries neither (link 0).

use crate::hash::BlockHash;
use crate::prefix_cache::{Anchor, ExtraKey};

use super::LinearStatePrefixCache;

/// The last block of a checkpoint a pool saved: its tokens, and for a chain's first block the
/// chain's extra key (its link is then the root, `crate::chain`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Tail {
    pub(crate) tokens: Box<[u32]>,
    pub(crate) root_key: Option<ExtraKey>,
}

impl LinearStatePrefixCache {
    /// The link and last block of the committed checkpoint of `prefix_hash` (link 0: matched
    /// by the hash alone), `None` if there is none.
    pub(crate) fn committed_link(&self, prefix_hash: BlockHash) -> Option<(Anchor, &Tail)> {
        self.peek(prefix_hash)
            .map(|slot| (self.anchors[slot as usize], &self.tails[slot as usize]))
    }

    /// The anchor of the pending or committed checkpoint of `prefix_hash`, if any.
    pub(crate) fn anchor_of(&self, prefix_hash: BlockHash) -> Option<Anchor> {
        self.index
            .get(&prefix_hash.0)
            .map(|&slot| self.anchors[slot as usize])
    }

    /// Gives the checkpoint of `prefix_hash` that carries `ticket` its real anchor; false if
    /// that checkpoint is gone (cancelled, evicted, replaced).
    pub(crate) fn resolve_anchor(
        &mut self,
        prefix_hash: BlockHash,
        ticket: Anchor,
        anchor: Anchor,
    ) -> bool {
        match self.index.get(&prefix_hash.0) {
            Some(&slot) if self.anchors[slot as usize] == ticket => {
                self.anchors[slot as usize] = anchor;
                true
            }
            _ => false,
        }
    }

    /// Whether the checkpoint of `prefix_hash` still carries `ticket`.
    pub(crate) fn has_ticket(&self, prefix_hash: BlockHash, ticket: Anchor) -> bool {
        self.anchor_of(prefix_hash) == Some(ticket)
    }

    /// Evicts the committed checkpoint of `prefix_hash` that still carries `ticket` (it can never
    /// be matched), unless pinned; returns whether it did.
    pub(crate) fn evict_ticket(&mut self, prefix_hash: BlockHash, ticket: Anchor) -> bool {
        self.has_ticket(prefix_hash, ticket) && self.evict_hash(prefix_hash)
    }

    /// Evicts the committed checkpoint of `prefix_hash` if nothing pins it (it names another
    /// prefix than the one about to be saved under that hash); returns whether it did.
    pub(crate) fn evict_hash(&mut self, prefix_hash: BlockHash) -> bool {
        match self.peek(prefix_hash) {
            Some(slot) if self.pins[slot as usize] == 0 => {
                self.evict_slot(slot);
                true
            }
            _ => false,
        }
    }
}
