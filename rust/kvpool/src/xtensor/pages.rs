//! `PageTable`: the free ids of an `XTensorBlockManager`, grouped by virtual-memory page.
//!
//! Ids `p*B .. (p+1)*B` (B = `blocks_per_page`; the last page may be shorter) form page p. Id 0
//! (the padding block, R1) lies on page 0 and is never free here. Every page keeps its own
//! LIFO free list (linked through `next`, one slot per id), its free count and whether it is
//! mapped. The table is pure bookkeeping: the manager calls the page backend and then tells the
//! table (`map` / `unmap`).
//!
//! Invariants (checked by [`PageTable::check`]):
//! - page 0 is always mapped; an unmapped page has every id free and sits on no list;
//! - a mapped page other than 0 with `f` free ids out of `t` sits in exactly one place: nowhere
//!   when `f == 0` (full), in bucket `f` when `0 < f < t`, on the empty list when `f == t`.
//!   Page 0 sits in bucket `f` whenever `f > 0` (it never unmaps, so it is never "empty");
//! - bit `f` of the bucket bitmap is set iff bucket `f` is non-empty;
//! - `free_mapped` is the sum of `f` over mapped pages, `free_unmapped` the number of ids on
//!   unmapped pages, `mapped` and `empty_len` count the mapped and the empty mapped pages;
//! - unmapped pages wait in a stack (full-size pages) and one slot (the short last page): the
//!   short page is mapped last, so `k` more pages always bring `k * B` ids while a full-size
//!   page is left.
//!
//! Order of [`PageTable::pop`]: the fullest mapped page with room (lowest non-empty bucket: one
//! bitmap scan), then an empty mapped page; `None` when no mapped page has a free id. So new
//! blocks pack into the pages already holding blocks and a spare page is opened only when none
//! has room. Every operation is O(1) except the bitmap scan, O(B / 4096) words.

use crate::error::{ensure_invariant, Result};
use crate::xtensor::buckets::{BucketBits, Divider};

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Page {
    /// Top of this page's free list (`NIL` when none is free).
    head: u32,
    free: u32,
    /// Allocatable ids on the page (page 0 without the padding id, the last page maybe short).
    total: u32,
    /// Links of the bucket or empty list the page sits on.
    prev: u32,
    next: u32,
    mapped: bool,
}

/// Where a mapped page sits, by its free count.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Place {
    Full,
    Bucket(u32),
    Empty,
}

/// Free ids by page, with the mapped set (module doc).
pub(crate) struct PageTable {
    blocks_per_page: u32,
    divider: Divider,
    /// Free-list link per id.
    next: Box<[u32]>,
    pages: Box<[Page]>,
    /// First page of each bucket (index = free count; 0 unused).
    buckets: Box<[u32]>,
    bits: BucketBits,
    /// The empty list: pages emptied by frees enter at the head (their memory is the most
    /// recently used), freshly mapped pages at the tail; `pop` takes the head.
    empty_head: u32,
    empty_tail: u32,
    empty_len: usize,
    /// Unmapped full-size pages, the next to map on top.
    unmapped: Vec<u32>,
    /// The short last page while it is unmapped.
    unmapped_short: Option<u32>,
    free_mapped: usize,
    free_unmapped: usize,
    mapped: usize,
}

