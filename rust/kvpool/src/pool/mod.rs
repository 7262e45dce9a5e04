//! `BlockManagerPool`: the sequence-level KV-cache manager (xLLM's `KVCacheManager`): per
//! data-parallel rank a full-attention group, a single-block manager and the rank's other groups
//! (sliding window, linear state), and optionally a host tier (the public
//! `HierarchyBlockManagerPool`).
//!
//! The pool is the coordinator: it loops over a rank's groups for every operation and never asks
//! which kind a group is (`groups/mod.rs`). Files: `config.rs` (options), `admission.rs` (plan
//! once, then allocate), `linear_plans.rs` (the recurrent-state copies of R24), `events.rs`
//! (R21), `stats.rs` and `check.rs` (R20), `batch.rs` (the batch calls of R16, R17, R19),
//! `publish.rs` (R17, after the KV exists), `tiers.rs` (the host tier's API), `hierarchy.rs` (the `HierarchyBlockManagerPool` name).
//!
//! Invariants: a sequence holds blocks of at most one pool (its allocation's `owner`) and one
//! rank (R13); every entry point is all-or-nothing (R14, R16, R29): it either succeeds or leaves
//! the pool and the sequence as they were (blocks, LRU, single blocks, statistics, dp rank);
//! counts of every rank obey R2; blocks are published only once their KV exists (R17); with
//! `dedup` a step's publication switches a duplicate the sequence alone holds to the cached copy
//! and records the switch (R9 revised, `prefix_cache/dedup.rs`). Every entry that changes the
//! pool advances its generation, which a plan is checked against.

mod admission;
mod batch;
mod check;
mod config;
mod elastic;
mod events;
mod hierarchy;
mod linear_plans;
mod plan;
mod publish;
mod retain;
mod stats;
mod tiers;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{ensure_arg, KvPoolError, Result};
use crate::groups::{FullGroup, Group, Ledger};
use crate::linear_state::LinearStatePrefixCache;
use crate::manager::{BlockCounts, BlockManager, BlockManagerImpl, SingleBlockManager};
use crate::prefix_cache::Switch;
use crate::sequence::Sequence;
use crate::sliding_window::SlidingWindowBlockManager;
use crate::tiers::HostTier;

use publish::Publish;

pub use crate::groups::{Miss, MissReason};
pub use admission::DebugCounters;
pub use config::{LinearStateMatch, LinearStateSave, PoolConfig, DEFAULT_RETENTION_TOKENS};
pub use elastic::{PageBackendKind, XTensorOptions, XTensorRankStats};
pub use events::{KvEvent, KvEventKind, DEFAULT_EVENT_REPLAY};
pub use hierarchy::{HierarchyBlockManagerPool, HierarchyConfig, HierarchyStats};
pub use linear_plans::LinearStatePlan;
pub use plan::{AllocationPlan, TableExtent};
pub use stats::{PoolStats, RankMemory, RankStats};

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// The sequence-level interface (xLLM's `KVCacheManager`).
pub trait KvCacheManager {
    /// R15: what `allocate` would answer, with no side effect.
    fn can_allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool>;
    /// R14.
    fn allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool>;
    /// xLLM's `allocate_shared(seq)`: the prefix hit only, into a sequence that
    /// holds nothing (its hit's blocks, single block and live slot; no new blocks).
    fn allocate_shared(&mut self, seq: &mut Sequence) -> Result<bool>;
    /// R16.
    fn can_append(&self, seq: &Sequence, lookahead: usize) -> Result<bool>;
    /// R16.
    fn may_append(&mut self, seq: &mut Sequence, lookahead: usize) -> Result<bool>;
    /// R17.
    fn cache(&mut self, seq: &mut Sequence) -> Result<()>;
    /// R18.
    fn deallocate(&mut self, seq: &mut Sequence) -> Result<()>;
}

/// One data-parallel rank.
pub(crate) struct Rank {
    pub(crate) full: FullGroup,
    pub(crate) single: SingleBlockManager,
    /// The rank's other groups, in the order of a sequence's tables.
    pub(crate) groups: Vec<Group>,
    pub(crate) query_tokens: u64,
    pub(crate) hit_tokens: u64,
    /// Admissions whose hit a group cut, per reason (docs/hybrid.md "Why no hit").
    pub(crate) misses: crate::groups::misses::MissCounts,
}

