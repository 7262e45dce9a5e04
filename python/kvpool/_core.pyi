"""Type stubs of ``kvpool._core``, the Rust extension behind :mod:`kvpool`.

Hand-written; checked against the built module with ``python -m mypy.stubtest kvpool._core
--allowlist stubtest-allowlist.txt``. Rule numbers ("R7") refer to DESIGN.md section 2.
Every class is frozen with a lock inside, safe to share between threads (R28), and cannot be
subclassed.
"""

from collections.abc import Iterable
from collections.abc import Sequence as _Sequence
from typing import Final, Literal, SupportsIndex, TypeAlias, TypedDict, final

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "__version__",
    "DEFAULT_HASH_SEED",
    "KVPoolError",
    "OutOfBlocksError",
    "InvariantError",
    "Block",
    "BlockManager",
    "SingleBlockManager",
    "PrefixCache",
    "hash_blocks",
    "Sequence",
    "BlockManagerPool",
    "ConcurrentBlockManager",
    "KVEvent",
]

# Type aliases and TypedDicts below are stub-only (private: not present at runtime).

_TokenIds: TypeAlias = _Sequence[int] | NDArray[np.integer]
"""Token ids: a list/tuple of ints or a 1-D integer numpy array, every id in ``[0, 2**32)``."""

_ExtraKey: TypeAlias = bytes | str | None
"""Extra key (cache salt, LoRA id, ...): bytes, str (hashed as UTF-8) or None (R6)."""

_LinearStateMatch: TypeAlias = Literal["deepest", "contiguous"]
_EventKind: TypeAlias = Literal["stored", "removed", "cleared"]

class _BlockCounts(TypedDict):
    """Block counts of one manager (R2)."""

    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    usage: float

class _ManagerStats(_BlockCounts):
    """``BlockManager.stats()``: counts plus prefix-cache statistics."""

    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evictions: int
    num_cache_entries: int

class _RankStats(_BlockCounts):
    """Statistics of one dp rank of a pool (R20)."""

    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evictions: int
    num_free_single_blocks: int
    num_live_slots: int
    num_pending_checkpoints: int
    num_committed_checkpoints: int
    host: _BlockCounts | None

class _PoolStats(_RankStats):
    """``BlockManagerPool.stats()``: totals over all ranks plus ``ranks``, one dict per rank."""

    ranks: list[_RankStats]

__version__: Final[str]
"""Version of the kvpool core."""

DEFAULT_HASH_SEED: Final[int]
"""Seed of the block hash when ``hash_seed`` is None (fixed: same tokens, same hash, R6)."""

# --- errors (R29) -----------------------------------------------------------------------------

class KVPoolError(Exception):
    """Base class of kvpool's own errors."""

class OutOfBlocksError(KVPoolError):
    """A manager cannot hand out the blocks asked for; nothing was changed (R3)."""

class InvariantError(KVPoolError):
    """``check()`` found a structure that breaks one of kvpool's rules (R20)."""

# --- physical level (R1-R12) ------------------------------------------------------------------

@final
class Block:
    """One handle of a physical KV block (R4).

    Handed out by a manager, never constructed directly. ``int(block)`` and
    ``operator.index(block)`` give its id.
    """

    @property
    def id(self) -> int:
        """Physical block id (never 0, the padding block)."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    def ref_count(self) -> int:
        """Handles of this block alive now, the prefix cache's included.

        0 once this handle is released and the block went back to the free list.
        """

    @property
    def hash(self) -> bytes | None:
        """The block's chained hash (16 bytes) while it is in the prefix cache, else None."""

    @property
    def released(self) -> bool:
        """Whether this handle was released (``deallocate``)."""

    def __int__(self) -> int: ...
    def __index__(self) -> int: ...

