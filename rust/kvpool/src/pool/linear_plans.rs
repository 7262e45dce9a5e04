//! The recurrent-state copies of R24 as plans: the pool hands the worker every copy planned
//! since the last take, for all ranks at once, and the worker confirms the plan once it copied.

use crate::error::{ensure_arg, Result};
use crate::groups::{Group, OpKind};
use crate::hash::BlockHash;
use crate::sequence::Sequence;

use super::BlockManagerPool;

/// What the worker must do to the recurrent state before the next forward step (R24), for all
/// ranks, in this order: zero every slot of `zero_slots` (live slots taken without a restore),
/// then every restore (`restore_src -> restore_dst`), then every save (`save_src -> save_dst`,
/// the checkpoint of `save_hashes[i]`). Confirm with `commit_linear_state_plan` once done.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinearStatePlan {
    pool_id: u64,
    plan_id: u64,
    ops: Vec<u64>,
    /// dp rank of each zeroed slot.
    pub zero_dp_rank: Vec<i32>,
    /// Live slots to fill with zeros (a sequence admitted without a restore starts from the
    /// zero state; the slot may hold an earlier sequence's state).
    pub zero_slots: Vec<i32>,
    /// dp rank of each restore.
    pub restore_dp_rank: Vec<i32>,
    /// Checkpoint slots to read.
    pub restore_src: Vec<i32>,
    /// Live slots to write.
    pub restore_dst: Vec<i32>,
    /// dp rank of each save.
    pub save_dp_rank: Vec<i32>,
    /// Live slots to read.
    pub save_src: Vec<i32>,
    /// Pending checkpoint slots to write.
    pub save_dst: Vec<i32>,
    /// Prefix hash of each saved checkpoint.
    pub save_hashes: Vec<BlockHash>,
}

impl LinearStatePlan {
    /// Number of operations (zeroed slots, restores and saves).
    pub fn len(&self) -> usize {
        self.zero_slots.len() + self.restore_src.len() + self.save_src.len()
    }

    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl BlockManagerPool {
    /// R24: the recurrent-state copies planned since the last call, for every rank.
    pub fn take_linear_state_plan(&mut self) -> LinearStatePlan {
        self.generation += 1;
        let plan_id = self.next_plan;
        self.next_plan += 1;
        let mut plan = LinearStatePlan {
            pool_id: self.id,
            plan_id,
            ..LinearStatePlan::default()
        };
        // Zeros first: a slot's earlier state is gone before anything is copied into it.
        for (rank, slot) in std::mem::take(&mut self.ledger.zeros) {
            plan.zero_dp_rank.push(rank as i32);
            plan.zero_slots.push(slot as i32);
        }
        for id in std::mem::take(&mut self.ledger.untaken) {
            let Some(op) = self.ledger.ops.get_mut(&id) else {
                debug_assert!(false, "untaken copies are registered");
                continue;
            };
            op.taken = true;
            let rank = op.rank as i32;
            match op.kind {
                OpKind::Restore | OpKind::Promote => {
                    plan.restore_dp_rank.push(rank);
                    plan.restore_src.push(op.src as i32);
                    plan.restore_dst.push(op.dst as i32);
                }
                OpKind::Save => {
                    plan.save_dp_rank.push(rank);
                    plan.save_src.push(op.src as i32);
                    plan.save_dst.push(op.dst as i32);
                    plan.save_hashes.push(op.hash);
                }
            }
            plan.ops.push(id);
        }
        self.open_plans.insert(plan_id);
        plan
    }

    /// R24: the worker made the copies of `plan`: saved checkpoints become matchable, restored
    /// checkpoints are unpinned, cancelled saves free their slots.
    pub fn commit_linear_state_plan(&mut self, plan: &LinearStatePlan) -> Result<()> {
        ensure_arg!(
            plan.pool_id == self.id,
            "plan",
            "was taken from another pool"
        );
        ensure_arg!(
            self.open_plans.remove(&plan.plan_id),
            "plan",
            "was already committed"
        );
        self.generation += 1;
        for id in &plan.ops {
            let Some(op) = self.ledger.ops.remove(id) else {
                continue;
            };
            let group = self
                .ranks
                .get_mut(op.rank)
                .and_then(|r| r.groups.iter_mut().find_map(Group::as_linear_mut));
            match group {
                Some(group) => group.finish_op(op),
                None => debug_assert!(false, "a copy of a rank without linear state"),
            }
        }
        for rank in 0..self.ranks.len() {
            self.collect_events(rank); // the committed checkpoints (R21)
        }
        Ok(())
    }

    /// R24: the smallest computed-token count in `(num_computed_tokens, len(seq)]` at which
    /// `cache(seq)` plans a checkpoint save: the next multiple of `checkpoint_interval`, the
    /// prompt's last block boundary, or its junction (where the prompt left the cached prefix
    /// tree at admission). `None` without linear state or when no boundary is left.
    /// A prefill chunk that passes a boundary without ending on it saves nothing for it, so
    /// engines end their chunks here. A sequence of another pool is an error naming `seq`.
    pub fn next_checkpoint_boundary(&self, seq: &mut Sequence) -> Result<Option<usize>> {
        self.take_seq(seq)?;
        if self.config.linear_state_slots == 0 {
            return Ok(None);
        }
        let bs = self.config.block_size;
        let computed = seq.num_computed_tokens();
        let prompt_end = seq.num_prompt_tokens() / bs * bs;
        let interval = self
            .config
            .checkpoint_interval
            .and_then(|t| (computed / t).checked_add(1)?.checked_mul(t));
        let junction = seq.alloc().and_then(|alloc| {
            let groups = &self.ranks[alloc.rank].groups;
            groups
                .iter()
                .zip(&alloc.groups)
                .find_map(|(group, table)| group.junction(table))
        });
        let boundary = [
            Some(prompt_end).filter(|&b| b > computed),
            interval,
            junction.filter(|&b| b > computed),
        ]
        .into_iter()
        .flatten()
        .min();
        Ok(boundary.filter(|&b| b <= seq.len()))
    }

    /// Copies planned and not yet confirmed.
    pub fn num_pending_linear_state_copies(&self) -> usize {
        self.ledger.ops.len()
    }
}
