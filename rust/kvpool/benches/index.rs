//! `KVIndex` under the Mooncake conversation trace at 100, 1,000 and 7,000 instances (issue
//! "Beyond one instance", item 5).
//!
//! The trace (`{timestamp, input_length, output_length, hash_ids}`, one id per 512-token block;
//! `KVPOOL_MOONCAKE_TRACE` or `../shared/data/mooncake/conversation_trace.jsonl` from the
//! repository root) is replayed as events, no pools: each request is routed kv-aware by the
//! index itself (the instance with the longest device match of at least two blocks, else the
//! hash of its second block), its missing blocks are stored there (one `stored` event per run
//! of missing blocks), and that instance's own block LRU of `CAPACITY` blocks evicts from the
//! chains' tails, one `removed` event per block as vLLM sends them. With more instances the
//! trace is replayed in more rounds (`N / 1000`, at least one; each round under its own extra
//! key), so every instance sees some traffic.
//!
//! Generation runs once per N; the measured replays feed the recorded batches and lookups to
//! a fresh index in trace order. Criterion measures the apply throughput (`apply`: events
//! only) and the mixed stream (`mixed`: each request's lookup, then its batch); a summary then
//! prints lookup p50/p99 and events+lookups per second from one timed replay per N.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvpool::Matches;
use kvpool::{BlockHash, BlockHasher, IndexConfig, IndexEvent, KVIndex};

const BLOCK_SIZE: u32 = 512;
/// Blocks each instance's cache holds (256 x 512 = 131,072 tokens).
const CAPACITY: usize = 256;
const INSTANCES: [usize; 3] = [100, 1_000, 7_000];

fn trace_path() -> PathBuf {
    if let Ok(path) = std::env::var("KVPOOL_MOONCAKE_TRACE") {
        return path.into();
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    for candidate in [
        root.join("../shared/data/mooncake/conversation_trace.jsonl"),
        root.join("shared/data/mooncake/conversation_trace.jsonl"),
        PathBuf::from("/work/shared/data/mooncake/conversation_trace.jsonl"),
    ] {
        if candidate.exists() {
            return candidate;
        }
    }
    root.join("../shared/data/mooncake/conversation_trace.jsonl")
}

/// Each request's hash ids.
fn load_trace() -> Option<Vec<Vec<u32>>> {
    let path = trace_path();
    let text = std::fs::read_to_string(&path)
        .map_err(|e| eprintln!("index bench: no trace at {}: {e}", path.display()))
        .ok()?;
    let requests = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
            v["hash_ids"]
                .as_array()
                .expect("hash_ids")
                .iter()
                .map(|x| x.as_u64().expect("an id") as u32)
                .collect()
        })
        .collect();
    Some(requests)
}

/// One instance's block cache: LRU over block hashes, touched deepest block first.
#[derive(Default)]
struct BlockLru {
    tick: u64,
    stamp: HashMap<BlockHash, u64>,
    order: BTreeMap<u64, BlockHash>,
}

impl BlockLru {
    fn contains(&self, h: &BlockHash) -> bool {
        self.stamp.contains_key(h)
    }

    fn touch(&mut self, h: BlockHash) {
        self.tick += 1;
        if let Some(old) = self.stamp.insert(h, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, h);
    }

    fn evict(&mut self, keep: usize) -> Vec<BlockHash> {
        let mut out = Vec::new();
        while self.stamp.len() > keep {
            let (_, h) = self.order.pop_first().expect("non-empty");
            self.stamp.remove(&h);
            out.push(h);
        }
        out
    }
}

#[derive(Clone)]
enum Step {
    Lookup(usize),
    Apply(u64, Vec<IndexEvent>),
}

struct Workload {
    instances: usize,
    chains: Vec<Vec<BlockHash>>,
    steps: Vec<Step>,
    events: usize,
    blocks: usize,
    removed_events: usize,
}

/// An index sized for the fleet: room for every instance's whole cache (`CAPACITY` blocks
/// each), the capacity hint a router knows from the fleet it routes to.
fn index(instances: usize) -> KVIndex {
    let config = IndexConfig {
        max_entries: 1 << 26,
        ..IndexConfig::default()
    };
    KVIndex::with_capacity(config, instances * CAPACITY).expect("config")
}

