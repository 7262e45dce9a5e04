//! `KVIndex`: a proptest against a plain dict-of-sets
//! model over random event streams (stores, removals, clears, speculative entries, gaps and
//! replays, many instances, ranks, media, groups and two block sizes), TTL expiry and
//! confirmation, the memory bound, dump/load, bad input, and readers racing the writer.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvpool::{
    BlockHash, BlockHasher, EventKind, GroupKind, IndexConfig, IndexEvent, KVIndex, KvPoolError,
    Match, Medium,
};
use kvpool::{Gap, LocationKey};
use proptest::prelude::*;

fn index(max_entries: usize) -> KVIndex {
    index_of(max_entries, 1)
}

/// An index of `writers` shards.
fn index_of(max_entries: usize, writers: usize) -> KVIndex {
    KVIndex::new(IndexConfig {
        max_entries,
        writers,
        ..IndexConfig::default()
    })
    .unwrap()
}

/// Three documents of 32 tokens: 0 and 1 share their first 16.
fn document(doc: usize) -> Vec<u32> {
    let head: Vec<u32> = if doc == 2 {
        (500..516).collect()
    } else {
        (0..16).collect()
    };
    let tail = (0..16).map(|i| 100 * (doc as u32 + 1) + i);
    head.into_iter().chain(tail).collect()
}

fn chain(doc: usize, block_size: u32) -> Vec<BlockHash> {
    BlockHasher::default().chain(&document(doc), block_size as usize, None)
}

const GROUPS: [(u32, GroupKind); 3] = [
    (0, GroupKind::FullAttention),
    (1, GroupKind::SlidingWindow { window: 6 }),
    (2, GroupKind::LinearState),
];

/// Instance 3 uses 8-token blocks, the others 4.
fn block_size_of(instance: u64) -> u32 {
    if instance == 3 {
        8
    } else {
        4
    }
}

// ------------------------------------------------------------------------------------ model

/// The plain model: per location, per group, the set of hashes; speculative hashes with their
/// expiry; per source the last number and whether it stalls.
#[derive(Default, Clone)]
struct Model {
    groups: BTreeMap<LocationKey, Vec<(u32, GroupKind)>>,
    held: HashMap<(LocationKey, u32, GroupKind), BTreeSet<BlockHash>>,
    speculative: HashMap<LocationKey, HashMap<BlockHash, f64>>,
    sources: HashMap<(u64, u32), (u64, bool)>,
}

impl Model {
    fn key(instance: u64, e: &IndexEvent) -> LocationKey {
        LocationKey {
            instance,
            dp_rank: e.dp_rank,
            medium: e.medium,
            block_size: e.block_size,
        }
    }

    /// Whether an event numbered `s` of (`instance`, `dp`) would be applied now.
    fn admits(&self, instance: u64, dp: u32, s: u64) -> bool {
        self.sources
            .get(&(instance, dp))
            .is_none_or(|&(last, _)| s == last || s == last + 1)
    }

    /// Returns whether the event was applied, and the gap it opened.
    fn admit(&mut self, instance: u64, e: &IndexEvent) -> (bool, Option<Gap>) {
        let Some(s) = e.sequence else {
            return (true, None);
        };
        let (last, stalled) = *self
            .sources
            .entry((instance, e.dp_rank))
            .or_insert((s, false));
        if s < last {
            (false, None)
        } else if s == last {
            (true, None) // the last unit again: applied, a stall stays (C3)
        } else if s == last + 1 {
            self.sources.insert((instance, e.dp_rank), (s, false));
            (true, None)
        } else {
            self.sources.insert((instance, e.dp_rank), (last, true));
            let gap = Gap {
                instance,
                dp_rank: e.dp_rank,
                expected: last + 1,
                got: s,
            };
            (false, (!stalled).then_some(gap))
        }
    }

    fn apply(&mut self, instance: u64, e: &IndexEvent) -> (bool, Option<Gap>) {
        let (applied, gap) = self.admit(instance, e);
        if !applied {
            return (false, gap);
        }
        let key = Self::key(instance, e);
        let group = (e.group, e.group_kind);
        match e.kind {
            EventKind::Stored => {
                let groups = self.groups.entry(key).or_default();
                if !groups.contains(&group) {
                    groups.push(group);
                }
                let set = self.held.entry((key, group.0, group.1)).or_default();
                let spec = self.speculative.entry(key).or_default();
                for h in &e.block_hashes {
                    set.insert(*h);
                    spec.remove(h);
                }
            }
            EventKind::Removed => {
                if let Some(set) = self.held.get_mut(&(key, group.0, group.1)) {
                    for h in &e.block_hashes {
                        set.remove(h);
                    }
                }
            }
            EventKind::Cleared => {
                self.drop_where(|k| {
                    k.instance == instance && k.dp_rank == e.dp_rank && k.medium == e.medium
                });
            }
            EventKind::Group => {
                let groups = self.groups.entry(key).or_default();
                if !groups.contains(&group) {
                    groups.push(group);
                }
            }
        }
        (true, None)
    }

    fn drop_where(&mut self, f: impl Fn(&LocationKey) -> bool) {
        for ((k, _, _), set) in self.held.iter_mut() {
            if f(k) {
                set.clear();
            }
        }
        for (k, spec) in self.speculative.iter_mut() {
            if f(k) {
                spec.clear();
            }
        }
    }

    fn holds_real(&self, key: &LocationKey, h: BlockHash) -> bool {
        self.groups.get(key).is_some_and(|groups| {
            groups.iter().any(|g| {
                self.held
                    .get(&(*key, g.0, g.1))
                    .is_some_and(|s| s.contains(&h))
            })
        })
    }

    fn speculate(&mut self, key: LocationKey, chain: &[BlockHash], now: f64, ttl: f64) {
        self.expire(now);
        self.groups.entry(key).or_default();
        for &h in chain {
            if self.holds_real(&key, h) {
                continue;
            }
            let spec = self.speculative.entry(key).or_default();
            let e = spec.entry(h).or_insert(now + ttl);
            *e = e.max(now + ttl);
        }
    }

    fn expire(&mut self, now: f64) {
        for spec in self.speculative.values_mut() {
            spec.retain(|_, t| *t > now);
        }
    }

    fn forget(&mut self, instance: u64, dp_rank: u32) {
        self.sources.remove(&(instance, dp_rank));
        self.drop_where(|k| k.instance == instance && k.dp_rank == dp_rank);
    }

