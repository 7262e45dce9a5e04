//! KV events for external KV-aware routers (R21), self-describing (docs/events.md):
//! the events of every rank's device cache, of its host cache (R26) and of the remote tier's
//! stores and removals the caller reports, each numbered in its rank's stream and kept in a
//! bounded replay buffer.
//!
//! Invariants:
//! - per rank, the recorded events carry the sequence numbers 1, 2, 3, ... with no gap and no
//!   repeat, in the order they were recorded, whatever their medium;
//! - the replay buffer of a rank holds the last `min(recorded, capacity)` events of that rank,
//!   consecutive numbers ending at the rank's last; `events_since` answers exactly from it;
//! - every event names its medium, group (0: full attention; the rank's other groups 1, 2, ...
//!   in the order of a sequence's tables: the linear-state group's checkpoints, the
//!   sliding-window group's published blocks), dp rank, block size, extra key and parent hash;
//! - a rank with groups besides full attention first announces them, one "group" event each
//!   (full attention as group 0, then its other groups), before any other event of its own;
//! - a sliding-window group's "removed" events follow its "stored" ones per hash (its blocks
//!   that stopped being findable are found when the pool takes its events, `drain_events`, or
//!   when the hash is published again, whichever comes first), and a reset's device "cleared"
//!   covers every group of the rank.

use std::collections::VecDeque;

use crate::error::{ensure_arg, Result};
use crate::hash::BlockHash;
use crate::index::{EventKind, GroupKind, IndexEvent, Medium};
use crate::prefix_cache::{CacheEvent, ExtraKey, PrefixCache};

use super::BlockManagerPool;

/// Events per rank the replay buffer keeps by default.
pub const DEFAULT_EVENT_REPLAY: usize = 4096;

/// Kind of a [`KvEvent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEventKind {
    /// Blocks became matchable.
    Stored,
    /// Blocks left the cache.
    Removed,
    /// The cache was reset.
    Cleared,
    /// The rank has this group (announced once, before its other events, by a rank with groups
    /// besides full attention: an index then asks a hit there for every group's blocks before
    /// the group stored any).
    Group,
}

impl KvEventKind {
    /// "stored", "removed" or "cleared".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::Removed => "removed",
            Self::Cleared => "cleared",
            Self::Group => "group",
        }
    }

    /// The index's kind of the same name.
    pub fn to_index_kind(self) -> EventKind {
        match self {
            Self::Stored => EventKind::Stored,
            Self::Removed => EventKind::Removed,
            Self::Cleared => EventKind::Cleared,
            Self::Group => EventKind::Group,
        }
    }
}

/// A KV event for external KV-aware routers (R21), self-describing (docs/events.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    /// Position in the rank's stream: 1, 2, 3, ... per (pool, dp rank), every medium.
    pub sequence: u64,
    /// What happened.
    pub kind: KvEventKind,
    /// Where the blocks live: the device cache, the host tier or the remote tier.
    pub medium: Medium,
    /// The KV-cache group: 0 full attention, then the rank's other groups in the order of a
    /// sequence's tables (the linear-state checkpoints, R22; the sliding window, R25).
    pub group: u32,
    /// The group's kind (with its window for a sliding window).
    pub group_kind: GroupKind,
    /// The chain hashes of the blocks (R6).
    pub block_hashes: Vec<BlockHash>,
    /// Hash of the parent of the first block; `None` for a chain's first block (and for
    /// "cleared").
    pub parent_hash: Option<BlockHash>,
    /// Tokens of the stored blocks (empty otherwise).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// The rank whose cache it happened in.
    pub dp_rank: usize,
    /// The chain's extra key.
    pub extra_key: Option<ExtraKey>,
}

impl KvEvent {
    fn new(kind: KvEventKind, medium: Medium, block_size: usize, dp_rank: usize) -> Self {
        Self {
            sequence: 0,
            kind,
            medium,
            group: 0,
            group_kind: GroupKind::FullAttention,
            block_hashes: Vec::new(),
            parent_hash: None,
            token_ids: Vec::new(),
            block_size,
            dp_rank,
            extra_key: None,
        }
    }

