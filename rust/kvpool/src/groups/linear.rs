//! The linear-state group of a rank (R22-R24): a [`LinearStatePrefixCache`] as a group, and the
//! ledger of the recurrent-state copies the pool plans for the worker.
//!
//! Hit limit: the checkpoint trim of R23, the deepest boundary (or the end of the contiguous run
//! from block 0) whose prefix has a committed checkpoint; checkpoints live on the device only, so
//! the same limit trims a hit that continues in a host tier. A checkpoint the pool saved records
//! the link of its boundary's last block (the anchor of the full-attention entry before it,
//! `crate::chain`) and that block's tokens, and serves a query only where the query's verified
//! walk reaches the linked entry and its last block has those tokens (R7): a prefix hash alone
//! never restores another prompt's state. A save whose boundary is not cached as the sequence's chain
//! yet (the full-attention publication waits for a deferred dedup, R9) carries a ticket that
//! matches nothing; the sequence's next publication resolves it, and its release evicts what is
//! still unresolved (it could never be matched). Taking the hit pins that checkpoint;
//! the sequence then takes a live slot and a restore copy is planned. At a step the group plans a
//! checkpoint save where the live state is exactly a boundary's state (R24); at release it cancels
//! the sequence's unconfirmed copies.
//!
//! Invariants (checked by [`LinearGroup::check`] and [`Ledger::check`]): every planned restore or
//! promotion pins its checkpoint and every planned save holds a pending slot that belongs to the
//! plan (`LinearStatePrefixCache::reserve_planned`); a copy's extra pins (F2) are pinned; an
//! untaken copy is never cancelled; the ranks' planned checkpoints are exactly the planned saves.
//!
//! Saved boundaries: a sequence saves each boundary once (`last_saved_boundary`); a
//! `reset_prefix_cache` forgets what it saved, so a step at the boundary it stands at saves it
//! again (docs/contract.md, R24's choices).

use std::collections::HashMap;

use crate::block::Block;
use crate::error::{ensure_invariant, KvPoolError, Result};
use crate::hash::BlockHash;
use crate::linear_state::{LinearStatePrefixCache, Tail};
use crate::prefix_cache::{is_ticket, ticket, Anchor};

use super::{FullGroup, OwnChain, QueryChain};

mod one_store;

/// R23: which checkpointed boundary a KV prefix hit is trimmed to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LinearStateMatch {
    /// The deepest boundary inside the KV hit whose prefix has a committed checkpoint.
    #[default]
    Deepest,
    /// The end of the longest run of checkpointed boundaries from block 0 (xLLM's design doc).
    Contiguous,
}

impl LinearStateMatch {
    /// From "deepest" or "contiguous".
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "deepest" => Ok(Self::Deepest),
            "contiguous" => Ok(Self::Contiguous),
            other => Err(KvPoolError::invalid(
                "linear_state_match",
                format!("must be \"deepest\" or \"contiguous\", got {other:?}"),
            )),
        }
    }
}

/// R22: how the pool saves a checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LinearStateSave {
    /// Reserve a pending slot; the worker copies the live state into it, then the plan's commit
    /// makes it matchable.
    #[default]
    Copy,
    /// Zero-copy promotion: the live slot becomes the committed checkpoint at once and the
    /// sequence continues in a fresh slot (the worker copies the old slot into the new one
    /// before the next step, listed with the restores).
    Promote,
}

impl LinearStateSave {
    /// From "copy" or "promote".
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "copy" => Ok(Self::Copy),
            "promote" => Ok(Self::Promote),
            other => Err(KvPoolError::invalid(
                "linear_state_save",
                format!("must be \"copy\" or \"promote\", got {other:?}"),
            )),
        }
    }
}

