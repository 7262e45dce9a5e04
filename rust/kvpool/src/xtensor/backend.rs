//! `PageBackend`: what maps and unmaps the memory behind a page, and the accounting-only one.
//!
//! The manager calls a backend only from `&mut self` methods, once per page state change:
//! `map_page(p)` for a page it is about to hand ids out of, `unmap_page(p)` for a page whose
//! ids are all free. It never maps a mapped page nor unmaps an unmapped one, and never unmaps
//! page 0 (it holds the padding block). A backend that fails leaves the page as it was: a
//! failed map leaves it unmapped, a failed unmap leaves it mapped, and the manager's books
//! follow the backend. [`PageError::OutOfMemory`] is the expected failure (another tenant of
//! the device holds the memory): the manager then treats the page as unavailable and hands out
//! what it has (allocation reports `OutOfBlocks`); any other error is passed on as
//! [`crate::KvPoolError::PageBackend`], raised by the call only if that call did nothing of its
//! own, else deferred to the next call, which retries first (the manager's module doc).

use std::sync::Arc;

use parking_lot::Mutex;

/// Why a page could not be mapped or unmapped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    /// No physical memory for the page now; nothing changed.
    #[error("page {page}: out of memory")]
    OutOfMemory {
        /// The page index.
        page: usize,
    },
    /// Anything else (a driver error, a bad page number); nothing changed.
    #[error("page {page}: {operation} failed: {message}")]
    Failed {
        /// The page index.
        page: usize,
        /// The backend operation that failed.
        operation: &'static str,
        /// The backend's own words.
        message: String,
    },
}

/// The memory behind the pages of one `XTensorBlockManager` (module doc).
pub trait PageBackend: Send + Sync {
    /// Backs `page` with physical memory.
    fn map_page(&mut self, page: usize) -> Result<(), PageError>;
    /// Returns `page`'s physical memory.
    fn unmap_page(&mut self, page: usize) -> Result<(), PageError>;
    /// The manager deferred the failure this backend just reported (it met it while settling
    /// after a call's own work: the page stays as it is and the manager's next call retries it,
    /// raising then if it fails again). A backend that keeps its errors for the caller to raise
    /// drops that one.
    fn deferred(&mut self) {}
    /// Physical bytes the backend holds now, where it can measure them (the host backend asks
    /// the kernel); `None` otherwise.
    fn resident_bytes(&self) -> Option<u64> {
        None
    }
}

#[derive(Debug, Default)]
struct Accounts {
    mapped: Vec<bool>,
    num_mapped: usize,
    /// Pages that may be mapped at once (`None`: no bound).
    capacity: Option<usize>,
    maps: u64,
    unmaps: u64,
}

/// A backend that maps nothing and keeps the books: which pages are mapped, how many maps and
/// unmaps it served. It refuses to map a mapped page or unmap an unmapped one (so a manager bug
/// surfaces as an error), and can be given a capacity to play a device whose memory another
/// tenant holds (maps beyond it fail with [`PageError::OutOfMemory`]). Clones share the books:
/// keep one to watch the backend a manager owns.
#[derive(Clone, Debug)]
pub struct AccountingBackend {
    accounts: Arc<Mutex<Accounts>>,
}

impl AccountingBackend {
    /// Books for `num_pages` pages, none mapped, no capacity bound.
    pub fn new(num_pages: usize) -> Self {
        Self {
            accounts: Arc::new(Mutex::new(Accounts {
                mapped: vec![false; num_pages],
                ..Accounts::default()
            })),
        }
    }

    /// Bounds the pages mapped at once (`None`: no bound). Lowering it below what is mapped
    /// unmaps nothing; later maps fail until enough pages are unmapped.
    pub fn set_capacity(&self, pages: Option<usize>) {
        self.accounts.lock().capacity = pages;
    }

    /// Pages mapped now.
    pub fn num_mapped(&self) -> usize {
        self.accounts.lock().num_mapped
    }

    /// Whether `page` is mapped.
    pub fn is_mapped(&self, page: usize) -> bool {
        self.accounts
            .lock()
            .mapped
            .get(page)
            .copied()
            .unwrap_or(false)
    }

    /// The mapped pages, ascending.
    pub fn mapped_pages(&self) -> Vec<usize> {
        let accounts = self.accounts.lock();
        (0..accounts.mapped.len())
            .filter(|&p| accounts.mapped[p])
            .collect()
    }

    /// Maps and unmaps served so far.
    pub fn operations(&self) -> (u64, u64) {
        let accounts = self.accounts.lock();
        (accounts.maps, accounts.unmaps)
    }
}

fn failed(page: usize, operation: &'static str, message: &str) -> PageError {
    PageError::Failed {
        page,
        operation,
        message: message.to_string(),
    }
}

impl PageBackend for AccountingBackend {
    fn map_page(&mut self, page: usize) -> Result<(), PageError> {
        let mut accounts = self.accounts.lock();
        match accounts.mapped.get(page) {
            None => return Err(failed(page, "map_page", "no such page")),
            Some(true) => return Err(failed(page, "map_page", "already mapped")),
            Some(false) => {}
        }
        if accounts.capacity.is_some_and(|c| accounts.num_mapped >= c) {
            return Err(PageError::OutOfMemory { page });
        }
        accounts.mapped[page] = true;
        accounts.num_mapped += 1;
        accounts.maps += 1;
        Ok(())
    }

    fn unmap_page(&mut self, page: usize) -> Result<(), PageError> {
        let mut accounts = self.accounts.lock();
        match accounts.mapped.get(page) {
            None => return Err(failed(page, "unmap_page", "no such page")),
            Some(false) => return Err(failed(page, "unmap_page", "not mapped")),
            Some(true) => {}
        }
        accounts.mapped[page] = false;
        accounts.num_mapped -= 1;
        accounts.unmaps += 1;
        Ok(())
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn accounting_refuses_double_maps_and_honours_its_capacity() {
        let mut backend = AccountingBackend::new(3);
        let view = backend.clone();
        backend.map_page(0).unwrap();
        assert!(matches!(
            backend.map_page(0),
            Err(PageError::Failed { page: 0, .. })
        ));
        assert!(backend.unmap_page(1).is_err());
        assert!(backend.map_page(3).is_err());
        view.set_capacity(Some(1));
        assert_eq!(backend.map_page(1), Err(PageError::OutOfMemory { page: 1 }));
        backend.unmap_page(0).unwrap();
        backend.map_page(1).unwrap();
        assert_eq!(view.mapped_pages(), vec![1]);
        assert_eq!(view.operations(), (2, 1));
    }
}

/// A backend's refusal as the crate's error.
pub(crate) fn backend_error(error: PageError) -> crate::KvPoolError {
    crate::KvPoolError::PageBackend(error.to_string())
}