    /// Matches of `tokens` by the definitions of `lookup.rs`, brute force.
    fn lookup(&self, tokens: &[u32], now: f64) -> Vec<Match> {
        let mut out = Vec::new();
        for (key, groups) in &self.groups {
            let bs = key.block_size as usize;
            let chain = BlockHasher::default().chain(tokens, bs, None);
            let len = chain.len();
            let spec = |i: usize| {
                self.speculative
                    .get(key)
                    .and_then(|s| s.get(&chain[i]))
                    .is_some_and(|&t| t > now)
            };
            let held = |g: &(u32, GroupKind), i: usize| {
                spec(i)
                    || self
                        .held
                        .get(&(*key, g.0, g.1))
                        .is_some_and(|s| s.contains(&chain[i]))
            };
            // `linear`: whether a linear-state group needs its checkpoint (the restorable
            // depth) or not (the KV depth).
            let admits = |n: usize, linear: bool| -> bool {
                if groups.is_empty() {
                    return (0..n).all(spec);
                }
                groups.iter().all(|g| match g.1 {
                    GroupKind::FullAttention => (0..n).all(|i| held(g, i)),
                    GroupKind::SlidingWindow { window } => {
                        let first = (n * bs).saturating_sub(window as usize - 1) / bs;
                        (first..n).all(|i| held(g, i))
                    }
                    GroupKind::LinearState => !linear || held(g, n - 1),
                })
            };
            let kv_groups =
                groups.is_empty() || groups.iter().any(|g| g.1 != GroupKind::LinearState);
            let kv = (1..=len).rev().find(|&n| admits(n, !kv_groups));
            if let Some(kv) = kv {
                let n = (1..=kv).rev().find(|&n| admits(n, true)).unwrap_or(0);
                out.push(Match {
                    instance: key.instance,
                    dp_rank: key.dp_rank,
                    medium: key.medium,
                    block_size: key.block_size,
                    blocks: n as u32,
                    tokens: (n * bs) as u64,
                    kv_blocks: kv as u32,
                });
            }
        }
        out.sort();
        out
    }
}

fn sorted(mut matches: Vec<Match>) -> Vec<Match> {
    matches.sort();
    matches
}

// ------------------------------------------------------------------------------- proptest

#[derive(Clone, Debug)]
enum Op {
    Store {
        instance: u64,
        dp: u32,
        medium: usize,
        group: usize,
        doc: usize,
        start: usize,
        len: usize,
        fate: u8,
    },
    Remove {
        instance: u64,
        dp: u32,
        medium: usize,
        group: usize,
        doc: usize,
        blocks: u8,
        fate: u8,
    },
    Clear {
        instance: u64,
        dp: u32,
        medium: usize,
        fate: u8,
    },
    Speculate {
        instance: u64,
        dp: u32,
        doc: usize,
        len: usize,
        ttl: u8,
    },
    Advance(u8),
    Replay {
        instance: u64,
        dp: u32,
    },
    /// The source's last applied unit delivered again (a redelivery, often during a stall).
    Redeliver {
        instance: u64,
        dp: u32,
    },
    Resync {
        instance: u64,
        dp: u32,
    },
    /// A location's group announced up front (a "group" event).
    Announce {
        instance: u64,
        dp: u32,
        medium: usize,
        group: usize,
        fate: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let source = (0u64..4, 0u32..2);
    prop_oneof![
        6 => (source.clone(), 0usize..3, prop_oneof![4 => Just(0usize), 1 => 1usize..3],
              0usize..3, 0usize..8, 1usize..9, any::<u8>())
            .prop_map(|((instance, dp), medium, group, doc, start, len, fate)| Op::Store {
                instance, dp, medium, group, doc, start, len, fate }),
        3 => (source.clone(), 0usize..3, prop_oneof![4 => Just(0usize), 1 => 1usize..3],
              0usize..3, any::<u8>(), any::<u8>())
            .prop_map(|((instance, dp), medium, group, doc, blocks, fate)| Op::Remove {
                instance, dp, medium, group, doc, blocks, fate }),
        1 => (source.clone(), 0usize..3, any::<u8>())
            .prop_map(|((instance, dp), medium, fate)| Op::Clear { instance, dp, medium, fate }),
        2 => (source.clone(), 0usize..3, 1usize..9, 1u8..6)
            .prop_map(|((instance, dp), doc, len, ttl)| Op::Speculate { instance, dp, doc, len, ttl }),
        1 => (0u8..4).prop_map(Op::Advance),
        1 => source.clone().prop_map(|(instance, dp)| Op::Replay { instance, dp }),
        1 => source.clone().prop_map(|(instance, dp)| Op::Redeliver { instance, dp }),
        1 => source.clone().prop_map(|(instance, dp)| Op::Resync { instance, dp }),
        1 => (source, 0usize..3, 0usize..3, any::<u8>())
            .prop_map(|((instance, dp), medium, group, fate)| Op::Announce {
                instance, dp, medium, group, fate }),
    ]
}

/// A publisher per source: numbers events, keeps them all (its replay buffer) and loses some.
#[derive(Default)]
struct Publishers {
    next: HashMap<(u64, u32), u64>,
    log: HashMap<(u64, u32), Vec<IndexEvent>>,
}

impl Publishers {
    /// Numbers `event`; `fate` decides: deliver (most), lose it (a gap), or deliver it twice.
    fn publish(&mut self, instance: u64, mut event: IndexEvent, fate: u8) -> Vec<IndexEvent> {
        let source = (instance, event.dp_rank);
        let seq = self.next.entry(source).or_insert(0);
        event.sequence = Some(*seq);
        *seq += 1;
        self.log.entry(source).or_default().push(event.clone());
        match fate % 16 {
            0 => vec![],                             // lost: the next delivered one opens a gap
            1 => vec![event.clone(), event.clone()], // duplicated
            _ => vec![event],
        }
    }

