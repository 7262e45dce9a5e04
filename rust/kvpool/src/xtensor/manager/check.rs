//! [`XTensorBlockManager`]'s `check()`: R1-R5 as in the plain manager, and the rules on the
//! mapped set the manager's module doc lists.

use super::XTensorBlockManager;
use crate::block::{CACHED, COUNT_MASK};
use crate::error::{ensure_invariant, Result};
use crate::manager::BlockManager;

impl XTensorBlockManager {
    /// Every invariant of the module doc (R1-R5 and the page rules).
    pub(super) fn check_all(&self) -> Result<()> {
        let n = self.store.num_blocks();
        let mut free = self.pages.check()?;
        let inbox = self.store.free.snapshot();
        ensure_invariant!(
            inbox.len() == self.store.free.len(),
            "the inbox holds {} ids but counts {}",
            inbox.len(),
            self.store.free.len()
        );
        for &id in &inbox {
            ensure_invariant!(id != 0, "padding block 0 was released (R1)");
            ensure_invariant!((id as usize) < n, "released id {id} out of range");
            ensure_invariant!(!free[id as usize], "id {id} is free twice (R4)");
            ensure_invariant!(
                self.pages.is_mapped(self.pages.page_of(id)),
                "released id {id} lies on an unmapped page"
            );
            free[id as usize] = true;
        }
        ensure_invariant!(
            self.store.state(0) & COUNT_MASK == 0,
            "padding block 0 was handed out (R1)"
        );
        let mut cached = 0;
        for id in 1..n as u32 {
            let state = self.store.state(id);
            let count = state & COUNT_MASK;
            ensure_invariant!(
                (count == 0) == free[id as usize],
                "block {id}: count {count} but {} free (R2, R4)",
                if free[id as usize] {
                    "listed"
                } else {
                    "not listed"
                }
            );
            if count > 0 {
                ensure_invariant!(
                    self.pages.is_mapped(self.pages.page_of(id)),
                    "block {id} is held on unmapped page {}",
                    self.pages.page_of(id)
                );
            }
            if state & CACHED != 0 {
                ensure_invariant!(
                    self.cache.is_some(),
                    "block {id} is cached with the cache off"
                );
                if count == 1 {
                    cached += 1;
                }
            }
        }
        self.counts().check(cached)?;
        if let Some(cache) = &self.cache {
            cache.check()?;
        }
        if inbox.is_empty() && !self.unsettled {
            self.check_page_rules()?;
        }
        Ok(())
    }

    /// The rules on the mapped set (module doc), once every release has been taken in.
    fn check_page_rules(&self) -> Result<()> {
        let (mapped, empty) = (self.pages.mapped(), self.pages.empty_len());
        let free = self.pages.free_mapped();
        ensure_invariant!(
            free >= self.reserved,
            "{} blocks are reserved but only {free} free ids are mapped",
            self.reserved
        );
        if mapped > self.limit_pages {
            ensure_invariant!(
                empty == 0,
                "{mapped} pages mapped over a limit of {}, {empty} of them empty",
                self.limit_pages
            );
            let settled_cache = self.cache.is_none()
                || (self.store.released.is_empty()
                    && self.reclaimed_at == Some(self.reclaim_clock()));
            if settled_cache {
                let reclaimable = crate::xtensor::reclaim::reclaimable_pages(self);
                ensure_invariant!(
                    reclaimable == 0,
                    "{mapped} pages mapped over a limit of {} but {reclaimable} could be \
                     reclaimed",
                    self.limit_pages
                );
            }
            return Ok(());
        }
        if empty > self.max_spares() {
            let smallest = self
                .pages
                .empty_pages()
                .iter()
                .map(|&p| self.pages.total(p) as usize)
                .min()
                .unwrap_or(0);
            ensure_invariant!(
                free - smallest < self.reserved,
                "{empty} empty pages mapped, {} spares allowed and the reservation does not \
                 need them",
                self.max_spares()
            );
        }
        if empty < self.spare_pages {
            ensure_invariant!(
                mapped == self.limit_pages || self.pages.unmapped_len() == 0 || self.map_refused,
                "{empty} empty pages mapped, {} spares wanted, and nothing stops mapping more",
                self.spare_pages
            );
        }
        Ok(())
    }
}