/// What a sequence holds of the linear-state group.
#[derive(Debug, Default)]
pub(crate) struct LinearTable {
    /// The live recurrent-state slot (R22), once taken.
    pub(crate) slot: Option<Block>,
    /// The checkpoint slot the live state was restored from at allocation (R23).
    pub(crate) restore_slot: Option<u32>,
    /// The prefix hash of that checkpoint (pinned until the restore copy is planned).
    restore: Option<BlockHash>,
    /// Copies of this sequence not yet confirmed (R24).
    pub(crate) ops: Vec<u64>,
    /// Computed tokens at the last planned save or at the restore (no boundary is saved twice,
    /// none before the restored one).
    last_saved_boundary: usize,
    /// The group's reset count when `last_saved_boundary` was set (a reset forgets it).
    saved_in: u64,
    /// Saves planned with a ticket for their link: (the boundary's last block, prefix hash,
    /// ticket).
    unanchored: Vec<(usize, BlockHash, Anchor)>,
    /// Computed tokens where the prompt left the cached prefix tree, past the restored
    /// boundary (0: none): a shared boundary, saved as a checkpoint (R24's junction save).
    junction: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind {
    /// Copy a committed checkpoint (pinned) into a live slot.
    Restore,
    /// Copy a live slot into a pending checkpoint.
    Save,
    /// Copy a promoted (committed, pinned) checkpoint into the sequence's fresh live slot.
    Promote,
}

/// One planned copy; it holds the live slot it touches so the slot cannot be reused before the
/// copy is confirmed, even if the sequence is dropped.
pub(crate) struct LinearOp {
    pub(crate) rank: usize,
    pub(crate) kind: OpKind,
    pub(crate) hash: BlockHash,
    pub(crate) src: u32,
    pub(crate) dst: u32,
    /// Saves: the computed tokens whose state the save reads (its boundary, R24).
    boundary: usize,
    pub(crate) taken: bool,
    pub(crate) cancelled: bool,
    /// Checkpoints the held slot became (promoted) while this copy was in flight: pinned until
    /// the copy is confirmed, since evicting them would free nothing (F2).
    pins: Vec<BlockHash>,
    live: Block,
}

impl LinearOp {
    fn new(rank: usize, kind: OpKind, hash: BlockHash, src: u32, live: Block) -> Self {
        Self {
            rank,
            kind,
            hash,
            src,
            dst: live.id(),
            boundary: 0,
            taken: false,
            cancelled: false,
            pins: Vec::new(),
            live,
        }
    }
}

/// The planned copies of a pool, over all its ranks (one plan serves every rank, R24).
#[derive(Default)]
pub(crate) struct Ledger {
    pub(crate) ops: HashMap<u64, LinearOp>,
    /// Planned and not yet taken, in planning order.
    pub(crate) untaken: Vec<u64>,
    /// (rank, slot): live slots taken without a restore, to be zeroed by the worker before
    /// their sequence's first step (a recycled slot holds an earlier sequence's state); not yet
    /// taken, each slot once. A release drops its own. A sequence dropped without release
    /// leaves its entry: zeroing a slot is harmless before the copies of the same plan, which
    /// run after the zeros, and no step runs on a slot before the plan that zeroes it.
    pub(crate) zeros: Vec<(usize, u32)>,
    next_op: u64,
}

impl Ledger {
    fn add(&mut self, table_ops: &mut Vec<u64>, op: LinearOp) {
        self.next_op += 1;
        let id = self.next_op;
        self.ops.insert(id, op);
        self.untaken.push(id);
        let ops = &self.ops;
        table_ops.retain(|id| ops.contains_key(id));
        table_ops.push(id);
    }

    /// Removes an untaken copy.
    fn remove_untaken(&mut self, id: u64) -> Option<LinearOp> {
        let op = self.ops.remove(&id)?;
        self.untaken.retain(|&u| u != id);
        Some(op)
    }

    /// Walks the copies against the ranks' caches (`cache(rank)`).
    pub(crate) fn check<'a>(
        &self,
        cache: impl Fn(usize) -> Option<&'a LinearStatePrefixCache>,
    ) -> Result<()> {
        for (id, op) in &self.ops {
            let Some(linear) = cache(op.rank) else {
                return Err(KvPoolError::Invariant(format!(
                    "linear-state copy {id} names rank {} without linear state",
                    op.rank
                )));
            };
            let ok = match op.kind {
                OpKind::Restore | OpKind::Promote => linear.is_pinned(op.hash),
                OpKind::Save => linear.is_pending(op.hash) && linear.is_planned(op.hash),
            };
            ensure_invariant!(
                ok,
                "linear-state copy {id} ({:?}) lost its checkpoint (R24)",
                op.kind
            );
            ensure_invariant!(
                op.pins.iter().all(|&h| linear.is_pinned(h)),
                "linear-state copy {id} lost a checkpoint it pins (F2)"
            );
            ensure_invariant!(
                op.taken || !op.cancelled,
                "an untaken linear-state copy {id} is cancelled"
            );
        }
        ensure_invariant!(
            self.untaken.iter().all(|id| self.ops.contains_key(id)),
            "an untaken linear-state copy is missing"
        );
        for (i, &(rank, slot)) in self.zeros.iter().enumerate() {
            ensure_invariant!(
                cache(rank).is_some_and(|c| slot > 0 && (slot as usize) < c.num_slots()),
                "a planned zero names slot {slot}, not a slot of rank {rank}"
            );
            ensure_invariant!(
                !self.zeros[..i].contains(&(rank, slot)),
                "slot {slot} of rank {rank} is zeroed twice"
            );
        }
        Ok(())
    }

