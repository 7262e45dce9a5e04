//! The block groups of a rank, behind one interface.
//!
//! A rank has a full-attention group ([`FullGroup`]: the allocator and prefix cache that own the
//! chain) and any number of other groups ([`Group`]: a sliding window, linear state), each with
//! its own table in a sequence's allocation ([`GroupTable`], same order). Every operation is the
//! same for every group, so the pool's coordinator loops over them and never asks which kind it
//! has (the shape of vLLM's `kv_cache_coordinator.py`):
//! - **hit limit**: the deepest boundary `k <= limit` the group can serve for a chain; the
//!   admission hit is the fold of the limits over the groups until it no longer moves (each
//!   limit only lowers it, and every group accepts `k = 0`), so it is the deepest boundary every
//!   group accepts; the R23 checkpoint trim is the linear group's limit;
//! - **fits / take hit / take slot / grow / admitted**: the all-or-nothing admission steps of
//!   R14 (pin what the hit found first, then take the per-sequence resources, then grow);
//! - **room / grow**: growth of an allocated sequence (R16), one computation for the question and
//!   the action;
//! - **publish / slide / step**: after the KV exists (R17, R24, R25);
//! - **release / reset / counts / check**.
//!
//! The groups that store per-prefix data beside the full-attention blocks verify a hit against
//! the query's verified walk and link what they store to the full-attention entries
//! (`crate::chain`, R7).
//!
//! Invariants: a sequence allocated on a rank holds one table per group of the rank, in order.

pub(crate) mod full;
pub(crate) mod linear;
pub(crate) mod misses;
pub(crate) mod shared_window;
pub(crate) mod window;

use crate::error::{ensure_invariant, Result};
use crate::hash::BlockHash;
use crate::manager::BlockCounts;
use crate::prefix_cache::{Anchor, PrefixCache};
use crate::sliding_window::WindowTable;

pub(crate) use crate::chain::{OwnChain, QueryChain};
pub(crate) use full::{FullGroup, Walk};
pub(crate) use linear::{Ledger, LinearGroup, LinearTable, OpKind};
pub use linear::{LinearStateMatch, LinearStateSave};
pub use misses::{Miss, MissReason};
pub(crate) use shared_window::{SharedWindowGroup, WindowKind};
pub(crate) use window::WindowGroup;

/// A group of a rank besides full attention.
// One per rank, never moved on a hot path: both kinds stay inline (no indirection per call).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Group {
    /// Sliding-window attention layers with their own block store (R25).
    Window(WindowGroup),
    /// Sliding-window attention layers in the full-attention group's store (R25, one store).
    SharedWindow(SharedWindowGroup),
    /// Recurrent (linear-attention) state and its checkpoints (R22).
    Linear(LinearGroup),
}

/// What a sequence holds of one [`Group`].
#[derive(Debug)]
pub(crate) enum GroupTable {
    /// The window group's table.
    Window(WindowTable),
    /// The live slot and planned copies.
    Linear(LinearTable),
}

impl GroupTable {
    pub(crate) fn as_window(&self) -> Option<&WindowTable> {
        match self {
            Self::Window(t) => Some(t),
            Self::Linear(_) => None,
        }
    }

    pub(crate) fn as_linear(&self) -> Option<&LinearTable> {
        match self {
            Self::Linear(t) => Some(t),
            Self::Window(_) => None,
        }
    }

    /// Whether a copy planned for this sequence is not confirmed yet (a linear-state save or
    /// restore in `ledger`, R24): dedup on publish waits for it (R9 revised).
    pub(crate) fn holds_plan(&self, ledger: &Ledger) -> bool {
        match self {
            Self::Linear(t) => t.ops.iter().any(|id| ledger.ops.contains_key(id)),
            Self::Window(_) => false,
        }
    }
}

