//! Publication, after the KV exists (R17): the full computed blocks go into the prefix cache
//! (deduplicated, R9) and into every group (linked to the chain's full-attention entries, R7),
//! the groups slide (R25) and, at a step, plan what they plan (the checkpoint saves of R24).
//!
//! Invariants: nothing is published past the sequence's computed tokens; a group publishes only
//! positions the full-attention publication went through in the cache's epoch; a slide never
//! releases a block before it is published.

use crate::groups::OwnChain;
use crate::linear_state::Tail;
use crate::sequence::Sequence;

use super::{BlockManagerPool, Rank};

/// When the pool publishes a sequence's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Publish {
    /// `cache(seq)` after a step: may plan a checkpoint save.
    Step,
    /// `deallocate(seq)`.
    Release { all_released: bool },
}

/// Whether a publication happens at a step (`cache`, the batch step calls), where dedup on
/// publish switches duplicates (R9 revised); a release publishes with the physical rule.
fn step_publish(when: Publish) -> bool {
    when == Publish::Step
}

impl BlockManagerPool {
    /// Whether `publish` would change nothing (most decode steps): no other group to serve and
    /// no full computed block left to publish in the cache's current epoch. Tested first,
    /// without the division `publish` needs.
    #[inline]
    fn publish_is_noop(&self, seq: &Sequence) -> bool {
        let Some(alloc) = seq.alloc() else {
            return true;
        };
        if self.has_groups {
            return false;
        }
        match self.ranks[alloc.rank].full.cache() {
            None => true,
            Some(cache) => {
                alloc.published_epoch == cache.epoch()
                    && (alloc.blocks.len() <= alloc.published
                        || seq.computed() < (alloc.published + 1) * self.config.block_size)
            }
        }
    }

    /// Publishes the full computed blocks (R17) in the prefix cache and every group, then slides
    /// the groups; at a step, lets the groups plan what they plan at a step (R24). The chain
    /// hashes are computed only as far as something needs them.
    pub(super) fn publish(&mut self, seq: &mut Sequence, when: Publish) {
        if self.publish_is_noop(seq) {
            return;
        }
        let block_size = self.config.block_size;
        let computed = seq.computed();
        let prompt = seq.num_prompt_tokens();
        let seq_id = seq.seq_id();
        let (chain, tokens, key, alloc) = seq.split_for_publish();
        let Some(alloc) = alloc else { return };
        let rank_index = alloc.rank;
        let full = (computed / block_size).min(alloc.blocks.len());
        let Rank {
            full: attention,
            groups,
            ..
        } = &mut self.ranks[rank_index];
        let raw_key = key.map(|k| &**k);
        let epoch = attention.cache().map(|c| c.epoch());
        if let Some(epoch) = epoch {
            if alloc.published_epoch != epoch {
                alloc.published = 0;
                alloc.published_epoch = epoch;
            }
            if alloc.published < full {
                let hasher = attention.hasher();
                let hashes = chain.ensure(&hasher, block_size, tokens, raw_key, full * block_size);
                // R9 revised: dedup between steps, never while a planned copy is unconfirmed.
                let dedup = self.config.dedup
                    && step_publish(when)
                    && !alloc.groups.iter().any(|t| t.holds_plan(&self.ledger));
                alloc.published = if dedup {
                    let switches = &mut self.switch_scratch;
                    let reached = attention.publish_dedup(
                        hashes,
                        tokens,
                        &mut alloc.blocks[..full],
                        alloc.published,
                        key,
                        switches,
                    );
                    self.block_switches.extend(
                        switches
                            .drain(..)
                            .map(|(_, old, new)| (seq_id, 0, old, new)),
                    );
                    reached
                } else {
                    attention.publish(
                        hashes,
                        tokens,
                        &alloc.blocks[..full],
                        alloc.published,
                        key,
                        matches!(when, Publish::Release { all_released: true }),
                    )
                };
            }
        }
        let step = when == Publish::Step;
        for (group, table) in groups.iter_mut().zip(alloc.groups.iter_mut()) {
            let publish = epoch.is_some() && group.wants_publish(table, full, computed);
            let steps = step && group.steps();
            let save =
                steps && epoch.is_some() && full > 0 && group.saves_at(table, computed, prompt);
            let resolve = epoch.is_some() && group.awaits_anchors(table);
            // What the group stores is linked to the chain's full-attention entries (R7).
            let mut anchored = None;
            if publish || save || resolve {
                let hasher = attention.hasher();
                let hashes = chain.ensure(&hasher, block_size, tokens, raw_key, full * block_size);
                let mut own = OwnChain::new(
                    hashes,
                    tokens,
                    key,
                    &alloc.blocks,
                    attention.cache_mut(),
                    block_size,
                    alloc.published,
                );
                if publish {
                    group.publish(table, &mut own, full, computed);
                }
                if resolve {
                    group.anchor_saves(table, &mut own);
                }
                if save {
                    let tail = Tail {
                        tokens: tokens[(full - 1) * block_size..full * block_size].into(),
                        root_key: key.filter(|_| full == 1).cloned(),
                    };
                    anchored = Some((hashes[full - 1], own.link(full - 1), tail));
                }
            }
            group.slide(table, computed);
            if steps {
                if let Some(cache) = attention.cache() {
                    group.set_clock(cache.clock());
                }
                group.step(attention, table, computed, anchored, &mut self.ledger);
            }
        }
        self.collect_events(rank_index);
    }

    /// Publishes the groups' full computed blocks, then slides them (before a growth: the
    /// slide must not release blocks before they are published, R25).
    pub(super) fn publish_and_slide_groups(&mut self, seq: &mut Sequence) {
        let block_size = self.config.block_size;
        let computed = seq.computed();
        let (chain, tokens, key, alloc) = seq.split_for_publish();
        let Some(alloc) = alloc else { return };
        let full = (computed / block_size).min(alloc.blocks.len());
        let Rank {
            full: attention,
            groups,
            ..
        } = &mut self.ranks[alloc.rank];
        let Some(epoch) = attention.cache().map(|c| c.epoch()) else {
            for (group, table) in groups.iter_mut().zip(alloc.groups.iter_mut()) {
                group.slide(table, computed);
            }
            return;
        };
        // How far the full-attention publication got in the cache's epoch (anchors end there).
        let reach = match alloc.published_epoch == epoch {
            true => alloc.published,
            false => 0,
        };
        for (group, table) in groups.iter_mut().zip(alloc.groups.iter_mut()) {
            if group.wants_publish(table, full, computed) {
                let raw_key = key.map(|k| &**k);
                let hasher = attention.hasher();
                let hashes = chain.ensure(&hasher, block_size, tokens, raw_key, full * block_size);
                let mut own = OwnChain::new(
                    hashes,
                    tokens,
                    key,
                    &alloc.blocks,
                    attention.cache_mut(),
                    block_size,
                    reach,
                );
                group.publish(table, &mut own, full, computed);
            }
            group.slide(table, computed);
        }
    }
}