    /// Planned saves of `rank`.
    pub(crate) fn num_saves(&self, rank: usize) -> usize {
        self.ops
            .values()
            .filter(|op| op.rank == rank && op.kind == OpKind::Save)
            .count()
    }
}

/// The linear-state group of one rank.
pub(crate) struct LinearGroup {
    cache: LinearStatePrefixCache,
    rank: usize,
    block_size: usize,
    checkpoint_interval: Option<usize>,
    rule: LinearStateMatch,
    save: LinearStateSave,
    /// Allocations whose state is restored from a checkpoint (stats).
    hits: u64,
    /// `reset_prefix_cache` calls so far.
    resets: u64,
    /// One store (docs/hybrid.md "Linear state in the one store"): how many blocks of the
    /// full-attention group's store a state takes (0: the slots are a store of their own).
    blocks_per_state: usize,
    /// The group's position after full attention: its blocks' owner in the memory census.
    owner: u8,
    /// Blocks of the store held for the states: at least `blocks_per_state` per slot in use
    /// (more after slots went free, until the store asks for them: [`Self::make_room`]).
    budget: Vec<Block>,
}

impl LinearGroup {
    pub(crate) fn new(
        cache: LinearStatePrefixCache,
        rank: usize,
        block_size: usize,
        checkpoint_interval: Option<usize>,
        rule: LinearStateMatch,
        save: LinearStateSave,
    ) -> Self {
        Self {
            cache,
            rank,
            block_size,
            checkpoint_interval,
            rule,
            save,
            hits: 0,
            resets: 0,
            blocks_per_state: 0,
            owner: 0,
            budget: Vec::new(),
        }
    }

    pub(crate) fn cache(&self) -> &LinearStatePrefixCache {
        &self.cache
    }

    pub(crate) fn cache_mut(&mut self) -> &mut LinearStatePrefixCache {
        &mut self.cache
    }

    pub(crate) fn hits(&self) -> u64 {
        self.hits
    }

    /// Whether a sequence could get its live slot here (R13).
    pub(crate) fn admits(&self) -> bool {
        self.cache.num_available_slots() > 0
    }

    /// Whether boundary `k >= 1` of `chain` has a committed checkpoint of that very prefix: its
    /// last block's link is the chain's and its tokens the chain's (or its link is 0: a
    /// checkpoint of the cache's own API, matched by hash).
    fn serves(&self, chain: &QueryChain<'_>, k: usize) -> bool {
        let bs = self.block_size;
        self.cache
            .committed_link(chain.hashes[k - 1])
            .is_some_and(|(link, tail)| {
                link == 0
                    || (chain.links(k - 1, link, tail.root_key.as_deref())
                        && chain.tokens.get((k - 1) * bs..k * bs) == Some(&*tail.tokens))
            })
    }

    /// R23: the boundary `k <= limit` of `chain` to restore from (0: start from an empty state).
    pub(crate) fn hit_limit(&self, chain: &QueryChain<'_>, limit: usize) -> usize {
        let limit = match self.rule {
            LinearStateMatch::Deepest => limit,
            LinearStateMatch::Contiguous => {
                (1..=limit).take_while(|&k| self.serves(chain, k)).count()
            }
        };
        (1..=limit)
            .rev()
            .find(|&k| self.serves(chain, k))
            .unwrap_or(0)
    }

    /// Whether a hit at `k` leaves a slot for the live state (pinning an unpinned checkpoint
    /// takes it off the available ones).
    pub(crate) fn fits(&self, chain: &QueryChain<'_>, k: usize) -> bool {
        let pin_cost = match k {
            0 => 0,
            _ => usize::from(!self.cache.is_pinned(chain.hashes[k - 1])),
        };
        self.cache.num_available_slots() > pin_cost
    }