impl Rank {
    /// Whether a sequence could get its single block and what every group gives it here (R13).
    pub(crate) fn admits(&self) -> bool {
        self.single.counts().free > 0 && self.groups.iter().all(Group::admits)
    }

    /// Before a growth of `need` full-attention blocks (the tables to `entries` entries): a
    /// linear-state group of the one store frees what the growth and the window groups' new
    /// blocks need (`LinearGroup::make_room`); nothing for the other pools.
    pub(crate) fn make_room(
        &mut self,
        tables: &[crate::groups::GroupTable],
        entries: usize,
        need: usize,
    ) {
        if !self.groups.iter().any(Group::makes_room) {
            return;
        }
        let shared: usize = (self.groups.iter().zip(tables))
            .map(|(g, t)| g.shared_growth(&self.full, t, 0, entries).0)
            .sum();
        for group in &mut self.groups {
            group.make_room(&mut self.full, need + shared);
        }
    }

    /// Blocks of the store available to a growth: free plus evictable, plus what a
    /// linear-state group of the one store gives back (R15).
    pub(crate) fn available(&self) -> usize {
        let spare: usize = self
            .groups
            .iter()
            .filter_map(Group::as_linear)
            .map(|g| g.spare())
            .sum();
        self.full.num_available() + spare
    }
}

/// Per-rank block groups behind the sequence-level API.
///
/// Concurrency (R27): the pool is `Send + Sync`; methods that change it take `&mut self`, so
/// threads share it behind a lock (the Python class does, and with `concurrent=True` releases the
/// GIL while it waits and works). Handles are released lock-free: a sequence dropped on any
/// thread returns its blocks without touching the pool or its lock.
pub struct BlockManagerPool {
    id: u64,
    config: PoolConfig,
    ranks: Vec<Rank>,
    /// Whether the ranks have groups besides full attention (the decode fast paths skip them).
    has_groups: bool,
    /// Whether some group publishes or slides a table (a sliding window).
    slides: bool,
    events: Option<events::EventLog>,
    ledger: Ledger,
    open_plans: HashSet<u64>,
    next_plan: u64,
    host: Option<HostTier>,
    /// Advanced by every entry that changes the pool (plans are checked against it).
    generation: u64,
    /// Table entries switched by dedup on publish since the last drain: (seq_id, group, old,
    /// new).
    block_switches: Vec<(u64, usize, u32, u32)>,
    /// Scratch of one publish's switches (position, old, new).
    switch_scratch: Vec<Switch>,
    /// Session hints (`retain.rs`).
    hints: retain::Hints,
}

// R27: the pool can be shared between threads (behind a lock).
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<BlockManagerPool>();
    assert_send_sync::<Sequence>();
};

impl BlockManagerPool {
    /// A pool per `config`.
    pub fn new(config: PoolConfig) -> Result<Self> {
        Self::build(config, Vec::new())
    }