/// The counters the groups of a rank report (R20).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct GroupCounters {
    pub(crate) window: Option<BlockCounts>,
    pub(crate) window_releases: u64,
    pub(crate) live_slots: usize,
    pub(crate) pending_checkpoints: usize,
    pub(crate) committed_checkpoints: usize,
    pub(crate) free_slots: usize,
    pub(crate) linear_hits: u64,
    pub(crate) checkpoint_evictions: u64,
    pub(crate) checkpoint_commits: u64,
    pub(crate) state_blocks: usize,
}

/// What a group's hit takes a chain from: the query's chain with the ids its device walk
/// verified and the host cache's walk; a group verifies it as a [`QueryChain`] over the
/// full-attention cache, a group of the shared store retains the runs attached to the walked
/// entries (R7 either way).
pub(crate) struct HitQuery<'a> {
    pub(crate) chain: (&'a [BlockHash], &'a [u32], Option<&'a [u8]>),
    pub(crate) device_ids: &'a [u32],
    pub(crate) host: Option<(&'a PrefixCache, &'a [u32])>,
}

impl<'a> HitQuery<'a> {
    /// The chain as a group verifies it, over `full`'s cache.
    fn chain<'b>(&'b self, full: &'b FullGroup) -> QueryChain<'b> {
        let device = full.cache().map(|c| (c, self.device_ids));
        QueryChain::new(self.chain, device, self.host)
    }
}

/// A table of the wrong kind for its group: an invariant the pool keeps, reported, never a panic.
fn mismatch() -> bool {
    debug_assert!(false, "a group got the table of another kind");
    false
}

impl Group {
    /// Whether a new sequence could get what it needs of this group here (R13).
    pub(crate) fn admits(&self) -> bool {
        match self {
            Self::Window(_) | Self::SharedWindow(_) => true,
            Self::Linear(g) => g.admits(),
        }
    }

    /// The deepest boundary `k <= limit` of the chain this group can serve (0 always).
    pub(crate) fn hit_limit(&self, chain: &QueryChain<'_>, limit: usize) -> usize {
        match self {
            Self::Window(g) => g.hit_limit(chain, limit),
            Self::SharedWindow(g) => g.hit_limit(chain.device(), limit),
            Self::Linear(g) => g.hit_limit(chain, limit),
        }
    }

    /// Why this group cuts a hit (docs/hybrid.md "Why no hit").
    pub(crate) fn miss_reason(&self) -> MissReason {
        match self {
            Self::Window(_) | Self::SharedWindow(_) => MissReason::WindowBlocksGone,
            Self::Linear(_) => MissReason::NoCheckpoint,
        }
    }

    /// Whether a hit at `k`, then a table of `entries` entries, fit in this group's own store
    /// (a group of the shared store counts in [`Self::demand`] instead).
    pub(crate) fn fits(&self, chain: &QueryChain<'_>, k: usize, entries: usize) -> bool {
        match self {
            Self::Window(g) => g.fits(chain, k, entries),
            Self::SharedWindow(_) => true,
            Self::Linear(g) => g.fits(chain, k),
        }
    }

    /// Blocks of the full-attention group's store a hit at `k` and then a table of `entries`
    /// entries take in this group (0 for a group with its own store).
    pub(crate) fn demand(&self, chain: &QueryChain<'_>, k: usize, entries: usize) -> usize {
        match self {
            Self::SharedWindow(g) => g.demand(chain.device(), k, entries),
            Self::Linear(g) => g.demand(chain, k),
            Self::Window(_) => 0,
        }
    }

    /// Blocks of the full-attention group's store this group gives back to the others after
    /// a hit at `k` (a linear-state group of the one store: its surplus and evictable
    /// checkpoints, once the new sequence's live slot is counted).
    pub(crate) fn spare_after(&self, chain: &QueryChain<'_>, k: usize) -> usize {
        match self {
            Self::Linear(g) => g.spare_after(chain, k),
            Self::Window(_) | Self::SharedWindow(_) => 0,
        }
    }

    /// Whether [`Self::make_room`] can free anything (a linear-state group of the one store).
    pub(crate) fn makes_room(&self) -> bool {
        matches!(self, Self::Linear(g) if g.blocks_per_state() > 0)
    }

