//! Publication of a chain's blocks (R9, first writer wins): [`PrefixCache::insert`] and the
//! entry it records for each new block.
//!
//! Invariants kept: the cached set stays closed under prefix (a block is recorded only under a
//! parent that is cached as the chain's previous position); the index maps each recorded hash to
//! exactly one id, whose entry holds that hash, its parent and its tokens, and whose state word
//! has `CACHED` set (`BlockStore::mark_cached`); a parent's child count is the number of live
//! entries under it. One probe of the index per new block: the entry goes into the slot the
//! look-up found.

use std::collections::hash_map;

use crate::block::Block;
use crate::hash::BlockHash;

use super::{CacheEvent, Entry, Eviction, ExtraKey, PrefixCache, NIL};

impl PrefixCache {
    /// Where a publication of blocks `start..` of a chain resumes, after draining the
    /// `released` stack: the end of what can be published (the shortest of `hashes`, `blocks`
    /// and the full blocks of `tokens`) and the parent entry of block `start` (`NIL` at the
    /// chain's root); `None` when block `start - 1` is not cached as this chain's previous
    /// position, so nothing past it can be (the cached set stays closed under prefix).
    #[inline]
    pub(super) fn resume_chain(
        &mut self,
        hashes: &[BlockHash],
        tokens: &[u32],
        blocks: &[Block],
        start: usize,
    ) -> Option<(usize, u32)> {
        self.drain_released();
        let end = hashes
            .len()
            .min(blocks.len())
            .min(tokens.len() / self.block_size);
        if start == 0 || start > end {
            return Some((end, NIL));
        }
        let previous = blocks[start - 1].id();
        (self.index.get(&hashes[start - 1].0) == Some(&previous)).then_some((end, previous))
    }

    /// Records block `id` as the chain position `hash` under `parent` with `tokens`.
    #[inline]
    pub(super) fn add_entry(
        &mut self,
        hash: BlockHash,
        parent: u32,
        id: u32,
        tokens: &[u32],
        extra_key: Option<&ExtraKey>,
    ) {
        self.index.insert(hash.0, id);
        self.fill_entry(hash, parent, id, tokens, extra_key);
    }

    /// [`Self::add_entry`] for a hash the index already maps to `id` (the caller put it there).
    #[inline]
    fn fill_entry(
        &mut self,
        hash: BlockHash,
        parent: u32,
        id: u32,
        tokens: &[u32],
        extra_key: Option<&ExtraKey>,
    ) {
        let at = self.token_start(id);
        self.tokens[at..at + self.block_size].copy_from_slice(tokens);
        let depth = if parent == NIL {
            0
        } else {
            self.child_added(parent);
            self.entries[parent as usize].depth + 1
        };
        self.entries[id as usize] = Entry {
            hash,
            parent,
            depth,
            live: true,
            extra_key: extra_key.cloned(),
            ..Entry::default()
        };
        self.store.mark_cached(id, hash);
        if self.eviction == Eviction::GhostSlru {
            self.admit(id, hash);
        }
        if !self.graves.is_empty() {
            self.raise(id, hash); // the same chain position computed again (`graves.rs`)
        }
    }

    /// Records the full blocks `start..` of a chain (R9): `hashes[i]`, `tokens[i*bs..]` and
    /// `blocks[i]` describe block i; blocks `..start` must already be cached as this chain's.
    /// Stops at the first block whose hash is cached with another block (first writer wins) or
    /// whose block is cached under another hash; the rest stays private. Returns (number newly
    /// cached, index where it stopped). The caller guarantees every block belongs to this cache's
    /// store.
    ///
    /// `releasing`: the caller drops every handle of `blocks` right after (a sequence being
    /// deallocated). A block whose chain position is already cached with another block (same
    /// hash, parent and tokens: a recomputed duplicate, e.g. after a linear-state trim) is then
    /// skipped and the chain continues under the cached entry, so the rest of the sequence is
    /// published too (R9's "publish the rest when the sequence releases it"). Safe because the
    /// sequence's own blocks all become cache-only together: no cached parent keeps a held
    /// child. Past a skipped duplicate only blocks that nobody else holds (one handle, the
    /// releasing sequence's) are published: a block another sequence shares (it matched it
    /// before a reset, say) would hang a held child under the cached original, which then
    /// counts as evictable but cannot be evicted (R10); the chain stops there instead.
    pub fn insert(
        &mut self,
        hashes: &[BlockHash],
        tokens: &[u32],
        blocks: &[Block],
        start: usize,
        extra_key: Option<&ExtraKey>,
        releasing: bool,
    ) -> (usize, usize) {
        let Some((end, mut parent)) = self.resume_chain(hashes, tokens, blocks, start) else {
            return (0, start);
        };
        let mut newly = 0;
        let mut stored_from = None;
        // Whether the chain continues under a cached original (a skipped duplicate).
        let mut under_original = false;
        let mut i = start;
        while i < end {
            let hash = hashes[i];
            let block = &blocks[i];
            let id = block.id();
            // One probe of the index per block: a new block's entry goes into the slot the
            // look-up found.
            let cached = match self.index.entry(hash.0) {
                hash_map::Entry::Occupied(slot) => Some(*slot.get()),
                hash_map::Entry::Vacant(slot) => {
                    if block.is_cached() || id == 0 || (under_original && block.ref_count() != 1) {
                        break;
                    }
                    slot.insert(id);
                    None
                }
            };
            if let Some(cached) = cached {
                if cached != id {
                    let block_tokens = &tokens[i * self.block_size..(i + 1) * self.block_size];
                    let key = extra_key.map(|k| &**k);
                    if releasing && self.find(hash, parent, key, block_tokens) == Some(cached) {
                        parent = cached; // a duplicate: continue the chain under the original
                        under_original = true;
                        i += 1;
                        continue;
                    }
                    break;
                }
                parent = id;
                i += 1;
                continue;
            }
            let block_tokens = &tokens[i * self.block_size..(i + 1) * self.block_size];
            self.fill_entry(hash, parent, id, block_tokens, extra_key);
            stored_from.get_or_insert(i);
            newly += 1;
            parent = id;
            i += 1;
        }
        self.stats.insertions += newly as u64;
        if let (Some(from), Some(events)) = (stored_from, self.events.as_mut()) {
            let parent_hash = (from > 0).then(|| hashes[from - 1]);
            events.push(CacheEvent::Stored {
                block_hashes: hashes[from..i].to_vec(),
                parent_hash,
                token_ids: tokens[from * self.block_size..i * self.block_size].to_vec(),
                extra_key: extra_key.cloned(),
            });
        }
        (newly, i)
    }
}
