//! Eviction: [`PrefixCache::evict`], which takes the cache-only blocks the policy (policy.rs)
//! orders first, and [`PrefixCache::evict_leaf`] for callers with an order of their own.
//!
//! Invariants kept: only cache-only leaves are evicted (R10: the cached set stays closed under
//! prefix; a held block is on no list, so it is never a candidate); the classes go in order
//! (the low list, the node segments, the protected attachments); within a segment of nodes the
//! victim is strictly its least recently released leaf. Each segment's walk keeps its place
//! between calls (segment_walk.rs), so a parent that still has children is passed once, not
//! once per call or per parent evicted behind it: O(1) per evicted block amortized, O(log n)
//! for a parent that becomes a leaf after the walk passed it.

use super::attach;
use super::lists::{List, NONE};
use super::policy::SEGMENTS;
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
        while evicted < n {
            let Some(victim) = self.next_victim() else {
                break;
            };
            evicted += self.evict_entry(victim, &mut removed);
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

    /// What [`Self::evict`] takes next: the oldest entry of the low list, else the oldest leaf
    /// of the first node segment that has one (segment_walk.rs), else a protected attachment;
    /// `None` when nothing is listed.
    fn next_victim(&mut self) -> Option<u32> {
        let low = self.lists.get(List::Low).oldest;
        if low != NIL {
            return Some(low);
        }
        (0..SEGMENTS.len())
            .find_map(|segment| self.segment_victim(segment))
            .or_else(|| self.keep_victim())
    }

    /// Evicts listed entry `id` (a leaf node or an attachment) and what goes with it; returns
    /// the blocks freed. A node's removal may turn its parent into an evictable leaf: the
    /// segment walks see it (`child_removed`, segment_walk.rs), so it competes by its own
    /// recency (F8).
    fn evict_entry(&mut self, id: u32, removed: &mut Vec<(BlockHash, Option<ExtraKey>)>) -> usize {
        if self.entries[id as usize].kind != attach::NODE {
            self.drop_attachment(id);
            return 1;
        }
        let (hash, key, attached) = self.remove_entry(id);
        if self.events.is_some() {
            removed.push((hash, key));
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
