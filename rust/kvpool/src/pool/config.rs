//! [`PoolConfig`]: the options of a pool, their validation (R29: every error names its
//! argument) and the ranks they build.

use crate::alloc;
use crate::block::BlockStore;
use crate::error::{ensure_arg, Result};
use crate::groups::{FullGroup, Group, LinearGroup, SharedWindowGroup, WindowGroup, WindowKind};
use crate::hash::BlockHasher;
use crate::linear_state::LinearStatePrefixCache;
use crate::manager::{BlockManagerImpl, ManagerConfig, SingleBlockManager};
use crate::prefix_cache::{
    AttachConfig, Eviction, PrefixCache, DEFAULT_PROTECTED_PERCENT, MAX_ATTACH_GROUPS,
};
use crate::sliding_window::SlidingWindowBlockManager;
use crate::tiers::HostTierConfig;
use crate::xtensor::{PageBackend, XTensorBlockManager};

pub use crate::groups::{LinearStateMatch, LinearStateSave};

/// Default of [`PoolConfig::retention_tokens`]: a conversation's next turn resends it and
/// diverges within its last few hundred tokens (its last, re-templated message); requests part
/// after their system prompt, within the first few hundred.
pub const DEFAULT_RETENTION_TOKENS: usize = 512;

use super::elastic::{PageBackendKind, XTensorOptions};
use super::Rank;

/// Options of a [`super::BlockManagerPool`].
#[derive(Clone, Copy, Debug)]
pub struct PoolConfig {
    /// Block ids per rank, padding block included.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Data-parallel ranks.
    pub dp_size: usize,
    /// Keep a prefix cache per rank.
    pub enable_prefix_cache: bool,
    /// Single blocks per rank, padding included (default: `num_blocks`).
    pub num_single_blocks: Option<usize>,
    /// Hasher (seed) of the chains.
    pub hasher: BlockHasher,
    /// Record KV events (R21).
    pub enable_events: bool,
    /// Events per rank the replay buffer keeps (`events_since`); 0: none.
    pub event_replay: usize,
    /// Recurrent-state slots per rank, padding slot 0 included; 0 disables linear state (R22).
    pub linear_state_slots: usize,
    /// Save a checkpoint every this many computed tokens (a multiple of `block_size`), besides
    /// the prompt's last block boundary (R24). `None`: only that boundary.
    pub checkpoint_interval: Option<usize>,
    /// How a KV prefix hit is trimmed to checkpointed boundaries (R23).
    pub linear_state_match: LinearStateMatch,
    /// How a checkpoint is saved (R22).
    pub linear_state_save: LinearStateSave,
    /// Blocks of the full-attention group's store one recurrent state takes (docs/hybrid.md
    /// "Linear state in the one store"): the states then draw their memory from that store,
    /// `linear_state_blocks` blocks per slot in use, and `linear_state_slots` caps the slots
    /// (the rows of the engine's state tensor). 0 (the default): the slots are a store of
    /// their own.
    pub linear_state_blocks: usize,
    /// Bytes of one block of the store across the layers of one group (a full-attention
    /// block's K and V); 0: unknown. `memory()` reports bytes with it.
    pub block_bytes: u64,
    /// Sliding window in tokens of the second group (R25); `None`: one full-attention group.
    pub sliding_window: Option<usize>,
    /// Chunked local attention in tokens (Llama 4's `attention_chunk_size`), in place of
    /// `sliding_window`: the window groups' query at position `p` reads the tokens from its
    /// chunk's start `p - p % chunk`, so a hit at a boundary needs the group's blocks from that
    /// chunk's start only (none at a chunk's end). A multiple of `block_size`; needs the shared
    /// store. `None`: the window groups are sliding windows.
    pub attention_chunk_size: Option<usize>,
    /// Recurrent-state groups in the shared store, in place of window groups (vLLM's Mamba
    /// groups in "align" mode, docs/hybrid.md "State groups"): each block of such a group holds
    /// the state at its end boundary once a step ended there; a step's state moves to the block
    /// of its last token, copied by the engine from the previous one; a hit at a boundary needs
    /// the one block before it. 0 (the default): none. At most 8; needs the shared store.
    pub state_groups: usize,
    /// Groups of `sliding_window` in the shared store (vLLM's several window groups of one
    /// spec, e.g. Gemma 3's five window layers per full one): each has a table of its own, its
    /// ids from the one store, and attaches its blocks to the full-attention tree on its own.
    /// 1 (the default) unless the store is shared; at most 8.
    pub window_groups: usize,
    /// Block ids per rank of a sliding-window group with its own store, padding included.
    /// `None` (the default): the window group draws from the full-attention group's store (one
    /// free list and id space, `num_blocks` ids in all), unless `shared_blocks` says otherwise.
    pub swa_num_blocks: Option<usize>,
    /// Whether the sliding-window group shares the full-attention group's store (R25, docs/hybrid.md
    /// "One block store"); `None`: shared unless `swa_num_blocks`, `xtensor` or a host tier is
    /// given.
    pub shared_blocks: Option<bool>,
    /// With a shared store: the tokens at the head of every chain and before a released
    /// sequence's last computed full block whose boundaries keep their window runs longest
    /// (the retention rule, docs/hybrid.md).
    pub retention_tokens: usize,
    /// A host tier per rank (R26); `None`: the device only.
    pub host: Option<HostTierConfig>,
    /// Full-attention blocks of every rank on elastic pages (`XTensorBlockManager`, xLLM's
    /// `enable_xtensor`); `None`: fixed memory.
    pub xtensor: Option<XTensorOptions>,
    /// Dedup on publish (R9 revised): a computed duplicate of a cached block switches to the
    /// cached copy. `false`: first writer wins, as at the physical level.
    pub dedup: bool,
    /// How the prefix cache orders what it may evict (`prefix_cache/policy.rs`, R11a): LRU by
    /// default.
    pub eviction: Eviction,
    /// The share of the blocks, in percent, SLRU's protected segment may hold (`"slru"`,
    /// `"ghost_slru"`; R11a).
    pub protected_percent: usize,
    /// The most of a rank's blocks session hints may hold (`retain`), in [0, 1].
    pub max_retained_fraction: f64,
}

