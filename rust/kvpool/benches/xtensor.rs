//! `XTensorBlockManager` against the plain `BlockManagerImpl` (`cargo bench --bench xtensor`).
//! The targets: allocate + free in the steady state (no page mapped or unmapped) within
//! 1.5x of the plain manager; the cost of mapping and unmapping a page reported apart, on the
//! accounting backend and on the host backend (`mprotect` + populate, `MADV_DONTNEED`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvpool::HostPageBackend;
use kvpool::{
    AccountingBackend, Block, BlockManager, BlockManagerImpl, ManagerConfig, PageBackend,
    XTensorBlockManager, XTensorConfig,
};

const NUM_BLOCKS: usize = 4096;
const BLOCKS_PER_PAGE: usize = 64;

fn plain() -> BlockManagerImpl {
    BlockManagerImpl::new(ManagerConfig::new(NUM_BLOCKS, 16)).unwrap()
}

fn xtensor_config() -> XTensorConfig {
    XTensorConfig::new(NUM_BLOCKS, 16, BLOCKS_PER_PAGE)
}

fn xtensor() -> XTensorBlockManager {
    XTensorBlockManager::new(xtensor_config()).unwrap()
}

fn xtensor_host(page_bytes: usize) -> XTensorBlockManager {
    let mut config = xtensor_config();
    config.page_bytes = page_bytes as u64;
    let backend = HostPageBackend::new(config.num_pages(), page_bytes).unwrap();
    XTensorBlockManager::with_backend(config, Box::new(backend)).unwrap()
}

/// Half the pool held (a running batch): the benchmarked blocks come and go on top of it.
fn half_full<M: BlockManager>(m: &mut M) -> Vec<Block> {
    m.allocate(NUM_BLOCKS / 2).unwrap()
}

/// allocate + free on a half-full pool, no page mapped or unmapped (asserted).
fn steady_state(c: &mut Criterion) {
    let mut group = c.benchmark_group("xtensor_steady_state");
    group.throughput(Throughput::Elements(1));

    let mut p = plain();
    let _held = half_full(&mut p);
    group.bench_function("plain/one_block_without_vec", |b| {
        b.iter(|| drop(black_box(p.allocate_one().unwrap())))
    });
    let mut x = xtensor();
    let _held_x = half_full(&mut x);
    // One round first: the first 64-block allocation opens the spare and maps the next one.
    let blocks = x.allocate(64).unwrap();
    x.deallocate(blocks).unwrap();
    let maps = x.page_stats();
    group.bench_function("xtensor/one_block_without_vec", |b| {
        b.iter(|| drop(black_box(x.allocate_one().unwrap())))
    });
    let mut h = xtensor_host(1 << 20);
    let _held_h = half_full(&mut h);
    let host_maps = h.page_stats();
    group.bench_function("xtensor_host/one_block_without_vec", |b| {
        b.iter(|| drop(black_box(h.allocate_one().unwrap())))
    });
    for n in [16usize, 64] {
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("plain/blocks", n), &n, |b, &n| {
            b.iter(|| {
                let blocks = p.allocate(black_box(n)).unwrap();
                p.deallocate(blocks).unwrap();
            })
        });
        group.bench_with_input(BenchmarkId::new("xtensor/blocks", n), &n, |b, &n| {
            b.iter(|| {
                let blocks = x.allocate(black_box(n)).unwrap();
                x.deallocate(blocks).unwrap();
            })
        });
    }
    group.finish();
    x.trim().unwrap();
    h.trim().unwrap();
    assert_eq!(
        x.page_stats(),
        maps,
        "the steady state mapped or unmapped a page"
    );
    assert_eq!(
        h.page_stats(),
        host_maps,
        "the steady state mapped or unmapped a page"
    );
}

/// One page mapped and unmapped per iteration: a block allocated on a fresh page (no spares)
/// and freed. Through the manager (the allocation and the free included), and the backend's
/// two calls alone.
fn map_unmap(c: &mut Criterion) {
    let mut group = c.benchmark_group("xtensor_map_unmap");
    group.throughput(Throughput::Elements(1));
    let mut config = xtensor_config();
    config.spare_pages = 0;
    let mut m = XTensorBlockManager::new(config).unwrap();
    let _page0 = m.allocate(BLOCKS_PER_PAGE - 1).unwrap();
    group.bench_function("accounting/allocate_map_free_unmap", |b| {
        b.iter(|| {
            let block = m.allocate_one().unwrap();
            m.deallocate(vec![black_box(block)]).unwrap();
        })
    });
    assert!(m.page_stats().unmaps > 0);
    for page_bytes in [64 << 10, 2 << 20] {
        let mut config = xtensor_config();
        config.spare_pages = 0;
        config.page_bytes = page_bytes as u64;
        let backend = HostPageBackend::new(config.num_pages(), page_bytes).unwrap();
        let mut m = XTensorBlockManager::with_backend(config, Box::new(backend)).unwrap();
        let _page0 = m.allocate(BLOCKS_PER_PAGE - 1).unwrap();
        let name = format!("host_{}KiB/allocate_map_free_unmap", page_bytes >> 10);
        group.bench_function(name, |b| {
            b.iter(|| {
                let block = m.allocate_one().unwrap();
                m.deallocate(vec![black_box(block)]).unwrap();
            })
        });
        let mut backend = HostPageBackend::new(2, page_bytes).unwrap();
        let name = format!("host_{}KiB/backend_map_unmap", page_bytes >> 10);
        group.bench_function(name, |b| {
            b.iter(|| {
                backend.map_page(black_box(1)).unwrap();
                backend.unmap_page(1).unwrap();
            })
        });
    }
    let mut backend = AccountingBackend::new(2);
    group.bench_function("accounting/backend_map_unmap", |b| {
        b.iter(|| {
            backend.map_page(black_box(1)).unwrap();
            backend.unmap_page(1).unwrap();
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = steady_state, map_unmap
}
criterion_main!(benches);
