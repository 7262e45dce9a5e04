//! Dedup on publish (R9 revised, the pool level): [`PrefixCache::insert_dedup`].
//!
//! A computed full block whose chain position (hash, parent entry, tokens: R7) is already cached
//! with another physical block is a duplicate. Instead of stopping there (the physical level's
//! first writer wins), the caller's table entry switches to the cached block (a new handle of
//! it), the duplicate's handle is dropped (its id goes back to the free list: the caller held it
//! alone), and the chain continues. Invariants kept: the cached set stays closed under prefix
//! and no cached block gets a held child it does not descend from (every block published past a
//! switch is a child of the cached original, which the caller now holds); only a block the
//! caller alone holds (one handle, not cached) is switched, so a pending transfer's source or
//! destination never is; a duplicate never becomes a "stored" event.

use crate::block::Block;
use crate::hash::BlockHash;

use super::{CacheEvent, ExtraKey, PrefixCache};

/// One table entry switched to the cached copy: (position in the table, old id, new id).
pub(crate) type Switch = (usize, u32, u32);

impl PrefixCache {
    /// [`Self::insert`] with dedup (module doc): publishes the full blocks `start..` of a chain,
    /// switching every duplicate to its cached copy (appended to `switches`). Stops at a block
    /// cached under another chain position, at a duplicate the caller does not hold alone, or at
    /// a hash collision (same hash, other tokens or parent). Returns (number newly cached, index
    /// where it stopped).
    pub(crate) fn insert_dedup(
        &mut self,
        hashes: &[BlockHash],
        tokens: &[u32],
        blocks: &mut [Block],
        start: usize,
        extra_key: Option<&ExtraKey>,
        switches: &mut Vec<Switch>,
    ) -> (usize, usize) {
        let Some((end, mut parent)) = self.resume_chain(hashes, tokens, blocks, start) else {
            return (0, start);
        };
        let bs = self.block_size;
        let key = extra_key.map(|k| &**k);
        let mut newly = 0;
        // The run of blocks stored since the last switch (one "stored" event per run).
        let mut run_from = None;
        let mut i = start;
        while i < end {
            let hash = hashes[i];
            let id = blocks[i].id();
            let block_tokens = &tokens[i * bs..(i + 1) * bs];
            if let Some(&cached) = self.index.get(&hash.0) {
                if cached == id {
                    parent = id;
                    i += 1;
                    continue;
                }
                let ours_alone = !blocks[i].is_cached() && blocks[i].ref_count() == 1;
                if !ours_alone || self.find(hash, parent, key, block_tokens) != Some(cached) {
                    break;
                }
                self.flush_stored(hashes, tokens, run_from.take(), i, extra_key);
                self.list_unlink(cached);
                let copy = self.store.retain_cached(cached);
                let duplicate = std::mem::replace(&mut blocks[i], copy);
                switches.push((i, id, cached));
                drop(duplicate); // the last handle: back to the free list
                parent = cached;
                i += 1;
                continue;
            }
            if blocks[i].is_cached() || id == 0 {
                break;
            }
            self.add_entry(hash, parent, id, block_tokens, extra_key);
            run_from.get_or_insert(i);
            newly += 1;
            parent = id;
            i += 1;
        }
        self.flush_stored(hashes, tokens, run_from, i, extra_key);
        self.stats.insertions += newly as u64;
        (newly, i)
    }

    /// The "stored" event of chain positions `from..to`, if recording and `from` is some.
    fn flush_stored(
        &mut self,
        hashes: &[BlockHash],
        tokens: &[u32],
        from: Option<usize>,
        to: usize,
        extra_key: Option<&ExtraKey>,
    ) {
        let (Some(from), Some(events)) = (from, self.events.as_mut()) else {
            return;
        };
        let bs = self.block_size;
        events.push(CacheEvent::Stored {
            block_hashes: hashes[from..to].to_vec(),
            parent_hash: (from > 0).then(|| hashes[from - 1]),
            token_ids: tokens[from * bs..to * bs].to_vec(),
            extra_key: extra_key.cloned(),
        });
    }
}
