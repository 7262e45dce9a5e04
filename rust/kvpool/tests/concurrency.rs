//! `ConcurrentBlockManager` (R27): same results as `BlockManagerImpl` on one thread, and stress
//! tests of many threads doing random operations at once, bounded in time (about 1 s each),
//! followed by exact accounting (R2) and a check that every id came back exactly once (R4).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use kvpool::{
    Block, BlockHasher, BlockManager, BlockManagerImpl, ConcurrentBlockManager, KvPoolError,
    ManagerConfig,
};
use proptest::prelude::*;

fn ids(blocks: &[Block]) -> Vec<u32> {
    blocks.iter().map(Block::id).collect()
}

fn concurrent(num_blocks: usize, block_size: usize) -> ConcurrentBlockManager {
    ConcurrentBlockManager::new(ManagerConfig::new(num_blocks, block_size)).unwrap()
}

/// After quiescence: R2 holds, nothing is used, and once the cache is reset every id
/// `1..num_blocks` is in the free list exactly once (allocating all of them yields each once).
fn assert_every_id_back_once(m: &ConcurrentBlockManager) {
    m.check().unwrap();
    let counts = m.counts();
    assert_eq!(counts.used, 0, "{counts:?}");
    assert_eq!(counts.free + counts.cached, counts.total, "{counts:?}");
    m.reset_prefix_cache();
    m.check().unwrap();
    assert_eq!(m.counts().free, counts.total);
    let all = m.allocate(counts.total).unwrap();
    let mut got = ids(&all);
    got.sort_unstable();
    assert_eq!(got, (1..=counts.total as u32).collect::<Vec<_>>());
    assert!(matches!(
        m.allocate(1),
        Err(KvPoolError::OutOfBlocks { .. })
    ));
    drop(all);
    m.check().unwrap();
}

#[test]
fn r27_manager_is_send_and_sync_and_shared_through_arc() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ConcurrentBlockManager>();
    assert_send_sync::<Block>();
    let m = Arc::new(concurrent(9, 4));
    let blocks = std::thread::scope(|s| {
        let a = s.spawn(|| m.allocate(4).unwrap());
        let b = s.spawn(|| m.allocate(4).unwrap());
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        let mut all = ids(&a);
        all.extend(ids(&b));
        all.sort_unstable();
        assert_eq!(all, (1..9).collect::<Vec<_>>(), "R1: id 0 never handed out");
        (a, b)
    });
    // Handles dropped on another thread than the one that allocated them (R4).
    std::thread::spawn(move || drop(blocks)).join().unwrap();
    assert_every_id_back_once(&m);
}

#[test]
fn r1_r3_r5_errors_and_argument_names() {
    let mut config = ManagerConfig::new(1, 4);
    assert!(matches!(
        ConcurrentBlockManager::new(config),
        Err(KvPoolError::InvalidArgument {
            name: "num_blocks",
            ..
        })
    ));
    config.num_blocks = 4;
    config.block_size = 0;
    assert!(matches!(
        ConcurrentBlockManager::new(config),
        Err(KvPoolError::InvalidArgument {
            name: "block_size",
            ..
        })
    ));
    let m = concurrent(4, 2);
    assert!(m.allocate(0).unwrap().is_empty());
    let held = m.allocate(2).unwrap();
    // R3: all-or-nothing, nothing changed on failure.
    let before = m.counts();
    assert!(matches!(
        m.allocate(2),
        Err(KvPoolError::OutOfBlocks {
            requested: 2,
            available: 1
        })
    ));
    assert_eq!(m.counts(), before);
    // Blocks of another manager are rejected by name, and none of the list is released.
    let other = concurrent(4, 2);
    let foreign = other.allocate(1).unwrap();
    let mut mixed = held.clone();
    mixed.extend(foreign.iter().cloned());
    assert!(matches!(
        m.deallocate(mixed),
        Err(KvPoolError::InvalidArgument { name: "blocks", .. })
    ));
    assert_eq!(
        held[0].ref_count(),
        1,
        "a rejected list releases none of the caller's handles"
    );
    assert!(matches!(
        m.cache(&[1, 2], &foreign, None),
        Err(KvPoolError::InvalidArgument { name: "blocks", .. })
    ));
    assert!(m.owns(&held[0]) && !m.owns(&foreign[0]));
    // R5: cached blocks stay out of the free list after deallocate.
    assert_eq!(m.cache(&[1, 2, 3, 4], &held, None).unwrap(), 2);
    m.deallocate(held).unwrap();
    let counts = m.counts();
    assert_eq!((counts.free, counts.cached, counts.used), (1, 2, 0));
    // R3: eviction makes room.
    let three = m.allocate(3).unwrap();
    assert_eq!(m.cache_stats().evictions, 2);
    drop(three);
    assert_every_id_back_once(&m);
}

