"""Session hints (docs/sessions.md): ``retain`` keeps a released sequence's
published prefix from eviction until its time to live runs out on the caller's clock or the
caller releases it; the held blocks are capped so hints cannot starve admission, and R15 stays
exact (held blocks are not available)."""

from __future__ import annotations

import random

import kvpool
import pytest

BS = 4


def turn(pool: kvpool.BlockManagerPool, tokens: list[int]) -> kvpool.Sequence:
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    seq.num_computed_tokens = len(seq)
    pool.cache(seq)
    return seq


def flood(pool: kvpool.BlockManagerPool, base: int) -> None:
    """Prompts that need every block of the pool, one after the other."""
    for i in range(3):
        pool.deallocate(turn(pool, list(range(base + 100 * i, base + 100 * i + 48))))


def test_a_retained_prefix_survives_a_flood_until_its_ttl_runs_out():
    pool = kvpool.BlockManagerPool(20, BS)
    session = list(range(1000, 1024))  # 6 blocks
    seq = turn(pool, session)
    assert pool.retain(seq, ttl=30.0, now=100.0)
    pool.deallocate(seq)
    assert pool.num_retained == 1 and pool.num_retained_blocks == 6
    assert pool.num_used_blocks == 6  # held, not cached: no eviction can take them (R15)
    flood(pool, 5000)
    back = kvpool.Sequence(session + [7])
    assert pool.can_allocate(back) and pool.allocate(back)
    assert back.num_cached_tokens == 24
    pool.deallocate(back)
    pool.check()
    # the clock passes the TTL: the hint ends, the prefix is evictable again
    assert pool.expire_retained(129.0) == 0
    assert pool.expire_retained(130.0) == 1
    assert pool.num_retained == 0 and pool.num_used_blocks == 0
    flood(pool, 9000)
    again = kvpool.Sequence(session + [7])
    assert pool.allocate(again) and again.num_cached_tokens == 0
    pool.check()


def test_without_a_hint_the_flood_evicts_the_session():
    pool = kvpool.BlockManagerPool(20, BS)
    session = list(range(1000, 1024))
    pool.deallocate(turn(pool, session))
    flood(pool, 5000)
    back = kvpool.Sequence(session + [7])
    assert pool.allocate(back) and back.num_cached_tokens == 0


def test_release_ends_a_hint_by_sequence_or_id():
    pool = kvpool.BlockManagerPool(20, BS)
    a = turn(pool, list(range(100, 112)))
    b = turn(pool, list(range(200, 212)))
    assert pool.retain(a, 10.0, 0.0) and pool.retain(b, 10.0, 0.0)
    pool.deallocate(a)
    pool.deallocate(b)
    assert pool.release_retained(a) and not pool.release_retained(a)
    assert pool.release_retained(b.seq_id) and pool.num_retained == 0
    assert pool.num_used_blocks == 0
    pool.check()


def test_the_cap_refuses_a_hint_over_the_fraction_whole():
    pool = kvpool.BlockManagerPool(21, BS, max_retained_fraction=0.5)  # 20 blocks: cap 10
    a = turn(pool, list(range(100, 132)))  # 8 blocks
    assert pool.retain(a, 60.0, 0.0)
    b = turn(pool, list(range(100, 108)) + list(range(300, 316)))  # shares 2 blocks, 4 new
    assert not pool.retain(b, 60.0, 0.0)  # 8 + 4 > 10: nothing held
    assert pool.num_retained == 1 and pool.num_retained_blocks == 8
    c = turn(pool, list(range(100, 108)) + list(range(400, 404)))  # shares 2, 1 new
    assert pool.retain(c, 60.0, 0.0)
    assert pool.num_retained_blocks == 9  # shared blocks counted once
    for s in (a, b, c):
        pool.deallocate(s)
    pool.check()
    # fraction 0: no hint at all
    zero = kvpool.BlockManagerPool(21, BS, max_retained_fraction=0.0)
    assert not zero.retain(turn(zero, list(range(8))), 1.0, 0.0)


def test_random_hints_keep_every_rule():
    """check() after every step, can_allocate predicting allocate, every id back at the end."""
    for seed in range(6):
        rng = random.Random(seed)
        pool = kvpool.BlockManagerPool(40, BS, max_retained_fraction=0.4)
        systems = [[rng.randrange(9) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
        running: list[kvpool.Sequence] = []
        now = 0.0
        for _ in range(300):
            now += rng.random()
            op = rng.random()
            if op < 0.4:
                seq = kvpool.Sequence(rng.choice(systems) + [rng.randrange(9) for _ in range(8)])
                can = pool.can_allocate(seq)
                assert pool.allocate(seq) == can, "R15 with hints"
                if can:
                    seq.num_computed_tokens = len(seq)
                    pool.cache(seq)
                    running.append(seq)
            elif op < 0.7 and running:
                seq = running.pop(rng.randrange(len(running)))
                if rng.random() < 0.6:
                    pool.retain(seq, rng.choice([0.0, 2.0, 10.0]), now)
                pool.deallocate(seq)
            elif op < 0.8:
                pool.expire_retained(now)
            elif op < 0.85:
                pool.release_retained(rng.randrange(1, 400))
            elif op < 0.87:
                pool.reset_prefix_cache()
            assert pool.num_retained_blocks <= 0.4 * 39
            pool.check()
        for seq in running:
            pool.deallocate(seq)
        pool.expire_retained(now + 100.0)
        pool.reset_prefix_cache()
        assert pool.num_used_blocks == 0 and pool.num_free_blocks == 39


def test_r29_hint_bad_input():
    pool = kvpool.BlockManagerPool(20, BS)
    seq = turn(pool, list(range(8)))
    for ttl, now, name in (
        (-1.0, 0.0, "ttl"),
        (float("inf"), 0.0, "ttl"),
        (1.0, float("nan"), "now"),
    ):
        with pytest.raises(ValueError, match=name):
            pool.retain(seq, ttl, now)
    with pytest.raises(TypeError, match="ttl"):
        pool.retain(seq, True, 0.0)
    with pytest.raises(TypeError, match="now"):
        pool.expire_retained("soon")
    with pytest.raises(ValueError, match="seq"):
        pool.retain(kvpool.Sequence([1, 2, 3]), 1.0, 0.0)  # holds no blocks
    with pytest.raises(ValueError, match="max_retained_fraction"):
        kvpool.BlockManagerPool(20, BS, max_retained_fraction=1.5)
    hybrid = kvpool.BlockManagerPool(20, BS, sliding_window=8)
    with pytest.raises(ValueError, match="retention rules"):
        hybrid.retain(turn(hybrid, list(range(8))), 1.0, 0.0)
    assert pool.num_retained == 0
    pool.check()
