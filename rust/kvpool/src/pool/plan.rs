//! What a plan is: the table extent an allocation asks for, and the [`AllocationPlan`]
//! `BlockManagerPool::plan` returns (a growth, or an admission's survey and decision; see
//! `admission.rs`), with the figures a scheduler reads from it.
//!
//! Invariants: a plan names the pool generation, sequence and extent it was made for; an
//! admission's decision never takes more than its survey found.

use crate::error::Result;
use crate::groups::{Miss, Walk};
use crate::hash::BlockHash;
use crate::sequence::Sequence;
use crate::tiers::HostPart;

/// How many tokens an allocation's table holds (R14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableExtent {
    /// `allocate(seq, num_tokens)`: this many tokens, in `1..=len(seq)` (and at least the hit).
    Tokens(usize),
    /// `allocate(seq, num_new_tokens=n)`: the computed tokens after the match (the hit over
    /// every tier; on an allocated sequence its `num_computed_tokens`) plus `n >= 1`, at most
    /// `len(seq)`: a chunked prefill's chunk sized without planning first.
    NewTokens(usize),
}

impl TableExtent {
    /// `num_tokens` (`None`: `len(seq)`) or `num_new_tokens`; both given is an error naming
    /// `num_new_tokens`.
    pub fn from_args(
        num_tokens: Option<usize>,
        num_new_tokens: Option<usize>,
    ) -> Result<Option<Self>> {
        match (num_tokens, num_new_tokens) {
            (Some(_), Some(_)) => Err(crate::error::KvPoolError::invalid(
                "num_new_tokens",
                "give num_tokens or num_new_tokens, not both",
            )),
            (n, None) => Ok(n.map(Self::Tokens)),
            (None, Some(n)) => Ok(Some(Self::NewTokens(n))),
        }
    }

    /// Tokens the table holds for a sequence of `len` tokens with `base` computed tokens.
    pub(super) fn tokens(self, len: usize, base: usize) -> usize {
        match self {
            Self::Tokens(n) => n,
            Self::NewTokens(n) => base.saturating_add(n).min(len),
        }
    }
}

/// An allocation decided by [`BlockManagerPool::plan`], with no side effect (see the module
/// doc). Pass it to [`BlockManagerPool::allocate_planned`] to carry it out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationPlan {
    pub(super) pool: u64,
    pub(super) generation: u64,
    pub(super) seq: u64,
    pub(super) seq_len: usize,
    /// The call's extent, and the tokens it resolved to.
    pub(super) extent: TableExtent,
    pub(super) num_tokens: usize,
    pub(super) block_size: usize,
    pub(super) rank: usize,
    pub(super) kind: Kind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// The sequence holds blocks: its tables grow by `need` blocks.
    Grow { need: usize, entries: usize },
    /// A first allocation.
    Admit(Survey, Decision),
}

/// The walks of an admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Survey {
    /// Full blocks looked up (R8: at least one token is left to compute).
    pub(super) query: usize,
    pub(super) device: Walk,
    /// The host walk, when there is a host tier and the device walk stopped short of `query`.
    pub(super) host: Option<Walk>,
}

/// What an admission takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Decision {
    /// Blocks of the hit after the groups' limits (device, host and remote parts).
    pub(super) hit: usize,
    /// Device blocks the hit retains.
    pub(super) device_hit: usize,
    /// The host (and remote) part, loaded into fresh table entries.
    pub(super) host: Option<HostPart>,
    /// Table entries after the allocation.
    pub(super) entries: usize,
    /// Prefix hash of the checkpoint the linear state is restored from.
    pub(super) restore: Option<BlockHash>,
    /// The group that cut the hit short of the prompt, and why.
    pub(super) miss: Option<Miss>,
}

impl AllocationPlan {
    /// The dp rank the sequence goes (or is) to (R13).
    pub fn dp_rank(&self) -> usize {
        self.rank
    }

