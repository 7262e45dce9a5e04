//! The recorded stream: the Mooncake conversation trace routed and evicted exactly as
//! `rust/kvpool/benches/index.rs` does (kv-aware routing by a `KVIndex` of the stream itself,
//! the longest device match of at least two blocks, else the hash of the request's second
//! block; one `stored` event per run of missing blocks; each instance's own LRU of `CAPACITY`
//! blocks evicting one `removed` event per block; `N / 1000` rounds, at least one, each under its
//! own extra key), recorded once per instance count in a neutral form that every index's adapter
//! converts to its own types before the timed replays.
//!
//! Blocks are numbered: block `b` has its content (the trace's hash id, mixed with the round, a
//! position-independent content hash as Dynamo and SGLang want it), its parent block and its
//! kvpool chained hash. Events and lookups name blocks by number.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use kvpool::{BlockHash, BlockHasher, IndexConfig, IndexEvent, KVIndex};

pub const BLOCK_SIZE: u32 = 512;
/// Blocks each instance's cache holds (256 x 512 = 131,072 tokens).
pub const CAPACITY: usize = 256;
pub const NONE: u32 = u32::MAX;

/// One event of one instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Blocks `blocks` (consecutive on one chain) stored after `parent` (`NONE`: a chain's first).
    Stored { parent: u32, blocks: Vec<u32> },
    /// One block removed.
    Removed { block: u32 },
}

/// A step of the stream: a request's lookup, or one instance's batch of events (one sequence
/// number per event, from 0 per instance).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Lookup {
        chain: u32,
    },
    Apply {
        instance: u32,
        first_sequence: u64,
        events: Vec<Event>,
    },
}

pub struct Workload {
    pub instances: usize,
    /// Per block: content hash, parent block (`NONE` for a chain's first), kvpool hash.
    pub content: Vec<u64>,
    pub parent: Vec<u32>,
    pub hash: Vec<BlockHash>,
    /// Per request: its blocks.
    pub chains: Vec<Vec<u32>>,
    pub steps: Vec<Step>,
}

impl Workload {
    pub fn events(&self) -> usize {
        self.batches().map(|(_, _, e)| e.len()).sum()
    }

    /// Stored and removed blocks.
    pub fn event_blocks(&self) -> usize {
        self.batches()
            .flat_map(|(_, _, e)| e)
            .map(|e| match e {
                Event::Stored { blocks, .. } => blocks.len(),
                Event::Removed { .. } => 1,
            })
            .sum()
    }

    pub fn lookups(&self) -> usize {
        self.chains.len()
    }

    pub fn batches(&self) -> impl Iterator<Item = (u32, u64, &[Event])> + '_ {
        self.steps.iter().filter_map(|s| match s {
            Step::Apply {
                instance,
                first_sequence,
                events,
            } => Some((*instance, *first_sequence, &events[..])),
            Step::Lookup { .. } => None,
        })
    }
}

pub fn trace_path() -> PathBuf {
    if let Ok(path) = std::env::var("KVPOOL_MOONCAKE_TRACE") {
        return path.into();
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for candidate in [
        here.join("../../../shared/data/mooncake/conversation_trace.jsonl"),
        here.join("../../shared/data/mooncake/conversation_trace.jsonl"),
        PathBuf::from("/work/shared/data/mooncake/conversation_trace.jsonl"),
    ] {
        if candidate.exists() {
            return candidate;
        }
    }
    here.join("../../../shared/data/mooncake/conversation_trace.jsonl")
}

/// Each request's hash ids.
pub fn load_trace(path: &Path) -> Result<Vec<Vec<u32>>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("no trace at {}: {e}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let v: serde_json::Value =
                serde_json::from_str(line).map_err(|e| format!("a trace line: {e}"))?;
            v["hash_ids"]
                .as_array()
                .ok_or("a trace line without hash_ids")?
                .iter()
                .map(|x| x.as_u64().map(|x| x as u32).ok_or("a hash id"))
                .collect::<Result<Vec<u32>, &str>>()
                .map_err(str::to_string)
        })
        .collect()
}

