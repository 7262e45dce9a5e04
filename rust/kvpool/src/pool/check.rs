//! `check` (R20): every structure of every rank, the planned copies and the host tier; and
//! `check_sequence`: a sequence against the pool.

use crate::error::{ensure_invariant, Result};
use crate::groups::Group;
use crate::manager::BlockManager;
use crate::sequence::Sequence;

use super::BlockManagerPool;

impl BlockManagerPool {
    /// Walks every structure of every rank (R20), the planned linear-state copies and, with a
    /// host tier, both tiers and every pending transfer (R26).
    pub fn check(&self) -> Result<()> {
        for (index, rank) in self.ranks.iter().enumerate() {
            rank.full.check().map_err(|e| e.in_rank(index, ""))?;
            rank.single.check().map_err(|e| e.in_rank(index, ""))?;
            for group in &rank.groups {
                group
                    .check(&rank.full, &self.ledger)
                    .map_err(|e| e.in_rank(index, ""))?;
            }
        }
        self.ledger.check(|rank| {
            self.ranks
                .get(rank)
                .and_then(|r| r.groups.iter().find_map(Group::as_linear))
                .map(|g| g.cache())
        })?;
        self.check_hints()?;
        if let Some(host) = &self.host {
            let devices: Vec<_> = self.ranks.iter().filter_map(|r| r.full.paged()).collect();
            host.check(&devices)?;
        }
        Ok(())
    }

    /// Checks a sequence against this pool: its tables, slots, counts and ownership.
    pub fn check_sequence(&self, seq: &Sequence) -> Result<()> {
        if !self.check_owner(seq)? {
            ensure_invariant!(
                seq.alloc().is_none() && seq.blocks().is_empty(),
                "unallocated sequence holds blocks"
            );
            return Ok(());
        }
        let Some(alloc) = seq.alloc() else {
            return Ok(());
        };
        ensure_invariant!(
            alloc.rank < self.ranks.len() && seq.dp_rank() == Some(alloc.rank),
            "allocated sequence has no valid dp rank"
        );
        let rank = &self.ranks[alloc.rank];
        ensure_invariant!(
            alloc.blocks.iter().all(|b| rank.full.owns(b)) && rank.single.owns(&alloc.single),
            "sequence holds foreign blocks"
        );
        ensure_invariant!(
            seq.cached() <= seq.computed()
                && seq.num_computed_tokens() <= seq.len()
                && seq.num_computed_tokens() <= seq.capacity(),
            "sequence {} token counts out of order (R17)",
            seq.seq_id()
        );
        ensure_invariant!(
            alloc.groups.len() == rank.groups.len(),
            "sequence {} holds {} group tables for {} groups",
            seq.seq_id(),
            alloc.groups.len(),
            rank.groups.len()
        );
        for (group, table) in rank.groups.iter().zip(&alloc.groups) {
            group.check_table(&rank.full, table, alloc.blocks.len(), seq.seq_id())?;
        }
        Ok(())
    }
}
