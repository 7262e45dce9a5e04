//! The tree's LRU list (a doubly linked list through the writer's links, oldest first),
//! eviction from its oldest end and the collection of emptied nodes (invariants in the parent
//! module's doc).

use super::{Holders, Tree, HAS_EXTRAS, LIVE, NIL, OFF, SPECULATIVE, UNKNOWN};

impl Tree<'_> {
    /// Moves node `id` (which has entries) to the newest end of the LRU.
    #[inline]
    pub(crate) fn touch(&mut self, id: u32) {
        let tail = self.links.tail;
        if tail == id {
            return;
        }
        let meta = self.links.meta[id as usize];
        if meta.prev != OFF {
            self.unlink(id);
        } else {
            self.links.on_lru += 1;
        }
        let tail = self.links.tail;
        let m = &mut self.links.meta[id as usize];
        m.prev = tail;
        m.next = NIL;
        if tail == NIL {
            self.links.head = id;
        } else {
            self.links.meta[tail as usize].next = id;
        }
        self.links.tail = id;
    }

    /// Takes node `id` (on the list) out of the list's links, leaving its own.
    #[inline]
    fn unlink(&mut self, id: u32) {
        let super::Meta { prev, next, .. } = self.links.meta[id as usize];
        if prev == NIL {
            self.links.head = next;
        } else {
            self.links.meta[prev as usize].next = next;
        }
        if next == NIL {
            self.links.tail = prev;
        } else {
            self.links.meta[next as usize].prev = prev;
        }
    }

    pub(super) fn leave_lru(&mut self, id: u32) {
        if self.links.meta[id as usize].prev != OFF {
            self.unlink(id);
            let m = &mut self.links.meta[id as usize];
            m.prev = OFF;
            m.next = NIL;
            self.links.on_lru -= 1;
        }
    }

    /// Evicts the oldest node with no children (a node with children met on the way is moved
    /// to the newest end, so each pass is amortized O(1)). Returns how many entries went.
    pub(crate) fn evict_one(&mut self) -> usize {
        let mut budget = self.links.on_lru;
        while budget > 0 && self.links.head != NIL {
            let id = self.links.head;
            budget -= 1;
            if self.links.meta[id as usize].children > 0 {
                self.touch(id);
                continue;
            }
            let rec = self.nodes.recs[id as usize];
            let mut holders = rec.holders();
            let mut gone = holders.len();
            holders.release(&mut self.nodes.sets);
            if rec.has_extras() {
                let extras = self.nodes.extras.remove(&id).unwrap_or_default();
                gone += extras.len();
                self.nodes.speculative -=
                    extras.iter().filter(|e| e.mask & SPECULATIVE != 0).count();
            }
            let rec = self.rec_mut(id);
            rec.set_holders(Holders::EMPTY);
            rec.word &= !HAS_EXTRAS;
            self.nodes.entries -= gone;
            self.collect(id);
            return gone;
        }
        0
    }

    /// Node `id` has no entries: leave the LRU; delete it if it has no children either, then
    /// reconsider its parent.
    pub(super) fn collect(&mut self, mut id: u32) {
        loop {
            let rec = self.nodes.recs[id as usize];
            if !rec.live() || rec.has_entries() {
                return; // it has entries, or went already (collected through a child)
            }
            self.leave_lru(id);
            let meta = self.links.meta[id as usize];
            if meta.children > 0 {
                return;
            }
            let hash = rec.hash();
            *self.rec_mut(id) = super::Rec::default();
            self.links.meta[id as usize] = super::BLANK;
            self.links.free.push(id);
            self.nodes.live -= 1;
            self.links.changes.deleted.push((hash, id));
            if meta.parent == NIL || meta.parent == UNKNOWN {
                return;
            }
            self.links.meta[meta.parent as usize].children -= 1;
            id = meta.parent;
        }
    }
}

/// A free record is all zero (no [`LIVE`] bit), so no reader takes it for a node.
const _: () = assert!(LIVE != 0);
