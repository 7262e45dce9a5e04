"""The objects kvpool's vLLM manager hands to vLLM 0.33 and 0.34 (``kvpool.integrations.vllm``).

vLLM's own ``KVCacheBlocks`` carrying the pool's block ids, the empty sentinel, the plan a
lookup hands to ``allocate_slots``, each request's entry (a Python mirror of its sequence) and
the views of vLLM's coordinator and block pool the Scheduler reads. Import
``kvpool.integrations.vllm``, which checks the vLLM version first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvpool._core import BlockManagerPool
from kvpool._core import Sequence as PoolSequence


class PoolBlocks(KVCacheBlocks):
    """vLLM's ``KVCacheBlocks`` for one full-attention group, holding kvpool's block ids.

    ``get_block_ids`` (the one method the Scheduler calls) returns the ids as they are;
    ``blocks`` builds vLLM ``KVCacheBlock`` objects on demand, as id carriers (their ``ref_cnt``
    and ``block_hash`` are not kvpool's: the pool keeps those).

    Parameters
    ----------
    block_ids : list of int
        Physical block ids of group 0, in table order (never 0, the null block).
    """

    def __init__(self, block_ids: list[int]) -> None:  # replaces the dataclass __init__
        self.block_ids = block_ids

    @property
    def blocks(self) -> tuple[list[KVCacheBlock], ...]:  # type: ignore[override]
        return ([KVCacheBlock(i) for i in self.block_ids],)

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None):  # type: ignore[override]
        if group_ids is None:  # what the Scheduler asks: a fresh list, as vLLM's
            return None if allow_none and not self.block_ids else (self.block_ids[:],)
        groups = tuple(group_ids)
        if any(g != 0 for g in groups):
            raise IndexError(f"group_ids: the KV cache has one group (0), got {list(groups)}")
        if allow_none and (not self.block_ids or not groups):
            return None
        return tuple(list(self.block_ids) for _ in groups)


class GroupBlocks(KVCacheBlocks):
    """vLLM's ``KVCacheBlocks`` for several groups (full attention and sliding windows), holding
    kvpool's block ids: one list per vLLM group, in vLLM's order; 0 is vLLM's null block (the
    entries behind a window).

    Parameters
    ----------
    groups : tuple of list of int
        Each group's physical block ids, in table order.
    """

    def __init__(self, groups: tuple[list[int], ...]) -> None:  # replaces the dataclass __init__
        self.groups = groups

    @property
    def blocks(self) -> tuple[list[KVCacheBlock], ...]:  # type: ignore[override]
        return tuple([KVCacheBlock(i) for i in ids] for ids in self.groups)

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None):  # type: ignore[override]
        if group_ids is None:
            if allow_none and not any(self.groups):
                return None
            return tuple(ids[:] for ids in self.groups)
        groups = tuple(group_ids)
        n = len(self.groups)
        if any(not 0 <= g < n for g in groups):
            raise IndexError(f"group_ids: the KV cache has {n} groups, got {list(groups)}")
        if allow_none and not any(self.groups[g] for g in groups):
            return None
        return tuple(self.groups[g][:] for g in groups)


class _EmptyBlocks(KVCacheBlocks):
    """vLLM's empty sentinel (``blocks == ((),) * groups``, compared by identity), answering
    ``get_block_ids`` without a walk: what most decode steps return."""

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None):  # type: ignore[override]
        n = len(self.blocks)
        if group_ids is None:
            return None if allow_none else tuple([] for _ in range(n))
        groups = list(group_ids)
        if any(not 0 <= g < n for g in groups):
            raise IndexError(f"group_ids: the KV cache has {n} group(s), got {groups}")
        return None if allow_none else tuple([] for _ in groups)


class _Hit(KVCacheBlocks):
    """What ``get_computed_blocks`` returns: the plan of the hit, handed back to ``allocate_slots``.

    kvpool picks the hit's blocks when ``allocate_slots`` pins them, so their ids are known only
    then (``get_blocks(request_id)``, as the Scheduler reads them).
    """

    def __init__(self, plan: Any, fits: bool, num_tokens: int, seq_len: int) -> None:
        self.plan = plan  # AllocationPlan of the whole sequence, or None if it does not fit
        self.fits = fits
        self.num_tokens = num_tokens
        self.seq_len = seq_len

    @property
    def blocks(self) -> tuple[list[KVCacheBlock], ...]:  # type: ignore[override]
        raise NotImplementedError(
            "kvpool picks the prefix hit's blocks in allocate_slots: read them with "
            "get_blocks(request_id) afterwards"
        )

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None):  # type: ignore[override]
        return self.blocks


class _Entry:
    """A request's kvpool sequence and a Python mirror of what the hot path reads of it (pyo3
    property reads cost more than the rest of a decode step): ``length`` = ``len(seq)``,
    ``capacity`` = tokens its table holds (0: holds no blocks), ``computed`` =
    ``seq.num_computed_tokens``, ``ids`` = ``seq.block_table`` as a list while it holds blocks
    (grown in place: ``get_blocks`` hands it out, ``get_block_ids`` copies it).
    ``KVCacheManager.check`` compares them."""

    __slots__ = ("seq", "length", "capacity", "computed", "ids")

    def __init__(self, seq: PoolSequence, length: int) -> None:
        self.seq = seq
        self.length = length
        self.capacity = 0
        self.computed = 0
        self.ids: list[int] = []


class _GroupView:
    """What the Scheduler reads of each of vLLM's single-type managers."""

    def __init__(self, kv_cache_spec: Any, block_size: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = block_size


class _CoordinatorView:
    """The coordinator as the Scheduler and ``EngineCore.get_kv_cache_group_metadata`` read it."""

    def __init__(self, groups: tuple[_GroupView, ...]) -> None:
        self.single_type_managers = groups
        self.enable_partial_hash_hits = False
        self.mamba_shared_prefix_checkpoint = False


class _BlockPoolView:
    """vLLM's ``BlockPool`` counters over kvpool's pool (free counts evictable cached blocks)."""

    def __init__(self, pool: BlockManagerPool) -> None:
        self._pool = pool
        self.num_gpu_blocks = pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self._pool.num_free_blocks + self._pool.num_cached_blocks

    def get_usage(self) -> float:
        return self._pool.num_used_blocks / (self.num_gpu_blocks - 1)  # stats()["usage"]