fn generate(trace: &[Vec<u32>], instances: usize) -> Workload {
    let hasher = BlockHasher::default();
    let rounds = (instances / 1000).max(1);
    let idx = index(instances);
    let mut caches: Vec<BlockLru> = (0..instances).map(|_| BlockLru::default()).collect();
    let mut sequence = vec![0u64; instances];
    let mut w = Workload {
        instances,
        chains: Vec::new(),
        steps: Vec::new(),
        events: 0,
        blocks: 0,
        removed_events: 0,
    };
    for round in 0..rounds {
        let root = hasher.root(Some(&(round as u64).to_le_bytes()));
        for ids in trace {
            let mut chain = Vec::with_capacity(ids.len());
            let mut parent = root;
            for &id in ids {
                parent = hasher.hash_block(parent, &[id]);
                chain.push(parent);
            }
            let best = idx
                .lookup_chain(&chain, BLOCK_SIZE, 0.0)
                .into_iter()
                .max_by_key(|m| (m.blocks, std::cmp::Reverse(m.instance)));
            let instance = match best {
                Some(m) if m.blocks >= 2 => m.instance as usize,
                _ => (chain.get(1).unwrap_or(&chain[0]).0 as usize) % instances,
            };
            w.steps.push(Step::Lookup(w.chains.len()));
            let cache = &mut caches[instance];
            let mut batch = Vec::new();
            let mut i = 0;
            while i < chain.len() {
                if cache.contains(&chain[i]) {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < chain.len() && !cache.contains(&chain[i]) {
                    i += 1;
                }
                let parent = start.checked_sub(1).map(|p| chain[p]);
                batch.push(
                    IndexEvent::stored(BLOCK_SIZE, parent, chain[start..i].to_vec())
                        .with_sequence(sequence[instance]),
                );
                sequence[instance] += 1;
                w.blocks += i - start;
            }
            for &h in chain.iter().rev() {
                cache.touch(h);
            }
            for h in cache.evict(CAPACITY) {
                batch.push(
                    IndexEvent::removed(BLOCK_SIZE, vec![h]).with_sequence(sequence[instance]),
                );
                sequence[instance] += 1;
                w.blocks += 1;
                w.removed_events += 1;
            }
            w.events += batch.len();
            idx.apply(instance as u64, &batch).expect("valid events");
            w.steps.push(Step::Apply(instance as u64, batch));
            w.chains.push(chain);
        }
    }
    w
}

/// How a replay looks up.
#[derive(Clone, Copy, PartialEq)]
enum Lookups {
    /// None (apply only).
    Skip,
    /// `Snapshot::lookup_into`: the compact answer (rows and layers), reused.
    Compact,
    /// `KVIndex::lookup_chain`: a `Match` per location (what the Python binding returns).
    Matches,
}

/// Replays `w` on a fresh index; returns the time of the replay and each lookup's time.
fn replay(w: &Workload, lookups: Lookups, timed: bool) -> (Duration, Vec<u32>) {
    let idx = index(w.instances);
    let out = replay_on(&idx, w, lookups, timed);
    drop(idx);
    out
}

/// [`replay`] on `idx` (apart, for a profiler: `--toggle-collect=index::replay_on`).
#[inline(never)]
fn replay_on(idx: &KVIndex, w: &Workload, lookups: Lookups, timed: bool) -> (Duration, Vec<u32>) {
    let mut latencies = Vec::with_capacity(if timed { w.chains.len() } else { 0 });
    let mut out = Matches::new();
    let start = Instant::now();
    for step in &w.steps {
        match *step {
            Step::Lookup(c) if lookups != Lookups::Skip => {
                let t = timed.then(Instant::now);
                if lookups == Lookups::Compact {
                    idx.snapshot()
                        .lookup_into(&w.chains[c], BLOCK_SIZE, 0.0, &mut out);
                    std::hint::black_box(&out);
                } else {
                    std::hint::black_box(idx.lookup_chain(&w.chains[c], BLOCK_SIZE, 0.0));
                }
                if let Some(t) = t {
                    latencies.push(t.elapsed().as_nanos() as u32);
                }
            }
            Step::Lookup(_) => {}
            Step::Apply(instance, ref batch) => {
                idx.apply(instance, batch).expect("valid events");
            }
        }
    }
    (start.elapsed(), latencies)
}

/// Reads every event's hashes once, in replay order, after a fresh index is built (as a
/// replay does): what reading the recorded input alone costs.
#[inline(never)]
fn read_input(w: &Workload) -> Duration {
    let idx = index(w.instances);
    let start = Instant::now();
    let mut sum = 0u128;
    for step in &w.steps {
        if let Step::Apply(instance, batch) = step {
            for e in batch {
                sum = sum.wrapping_add(u128::from(*instance));
                for h in &e.block_hashes {
                    sum = sum.wrapping_add(h.0);
                }
            }
        }
    }
    std::hint::black_box(sum);
    let time = start.elapsed();
    drop(idx);
    time
}

/// A floor for applying the stream on this machine: only what any hash-addressed index must
/// do per block, once (one copy): an open-addressing table (hash -> node, pre-sized, linear
/// probing) and a 64-byte node per new block holding one location; a removal clears it
/// (no LRU, parents, sequence numbers, second copy, concurrent readers or memory reuse).
/// With `prefetch`, each batch first asks the cache for its blocks' home slots (as the
/// index's apply does), so that their misses overlap.
#[inline(never)]
fn replay_floor(w: &Workload, prefetch: bool) -> Duration {
    #[derive(Clone, Copy, Default)]
    #[repr(align(64))]
    struct Node {
        hash: u128,
        location: u32,
    }
    // Room for every hash of the stream (a removed block keeps its node: less work still).
    let distinct: std::collections::HashSet<u128> = w
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Apply(_, batch) => Some(batch),
            Step::Lookup(_) => None,
        })
        .flat_map(|batch| {
            batch
                .iter()
                .flat_map(|e| e.block_hashes.iter().map(|h| h.0))
        })
        .collect();
    let slots = (distinct.len() * 2).next_power_of_two();
    let mut table = vec![0u64; slots];
    for s in table.iter_mut() {
        *s = u64::MAX; // touched up front, as the index's table is
    }
    let mut nodes: Vec<Node> = Vec::with_capacity(distinct.len());
    nodes.resize(distinct.len(), Node::default());
    nodes.clear();
    let mask = slots - 1;
    let start = Instant::now();
    for step in &w.steps {
        let Step::Apply(instance, batch) = step else {
            continue;
        };
        if prefetch {
            for e in batch {
                for h in &e.block_hashes {
                    let at = (h.0 as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) as usize & mask;
                    prefetch_at(&table[at]);
                }
            }
        }
        for e in batch {
            for h in &e.block_hashes {
                let mut at = (h.0 as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) as usize & mask;
                loop {
                    let id = table[at];
                    if id == u64::MAX {
                        if e.kind == kvpool::EventKind::Stored {
                            table[at] = nodes.len() as u64;
                            nodes.push(Node {
                                hash: h.0,
                                location: *instance as u32,
                            });
                        }
                        break;
                    }
                    if nodes[id as usize].hash == h.0 {
                        nodes[id as usize].location = if e.kind == kvpool::EventKind::Stored {
                            *instance as u32
                        } else {
                            u32::MAX
                        };
                        break;
                    }
                    at = (at + 1) & mask;
                }
            }
        }
    }
    let time = start.elapsed();
    std::hint::black_box(&nodes);
    time
}

