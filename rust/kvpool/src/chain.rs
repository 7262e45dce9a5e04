//! The chain as the groups beside full attention see it: what a window block or a linear-state
//! checkpoint links to when it is stored, and is verified against when a hit takes it (R7).
//!
//! A window keeps only a chain's last blocks and a checkpoint only the state at its end, so
//! neither can walk a prefix from its root the way the full-attention cache does. Each verifies
//! as that cache does (hash, parent, tokens), with the full-attention cache standing in for the
//! parent: what is stored for chain position `i` records its **link**, the anchor of the
//! full-attention entry of position `i - 1` (`prefix_cache/anchors.rs`; for a chain's first
//! block the root, [`ROOT`], with the chain's extra key stored beside it), with its hash and
//! its tokens. A hit at position `i` takes it only where the query's verified walk (device, or
//! host) reaches an entry with that anchor at `i - 1` (or, at the root, the query has that
//! extra key) and the tokens of block `i` are the query's: the prefix before is then the
//! query's (an anchor names one prefix for ever), and so is the block. [`OwnChain`] finds the
//! links of a sequence that publishes, [`QueryChain`] checks them.
//!
//! Linking to the parent rather than to the block's own entry keeps a link valid when the
//! full-attention cache evicts the chain's last block and a later request computes it again;
//! a first block's link never goes stale.

use crate::block::Block;
use crate::hash::BlockHash;
use crate::prefix_cache::{is_ticket, Anchor, ExtraKey, PrefixCache, CACHE_ONLY_BIT};

/// The link of a chain's first block: its parent is the root, named by the extra key stored
/// beside the link. Anchors stay below it.
pub(crate) use crate::prefix_cache::ROOT_LINK as ROOT;

/// A query's chain with the entries its walks verified (R7): `device` from block 0, `host` from
/// block 0 in the host tier (when the admission walked it).
pub(crate) struct QueryChain<'a> {
    pub(crate) hashes: &'a [BlockHash],
    pub(crate) tokens: &'a [u32],
    extra_key: Option<&'a [u8]>,
    device: Option<(&'a PrefixCache, &'a [u32])>,
    host: Option<(&'a PrefixCache, &'a [u32])>,
}

impl<'a> QueryChain<'a> {
    /// The chain of `hashes`, `tokens` and `extra_key` with the walked ids (flags ignored) of
    /// each tier.
    pub(crate) fn new(
        (hashes, tokens, extra_key): (&'a [BlockHash], &'a [u32], Option<&'a [u8]>),
        device: Option<(&'a PrefixCache, &'a [u32])>,
        host: Option<(&'a PrefixCache, &'a [u32])>,
    ) -> Self {
        Self {
            hashes,
            tokens,
            extra_key,
            device,
            host,
        }
    }

    /// How many chain positions the walks verified (device, or host past it): where the query
    /// leaves the cached prefix tree.
    pub(crate) fn walked(&self) -> usize {
        let len = |tier: Option<(&PrefixCache, &[u32])>| tier.map_or(0, |(_, ids)| ids.len());
        len(self.device).max(len(self.host))
    }

    /// The device cache with the ids its walk verified (a group of the shared store reads the
    /// runs attached to them).
    pub(crate) fn device(&self) -> Option<(&'a PrefixCache, &'a [u32])> {
        self.device
    }

    /// Whether `link` (recorded for position `i` by [`OwnChain::link`], with `root_key`, the
    /// extra key stored beside a [`ROOT`] link) is this chain's at position `i`: a walk that
    /// verified position `i - 1` reached the entry that carries its anchor, or `i` is 0 and the
    /// chain has that extra key. Never for 0 or a ticket. The caller compares the tokens of
    /// block `i` (and the hash it found the link under).
    #[inline]
    pub(crate) fn links(&self, i: usize, link: Anchor, root_key: Option<&[u8]>) -> bool {
        if i == 0 {
            return link == ROOT && root_key == self.extra_key;
        }
        if link == 0 || link == ROOT || is_ticket(link) {
            return false;
        }
        let reaches = |tier: Option<(&PrefixCache, &[u32])>| {
            tier.and_then(|(cache, ids)| {
                ids.get(i - 1)
                    .map(|&id| cache.anchor_of(id & !CACHE_ONLY_BIT))
            }) == Some(link)
        };
        reaches(self.device) || reaches(self.host)
    }
}

/// A sequence's own chain while it publishes: its full-attention table and the device cache,
/// to find the anchors of its full blocks' entries and so the links of its positions.
pub(crate) struct OwnChain<'a> {
    pub(crate) hashes: &'a [BlockHash],
    pub(crate) tokens: &'a [u32],
    pub(crate) extra_key: Option<&'a ExtraKey>,
    blocks: &'a [Block],
    cache: Option<&'a mut PrefixCache>,
    block_size: usize,
    /// Chain positions the full-attention publication went through in the cache's epoch.
    reach: usize,
    /// The last position resolved and its entry.
    memo: Option<(usize, u32)>,
}