    fn replay(&self, instance: u64, dp: u32, from: u64) -> Vec<IndexEvent> {
        self.log
            .get(&(instance, dp))
            .map(|log| {
                log.iter()
                    .filter(|e| e.sequence.unwrap() >= from)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// A "group" event announcing `group` of `kind` at (`dp`, `medium`).
fn announce(block_size: u32, dp: u32, medium: Medium, group: u32, kind: GroupKind) -> IndexEvent {
    IndexEvent {
        kind: EventKind::Group,
        ..IndexEvent::stored(block_size, None, Vec::new())
    }
    .with_dp_rank(dp)
    .with_medium(medium)
    .with_group(group, kind)
}

fn run_workload(ops: Vec<Op>, writers: usize) -> Result<(), TestCaseError> {
    let idx = index_of(1 << 20, writers);
    let mut model = Model::default();
    let mut publishers = Publishers::default();
    let mut now = 0.0f64;
    let deliver = |idx: &KVIndex, model: &mut Model, instance: u64, events: Vec<IndexEvent>| {
        let mut gaps = Vec::new();
        let mut applied = 0;
        if let Some(s) = events.first().and_then(|e| e.sequence) {
            let dp = events[0].dp_rank;
            assert_eq!(
                idx.can_apply(instance, dp, s),
                model.admits(instance, dp, s)
            );
        }
        for e in &events {
            let (a, gap) = model.apply(instance, e);
            applied += usize::from(a);
            gaps.extend(gap);
        }
        let report = idx.apply(instance, events).unwrap();
        assert_eq!(report.applied, applied);
        assert_eq!(report.gaps, gaps);
    };
    for op in ops {
        match op {
            Op::Store {
                instance,
                dp,
                medium,
                group,
                doc,
                start,
                len,
                fate,
            } => {
                let bs = block_size_of(instance);
                let c = chain(doc, bs);
                let start = start.min(c.len() - 1);
                let end = (start + len).min(c.len());
                let (g, kind) = GROUPS[group];
                let mut e = IndexEvent::stored(
                    bs,
                    start.checked_sub(1).map(|i| c[i]),
                    c[start..end].to_vec(),
                )
                .with_dp_rank(dp)
                .with_medium(Medium::ALL[medium])
                .with_group(g, kind);
                e.token_ids = Some(document(doc)[start * bs as usize..end * bs as usize].to_vec());
                let events = publishers.publish(instance, e, fate);
                deliver(&idx, &mut model, instance, events);
            }
            Op::Remove {
                instance,
                dp,
                medium,
                group,
                doc,
                blocks,
                fate,
            } => {
                let bs = block_size_of(instance);
                let c = chain(doc, bs);
                let hashes = (0..c.len())
                    .filter(|i| blocks >> i & 1 != 0)
                    .map(|i| c[i])
                    .collect();
                let (g, kind) = GROUPS[group];
                let e = IndexEvent::removed(bs, hashes)
                    .with_dp_rank(dp)
                    .with_medium(Medium::ALL[medium])
                    .with_group(g, kind);
                let events = publishers.publish(instance, e, fate);
                deliver(&idx, &mut model, instance, events);
            }
            Op::Clear {
                instance,
                dp,
                medium,
                fate,
            } => {
                let e = IndexEvent::cleared(block_size_of(instance))
                    .with_dp_rank(dp)
                    .with_medium(Medium::ALL[medium]);
                let events = publishers.publish(instance, e, fate);
                deliver(&idx, &mut model, instance, events);
            }
            Op::Speculate {
                instance,
                dp,
                doc,
                len,
                ttl,
            } => {
                let bs = block_size_of(instance);
                let c = chain(doc, bs);
                let c = c[..len.min(c.len())].to_vec();
                let key = LocationKey {
                    instance,
                    dp_rank: dp,
                    medium: Medium::Device,
                    block_size: bs,
                };
                model.speculate(key, &c, now, f64::from(ttl));
                idx.insert_speculative(instance, dp, bs, c, now, f64::from(ttl))
                    .unwrap();
            }
            Op::Advance(dt) => {
                now += f64::from(dt);
                model.expire(now);
                idx.expire(now).unwrap();
            }
            Op::Replay { instance, dp } => {
                let from = idx
                    .sources()
                    .iter()
                    .find(|s| (s.instance, s.dp_rank) == (instance, dp))
                    .map_or(0, |s| s.last + 1);
                let events = publishers.replay(instance, dp, from);
                deliver(&idx, &mut model, instance, events);
            }
            Op::Redeliver { instance, dp } => {
                let last = idx
                    .sources()
                    .iter()
                    .find(|s| (s.instance, s.dp_rank) == (instance, dp))
                    .map(|s| s.last);
                if let Some(last) = last {
                    let events: Vec<IndexEvent> = publishers
                        .replay(instance, dp, last)
                        .into_iter()
                        .filter(|e| e.sequence == Some(last))
                        .collect();
                    deliver(&idx, &mut model, instance, events);
                }
            }
            Op::Resync { instance, dp } => {
                model.forget(instance, dp);
                idx.resync(instance, dp);
            }
            Op::Announce {
                instance,
                dp,
                medium,
                group,
                fate,
            } => {
                let (g, kind) = GROUPS[group];
                let e = announce(block_size_of(instance), dp, Medium::ALL[medium], g, kind);
                let events = publishers.publish(instance, e, fate);
                deliver(&idx, &mut model, instance, events);
            }
        }
        idx.check()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for doc in 0..3 {
            let tokens = document(doc);
            for cut in [32, 20, 8] {
                prop_assert_eq!(
                    sorted(idx.lookup_tokens(&tokens[..cut], None, now)),
                    model.lookup(&tokens[..cut], now),
                    "doc {} cut {} at t={}",
                    doc,
                    cut,
                    now
                );
            }
        }
        let stalled: BTreeSet<(u64, u32)> = idx
            .sources()
            .iter()
            .filter(|s| s.stalled.is_some())
            .map(|s| (s.instance, s.dp_rank))
            .collect();
        let model_stalled: BTreeSet<(u64, u32)> = model
            .sources
            .iter()
            .filter(|(_, v)| v.1)
            .map(|(k, _)| *k)
            .collect();
        prop_assert_eq!(stalled, model_stalled);
    }
    // Dump and load keep everything (warm restart).
    let loaded = KVIndex::load(&idx.dump(), None).unwrap();
    loaded.check().unwrap();
    prop_assert_eq!(loaded.dump(), idx.dump());
    for doc in 0..3 {
        prop_assert_eq!(
            sorted(loaded.lookup_tokens(&document(doc), None, now)),
            model.lookup(&document(doc), now)
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn index_matches_the_dict_of_sets_model(ops in proptest::collection::vec(op(), 1..60)) {
        run_workload(ops, 1)?;
    }

    /// The same over several writers (shards by instance): one thread, the same answers.
    #[test]
    fn an_index_of_several_writers_matches_the_model(
        ops in proptest::collection::vec(op(), 1..60),
        writers in 2usize..5,
    ) {
        run_workload(ops, writers)?;
    }
}

/// A fleet: 150 instances on two media (300 locations, bitsets of 5 words), documents that
/// share prefixes, so that popular blocks have holder lists and bitsets that grow and shrink
/// and lookups take the bitset walk; a few instances have two full-attention groups or a
/// sliding window, some entries are speculative. After every step the index answers as the
/// model does, and both copies are equal, node for node (`check`).
#[test]
fn a_fleet_with_shared_prefixes_matches_the_model() {
    fleet(1);
}

/// The fleet over three writers: the lookups' layers and rows come from three shards.
#[test]
fn a_fleet_over_three_writers_matches_the_model() {
    fleet(3);
}

fn fleet(writers: usize) {
    const INSTANCES: u64 = 150;
    // Documents of 64 tokens (16 blocks of 4): document d shares its first 4 * (d % 4) + 4
    // tokens with document 0.
    let doc = |d: usize| -> Vec<u32> {
        let shared = 4 * (d % 4) + 4;
        (0..64u32)
            .map(|i| {
                if (i as usize) < shared {
                    i
                } else {
                    1000 * (d as u32 + 1) + i
                }
            })
            .collect()
    };
    let docs: Vec<Vec<u32>> = (0..12).map(doc).collect();
    let chains: Vec<Vec<BlockHash>> = docs
        .iter()
        .map(|t| BlockHasher::default().chain(t, 4, None))
        .collect();
    let group_of = |instance: u64, second: bool| -> (u32, GroupKind) {
        match (instance % 23, second) {
            (0, true) => (1, GroupKind::SlidingWindow { window: 6 }),
            (11, true) => (1, GroupKind::FullAttention),
            _ => (0, GroupKind::FullAttention),
        }
    };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let idx = index_of(1 << 20, writers);
    let mut model = Model::default();
    let mut now = 0.0f64;
    for step in 0..1500 {
        let instance = next(INSTANCES);
        let d = next(docs.len() as u64) as usize;
        let medium = if next(4) == 0 {
            Medium::Host
        } else {
            Medium::Device
        };
        let kind = next(100);
        let events: Vec<IndexEvent> = if kind < 55 {
            // A run: the document's blocks start..end, under one or both groups.
            let start = next(8) as usize;
            let end = (start + 1 + next(10) as usize).min(16);
            let mut out = Vec::new();
            for second in [false, true] {
                let (g, group_kind) = group_of(instance, second);
                if second && g == 0 {
                    continue;
                }
                out.push(
                    IndexEvent::stored(4, start.checked_sub(1).map(|i| chains[d][i]), {
                        chains[d][start..end].to_vec()
                    })
                    .with_medium(medium)
                    .with_group(g, group_kind),
                );
            }
            if next(4) == 0 {
                // Churn within the batch: some of the run leaves again at once.
                let gone = (start..end).filter(|_| next(2) == 0).map(|i| chains[d][i]);
                out.push(IndexEvent::removed(4, gone.collect()).with_medium(medium));
            }
            out
        } else if kind < 85 {
            let blocks: Vec<BlockHash> = (0..16)
                .filter(|_| next(3) == 0)
                .map(|i| chains[d][i])
                .collect();
            let (g, group_kind) = group_of(instance, next(2) == 0);
            vec![IndexEvent::removed(4, blocks)
                .with_medium(medium)
                .with_group(g, group_kind)]
        } else if kind < 88 {
            vec![IndexEvent::cleared(4).with_medium(medium)]
        } else if kind < 96 {
            let len = 1 + next(12) as usize;
            let ttl = 1.0 + next(4) as f64;
            let key = LocationKey {
                instance,
                dp_rank: 0,
                medium: Medium::Device,
                block_size: 4,
            };
            model.speculate(key, &chains[d][..len], now, ttl);
            idx.insert_speculative(instance, 0, 4, chains[d][..len].to_vec(), now, ttl)
                .unwrap();
            Vec::new()
        } else {
            now += 1.0;
            model.expire(now);
            idx.expire(now).unwrap();
            Vec::new()
        };
        if !events.is_empty() {
            for e in &events {
                model.apply(instance, e);
            }
            idx.apply(instance, &events).unwrap();
        }
        for _ in 0..3 {
            let q = next(docs.len() as u64) as usize;
            let cut = 4 * (1 + next(16) as usize);
            assert_eq!(
                sorted(idx.lookup_tokens(&docs[q][..cut], None, now)),
                model.lookup(&docs[q][..cut], now),
                "step {step}: document {q} cut {cut}"
            );
        }
        idx.check().unwrap();
    }
    idx.check().unwrap();
    // The compact answer is the same answer.
    let snapshot = idx.snapshot();
    let mut compact = kvpool::Matches::new();
    for c in &chains {
        snapshot.lookup_into(c, 4, now, &mut compact);
        let rows: Vec<Match> = compact
            .iter()
            .map(|r| snapshot.to_match(r).unwrap())
            .collect();
        assert_eq!(rows.len(), compact.len());
        assert_eq!(sorted(rows), sorted(idx.lookup_chain(c, 4, now)));
        let best = compact.best().map(|r| r.blocks);
        assert_eq!(best, compact.iter().map(|r| r.blocks).max());
    }
    let loaded = KVIndex::load(&idx.dump(), None).unwrap();
    loaded.check().unwrap();
    assert_eq!(loaded.dump(), idx.dump());
}

// ----------------------------------------------------------------------------- unit tests

fn blocks_on(matches: &[Match], instance: u64, medium: Medium) -> u32 {
    matches
        .iter()
        .filter(|m| m.instance == instance && m.medium == medium)
        .map(|m| m.blocks)
        .max()
        .unwrap_or(0)
}

#[test]
fn every_instance_and_medium_in_one_call() {
    let idx = index(1000);
    let c = chain(0, 4);
    idx.apply(1, vec![IndexEvent::stored(4, None, c[..8].to_vec())])
        .unwrap();
    idx.apply(2, vec![IndexEvent::stored(4, None, c[..3].to_vec())])
        .unwrap();
    idx.apply(
        2,
        vec![IndexEvent::stored(4, None, c[..6].to_vec()).with_medium(Medium::Host)],
    )
    .unwrap();
    idx.apply(3, vec![IndexEvent::stored(4, None, chain(2, 4))])
        .unwrap();
    let m = idx.lookup_tokens(&document(0), None, 0.0);
    assert_eq!(m.len(), 3, "{m:?}");
    assert_eq!(blocks_on(&m, 1, Medium::Device), 8);
    assert_eq!(blocks_on(&m, 2, Medium::Device), 3);
    assert_eq!(blocks_on(&m, 2, Medium::Host), 6);
    assert!(m.iter().all(|m| m.tokens == u64::from(m.blocks) * 4));
    // The compact rows resolve to the same matches.
    let snapshot = idx.snapshot();
    let mut rows = Vec::new();
    snapshot.lookup_rows_into(&c, 4, 0.0, &mut rows);
    let resolved: Vec<Match> = rows
        .iter()
        .map(|&r| snapshot.to_match(r).unwrap())
        .collect();
    assert_eq!(sorted(resolved), sorted(idx.lookup_chain(&c, 4, 0.0)));
    assert_eq!(snapshot.location(rows[0].location).unwrap().block_size, 4);
    assert!(snapshot.location(999).is_none());
    // Document 1 shares 16 tokens (4 blocks) with document 0.
    let m = idx.lookup_chain(&chain(1, 4), 4, 0.0);
    assert_eq!(blocks_on(&m, 1, Medium::Device), 4);
    assert_eq!(blocks_on(&m, 2, Medium::Host), 4);
    // A removal in the middle cuts the prefix there; a clear drops one medium only.
    idx.apply(1, vec![IndexEvent::removed(4, vec![c[2]])])
        .unwrap();
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 0.0), 1, Medium::Device),
        2
    );
    idx.apply(2, vec![IndexEvent::cleared(4)]).unwrap();
    let m = idx.lookup_chain(&c, 4, 0.0);
    assert_eq!(blocks_on(&m, 2, Medium::Device), 0);
    assert_eq!(blocks_on(&m, 2, Medium::Host), 6);
    idx.check().unwrap();
}

#[test]
fn speculative_entries_lapse_or_are_confirmed() {
    let idx = index(1000);
    let c = chain(0, 4);
    // Routed at t=10 with a 5 s TTL: visible until 15 (exclusive), on the device of rank 0.
    assert_eq!(
        idx.insert_speculative(7, 0, 4, c[..6].to_vec(), 10.0, 5.0)
            .unwrap(),
        6
    );
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 12.0), 7, Medium::Device),
        6
    );
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 15.0), 7, Medium::Device),
        0
    );
    assert_eq!(idx.stats().speculative_entries, 6);
    // The pool stores the first 4: those are real now, the other 2 still speculative.
    idx.apply(7, vec![IndexEvent::stored(4, None, c[..4].to_vec())])
        .unwrap();
    assert_eq!(idx.stats().speculative_entries, 2);
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 14.0), 7, Medium::Device),
        6
    );
    // Expiry drops the unconfirmed two and keeps the confirmed four.
    assert_eq!(idx.expire(15.0).unwrap(), 2);
    assert_eq!(idx.stats().speculative_entries, 0);
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 99.0), 7, Medium::Device),
        4
    );
    // Re-routing extends a TTL; a block held for real is not made speculative.
    assert_eq!(
        idx.insert_speculative(7, 0, 4, c[..5].to_vec(), 20.0, 1.0)
            .unwrap(),
        1
    );
    assert_eq!(
        idx.insert_speculative(7, 0, 4, c[..5].to_vec(), 20.5, 1.0)
            .unwrap(),
        1
    );
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 21.2), 7, Medium::Device),
        5
    );
    assert_eq!(idx.expire(21.5).unwrap(), 1);
    assert_eq!(idx.stats().counters.expired_entries, 3);
    // Bad clocks are errors naming the argument.
    for (now, ttl, name) in [
        (f64::NAN, 1.0, "now"),
        (0.0, 0.0, "ttl"),
        (0.0, f64::INFINITY, "ttl"),
        (1e308, 1e308, "ttl"),
    ] {
        match idx.insert_speculative(7, 0, 4, c.clone(), now, ttl) {
            Err(KvPoolError::InvalidArgument { name: got, .. }) => assert_eq!(got, name),
            other => panic!("{other:?}"),
        }
    }
    assert!(idx.expire(f64::NAN).is_err());
    idx.check().unwrap();
}

