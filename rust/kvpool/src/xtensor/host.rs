//! `HostPageBackend`: pages of one reserved anonymous mapping in the process's own memory.
//!
//! The whole range (`num_pages * page_bytes`) is reserved once with `PROT_NONE` and
//! `MAP_NORESERVE`: address space only, no memory committed. `map_page` makes a page readable
//! and writable and faults it in at once (`MADV_POPULATE_WRITE`, or one write per OS page where
//! the kernel lacks it), so a mapped page is resident memory, as a CUDA physical allocation
//! is; `unmap_page` hands the memory back (`MADV_DONTNEED`: the kernel frees the frames, a
//! later touch would read zeros) and makes the page inaccessible again (`PROT_NONE`), so a
//! stray access to an unmapped page faults instead of silently committing memory. The
//! process's resident memory therefore follows the mapped pages; [`HostPageBackend::
//! resident_bytes`] measures it for the range alone (`mincore`), independent of the rest of
//! the process.
//!
//! Invariants: `mapped[p]` is true exactly for the pages whose protection is read/write; the
//! mapping lives as long as the backend (unmapped in `Drop`).

use std::ptr::NonNull;

use crate::error::KvPoolError;
use crate::xtensor::backend::{PageBackend, PageError};

/// Host memory behind a manager's pages (module doc).
pub struct HostPageBackend {
    base: NonNull<u8>,
    page_bytes: usize,
    num_pages: usize,
    os_page: usize,
    mapped: Vec<bool>,
}

// SAFETY: the backend owns its mapping exclusively; the raw pointer is only dereferenced by
// the kernel calls of `&mut self` methods (and by `resident_bytes`, which only reads page
// residency), so moving the backend to another thread or sharing `&HostPageBackend` cannot race.
unsafe impl Send for HostPageBackend {}
// SAFETY: see `Send`: `&self` methods do not touch the memory.
unsafe impl Sync for HostPageBackend {}

fn os_page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

fn last_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

impl HostPageBackend {
    /// Reserves `num_pages * page_bytes` bytes of address space; `page_bytes` must be a positive
    /// multiple of the OS page size.
    pub fn new(num_pages: usize, page_bytes: usize) -> crate::Result<Self> {
        let os_page = os_page_size();
        if page_bytes == 0 || page_bytes % os_page != 0 {
            return Err(KvPoolError::invalid(
                "page_bytes",
                format!(
                    "must be a positive multiple of the OS page size {os_page}, got {page_bytes}"
                ),
            ));
        }
        let len = num_pages
            .checked_mul(page_bytes)
            .filter(|&len| len > 0 && len <= isize::MAX as usize)
            .ok_or_else(|| {
                KvPoolError::invalid(
                    "page_bytes",
                    format!("{num_pages} pages of {page_bytes} bytes do not fit the address space"),
                )
            })?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing; no
        // existing memory is affected. PROT_NONE + MAP_NORESERVE reserve address space only.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(KvPoolError::invalid(
                "page_bytes",
                format!(
                    "cannot reserve {len} bytes of address space: {}",
                    last_error()
                ),
            ));
        }
        Ok(Self {
            base: NonNull::new(base.cast()).expect("mmap does not return null on success"),
            page_bytes,
            num_pages,
            os_page,
            mapped: vec![false; num_pages],
        })
    }

    /// Start of the reserved range. Only mapped pages may be accessed; touching an unmapped page
    /// faults (`SIGSEGV`).
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Bytes of the reserved range.
    pub fn len(&self) -> usize {
        self.num_pages * self.page_bytes
    }

    /// Whether the range is empty (never: the constructor refuses it).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Whether `page` is mapped.
    pub fn is_mapped(&self, page: usize) -> bool {
        self.mapped.get(page).copied().unwrap_or(false)
    }

    fn page_start(&self, page: usize, operation: &'static str) -> Result<*mut u8, PageError> {
        if page >= self.num_pages {
            return Err(PageError::Failed {
                page,
                operation,
                message: format!("no such page (the range has {})", self.num_pages),
            });
        }
        // SAFETY: page < num_pages, so the offset stays inside the reserved range.
        Ok(unsafe { self.base.as_ptr().add(page * self.page_bytes) })
    }

    fn protect(&self, start: *mut u8, protection: libc::c_int) -> std::io::Result<()> {
        // SAFETY: [start, start + page_bytes) is a page of our own mapping.
        match unsafe { libc::mprotect(start.cast(), self.page_bytes, protection) } {
            0 => Ok(()),
            _ => Err(last_error()),
        }
    }

    /// Faults the page in (commits it).
    fn populate(&self, start: *mut u8) -> std::io::Result<()> {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: advice on a read/write page of our own mapping.
            let done =
                unsafe { libc::madvise(start.cast(), self.page_bytes, libc::MADV_POPULATE_WRITE) };
            if done == 0 {
                return Ok(());
            }
            let error = last_error();
            if error.raw_os_error() != Some(libc::EINVAL) {
                return Err(error); // ENOMEM and friends; EINVAL: a kernel before 5.14
            }
        }
        for offset in (0..self.page_bytes).step_by(self.os_page) {
            // SAFETY: inside a page that was just made read/write; a volatile write so the
            // touch is not optimised away. Fresh anonymous memory reads zero, so writing zero
            // changes no content.
            unsafe { start.add(offset).write_volatile(0) };
        }
        Ok(())
    }

    /// Bytes of the range resident in memory now (`mincore`).
    pub fn resident(&self) -> u64 {
        let pages = self.len().div_ceil(self.os_page);
        let mut residency = vec![0u8; pages];
        // SAFETY: the range is our mapping; `residency` has one byte per OS page of it.
        let status = unsafe {
            libc::mincore(
                self.base.as_ptr().cast(),
                self.len(),
                residency.as_mut_ptr().cast(),
            )
        };
        if status != 0 {
            return 0;
        }
        residency.iter().filter(|&&r| r & 1 != 0).count() as u64 * self.os_page as u64
    }
}

