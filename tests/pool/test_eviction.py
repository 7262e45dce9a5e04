"""Eviction policies of the pool (R11a, docs/eviction.md): the ``eviction=`` option, scan
resistance (LRU loses a hot prefix to a scan of one-off prompts larger than the cache, SLRU keeps
it), each policy against the offline bound and with ``check()`` after every step on random
request-order workloads, and ``kvpool simulate --eviction``.

The stateful model (every rule, ``check()`` after every step) runs under each policy in
tests/pool/test_pool_stateful.py (``TestPoolStatefulSlru``, ``TestPoolStatefulGhostSlru``).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import kvpool
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool.sim.config import POOL_EVICTIONS
from kvpool.sim.optimal import request_order_bound

BS = 4
POLICIES = ("lru", "slru", "ghost_slru")


def test_policies_are_the_simulators():
    assert POOL_EVICTIONS == POLICIES


@pytest.mark.parametrize("eviction", POLICIES)
def test_r11a_eviction_option_is_kept(eviction):
    pool = kvpool.BlockManagerPool(16, BS, eviction=eviction)
    assert pool.eviction == eviction
    assert kvpool.BlockManagerPool(16, BS).eviction == "lru", "LRU stays the default"
    host = kvpool.HierarchyBlockManagerPool(16, 16, BS, eviction=eviction)
    host.check()


@pytest.mark.parametrize(
    ("value", "error"),
    [("lfu", ValueError), ("LRU", ValueError), ("", ValueError), (1, TypeError)],
)
def test_r29_a_bad_eviction_names_the_argument(value, error):
    with pytest.raises(error, match="^eviction:"):
        kvpool.BlockManagerPool(16, BS, eviction=value)


def test_r29_eviction_needs_a_prefix_cache():
    with pytest.raises(ValueError, match="^eviction:"):
        kvpool.BlockManagerPool(16, BS, eviction="slru", enable_prefix_cache=False)
    assert kvpool.BlockManagerPool(16, BS, eviction="lru", enable_prefix_cache=False)


def serve(pool: kvpool.BlockManagerPool, tokens: list[int]) -> int:
    """One request in request order: the hit, the rest computed and published, all released.
    Returns the prompt tokens found in the cache."""
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    hit = seq.num_cached_tokens
    seq.num_computed_tokens = len(tokens)
    pool.deallocate(seq)
    pool.check()
    return hit


def hot_prefix_between_scans(eviction: str) -> tuple[int, int]:
    """A hot prompt (4 blocks) used twice, then asked again after each of 8 scans of one-off
    prompts (40 blocks each, the cache holds 32): the hot prompt's hit tokens after the warm-up
    and the tokens it asked."""
    pool = kvpool.BlockManagerPool(33, BS, eviction=eviction)
    hot = [1_000_000 + t for t in range(4 * BS + 1)]
    serve(pool, hot)
    assert serve(pool, hot) == 4 * BS, "the second use hits under every policy"
    hits = asked = 0
    one_off = 0
    for _ in range(8):
        for _ in range(10):
            assert serve(pool, [one_off * 100 + t for t in range(4 * BS + 1)]) == 0
            one_off += 1
        hits += serve(pool, hot)
        asked += 4 * BS
    return hits, asked


def test_r11a_scan_resistance_lru_fails_and_slru_passes():
    lru, _ = hot_prefix_between_scans("lru")
    assert lru == 0, "each scan flushes the hot prefix out of LRU"
    for eviction in ("slru", "ghost_slru"):
        hits, asked = hot_prefix_between_scans(eviction)
        assert hits == asked, f"{eviction} keeps the hot prefix through every scan"


def random_prompts(rng: random.Random) -> list[list[int]]:
    """Shared system prompts, next turns that resend a previous prompt, one-off prompts."""
    systems = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    prompts: list[list[int]] = []
    for _ in range(rng.randint(10, 60)):
        base = list(rng.choice(systems)) if rng.random() < 0.8 else []
        if prompts and rng.random() < 0.3:
            base = list(rng.choice(prompts))
        prompts.append(base + [rng.randrange(50) for _ in range(rng.randrange(1, 12))])
    return prompts


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), eviction=st.sampled_from(POLICIES))
def test_r11a_each_policy_checks_after_every_step_and_stays_under_the_bound(seed, eviction):
    """R10, R11a: every request's hit is a prefix of the prompt, check() passes after every
    request (segments, flags, caps), and no policy beats the offline bound (R10's prefix
    closure kept: the bound is the best any prefix-closed eviction can do)."""
    rng = random.Random(seed)
    prompts = random_prompts(rng)
    num_blocks = max(-(-len(p) // BS) for p in prompts) + 1 + rng.randrange(12)
    pool = kvpool.BlockManagerPool(num_blocks, BS, eviction=eviction)
    hits = sum(serve(pool, p) for p in prompts)
    chains = [kvpool.hash_blocks(p, BS) for p in prompts]
    bound = request_order_bound(chains, [len(p) for p in prompts], num_blocks - 1, BS)
    assert sum(bound.hit_tokens) >= hits
    pool.reset_prefix_cache()
    pool.check()
    assert pool.num_free_blocks == num_blocks - 1


def test_r29_protected_percent_is_kept_and_checked():
    pool = kvpool.BlockManagerPool(16, BS, eviction="slru", protected_percent=50)
    assert pool.protected_percent == 50
    assert kvpool.BlockManagerPool(16, BS).protected_percent == 20
    for bad in (101, -1):
        with pytest.raises(ValueError, match="^protected_percent:"):
            kvpool.BlockManagerPool(16, BS, eviction="slru", protected_percent=bad)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_r11a_slru_without_a_protected_segment_is_lru(seed):
    """A protected segment of 0 blocks gives every promoted block straight back to the newest
    end of probation: the order of LRU, request for request."""
    rng = random.Random(seed)
    prompts = random_prompts(rng)
    num_blocks = max(-(-len(p) // BS) for p in prompts) + 1 + rng.randrange(12)
    lru = kvpool.BlockManagerPool(num_blocks, BS)
    slru = kvpool.BlockManagerPool(num_blocks, BS, eviction="slru", protected_percent=0)
    assert [serve(lru, p) for p in prompts] == [serve(slru, p) for p in prompts]


def _simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", "simulate", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_simulate_runs_each_policy_in_a_sweep():
    p = _simulate(
        "-n", "150", "--order", "request", "--num-blocks", "300", "--json",
        "--sweep", "eviction=lru,slru,ghost_slru,optimal",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    runs = {run["config"]["eviction"]: run["summary"] for run in json.loads(p.stdout)["sweep"]}
    assert set(runs) == {*POLICIES, "optimal"}
    for eviction in POLICIES:
        assert runs[eviction]["prefix_query_tokens"] == runs["optimal"]["prefix_query_tokens"]
        assert runs[eviction]["prefix_hit_tokens"] <= runs["optimal"]["prefix_hit_tokens"]


def test_simulate_sweeps_the_protected_share():
    p = _simulate(
        "-n", "120", "--order", "request", "--num-blocks", "300", "--json",
        "--eviction", "slru", "--sweep", "protected_percent=10,90",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    runs = json.loads(p.stdout)["sweep"]
    assert [run["config"]["protected_percent"] for run in runs] == [10, 90]


def test_simulate_checks_each_policy_every_step():
    p = _simulate("-n", "60", "--num-blocks", "800", "--eviction", "ghost_slru", "--check")
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize(
    "args", [["--eviction", "lfu"], ["--sweep", "eviction=lru,lfu"]], ids=["flag", "sweep"]
)
def test_simulate_refuses_an_unknown_policy(args):
    p = _simulate("-n", "5", *args)
    assert p.returncode == 2 and "lfu" in p.stderr, p.stderr
