"""The remote tier's lookup policy in Python (out of the binding): one existence query
per admission, reusing the plan's walks; failures are counted misses; BaseExceptions propagate
with the pool unchanged (F12); the remote options are validated by name (R29)."""

from __future__ import annotations

import kvpool
import pytest
from kvpool.tiers.base import RemoteTier
from kvpool.tiers.lookup import RemoteLookup, lookup_for

BS = 4


class MemoryTier(RemoteTier):
    """A remote tier in a dict: exists_many answers from what was put."""

    def __init__(self, stored=()):
        super().__init__()
        self.stored = set(stored)

    def exists_many(self, keys, *, timeout=None):
        self.note("exists_calls")
        return [k in self.stored for k in keys]

    def get_many(self, keys, *, timeout=None):
        return [None] * len(keys)

    def put_many(self, keys, payloads, *, timeout=None):
        self.stored.update(keys)


def test_one_lookup_and_one_walk_per_tier_per_admission():
    tokens = list(range(21))
    tier = MemoryTier(kvpool.hash_blocks(tokens, BS))
    pool = kvpool.HierarchyBlockManagerPool(32, 32, BS, remote=tier)
    assert isinstance(pool, kvpool.BlockManagerPool) and pool.remote is tier
    seq = kvpool.Sequence(tokens)
    before = pool.debug_counters()
    assert pool.allocate(seq)
    after = pool.debug_counters()
    assert after["device_chain_walks"] - before["device_chain_walks"] == 1
    assert after["host_chain_walks"] - before["host_chain_walks"] == 1
    assert tier.stats()["exists_calls"] == 1
    fetches = pool.take_fetch_plans()
    assert len(fetches) == 1 and len(fetches[0]) == 5, "R8: 5 of the 21 tokens' full blocks"
    remote = pool.stats()["remote"]
    assert remote["lookups"] == 1 and remote["lookup_keys"] == 5 and remote["hit_blocks"] == 5
    assert remote["miss_blocks"] == 0 and remote["pending_fetch_blocks"] == 5
    assert remote["exists_calls"] == 1, "the tier's own counters are merged"
    pool.complete_fetches(fetches)
    pool.complete_loads(pool.take_load_plans())
    assert seq.num_cached_tokens == 20
    pool.deallocate(seq)
    pool.check()


def test_allocate_with_a_plan_reuses_its_walks_for_the_lookup():
    tier = MemoryTier()
    pool = kvpool.HierarchyBlockManagerPool(32, 32, BS, remote=tier)
    seq = kvpool.Sequence(list(range(21)))
    plan = pool.plan(seq)
    assert pool.remote_query(seq, plan=plan) == (0, kvpool.hash_blocks(list(range(20)), BS))
    before = pool.debug_counters()
    assert pool.allocate(seq, plan=plan)
    assert pool.debug_counters() == before, "the plan's walks, no new one"
    assert pool.stats()["remote"]["miss_blocks"] == 5
    pool.check()


def test_remote_options_are_validated_by_name():
    with pytest.raises(TypeError, match="^remote"):
        kvpool.HierarchyBlockManagerPool(8, 8, BS, remote=object())
    with pytest.raises(ValueError, match="^remote_policy"):
        kvpool.HierarchyBlockManagerPool(8, 8, BS, remote_policy="never")
    with pytest.raises(TypeError, match="^remote_budget_ms"):
        kvpool.HierarchyBlockManagerPool(8, 8, BS, remote_budget_ms=True)
    with pytest.raises(ValueError, match="^remote_budget_ms"):
        kvpool.HierarchyBlockManagerPool(8, 8, BS, remote_budget_ms=float("inf"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'remote_budget'"):
        kvpool.HierarchyBlockManagerPool(8, 8, BS, remote_budget=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'host_num_blocks'"):
        kvpool.BlockManagerPool(8, BS, host_num_blocks=5)
    lookup, policy, budget = lookup_for(MemoryTier(), "on_host_evict", 7)
    assert isinstance(lookup, RemoteLookup) and (policy, budget) == ("on_host_evict", 7.0)
    assert lookup_for(None) == (None, "write_through", 50.0)


def test_a_pool_with_other_groups_never_asks_the_remote_tier():
    tokens = list(range(21))
    tier = MemoryTier(kvpool.hash_blocks(tokens, BS))
    pool = kvpool.HierarchyBlockManagerPool(32, 32, BS, remote=tier, linear_state_slots=4)
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq) and tier.stats()["exists_calls"] == 0
    assert pool.take_fetch_plans() == [] and pool.stats()["remote"]["lookups"] == 0
    pool.deallocate(seq)
    pool.check()


def test_the_remote_tier_is_composed_in_python_over_the_compiled_pool():
    """kvpool.HierarchyBlockManagerPool is a Python subclass of the compiled pool, which takes no
    remote option and imports nothing of the package: the lookup runs in Python, calling down."""
    core = kvpool._core.HierarchyBlockManagerPool
    assert issubclass(kvpool.HierarchyBlockManagerPool, core)
    assert kvpool.HierarchyBlockManagerPool is not core
    with pytest.raises(TypeError, match="remote"):
        core(32, 32, BS, remote=MemoryTier())
    plain = core(32, 32, BS)
    assert not hasattr(plain, "remote") and "remote" not in plain.stats()
    stats, counters = plain.stats_with_remote()
    assert set(counters) == {
        "hit_blocks",
        "fetched_blocks",
        "failed_fetch_blocks",
        "pending_fetch_blocks",
    }
    assert stats["num_total_blocks"] == plain.stats()["num_total_blocks"]
    tokens = list(range(21))
    tier = MemoryTier(kvpool.hash_blocks(tokens, BS))
    pool = kvpool.HierarchyBlockManagerPool(32, 32, BS, remote=tier, remote_budget_ms=20)
    assert (pool.remote, pool.remote_policy, pool.remote_budget_ms) == (tier, "write_through", 20.0)
    for name in ("remote", "remote_policy", "remote_budget_ms"):
        with pytest.raises(AttributeError):
            setattr(pool, name, None)
    assert pool.allocate(kvpool.Sequence(tokens))
    remote = pool.stats()["remote"]
    assert (
        remote["lookups"] == 1 and remote["hit_blocks"] == 5 and tier.stats()["exists_calls"] == 1
    )
    # without a remote tier the Python class adds nothing to the stats
    local = kvpool.HierarchyBlockManagerPool(32, 32, BS)
    assert local.remote is None and "remote" not in local.stats()