@final
class BlockManager:
    """Plain block allocator with a prefix cache (the seed's BlockManagerImpl, R1-R12).

    Parameters
    ----------
    num_blocks : int
        Ids in the pool, padding block 0 included (``num_total_blocks == num_blocks - 1``).
    block_size : int
        Tokens per block, at least 1.
    enable_prefix_cache : bool
        Keep a prefix cache.
    hash_seed : int or None
        Seed of the block hash in ``[0, 2**64)``; None is ``DEFAULT_HASH_SEED``.
    debug_hash_bits : int or None
        Truncate hashes to this many bits (1..128) to force collisions in tests.

    Raises
    ------
    ValueError
        ``num_blocks < 2``, ``block_size < 1`` or an option out of range.
    """

    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_cache: bool = True,
        hash_seed: int | None = None,
        debug_hash_bits: int | None = None,
    ) -> BlockManager: ...
    @property
    def num_blocks(self) -> int:
        """Ids in the pool, padding block 0 included."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    def enable_prefix_cache(self) -> bool:
        """Whether a prefix cache is kept."""

    @property
    def num_total_blocks(self) -> int:
        """Allocatable ids: ``num_blocks - 1`` (R1)."""

    @property
    def num_free_blocks(self) -> int:
        """Ids in the free list (R2)."""

    @property
    def num_cached_blocks(self) -> int:
        """Ids held only by the prefix cache: evictable (R2)."""

    @property
    def num_used_blocks(self) -> int:
        """Ids held by a handle outside the cache (R2)."""

    @property
    def num_available_blocks(self) -> int:
        """``free + cached``: what ``allocate`` can hand out (R2)."""

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Read-only view of the prefix cache, or None when disabled."""

    def allocate(self, n: int) -> list[Block]:
        """Allocate ``n`` fresh blocks, evicting cached ones if needed (R3).

        Returns
        -------
        list[Block]
            ``n`` handles; ``[]`` for ``n == 0``.

        Raises
        ------
        OutOfBlocksError
            ``free + cached < n``; nothing was changed.
        ValueError
            ``n < 0``.
        """

    def deallocate(self, blocks: Iterable[Block]) -> None:
        """Release these handles (R5); all or nothing.

        Raises
        ------
        ValueError
            A handle was already released, is listed twice, or belongs to another manager.
        TypeError
            An item is not a :class:`Block`.
        """

    def allocate_shared(self, token_ids: _TokenIds, *, extra_key: _ExtraKey = None) -> list[Block]:
        """Handles of the longest cached prefix of ``token_ids`` (R7).

        Returns
        -------
        list[Block]
            One new handle per matched full block, in order; ``[]`` on a miss.
        """

    def cache(
        self, token_ids: _TokenIds, blocks: Iterable[Block], *, extra_key: _ExtraKey = None
    ) -> int:
        """Publish the full blocks of ``token_ids`` held in ``blocks`` in the prefix cache (R9).

        Returns
        -------
        int
            Number of blocks newly cached.
        """

    def evict(self, n: int) -> int:
        """Evict up to ``n`` cached blocks, least recently used leaves first (R10).

        Returns
        -------
        int
            Number of blocks evicted.
        """

    def reset_prefix_cache(self) -> None:
        """Drop every cached entry; held blocks stay with their holders (R12)."""

    def check(self) -> None:
        """Walk every structure.

        Raises
        ------
        InvariantError
            A rule is broken.
        """

    def stats(self) -> _ManagerStats:
        """Block counts and prefix-cache statistics."""

    def eviction_order(self) -> list[int]:
        """Block ids on the eviction list, oldest first (for tests and debugging)."""

