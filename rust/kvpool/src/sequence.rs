//! `Sequence`: one request's tokens, and the [`Allocation`] a pool gives it.
//!
//! The sequence owns its data; its fields are private. Everything a pool hands it (the
//! full-attention table, the single block, the other groups' tables, the publication mark and a
//! tier ticket) is one [`Allocation`], present exactly while the sequence holds blocks:
//! allocating sets it, releasing drops it (its `Drop` releases the table tail first).
//!
//! Invariants: tokens only grow; `num_cached_tokens <= num_computed_tokens <= len` and
//! `num_computed_tokens <= table capacity` (R17); while it holds blocks, the allocation's `owner`
//! names the pool that handed them out and `dp_rank` the rank (R13, R18). Holding a sequence
//! holds its block handles: dropping it releases them (R4).
//!
//! One source of truth for the token counts: the fields, with a confirmed host load (R26) folded
//! in by [`Sequence::sync`], the one place that reads a [`LoadTicket`]. Every pool entry that takes
//! a sequence syncs it first; the public getters report the folded value without changing
//! anything.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::block::Block;
use crate::error::{ensure_arg, Result};
use crate::groups::GroupTable;
use crate::hash::{BlockHash, BlockHasher};
use crate::prefix_cache::ExtraKey;
use crate::sliding_window::WindowTable;
use crate::sync::Arc;

static NEXT_SEQ_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// Shared by a pending host load and the sequence it fills (R26): the load's completion marks it
/// done at the token count the load brings the sequence to; the sequence folds that in (see the
/// module doc). A ticket whose sequence was released is simply dropped with it.
#[derive(Debug)]
pub(crate) struct LoadTicket {
    done: AtomicU32,
    /// Shrinks when a fetch fails in part; written only before `done` is set.
    tokens: AtomicUsize,
}

impl LoadTicket {
    pub(crate) fn new(tokens: usize) -> Self {
        Self {
            done: AtomicU32::new(0),
            tokens: AtomicUsize::new(tokens),
        }
    }

    /// Tokens the sequence counts as cached once the load is done, or `None` before.
    pub(crate) fn done_tokens(&self) -> Option<usize> {
        // Acquire: pairs with the Release of `finish`.
        (self.done.load(Ordering::Acquire) != 0).then(|| self.tokens.load(Ordering::Relaxed))
    }

    /// Marks the load done at `tokens`.
    pub(crate) fn finish(&self, tokens: usize) {
        // Relaxed: published by the Release store below.
        self.tokens.store(tokens, Ordering::Relaxed);
        // Release: the sequence's reader sees the load as done, with its token count.
        self.done.store(1, Ordering::Release);
    }

    /// Lowers the promise of a load not done yet (a fetch that delivered only part of its
    /// blocks). The sequence reads the count only after `finish`, whose Release publishes it.
    pub(crate) fn shrink(&self, tokens: usize) {
        debug_assert!(self.done_tokens().is_none(), "a done ticket never shrinks");
        // Relaxed: read only after `finish` (Release) / `done_tokens` (Acquire).
        self.tokens.store(tokens, Ordering::Relaxed);
    }

    /// The tokens the load promises (for `check`).
    pub(crate) fn promised(&self) -> usize {
        self.tokens.load(Ordering::Relaxed)
    }
}

/// Everything a pool gives a sequence, present exactly while the sequence holds blocks.
pub(crate) struct Allocation {
    /// The pool that handed it out.
    pub(crate) owner: u64,
    /// The dp rank it is on (also the sequence's sticky `dp_rank`, R13).
    pub(crate) rank: usize,
    /// Tokens per block of the full-attention table.
    pub(crate) block_size: usize,
    /// The full-attention table (group 0), in logical order.
    pub(crate) blocks: Vec<Block>,
    /// The single block (one id per sequence).
    pub(crate) single: Block,
    /// One table per other group of the rank, in the rank's group order.
    pub(crate) groups: Vec<GroupTable>,
    /// Leading blocks known to be in the owner's cache as this chain's, in cache epoch `epoch`.
    pub(crate) published: usize,
    pub(crate) published_epoch: u64,
    /// The host load of this allocation (R26), until the sequence folds it in.
    pub(crate) host_load: Option<Arc<LoadTicket>>,
}

