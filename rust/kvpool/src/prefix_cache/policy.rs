//! Eviction policies: how the cache orders the nodes it may evict, inside the classes of
//! attach.rs (what no hit point can use, [`List::Low`], still goes first; the protected
//! attachments, [`List::Keep`], last). Chosen per cache ([`Eviction`], `PoolConfig::eviction`).
//!
//! - [`Eviction::Lru`] (the default, R10, R11): one list of nodes, [`List::Main`], oldest
//!   release first.
//! - [`Eviction::Slru`] (segmented LRU, R11a): the nodes are split into two segments, each an
//!   LRU list. A node enters the **probationary** segment ([`List::Main`]) when it becomes
//!   cache-only, unless a lookup found it while it was cached since it last entered probation
//!   (its [`HIT`] flag): then it enters the **protected** segment ([`List::Protected`]). The
//!   protected segment holds at most `protected_cap` nodes; what overflows it goes back to the
//!   newest end of probation, without its flag (a second chance). Eviction takes the
//!   evictable leaves of probation first, least recently released first, then those of the
//!   protected segment. So a scan of one-off prompts, larger than the cache, flushes only
//!   probation and never what was hit again: scan resistance.
//! - [`Eviction::GhostSlru`] (R11a): SLRU whose protected segment also admits what the cache
//!   evicted too early. A node recorded (published) while the ghost filter of mod.rs
//!   remembers evicting its hash, about the last `num_blocks` evictions, gets the [`HIT`] flag
//!   at once: it was used again after it left, so it enters the protected segment when it
//!   becomes cache-only (S3-FIFO's ghost admission, with LRU segments instead of FIFOs). A
//!   conversation whose turns come back after longer than LRU keeps them is kept from its
//!   second computation on, ahead of first-time prompts.
//!
//! Invariants (checked by `PrefixCache::check`): under LRU the protected segment is empty;
//! under SLRU and GhostSlru a listed node is on the protected segment iff its [`HIT`] flag is
//! set (a node on the low list keeps its flag: when it gets a child it moves to the segment the
//! flag names), and the segment holds at most `protected_cap` nodes (`protected_percent` of the
//! cache's entries). Only leaves are evicted from either segment (R10: prefix closure); the walk
//! is the LRU walk of evict.rs, one per segment keeping its place between calls
//! (segment_walk.rs): O(1) per block amortized, O(log n) for a parent left behind by its walk
//! that becomes a leaf (ghost admission makes many: a child in the protected segment under a
//! parent in probation).
//! A hit costs one flag write on an entry line the hit touches anyway; ghost admission one read
//! of the ghost filter per recorded node (GhostSlru only). With `protected_percent` 0 every
//! promoted node goes straight back to the newest end of probation: LRU's order.

use crate::error::{KvPoolError, Result};

use super::lists::List;
use super::{PrefixCache, NIL};

/// [`super::Entry`] flag: a lookup found the node while it was cached, since it last entered
/// probation (SLRU's promotion, module doc).
pub(super) const HIT: u8 = 1 << 6;

/// Default share of a cache's blocks the SLRU protected segment may hold, in percent.
pub const DEFAULT_PROTECTED_PERCENT: usize = 20;

/// How a prefix cache orders the nodes it may evict (module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Eviction {
    /// Least recently released leaf first (R10, R11).
    #[default]
    Lru,
    /// Segmented LRU: probation first, then the nodes hit while cached (R11a).
    Slru,
    /// SLRU whose protected segment also admits a recomputed node the ghost filter remembers
    /// evicting (R11a).
    GhostSlru,
}

impl Eviction {
    /// The names [`Self::parse`] takes, in the order the docs list them.
    pub const NAMES: [&'static str; 3] = ["lru", "slru", "ghost_slru"];

    /// From "lru", "slru" or "ghost_slru"; an error naming `eviction` otherwise.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "lru" => Ok(Self::Lru),
            "slru" => Ok(Self::Slru),
            "ghost_slru" => Ok(Self::GhostSlru),
            other => Err(KvPoolError::invalid(
                "eviction",
                format!("must be \"lru\", \"slru\" or \"ghost_slru\", got {other:?}"),
            )),
        }
    }

    /// The policy's name, as [`Self::parse`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Slru => "slru",
            Self::GhostSlru => "ghost_slru",
        }
    }
}

/// The segments of the node walk, in eviction order.
pub(super) const SEGMENTS: [List; 2] = [List::Main, List::Protected];