impl PageTable {
    /// `num_blocks` ids (padding 0 included) in pages of `blocks_per_page`; page 0 mapped, every
    /// other page unmapped. The caller has validated the numbers (`num_blocks >= 2`, both below
    /// `u32::MAX`) and sized its allocation probe with [`Self::bytes_per_block`].
    pub(crate) fn new(num_blocks: usize, blocks_per_page: usize) -> Result<Self> {
        let per_page = blocks_per_page as u32;
        let num_pages = num_blocks.div_ceil(blocks_per_page);
        let mut next = crate::alloc::boxed(num_blocks, "num_blocks", || NIL)?;
        let mut pages = crate::alloc::boxed(num_pages, "num_blocks", || Page {
            head: NIL,
            free: 0,
            total: 0,
            prev: NIL,
            next: NIL,
            mapped: false,
        })?;
        for (p, page) in pages.iter_mut().enumerate() {
            let start = (p * blocks_per_page).max(1) as u32;
            let end = ((p + 1) * blocks_per_page).min(num_blocks) as u32;
            // Lowest id on top: a fresh page hands out its ids in order.
            for id in (start..end).rev() {
                next[id as usize] = page.head;
                page.head = id;
            }
            page.total = end.saturating_sub(start);
            page.free = page.total;
        }
        let short = (num_pages > 1 && num_blocks % blocks_per_page != 0).then(|| num_pages - 1);
        let mut table = Self {
            blocks_per_page: per_page,
            divider: Divider::new(per_page),
            next,
            buckets: vec![NIL; blocks_per_page].into_boxed_slice(),
            bits: BucketBits::new(blocks_per_page),
            empty_head: NIL,
            empty_tail: NIL,
            empty_len: 0,
            // Page 1 on top: memory is mapped from the start of the range.
            unmapped: (1..num_pages as u32)
                .rev()
                .filter(|&p| Some(p as usize) != short)
                .collect(),
            unmapped_short: short.map(|p| p as u32),
            free_mapped: 0,
            free_unmapped: pages.iter().skip(1).map(|p| p.total as usize).sum(),
            mapped: 1,
            pages,
        };
        let first = &mut table.pages[0];
        first.mapped = true;
        table.free_mapped = first.total as usize;
        let place = table.place(0, table.pages[0].free);
        table.link(0, place);
        Ok(table)
    }

    /// Bytes the table spends per id and per page (for the manager's allocation probe).
    pub(crate) const BYTES_PER_ID: u128 = 4;
    pub(crate) const BYTES_PER_PAGE: u128 = std::mem::size_of::<Page>() as u128 + 4 + 4;

    #[inline]
    pub(crate) fn page_of(&self, id: u32) -> u32 {
        self.divider.divide(id)
    }

    pub(crate) fn num_pages(&self) -> usize {
        self.pages.len()
    }

    pub(crate) fn blocks_per_page(&self) -> usize {
        self.blocks_per_page as usize
    }

    /// Allocatable ids on `page`.
    pub(crate) fn total(&self, page: u32) -> u32 {
        self.pages[page as usize].total
    }

    /// Free ids on `page` (all of them when it is unmapped).
    pub(crate) fn free(&self, page: u32) -> u32 {
        self.pages[page as usize].free
    }

    pub(crate) fn is_mapped(&self, page: u32) -> bool {
        self.pages[page as usize].mapped
    }

    /// Mapped pages, page 0 included.
    #[inline]
    pub(crate) fn mapped(&self) -> usize {
        self.mapped
    }

    /// Mapped pages other than 0 with every id free.
    #[inline]
    pub(crate) fn empty_len(&self) -> usize {
        self.empty_len
    }

    /// Free ids on mapped pages.
    #[inline]
    pub(crate) fn free_mapped(&self) -> usize {
        self.free_mapped
    }

    /// Ids on unmapped pages (all free).
    pub(crate) fn free_unmapped(&self) -> usize {
        self.free_unmapped
    }

    /// Unmapped pages.
    pub(crate) fn unmapped_len(&self) -> usize {
        self.unmapped.len() + usize::from(self.unmapped_short.is_some())
    }

    /// Ids that mapping `pages` more pages would bring (full-size pages first).
    pub(crate) fn ids_of_next(&self, pages: usize) -> usize {
        if pages >= self.unmapped_len() {
            self.free_unmapped
        } else {
            pages * self.blocks_per_page as usize
        }
    }

    /// The page [`Self::map`] should get next: a full-size page while one is left.
    pub(crate) fn next_to_map(&self) -> Option<u32> {
        self.unmapped.last().copied().or(self.unmapped_short)
    }

    /// The empty page to unmap first: the short last page (fewest ids for the same memory),
    /// else the tail of the empty list (the least recently emptied; `pop` takes the head).
    pub(crate) fn empty_to_unmap(&self) -> Option<u32> {
        match self.unmapped_short {
            None if self.short_page().is_some_and(|p| self.is_empty_mapped(p)) => self.short_page(),
            _ => (self.empty_tail != NIL).then_some(self.empty_tail),
        }
    }

