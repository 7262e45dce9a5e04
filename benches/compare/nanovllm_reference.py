"""A pure-Python block manager that follows nano-vllm's published ``BlockManager`` algorithm.

This is a reference for benchmarks and cross-checks, written for this repository from the
description of the algorithm (research/peers.md section 1, seed 003); it is not nano-vllm's code.

The algorithm (nano-vllm HEAD, after the chunked-prefill refactor):

* ``Block``: ``block_id``, ``ref_count``, ``hash`` (-1 when not cached) and ``token_ids`` (the
  block's tokens, kept so that a hit can be verified token by token).
* ``BlockManager``: ``blocks`` (all of them, created once), ``free_block_ids`` (a ``deque``,
  allocation pops the left end, release appends to the right end), ``used_block_ids`` (a set) and
  ``hash_to_block_id`` (a dict, one block per hash).
* Hashes chain: block i's hash is xxh64(hash of block i-1 as 8 little-endian bytes, then the
  block's tokens as a native int64 array), as an integer. Falls back to blake2b-64 when the
  ``xxhash`` package is missing.
* ``can_allocate(seq) -> int`` walks the chain over every block but the last one (so a fully cached
  prompt still computes its last block), stops at the first miss or token mismatch, and returns the
  number of hit blocks, or -1 if the free deque cannot cover the blocks still needed. Only hits on
  blocks in use reduce that need: reviving a free cached block takes it out of the free deque.
* ``allocate(seq, num_cached_blocks)``: shares hit blocks in use (``ref_count += 1``), revives free
  hit blocks (``free_block_ids.remove(id)``: O(n) on a deque), pops the rest from the left. A popped
  block that still carries a hash is evicted then (its dict entry goes if it still points at it).
* ``deallocate(seq)`` walks the table in reverse (tails go back to the free deque first, so they
  are reused, and lose their content, before shared prefixes) and keeps each block's hash and
  tokens, so a freed block can still be hit until it is popped again.
* ``can_append(seq)`` / ``may_append(seq)``: ``len(seq)`` already counts the token whose KV the next
  step writes; a new block is needed exactly when ``len(seq) % block_size == 1``.
* ``hash_blocks(seq)`` publishes the blocks that became full in the step just run (from
  ``num_cached_tokens`` to ``num_cached_tokens + num_scheduled_tokens``), after their KV exists.

Small departures, each in the reference's favour or neutral:

* ``can_allocate`` remembers the hit block ids on the sequence, so ``allocate`` does not hash the
  prompt a second time.
* A sequence may carry an ``extra_key`` (cache salt / LoRA namespace); it seeds the root of the hash
  chain so that different keys never share blocks (nano-vllm has no namespace; without this the
  reference would report hits that the other managers rightly refuse).
* Classes use ``__slots__``.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as _SequenceABC

import numpy as np

try:  # nano-vllm hashes with xxh64
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None  # type: ignore[assignment]

__all__ = [
    "HASH_BACKEND",
    "Block",
    "BlockManager",
    "NanoSequence",
    "compute_hash",
]

HASH_BACKEND = "xxh64" if _xxhash is not None else "blake2b-64"


if _xxhash is not None:
    _xxh64 = _xxhash.xxh64

    def compute_hash(token_ids: _SequenceABC[int], prefix: int = -1) -> int:
        """Chained hash of one block: xxh64(prefix as 8 LE bytes | tokens as native int64)."""
        h = _xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids, dtype=np.int64).tobytes())
        return h.intdigest()

else:  # pragma: no cover - depends on the environment

    def compute_hash(token_ids: _SequenceABC[int], prefix: int = -1) -> int:
        """Chained hash of one block (blake2b-64 stand-in when xxhash is missing)."""
        h = hashlib.blake2b(digest_size=8)
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids, dtype=np.int64).tobytes())
        return int.from_bytes(h.digest(), "little")


def _root_hash(extra_key: bytes | None) -> int:
    """The parent of block 0: -1 (no parent), or a hash of the namespace key."""
    if extra_key is None:
        return -1
    return int.from_bytes(hashlib.blake2b(extra_key, digest_size=8).digest(), "little")


class NanoSequence:
    """The part of nano-vllm's ``Sequence`` that the block manager reads."""

    __slots__ = (
        "seq_id",
        "token_ids",
        "num_tokens",
        "num_prompt_tokens",
        "num_cached_tokens",
        "num_scheduled_tokens",
        "block_table",
        "block_size",
        "extra_key",
        "_hit_block_ids",
    )

    def __init__(
        self,
        token_ids: Iterable[int],
        block_size: int,
        *,
        seq_id: int = 0,
        extra_key: bytes | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.token_ids = list(token_ids)
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        self.block_size = block_size
        self.extra_key = extra_key
        self._hit_block_ids: list[int] = []

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        bs = self.block_size
        return self.token_ids[i * bs : (i + 1) * bs]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.num_tokens += 1


class Block:
    """One physical block: reference count plus the cached content (hash and tokens)."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, hash={self.hash})"


class BlockManager:
    """nano-vllm-style block manager: deque free list, chained xxh64, hash -> block id dict."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if block_size < 2:
            # nano-vllm's `% block_size == 1` test for "needs a new block" needs block_size >= 2
            raise ValueError("block_size must be >= 2")
        self.block_size = block_size
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.num_evictions = 0  # cached blocks whose content was dropped on reuse (for benchmarks)

    # -- single blocks -------------------------------------------------------------------------

    def _allocate_block(self) -> Block:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != -1:
            # lazy eviction of a free cached block; spare an entry that points at a newer block
            self.num_evictions += 1
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
        block.reset()
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    # -- sequences -----------------------------------------------------------------------------

    def can_allocate(self, seq: NanoSequence) -> int:
        """Number of prefix blocks that hit, or -1 if the free blocks cannot cover the rest."""
        bs = self.block_size
        tokens = seq.token_ids
        blocks = self.blocks
        lookup = self.hash_to_block_id.get
        used = self.used_block_ids
        hits: list[int] = []
        num_new_blocks = seq.num_blocks
        h = _root_hash(seq.extra_key)
        for i in range(seq.num_blocks - 1):  # the last block is never matched
            block_tokens = tokens[i * bs : (i + 1) * bs]
            h = compute_hash(block_tokens, h)
            block_id = lookup(h, -1)
            if block_id == -1 or blocks[block_id].token_ids != block_tokens:
                break
            hits.append(block_id)
            if block_id in used:
                num_new_blocks -= 1
        seq._hit_block_ids = hits
        if len(self.free_block_ids) < num_new_blocks:
            return -1
        return len(hits)

    def allocate(self, seq: NanoSequence, num_cached_blocks: int) -> None:
        """Give ``seq`` its table: the first ``num_cached_blocks`` from the hits, the rest new."""
        assert not seq.block_table
        table = seq.block_table
        blocks = self.blocks
        used = self.used_block_ids
        for block_id in seq._hit_block_ids[:num_cached_blocks]:
            block = blocks[block_id]
            if block_id in used:
                block.ref_count += 1
            else:  # revive a free block that still holds the content
                assert block.ref_count == 0
                block.ref_count = 1
                self.free_block_ids.remove(block_id)  # O(n) on a deque: nano-vllm's cost
                used.add(block_id)
            table.append(block_id)
        for _ in range(seq.num_blocks - num_cached_blocks):
            table.append(self._allocate_block().block_id)
        seq.num_cached_tokens = num_cached_blocks * self.block_size
        seq._hit_block_ids = []

    def deallocate(self, seq: NanoSequence) -> None:
        blocks = self.blocks
        for block_id in reversed(seq.block_table):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: NanoSequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: NanoSequence) -> None:
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._allocate_block().block_id)

    def hash_blocks(self, seq: NanoSequence) -> None:
        """Publish the blocks that the step just run (``num_scheduled_tokens``) made full."""
        bs = self.block_size
        start = seq.num_cached_tokens // bs
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // bs
        if start == end:
            return
        table = seq.block_table
        blocks = self.blocks
        h = blocks[table[start - 1]].hash if start > 0 else _root_hash(seq.extra_key)
        for i in range(start, end):
            block = blocks[table[i]]
            block_tokens = seq.block(i)
            h = compute_hash(block_tokens, h)
            block.update(h, block_tokens)
            self.hash_to_block_id[h] = block.block_id

    # -- introspection -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content can still be hit (in use or free)."""
        return len(self.hash_to_block_id)
