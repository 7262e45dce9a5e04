//! The pool on elastic pages (`PoolConfig::xtensor`, xLLM's `enable_xtensor`): a
//! proptest of random workloads (allocate, the batch calls, deallocate, limit changes under
//! load, dp ranks, the prefix cache) with `check()` after every step, and the page rules
//! asserted from the sequences' tables: every held block lies on a mapped page, the mapped pages
//! are page 0, the held or cached pages and the spares, and every id comes back (R1-R5, R13-R20).

use std::collections::BTreeSet;

use kvpool::{
    BlockManager, BlockManagerPool, KvCacheManager, PoolConfig, Sequence, XTensorOptions,
};
use proptest::prelude::*;

const BS: usize = 4;
const PAGE: u64 = 1 << 20;

fn elastic(num_blocks: usize, dp_size: usize, bpp: usize, spare: usize) -> BlockManagerPool {
    let mut config = PoolConfig::new(num_blocks, BS);
    config.dp_size = dp_size;
    config.enable_events = true;
    let mut x = XTensorOptions::new(bpp);
    x.page_bytes = PAGE;
    x.spare_pages = spare;
    config.xtensor = Some(x);
    BlockManagerPool::new(config).unwrap()
}

/// The page rules seen from the tables, after `check()` walked them inside.
fn check_pages(pool: &BlockManagerPool, live: &[Sequence], cache_empty: bool) {
    pool.check().unwrap();
    for rank in 0..pool.dp_size() {
        let m = pool.xtensor_manager(rank).unwrap();
        let mapped: BTreeSet<usize> = m.mapped_page_ids().into_iter().collect();
        let mut held = BTreeSet::from([0]);
        for seq in live.iter().filter(|s| s.dp_rank() == Some(rank)) {
            held.extend(seq.block_ids().map(|id| m.page_of(id).unwrap()));
        }
        assert!(
            held.is_subset(&mapped),
            "rank {rank}: a held block on an unmapped page"
        );
        let stats = pool.stats().ranks[rank].xtensor.unwrap();
        assert_eq!(stats.mapped_pages, mapped.len());
        assert!(mapped.len() >= held.len() + stats.spare_pages);
        if cache_empty {
            assert_eq!(
                mapped.len(),
                held.len() + stats.spare_pages,
                "held pages + spares"
            );
        }
        if stats.mapped_pages > stats.limit_pages {
            assert_eq!(stats.spare_pages, 0, "no spare over the limit");
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Admit { prefix: u32, len: usize },
    Step,
    Grow { lookahead: usize },
    Release { index: usize },
    Limit { pages: Option<u64> },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..3, 1usize..40).prop_map(|(prefix, len)| Op::Admit { prefix, len }),
        4 => Just(Op::Step),
        1 => (0usize..6).prop_map(|lookahead| Op::Grow { lookahead }),
        2 => (0usize..64).prop_map(|index| Op::Release { index }),
        1 => prop::option::of(1u64..12).prop_map(|pages| Op::Limit { pages }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_the_page_rules(
        ops in prop::collection::vec(op(), 1..120),
        shape in prop::sample::select(vec![(1usize, 0usize), (4, 1), (8, 2)]),
        dp_size in 1usize..3,
    ) {
        let (bpp, spare) = shape;
        let mut pool = elastic(80, dp_size, bpp, spare);
        let mut live: Vec<Sequence> = Vec::new();
        let mut next = 10_000u32;
        for op in ops {
            match op {
                Op::Admit { prefix, len } => {
                    let mut tokens: Vec<u32> = vec![prefix; (prefix as usize % 3) * BS];
                    tokens.extend((0..len as u32).map(|t| next + t));
                    next += len as u32;
                    let mut seq = Sequence::new(tokens, None, None);
                    let can = pool.can_allocate(&mut seq, None).unwrap();
                    prop_assert_eq!(pool.allocate(&mut seq, None).unwrap(), can, "R15");
                    if can {
                        seq.set_num_computed_tokens(seq.len()).unwrap();
                        pool.cache(&mut seq).unwrap();
                        live.push(seq);
                    }
                }
                Op::Step if !live.is_empty() => {
                    let tokens: Vec<u32> = (0..live.len() as u32).map(|i| next + i).collect();
                    next += tokens.len() as u32;
                    let mut refs: Vec<&mut Sequence> = live.iter_mut().collect();
                    let failed = pool.advance_and_reserve_all(&mut refs, &tokens, 0).unwrap();
                    for &i in failed.iter().rev() {
                        let mut seq = live.remove(i);
                        pool.deallocate(&mut seq).unwrap();
                    }
                }
                Op::Grow { lookahead } if !live.is_empty() => {
                    let mut refs: Vec<&mut Sequence> = live.iter_mut().collect();
                    pool.may_append_all(&mut refs, lookahead).unwrap();
                }
                Op::Release { index } if !live.is_empty() => {
                    let mut seq = live.remove(index % live.len());
                    pool.deallocate(&mut seq).unwrap();
                }
                Op::Limit { pages } => {
                    let reports = pool.set_memory_limit(pages.map(|p| p * PAGE), None).unwrap();
                    prop_assert_eq!(reports.len(), dp_size);
                    for r in reports {
                        let over = r.mapped_pages.saturating_sub(r.limit_pages) as u64 * PAGE;
                        prop_assert_eq!(r.excess_bytes, over);
                    }
                }
                _ => {}
            }
            check_pages(&pool, &live, false);
            pool.drain_events();
        }
        for mut seq in live.drain(..) {
            pool.deallocate(&mut seq).unwrap();
        }
        pool.reset_prefix_cache();
        check_pages(&pool, &[], true);
        for rank in 0..dp_size {
            let counts = pool.counts(rank).unwrap();
            prop_assert_eq!(counts.free, counts.total, "every id back (R2, R4)");
            let m = pool.xtensor_manager(rank).unwrap();
            prop_assert_eq!(m.counts(), counts);
        }
    }
}

#[test]
fn the_rank_with_room_under_its_limit_gets_the_sequence() {
    let mut pool = elastic(64, 2, 4, 0);
    pool.set_memory_limit(Some(2 * PAGE), Some(0)).unwrap();
    let mut seq = Sequence::new((0..16).collect(), None, None);
    assert!(pool.allocate(&mut seq, None).unwrap());
    assert_eq!(
        seq.dp_rank(),
        Some(1),
        "R13 with the limit's available blocks"
    );
    assert!(
        pool.set_memory_limit(None, Some(2)).is_err(),
        "rank past the last"
    );
    let mut plain = BlockManagerPool::new(PoolConfig::new(16, BS)).unwrap();
    assert!(
        plain.set_memory_limit(Some(PAGE), None).is_err(),
        "not on elastic pages"
    );
    assert!(plain.xtensor_stats().is_none() && plain.xtensor_manager(0).is_none());
    pool.check().unwrap();
}
