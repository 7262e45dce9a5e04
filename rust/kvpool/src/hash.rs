//! Chained block hashes (R6).
//!
//! `hash(block i) = XXH3-128(seed, parent || tokens)`, where `parent` is the hash of block i-1
//! or, for block 0, a root derived from the sequence's extra key (cache salt, LoRA id, model
//! namespace), and tokens are u32 little-endian. The default seed is fixed, so the same tokens
//! give the same hashes in every process (needed for KV events and cluster routing).
//! Canonical bytes of a hash are its big-endian encoding (XXH3's canonical form).

use xxhash_rust::xxh3::xxh3_128_with_seed;

/// The default seed: `"kvpool"` in ASCII, then a format version.
pub const DEFAULT_HASH_SEED: u64 = 0x6b76_706f_6f6c_0001;

/// A 128-bit chained block hash.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// Canonical 16 bytes (big-endian).
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// Canonical bytes in lower-case hex (what Python's `bytes.hex()` prints for them).
    pub fn to_hex(self) -> String {
        format!("{:032x}", self.0)
    }

    /// From canonical bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(u128::from_be_bytes(bytes))
    }
}

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockHash({:032x})", self.0)
    }
}

/// Computes chained block hashes with one seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    seed: u64,
    mask: u128,
}

impl Default for BlockHasher {
    fn default() -> Self {
        Self::new(DEFAULT_HASH_SEED)
    }
}

const ROOT_DOMAIN: &[u8] = b"kvpool/root";
const STACK_TOKENS: usize = 256;

impl BlockHasher {
    /// A hasher with `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            mask: u128::MAX,
        }
    }

    /// Test hook: keep only the low `bits` bits (1..=128) of every hash, so that collisions can be
    /// forged and R7's token verification observed.
    pub fn with_debug_bits(seed: u64, bits: u32) -> Self {
        let mask = if bits >= 128 {
            u128::MAX
        } else {
            (1u128 << bits) - 1
        };
        Self { seed, mask }
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The parent of a chain's first block for `extra_key` (`None` and every key differ).
    pub fn root(&self, extra_key: Option<&[u8]>) -> BlockHash {
        let mut buf = Vec::with_capacity(ROOT_DOMAIN.len() + 1 + extra_key.map_or(0, <[u8]>::len));
        buf.extend_from_slice(ROOT_DOMAIN);
        match extra_key {
            None => buf.push(0),
            Some(key) => {
                buf.push(1);
                buf.extend_from_slice(key);
            }
        }
        BlockHash(xxh3_128_with_seed(&buf, self.seed) & self.mask)
    }

    /// Hash of one block given its parent's hash.
    #[inline]
    pub fn hash_block(&self, parent: BlockHash, tokens: &[u32]) -> BlockHash {
        let len = 16 + 4 * tokens.len();
        // Stack buffers sized for the common block sizes: zeroing a large one per block would
        // cost as much as the hash itself.
        let digest = if let Ok(block) = <&[u32; 16]>::try_from(tokens) {
            // The common block size, with a fixed-size buffer: the copy unrolls into vector
            // moves and the buffer needs no zeroing.
            let mut buf = [0u8; 16 + 4 * 16];
            buf[..16].copy_from_slice(&parent.0.to_le_bytes());
            for (chunk, token) in buf[16..].chunks_exact_mut(4).zip(block) {
                chunk.copy_from_slice(&token.to_le_bytes());
            }
            xxh3_128_with_seed(&buf, self.seed)
        } else if tokens.len() <= 16 {
            let mut buf = [0u8; 16 + 4 * 16];
            fill(&mut buf[..len], parent, tokens);
            xxh3_128_with_seed(&buf[..len], self.seed)
        } else if tokens.len() <= STACK_TOKENS {
            let mut buf = [0u8; 16 + 4 * STACK_TOKENS];
            fill(&mut buf[..len], parent, tokens);
            xxh3_128_with_seed(&buf[..len], self.seed)
        } else {
            let mut buf = vec![0u8; len];
            fill(&mut buf, parent, tokens);
            xxh3_128_with_seed(&buf, self.seed)
        };
        BlockHash(digest & self.mask)
    }

    /// Appends to `out` the hashes of full blocks `out.len()..` of `tokens`, continuing the chain
    /// already in `out` (rooted at `extra_key`). Idempotent; cost is the new blocks only.
    pub fn extend_chain(
        &self,
        out: &mut Vec<BlockHash>,
        tokens: &[u32],
        block_size: usize,
        extra_key: Option<&[u8]>,
    ) {
        let full = tokens.len() / block_size;
        if out.len() >= full {
            return;
        }
        let mut parent = match out.last() {
            Some(&h) => h,
            None => self.root(extra_key),
        };
        out.reserve(full - out.len());
        for i in out.len()..full {
            parent = self.hash_block(parent, &tokens[i * block_size..(i + 1) * block_size]);
            out.push(parent);
        }
    }

    /// The chain of hashes of the full blocks of `tokens` (R6).
    pub fn chain(
        &self,
        tokens: &[u32],
        block_size: usize,
        extra_key: Option<&[u8]>,
    ) -> Vec<BlockHash> {
        let mut out = Vec::new();
        self.extend_chain(&mut out, tokens, block_size, extra_key);
        out
    }
}

