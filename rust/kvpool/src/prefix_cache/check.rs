//! [`PrefixCache::check`]: the invariants of the module doc, walked entry by entry.

use crate::block::{CACHED, COUNT_MASK, QUEUED};
use crate::error::{ensure_invariant, Result};

use super::attach::NODE;
use super::lists::{List, NONE};
use super::{PrefixCache, NIL};

impl PrefixCache {
    /// Walks every structure and verifies the invariants in the module doc.
    pub fn check(&self) -> Result<()> {
        let n = self.entries.len();
        let mut children = vec![0u32; n];
        let mut cache_only = 0usize;
        for (&hash, &id) in &self.index {
            ensure_invariant!((id as usize) < n && id != 0, "cached id {id} out of range");
            let entry = &self.entries[id as usize];
            ensure_invariant!(
                entry.live && entry.kind == NODE,
                "index names block {id} but its entry is not a live node"
            );
            ensure_invariant!(
                entry.hash.0 == hash,
                "block {id} indexed under a foreign hash"
            );
            let state = self.store.state(id);
            ensure_invariant!(
                state & CACHED != 0,
                "cached block {id} lacks the cache's reference"
            );
            let count = state & COUNT_MASK;
            ensure_invariant!(count >= 1, "cached block {id} has count 0");
            if count == 1 {
                cache_only += 1;
                ensure_invariant!(
                    entry.list == List::Main as u8
                        || entry.list == List::Protected as u8
                        || entry.list == List::Low as u8
                        || state & QUEUED != 0,
                    "cache-only block {id} is neither on an eviction list nor queued for it"
                );
                ensure_invariant!(
                    entry.list != List::Low as u8 || entry.children == 0,
                    "block {id} with children is on the low list (R10)"
                );
            } else {
                ensure_invariant!(
                    entry.list == NONE,
                    "held block {id} is on an eviction list (R10)"
                );
            }
            ensure_invariant!(
                self.store.hash_of(id) == entry.hash,
                "block {id}'s recorded hash differs from its entry"
            );
            let parent_hash = if entry.parent == NIL {
                ensure_invariant!(
                    entry.depth == 0,
                    "root block {id} has depth {}",
                    entry.depth
                );
                self.hasher.root(entry.extra_key.as_deref())
            } else {
                let parent = &self.entries[entry.parent as usize];
                ensure_invariant!(
                    parent.live,
                    "cached block {id}'s parent {} is not cached (R10 prefix closure)",
                    entry.parent
                );
                ensure_invariant!(
                    parent.depth + 1 == entry.depth,
                    "depth of block {id} is off"
                );
                children[entry.parent as usize] += 1;
                parent.hash
            };
            ensure_invariant!(
                self.hasher.hash_block(parent_hash, self.block_tokens(id)) == entry.hash,
                "block {id}'s tokens do not hash to its key (R6)"
            );
        }
        self.check_attachments(&mut cache_only)?;
        for (id, entry) in self.entries.iter().enumerate() {
            ensure_invariant!(
                (self.anchors[id] != 0) == (entry.live && entry.anchored()),
                "block {id}: anchor {} but entry live {} anchored {}",
                self.anchors[id],
                entry.live,
                entry.anchored()
            );
            if entry.live && entry.kind != NODE {
                continue; // an attachment: check_attachments
            }
            if entry.live {
                ensure_invariant!(
                    entry.children == children[id],
                    "block {id} counts {} children, has {}",
                    entry.children,
                    children[id]
                );
            } else {
                ensure_invariant!(entry.list == NONE, "dead entry {id} on an eviction list");
                if id > 0 {
                    ensure_invariant!(
                        self.store.state(id as u32) & CACHED == 0,
                        "block {id} is marked cached but has no entry"
                    );
                }
            }
        }
        // An anchor names one chain position: a grave's anchor is carried by no live entry of
        // another hash (a load may give the same position's entry the anchor back meanwhile).
        let live: std::collections::HashMap<u64, u128> = self
            .anchors
            .iter()
            .enumerate()
            .filter(|&(_, &a)| a != 0)
            .map(|(id, &a)| (a, self.entries[id].hash.0))
            .collect();
        ensure_invariant!(
            self.graves.len() <= n
                && self.graves.consistent()
                && self
                    .graves
                    .anchors()
                    .all(|(a, hash)| live.get(&a).is_none_or(|&h| h == hash)),
            "a grave's anchor is carried by a live entry of another hash, or the graves are \
             inconsistent"
        );
        ensure_invariant!(
            cache_only == self.store.num_cache_only(),
            "cached-block count {} differs from the {} cache-only entries (R2)",
            self.store.num_cache_only(),
            cache_only
        );
        let mut seen = vec![false; n];
        for list in List::ALL {
            let order = self.list_ids(list);
            let ends = self.lists.get(list);
            ensure_invariant!(
                order.len() == ends.len,
                "{list:?} list length differs from its count"
            );
            let mut prev = NIL;
            for &id in &order {
                ensure_invariant!(!seen[id as usize], "block {id} twice on the eviction lists");
                seen[id as usize] = true;
                let entry = &self.entries[id as usize];
                ensure_invariant!(
                    entry.list == list as u8 && entry.prev == prev,
                    "{list:?} list links broken at block {id}"
                );
                ensure_invariant!(
                    prev == NIL || self.entries[prev as usize].stamp < entry.stamp,
                    "{list:?} list stamps do not increase at block {id}"
                );
                ensure_invariant!(
                    self.store.state(id) & (CACHED | COUNT_MASK) == CACHED | 1,
                    "listed block {id} is not cache-only (R10)"
                );
                prev = id;
            }
            ensure_invariant!(prev == ends.newest, "{list:?} list tail pointer is off");
        }
        ensure_invariant!(
            self.list_ids(List::Main)
                .iter()
                .chain(&self.list_ids(List::Protected))
                .all(|&id| self.entries[id as usize].kind == NODE)
                && self
                    .list_ids(List::Keep)
                    .iter()
                    .all(|&id| self.entries[id as usize].kind != NODE),
            "a node on the keep list or an attachment on the LRU list"
        );
        self.check_segments()?;
        self.check_walks()
    }
}
