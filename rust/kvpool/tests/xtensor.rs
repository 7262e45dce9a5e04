//! `XTensorBlockManager`: pages mapped as blocks are handed out and unmapped as they
//! empty, spares, reservation, the memory limit, page-aware eviction with the prefix cache, the
//! page backends; plus a proptest of random workloads with `check()` and the page rules after
//! every step.

use std::collections::BTreeSet;

use kvpool::HostPageBackend;
use kvpool::{
    AccountingBackend, Block, BlockHasher, BlockManager, KvPoolError, PageBackend, PageError,
    XTensorBlockManager, XTensorConfig,
};
use proptest::prelude::*;

const PAGE: u64 = 1 << 20;

fn config(num_blocks: usize, blocks_per_page: usize, spare_pages: usize) -> XTensorConfig {
    let mut config = XTensorConfig::new(num_blocks, 4, blocks_per_page);
    config.page_bytes = PAGE;
    config.spare_pages = spare_pages;
    config
}

/// A manager on an accounting backend, with a view of that backend.
fn manager(config: XTensorConfig) -> (XTensorBlockManager, AccountingBackend) {
    let backend = AccountingBackend::new(config.num_pages());
    let view = backend.clone();
    (
        XTensorBlockManager::with_backend(config, Box::new(backend)).unwrap(),
        view,
    )
}

fn pages_of(m: &XTensorBlockManager, blocks: &[Block]) -> BTreeSet<usize> {
    blocks.iter().map(|b| m.page_of(b.id()).unwrap()).collect()
}

/// Tokens of `n` full blocks: the first `shared` blocks common to `family`, the rest unique.
fn tokens(family: u32, shared: usize, n: usize, unique: u32) -> Vec<u32> {
    (0..n * 4)
        .map(|i| match i / 4 < shared {
            true => family * 1000 + i as u32,
            false => 1_000_000 + unique * 10_000 + i as u32,
        })
        .collect()
}

/// The page rules from the outside (module doc of `xtensor::manager`): the mapped pages are
/// page 0, the pages holding a held or cached block, and the spares; the backend agrees.
fn assert_page_rules(m: &XTensorBlockManager, backend: &AccountingBackend, held: &[&Block]) {
    m.check().unwrap();
    let mapped: BTreeSet<usize> = m.mapped_page_ids().into_iter().collect();
    assert_eq!(
        backend.mapped_pages().into_iter().collect::<BTreeSet<_>>(),
        mapped,
        "the backend and the manager disagree on the mapped pages"
    );
    let mut occupied: BTreeSet<usize> = held.iter().map(|b| m.page_of(b.id()).unwrap()).collect();
    if let Some(cache) = m.prefix_cache() {
        occupied.extend(cache.entries().map(|(id, _)| m.page_of(id).unwrap()));
    }
    occupied.insert(0);
    assert!(
        occupied.is_subset(&mapped),
        "a page holding blocks is unmapped: occupied {occupied:?}, mapped {mapped:?}"
    );
    let spares = mapped.difference(&occupied).count();
    let room = m.limit_pages().saturating_sub(occupied.len());
    let unmapped = m.num_pages() - mapped.len();
    if m.reserved() == 0 {
        // Between `spare_pages` (fewer where the limit or the range stops it, or the device
        // refused a map) and `2 * spare_pages`.
        let wanted = m.spare_pages().min(room).min(spares + unmapped);
        assert!(
            (spares >= wanted || m.page_stats().map_failures > 0) && spares <= 2 * m.spare_pages(),
            "{spares} spare pages mapped, {wanted}..={} wanted (mapped {mapped:?}, occupied \
             {occupied:?}, limit {} pages)",
            2 * m.spare_pages(),
            m.limit_pages()
        );
    }
    if mapped.len() > m.limit_pages() {
        assert_eq!(spares, 0, "over the limit with a spare page mapped");
    }
    assert_eq!(m.mapped_bytes(), mapped.len() as u64 * m.page_bytes());
}

