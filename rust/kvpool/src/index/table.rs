//! The hash table (block hash -> node id) that both copies of an index share.
//!
//! Both copies of [`crate::KVIndex`] give a block the same node id (their writes are
//! deterministic and replayed in order), so one table serves them: the writer inserts a
//! node's id once, in the copy it writes first, and the replay on the other copy inserts
//! nothing. The table is a hint, never the truth: a probe returns only an id that the caller's
//! own copy confirms (the node there is live and has that hash), so an entry of a node that
//! only the newer copy holds, or one that no copy holds any more, is harmless.
//!
//! Open addressing with linear probing over one `AtomicU64` per slot: `0` is empty, `1` a
//! tombstone, anything else `tag << 32 | id` (the tag: 32 bits mixed from the hash, its low bit
//! set so that no entry is 0 or 1). Readers probe while the writer stores; no slot on an
//! entry's probe path (from its home slot to it) is ever empty: a slot goes back to empty
//! only as a tombstone followed by an empty slot, which no path crosses. A probe ends at an
//! empty slot (the writer keeps at least a quarter of the slots empty, rebuilding into a new
//! table before) or after one lap.
//!
//! What makes the relaxed orderings enough (the invariant the writer keeps, see `mod.rs`): a
//! node's entry is stored before the copy holding the node is published (the `ArcSwap`
//! publication is a release, a reader's load an acquire), so a reader of that copy sees the
//! entry or a later value of its slot; the only later value is a tombstone (or empty), which
//! the writer stores only once no copy a reader can reach holds the node (deletions are
//! deferred until the other copy is level), and no slot on the path before it becomes empty. A table that has been replaced (grown, or rebuilt when
//! the writer abandoned a copy still held by a slow reader) is never written again: copies
//! keep the table they were published with until the writer brings them level.
//!
//! Invariants (checked by `check` of the tree): every live node of a copy is found here under
//! its hash; `used` counts the slots that are not empty, `entries` those holding an entry.

use crate::sync::{AtomicU64, AtomicUsize, Ordering};

const EMPTY: u64 = 0;
const TOMBSTONE: u64 = 1;
/// The fewest slots of a table.
const MIN_SLOTS: usize = 16;

/// The slot a hash probes first, and its tag (shifted into place): both from one folded
/// multiply of the hash's halves (each output bit depends on every input bit), the home from
/// its low bits, the tag from bits 32-63 (independent of the home for tables of up to 2^32
/// slots), so that hand-made hashes (small integers in tests, or halves that repeat) spread
/// too. The tag's low bit is set, so that no entry is 0 or 1.
#[inline]
fn home_and_tag(hash: u128) -> (usize, u64) {
    const MIX_LOW: u64 = 0x9E37_79B9_7F4A_7C15;
    const MIX_HIGH: u64 = 0xD6E8_FEB8_6659_FD93;
    let (low, high) = (hash as u64, (hash >> 64) as u64);
    let product = u128::from(low ^ MIX_LOW) * u128::from(high ^ MIX_HIGH);
    let mixed = (product as u64) ^ ((product >> 64) as u64);
    (mixed as usize, ((mixed >> 32) | 1) << 32)
}

/// Adds `delta` to one of the writer's own counts: a load and a store, not a locked
/// read-modify-write (no other thread writes it).
#[inline]
fn bump(count: &AtomicUsize, delta: isize) {
    // Relaxed: the writer's own count (see `Table::used`).
    let value = count.load(Ordering::Relaxed);
    count.store(value.wrapping_add_signed(delta), Ordering::Relaxed);
}

pub(crate) use crate::prefetch::prefetch;

/// Where an insert of a hash goes: the slot [`Table::probe`] found for it and the hash's tag
/// (computed once, for [`Table::insert_at`]).
#[derive(Clone, Copy)]
pub(crate) struct Vacant {
    slot: usize,
    tag: u64,
}

/// What [`Table::probe`] found.
pub(crate) enum Probe {
    Found(u32),
    Vacant(Vacant),
}

/// The table (see the module doc).
pub(crate) struct Table {
    slots: Box<[AtomicU64]>,
    mask: usize,
    /// Slots not empty (entries and tombstones), and slots holding an entry: the writer's own
    /// counts (atomics only so that the table can be shared; only the writer, under the
    /// writer's lock, touches them).
    used: AtomicUsize,
    entries: AtomicUsize,
}

