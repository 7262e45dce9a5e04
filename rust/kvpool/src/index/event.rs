//! The index's event record: one self-describing KV event, as a pool (or a reader of another
//! engine's events) hands it to a [`crate::KVIndex`].
//!
//! Every event says where it happened (dp rank, medium, KV-cache group with its kind and
//! window, block size) and where it sits in its source's stream (`sequence`), so that an
//! index needs no side channel to interpret it (docs/events.md).
//!
//! Invariants checked by [`IndexEvent::validate`] (the index rejects a batch holding an event
//! that breaks one, and changes nothing):
//! - `block_size >= 1`; a sliding window is `>= 1` token;
//! - `token_ids`, when given on a stored event, hold exactly `block_size` tokens per block;
//! - no block is its own parent (`parent_hash` differs from the first hash, and consecutive
//!   hashes differ), so the chains an index builds have no cycles of length one;
//! - a group index is below [`MAX_GROUPS`];
//! - a "group" event carries no blocks and no parent.

use crate::error::{ensure_arg, Result};
use crate::hash::BlockHash;
use crate::prefix_cache::ExtraKey;

/// Groups one location can hold (`group` of an event is in `0..MAX_GROUPS`); one more bit of
/// the index's per-entry mask marks a speculative entry.
pub const MAX_GROUPS: u32 = 31;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// The blocks became matchable at the event's location.
    Stored,
    /// The blocks left the event's location.
    Removed,
    /// Everything of the event's (instance, dp rank, medium) was dropped.
    Cleared,
    /// The location has the event's group (index, kind and window), announced up front: an
    /// index then counts it in every hit there before the group stores anything, so that a
    /// linear-state group with no checkpoint yet admits no hit (no blocks, no parent).
    Group,
}

impl EventKind {
    /// "stored", "removed", "cleared" or "group".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::Removed => "removed",
            Self::Cleared => "cleared",
            Self::Group => "group",
        }
    }

    /// The kind named `name` (the inverse of [`EventKind::as_str`]).
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "stored" => Ok(Self::Stored),
            "removed" => Ok(Self::Removed),
            "cleared" => Ok(Self::Cleared),
            "group" => Ok(Self::Group),
            other => Err(crate::KvPoolError::invalid(
                "kind",
                format!("must be 'stored', 'removed', 'cleared' or 'group', got {other:?}"),
            )),
        }
    }
}

/// Where the KV of a block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// Accelerator memory (the pool's blocks).
    Device,
    /// Pinned host memory (the host tier, R26).
    Host,
    /// A remote tier shared by instances (Redis, Mooncake store, ...).
    Remote,
}

impl Medium {
    /// Every medium, in the order of their codes.
    pub const ALL: [Medium; 3] = [Medium::Device, Medium::Host, Medium::Remote];

    /// "device", "host" or "remote".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Device => "device",
            Self::Host => "host",
            Self::Remote => "remote",
        }
    }

    /// The medium named `name` (the inverse of [`Medium::as_str`]).
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "device" => Ok(Self::Device),
            "host" => Ok(Self::Host),
            "remote" => Ok(Self::Remote),
            other => Err(crate::KvPoolError::invalid(
                "medium",
                format!("must be 'device', 'host' or 'remote', got {other:?}"),
            )),
        }
    }

    /// Its one-byte code in dumps (0, 1, 2).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The medium of code `code`.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }
}

/// The kind of a KV-cache group, which decides which blocks a prefix hit needs from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupKind {
    /// Full attention: a hit of `n` blocks needs blocks `0..n`.
    FullAttention,
    /// Sliding window of `window` tokens: a hit of `n` blocks needs only the blocks holding
    /// the last `window - 1` tokens before position `n * block_size`.
    SlidingWindow {
        /// The window in tokens.
        window: u32,
    },
    /// Linear (recurrent) state, e.g. Mamba / GDN: a hit of `n` blocks needs a state
    /// checkpoint at the end of block `n - 1`, stored under that block's hash.
    LinearState,
}

