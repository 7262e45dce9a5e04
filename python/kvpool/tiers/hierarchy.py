"""``kvpool.HierarchyBlockManagerPool``: the core's hierarchy pool, with the remote tier added.

The compiled ``kvpool._core.HierarchyBlockManagerPool`` is a ``kvpool.BlockManagerPool`` with a
host tier per dp rank (R26): its transfer plans and completions, and the core's half of a remote
lookup, ``remote_query`` (the chain past the device+host reach) and ``allocate_with_remote`` (an
allocation with the answer). It does no I/O and imports nothing of this package. This subclass
adds the remote tier (docs/remote_tier.md): with ``remote=tier``, ``allocate`` runs one lookup
(``kvpool.tiers.lookup.RemoteLookup``: one batched existence query with no lock held, a failure
a miss) and ``stats()["remote"]`` holds the lookup's, the core's and the tier's counters. So a
remote hit walks Python -> bindings -> core, as every other call does.

Without a remote tier every call is the compiled class's but ``allocate`` and ``stats``, which
add one attribute test each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool._core import HierarchyBlockManagerPool as _CoreHierarchyPool
from kvpool.tiers.lookup import RemoteLookup, lookup_for

if TYPE_CHECKING:
    from kvpool._core import _HierarchyPoolStats

__all__ = ["HierarchyBlockManagerPool"]

_core_allocate = _CoreHierarchyPool.allocate
_core_stats = _CoreHierarchyPool.stats


class HierarchyBlockManagerPool(_CoreHierarchyPool):
    """A BlockManagerPool with a host-memory KV tier per dp rank (R26) and an optional remote tier.

    Parameters
    ----------
    num_blocks, host_num_blocks, block_size, **options
        Those of ``kvpool._core.HierarchyBlockManagerPool``: device and host blocks per rank,
        tokens per block, the pool's options and ``offload_policy``.
    remote : kvpool.tiers.base.RemoteTier or None
        A shared remote tier: ``allocate`` asks it once past the device+host reach (R26).
    remote_policy : {"write_through", "on_host_evict"}, optional
        When offloaded host blocks go to the remote tier (default ``"write_through"``).
    remote_budget_ms : float, optional
        Scheduler budget of the one remote lookup per allocate, in milliseconds (default 50).
    """

    __slots__ = ("_lookup", "_remote", "_remote_budget_ms", "_remote_policy")

    _lookup: RemoteLookup | None
    _remote: Any
    _remote_policy: str
    _remote_budget_ms: float

    def __new__(
        cls,
        num_blocks: Any,
        host_num_blocks: Any,
        block_size: Any,
        *,
        remote: Any = None,
        remote_policy: Any = None,
        remote_budget_ms: Any = None,
        **options: Any,
    ) -> HierarchyBlockManagerPool:
        # validates remote, remote_policy and remote_budget_ms by name before the pool exists
        lookup, policy, budget = lookup_for(remote, remote_policy, remote_budget_ms)
        self = super().__new__(cls, num_blocks, host_num_blocks, block_size, **options)
        self._lookup = lookup
        self._remote = remote
        self._remote_policy = policy
        self._remote_budget_ms = budget
        return self

    @property
    def remote(self) -> Any:
        """The remote tier (a ``kvpool.tiers.base.RemoteTier``), or None."""
        return self._remote

    @property
    def remote_policy(self) -> str:
        """When offloaded host blocks go to the remote tier: "write_through" or "on_host_evict"."""
        return self._remote_policy

    @property
    def remote_budget_ms(self) -> float:
        """Scheduler budget of the one remote lookup per allocate, in milliseconds."""
        return self._remote_budget_ms

    def allocate(
        self, seq: Any, num_tokens: Any = None, *, plan: Any = None, num_new_tokens: Any = None
    ) -> bool:
        """Device match, host match past it, then (with a remote tier) one lookup (R14, R26)."""
        lookup = self._lookup
        if lookup is None:
            return _core_allocate(self, seq, num_tokens, plan=plan, num_new_tokens=num_new_tokens)
        if num_new_tokens is not None:
            # The lookup takes a token count: plan the chunk once (the core checks the arguments)
            # and hand over the count it resolved to, with the plan (the same decision, R14).
            plan = self.plan(seq, num_tokens, num_new_tokens=num_new_tokens)
            if plan is None:
                return False
            num_tokens = plan.num_tokens
        return lookup.allocate(self, seq, num_tokens, plan)

    def stats(self) -> _HierarchyPoolStats:  # type: ignore[override]  # as the core class's
        """The pool's statistics (R20) with ``host``, and with a remote tier ``remote`` (R26)."""
        lookup = self._lookup
        if lookup is None:
            return _core_stats(self)
        out, core = self.stats_with_remote()
        out["remote"] = lookup.stats(core)
        return out
