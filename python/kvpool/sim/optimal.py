"""The offline bound of a prefix cache in request order (``kvpool simulate --eviction optimal``).

Requests are replayed one at a time in arrival order, as ``--order request`` replays them
through the pool: each prompt's full blocks are looked up (the hit is the longest cached prefix
of its chain, trimmed as R8 trims it), the blocks it lacks are allocated, and at its end its
full blocks stay cached. Only the choice of what to evict differs: Belady's MIN, the cached
block whose next use lies farthest ahead (never used again first), ties to the deepest. The
future is known because in request order it does not depend on the policy, so this is the
largest number of block hits any eviction policy can get on the trace and memory (MIN is
optimal for demand paging with uniform blocks); every policy's hit rate is read against it.

Invariants: the cache holds at most ``capacity`` blocks beside the current request's new
ones, and it is closed under prefix. A block's parent is used whenever the block is (same
chain), so its next use is never later; with ties to the deepest, a parent never goes before
its child.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["OptimalRun", "request_order_bound"]

NEVER = 1 << 62  # the next use of a block no later request holds


@dataclass(frozen=True)
class OptimalRun:
    """The bound's run: per request, the prompt tokens served from the cache, and totals.

    Attributes
    ----------
    hit_tokens : list[int]
        Per request, in order: the tokens of its longest cached prefix (R8: a prompt that is a
        whole number of blocks computes its last one).
    query_tokens : int
        Tokens of the full blocks the requests looked up (R8: not a prompt's last token).
    evictions : int
        Blocks evicted.
    peak_blocks : int
        The most blocks held at once (cached plus the current request's new ones).
    """

    hit_tokens: list[int]
    query_tokens: int
    evictions: int
    peak_blocks: int


def request_order_bound(
    chains: Sequence[Sequence[object]],
    lengths: Sequence[int],
    capacity: int,
    block_size: int,
) -> OptimalRun:
    """Replays the requests with farthest-next-use eviction (module doc).

    Parameters
    ----------
    chains : sequence of sequences of hashable
        Per request, the chain hashes of its prompt's full blocks (``kvpool.hash_blocks``), in
        order; equal hashes are the same cached block.
    lengths : sequence of int
        Per request, its prompt length in tokens (``len(chains[i]) == lengths[i] //
        block_size``).
    capacity : int
        Block ids of the cache (padding excluded).
    block_size : int
        Tokens per block.

    Returns
    -------
    OptimalRun

    Raises
    ------
    ValueError
        ``capacity`` or ``block_size`` below 1, mismatched lengths, or a prompt needing more
        blocks than ``capacity`` (naming the request's position).
    """
    if capacity < 1:
        raise ValueError(f"capacity: must be at least 1, got {capacity}")
    if block_size < 1:
        raise ValueError(f"block_size: must be at least 1, got {block_size}")
    if len(chains) != len(lengths):
        raise ValueError(f"lengths: {len(lengths)} lengths for {len(chains)} chains")
    # next use of each (request, position): the next request holding the same block
    following: list[list[int]] = [[] for _ in chains]
    last: dict[object, int] = {}
    for i in range(len(chains) - 1, -1, -1):
        chain = chains[i]
        if len(chain) != lengths[i] // block_size:
            raise ValueError(f"chains: request {i} has {len(chain)} blocks for {lengths[i]} tokens")
        following[i] = [last.get(h, NEVER) for h in chain]
        for h in chain:
            last[h] = i
    cached: dict[object, int] = {}  # block -> its next use
    heap: list[tuple[int, int, int, object]] = []  # (-next use, -depth, tie, block), lazy
    tie = 0
    hits: list[int] = []
    query = evictions = peak = 0
    for i, chain in enumerate(chains):
        length = lengths[i]
        n = len(chain)
        query += (length - 1) // block_size * block_size  # R8: the blocks a hit may cover
        hit = 0
        while hit < n and chain[hit] in cached:
            hit += 1
        if hit == n and n and length % block_size == 0:
            hit -= 1  # R8: the last token is computed
        hits.append(hit * block_size)
        new = -(-length // block_size) - hit  # the request's own blocks beside the hit
        if hit + new > capacity:
            raise ValueError(
                f"chains: request {i} needs {hit + new} blocks, the cache has {capacity}"
            )
        for h in chain[:hit]:
            cached[h] = i  # in use now: never a victim while this request runs
        while len(cached) + new > capacity:
            neg_next, _, _, victim = heapq.heappop(heap)
            if cached.get(victim) == -neg_next:
                del cached[victim]
                evictions += 1
        peak = max(peak, len(cached) + new)
        for depth, h in enumerate(chain):
            # published at the end (an R8 block computed again is a duplicate of its cached
            # copy and goes, R9); the partial block goes: never more than `capacity` stay
            cached[h] = following[i][depth]
            heapq.heappush(heap, (-cached[h], -depth, tie, h))
            tie += 1
    return OptimalRun(hits, query, evictions, peak)
