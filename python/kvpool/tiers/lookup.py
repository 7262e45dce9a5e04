"""The remote tier's lookup policy: one batched existence query per admission (docs/remote_tier.md).

``HierarchyBlockManagerPool(..., remote=tier)`` hands ``allocate`` to a ``RemoteLookup``:
plan the allocation (one walk of the chain per local tier), ask the core what lies past the
device+host reach (``remote_query``), make ONE ``tier.exists_many(keys, timeout=budget)`` call
with no lock held, and allocate with the answer (``allocate_with_remote``), reusing the plan's
walks. The core does no I/O and keeps no policy; this module owns it:

- **budget**: ``remote_budget_ms`` is passed to ``exists_many`` as ``timeout`` (seconds); a
  lookup that takes longer is counted (``lookups_over_budget``);
- **misses**: an ``Exception`` from the tier or a malformed answer is a miss, counted in
  ``lookup_failures``; the allocation goes on with the local tiers (R14, R15 hold: the remote
  part only extends a hit);
- a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``)
  propagates before the pool or the counters changed (F12).

The counters appear in the pool's ``stats()["remote"]`` with the core's (hit, fetched, failed
and pending blocks) and the tier's own ``stats()``.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_BUDGET_MS", "POLICIES", "RemoteLookup", "lookup_for"]

POLICIES = ("write_through", "on_host_evict")
DEFAULT_BUDGET_MS = 50.0
_TIER_METHODS = ("exists_many", "get_many", "put_many")


def lookup_for(
    remote: Any, remote_policy: Any = None, remote_budget_ms: Any = None
) -> tuple[RemoteLookup | None, str, float]:
    """Validates the remote options of a hierarchy pool (each error names its argument).

    Returns
    -------
    tuple
        ``(lookup, policy, budget_ms)``: the ``RemoteLookup`` (None without a remote tier), the
        write policy and the lookup budget in milliseconds.
    """
    if remote is not None:
        for method in _TIER_METHODS:
            if not hasattr(remote, method):
                raise TypeError(
                    f"remote: must be a kvpool.tiers.base.RemoteTier (no {method} method)"
                )
    if remote_policy is None:
        policy = POLICIES[0]
    elif not isinstance(remote_policy, str):
        raise TypeError("remote_policy: must be a str")
    elif remote_policy not in POLICIES:
        raise ValueError(
            f"remote_policy: must be 'write_through' or 'on_host_evict', got {remote_policy!r}"
        )
    else:
        policy = remote_policy
    if remote_budget_ms is None:
        budget = DEFAULT_BUDGET_MS
    elif isinstance(remote_budget_ms, bool) or not isinstance(remote_budget_ms, numbers.Real):
        raise TypeError("remote_budget_ms: must be a number")
    else:
        budget = float(remote_budget_ms)
        if not (math.isfinite(budget) and budget > 0):
            raise ValueError(f"remote_budget_ms: must be a finite number > 0, got {budget}")
    lookup = RemoteLookup(remote, policy, budget) if remote is not None else None
    return lookup, policy, budget


class RemoteLookup:
    """The lookup policy of one pool's remote tier (see the module doc)."""

    def __init__(self, tier: Any, policy: str, budget_ms: float) -> None:
        self.tier = tier
        self.policy = policy
        self.budget_s = budget_ms / 1000.0
        self._lock = threading.Lock()
        self.lookups = 0
        self.keys = 0
        self.failures = 0
        self.over_budget = 0
        self.seconds = 0.0

    def allocate(
        self, pool: Any, seq: Any, num_tokens: int | None = None, plan: Any = None
    ) -> bool:
        """``pool.allocate(seq, num_tokens, plan=plan)`` with one remote lookup (R14, R26)."""
        if plan is None:
            plan = pool.plan(seq, num_tokens)
            if plan is None:  # allocate would return False (R15), or a growth would fail
                return pool.allocate_with_remote(seq, num_tokens)
        query = pool.remote_query(seq, num_tokens, plan=plan)
        hits = self.lookup(query) if query is not None else None
        return pool.allocate_with_remote(seq, num_tokens, remote_hits=hits, plan=plan)

    def lookup(self, query: tuple[int, list[bytes]]) -> tuple[int, int] | None:
        """One batched existence query: the leading run of ``keys`` the tier holds, as chain
        positions ``(from, to)``, or None on a miss (a failure is a counted miss)."""
        start_from, keys = query
        start = time.perf_counter()
        try:
            hits = 0
            for found in self.tier.exists_many(keys, timeout=self.budget_s):
                if not found or hits == len(keys):
                    break
                hits += 1
            failed = False
        except Exception:  # noqa: BLE001 - any tier failure is a miss (BaseExceptions propagate)
            hits, failed = 0, True
        elapsed = time.perf_counter() - start
        with self._lock:
            self.lookups += 1
            self.keys += len(keys)
            self.seconds += elapsed
            self.over_budget += elapsed > self.budget_s
            self.failures += failed
        return (start_from, start_from + hits) if hits else None

    def stats(self, core: Mapping[str, Any]) -> dict[str, Any]:
        """The pool's ``stats()["remote"]``: these counters, the core's ``core`` (hit, fetched,
        failed and pending blocks) and the tier's own ``stats()``."""
        with self._lock:
            out: dict[str, Any] = {
                "policy": self.policy,
                "lookups": self.lookups,
                "lookup_keys": self.keys,
                "lookup_failures": self.failures,
                "lookups_over_budget": self.over_budget,
                "lookup_seconds": self.seconds,
            }
        hit = core.get("hit_blocks", 0)
        out["hit_blocks"] = hit
        out["miss_blocks"] = max(0, out["lookup_keys"] - hit)
        for key in ("fetched_blocks", "failed_fetch_blocks", "pending_fetch_blocks"):
            out[key] = core.get(key, 0)
        tier_stats = getattr(self.tier, "stats", None)
        if tier_stats is not None:
            extra = tier_stats()
            if isinstance(extra, dict):
                for key, value in extra.items():
                    out.setdefault(key, value)
        return out
