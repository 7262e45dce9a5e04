//! The prefix cache's keys: the map keyed by block hashes and the token compare that confirms
//! a hash hit.

use crate::hash::ByHash;

pub(super) type HashIndex = ByHash<u32>;

/// `a == b` for token blocks, branch-free over the block (it vectorizes; a slice `==` calls
/// `memcmp`, which costs more than the compare for a 16-token block).
#[inline]
pub(super) fn same_tokens(a: &[u32], b: &[u32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |diff, (x, y)| diff | (x ^ y)) == 0
}