impl Table {
    /// An empty table where `capacity` entries take at most half the slots.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let slots = (capacity.saturating_mul(2))
            .max(MIN_SLOTS)
            .checked_next_power_of_two()
            .unwrap_or(1 << (usize::BITS - 1));
        let slots: Box<[AtomicU64]> = (0..slots).map(|_| AtomicU64::new(EMPTY)).collect();
        Self {
            mask: slots.len() - 1,
            slots,
            used: AtomicUsize::new(0),
            entries: AtomicUsize::new(0),
        }
    }

    /// Entries held (live or not yet tombstoned).
    pub(crate) fn entries(&self) -> usize {
        // Relaxed: the writer's own count (see the field).
        self.entries.load(Ordering::Relaxed)
    }

    /// Bytes of the slots.
    pub(crate) fn bytes(&self) -> usize {
        self.slots.len() * 8
    }

    /// Whether `inserts` more would leave fewer than a quarter of the slots empty.
    #[inline]
    pub(crate) fn needs_room_for(&self, inserts: usize) -> bool {
        // Relaxed: the writer's own count.
        (self.used.load(Ordering::Relaxed) + inserts) * 4 > self.slots.len() * 3
    }

    /// The id stored for `hash` that `valid` confirms, if any. `valid` is the caller's copy
    /// saying whether node `id` is live there with this hash.
    #[inline]
    pub(crate) fn find(&self, hash: u128, valid: impl Fn(u32) -> bool) -> Option<u32> {
        let (home, tag) = home_and_tag(hash);
        let mut at = home & self.mask;
        for _ in 0..self.slots.len() {
            // Relaxed: see the module doc (entries a reader needs were stored before its copy
            // was published; a torn slot cannot exist, each is one atomic word).
            let value = self.slots[at].load(Ordering::Relaxed);
            if value == EMPTY {
                return None;
            }
            if value & !0xFFFF_FFFF == tag && valid(value as u32) {
                return Some(value as u32);
            }
            at = (at + 1) & self.mask;
        }
        None
    }

    /// Asks the cache for the first slot `hash` probes, so that the slots of a batch's blocks
    /// arrive together (their misses overlap) before the probes that depend on them.
    #[inline]
    pub(crate) fn prefetch(&self, hash: u128) {
        let (home, _) = home_and_tag(hash);
        prefetch(&self.slots[home & self.mask]);
    }

    /// The id of the first entry whose tag matches `hash`'s, unconfirmed: a hint (to ask the
    /// cache for that node ahead of the look-up that confirms it).
    #[inline]
    pub(crate) fn candidate(&self, hash: u128) -> Option<u32> {
        let (home, tag) = home_and_tag(hash);
        let mut at = home & self.mask;
        for _ in 0..4 {
            // Relaxed: a hint; nothing is concluded from it.
            let value = self.slots[at].load(Ordering::Relaxed);
            if value == EMPTY {
                return None;
            }
            if value & !0xFFFF_FFFF == tag {
                return Some(value as u32);
            }
            at = (at + 1) & self.mask;
        }
        None
    }

    /// Where `hash` is: its confirmed id, or else the slot an insert would take (the first
    /// tombstone or empty slot of its probe path). The writer only.
    #[inline]
    pub(crate) fn probe(&self, hash: u128, valid: impl Fn(u32) -> bool) -> Probe {
        let (home, tag) = home_and_tag(hash);
        let mut at = home & self.mask;
        let mut vacant = None;
        loop {
            // Relaxed: only the writer stores, so it reads its own latest values.
            let value = self.slots[at].load(Ordering::Relaxed);
            if value == EMPTY {
                return Probe::Vacant(Vacant {
                    slot: vacant.unwrap_or(at),
                    tag,
                });
            }
            if value == TOMBSTONE {
                vacant.get_or_insert(at);
            } else if value & !0xFFFF_FFFF == tag && valid(value as u32) {
                return Probe::Found(value as u32);
            }
            at = (at + 1) & self.mask;
        }
    }

    /// Stores `id` where [`Table::probe`] said its hash goes (the writer only, with no store
    /// in between; room was made with `needs_room_for` before the probe).
    #[inline]
    pub(crate) fn insert_at(&self, vacant: Vacant, id: u32) {
        let Vacant { slot, tag } = vacant;
        // Relaxed: the writer reads its own stores.
        let was = self.slots[slot].load(Ordering::Relaxed);
        // Relaxed: readers of the copy holding this node load that copy after its
        // publication (a release), which comes after this store.
        self.slots[slot].store(tag | u64::from(id), Ordering::Relaxed);
        if was == EMPTY {
            bump(&self.used, 1);
        }
        bump(&self.entries, 1);
    }

    /// Stores `hash -> id` (the writer only; the caller made room with `needs_room_for` first and
    /// knows no confirmed entry of `hash` exists).
    pub(crate) fn insert(&self, hash: u128, id: u32) {
        if let Probe::Vacant(vacant) = self.probe(hash, |_| false) {
            self.insert_at(vacant, id);
        }
    }

    /// Drops the entry `hash -> id`, if present, unless `keep(id)` (the node there is live with
    /// this hash again): the writer only, once no copy a reader can reach holds the node. The
    /// slot becomes a tombstone, or empty when the next slot is empty (then so do the
    /// tombstones right before it): no entry's probe path crosses an empty slot, as none can
    /// cross the next one. Returns whether it was dropped.
    pub(crate) fn remove(&self, hash: u128, id: u32, keep: impl Fn(u32) -> bool) -> bool {
        let (home, tag) = home_and_tag(hash);
        let want = tag | u64::from(id);
        let mut at = home & self.mask;
        for _ in 0..self.slots.len() {
            // Relaxed: the writer reads its own stores.
            let value = self.slots[at].load(Ordering::Relaxed);
            if value == EMPTY {
                return false;
            }
            if value == want {
                if keep(id) {
                    return false;
                }
                // Relaxed: no reader can reach a copy that holds this node any more, so a
                // reader that sees the tombstone (or not) answers the same.
                self.slots[at].store(TOMBSTONE, Ordering::Relaxed);
                bump(&self.entries, -1);
                // Relaxed (every load and store below): the writer's own slots; a slot made
                // empty lies on no entry's probe path (see above), so readers of every copy
                // find what they found.
                if self.slots[(at + 1) & self.mask].load(Ordering::Relaxed) == EMPTY {
                    while self.slots[at].load(Ordering::Relaxed) == TOMBSTONE {
                        self.slots[at].store(EMPTY, Ordering::Relaxed);
                        bump(&self.used, -1);
                        at = at.wrapping_sub(1) & self.mask;
                    }
                }
                return true;
            }
            at = (at + 1) & self.mask;
        }
        false
    }

    /// A new table holding `live` (hash, id) pairs, with room for `capacity` entries.
    pub(crate) fn rebuilt(live: impl Iterator<Item = (u128, u32)>, capacity: usize) -> Self {
        let table = Self::with_capacity(capacity);
        for (hash, id) in live {
            table.insert(hash, id);
        }
        table
    }
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Table(slots={}, entries={})",
            self.slots.len(),
            self.entries()
        )
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn insert_find_remove_and_tombstones_are_reused() {
        let t = Table::with_capacity(4);
        let (a, b) = (5u128, 5u128 | (1 << 64));
        t.insert(a, 1);
        t.insert(b, 2);
        assert_eq!(t.find(a, |id| id == 1), Some(1));
        assert_eq!(t.find(b, |id| id == 2), Some(2));
        assert_eq!(t.find(a, |_| false), None, "an unconfirmed id is no answer");
        assert_eq!(t.find(a, |id| id == 2), None, "nor another hash's id");
        assert!(!t.remove(a, 1, |_| true), "a live node keeps its entry");
        assert!(t.remove(a, 1, |_| false));
        assert!(!t.remove(a, 1, |_| false));
        assert_eq!(t.find(b, |id| id == 2), Some(2), "probes pass tombstones");
        t.insert(7, 3); // reuses the tombstone or an empty slot; either way found
        assert_eq!(t.find(7, |id| id == 3), Some(3));
        assert_eq!(t.entries(), 2);
        let r = Table::rebuilt([(a, 9), (b, 2)].into_iter(), 2);
        assert_eq!(r.find(a, |id| id == 9), Some(9));
        assert_eq!(r.entries(), 2);
        assert!(!Table::with_capacity(0).needs_room_for(1));
    }
}