    /// Frees blocks of the full-attention group's store until `need` are free, from what this
    /// group can give back (a linear-state group of the one store, `LinearGroup::make_room`).
    pub(crate) fn make_room(&mut self, full: &mut FullGroup, need: usize) {
        if let Self::Linear(g) = self {
            g.make_room(full, need);
        }
    }

    /// Sets the clock the group's listed entries are stamped with (the store's).
    pub(crate) fn set_clock(&mut self, clock: u64) {
        if let Self::Linear(g) = self {
            g.set_clock(clock);
        }
    }

    /// Takes the hit at `k` (pins or shares what it found); `None` if it vanished meanwhile.
    pub(crate) fn take_hit(
        &mut self,
        full: &mut FullGroup,
        query: &HitQuery<'_>,
        k: usize,
    ) -> Option<GroupTable> {
        match self {
            Self::Window(g) => g.take_hit(&query.chain(full), k).map(GroupTable::Window),
            Self::SharedWindow(g) => g
                .take_hit(full, query.device_ids, k)
                .map(GroupTable::Window),
            Self::Linear(g) => g.take_hit(&query.chain(full), k).map(GroupTable::Linear),
        }
    }

    /// Takes the per-sequence resources after the single block (the live slot; in the one
    /// store, its memory from `full`'s store as the admission's plan counted it).
    pub(crate) fn take_slot(&mut self, full: &mut FullGroup, table: &mut GroupTable) -> bool {
        match (self, table) {
            (Self::Linear(g), GroupTable::Linear(t)) => g.take_slot(full, t),
            (Self::Window(_) | Self::SharedWindow(_), GroupTable::Window(_)) => true,
            _ => mismatch(),
        }
    }

    /// Gives back what a failed admission took of this group.
    pub(crate) fn undo(&mut self, table: GroupTable) {
        match (self, table) {
            (Self::Linear(g), GroupTable::Linear(t)) => g.undo(t),
            (Self::Window(_) | Self::SharedWindow(_), GroupTable::Window(t)) => drop(t),
            _ => {
                mismatch();
            }
        }
    }

    /// Grows the table to `entries` entries (all-or-nothing); a group of the shared store
    /// takes its blocks from `full`'s allocator.
    pub(crate) fn grow(
        &mut self,
        full: &mut FullGroup,
        table: &mut GroupTable,
        entries: usize,
    ) -> bool {
        match (self, table) {
            (Self::Window(g), GroupTable::Window(t)) => g.grow(t, entries),
            (Self::SharedWindow(g), GroupTable::Window(t)) => g.grow(full, t, entries),
            (Self::Linear(_), GroupTable::Linear(_)) => true,
            _ => mismatch(),
        }
    }

    /// Whether `need` more entries can be had for a table whose sequence computed `computed`,
    /// in this group's own store (a group of the shared store answers with
    /// [`Self::shared_growth`]).
    pub(crate) fn room(&self, table: &GroupTable, computed: usize, need: usize) -> bool {
        match (self, table) {
            (Self::Window(g), GroupTable::Window(t)) => g.room(t, computed, need),
            (Self::SharedWindow(_), GroupTable::Window(_)) => true,
            (Self::Linear(_), GroupTable::Linear(_)) => true,
            _ => mismatch(),
        }
    }

    /// For a group of the shared store, (blocks a growth of the table to `entries` entries
    /// takes, blocks its slide to `computed` or its spare memory makes available first); (0, 0)
    /// otherwise.
    pub(crate) fn shared_growth(
        &self,
        full: &FullGroup,
        table: &GroupTable,
        computed: usize,
        entries: usize,
    ) -> (usize, usize) {
        match (self, table) {
            (Self::SharedWindow(g), GroupTable::Window(t)) => {
                (g.growth(t, entries), g.releasable(full, t, computed))
            }
            (Self::Linear(g), GroupTable::Linear(_)) => (0, g.spare()),
            _ => (0, 0),
        }
    }