#[test]
fn construction_maps_page_zero_and_the_spares() {
    let (m, backend) = manager(config(64, 8, 2));
    assert_eq!(m.num_pages(), 8);
    assert_eq!(m.mapped_page_ids(), vec![0, 1, 2]);
    assert_eq!(backend.mapped_pages(), vec![0, 1, 2]);
    assert_eq!(m.counts().total, 63);
    assert_eq!(m.counts().free, 63, "unmapped ids are free (R2)");
    assert_eq!(m.num_available_blocks(), 63);
    assert_page_rules(&m, &backend, &[]);
}

#[test]
fn allocation_packs_into_the_fullest_page_and_maps_only_when_none_has_room() {
    let (mut m, backend) = manager(config(64, 8, 0));
    assert_eq!(m.mapped_page_ids(), vec![0]);
    // Page 0 holds ids 1..8 (7 blocks); an 8th block needs page 1.
    let a = m.allocate(7).unwrap();
    assert_eq!(pages_of(&m, &a), BTreeSet::from([0]));
    assert!(
        a.iter().all(|b| b.id() != 0),
        "the padding block is never handed out (R1)"
    );
    assert_eq!(m.mapped_pages(), 1);
    let b = m.allocate(3).unwrap();
    assert_eq!(pages_of(&m, &b), BTreeSet::from([1]));
    assert_eq!(backend.operations(), (2, 0));
    // Free two blocks of page 0 and one of page 1: page 1 (5 free) is less full than page 0
    // (2 free), so the next two blocks go to page 0.
    let mut a = a;
    let freed: Vec<Block> = a.drain(..2).collect();
    m.deallocate(freed).unwrap();
    let c = m.allocate(2).unwrap();
    assert_eq!(pages_of(&m, &c), BTreeSet::from([0]));
    assert_page_rules(
        &m,
        &backend,
        &a.iter().chain(&b).chain(&c).collect::<Vec<_>>(),
    );
    // Page 1 unmaps when its last block goes.
    m.deallocate(b).unwrap();
    assert_eq!(m.mapped_page_ids(), vec![0]);
    assert_eq!(backend.operations(), (2, 1));
    m.deallocate(a).unwrap();
    m.deallocate(c).unwrap();
    assert_page_rules(&m, &backend, &[]);
    assert_eq!(m.counts().free, 63, "every id back");
}

#[test]
fn a_spare_page_absorbs_churn_at_a_page_boundary() {
    let (mut m, backend) = manager(config(64, 8, 1));
    let base = m.allocate(7).unwrap(); // page 0 full
    let maps = backend.operations().0;
    for _ in 0..100 {
        let block = m.allocate_one().unwrap();
        drop(block);
        m.trim().unwrap();
    }
    // The first allocation opened the spare (page 1) and mapped a new spare (page 2); the churn
    // then stays on page 1, which empties and is kept (two spares are within the band): after
    // that first step no page is mapped or unmapped.
    assert_eq!(backend.operations(), (maps + 1, 0));
    assert_eq!(m.mapped_page_ids(), vec![0, 1, 2]);
    assert_page_rules(&m, &backend, &base.iter().collect::<Vec<_>>());
}

#[test]
fn r3_a_failed_allocation_changes_nothing_and_available_is_exact() {
    let mut c = config(40, 8, 1);
    c.memory_limit = Some(3 * PAGE); // pages 0..3: 7 + 8 + 8 = 23 ids
    let (mut m, backend) = manager(c);
    assert_eq!(m.num_available_blocks(), 23);
    assert_eq!(m.counts().free, 39, "R2 counts every unmapped id as free");
    let err = m.allocate(24).unwrap_err();
    assert_eq!(
        err,
        KvPoolError::OutOfBlocks {
            requested: 24,
            available: 23
        }
    );
    assert_eq!(
        m.mapped_pages(),
        2,
        "page 0 and the spare, nothing mapped by the failure"
    );
    let all = m.allocate(23).unwrap();
    assert_eq!(m.mapped_pages(), 3);
    assert_eq!(m.num_available_blocks(), 0);
    assert_page_rules(&m, &backend, &all.iter().collect::<Vec<_>>());
    m.deallocate(all).unwrap();
    assert_eq!(m.num_available_blocks(), 23);
    assert_page_rules(&m, &backend, &[]);
}

