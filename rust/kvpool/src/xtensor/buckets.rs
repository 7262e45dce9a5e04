//! The two small structures behind [`super::pages::PageTable`]'s O(1) page lookup and
//! fullest-page-first order: [`Divider`] (an id's page by one multiplication) and
//! [`BucketBits`] (which free-count buckets are non-empty, lowest found in a short scan).
//!
//! Invariant: `BucketBits`'s summary bit `w` is set iff word `w` is non-zero.

/// `n / d` for 32-bit `n` by one multiplication (Lemire, Kaser and Kurz, "Faster remainder by
/// direct computation", 2019: with `c = ceil(2^64 / d)`, `n / d == (c * n) >> 64` for every
/// `n < 2^32`). A page lookup sits on every allocation and free, where a hardware division
/// would cost more than the rest of the bookkeeping.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Divider {
    /// `ceil(2^64 / d)`, or 0 for `d == 1` (where it does not fit).
    magic: u64,
}

impl Divider {
    pub(crate) fn new(divisor: u32) -> Self {
        debug_assert!(divisor >= 1);
        let magic = match divisor {
            1 => 0,
            // For d >= 2, ceil(2^64 / d) == floor((2^64 - 1) / d) + 1 (also for powers of two).
            d => u64::MAX / u64::from(d) + 1,
        };
        Self { magic }
    }

    #[inline]
    pub(crate) fn divide(self, n: u32) -> u32 {
        if self.magic == 0 {
            n
        } else {
            ((u128::from(self.magic) * u128::from(n)) >> 64) as u32
        }
    }
}

/// Which buckets are non-empty: one bit per free count, with a summary word per 64 words so
/// the lowest set bit is found by scanning `B / 4096` summary words.
pub(crate) struct BucketBits {
    words: Box<[u64]>,
    summary: Box<[u64]>,
}

impl BucketBits {
    pub(crate) fn new(bits: usize) -> Self {
        let words = bits.div_ceil(64).max(1);
        Self {
            words: vec![0; words].into_boxed_slice(),
            summary: vec![0; words.div_ceil(64)].into_boxed_slice(),
        }
    }

    #[inline]
    pub(crate) fn set(&mut self, bit: u32) {
        let word = (bit / 64) as usize;
        self.words[word] |= 1 << (bit % 64);
        self.summary[word / 64] |= 1 << (word % 64);
    }

    #[inline]
    pub(crate) fn clear(&mut self, bit: u32) {
        let word = (bit / 64) as usize;
        self.words[word] &= !(1 << (bit % 64));
        if self.words[word] == 0 {
            self.summary[word / 64] &= !(1 << (word % 64));
        }
    }

    #[inline]
    pub(crate) fn lowest(&self) -> Option<u32> {
        let first = self.summary[0];
        if first != 0 {
            let word = first.trailing_zeros() as usize;
            return Some((word * 64) as u32 + self.words[word].trailing_zeros());
        }
        self.lowest_beyond_first()
    }

    #[cold]
    pub(crate) fn lowest_beyond_first(&self) -> Option<u32> {
        for (s, &summary) in self.summary.iter().enumerate().skip(1) {
            if summary != 0 {
                let word = s * 64 + summary.trailing_zeros() as usize;
                return Some((word * 64) as u32 + self.words[word].trailing_zeros());
            }
        }
        None
    }

    pub(crate) fn get(&self, bit: u32) -> bool {
        self.words[(bit / 64) as usize] & (1 << (bit % 64)) != 0
    }
}
