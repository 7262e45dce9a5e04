//! A node's holders: the set of location ids whose entry at that node is exactly group bit 0
//! (the one full-attention group of a plain location; see `tree.rs` for the other entries).
//!
//! A small set is a sorted array (inline up to [`INLINE`] ids, else in the tree's [`Sets`]);
//! a large one a bitset over location ids (in [`Sets`] too), so that a lookup intersects it
//! with the locations still matching a word at a time. A set becomes a bitset when its array
//! would take more bytes than the bitset of every known location (more than `2 * width` ids,
//! `width` being the bitset's words), and an array again when it shrinks to `width / 2` ids:
//! the form depends only on the operations, so two copies given the same ones agree. The set
//! itself is plain data (16 bytes, `Copy`), so that a node copies with a `memcpy`; the arrays
//! and bitsets it names live in [`Sets`], whose slots are reused.
//!
//! Invariants (checked by [`Holders::check`]): arrays are sorted without duplicates and `len`
//! counts them; a bitset's `len` is its popcount; a set of at most [`INLINE`] ids is inline;
//! [`Sets`] slots are named by exactly one set or free.

/// Ids kept inline.
pub(crate) const INLINE: usize = 3;

#[derive(Clone, Copy, Debug)]
pub(crate) enum Holders {
    Inline {
        len: u32,
        ids: [u32; INLINE],
    },
    /// Sorted ids in `Sets::lists[at]`.
    List {
        len: u32,
        at: u32,
    },
    /// A bitset in `Sets::bits[at]`.
    Bits {
        len: u32,
        at: u32,
    },
}

/// A read-only view for lookups.
pub(crate) enum View<'a> {
    Sorted(&'a [u32]),
    Bits(&'a [u64]),
}

/// The arrays and bitsets of the sets too large to be inline, by slot.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sets {
    pub lists: Vec<Vec<u32>>,
    pub bits: Vec<Vec<u64>>,
    pub free_lists: Vec<u32>,
    pub free_bits: Vec<u32>,
}

/// A slot of the slab `slots` for a new set: the last one freed (its vector keeps its
/// capacity; the caller clears it), or a new one at the end.
fn take_slot<T>(slots: &mut Vec<Vec<T>>, free: &mut Vec<u32>) -> u32 {
    free.pop().unwrap_or_else(|| {
        slots.push(Vec::new());
        (slots.len() - 1) as u32
    })
}

impl Sets {
    fn new_list(&mut self, ids: &[u32]) -> u32 {
        let at = take_slot(&mut self.lists, &mut self.free_lists);
        let list = &mut self.lists[at as usize];
        list.clear();
        list.extend_from_slice(ids);
        at
    }

    fn new_bits(&mut self, words: usize) -> u32 {
        let at = take_slot(&mut self.bits, &mut self.free_bits);
        let bits = &mut self.bits[at as usize];
        bits.clear();
        bits.resize(words, 0);
        at
    }

    /// Makes slot `at` of `source` (another copy's) this copy's too.
    pub(crate) fn copy_list(&mut self, source: &Sets, at: u32) {
        let at = at as usize;
        if self.lists.len() <= at {
            self.lists.resize_with(at + 1, Vec::new);
        }
        self.lists[at].clone_from(&source.lists[at]);
    }

    /// Makes bitset slot `at` of `source` this copy's too.
    pub(crate) fn copy_bits(&mut self, source: &Sets, at: u32) {
        let at = at as usize;
        if self.bits.len() <= at {
            self.bits.resize_with(at + 1, Vec::new);
        }
        self.bits[at].clone_from(&source.bits[at]);
    }
}

impl Default for Holders {
    fn default() -> Self {
        Self::EMPTY
    }
}

#[inline]
fn bit(words: &[u64], id: u32) -> bool {
    words
        .get(id as usize / 64)
        .is_some_and(|w| w >> (id % 64) & 1 != 0)
}

impl Holders {
    pub(crate) const EMPTY: Self = Self::Inline {
        len: 0,
        ids: [0; INLINE],
    };