#[test]
fn cached_blocks_keep_their_page_and_allocation_evicts_only_past_the_limit() {
    let mut c = config(40, 8, 0);
    c.memory_limit = Some(3 * PAGE);
    let (mut m, backend) = manager(c);
    let a = m.allocate(15).unwrap(); // pages 0 and 1
    let t = tokens(1, 0, 15, 1);
    assert_eq!(m.cache(&t, &a, None).unwrap(), 15);
    m.deallocate(a).unwrap();
    assert_eq!(m.counts().cached, 15);
    assert_eq!(
        m.mapped_page_ids(),
        vec![0, 1],
        "cached blocks keep their pages mapped"
    );
    assert_eq!(
        m.num_available_blocks(),
        15 + 8,
        "cached + page 2 within the limit"
    );
    // 8 blocks: page 2 is mapped rather than evicting.
    let b = m.allocate(8).unwrap();
    assert_eq!(m.counts().cached, 15);
    assert_eq!(pages_of(&m, &b), BTreeSet::from([2]));
    // One more: the limit is reached, so the LRU cached block (the chain's tail) goes.
    let c1 = m.allocate(1).unwrap();
    assert_eq!(m.counts().cached, 14);
    assert_eq!(m.prefix_cache().unwrap().stats().evictions, 1);
    assert_page_rules(&m, &backend, &b.iter().chain(&c1).collect::<Vec<_>>());
}

#[test]
fn evict_frees_whole_pages_first_and_stays_prefix_closed() {
    let (mut m, backend) = manager(config(40, 8, 0));
    // Chain A: 7 blocks on page 0; chain B: 8 blocks on page 1; chain C: 3 blocks on page 2,
    // and a held sequence with 5 blocks on page 2 too.
    let a = m.allocate(7).unwrap();
    let b = m.allocate(8).unwrap();
    let c = m.allocate(3).unwrap();
    let held = m.allocate(5).unwrap();
    for (i, blocks) in [&a, &b, &c].into_iter().enumerate() {
        let t = tokens(i as u32, 0, blocks.len(), i as u32);
        m.cache(&t, blocks, None).unwrap();
    }
    m.deallocate(b).unwrap(); // B is released first: the oldest in the LRU
    m.deallocate(c).unwrap();
    m.deallocate(a).unwrap();
    assert_eq!(m.mapped_page_ids(), vec![0, 1, 2]);
    // Page 2 holds a sequence's blocks: not reclaimable. Page 0 never unmaps. Page 1 (8 cached
    // blocks) is the only whole page: evict(8) takes exactly it.
    assert_eq!(m.evict(8), 8);
    assert_eq!(
        m.mapped_page_ids(),
        vec![0, 2],
        "the evicted page came back"
    );
    assert_page_rules(&m, &backend, &held.iter().collect::<Vec<_>>());
    // Asked for fewer blocks than any whole page: plain LRU leaves (C is older than A).
    assert_eq!(m.evict(1), 1);
    let cache = m.prefix_cache().unwrap();
    assert_eq!(cache.len(), 7 + 2);
    assert_page_rules(&m, &backend, &held.iter().collect::<Vec<_>>());
}

