//! The prefix cache's keys: the hash map keyed by already-uniform 128-bit block hashes (an
//! identity hasher, nothing to mix) and the token compare that confirms a hash hit.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The map's hasher: keys are already uniformly distributed 128-bit hashes.
#[derive(Default)]
pub(crate) struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, value: u128) {
        self.0 = (value as u64) ^ ((value >> 64) as u64);
    }
}

pub(super) type HashIndex = HashMap<u128, u32, BuildHasherDefault<IdentityHasher>>;

/// `a == b` for token blocks, branch-free over the block (it vectorizes; a slice `==` calls
/// `memcmp`, which costs more than the compare for a 16-token block).
#[inline]
pub(super) fn same_tokens(a: &[u32], b: &[u32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |diff, (x, y)| diff | (x ^ y)) == 0
}