    fn short_page(&self) -> Option<u32> {
        let last = self.pages.len() - 1;
        (last > 0 && self.pages[last].total < self.blocks_per_page).then_some(last as u32)
    }

    fn is_empty_mapped(&self, page: u32) -> bool {
        let p = &self.pages[page as usize];
        page != 0 && p.mapped && p.free == p.total
    }

    /// The empty mapped pages (other than 0), for `check` and reports.
    pub(crate) fn empty_pages(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.empty_len);
        let mut page = self.empty_head;
        while page != NIL && out.len() <= self.pages.len() {
            out.push(page);
            page = self.pages[page as usize].next;
        }
        out
    }

    #[inline]
    fn place(&self, page: u32, free: u32) -> Place {
        let total = self.pages[page as usize].total;
        if free == 0 {
            Place::Full
        } else if free < total || page == 0 {
            Place::Bucket(free)
        } else {
            Place::Empty
        }
    }

    #[inline]
    fn link(&mut self, page: u32, place: Place) {
        let head = match place {
            Place::Full => return,
            Place::Bucket(f) => {
                let head = self.buckets[f as usize];
                self.buckets[f as usize] = page;
                if head == NIL {
                    self.bits.set(f);
                }
                head
            }
            Place::Empty => {
                self.empty_len += 1;
                if self.empty_tail == NIL {
                    self.empty_tail = page;
                }
                std::mem::replace(&mut self.empty_head, page)
            }
        };
        let p = &mut self.pages[page as usize];
        p.prev = NIL;
        p.next = head;
        if head != NIL {
            self.pages[head as usize].prev = page;
        }
    }

    /// Puts an empty page at the tail of the empty list (a freshly mapped page: used after the
    /// recently emptied ones, and pages mapped together are used in the order they were mapped).
    fn link_empty_tail(&mut self, page: u32) {
        let tail = std::mem::replace(&mut self.empty_tail, page);
        {
            let p = &mut self.pages[page as usize];
            p.prev = tail;
            p.next = NIL;
        }
        if tail == NIL {
            self.empty_head = page;
        } else {
            self.pages[tail as usize].next = page;
        }
        self.empty_len += 1;
    }

    #[inline]
    fn unlink(&mut self, page: u32, place: Place) {
        if place == Place::Full {
            return;
        }
        let Page { prev, next, .. } = self.pages[page as usize];
        if next != NIL {
            self.pages[next as usize].prev = prev;
        } else if place == Place::Empty {
            self.empty_tail = prev;
        }
        if prev != NIL {
            self.pages[prev as usize].next = next;
        } else if let Place::Bucket(f) = place {
            self.buckets[f as usize] = next;
            if next == NIL {
                self.bits.clear(f);
            }
        } else {
            self.empty_head = next;
        }
        if place == Place::Empty {
            self.empty_len -= 1;
        }
    }

    /// Moves `page` from the place of free count `before` to that of `after`.
    #[inline]
    fn relink(&mut self, page: u32, before: u32, after: u32) {
        let (from, to) = (self.place(page, before), self.place(page, after));
        self.unlink(page, from);
        self.link(page, to);
    }

    /// Takes `page` off bucket `f` (it sits there: its free count is `f`).
    #[inline]
    fn unlink_bucket(&mut self, page: u32, f: u32) {
        let Page { prev, next, .. } = self.pages[page as usize];
        if next != NIL {
            self.pages[next as usize].prev = prev;
        }
        if prev != NIL {
            self.pages[prev as usize].next = next;
        } else {
            self.buckets[f as usize] = next;
            if next == NIL {
                self.bits.clear(f);
            }
        }
    }

    /// Puts `page` on bucket `f`.
    #[inline]
    fn link_bucket(&mut self, page: u32, f: u32) {
        let head = std::mem::replace(&mut self.buckets[f as usize], page);
        let p = &mut self.pages[page as usize];
        p.prev = NIL;
        p.next = head;
        if head != NIL {
            self.pages[head as usize].prev = page;
        } else {
            self.bits.set(f);
        }
    }

    /// A free id from the fullest mapped page with room (module doc), or `None`. Also returns
    /// whether the page was empty (a spare was opened).
    #[inline]
    pub(crate) fn pop(&mut self) -> Option<(u32, bool)> {
        let Some(f) = self.bits.lowest() else {
            return self.pop_empty();
        };
        // A page in bucket f has f free ids, fewer than its total (or it is page 0): after the
        // pop it has f - 1, so it moves to bucket f - 1, or off the lists when full.
        let page = self.buckets[f as usize];
        let p = &mut self.pages[page as usize];
        let id = p.head;
        p.head = self.next[id as usize];
        p.free = f - 1;
        self.unlink_bucket(page, f);
        if f > 1 {
            self.link_bucket(page, f - 1);
        }
        self.free_mapped -= 1;
        Some((id, false))
    }

    /// `pop` from an empty page, when no partly used page has room.
    fn pop_empty(&mut self) -> Option<(u32, bool)> {
        let page = self.empty_head;
        if page == NIL {
            return None;
        }
        let p = &mut self.pages[page as usize];
        let id = p.head;
        p.head = self.next[id as usize];
        p.free -= 1;
        let free = p.free;
        self.relink(page, free + 1, free);
        self.free_mapped -= 1;
        Some((id, true))
    }

    /// Puts a freed id back on its page, which is mapped (it was handed out from there).
    #[inline]
    pub(crate) fn push(&mut self, id: u32) {
        let page = self.page_of(id);
        let p = &mut self.pages[page as usize];
        debug_assert!(p.mapped && p.free < p.total && id != 0);
        self.next[id as usize] = p.head;
        p.head = id;
        let f = p.free;
        p.free = f + 1;
        let total = p.total;
        if f > 0 {
            self.unlink_bucket(page, f); // 0 < f < total: the page sat in bucket f
        }
        if f + 1 < total || page == 0 {
            self.link_bucket(page, f + 1);
        } else {
            self.link(page, Place::Empty);
        }
        self.free_mapped += 1;
    }

    /// Marks `page` mapped (the backend just mapped it): it becomes an empty page.
    pub(crate) fn map(&mut self, page: u32) {
        debug_assert!(!self.pages[page as usize].mapped);
        if self.unmapped_short == Some(page) {
            self.unmapped_short = None;
        } else {
            let at = self.unmapped.iter().rposition(|&p| p == page);
            debug_assert!(at.is_some(), "page {page} is not waiting to be mapped");
            if let Some(at) = at {
                self.unmapped.remove(at);
            }
        }
        let total = self.pages[page as usize].total;
        self.pages[page as usize].mapped = true;
        self.mapped += 1;
        self.free_mapped += total as usize;
        self.free_unmapped -= total as usize;
        match self.place(page, total) {
            Place::Empty => self.link_empty_tail(page),
            place => self.link(page, place),
        }
    }

    /// Marks the empty `page` unmapped (the backend just unmapped it).
    pub(crate) fn unmap(&mut self, page: u32) {
        debug_assert!(self.is_empty_mapped(page));
        let total = self.pages[page as usize].total;
        self.unlink(page, Place::Empty);
        self.pages[page as usize].mapped = false;
        self.mapped -= 1;
        self.free_mapped -= total as usize;
        self.free_unmapped += total as usize;
        if Some(page) == self.short_page() {
            self.unmapped_short = Some(page);
        } else {
            self.unmapped.push(page);
        }
    }

    /// Walks every structure (module doc); returns, per id, whether it is in a page's free list.
    pub(crate) fn check(&self) -> Result<Vec<bool>> {
        let n = self.next.len();
        let mut free = vec![false; n];
        let (mut free_mapped, mut free_unmapped, mut mapped, mut empty) = (0, 0, 0, 0);
        let mut expected: Vec<Option<Place>> = vec![None; self.pages.len()];
        for (p, page) in self.pages.iter().enumerate() {
            let mut count = 0u32;
            let mut id = page.head;
            while id != NIL && count <= page.total {
                ensure_invariant!(
                    id != 0 && (id as usize) < n,
                    "page {p}'s free list holds id {id} (R1)"
                );
                ensure_invariant!(
                    self.page_of(id) as usize == p,
                    "page {p}'s free list holds id {id} of page {}",
                    self.page_of(id)
                );
                ensure_invariant!(!free[id as usize], "id {id} is twice in page {p}'s list");
                free[id as usize] = true;
                count += 1;
                id = self.next[id as usize];
            }
            ensure_invariant!(
                id == NIL && count == page.free && page.free <= page.total,
                "page {p} counts {} free ids but lists {count} of {}",
                page.free,
                page.total
            );
            if page.mapped {
                mapped += 1;
                free_mapped += page.free as usize;
                let place = self.place(p as u32, page.free);
                if place == Place::Empty {
                    empty += 1;
                }
                expected[p] = Some(place);
            } else {
                ensure_invariant!(p != 0, "page 0 is unmapped");
                ensure_invariant!(
                    page.free == page.total,
                    "unmapped page {p} has {} of {} ids handed out",
                    page.total - page.free,
                    page.total
                );
                free_unmapped += page.free as usize;
            }
        }
        ensure_invariant!(
            (free_mapped, free_unmapped, mapped, empty)
                == (
                    self.free_mapped,
                    self.free_unmapped,
                    self.mapped,
                    self.empty_len
                ),
            "page counters are off: free mapped {}/{free_mapped}, free unmapped {}/{free_unmapped}, \
             mapped {}/{mapped}, empty {}/{empty}",
            self.free_mapped,
            self.free_unmapped,
            self.mapped,
            self.empty_len
        );
        let mut seen = vec![false; self.pages.len()];
        let walk = |head: u32, place: Place, seen: &mut Vec<bool>| -> Result<()> {
            let mut prev = NIL;
            let mut page = head;
            while page != NIL {
                ensure_invariant!(!seen[page as usize], "page {page} is on two lists");
                seen[page as usize] = true;
                ensure_invariant!(
                    expected[page as usize] == Some(place),
                    "page {page} sits in {place:?} but belongs in {:?}",
                    expected[page as usize]
                );
                ensure_invariant!(
                    self.pages[page as usize].prev == prev,
                    "list links broken at page {page}"
                );
                prev = page;
                page = self.pages[page as usize].next;
            }
            Ok(())
        };
        for f in 1..self.buckets.len() as u32 {
            ensure_invariant!(
                self.bits.get(f) == (self.buckets[f as usize] != NIL),
                "bucket bit {f} disagrees with its list"
            );
            walk(self.buckets[f as usize], Place::Bucket(f), &mut seen)?;
        }
        ensure_invariant!(self.buckets[0] == NIL, "bucket 0 holds a page");
        walk(self.empty_head, Place::Empty, &mut seen)?;
        let last = self.empty_pages().last().copied().unwrap_or(NIL);
        ensure_invariant!(
            last == self.empty_tail,
            "the empty list's tail pointer is off"
        );
        for (p, place) in expected.iter().enumerate() {
            let listed = !matches!(place, None | Some(Place::Full));
            ensure_invariant!(
                seen[p] == listed,
                "page {p} ({place:?}) is {} a list",
                if seen[p] { "on" } else { "not on" }
            );
        }
        let mut waiting = vec![false; self.pages.len()];
        for &p in self.unmapped.iter().chain(self.unmapped_short.iter()) {
            ensure_invariant!(
                !self.pages[p as usize].mapped && !waiting[p as usize],
                "page {p} waits to be mapped twice or while mapped"
            );
            waiting[p as usize] = true;
        }
        ensure_invariant!(
            self.unmapped_len() == self.pages.len() - self.mapped,
            "{} pages wait to be mapped but {} are unmapped",
            self.unmapped_len(),
            self.pages.len() - self.mapped
        );
        ensure_invariant!(
            self.unmapped_short
                .is_none_or(|p| Some(p) == self.short_page()),
            "a full-size page waits in the short page's slot"
        );
        Ok(free)
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn divider_matches_division() {
        for d in [1u32, 2, 3, 7, 16, 63, 64, 100, 1000, 4096, 65535, 65536] {
            let divider = Divider::new(d);
            for n in (0..5000u32).chain([u32::MAX - 1, u32::MAX, 1 << 31, (1 << 30) + 17]) {
                assert_eq!(divider.divide(n), n / d, "{n} / {d}");
            }
        }
    }

    #[test]
    fn fullest_page_first_then_empty_pages() {
        // 4 pages of 4 ids: page 0 holds 1..4, pages 1..3 hold 4..16.
        let mut t = PageTable::new(16, 4).unwrap();
        t.check().unwrap();
        assert_eq!((t.mapped(), t.free_mapped(), t.free_unmapped()), (1, 3, 12));
        assert_eq!(t.next_to_map(), Some(1));
        t.map(1);
        t.map(2);
        assert_eq!(t.empty_len(), 2);
        // Page 0 first (it is in the buckets), then an empty page.
        let taken: Vec<u32> = (0..4).map(|_| t.pop().unwrap().0).collect();
        assert_eq!(&taken[..3], &[1, 2, 3]);
        let page = t.page_of(taken[3]);
        assert!(page == 1 || page == 2);
        t.check().unwrap();
        // Fewer free ids = fuller: page 0 with 1 free goes before `page` with 3 free.
        t.push(2);
        assert_eq!(t.pop().unwrap(), (2, false));
        let (id, opened) = t.pop().unwrap();
        assert_eq!(
            (t.page_of(id), opened),
            (page, false),
            "the partly used page before a spare"
        );
        t.check().unwrap();
    }

    proptest::proptest! {
        /// Random pops and pushes (large pages too: several bitmap words and summary words):
        /// `pop` always takes from the fullest mapped page with room, and `check` passes.
        #[test]
        fn pop_takes_the_fullest_page_with_room(
            steps in proptest::collection::vec((0u8..4, proptest::prelude::any::<u16>()), 1..300),
            per_page in proptest::prop_oneof![proptest::strategy::Just(3usize), proptest::strategy::Just(70), proptest::strategy::Just(5000)],
        ) {
            let num_blocks = per_page * 5 + per_page / 2;
            let mut t = PageTable::new(num_blocks, per_page).unwrap();
            let mut held: Vec<u32> = Vec::new();
            for (kind, pick) in steps {
                match kind {
                    0 => if let Some(page) = t.next_to_map() { t.map(page) },
                    1 => if let Some(page) = t.empty_to_unmap() { t.unmap(page) },
                    2 if !held.is_empty() => {
                        let id = held.swap_remove(pick as usize % held.len());
                        t.push(id);
                    }
                    _ => {
                        let fullest = (0..t.num_pages() as u32)
                            .filter(|&p| t.is_mapped(p) && t.free(p) > 0)
                            .filter(|&p| p == 0 || t.free(p) < t.total(p))
                            .map(|p| t.free(p))
                            .min();
                        match t.pop() {
                            Some((id, opened)) => {
                                let page = t.page_of(id);
                                match fullest {
                                    Some(f) => proptest::prop_assert!(!opened && t.free(page) + 1 == f),
                                    None => proptest::prop_assert!(opened),
                                }
                                held.push(id);
                            }
                            None => proptest::prop_assert_eq!(t.free_mapped(), 0),
                        }
                    }
                }
                t.check().unwrap();
            }
        }
    }

    #[test]
    fn short_last_page_is_mapped_last_and_unmapped_first() {
        let mut t = PageTable::new(10, 4).unwrap(); // pages: 0 (1..4), 1 (4..8), 2 (8..10)
        assert_eq!(t.total(2), 2);
        assert_eq!(t.ids_of_next(1), 4);
        assert_eq!(t.ids_of_next(2), 6);
        assert_eq!(t.next_to_map(), Some(1));
        t.map(1);
        assert_eq!(t.next_to_map(), Some(2));
        t.map(2);
        assert_eq!(t.empty_to_unmap(), Some(2));
        t.unmap(2);
        t.check().unwrap();
        assert_eq!(t.empty_to_unmap(), Some(1));
        t.unmap(1);
        assert_eq!(t.next_to_map(), Some(1));
        t.check().unwrap();
    }
}
