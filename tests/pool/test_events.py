"""R21: KV events equal what happened to the prefix cache.

The contract (R21) fixes the event fields but not how blocks are grouped into events, so the helpers below
flatten "stored" events into per-block records (checking that each event is one contiguous chain:
parent_hash links its first block, token_ids holds block_size tokens per block) and "removed"
events into hashes. A default extra_key may be reported as None or b"".
"""

from __future__ import annotations

import random

import kvpool
import pytest
from conftest import toks

BS = 4


def flatten_stored(events, block_size=BS):
    """[(hash, parent_hash, tokens tuple, dp_rank, extra_key)] for every block of every "stored"."""
    out = []
    for e in events:
        if e.kind != "stored":
            continue
        assert e.block_size == block_size
        hs = list(e.block_hashes)
        assert hs, "a stored event names at least one block"
        assert all(isinstance(h, bytes) and len(h) == 16 for h in hs)
        tk = list(e.token_ids)
        assert len(tk) == len(hs) * block_size, "token_ids: block_size tokens per stored block"
        parent = e.parent_hash
        for i, h in enumerate(hs):
            out.append(
                (
                    h,
                    parent,
                    tuple(tk[i * block_size : (i + 1) * block_size]),
                    e.dp_rank,
                    e.extra_key,
                )
            )
            parent = h
    return out


def removed_hashes(events):
    out = []
    for e in events:
        if e.kind == "removed":
            assert all(isinstance(h, bytes) and len(h) == 16 for h in e.block_hashes)
            out.extend(e.block_hashes)
    return out


def kinds(events):
    return [e.kind for e in events]


def same_key(got, expected):
    if expected is None:
        return got in (None, b"")
    return got == expected


def expected_blocks(tokens, first, last, *, extra_key=None, hash_seed=None, dp_rank=0):
    """Per-block records for blocks first..last-1 of `tokens` (what "stored" should say)."""
    hs = kvpool.hash_blocks(tokens, BS, extra_key=extra_key, hash_seed=hash_seed)
    out = []
    for i in range(first, last):
        parent = hs[i - 1] if i > 0 else None
        out.append((hs[i], parent, tuple(tokens[i * BS : (i + 1) * BS]), dp_rank))
    return out


def strip(records):
    return [r[:4] for r in records]


def run(pool, tokens, extra_key=None, computed=None):
    s = kvpool.Sequence(tokens, extra_key=extra_key)
    assert pool.allocate(s)
    s.num_computed_tokens = len(tokens) if computed is None else computed
    return s


def test_r21_stored_on_cache_then_nothing_on_hit():
    pool = kvpool.BlockManagerPool(32, BS, enable_events=True)
    assert pool.drain_events() == []
    t = toks(10)
    x = run(pool, t)
    assert pool.drain_events() == [], "allocating fresh blocks stores nothing"
    pool.cache(x)
    ev = pool.drain_events()
    assert set(kinds(ev)) == {"stored"}
    recs = flatten_stored(ev)
    assert strip(recs) == expected_blocks(t, 0, 2)
    assert all(same_key(r[4], None) for r in recs)
    assert pool.drain_events() == [], "drain clears"
    pool.cache(x)
    assert pool.drain_events() == [], "nothing new to store"
    # a hit is not a store; extending the chain stores only the new blocks, with the parent link
    y = run(pool, t[:8] + toks(9, start=100))
    assert y.num_cached_tokens == 8
    assert pool.drain_events() == []
    pool.cache(y)
    recs = flatten_stored(pool.drain_events())
    assert strip(recs) == expected_blocks(t[:8] + toks(9, start=100), 2, 4)
    assert recs[0][1] == kvpool.hash_blocks(t, BS)[1]
    # releasing blocks that stay cached removes nothing
    pool.deallocate(x)
    pool.deallocate(y)
    ev = pool.drain_events()
    assert removed_hashes(ev) == []
    assert flatten_stored(ev) == []


def test_r21_deallocate_publishes_computed_blocks():
    pool = kvpool.BlockManagerPool(32, BS, enable_events=True)
    t = toks(14, start=5)
    s = run(pool, t, computed=9)
    pool.deallocate(s)
    recs = flatten_stored(pool.drain_events())
    assert strip(recs) == expected_blocks(t, 0, 2), "only full blocks inside the computed tokens"