/// Operations of the differential test (as in tests/manager.rs).
#[derive(Clone, Debug)]
enum Op {
    Allocate(usize),
    Share(usize),
    Drop(usize),
    Insert(usize, u8),
    Match(u8, usize),
    Evict(usize),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..6).prop_map(Op::Allocate),
        2 => any::<usize>().prop_map(Op::Share),
        4 => any::<usize>().prop_map(Op::Drop),
        3 => (any::<usize>(), 0u8..4).prop_map(|(h, c)| Op::Insert(h, c)),
        3 => (0u8..4, 1usize..5).prop_map(|(c, n)| Op::Match(c, n)),
        1 => (0usize..4).prop_map(Op::Evict),
        1 => Just(Op::Reset),
    ]
}

fn chain_tokens(chain: u8, blocks: usize) -> Vec<u32> {
    (0..blocks)
        .flat_map(|i| [u32::from(chain), i as u32])
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    /// R1-R12 by reference: on one thread the concurrent manager returns exactly what the plain
    /// `BlockManagerImpl` returns (same ids in the same order, same errors, same hits, same
    /// evictions, same counts), through the `BlockManager` trait of `&ConcurrentBlockManager`.
    #[test]
    fn same_results_as_plain_manager_on_one_thread(ops in proptest::collection::vec(op(), 1..120), bits in prop_oneof![Just(128u32), Just(2u32)]) {
        let mut config = ManagerConfig::new(12, 2);
        config.hasher = BlockHasher::with_debug_bits(7, bits);
        let mut plain = BlockManagerImpl::new(config).unwrap();
        let shared = ConcurrentBlockManager::new(config).unwrap();
        let mut conc = &shared;
        let mut groups: Vec<(Vec<Block>, Vec<Block>)> = Vec::new();
        for op in ops {
            match op {
                Op::Allocate(n) => match (plain.allocate(n), BlockManager::allocate(&mut conc, n)) {
                    (Ok(p), Ok(c)) => {
                        prop_assert_eq!(ids(&p), ids(&c));
                        groups.push((p, c));
                    }
                    (Err(p), Err(c)) => prop_assert_eq!(p, c),
                    (p, c) => prop_assert!(false, "diverged: {:?} vs {:?}", p, c),
                },
                Op::Share(i) if !groups.is_empty() => {
                    let g = groups[i % groups.len()].clone();
                    groups.push(g);
                }
                Op::Drop(i) if !groups.is_empty() => {
                    let (p, c) = groups.swap_remove(i % groups.len());
                    plain.deallocate(p).unwrap();
                    BlockManager::deallocate(&mut conc, c).unwrap();
                }
                Op::Insert(i, chain) if !groups.is_empty() => {
                    let (p, c) = &groups[i % groups.len()];
                    let tokens = chain_tokens(chain, p.len());
                    prop_assert_eq!(plain.cache(&tokens, p, None).unwrap(), BlockManager::cache(&mut conc, &tokens, c, None).unwrap());
                }
                Op::Match(chain, n) => {
                    let tokens = chain_tokens(chain, n);
                    let p = plain.allocate_shared(&tokens, None);
                    let c = BlockManager::allocate_shared(&mut conc, &tokens, None);
                    prop_assert_eq!(ids(&p), ids(&c));
                    if !p.is_empty() {
                        groups.push((p, c));
                    }
                }
                Op::Evict(n) => prop_assert_eq!(plain.evict(n), BlockManager::evict(&mut conc, n)),
                Op::Reset => {
                    plain.reset_prefix_cache();
                    BlockManager::reset_prefix_cache(&mut conc);
                }
                _ => {}
            }
            prop_assert_eq!(plain.counts(), BlockManager::counts(&conc));
            if let Err(e) = BlockManager::check(&conc) {
                prop_assert!(false, "check failed: {e}");
            }
        }
        prop_assert_eq!(plain.prefix_cache().unwrap().stats(), shared.cache_stats());
        groups.clear();
        assert_every_id_back_once(&shared);
    }
}

/// Small deterministic generator (xorshift64*), one per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const BLOCK_SIZE: usize = 4;

/// Prompt of `chain` with `blocks` full blocks; every chain shares its first block (a system
/// prompt), chains with the same `chain / 2` share the second too.
fn prompt(chain: usize, blocks: usize) -> Vec<u32> {
    (0..blocks)
        .flat_map(|i| {
            let owner = match i {
                0 => 0,
                1 => 1 + chain / 2,
                _ => 100 + chain,
            };
            [owner as u32, i as u32, 7, 9]
        })
        .collect()
}