/// loom model: `RUSTFLAGS="--cfg kvpool_loom" CARGO_TARGET_DIR=target/loom cargo test -p
/// kvpool --release --lib index::table`.
#[cfg(all(test, kvpool_loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicUsize as Version;
    use loom::sync::Arc;

    /// A writer inserts two nodes, publishes (a release store standing for the `ArcSwap`
    /// swap), tombstones an older node no published copy holds, inserts a third into slots on
    /// the same probe path and drops it again (its slot, the cluster's last, goes back to
    /// empty); a reader that loaded a version finds every node live at that version, whatever
    /// it sees of the later stores.
    #[test]
    fn a_published_node_is_always_found() {
        // Four hashes with the same home slot of a 16-slot table, so that every store lies
        // on every probe path.
        let home = |x: u128| home_and_tag(x).0 & (MIN_SLOTS - 1);
        let same: Vec<u128> = (0u128..).filter(|&x| home(x) == home(0)).take(4).collect();
        loom::model(move || {
            let h = [same[0], same[1], same[2], same[3]];
            let table = Arc::new(Table::with_capacity(4));
            table.insert(h[0], 0); // node 0: held by no copy any more (deleted, deferred)
            let version = Arc::new(Version::new(0));
            let (t, v) = (table.clone(), version.clone());
            let writer = loom::thread::spawn(move || {
                t.insert(h[1], 1);
                t.insert(h[2], 2);
                // Release: the publication of the copy holding nodes 1 and 2.
                v.store(1, Ordering::Release);
                t.remove(h[0], 0, |_| false);
                t.insert(h[3], 3);
                // Node 3 goes before any copy held it: its slot (last of the cluster) empties.
                t.remove(h[3], 3, |_| false);
            });
            // Acquire: loading the published copy.
            let seen = version.load(Ordering::Acquire);
            // Nodes live in the copy of version `seen` (node 3 is in no published copy).
            let live = |id: u32| seen == 1 && (id == 1 || id == 2);
            if seen == 1 {
                assert_eq!(table.find(h[1], |id| id == 1 && live(id)), Some(1));
                assert_eq!(table.find(h[2], |id| id == 2 && live(id)), Some(2));
            }
            assert_eq!(table.find(h[3], |id| id == 3 && live(id)), None);
            writer.join().unwrap();
        });
    }

    /// Two shards (an index of two writers), each a table and a published version written by
    /// its own writer thread at once: a node inserts, its copy publishes, a later node inserts
    /// and goes again before any copy held it. A reader loading one shard's version after the
    /// other's finds, in each, exactly the nodes published at the version it loaded there,
    /// whatever the other shard's writer does meanwhile (the shards share nothing).
    #[test]
    fn shards_publish_independently() {
        let home = |x: u128| home_and_tag(x).0 & (MIN_SLOTS - 1);
        let same: Vec<u128> = (0u128..).filter(|&x| home(x) == home(0)).take(2).collect();
        loom::model(move || {
            let shards: Vec<(Arc<Table>, Arc<Version>)> = (0..2)
                .map(|_| (Arc::new(Table::with_capacity(4)), Arc::new(Version::new(0))))
                .collect();
            let writers: Vec<_> = shards
                .iter()
                .map(|(t, v)| {
                    let (t, v, h) = (t.clone(), v.clone(), [same[0], same[1]]);
                    loom::thread::spawn(move || {
                        t.insert(h[0], 0);
                        // Release: the publication of the copy holding node 0.
                        v.store(1, Ordering::Release);
                        t.insert(h[1], 1);
                        t.remove(h[1], 1, |_| false);
                    })
                })
                .collect();
            for (table, version) in &shards {
                // Acquire: loading this shard's published copy.
                let seen = version.load(Ordering::Acquire);
                let live = |id: u32| seen == 1 && id == 0;
                assert_eq!(
                    table.find(same[0], |id| id == 0 && live(id)),
                    (seen == 1).then_some(0)
                );
                assert_eq!(table.find(same[1], |id| id == 1 && live(id)), None);
            }
            for w in writers {
                w.join().unwrap();
            }
        });
    }
}
