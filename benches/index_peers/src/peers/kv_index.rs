//! SGLang gateway's `kv-index` 2.0.0 `ShardedChainIndex` (run-compressed chain index, lock-free
//! readers, one lane map per worker), as its Mooncake replay drives it: a shard holds at most
//! 1,024 workers, so `ceil(instances / 1024)` shards with contiguous worker ranges; each
//! worker's `ChainBlockMap` is the caller's (its event lane's). Engine hashes are the low 64
//! bits of kvpool's chained hash (any chain hash serves, see the crate's doc), content hashes
//! the recorded contents.

use kv_index::{ChainBlockMap, ContentHash, SequenceHash, ShardedChainIndex, StoredBlock};

use super::{Answer, Index};
use crate::workload::{Event, Workload, NONE};

/// One kv-index operation of an event.
pub enum Op {
    Store(Option<SequenceHash>, Vec<StoredBlock>),
    Remove(Vec<SequenceHash>),
}

pub struct KvIndex {
    index: Option<ShardedChainIndex>,
    workers: Vec<u32>,
    maps: Vec<ChainBlockMap>,
    /// Worker id -> instance.
    instance_of: std::collections::HashMap<u32, u32>,
    batches: Vec<(u32, Vec<Op>)>,
    chains: Vec<Vec<ContentHash>>,
    instances: usize,
    pub errors: usize,
}

const MAX_WORKERS: usize = 1024;

impl KvIndex {
    pub fn new(w: &Workload) -> Self {
        let batches = batches(w);
        let chains = w
            .chains
            .iter()
            .map(|c| {
                c.iter()
                    .map(|&b| ContentHash(w.content[b as usize]))
                    .collect()
            })
            .collect();
        Self {
            index: None,
            workers: Vec::new(),
            maps: Vec::new(),
            instance_of: Default::default(),
            batches,
            chains,
            instances: w.instances,
            errors: 0,
        }
    }
}

impl Index for KvIndex {
    fn reset(&mut self) {
        let n = self.instances;
        let shards = n.div_ceil(MAX_WORKERS);
        self.index = None;
        let index = self
            .index
            .insert(ShardedChainIndex::new(shards, n.min(MAX_WORKERS)));
        self.workers = (0..n)
            .map(|i| {
                index
                    .intern_worker_in(i * shards / n, &format!("worker-{i}"))
                    .expect("worker slots")
            })
            .collect();
        self.maps = (0..n).map(|_| ChainBlockMap::default()).collect();
        self.instance_of = self
            .workers
            .iter()
            .enumerate()
            .map(|(i, &w)| (w, i as u32))
            .collect();
    }

    fn apply(&mut self, batch: usize) {
        let (instance, ops) = &self.batches[batch];
        let worker = self.workers[*instance as usize];
        let map = &mut self.maps[*instance as usize];
        let index = self.index.as_ref().expect("reset first");
        for op in ops {
            match op {
                Op::Store(parent, blocks) => {
                    if index.apply_stored(worker, blocks, *parent, map).is_err() {
                        self.errors += 1;
                    }
                }
                Op::Remove(hashes) => index.apply_removed(worker, hashes, map),
            }
        }
    }

    fn lookup(&mut self, chain: usize, _answer: Answer) -> usize {
        std::hint::black_box(
            self.index
                .as_ref()
                .expect("reset first")
                .find_matches(&self.chains[chain], false),
        )
        .scores
        .len()
    }

    fn answer(&mut self, chain: usize) -> Vec<(u32, u32)> {
        let scores = self
            .index
            .as_ref()
            .expect("reset first")
            .find_matches(&self.chains[chain], false);
        let mut out: Vec<(u32, u32)> = scores
            .scores
            .iter()
            .filter(|(_, &s)| s > 0)
            .map(|(w, &s)| (self.instance_of[w], s))
            .collect();
        out.sort_unstable();
        out
    }
}

/// The stream as kv-index operations per batch: (worker's instance, operations).
pub fn batches(w: &Workload) -> Vec<(u32, Vec<Op>)> {
    let key = |b: u32| SequenceHash(w.hash[b as usize].0 as u64);
    w.batches()
        .map(|(instance, _, events)| {
            let ops = events
                .iter()
                .map(|e| match e {
                    Event::Stored { parent, blocks } => Op::Store(
                        (*parent != NONE).then(|| key(*parent)),
                        blocks
                            .iter()
                            .map(|&b| StoredBlock {
                                seq_hash: key(b),
                                content_hash: ContentHash(w.content[b as usize]),
                            })
                            .collect(),
                    ),
                    Event::Removed { block } => Op::Remove(vec![key(*block)]),
                })
                .collect();
            (instance, ops)
        })
        .collect()
}
