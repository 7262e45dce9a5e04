//! The index's dump: a compact, versioned binary image for a warm restart.
//!
//! Layout (little-endian integers; version 1):
//!
//! ```text
//! magic "KVPIDX\0\0" | version u32 | hash_seed u64 | max_entries u64 | 7 counters u64
//! locations u32, each: instance u64 | dp_rank u32 | medium u8 | block_size u32 | groups u8,
//!     each group: index u32 | kind u8 (0 full, 1 sliding window, 2 linear) | window u32
//! sources u32, each: instance u64 | dp_rank u32 | last u64 | stalled u8 | stalled_at u64
//! nodes u32, oldest first (LRU order, then the nodes kept only for their children), each:
//!     hash 16 bytes (big-endian, as BlockHash::to_bytes) | parent u8 (0 none: a chain's
//!     first block, 1 unknown, 2 known: then its position in this list u32) | entries u32,
//!     each: location u32 | mask u32 | expires f64 (only when the speculative bit is set)
//! checksum u64: XXH3-64 of every byte before it
//! ```
//!
//! An index of several writers (shards by instance) dumps version 2: magic | version u32 (2) |
//! shards u32, each: length u64 | that shard's version-1 image | checksum u64 (as above).
//!
//! Loading checks bounds, the checksum and every invariant of the state it rebuilds
//! (`IndexState::check`): a truncated, corrupt or foreign image is an `InvalidArgument` on
//! "data", never a panic. Equal states give equal dumps (node slots do not appear in it), which
//! `KVIndex::check` uses to compare the two copies.

use xxhash_rust::xxh3::xxh3_64;

use crate::error::{KvPoolError, Result};
use crate::index::event::{GroupKind, Medium, MAX_GROUPS};
use crate::index::expiry::Due;
use crate::index::location::LocationKey;
use crate::index::sequence::SourceState;
use crate::index::state::{IndexConfig, IndexCounters, IndexState};
use crate::index::tree::{Entry, Links, Tree, SPECULATIVE};

const MAGIC: &[u8; 8] = b"KVPIDX\0\0";
/// The version of one shard's image; a dump of another version is refused.
pub(crate) const VERSION: u32 = 1;
/// The version of a dump of several shards (writers): their images in order.
pub(crate) const VERSION_SHARDS: u32 = 2;
const NO_PARENT: u8 = 0;
const UNKNOWN_PARENT: u8 = 1;
const KNOWN_PARENT: u8 = 2;

/// The dump of `state`, `links` being its tree's.
pub(crate) fn encode(state: &IndexState, links: &Links) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + state.tree.entries * 8 + state.tree.len() * 25);
    out.extend_from_slice(MAGIC);
    put_u32(&mut out, VERSION);
    put_u64(&mut out, state.config.hash_seed);
    put_u64(&mut out, state.config.max_entries as u64);
    let c = &state.counters;
    for value in [
        c.events_applied,
        c.duplicates,
        c.dropped,
        c.gaps,
        c.evicted_entries,
        c.expired_entries,
        c.speculative_inserted,
    ] {
        put_u64(&mut out, value);
    }
    put_u32(&mut out, state.locations.len() as u32);
    for (_, location) in state.locations.iter() {
        put_u64(&mut out, location.key.instance);
        put_u32(&mut out, location.key.dp_rank);
        out.push(location.key.medium.code());
        put_u32(&mut out, location.key.block_size);
        out.push(location.groups.len() as u8);
        for &(index, kind) in &location.groups {
            put_u32(&mut out, index);
            out.push(kind.code());
            put_u32(&mut out, kind.window().unwrap_or(0));
        }
    }
    let sources = state.sources();
    put_u32(&mut out, sources.len() as u32);
    for source in sources {
        put_u64(&mut out, source.instance);
        put_u32(&mut out, source.dp_rank);
        put_u64(&mut out, source.last);
        out.push(u8::from(source.stalled.is_some()));
        put_u64(&mut out, source.stalled.unwrap_or(0));
    }
    let order = links.ids_in_order(&state.tree);
    let mut position = vec![u32::MAX; order.iter().map(|&id| id as usize + 1).max().unwrap_or(0)];
    for (i, &id) in order.iter().enumerate() {
        position[id as usize] = i as u32;
    }
    put_u32(&mut out, order.len() as u32);
    for &id in &order {
        out.extend_from_slice(&state.tree.rec(id).hash().to_be_bytes());
        match links.parent(id) {
            None => out.push(UNKNOWN_PARENT),
            Some(None) => out.push(NO_PARENT),
            Some(Some(parent)) => {
                out.push(KNOWN_PARENT);
                put_u32(&mut out, position[parent as usize]);
            }
        }
        let entries = state.tree.entries_of(id);
        put_u32(&mut out, entries.len() as u32);
        for entry in &entries {
            put_u32(&mut out, entry.location);
            put_u32(&mut out, entry.mask);
            if entry.mask & SPECULATIVE != 0 {
                out.extend_from_slice(&entry.expires.to_le_bytes());
            }
        }
    }
    let checksum = xxh3_64(&out);
    put_u64(&mut out, checksum);
    out
}

