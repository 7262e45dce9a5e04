//! Eviction: [`PrefixCache::evict`], the walk that takes the cache-only blocks the policy
//! (policy.rs) orders first, and [`PrefixCache::evict_leaf`] for callers with an order of their
//! own.
//!
//! Invariants kept: only cache-only leaves are evicted (R10: the cached set stays closed under
//! prefix; a held block is on no list, so it is never a candidate); the classes go in order
//! (the low list, the node segments, the protected attachments); within a segment of nodes the
//! walk is strictly least recently released among its leaves. Every entry older than a
//! segment's cursor that is still on the segment has children, so a walk never revisits one
//! and costs O(1) per evicted block, but for skipped parents (a chain's head released before
//! its tail).

use super::attach;
use super::lists::{List, NONE};
use super::policy::{segment_index, SEGMENTS};
use super::{BlockHash, CacheEvent, ExtraKey, PrefixCache, NIL};

impl PrefixCache {
    /// Evicts up to `n` cache-only blocks; returns how many went back to the free list. Without
    /// attachments: strictly least recently used among the evictable leaves (R10, module doc).
    /// With them (attach.rs): first what no hit point can use (the low list), then the LRU walk
    /// of the nodes, then the protected attachments; evicting a node drops its attachments and
    /// its marks, so what only it made useful goes next. Under SLRU (policy.rs) the walk of the
    /// nodes takes the leaves of probation first, then those of the protected segment.
    pub fn evict(&mut self, n: usize) -> usize {
        self.drain_released();
        let mut evicted = 0;
        let mut removed = Vec::new();
        // One walk per segment of nodes (policy.rs; under LRU the second is empty): every entry
        // older than `cursors[s]` that is still on segment `s` has children.
        let mut cursors = SEGMENTS.map(|list| self.lists.get(list).oldest);
        while evicted < n {
            let low = self.lists.get(List::Low).oldest;
            if low != NIL {
                evicted += self.evict_entry(low, &mut removed, &mut cursors);
                continue;
            }
            let Some(segment) = self.walking_segment(&mut cursors) else {
                let Some(keep) = self.keep_victim() else {
                    break;
                };
                evicted += self.evict_entry(keep, &mut removed, &mut cursors);
                continue;
            };
            let victim = cursors[segment];
            cursors[segment] = self.entries[victim as usize].next;
            if self.entries[victim as usize].children > 0 {
                continue;
            }
            evicted += self.evict_entry(victim, &mut removed, &mut cursors);
        }
        self.stats.evictions += evicted as u64;
        if let Some(events) = self.events.as_mut() {
            for (hash, extra_key) in removed {
                events.push(CacheEvent::Removed {
                    block_hashes: vec![hash],
                    extra_key,
                });
            }
        }
        evicted
    }

    /// The first segment whose walk has entries left (its cursor not `NIL`), or `None` when
    /// both are done. A cursor whose entry moved to the low list (a leaf that is no hit point)
    /// walks again from its segment's oldest: every entry skipped before it still has children.
    #[inline]
    fn walking_segment(&self, cursors: &mut [u32; 2]) -> Option<usize> {
        for (segment, list) in SEGMENTS.into_iter().enumerate() {
            let cursor = cursors[segment];
            if cursor != NIL && self.entries[cursor as usize].list != list as u8 {
                cursors[segment] = self.lists.get(list).oldest;
            }
            if cursors[segment] != NIL {
                return Some(segment);
            }
        }
        None
    }

    /// Evicts listed entry `id` (a leaf node or an attachment) and what goes with it; returns
    /// the blocks freed. A node's removal may turn its parent into an evictable leaf older than
    /// its segment's walk `cursors`: that cursor moves back to it, so it goes next in its turn
    /// (F8: it competes by its own recency).
    fn evict_entry(
        &mut self,
        id: u32,
        removed: &mut Vec<(BlockHash, Option<ExtraKey>)>,
        cursors: &mut [u32; 2],
    ) -> usize {
        if self.entries[id as usize].kind != attach::NODE {
            self.drop_attachment(id);
            return 1;
        }
        for (segment, list) in SEGMENTS.into_iter().enumerate() {
            if cursors[segment] == id {
                // The walk's next entry; or, for an entry that moved off the segment under the
                // cursor, the walk starts again from the oldest (what it skipped has children).
                cursors[segment] = match self.entries[id as usize].list == list as u8 {
                    true => self.entries[id as usize].next,
                    false => self.lists.get(list).oldest,
                };
            }
        }
        let parent = self.entries[id as usize].parent;
        let (hash, key, attached) = self.remove_entry(id);
        if self.events.is_some() {
            removed.push((hash, key));
        }
        if parent != NIL {
            let p = &self.entries[parent as usize];
            if let (0, Some(segment)) = (p.children, segment_index(p.list)) {
                let cursor = cursors[segment];
                if cursor == NIL || p.stamp < self.entries[cursor as usize].stamp {
                    cursors[segment] = parent;
                }
            }
        }
        1 + attached
    }

    /// Evicts block `id` if it is an evictable leaf: cache-only, on the LRU list (so call
    /// [`Self::drain_released`] first) and without cached children (R10: the cached set stays
    /// closed under prefix). Returns whether it did; otherwise nothing changes. The same
    /// bookkeeping as [`Self::evict`] (statistics, events). For callers that choose victims by
    /// a policy of their own among the evictable leaves (`XTensorBlockManager` frees whole
    /// pages); `evict` stays the LRU walk.
    pub fn evict_leaf(&mut self, id: u32) -> bool {
        let Some(entry) = self.entries.get(id as usize) else {
            return false;
        };
        if !entry.live || entry.list == NONE || entry.children > 0 || entry.kind != attach::NODE {
            return false;
        }
        let (hash, extra_key, _) = self.remove_entry(id);
        self.stats.evictions += 1;
        if let Some(events) = self.events.as_mut() {
            events.push(CacheEvent::Removed {
                block_hashes: vec![hash],
                extra_key,
            });
        }
        true
    }
}
