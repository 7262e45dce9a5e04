//! `Sequence`: one request's tokens and the KV state a pool keeps for it.
//!
//! Invariants: tokens only grow; `num_cached_tokens <= num_computed_tokens <= len` and
//! `num_computed_tokens <= table capacity` (R17); while it holds blocks, `owner` names the pool
//! that handed them out and `dp_rank` the rank (R13, R18). Holding a sequence holds its block
//! handles: dropping it releases them (R4).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::block::Block;
use crate::error::{ensure_arg, Result};
use crate::hash::{BlockHash, BlockHasher};
use crate::hierarchy::LoadTicket; // host tier (R26)
use crate::prefix_cache::ExtraKey;
use crate::sliding_window::WindowTable;
use crate::sync::Arc; // host tier (R26)

static NEXT_SEQ_ID: AtomicU64 = AtomicU64::new(1);

/// A request's tokens and KV-cache state.
pub struct Sequence {
    seq_id: u64,
    tokens: Vec<u32>,
    extra_key: Option<ExtraKey>,
    pub(crate) blocks: Vec<Block>,
    pub(crate) block_size: usize,
    pub(crate) num_cached_tokens: usize,
    pub(crate) num_computed_tokens: usize,
    pub(crate) dp_rank: Option<usize>,
    pub(crate) single_block: Option<Block>,
    pub(crate) owner: Option<u64>,
    /// Chain hashes of the full blocks of `tokens`, memoized for one hasher.
    hashes: Vec<BlockHash>,
    hashes_for: Option<(BlockHasher, usize)>,
    /// Leading blocks known to be in the owner's cache as this chain's, and the cache epoch.
    pub(crate) num_published: usize,
    pub(crate) published_epoch: u64,
    /// Tokens given at construction (the prompt): its last block boundary gets a checkpoint.
    num_prompt_tokens: usize,
    /// The sliding-window group's table (R25), when the pool has one.
    pub(crate) window: Option<WindowTable>,
    /// The live recurrent-state slot (R22).
    pub(crate) linear_slot: Option<Block>,
    /// The checkpoint slot the live state was restored from at allocation (R23).
    pub(crate) restore_slot: Option<u32>,
    /// Linear-state plan operations of this sequence not yet confirmed (R24).
    pub(crate) linear_ops: Vec<u64>,
    /// Computed tokens at the last planned save (no boundary is saved twice).
    pub(crate) last_saved_boundary: usize,
    /// host tier (R26): the host load of this allocation, until the pool folds it in.
    pub(crate) host_load: Option<Arc<LoadTicket>>,
}

impl Sequence {
    /// A sequence of `tokens`; `seq_id` defaults to a process-unique counter.
    pub fn new(tokens: Vec<u32>, seq_id: Option<u64>, extra_key: Option<&[u8]>) -> Self {
        // Relaxed: only uniqueness matters.
        let seq_id = seq_id.unwrap_or_else(|| NEXT_SEQ_ID.fetch_add(1, Ordering::Relaxed));
        let num_prompt_tokens = tokens.len();
        Self {
            seq_id,
            tokens,
            extra_key: extra_key.map(ExtraKey::from),
            blocks: Vec::new(),
            block_size: 0,
            num_cached_tokens: 0,
            num_computed_tokens: 0,
            dp_rank: None,
            single_block: None,
            owner: None,
            hashes: Vec::new(),
            hashes_for: None,
            num_published: 0,
            published_epoch: 0,
            num_prompt_tokens,
            window: None,
            linear_slot: None,
            restore_slot: None,
            linear_ops: Vec::new(),
            last_saved_boundary: 0,
            host_load: None, // host tier (R26)
        }
    }

    /// Tokens given at construction (the prompt).
    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    /// The live recurrent-state slot while allocated in a pool with linear state (R22).
    pub fn linear_state_slot(&self) -> Option<u32> {
        self.linear_slot.as_ref().map(Block::id)
    }

    /// The checkpoint slot the live state is restored from (R23), or `None` if the sequence
    /// starts from an empty state.
    pub fn linear_state_restore_slot(&self) -> Option<u32> {
        self.restore_slot
    }

    /// Number of groups whose tables the sequence holds (1, or 2 with a sliding window).
    pub fn num_groups(&self) -> usize {
        1 + usize::from(self.window.is_some())
    }

    /// The block table of group `group` (0: full attention; 1: the sliding window, released
    /// entries 0), or `None` if the sequence has no such group.
    pub fn group_block_ids(&self, group: usize) -> Option<Vec<u32>> {
        match group {
            0 => Some(self.block_ids().collect()),
            1 => self.window.as_ref().map(|w| w.ids().collect()),
            _ => None,
        }
    }

    /// The sliding-window table, if any.
    pub fn window_table(&self) -> Option<&WindowTable> {
        self.window.as_ref()
    }

