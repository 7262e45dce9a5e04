//! A node's holders: the set of location ids whose entry at that node is exactly group bit 0
//! (the one full-attention group of a plain location; see `tree.rs` for the other entries).
//!
//! The set is one packed word (62 bits, so that a node record keeps two flag bits beside it):
//! up to [`INLINE`] ids inline (each below 2^29), else a slot of the tree's [`Sets`]: a sorted
//! array, or a bitset over location ids (so that a lookup intersects it with the locations
//! still matching a word at a time). A set becomes a bitset when its array would take more
//! bytes than the bitset of every known location (more than `2 * width` ids, `width` being the
//! bitset's words), and an array again when it shrinks to `width / 2` ids: the form depends
//! only on the operations, so two copies given the same ones agree. The arrays and bitsets live
//! in [`Sets`], whose slots are reused.
//!
//! Layout: bits 60-61 the form (0 inline, 1 array, 2 bitset); inline: bits 58-59 the count, the
//! ids in bits 0-28 and 29-57 (sorted); otherwise bits 32-59 the count, bits 0-31 the slot.
//!
//! Invariants (checked by [`Holders::check`]): arrays are sorted without duplicates and the
//! count counts them; a bitset's count is its popcount; a set of at most [`INLINE`] ids is
//! inline; [`Sets`] slots are named by exactly one set or free.

/// Ids kept inline.
pub(crate) const INLINE: usize = 2;

/// Location ids a holder set can name (an inline id has 29 bits; counts have 28).
pub(crate) const MAX_LOCATIONS: usize = 1 << 28;

const FORM_SHIFT: u32 = 60;
const FORM_INLINE: u64 = 0;
const FORM_LIST: u64 = 1;
const FORM_BITS: u64 = 2;
const ID_BITS: u32 = 29;
const ID_MASK: u64 = (1 << ID_BITS) - 1;
const COUNT_SHIFT_INLINE: u32 = 58;
const COUNT_SHIFT: u32 = 32;
const COUNT_MASK: u64 = (1 << 28) - 1;

/// The set (see the module doc): plain data, 8 bytes, `Copy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct Holders(u64);