impl Drop for Allocation {
    /// Releases the table tail first, as `deallocate` does: a chain's tail becomes cache-only
    /// before its head, so its place on the LRU is older (R10, R11). Dropping a sequence without
    /// `deallocate` gives its blocks their LRU place at this moment (F9).
    fn drop(&mut self) {
        // Tail first, with the shared pushes batched per run of blocks (release.rs).
        crate::release::release_all(&mut self.blocks);
    }
}

impl Allocation {
    /// The window table, if the rank has a sliding-window group.
    pub(crate) fn window(&self) -> Option<&WindowTable> {
        self.groups.iter().find_map(GroupTable::as_window)
    }

    /// The `n`-th window table (0: the first window group's), if the rank has that many.
    pub(crate) fn window_at(&self, n: usize) -> Option<&WindowTable> {
        self.groups.iter().filter_map(GroupTable::as_window).nth(n)
    }

    /// Window tables, one per window group of the rank.
    pub(crate) fn num_windows(&self) -> usize {
        self.groups.iter().filter_map(GroupTable::as_window).count()
    }
}

/// The chain hashes (R6) of a sequence's full blocks, memoized for one hasher and block size.
#[derive(Debug, Default)]
pub(crate) struct ChainHashes {
    hashes: Vec<BlockHash>,
    made_by: Option<(BlockHasher, usize)>,
}

impl ChainHashes {
    /// The hashes of the full blocks among the first `num_tokens` of `tokens`, computing what is
    /// not memoized yet.
    #[inline]
    pub(crate) fn ensure(
        &mut self,
        hasher: &BlockHasher,
        block_size: usize,
        tokens: &[u32],
        extra_key: Option<&[u8]>,
        num_tokens: usize,
    ) -> &[BlockHash] {
        if self.made_by != Some((*hasher, block_size)) {
            self.hashes.clear();
            self.made_by = Some((*hasher, block_size));
        }
        let full = num_tokens.min(tokens.len()) / block_size;
        if self.hashes.len() < full {
            hasher.extend_chain(
                &mut self.hashes,
                &tokens[..full * block_size],
                block_size,
                extra_key,
            );
        }
        &self.hashes[..full]
    }
}

/// A request's tokens and KV-cache state.
pub struct Sequence {
    seq_id: u64,
    /// Process-unique identity (never caller-chosen): what a plan is checked against.
    uid: u64,
    tokens: Vec<u32>,
    extra_key: Option<ExtraKey>,
    /// Tokens given at construction (the prompt): its last block boundary gets a checkpoint.
    num_prompt_tokens: usize,
    hashes: ChainHashes,
    num_cached_tokens: usize,
    num_computed_tokens: usize,
    dp_rank: Option<usize>,
    /// Block tables of the pool that last allocated it: 1, or 2 with a sliding window.
    num_groups: usize,
    alloc: Option<Allocation>,
}

impl Sequence {
    /// A sequence of `tokens`; `seq_id` defaults to a process-unique counter.
    pub fn new(tokens: Vec<u32>, seq_id: Option<u64>, extra_key: Option<&[u8]>) -> Self {
        // Relaxed: only uniqueness matters.
        let seq_id = seq_id.unwrap_or_else(|| NEXT_SEQ_ID.fetch_add(1, Ordering::Relaxed));
        let num_prompt_tokens = tokens.len();
        Self {
            seq_id,
            // Relaxed: only uniqueness matters.
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            tokens,
            extra_key: extra_key.map(ExtraKey::from),
            num_prompt_tokens,
            hashes: ChainHashes::default(),
            num_cached_tokens: 0,
            num_computed_tokens: 0,
            dp_rank: None,
            num_groups: 1,
            alloc: None,
        }
    }