#[test]
fn a_page_whose_cached_block_has_a_held_descendant_is_not_reclaimable() {
    let (mut m, backend) = manager(config(40, 8, 0));
    let _page0 = m.allocate(7).unwrap();
    let chain = m.allocate(10).unwrap(); // 8 on page 1, 2 on page 2
    assert_eq!(m.page_of(chain[8].id()), Some(2));
    let t = tokens(3, 0, 10, 3);
    m.cache(&t, &chain, None).unwrap();
    // Keep the chain's last block, release the rest: page 1 is all cache-only, but its blocks
    // are ancestors of a held block, so evicting them would break R10.
    let mut chain = chain;
    let tail = chain.pop().unwrap();
    m.deallocate(chain).unwrap();
    let report = m.set_memory_limit(Some(2 * PAGE)).unwrap();
    assert_eq!(report.evicted_blocks, 0);
    assert_eq!(report.mapped_pages, 3);
    assert_eq!(report.excess_bytes, PAGE);
    assert_eq!(
        report.held_pages, 2,
        "page 0 (its 7 blocks) and page 2 (the tail)"
    );
    assert_page_rules(&m, &backend, &[&tail]);
    // Releasing the tail makes the chain evictable: the manager reclaims toward the limit.
    m.deallocate(vec![tail]).unwrap();
    assert!(m.mapped_pages() <= 2);
    assert_page_rules(&m, &backend, &[]);
}

#[test]
fn lowering_the_limit_evicts_page_by_page_and_reports_what_sequences_hold() {
    let (mut m, backend) = manager(config(80, 8, 1));
    let mut held = vec![m.allocate(7).unwrap()]; // page 0
    let mut cached_groups = 0;
    // Six sequences of one page each (pages 1..=6); the even ones finish (their blocks stay
    // cached), the odd ones run on.
    for i in 0..6u32 {
        let blocks = m.allocate(8).unwrap();
        let t = tokens(i, 0, 8, i);
        m.cache(&t, &blocks, None).unwrap();
        if i % 2 == 0 {
            m.deallocate(blocks).unwrap();
            cached_groups += 1;
        } else {
            held.push(blocks);
        }
    }
    assert_eq!(cached_groups, 3);
    let before = m.mapped_pages();
    let held_refs: Vec<&Block> = held.iter().flatten().collect();
    assert_page_rules(&m, &backend, &held_refs);
    assert_eq!(before, 1 + 6 + 1, "page 0, six pages, a spare");
    let report = m.set_memory_limit(Some(2 * PAGE)).unwrap();
    // The spare and the three cached pages go (24 blocks evicted); page 0 and the three running
    // sequences' pages stay: 2 pages over the limit.
    assert_eq!(report.evicted_blocks, 24);
    assert_eq!(report.unmapped_pages, 4);
    assert_eq!(report.mapped_pages, 4);
    assert_eq!(m.mapped_page_ids(), vec![0, 2, 4, 6]);
    assert_eq!(report.excess_bytes, 2 * PAGE);
    assert_eq!(report.held_pages, 4);
    assert_page_rules(&m, &backend, &held_refs);
    drop(held_refs);
    // As the sequences finish, their blocks become cached and the manager reclaims them.
    for blocks in held {
        m.deallocate(blocks).unwrap();
        m.check().unwrap();
    }
    assert_eq!(m.mapped_page_ids().len(), 2, "back at the limit");
    assert_page_rules(&m, &backend, &[]);
    // Raising the limit maps the spare again.
    let report = m.set_memory_limit(None).unwrap();
    assert_eq!(report.excess_bytes, 0);
    assert_page_rules(&m, &backend, &[]);
}

#[test]
fn reservation_maps_ahead_and_allocation_consumes_it() {
    let mut c = config(64, 8, 0);
    c.memory_limit = Some(4 * PAGE); // 7 + 3 * 8 = 31 ids
    let (mut m, backend) = manager(c);
    assert!(m.try_reserve(20).unwrap());
    assert_eq!(m.reserved(), 20);
    assert_eq!(m.mapped_pages(), 3, "7 + 8 + 8 >= 20");
    m.check().unwrap();
    assert!(
        !m.try_reserve(12).unwrap(),
        "32 > 31: refused, nothing changed"
    );
    assert_eq!((m.reserved(), m.mapped_pages()), (20, 3));
    let maps = backend.operations().0;
    let a = m.allocate(20).unwrap();
    assert_eq!(
        backend.operations().0,
        maps,
        "the reserved allocation mapped nothing"
    );
    assert_eq!(m.reserved(), 0);
    assert!(m.try_reserve(5).unwrap());
    assert_eq!(m.free_reserved().unwrap(), 5);
    m.deallocate(a).unwrap();
    assert_page_rules(&m, &backend, &[]);
    assert!(m.try_reserve(31).unwrap());
    assert_eq!(m.mapped_pages(), 4);
    // A lower limit cuts the reservation.
    let report = m.set_memory_limit(Some(2 * PAGE)).unwrap();
    assert_eq!(report.released_reserved_blocks, 31 - 15);
    assert_eq!(m.reserved(), 15);
    m.free_reserved().unwrap();
    assert_page_rules(&m, &backend, &[]);
}

