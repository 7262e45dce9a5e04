//! Session hints (docs/sessions.md, R11's choice): a sequence's published
//! prefix kept from eviction while its session is away (an agent's tool call, a user reading
//! the answer), until the hint's time to live runs out on the caller's clock, or the caller
//! releases it (the session came back, or ended).
//!
//! A hint holds a handle of every block of the prefix, so its blocks are used, not cached: no
//! eviction takes them and no admission counts them as available (R15 stays exact). The blocks
//! held by hints are capped per rank at `max_retained_fraction` of its blocks, counted once
//! however many hints hold them, so hints can never starve admission; a hint over the cap is
//! refused whole. Full attention only: a hybrid group keeps its runs and checkpoints by its own
//! retention rules (docs/hybrid.md), so a pool with other groups refuses hints.
//!
//! Invariants (checked by [`BlockManagerPool::check`]): every hint's blocks are blocks of its
//! rank's store; `counts[rank][id]` is the number of hints holding `id`, and `held[rank]` the
//! number of ids with a count, at most the cap.

use std::collections::HashMap;

use crate::block::Block;
use crate::error::{ensure_arg, ensure_invariant, KvPoolError, Result};
use crate::sequence::Sequence;

use super::{BlockManagerPool, Publish};

/// One session hint.
struct Hint {
    rank: usize,
    blocks: Vec<Block>,
    /// On the caller's clock.
    expires: f64,
}

/// The hints of a pool, by the id of the sequence they were taken from.
#[derive(Default)]
pub(crate) struct Hints {
    hints: HashMap<u64, Hint>,
    /// Per rank: hints holding each block id.
    counts: Vec<HashMap<u32, u32>>,
    /// Per rank: block ids some hint holds.
    held: Vec<usize>,
}

impl Hints {
    fn ensure_ranks(&mut self, ranks: usize) {
        if self.counts.len() < ranks {
            self.counts.resize_with(ranks, HashMap::new);
            self.held.resize(ranks, 0);
        }
    }

    fn drop_hint(&mut self, hint: Hint) {
        let counts = &mut self.counts[hint.rank];
        for block in &hint.blocks {
            let id = block.id();
            if let Some(count) = counts.get_mut(&id) {
                *count -= 1;
                if *count == 0 {
                    counts.remove(&id);
                    self.held[hint.rank] -= 1;
                }
            }
        }
        drop(hint); // the handles go: the blocks are cache-only again, at the newest end (R11)
    }
}

impl BlockManagerPool {
    /// The most blocks hints may hold on one rank.
    fn retain_cap(&self) -> usize {
        let usable = self.config.num_blocks.saturating_sub(1) as f64;
        (usable * self.config.max_retained_fraction).floor() as usize
    }