    /// Pins the checkpoint of a hit at `k` (R14: before anything is taken).
    pub(crate) fn take_hit(&mut self, chain: &QueryChain<'_>, k: usize) -> Option<LinearTable> {
        let mut table = LinearTable {
            last_saved_boundary: k * self.block_size,
            saved_in: self.resets,
            ..LinearTable::default()
        };
        if k > 0 {
            if !self.serves(chain, k) {
                return None;
            }
            let hash = chain.hashes[k - 1];
            self.cache.lookup(hash)?;
            table.restore_slot = Some(self.cache.pin(hash).ok()?);
            table.restore = Some(hash);
        }
        // The KV reaches further than the checkpoint: the prompt shares the chain up to the
        // end of the walk, where another prompt of the same prefix will come back.
        let walked = chain.walked();
        if walked > k {
            table.junction = walked * self.block_size;
        }
        Some(table)
    }

    /// The junction save of the table (R24), in computed tokens, if still ahead.
    pub(crate) fn junction(&self, table: &LinearTable) -> Option<usize> {
        (table.junction > table.last_saved_boundary).then_some(table.junction)
    }

    /// Takes the live slot (after the single block, R14); false if none can be had.
    pub(crate) fn take_slot(&mut self, full: &mut FullGroup, table: &mut LinearTable) -> bool {
        if !self.secure_slot(full, true) {
            return false;
        }
        table.slot = self.cache.acquire_slot();
        table.slot.is_some()
    }

    /// Gives back what a failed admission took of this group.
    pub(crate) fn undo(&mut self, table: LinearTable) {
        if let Some(hash) = table.restore {
            let unpinned = self.cache.unpin(hash);
            debug_assert!(unpinned.is_ok(), "the hit pinned {hash:?}");
        }
    }

    /// The admission succeeded: plans the restore copy into the live slot (R23, R24).
    /// Without a restore the live slot starts from zeros: the worker zeroes it (a recycled
    /// slot holds an earlier sequence's state).
    pub(crate) fn admitted(&mut self, table: &mut LinearTable, ledger: &mut Ledger) {
        self.hits += u64::from(table.restore.is_some());
        match (&table.slot, table.restore.take(), table.restore_slot) {
            (Some(live), Some(hash), Some(src)) => {
                let op = LinearOp::new(self.rank, OpKind::Restore, hash, src, live.clone());
                ledger.add(&mut table.ops, op);
            }
            (Some(live), None, _) => {
                let zero = (self.rank, live.id());
                if !ledger.zeros.contains(&zero) {
                    ledger.zeros.push(zero);
                }
            }
            _ => {}
        }
    }

    /// Whether a step at `computed` tokens (prompt of `prompt` tokens) plans a save (R24): on a
    /// block boundary past the last saved one (or at it, if a reset forgot it since) that is
    /// the prompt's last boundary or a multiple of the interval.
    pub(crate) fn saves_at(&self, table: &LinearTable, computed: usize, prompt: usize) -> bool {
        let bs = self.block_size;
        let saved = match computed.cmp(&table.last_saved_boundary) {
            std::cmp::Ordering::Less => true,
            std::cmp::Ordering::Equal => table.saved_in == self.resets,
            std::cmp::Ordering::Greater => false,
        };
        if computed == 0 || computed % bs != 0 || saved {
            return false;
        }
        self.checkpoint_interval.is_some_and(|t| computed % t == 0)
            || computed == prompt / bs * bs
            || computed == table.junction
    }

    /// At a step: drops stale saves (F6), then, when `save` names the prefix hash of the
    /// boundary at `computed` (see [`Self::saves_at`]), the link of its last block and that
    /// block's tokens, plans its checkpoint (R24).
    pub(crate) fn step(
        &mut self,
        full: &mut FullGroup,
        table: &mut LinearTable,
        computed: usize,
        save: Option<(BlockHash, Anchor, Tail)>,
        ledger: &mut Ledger,
    ) {
        self.drop_stale_saves(table, computed, ledger);
        if let Some(save) = save {
            // R23's retention: a junction's checkpoint outlives the intermediate ones (so does
            // one a hit restored); a prompt's last one does not (measured: docs/hybrid.md).
            let kept = computed == table.junction;
            if self.secure_slot(full, false) {
                self.plan_save(table, (computed, kept), save, ledger);
            }
        }
    }

    /// The boundary at `computed` counts as saved (until a reset).
    fn mark_saved(&self, table: &mut LinearTable, computed: usize) {
        table.last_saved_boundary = computed;
        table.saved_in = self.resets;
    }