/// A read-only view for lookups (an inline set's ids copied out).
pub(crate) enum View<'a> {
    Inline { ids: [u32; INLINE], len: usize },
    Sorted(&'a [u32]),
    Bits(&'a [u64]),
}

/// What a [`View`] holds: sorted ids or a bitset.
pub(crate) enum Form<'a> {
    Sorted(&'a [u32]),
    Bits(&'a [u64]),
}

impl View<'_> {
    #[inline]
    pub(crate) fn form(&self) -> Form<'_> {
        match self {
            View::Inline { ids, len } => Form::Sorted(&ids[..*len]),
            View::Sorted(ids) => Form::Sorted(ids),
            View::Bits(words) => Form::Bits(words),
        }
    }
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

#[inline]
fn bit(words: &[u64], id: u32) -> bool {
    words
        .get(id as usize / 64)
        .is_some_and(|w| w >> (id % 64) & 1 != 0)
}

impl Holders {
    pub(crate) const EMPTY: Self = Self(0);
    /// The bits a set takes of a word (the rest are the record's flags).
    pub(crate) const MASK: u64 = (1 << 62) - 1;

    /// The set packed in the low 62 bits of `word`.
    #[inline]
    pub(crate) const fn from_word(word: u64) -> Self {
        Self(word & Self::MASK)
    }

    /// The packed set.
    #[inline]
    pub(crate) const fn word(self) -> u64 {
        self.0
    }

    #[inline]
    const fn inline(ids: [u32; INLINE], len: usize) -> Self {
        Self(
            (len as u64) << COUNT_SHIFT_INLINE
                | (ids[1] as u64 & ID_MASK) << ID_BITS
                | (ids[0] as u64 & ID_MASK),
        )
    }

    #[inline]
    fn out_of_line(form: u64, len: usize, at: u32) -> Self {
        Self(form << FORM_SHIFT | (len as u64 & COUNT_MASK) << COUNT_SHIFT | u64::from(at))
    }

    #[inline]
    fn form(self) -> u64 {
        self.0 >> FORM_SHIFT & 3
    }

    #[inline]
    fn inline_ids(self) -> [u32; INLINE] {
        [
            (self.0 & ID_MASK) as u32,
            (self.0 >> ID_BITS & ID_MASK) as u32,
        ]
    }

    /// The set of one id.
    #[inline]
    pub(crate) const fn one(id: u32) -> Self {
        Self::inline([id, 0], 1)
    }

    #[inline]
    pub(crate) fn len(self) -> usize {
        if self.form() == FORM_INLINE {
            (self.0 >> COUNT_SHIFT_INLINE & 3) as usize
        } else {
            (self.0 >> COUNT_SHIFT & COUNT_MASK) as usize
        }
    }

    #[inline]
    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The slot of `sets` this set names: `(is a bitset, slot)`.
    #[inline]
    pub(crate) fn slot(self) -> Option<(bool, u32)> {
        match self.form() {
            FORM_LIST => Some((false, self.0 as u32)),
            FORM_BITS => Some((true, self.0 as u32)),
            _ => None,
        }
    }

    #[inline]
    pub(crate) fn view(self, sets: &Sets) -> View<'_> {
        match self.form() {
            FORM_LIST => View::Sorted(&sets.lists[self.0 as u32 as usize]),
            FORM_BITS => View::Bits(&sets.bits[self.0 as u32 as usize]),
            _ => View::Inline {
                ids: self.inline_ids(),
                len: self.len(),
            },
        }
    }

    #[inline]
    pub(crate) fn contains(self, id: u32, sets: &Sets) -> bool {
        match self.view(sets).form() {
            Form::Sorted(ids) => ids.binary_search(&id).is_ok(),
            Form::Bits(words) => bit(words, id),
        }
    }

    /// Adds `id`; `width` is the bitset size of every known location. Returns whether new.
    #[inline]
    pub(crate) fn insert(&mut self, id: u32, width: usize, sets: &mut Sets) -> bool {
        if self.is_empty() {
            // The common case: the first holder of a new node.
            *self = Self::one(id);
            return true;
        }
        self.insert_slow(id, width, sets)
    }

    fn insert_slow(&mut self, id: u32, width: usize, sets: &mut Sets) -> bool {
        let len = self.len();
        match self.form() {
            FORM_INLINE => {
                let ids = self.inline_ids();
                let Err(at) = ids[..len].binary_search(&id) else {
                    return false;
                };
                if len < INLINE {
                    let mut ids = ids;
                    ids.copy_within(at..len, at + 1);
                    ids[at] = id;
                    *self = Self::inline(ids, len + 1);
                } else {
                    let mut all = [0u32; INLINE + 1];
                    all[..at].copy_from_slice(&ids[..at]);
                    all[at] = id;
                    all[at + 1..].copy_from_slice(&ids[at..]);
                    *self = Self::out_of_line(FORM_LIST, len + 1, sets.new_list(&all));
                }
                true
            }
            FORM_LIST => {
                let at = self.0 as u32;
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
                    *self = Self::out_of_line(FORM_BITS, len + 1, bits);
                    return true;
                }
                list.insert(i, id);
                *self = Self::out_of_line(FORM_LIST, len + 1, at);
                true
            }
            _ => {
                let at = self.0 as u32;
                let words = &mut sets.bits[at as usize];
                grow_to(words, id);
                let (w, b) = (id as usize / 64, 1u64 << (id % 64));
                if words[w] & b != 0 {
                    return false;
                }
                words[w] |= b;
                *self = Self::out_of_line(FORM_BITS, len + 1, at);
                true
            }
        }
    }

    /// Removes `id`; returns whether it was there.
    #[inline]
    pub(crate) fn remove(&mut self, id: u32, width: usize, sets: &mut Sets) -> bool {
        if *self == Self::one(id) {
            // The common case: a block's only holder goes.
            *self = Self::EMPTY;
            return true;
        }
        self.remove_slow(id, width, sets)
    }

    fn remove_slow(&mut self, id: u32, width: usize, sets: &mut Sets) -> bool {
        let len = self.len();
        match self.form() {
            FORM_INLINE => {
                let mut ids = self.inline_ids();
                let Ok(at) = ids[..len].binary_search(&id) else {
                    return false;
                };
                ids.copy_within(at + 1..len, at);
                ids[len - 1] = 0;
                *self = Self::inline(ids, len - 1);
            }
            FORM_LIST => {
                let at = self.0 as u32;
                let list = &mut sets.lists[at as usize];
                let Ok(i) = list.binary_search(&id) else {
                    return false;
                };
                list.remove(i);
                *self = Self::out_of_line(FORM_LIST, len - 1, at);
            }
            _ => {
                let at = self.0 as u32;
                let words = &mut sets.bits[at as usize];
                let (w, b) = (id as usize / 64, 1u64 << (id % 64));
                if words.get(w).is_none_or(|x| x & b == 0) {
                    return false;
                }
                words[w] &= !b;
                *self = Self::out_of_line(FORM_BITS, len - 1, at);
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
        match self.form() {
            FORM_INLINE => {
                let ids = self.inline_ids();
                let mut kept = [0u32; INLINE];
                let mut n = 0;
                for &x in &ids[..before] {
                    if keep(x) {
                        kept[n] = x;
                        n += 1;
                    }
                }
                *self = Self::inline(kept, n);
            }
            FORM_LIST => {
                let at = self.0 as u32;
                let list = &mut sets.lists[at as usize];
                list.retain(|&x| keep(x));
                *self = Self::out_of_line(FORM_LIST, list.len(), at);
            }
            _ => {
                let at = self.0 as u32;
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
                    n += word.count_ones() as usize;
                }
                *self = Self::out_of_line(FORM_BITS, n, at);
            }
        }
        self.settle(width, sets);
        before - self.len()
    }

    /// Back to a smaller form after removals (see the module doc).
    fn settle(&mut self, width: usize, sets: &mut Sets) {
        let len = self.len();
        let shrink = match self.form() {
            FORM_INLINE => false,
            FORM_LIST => len <= INLINE,
            _ => len <= width / 2 || len <= INLINE,
        };
        if shrink {
            let ids: Vec<u32> = self.iter(sets).collect();
            self.release(sets);
            *self = Self::from_sorted(&ids, sets);
        }
    }

    /// Gives this set's slot back to `sets` (the set is dropped, or about to be replaced).
    pub(crate) fn release(&mut self, sets: &mut Sets) {
        match self.slot() {
            Some((false, at)) => sets.free_lists.push(at),
            Some((true, at)) => sets.free_bits.push(at),
            None => {}
        }
        *self = Self::EMPTY;
    }

    /// The set of sorted, distinct `ids` in array form.
    pub(crate) fn from_sorted(ids: &[u32], sets: &mut Sets) -> Self {
        if ids.len() <= INLINE {
            let mut inline = [0; INLINE];
            inline[..ids.len()].copy_from_slice(ids);
            return Self::inline(inline, ids.len());
        }
        Self::out_of_line(FORM_LIST, ids.len(), sets.new_list(ids))
    }

    /// Members, ascending.
    pub(crate) fn iter(self, sets: &Sets) -> impl Iterator<Item = u32> + '_ {
        let (inline, n, sorted, words): ([u32; INLINE], usize, &[u32], &[u64]) =
            match self.view(sets) {
                View::Inline { ids, len } => (ids, len, &[], &[]),
                View::Sorted(ids) => ([0; INLINE], 0, ids, &[]),
                View::Bits(words) => ([0; INLINE], 0, &[], words),
            };
        inline
            .into_iter()
            .take(n)
            .chain(sorted.iter().copied())
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
    pub(crate) fn check(self, sets: &Sets) -> std::result::Result<(), String> {
        let len = self.len();
        match self.form() {
            FORM_INLINE => {
                let ids = self.inline_ids();
                if len > INLINE
                    || ids[..len].windows(2).any(|p| p[0] >= p[1])
                    || ids[len..].iter().any(|&x| x != 0)
                    || self.0 >> 60 != 0
                {
                    return Err(format!("inline holders {self:?} unsorted, long or untidy"));
                }
            }
            FORM_LIST => {
                let list = sets
                    .lists
                    .get(self.0 as u32 as usize)
                    .ok_or("holders list slot out of range")?;
                if list.len() != len
                    || list.len() <= INLINE
                    || list.windows(2).any(|p| p[0] >= p[1])
                {
                    return Err(format!(
                        "holders list of {len} unsorted, short or miscounted"
                    ));
                }
            }
            FORM_BITS => {
                let words = sets
                    .bits
                    .get(self.0 as u32 as usize)
                    .ok_or("holders bitset slot out of range")?;
                let count: usize = words.iter().map(|w| w.count_ones() as usize).sum();
                if count != len {
                    return Err(format!("holders bitset counts {len}, holds {count}"));
                }
            }
            _ => return Err(format!("holders {self:?} of an unknown form")),
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
            assert_eq!(h.is_empty(), model.is_empty());
            assert!(h.iter(&sets).eq(model.iter().copied()));
            assert!(h.contains(id, &sets) == model.contains(&id));
            assert!(h.slot().is_none() || h.slot() != other.slot());
            assert_eq!(Holders::from_word(h.word() | 3 << 62), h, "flags stay out");
        }
        h.release(&mut sets);
        other.release(&mut sets);
        assert_eq!(
            sets.free_lists.len() + sets.free_bits.len(),
            sets.lists.len() + sets.bits.len(),
            "every slot back"
        );
        let big = (1u32 << 29) - 1;
        let mut h = Holders::one(big);
        assert!(h.insert(big - 1, 1, &mut sets));
        assert!(h.iter(&sets).eq([big - 1, big]), "ids of 29 bits inline");
    }
}