    /// Tokens the table will hold (`num_tokens` of the call, or what `num_new_tokens` resolved
    /// to).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Whether the sequence already holds blocks (the plan grows its table).
    pub fn is_growth(&self) -> bool {
        matches!(self.kind, Kind::Grow { .. })
    }

    pub(super) fn decision(&self) -> Option<&Decision> {
        match &self.kind {
            Kind::Admit(_, d) => Some(d),
            Kind::Grow { .. } => None,
        }
    }

    /// Blocks of the prefix hit, every tier together (what the sequence counts as cached once
    /// its loads are confirmed); 0 for a growth.
    pub fn num_cached_blocks(&self) -> usize {
        self.decision().map_or(0, |d| d.hit)
    }

    /// [`Self::num_cached_blocks`] in tokens.
    pub fn num_cached_tokens(&self) -> usize {
        self.num_cached_blocks() * self.block_size
    }

    /// Hit blocks already on the device (retained, counted as cached at allocation).
    pub fn device_hit_blocks(&self) -> usize {
        self.decision().map_or(0, |d| d.device_hit)
    }

    /// Hit blocks loaded from the host tier and from the remote tier (through host staging).
    pub(super) fn tier_split(&self) -> (usize, usize) {
        match self.decision() {
            Some(Decision {
                device_hit,
                host: Some(part),
                ..
            }) => {
                let host_end = part.host_end.min(part.end).max(*device_hit);
                (host_end - device_hit, part.end - host_end)
            }
            _ => (0, 0),
        }
    }

    /// Blocks of the prefix the full-attention caches hold (device and host walks, R8
    /// applied): the hit the full-attention group alone could serve, before the other groups'
    /// limits (what the groups cost, docs/hybrid.md "Why no hit"); 0 for a growth.
    pub fn num_kv_hit_blocks(&self) -> usize {
        self.local_reach().map_or(0, |(_, reach)| reach)
    }

    /// Hit blocks loaded from the host tier.
    pub fn host_hit_blocks(&self) -> usize {
        self.tier_split().0
    }

    /// Hit blocks fetched from the remote tier (then loaded from host).
    pub fn remote_hit_blocks(&self) -> usize {
        self.tier_split().1
    }

    /// Fresh device blocks the allocation takes (load destinations included).
    pub fn num_new_blocks(&self) -> usize {
        match &self.kind {
            Kind::Grow { need, .. } => *need,
            Kind::Admit(_, d) => d.entries.saturating_sub(d.device_hit),
        }
    }

    /// Entries of the full-attention table after the allocation.
    pub fn num_blocks(&self) -> usize {
        match &self.kind {
            Kind::Grow { entries, .. } => *entries,
            Kind::Admit(_, d) => d.entries.max(d.device_hit),
        }
    }

    /// The prefix hash of the checkpoint the linear state is restored from (R23), if any.
    pub fn restore_checkpoint(&self) -> Option<BlockHash> {
        self.decision().and_then(|d| d.restore)
    }

    /// Why the hit stops short of the prompt: the group that cut it and the reason
    /// (docs/hybrid.md "Why no hit"); `None` for a full hit, a growth, or a pool without a
    /// prefix cache.
    pub fn miss(&self) -> Option<Miss> {
        self.decision().and_then(|d| d.miss)
    }

    /// The full blocks looked up and how far the device and host walks reached.
    pub(crate) fn local_reach(&self) -> Option<(usize, usize)> {
        match &self.kind {
            Kind::Admit(survey, _) => {
                let host = survey.host.as_ref().map_or(0, Walk::len);
                Some((survey.query, host.max(survey.device.len())))
            }
            Kind::Grow { .. } => None,
        }
    }

    /// Whether the plan was made for this very sequence object at its current length.
    pub(crate) fn is_for(&self, seq: &Sequence) -> bool {
        self.seq == seq.uid() && self.seq_len == seq.len()
    }
}
