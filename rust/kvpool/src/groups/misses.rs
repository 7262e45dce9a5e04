//! Why no hit (docs/hybrid.md): which group cut an admission's prefix hit short of the whole
//! prompt, and why. `plan()` reports it per request; `stats()` counts it per group and reason
//! (what vLLM #54607 asks for: a miss below the block floor, an evicted prefix and a missing
//! checkpoint are different problems with different cures).
//!
//! The cut is decided from the plan's walks, with no side effect: the full-attention group cuts
//! where its chain ends (the prompt has no full block to look up, the next block was evicted, or
//! it was never cached); another group cuts below that when it cannot serve the boundary the
//! full-attention group reached (a window run gone, no checkpoint at or below it).

/// Why an admission's hit stops short of the prompt's last full block (R8 aside).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MissReason {
    /// The prompt has no full block before its last token (nothing to look up).
    ShorterThanBlock,
    /// The cache never held the next block of the chain (or forgot its eviction).
    NoSharedPrefix,
    /// The next block of the chain was evicted.
    Evicted,
    /// A sliding-window group lacks a block of the run the boundary needs (R25).
    WindowBlocksGone,
    /// The linear-state group has no checkpoint at the boundary or below it (R23).
    NoCheckpoint,
}

impl MissReason {
    /// Every reason, in the order of [`Self::index`].
    pub const ALL: [MissReason; 5] = [
        Self::ShorterThanBlock,
        Self::NoSharedPrefix,
        Self::Evicted,
        Self::WindowBlocksGone,
        Self::NoCheckpoint,
    ];

    /// "shorter_than_block", "no_shared_prefix", "evicted", "window_blocks_gone" or
    /// "no_checkpoint".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ShorterThanBlock => "shorter_than_block",
            Self::NoSharedPrefix => "no_shared_prefix",
            Self::Evicted => "evicted",
            Self::WindowBlocksGone => "window_blocks_gone",
            Self::NoCheckpoint => "no_checkpoint",
        }
    }

    /// Position in [`Self::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The group that cut an admission's hit and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Miss {
    /// The group: 0 full attention, then the rank's other groups in the order of a sequence's
    /// tables.
    pub group: usize,
    /// Why.
    pub reason: MissReason,
}

/// Admissions per reason (R20's `misses`), summed over a rank's groups: each reason belongs to
/// one group kind (the first three to full attention).
pub(crate) type MissCounts = [u64; MissReason::ALL.len()];