#[test]
fn a_device_out_of_memory_is_out_of_blocks_and_changes_nothing() {
    let (mut m, backend) = manager(config(64, 8, 0));
    backend.set_capacity(Some(2)); // another tenant holds the rest of the device
    let a = m.allocate(15).unwrap(); // pages 0 and 1
    let err = m.allocate(1).unwrap_err();
    assert!(matches!(
        err,
        KvPoolError::OutOfBlocks {
            requested: 1,
            available: 0
        }
    ));
    assert_eq!(m.page_stats().map_failures, 1);
    assert_eq!(m.mapped_pages(), 2);
    m.check().unwrap();
    // With cached blocks to fall back on, the allocation evicts instead.
    let t = tokens(0, 0, 15, 0);
    m.cache(&t, &a, None).unwrap();
    m.deallocate(a).unwrap();
    let b = m.allocate(9).unwrap();
    assert_eq!(b.len(), 9);
    backend.set_capacity(None);
    assert!(m.try_reserve(20).unwrap());
    m.free_reserved().unwrap();
    assert_page_rules(&m, &backend, &b.iter().collect::<Vec<_>>());
}

/// A backend whose operations fail on demand with something other than a lack of memory.
struct Broken {
    inner: AccountingBackend,
    fail_map: std::sync::Arc<std::sync::atomic::AtomicBool>,
    fail_unmap: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl PageBackend for Broken {
    fn map_page(&mut self, page: usize) -> Result<(), PageError> {
        if self.fail_map.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(PageError::Failed {
                page,
                operation: "map_page",
                message: "driver gone".into(),
            });
        }
        self.inner.map_page(page)
    }
    fn unmap_page(&mut self, page: usize) -> Result<(), PageError> {
        if self.fail_unmap.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(PageError::Failed {
                page,
                operation: "unmap_page",
                message: "driver gone".into(),
            });
        }
        self.inner.unmap_page(page)
    }
}

#[test]
fn backend_failures_are_typed_errors_and_leave_the_books_consistent() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let c = config(64, 8, 0);
    let view = AccountingBackend::new(c.num_pages());
    let fail_map = Arc::new(AtomicBool::new(false));
    let fail_unmap = Arc::new(AtomicBool::new(false));
    let backend = Broken {
        inner: view.clone(),
        fail_map: fail_map.clone(),
        fail_unmap: fail_unmap.clone(),
    };
    let mut m = XTensorBlockManager::with_backend(c, Box::new(backend)).unwrap();
    let a = m.allocate(7).unwrap();
    fail_map.store(true, Ordering::Relaxed);
    let err = m.allocate(3).unwrap_err();
    assert!(
        matches!(err, KvPoolError::PageBackend(ref s) if s.contains("driver gone")),
        "{err}"
    );
    assert_eq!(m.counts().used, 7, "nothing handed out");
    fail_map.store(false, Ordering::Relaxed);
    let b = m.allocate(3).unwrap();
    fail_unmap.store(true, Ordering::Relaxed);
    m.deallocate(b).unwrap(); // C6: a release never raises; the failed unmap is pending
    assert_eq!(
        view.mapped_pages(),
        m.mapped_page_ids(),
        "the page stayed mapped"
    );
    m.check().unwrap();
    // The next call that may map or allocate retries first and raises, doing nothing.
    let err = m.allocate(1).unwrap_err();
    assert!(matches!(err, KvPoolError::PageBackend(_)), "{err}");
    assert_eq!(m.counts().used, 7, "nothing handed out");
    m.check().unwrap();
    fail_unmap.store(false, Ordering::Relaxed);
    assert_eq!(m.trim().unwrap(), 1, "the next call unmaps it");
    assert_page_rules(&m, &view, &a.iter().collect::<Vec<_>>());
}