impl GroupKind {
    /// "full_attention", "sliding_window" or "linear_state".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FullAttention => "full_attention",
            Self::SlidingWindow { .. } => "sliding_window",
            Self::LinearState => "linear_state",
        }
    }

    /// The window of a sliding-window group, else `None`.
    pub fn window(self) -> Option<u32> {
        match self {
            Self::SlidingWindow { window } => Some(window),
            _ => None,
        }
    }

    /// The kind named `name`; `window` is required for (and only allowed with)
    /// "sliding_window".
    pub fn parse(name: &str, window: Option<u32>) -> Result<Self> {
        match (name, window) {
            ("full_attention", None) => Ok(Self::FullAttention),
            ("linear_state", None) => Ok(Self::LinearState),
            ("sliding_window", Some(window)) => Ok(Self::SlidingWindow { window }),
            ("sliding_window", None) => Err(crate::KvPoolError::invalid(
                "sliding_window",
                "required for group_kind 'sliding_window'",
            )),
            ("full_attention" | "linear_state", Some(_)) => Err(crate::KvPoolError::invalid(
                "sliding_window",
                format!("only for group_kind 'sliding_window', not {name:?}"),
            )),
            (other, _) => Err(crate::KvPoolError::invalid(
                "group_kind",
                format!(
                    "must be 'full_attention', 'sliding_window' or 'linear_state', got {other:?}"
                ),
            )),
        }
    }

    /// Its one-byte code in dumps.
    pub(crate) fn code(self) -> u8 {
        match self {
            Self::FullAttention => 0,
            Self::SlidingWindow { .. } => 1,
            Self::LinearState => 2,
        }
    }

    /// The kind of code `code` (window used for sliding windows only).
    pub(crate) fn from_code(code: u8, window: u32) -> Option<Self> {
        match code {
            0 => Some(Self::FullAttention),
            1 => Some(Self::SlidingWindow { window }),
            2 => Some(Self::LinearState),
            _ => None,
        }
    }

    /// Whether a hit under this group may skip blocks (sliding window, linear state).
    pub fn is_gapped(self) -> bool {
        !matches!(self, Self::FullAttention)
    }
}

/// One KV event of one source (an instance's pool at one dp rank).
#[derive(Clone, Debug, PartialEq)]
pub struct IndexEvent {
    /// Position in the source's stream. Numbers are gap-free and non-decreasing per
    /// (instance, dp rank): each publication unit (a kvpool event, a vLLM batch) takes the
    /// previous number plus one and its events share it. `None`: an unsequenced event,
    /// applied without gap detection.
    pub sequence: Option<u64>,
    /// Whether the blocks were stored or removed.
    pub kind: EventKind,
    /// Where the blocks live: device, host or remote.
    pub medium: Medium,
    /// The data-parallel rank inside the instance.
    pub dp_rank: u32,
    /// The KV-cache group's index in its instance (0 for a model with one group).
    pub group: u32,
    /// The kind of block group the blocks belong to.
    pub group_kind: GroupKind,
    /// Tokens per block of that group.
    pub block_size: u32,
    /// The chains' extra key (cache salt, LoRA, namespace), informational: the hashes are
    /// already rooted at it (R6).
    pub extra_key: Option<ExtraKey>,
    /// Hash of the parent of the first block; `None` for a chain's first block.
    pub parent_hash: Option<BlockHash>,
    /// Chained hashes of consecutive blocks, parent first (empty for "cleared").
    pub block_hashes: Vec<BlockHash>,
    /// Tokens of the stored blocks, when the source sends them.
    pub token_ids: Option<Vec<u32>>,
}

impl IndexEvent {
    /// A stored event of group 0 (full attention) on the device, unsequenced.
    pub fn stored(
        block_size: u32,
        parent_hash: Option<BlockHash>,
        block_hashes: Vec<BlockHash>,
    ) -> Self {
        Self {
            sequence: None,
            kind: EventKind::Stored,
            medium: Medium::Device,
            dp_rank: 0,
            group: 0,
            group_kind: GroupKind::FullAttention,
            block_size,
            extra_key: None,
            parent_hash,
            block_hashes,
            token_ids: None,
        }
    }

    /// A removed event of group 0 (full attention) on the device, unsequenced.
    pub fn removed(block_size: u32, block_hashes: Vec<BlockHash>) -> Self {
        Self {
            kind: EventKind::Removed,
            ..Self::stored(block_size, None, block_hashes)
        }
    }

    /// A cleared event of the device, unsequenced.
    pub fn cleared(block_size: u32) -> Self {
        Self {
            kind: EventKind::Cleared,
            ..Self::stored(block_size, None, Vec::new())
        }
    }

    /// This event with sequence number `sequence`.
    pub fn with_sequence(mut self, sequence: u64) -> Self {
        self.sequence = Some(sequence);
        self
    }