    /// F6 (R24): a save not yet taken whose boundary the sequence's state has moved past would
    /// read the live slot's later state into the earlier boundary's checkpoint. It is dropped
    /// (its pending slot freed) the next time the pool sees the sequence at a step.
    fn drop_stale_saves(&mut self, table: &mut LinearTable, computed: usize, ledger: &mut Ledger) {
        let ops = &ledger.ops;
        let stale: Vec<u64> = table
            .ops
            .iter()
            .copied()
            .filter(|id| {
                ops.get(id).is_some_and(|op| {
                    op.kind == OpKind::Save && !op.taken && op.boundary != computed
                })
            })
            .collect();
        for id in stale {
            if let Some(op) = ledger.remove_untaken(id) {
                table.ops.retain(|&o| o != id);
                self.cancel_op(&op);
            }
        }
    }

    /// Whether saves of this table wait for their anchors.
    pub(crate) fn awaits_anchors(&self, table: &LinearTable) -> bool {
        !table.unanchored.is_empty()
    }

    /// Gives the table's ticketed saves their anchors where the sequence's chain (`own`, just
    /// published) is now cached; forgets those whose checkpoint is gone.
    pub(crate) fn anchor_saves(&mut self, table: &mut LinearTable, own: &mut OwnChain<'_>) {
        let cache = &mut self.cache;
        table.unanchored.retain(|&(block, hash, ticket)| {
            if !cache.has_ticket(hash, ticket) {
                return false;
            }
            let link = own.link(block);
            link == 0 || !cache.resolve_anchor(hash, ticket, link)
        });
    }

    /// Plans the save of the boundary at `computed`: its prefix hash, the link of its last
    /// block (0: not known yet, the parent not being cached as the chain's; the save then
    /// carries a ticket until [`Self::anchor_saves`] resolves it) and that block's tokens. A
    /// checkpoint under the same hash linked elsewhere (another prefix whose hash collides, or
    /// this prefix before its parent's entry was evicted and computed again) gives way unless
    /// pinned, pending or itself waiting for its link, or unless this save's link is not known.
    fn plan_save(
        &mut self,
        table: &mut LinearTable,
        (computed, kept): (usize, bool),
        (hash, link, tail): (BlockHash, Anchor, Tail),
        ledger: &mut Ledger,
    ) {
        if let Some(existing) = self.cache.anchor_of(hash) {
            let same = existing == link || existing == 0; // 0: vouched for by the cache's API
            let keep = same || link == 0 || is_ticket(existing) || self.cache.is_pending(hash);
            if keep || !self.cache.evict_hash(hash) {
                self.mark_saved(table, computed); // saved already, or kept (pinned, in flight)
                return;
            }
        }
        let stored = match link {
            0 => ticket(),
            l => l,
        };
        let Some(live) = table.slot.take() else {
            return;
        };
        let rank = self.rank;
        let op = match self.save {
            LinearStateSave::Copy => {
                let op = self
                    .cache
                    .reserve_planned(hash, stored, tail, kept)
                    .map(|dst| LinearOp {
                        dst,
                        boundary: computed,
                        ..LinearOp::new(rank, OpKind::Save, hash, live.id(), live.clone())
                    });
                table.slot = Some(live);
                op
            }
            LinearStateSave::Promote => {
                let promoted = live.id();
                match self.cache.promote_anchored(live, hash, stored, tail, kept) {
                    Ok(fresh) => {
                        let pinned = self.cache.pin(hash);
                        debug_assert!(pinned.is_ok(), "just promoted");
                        let old = pinned.unwrap_or(promoted);
                        // F2: an earlier copy into the promoted slot may still be in flight; it
                        // holds the slot, so the new checkpoint stays pinned until it is done.
                        let writer = table.ops.iter().copied().find(|id| {
                            ledger
                                .ops
                                .get(id)
                                .is_some_and(|op| op.rank == rank && op.live.id() == promoted)
                        });
                        if let Some(op) = writer.and_then(|id| ledger.ops.get_mut(&id)) {
                            let pinned = self.cache.pin(hash);
                            debug_assert!(pinned.is_ok(), "just promoted");
                            op.pins.push(hash);
                        }
                        let op = LinearOp::new(rank, OpKind::Promote, hash, old, fresh.clone());
                        table.slot = Some(fresh);
                        Some(op)
                    }
                    Err(live) => {
                        table.slot = Some(live);
                        None
                    }
                }
            }
        };
        // F7 (R24): the boundary counts as saved only once its save is planned; a reservation
        // that failed (every slot live) is retried by the next cache() at this boundary.
        if let Some(op) = op {
            self.mark_saved(table, computed);
            ledger.add(&mut table.ops, op);
            if link == 0 {
                table
                    .unanchored
                    .push((computed / self.block_size - 1, hash, stored));
            }
        }
    }