    /// Caller-visible id.
    pub fn seq_id(&self) -> u64 {
        self.seq_id
    }

    /// Tokens given at construction (the prompt).
    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
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
        self.alloc.as_ref().map_or(&[], |a| &a.blocks)
    }

    /// The block table: physical id of each logical block.
    pub fn block_ids(&self) -> impl ExactSizeIterator<Item = u32> + '_ {
        self.blocks().iter().map(Block::id)
    }

    /// Tokens the table can hold.
    pub fn capacity(&self) -> usize {
        self.alloc
            .as_ref()
            .map_or(0, |a| a.blocks.len() * a.block_size)
    }

    /// Number of block tables (1, or 2 with a sliding window).
    pub fn num_groups(&self) -> usize {
        self.num_groups
    }

    /// The block table of group `group` (0: full attention; 1, 2, ...: the sliding-window
    /// groups, released entries 0), or `None` if the sequence has no such group.
    pub fn group_block_ids(&self, group: usize) -> Option<Vec<u32>> {
        match group {
            0 => Some(self.block_ids().collect()),
            g if g < self.num_groups => Some(
                self.group_window_table(g)
                    .map_or_else(Vec::new, |w| w.ids().collect()),
            ),
            _ => None,
        }
    }

    /// The table of window group `group` (1, 2, ...), while allocated in a pool with it.
    pub fn group_window_table(&self, group: usize) -> Option<&WindowTable> {
        let n = group.checked_sub(1)?;
        self.alloc.as_ref().and_then(|a| a.window_at(n))
    }

    /// The sliding-window table, while allocated in a pool with a sliding window.
    pub fn window_table(&self) -> Option<&WindowTable> {
        self.alloc.as_ref().and_then(Allocation::window)
    }

    /// The live recurrent-state slot while allocated in a pool with linear state (R22).
    pub fn linear_state_slot(&self) -> Option<u32> {
        self.linear_table()
            .and_then(|t| t.slot.as_ref())
            .map(Block::id)
    }

    /// The checkpoint slot the live state is restored from (R23), or `None` if the sequence
    /// starts from an empty state.
    pub fn linear_state_restore_slot(&self) -> Option<u32> {
        self.linear_table().and_then(|t| t.restore_slot)
    }

    fn linear_table(&self) -> Option<&crate::groups::LinearTable> {
        let alloc = self.alloc.as_ref()?;
        alloc.groups.iter().find_map(GroupTable::as_linear)
    }

    /// Tokens a confirmed host load brought the sequence to (0 if none, R26).
    fn loaded_tokens(&self) -> usize {
        self.alloc
            .as_ref()
            .and_then(|a| a.host_load.as_ref())
            .and_then(|t| t.done_tokens())
            .unwrap_or(0)
    }

    /// Tokens whose KV came from the prefix cache (or a confirmed host load) at allocation.
    pub fn num_cached_tokens(&self) -> usize {
        self.num_cached_tokens.max(self.loaded_tokens())
    }

    /// Tokens whose KV exists (advanced by the engine after each step, R17).
    pub fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens.max(self.loaded_tokens())
    }

    /// Advances `num_computed_tokens` (R17): never lowers, never past `len` or the table.
    pub fn set_num_computed_tokens(&mut self, n: usize) -> Result<()> {
        self.sync();
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
        self.alloc.as_ref().map(|a| a.single.id())
    }

    /// Whether the sequence holds blocks of some pool.
    pub fn is_allocated(&self) -> bool {
        self.alloc.is_some()
    }

    // ---- for the pool (crate-private) ----------------------------------------------------------

    /// Process-unique identity of this sequence object.
    pub(crate) fn uid(&self) -> u64 {
        self.uid
    }

    pub(crate) fn extra_key_arc(&self) -> Option<&ExtraKey> {
        self.extra_key.as_ref()
    }

    /// The pool that handed out the allocation, if any.
    #[inline]
    pub(crate) fn owner(&self) -> Option<u64> {
        self.alloc.as_ref().map(|a| a.owner)
    }

    /// The allocation, while the sequence holds blocks.
    #[inline]
    pub(crate) fn alloc(&self) -> Option<&Allocation> {
        self.alloc.as_ref()
    }

    /// The allocation, mutably (the pool's growth, publication and slides).
    #[inline]
    pub(crate) fn alloc_mut(&mut self) -> Option<&mut Allocation> {
        self.alloc.as_mut()
    }

    /// The computed tokens as the pool counts them (after [`Self::sync`]).
    #[inline]
    pub(crate) fn computed(&self) -> usize {
        self.num_computed_tokens
    }

    /// The cached tokens as the pool counts them (after [`Self::sync`]).
    pub(crate) fn cached(&self) -> usize {
        self.num_cached_tokens
    }

    /// Sets `num_computed_tokens` to `len` (a forward step over every token; the caller checked
    /// that the table holds them).
    #[inline]
    pub(crate) fn compute_all(&mut self) {
        debug_assert!(self.len() <= self.capacity());
        self.num_computed_tokens = self.tokens.len();
    }

    /// Folds a confirmed host load into the counts and drops its ticket (R26): the one place a
    /// ticket's count becomes the sequence's.
    #[inline]
    pub(crate) fn sync(&mut self) {
        let Some(alloc) = self.alloc.as_mut() else {
            return;
        };
        let Some(ticket) = alloc.host_load.as_ref() else {
            return;
        };
        if let Some(tokens) = ticket.done_tokens() {
            self.num_cached_tokens = self.num_cached_tokens.max(tokens);
            self.num_computed_tokens = self.num_computed_tokens.max(tokens);
            alloc.host_load = None;
        }
    }

    /// Takes an allocation with `cached` tokens from the cache (R14).
    pub(crate) fn attach(&mut self, alloc: Allocation, cached: usize) {
        debug_assert!(self.alloc.is_none());
        self.num_groups = 1 + alloc.num_windows();
        self.dp_rank = Some(alloc.rank);
        self.alloc = Some(alloc);
        self.num_cached_tokens = cached;
        self.num_computed_tokens = cached;
    }

    /// Gives the allocation back, resetting the counts (tokens and dp rank kept, R18). The
    /// caller releases what the allocation holds in its pool first.
    pub(crate) fn detach(&mut self) -> Option<Allocation> {
        self.num_cached_tokens = 0;
        self.num_computed_tokens = 0;
        self.alloc.take()
    }

    /// Memoizes the chain hashes of the full blocks among the first `num_tokens` tokens.
    pub(crate) fn ensure_hashes(
        &mut self,
        hasher: &BlockHasher,
        block_size: usize,
        num_tokens: usize,
    ) {
        let key = self.extra_key.as_deref();
        self.hashes
            .ensure(hasher, block_size, &self.tokens, key, num_tokens);
    }

    /// The first `num_blocks` memoized chain hashes (after `ensure_hashes`).
    pub(crate) fn hashes(&self, num_blocks: usize) -> &[BlockHash] {
        let hashes = &self.hashes.hashes;
        &hashes[..num_blocks.min(hashes.len())]
    }

    /// The parts a publication needs at once: the hash memo (to extend), the tokens, the extra
    /// key and the allocation.
    #[inline]
    pub(crate) fn split_for_publish(
        &mut self,
    ) -> (
        &mut ChainHashes,
        &[u32],
        Option<&ExtraKey>,
        Option<&mut Allocation>,
    ) {
        (
            &mut self.hashes,
            &self.tokens,
            self.extra_key.as_ref(),
            self.alloc.as_mut(),
        )
    }
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequence")
            .field("seq_id", &self.seq_id)
            .field("len", &self.len())
            .field("block_table", &self.block_ids().collect::<Vec<_>>())
            .field("num_computed_tokens", &self.num_computed_tokens())
            .field("dp_rank", &self.dp_rank)
            .finish()
    }
}