    /// The admission succeeded: plans what the group plans for a new sequence.
    pub(crate) fn admitted(&mut self, table: &mut GroupTable, ledger: &mut Ledger) {
        if let (Self::Linear(g), GroupTable::Linear(t)) = (self, table) {
            g.admitted(t, ledger);
        }
    }

    /// Whether the group publishes or slides at all (most decode steps of a plain pool skip
    /// these calls).
    pub(crate) fn publishes(&self) -> bool {
        matches!(self, Self::Window(_) | Self::SharedWindow(_))
    }

    /// Whether [`Self::publish`] has work below `full` full computed blocks (`computed` tokens).
    pub(crate) fn wants_publish(&self, table: &GroupTable, full: usize, computed: usize) -> bool {
        match (self, table) {
            (Self::Window(g), GroupTable::Window(t)) => g.wants_publish(t, full),
            (Self::SharedWindow(g), GroupTable::Window(t)) => g.wants_publish(t, full, computed),
            _ => false,
        }
    }

    /// Publishes the table's full computed blocks `..full` under their chain hashes, linked to
    /// the chain's full-attention entries (a group of the shared store attaches them to those
    /// entries).
    pub(crate) fn publish(
        &mut self,
        table: &mut GroupTable,
        chain: &mut OwnChain<'_>,
        full: usize,
        computed: usize,
    ) {
        match (self, table) {
            (Self::Window(g), GroupTable::Window(t)) => g.publish(t, chain, full),
            (Self::SharedWindow(g), GroupTable::Window(t)) => g.publish(t, chain, full, computed),
            _ => {}
        }
    }

    /// Releases what no future query needs once `computed` tokens exist (R25).
    #[inline]
    pub(crate) fn slide(&mut self, table: &mut GroupTable, computed: usize) {
        match (self, table) {
            (Self::Window(g), GroupTable::Window(t)) => g.slide(t, computed),
            (Self::SharedWindow(g), GroupTable::Window(t)) => {
                g.slide(t, computed);
            }
            _ => {}
        }
    }

    /// Whether a step at `computed` tokens (prompt `prompt`) plans a copy that needs the prefix
    /// hash of that boundary (R24).
    pub(crate) fn saves_at(&self, table: &GroupTable, computed: usize, prompt: usize) -> bool {
        match (self, table) {
            (Self::Linear(g), GroupTable::Linear(t)) => g.saves_at(t, computed, prompt),
            _ => false,
        }
    }

    /// The computed-token count of the table's junction save still ahead (R24), if any.
    pub(crate) fn junction(&self, table: &GroupTable) -> Option<usize> {
        match (self, table) {
            (Self::Linear(g), GroupTable::Linear(t)) => g.junction(t),
            _ => None,
        }
    }

    /// After a forward step (`cache(seq)`): what the group plans at a step (R24); `save`: the
    /// prefix hash of the boundary at `computed`, its last block's link and tokens; a group
    /// of the one store takes the new checkpoint's memory from `full`'s store.
    pub(crate) fn step(
        &mut self,
        full: &mut FullGroup,
        table: &mut GroupTable,
        computed: usize,
        save: Option<(BlockHash, Anchor, crate::linear_state::Tail)>,
        ledger: &mut Ledger,
    ) {
        if let (Self::Linear(g), GroupTable::Linear(t)) = (self, table) {
            g.step(full, t, computed, save, ledger);
        }
    }

    /// Whether saves of this table wait for the links of their boundaries (linear state).
    pub(crate) fn awaits_anchors(&self, table: &GroupTable) -> bool {
        match (self, table) {
            (Self::Linear(g), GroupTable::Linear(t)) => g.awaits_anchors(t),
            _ => false,
        }
    }

    /// After a publication of the sequence's chain: resolves what waits for its links.
    pub(crate) fn anchor_saves(&mut self, table: &mut GroupTable, own: &mut OwnChain<'_>) {
        if let (Self::Linear(g), GroupTable::Linear(t)) = (self, table) {
            g.anchor_saves(t, own);
        }
    }

