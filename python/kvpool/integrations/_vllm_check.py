"""The invariants of kvpool's vLLM manager (``KVCacheManager.check``), walked by the tests
after every step. Import ``kvpool.integrations.vllm``, which checks the vLLM version first.
"""

from __future__ import annotations

from typing import Any

from kvpool._core import InvariantError

__all__ = ["check_manager"]


def check_manager(manager: Any) -> None:
    """Walk the pool's structures (R20) and ``manager``'s (a ``KVCacheManager``): ``usage``
    (cached since the last allocation or release) and the free count are the pool's stats; each
    entry mirrors its sequence (length, table capacity, computed tokens), a held table has no id
    0 and holds the computed tokens, each window table has one entry per full-attention entry
    and shares no id with it, and every request awaiting publication is tracked.

    Raises
    ------
    kvpool.InvariantError
        A rule is broken.
    """
    manager.pool.check()
    stats = manager.pool.stats()
    counted = (
        manager.usage,
        manager.block_pool.get_num_free_blocks(),
    )  # usage: set at the last change
    if counted != (stats["usage"], stats["num_free_blocks"] + stats["num_cached_blocks"]):
        raise InvariantError(
            f"usage and free blocks {counted} disagree with the pool's stats {stats}"
        )
    recorded = manager.prefix_cache_stats
    if recorded is not None and manager._stats_recorded != bool(
        recorded.requests or recorded.preempted_requests or recorded.reset
    ):
        raise InvariantError(
            f"prefix cache stats {recorded} but recorded={manager._stats_recorded}"
        )
    for rid, entry in manager._seqs.items():
        seq = entry.seq
        table = seq.block_table.tolist()
        mirror = (
            entry.length,
            entry.capacity,
            entry.computed if entry.capacity else 0,
            entry.ids if entry.capacity else [],
        )
        actual = (len(seq), len(table) * manager.block_size, seq.num_computed_tokens, table)
        if (
            mirror != actual
            or (entry.capacity == 0) == seq.is_allocated
            or 0 in table
            or entry.computed > entry.capacity
        ):
            raise InvariantError(
                f"request {rid!r}: entry (length, capacity, computed) "
                f"{mirror}, sequence {actual}, table {table}"
            )
        for g in range(1, manager.num_kv_cache_groups):  # window tables: one entry per block
            window = seq.group_block_table(g).tolist() if entry.capacity else []
            if len(window) != len(table) or set(window) & set(table) - {0}:
                raise InvariantError(
                    f"request {rid!r}: window group {g}'s table {window} against the "
                    f"full-attention table {table}"
                )
    for rid, (_, entry, _end) in manager._unpublished.items():
        if manager._seqs.get(rid) is not entry:
            raise InvariantError(f"request {rid!r}: awaits publication but is not tracked")