/// The walk's segment index of a list, if it is a segment of nodes.
#[inline]
pub(super) fn segment_index(list: u8) -> Option<usize> {
    if list == List::Main as u8 {
        Some(0)
    } else if list == List::Protected as u8 {
        Some(1)
    } else {
        None
    }
}

impl PrefixCache {
    /// Sets the eviction policy; the protected segment of SLRU gets `protected_percent` of the
    /// cache's blocks. Every listed node is placed anew (oldest first, so each segment keeps its
    /// order). An error naming `protected_percent` above 100.
    pub fn set_eviction(&mut self, eviction: Eviction, protected_percent: usize) -> Result<()> {
        if protected_percent > 100 {
            return Err(KvPoolError::invalid(
                "protected_percent",
                format!("must be at most 100, got {protected_percent}"),
            ));
        }
        self.drain_released();
        self.eviction = eviction;
        self.protected_cap = self.entries.len() * protected_percent / 100;
        let mut nodes = self.list_ids(List::Main);
        nodes.extend(self.list_ids(List::Protected));
        nodes.sort_by_key(|&id| self.entries[id as usize].stamp);
        for id in nodes {
            self.list_unlink(id);
            if eviction == Eviction::Lru {
                self.entries[id as usize].flags &= !HIT;
            }
            self.push_node(id);
        }
        self.restart_walks();
        Ok(())
    }

    /// The cache's eviction policy.
    pub fn eviction(&self) -> Eviction {
        self.eviction
    }

    /// The segment a cache-only node of the node class goes to (module doc).
    #[inline]
    pub(super) fn segment_of(&self, id: u32) -> List {
        if self.eviction != Eviction::Lru && self.entries[id as usize].flags & HIT != 0 {
            List::Protected
        } else {
            List::Main
        }
    }

    /// Puts cache-only node `id` (on no list, of the node class) at the newest end of its
    /// segment; a protected segment over its cap gives its oldest back to probation.
    #[inline]
    pub(super) fn push_node(&mut self, id: u32) {
        let segment = self.segment_of(id);
        self.list_push(segment, id);
        if segment == List::Protected {
            self.demote_overflow();
        }
    }

    /// Moves a node from the low list to its segment (it got a child, attach.rs).
    pub(super) fn lift_node(&mut self, id: u32) {
        self.list_unlink(id);
        self.push_node(id);
    }

    /// Gives the oldest protected nodes back to probation (newest end, flag cleared) until the
    /// protected segment fits its cap.
    fn demote_overflow(&mut self) {
        while self.lists.get(List::Protected).len > self.protected_cap {
            let oldest = self.lists.get(List::Protected).oldest;
            debug_assert_ne!(oldest, NIL);
            self.list_unlink(oldest);
            self.entries[oldest as usize].flags &= !HIT;
            self.list_push(List::Main, oldest);
        }
    }

    /// Ghost admission (GhostSlru): a node just recorded whose eviction the ghost filter
    /// remembers was used again after it left, so it enters the protected segment when it
    /// becomes cache-only, as if it had been hit while cached.
    #[inline]
    pub(super) fn admit(&mut self, id: u32, hash: super::BlockHash) {
        if self.ghost_remembers(hash) {
            self.entries[id as usize].flags |= HIT;
        }
    }

    /// The nodes of the protected segment, oldest first (empty under LRU).
    pub fn protected_order(&self) -> Vec<u32> {
        self.list_ids(List::Protected)
    }

    /// Verifies the module doc's invariants of the segments.
    pub(super) fn check_segments(&self) -> Result<()> {
        let protected = self.lists.get(List::Protected).len;
        crate::error::ensure_invariant!(
            self.eviction != Eviction::Lru || protected == 0,
            "{protected} nodes on the protected segment under {}",
            self.eviction.name()
        );
        crate::error::ensure_invariant!(
            protected <= self.protected_cap,
            "the protected segment holds {protected} nodes, over its cap {}",
            self.protected_cap
        );
        if self.eviction != Eviction::Lru {
            for list in SEGMENTS {
                for id in self.list_ids(list) {
                    let hit = self.entries[id as usize].flags & HIT != 0;
                    crate::error::ensure_invariant!(
                        hit == (list == List::Protected),
                        "node {id} is on the {list:?} segment with hit flag {hit}"
                    );
                }
            }
        }
        Ok(())
    }
}