    /// Cancels the sequence's unconfirmed copies (R24): untaken ones at once; taken ones when
    /// their plan is committed (the worker may be copying them now).
    pub(crate) fn release(&mut self, table: &mut LinearTable, ledger: &mut Ledger) {
        if let Some(live) = &table.slot {
            let zero = (self.rank, live.id());
            ledger.zeros.retain(|&z| z != zero);
        }
        for (_, hash, ticket) in std::mem::take(&mut table.unanchored) {
            self.cache.evict_ticket(hash, ticket); // never matchable; a pending one is cancelled
        }
        for id in std::mem::take(&mut table.ops) {
            let Some(op) = ledger.ops.get_mut(&id) else {
                continue;
            };
            if op.taken {
                op.cancelled = true;
            } else if let Some(op) = ledger.remove_untaken(id) {
                self.cancel_op(&op);
            }
        }
    }

    /// Undoes what a copy holds in the cache (a cancelled copy). Failures are impossible by the
    /// copy's invariant (checked by `Ledger::check`).
    fn cancel_op(&mut self, op: &LinearOp) {
        let undone = match op.kind {
            OpKind::Restore | OpKind::Promote => self.cache.unpin(op.hash),
            OpKind::Save => self.cache.cancel_planned(op.hash),
        };
        debug_assert!(undone.is_ok(), "copy of {:?} lost its checkpoint", op.hash);
        for &hash in &op.pins {
            let unpinned = self.cache.unpin(hash);
            debug_assert!(unpinned.is_ok(), "copy lost its pin of {hash:?} (F2)");
        }
    }

    /// The worker made the copy (its plan was committed): a save becomes matchable, a restore
    /// unpins its checkpoint; a cancelled copy is undone.
    pub(crate) fn finish_op(&mut self, op: LinearOp) {
        if op.cancelled {
            self.cancel_op(&op);
            return;
        }
        let done = match op.kind {
            OpKind::Restore | OpKind::Promote => self.cache.unpin(op.hash),
            OpKind::Save => self.cache.commit_planned(op.hash).map(|_| ()),
        };
        debug_assert!(done.is_ok(), "copy of {:?} lost its checkpoint", op.hash);
        for &hash in &op.pins {
            let unpinned = self.cache.unpin(hash);
            debug_assert!(unpinned.is_ok(), "copy lost its pin of {hash:?} (F2)");
        }
        drop(op); // its handle of the live slot goes last, after the pins
    }

    /// Drops every committed checkpoint nothing pins (R24); every sequence's saved boundary is
    /// forgotten (module doc).
    pub(crate) fn reset(&mut self) {
        self.cache.reset();
        self.release_surplus();
        self.resets += 1;
    }

    /// Sets the stamp of the checkpoints listed from now on (the store's clock).
    pub(crate) fn set_clock(&mut self, clock: u64) {
        self.cache.set_clock(clock);
    }

    pub(crate) fn check(&self, full: &FullGroup, ledger: &Ledger) -> Result<()> {
        self.cache.check()?;
        let k = self.blocks_per_state;
        ensure_invariant!(
            self.budget.len() >= k * self.in_use(),
            "the linear-state group holds {} blocks of the store for {} states of {k} blocks",
            self.budget.len(),
            self.in_use()
        );
        ensure_invariant!(
            self.budget
                .iter()
                .all(|b| full.owns(b) && b.ref_count() == 1),
            "a block the linear-state group holds is not its own block of the store"
        );
        let saves = ledger.num_saves(self.rank);
        ensure_invariant!(
            saves == self.cache.num_planned_checkpoints(),
            "{} planned checkpoints for {saves} planned saves (R24)",
            self.cache.num_planned_checkpoints()
        );
        Ok(())
    }

    /// A sequence's live slot belongs to this rank (R22).
    pub(crate) fn check_table(&self, table: &LinearTable, seq_id: u64) -> Result<()> {
        ensure_invariant!(
            table.slot.as_ref().is_some_and(|s| self.cache.owns(s)),
            "sequence {seq_id} has no live slot of its rank (R22)"
        );
        Ok(())
    }
}
