//! The plain reference every index is checked against: per block, the sorted instances
//! holding it; a lookup walks the request's blocks keeping the instances still holding every
//! block so far, and gives each instance its depth.

use std::collections::HashMap;

use crate::workload::{Event, Workload};

#[derive(Default)]
pub struct Reference {
    holders: HashMap<u32, Vec<u32>>,
    entries: usize,
}

impl Reference {
    pub fn apply(&mut self, instance: u32, events: &[Event]) {
        for e in events {
            match e {
                Event::Stored { blocks, .. } => {
                    for &b in blocks {
                        let list = self.holders.entry(b).or_default();
                        if let Err(i) = list.binary_search(&instance) {
                            list.insert(i, instance);
                            self.entries += 1;
                        }
                    }
                }
                Event::Removed { block } => {
                    if let Some(list) = self.holders.get_mut(block) {
                        if let Ok(i) = list.binary_search(&instance) {
                            list.remove(i);
                            self.entries -= 1;
                            if list.is_empty() {
                                self.holders.remove(block);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Live (instance, block) entries.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Blocks held by at least one instance.
    pub fn blocks(&self) -> usize {
        self.holders.len()
    }

    /// Every instance holding the chain's first block, with its depth, sorted by instance.
    pub fn lookup(&self, chain: &[u32]) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        let Some(first) = chain.first().and_then(|b| self.holders.get(b)) else {
            return out;
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
        out.sort_unstable();
        out
    }
}

/// The reference replayed up to the end: its live entries and distinct blocks.
pub fn final_state(w: &Workload) -> (usize, usize) {
    let mut r = Reference::default();
    for (instance, _, events) in w.batches() {
        r.apply(instance, events);
    }
    (r.entries(), r.blocks())
}