    fn of_cache(event: CacheEvent, medium: Medium, block_size: usize, rank: usize) -> Self {
        match event {
            CacheEvent::Stored {
                block_hashes,
                parent_hash,
                token_ids,
                extra_key,
            } => Self {
                block_hashes,
                parent_hash,
                token_ids,
                extra_key,
                ..Self::new(KvEventKind::Stored, medium, block_size, rank)
            },
            CacheEvent::Removed {
                block_hashes,
                extra_key,
            } => Self {
                block_hashes,
                extra_key,
                ..Self::new(KvEventKind::Removed, medium, block_size, rank)
            },
            CacheEvent::Cleared => Self::new(KvEventKind::Cleared, medium, block_size, rank),
        }
    }

    /// The same event as a [`crate::KVIndex`] applies it (for the pool's own instance id).
    pub fn to_index_event(&self) -> IndexEvent {
        IndexEvent {
            sequence: Some(self.sequence),
            kind: self.kind.to_index_kind(),
            medium: self.medium,
            // Ranks are below the pool's dp_size, which is far below 2**32.
            dp_rank: self.dp_rank as u32,
            group: self.group,
            group_kind: self.group_kind,
            block_size: self.block_size as u32,
            extra_key: self.extra_key.clone(),
            parent_hash: self.parent_hash,
            block_hashes: self.block_hashes.clone(),
            token_ids: (self.kind == KvEventKind::Stored && !self.token_ids.is_empty())
                .then(|| self.token_ids.clone()),
        }
    }
}

/// The pool's event state: events not yet drained, the next number and the replay buffer of
/// every rank.
pub(crate) struct EventLog {
    pending: Vec<KvEvent>,
    next: Vec<u64>,
    replay: Vec<VecDeque<KvEvent>>,
    capacity: usize,
    /// Whether each rank's groups were announced.
    announced: Vec<bool>,
}

impl EventLog {
    pub(crate) fn new(dp_size: usize, capacity: usize) -> Self {
        Self {
            pending: Vec::new(),
            next: vec![1; dp_size],
            replay: (0..dp_size).map(|_| VecDeque::new()).collect(),
            capacity,
            announced: vec![false; dp_size],
        }
    }

    fn record(&mut self, mut event: KvEvent) {
        let rank = event.dp_rank;
        event.sequence = self.next[rank];
        self.next[rank] += 1;
        if self.capacity > 0 {
            let buffer = &mut self.replay[rank];
            if buffer.len() == self.capacity {
                buffer.pop_front();
            }
            buffer.push_back(event.clone());
        }
        self.pending.push(event);
    }

    fn record_cache(&mut self, cache: &mut PrefixCache, medium: Medium, bs: usize, rank: usize) {
        for event in cache.take_events() {
            self.record(KvEvent::of_cache(event, medium, bs, rank));
        }
    }
}

impl BlockManagerPool {
    /// Moves the events of `rank`'s device and host caches and groups into the pool's list
    /// (R21). Inline: most pools record no events, and every step of theirs asks.
    #[inline]
    pub(crate) fn collect_events(&mut self, rank: usize) {
        if self.events.is_some() {
            self.record_events(rank);
        }
    }

