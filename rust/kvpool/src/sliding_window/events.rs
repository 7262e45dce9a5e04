//! KV events of a sliding-window group (R21, docs/events.md): a "stored"
//! event when the group publishes blocks (they become findable by a prefix hit), a "removed"
//! event once such a block is no longer findable.
//!
//! A published window block stops being findable when its last handle drops, which happens
//! lock-free on whatever thread drops a sequence (R27), where the manager does not see it; or
//! when the manager itself lets it go (a kept tail evicted, the index pruned). Rather than
//! adding work to the drop path every block of every pool shares, the group remembers what it
//! announced (`announced`: hash -> the id that holds it) and finds the blocks that left by
//! asking each announced id whether it is still findable ([`WindowEvents::sweep`], when the
//! pool takes its events). A block's state word is read with Acquire (`BlockStore::state`),
//! so a drop that happened before the sweep is seen; one racing it is seen by the next sweep.
//!
//! Invariants (checked by [`WindowEvents::check`] against the manager's index):
//! - every findable published block (held, published under its hash, the index's entry for
//!   that hash) is announced under that hash with that id, so a consumer of the events holds
//!   at least what the group can hit, and after a sweep exactly that;
//! - per hash, events alternate: "stored", then "removed", then "stored" again; a hash is
//!   re-announced (a new block published under it) only after its removal is queued, so a
//!   removal never precedes its store and never cancels a later one;
//! - events are queued in the order they happened, consecutive published blocks of one chain
//!   in one "stored" event whose parent is the hash before the first.

use crate::error::{ensure_invariant, Result};
use crate::hash::{BlockHash, ByHash};
use crate::prefix_cache::{CacheEvent, ExtraKey};

/// What the group announced of one hash.
struct Announced {
    id: u32,
    extra_key: Option<ExtraKey>,
}

/// The event state of one sliding-window group.
#[derive(Default)]
pub(crate) struct WindowEvents {
    announced: ByHash<Announced>,
    pending: Vec<CacheEvent>,
}

impl WindowEvents {
    /// Block `id` was published under `hash` (parent `parent`, `tokens` its tokens); any older
    /// announcement of `hash` (whose block the caller found unfindable) is removed first.
    pub(crate) fn stored(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        id: u32,
        extra_key: Option<&ExtraKey>,
    ) {
        let fresh = Announced {
            id,
            extra_key: extra_key.cloned(),
        };
        if let Some(old) = self.announced.insert(hash.0, fresh) {
            self.pending.push(CacheEvent::Removed {
                block_hashes: vec![hash],
                extra_key: old.extra_key,
            });
        }
        if let Some(CacheEvent::Stored {
            block_hashes,
            token_ids,
            extra_key: key,
            ..
        }) = self.pending.last_mut()
        {
            // The next block of the run this publication started: one event.
            if parent.is_some()
                && block_hashes.last() == parent.as_ref()
                && key.as_ref() == extra_key
            {
                block_hashes.push(hash);
                token_ids.extend_from_slice(tokens);
                return;
            }
        }
        self.pending.push(CacheEvent::Stored {
            block_hashes: vec![hash],
            parent_hash: parent,
            token_ids: tokens.to_vec(),
            extra_key: extra_key.cloned(),
        });
    }

    /// Queues a removal for every announced hash `findable` no longer confirms (by id order,
    /// consecutive ids of one extra key in one event); returns how many hashes left.
    pub(crate) fn sweep(&mut self, findable: impl Fn(BlockHash, u32) -> bool) -> usize {
        let mut gone: Vec<(u32, u128)> = self
            .announced
            .iter()
            .filter(|(&hash, a)| !findable(BlockHash(hash), a.id))
            .map(|(&hash, a)| (a.id, hash))
            .collect();
        gone.sort_unstable();
        for &(_, hash) in &gone {
            let Some(old) = self.announced.remove(&hash) else {
                continue; // listed above: unreachable
            };
            match self.pending.last_mut() {
                Some(CacheEvent::Removed {
                    block_hashes,
                    extra_key,
                }) if *extra_key == old.extra_key => block_hashes.push(BlockHash(hash)),
                _ => self.pending.push(CacheEvent::Removed {
                    block_hashes: vec![BlockHash(hash)],
                    extra_key: old.extra_key,
                }),
            }
        }
        gone.len()
    }

    /// Takes the queued events, oldest first.
    pub(crate) fn take(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.pending)
    }

    /// Forgets everything: the rank's "cleared" event covers every group (a reset).
    pub(crate) fn forget(&mut self) {
        self.announced.clear();
        self.pending.clear();
    }

    /// Hashes announced and not yet removed.
    pub(crate) fn num_announced(&self) -> usize {
        self.announced.len()
    }

    /// Every findable block among `index` (hash -> id, `findable` deciding) is announced.
    pub(crate) fn check<'a>(
        &self,
        index: impl Iterator<Item = (&'a u128, &'a u32)>,
        findable: impl Fn(BlockHash, u32) -> bool,
    ) -> Result<()> {
        for (&hash, &id) in index {
            if findable(BlockHash(hash), id) {
                let announced = self.announced.get(&hash).map(|a| a.id);
                ensure_invariant!(
                    announced == Some(id),
                    "window block {id} is findable under {hash:032x} but announced as \
                     {announced:?} (R21)"
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u128) -> BlockHash {
        BlockHash(n)
    }

    #[test]
    fn runs_of_a_chain_are_one_event_and_a_republished_hash_is_removed_first() {
        let mut events = WindowEvents::default();
        events.stored(h(1), None, &[1, 2], 5, None);
        events.stored(h(2), Some(h(1)), &[3, 4], 6, None);
        events.stored(h(1), None, &[1, 2], 7, None); // block 5 died, 7 holds hash 1 now
        assert_eq!(
            events.take(),
            vec![
                CacheEvent::Stored {
                    block_hashes: vec![h(1), h(2)],
                    parent_hash: None,
                    token_ids: vec![1, 2, 3, 4],
                    extra_key: None,
                },
                CacheEvent::Removed {
                    block_hashes: vec![h(1)],
                    extra_key: None,
                },
                CacheEvent::Stored {
                    block_hashes: vec![h(1)],
                    parent_hash: None,
                    token_ids: vec![1, 2],
                    extra_key: None,
                },
            ]
        );
        assert_eq!(events.sweep(|hash, id| hash == h(1) && id == 7), 1);
        assert_eq!(
            events.take(),
            vec![CacheEvent::Removed {
                block_hashes: vec![h(2)],
                extra_key: None,
            }]
        );
        assert_eq!(events.num_announced(), 1);
        events.forget();
        assert_eq!(events.num_announced(), 0);
    }
}
