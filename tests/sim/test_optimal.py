"""The offline bound of a prefix cache in request order (kvpool.sim.optimal, ``kvpool simulate
--eviction optimal``): it equals an exhaustive search over every eviction choice on small
random traces, it is never below the pool's own LRU on the same trace and memory, it beats LRU
where LRU is known to lose (a loop longer than the cache), and its bad inputs name themselves."""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys

import kvpool
import pytest
from kvpool.sim.optimal import request_order_bound

BS = 4


def exhaustive(chains: list[list[int]], lengths: list[int], capacity: int) -> int:
    """The most hit tokens any eviction choice gets (any cached blocks may go, not only
    leaves; the hit is still the longest cached prefix, trimmed as R8 trims it)."""

    @functools.cache
    def best(i: int, cached: frozenset) -> int:
        if i == len(chains):
            return 0
        chain, length = chains[i], lengths[i]
        hit = 0
        while hit < len(chain) and chain[hit] in cached:
            hit += 1
        if hit == len(chain) and chain and length % BS == 0:
            hit -= 1
        new = -(-length // BS) - hit
        keep = set(chain[:hit])
        free = [b for b in cached if b not in keep]
        over = len(cached) + new - capacity
        options = [frozenset()] if over <= 0 else _subsets(sorted(free), over)
        result = 0
        for gone in options:
            after = (cached - gone) | frozenset(chain)
            result = max(result, best(i + 1, after))
        return hit * BS + result

    return best(0, frozenset())


def _subsets(items: list[int], k: int) -> list[frozenset]:
    import itertools

    return [frozenset(c) for c in itertools.combinations(items, k)]


def random_trace(rng: random.Random, requests: int) -> tuple[list[list[int]], list[int]]:
    """Prompts over a small tree of shared prefixes: chain ids are tuples of the path."""
    chains, lengths = [], []
    for _ in range(requests):
        depth = rng.randint(0, 3)
        path = tuple(rng.randrange(3) for _ in range(depth))
        chain = [hash(path[: k + 1]) for k in range(depth)]
        length = depth * BS + rng.choice([0, 0, 1, 3])
        if length == 0:
            length = 1
        chains.append(chain)
        lengths.append(length)
    return chains, lengths


@pytest.mark.parametrize("seed", range(60))
def test_the_bound_equals_an_exhaustive_search(seed):
    rng = random.Random(seed)
    chains, lengths = random_trace(rng, rng.randint(4, 9))
    need = max(-(-n // BS) for n in lengths)
    capacity = rng.randint(need, need + 3)
    run = request_order_bound(chains, lengths, capacity, BS)
    assert sum(run.hit_tokens) == exhaustive(chains, lengths, capacity)
    assert run.peak_blocks <= capacity


def _pool_hits(prompts: list[list[int]], num_blocks: int) -> int:
    """What the pool's own eviction (LRU leaves, R10 R11) serves in request order."""
    pool = kvpool.BlockManagerPool(num_blocks, BS)
    hits = 0
    for tokens in prompts:
        seq = kvpool.Sequence(tokens)
        assert pool.allocate(seq)
        hits += seq.num_cached_tokens
        seq.num_computed_tokens = len(tokens)
        pool.deallocate(seq)
        pool.check()
    return hits


@pytest.mark.parametrize("seed", range(40))
def test_the_bound_is_never_below_the_pools_lru(seed):
    rng = random.Random(seed)
    systems = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    prompts = []
    for _ in range(rng.randint(10, 60)):
        base = list(rng.choice(systems)) if rng.random() < 0.8 else []
        if prompts and rng.random() < 0.3:
            base = list(rng.choice(prompts))  # a next turn resends a previous prompt
        prompts.append(base + [rng.randrange(50) for _ in range(rng.randrange(1, 12))])
    num_blocks = max(-(-len(p) // BS) for p in prompts) + 1 + rng.randrange(12)
    chains = [kvpool.hash_blocks(p, BS) for p in prompts]
    run = request_order_bound(chains, [len(p) for p in prompts], num_blocks - 1, BS)
    lru = _pool_hits(prompts, num_blocks)
    assert sum(run.hit_tokens) >= lru, (sum(run.hit_tokens), lru)


def test_a_loop_longer_than_the_cache_defeats_lru_not_the_bound():
    """Three unrelated prompts of two blocks each, in a loop, on four blocks: LRU always evicts
    the prompt that comes next (no hits at all); the bound keeps one and hits it every lap."""
    prompts = [[100 * k + t for t in range(2 * BS + 1)] for k in range(3)] * 4
    assert _pool_hits(prompts, 5 + 1) == 0  # 5 usable blocks: two prompts of 3 blocks do not fit
    chains = [kvpool.hash_blocks(p, BS) for p in prompts]
    run = request_order_bound(chains, [len(p) for p in prompts], 5, BS)
    assert sum(run.hit_tokens) > 0 and run.evictions > 0


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (([[1]], [4], 0, BS), "capacity"),
        (([[1]], [4], 2, 0), "block_size"),
        (([[1]], [4, 4], 2, BS), "lengths"),
        (([[1, 2]], [4], 2, BS), "chains"),
        (([[1, 2, 3]], [12], 2, BS), "chains"),
    ],
)
def test_bad_inputs_name_themselves(args, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        request_order_bound(*args)


def _simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", "simulate", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_simulate_reports_the_bound_beside_lru():
    common = ["-n", "200", "--order", "request", "--num-blocks", "400", "--json"]
    runs = {}
    for eviction in ("lru", "optimal"):
        p = _simulate(*common, "--eviction", eviction)
        assert p.returncode == 0, p.stderr
        runs[eviction] = json.loads(p.stdout)
    lru, opt = runs["lru"]["summary"], runs["optimal"]["summary"]
    assert runs["optimal"]["config"]["eviction"] == "optimal"
    assert opt["prefix_query_tokens"] == lru["prefix_query_tokens"]
    assert opt["prefix_hit_tokens"] >= lru["prefix_hit_tokens"] > 0
    assert opt["admitted_cached_tokens"] == opt["prefix_hit_tokens"]
    assert opt["prefill_tokens_computed"] == opt["prompt_tokens"] - opt["prefix_hit_tokens"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--eviction optimal needs --order request"),
        (["--order", "request", "--sliding-window", "64"], "drop --sliding-window"),
        (["--order", "request", "--attention-chunk-size", "64"], "drop --attention-chunk-size"),
        (["--order", "request", "--dp", "2"], "drop --dp"),
        (["--order", "request", "--host-blocks", "64"], "drop --host-blocks"),
    ],
)
def test_simulate_refuses_what_the_bound_does_not_model(extra, message):
    p = _simulate("-n", "5", "--eviction", "optimal", *extra)
    assert p.returncode == 2 and message in p.stderr, p.stderr