#[test]
fn gaps_are_reported_and_replays_or_resyncs_recover() {
    let idx = index(1000);
    let c = chain(0, 4);
    let store = |i: usize, seq: u64| {
        IndexEvent::stored(4, (i > 0).then(|| c[i - 1]), vec![c[i]]).with_sequence(seq)
    };
    let r = idx.apply(5, vec![store(0, 10), store(1, 11)]).unwrap();
    assert_eq!((r.applied, r.gaps.len()), (2, 0));
    // 12 is lost: 13 and 14 are dropped, one gap reported.
    let r = idx.apply(5, vec![store(3, 13), store(4, 14)]).unwrap();
    assert_eq!(r.applied, 0);
    assert_eq!(r.dropped, 2);
    assert_eq!(
        r.gaps,
        vec![Gap {
            instance: 5,
            dp_rank: 0,
            expected: 12,
            got: 13
        }]
    );
    assert_eq!(idx.sources()[0].stalled, Some(13));
    assert_eq!(idx.stats().stalled_sources, 1);
    // G4, C3: the last unit delivered again is applied, but the hole (12) is still there: the
    // source stays stalled and the next event past the hole reports nothing new.
    assert!(idx.can_apply(5, 0, 11) && idx.can_apply(5, 0, 12));
    assert!(!idx.can_apply(5, 0, 10) && !idx.can_apply(5, 0, 15));
    let r = idx.apply(5, vec![store(1, 11)]).unwrap();
    assert_eq!((r.applied, r.gaps.len()), (1, 0));
    assert_eq!(idx.sources()[0].stalled, Some(13));
    assert_eq!(idx.stats().stalled_sources, 1);
    let r = idx.apply(5, vec![store(4, 15)]).unwrap();
    assert_eq!((r.applied, r.dropped, r.gaps.len()), (0, 1, 0));
    // A replay from 10 resumes the source: 10 is a duplicate, 11 (the last unit, again) is
    // applied again (idempotent), 12.. fill the gap.
    let r = idx
        .apply(
            5,
            vec![
                store(0, 10),
                store(1, 11),
                store(2, 12),
                store(3, 13),
                store(4, 14),
            ],
        )
        .unwrap();
    assert_eq!((r.applied, r.duplicates, r.dropped), (4, 1, 0));
    assert_eq!(idx.sources()[0].stalled, None);
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 0.0), 5, Medium::Device),
        5
    );
    // Another gap the buffer cannot fill: resync drops the source's entries and number.
    idx.apply(5, vec![store(6, 20)]).unwrap();
    assert_eq!(idx.resync(5, 0), 5);
    assert!(idx.sources().is_empty());
    let r = idx.apply(5, vec![store(0, 40)]).unwrap();
    assert_eq!(r.applied, 1, "a resynced source starts from what it sees");
    idx.check().unwrap();
}