@final
class ConcurrentBlockManager:
    """Thread-safe block allocator with a prefix cache (the seed's ConcurrentBlockManagerImpl).

    The same API and behaviour as :class:`BlockManager` (R1-R12), for many threads at once
    (R27): allocation from the free list and every handle release are lock-free, the prefix
    cache sits behind one lock that a handle release never takes, and every method releases the
    GIL around its Rust work (R28). Counts read while other threads work are snapshots; they,
    and ``check()``, are exact when no other thread is using the manager.

    Parameters
    ----------
    num_blocks : int
        Ids in the pool, padding block 0 included (``num_total_blocks == num_blocks - 1``).
    block_size : int
        Tokens per block, at least 1.
    enable_prefix_cache : bool
        Keep a prefix cache.
    hash_seed : int or None
        Seed of the block hash in ``[0, 2**64)``; None is ``DEFAULT_HASH_SEED``.
    debug_hash_bits : int or None
        Truncate hashes to this many bits (1..128) to force collisions in tests.

    Raises
    ------
    ValueError
        ``num_blocks < 2``, ``block_size < 1`` or an option out of range.
    """

    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_cache: bool = True,
        hash_seed: int | None = None,
        debug_hash_bits: int | None = None,
    ) -> ConcurrentBlockManager: ...
    @property
    def num_blocks(self) -> int:
        """Ids in the pool, padding block 0 included."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    def enable_prefix_cache(self) -> bool:
        """Whether a prefix cache is kept."""

    @property
    def num_total_blocks(self) -> int:
        """Allocatable ids: ``num_blocks - 1`` (R1)."""

    @property
    def num_free_blocks(self) -> int:
        """Ids in the free list (R2)."""

    @property
    def num_cached_blocks(self) -> int:
        """Ids held only by the prefix cache: evictable (R2)."""

    @property
    def num_used_blocks(self) -> int:
        """Ids held by a handle outside the cache (R2)."""

    @property
    def num_available_blocks(self) -> int:
        """``free + cached``: what ``allocate`` can hand out (R2)."""

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Read-only view of the prefix cache, or None when disabled."""

    def allocate(self, n: int) -> list[Block]:
        """Allocate ``n`` fresh blocks, evicting cached ones if needed (R3).

        Returns
        -------
        list[Block]
            ``n`` handles; ``[]`` for ``n == 0``.

        Raises
        ------
        OutOfBlocksError
            ``free + cached < n`` (nothing was changed), or other threads took the blocks
            first (blocks this call evicted then stay free); never a partial result.
        ValueError
            ``n < 0``.
        """

    def deallocate(self, blocks: Iterable[Block]) -> None:
        """Release these handles (R5); all or nothing.

        Raises
        ------
        ValueError
            A handle was already released, is listed twice, or belongs to another manager.
        TypeError
            An item is not a :class:`Block`.
        """

    def allocate_shared(self, token_ids: _TokenIds, *, extra_key: _ExtraKey = None) -> list[Block]:
        """Handles of the longest cached prefix of ``token_ids`` (R7).

        Returns
        -------
        list[Block]
            One new handle per matched full block, in order; ``[]`` on a miss.
        """

    def cache(
        self, token_ids: _TokenIds, blocks: Iterable[Block], *, extra_key: _ExtraKey = None
    ) -> int:
        """Publish the full blocks of ``token_ids`` held in ``blocks`` in the prefix cache (R9).

        Returns
        -------
        int
            Number of blocks newly cached.
        """

    def evict(self, n: int) -> int:
        """Evict up to ``n`` cached blocks, least recently used leaves first (R10).

        Returns
        -------
        int
            Number of blocks evicted.
        """

    def reset_prefix_cache(self) -> None:
        """Drop every cached entry; held blocks stay with their holders (R12)."""

    def check(self) -> None:
        """Walk every structure; exact only while no other thread uses the manager.

        Raises
        ------
        InvariantError
            A rule is broken.
        """

    def stats(self) -> _ManagerStats:
        """Block counts and prefix-cache statistics."""

    def eviction_order(self) -> list[int]:
        """Block ids on the eviction list, oldest first (for tests and debugging)."""