    /// [`Self::collect_events`] of a pool that records events.
    fn record_events(&mut self, rank: usize) {
        let Some(log) = self.events.as_mut() else {
            return;
        };
        let bs = self.config.block_size;
        if !log.announced[rank] {
            // First of the rank's events: its groups, when it has more than full attention.
            log.announced[rank] = true;
            let groups = &self.ranks[rank].groups;
            if !groups.is_empty() {
                log.record(KvEvent::new(KvEventKind::Group, Medium::Device, bs, rank));
            }
            for (position, group) in groups.iter().enumerate() {
                // A window in its own store or in the shared one (R25).
                let window = group
                    .as_window()
                    .map(|w| w.manager().window())
                    .or_else(|| group.as_shared_window().map(|w| w.window()));
                let group_kind = match window {
                    // A window past 2**32 tokens covers any sequence, as the largest u32 does.
                    Some(window) => GroupKind::SlidingWindow {
                        window: u32::try_from(window).unwrap_or(u32::MAX),
                    },
                    None if group.as_linear().is_some() => GroupKind::LinearState,
                    None => continue,
                };
                let mut event = KvEvent::new(KvEventKind::Group, Medium::Device, bs, rank);
                event.group = position as u32 + 1;
                event.group_kind = group_kind;
                log.record(event);
            }
        }
        if let Some(cache) = self.ranks[rank].full.cache_mut() {
            log.record_cache(cache, Medium::Device, bs, rank);
        }
        if let Some(cache) = self.host.as_mut().and_then(|h| h.cache_mut(rank)) {
            log.record_cache(cache, Medium::Host, bs, rank);
        }
        let r = &mut self.ranks[rank];
        // The window groups of the shared store: their attachments' events, from the cache
        // (taken once: each group's are those of its attachment group).
        let attach_events = match r.full.cache_mut() {
            Some(cache) if r.groups.iter().any(|g| g.as_shared_window().is_some()) => {
                cache.take_attach_events()
            }
            _ => Vec::new(),
        };
        for (position, group) in r.groups.iter().enumerate() {
            let Some(shared) = group.as_shared_window() else {
                continue;
            };
            let window = u32::try_from(shared.window()).unwrap_or(u32::MAX);
            for attached in &attach_events {
                if attached.group != shared.attach_group() {
                    continue;
                }
                if attached.event == CacheEvent::Cleared {
                    continue; // the rank's device "cleared" covers every group
                }
                let mut event = KvEvent::of_cache(attached.event.clone(), Medium::Device, bs, rank);
                event.group = position as u32 + 1;
                event.group_kind = GroupKind::SlidingWindow { window };
                log.record(event);
            }
        }
        for (position, group) in self.ranks[rank].groups.iter_mut().enumerate() {
            // Groups after full attention (0), in the order of a sequence's tables.
            let group_index = position as u32 + 1;
            if let Some(window) = group.as_window_mut() {
                let manager = window.manager_mut();
                // A window past 2**32 tokens covers any sequence, as the largest u32 does.
                let window = u32::try_from(manager.window()).unwrap_or(u32::MAX);
                for event in manager.take_events() {
                    let mut event = KvEvent::of_cache(event, Medium::Device, bs, rank);
                    event.group = group_index;
                    event.group_kind = GroupKind::SlidingWindow { window };
                    log.record(event);
                }
                continue;
            }
            // The linear-state group's checkpoints (R22): one block each, under its prefix hash.
            let Some(linear) = group.as_linear_mut() else {
                continue;
            };
            let changes = linear.cache_mut().events.as_mut().map(std::mem::take);
            for (committed, hash) in changes.unwrap_or_default() {
                let kind = if committed {
                    KvEventKind::Stored
                } else {
                    KvEventKind::Removed
                };
                let mut event = KvEvent::new(kind, Medium::Device, bs, rank);
                event.group = group_index;
                event.group_kind = GroupKind::LinearState;
                event.block_hashes.push(hash);
                log.record(event);
            }
        }
    }

