//! The data of a tier transfer: what the engine is handed ([`TransferPlan`]) and what the pool
//! keeps until the engine confirms it ([`Pending`]).
//!
//! A [`Pending`] record is a chain of blocks in transfer: blocks `start..hashes.len()` are copied
//! from `src[start - src_offset..]` to `chain[start..]`. The destination tier holds the whole
//! chain from block 0, and so does the source tier for every *cached* source block (`src_offset`
//! is 0 whenever the record pins host cache hits), so no pinned cached block ever has a
//! cache-only ancestor (which would count as evictable but could not be evicted, R10).
//!
//! Loads with remote hits: positions `fetch_start..` of `src` are host staging blocks (fresh,
//! never cached) that the fetch fills; until `complete_fetches` the record is a fetch. Without
//! a host hit before them, `src_offset` is that first fetched position, and it stays so when
//! the completed fetch turns the record into a load: its source is then staging blocks only.

use crate::block::Block;
use crate::hash::BlockHash;
use crate::prefix_cache::{Anchor, ExtraKey};
use crate::sequence::LoadTicket;
use crate::sync::Arc;

/// Direction of a [`TransferPlan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferDirection {
    /// Host -> device (`src` host ids, `dst` device ids).
    Load,
    /// Device -> host (`src` device ids, `dst` host ids).
    Offload,
    /// Remote -> host (`keys` chain hashes, `dst` host staging ids, `src` empty).
    Fetch,
}

impl TransferDirection {
    /// "load", "offload" or "fetch".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Load => "load",
            Self::Offload => "offload",
            Self::Fetch => "fetch",
        }
    }
}

/// What to ask the remote tier before a first allocation: the chain hashes of blocks
/// `from..from + hashes.len()` (past the device and host matches, up to the R8 limit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteQuery {
    /// First chain position asked about (the device+host reach).
    pub from: usize,
    /// Chain hashes (R6) of the positions asked about.
    pub hashes: Vec<BlockHash>,
}

/// The remote tier's answer: chain blocks `from..to` exist there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteHits {
    /// First chain position that exists remotely.
    pub from: usize,
    /// One past the last (the leading run of hits).
    pub to: usize,
}

/// Block copies of one rank in one direction: copy block `src[i]` to block `dst[i]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferPlan {
    /// The rank whose caches the ids index.
    pub dp_rank: usize,
    /// Source block ids.
    pub src: Vec<i32>,
    /// Destination block ids (distinct).
    pub dst: Vec<i32>,
    /// Chain hashes (R6) of the blocks copied, one per `dst` entry: the remote keys of a fetch,
    /// the hashes of the blocks an offload puts on host (what a write-through sends on).
    pub keys: Vec<BlockHash>,
    pub(crate) id: u64,
    pub(crate) pool: u64,
    pub(crate) direction: TransferDirection,
}

impl TransferPlan {
    /// Process-unique id of the plan.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Load, offload or fetch.
    pub fn direction(&self) -> TransferDirection {
        self.direction
    }

    /// Number of block copies.
    pub fn len(&self) -> usize {
        self.dst.len()
    }

    /// Whether the plan copies nothing.
    pub fn is_empty(&self) -> bool {
        self.dst.is_empty()
    }
}

/// A chain of blocks in transfer (module doc).
pub(crate) struct Pending {
    pub(crate) hashes: Vec<BlockHash>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) extra_key: Option<ExtraKey>,
    /// Destination tier: the whole chain (prefix plus destinations).
    pub(crate) chain: Vec<Block>,
    /// Source tier: chain positions `src_offset..` (prefix plus sources).
    pub(crate) src: Vec<Block>,
    pub(crate) start: usize,
    /// First chain position of `src`: 0, or `fetch_start` when no host hit precedes the fetch.
    pub(crate) src_offset: usize,
    /// First chain position filled from the remote tier (`hashes.len()` when none).
    pub(crate) fetch_start: usize,
    /// Loads: the ticket of the sequence.
    pub(crate) ticket: Option<Arc<LoadTicket>>,
    /// The anchors of the source entries of positions `start..` (`prefix_cache/anchors.rs`),
    /// given to the destination entries at completion; missing or 0 where there is none.
    pub(crate) anchors: Vec<Anchor>,
}

impl Drop for Pending {
    /// Releases both chains tail first, so a chain's tail is older on the LRU than its head
    /// (R10, R11; see `Allocation`'s `Drop`).
    fn drop(&mut self) {
        while self.chain.pop().is_some() {}
        while self.src.pop().is_some() {}
    }
}

impl Pending {
    /// Gives the entries `cache` recorded for the destinations of this record the anchors of
    /// their sources (the same prefix's KV, moved between tiers).
    pub(crate) fn pass_anchors(&self, cache: &mut crate::prefix_cache::PrefixCache) {
        for (i, &anchor) in self.anchors.iter().enumerate() {
            let at = self.start + i;
            let (Some(block), Some(&hash)) = (self.chain.get(at), self.hashes.get(at)) else {
                break;
            };
            if anchor != 0 && cache.is_entry(block.id(), hash) {
                cache.set_anchor(block.id(), anchor);
            }
        }
    }

    /// Blocks this record still has to move in `direction`.
    pub(crate) fn pending(&self, direction: TransferDirection) -> usize {
        match direction {
            TransferDirection::Fetch => self.hashes.len() - self.fetch_start,
            _ => self.hashes.len() - self.start,
        }
    }

    /// Keeps chain positions `..end` (a fetch that delivered only part of its blocks); what
    /// remains is all on host, so no fetch part is left.
    pub(crate) fn truncate(&mut self, end: usize, block_size: usize) {
        self.hashes.truncate(end);
        self.tokens.truncate(end * block_size);
        self.chain.truncate(end);
        self.src.truncate(end.saturating_sub(self.src_offset));
        self.anchors.truncate(end.saturating_sub(self.start));
        self.fetch_start = end;
    }
}

/// Blocks `records` still have to move in `direction`.
pub(crate) fn pending_len(records: &[Pending], direction: TransferDirection) -> usize {
    records.iter().map(|r| r.pending(direction)).sum()
}

/// Taken, unconfirmed plans.
pub(crate) struct Taken {
    pub(crate) rank: usize,
    pub(crate) direction: TransferDirection,
    pub(crate) records: Vec<Pending>,
}

impl Taken {
    /// Lets go of the records in planning order, each table tail first (`Pending`'s `Drop`):
    /// of the blocks that become cache-only, the first record's are the oldest on the LRU
    /// (docs/contract.md, R10's choices).
    pub(crate) fn release(mut self) {
        for record in self.records.drain(..) {
            drop(record);
        }
    }
}
