"""Type stubs of ``kvpool._core``, the Rust extension behind :mod:`kvpool`.

Hand-written; checked against the built module with ``python -m mypy.stubtest kvpool._core
--allowlist stubtest-allowlist.txt``. Rule numbers ("R7") refer to docs/contract.md.
Every class is frozen with a lock inside, safe to share between threads (R28), and cannot be
subclassed, but ``BlockManagerPool``, whose subclass is ``HierarchyBlockManagerPool``. The
Python docs live here; a binding's own ``__doc__`` is one line.
"""

from collections.abc import Iterable, Iterator
from collections.abc import Sequence as _Sequence
from typing import (
    Any,
    Final,
    Literal,
    SupportsIndex,
    TypeAlias,
    TypedDict,
    final,
    overload,
)

import numpy as np
from numpy.typing import NDArray
from typing_extensions import Required, Self, disjoint_base

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
    "SequenceBatch",
    "BlockManagerPool",
    "AllocationPlan",
    "ConcurrentBlockManager",
    "KVEvent",
    "LinearStatePrefixCache",
    "LinearStatePlan",
    "SlidingWindowBlockManager",
    "CompositeBlockManager",
    "HierarchyBlockManagerPool",
    "TransferPlan",
    "KVIndex",
    "encode_events",
    "decode_events",
]

# Type aliases and TypedDicts below are stub-only (private: not present at runtime).

_TokenIds: TypeAlias = _Sequence[int] | NDArray[np.integer]
# the ``seqs`` argument of the batch calls
_Seqs: TypeAlias = SequenceBatch | Iterable[Sequence]
"""Token ids: a list/tuple of ints or a 1-D integer numpy array, every id in ``[0, 2**32)``."""

_ExtraKey: TypeAlias = bytes | str | None
"""Extra key (cache salt, LoRA id, ...): bytes, str (hashed as UTF-8) or None (R6)."""

_LinearStateMatch: TypeAlias = Literal["deepest", "contiguous"]
_LinearStateSave: TypeAlias = Literal["copy", "promote"]
_Eviction: TypeAlias = Literal["lru", "slru", "ghost_slru"]
_EventKind: TypeAlias = Literal["stored", "removed", "cleared", "group"]

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

class _WindowCounts(_BlockCounts):
    """Block counts of the sliding-window group (R25) plus blocks released behind the window."""

    num_releases: int

class _CheckpointStats(TypedDict):
    """``LinearStatePrefixCache.stats()``."""

    hits: int
    evictions: int
    commits: int

_MissReason = Literal[
    "shorter_than_block", "no_shared_prefix", "evicted", "window_blocks_gone", "no_checkpoint"
]

class _MissStats(TypedDict):
    """Admissions whose prefix hit a group cut short of the prompt, per reason (docs/hybrid.md
    "Why no hit"): the first three are the full-attention group's, then the sliding-window
    group's and the linear-state group's."""

    shorter_than_block: int
    no_shared_prefix: int
    evicted: int
    window_blocks_gone: int
    no_checkpoint: int

class _MemoryStats(TypedDict):
    """Bytes of one rank's store (every value 0 unless the pool was given ``block_bytes``):
    free blocks, cached KV blocks, KV blocks in use, and blocks held for recurrent states
    (``linear_state_blocks``)."""

    free_bytes: int
    cached_bytes: int
    kv_bytes: int
    state_bytes: int

class _RankStats(_BlockCounts):
    """Statistics of one dp rank of a pool (R20)."""

    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evictions: int
    num_free_single_blocks: int
    num_live_slots: int
    num_pending_checkpoints: int
    num_committed_checkpoints: int
    num_free_linear_state_slots: int
    linear_state_hits: int
    num_checkpoint_evictions: int
    num_checkpoint_commits: int
    num_linear_state_blocks: int
    """Blocks of the store held for recurrent states (``linear_state_blocks``; else 0)."""
    window: _WindowCounts | None
    """The sliding-window group's own store (``swa_num_blocks``); None without one (a window
    group in the shared store is counted in ``BlockManagerPool.memory()``)."""
    misses: _MissStats
    memory: _MemoryStats
    xtensor: _MappedMemoryStats | None
    """Mapped memory on elastic pages (the ``xtensor`` option); None without it."""
    host: _HostStats | None

class _MappedMemoryStats(TypedDict):
    """Mapped memory of one rank of a pool on elastic pages, or the sum over the ranks
    (docs/xtensor.md)."""

    num_pages: int
    mapped_pages: int
    """Pages mapped now, page 0 included."""
    mapped_bytes: int
    spare_pages: int
    """Mapped pages with no used or cached block (the preallocated spares)."""
    limit_pages: int
    limit_bytes: int
    peak_mapped_pages: int
    """Most pages mapped at once (for the total: the sum of the ranks' peaks)."""
    num_page_maps: int
    num_page_unmaps: int
    num_map_failures: int

class _XTensorOption(TypedDict, total=False):
    """The ``xtensor=`` option of :class:`BlockManagerPool` (docs/xtensor.md); only
    ``blocks_per_page`` is required."""

    blocks_per_page: Required[int]
    page_bytes: int
    spare_pages: int
    memory_limit: int | None
    backend: Literal["accounting", "host"] | Any
    """A name, or page backend objects (``map_page(page)`` / ``unmap_page(page)``, e.g.
    ``kvpool.xtensor.CudaPageBackend``): a list of one per dp rank, or one object for one rank."""

class _SharedGroupMemory(TypedDict):
    """One group's blocks in the full-attention group's store."""

    group: int
    """0 full attention, then the pool's other groups in table order."""
    cached_blocks: int
    used_blocks: int

class _LinearStateMemory(TypedDict):
    group: int
    slots_in_use: int
    """Live, pending and committed slots."""
    slots: int

class _RankMemory(TypedDict):
    """``BlockManagerPool.memory()``: one rank's store per group (docs/hybrid.md)."""

    num_blocks: int
    free_blocks: int
    block_bytes: int
    """Bytes of one block of the store (the pool's ``block_bytes``; 0: unknown)."""
    shared: list[_SharedGroupMemory]
    own_window: _WindowCounts | None
    """A sliding-window group with its own store (``swa_num_blocks``), with its ``group``."""
    linear_state: _LinearStateMemory | None

class _PoolStats(_RankStats):
    """``BlockManagerPool.stats()``: totals over all ranks plus ``ranks``, one dict per rank."""

    ranks: list[_RankStats]

class _HostStats(_BlockCounts):
    """The host tier of a ``HierarchyBlockManagerPool`` rank (R26): counts plus transfers."""

    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evictions: int
    num_loaded_blocks: int
    num_offloaded_blocks: int
    num_pending_load_blocks: int
    num_pending_offload_blocks: int

class _HierarchyRankStats(_BlockCounts):
    """Statistics of one dp rank of a ``HierarchyBlockManagerPool``: device tier plus ``host``."""

    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evictions: int
    num_free_single_blocks: int
    num_live_slots: int
    num_pending_checkpoints: int
    num_committed_checkpoints: int
    num_free_linear_state_slots: int
    linear_state_hits: int
    num_checkpoint_evictions: int
    num_checkpoint_commits: int
    num_linear_state_blocks: int
    window: _WindowCounts | None
    misses: _MissStats
    memory: _MemoryStats
    xtensor: None
    host: _HostStats

class _DebugCounters(TypedDict):
    """``BlockManagerPool.debug_counters()``: chain walks so far (for tests, not statistics)."""

    device_chain_walks: int
    host_chain_walks: int

class _HierarchyPoolStats(_HierarchyRankStats, total=False):
    """``HierarchyBlockManagerPool.stats()``: totals plus ``ranks``, one dict per rank; with a
    remote tier (``kvpool.HierarchyBlockManagerPool``, python/kvpool/tiers/hierarchy.py),
    ``remote`` (lookups, hit/miss/fetched/failed blocks, the tier's counters)."""

    ranks: list[_HierarchyRankStats]
    remote: dict[str, Any]

class _RemoteCounters(TypedDict):
    """The core's part of ``stats()["remote"]``, totals over ranks (R26)."""

    hit_blocks: int
    fetched_blocks: int
    failed_fetch_blocks: int
    pending_fetch_blocks: int

