//! Anchors: the identity of one cached chain position, for the groups that store what a prefix
//! computed beside the full-attention blocks (sliding-window blocks, linear-state checkpoints).
//!
//! A hit in this cache is verified by hash, parent entry and tokens (R7); an entry therefore
//! stands for exactly one prefix for as long as it lives. Another group cannot verify a prefix
//! on its own: a window keeps only the last blocks of a chain and a checkpoint only the state at
//! its end, so a hash collision would hand out another prefix's KV or state. Instead, what such
//! a group stores records the **anchor** of the full-attention entry at the same chain position,
//! and a hit takes it only if the query's own verified walk reaches an entry with that anchor.
//!
//! An anchor is a process-unique number (never 0, never reused) given to an entry the first time
//! a group asks for it ([`PrefixCache::anchor`]); it leaves with the entry (eviction, reset), so
//! a later entry of the same id never inherits it, except a later entry of the same chain
//! position, which takes it back from the entry's grave (`graves.rs`). A host tier copies it along with the KV:
//! an offload gives the host entry the device entry's anchor, a load gives the device entry the
//! host entry's ([`PrefixCache::set_anchor`]). Every entry carrying anchor `a`, in any tier, thus
//! holds the KV of the one prefix `a` was first given to; the same prefix may carry several
//! anchors (one per independent computation), which costs hits, never correctness.
//!
//! A *ticket* stands in for an anchor not known yet: something stored for a chain position that
//! is not cached as the chain's at that moment (a checkpoint saved while the full-attention
//! publication waits for a deferred dedup, R9) gets a ticket, unique like an anchor but with the
//! top bit set, so it matches no entry until its owner replaces it with the real anchor.
//!
//! Invariant (checked by `check.rs`): `anchors[id]` is non-zero exactly for live entries with
//! the `anchored` flag. The full-attention hot paths never touch `anchors` unless an entry is
//! anchored (the flag sits in the entry's cache line).

// std, not the loom shim: uniqueness only, outside every loom model.
use std::sync::atomic::{AtomicU64, Ordering};

use crate::hash::BlockHash;

use super::PrefixCache;

/// The next anchor handed out (process-wide, so anchors never coincide across caches).
static NEXT_ANCHOR: AtomicU64 = AtomicU64::new(1);

/// Identity of a cached chain position (0: none).
pub(crate) type Anchor = u64;

/// The bit that marks a ticket (module doc); anchors stay below 2^62 (the next bit tags the
/// links of first blocks, `crate::chain`).
const TICKET: Anchor = 1 << 63;

/// A fresh ticket: unique, and never an entry's anchor.
pub(crate) fn ticket() -> Anchor {
    // Relaxed: only uniqueness matters.
    TICKET | NEXT_ANCHOR.fetch_add(1, Ordering::Relaxed)
}

/// The link of a chain's first block (`crate::chain`): its parent is the root, named by the
/// chain's extra key.
pub(crate) const ROOT_LINK: Anchor = 1 << 62;

/// Whether `anchor` is a ticket.
pub(crate) fn is_ticket(anchor: Anchor) -> bool {
    anchor & TICKET != 0
}

impl PrefixCache {
    /// The anchor of entry `id`, 0 if it has none (or is not an entry).
    #[inline]
    pub(crate) fn anchor_of(&self, id: u32) -> Anchor {
        self.anchors.get(id as usize).copied().unwrap_or(0)
    }

    /// Whether block `id` is a live entry cached under `hash`.
    #[inline]
    pub(crate) fn is_entry(&self, id: u32, hash: BlockHash) -> bool {
        self.entries
            .get(id as usize)
            .is_some_and(|e| e.live && e.hash == hash)
    }

    /// The anchor of live entry `id`, given now if it has none; 0 if `id` is not an entry.
    pub(crate) fn anchor(&mut self, id: u32) -> Anchor {
        let Some(entry) = self.entries.get_mut(id as usize).filter(|e| e.live) else {
            return 0;
        };
        if !entry.anchored() {
            entry.set_anchored();
            // Relaxed: only uniqueness matters.
            self.anchors[id as usize] = NEXT_ANCHOR.fetch_add(1, Ordering::Relaxed);
        }
        self.anchors[id as usize]
    }

    /// Gives live entry `id` the anchor `anchor` that the same prefix's entry in another tier
    /// carries (module doc), unless it has one already or `anchor` is 0.
    pub(crate) fn set_anchor(&mut self, id: u32, anchor: Anchor) {
        if anchor == 0 {
            return;
        }
        if let Some(entry) = self
            .entries
            .get_mut(id as usize)
            .filter(|e| e.live && !e.anchored())
        {
            entry.set_anchored();
            self.anchors[id as usize] = anchor;
        }
    }

    /// The entry at a chain position (hash, parent entry or `None` at the root with the chain's
    /// extra key, tokens), verified as a hit is (R7).
    #[inline]
    pub(crate) fn find_entry(
        &self,
        hash: BlockHash,
        parent: Option<u32>,
        extra_key: Option<&[u8]>,
        tokens: &[u32],
    ) -> Option<u32> {
        self.find(hash, parent.unwrap_or(super::NIL), extra_key, tokens)
    }
}
