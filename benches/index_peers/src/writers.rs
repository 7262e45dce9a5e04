//! `index_peers writers`: apply throughput with 1, 2, ... writer threads on the same stream.
//!
//! The stream's batches are split by instance over the threads, sticky (each instance's
//! batches stay in order on one thread), and every thread applies its share in stream order;
//! the time runs from a barrier releasing the threads to the last one done. kvpool: an index of
//! `T` writers (`IndexConfig::writers`), thread `t` applying the instances with
//! `writer_of(i) == t`; and, for the cost of sharding alone, `T` writers applied by one thread.
//! kv-index: one `ShardedChainIndex` (as in `peers/kv_index.rs`), thread `t` applying the
//! workers `i % T == t` with their own lane maps (its concurrent lanes). Dynamo's
//! `ThreadPoolIndexer` over `ConcurrentRadixTreeCompressed` with `T` event threads (its sticky
//! workers), the caller enqueuing every event, then flushing. No lookups. Median of the rounds.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use kv_index::{ChainBlockMap, ShardedChainIndex};
use kvpool::{IndexConfig, IndexEvent, KVIndex};

use crate::peers::kv_index::Op;
use crate::workload::Workload;

/// kvpool with `writers` shards, applied by `threads` threads; seconds.
fn kvpool_apply(batches: &Arc<Vec<(u64, Vec<IndexEvent>)>>, writers: usize, threads: usize) -> f64 {
    let index = Arc::new(
        KVIndex::new(IndexConfig {
            max_entries: 1 << 26,
            writers,
            ..IndexConfig::default()
        })
        .expect("config"),
    );
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (index, batches, barrier) = (index.clone(), batches.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mine: Vec<usize> = (0..batches.len())
                    .filter(|&b| index.writer_of(batches[b].0) % threads == t)
                    .collect();
                barrier.wait();
                for b in mine {
                    let (instance, events) = &batches[b];
                    index.apply(*instance, events).expect("valid events");
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().expect("a writer thread");
    }
    let time = start.elapsed().as_secs_f64();
    drop(index);
    time
}

fn kv_index_apply(batches: &Arc<Vec<(u32, Vec<Op>)>>, instances: usize, threads: usize) -> f64 {
    const MAX_WORKERS: usize = 1024;
    let shards = instances.div_ceil(MAX_WORKERS);
    let index = Arc::new(ShardedChainIndex::new(shards, instances.min(MAX_WORKERS)));
    let workers: Arc<Vec<u32>> = Arc::new(
        (0..instances)
            .map(|i| {
                index
                    .intern_worker_in(i * shards / instances, &format!("worker-{i}"))
                    .expect("worker slots")
            })
            .collect(),
    );
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (index, batches, barrier, workers) = (
                index.clone(),
                batches.clone(),
                barrier.clone(),
                workers.clone(),
            );
            std::thread::spawn(move || {
                let mut maps: Vec<Option<ChainBlockMap>> = (0..instances).map(|_| None).collect();
                let mine: Vec<usize> = (0..batches.len())
                    .filter(|&b| batches[b].0 as usize % threads == t)
                    .collect();
                barrier.wait();
                for b in mine {
                    let (instance, ops) = &batches[b];
                    let worker = workers[*instance as usize];
                    let map = maps[*instance as usize].get_or_insert_with(ChainBlockMap::default);
                    for op in ops {
                        match op {
                            Op::Store(parent, blocks) => {
                                let _ = index.apply_stored(worker, blocks, *parent, map);
                            }
                            Op::Remove(hashes) => index.apply_removed(worker, hashes, map),
                        }
                    }
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().expect("a writer thread");
    }
    start.elapsed().as_secs_f64()
}

/// Dynamo's thread pool with `threads` event threads; seconds (enqueue all, then flush).
fn dynamo_apply(w: &Workload, threads: usize) -> f64 {
    std::env::set_var("KVPOOL_PEERS_DYNAMO_THREADS", threads.to_string());
    let mut d = crate::peers::dynamo::Dynamo::new(w, crate::peers::dynamo::Kind::Crtc);
    use crate::peers::Index;
    d.reset();
    d.prepare();
    let batches = w.batches().count();
    let start = Instant::now();
    for b in 0..batches {
        d.apply(b);
    }
    d.settle();
    start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs every configuration `rounds` times, interleaved; prints the table.
pub fn run(w: &Workload, threads: &[usize], rounds: usize, peers: bool) {
    let events = w.events() as f64;
    let kv_batches = Arc::new(crate::peers::kvpool::batches(w));
    let ki_batches = Arc::new(crate::peers::kv_index::batches(w));
    // (label, writer threads, measure)
    type Measure<'a> = Box<dyn Fn() -> f64 + 'a>;
    let mut configs: Vec<(String, usize, Measure)> = Vec::new();
    for &t in threads {
        let b = kv_batches.clone();
        configs.push((
            format!("kvpool, writers={t}"),
            t,
            Box::new(move || kvpool_apply(&b, t, t)),
        ));
        if t > 1 {
            let b = kv_batches.clone();
            configs.push((
                format!("kvpool, writers={t}, one thread"),
                1,
                Box::new(move || kvpool_apply(&b, t, 1)),
            ));
        }
        if peers {
            let b = ki_batches.clone();
            let n = w.instances;
            configs.push((
                format!("kv-index, {t} lanes"),
                t,
                Box::new(move || kv_index_apply(&b, n, t)),
            ));
            configs.push((
                format!("dynamo-crtc, {t} event threads"),
                t,
                Box::new(move || dynamo_apply(w, t)),
            ));
        }
    }
    let mut times: Vec<Vec<f64>> = configs.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for k in 0..configs.len() {
            let i = (k + round) % configs.len();
            times[i].push((configs[i].2)());
        }
        eprintln!("  writers round {} of {rounds} done", round + 1);
    }
    let base = median(times[0].clone());
    println!(
        "\n{} instances: apply only, medians of {rounds} interleaved rounds; speed-up vs kvpool with one writer",
        w.instances
    );
    println!("| configuration | writer threads | M events/s | speed-up |");
    println!("|---|---|---|---|");
    for (i, (label, t, _)) in configs.iter().enumerate() {
        let m = median(times[i].clone());
        println!(
            "| {label} | {t} | {:.2} | {:.2}x |",
            events / m / 1e6,
            base / m
        );
    }
}
