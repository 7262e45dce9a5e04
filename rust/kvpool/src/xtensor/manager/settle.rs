//! How an [`XTensorBlockManager`] call settles: the inbox of released ids, the page rules
//! restored after every call, and what a failing page backend does to a call.
//!
//! Every `&mut self` call runs between [`XTensorBlockManager::begin`] (or a bare `drain` for a
//! release) and [`XTensorBlockManager::finish`], on every exit path: a call that answers "no
//! room" or fails still settles what its drain took in. A backend error is raised only by a
//! call that has done nothing of its own (docs/xtensor.md, "A failing backend"): `begin`
//! retries what an earlier failure left pending (unmaps of pages already empty, maps of
//! spares; never an eviction) and fails the call before its work; `finish` defers a failure
//! met while settling after the call's work (`unsettled`, the backend told through
//! [`crate::xtensor::PageBackend::deferred`]), so the call's result stands.
//!
//! Invariants: `unsettled` is set exactly while a backend failure left the page rules
//! unrestored; the page rules of the parent module hold after every `finish` that returns
//! with `unsettled` clear and the inbox empty.

use crate::error::{KvPoolError, Result};
use crate::prefix_cache::PrefixCache;
use crate::xtensor::backend::{backend_error, PageError};

use super::XTensorBlockManager;

impl XTensorBlockManager {
    // --- one call: begin, the call's own work, finish --------------------------------------------

    /// The start of a call that maps, evicts or allocates: takes in the releases and, if an
    /// earlier backend failure left pages pending, retries them first: the unmaps of pages
    /// already empty and the maps of spares, never an eviction. An error here is raised by the
    /// call before it does anything of its own (the pending pages stay pending).
    #[inline]
    pub(super) fn begin(&mut self) -> Result<()> {
        self.retry_pending()?;
        self.drain();
        Ok(())
    }

    /// The retry of [`Self::begin`] alone: what an earlier backend failure left pending (the
    /// pool runs it for every rank before a call that may allocate, then grows with
    /// [`Self::grow_into`], which does not retry: a failure met earlier in the same call stays
    /// deferred to the next).
    #[inline]
    pub(crate) fn retry_pending(&mut self) -> Result<()> {
        if self.unsettled {
            self.drain();
            self.trim_empty()?;
            self.replenish()?;
        }
        Ok(())
    }

    /// The end of every call, on every exit path: takes in what the call released and restores
    /// the page rules; `outcome` is the call's own result and stays so. A backend failure in
    /// the call's own work leaves the settling to the next call; one in this settling is
    /// deferred (the page stays as the backend left it, `unsettled`, and the backend is told,
    /// [`crate::xtensor::PageBackend::deferred`]): the next call retries it in [`Self::begin`].
    #[inline]
    pub(super) fn finish<T>(&mut self, outcome: Result<T>) -> Result<T> {
        self.drain(); // what the call released: evictions, handles a failed call gave back
        if matches!(outcome, Err(KvPoolError::PageBackend(_))) {
            self.unsettled = true;
            return outcome;
        }
        match self.settle() {
            Ok(()) => outcome,
            Err(KvPoolError::PageBackend(_)) => {
                self.backend.deferred();
                outcome
            }
            Err(error) => Err(error),
        }
    }

    /// Takes in the releases and settles, deferring a backend failure (the pool's take-in after
    /// a release: a release never raises one).
    pub(crate) fn take_in(&mut self) {
        if let Some(cache) = self.cache.as_mut() {
            cache.drain_released();
        }
        let _settled = self.finish(Ok(())); // only an invariant error could come back
    }

    // --- the inbox and the page rules --------------------------------------------------------

    /// Moves the ids released since the last call onto their pages.
    #[inline]
    pub(crate) fn drain(&mut self) {
        while let Some(id) = self.store.free.pop() {
            self.pages.push(id);
            self.released += 1;
        }
    }

    /// Most empty pages kept mapped (the top of the spare band).
    #[inline]
    pub(super) fn max_spares(&self) -> usize {
        2 * self.spare_pages
    }

    #[inline]
    pub(super) fn needs_settle(&self) -> bool {
        let empty = self.pages.empty_len();
        let mapped = self.pages.mapped();
        empty > self.max_spares()
            || mapped > self.limit_pages
            || (empty < self.spare_pages
                && !self.map_refused
                && mapped < self.limit_pages
                && self.pages.unmapped_len() > 0)
            || self.unsettled
    }

    /// Restores the page rules (module doc) after a change: unmaps the empty pages beyond the
    /// spares, reclaims toward the limit, maps spares.
    #[inline]
    pub(crate) fn settle(&mut self) -> Result<()> {
        if self.needs_settle() {
            self.settle_slow()
        } else {
            Ok(())
        }
    }