    /// The set of one id.
    #[inline]
    pub(crate) const fn one(id: u32) -> Self {
        Self::Inline {
            len: 1,
            ids: [id, 0, 0],
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        match *self {
            Self::Inline { len, .. } | Self::List { len, .. } | Self::Bits { len, .. } => {
                len as usize
            }
        }
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The slot of `sets` this set names: `(is a bitset, slot)`.
    #[inline]
    pub(crate) fn slot(&self) -> Option<(bool, u32)> {
        match *self {
            Self::Inline { .. } => None,
            Self::List { at, .. } => Some((false, at)),
            Self::Bits { at, .. } => Some((true, at)),
        }
    }

    #[inline]
    pub(crate) fn view<'a>(&'a self, sets: &'a Sets) -> View<'a> {
        match self {
            Self::Inline { len, ids } => View::Sorted(&ids[..*len as usize]),
            Self::List { at, .. } => View::Sorted(&sets.lists[*at as usize]),
            Self::Bits { at, .. } => View::Bits(&sets.bits[*at as usize]),
        }
    }

    #[inline]
    pub(crate) fn contains(&self, id: u32, sets: &Sets) -> bool {
        match self.view(sets) {
            View::Sorted(ids) => ids.binary_search(&id).is_ok(),
            View::Bits(words) => bit(words, id),
        }
    }

    /// Adds `id`; `width` is the bitset size of every known location. Returns whether new.
    #[inline]
    pub(crate) fn insert(&mut self, id: u32, width: usize, sets: &mut Sets) -> bool {
        if let Self::Inline { len: len @ 0, ids } = self {
            // The common case: the first holder of a new node.
            ids[0] = id;
            *len = 1;
            return true;
        }
        self.insert_slow(id, width, sets)
    }

    fn insert_slow(&mut self, id: u32, width: usize, sets: &mut Sets) -> bool {
        match *self {
            Self::Inline { len, mut ids } => {
                let n = len as usize;
                let Err(at) = ids[..n].binary_search(&id) else {
                    return false;
                };
                if n < INLINE {
                    ids.copy_within(at..n, at + 1);
                    ids[at] = id;
                    *self = Self::Inline { len: len + 1, ids };
                } else {
                    let mut all = [0u32; INLINE + 1];
                    all[..at].copy_from_slice(&ids[..at]);
                    all[at] = id;
                    all[at + 1..].copy_from_slice(&ids[at..]);
                    *self = Self::List {
                        len: len + 1,
                        at: sets.new_list(&all),
                    };
                }
                true
            }
            Self::List { len, at } => {
                let list = &mut sets.lists[at as usize];
                let Err(i) = list.binary_search(&id) else {
                    return false;
                };
                if list.len() + 1 > 2 * width {
                    let bits = sets.new_bits(width.max(id as usize / 64 + 1));
                    let list = std::mem::take(&mut sets.lists[at as usize]);
                    let words = &mut sets.bits[bits as usize];
                    for &x in list.iter().chain(std::iter::once(&id)) {
                        grow_to(words, x);
                        words[x as usize / 64] |= 1 << (x % 64);
                    }
                    sets.lists[at as usize] = list;
                    sets.free_lists.push(at);
                    *self = Self::Bits {
                        len: len + 1,
                        at: bits,
                    };
                    return true;
                }
                list.insert(i, id);
                *self = Self::List { len: len + 1, at };
                true
            }
            Self::Bits { len, at } => {
                let words = &mut sets.bits[at as usize];
                grow_to(words, id);
                let (w, b) = (id as usize / 64, 1u64 << (id % 64));
                if words[w] & b != 0 {
                    return false;
                }
                words[w] |= b;
                *self = Self::Bits { len: len + 1, at };
                true
            }
        }
    }

    /// Removes `id`; returns whether it was there.
    #[inline]
    pub(crate) fn remove(&mut self, id: u32, width: usize, sets: &mut Sets) -> bool {
        if let Self::Inline { len: len @ 1, ids } = self {
            // The common case: a block's only holder goes (as the general path leaves it).
            if ids[0] != id {
                return false;
            }
            *len = 0;
            return true;
        }
        self.remove_slow(id, width, sets)
    }

    fn remove_slow(&mut self, id: u32, width: usize, sets: &mut Sets) -> bool {
        match *self {
            Self::Inline { len, mut ids } => {
                let n = len as usize;
                let Ok(at) = ids[..n].binary_search(&id) else {
                    return false;
                };
                ids.copy_within(at + 1..n, at);
                *self = Self::Inline { len: len - 1, ids };
            }
            Self::List { len, at } => {
                let list = &mut sets.lists[at as usize];
                let Ok(i) = list.binary_search(&id) else {
                    return false;
                };
                list.remove(i);
                *self = Self::List { len: len - 1, at };
            }
            Self::Bits { len, at } => {
                let words = &mut sets.bits[at as usize];
                let (w, b) = (id as usize / 64, 1u64 << (id % 64));
                if words.get(w).is_none_or(|x| x & b == 0) {
                    return false;
                }
                words[w] &= !b;
                *self = Self::Bits { len: len - 1, at };
            }
        }
        self.settle(width, sets);
        true
    }

    /// Keeps the ids `keep` says; returns how many went.
    pub(crate) fn retain(
        &mut self,
        keep: impl Fn(u32) -> bool,
        width: usize,
        sets: &mut Sets,
    ) -> usize {
        let before = self.len();
        match *self {
            Self::Inline { len, mut ids } => {
                let mut n = 0;
                for i in 0..len as usize {
                    if keep(ids[i]) {
                        ids[n] = ids[i];
                        n += 1;
                    }
                }
                *self = Self::Inline { len: n as u32, ids };
            }
            Self::List { at, .. } => {
                let list = &mut sets.lists[at as usize];
                list.retain(|&x| keep(x));
                *self = Self::List {
                    len: list.len() as u32,
                    at,
                };
            }
            Self::Bits { at, .. } => {
                let mut n = 0;
                for (w, word) in sets.bits[at as usize].iter_mut().enumerate() {
                    let mut bits = *word;
                    while bits != 0 {
                        let b = bits.trailing_zeros();
                        bits &= bits - 1;
                        if !keep((w * 64) as u32 + b) {
                            *word &= !(1u64 << b);
                        }
                    }
                    n += word.count_ones();
                }
                *self = Self::Bits { len: n, at };
            }
        }
        self.settle(width, sets);
        before - self.len()
    }

    /// Back to a smaller form after removals (see the module doc).
    fn settle(&mut self, width: usize, sets: &mut Sets) {
        let len = self.len();
        let shrink = match self {
            Self::Inline { .. } => false,
            Self::List { .. } => len <= INLINE,
            Self::Bits { .. } => len <= width / 2 || len <= INLINE,
        };
        if shrink {
            let ids: Vec<u32> = self.iter(sets).collect();
            self.release(sets);
            *self = Self::from_sorted(&ids, sets);
        }
    }

    /// Gives this set's slot back to `sets` (the set is dropped, or about to be replaced).
    pub(crate) fn release(&mut self, sets: &mut Sets) {
        match *self {
            Self::Inline { .. } => {}
            Self::List { at, .. } => sets.free_lists.push(at),
            Self::Bits { at, .. } => sets.free_bits.push(at),
        }
        *self = Self::EMPTY;
    }

    /// The set of sorted, distinct `ids` in array form.
    pub(crate) fn from_sorted(ids: &[u32], sets: &mut Sets) -> Self {
        if ids.len() <= INLINE {
            let mut inline = [0; INLINE];
            inline[..ids.len()].copy_from_slice(ids);
            return Self::Inline {
                len: ids.len() as u32,
                ids: inline,
            };
        }
        Self::List {
            len: ids.len() as u32,
            at: sets.new_list(ids),
        }
    }

    /// Members, ascending.
    pub(crate) fn iter<'a>(&'a self, sets: &'a Sets) -> impl Iterator<Item = u32> + 'a {
        let (sorted, words): (&[u32], &[u64]) = match self.view(sets) {
            View::Sorted(ids) => (ids, &[]),
            View::Bits(words) => (&[], words),
        };
        sorted
            .iter()
            .copied()
            .chain(words.iter().enumerate().flat_map(|(w, &word)| {
                let mut bits = word;
                std::iter::from_fn(move || {
                    (bits != 0).then(|| {
                        let b = bits.trailing_zeros();
                        bits &= bits - 1;
                        (w * 64) as u32 + b
                    })
                })
            }))
    }

    /// Checks the module's invariants for this set; `Err` says which.
    pub(crate) fn check(&self, sets: &Sets) -> std::result::Result<(), String> {
        match *self {
            Self::Inline { len, ids } => {
                let n = len as usize;
                if n > INLINE || ids[..n].windows(2).any(|p| p[0] >= p[1]) {
                    return Err(format!("inline holders {:?} unsorted or long", &ids[..n]));
                }
            }
            Self::List { len, at } => {
                let list = sets
                    .lists
                    .get(at as usize)
                    .ok_or("holders list slot out of range")?;
                if list.len() != len as usize
                    || list.len() <= INLINE
                    || list.windows(2).any(|p| p[0] >= p[1])
                {
                    return Err(format!(
                        "holders list of {len} unsorted, short or miscounted"
                    ));
                }
            }
            Self::Bits { len, at } => {
                let words = sets
                    .bits
                    .get(at as usize)
                    .ok_or("holders bitset slot out of range")?;
                let count: u32 = words.iter().map(|w| w.count_ones()).sum();
                if count != len {
                    return Err(format!("holders bitset counts {len}, holds {count}"));
                }
            }
        }
        Ok(())
    }
}

fn grow_to(words: &mut Vec<u64>, id: u32) {
    let need = id as usize / 64 + 1;
    if words.len() < need {
        words.resize(need, 0);
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn every_form_agrees_with_a_set() {
        let mut sets = Sets::default();
        let mut h = Holders::default();
        let mut other = Holders::default(); // a second set sharing the slots
        let mut model = BTreeSet::new();
        let width = 2; // 128 locations: a bitset past 4 ids, an array again at 1
        let mut x = 12345u32;
        for step in 0..4000 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let id = (x >> 8) % 150;
            if step % 3 == 2 {
                assert_eq!(h.remove(id, width, &mut sets), model.remove(&id));
            } else {
                assert_eq!(h.insert(id, width, &mut sets), model.insert(id));
            }
            other.insert(id % 7, width, &mut sets);
            if step % 500 == 499 {
                let cut = (x >> 4) % 150;
                let gone = h.retain(|i| i < cut, width, &mut sets);
                let before = model.len();
                model.retain(|&i| i < cut);
                assert_eq!(gone, before - model.len());
            }
            h.check(&sets).unwrap();
            other.check(&sets).unwrap();
            assert_eq!(h.len(), model.len());
            assert!(h.iter(&sets).eq(model.iter().copied()));
            assert!(h.contains(id, &sets) == model.contains(&id));
            assert!(h.slot().is_none() || h.slot() != other.slot());
        }
        h.release(&mut sets);
        other.release(&mut sets);
        assert_eq!(
            sets.free_lists.len() + sets.free_bits.len(),
            sets.lists.len() + sets.bits.len(),
            "every slot back"
        );
    }
}