    /// This event at `medium`.
    pub fn with_medium(mut self, medium: Medium) -> Self {
        self.medium = medium;
        self
    }

    /// This event at dp rank `dp_rank`.
    pub fn with_dp_rank(mut self, dp_rank: u32) -> Self {
        self.dp_rank = dp_rank;
        self
    }

    /// This event of group `group` of kind `kind`.
    pub fn with_group(mut self, group: u32, kind: GroupKind) -> Self {
        self.group = group;
        self.group_kind = kind;
        self
    }

    /// Checks the invariants of the module doc; `Err(InvalidArgument)` names the field.
    pub fn validate(&self) -> Result<()> {
        ensure_arg!(self.block_size >= 1, "block_size", "must be >= 1, got 0");
        ensure_arg!(
            self.group < MAX_GROUPS,
            "group",
            "must be < {MAX_GROUPS}, got {}",
            self.group
        );
        if let GroupKind::SlidingWindow { window } = self.group_kind {
            ensure_arg!(window >= 1, "sliding_window", "must be >= 1, got 0");
        }
        if self.kind == EventKind::Stored {
            if let Some(tokens) = &self.token_ids {
                let expected = self.block_hashes.len() as u64 * u64::from(self.block_size);
                ensure_arg!(
                    tokens.len() as u64 == expected,
                    "token_ids",
                    "must hold block_size * len(block_hashes) = {expected} tokens, got {}",
                    tokens.len()
                );
            }
        }
        if self.kind == EventKind::Group {
            ensure_arg!(
                self.block_hashes.is_empty(),
                "block_hashes",
                "must be empty for a 'group' event, got {} hashes",
                self.block_hashes.len()
            );
            ensure_arg!(
                self.parent_hash.is_none(),
                "parent_hash",
                "must be None for a 'group' event"
            );
        }
        let mut parent = self.parent_hash;
        for &hash in &self.block_hashes {
            ensure_arg!(
                parent != Some(hash),
                "block_hashes",
                "block {hash:?} is its own parent"
            );
            parent = Some(hash);
        }
        Ok(())
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in [
            EventKind::Stored,
            EventKind::Removed,
            EventKind::Cleared,
            EventKind::Group,
        ] {
            assert_eq!(EventKind::parse(kind.as_str()), Ok(kind));
        }
        for medium in Medium::ALL {
            assert_eq!(Medium::parse(medium.as_str()), Ok(medium));
            assert_eq!(Medium::from_code(medium.code()), Some(medium));
        }
        for kind in [
            GroupKind::FullAttention,
            GroupKind::SlidingWindow { window: 128 },
            GroupKind::LinearState,
        ] {
            assert_eq!(GroupKind::parse(kind.as_str(), kind.window()), Ok(kind));
            assert_eq!(
                GroupKind::from_code(kind.code(), kind.window().unwrap_or(0)),
                Some(kind)
            );
        }
        assert!(EventKind::parse("evicted").is_err());
        assert!(Medium::parse("disk").is_err());
        assert!(GroupKind::parse("sliding_window", None).is_err());
        assert!(GroupKind::parse("full_attention", Some(3)).is_err());
    }

    #[test]
    fn validate_names_the_field() {
        let h = |x| BlockHash(x);
        let ok = IndexEvent::stored(4, None, vec![h(1), h(2)]);
        assert_eq!(ok.validate(), Ok(()));
        let field = |e: IndexEvent| match e.validate() {
            Err(crate::KvPoolError::InvalidArgument { name, .. }) => name,
            other => panic!("expected an invalid argument, got {other:?}"),
        };
        assert_eq!(field(IndexEvent::stored(0, None, vec![])), "block_size");
        assert_eq!(
            field(ok.clone().with_group(31, GroupKind::FullAttention)),
            "group"
        );
        assert_eq!(
            field(
                ok.clone()
                    .with_group(1, GroupKind::SlidingWindow { window: 0 })
            ),
            "sliding_window"
        );
        let mut tokens = ok.clone();
        tokens.token_ids = Some(vec![0; 7]);
        assert_eq!(field(tokens), "token_ids");
        assert_eq!(
            field(IndexEvent::stored(4, Some(h(1)), vec![h(1)])),
            "block_hashes"
        );
        assert_eq!(
            field(IndexEvent::stored(4, None, vec![h(1), h(1)])),
            "block_hashes"
        );
    }
}