    /// Caller-visible id.
    pub fn seq_id(&self) -> u64 {
        self.seq_id
    }

    /// Number of tokens (prompt plus generated).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The extra key (cache salt) of the chain.
    pub fn extra_key(&self) -> Option<&[u8]> {
        self.extra_key.as_deref()
    }

    pub(crate) fn extra_key_arc(&self) -> Option<&ExtraKey> {
        self.extra_key.as_ref()
    }

    /// Appends a sampled token (its KV is written by the next step: R16).
    pub fn append_token(&mut self, token: u32) {
        self.tokens.push(token);
    }

    /// Appends several tokens (speculative decoding, chunked input).
    pub fn append_tokens(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    /// Handles of the block table, in logical order.
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// The block table: physical id of each logical block.
    pub fn block_ids(&self) -> impl ExactSizeIterator<Item = u32> + '_ {
        self.blocks.iter().map(Block::id)
    }

    /// Tokens the table can hold.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * self.block_size
    }

    /// Tokens whose KV came from the prefix cache at allocation.
    pub fn num_cached_tokens(&self) -> usize {
        self.num_cached_tokens.max(self.host_loaded_tokens()) // host tier (R26)
    }

    /// Tokens whose KV exists (advanced by the engine after each step, R17).
    pub fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens.max(self.host_loaded_tokens()) // host tier (R26)
    }

    /// Advances `num_computed_tokens` (R17): never lowers, never past `len` or the table.
    pub fn set_num_computed_tokens(&mut self, n: usize) -> Result<()> {
        self.fold_host_load(); // host tier (R26)
        ensure_arg!(
            n >= self.num_computed_tokens,
            "num_computed_tokens",
            "cannot be lowered from {} to {n} (only deallocate resets it)",
            self.num_computed_tokens
        );
        ensure_arg!(
            n <= self.len(),
            "num_computed_tokens",
            "{n} exceeds len(seq) = {}",
            self.len()
        );
        ensure_arg!(
            n <= self.capacity(),
            "num_computed_tokens",
            "{n} exceeds the {} tokens the block table holds",
            self.capacity()
        );
        self.num_computed_tokens = n;
        Ok(())
    }

    /// Data-parallel rank, once allocated (sticky for the sequence's life, R13).
    pub fn dp_rank(&self) -> Option<usize> {
        self.dp_rank
    }

    /// The single block (one id per sequence), while allocated.
    pub fn single_block_id(&self) -> Option<u32> {
        self.single_block.as_ref().map(Block::id)
    }

    /// Whether the sequence holds blocks of some pool.
    pub fn is_allocated(&self) -> bool {
        self.owner.is_some()
    }

    /// Memoizes the chain hashes of the full blocks among the first `num_tokens` tokens.
    pub(crate) fn ensure_hashes(
        &mut self,
        hasher: &BlockHasher,
        block_size: usize,
        num_tokens: usize,
    ) {
        if self.hashes_for != Some((*hasher, block_size)) {
            self.hashes.clear();
            self.hashes_for = Some((*hasher, block_size));
        }
        let full = num_tokens.min(self.tokens.len()) / block_size;
        if self.hashes.len() < full {
            hasher.extend_chain(
                &mut self.hashes,
                &self.tokens[..full * block_size],
                block_size,
                self.extra_key.as_deref(),
            );
        }
    }

    /// The first `num_blocks` memoized chain hashes (after `ensure_hashes`).
    pub(crate) fn hashes(&self, num_blocks: usize) -> &[BlockHash] {
        &self.hashes[..num_blocks.min(self.hashes.len())]
    }

    /// Releases everything and resets the KV state (tokens and dp rank kept, R18).
    pub(crate) fn reset(&mut self) {
        while self.blocks.pop().is_some() {} // tail first (see `Drop`)
        self.single_block = None;
        if let Some(window) = self.window.as_mut() {
            window.clear();
        }
        self.linear_slot = None;
        self.restore_slot = None;
        self.linear_ops.clear();
        self.last_saved_boundary = 0;
        self.num_cached_tokens = 0;
        self.num_computed_tokens = 0;
        self.num_published = 0;
        self.owner = None;
        self.host_load = None; // host tier (R26): an unconfirmed load no longer applies
    }
}

impl Drop for Sequence {
    /// Releases the table tail first, as `deallocate` does: a chain's tail becomes cache-only
    /// before its head, so its place on the LRU is older (R10, R11). Dropping a sequence without
    /// `deallocate` gives its blocks their LRU place at this moment (F9).
    fn drop(&mut self) {
        while self.blocks.pop().is_some() {}
    }
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequence")
            .field("seq_id", &self.seq_id)
            .field("len", &self.len())
            .field("block_table", &self.block_ids().collect::<Vec<_>>())
            .field("num_computed_tokens", &self.num_computed_tokens)
            .field("dp_rank", &self.dp_rank)
            .finish()
    }
}