/// One instance's block cache: LRU over blocks, touched deepest block first.
#[derive(Default)]
struct BlockLru {
    tick: u64,
    stamp: HashMap<u32, u64>,
    order: BTreeMap<u64, u32>,
}

impl BlockLru {
    fn contains(&self, b: u32) -> bool {
        self.stamp.contains_key(&b)
    }

    fn touch(&mut self, b: u32) {
        self.tick += 1;
        if let Some(old) = self.stamp.insert(b, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, b);
    }

    fn evict(&mut self, keep: usize) -> Vec<u32> {
        let mut out = Vec::new();
        while self.stamp.len() > keep {
            let (_, b) = self.order.pop_first().expect("non-empty");
            self.stamp.remove(&b);
            out.push(b);
        }
        out
    }
}

/// splitmix64: the content hash of hash id `id` in round `round`.
pub fn content_of(round: u64, id: u32) -> u64 {
    let mut z = (round << 32 | u64::from(id)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The stream at `instances` instances.
pub fn generate(trace: &[Vec<u32>], instances: usize) -> Workload {
    let hasher = BlockHasher::default();
    let rounds = (instances / 1000).max(1);
    let config = IndexConfig {
        max_entries: 1 << 26,
        ..IndexConfig::default()
    };
    let idx = KVIndex::new(config).expect("config");
    let mut caches: Vec<BlockLru> = (0..instances).map(|_| BlockLru::default()).collect();
    let mut sequence = vec![0u64; instances];
    let mut number: HashMap<BlockHash, u32> = HashMap::new();
    let mut w = Workload {
        instances,
        content: Vec::new(),
        parent: Vec::new(),
        hash: Vec::new(),
        chains: Vec::new(),
        steps: Vec::new(),
    };
    for round in 0..rounds {
        let root = hasher.root(Some(&(round as u64).to_le_bytes()));
        for ids in trace {
            let mut chain = Vec::with_capacity(ids.len());
            let mut blocks = Vec::with_capacity(ids.len());
            let mut parent = root;
            let mut parent_block = NONE;
            for &id in ids {
                parent = hasher.hash_block(parent, &[id]);
                chain.push(parent);
                let b = *number.entry(parent).or_insert_with(|| {
                    w.content.push(content_of(round as u64, id));
                    w.parent.push(parent_block);
                    w.hash.push(parent);
                    (w.hash.len() - 1) as u32
                });
                blocks.push(b);
                parent_block = b;
            }
            let best = idx
                .lookup_chain(&chain, BLOCK_SIZE, 0.0)
                .into_iter()
                .max_by_key(|m| (m.blocks, std::cmp::Reverse(m.instance)));
            let instance = match best {
                Some(m) if m.blocks >= 2 => m.instance as usize,
                _ => (chain.get(1).unwrap_or(&chain[0]).0 as usize) % instances,
            };
            w.steps.push(Step::Lookup {
                chain: w.chains.len() as u32,
            });
            let cache = &mut caches[instance];
            let first_sequence = sequence[instance];
            let mut events = Vec::new();
            let mut batch = Vec::new();
            let mut i = 0;
            while i < chain.len() {
                if cache.contains(blocks[i]) {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < chain.len() && !cache.contains(blocks[i]) {
                    i += 1;
                }
                let parent = start.checked_sub(1).map(|p| chain[p]);
                batch.push(
                    IndexEvent::stored(BLOCK_SIZE, parent, chain[start..i].to_vec())
                        .with_sequence(sequence[instance]),
                );
                events.push(Event::Stored {
                    parent: start.checked_sub(1).map_or(NONE, |p| blocks[p]),
                    blocks: blocks[start..i].to_vec(),
                });
                sequence[instance] += 1;
            }
            for &b in blocks.iter().rev() {
                cache.touch(b);
            }
            for b in cache.evict(CAPACITY) {
                batch.push(
                    IndexEvent::removed(BLOCK_SIZE, vec![w.hash[b as usize]])
                        .with_sequence(sequence[instance]),
                );
                events.push(Event::Removed { block: b });
                sequence[instance] += 1;
            }
            idx.apply(instance as u64, &batch).expect("valid events");
            w.steps.push(Step::Apply {
                instance: instance as u32,
                first_sequence,
                events,
            });
            w.chains.push(blocks);
        }
    }
    w
}

// ------------------------------------------------------------------------------ file format

fn put(out: &mut Vec<u8>, x: u64) {
    out.extend_from_slice(&x.to_le_bytes());
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn get(&mut self) -> u64 {
        let (head, tail) = self.0.split_at(8);
        self.0 = tail;
        u64::from_le_bytes(head.try_into().expect("8 bytes"))
    }
}

/// Writes `w` to `path` (for the memory children: they read it without generating).
pub fn save(w: &Workload, path: &Path) -> std::io::Result<()> {
    let mut out = Vec::new();
    put(&mut out, w.instances as u64);
    put(&mut out, w.content.len() as u64);
    for b in 0..w.content.len() {
        put(&mut out, w.content[b]);
        put(&mut out, u64::from(w.parent[b]));
        put(&mut out, w.hash[b].0 as u64);
        put(&mut out, (w.hash[b].0 >> 64) as u64);
    }
    put(&mut out, w.chains.len() as u64);
    for c in &w.chains {
        put(&mut out, c.len() as u64);
        for &b in c {
            put(&mut out, u64::from(b));
        }
    }
    put(&mut out, w.steps.len() as u64);
    for s in &w.steps {
        match s {
            Step::Lookup { chain } => {
                put(&mut out, 0);
                put(&mut out, u64::from(*chain));
            }
            Step::Apply {
                instance,
                first_sequence,
                events,
            } => {
                put(&mut out, 1);
                put(&mut out, u64::from(*instance));
                put(&mut out, *first_sequence);
                put(&mut out, events.len() as u64);
                for e in events {
                    match e {
                        Event::Stored { parent, blocks } => {
                            put(&mut out, 0);
                            put(&mut out, u64::from(*parent));
                            put(&mut out, blocks.len() as u64);
                            for &b in blocks {
                                put(&mut out, u64::from(b));
                            }
                        }
                        Event::Removed { block } => {
                            put(&mut out, 1);
                            put(&mut out, u64::from(*block));
                        }
                    }
                }
            }
        }
    }
    std::fs::File::create(path)?.write_all(&out)
}

pub fn load(path: &Path) -> std::io::Result<Workload> {
    let mut data = Vec::new();
    std::fs::File::open(path)?.read_to_end(&mut data)?;
    let mut r = Reader(&data);
    let instances = r.get() as usize;
    let blocks = r.get() as usize;
    let mut w = Workload {
        instances,
        content: Vec::with_capacity(blocks),
        parent: Vec::with_capacity(blocks),
        hash: Vec::with_capacity(blocks),
        chains: Vec::new(),
        steps: Vec::new(),
    };
    for _ in 0..blocks {
        w.content.push(r.get());
        w.parent.push(r.get() as u32);
        let low = r.get();
        let high = r.get();
        w.hash
            .push(BlockHash(u128::from(low) | u128::from(high) << 64));
    }
    let chains = r.get() as usize;
    w.chains.reserve_exact(chains);
    for _ in 0..chains {
        let n = r.get() as usize;
        w.chains.push((0..n).map(|_| r.get() as u32).collect());
    }
    let steps = r.get() as usize;
    w.steps.reserve_exact(steps);
    for _ in 0..steps {
        if r.get() == 0 {
            w.steps.push(Step::Lookup {
                chain: r.get() as u32,
            });
            continue;
        }
        let instance = r.get() as u32;
        let first_sequence = r.get();
        let n = r.get() as usize;
        let mut events = Vec::with_capacity(n);
        for _ in 0..n {
            if r.get() == 0 {
                let parent = r.get() as u32;
                let k = r.get() as usize;
                events.push(Event::Stored {
                    parent,
                    blocks: (0..k).map(|_| r.get() as u32).collect(),
                });
            } else {
                events.push(Event::Removed {
                    block: r.get() as u32,
                });
            }
        }
        w.steps.push(Step::Apply {
            instance,
            first_sequence,
            events,
        });
    }
    Ok(w)
}
