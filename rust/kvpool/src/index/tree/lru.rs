//! The tree's LRU queue (stamps and records, compaction), eviction from its oldest end and
//! the collection of emptied nodes (invariants in the parent module's doc).

use super::{Tree, HAS_EXTRAS, LRU_SLACK, NIL, SPECULATIVE};

impl Tree {
    /// Moves node `id` (which has entries) to the newest end of the LRU.
    #[inline]
    pub(crate) fn touch(&mut self, id: u32) {
        self.stamp(id);
        self.compact_lru();
    }

    /// [`Tree::touch`] without the compaction check (the caller makes it).
    #[inline(always)]
    pub(super) fn stamp(&mut self, id: u32) {
        self.tick += 1;
        let tick = self.tick;
        let node = self.node_mut(id);
        let entered = node.stamp == 0;
        node.stamp = tick;
        self.on_lru += usize::from(entered);
        self.lru.push((id, tick));
    }

    /// Drops the stale records when they outnumber the live ones.
    #[inline]
    pub(super) fn compact_lru(&mut self) {
        if self.lru.len() - self.lru_head > 2 * self.on_lru + LRU_SLACK {
            let nodes = &self.nodes;
            self.lru.drain(..self.lru_head);
            self.lru
                .retain(|&(id, stamp)| nodes[id as usize].stamp == stamp);
            self.lru_head = 0;
            self.changes.lru_compacted = true;
        }
    }

    pub(super) fn leave_lru(&mut self, id: u32) {
        if self.nodes[id as usize].stamp != 0 {
            self.node_mut(id).stamp = 0;
            self.on_lru -= 1;
        }
    }

    /// Evicts the oldest node with no children (a node with children met on the way is moved
    /// to the newest end, so each pass is amortized O(1)). Returns how many entries went.
    pub(crate) fn evict_one(&mut self) -> usize {
        let mut budget = self.live;
        while budget > 0 && self.lru_head < self.lru.len() {
            let (id, stamp) = self.lru[self.lru_head];
            if self.nodes[id as usize].stamp != stamp {
                self.lru_head += 1; // stale
                continue;
            }
            budget -= 1;
            if self.nodes[id as usize].children > 0 {
                self.lru_head += 1;
                self.touch(id);
                continue;
            }
            self.lru_head += 1;
            self.mark(id);
            let node = &mut self.nodes[id as usize];
            let mut gone = node.holders.len();
            node.holders.release(&mut self.sets);
            if node.has_extras() {
                node.flags &= !HAS_EXTRAS;
                let extras = self.extras.remove(&id).unwrap_or_default();
                gone += extras.len();
                self.speculative -= extras.iter().filter(|e| e.mask & SPECULATIVE != 0).count();
            }
            self.entries -= gone;
            self.collect(id);
            return gone;
        }
        0
    }

    /// Node `id` has no entries: leave the LRU; delete it if it has no children either, then
    /// reconsider its parent.
    pub(super) fn collect(&mut self, mut id: u32) {
        loop {
            let node = &self.nodes[id as usize];
            if !node.live() || node.has_entries() {
                return; // it has entries, or went already (collected through a child)
            }
            self.leave_lru(id);
            if self.nodes[id as usize].children > 0 {
                return;
            }
            let node = self.node_mut(id);
            let (hash, parent) = (node.hash, node.parent);
            node.flags = 0;
            node.parent = NIL;
            self.free.push(id);
            self.live -= 1;
            self.changes.deleted.push((hash, id));
            if parent == NIL {
                return;
            }
            self.node_mut(parent).children -= 1;
            id = parent;
        }
    }
}