impl<'a> OwnChain<'a> {
    /// `reach`: how far the full-attention publication of this table got (its `published`, or
    /// 0 when the cache was reset since).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        hashes: &'a [BlockHash],
        tokens: &'a [u32],
        extra_key: Option<&'a ExtraKey>,
        blocks: &'a [Block],
        cache: Option<&'a mut PrefixCache>,
        block_size: usize,
        reach: usize,
    ) -> Self {
        Self {
            hashes,
            tokens,
            extra_key,
            blocks,
            cache,
            block_size,
            reach,
            memo: None,
        }
    }

    /// The sequence's full-attention table.
    pub(crate) fn blocks(&self) -> &'a [Block] {
        self.blocks
    }

    /// The device cache (a group of the shared store attaches its blocks to its entries).
    pub(crate) fn cache_mut(&mut self) -> Option<&mut PrefixCache> {
        self.cache.as_deref_mut()
    }

    /// Positions `..reach()` went through the full-attention publication: the groups publish no
    /// further (a later step anchors the rest).
    pub(crate) fn reach(&self) -> usize {
        self.reach
    }

    /// The link of chain position `i` (module doc: [`ROOT`] at 0, with the chain's extra key);
    /// 0 if the position before is not cached as this chain's.
    pub(crate) fn link(&mut self, i: usize) -> Anchor {
        match i {
            0 => ROOT,
            _ => self.anchor(i - 1),
        }
    }

    /// The anchor of chain position `i` (given now if its entry has none); 0 if the position is
    /// not cached as this chain's.
    pub(crate) fn anchor(&mut self, i: usize) -> Anchor {
        match self.entry(i) {
            Some(id) => self.cache.as_deref_mut().map_or(0, |c| c.anchor(id)),
            None => 0,
        }
    }

    /// The cached entry of chain position `i`: the sequence's own block when it is that entry
    /// (a block a sequence holds carries its prefix's KV, so an entry it holds is its chain's),
    /// else the verified entry under the nearest resolved position before it (a duplicate left
    /// private: a table published without dedup).
    pub(crate) fn entry(&mut self, i: usize) -> Option<u32> {
        if let Some((j, e)) = self.memo {
            if j == i {
                return Some(e);
            }
        }
        let cache = self.cache.as_deref()?;
        if i >= self.blocks.len() || i >= self.hashes.len() {
            return None;
        }
        let own = |k: usize| {
            let id = self.blocks[k].id();
            cache.is_entry(id, self.hashes[k]).then_some(id)
        };
        let found = match own(i) {
            Some(id) => id,
            None => {
                let (mut k, mut parent) = (i, None);
                while k > 0 {
                    parent = match self.memo {
                        Some((j, e)) if j + 1 == k => Some(e),
                        _ => own(k - 1),
                    };
                    if parent.is_some() {
                        break;
                    }
                    k -= 1;
                }
                let key = self.extra_key.map(|k| &**k);
                let bs = self.block_size;
                for p in k..=i {
                    let block = self.tokens.get(p * bs..(p + 1) * bs)?;
                    parent = Some(cache.find_entry(self.hashes[p], parent, key, block)?);
                }
                parent?
            }
        };
        self.memo = Some((i, found));
        Some(found)
    }
}