@final
class PrefixCache:
    """Read-only view of a :class:`BlockManager`'s prefix cache (``BlockManager.prefix_cache``)."""

    def __len__(self) -> int:
        """Number of cached blocks (entries), held or not."""

    @property
    def query_tokens(self) -> int:
        """Tokens of full blocks looked up by ``allocate_shared``."""

    @property
    def hit_tokens(self) -> int:
        """Tokens of those that hit."""

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / query_tokens`` (0.0 before any query)."""

    @property
    def num_evictions(self) -> int:
        """Blocks evicted so far."""

    def contains(self, block_hash: bytes) -> bool:
        """Whether ``block_hash`` (16 bytes) is cached.

        Raises
        ------
        TypeError
            ``block_hash`` is not bytes.
        ValueError
            ``block_hash`` is not exactly 16 bytes.
        """

    def block_id(self, block_hash: bytes) -> int | None:
        """The block id cached under ``block_hash`` (16 bytes), or None."""

    def hashes(self) -> list[bytes]:
        """Every cached hash (16 bytes each, unordered)."""

@final
class SingleBlockManager:
    """One id per sequence: block size 1, id 0 reserved, no prefix cache.

    Same interface as :class:`BlockManager`; the prefix-cache methods are no-ops.

    Parameters
    ----------
    num_slots : int
        Ids in the pool, padding id 0 included (at least 2).
    """

    def __new__(cls, num_slots: int) -> SingleBlockManager: ...
    @property
    def num_blocks(self) -> int:
        """Ids in the pool, padding id 0 included."""

    @property
    def block_size(self) -> int:
        """Always 1."""

    @property
    def num_total_blocks(self) -> int:
        """Allocatable ids: ``num_blocks - 1``."""

    @property
    def num_free_blocks(self) -> int:
        """Ids in the free list."""

    @property
    def num_cached_blocks(self) -> int:
        """Always 0."""

    @property
    def num_used_blocks(self) -> int:
        """Ids held by a handle."""

    @property
    def num_available_blocks(self) -> int:
        """Same as ``num_free_blocks``."""

    def allocate(self, n: int) -> list[Block]:
        """Allocate ``n`` fresh slots.

        Raises
        ------
        OutOfBlocksError
            Fewer than ``n`` are free; nothing was changed.
        """

    def deallocate(self, blocks: Iterable[Block]) -> None:
        """Release these handles; a released handle again is a ValueError."""

    def allocate_shared(self, token_ids: _TokenIds, *, extra_key: _ExtraKey = None) -> list[Block]:
        """No prefix cache: always ``[]`` (arguments are still validated)."""

    def cache(
        self, token_ids: _TokenIds, blocks: Iterable[Block], *, extra_key: _ExtraKey = None
    ) -> int:
        """No prefix cache: always 0 (arguments are still validated)."""

    def evict(self, n: int) -> int:
        """No prefix cache: always 0."""

    def reset_prefix_cache(self) -> None:
        """No prefix cache: does nothing."""

    def check(self) -> None:
        """Walk every structure; raises :class:`InvariantError` if a rule is broken."""

def hash_blocks(
    token_ids: _TokenIds,
    block_size: int,
    *,
    extra_key: _ExtraKey = None,
    hash_seed: int | None = None,
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (R6).

    Parameters
    ----------
    token_ids : sequence of int or 1-D integer numpy.ndarray
        Tokens; a trailing partial block is not hashed.
    block_size : int
        Tokens per block, at least 1.
    extra_key : bytes, str or None
        Root of the chain (cache salt).
    hash_seed : int or None
        Seed in ``[0, 2**64)``; None is ``DEFAULT_HASH_SEED``.

    Returns
    -------
    list[bytes]
        ``len(token_ids) // block_size`` digests of 16 bytes (XXH3-128).
    """

# --- sequence level (R13-R21) -----------------------------------------------------------------