    /// Takes the recorded KV events (R21); empty unless `enable_events`. First records the
    /// removals of sliding-window blocks that stopped being findable since the last call
    /// (their last handle drops lock-free, where the pool does not see it).
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        if self.slides && self.events.is_some() {
            for rank in 0..self.ranks.len() {
                for group in &mut self.ranks[rank].groups {
                    if let Some(window) = group.as_window_mut() {
                        window.manager_mut().sweep_events();
                    }
                }
                self.collect_events(rank);
            }
        }
        self.events
            .as_mut()
            .map(|log| std::mem::take(&mut log.pending))
            .unwrap_or_default()
    }

    /// The last sequence number recorded for `rank` (0 before its first event).
    pub fn last_event_sequence(&self, rank: usize) -> Result<u64> {
        self.check_event_rank(rank)?;
        Ok(self.events.as_ref().map_or(0, |log| log.next[rank] - 1))
    }

    /// Replay: `rank`'s events numbered `from` and later, from the bounded buffer (drained or
    /// not), so a consumer that saw a gap (expected `from`) can fill it. `None` when the buffer
    /// no longer reaches back to `from` (the consumer resyncs from scratch: drops the rank's
    /// entries and applies what comes next). Numbers start at 1, so `from` 0 asks the same as
    /// 1: every event, which the buffer answers while it has dropped none. `from` past the
    /// next number is an `InvalidArgument`; without `enable_events` there is nothing to
    /// replay (an empty list).
    pub fn events_since(&self, rank: usize, from: u64) -> Result<Option<Vec<KvEvent>>> {
        self.check_event_rank(rank)?;
        // No event is numbered 0: "from 0" loses nothing that "from 1" does not.
        let from = from.max(1);
        let Some(log) = self.events.as_ref() else {
            ensure_arg!(
                from <= 1,
                "sequence",
                "must be <= 1 (no events), got {from}"
            );
            return Ok(Some(Vec::new()));
        };
        let next = log.next[rank];
        ensure_arg!(
            from <= next,
            "sequence",
            "must be <= {next} (the next event of dp rank {rank}), got {from}"
        );
        let buffer = &log.replay[rank];
        let oldest = buffer.front().map_or(next, |e| e.sequence);
        if from < oldest {
            return Ok(None);
        }
        // Numbers in the buffer are consecutive: `from` sits at offset from - oldest.
        let skip = (from - oldest) as usize;
        Ok(Some(buffer.iter().skip(skip).cloned().collect()))
    }

    /// Records the remote tier's stores or removals of `rank`'s blocks (`hashes`, chain hashes
    /// as the tier's keys) as remote-medium events in the rank's stream: the pool does no I/O,
    /// so the caller (`kvpool.tiers.remote_transfer.RemoteTransfer`) reports what it wrote or
    /// found missing.
    /// Hashes are grouped into events of consecutive chain blocks; each event's parent, tokens
    /// and extra key come from the rank's host or device cache where the block is known there
    /// (else no parent and no tokens). Returns the events recorded (0 without `enable_events`).
    pub fn record_remote_events(
        &mut self,
        rank: usize,
        kind: KvEventKind,
        hashes: &[BlockHash],
    ) -> Result<usize> {
        self.check_event_rank(rank)?;
        ensure_arg!(
            kind != KvEventKind::Cleared,
            "kind",
            "must be 'stored' or 'removed' (a remote tier is never cleared by a pool)"
        );
        let bs = self.config.block_size;
        let host = self.host.as_ref().and_then(|h| h.cache(rank));
        let device = self.ranks[rank].full.cache();
        let Some(log) = self.events.as_mut() else {
            return Ok(0);
        };
        let describe = |h: BlockHash| {
            host.and_then(|c| c.describe(h))
                .or_else(|| device.and_then(|c| c.describe(h)))
        };
        let mut events: Vec<KvEvent> = Vec::new();
        for &hash in hashes {
            let block = describe(hash);
            let parent = block.as_ref().and_then(|b| b.parent_hash);
            let extends = parent.is_some()
                && events
                    .last()
                    .is_some_and(|e| e.block_hashes.last() == parent.as_ref());
            if !extends {
                let mut event = KvEvent::new(kind, Medium::Remote, bs, rank);
                event.parent_hash = parent;
                event.extra_key = block.as_ref().and_then(|b| b.extra_key.clone());
                events.push(event);
            }
            let Some(event) = events.last_mut() else {
                continue; // pushed above: unreachable
            };
            event.block_hashes.push(hash);
            if kind == KvEventKind::Stored {
                // Tokens for every block of the event or for none.
                match &block {
                    Some(b) if event.token_ids.len() == (event.block_hashes.len() - 1) * bs => {
                        event.token_ids.extend_from_slice(&b.token_ids)
                    }
                    _ => event.token_ids.clear(),
                }
            }
        }
        let n = events.len();
        for event in events {
            log.record(event);
        }
        Ok(n)
    }

    fn check_event_rank(&self, rank: usize) -> Result<()> {
        ensure_arg!(
            rank < self.ranks.len(),
            "dp_rank",
            "must be < dp_size ({}), got {rank}",
            self.ranks.len()
        );
        Ok(())
    }
}