#[test]
fn sliding_window_and_linear_state_groups_need_their_own_blocks() {
    // Hybrid location: group 0 full attention, group 1 a 9-token window (2 blocks of 4
    // before the hit), group 2 a linear state (checkpoint at the hit's last block).
    let idx = index(1000);
    let c = chain(0, 4);
    let full = IndexEvent::stored(4, None, c[..8].to_vec());
    let window = |from: usize, to: usize| {
        IndexEvent::stored(4, from.checked_sub(1).map(|i| c[i]), c[from..to].to_vec())
            .with_group(1, GroupKind::SlidingWindow { window: 9 })
    };
    idx.apply(1, vec![full, window(2, 4)]).unwrap();
    // Full holds 8, the window only blocks 2..4: the largest n with blocks n-2..n is 4.
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 0.0), 1, Medium::Device),
        4
    );
    idx.apply(1, vec![window(5, 8)]).unwrap();
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 0.0), 1, Medium::Device),
        8
    );
    // A linear state with checkpoints after blocks 3 and 6 (n = 4, n = 7): n = 7 also needs
    // window blocks 5, 6: held.
    let state = |i: usize| {
        IndexEvent::stored(4, Some(c[i - 1]), vec![c[i]]).with_group(2, GroupKind::LinearState)
    };
    idx.apply(1, vec![state(3), state(6)]).unwrap();
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 0.0), 1, Medium::Device),
        7
    );
    idx.apply(
        1,
        vec![IndexEvent::removed(4, vec![c[5]])
            .with_group(1, GroupKind::SlidingWindow { window: 9 })],
    )
    .unwrap();
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 0.0), 1, Medium::Device),
        4
    );
    // A pure sliding-window location (no full group) hits without the chain's head.
    idx.apply(2, vec![window(5, 8)]).unwrap();
    assert_eq!(
        blocks_on(&idx.lookup_chain(&c, 4, 0.0), 2, Medium::Device),
        8
    );
    idx.check().unwrap();
}

#[test]
fn the_memory_bound_evicts_chains_from_their_tails() {
    let idx = index(40);
    let hasher = BlockHasher::default();
    let mut model = Model::default();
    let mut chains = Vec::new();
    for r in 0..60u32 {
        // Requests share a 4-block system prompt, then 6 blocks of their own.
        let tokens: Vec<u32> = (0..16).chain((0..24).map(|i| 1000 * (r + 1) + i)).collect();
        let c = hasher.chain(&tokens, 4, None);
        let instance = u64::from(r % 3);
        let e = IndexEvent::stored(4, None, c.clone());
        model.apply(instance, &e);
        let report = idx.apply(instance, vec![e]).unwrap();
        assert!(idx.stats().entries <= 40);
        idx.check().unwrap();
        if r >= 10 {
            assert!(report.evicted > 0);
        }
        chains.push((instance, tokens));
        // The index never claims more than the model; the last request is whole (it is the
        // most recent chain, 10 entries under a bound of 40).
        for (instance, tokens) in &chains {
            let got = blocks_on(
                &idx.lookup_tokens(tokens, None, 0.0),
                *instance,
                Medium::Device,
            );
            let want = blocks_on(&model.lookup(tokens, 0.0), *instance, Medium::Device);
            assert!(got <= want);
        }
        assert_eq!(
            blocks_on(
                &idx.lookup_tokens(&chains.last().unwrap().1, None, 0.0),
                instance,
                Medium::Device
            ),
            10
        );
    }
    // Eviction took the tails: every instance still has the shared prefix (its parents are
    // newer than the leaves evicted), so the index stayed prefix-closed per location.
    for instance in 0..3 {
        let tokens: Vec<u32> = (0..16).collect();
        assert_eq!(
            blocks_on(
                &idx.lookup_tokens(&tokens, None, 0.0),
                instance,
                Medium::Device
            ),
            4
        );
    }
    // 3 * 4 shared + 60 * 6 own entries were stored, 40 stay.
    assert_eq!(
        idx.stats().counters.evicted_entries,
        3 * 4 + 60 * 6 - idx.stats().entries as u64
    );
    // Loading with a smaller bound evicts down to it.
    let small = KVIndex::load(&idx.dump(), Some(12)).unwrap();
    assert!(small.stats().entries <= 12);
    small.check().unwrap();
}