/// Asks the cache for the line holding `value` (a hint; never faults).
#[inline]
fn prefetch_at<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults and reads nothing the program sees.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (value as *const T).cast(),
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// The instance counts to run: `KVPOOL_INDEX_INSTANCES` (comma-separated) or [`INSTANCES`].
fn instance_counts() -> Vec<usize> {
    std::env::var("KVPOOL_INDEX_INSTANCES")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| INSTANCES.to_vec())
}

/// The peer of the same run: a plain single-copy dict of sets (hash -> sorted instances), the
/// model the proptest checks `KVIndex` against, with the same walk (no media, groups, TTLs,
/// sequence numbers, memory bound or concurrent readers).
#[derive(Default)]
struct PlainIndex {
    holders: HashMap<BlockHash, Vec<u32>>,
}

impl PlainIndex {
    fn apply(&mut self, instance: u64, events: &[IndexEvent]) {
        let instance = instance as u32;
        for e in events {
            for h in &e.block_hashes {
                let list = self.holders.entry(*h).or_default();
                let at = list.binary_search(&instance);
                match (e.kind, at) {
                    (kvpool::EventKind::Stored, Err(i)) => list.insert(i, instance),
                    (kvpool::EventKind::Removed, Ok(i)) => {
                        list.remove(i);
                        if list.is_empty() {
                            self.holders.remove(h);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    fn lookup(&self, chain: &[BlockHash], out: &mut Vec<(u32, u32)>) {
        let Some(first) = chain.first().and_then(|h| self.holders.get(h)) else {
            return;
        };
        let mut active = first.clone();
        let mut depth = 1;
        while depth < chain.len() && !active.is_empty() {
            let Some(next) = self.holders.get(&chain[depth]) else {
                break;
            };
            active.retain(|i| {
                let keep = next.binary_search(i).is_ok();
                if !keep {
                    out.push((*i, depth as u32));
                }
                keep
            });
            depth += 1;
        }
        out.extend(active.iter().map(|&i| (i, depth as u32)));
    }
}

/// The plain peer's replay: (apply-only time, mixed time, lookup times).
#[inline(never)]
fn replay_plain(w: &Workload) -> (Duration, Duration, Vec<u32>) {
    let mut plain = PlainIndex::default();
    let start = Instant::now();
    for step in &w.steps {
        if let Step::Apply(instance, batch) = step {
            plain.apply(*instance, batch);
        }
    }
    let apply = start.elapsed();
    let mut plain = PlainIndex::default();
    let mut out = Vec::with_capacity(w.instances);
    let mut latencies = Vec::with_capacity(w.chains.len());
    let start = Instant::now();
    for step in &w.steps {
        match step {
            Step::Lookup(c) => {
                out.clear();
                let t = Instant::now();
                plain.lookup(&w.chains[*c], &mut out);
                latencies.push(t.elapsed().as_nanos() as u32);
                std::hint::black_box(&out);
            }
            Step::Apply(instance, batch) => plain.apply(*instance, batch),
        }
    }
    (apply, start.elapsed(), latencies)
}

fn workloads() -> Vec<Workload> {
    match load_trace() {
        Some(trace) => instance_counts()
            .into_iter()
            .map(|n| generate(&trace, n))
            .collect(),
        None => Vec::new(),
    }
}

/// `KVPOOL_INDEX_PROFILE=apply|mixed|matches|read|floor|floor_prefetch|plain` (with `KVPOOL_INDEX_REPEAT`, default 1): only
/// that replay of each workload, timed, for a profiler (`valgrind --tool=callgrind
/// --toggle-collect=index::replay_on`,
/// or `index::replay_plain`); no criterion run, no summary.
fn profile(workloads: &[Workload]) -> bool {
    let Ok(kind) = std::env::var("KVPOOL_INDEX_PROFILE") else {
        return false;
    };
    let repeat: usize = std::env::var("KVPOOL_INDEX_REPEAT")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1);
    for w in workloads {
        for _ in 0..repeat {
            let time = match kind.as_str() {
                "apply" => replay(w, Lookups::Skip, false).0,
                "mixed" => replay(w, Lookups::Compact, false).0,
                "matches" => replay(w, Lookups::Matches, false).0,
                "read" => read_input(w),
                "floor" => replay_floor(w, false),
                "floor_prefetch" => replay_floor(w, true),
                _ => replay_plain(w).1,
            };
            println!(
                "profile {kind} {} instances: {:.2} ms, {:.0} events+lookups/s",
                w.instances,
                time.as_secs_f64() * 1e3,
                (w.events + w.chains.len()) as f64 / time.as_secs_f64()
            );
        }
    }
    true
}

fn bench(c: &mut Criterion) {
    let workloads = workloads();
    if profile(&workloads) {
        return;
    }
    if workloads.is_empty() {
        eprintln!("index bench: skipped (set KVPOOL_MOONCAKE_TRACE)");
        return;
    }
    let mut group = c.benchmark_group("index");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(6));
    for w in &workloads {
        group.throughput(Throughput::Elements(w.events as u64));
        group.bench_with_input(BenchmarkId::new("apply", w.instances), w, |b, w| {
            b.iter_custom(|iters| (0..iters).map(|_| replay(w, Lookups::Skip, false).0).sum())
        });
        group.throughput(Throughput::Elements((w.events + w.chains.len()) as u64));
        group.bench_with_input(BenchmarkId::new("mixed", w.instances), w, |b, w| {
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| replay(w, Lookups::Compact, false).0)
                    .sum()
            })
        });
    }
    group.finish();
    summary(&workloads);
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0
}

fn summary(workloads: &[Workload]) {
    println!(
        "\nindex summary (one core; lookups timed one by one, interleaved with the batches;\n\
         plain = a single-copy dict of sets with the same walk, the peer of this run)\n\
         {:>9} {:>8} {:>8} {:>8} {:>8} {:>11} {:>11} {:>7} {:>7} {:>7} {:>12} {:>9} {:>9} {:>9}",
        "instances",
        "requests",
        "events",
        "removed",
        "blocks",
        "apply ev/s",
        "apply blk/s",
        "p50 us",
        "p99 us",
        "mean us",
        "ev+lookup/s",
        "plain p50",
        "plain p99",
        "apply x"
    );
    for w in workloads {
        let (apply, _) = replay(w, Lookups::Skip, false);
        let (mixed, mut latencies) = replay(w, Lookups::Compact, true);
        let (plain_apply, _, mut plain_latencies) = replay_plain(w);
        latencies.sort_unstable();
        plain_latencies.sort_unstable();
        let mean =
            latencies.iter().map(|&x| f64::from(x)).sum::<f64>() / latencies.len() as f64 / 1000.0;
        println!(
            "{:>9} {:>8} {:>8} {:>8} {:>8} {:>11.0} {:>11.0} {:>7.2} {:>7.2} {:>7.2} {:>12.0} {:>9.2} {:>9.2} {:>9.2}",
            w.instances,
            w.chains.len(),
            w.events,
            w.removed_events,
            w.blocks,
            w.events as f64 / apply.as_secs_f64(),
            w.blocks as f64 / apply.as_secs_f64(),
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.99),
            mean,
            (w.events + w.chains.len()) as f64 / mixed.as_secs_f64(),
            percentile(&plain_latencies, 0.5),
            percentile(&plain_latencies, 0.99),
            apply.as_secs_f64() / plain_apply.as_secs_f64(),
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
