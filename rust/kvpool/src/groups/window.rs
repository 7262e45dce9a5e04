//! The sliding-window group of a rank (R25): a [`SlidingWindowBlockManager`] as a group.
//!
//! Hit limit: the deepest boundary whose window blocks are all still held and published under
//! the chain, each linked to the full-attention entry the query's verified walk reaches at the
//! position before it (the manager's rule, `sliding_window.rs`; the links of `crate::chain`,
//! R7); taking the hit shares exactly those blocks. Publication follows the full-attention
//! cache: a block is published once that cache's publication of the chain went past it. Its table grows with the full-attention table (one entry per block) and slides
//! behind the window whenever the pool touches the sequence; at release the published blocks
//! still in the window are kept for a next turn. Window blocks never go to a host tier: a hit
//! whose window blocks are missing is trimmed (docs/host_tier.md).
//!
//! Events (R21): the manager's (`sliding_window/events.rs`): "stored" at publication,
//! "removed" once a block is no longer findable (found when the pool takes its events).
//!
//! Invariants: those of the manager (`SlidingWindowBlockManager::check`); a sequence's window
//! table has as many entries as its full-attention table.

use crate::error::{ensure_invariant, Result};
use crate::manager::{BlockCounts, BlockManager};
use crate::sliding_window::{SlidingWindowBlockManager, WindowTable};

use super::{OwnChain, QueryChain};

/// The sliding-window group of one rank.
pub(crate) struct WindowGroup {
    manager: SlidingWindowBlockManager,
    /// Window blocks released behind the window (stats).
    releases: u64,
}

impl WindowGroup {
    pub(crate) fn new(manager: SlidingWindowBlockManager) -> Self {
        Self {
            manager,
            releases: 0,
        }
    }

    pub(crate) fn manager(&self) -> &SlidingWindowBlockManager {
        &self.manager
    }

    pub(crate) fn manager_mut(&mut self) -> &mut SlidingWindowBlockManager {
        &mut self.manager
    }

    /// The deepest boundary `k <= limit` whose window blocks are held (0 always is).
    pub(crate) fn hit_limit(&self, chain: &QueryChain<'_>, limit: usize) -> usize {
        (1..=limit)
            .rev()
            .find(|&k| self.manager.hit_cost(chain, k).is_some())
            .unwrap_or(0)
    }

    /// Whether a hit at `k` (accepted by `hit_limit`), then `entries` table entries, fit.
    pub(crate) fn fits(&self, chain: &QueryChain<'_>, k: usize, entries: usize) -> bool {
        let cost = match k {
            0 => 0,
            _ => match self.manager.hit_cost(chain, k) {
                Some(cost) => cost,
                None => return false,
            },
        };
        entries.saturating_sub(k) <= self.manager.num_available().saturating_sub(cost)
    }

    /// The table of a hit at `k`: padding before the window, the window's blocks shared. `None`
    /// if a window block was released meanwhile (by a handle drop elsewhere).
    pub(crate) fn take_hit(&self, chain: &QueryChain<'_>, k: usize) -> Option<WindowTable> {
        let mut table = WindowTable::default();
        (k == 0 || self.manager.take_hit(&mut table, chain, k)).then_some(table)
    }

    pub(crate) fn grow(&mut self, table: &mut WindowTable, entries: usize) -> bool {
        self.manager.grow(table, entries).is_ok()
    }

    /// Whether `need` more entries can be had once the table slid to `computed` (F4).
    pub(crate) fn room(&self, table: &WindowTable, computed: usize, need: usize) -> bool {
        need <= self.manager.available_after_slide(table, computed)
    }

    /// Publishes the held full computed blocks among the first `full` entries, each with its
    /// link (with events: their "stored" events, under the chain's extra key).
    pub(crate) fn publish(
        &mut self,
        table: &mut WindowTable,
        chain: &mut OwnChain<'_>,
        full: usize,
    ) {
        if table.published < full {
            self.manager.publish(table, chain, full);
        }
    }

    /// Whether [`Self::publish`] has blocks to publish below `full`.
    pub(crate) fn wants_publish(&self, table: &WindowTable, full: usize) -> bool {
        table.published < full && self.manager.sharing()
    }

    /// Releases the blocks no future query can attend to (R25).
    #[inline]
    pub(crate) fn slide(&mut self, table: &mut WindowTable, computed: usize) {
        self.releases += self.manager.slide(table, computed) as u64;
    }

    /// Keeps the published blocks still in the window of a sequence being released (R25).
    pub(crate) fn release(&mut self, table: &WindowTable) {
        self.manager.keep_tail(table);
    }

    /// Drops the publications and kept tails; the events announced so far are forgotten, as
    /// the rank's device "cleared" event (which the pool records with the reset) covers them.
    pub(crate) fn reset(&mut self) {
        self.manager.reset_sharing();
        self.manager.forget_events();
    }

    pub(crate) fn counts(&self) -> BlockCounts {
        self.manager.counts()
    }

    pub(crate) fn releases(&self) -> u64 {
        self.releases
    }

    pub(crate) fn check(&self) -> Result<()> {
        self.manager.check()
    }

    /// A sequence's window table against its full-attention table of `entries` entries.
    pub(crate) fn check_table(
        &self,
        table: &WindowTable,
        entries: usize,
        seq_id: u64,
    ) -> Result<()> {
        ensure_invariant!(
            table.len() == entries && table.blocks().iter().all(|b| self.manager.owns(b)),
            "sequence {seq_id}: the window table does not match the full table (R25)"
        );
        Ok(())
    }
}