impl PoolConfig {
    /// Defaults of the host tier (R26, docs/host_tier.md).
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            num_blocks,
            block_size,
            dp_size: 1,
            enable_prefix_cache: true,
            num_single_blocks: None,
            hasher: BlockHasher::default(),
            enable_events: false,
            event_replay: super::DEFAULT_EVENT_REPLAY,
            linear_state_slots: 0,
            checkpoint_interval: None,
            linear_state_match: LinearStateMatch::Deepest,
            linear_state_save: LinearStateSave::Copy,
            linear_state_blocks: 0,
            block_bytes: 0,
            sliding_window: None,
            attention_chunk_size: None,
            window_groups: 1,
            state_groups: 0,
            swa_num_blocks: None,
            shared_blocks: None,
            retention_tokens: DEFAULT_RETENTION_TOKENS,
            host: None,
            xtensor: None,
            dedup: true,
            eviction: Eviction::Lru,
            protected_percent: DEFAULT_PROTECTED_PERCENT,
            max_retained_fraction: 0.5,
        }
    }

    fn manager(&self) -> ManagerConfig {
        ManagerConfig {
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            enable_prefix_cache: self.enable_prefix_cache,
            hasher: self.hasher,
        }
    }

    fn num_single(&self) -> usize {
        self.num_single_blocks.unwrap_or(self.num_blocks)
    }

    /// The window groups' window in tokens: `sliding_window`, or the chunk of
    /// `attention_chunk_size` (the most tokens before a query it reads, plus one).
    pub fn window(&self) -> Option<usize> {
        // (a state group reads the block of the token before a query: a window of two tokens)
        self.sliding_window
            .or(self.attention_chunk_size)
            .or((self.state_groups > 0).then_some(2))
    }

    /// The groups of the shared store beside full attention: `state_groups` or `window_groups`.
    pub fn num_window_groups(&self) -> usize {
        if self.state_groups > 0 {
            self.state_groups
        } else {
            self.window_groups
        }
    }

    /// What the groups beside full attention are.
    fn window_kind(&self) -> WindowKind {
        match (self.state_groups > 0, self.attention_chunk_size.is_some()) {
            (true, _) => WindowKind::State,
            (false, true) => WindowKind::Chunked,
            (false, false) => WindowKind::Sliding,
        }
    }

    fn swa_blocks(&self) -> usize {
        self.swa_num_blocks.unwrap_or(self.num_blocks)
    }

    /// Whether the sliding-window group draws from the full-attention group's store: by
    /// default when nothing sizes or places the window group on its own (`swa_num_blocks`,
    /// `xtensor`) and there is no host tier (with one, a window store of its own keeps the runs
    /// of the chains whose full-attention blocks went to the host: docs/host_tier.md).
    pub fn shares_window_store(&self) -> bool {
        self.window().is_some()
            && self.shared_blocks.unwrap_or(
                self.swa_num_blocks.is_none() && self.xtensor.is_none() && self.host.is_none(),
            )
    }

    /// Checks every option (each error names its argument) and the footprint of every rank in
    /// one request (F1), before anything is sized by them.
    pub(crate) fn validate(&self) -> Result<()> {
        ensure_arg!(
            self.dp_size >= 1,
            "dp_size",
            "must be at least 1, got {}",
            self.dp_size
        );
        ensure_arg!(
            self.dp_size <= 1024,
            "dp_size",
            "must be at most 1024, got {}",
            self.dp_size
        );
        self.manager().validate()?;
        ensure_arg!(
            self.linear_state_slots != 1,
            "linear_state_slots",
            "must be 0 (off) or at least 2 (slot 0 is padding), got 1"
        );
        if let Some(interval) = self.checkpoint_interval {
            ensure_arg!(
                self.linear_state_slots > 0,
                "checkpoint_interval",
                "needs linear_state_slots > 0"
            );
            ensure_arg!(
                interval >= self.block_size && interval % self.block_size == 0,
                "checkpoint_interval",
                "must be a positive multiple of block_size {}, got {interval}",
                self.block_size
            );
        }
        ensure_arg!(
            (0.0..=1.0).contains(&self.max_retained_fraction),
            "max_retained_fraction",
            "must be in [0, 1], got {}",
            self.max_retained_fraction
        );
        if self.linear_state_blocks > 0 {
            ensure_arg!(
                self.linear_state_slots > 0,
                "linear_state_blocks",
                "needs linear_state_slots > 0"
            );
            ensure_arg!(
                self.linear_state_blocks < self.num_blocks,
                "linear_state_blocks",
                "must be below num_blocks {} (one state must fit in the store), got {}",
                self.num_blocks,
                self.linear_state_blocks
            );
            ensure_arg!(
                self.xtensor.is_none(),
                "linear_state_blocks",
                "is not supported with xtensor (elastic pages hold full attention only)"
            );
        }
        // R23: "contiguous" needs a checkpoint at every block boundary from block 0, and saves
        // land only on multiples of the interval (R24): a longer interval could never hit.
        if let (LinearStateMatch::Contiguous, Some(interval)) =
            (self.linear_state_match, self.checkpoint_interval)
        {
            ensure_arg!(
                interval == self.block_size,
                "checkpoint_interval",
                "must equal block_size {} with linear_state_match=\"contiguous\" (a hit needs a \
                 checkpoint at every block boundary), got {interval}",
                self.block_size
            );
        }
        if self.state_groups > 0 {
            ensure_arg!(
                self.state_groups <= MAX_ATTACH_GROUPS,
                "state_groups",
                "must be at most {MAX_ATTACH_GROUPS}, got {}",
                self.state_groups
            );
            ensure_arg!(
                self.sliding_window.is_none()
                    && self.attention_chunk_size.is_none()
                    && self.window_groups == 1,
                "state_groups",
                "is not with sliding_window, attention_chunk_size or window_groups (the groups \
                 beside full attention are one kind)"
            );
            ensure_arg!(
                self.shares_window_store(),
                "state_groups",
                "needs the shared store (no shared_blocks=False, xtensor or host tier)"
            );
        }
        if let Some(chunk) = self.attention_chunk_size {
            ensure_arg!(
                self.sliding_window.is_none(),
                "attention_chunk_size",
                "is not with sliding_window (the window groups are one or the other)"
            );
            ensure_arg!(
                chunk >= self.block_size && chunk % self.block_size == 0,
                "attention_chunk_size",
                "must be a positive multiple of block_size {}, got {chunk}",
                self.block_size
            );
            ensure_arg!(
                self.shares_window_store(),
                "attention_chunk_size",
                "needs the shared store (no swa_num_blocks, shared_blocks=False, xtensor or host \
                 tier)"
            );
        }
        ensure_arg!(
            self.swa_num_blocks.is_none() || self.sliding_window.is_some(),
            "swa_num_blocks",
            "needs sliding_window"
        );
        ensure_arg!(
            (1..=MAX_ATTACH_GROUPS).contains(&self.window_groups),
            "window_groups",
            "must be between 1 and {MAX_ATTACH_GROUPS}, got {}",
            self.window_groups
        );
        ensure_arg!(
            self.window_groups == 1 || self.shares_window_store(),
            "window_groups",
            "needs sliding_window in the shared store (no swa_num_blocks, xtensor or host tier), \
             got {}",
            self.window_groups
        );
        if self.shared_blocks == Some(true) {
            ensure_arg!(
                self.window().is_some(),
                "shared_blocks",
                "needs sliding_window (the groups that share the store)"
            );
            ensure_arg!(
                self.swa_num_blocks.is_none(),
                "swa_num_blocks",
                "sizes a window store of its own: not with shared_blocks=True"
            );
            ensure_arg!(
                self.xtensor.is_none(),
                "shared_blocks",
                "is not supported with xtensor (elastic pages hold full attention only)"
            );
        }
        // Every count within its cap before anything is sized by it (F1).
        let within_caps = |n: usize, block_size: usize, name: &'static str| {
            ManagerConfig::new(n, block_size)
                .validate()
                .map_err(|e| e.renamed("num_blocks", name).renamed("block_size", name))
        };
        within_caps(self.num_single(), 1, "num_single_blocks")?;
        if self.linear_state_slots > 0 {
            within_caps(self.linear_state_slots, 1, "linear_state_slots")?;
        }
        if self.sliding_window.is_some() && !self.shares_window_store() {
            within_caps(self.swa_blocks(), self.block_size, "swa_num_blocks")?;
        }
        ensure_arg!(
            self.eviction == Eviction::Lru || self.xtensor.is_none(),
            "eviction",
            "must be \"lru\" with xtensor (elastic pages reclaim by their own order), got {:?}",
            self.eviction.name()
        );
        ensure_arg!(
            self.protected_percent <= 100,
            "protected_percent",
            "must be at most 100, got {}",
            self.protected_percent
        );
        ensure_arg!(
            self.eviction == Eviction::Lru || self.enable_prefix_cache,
            "eviction",
            "needs enable_prefix_cache (there is nothing to evict without it), got {:?}",
            self.eviction.name()
        );
        if let Some(xtensor) = &self.xtensor {
            xtensor.validate(self)?;
        }
        let allocator = match &self.xtensor {
            Some(xtensor) => xtensor.manager_config(self).footprint(),
            None => self.manager().footprint(),
        };
        // F1: the whole footprint of every rank in one request, before anything is filled.
        let per_rank = allocator
            + self.num_single() as u128 * BlockStore::BYTES_PER_ID
            + LinearStatePrefixCache::footprint(self.linear_state_slots)
            + match (self.window(), self.shares_window_store()) {
                (None, _) => 0,
                (Some(_), true) => {
                    self.num_blocks as u128
                        * PrefixCache::attach_bytes_per_block(self.num_window_groups())
                }
                (Some(_), false) => SlidingWindowBlockManager::footprint(
                    self.swa_blocks(),
                    self.block_size,
                    self.enable_prefix_cache,
                ),
            };
        alloc::probe(self.dp_size as u128 * per_rank, "num_blocks")
    }

    /// The ranks (after [`Self::validate`]).
    /// `backends`: rank `r`'s page backend at `r`, for elastic pages with a `Custom` backend.
    pub(crate) fn build_ranks(&self, backends: Vec<Box<dyn PageBackend>>) -> Result<Vec<Rank>> {
        let mut ranks = Vec::with_capacity(self.dp_size);
        let mut backends = backends.into_iter();
        for index in 0..self.dp_size {
            let mut full = match &self.xtensor {
                None => {
                    let mut blocks = BlockManagerImpl::new(self.manager())?;
                    if let Some(cache) = blocks.prefix_cache_mut() {
                        cache.set_record_events(self.enable_events);
                        if self.eviction != Eviction::Lru {
                            cache.set_eviction(self.eviction, self.protected_percent)?;
                        }
                        if let (Some(window), true) = (self.window(), self.shares_window_store()) {
                            cache.enable_attachments(AttachConfig {
                                windows: vec![window; self.num_window_groups()],
                                chunked: self.attention_chunk_size.is_some(),
                                states: self.state_groups > 0,
                                retention_tokens: self.retention_tokens,
                            })?;
                            cache.set_record_attach_events(self.enable_events);
                        }
                    }
                    FullGroup::new(blocks)
                }
                Some(xtensor) => {
                    let backend = match xtensor.backend(self)? {
                        Some(backend) => backend,
                        None => backends.next().ok_or_else(|| {
                            crate::error::KvPoolError::invalid(
                                "xtensor.backend",
                                format!("no page backend for dp rank {index}"),
                            )
                        })?,
                    };
                    debug_assert!(
                        xtensor.backend == PageBackendKind::Custom || backends.len() == 0
                    );
                    let mut manager =
                        XTensorBlockManager::with_backend(xtensor.manager_config(self), backend)?;
                    if let Some(cache) = manager.cache.as_mut() {
                        cache.set_record_events(self.enable_events);
                    }
                    FullGroup::elastic(manager)
                }
            };
            let single = SingleBlockManager::new(self.num_single())
                .map_err(|e| e.renamed("num_slots", "num_single_blocks"))?;
            let mut groups = Vec::new();
            if self.linear_state_slots > 0 {
                let mut cache = LinearStatePrefixCache::new(self.linear_state_slots)
                    .map_err(|e| e.renamed("num_slots", "linear_state_slots"))?;
                cache.events = self.enable_events.then(Vec::new);
                let mut group = LinearGroup::new(
                    cache,
                    index,
                    self.block_size,
                    self.checkpoint_interval,
                    self.linear_state_match,
                    self.linear_state_save,
                );
                if self.linear_state_blocks > 0 {
                    full.track_owners()?;
                    group = group.in_one_store(self.linear_state_blocks, groups.len() as u8 + 1);
                }
                groups.push(Group::Linear(group));
            }
            if let (Some(window), true) = (self.window(), self.shares_window_store()) {
                ensure_arg!(
                    window >= 1,
                    "sliding_window",
                    "must be at least 1, got {window}"
                );
                full.track_owners()?;
                for attach_group in 0..self.num_window_groups() {
                    let owner = groups.len() as u8 + 1;
                    groups.push(Group::SharedWindow(SharedWindowGroup::new(
                        window,
                        self.window_kind(),
                        self.block_size,
                        attach_group,
                        owner,
                    )));
                }
            } else if let Some(window) = self.sliding_window {
                let mut manager = SlidingWindowBlockManager::new(
                    self.swa_blocks(),
                    self.block_size,
                    window,
                    self.enable_prefix_cache,
                )
                .map_err(|e| {
                    e.renamed("num_blocks", "swa_num_blocks")
                        .renamed("window", "sliding_window")
                })?;
                manager.set_record_events(self.enable_events);
                groups.push(Group::Window(WindowGroup::new(manager)));
            }
            ranks.push(Rank {
                full,
                single,
                groups,
                query_tokens: 0,
                hit_tokens: 0,
                misses: Default::default(),
            });
        }
        Ok(ranks)
    }
}