    /// Keeps `seq`'s published prefix (its computed full blocks, published first) from eviction
    /// until `now + ttl` on the caller's clock, or until [`Self::release_retained`]; a hint
    /// taken from the same sequence id before is replaced. Call it before `deallocate`. Returns
    /// false, keeping nothing, when the hint would take the rank's retained blocks over
    /// `max_retained_fraction` of its blocks. Hints that expired by `now` are dropped first.
    pub fn retain(&mut self, seq: &mut Sequence, ttl: f64, now: f64) -> Result<bool> {
        ensure_arg!(
            ttl.is_finite() && ttl >= 0.0,
            "ttl",
            "must be a finite number >= 0, got {ttl}"
        );
        ensure_arg!(now.is_finite(), "now", "must be a finite number, got {now}");
        ensure_arg!(
            !self.has_groups,
            "seq",
            "session hints keep full-attention prefixes; this pool's other groups keep theirs by \
             their own retention rules (docs/hybrid.md)"
        );
        ensure_arg!(
            self.ranks.iter().all(|r| r.full.cache().is_some()),
            "seq",
            "session hints need the prefix cache (enable_prefix_cache=True)"
        );
        if !self.take_seq(seq)? {
            return Err(KvPoolError::invalid(
                "seq",
                format!("sequence {} holds no blocks of this pool", seq.seq_id()),
            ));
        }
        self.expire_retained(now)?;
        self.generation += 1;
        self.publish(seq, Publish::Step);
        let Some(alloc) = seq.alloc() else {
            return Ok(false);
        };
        let epoch = self.ranks[alloc.rank].full.cache().map(|c| c.epoch());
        let published = match epoch == Some(alloc.published_epoch) {
            true => alloc.published.min(alloc.blocks.len()),
            false => 0,
        };
        let rank = alloc.rank;
        let blocks: Vec<Block> = alloc.blocks[..published].to_vec();
        let id = seq.seq_id();
        self.hints.ensure_ranks(self.ranks.len());
        let old = self.hints.hints.remove(&id);
        if let Some(old) = old {
            self.hints.drop_hint(old);
        }
        let counts = &self.hints.counts[rank];
        let new = blocks
            .iter()
            .filter(|b| !counts.contains_key(&b.id()))
            .count();
        if self.hints.held[rank] + new > self.retain_cap() {
            return Ok(false);
        }
        let counts = &mut self.hints.counts[rank];
        for block in &blocks {
            *counts.entry(block.id()).or_insert(0) += 1;
        }
        self.hints.held[rank] += new;
        let expires = now + ttl;
        self.hints.hints.insert(
            id,
            Hint {
                rank,
                blocks,
                expires,
            },
        );
        Ok(true)
    }

    /// Ends the hint taken from the sequence with id `seq_id` (its session came back or ended);
    /// returns whether there was one.
    pub fn release_retained(&mut self, seq_id: u64) -> bool {
        match self.hints.hints.remove(&seq_id) {
            Some(hint) => {
                self.generation += 1;
                self.hints.drop_hint(hint);
                true
            }
            None => false,
        }
    }

    /// Drops the hints whose time to live ran out by `now` (the caller's clock); returns how
    /// many.
    pub fn expire_retained(&mut self, now: f64) -> Result<usize> {
        ensure_arg!(now.is_finite(), "now", "must be a finite number, got {now}");
        let expired: Vec<u64> = self
            .hints
            .hints
            .iter()
            .filter(|(_, h)| h.expires <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in &expired {
            if let Some(hint) = self.hints.hints.remove(id) {
                self.hints.drop_hint(hint);
            }
        }
        if !expired.is_empty() {
            self.generation += 1;
        }
        Ok(expired.len())
    }

    /// Hints held now.
    pub fn num_retained(&self) -> usize {
        self.hints.hints.len()
    }

    /// Block ids hints hold on `rank` (counted once however many hints hold them).
    pub fn num_retained_blocks(&self, rank: usize) -> usize {
        self.hints.held.get(rank).copied().unwrap_or(0)
    }

    /// Walks the hints (module doc invariants).
    pub(crate) fn check_hints(&self) -> Result<()> {
        let mut counts: Vec<HashMap<u32, u32>> = vec![HashMap::new(); self.hints.counts.len()];
        for (id, hint) in &self.hints.hints {
            ensure_invariant!(
                hint.rank < counts.len(),
                "session hint {id} names rank {}",
                hint.rank
            );
            for block in &hint.blocks {
                ensure_invariant!(
                    self.ranks[hint.rank].full.owns(block),
                    "session hint {id} holds a block of another store"
                );
                *counts[hint.rank].entry(block.id()).or_insert(0) += 1;
            }
        }
        for (rank, expected) in counts.iter().enumerate() {
            ensure_invariant!(
                *expected == self.hints.counts[rank]
                    && self.hints.held[rank] == expected.len()
                    && expected.len() <= self.retain_cap(),
                "session hints of rank {rank}: the block counts drifted or passed the cap"
            );
        }
        Ok(())
    }
}
