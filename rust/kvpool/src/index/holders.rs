//! A node's holders: the set of location ids whose entry at that node is exactly group bit 0
//! (the one full-attention group of a plain location; see `tree.rs` for the other entries).
//!
//! A small set is a sorted array (inline up to [`INLINE`] ids, then boxed); a large one a
//! bitset over location ids, so that a lookup intersects it with the locations still matching
//! a word at a time. A set becomes a bitset when its array would take more bytes than the
//! bitset of every known location (more than `2 * width` ids, `width` being the bitset's
//! words), and an array again when it shrinks to `width / 2` ids: the form depends only on
//! the operations, so two copies given the same ones agree.
//!
//! Invariants (checked by [`Holders::check`]): arrays are sorted without duplicates and `len`
//! counts them; a bitset's `len` is its popcount; no inline array is boxed.

/// Ids kept inline before the array is boxed.
pub(crate) const INLINE: usize = 3;

#[derive(Debug)]
pub(crate) enum Holders {
    Inline { len: u32, ids: [u32; INLINE] },
    /// `ids[..len]` sorted; `ids.len()` is the capacity.
    List { len: u32, ids: Box<[u32]> },
    Bits { len: u32, words: Box<[u64]> },
}

/// A read-only view for lookups.
pub(crate) enum View<'a> {
    Sorted(&'a [u32]),
    Bits(&'a [u64]),
}

impl Clone for Holders {
    #[inline]
    fn clone(&self) -> Self {
        match self {
            Self::Inline { len, ids } => Self::Inline {
                len: *len,
                ids: *ids,
            },
            Self::List { len, ids } => Self::List {
                len: *len,
                ids: ids.clone(),
            },
            Self::Bits { len, words } => Self::Bits {
                len: *len,
                words: words.clone(),
            },
        }
    }

    /// Reuses this set's box when the source's is the same size (the replay copies the
    /// nodes a write changed; a large set changes in place).
    #[inline]
    fn clone_from(&mut self, source: &Self) {
        match (self, source) {
            (Self::List { len, ids }, Self::List { len: l, ids: from })
                if ids.len() == from.len() =>
            {
                *len = *l;
                ids.copy_from_slice(from);
            }
            (Self::Bits { len, words }, Self::Bits { len: l, words: from })
                if words.len() == from.len() =>
            {
                *len = *l;
                words.copy_from_slice(from);
            }
            (this, source) => *this = source.clone(),
        }
    }
}

impl Default for Holders {
    fn default() -> Self {
        Self::Inline {
            len: 0,
            ids: [0; INLINE],
        }
    }
}

#[inline]
fn bit(words: &[u64], id: u32) -> bool {
    words
        .get(id as usize / 64)
        .is_some_and(|w| w >> (id % 64) & 1 != 0)
}

impl Holders {
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            Self::Inline { len, .. } | Self::List { len, .. } | Self::Bits { len, .. } => {
                *len as usize
            }
        }
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub fn view(&self) -> View<'_> {
        match self {
            Self::Inline { len, ids } => View::Sorted(&ids[..*len as usize]),
            Self::List { len, ids } => View::Sorted(&ids[..*len as usize]),
            Self::Bits { words, .. } => View::Bits(words),
        }
    }

    #[inline]
    pub fn contains(&self, id: u32) -> bool {
        match self.view() {
            View::Sorted(ids) => ids.binary_search(&id).is_ok(),
            View::Bits(words) => bit(words, id),
        }
    }

    /// Adds `id`; `width` is the bitset size of every known location. Returns whether new.
    #[inline]
    pub fn insert(&mut self, id: u32, width: usize) -> bool {
        if let Self::Inline { len: len @ 0, ids } = self {
            // The common case: the first holder of a new node.
            ids[0] = id;
            *len = 1;
            return true;
        }
        self.insert_slow(id, width)
    }

    fn insert_slow(&mut self, id: u32, width: usize) -> bool {
        match self {
            Self::Inline { len, ids } => {
                let n = *len as usize;
                let Err(at) = ids[..n].binary_search(&id) else {
                    return false;
                };
                if n < INLINE {
                    ids.copy_within(at..n, at + 1);
                    ids[at] = id;
                    *len += 1;
                } else {
                    let mut boxed = vec![0u32; 2 * INLINE + 2].into_boxed_slice();
                    boxed[..at].copy_from_slice(&ids[..at]);
                    boxed[at] = id;
                    boxed[at + 1..=n].copy_from_slice(&ids[at..n]);
                    *self = Self::List {
                        len: n as u32 + 1,
                        ids: boxed,
                    };
                }
                true
            }
            Self::List { len, ids } => {
                let n = *len as usize;
                let Err(at) = ids[..n].binary_search(&id) else {
                    return false;
                };
                if n + 1 > 2 * width {
                    let mut words = vec![0u64; width.max(id as usize / 64 + 1)].into_boxed_slice();
                    for &x in ids[..n].iter().chain(std::iter::once(&id)) {
                        Self::grow_to(&mut words, x);
                        words[x as usize / 64] |= 1 << (x % 64);
                    }
                    *self = Self::Bits {
                        len: n as u32 + 1,
                        words,
                    };
                    return true;
                }
                if n == ids.len() {
                    let mut bigger = vec![0u32; 2 * n].into_boxed_slice();
                    bigger[..n].copy_from_slice(&ids[..n]);
                    *ids = bigger;
                }
                ids.copy_within(at..n, at + 1);
                ids[at] = id;
                *len += 1;
                true
            }
            Self::Bits { len, words } => {
                Self::grow_to(words, id);
                let (w, b) = (id as usize / 64, 1u64 << (id % 64));
                if words[w] & b != 0 {
                    return false;
                }
                words[w] |= b;
                *len += 1;
                true
            }
        }
    }

    fn grow_to(words: &mut Box<[u64]>, id: u32) {
        let need = id as usize / 64 + 1;
        if words.len() < need {
            let mut bigger = vec![0u64; need].into_boxed_slice();
            bigger[..words.len()].copy_from_slice(words);
            *words = bigger;
        }
    }

    /// Removes `id`; returns whether it was there.
    pub fn remove(&mut self, id: u32, width: usize) -> bool {
        let removed = match self {
            Self::Inline { len, ids } => {
                let n = *len as usize;
                let Ok(at) = ids[..n].binary_search(&id) else {
                    return false;
                };
                ids.copy_within(at + 1..n, at);
                *len -= 1;
                true
            }
            Self::List { len, ids } => {
                let n = *len as usize;
                let Ok(at) = ids[..n].binary_search(&id) else {
                    return false;
                };
                ids.copy_within(at + 1..n, at);
                *len -= 1;
                true
            }
            Self::Bits { len, words } => {
                let (w, b) = (id as usize / 64, 1u64 << (id % 64));
                if words.get(w).is_none_or(|x| x & b == 0) {
                    return false;
                }
                words[w] &= !b;
                *len -= 1;
                true
            }
        };
        self.settle(width);
        removed
    }

    /// Keeps the ids `keep` says; returns how many went.
    pub fn retain(&mut self, keep: impl Fn(u32) -> bool, width: usize) -> usize {
        let before = self.len();
        match self {
            Self::Inline { len, ids } => {
                let mut n = 0;
                for i in 0..*len as usize {
                    if keep(ids[i]) {
                        ids[n] = ids[i];
                        n += 1;
                    }
                }
                *len = n as u32;
            }
            Self::List { len, ids } => {
                let mut n = 0;
                for i in 0..*len as usize {
                    if keep(ids[i]) {
                        ids[n] = ids[i];
                        n += 1;
                    }
                }
                *len = n as u32;
            }
            Self::Bits { len, words } => {
                let mut n = 0;
                for (w, word) in words.iter_mut().enumerate() {
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
                *len = n;
            }
        }
        self.settle(width);
        before - self.len()
    }

    /// Back to a smaller form after removals (see the module doc).
    fn settle(&mut self, width: usize) {
        let len = self.len();
        let shrink = match self {
            Self::Inline { .. } => false,
            Self::List { .. } => len <= INLINE,
            Self::Bits { .. } => len <= width / 2 || len <= INLINE,
        };
        if shrink {
            let ids: Vec<u32> = self.iter().collect();
            *self = Self::from_sorted(&ids);
        }
    }

    /// The set of sorted, distinct `ids` in array form.
    pub fn from_sorted(ids: &[u32]) -> Self {
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
            ids: ids.to_vec().into_boxed_slice(),
        }
    }

    /// Members, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let (sorted, words): (&[u32], &[u64]) = match self.view() {
            View::Sorted(ids) => (ids, &[]),
            View::Bits(words) => (&[], words),
        };
        sorted.iter().copied().chain(words.iter().enumerate().flat_map(|(w, &word)| {
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

    /// Checks the module's invariants; `Err` says which.
    pub fn check(&self) -> std::result::Result<(), String> {
        match self {
            Self::Inline { len, ids } => {
                let n = *len as usize;
                if n > INLINE || ids[..n].windows(2).any(|p| p[0] >= p[1]) {
                    return Err(format!("inline holders {:?} unsorted or long", &ids[..n]));
                }
            }
            Self::List { len, ids } => {
                let n = *len as usize;
                if n > ids.len() || n <= INLINE || ids[..n].windows(2).any(|p| p[0] >= p[1]) {
                    return Err(format!("holders list of {n} unsorted or short"));
                }
            }
            Self::Bits { len, words } => {
                let count: u32 = words.iter().map(|w| w.count_ones()).sum();
                if count != *len {
                    return Err(format!("holders bitset counts {len}, holds {count}"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn every_form_agrees_with_a_set() {
        let mut h = Holders::default();
        let mut model = BTreeSet::new();
        let width = 2; // 128 locations: a bitset past 4 ids, an array again at 1
        let mut x = 12345u32;
        for step in 0..4000 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let id = (x >> 8) % 150;
            if step % 3 == 2 {
                assert_eq!(h.remove(id, width), model.remove(&id));
            } else {
                assert_eq!(h.insert(id, width), model.insert(id));
            }
            if step % 500 == 499 {
                let cut = (x >> 4) % 150;
                let gone = h.retain(|i| i < cut, width);
                let before = model.len();
                model.retain(|&i| i < cut);
                assert_eq!(gone, before - model.len());
            }
            h.check().unwrap();
            assert_eq!(h.len(), model.len());
            assert!(h.iter().eq(model.iter().copied()));
            assert!(h.contains(id) == model.contains(&id));
        }
    }
}