@final
class Sequence:
    """A request's tokens and KV-cache state (block table, computed tokens, dp rank).

    Parameters
    ----------
    token_ids : sequence of int or 1-D integer numpy.ndarray
        Prompt tokens, each in ``[0, 2**32)``.
    seq_id : int or None
        Caller-visible id; None takes a process-unique counter.
    extra_key : bytes, str or None
        Cache salt: sequences with different keys never share blocks (R6).
    """

    def __new__(
        cls, token_ids: _TokenIds, *, seq_id: int | None = None, extra_key: _ExtraKey = None
    ) -> Sequence: ...
    def __len__(self) -> int:
        """Number of tokens (prompt plus appended)."""

    @property
    def seq_id(self) -> int:
        """Caller-visible id (a process-unique counter unless given)."""

    @property
    def extra_key(self) -> bytes | None:
        """The extra key (cache salt) as bytes, or None."""

    @property
    def token_ids(self) -> list[int]:
        """Token ids (prompt plus appended)."""

    def append_token(self, token: SupportsIndex) -> None:
        """Append one token in ``[0, 2**32)`` (an int or numpy integer).

        Append the sampled token, then call ``BlockManagerPool.may_append`` (R16).
        """

    def append_tokens(self, token_ids: _TokenIds) -> None:
        """Append several tokens."""

    @property
    def block_table(self) -> NDArray[np.int32]:
        """The block table: int32 array of shape ``[num_blocks]``, one physical id per logical
        block (a fresh copy)."""

    def group_block_table(self, group: int) -> NDArray[np.int32]:
        """The block table of group ``group`` (0: full attention), int32 of shape ``[n]`` (R25).

        Raises
        ------
        ValueError
            The sequence has no such group.
        """

    @property
    def num_blocks(self) -> int:
        """Number of entries of the block table."""

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV came from the prefix cache at allocation."""

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV exists; the engine advances it after each step (R17).

        Raises
        ------
        ValueError
            On set: lowering it, or setting it past ``len(seq)`` or past what the block table
            holds.
        """

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None: ...
    @property
    def dp_rank(self) -> int | None:
        """Data-parallel rank once allocated (kept across deallocate: R13), else None."""

    @property
    def single_block_id(self) -> int | None:
        """The sequence's single block id while allocated, else None."""

    @property
    def linear_state_slot(self) -> int | None:
        """Live linear-state slot (hybrid models, R22), else None."""

    @property
    def linear_state_restore_slot(self) -> int | None:
        """Checkpoint slot to restore the linear state from (R23), else None."""

    @property
    def is_allocated(self) -> bool:
        """Whether the sequence holds blocks of a pool."""

@final
class KVEvent:
    """A KV event for external KV-aware routers (R21), from ``BlockManagerPool.drain_events``."""

    @property
    def kind(self) -> _EventKind:
        """``"stored"``, ``"removed"`` or ``"cleared"``."""

    @property
    def block_hashes(self) -> list[bytes]:
        """16-byte hashes of the blocks."""

    @property
    def parent_hash(self) -> bytes | None:
        """Hash of the parent of the first block; None for a chain's first block."""

    @property
    def token_ids(self) -> list[int]:
        """Token ids of the stored blocks (empty for other kinds)."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank whose cache changed."""

    @property
    def extra_key(self) -> bytes | None:
        """Extra key (cache salt) of the chain, or None."""