#[test]
fn bad_input_is_a_named_error_and_changes_nothing() {
    let idx = index(1000);
    let c = chain(0, 4);
    idx.apply(
        1,
        vec![IndexEvent::stored(4, None, c[..2].to_vec()).with_sequence(0)],
    )
    .unwrap();
    let before = idx.dump();
    let mut bad_tokens = IndexEvent::stored(4, Some(c[1]), vec![c[2]]).with_sequence(1);
    bad_tokens.token_ids = Some(vec![1, 2, 3]);
    let cases = [
        (IndexEvent::stored(0, None, vec![c[0]]), "block_size"),
        (bad_tokens, "token_ids"),
        (
            IndexEvent::stored(4, Some(c[0]), vec![c[0]]),
            "block_hashes",
        ),
        (
            IndexEvent::stored(4, None, vec![c[0]]).with_group(40, GroupKind::FullAttention),
            "group",
        ),
    ];
    for (bad, field) in cases {
        let good = IndexEvent::stored(4, Some(c[1]), vec![c[2]]).with_sequence(1);
        match idx.apply(1, vec![good, bad]) {
            Err(KvPoolError::InvalidArgument { name, .. }) => assert_eq!(name, field),
            other => panic!("{other:?}"),
        }
        assert_eq!(idx.dump(), before, "a failed batch applied nothing");
    }
    // 31 groups fit a location; a batch bringing the 32nd fails whole.
    let many: Vec<IndexEvent> = (0..31)
        .map(|g| IndexEvent::stored(4, None, vec![c[0]]).with_group(g, GroupKind::FullAttention))
        .collect();
    idx.apply(9, many).unwrap();
    let before = idx.dump();
    let extra = IndexEvent::stored(4, None, vec![c[0]]).with_group(0, GroupKind::LinearState);
    assert!(idx.apply(9, vec![extra]).is_err());
    assert_eq!(idx.dump(), before);
    assert!(KVIndex::new(IndexConfig {
        max_entries: 0,
        ..IndexConfig::default()
    })
    .is_err());
    idx.check().unwrap();
}

#[test]
fn dump_load_round_trip_and_corrupt_dumps_are_errors() {
    let idx = index(1000);
    for doc in 0..3 {
        let mut e = IndexEvent::stored(4, None, chain(doc, 4))
            .with_sequence(doc as u64)
            .with_dp_rank(1)
            .with_group(1, GroupKind::SlidingWindow { window: 16 });
        e.extra_key = Some(b"x".to_vec().into());
        idx.apply(
            doc as u64,
            vec![e, IndexEvent::stored(4, None, chain(doc, 4))],
        )
        .unwrap();
    }
    idx.insert_speculative(9, 0, 4, chain(1, 4), 1.0, 2.0)
        .unwrap();
    idx.apply(
        0,
        vec![IndexEvent::stored(4, None, vec![]).with_sequence(9)],
    )
    .unwrap(); // a gap
    let dump = idx.dump();
    let loaded = KVIndex::load(&dump, None).unwrap();
    loaded.check().unwrap();
    assert_eq!(loaded.dump(), dump);
    assert_eq!(loaded.sources(), idx.sources());
    assert_eq!(loaded.stats(), idx.stats());
    for doc in 0..3 {
        assert_eq!(
            sorted(loaded.lookup_tokens(&document(doc), None, 1.5)),
            sorted(idx.lookup_tokens(&document(doc), None, 1.5))
        );
    }
    // Every truncation and many single-byte flips are refused, never a panic.
    for cut in 0..dump.len() {
        assert!(KVIndex::load(&dump[..cut], None).is_err(), "cut at {cut}");
    }
    for at in (0..dump.len()).step_by(7) {
        let mut bad = dump.clone();
        bad[at] ^= 0x5a;
        assert!(KVIndex::load(&bad, None).is_err(), "flip at {at}");
    }
}

// ----------------------------------------------------------------------------- concurrency