    /// A pool per `config`; on elastic pages with a `Custom` backend, `backends[r]` is rank
    /// `r`'s.
    fn build(
        config: PoolConfig,
        backends: Vec<Box<dyn crate::xtensor::PageBackend>>,
    ) -> Result<Self> {
        config.validate()?;
        let mut ranks = config.build_ranks(backends)?;
        // Relaxed: only uniqueness matters.
        let id = NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed);
        // Where links outlive their chains (checkpoints; window tails behind a host tier), the
        // caches keep graves so that a chain computed again takes its anchors back (R7).
        let graves =
            config.linear_state_slots > 0 || (config.window().is_some() && config.host.is_some());
        for rank in &mut ranks {
            if let Some(cache) = rank.full.cache_mut() {
                cache.keep_graves(graves);
            }
        }
        let host = match config.host {
            None => None,
            Some(host) => {
                let mut tier =
                    HostTier::new(host, id, config.dp_size, config.block_size, config.hasher)?;
                tier.set_record_events(config.enable_events);
                tier.keep_graves(graves);
                Some(tier)
            }
        };
        let has_groups = ranks.iter().any(|r| !r.groups.is_empty());
        let slides = ranks.iter().any(|r| r.groups.iter().any(Group::publishes));
        Ok(Self {
            id,
            config,
            ranks,
            has_groups,
            slides,
            events: config
                .enable_events
                .then(|| events::EventLog::new(config.dp_size, config.event_replay)),
            ledger: Ledger::default(),
            open_plans: HashSet::new(),
            next_plan: 1,
            host,
            generation: 0,
            block_switches: Vec::new(),
            switch_scratch: Vec::new(),
            hints: retain::Hints::default(),
        })
    }

    /// Takes the table entries that dedup on publish switched since the last call (R9
    /// revised): (seq_id, old block id, new block id), in the order they happened. Engines that
    /// mirror block tables apply them; the list grows until drained.
    pub fn drain_block_switches(&mut self) -> Vec<(u64, u32, u32)> {
        self.drain_block_switches_by_group()
            .into_iter()
            .map(|(seq, _, old, new)| (seq, old, new))
            .collect()
    }

    /// [`Self::drain_block_switches`] with the group of each switch: (seq_id, group, old block
    /// id, new block id), `group` as in `block_tables(seqs, group)`. Only the full-attention
    /// group (0) dedups today: the sliding-window group keeps the first writer (R25) and
    /// linear-state slots are not blocks.
    pub fn drain_block_switches_by_group(&mut self) -> Vec<(u64, usize, u32, u32)> {
        std::mem::take(&mut self.block_switches)
    }

    /// The options.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Number of dp ranks.
    pub fn dp_size(&self) -> usize {
        self.ranks.len()
    }

    /// Block groups of every sequence: 1, or 1 + `window_groups` with a sliding window (R25).
    pub fn num_groups(&self) -> usize {
        1 + if self.config.window().is_some() {
            self.config.num_window_groups()
        } else {
            0
        }
    }

    /// Whether the pool has a host tier (R26).
    pub fn has_host_tier(&self) -> bool {
        self.host.is_some()
    }

    /// The block manager of `rank`'s full-attention group (`None` on elastic pages: see
    /// [`Self::xtensor_manager`]).
    pub fn block_manager(&self, rank: usize) -> Option<&BlockManagerImpl> {
        self.ranks.get(rank).and_then(|r| r.full.paged())
    }

    /// The sliding-window group's manager of `rank`, if any.
    pub fn window_manager(&self, rank: usize) -> Option<&SlidingWindowBlockManager> {
        let rank = self.ranks.get(rank)?;
        rank.groups
            .iter()
            .find_map(Group::as_window)
            .map(|g| g.manager())
    }

    /// The sliding-window group's manager of `rank`, if any (to evict kept tails).
    pub fn window_manager_mut(&mut self, rank: usize) -> Option<&mut SlidingWindowBlockManager> {
        self.generation += 1;
        let rank = self.ranks.get_mut(rank)?;
        rank.groups
            .iter_mut()
            .find_map(Group::as_window_mut)
            .map(|g| g.manager_mut())
    }

    /// The linear-state cache of `rank`, if linear state is enabled (R22).
    pub fn linear_state_cache(&self, rank: usize) -> Option<&LinearStatePrefixCache> {
        let rank = self.ranks.get(rank)?;
        rank.groups
            .iter()
            .find_map(Group::as_linear)
            .map(|g| g.cache())
    }

    /// The linear-state cache of `rank`, if linear state is enabled (R22).
    pub fn linear_state_cache_mut(&mut self, rank: usize) -> Option<&mut LinearStatePrefixCache> {
        self.generation += 1;
        let rank = self.ranks.get_mut(rank)?;
        rank.groups
            .iter_mut()
            .find_map(Group::as_linear_mut)
            .map(|g| g.cache_mut())
    }

    /// Block counts of `rank`'s full-attention group; an error naming `rank` past the last.
    pub fn counts(&self, rank: usize) -> Result<BlockCounts> {
        self.ranks
            .get(rank)
            .map(|r| r.full.counts())
            .ok_or_else(|| self.rank_error(rank))
    }

    /// Block counts of every rank's full-attention group, summed: `stats().total.counts`
    /// without the rest of the stats (one read of each rank's counters).
    pub fn total_counts(&self) -> BlockCounts {
        let mut total = BlockCounts::default();
        for rank in &self.ranks {
            total.add(&rank.full.counts());
        }
        total
    }

    fn rank_error(&self, rank: usize) -> KvPoolError {
        KvPoolError::invalid(
            "rank",
            format!("must be < dp_size {}, got {rank}", self.ranks.len()),
        )
    }

    /// Whether `seq` holds blocks of this pool (`ValueError`-style error if of another pool).
    pub fn owns_sequence(&self, seq: &Sequence) -> Result<bool> {
        self.check_owner(seq)
    }

    pub(crate) fn check_owner(&self, seq: &Sequence) -> Result<bool> {
        self.check_owner_as(seq, "seq")
    }

    /// [`Self::check_owner`] for a sequence passed as argument `name` (`seqs` in batch calls).
    #[inline]
    fn check_owner_as(&self, seq: &Sequence, name: &'static str) -> Result<bool> {
        match seq.owner() {
            None => Ok(false),
            Some(owner) if owner == self.id => Ok(true),
            Some(_) => Err(KvPoolError::invalid(
                name,
                format!("sequence {} holds blocks of another pool", seq.seq_id()),
            )),
        }
    }

    /// The one entry of every call that takes a sequence: folds a confirmed host load into it
    /// (R26) and says whether it holds blocks of this pool.
    #[inline]
    fn take_seq(&self, seq: &mut Sequence) -> Result<bool> {
        if self.host.is_some() {
            seq.sync(); // only a host tier hands out tickets
        }
        self.check_owner(seq)
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    fn validate_num_tokens(seq: &Sequence, num_tokens: Option<usize>) -> Result<usize> {
        let n = num_tokens.unwrap_or(seq.len());
        ensure_arg!(
            n >= 1 && n <= seq.len(),
            "num_tokens",
            "must be in 1..={} (len(seq)), got {n}",
            seq.len()
        );
        Ok(n)
    }

    /// Drops every cached entry of every rank (R12), every committed checkpoint nothing pins
    /// (R24), every sliding-window publication and, with a host tier, every host entry nothing
    /// pins (R26).
    pub fn reset_prefix_cache(&mut self) {
        self.generation += 1;
        for index in 0..self.ranks.len() {
            let rank = &mut self.ranks[index];
            rank.full.reset();
            for group in &mut rank.groups {
                group.reset();
            }
            self.collect_events(index);
        }
        if let Some(host) = self.host.as_mut() {
            host.reset();
            for index in 0..self.ranks.len() {
                self.collect_events(index);
            }
        }
    }

    /// The blocks missing for `seq`'s tables to hold `tokens` tokens, or `None` if a group
    /// cannot supply them. The one computation behind both the question (`can_append`,
    /// `can_allocate` on an allocated sequence) and the action (`may_append`, `allocate`), so
    /// they agree exactly (R15, R16). A group that slides counts with exactly what its slide
    /// frees or makes evictable (F4).
    fn growth(&self, seq: &Sequence, tokens: usize) -> Option<usize> {
        let alloc = seq.alloc()?;
        let rank = self.ranks.get(alloc.rank)?;
        let need = self.blocks_for(tokens).saturating_sub(alloc.blocks.len());
        if need == 0 {
            return Some(0);
        }
        if need > rank.available() {
            return None;
        }
        let computed = seq.num_computed_tokens(); // a confirmed load counts (R16 exactness)
        let entries = alloc.blocks.len() + need;
        // The groups of the shared store draw from the full-attention group's blocks, after
        // their slide gave some back.
        let (shared, releasable) =
            rank.groups
                .iter()
                .zip(&alloc.groups)
                .fold((0, 0), |(shared, releasable), (g, t)| {
                    let (s, r) = g.shared_growth(&rank.full, t, computed, entries);
                    (shared + s, releasable + r)
                });
        if need + shared > rank.full.num_available() + releasable {
            return None;
        }
        let room = rank
            .groups
            .iter()
            .zip(&alloc.groups)
            .all(|(g, t)| g.room(t, computed, need));
        room.then_some(need)
    }

    /// Whether [`Self::grow`] would succeed (no side effect).
    fn can_grow(&self, seq: &Sequence, tokens: usize) -> bool {
        self.growth(seq, tokens).is_some()
    }

    /// Grows `seq`'s tables to hold `tokens` tokens: all-or-nothing (R14, R16). On success it
    /// first publishes the window blocks and slides the window (R25); a failure changes nothing.
    fn grow(&mut self, seq: &mut Sequence, tokens: usize) -> bool {
        let Some(need) = self.growth(seq, tokens) else {
            return false;
        };
        if self.slides {
            self.publish_and_slide_groups(seq); // publish before the slide releases (R25)
        }
        if need == 0 {
            return true;
        }
        let entries = self.blocks_for(tokens);
        let Some(alloc) = seq.alloc_mut() else {
            return false;
        };
        let rank_index = alloc.rank;
        let rank = &mut self.ranks[rank_index];
        let before = alloc.blocks.len();
        rank.make_room(&alloc.groups, entries, need);
        let mut ok = rank.full.grow(&mut alloc.blocks, need);
        for (group, table) in rank.groups.iter_mut().zip(alloc.groups.iter_mut()) {
            ok = ok && group.grow(&mut rank.full, table, entries);
        }
        if !ok {
            // `growth` counted every group's blocks after the slide: only a page backend that
            // refuses a page (elastic memory) gets here. Nothing changes.
            alloc.blocks.truncate(before);
            rank.full.drain();
        }
        debug_assert!(
            ok || rank.full.elastic_manager().is_some(),
            "growth() promised {need} blocks"
        );
        self.collect_events(rank_index);
        ok
    }

    /// R18's deallocate. `all_released`: nothing else keeps the sequence's blocks after this
    /// (false with a host tier, whose offload may still hold them), so recomputed duplicates may
    /// be skipped and the rest of the chain published (see `PrefixCache::insert`).
    fn release(&mut self, seq: &mut Sequence, all_released: bool) {
        self.publish(seq, Publish::Release { all_released });
        let full_computed = seq.computed() / self.config.block_size;
        let Some(mut alloc) = seq.detach() else {
            return;
        };
        let rank = &mut self.ranks[alloc.rank];
        // The block of the last computed full block: its node gets a shared group's end mark.
        let end = full_computed
            .checked_sub(1)
            .and_then(|i| alloc.blocks.get(i))
            .map(|b| b.id());
        for (group, table) in rank.groups.iter_mut().zip(alloc.groups.iter_mut()) {
            // R24 cancels, R25 keeps the window's tail (its hit points, with the shared store)
            group.release(&mut rank.full, table, &mut self.ledger, end);
        }
        drop(alloc); // the table tail first (`Allocation`'s `Drop`)
        rank.full.drain();
    }
}