#[test]
fn a_handle_dropped_outside_the_manager_frees_its_page_at_the_next_call() {
    let (mut m, backend) = manager(config(64, 8, 0));
    let _page0 = m.allocate(7).unwrap();
    let b = m.allocate(2).unwrap();
    assert_eq!(m.mapped_pages(), 2);
    drop(b); // not through deallocate
    m.check().unwrap(); // the released ids wait in the inbox: counted free, page still mapped
    assert_eq!(m.counts().used, 7);
    assert_eq!(m.trim().unwrap(), 1);
    assert_eq!(m.mapped_page_ids(), vec![0]);
    assert_page_rules(&m, &backend, &_page0.iter().collect::<Vec<_>>());
}

#[test]
fn bad_configs_are_errors_naming_the_argument() {
    let cases: [(XTensorConfig, &str); 5] = [
        (XTensorConfig::new(1, 4, 8), "num_blocks"),
        (XTensorConfig::new(16, 0, 8), "block_size"),
        (XTensorConfig::new(16, 4, 0), "blocks_per_page"),
        (XTensorConfig::new(16, 4, 1 << 17), "blocks_per_page"),
        (
            XTensorConfig {
                spare_pages: 3,
                ..XTensorConfig::new(16, 4, 8)
            },
            "spare_pages",
        ),
    ];
    for (c, name) in cases {
        match XTensorBlockManager::new(c) {
            Err(KvPoolError::InvalidArgument { name: got, .. }) => assert_eq!(got, name),
            other => panic!("{name}: {:?}", other.map(|_| ())),
        }
    }
    let mut c = XTensorConfig::new(16, 4, 8);
    c.page_bytes = 0;
    assert!(matches!(
        XTensorBlockManager::new(c),
        Err(KvPoolError::InvalidArgument {
            name: "page_bytes",
            ..
        })
    ));
}

#[test]
fn a_single_page_manager_keeps_no_spare() {
    // blocks_per_page >= num_blocks: page 0 is the whole range; the default spare cannot exist.
    let (mut m, backend) = manager(XTensorConfig {
        page_bytes: PAGE,
        ..XTensorConfig::new(8, 4, 8)
    });
    assert_eq!((m.num_pages(), m.mapped_pages()), (1, 1));
    let blocks = m.allocate(7).unwrap();
    assert!(m.allocate(1).is_err());
    assert_page_rules(&m, &backend, &blocks.iter().collect::<Vec<_>>());
}

#[test]
fn host_backend_resident_memory_falls_when_the_load_falls() {
    let page = 1 << 20;
    let mut c = config(16 * 32, 32, 1);
    c.page_bytes = page as u64;
    let backend = HostPageBackend::new(c.num_pages(), page).unwrap();
    let mut m = XTensorBlockManager::with_backend(c, Box::new(backend)).unwrap();
    let idle = m.resident_bytes().unwrap();
    assert_eq!(idle, 2 * page as u64, "page 0 and the spare");
    let load: Vec<Block> = m.allocate(12 * 32).unwrap();
    let busy = m.resident_bytes().unwrap();
    assert_eq!(busy, m.mapped_bytes());
    assert!(busy >= 12 * page as u64);
    let (keep, release): (Vec<Block>, Vec<Block>) = load.into_iter().partition(|b| b.id() < 64);
    m.deallocate(release).unwrap();
    let light = m.resident_bytes().unwrap();
    assert_eq!(light, m.mapped_bytes());
    assert!(
        light <= 4 * page as u64,
        "pages 0, 1 and at most two spares: {light}"
    );
    m.deallocate(keep).unwrap();
    assert!(m.resident_bytes().unwrap() <= idle + page as u64);
    assert_eq!(m.resident_bytes().unwrap(), m.mapped_bytes());
    m.check().unwrap();
}

