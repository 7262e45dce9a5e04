//! Page-aware eviction: how an `XTensorBlockManager` gives memory back in whole pages.
//!
//! A mapped page returns its memory only once every block on it is free. Plain LRU eviction
//! frees blocks scattered over many pages and may return nothing, so when memory must be given
//! back (the memory limit is lowered, or `evict` is asked for blocks) the manager evicts page
//! by page:
//!
//! - a page is **reclaimable** when no sequence holds a block on it (every non-free block is
//!   cache-only) and no sequence holds a cached descendant of those blocks. Evicting the page
//!   means evicting its cached blocks and all their cached descendants (on any page), leaves
//!   first, so the cached set stays closed under prefix at every step (R10) and never loses a
//!   block a sequence holds;
//! - reclaimable pages go cheapest first: fewest cached blocks lost (the page's blocks plus
//!   their descendants; blocks nested under another block of the same page counted once
//!   through it), then the least recently used (the newest LRU position of the page's cached
//!   blocks), then the lowest page;
//! - for the limit, pages are evicted until the limit is met (each emptied page unmaps at
//!   once); for `evict(n)`, whole pages are evicted while they fit in what is left of `n`, and
//!   the rest is plain LRU among the evictable leaves ([`PrefixCache::evict`]);
//! - allocation, which reuses what it evicts at once, evicts by plain LRU: the ids come back
//!   on their pages and are handed out again, so which pages they lie on does not matter.
//!
//! Each call costs O(cached blocks + pages) for the analysis plus O(1) per evicted block.
//! Pages with a held block are never candidates; what they pin is reported by
//! `set_memory_limit` and reclaimed later, as their holders release them.

use std::collections::{HashMap, HashSet};

use crate::block::{BlockStore, CACHED, COUNT_MASK};
use crate::error::Result;
use crate::prefix_cache::PrefixCache;
use crate::xtensor::manager::XTensorBlockManager;
use crate::xtensor::pages::PageTable;

/// The cached blocks as a forest: children, and per block its subtree's size and whether a
/// sequence holds a block of it.
struct Forest {
    children: HashMap<u32, Vec<u32>>,
    subtree: HashMap<u32, (usize, bool)>,
}

fn is_held(store: &BlockStore, id: u32) -> bool {
    store.state(id) & COUNT_MASK != 1 // the cache holds one reference; more means a sequence
}

fn forest(cache: &PrefixCache, store: &BlockStore) -> Forest {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut subtree = HashMap::with_capacity(cache.len());
    for (id, parent) in cache.entries() {
        if let Some(parent) = parent {
            children.entry(parent).or_default().push(id);
        }
        subtree.insert(id, (1usize, is_held(store, id)));
    }
    // Leaves first (Kahn's order): a block is summed into its parent once all its children are.
    let mut waiting: HashMap<u32, usize> = children.iter().map(|(&p, c)| (p, c.len())).collect();
    let mut ready: Vec<u32> = subtree
        .keys()
        .copied()
        .filter(|id| !children.contains_key(id))
        .collect();
    while let Some(id) = ready.pop() {
        let Some(parent) = cache.parent_of(id) else {
            continue;
        };
        let (size, held) = subtree[&id];
        if let Some(entry) = subtree.get_mut(&parent) {
            entry.0 += size;
            entry.1 |= held;
        }
        if let Some(left) = waiting.get_mut(&parent) {
            *left -= 1;
            if *left == 0 {
                ready.push(parent);
            }
        }
    }
    Forest { children, subtree }
}

#[derive(Clone, Copy, Default)]
struct PageInfo {
    cache_only: u32,
    pinned: bool,
    cost: usize,
    age: usize,
}

/// A reclaimable page with its estimated cost and age.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    page: u32,
    cost: usize,
    age: usize,
}

/// The reclaimable pages, cheapest first (module doc). Needs the cache's `released` stack
/// drained (cache-only blocks not yet on the LRU count as held, so their page is skipped).
fn candidates(pages: &PageTable, cache: &PrefixCache, forest: &Forest) -> Vec<Candidate> {
    let mut info: HashMap<u32, PageInfo> = HashMap::new();
    for (position, id) in cache.lru_order().into_iter().enumerate() {
        let page = pages.page_of(id);
        if page == 0 {
            continue; // page 0 never unmaps
        }
        let entry = info.entry(page).or_default();
        entry.cache_only += 1;
        entry.age = position; // the LRU runs oldest first: the last seen is the newest
        let (size, held) = forest.subtree.get(&id).copied().unwrap_or((1, true));
        entry.pinned |= held;
        if cache.parent_of(id).map(|p| pages.page_of(p)) != Some(page) {
            entry.cost += size;
        }
    }
    let mut out: Vec<Candidate> = info
        .into_iter()
        .filter(|&(page, i)| {
            pages.is_mapped(page)
                && !i.pinned
                && pages.total(page) - pages.free(page) == i.cache_only
        })
        .map(|(page, i)| Candidate {
            page,
            cost: i.cost,
            age: i.age,
        })
        .collect();
    out.sort_unstable_by_key(|c| (c.cost, c.age, c.page));
    out
}