@final
class BlockManagerPool:
    """Sequence-level KV-cache manager: per dp rank a BlockManager and a SingleBlockManager.

    Parameters
    ----------
    num_blocks : int
        Block ids per rank, padding block 0 included.
    block_size : int
        Tokens per block.
    dp_size : int
        Number of data-parallel ranks (R13).
    enable_prefix_cache : bool
        Keep a prefix cache per rank.
    num_single_blocks : int or None
        Single-block ids per rank, padding included; None: one per block.
    linear_state_slots : int
        Linear-state slots per rank (hybrid models, R22); 0 disables.
    checkpoint_interval : int or None
        Tokens between linear-state checkpoints, a multiple of ``block_size`` (R24).
    linear_state_match : {"deepest", "contiguous"}
        How a KV hit is trimmed to a checkpoint boundary (R23).
    concurrent : bool
        Accepted for API compatibility; every Python pool is thread-safe (R27, R28).
    enable_events : bool
        Record KV events for ``drain_events`` (R21).
    hash_seed : int or None
        Seed of the block hash in ``[0, 2**64)``; None is ``DEFAULT_HASH_SEED``.
    sliding_window : int or None
        Window in tokens of a sliding-window group 1 (R25).
    swa_num_blocks : int or None
        Block ids per rank of the sliding-window group.
    debug_hash_bits : int or None
        Truncate hashes to this many bits (1..128) to force collisions in tests.

    Raises
    ------
    ValueError
        An argument is out of range or names a feature this build lacks.
    """

    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        *,
        dp_size: int = 1,
        enable_prefix_cache: bool = True,
        num_single_blocks: int | None = None,
        linear_state_slots: int = 0,
        checkpoint_interval: int | None = None,
        linear_state_match: _LinearStateMatch = "deepest",
        concurrent: bool = False,
        enable_events: bool = False,
        hash_seed: int | None = None,
        sliding_window: int | None = None,
        swa_num_blocks: int | None = None,
        debug_hash_bits: int | None = None,
    ) -> BlockManagerPool: ...
    @property
    def num_blocks(self) -> int:
        """Block ids per rank, padding block included."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks."""

    @property
    def enable_prefix_cache(self) -> bool:
        """Whether each rank keeps a prefix cache."""

    def can_allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """What ``allocate(seq, num_tokens)`` would return, with no side effect (R15)."""

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Give ``seq`` blocks for ``num_tokens`` tokens after a prefix-cache match (R8, R13, R14).

        On a sequence that holds blocks, grows its table (chunked prefill).

        Parameters
        ----------
        seq : Sequence
            The sequence; gets ``num_cached_tokens``, ``num_computed_tokens`` and ``dp_rank``.
        num_tokens : int or None
            Tokens the table must hold, in ``1..len(seq)``; None is ``len(seq)``.

        Returns
        -------
        bool
            False if the blocks cannot be had; the pool and ``seq`` are then unchanged.

        Raises
        ------
        ValueError
            ``num_tokens`` out of range, or ``seq`` holds blocks of another pool.
        """

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether the blocks for ``len(seq) + lookahead`` tokens can be had (R16).

        ``len(seq)`` already counts the token whose KV the next step writes: append the
        sampled token first, then ask. ``lookahead`` reserves room for speculative tokens.
        """

    def may_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Take the blocks ``can_append`` asks about (all or nothing; False if they cannot be had)."""

    def cache(self, seq: Sequence) -> None:
        """Publish the full blocks inside ``seq.num_computed_tokens`` in the prefix cache (R17)."""

    def deallocate(self, seq: Sequence) -> None:
        """``cache(seq)``, then release its blocks and single block and reset it (R18).

        Raises
        ------
        ValueError
            ``seq`` holds blocks of another pool.
        """

    def block_tables(self, seqs: Iterable[Sequence], group: int = 0) -> NDArray[np.int32]:
        """Block tables of ``seqs`` in one array (R19).

        Returns
        -------
        numpy.ndarray
            int32 of shape ``[len(seqs), max_blocks]``, padded with 0.
        """

    def slot_mapping(self, seqs: Iterable[Sequence], group: int = 0) -> NDArray[np.int64]:
        """Cache slots of tokens ``[num_computed_tokens, len)`` of every sequence (R19).

        ``slot = block_id * block_size + position % block_size``.

        Returns
        -------
        numpy.ndarray
            int64, 1-D, the sequences' slots concatenated in order.

        Raises
        ------
        ValueError
            A token is not held by its table yet (call ``may_append`` first).
        """

    def stats(self) -> _PoolStats:
        """Counts, prefix-cache and slot statistics, totals and per rank (R20)."""

    def check(self) -> None:
        """Walk every structure (R20).

        Raises
        ------
        InvariantError
            A rule is broken.
        """

    def drain_events(self) -> list[KVEvent]:
        """Return and clear the recorded KV events (R21); ``[]`` unless ``enable_events``."""

    def reset_prefix_cache(self) -> None:
        """Drop every cached entry of every rank; blocks sequences hold stay with them (R12)."""