/// What a worker would have written into block `i` of `tokens` (its KV): a digest of the prefix
/// up to and including that block.
fn kv_digest(tokens: &[u32], i: usize) -> u64 {
    tokens[..(i + 1) * BLOCK_SIZE]
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
            (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// Shared state of the stress test besides the manager.
///
/// Orderings: `exclusive` is taken with an AcqRel swap and given back with a Release store, so a
/// second taker of the same id would see the first one's flag (the test's own ownership check,
/// independent of the manager's). `kv` is Relaxed: a writer stores before `cache()` and a reader
/// loads after `allocate_shared()`, and the manager's cache lock orders the two. The counters are
/// Relaxed statistics read after the threads are joined.
struct Shadow {
    /// Set while a thread holds the id as a fresh, unpublished allocation: two threads never
    /// can (R4: an id is handed out at most once at a time).
    exclusive: Vec<AtomicBool>,
    /// The simulated KV content of each block.
    kv: Vec<AtomicU64>,
    /// Groups of handles in flight between threads (dropped by another thread than the one that
    /// allocated them).
    mailbox: Mutex<Vec<Vec<Block>>>,
    ops: AtomicUsize,
    hits: AtomicUsize,
    out_of_blocks: AtomicUsize,
}

/// One request: match the prompt's cached prefix, verify the matched KV, allocate the rest
/// (all-or-nothing), "compute" it, publish it. Returns the handles, or None when out of blocks.
fn request(m: &ConcurrentBlockManager, shadow: &Shadow, rng: &mut Rng) -> Option<Vec<Block>> {
    let chain = rng.below(8);
    let len = 1 + rng.below(6);
    let tokens = prompt(chain, len);
    let mut blocks = m.allocate_shared(&tokens, None);
    for (i, block) in blocks.iter().enumerate() {
        // A matched block is held, so it cannot have been evicted and reused (R10, R27). (It
        // may already be uncached: another thread's reset leaves held blocks with their
        // holders, R12.)
        assert!(block.ref_count() >= 1);
        assert_eq!(
            shadow.kv[block.id() as usize].load(Ordering::Relaxed),
            kv_digest(&tokens, i),
            "matched block {} carries another prefix's KV",
            block.id()
        );
    }
    shadow.hits.fetch_add(blocks.len(), Ordering::Relaxed);
    let start = blocks.len();
    match m.allocate(len - start) {
        Ok(fresh) => {
            assert_eq!(fresh.len(), len - start, "partial allocation (R3)");
            for (k, block) in fresh.iter().enumerate() {
                let id = block.id() as usize;
                assert!(id != 0, "padding block handed out (R1)");
                assert!(
                    !shadow.exclusive[id].swap(true, Ordering::AcqRel),
                    "id {id} handed out twice at once"
                );
                shadow.kv[id].store(kv_digest(&tokens, start + k), Ordering::Relaxed);
            }
            for block in &fresh {
                shadow.exclusive[block.id() as usize].store(false, Ordering::Release);
            }
            blocks.extend(fresh);
        }
        Err(KvPoolError::OutOfBlocks { .. }) => {
            shadow.out_of_blocks.fetch_add(1, Ordering::Relaxed);
            m.deallocate(blocks).unwrap();
            return None;
        }
        Err(e) => panic!("unexpected error {e}"),
    }
    m.cache(&tokens, &blocks, None).unwrap();
    Some(blocks)
}

fn worker(m: &ConcurrentBlockManager, shadow: &Shadow, seed: u64, deadline: Instant) {
    let mut rng = Rng(seed | 1);
    let mut held: Vec<Vec<Block>> = Vec::new();
    while Instant::now() < deadline {
        for _ in 0..64 {
            match rng.below(100) {
                0..=39 if held.len() < 4 => {
                    if let Some(blocks) = request(m, shadow, &mut rng) {
                        held.push(blocks);
                    }
                }
                40..=59 if !held.is_empty() => {
                    let group = held.swap_remove(rng.below(held.len()));
                    m.deallocate(group).unwrap();
                }
                60..=69 if !held.is_empty() => {
                    // Hand a group (or a clone of it: two threads drop handles of the same ids)
                    // to another thread.
                    let i = rng.below(held.len());
                    let group = if rng.below(2) == 0 {
                        held.swap_remove(i)
                    } else {
                        held[i].clone()
                    };
                    shadow.mailbox.lock().unwrap().push(group);
                }
                70..=79 => {
                    let group = shadow.mailbox.lock().unwrap().pop();
                    drop(group);
                }
                80..=89 => {
                    // A raw allocation of up to a third of the pool, held briefly.
                    let n = 1 + rng.below(20);
                    if let Ok(blocks) = m.allocate(n) {
                        assert_eq!(blocks.len(), n, "partial allocation (R3)");
                        for b in &blocks {
                            assert!(!shadow.exclusive[b.id() as usize].swap(true, Ordering::AcqRel));
                        }
                        for b in &blocks {
                            shadow.exclusive[b.id() as usize].store(false, Ordering::Release);
                        }
                    }
                }
                90..=98 => {
                    m.evict(1 + rng.below(4));
                }
                99 => {
                    if rng.below(8) == 0 {
                        m.reset_prefix_cache();
                    } else {
                        let counts = m.counts();
                        assert_eq!(counts.free + counts.cached + counts.used, counts.total);
                    }
                }
                _ => {}
            }
            shadow.ops.fetch_add(1, Ordering::Relaxed);
        }
    }
    drop(held);
}

/// R2-R5, R10, R27: 4 threads x random requests, releases, cross-thread drops, raw allocations,
/// evictions and resets on a small pool (so it runs out and evicts all the time) for about 1 s;
/// then exact accounting and every id back exactly once.
#[test]
fn r27_stress_random_operations_on_many_threads() {
    let num_blocks = 64;
    let m = ConcurrentBlockManager::new(ManagerConfig::new(num_blocks, BLOCK_SIZE)).unwrap();
    let shadow = Shadow {
        exclusive: (0..num_blocks).map(|_| AtomicBool::new(false)).collect(),
        kv: (0..num_blocks).map(|_| AtomicU64::new(0)).collect(),
        mailbox: Mutex::new(Vec::new()),
        ops: AtomicUsize::new(0),
        hits: AtomicUsize::new(0),
        out_of_blocks: AtomicUsize::new(0),
    };
    let deadline = Instant::now() + Duration::from_millis(1000);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (m, shadow) = (&m, &shadow);
            s.spawn(move || {
                worker(
                    m,
                    shadow,
                    0x9e37_79b9_7f4a_7c15u64.wrapping_mul(t + 1),
                    deadline,
                )
            });
        }
    });
    shadow.mailbox.lock().unwrap().clear();
    let ops = shadow.ops.load(Ordering::Relaxed);
    let (hits, oob) = (
        shadow.hits.load(Ordering::Relaxed),
        shadow.out_of_blocks.load(Ordering::Relaxed),
    );
    let evictions = m.cache_stats().evictions;
    eprintln!("stress: {ops} ops, {hits} blocks hit, {evictions} evictions, {oob} OutOfBlocks");
    assert!(ops > 1000, "only {ops} operations ran");
    assert!(
        shadow.hits.load(Ordering::Relaxed) > 0,
        "no prefix hit: the test lost its point"
    );
    assert!(
        m.cache_stats().evictions > 0,
        "no eviction: the test lost its point"
    );
    assert_every_id_back_once(&m);
}