def test_r21_removed_on_eviction_leaf_first():
    pool = kvpool.BlockManagerPool(6, BS, enable_events=True)  # 5 ids
    t = toks(12)
    pool.deallocate(run(pool, t))  # chain of 3 cached, 2 free
    hs = kvpool.hash_blocks(t, BS)
    pool.drain_events()
    z = run(pool, toks(12, start=100), computed=0)  # needs 3: 2 free + evict 1
    ev = pool.drain_events()
    assert removed_hashes(ev) == [hs[2]], "the chain's tail goes first (R10)"
    assert all(same_key(e.extra_key, None) for e in ev if e.kind == "removed")
    assert all(e.dp_rank == 0 for e in ev)
    pool.deallocate(z)
    w = run(pool, toks(20, start=200), computed=0)  # needs 5: 3 free + evict 2
    assert removed_hashes(pool.drain_events()) == [hs[1], hs[0]]
    pool.deallocate(w)


def test_r21_cleared_on_reset():
    pool = kvpool.BlockManagerPool(32, BS, enable_events=True)
    pool.deallocate(run(pool, toks(8)))
    pool.drain_events()
    pool.reset_prefix_cache()
    ev = pool.drain_events()
    assert "cleared" in kinds(ev)
    assert flatten_stored(ev) == []
    cleared = [e for e in ev if e.kind == "cleared"]
    assert all(e.dp_rank == 0 for e in cleared)


def test_r21_extra_key_and_hash_seed_in_events():
    pool = kvpool.BlockManagerPool(32, BS, enable_events=True, hash_seed=1234)
    t = toks(8, start=40)
    pool.cache(run(pool, t, extra_key=b"lora-7"))
    recs = flatten_stored(pool.drain_events())
    assert strip(recs) == expected_blocks(t, 0, 2, extra_key=b"lora-7", hash_seed=1234)
    assert all(r[4] == b"lora-7" for r in recs)


def test_r21_dp_rank_in_events():
    pool = kvpool.BlockManagerPool(16, BS, dp_size=2, enable_events=True)
    a = run(pool, toks(8))
    b = run(pool, toks(8, start=50))
    assert (a.dp_rank, b.dp_rank) == (0, 1)
    pool.cache(a)
    pool.cache(b)
    recs = flatten_stored(pool.drain_events())
    assert sorted(strip(recs)) == sorted(
        expected_blocks(toks(8), 0, 2, dp_rank=0)
        + expected_blocks(toks(8, start=50), 0, 2, dp_rank=1)
    )
    pool.reset_prefix_cache()
    cleared = {e.dp_rank for e in pool.drain_events() if e.kind == "cleared"}
    assert cleared == {0, 1}, "each rank's cache reports its own clear"


def test_r21_events_disabled_by_default():
    """ASSUMPTION beyond the contract: without enable_events, drain_events() returns []."""
    pool = kvpool.BlockManagerPool(16, BS)
    pool.deallocate(run(pool, toks(8)))
    pool.reset_prefix_cache()
    assert pool.drain_events() == []