    pub(super) fn settle_slow(&mut self) -> Result<()> {
        self.unsettled = true;
        self.trim_empty()?;
        if self.pages.mapped() > self.limit_pages {
            self.reclaim_over_limit()?;
        }
        self.replenish()?;
        self.unsettled = false;
        Ok(())
    }

    /// Unmaps empty pages while more than `2 * spare_pages` are mapped (and the reservation
    /// keeps its ids), or while the limit is exceeded (cutting the reservation if it must).
    pub(crate) fn trim_empty(&mut self) -> Result<()> {
        loop {
            let over = self.pages.mapped() > self.limit_pages;
            if !over && self.pages.empty_len() <= self.max_spares() {
                return Ok(());
            }
            let Some(page) = self.pages.empty_to_unmap() else {
                return Ok(());
            };
            let left = self.pages.free_mapped() - self.pages.total(page) as usize;
            if left < self.reserved {
                if !over {
                    return Ok(());
                }
                self.reserved = left;
            }
            self.unmap_page(page)?;
        }
    }

    pub(super) fn reclaim_over_limit(&mut self) -> Result<()> {
        let Some(cache) = self.cache.as_mut() else {
            return Ok(());
        };
        cache.drain_released();
        if self.reclaimed_at == Some(self.reclaim_clock()) {
            return Ok(());
        }
        self.reclaim_pages()?;
        self.reclaimed_at = Some(self.reclaim_clock());
        Ok(())
    }

    /// What moves when a page may have become reclaimable (see `reclaimed_at`).
    pub(super) fn reclaim_clock(&self) -> (u64, u64) {
        let insertions = self.cache.as_ref().map_or(0, PrefixCache::lru_insertions);
        (self.released, insertions)
    }

    pub(super) fn replenish(&mut self) -> Result<()> {
        while self.pages.empty_len() < self.spare_pages
            && self.pages.mapped() < self.limit_pages
            && !self.map_refused
        {
            let Some(page) = self.pages.next_to_map() else {
                break;
            };
            match self.map_page(page) {
                Ok(()) | Err(PageError::OutOfMemory { .. }) => {} // a refusal ends the loop
                Err(error) => return Err(backend_error(error)),
            }
        }
        Ok(())
    }

    pub(super) fn map_page(&mut self, page: u32) -> std::result::Result<(), PageError> {
        if let Err(error) = self.backend.map_page(page as usize) {
            if matches!(error, PageError::OutOfMemory { .. }) {
                self.stats.map_failures += 1;
                self.map_refused = true;
            }
            return Err(error);
        }
        self.map_refused = false;
        self.pages.map(page);
        self.stats.maps += 1;
        self.stats.peak_mapped_pages = self.stats.peak_mapped_pages.max(self.pages.mapped());
        Ok(())
    }

    pub(crate) fn unmap_page(&mut self, page: u32) -> Result<()> {
        self.backend
            .unmap_page(page as usize)
            .map_err(backend_error)?;
        self.pages.unmap(page);
        self.stats.unmaps += 1;
        self.map_refused = false;
        Ok(())
    }

    /// Maps pages (the next in order) until `free ids on mapped pages >= want` or the limit or
    /// the range ends; returns the pages mapped. A refused map stops it (and sets
    /// `map_refused`); any other backend error unmaps what it mapped and is returned.
    pub(super) fn map_until(&mut self, want: usize) -> Result<Vec<u32>> {
        let mut fresh = Vec::new();
        while self.pages.free_mapped() < want && self.pages.mapped() < self.limit_pages {
            let Some(page) = self.pages.next_to_map() else {
                break;
            };
            match self.map_page(page) {
                Ok(()) => fresh.push(page),
                Err(PageError::OutOfMemory { .. }) => break,
                Err(error) => {
                    self.unmap_all(&fresh)?;
                    return Err(backend_error(error));
                }
            }
        }
        Ok(fresh)
    }

    /// Gives back the pages a call mapped before it failed; a refusal that made it fail stands.
    pub(super) fn unmap_all(&mut self, pages: &[u32]) -> Result<()> {
        let refused = self.map_refused;
        for &page in pages.iter().rev() {
            self.unmap_page(page)?;
        }
        self.map_refused = refused;
        Ok(())
    }

    /// Ids the unmapped pages within the limit would bring.
    pub(super) fn unmapped_capacity(&self) -> usize {
        let headroom = self.limit_pages.saturating_sub(self.pages.mapped());
        self.pages.ids_of_next(headroom)
    }
}