    /// Whether [`Self::step`] has anything to do (a live state to save or stale saves).
    pub(crate) fn steps(&self) -> bool {
        matches!(self, Self::Linear(_))
    }

    /// The sequence is released (R18): keeps or cancels what outlives it. `end`: the block of
    /// its full-attention table holding its last computed full block (the end mark of a group
    /// of the shared store).
    pub(crate) fn release(
        &mut self,
        full: &mut FullGroup,
        table: &mut GroupTable,
        ledger: &mut Ledger,
        end: Option<u32>,
    ) {
        match (self, table) {
            (Self::Window(g), GroupTable::Window(t)) => g.release(t),
            (Self::SharedWindow(g), GroupTable::Window(_)) => g.release(full, end),
            (Self::Linear(g), GroupTable::Linear(t)) => g.release(t, ledger),
            _ => {
                mismatch();
            }
        }
    }

    /// Drops everything cached that nothing holds (R12, R24, R25); a group of the shared store
    /// has nothing of its own (the full-attention cache's reset drops its attachments).
    pub(crate) fn reset(&mut self) {
        match self {
            Self::Window(g) => g.reset(),
            Self::SharedWindow(_) => {}
            Self::Linear(g) => g.reset(),
        }
    }

    /// Adds this group's counters (R20).
    pub(crate) fn count(&self, c: &mut GroupCounters) {
        match self {
            Self::Window(g) => {
                c.window = Some(g.counts());
                c.window_releases = g.releases();
            }
            Self::SharedWindow(g) => {
                c.window_releases = g.releases();
            }
            Self::Linear(g) => {
                let cache = g.cache();
                let s = cache.stats();
                c.live_slots = cache.num_live_slots();
                c.pending_checkpoints = cache.num_pending_checkpoints();
                c.committed_checkpoints = cache.num_committed_checkpoints();
                c.free_slots = cache.num_free_slots();
                c.linear_hits = g.hits();
                c.checkpoint_evictions = s.evictions;
                c.checkpoint_commits = s.commits;
                c.state_blocks = g.budget_blocks();
            }
        }
    }

    /// Walks the group's structures.
    pub(crate) fn check(&self, full: &FullGroup, ledger: &Ledger) -> Result<()> {
        match self {
            Self::Window(g) => g.check(),
            Self::SharedWindow(_) => Ok(()), // the full-attention cache's check covers it
            Self::Linear(g) => g.check(full, ledger),
        }
    }

    /// Checks a sequence's table of this group (`entries`: its full-attention table's length).
    pub(crate) fn check_table(
        &self,
        full: &FullGroup,
        table: &GroupTable,
        entries: usize,
        seq_id: u64,
    ) -> Result<()> {
        match (self, table) {
            (Self::Window(g), GroupTable::Window(t)) => g.check_table(t, entries, seq_id),
            (Self::SharedWindow(g), GroupTable::Window(t)) => {
                g.check_table(full, t, entries, seq_id)
            }
            (Self::Linear(g), GroupTable::Linear(t)) => g.check_table(t, seq_id),
            _ => {
                ensure_invariant!(
                    false,
                    "sequence {seq_id} holds a table of another group kind"
                );
                Ok(())
            }
        }
    }

    pub(crate) fn as_window(&self) -> Option<&WindowGroup> {
        match self {
            Self::Window(g) => Some(g),
            _ => None,
        }
    }

    pub(crate) fn as_window_mut(&mut self) -> Option<&mut WindowGroup> {
        match self {
            Self::Window(g) => Some(g),
            _ => None,
        }
    }

    pub(crate) fn as_shared_window(&self) -> Option<&SharedWindowGroup> {
        match self {
            Self::SharedWindow(g) => Some(g),
            _ => None,
        }
    }

    pub(crate) fn as_linear(&self) -> Option<&LinearGroup> {
        match self {
            Self::Linear(g) => Some(g),
            _ => None,
        }
    }

    pub(crate) fn as_linear_mut(&mut self) -> Option<&mut LinearGroup> {
        match self {
            Self::Linear(g) => Some(g),
            _ => None,
        }
    }
}