/// The dump of an index of several shards (version 2): magic, version, the number of shards,
/// each shard's version-1 image (its length u64, then the image), the checksum.
pub(crate) fn encode_shards(images: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + images.iter().map(|i| i.len() + 8).sum::<usize>());
    out.extend_from_slice(MAGIC);
    put_u32(&mut out, VERSION_SHARDS);
    put_u32(&mut out, images.len() as u32);
    for image in images {
        put_u64(&mut out, image.len() as u64);
        out.extend_from_slice(image);
    }
    let checksum = xxh3_64(&out);
    put_u64(&mut out, checksum);
    out
}

/// The shards' images of a dump: itself for version 1, the images of version 2 (checked for
/// framing and checksum here; each image is checked when decoded).
pub(crate) fn decode_shards(data: &[u8]) -> Result<Vec<&[u8]>> {
    if data.len() < MAGIC.len() + 4 + 8 || &data[..MAGIC.len()] != MAGIC {
        return Err(bad("not a kvpool index dump"));
    }
    let mut r = Reader {
        data,
        at: MAGIC.len(),
    };
    match r.u32()? {
        VERSION => return Ok(vec![data]),
        VERSION_SHARDS => {}
        version => {
            return Err(bad(format!(
                "dump version {version}, this kvpool reads versions {VERSION} and {VERSION_SHARDS}"
            )))
        }
    }
    let (body, tail) = data.split_at(data.len() - 8);
    let mut checksum = [0u8; 8];
    checksum.copy_from_slice(tail);
    if xxh3_64(body) != u64::from_le_bytes(checksum) {
        return Err(bad("checksum mismatch (corrupt or truncated)"));
    }
    let mut r = Reader {
        data: body,
        at: MAGIC.len() + 4,
    };
    let shards = r.count(8)?;
    if !(2..=crate::index::MAX_WRITERS).contains(&shards) {
        return Err(bad(format!("{shards} shards")));
    }
    let mut images = Vec::with_capacity(shards);
    for _ in 0..shards {
        let len = usize::try_from(r.u64()?).map_err(|_| bad("image too large"))?;
        images.push(r.take(len)?);
    }
    if r.at != body.len() {
        return Err(bad(format!("{} trailing bytes", body.len() - r.at)));
    }
    Ok(images)
}

fn put_u32(out: &mut Vec<u8>, value: u32) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn bad(message: impl Into<String>) -> KvPoolError {
    KvPoolError::invalid("data", message)
}

/// A bounds-checked reader over the dump's bytes.
struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.data.len())
            .ok_or_else(|| bad(format!("truncated at byte {}", self.at)))?;
        let bytes = &self.data[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of records of at least `min_size` bytes each, checked against what is left.
    fn count(&mut self, min_size: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_size) > self.data.len() - self.at {
            return Err(bad(format!("{n} records cannot fit in what is left")));
        }
        Ok(n)
    }
}