def test_r21_failed_allocate_emits_nothing():
    pool = kvpool.BlockManagerPool(6, BS, enable_events=True)
    pool.deallocate(run(pool, toks(8)))
    pool.drain_events()
    s = kvpool.Sequence(toks(40, start=100))
    assert pool.can_allocate(s) is False
    assert pool.allocate(s) is False
    assert pool.drain_events() == []


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_r21_random_workload_events_replay_to_the_cache(seed):
    """Replaying the events gives a cache that (a) only ever stores known chains, prefix-closed,
    never twice, (b) only removes leaves it holds, and (c) predicts every later prefix hit."""
    rng = random.Random(seed)
    pool = kvpool.BlockManagerPool(20, BS, enable_events=True)
    prefixes = [[rng.randrange(6) for _ in range(rng.choice([4, 8, 12]))] for _ in range(5)]
    known: dict[bytes, tuple] = {}  # hash -> (parent, block tokens, extra_key)
    cached: set[bytes] = set()
    children: dict[bytes, int] = {}
    workload: list = []

    def learn(tokens, key):
        hs = kvpool.hash_blocks(tokens, BS, extra_key=key)
        for i, h in enumerate(hs):
            known[h] = (hs[i - 1] if i else None, tuple(tokens[i * BS : (i + 1) * BS]), key)

    def apply(events):
        for e in events:
            assert e.dp_rank == 0 and e.block_size == BS
            if e.kind == "stored":
                for h, parent, btoks, _rank, key in flatten_stored([e]):
                    assert h in known, "stored a hash no sequence has"
                    assert known[h][0] == parent and known[h][1] == btoks
                    assert same_key(key, known[h][2])
                    assert h not in cached, "stored twice without a removal"
                    assert parent is None or parent in cached, "stored block's parent not cached"
                    cached.add(h)
                    children[h] = 0
                    if parent is not None:
                        children[parent] += 1
            elif e.kind == "removed":
                for h in e.block_hashes:
                    assert h in cached, "removed a hash that was not cached"
                    assert children[h] == 0, "removed a block with a cached child (R10)"
                    cached.discard(h)
                    p = known[h][0]
                    if p is not None:
                        children[p] -= 1
            elif e.kind == "cleared":
                cached.clear()
                children.clear()
            else:
                raise AssertionError(f"unknown event kind {e.kind!r}")

    running: list = []
    for _step in range(250):
        r = rng.random()
        if r < 0.35:
            key = rng.choice([None, b"k"])
            t = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(0, 9))]
            learn(t, key)
            s = kvpool.Sequence(t, extra_key=key)
            workload.append((t, key))
            if pool.allocate(s):
                running.append(s)
        elif r < 0.6 and running:
            s = rng.choice(running)
            s.num_computed_tokens = rng.randint(s.num_computed_tokens, len(s))
            pool.cache(s)
        elif r < 0.9 and running:
            s = running.pop(rng.randrange(len(running)))
            s.num_computed_tokens = rng.randint(s.num_computed_tokens, len(s))
            pool.deallocate(s)
        elif r < 0.93:
            pool.reset_prefix_cache()
        apply(pool.drain_events())
    for s in running:
        pool.deallocate(s)
    running.clear()
    apply(pool.drain_events())
    # (c) every workload prompt's hit is what the replayed cache predicts
    for t, key in workload:
        hs = kvpool.hash_blocks(t, BS, extra_key=key)
        exp = 0
        while exp < len(hs) and hs[exp] in cached:
            exp += 1
        probe = kvpool.Sequence(t + [99], extra_key=key)  # the extra token avoids R8's trim
        if not pool.allocate(probe):
            continue
        assert probe.num_cached_tokens == exp * BS, (t, key)
        pool.deallocate(probe)  # computed == cached: stores nothing new
        ev = pool.drain_events()
        assert flatten_stored(ev) == []
        apply(ev)
    pool.check()


@pytest.mark.parametrize(
    "options",
    [
        {"linear_state_slots": 8, "checkpoint_interval": 2 * BS},
        {"sliding_window": 6},  # the window in the shared store
        {"sliding_window": 6, "swa_num_blocks": 32},  # the window in a store of its own
    ],
)
def test_a_hybrid_pool_announces_its_groups_first(options):
    """A rank with groups besides full attention announces them ("group" events: group 0, then
    its other groups) before any other event of its own; an index fed the stream then asks a
    hit for every group's blocks from the start (contract: groups announced up front). A plain
    pool announces nothing."""
    pool = kvpool.BlockManagerPool(32, BS, enable_events=True, dp_size=2, **options)
    tokens = list(range(6 * BS))
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    seq.num_computed_tokens = BS  # one block: no checkpoint at its boundary yet
    pool.cache(seq)
    events = pool.drain_events()
    rank = seq.dp_rank
    mine = [e for e in events if e.dp_rank == rank]
    kind = "linear_state" if "linear_state_slots" in options else "sliding_window"
    assert [(e.kind, e.group, e.group_kind) for e in mine[:2]] == [
        ("group", 0, "full_attention"),
        ("group", 1, kind),
    ]
    assert [e.sequence for e in mine[:2]] == [1, 2] and mine[0].block_hashes == []
    assert all(e.kind != "group" for e in mine[2:])
    assert mine[1].sliding_window == options.get("sliding_window")
    index = kvpool.KVIndex()
    assert index.apply(0, events)["gaps"] == []
    if kind == "linear_state":
        rows = [r for r in index.lookup(tokens, depths=True) if r[1] == rank]
        assert [(r[3], r[5]) for r in rows] == [(0, 1)], "KV of one block, no checkpoint: no hit"
    plain = kvpool.BlockManagerPool(32, BS, enable_events=True)
    s = kvpool.Sequence(tokens)
    assert plain.allocate(s)
    s.num_computed_tokens = BS
    plain.cache(s)
    assert all(e.kind != "group" for e in plain.drain_events())