#[cfg(test)]
mod tests {
    //! The anchors' graves (`prefix_cache/graves.rs`), through the public manager.
    use crate::hash::BlockHasher;
    use crate::manager::{BlockManager, BlockManagerImpl, ManagerConfig};

    fn manager(bits: u32) -> BlockManagerImpl {
        let mut config = ManagerConfig::new(8, 2);
        config.hasher = BlockHasher::with_debug_bits(crate::hash::DEFAULT_HASH_SEED, bits);
        let mut m = BlockManagerImpl::new(config).unwrap();
        m.prefix_cache_mut().unwrap().keep_graves(true);
        m
    }

    /// Caches `tokens` in fresh blocks and releases them; returns the block ids.
    fn publish(m: &mut BlockManagerImpl, tokens: &[u32]) -> Vec<u32> {
        let blocks = m.allocate(tokens.len() / 2).unwrap();
        m.cache(tokens, &blocks, None).unwrap();
        let ids = blocks.iter().map(|b| b.id()).collect();
        m.deallocate(blocks).unwrap();
        ids
    }

    #[test]
    fn a_chain_computed_again_gets_its_anchors_back_and_no_other_chain_does() {
        let mut m = manager(128);
        let ids = publish(&mut m, &[1, 2, 3, 4, 5, 6]);
        let cache = m.prefix_cache_mut().unwrap();
        let anchors: Vec<u64> = ids.iter().map(|&id| cache.anchor(id)).collect();
        assert!(anchors.iter().all(|&a| a != 0));
        assert_eq!(cache.evict(3), 3);
        assert!(
            ids.iter().all(|&id| cache.anchor_of(id) == 0),
            "anchors leave"
        );
        cache.check().unwrap();
        // Another chain under the same first block: its first entry is the same position.
        let other = publish(&mut m, &[1, 2, 9, 9]);
        let cache = m.prefix_cache_mut().unwrap();
        assert_eq!(
            cache.anchor_of(other[0]),
            anchors[0],
            "the same first block"
        );
        assert_eq!(
            cache.anchor_of(other[1]),
            0,
            "another position keeps nothing"
        );
        assert_eq!(cache.evict(2), 2);
        let again = publish(&mut m, &[1, 2, 3, 4, 5, 6]);
        let cache = m.prefix_cache_mut().unwrap();
        let back: Vec<u64> = again.iter().map(|&id| cache.anchor_of(id)).collect();
        assert_eq!(
            back, anchors,
            "the same chain positions take their anchors back"
        );
        cache.check().unwrap();
    }

    #[test]
    fn a_colliding_chain_never_takes_an_anchor() {
        // 1-bit hashes: [7, 7] and [8, 8] may share a hash, never an anchor.
        let mut m = manager(1);
        let ids = publish(&mut m, &[7, 7]);
        let cache = m.prefix_cache_mut().unwrap();
        let anchor = cache.anchor(ids[0]);
        assert_eq!(cache.evict(1), 1);
        for tokens in [[8u32, 8], [9, 9], [7, 8]] {
            let other = publish(&mut m, &tokens);
            let cache = m.prefix_cache_mut().unwrap();
            assert_ne!(cache.anchor_of(other[0]), anchor, "{tokens:?}");
            cache.evict(1);
            cache.check().unwrap();
        }
        let again = publish(&mut m, &[7, 7]);
        assert_eq!(m.prefix_cache().unwrap().anchor_of(again[0]), anchor);
    }
}