/// Readers query while the writer applies batches; each write moves one instance's chain
/// length through a removal or a store plus churn of the chain's head (dropped and restored in
/// the same batch). Every answer must be exactly the state after some whole write, and no
/// reader may see an older state after a newer one.
#[test]
fn readers_never_see_a_torn_or_older_state() {
    const INSTANCES: usize = 6;
    const WRITES: usize = 1800;
    let tokens: Vec<u32> = (0..4 * 320).collect();
    let c = BlockHasher::default().chain(&tokens, 4, None);
    // Write k moves instance k % 6; instance 0 grows by one block a round (a clock), the
    // others take another length each time: so every state after a write is distinct.
    let mut lens = [1usize; INSTANCES];
    let mut writes = Vec::new();
    let mut states: HashMap<Vec<u32>, usize> = HashMap::new();
    states.insert(lens.iter().map(|&l| l as u32).collect(), 0);
    for k in 1..WRITES {
        let i = k % INSTANCES;
        let mut next = if i == 0 {
            k / INSTANCES + 1
        } else {
            (k * 7 + i * 13) % 37 + 1
        };
        if next == lens[i] {
            next += 1;
        }
        writes.push((i, lens[i], next));
        lens[i] = next;
        let state: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        assert!(states.insert(state, k).is_none(), "states are distinct");
    }
    let idx = Arc::new(index(1 << 20));
    for i in 0..INSTANCES {
        idx.apply(i as u64, vec![IndexEvent::stored(4, None, c[..1].to_vec())])
            .unwrap();
    }
    let done = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (idx, done, c, states) = (idx.clone(), done.clone(), c.clone(), states.clone());
            std::thread::spawn(move || {
                let (mut last, mut reads) = (0usize, 0usize);
                // Relaxed: the flag only ends the loop; the index's own orderings are tested.
                while !done.load(Ordering::Relaxed) || reads < 100 {
                    let m = idx.lookup_chain(&c, 4, 0.0);
                    let mut seen = vec![0u32; INSTANCES];
                    for x in &m {
                        seen[x.instance as usize] = x.blocks;
                    }
                    let k = *states
                        .get(&seen)
                        .unwrap_or_else(|| panic!("torn answer {seen:?}"));
                    assert!(k >= last, "state {k} after state {last}");
                    last = k;
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    for (i, before, after) in writes {
        let mut batch = vec![
            IndexEvent::removed(4, vec![c[0]]),
            IndexEvent::stored(4, None, vec![c[0]]),
        ];
        if after < before {
            batch.push(IndexEvent::removed(4, c[after..before].to_vec()));
        } else {
            batch.push(IndexEvent::stored(
                4,
                Some(c[before - 1]),
                c[before..after].to_vec(),
            ));
        }
        idx.apply(i as u64, batch).unwrap();
    }
    done.store(true, Ordering::Relaxed);
    for r in readers {
        assert!(r.join().unwrap() >= 100);
    }
    idx.check().unwrap();
}

// ---------------------------------------------------------------- groups and depths (item 4)

/// A hybrid location (full attention and a linear state) announced up front is credited
/// nothing before its first checkpoint, where the same stores without the announcement make a
/// plain location credited with all of them (the over-credit); every row carries the depth a
/// hit restores and the KV depth.
#[test]
fn group_events_stop_over_credit_and_rows_carry_both_depths() {
    let idx = index(1000);
    let c = chain(0, 4);
    let linear = |i: usize| {
        IndexEvent::stored(4, Some(c[i - 1]), vec![c[i]]).with_group(1, GroupKind::LinearState)
    };
    let full = IndexEvent::stored(4, None, c[..8].to_vec());
    // Instance 1 announces its groups; instance 2 sends the same stores without.
    let groups = vec![
        announce(4, 0, Medium::Device, 0, GroupKind::FullAttention),
        announce(4, 0, Medium::Device, 1, GroupKind::LinearState),
    ];
    idx.apply(
        1,
        groups
            .iter()
            .cloned()
            .chain([full.clone()])
            .collect::<Vec<_>>(),
    )
    .unwrap();
    idx.apply(2, vec![full.clone()]).unwrap();
    let row = |m: &[Match], instance: u64| {
        m.iter()
            .find(|m| m.instance == instance)
            .map(|m| (m.blocks, m.kv_blocks))
    };
    let m = idx.lookup_chain(&c, 4, 0.0);
    assert_eq!(
        row(&m, 2),
        Some((8, 8)),
        "a plain location: both depths are its run"
    );
    assert_eq!(
        row(&m, 1),
        Some((0, 8)),
        "no checkpoint yet: nothing restorable, the KV is there"
    );
    // Checkpoints after blocks 3 and 5: a hit restores 6 blocks, the KV goes to 8.
    idx.apply(1, vec![linear(3), linear(5)]).unwrap();
    let m = idx.lookup_chain(&c, 4, 0.0);
    assert_eq!(row(&m, 1), Some((6, 8)));
    // The compact answer carries the same depths.
    let snapshot = idx.snapshot();
    let mut compact = kvpool::Matches::new();
    snapshot.lookup_into(&c, 4, 0.0, &mut compact);
    let rows: Vec<Match> = compact
        .iter()
        .filter_map(|r| snapshot.to_match(r))
        .collect();
    assert_eq!(sorted(rows), sorted(m));
    // Announcing again changes nothing but the count of events applied; the groups stay
    // through a clear and a dump. (The dump without its header, 84 bytes up to and with the
    // 7 counters, and its checksum, 8: see dump.rs.)
    let state = |d: &[u8]| d[84..d.len() - 8].to_vec();
    let (before, applied) = (idx.dump(), idx.stats().counters.events_applied);
    idx.apply(1, groups.clone()).unwrap();
    assert_eq!(state(&idx.dump()), state(&before));
    assert_eq!(idx.stats().counters.events_applied, applied + 2);
    idx.apply(1, vec![IndexEvent::cleared(4)]).unwrap();
    idx.apply(1, vec![full.clone()]).unwrap();
    let loaded = KVIndex::load(&idx.dump(), None).unwrap();
    assert_eq!(
        row(&loaded.lookup_chain(&c, 4, 0.0), 1),
        Some((0, 8)),
        "after the clear the checkpoints are gone, the groups are not"
    );
    // A "group" event carries no blocks and no parent; a batch holding one is refused whole.
    let mut bad = announce(4, 0, Medium::Device, 2, GroupKind::LinearState);
    bad.block_hashes = vec![c[0]];
    match idx.apply(1, vec![full.clone(), bad]) {
        Err(KvPoolError::InvalidArgument { name, .. }) => assert_eq!(name, "block_hashes"),
        other => panic!("{other:?}"),
    }
    let mut bad = announce(4, 0, Medium::Device, 2, GroupKind::LinearState);
    bad.parent_hash = Some(c[0]);
    assert!(idx.apply(1, vec![bad]).is_err());
    // A location whose only group is a linear state: its depth is the checkpoint's.
    idx.apply(3, vec![linear(4)]).unwrap();
    assert_eq!(row(&idx.lookup_chain(&c, 4, 0.0), 3), Some((5, 5)));
    idx.check().unwrap();
}

// --------------------------------------------------------------------- several writers (item 3)

/// An index of three writers dumps version 2 (one image per shard) and loads back with its
/// writers, the same answers, sources and stats; an index of one writer still dumps version 1;
/// truncated, corrupt or other-version images are refused.
#[test]
fn dumps_of_several_writers_round_trip() {
    let idx = index_of(1000, 3);
    assert_eq!(idx.config().writers, 3);
    let mut shards = BTreeSet::new();
    for instance in 0..12u64 {
        shards.insert(idx.writer_of(instance));
        let doc = instance as usize % 3;
        idx.apply(
            instance,
            vec![IndexEvent::stored(
                4,
                None,
                chain(doc, 4)[..(instance as usize % 7) + 1].to_vec(),
            )
            .with_sequence(instance)],
        )
        .unwrap();
    }
    assert_eq!(shards.len(), 3, "twelve instances over every writer");
    idx.insert_speculative(20, 0, 4, chain(1, 4), 1.0, 2.0)
        .unwrap();
    let dump = idx.dump();
    assert_eq!(&dump[8..12], &2u32.to_le_bytes(), "version 2");
    let loaded = KVIndex::load(&dump, None).unwrap();
    loaded.check().unwrap();
    assert_eq!(loaded.config(), idx.config());
    assert_eq!(loaded.dump(), dump);
    assert_eq!(loaded.sources(), idx.sources());
    assert_eq!(loaded.stats(), idx.stats());
    for doc in 0..3 {
        assert_eq!(
            sorted(loaded.lookup_tokens(&document(doc), None, 1.5)),
            sorted(idx.lookup_tokens(&document(doc), None, 1.5))
        );
    }
    // A smaller bound is split among the writers.
    let small = KVIndex::load(&dump, Some(9)).unwrap();
    small.check().unwrap();
    assert!(small.stats().entries <= 9 && small.config().max_entries == 9);
    assert!(
        KVIndex::load(&dump, Some(2)).is_err(),
        "fewer entries than writers"
    );
    for cut in (0..dump.len()).step_by(3) {
        assert!(KVIndex::load(&dump[..cut], None).is_err(), "cut at {cut}");
    }
    for at in (0..dump.len()).step_by(5) {
        let mut bad = dump.clone();
        bad[at] ^= 0x5a;
        assert!(KVIndex::load(&bad, None).is_err(), "flip at {at}");
    }
    let mut other = dump.clone();
    other[8..12].copy_from_slice(&3u32.to_le_bytes());
    match KVIndex::load(&other, None) {
        Err(KvPoolError::InvalidArgument { message, .. }) => {
            assert!(message.contains("version 3"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    let one = index(1000);
    one.apply(1, vec![IndexEvent::stored(4, None, chain(0, 4))])
        .unwrap();
    assert_eq!(
        &one.dump()[8..12],
        &1u32.to_le_bytes(),
        "one writer: version 1"
    );
    assert_eq!(
        KVIndex::load(&one.dump(), None).unwrap().config().writers,
        1
    );
    assert!(KVIndex::new(IndexConfig {
        writers: 0,
        ..IndexConfig::default()
    })
    .is_err());
    assert!(KVIndex::new(IndexConfig {
        writers: 4,
        max_entries: 3,
        ..IndexConfig::default()
    })
    .is_err());
}

/// One instance's events in a threaded run: stores, removals, clears and announcements.
#[derive(Clone, Debug)]
enum InstanceOp {
    Store {
        doc: usize,
        start: usize,
        len: usize,
        group: usize,
    },
    Remove {
        doc: usize,
        blocks: u8,
        group: usize,
    },
    Clear,
    Announce {
        group: usize,
    },
}

fn instance_op() -> impl Strategy<Value = InstanceOp> {
    prop_oneof![
        6 => (0usize..3, 0usize..8, 1usize..9, prop_oneof![4 => Just(0usize), 1 => 1usize..3])
            .prop_map(|(doc, start, len, group)| InstanceOp::Store { doc, start, len, group }),
        3 => (0usize..3, any::<u8>(), prop_oneof![4 => Just(0usize), 1 => 1usize..3])
            .prop_map(|(doc, blocks, group)| InstanceOp::Remove { doc, blocks, group }),
        1 => Just(InstanceOp::Clear),
        1 => (0usize..3).prop_map(|group| InstanceOp::Announce { group }),
    ]
}

fn instance_event(op: &InstanceOp, sequence: u64) -> IndexEvent {
    let e = match *op {
        InstanceOp::Store {
            doc,
            start,
            len,
            group,
        } => {
            let c = chain(doc, 4);
            let start = start.min(c.len() - 1);
            let end = (start + len).min(c.len());
            let (g, kind) = GROUPS[group];
            IndexEvent::stored(
                4,
                start.checked_sub(1).map(|i| c[i]),
                c[start..end].to_vec(),
            )
            .with_group(g, kind)
        }
        InstanceOp::Remove { doc, blocks, group } => {
            let c = chain(doc, 4);
            let (g, kind) = GROUPS[group];
            let hashes = (0..c.len())
                .filter(|i| blocks >> i & 1 != 0)
                .map(|i| c[i])
                .collect();
            IndexEvent::removed(4, hashes).with_group(g, kind)
        }
        InstanceOp::Clear => IndexEvent::cleared(4),
        InstanceOp::Announce { group } => {
            let (g, kind) = GROUPS[group];
            announce(4, 0, Medium::Device, g, kind)
        }
    };
    e.with_sequence(sequence)
}

/// The rows of `instance` among `matches`, sorted.
fn rows_of(matches: &[Match], instance: u64) -> Vec<Match> {
    sorted(
        matches
            .iter()
            .filter(|m| m.instance == instance)
            .copied()
            .collect(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    /// Several writer threads, each applying the batches of the instances of its writers (sticky,
    /// as `writer_of` says) while two readers look up: every answer a reader sees for an
    /// instance is that instance's state after some prefix of its batches, never an older one
    /// after a newer one, and the index ends as the model does (instances are independent in
    /// the model, so any interleaving of different instances' batches ends the same). With
    /// `shared`, one thread more than writers takes instances round robin instead, so that
    /// threads also take turns on one writer (its lock).
    #[test]
    fn threaded_writers_match_the_model(
        streams in proptest::collection::vec(proptest::collection::vec(instance_op(), 1..14), 6),
        writers in 2usize..4,
        shared in any::<bool>(),
    ) {
        let instances = streams.len() as u64;
        // Each instance's expected rows for each document after each of its batches.
        let mut expected: Vec<Vec<Vec<Vec<Match>>>> = Vec::new();
        for (i, ops) in streams.iter().enumerate() {
            let mut model = Model::default();
            let states = |model: &Model| -> Vec<Vec<Match>> {
                (0..3).map(|doc| rows_of(&model.lookup(&document(doc), 0.0), i as u64)).collect()
            };
            let mut mine = vec![states(&model)];
            for (k, op) in ops.iter().enumerate() {
                model.apply(i as u64, &instance_event(op, k as u64));
                mine.push(states(&model));
            }
            expected.push(mine);
        }
        let idx = Arc::new(index_of(1 << 20, writers));
        let expected = Arc::new(expected);
        let done = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (idx, done, expected) = (idx.clone(), done.clone(), expected.clone());
                std::thread::spawn(move || -> Result<usize, String> {
                    let mut last = vec![0usize; instances as usize];
                    let mut reads = 0;
                    // Relaxed: the flag only ends the loop; the index's own orderings are tested.
                    while !done.load(Ordering::Relaxed) || reads < 20 {
                        let snapshot = idx.snapshot();
                        let answers: Vec<Vec<Match>> = (0..3)
                            .map(|doc| snapshot.lookup_tokens(&document(doc), None, 0.0))
                            .collect();
                        for i in 0..instances as usize {
                            let seen: Vec<Vec<Match>> =
                                answers.iter().map(|a| rows_of(a, i as u64)).collect();
                            let k = (last[i]..expected[i].len())
                                .find(|&k| expected[i][k] == seen)
                                .ok_or_else(|| format!("instance {i}: {seen:?} is no state from {}", last[i]))?;
                            last[i] = k;
                        }
                        reads += 1;
                    }
                    Ok(reads)
                })
            })
            .collect();
        let streams = Arc::new(streams);
        let threads = writers + usize::from(shared);
        let writers_threads: Vec<_> = (0..threads)
            .map(|t| {
                let (idx, streams) = (idx.clone(), streams.clone());
                std::thread::spawn(move || {
                    let mine: Vec<u64> = (0..instances)
                        .filter(|&i| {
                            if shared {
                                i as usize % threads == t
                            } else {
                                idx.writer_of(i) == t
                            }
                        })
                        .collect();
                    let longest = mine.iter().map(|&i| streams[i as usize].len()).max().unwrap_or(0);
                    for k in 0..longest {
                        for &i in &mine {
                            if let Some(op) = streams[i as usize].get(k) {
                                idx.apply(i, vec![instance_event(op, k as u64)]).unwrap();
                            }
                        }
                    }
                })
            })
            .collect();
        for w in writers_threads {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        for r in readers {
            let reads = r.join().unwrap().map_err(TestCaseError::fail)?;
            prop_assert!(reads >= 20);
        }
        idx.check().map_err(|e| TestCaseError::fail(e.to_string()))?;
        for i in 0..instances as usize {
            let end: Vec<Vec<Match>> = (0..3)
                .map(|doc| rows_of(&idx.lookup_tokens(&document(doc), None, 0.0), i as u64))
                .collect();
            prop_assert_eq!(&end, expected[i].last().unwrap(), "instance {}", i);
        }
    }
}