#[inline]
fn fill(buf: &mut [u8], parent: BlockHash, tokens: &[u32]) {
    buf[..16].copy_from_slice(&parent.0.to_le_bytes());
    for (chunk, token) in buf[16..].chunks_exact_mut(4).zip(tokens) {
        chunk.copy_from_slice(&token.to_le_bytes());
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn chain_is_deterministic_and_prefix_stable() {
        let h = BlockHasher::default();
        let tokens: Vec<u32> = (0..40).collect();
        let a = h.chain(&tokens, 16, None);
        assert_eq!(a.len(), 2);
        assert_eq!(a, h.chain(&tokens[..32], 16, None));
        assert_eq!(a[..1], h.chain(&tokens[..16], 16, None)[..]);
        // The fixed default seed gives fixed hashes across processes and versions.
        assert_eq!(
            a,
            BlockHasher::new(DEFAULT_HASH_SEED).chain(&tokens, 16, None)
        );
    }

    #[test]
    fn extra_key_and_seed_change_everything() {
        let h = BlockHasher::default();
        let tokens = [1u32, 2, 3, 4];
        let plain = h.chain(&tokens, 4, None);
        assert_ne!(plain, h.chain(&tokens, 4, Some(b"")));
        assert_ne!(plain, h.chain(&tokens, 4, Some(b"lora-7")));
        assert_ne!(plain, BlockHasher::new(7).chain(&tokens, 4, None));
    }

    #[test]
    fn parent_changes_the_hash() {
        let h = BlockHasher::default();
        let a = h.chain(&[1, 2, 9, 9], 2, None);
        let b = h.chain(&[3, 4, 9, 9], 2, None);
        assert_ne!(a[1], b[1], "same tokens under different parents differ");
    }

    #[test]
    fn extend_chain_matches_chain_and_long_blocks_work() {
        let h = BlockHasher::default();
        let tokens: Vec<u32> = (0..1200).map(|i| i * 7).collect();
        let mut out = Vec::new();
        h.extend_chain(&mut out, &tokens[..600], 300, None);
        h.extend_chain(&mut out, &tokens, 300, None);
        assert_eq!(out, h.chain(&tokens, 300, None));
    }

    #[test]
    fn debug_bits_truncate() {
        let h = BlockHasher::with_debug_bits(1, 2);
        for x in h.chain(&(0..64).collect::<Vec<_>>(), 4, None) {
            assert!(x.0 < 4);
        }
        let bytes = BlockHash(0x0102).to_bytes();
        assert_eq!(BlockHash::from_bytes(bytes), BlockHash(0x0102));
        assert_eq!(bytes[15], 2);
    }
}

/// The hasher of maps keyed by block hashes: the keys are already uniformly distributed 128-bit
/// hashes, so it only folds them to 64 bits (no mixing).
#[derive(Default)]
pub(crate) struct IdentityHasher(u64);

impl std::hash::Hasher for IdentityHasher {
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

/// A map keyed by raw 128-bit block hashes.
pub(crate) type ByHash<V> =
    std::collections::HashMap<u128, V, std::hash::BuildHasherDefault<IdentityHasher>>;