/// R4, R27: the handles of blocks (half of them cached) are cloned to 4 threads that drop them
/// at the same moment, round after round: each id goes back exactly once (free or cache-only).
#[test]
fn r4_simultaneous_drops_return_each_id_once() {
    let m = concurrent(17, 1);
    let threads = 4;
    let barrier = Barrier::new(threads + 1);
    let slots: Vec<Mutex<Vec<Block>>> = (0..threads).map(|_| Mutex::new(Vec::new())).collect();
    let deadline = Instant::now() + Duration::from_millis(700);
    let mut rounds = 0;
    std::thread::scope(|s| {
        for slot in &slots {
            let barrier = &barrier;
            s.spawn(move || loop {
                barrier.wait(); // handles are in place (or the test is over)
                let handles = std::mem::take(&mut *slot.lock().unwrap());
                let done = handles.is_empty();
                drop(handles);
                barrier.wait(); // every drop is done
                if done {
                    break;
                }
            });
        }
        loop {
            let over = Instant::now() >= deadline;
            if !over {
                let blocks = m.allocate(16).unwrap();
                let tokens: Vec<u32> = (0..8).map(|t| t + rounds * 8).collect();
                assert_eq!(m.cache(&tokens, &blocks[..8], None).unwrap(), 8);
                for slot in &slots {
                    *slot.lock().unwrap() = blocks.clone();
                }
                drop(blocks);
            }
            barrier.wait();
            barrier.wait();
            if over {
                break;
            }
            rounds += 1;
            m.check().unwrap();
            let counts = m.counts();
            assert_eq!(
                (counts.free, counts.cached, counts.used),
                (8, 8, 0),
                "round {rounds}"
            );
            assert_eq!(m.evict(16), 8);
        }
    });
    assert!(rounds > 10, "only {rounds} rounds");
    assert_every_id_back_once(&m);
}
