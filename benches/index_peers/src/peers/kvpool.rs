//! `kvpool::KVIndex` as a router uses it: one `apply` per batch (the instance's events of one
//! step, sequenced), lookups through a snapshot, compact (`Snapshot::lookup_into`, reused
//! `Matches`) or one `Match` per location (`KVIndex::lookup_chain`).

use kvpool::{BlockHash, IndexConfig, IndexEvent, KVIndex, Matches};

use super::{Answer, Index};
use crate::workload::{Event, Workload, BLOCK_SIZE, NONE};

pub struct Kvpool {
    index: KVIndex,
    batches: Vec<(u64, Vec<IndexEvent>)>,
    chains: Vec<Vec<BlockHash>>,
    out: Matches,
}

impl Kvpool {
    pub fn new(w: &Workload) -> Self {
        let batches = batches(w);
        let chains = w
            .chains
            .iter()
            .map(|c| c.iter().map(|&b| w.hash[b as usize]).collect())
            .collect();
        Self {
            index: fresh(),
            batches,
            chains,
            out: Matches::new(),
        }
    }
}

fn fresh() -> KVIndex {
    let config = IndexConfig {
        max_entries: 1 << 26,
        ..IndexConfig::default()
    };
    KVIndex::new(config).expect("config")
}

impl Index for Kvpool {
    fn reset(&mut self) {
        self.index = fresh();
    }

    fn apply(&mut self, batch: usize) {
        let (instance, events) = &self.batches[batch];
        self.index.apply(*instance, events).expect("valid events");
    }

    fn lookup(&mut self, chain: usize, answer: Answer) -> usize {
        let chain = &self.chains[chain];
        match answer {
            Answer::Compact => {
                self.index
                    .snapshot()
                    .lookup_into(chain, BLOCK_SIZE, 0.0, &mut self.out);
                std::hint::black_box(&self.out);
                self.out.is_empty() as usize
            }
            Answer::Rows => {
                std::hint::black_box(self.index.lookup_chain(chain, BLOCK_SIZE, 0.0)).len()
            }
        }
    }

    fn answer(&mut self, chain: usize) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = self
            .index
            .lookup_chain(&self.chains[chain], BLOCK_SIZE, 0.0)
            .into_iter()
            .map(|m| (m.instance as u32, m.blocks))
            .collect();
        out.sort_unstable();
        out
    }

    fn breakdown(&self) -> String {
        self.index
            .heap_bytes()
            .iter()
            .map(|(part, bytes)| format!("{part} {:.1} MB", *bytes as f64 / 1e6))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn compact(&self) -> bool {
        true
    }
}

/// The stream as kvpool's `IndexEvent` batches: (instance, events numbered from the batch's
/// first sequence number).
pub fn batches(w: &Workload) -> Vec<(u64, Vec<IndexEvent>)> {
    w.batches()
        .map(|(instance, first, events)| {
            let events = events
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    let e = match e {
                        Event::Stored { parent, blocks } => IndexEvent::stored(
                            BLOCK_SIZE,
                            (*parent != NONE).then(|| w.hash[*parent as usize]),
                            blocks.iter().map(|&b| w.hash[b as usize]).collect(),
                        ),
                        Event::Removed { block } => {
                            IndexEvent::removed(BLOCK_SIZE, vec![w.hash[*block as usize]])
                        }
                    };
                    e.with_sequence(first + i as u64)
                })
                .collect();
            (u64::from(instance), events)
        })
        .collect()
}