/// `len(seq) + lookahead`, the tokens R16 asks room for; `None` past `usize::MAX` (F5).
fn appended_len(seq: &Sequence, lookahead: usize) -> Option<usize> {
    seq.len().checked_add(lookahead)
}

impl KvCacheManager for BlockManagerPool {
    fn can_allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool> {
        Ok(self.plan(seq, num_tokens)?.is_some())
    }

    fn allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool> {
        self.allocate_planned(seq, num_tokens, None, None)
    }

    fn allocate_shared(&mut self, seq: &mut Sequence) -> Result<bool> {
        self.allocate_shared_prefix(seq)
    }

    fn can_append(&self, seq: &Sequence, lookahead: usize) -> Result<bool> {
        ensure_arg!(
            self.check_owner(seq)?,
            "seq",
            "sequence {} is not allocated in this pool",
            seq.seq_id()
        );
        // F5: a sum past usize::MAX tokens can never be had.
        Ok(appended_len(seq, lookahead).is_some_and(|tokens| self.can_grow(seq, tokens)))
    }

    fn may_append(&mut self, seq: &mut Sequence, lookahead: usize) -> Result<bool> {
        ensure_arg!(
            self.take_seq(seq)?,
            "seq",
            "sequence {} is not allocated in this pool",
            seq.seq_id()
        );
        self.retry_pending()?;
        self.generation += 1;
        Ok(appended_len(seq, lookahead).is_some_and(|tokens| self.grow(seq, tokens)))
    }

    fn cache(&mut self, seq: &mut Sequence) -> Result<()> {
        if self.take_seq(seq)? {
            self.generation += 1;
            self.publish(seq, Publish::Step);
        }
        Ok(())
    }

    fn deallocate(&mut self, seq: &mut Sequence) -> Result<()> {
        if !self.take_seq(seq)? {
            return Ok(());
        }
        self.generation += 1;
        match self.host.is_some() {
            false => self.release(seq, true),
            true => {
                self.plan_offload(seq);
                // A pending offload keeps the blocks: publish without skipping recomputed
                // duplicates, or a cached duplicate could get a held child and be counted
                // evictable (R9).
                self.release(seq, false);
            }
        }
        Ok(())
    }
}