/// The state a dump holds, with its tree's links.
pub(crate) fn decode(data: &[u8]) -> Result<(IndexState, Links)> {
    if data.len() < MAGIC.len() + 4 + 8 || &data[..MAGIC.len()] != MAGIC {
        return Err(bad("not a kvpool index dump"));
    }
    let (body, tail) = data.split_at(data.len() - 8);
    let mut checksum = [0u8; 8];
    checksum.copy_from_slice(tail);
    if xxh3_64(body) != u64::from_le_bytes(checksum) {
        return Err(bad("checksum mismatch (corrupt or truncated)"));
    }
    let mut r = Reader {
        data: body,
        at: MAGIC.len(),
    };
    let version = r.u32()?;
    if version != VERSION {
        return Err(bad(format!(
            "dump version {version}, this kvpool reads versions {VERSION} and {VERSION_SHARDS}"
        )));
    }
    let hash_seed = r.u64()?;
    let max_entries = usize::try_from(r.u64()?).map_err(|_| bad("max_entries too large"))?;
    let mut state = IndexState::new(IndexConfig {
        max_entries,
        hash_seed,
        writers: 1,
    })
    .map_err(|e| bad(e.to_string()))?;
    let mut counters = [0u64; 7];
    for value in &mut counters {
        *value = r.u64()?;
    }
    let [events_applied, duplicates, dropped, gaps, evicted_entries, expired_entries, speculative_inserted] =
        counters;
    state.counters = IndexCounters {
        events_applied,
        duplicates,
        dropped,
        gaps,
        evicted_entries,
        expired_entries,
        speculative_inserted,
    };
    for _ in 0..r.count(18)? {
        let key = LocationKey {
            instance: r.u64()?,
            dp_rank: r.u32()?,
            medium: Medium::from_code(r.u8()?).ok_or_else(|| bad("unknown medium code"))?,
            block_size: r.u32()?,
        };
        if key.block_size == 0 || state.locations.find(&key).is_some() {
            return Err(bad(format!("bad or repeated location {key:?}")));
        }
        let id = state.locations.register(key);
        let groups = r.u8()?;
        if u32::from(groups) > MAX_GROUPS {
            return Err(bad(format!("{groups} groups at one location")));
        }
        for _ in 0..groups {
            let index = r.u32()?;
            let code = r.u8()?;
            let window = r.u32()?;
            let kind = GroupKind::from_code(code, window)
                .filter(|k| k.window() != Some(0) && index < MAX_GROUPS)
                .ok_or_else(|| bad("bad group"))?;
            if state.locations.group_bit(id, index, kind).is_some() {
                return Err(bad("repeated group"));
            }
            state
                .locations
                .add_group(id, index, kind)
                .map_err(|e| bad(e.to_string()))?;
        }
    }
    for _ in 0..r.count(25)? {
        let instance = r.u64()?;
        let dp_rank = r.u32()?;
        let last = r.u64()?;
        let stalled = r.u8()?;
        let stalled_at = r.u64()?;
        state.sources.restore(SourceState {
            instance,
            dp_rank,
            last,
            stalled: (stalled != 0).then_some(stalled_at),
        });
    }
    let n = r.count(21)?;
    let mut nodes = Vec::with_capacity(n);
    for _ in 0..n {
        let hash = u128::from_be_bytes(r.array()?);
        let parent = match r.u8()? {
            NO_PARENT => Some(None),
            UNKNOWN_PARENT => None,
            KNOWN_PARENT => {
                let at = r.u32()?;
                if at as usize >= n {
                    return Err(bad("parent out of range"));
                }
                Some(Some(at))
            }
            _ => return Err(bad("bad parent tag")),
        };
        let mut entries = Vec::new();
        for _ in 0..r.count(8)? {
            let location = r.u32()?;
            let mask = r.u32()?;
            let expires = if mask & SPECULATIVE != 0 {
                f64::from_le_bytes(r.array()?)
            } else {
                0.0
            };
            if mask & SPECULATIVE != 0 && !expires.is_finite() {
                return Err(bad("a speculative entry without a finite expiry"));
            }
            entries.push(Entry {
                location,
                mask,
                expires,
            });
        }
        nodes.push((hash, parent, entries));
    }
    if r.at != body.len() {
        return Err(bad(format!("{} trailing bytes", body.len() - r.at)));
    }
    let (tree, links) =
        Tree::restore(nodes, state.locations.width()).map_err(|e| bad(e.to_string()))?;
    state.tree = tree;
    let live: Vec<Due> = state.speculative_due();
    state.expiry.rebuild(live);
    state.check(&links).map_err(|e| bad(e.to_string()))?;
    Ok((state, links))
}