_OffloadPolicy: TypeAlias = Literal["on_deallocate", "on_evict"]

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
    """Plain block allocator with a prefix cache (xLLM's BlockManagerImpl, R1-R12).

    Parameters
    ----------
    num_blocks : int
        Ids in the pool, padding block 0 included (``num_total_blocks == num_blocks - 1``), at
        most ``2**30``; ``num_blocks * block_size`` below ``2**40`` (docs/contract.md, "Choice:
        sizes and counts").
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
    """Thread-safe block allocator with a prefix cache (xLLM's ConcurrentBlockManagerImpl).

    The same API and behaviour as :class:`BlockManager` (R1-R12), for many threads at once
    (R27): allocation from the free list and every handle release are lock-free, the prefix
    cache sits behind one lock that a handle release never takes, and every method releases the
    GIL around its Rust work (R28). Counts read while other threads work are snapshots; they,
    and ``check()``, are exact when no other thread is using the manager.

    Parameters
    ----------
    num_blocks : int
        Ids in the pool, padding block 0 included (``num_total_blocks == num_blocks - 1``), at
        most ``2**30``; ``num_blocks * block_size`` below ``2**40`` (docs/contract.md, "Choice:
        sizes and counts").
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

@disjoint_base
class Sequence:
    """A request's tokens and KV-cache state (block table, computed tokens, dp rank).

    Subclass it for an engine's own sequence class (no twin object): instances take their own
    attributes, and a subclass's constructor arguments past ``token_ids`` (and the keywords
    ``seq_id`` / ``extra_key``) go to its ``__init__``, which need not call the base's.

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
        cls,
        token_ids: _TokenIds,
        *args: Any,
        seq_id: int | None = None,
        extra_key: _ExtraKey = None,
        **kwargs: Any,
    ) -> Self: ...
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

    def extend_to(self, token_ids: _TokenIds) -> None:
        """Append the items of ``token_ids`` past ``len(self)``.

        ``token_ids`` is the request's whole token list, as an engine grows it: its first
        ``len(self)`` items are this sequence's tokens (not read again). A list is read from
        there on without a slice, so a per-step sync costs the new tokens only.

        Raises
        ------
        ValueError
            ``token_ids`` is shorter than the sequence, or a token is out of ``[0, 2**32)``.
        TypeError
            ``token_ids`` is not a sequence of ints or a 1-D integer array.
        """

    @property
    def block_table(self) -> NDArray[np.int32]:
        """The block table: int32 array of shape ``[num_blocks]``, one physical id per logical
        block (a fresh copy)."""

    def group_block_table(self, group: int) -> NDArray[np.int32]:
        """The block table of group ``group``, int32 of shape ``[n]`` (R25).

        Group 0 is the full-attention table; group 1, in a pool built with ``sliding_window``,
        the window table, whose entries behind the window are 0.

        Raises
        ------
        ValueError
            The sequence has no such group.
        """

    @property
    def num_blocks(self) -> int:
        """Number of entries of the block table."""

    @property
    def last_block_id(self) -> int | None:
        """The table's last entry (the one ``may_append`` just added), or None; no copy."""

    def block_id(self, i: int) -> int:
        """Entry ``i`` of the block table (negative ``i`` counts from the end); no copy.

        Raises
        ------
        IndexError
            ``i`` is out of range.
        """

    def block_ids(self) -> list[int]:
        """The block table as a Python list of int (engines that keep tables as lists)."""

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV came from the prefix cache at allocation.

        vLLM's ``num_cached_tokens`` (the admission hit). nano-vllm's ``num_cached_tokens``
        ("KV exists") is ``num_computed_tokens`` here.
        """

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
        """Live linear-state slot while allocated in a pool with linear state (R22), else None."""

    @property
    def linear_state_restore_slot(self) -> int | None:
        """Checkpoint slot the live state is restored from at allocation (R23), else None.

        None means the sequence starts from an empty recurrent state.
        """

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens given at construction (the prompt; its last block boundary gets a checkpoint)."""

    @property
    def is_allocated(self) -> bool:
        """Whether the sequence holds blocks of a pool."""

@final
class SequenceBatch:
    """An ordered set of sequences kept from step to step: an engine's running batch.

    Pass it wherever a pool takes ``seqs`` (``may_append_all``, ``advance``, ``block_tables``,
    ``slot_mapping``): the pool reads the members in Rust, with no per-sequence Python work and
    no conversion per call. Each sequence is in a batch at most once; the order is insertion
    order (removals keep the others' order), and ``token_ids`` arrays line up with it.

    Parameters
    ----------
    seqs : iterable of Sequence, optional
        Initial members, in order (as ``extend``).
    """

    def __new__(cls, seqs: Iterable[Sequence] | None = None) -> SequenceBatch: ...
    def add(self, seq: Sequence) -> None:
        """Append ``seq``.

        Raises
        ------
        ValueError
            ``seq`` is already in the batch.
        TypeError
            ``seq`` is not a Sequence.
        """

    def extend(self, seqs: Iterable[Sequence]) -> None:
        """Append every sequence of ``seqs`` in order; all-or-nothing.

        Raises
        ------
        ValueError
            One is already in the batch or listed twice (nothing is added).
        TypeError
            One is not a Sequence (nothing is added).
        """

    def remove(self, seq: Sequence) -> None:
        """Remove ``seq``, keeping the others' order.

        Raises
        ------
        ValueError
            ``seq`` is not in the batch.
        """

    def remove_all(self, seqs: Iterable[Sequence]) -> None:
        """Remove every sequence of ``seqs`` in one pass, keeping the others' order;
        all-or-nothing.

        Raises
        ------
        ValueError
            One is not in the batch or is listed twice (nothing is removed).
        """

    def clear(self) -> None:
        """Remove every sequence."""

    def check(self) -> None:
        """Check the invariants: each member once, the membership index naming exactly them.

        Raises
        ------
        InvariantError
            A rule is broken.
        """

    @property
    def seq_ids(self) -> NDArray[np.uint64]:
        """``seq_id`` of each member in batch order: uint64 of shape ``[len(batch)]``."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: SupportsIndex, /) -> Sequence:
        """The member at ``index`` (negative counts from the end): the sequence behind an index
        that ``advance`` or ``may_append_all`` returned.

        Raises
        ------
        IndexError
            ``index`` is out of range.
        TypeError
            ``index`` is not an int.
        """

    def __contains__(self, seq: object, /) -> bool: ...
    def __iter__(self) -> Iterator[Sequence]:
        """The members in batch order (a snapshot: changing the batch meanwhile is safe)."""

@final
class KVEvent:
    """A KV event for external KV-aware routers (R21), from ``BlockManagerPool.drain_events``.

    Self-describing (docs/events.md): ``KVIndex.apply(instance, pool.drain_events())`` takes
    the list as it is."""

    @property
    def sequence(self) -> int:
        """Position in the (pool, dp rank) stream: 1, 2, 3, ... over every medium."""

    @property
    def medium(self) -> _Medium:
        """``"device"``, ``"host"`` (the host tier, R26) or ``"remote"`` (the remote tier)."""

    @property
    def group(self) -> int:
        """The KV-cache group: 0 full attention, then the pool's other groups in the order of a
        sequence's tables (the linear-state checkpoints, R22; the sliding window, R25)."""

    @property
    def group_kind(self) -> _GroupKind:
        """The group's kind."""

    @property
    def sliding_window(self) -> int | None:
        """The group's window in tokens for ``"sliding_window"``, else None."""

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

@disjoint_base
class BlockManagerPool:
    """Sequence-level KV-cache manager: per dp rank a BlockManager and a SingleBlockManager.

    Parameters
    ----------
    num_blocks : int
        Block ids per rank, padding block 0 included; at most ``2**30`` (as are
        ``num_single_blocks``, ``linear_state_slots`` and ``swa_num_blocks``; ``block_size`` at
        most ``2**16``, ``dp_size`` at most 1024: docs/contract.md, "Choice: sizes and counts").
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
        Release the GIL in every call so threads run in parallel (R27, R28); every pool is
        thread-safe either way, and batch exports always release it.
    enable_events : bool
        Record KV events for ``drain_events`` (R21).
    event_replay : int
        Events per rank the replay buffer keeps for ``events_since`` (default 4096; 0: none).
    hash_seed : int or None
        Seed of the block hash in ``[0, 2**64)``; None is ``DEFAULT_HASH_SEED``.
    sliding_window : int or None
        Window in tokens of a sliding-window group 1 (R25).
    attention_chunk_size : int or None
        In place of ``sliding_window``: the window groups are chunked local attention groups of
        this chunk in tokens (Llama 4's ``attention_chunk_size``, a multiple of ``block_size``):
        a query at position p reads the tokens from its chunk's start ``p - p % chunk``, so a
        group's table holds its blocks from there and a hit at a chunk's end needs none of them.
        Needs the shared store (docs/hybrid.md "Chunked local attention").
    window_groups : int
        Groups of ``sliding_window`` in the shared store (default 1, at most 8): groups 1 to
        ``window_groups``, each with a table of its own and its ids from the one store (vLLM's
        several window groups of one spec, e.g. Gemma 3's); more than 1 needs the shared store.
    state_groups : int
        Recurrent-state groups in the shared store, in place of window groups (default 0, at
        most 8; vLLM's Mamba groups in "align" mode, docs/hybrid.md "State groups"): groups 1
        to ``state_groups``. A step's state lives in the block of its last token, copied by the
        engine from the previous step's block (which the table holds until the step is done);
        a block is cached only when a step ended on its end boundary, and a hit at a boundary
        needs the one block before it.
    swa_num_blocks : int or None
        Block ids per rank of a sliding-window group with a store of its own. None (the
        default): the window group draws its blocks from the full-attention group's store, one
        free list and one id space of ``num_blocks`` ids for both (docs/hybrid.md "One block
        store").
    shared_blocks : bool or None
        Whether the sliding-window group shares the full-attention group's store; None: shared
        unless ``swa_num_blocks``, ``xtensor`` or a host tier is given (with a host tier, a
        window store of its own keeps the runs of chains whose blocks went to the host).
    retention_tokens : int
        With a shared store, the window runs kept longest (evicted last): those of the
        boundaries in the first ``retention_tokens`` tokens of every chain (where system prompts
        end) and in the last ``retention_tokens`` computed tokens of each released sequence
        (where the next turn of a conversation diverges); default 512.
    linear_state_save : {"copy", "promote"}
        Save a checkpoint by copying the live state into a pending slot, or by promoting the
        live slot (zero-copy; the sequence continues in a fresh slot) (R22).
    linear_state_blocks : int
        Blocks of the full-attention group's store one recurrent state takes (docs/hybrid.md
        "Linear state in the one store"): each slot in use (live, pending or committed) then
        holds that many blocks of the store, so memory flows between KV and states;
        ``linear_state_slots`` caps the slots (the rows of the state tensor). 0 (the default):
        the slots are a store of their own.
    block_bytes : int
        Bytes of one block of the store (one group's K and V across its layers); ``stats()``
        and ``memory()`` report bytes with it (0, the default: unknown).
    debug_hash_bits : int or None
        Truncate hashes to this many bits (1..128) to force collisions in tests.
    xtensor : dict or None
        Every rank's full-attention blocks on elastic virtual-memory pages (an
        ``XTensorBlockManager`` per rank, xLLM's ``enable_xtensor``; docs/xtensor.md):
        ``{"blocks_per_page": int, "page_bytes": int = 2 MiB, "spare_pages": int = 1,
        "memory_limit": int | None = None, "backend": "accounting" | "host" | [object per rank]
        = "accounting"}``, ``memory_limit`` in bytes per rank. Backend objects have
        ``map_page(page)`` / ``unmap_page(page)`` (``kvpool.xtensor.CudaPageBackend``); the pool
        then releases the GIL in every call, and an exception a backend raises is raised as
        itself by a call that has done nothing of its own (one met while settling after a
        call's work is retried, and raised, by the rank's next call that may map, evict or
        allocate; docs/xtensor.md, "A failing backend"). Errors name ``xtensor.<key>``.
    dedup : bool
        Dedup on publish (R9 revised): a computed full block whose chain position is already
        cached with another block switches the sequence's table entry to the cached block and
        frees the duplicate (read the switches with ``drain_block_switches``). False keeps first
        writer wins (engines whose workers only append to block tables, as vLLM's do).
    eviction : {"lru", "slru", "ghost_slru"}
        How the prefix cache orders what it may evict (R11a, docs/eviction.md), always leaves
        first (R10) and, in a hybrid pool, what no hit point can use first. ``"lru"`` (the
        default): least recently released. ``"slru"``: segmented LRU, a block found by a
        lookup while cached is kept in a protected segment (20% of the blocks) that is evicted
        after the others: a scan of one-off prompts cannot flush it. ``"ghost_slru"``: SLRU
        whose protected segment also admits a block recomputed soon after its eviction. Not
        with ``xtensor``, and needs ``enable_prefix_cache``.
    protected_percent : int
        The share of the blocks, in percent (0-100, default 20), the protected segment of
        ``"slru"`` and ``"ghost_slru"`` may hold; no effect under ``"lru"``.
    max_retained_fraction : float
        The most of a rank's blocks session hints (``retain``) may hold, in [0, 1]; default 0.5.

    Every option composes with every other, and with a host tier (the subclass
    ``HierarchyBlockManagerPool``; docs/host_tier.md), except ``xtensor``, which takes no
    host tier.

    Raises
    ------
    ValueError
        An argument is out of range (the message names it).
    TypeError
        An option of the wrong type, or an unknown option.
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
        event_replay: int = 4096,
        hash_seed: int | None = None,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        window_groups: int = 1,
        state_groups: int = 0,
        swa_num_blocks: int | None = None,
        shared_blocks: bool | None = None,
        retention_tokens: int = 512,
        linear_state_save: _LinearStateSave = "copy",
        linear_state_blocks: int = 0,
        block_bytes: int = 0,
        debug_hash_bits: int | None = None,
        xtensor: _XTensorOption | None = None,
        dedup: bool = True,
        eviction: _Eviction = "lru",
        protected_percent: int = 20,
        max_retained_fraction: float = 0.5,
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

    @property
    def concurrent(self) -> bool:
        """Whether every call releases the GIL (built with ``concurrent=True``)."""

    @property
    def num_free_blocks(self) -> int:
        """Free blocks over all ranks: ``stats()["num_free_blocks"]`` without building the dict."""

    @property
    def num_cached_blocks(self) -> int:
        """Cache-only blocks over all ranks: ``stats()["num_cached_blocks"]``."""

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by sequences over all ranks: ``stats()["num_used_blocks"]``."""

    @property
    def num_groups(self) -> int:
        """Block groups of every sequence: 1, or 1 + ``window_groups`` with ``sliding_window``
        (R25)."""

    def can_allocate(
        self, seq: Sequence, num_tokens: int | None = None, *, num_new_tokens: int | None = None
    ) -> bool:
        """What ``allocate(seq, num_tokens)`` would return, with no side effect (R15)."""

    def plan(
        self, seq: Sequence, num_tokens: int | None = None, *, num_new_tokens: int | None = None
    ) -> AllocationPlan | None:
        """The allocation ``allocate(seq, num_tokens)`` would make, with no side effect of any kind.

        One walk of the prefix chain per tier (device, then host); the plan carries what the
        walks found, so ``allocate(seq, num_tokens, plan=plan)`` only retains it. The hit is
        the deepest boundary every group of the rank can serve (R23, R25, docs/host_tier.md).

        Returns
        -------
        AllocationPlan or None
            None exactly when ``allocate`` would return False (R15). A sequence that holds
            blocks gets a growth plan (``is_growth``).

        Raises
        ------
        ValueError
            ``num_tokens`` out of range, or ``seq`` holds blocks of another pool.
        TypeError
            ``plan`` is not an ``AllocationPlan``.
        """

    def next_checkpoint_boundary(self, seq: Sequence) -> int | None:
        """Where ``seq``'s next prefill chunk must end for a checkpoint to be saved (R24).

        The smallest computed-token count above ``seq.num_computed_tokens``, at most
        ``len(seq)``, at which ``cache(seq)`` plans a checkpoint save: the next multiple of
        ``checkpoint_interval``, the prompt's last block boundary, or its junction (where the
        prompt left the cached prefix tree at admission, past the restored checkpoint). A chunk
        that passes a boundary without ending on it saves nothing there.

        Returns
        -------
        int or None
            None without linear state, or when no boundary is left before ``len(seq)``.

        Raises
        ------
        ValueError
            ``seq`` holds blocks of another pool.
        """

    def allocate_shared(self, seq: Sequence) -> bool:
        """The prefix hit only, into a sequence that holds nothing (xLLM's ``allocate_shared``).

        Takes the hit's blocks (trimmed as ``allocate`` trims it), the single block and the
        live slot, but no new blocks; ``num_computed_tokens`` is the hit. ``allocate`` then grows
        the table. With a host tier only the device hit is taken (loads need new blocks).

        Returns
        -------
        bool
            False if the rank has no single block or live slot; nothing changed then.

        Raises
        ------
        ValueError
            ``seq`` already holds blocks, has no tokens, or holds blocks of another pool.
        """

    def allocate(
        self,
        seq: Sequence,
        num_tokens: int | None = None,
        *,
        plan: AllocationPlan | None = None,
        num_new_tokens: int | None = None,
    ) -> bool:
        """Give ``seq`` blocks for ``num_tokens`` tokens after a prefix-cache match (R8, R13, R14).

        On a sequence that holds blocks, grows its table (chunked prefill).

        Parameters
        ----------
        seq : Sequence
            The sequence; gets ``num_cached_tokens``, ``num_computed_tokens`` and ``dp_rank``.
        num_tokens : int or None
            Tokens the table must hold, in ``1..len(seq)``; None is ``len(seq)``.
        num_new_tokens : int or None
            Instead of ``num_tokens``: the table holds the computed tokens after the match (the
            hit over every tier; on an allocated sequence its ``num_computed_tokens``) plus
            ``num_new_tokens >= 1``, at most ``len(seq)``: a first chunk sized in one walk.
        plan : AllocationPlan or None
            A plan from ``plan(seq, num_tokens)``: carried out when nothing changed since
            (this pool, this sequence at its length, no pool call in between), else the pool
            plans again.

        Returns
        -------
        bool
            False if the blocks cannot be had; the pool and ``seq`` are then unchanged.

        Raises
        ------
        ValueError
            ``num_tokens`` or ``num_new_tokens`` out of range, both given, or ``seq`` holds
            blocks of another pool.
        """

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether the blocks for ``len(seq) + lookahead`` tokens can be had (R16).

        ``len(seq)`` already counts the token whose KV the next step writes: append the
        sampled token first, then ask. ``lookahead`` reserves room for speculative tokens.
        """

    def may_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Take the blocks ``can_append`` asks about, all or nothing (False: they cannot be had)."""

    def cache(self, seq: Sequence) -> None:
        """Publish the full blocks inside ``seq.num_computed_tokens`` in the prefix cache (R17)."""

    def deallocate(self, seq: Sequence) -> None:
        """``cache(seq)``, then release its blocks and single block and reset it (R18).

        Raises
        ------
        ValueError
            ``seq`` holds blocks of another pool.
        """

    def block_tables(self, seqs: _Seqs, group: int = 0, *, pad: int = 0) -> NDArray[np.int32]:
        """Block tables of ``seqs`` in one array (R19).

        Parameters
        ----------
        pad : int
            The value past each table's end (0, id 0 being the padding block; nano-vllm pads
            with -1). Released sliding-window entries stay 0.

        Returns
        -------
        numpy.ndarray
            int32 of shape ``[len(seqs), max_blocks]``, padded with ``pad``.
        """

    def slot_mapping(
        self, seqs: _Seqs, group: int = 0, *, num_tokens: _TokenIds | None = None
    ) -> NDArray[np.int64]:
        """Cache slots of tokens ``[num_computed_tokens, len)`` of every sequence (R19).

        ``slot = block_id * block_size + position % block_size``.

        Parameters
        ----------
        num_tokens : sequence of int or None
            One count per sequence: the slots of its next ``num_tokens[i]`` tokens from
            ``num_computed_tokens`` (a chunked prefill's chunk) instead of all of them.

        Returns
        -------
        numpy.ndarray
            int64, 1-D, the sequences' slots concatenated in order.

        Raises
        ------
        ValueError
            A token is not held by its table yet (call ``may_append`` first), or a count goes
            past ``len(seq)`` or the table (the message names ``num_tokens``).
        """

    def advance(
        self, seqs: _Seqs, token_ids: _TokenIds, *, lookahead: int | None = None
    ) -> list[int] | None:
        """After a forward step, for every sequence in one call (GIL released).

        For each ``seqs[i]``: ``num_computed_tokens = len(seq)`` (R17), ``cache(seq)``,
        ``append_token(token_ids[i])``: the calls an engine makes per sequence after each step,
        without the Python loop. Take the new tokens' slots with ``may_append_all``, or pass
        ``lookahead`` to take them in this call (one call per decode step).

        Parameters
        ----------
        seqs : SequenceBatch or iterable of Sequence
            Distinct, allocated in this pool, each holding all its tokens.
        token_ids : list of int or 1-D integer array, shape ``[len(seqs)]``
            The sampled token of each sequence, in ``seqs`` order.
        lookahead : int, optional
            When given (>= 0), then also ``may_append(seq, lookahead)`` for every sequence.

        Returns
        -------
        list of int or None
            With ``lookahead``: the indices of the sequences that got no room for their next
            token (advanced, but not grown: grow them later or preempt them); else None.

        Raises
        ------
        ValueError
            ``token_ids`` has another length, a sequence is listed twice, is not allocated in
            this pool, or has tokens its table does not hold; nothing is changed.
        """

    def may_append_all(self, seqs: _Seqs, lookahead: int = 0) -> list[int]:
        """``may_append(seq, lookahead)`` for every sequence in one call (R16, GIL released).

        Returns
        -------
        list of int
            Indices into ``seqs`` of the sequences whose blocks could not be had, ascending;
            empty when every sequence got room (``if pool.may_append_all(batch):`` is the
            check). Those sequences are unchanged: preempt them.

        Raises
        ------
        ValueError
            A sequence is listed twice or is not allocated in this pool; nothing is changed.
        """

    def stats(self) -> _PoolStats:
        """Counts, prefix-cache and slot statistics, totals and per rank (R20)."""

    def memory(self) -> list[_RankMemory]:
        """Every rank's memory per group: a census of its store (O(blocks), not for every
        step; ``stats()`` has the totals)."""

    def debug_counters(self) -> _DebugCounters:
        """Chain walks of the device and host prefix caches so far (for tests of one walk per
        admission; not part of ``stats``)."""

    def check(self) -> None:
        """Walk every structure (R20).

        Raises
        ------
        InvariantError
            A rule is broken.
        """

    def drain_events(self) -> list[KVEvent]:
        """Return and clear the recorded KV events (R21); ``[]`` unless ``enable_events``.

        First records the removals of sliding-window blocks that stopped being findable since
        the last call (their last handle may drop anywhere, lock-free; docs/events.md)."""

    @overload
    def drain_block_switches(
        self, *, with_group: Literal[False] = False
    ) -> list[tuple[int, int, int]]: ...
    @overload
    def drain_block_switches(
        self, *, with_group: Literal[True]
    ) -> list[tuple[int, int, int, int]]: ...
    @overload
    def drain_block_switches(
        self, *, with_group: bool = False
    ) -> list[tuple[int, int, int]] | list[tuple[int, int, int, int]]:
        """Return and clear the table entries dedup on publish switched (R9 revised).

        Parameters
        ----------
        with_group : bool
            Return ``(seq_id, group, old_id, new_id)``: ``group`` as in
            ``block_tables(seqs, group)``. Only the full-attention group (0) dedups: the
            sliding-window group keeps the first writer (R25), linear-state slots are not blocks.

        Returns
        -------
        list of (seq_id, old_id, new_id)
            In the order they happened; ``old_id`` went back to the free list, ``new_id`` is
            the cached block the sequence now holds at that position. ``[]`` with
            ``dedup=False``. The list grows until drained.
        """

    @property
    def dedup(self) -> bool:
        """Whether the pool dedups on publish (R9 revised)."""

    @property
    def eviction(self) -> _Eviction:
        """The prefix cache's eviction policy (R11a): ``"lru"``, ``"slru"`` or
        ``"ghost_slru"``."""

    @property
    def protected_percent(self) -> int:
        """The share of the blocks, in percent, SLRU's protected segment may hold (R11a)."""

    def last_event_sequence(self, dp_rank: int) -> int:
        """The last event sequence number of rank ``dp_rank`` (0 before its first event)."""

    def events_since(self, dp_rank: int, sequence: int) -> list[KVEvent] | None:
        """Replay: rank ``dp_rank``'s events numbered ``sequence`` and later, drained or not,
        from the bounded buffer (``event_replay``); None when it no longer reaches back that
        far (the consumer then calls ``KVIndex.resync``). ``sequence`` past the next number is
        a ValueError."""

    def record_remote_events(
        self, dp_rank: int, kind: Literal["stored", "removed"], block_hashes: _Sequence[bytes]
    ) -> int:
        """Record the remote tier's stores or removals of rank ``dp_rank``'s blocks as
        ``"remote"`` events in its stream (``kvpool.tiers.remote_transfer.RemoteTransfer`` calls
        it: the pool does no I/O); returns the events recorded (0 without ``enable_events``)."""

    def reset_prefix_cache(self) -> None:
        """Drop every cached entry of every rank, every committed checkpoint nothing pins and
        every sliding-window publication; blocks sequences hold stay with them (R12, R24)."""

    @property
    def xtensor(self) -> _XTensorOption | None:
        """The ``xtensor`` option with its defaults filled in (``backend`` ``"custom"`` for
        objects), or None (fixed memory)."""

    def set_memory_limit(
        self, limit: int | None, *, dp_rank: int | None = None
    ) -> list[_MemoryLimitReport]:
        """Set the memory limit in bytes (None: the whole range) of rank ``dp_rank``, or of every
        rank; one report per rank set. Lowering it unmaps spares, evicts cached blocks page by page
        and unmaps what empties; what sequences hold stays mapped (``excess_bytes``) and returns
        as they release it (docs/xtensor.md).

        Raises
        ------
        ValueError
            The pool has no ``xtensor`` option (names ``limit``), ``limit`` negative, or
            ``dp_rank`` out of range.
        """

    def mapped_page_ids(self, dp_rank: int = 0) -> list[int]:
        """The mapped pages of rank ``dp_rank``, ascending (page ``p`` holds blocks
        ``p * blocks_per_page ..``); ``[]`` without the ``xtensor`` option."""

    def retain(self, seq: Sequence, ttl: float, now: float) -> bool:
        """Session hint: keep ``seq``'s published prefix from eviction while its session is away.

        Publishes ``seq``'s computed full blocks, then holds them (used, not cached: R15 stays
        exact) until ``now + ttl`` on the caller's clock (``expire_retained``) or
        ``release_retained``. Call it before ``deallocate``. A hint taken from the same sequence
        id before ends. Full attention only (docs/sessions.md).

        Returns
        -------
        bool
            False, holding nothing, when the hint would take the rank's held blocks over
            ``max_retained_fraction`` of its blocks.

        Raises
        ------
        ValueError
            ``seq`` holds no blocks of this pool, the pool has other groups or no prefix cache,
            or ``ttl`` / ``now`` is not finite (``ttl`` must be >= 0).
        TypeError
            ``ttl`` or ``now`` is not a number.
        """

    def release_retained(self, seq: Sequence | int) -> bool:
        """End the session hint taken from ``seq`` (or the sequence id ``seq``): its session came
        back or ended. Returns whether there was one."""

    def expire_retained(self, now: float) -> int:
        """Drop the session hints whose time to live ran out by ``now``; returns how many."""

    @property
    def num_retained(self) -> int:
        """Session hints held now."""

    @property
    def num_retained_blocks(self) -> int:
        """Blocks session hints hold, over all ranks (each counted once)."""

    def linear_state_cache(self, dp_rank: int) -> LinearStatePrefixCache:
        """The linear-state cache of rank ``dp_rank``, a live view (R22).

        Raises
        ------
        ValueError
            ``dp_rank`` out of range, or the pool has no linear state.
        """

    def take_linear_state_plan(self) -> LinearStatePlan:
        """The recurrent-state copies planned since the last call, for every rank (R24).

        Execute them before the sequences' next forward step (restores first, then saves),
        then confirm with ``commit_linear_state_plan``.
        """

    def commit_linear_state_plan(self, plan: LinearStatePlan) -> None:
        """Confirm the copies of ``plan``: saved checkpoints become matchable, restored ones are
        unpinned, cancelled saves free their slots (R24).

        Raises
        ------
        ValueError
            The plan was already committed or comes from another pool.
        """

@final
class AllocationPlan:
    """An allocation decided by ``BlockManagerPool.plan``, with no side effect (docs/contract.md,
    "Plan once").

    Hand it to ``allocate(seq, num_tokens, plan=plan)``. Read-only; tokens are multiples of the
    block size. ``num_cached_tokens`` is what ``seq.num_cached_tokens`` becomes once every load
    is confirmed (nano-vllm's ``can_allocate``, vLLM's ``get_computed_blocks``).
    """

    @property
    def dp_rank(self) -> int:
        """The dp rank the sequence goes (or is) to (R13)."""

    @property
    def num_tokens(self) -> int:
        """Tokens the table will hold."""

    @property
    def is_growth(self) -> bool:
        """Whether the sequence already holds blocks (the plan grows its table)."""

    @property
    def num_cached_blocks(self) -> int:
        """Blocks of the prefix hit, every tier together (0 for a growth)."""

    @property
    def num_cached_tokens(self) -> int:
        """Tokens of the prefix hit, every tier together."""

    @property
    def device_hit_tokens(self) -> int:
        """Hit tokens already on the device (cached at allocation)."""

    @property
    def host_hit_tokens(self) -> int:
        """Hit tokens loaded from the host tier (cached once the load is confirmed, R26)."""

    @property
    def remote_hit_tokens(self) -> int:
        """Hit tokens fetched from the remote tier, then loaded from host."""

    @property
    def num_new_blocks(self) -> int:
        """Fresh device blocks the allocation takes (load destinations included)."""

    @property
    def num_blocks(self) -> int:
        """Entries of the block table after the allocation."""

    @property
    def restore_checkpoint(self) -> bytes | None:
        """Prefix hash (16 bytes) of the checkpoint the linear state is restored from (R23)."""

    @property
    def kv_hit_tokens(self) -> int:
        """Tokens of the prefix the full-attention caches hold (device and host, R8 applied):
        the hit the full-attention group alone could serve, before the other groups' limits."""

    @property
    def miss_group(self) -> int | None:
        """The group that cut the hit short of the prompt (0 full attention, then the pool's
        other groups in table order); None for a full hit (docs/hybrid.md "Why no hit")."""

    @property
    def miss_reason(self) -> _MissReason | None:
        """Why the hit stops short of the prompt; None for a full hit."""

# --- hybrid models (R22-R25) ------------------------------------------------------------------

@final
class LinearStatePrefixCache:
    """Recurrent-state (GDN / Mamba) slots and their prefix checkpoints (R22).

    Slot 0 is padding. A slot is free, live (held by a running sequence), a pending checkpoint
    (reserved for a prefix hash, not matchable) or a committed checkpoint (matchable, LRU
    evictable unless pinned by a planned restore). ``prefix_hash`` arguments are the 16-byte
    chain hashes of ``hash_blocks``.

    Parameters
    ----------
    num_slots : int
        Slots including the padding slot 0 (at least 2).
    """

    def __new__(cls, num_slots: int) -> LinearStatePrefixCache: ...
    @property
    def num_slots(self) -> int:
        """Slots including the padding slot 0."""

    @property
    def num_free_slots(self) -> int:
        """Free slots."""

    @property
    def num_live_slots(self) -> int:
        """Live slots (running sequences and ``acquire_live_slot``)."""

    @property
    def num_pending_checkpoints(self) -> int:
        """Reserved checkpoints the worker has not written yet."""

    @property
    def num_committed_checkpoints(self) -> int:
        """Matchable checkpoints."""

    @property
    def num_pinned_checkpoints(self) -> int:
        """Committed checkpoints pinned by planned restores."""

    def acquire_live_slot(self) -> int:
        """Take a live slot, evicting the least-recently-used unpinned checkpoint if none is free.

        Raises
        ------
        OutOfBlocksError
            Every slot is live, pending or pinned.
        ValueError
            A view of a pool whose states take blocks of its one store
            (``linear_state_blocks``): only the pool takes their slots.
        """

    def release_live_slot(self, slot: int) -> None:
        """Release a slot taken with ``acquire_live_slot`` (anything else is a ValueError)."""

    def reserve_checkpoint(self, prefix_hash: bytes) -> int | None:
        """Reserve a slot for the checkpoint of ``prefix_hash`` (pending, not matchable).

        Returns None if the hash is already pending or committed, or no slot can be had (always,
        through a view of a pool whose states take blocks of its one store).
        """

    def commit_checkpoint(self, prefix_hash: bytes) -> None:
        """Make the pending checkpoint of ``prefix_hash`` matchable (ValueError if none)."""

    def cancel_checkpoint(self, prefix_hash: bytes) -> None:
        """Drop the pending checkpoint of ``prefix_hash``; its slot is free again."""

    def promote(self, live_slot: int, prefix_hash: bytes) -> int:
        """Zero-copy save: ``live_slot`` becomes the committed checkpoint of ``prefix_hash``.

        Returns
        -------
        int
            The fresh live slot the sequence continues in.

        Raises
        ------
        ValueError
            ``live_slot`` is not a live slot of this cache, or the hash is already there.
        OutOfBlocksError
            No fresh slot can be had.
        """

    def contains(self, prefix_hash: bytes) -> bool:
        """Whether a committed checkpoint of ``prefix_hash`` exists (pending ones never match)."""

    def __contains__(self, key: bytes, /) -> bool: ...
    def lookup(self, prefix_hash: bytes) -> int | None:
        """Slot of the committed checkpoint of ``prefix_hash``, refreshing its recency."""

    def evict(self, n: int) -> int:
        """Evict up to ``n`` committed checkpoints, least recently used first, never pinned ones."""

    def reset(self) -> None:
        """Drop every committed checkpoint that nothing pins."""

    def lru_order(self) -> list[int]:
        """Unpinned committed checkpoint slots in eviction order: the plain ones (a pool's
        intermediate saves), then the kept ones (junction saves, restored checkpoints, the API's
        own), each least recently used first (R23)."""

    def stats(self) -> _CheckpointStats:
        """Counters: hits, evictions, commits."""

    def check(self) -> None:
        """Walk every structure; raises ``InvariantError`` if a rule is broken."""

@final
class LinearStatePlan:
    """What the worker does to the recurrent state (R24), from ``take_linear_state_plan``.

    First fill every slot of ``zero_slots`` with zeros (live slots taken without a restore: a
    recycled slot holds an earlier sequence's state), then execute every restore
    (``restore_src[i] -> restore_dst[i]``, e.g. with ``kvpool.kernels.copy_linear_state``), then
    every save (``save_src[i] -> save_dst[i]``), then call ``commit_linear_state_plan``. Slot
    arrays are int32 of shape ``[n]``.
    """

    @property
    def dp_rank(self) -> NDArray[np.int32]:
        """dp rank of every copy: the restores' ranks, then the saves'."""

    @property
    def zero_dp_rank(self) -> NDArray[np.int32]:
        """dp rank of each zeroed slot."""

    @property
    def zero_slots(self) -> NDArray[np.int32]:
        """Live slots to fill with zeros before anything else (taken without a restore)."""

    @property
    def restore_dp_rank(self) -> NDArray[np.int32]:
        """dp rank of each restore."""

    @property
    def restore_src(self) -> NDArray[np.int32]:
        """Checkpoint slots to read."""

    @property
    def restore_dst(self) -> NDArray[np.int32]:
        """Live slots to write."""

    @property
    def save_dp_rank(self) -> NDArray[np.int32]:
        """dp rank of each save."""

    @property
    def save_src(self) -> NDArray[np.int32]:
        """Live slots to read."""

    @property
    def save_dst(self) -> NDArray[np.int32]:
        """Pending checkpoint slots to write."""

    @property
    def save_hashes(self) -> list[bytes]:
        """Prefix hash (16 bytes) of each saved checkpoint."""

    def __len__(self) -> int:
        """Number of operations: zeroed slots, restores and saves."""

    def __bool__(self) -> bool: ...

@final
class SlidingWindowBlockManager:
    """Block allocator of a sliding-window group (R25).

    Blocks whose tokens all lie before ``num_computed_tokens - window + 1`` can never be read
    again; ``first_needed_block`` says where a sequence's table may start.

    Parameters
    ----------
    num_blocks : int
        Ids, padding block 0 included.
    block_size : int
        Tokens per block.
    window : int
        Window in tokens.
    """

    def __new__(
        cls, num_blocks: int, block_size: int, window: int
    ) -> SlidingWindowBlockManager: ...
    @property
    def num_blocks(self) -> int:
        """Ids, padding block included."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    def window(self) -> int:
        """Window in tokens."""

    @property
    def num_total_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block the query at ``num_computed_tokens`` can attend to."""

    def allocate(self, n: int) -> list[Block]:
        """``n`` fresh blocks; ``OutOfBlocksError`` if fewer are free, changing nothing."""

    def deallocate(self, blocks: Iterable[Block]) -> None:
        """Release these handles; a released handle again is a ValueError."""

    def check(self) -> None:
        """Walk every structure; raises ``InvariantError`` if a rule is broken."""

@final
class CompositeBlockManager:
    """Several block groups in one manager, each with its own ids and block size (R25).

    Parameters
    ----------
    groups : list of (num_blocks, block_size, window)
        One tuple per group; ``window`` None for full attention, else the sliding window in
        tokens.
    """

    def __new__(cls, groups: Iterable[tuple[int, int, int | None]]) -> CompositeBlockManager: ...
    @property
    def num_groups(self) -> int:
        """Number of groups."""

    def block_size(self, group: int) -> int:
        """Tokens per block of ``group``."""

    def window(self, group: int) -> int | None:
        """Sliding window of ``group`` in tokens; None for full attention."""

    def counts(self, group: int) -> _BlockCounts:
        """Block counts of ``group``."""

    def allocate(self, group: int, n: int) -> list[Block]:
        """``n`` fresh blocks of ``group``; ``OutOfBlocksError`` if fewer are free."""

    def deallocate(self, blocks: Iterable[Block]) -> None:
        """Release these handles (of any group)."""

    def check(self) -> None:
        """Walk every group; raises ``InvariantError`` if a rule is broken."""

# --- host tier (R26) --------------------------------------------------------------------------

@final
class TransferPlan:
    """Block copies of one dp rank in one direction: copy block ``src[i]`` to block ``dst[i]``.

    Made by ``HierarchyBlockManagerPool.take_load_plans`` / ``take_offload_plans``; run it with
    one ``kvpool.kernels.swap_blocks`` call per cache array (or the executors of
    ``kvpool.tiers.host_transfer``), then hand it back to ``complete_loads`` /
    ``complete_offloads``.
    """

    @property
    def dp_rank(self) -> int:
        """The dp rank whose caches the ids index."""

    @property
    def src(self) -> NDArray[np.int32]:
        """Source block ids, int32 ``[n]``: host ids for a load, device ids for an offload."""

    @property
    def dst(self) -> NDArray[np.int32]:
        """Destination block ids, int32 ``[n]``, distinct (device ids of a load, host ids else)."""

    @property
    def direction(self) -> Literal["load", "offload", "fetch"]:
        """``"load"`` (host -> device), ``"offload"`` (device -> host) or ``"fetch"``
        (remote -> host staging; ``src`` is empty, ``keys`` names the blocks)."""

    @property
    def keys(self) -> list[bytes]:
        """Chain hashes (R6, 16 bytes) of the blocks, one per ``dst`` entry: the remote keys of
        a fetch, the blocks an offload puts on host."""

    def __len__(self) -> int: ...

@disjoint_base
class HierarchyBlockManagerPool(BlockManagerPool):
    """A ``BlockManagerPool`` with a host-memory KV tier per dp rank (R26).

    Subclassable: ``kvpool.HierarchyBlockManagerPool`` (python/kvpool/tiers/hierarchy.py) is the
    Python subclass that adds a remote tier (``remote=``, ``remote_policy=``,
    ``remote_budget_ms=``): it runs the remote lookup with ``remote_query`` and
    ``allocate_with_remote``. This class does no I/O.

    Each rank has a host manager (ids ``1..host_num_blocks-1``) with its own prefix cache beside
    the device groups. ``allocate`` continues the device prefix match in the host cache and
    plans loads (host id -> device id) for the host hits; ``deallocate`` plans offloads (device
    id -> host id) of the full computed blocks not yet on host. Blocks in a pending transfer are
    held on both tiers until the engine confirms it; loaded tokens count in
    ``num_cached_tokens`` / ``num_computed_tokens`` only after ``complete_loads``. Every pool
    method is this pool's (it is a subclass): dp ranks, linear state, sliding windows, events,
    ``concurrent``, ``plan``, ``advance`` / ``may_append_all`` / ``SequenceBatch``. A hit across
    tiers counts only up to the boundary every group can serve: linear-state checkpoints and
    window blocks stay on the device (docs/host_tier.md).

    Parameters
    ----------
    num_blocks : int
        Device block ids per rank, padding block 0 included.
    host_num_blocks : int
        Host block ids per rank, padding block 0 included (>= 2, at most ``2**30``).
    block_size : int
        Tokens per block (both tiers).
    offload_policy : {"on_deallocate", "on_evict"}
        ``"on_deallocate"``: a released sequence's full computed blocks not on host are
        offloaded. ``"on_evict"``: only the blocks that the release makes evictable (held by
        nothing but the device cache); a block another sequence holds goes when its last
        holder releases it.
    dp_size, enable_prefix_cache, num_single_blocks, linear_state_slots, checkpoint_interval,
    linear_state_match, linear_state_save, concurrent, enable_events, event_replay, hash_seed,
    sliding_window, attention_chunk_size, window_groups, state_groups, swa_num_blocks,
    debug_hash_bits, eviction, protected_percent
        As for ``BlockManagerPool``. Without the device prefix cache the host tier stays idle.

    Raises
    ------
    ValueError
        An argument is out of range (the message names it).
    TypeError
        An option of the wrong type, or an unknown option.
    """

    def __new__(
        cls,
        num_blocks: int,
        host_num_blocks: int,
        block_size: int,
        *,
        dp_size: int = 1,
        enable_prefix_cache: bool = True,
        num_single_blocks: int | None = None,
        offload_policy: _OffloadPolicy = "on_deallocate",
        linear_state_slots: int = 0,
        checkpoint_interval: int | None = None,
        linear_state_match: _LinearStateMatch = "deepest",
        linear_state_save: _LinearStateSave = "copy",
        linear_state_blocks: int = 0,
        block_bytes: int = 0,
        concurrent: bool = False,
        enable_events: bool = False,
        event_replay: int = 4096,
        hash_seed: int | None = None,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        window_groups: int = 1,
        state_groups: int = 0,
        swa_num_blocks: int | None = None,
        shared_blocks: bool | None = None,
        retention_tokens: int = 512,
        debug_hash_bits: int | None = None,
        dedup: bool = True,
        eviction: _Eviction = "lru",
        protected_percent: int = 20,
        max_retained_fraction: float = 0.5,
    ) -> Self: ...
    @property
    def host_num_blocks(self) -> int:
        """Host block ids per rank, padding block included."""

    @property
    def offload_policy(self) -> _OffloadPolicy:
        """``"on_deallocate"`` or ``"on_evict"``."""

    def allocate(
        self,
        seq: Sequence,
        num_tokens: int | None = None,
        *,
        plan: AllocationPlan | None = None,
        num_new_tokens: int | None = None,
    ) -> bool:
        """Device match, host match past it, then new blocks (R8, R13, R14, R26).

        Host hits get fresh device blocks (their table entries) and a load plan; they are
        trimmed to what the device can hold and to the boundary every group can serve, so
        success is decided exactly as for ``BlockManagerPool``. On a sequence that holds blocks,
        grows its table.

        Returns
        -------
        bool
            False if the blocks cannot be had; both tiers and ``seq`` are then unchanged.
        """

    def remote_query(
        self, seq: Sequence, num_tokens: int | None = None, *, plan: AllocationPlan | None = None
    ) -> tuple[int, list[bytes]] | None:
        """What to ask the remote tier before allocating ``seq``: ``(from, keys)``, the chain
        hashes of blocks ``from..`` past the device and host reach (R8), or None when there is
        nothing to ask. With ``plan`` (from ``plan(seq)``), no walk of its own. No side effect."""

    def allocate_with_remote(
        self,
        seq: Sequence,
        num_tokens: int | None = None,
        *,
        remote_hits: tuple[int, int] | None = None,
        plan: AllocationPlan | None = None,
    ) -> bool:
        """``allocate`` where chain blocks ``remote_hits = (from, to)`` exist on the remote tier
        (the answer to ``remote_query``): the same answer as ``allocate`` (R14, R15); remote hits
        get host staging blocks and a fetch plan (``take_fetch_plans``)."""

    def take_load_plans(self) -> list[TransferPlan]:
        """Load plans (host -> device) made since the last call, one per rank that has any.

        Run them before the step that needs the blocks, then call ``complete_loads``.
        """

    def take_offload_plans(self) -> list[TransferPlan]:
        """Offload plans (device -> host) made since the last call, one per rank that has any."""

    def take_fetch_plans(self) -> list[TransferPlan]:
        """Fetch plans (remote -> host staging) made since the last call, one per rank with any."""

    def complete_fetches(
        self, plans: Iterable[TransferPlan], arrived: Iterable[Iterable[bool]] | None = None
    ) -> None:
        """Report which fetched blocks arrived intact (``arrived[i][j]``; None: all).

        Each sequence keeps the leading run of its chain; its load becomes takeable and its
        ticket promises only that much (the rest is recomputed).

        Raises
        ------
        ValueError
            A foreign, repeated or completed plan, or ``arrived`` of the wrong shape.
        """

    def fail_fetches(self, plans: Iterable[TransferPlan]) -> None:
        """``complete_fetches``, nothing arrived: host hits still load, remote hits recompute."""

    def complete_loads(self, plans: Iterable[TransferPlan]) -> None:
        """Confirm that ``plans`` ran: loaded tokens count as cached and computed (R26).

        Raises
        ------
        ValueError
            A plan of another pool, an offload plan, a plan listed twice or already completed;
            nothing is changed then.
        """

    def complete_offloads(self, plans: Iterable[TransferPlan]) -> None:
        """Confirm that ``plans`` ran: the host blocks become matchable, device blocks are released.

        Raises
        ------
        ValueError
            A plan of another pool, a load plan, a plan listed twice or already completed;
            nothing is changed then.
        """

    def stats(self) -> _HierarchyPoolStats:  # type: ignore[override]
        """Device statistics (R20) with ``host`` (host counts and transfers), totals and per rank;
        with a remote tier, ``remote`` (lookups, hit/miss/fetched/failed blocks, the tier's own)."""

    def stats_with_remote(self) -> tuple[_HierarchyPoolStats, _RemoteCounters]:
        """``stats()`` and the core's remote counters, from one snapshot: what the Python
        subclass merges with its lookup's counters into ``stats()["remote"]``."""

# --- prefix index over KV events (docs/events.md) ----------------------------------------------

_Medium: TypeAlias = Literal["device", "host", "remote"]
_GroupKind: TypeAlias = Literal["full_attention", "sliding_window", "linear_state"]

class _IndexEvent(TypedDict, total=False):
    """An event as ``KVIndex.apply`` takes it (docs/events.md); objects with these attributes
    work too. Only ``kind`` and ``block_size`` are required; None means the default."""

    sequence: int | None
    kind: _EventKind
    medium: _Medium
    dp_rank: int
    group: int
    group_kind: _GroupKind
    sliding_window: int | None
    block_size: int
    extra_key: bytes | str | None
    parent_hash: bytes | None
    block_hashes: list[bytes]
    token_ids: _TokenIds | None

class _Gap(TypedDict):
    instance: int
    dp_rank: int
    expected: int
    got: int

class _ApplyReport(TypedDict):
    applied: int
    duplicates: int
    dropped: int
    evicted: int
    gaps: list[_Gap]

class _Source(TypedDict):
    instance: int
    dp_rank: int
    last: int
    stalled: int | None

class _IndexStats(TypedDict):
    entries: int
    speculative_entries: int
    blocks: int
    locations: int
    sources: int
    stalled_sources: int
    max_entries: int
    writers: int
    events_applied: int
    duplicates: int
    dropped: int
    gaps: int
    evicted_entries: int
    expired_entries: int
    speculative_inserted: int

@final
class KVIndex:
    """A prefix index over the KV events of many instances, for KV-aware routing.

    Entries are (block hash, location), a location being (instance, dp rank, medium, block
    size). Reads never wait for a writer (two copies behind an atomic swap); every call
    releases the GIL around the core work. At most ``max_entries`` entries are kept: beyond,
    the least-recently stored chains are evicted from their tails.

    Parameters
    ----------
    max_entries : int
        Memory bound, at least 1 (and at least ``writers``: it is split among them).
    hash_seed : int or None
        Seed of the chained hashes token-id lookups compute; must be the pools' (R6).
    writers : int
        Shards by instance, each with its own writer (1 to 64): batches of instances of
        different writers (``writer_of``) apply concurrently from threads. A lookup then sees
        each writer's state after some whole write of it.
    """

    def __new__(
        cls, *, max_entries: int = 16777216, hash_seed: int | None = None, writers: int = 1
    ) -> KVIndex: ...
    def apply(self, instance: int, events: Iterable[_IndexEvent | Any]) -> _ApplyReport:
        """Apply a batch of ``instance``'s events in order (dicts or objects, docs/events.md).

        Per source (instance, dp rank), ``sequence`` numbers are gap-free and non-decreasing:
        a number below the source's last is a duplicate (skipped); one above last + 1 opens a
        gap, reported once in ``gaps``, and the source's events are dropped until the replay
        brings last + 1 (or ``resync``).

        Raises
        ------
        ValueError, TypeError
            An invalid event, named as ``events[i].field``; nothing is applied.
        """

    def apply_msgpack(self, instance: int, data: bytes) -> _ApplyReport:
        """Apply a batch in the msgpack wire format of docs/events.md."""

    @overload
    def lookup(
        self,
        token_ids: _TokenIds | None = None,
        *,
        extra_key: _ExtraKey = None,
        block_hashes: _Sequence[bytes] | None = None,
        block_size: int | None = None,
        now: float = 0.0,
        depths: Literal[False] = False,
    ) -> list[tuple[int, int, _Medium, int, int]]:
        """The matched prefix of a request on every location holding its first block.

        Give ``token_ids`` (and ``extra_key``; hashed for every block size in use) or its
        ``block_hashes`` with their ``block_size``. Speculative entries count unless lapsed at
        ``now``. Returns ``(instance, dp_rank, medium, blocks, tokens)`` rows, unordered.
        With ``depths=True``: ``(instance, dp_rank, medium, blocks, tokens, kv_blocks,
        kv_tokens)`` on every location holding KV of the first block, ``blocks`` the depth a
        hit restores (a linear-state group's deepest checkpoint), ``kv_blocks >= blocks`` the
        KV held (past ``blocks`` a hit recomputes from that checkpoint).
        """

    @overload
    def lookup(
        self,
        token_ids: _TokenIds | None = None,
        *,
        extra_key: _ExtraKey = None,
        block_hashes: _Sequence[bytes] | None = None,
        block_size: int | None = None,
        now: float = 0.0,
        depths: Literal[True],
    ) -> list[tuple[int, int, _Medium, int, int, int, int]]: ...
    @overload
    def lookup(
        self,
        token_ids: _TokenIds | None = None,
        *,
        extra_key: _ExtraKey = None,
        block_hashes: _Sequence[bytes] | None = None,
        block_size: int | None = None,
        now: float = 0.0,
        depths: bool,
    ) -> (
        list[tuple[int, int, _Medium, int, int]]
        | list[tuple[int, int, _Medium, int, int, int, int]]
    ): ...
    def insert_speculative(
        self,
        instance: int,
        token_ids: _TokenIds | None = None,
        *,
        block_size: int,
        now: float,
        ttl: float,
        extra_key: _ExtraKey = None,
        block_hashes: _Sequence[bytes] | None = None,
        dp_rank: int = 0,
    ) -> int:
        """Mark a routed request's blocks as held on ``instance``'s device until ``now + ttl``
        unless a stored event confirms them first; returns how many were marked or extended."""

    def hash_blocks(
        self,
        token_ids: _TokenIds,
        block_size: int,
        *,
        parent_hash: bytes | None = None,
        extra_key: _ExtraKey = None,
    ) -> list[bytes]:
        """Chained hashes (R6, the index's seed) of the full blocks of ``token_ids``,
        continuing from ``parent_hash`` when given, else rooted at ``extra_key``."""

    def expire(self, now: float) -> int:
        """Drop the speculative entries lapsing at or before ``now``; returns how many."""

    def can_apply(self, instance: int, sequence: int, *, dp_rank: int = 0) -> bool:
        """Whether ``apply`` would now apply an event of (instance, dp rank) numbered
        ``sequence``: not a duplicate, not dropped by a gap or a stall. Changes nothing."""

    def resync(self, instance: int, dp_rank: int = 0) -> int:
        """Drop every entry of (instance, dp rank) and forget its sequence number."""

    def remove_instance(self, instance: int) -> int:
        """Drop every entry and source of ``instance``."""

    def writer_of(self, instance: int) -> int:
        """The writer (in ``range(writers)``) applying ``instance``'s events: give each of
        several applying threads the instances of its writers."""

    def sources(self) -> list[_Source]:
        """Every source's last sequence number and gap (``stalled``), sorted."""

    def stats(self) -> _IndexStats:
        """Sizes and counters."""

    def dump(self) -> bytes:
        """A compact, versioned, checksummed binary image for ``load``."""

    @staticmethod
    def load(data: bytes, *, max_entries: int | None = None) -> KVIndex:
        """An index from ``dump``; ``max_entries`` overrides the dumped bound.

        Raises
        ------
        ValueError
            A truncated, corrupt or unknown-version image.
        """

    def check(self) -> None:
        """Raises :class:`InvariantError` if a rule of the index is broken."""

    def __len__(self) -> int: ...

def encode_events(events: Iterable[_IndexEvent | Any]) -> bytes:
    """The msgpack wire format (docs/events.md) of a batch of events."""

def decode_events(data: bytes) -> list[_IndexEvent]:
    """The events of a msgpack batch, as dicts with every field."""

# --- elastic pages: XTensorBlockManager (docs/xtensor.md) -------------------------------------

__all__ += ["XTensorBlockManager"]

class _XTensorStats(_ManagerStats):
    """Counts, prefix-cache statistics and page counters of an :class:`XTensorBlockManager`."""

    num_available_blocks: int
    mapped_pages: int
    mapped_bytes: int
    peak_mapped_pages: int
    num_page_maps: int
    num_page_unmaps: int
    num_map_failures: int
    memory_limit: int | None
    reserved_blocks: int

class _MemoryLimitReport(TypedDict):
    """What :meth:`XTensorBlockManager.set_memory_limit` did."""

    limit_bytes: int | None
    limit_pages: int
    mapped_pages: int
    mapped_bytes: int
    evicted_blocks: int
    unmapped_pages: int
    mapped_new_pages: int
    released_reserved_blocks: int
    excess_bytes: int
    """Bytes mapped above the limit that sequences hold; returned as they release them."""
    held_pages: int
    """Mapped pages on which sequences hold blocks (page 0 included when it holds one)."""

@final
class XTensorBlockManager:
    """Elastic block allocator on virtual-memory pages (xLLM's XTensorBlockManagerImpl),
    with the prefix cache on top (docs/xtensor.md).

    Ids are grouped into pages of ``blocks_per_page``; a page's memory is mapped (by the
    backend) only while it holds a used or cached block, plus a few spare pages, so the KV
    footprint follows the load. Allocation packs into the fullest mapped page with room and
    maps a page only when none has room; a page whose blocks are all free is unmapped (beyond
    the spares). The memory limit can change at run time; lowering it evicts cached blocks page
    by page. R1-R5, R10 and R29 hold as for :class:`BlockManager`; block 0 lives on page 0,
    which stays mapped.

    Parameters
    ----------
    num_blocks : int
        Ids in the pool, padding block 0 included (as :class:`BlockManager`).
    block_size : int
        Tokens per block, at least 1.
    blocks_per_page : int
        Blocks per page, 1..65536 (the last page may hold fewer).
    page_bytes : int or None
        Memory one mapped page costs (all layers, K and V): counts ``mapped_bytes`` and the
        memory limit. Default the backend's ``page_bytes`` attribute, else 2 MiB.
    spare_pages : int
        Empty pages kept mapped for the next allocations: a page is mapped ahead when fewer are
        left, and empty pages unmap above ``2 * spare_pages`` (at most the number of pages).
    memory_limit : int or None
        Bytes that may be mapped at once (page 0 counts); None: the whole range.
    backend : None, "accounting", "host" or an object
        What maps the pages. None / "accounting": bookkeeping only. "host": one reserved
        anonymous mapping of the process (resident memory follows the mapped pages).
        An object with ``map_page(page)`` and ``unmap_page(page)`` (e.g.
        :class:`kvpool.xtensor.CudaPageBackend`), called with the GIL; ``MemoryError`` from
        ``map_page`` means the device has no memory for it now; other exceptions are raised by
        a call that has done nothing of its own: one met while settling after a call's work
        (a release, an allocation) is retried first, and raised, by the next call that may map,
        evict or allocate (docs/xtensor.md, "A failing backend"). Optional attributes
        ``page_bytes``, ``blocks_per_page``, ``num_pages`` are checked.
    enable_prefix_cache, hash_seed, debug_hash_bits
        As for :class:`BlockManager`.

    Raises
    ------
    ValueError
        An argument out of range (named), or one that disagrees with the backend.
    TypeError
        A backend without callable ``map_page`` / ``unmap_page``.
    """

    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        *,
        blocks_per_page: int,
        page_bytes: int | None = None,
        spare_pages: int = 1,
        memory_limit: int | None = None,
        backend: Any = None,
        enable_prefix_cache: bool = True,
        hash_seed: int | None = None,
        debug_hash_bits: int | None = None,
    ) -> XTensorBlockManager: ...
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
    def backend(self) -> Any:
        """The page backend: ``"accounting"``, ``"host"`` or the object given."""

    @property
    def blocks_per_page(self) -> int:
        """Blocks per page (the last page may hold fewer)."""

    @property
    def num_pages(self) -> int:
        """Pages of the range: ``ceil(num_blocks / blocks_per_page)``."""

    @property
    def page_bytes(self) -> int:
        """Bytes one mapped page costs."""

    @property
    def spare_pages(self) -> int:
        """Empty pages kept mapped (mapped ahead below it, unmapped above twice it)."""

    @property
    def num_total_blocks(self) -> int:
        """Allocatable ids: ``num_blocks - 1`` (R1)."""

    @property
    def num_free_blocks(self) -> int:
        """Ids not handed out, those on unmapped pages included (R2)."""

    @property
    def num_cached_blocks(self) -> int:
        """Ids held only by the prefix cache: evictable (R2)."""

    @property
    def num_used_blocks(self) -> int:
        """Ids held by a handle outside the cache (R2)."""

    @property
    def num_available_blocks(self) -> int:
        """Exactly what ``allocate`` can hand out: free ids on mapped pages, cached blocks, and
        the ids of the unmapped pages the memory limit allows."""

    @property
    def mapped_pages(self) -> int:
        """Pages mapped now, page 0 included."""

    @property
    def mapped_bytes(self) -> int:
        """Bytes mapped now: ``mapped_pages * page_bytes``."""

    @property
    def memory_limit(self) -> int | None:
        """The memory limit in bytes, or None (the whole range)."""

    @property
    def limit_pages(self) -> int:
        """Pages the memory limit allows: ``memory_limit // page_bytes``, at most ``num_pages``."""

    @property
    def reserved_blocks(self) -> int:
        """Blocks promised by :meth:`try_reserve` and not yet allocated."""

    @property
    def resident_bytes(self) -> int | None:
        """Physical bytes the backend holds, where it can measure them (the host backend asks
        the kernel, ``mincore``); None otherwise."""

    def allocate(self, n: int) -> list[Block]:
        """Allocate ``n`` fresh blocks (R3): free ids on mapped pages (fullest page first), then
        newly mapped pages within the limit, then evicted cached blocks (LRU).

        Raises
        ------
        OutOfBlocksError
            Fewer than ``n`` available (or the device refused a page); nothing was changed.
        ValueError
            ``n < 0``.
        """

    def deallocate(self, blocks: Iterable[Block]) -> None:
        """Release these handles (R5); pages left with no used or cached block unmap (beyond
        the spares).

        Raises
        ------
        ValueError
            A handle was already released, is listed twice, or belongs to another manager.
        TypeError
            An item is not a :class:`Block`.
        """

    def allocate_shared(self, token_ids: _TokenIds, *, extra_key: _ExtraKey = None) -> list[Block]:
        """Handles of the longest cached prefix of ``token_ids`` (R7)."""

    def cache(
        self, token_ids: _TokenIds, blocks: Iterable[Block], *, extra_key: _ExtraKey = None
    ) -> int:
        """Publish the full blocks of ``token_ids`` held in ``blocks`` (R9); returns how many are
        new. Cached blocks keep their pages mapped."""

    def evict(self, n: int) -> int:
        """Evict up to ``n`` cached blocks: whole reclaimable pages first (their memory comes
        back), then least recently used leaves (R10). Returns how many."""

    def reset_prefix_cache(self) -> None:
        """Drop every cached entry; held blocks stay with their holders (R12)."""

    def check(self) -> None:
        """Walk every structure: R1-R5, R10 and the page rules (mapped pages = page 0, pages
        holding a used or cached block, and the spares; the reservation is mapped; the limit is
        met unless sequences hold the excess).

        Raises
        ------
        InvariantError
            A rule is broken.
        """

    def try_reserve(self, n: int) -> bool:
        """Promise ``n`` more blocks to the coming allocations, mapping the pages they need now
        (within the limit; never evicts). False, changing nothing, if it cannot."""

    def free_reserved(self) -> int:
        """Drop what is left of the reservation; returns how many blocks were still promised."""

    def set_memory_limit(self, limit: int | None) -> _MemoryLimitReport:
        """Set the memory limit in bytes (None: the whole range; page 0 counts).

        Lowering it unmaps spare pages, evicts cached blocks page by page and unmaps the pages
        that empty; what sequences hold stays mapped and is reported (``excess_bytes``,
        ``held_pages``); the manager keeps reclaiming toward the limit as they release it.
        Raising it maps spares again.

        Raises
        ------
        ValueError
            ``limit < 0``.
        """

    def trim(self) -> int:
        """Take in handles dropped outside :meth:`deallocate` and unmap the pages they emptied;
        returns how many pages were unmapped."""

    def page_of(self, block_id: int) -> int:
        """The page holding block ``block_id`` (``block_id // blocks_per_page``).

        Raises
        ------
        ValueError
            ``block_id`` is not below ``num_blocks``.
        """

    def is_page_mapped(self, page: int) -> bool:
        """Whether ``page`` is mapped (ValueError past ``num_pages``)."""

    def mapped_page_ids(self) -> list[int]:
        """The mapped pages, ascending."""

    def stats(self) -> _XTensorStats:
        """Block counts, prefix-cache statistics and page counters."""

    def eviction_order(self) -> list[int]:
        """Block ids in LRU eviction order, oldest first (for tests and debugging)."""
