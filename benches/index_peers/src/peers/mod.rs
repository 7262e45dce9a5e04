//! The indexes under test, each behind the same small interface: built from the recorded
//! stream (its events and lookups converted to the index's own types before any timing),
//! then fed the stream's batches and lookups in order.

pub mod dynamo;
pub mod kv_index;
pub mod kvpool;
pub mod smg;

use crate::workload::Workload;

/// How a lookup answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The index's compact form (kvpool's `Matches`: rows and bitset layers, unresolved).
    Compact,
    /// One row per matching instance (an instance id and its depth).
    Rows,
}

pub trait Index {
    /// Starts again from an empty index (the old one is dropped first).
    fn reset(&mut self);
    /// Makes the inputs of one replay (an index whose API consumes its events gets fresh
    /// copies here, before the replay and outside its timing).
    fn prepare(&mut self) {}
    /// Waits for the batches applied so far to be visible to lookups (an index applying them
    /// on other threads): before every lookup (untimed) and at the end of a replay (timed).
    fn settle(&mut self) {}
    /// Applies batch `batch` (the `batch`-th apply step of the stream).
    fn apply(&mut self, batch: usize);
    /// Looks up request `chain`'s blocks; returns how many rows (or instances) answered.
    fn lookup(&mut self, chain: usize, answer: Answer) -> usize;
    /// Every instance holding the request's first block, with its depth, sorted by instance.
    fn answer(&mut self, chain: usize) -> Vec<(u32, u32)>;
    /// A breakdown of the index's memory, if it has one (printed by the memory child).
    fn breakdown(&self) -> String {
        String::new()
    }
    /// Whether the compact form differs from the per-instance rows.
    fn compact(&self) -> bool {
        false
    }
}

/// The indexes this binary knows, by name.
pub const NAMES: &[&str] = &[
    "kvpool",
    "smg-radix-tree",
    "kv-index",
    "dynamo-radix",
    "dynamo-flash",
    "dynamo-crtc",
];

/// Index `name` for stream `w`.
pub fn make(name: &str, w: &Workload) -> Option<Box<dyn Index>> {
    Some(match name {
        "kvpool" => Box::new(kvpool::Kvpool::new(w)),
        "smg-radix-tree" => Box::new(smg::Smg::new(w)),
        "kv-index" => Box::new(kv_index::KvIndex::new(w)),
        "dynamo-radix" => Box::new(dynamo::Dynamo::new(w, dynamo::Kind::Radix)),
        "dynamo-flash" => Box::new(dynamo::Dynamo::new(w, dynamo::Kind::Flash)),
        "dynamo-crtc" => Box::new(dynamo::Dynamo::new(w, dynamo::Kind::Crtc)),
        _ => return None,
    })
}