// --- random workloads ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Allocate {
        n: usize,
        family: u32,
        shared: usize,
    },
    AllocateShared {
        family: u32,
        shared: usize,
    },
    Release(usize),
    StrayDrop(usize),
    Cache(usize),
    Evict(usize),
    Reset,
    Limit(Option<usize>),
    Reserve(usize, bool),
    FreeReserved,
    Capacity(Option<usize>),
    Trim,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1..12usize, 0..3u32, 0..6usize)
            .prop_map(|(n, family, shared)| Op::Allocate { n, family, shared }),
        2 => (0..3u32, 1..8usize).prop_map(|(family, shared)| Op::AllocateShared { family, shared }),
        4 => any::<usize>().prop_map(Op::Release),
        1 => any::<usize>().prop_map(Op::StrayDrop),
        3 => any::<usize>().prop_map(Op::Cache),
        1 => (0..20usize).prop_map(Op::Evict),
        1 => Just(Op::Reset),
        2 => proptest::option::of(0..9usize).prop_map(Op::Limit),
        1 => (0..20usize, any::<bool>()).prop_map(|(n, take)| Op::Reserve(n, take)),
        1 => Just(Op::FreeReserved),
        1 => proptest::option::of(1..9usize).prop_map(Op::Capacity),
        1 => Just(Op::Trim),
    ]
}