impl PageBackend for HostPageBackend {
    fn map_page(&mut self, page: usize) -> Result<(), PageError> {
        let start = self.page_start(page, "map_page")?;
        if self.mapped[page] {
            return Err(PageError::Failed {
                page,
                operation: "map_page",
                message: "already mapped".into(),
            });
        }
        let fail = |error: std::io::Error| match error.raw_os_error() {
            Some(libc::ENOMEM) | Some(libc::EAGAIN) => PageError::OutOfMemory { page },
            _ => PageError::Failed {
                page,
                operation: "map_page",
                message: error.to_string(),
            },
        };
        self.protect(start, libc::PROT_READ | libc::PROT_WRITE)
            .map_err(fail)?;
        if let Err(error) = self.populate(start) {
            // Give back whatever got faulted in and restore the reservation: nothing changed.
            // SAFETY: a page of our own mapping.
            unsafe { libc::madvise(start.cast(), self.page_bytes, libc::MADV_DONTNEED) };
            let _ = self.protect(start, libc::PROT_NONE);
            return Err(fail(error));
        }
        self.mapped[page] = true;
        Ok(())
    }

    fn unmap_page(&mut self, page: usize) -> Result<(), PageError> {
        let start = self.page_start(page, "unmap_page")?;
        let fail = |error: std::io::Error| PageError::Failed {
            page,
            operation: "unmap_page",
            message: error.to_string(),
        };
        if !self.mapped[page] {
            return Err(fail(std::io::Error::other("not mapped")));
        }
        // SAFETY: a mapped page of our own mapping; its contents are dead (every block on it
        // is free), so dropping them is what we want.
        if unsafe { libc::madvise(start.cast(), self.page_bytes, libc::MADV_DONTNEED) } != 0 {
            return Err(fail(last_error()));
        }
        self.protect(start, libc::PROT_NONE).map_err(fail)?;
        self.mapped[page] = false;
        Ok(())
    }

    fn resident_bytes(&self) -> Option<u64> {
        Some(self.resident())
    }
}

impl Drop for HostPageBackend {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `new` and is unmapped exactly once, here.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len()) };
    }
}

impl std::fmt::Debug for HostPageBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPageBackend")
            .field("num_pages", &self.num_pages)
            .field("page_bytes", &self.page_bytes)
            .field("mapped", &self.mapped.iter().filter(|&&m| m).count())
            .finish()
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn resident_memory_follows_the_mapped_pages() {
        let page = 256 * 1024;
        let mut backend = HostPageBackend::new(8, page).unwrap();
        assert_eq!(backend.resident(), 0, "a reservation commits nothing");
        for p in [0, 3, 5] {
            backend.map_page(p).unwrap();
        }
        assert_eq!(backend.resident(), 3 * page as u64);
        // SAFETY: page 3 is mapped read/write.
        unsafe { backend.as_ptr().add(3 * page + 17).write(42) };
        backend.unmap_page(3).unwrap();
        assert_eq!(backend.resident(), 2 * page as u64);
        backend.map_page(3).unwrap();
        // SAFETY: mapped again; MADV_DONTNEED dropped the old contents.
        assert_eq!(unsafe { backend.as_ptr().add(3 * page + 17).read() }, 0);
        assert!(
            backend.map_page(3).is_err(),
            "a mapped page is not mapped twice"
        );
        assert!(
            backend.unmap_page(1).is_err(),
            "an unmapped page is not unmapped"
        );
        assert!(backend.map_page(8).is_err());
        assert!(
            HostPageBackend::new(2, 1000).is_err(),
            "not a multiple of the OS page"
        );
    }
}
