//! A growable array in fixed chunks of [`CHUNK`] elements: growing never moves or copies what
//! it holds (a `Vec` doubling copies everything into a new buffer and, on a heap that keeps
//! the old one resident, holds both), and it holds at most one chunk more than it needs.
//!
//! Invariant: `chunks.len() == len.div_ceil(CHUNK)` (no chunk past the last element's); the
//! elements past `len` in the last chunk are `T::default()`.

const CHUNK_BITS: u32 = 12;
/// Elements per chunk.
pub(crate) const CHUNK: usize = 1 << CHUNK_BITS;
const MASK: usize = CHUNK - 1;

#[derive(Clone, Debug, Default)]
pub(crate) struct Chunked<T> {
    chunks: Vec<Box<[T]>>,
    len: usize,
}

impl<T: Copy + Default> Chunked<T> {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        if i < self.len {
            Some(&self.chunks[i >> CHUNK_BITS][i & MASK])
        } else {
            None
        }
    }

    #[inline]
    pub(crate) fn push(&mut self, value: T) {
        if self.len & MASK == 0 {
            self.chunks
                .push(vec![T::default(); CHUNK].into_boxed_slice());
        }
        let i = self.len;
        self.chunks[i >> CHUNK_BITS][i & MASK] = value;
        self.len += 1;
    }

    /// Keeps the first `len` elements.
    pub(crate) fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        let chunks = len.div_ceil(CHUNK);
        self.chunks.truncate(chunks);
        if let Some(last) = self.chunks.last_mut() {
            // Past the old length the elements are defaults already (the invariant): only
            // what is dropped is cleared, not the whole chunk's tail at every call.
            let start = (chunks - 1) * CHUNK;
            last[len - start..(self.len - start).min(CHUNK)].fill(T::default());
        }
        self.len = len;
    }

    /// Appends `source`'s elements from `self.len()` on (this array being a prefix of it).
    pub(crate) fn extend_from(&mut self, source: &Chunked<T>) {
        while self.len < source.len {
            let i = self.len;
            let (c, at) = (i >> CHUNK_BITS, i & MASK);
            if at == 0 {
                self.chunks.push(source.chunks[c].clone());
            } else {
                let n = (CHUNK - at).min(source.len - i);
                self.chunks[c][at..at + n].copy_from_slice(&source.chunks[c][at..at + n]);
            }
            self.len = ((c + 1) * CHUNK).min(source.len);
        }
        // Nothing to clear past the new length: a whole chunk copied holds the source's
        // defaults past its length, a part copied leaves this array's own (the invariant).
    }

    /// The elements in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.chunks.iter().flat_map(|c| c.iter()).take(self.len)
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK * std::mem::size_of::<T>() + self.chunks.capacity() * 16
    }
}

impl<T> std::ops::Index<usize> for Chunked<T> {
    type Output = T;

    #[inline]
    fn index(&self, i: usize) -> &T {
        assert!(i < self.len, "index {i} out of {}", self.len);
        &self.chunks[i >> CHUNK_BITS][i & MASK]
    }
}

impl<T> std::ops::IndexMut<usize> for Chunked<T> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        assert!(i < self.len, "index {i} out of {}", self.len);
        &mut self.chunks[i >> CHUNK_BITS][i & MASK]
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    /// The invariant: the elements past `len` in the last chunk are defaults.
    fn tail_is_default(a: &Chunked<u32>) -> bool {
        a.chunks.last().is_none_or(|last| {
            last[a.len - (a.chunks.len() - 1) * CHUNK..]
                .iter()
                .all(|&x| x == 0)
        })
    }

    #[test]
    fn behaves_as_a_vec() {
        let mut a: Chunked<u32> = Chunked::default();
        let mut model = Vec::new();
        let mut x = 7u32;
        for step in 0..20_000u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            if x % 97 == 0 {
                let keep = (x as usize >> 3) % (model.len() + 1);
                a.truncate(keep);
                model.truncate(keep);
            } else {
                a.push(step);
                model.push(step);
            }
            if step % 1000 == 0 {
                let mut b: Chunked<u32> = Chunked::default();
                let cut = model.len() / 3;
                for &v in &model[..cut] {
                    b.push(v);
                }
                b.extend_from(&a);
                assert!(b.iter().eq(model.iter()));
                assert!(tail_is_default(&b), "step {step}");
                assert_eq!(b.chunks.len(), b.len.div_ceil(CHUNK));
            }
            assert_eq!(a.len(), model.len());
            assert_eq!(a.chunks.len(), a.len.div_ceil(CHUNK));
            assert!(tail_is_default(&a), "step {step}");
        }
        assert!(a.iter().eq(model.iter()));
        assert_eq!(a.get(model.len()), None);
    }
}