struct Group {
    tokens: Vec<u32>,
    blocks: Vec<Block>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// R1-R5, R10 and the page rules after every step: the mapped pages are exactly page 0,
    /// the pages holding a held or cached block and the spares; no id on an unmapped page is
    /// ever handed out (every handle's page is mapped); a page unmaps when it empties; limit
    /// and capacity changes under load keep every rule; every id comes back at the end.
    #[test]
    fn random_workloads_keep_the_page_rules(
        ops in proptest::collection::vec(op(), 1..80),
        blocks_per_page in prop_oneof![Just(1usize), Just(3), Just(4), Just(8)],
        num_blocks in 20..48usize,
        spare_pages in 0..3usize,
        cache_on in prop_oneof![3 => Just(true), 1 => Just(false)],
        bits in prop_oneof![Just(128u32), Just(3u32)],
    ) {
        let mut c = config(num_blocks, blocks_per_page, spare_pages.min(num_blocks.div_ceil(blocks_per_page) - 1));
        c.enable_prefix_cache = cache_on;
        c.hasher = BlockHasher::with_debug_bits(11, bits);
        let (mut m, backend) = manager(c);
        let mut groups: Vec<Group> = Vec::new();
        let mut unique = 0u32;
        for op in ops {
            match op {
                Op::Allocate { n, family, shared } => {
                    let before = m.counts();
                    let available = m.num_available_blocks();
                    unique += 1;
                    match m.allocate(n) {
                        Ok(blocks) => {
                            prop_assert_eq!(blocks.len(), n);
                            prop_assert!(n <= available);
                            for b in &blocks {
                                prop_assert!(m.is_page_mapped(m.page_of(b.id()).unwrap()));
                            }
                            groups.push(Group { tokens: tokens(family, shared, n, unique), blocks });
                        }
                        Err(KvPoolError::OutOfBlocks { .. }) => {
                            // R3: exact availability, except when the device refused a map or
                            // a cached block's descendants are held (as the plain manager).
                            prop_assert!(n > available || m.page_stats().map_failures > 0 || bits < 128);
                            prop_assert_eq!(m.counts().used, before.used);
                        }
                        Err(e) => prop_assert!(false, "unexpected {}", e),
                    }
                }
                Op::AllocateShared { family, shared } => {
                    let t = tokens(family, shared, shared, 0);
                    let blocks = m.allocate_shared(&t, None);
                    let n = blocks.len();
                    groups.push(Group { tokens: t[..n * 4].to_vec(), blocks });
                }
                Op::Release(i) if !groups.is_empty() => {
                    let g = groups.swap_remove(i % groups.len());
                    m.deallocate(g.blocks).unwrap();
                }
                Op::StrayDrop(i) if !groups.is_empty() => {
                    drop(groups.swap_remove(i % groups.len()));
                    m.check().unwrap();
                    m.trim().unwrap();
                }
                Op::Cache(i) if !groups.is_empty() => {
                    let g = &groups[i % groups.len()];
                    m.cache(&g.tokens, &g.blocks, None).unwrap();
                }
                Op::Evict(n) => {
                    let cached = m.counts().cached;
                    let evicted = m.evict(n);
                    prop_assert!(evicted <= n.min(cached));
                }
                Op::Reset => m.reset_prefix_cache(),
                Op::Limit(pages) => {
                    let report = m.set_memory_limit(pages.map(|p| p as u64 * PAGE)).unwrap();
                    prop_assert_eq!(report.mapped_pages, m.mapped_pages());
                    prop_assert_eq!(
                        report.excess_bytes,
                        m.mapped_pages().saturating_sub(m.limit_pages()) as u64 * PAGE
                    );
                    if report.excess_bytes > 0 {
                        prop_assert!(report.held_pages > 0 || m.limit_pages() == 0);
                    }
                }
                Op::Reserve(n, take) => {
                    let reserved = m.reserved();
                    if m.try_reserve(n).unwrap() {
                        prop_assert_eq!(m.reserved(), reserved + n);
                        if !take {
                            continue;
                        }
                        let maps = backend.operations().0;
                        let held = m.allocate(m.reserved()).unwrap();
                        prop_assert_eq!(backend.operations().0 - maps <= m.spare_pages() as u64, true,
                            "a reserved allocation maps at most the spares it replaces");
                        groups.push(Group { tokens: Vec::new(), blocks: held });
                    } else {
                        prop_assert_eq!(m.reserved(), reserved);
                    }
                }
                Op::FreeReserved => {
                    m.free_reserved().unwrap();
                    prop_assert_eq!(m.reserved(), 0);
                }
                Op::Capacity(pages) => backend.set_capacity(pages),
                Op::Trim => {
                    m.trim().unwrap();
                }
                _ => {}
            }
            let held: Vec<&Block> = groups.iter().flat_map(|g| &g.blocks).collect();
            m.check().unwrap();
            if m.page_stats().map_failures == 0 {
                assert_page_rules(&m, &backend, &held);
            } else {
                // With a refused map the spares may be short; the rest holds.
                let mapped: BTreeSet<usize> = m.mapped_page_ids().into_iter().collect();
                prop_assert_eq!(backend.mapped_pages().into_iter().collect::<BTreeSet<_>>(), mapped.clone());
                for b in &held {
                    prop_assert!(mapped.contains(&m.page_of(b.id()).unwrap()));
                }
            }
            let counts = m.counts();
            prop_assert_eq!(counts.used, held.iter().map(|b| b.id()).collect::<BTreeSet<_>>().len());
        }
        // Everything back: every id free, only page 0 and the spares mapped.
        backend.set_capacity(None);
        for g in groups.drain(..) {
            m.deallocate(g.blocks).unwrap();
        }
        m.free_reserved().unwrap();
        m.reset_prefix_cache();
        m.set_memory_limit(None).unwrap();
        let counts = m.counts();
        prop_assert_eq!((counts.free, counts.cached, counts.used), (num_blocks - 1, 0, 0));
        prop_assert_eq!(m.num_available_blocks(), num_blocks - 1);
        let spares = m.mapped_pages() - 1;
        prop_assert!(spares >= m.spare_pages().min(m.num_pages() - 1) && spares <= 2 * m.spare_pages());
        assert_page_rules(&m, &backend, &[]);
    }
}