/// The cached blocks of `page`.
fn cached_on(store: &BlockStore, pages: &PageTable, page: u32) -> Vec<u32> {
    let per_page = pages.blocks_per_page() as u32;
    let start = (page * per_page).max(1);
    let end = ((page + 1) * per_page).min(store.num_blocks() as u32);
    (start..end)
        .filter(|&id| store.state(id) & CACHED != 0)
        .collect()
}

/// The cached children of `id` still in the cache.
fn live_children<'a>(
    cache: &'a PrefixCache,
    forest: &'a Forest,
    id: u32,
) -> impl Iterator<Item = u32> + 'a {
    forest
        .children
        .get(&id)
        .into_iter()
        .flatten()
        .copied()
        .filter(move |&child| cache.parent_of(child) == Some(id))
}

/// Blocks that evicting `roots` with their descendants would evict now.
fn eviction_size(cache: &PrefixCache, store: &BlockStore, forest: &Forest, roots: &[u32]) -> usize {
    let mut seen = HashSet::new();
    let mut stack: Vec<u32> = roots.to_vec();
    while let Some(id) = stack.pop() {
        if store.state(id) & CACHED == 0 || !seen.insert(id) {
            continue;
        }
        stack.extend(live_children(cache, forest, id));
    }
    seen.len()
}

/// Evicts `roots` and their cached descendants, leaves first (post-order); returns how many.
fn evict_subtrees(
    cache: &mut PrefixCache,
    store: &BlockStore,
    forest: &Forest,
    roots: &[u32],
) -> usize {
    let mut evicted = 0;
    let mut stack: Vec<(u32, bool)> = roots.iter().map(|&id| (id, false)).collect();
    while let Some((id, expanded)) = stack.pop() {
        if store.state(id) & CACHED == 0 {
            continue; // evicted already, through another root
        }
        if expanded {
            // Its descendants are gone: a cache-only leaf now (the page was reclaimable).
            if cache.evict_leaf(id) {
                evicted += 1;
            }
            continue;
        }
        stack.push((id, true));
        let children: Vec<u32> = live_children(cache, forest, id).collect();
        stack.extend(children.into_iter().map(|child| (child, false)));
    }
    evicted
}

impl XTensorBlockManager {
    /// Evicts whole reclaimable pages, cheapest first, until at most `limit_pages` are mapped
    /// (each emptied page unmaps at once) or none is left.
    pub(crate) fn reclaim_pages(&mut self) -> Result<()> {
        let Some(cache) = self.cache.as_mut() else {
            return Ok(());
        };
        cache.drain_released();
        self.drain();
        let Some(cache) = self.cache.as_ref() else {
            return Ok(());
        };
        let forest = forest(cache, &self.store);
        for candidate in candidates(&self.pages, cache, &forest) {
            if self.pages.mapped() <= self.limit_pages {
                break;
            }
            let roots = cached_on(&self.store, &self.pages, candidate.page);
            if let Some(cache) = self.cache.as_mut() {
                evict_subtrees(cache, &self.store, &forest, &roots);
            }
            self.drain();
            self.trim_empty()?;
        }
        Ok(())
    }

    /// Evicts up to `n` cached blocks: whole reclaimable pages while they fit in what is left,
    /// then LRU leaves; returns how many. The caller drains and settles after.
    pub(crate) fn reclaim_blocks(&mut self, n: usize) -> usize {
        self.drain();
        let Some(cache) = self.cache.as_mut() else {
            return 0;
        };
        cache.drain_released();
        if n == 0 {
            return 0;
        }
        let forest = forest(cache, &self.store);
        let mut evicted = 0;
        for candidate in candidates(&self.pages, cache, &forest) {
            if evicted == n {
                break;
            }
            let roots = cached_on(&self.store, &self.pages, candidate.page);
            if evicted + eviction_size(cache, &self.store, &forest, &roots) > n {
                continue;
            }
            evicted += evict_subtrees(cache, &self.store, &forest, &roots);
        }
        if evicted < n {
            evicted += cache.evict(n - evicted);
        }
        evicted
    }
}

/// Reclaimable pages now (for `check`: none may be left while the limit is exceeded).
pub(crate) fn reclaimable_pages(manager: &XTensorBlockManager) -> usize {
    manager.cache.as_ref().map_or(0, |cache| {
        let forest = forest(cache, &manager.store);
        candidates(&manager.pages, cache, &forest).len()
    })
}

/// Mapped pages on which a sequence holds a block.
pub(crate) fn held_pages(manager: &XTensorBlockManager) -> usize {
    let store = &manager.store;
    let pages = &manager.pages;
    let per_page = pages.blocks_per_page() as u32;
    (0..pages.num_pages() as u32)
        .filter(|&page| pages.is_mapped(page))
        .filter(|&page| {
            let start = (page * per_page).max(1);
            let end = ((page + 1) * per_page).min(store.num_blocks() as u32);
            (start..end).any(|id| {
                let state = store.state(id);
                let count = state & COUNT_MASK;
                count > 1 || (count == 1 && state & CACHED == 0)
            })
        })
        .count()
}
