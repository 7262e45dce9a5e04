//! SGLang gateway's `smg-radix-tree` 0.1.0 `RadixTree` (chain-native radix tree with interned
//! holder sets): single writer, called directly (`&mut`, no lock: the crate has none). One
//! holder per instance; a block's key is its engine hash (the low 64 bits of kvpool's chained
//! hash, opaque to the tree), its content hash the recorded content.

use radix_tree::{BlockKey, Config, ContentHash, HolderId, Overlap, OverlapScratch, RadixTree};

use super::{Answer, Index};
use crate::workload::{Event, Workload, NONE};

enum Op {
    Store(Option<BlockKey>, Vec<(BlockKey, ContentHash)>),
    Remove(Vec<BlockKey>),
}

pub struct Smg {
    tree: RadixTree,
    holders: Vec<HolderId>,
    /// Holder slot index -> instance.
    instance_of: Vec<u32>,
    batches: Vec<(u32, Vec<Op>)>,
    chains: Vec<Vec<ContentHash>>,
    scratch: OverlapScratch,
    out: Vec<Overlap>,
    instances: usize,
    pub errors: usize,
}

impl Smg {
    pub fn new(w: &Workload) -> Self {
        let key = |b: u32| w.hash[b as usize].0 as u64;
        let batches = w
            .batches()
            .map(|(instance, _, events)| {
                let ops = events
                    .iter()
                    .map(|e| match e {
                        Event::Stored { parent, blocks } => Op::Store(
                            (*parent != NONE).then(|| key(*parent)),
                            blocks
                                .iter()
                                .map(|&b| (key(b), w.content[b as usize]))
                                .collect(),
                        ),
                        Event::Removed { block } => Op::Remove(vec![key(*block)]),
                    })
                    .collect();
                (instance, ops)
            })
            .collect();
        let chains = w
            .chains
            .iter()
            .map(|c| c.iter().map(|&b| w.content[b as usize]).collect())
            .collect();
        Self {
            tree: RadixTree::new(Config::default()),
            holders: Vec::new(),
            instance_of: Vec::new(),
            batches,
            chains,
            scratch: OverlapScratch::default(),
            out: Vec::new(),
            instances: w.instances,
            errors: 0,
        }
    }
}

impl Index for Smg {
    fn reset(&mut self) {
        self.tree = RadixTree::new(Config::default());
        self.holders = (0..self.instances)
            .map(|i| self.tree.create_holder(&format!("worker-{i}")))
            .collect();
        let slots = self
            .holders
            .iter()
            .map(|h| h.parts().0 as usize + 1)
            .max()
            .unwrap_or(0);
        self.instance_of = vec![u32::MAX; slots];
        for (i, h) in self.holders.iter().enumerate() {
            self.instance_of[h.parts().0 as usize] = i as u32;
        }
    }

    fn apply(&mut self, batch: usize) {
        let (instance, ops) = &self.batches[batch];
        let holder = self.holders[*instance as usize];
        for op in ops {
            match op {
                Op::Store(parent, blocks) => {
                    if self.tree.store(holder, *parent, blocks).is_err() {
                        self.errors += 1;
                    }
                }
                Op::Remove(keys) => {
                    self.tree.remove(holder, keys);
                }
            }
        }
    }

    fn lookup(&mut self, chain: usize, _answer: Answer) -> usize {
        self.tree
            .overlap(&self.chains[chain], &mut self.scratch, &mut self.out);
        std::hint::black_box(&self.out).len()
    }

    fn answer(&mut self, chain: usize) -> Vec<(u32, u32)> {
        self.tree
            .overlap(&self.chains[chain], &mut self.scratch, &mut self.out);
        let mut out: Vec<(u32, u32)> = self
            .out
            .iter()
            .filter(|o| o.depth > 0)
            .map(|o| (self.instance_of[o.holder.parts().0 as usize], o.depth))
            .collect();
        out.sort_unstable();
        out
    }
}
