//! NVIDIA Dynamo's `dynamo-kv-router` 1.6.1 indexes, fed `RouterEvent`s as its router builds
//! them from engine events (a block's `tokens_hash` its content hash, its `block_hash` the
//! rolling sequence hash Dynamo computes, `compute_next_seq_hash`):
//! - `dynamo-radix`: `RadixTree`, single-threaded, called directly (`apply_event`,
//!   `find_matches`; its `KvIndexer` runs the same calls on one actor thread);
//! - `dynamo-flash`: `PositionalIndexer` (the positional "flash" indexer, jump 32), called
//!   directly with one per-worker block map (its `SyncIndexer` reads);
//! - `dynamo-crtc`: `ConcurrentRadixTreeCompressed` through its `ThreadPoolIndexer` (events
//!   sticky per worker over `KVPOOL_PEERS_DYNAMO_THREADS` threads, default 1; reads inline on
//!   the caller's thread, as the pool does); the pool is flushed before each lookup and at the
//!   end of the replay, so every answer sees the batches before it.
//!
//! Events are owned values in Dynamo's API: each timed replay gets fresh clones, made before
//! it; the memory child clones each batch as it applies it.

use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::nested_map::{LevelIndex, PositionalIndexer};
use dynamo_kv_router::protocols::{
    compute_next_seq_hash, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData,
    KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    WorkerWithDpRank,
};
use dynamo_kv_router::radix_tree::RadixTree;
use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use rustc_hash::FxHashMap;

use super::{Answer, Index};
use crate::workload::{Event, Workload, NONE};

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Radix,
    Flash,
    Crtc,
}

enum Backend {
    Radix(RadixTree),
    Flash(PositionalIndexer, FxHashMap<WorkerWithDpRank, LevelIndex>),
    Crtc(ThreadPoolIndexer<ConcurrentRadixTreeCompressed>),
}

pub struct Dynamo {
    kind: Kind,
    backend: Option<Backend>,
    batches: Vec<Vec<RouterEvent>>,
    /// This replay's events (clones of `batches`, taken as applied).
    pending: Vec<Vec<RouterEvent>>,
    chains: Vec<Vec<LocalBlockHash>>,
    runtime: tokio::runtime::Runtime,
    threads: usize,
    dirty: bool,
    pub errors: usize,
}

impl Dynamo {
    pub fn new(w: &Workload, kind: Kind) -> Self {
        // Dynamo's rolling sequence hash of every block (parents are numbered first).
        let mut seq = Vec::with_capacity(w.content.len());
        for b in 0..w.content.len() {
            let local = LocalBlockHash(w.content[b]);
            let parent = w.parent[b];
            seq.push(if parent == NONE {
                local.0
            } else {
                compute_next_seq_hash(seq[parent as usize], local)
            });
        }
        let mut event_id = 0u64;
        let batches = w
            .batches()
            .map(|(instance, _, events)| {
                events
                    .iter()
                    .map(|e| {
                        let data = match e {
                            Event::Stored { parent, blocks } => {
                                KvCacheEventData::Stored(KvCacheStoreData {
                                    parent_hash: (*parent != NONE)
                                        .then(|| ExternalSequenceBlockHash(seq[*parent as usize])),
                                    start_position: None,
                                    blocks: blocks
                                        .iter()
                                        .map(|&b| KvCacheStoredBlockData {
                                            block_hash: ExternalSequenceBlockHash(seq[b as usize]),
                                            tokens_hash: LocalBlockHash(w.content[b as usize]),
                                            mm_extra_info: None,
                                        })
                                        .collect(),
                                })
                            }
                            Event::Removed { block } => {
                                KvCacheEventData::Removed(KvCacheRemoveData {
                                    block_hashes: vec![ExternalSequenceBlockHash(
                                        seq[*block as usize],
                                    )],
                                })
                            }
                        };
                        event_id += 1;
                        RouterEvent::new(
                            u64::from(instance),
                            KvCacheEvent {
                                event_id,
                                data,
                                dp_rank: 0,
                            },
                        )
                    })
                    .collect()
            })
            .collect();
        let chains = w
            .chains
            .iter()
            .map(|c| {
                c.iter()
                    .map(|&b| LocalBlockHash(w.content[b as usize]))
                    .collect()
            })
            .collect();
        let threads = std::env::var("KVPOOL_PEERS_DYNAMO_THREADS")
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or(1usize)
            .max(1);
        Self {
            kind,
            backend: None,
            batches,
            pending: Vec::new(),
            chains,
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a tokio runtime"),
            threads,
            dirty: false,
            errors: 0,
        }
    }

    /// Waits for the thread pool's queued events.
    fn flush(&mut self) {
        if let (true, Some(Backend::Crtc(pool))) = (self.dirty, &self.backend) {
            self.runtime
                .block_on(pool.flush_and_wait())
                .expect("the pool flushes");
            self.dirty = false;
        }
    }

    fn find(&mut self, chain: usize) -> dynamo_kv_router::protocols::OverlapScores {
        let seq = &self.chains[chain];
        match self.backend.as_ref().expect("reset first") {
            Backend::Radix(tree) => tree.find_matches(seq.clone(), false),
            Backend::Flash(index, _) => index.find_matches(seq, false),
            Backend::Crtc(pool) => pool.backend().find_matches(seq, false),
        }
    }
}

impl Index for Dynamo {
    fn reset(&mut self) {
        // The old pool's threads end when it drops.
        self.backend = None;
        self.backend = Some(match self.kind {
            Kind::Radix => Backend::Radix(RadixTree::new()),
            Kind::Flash => Backend::Flash(PositionalIndexer::new(32), FxHashMap::default()),
            Kind::Crtc => Backend::Crtc(ThreadPoolIndexer::new(
                ConcurrentRadixTreeCompressed::new(),
                self.threads,
                crate::workload::BLOCK_SIZE,
            )),
        });
        self.dirty = false;
    }

    fn prepare(&mut self) {
        self.pending = self.batches.clone();
    }

    fn apply(&mut self, batch: usize) {
        // Unprepared (the memory child): copies made here, freed by the index as it consumes
        // them, as a router's decoded events are.
        let events = match self.pending.get_mut(batch) {
            Some(events) => std::mem::take(events),
            None => self.batches[batch].clone(),
        };
        match self.backend.as_mut().expect("reset first") {
            Backend::Radix(tree) => {
                for e in events {
                    if tree.apply_event(e).is_err() {
                        self.errors += 1;
                    }
                }
            }
            Backend::Flash(index, blocks) => {
                for e in events {
                    if index.apply_event(blocks, e, None).is_err() {
                        self.errors += 1;
                    }
                }
            }
            Backend::Crtc(pool) => {
                for e in events {
                    pool.enqueue_event(e).expect("the pool takes events");
                }
                self.dirty = true;
            }
        }
    }

    fn settle(&mut self) {
        self.flush();
    }

    fn lookup(&mut self, chain: usize, _answer: Answer) -> usize {
        std::hint::black_box(self.find(chain)).scores.len()
    }

    fn answer(&mut self, chain: usize) -> Vec<(u32, u32)> {
        let scores = self.find(chain);
        let mut out: Vec<(u32, u32)> = scores
            .scores
            .iter()
            .filter(|(_, &s)| s > 0)
            .map(|(w, &s)| (w.worker_id as u32, s))
            .collect();
        out.sort_unstable();
        out
    }
}
