"""Model-based test of kvpool.BlockManagerPool: R2, R8, R13-R19 on random workloads.

The machine drives the pool like an engine (admit, chunked prefill, decode, cache, preempt,
finish, reset) and checks after every step:

* R15: can_allocate / can_append answer exactly what allocate / may_append then do, and have no
  side effect (stats, sequence, events);
* R14/R16: success is decided exactly by the free + cached blocks of the sequence's rank, and a
  failure leaves everything as it was;
* R13: a new sequence goes to the rank with the most available blocks, lowest on ties, and keeps
  its rank for life;
* R7/R17 ("ghost KV"): the test keeps, per (rank, block id, offset), the (extra_key, token prefix)
  whose KV the engine wrote there; every prefix-cache hit must point at exactly the KV the
  sequence would have computed itself;
* R2: per rank, used blocks == the distinct ids in the live block tables;
* R19: block_tables / slot_mapping equal a slow Python reference;
* check() passes; at the end every id is free after all sequences are deallocated and the
  cache is reset.

The success condition used for allocate: a sequence needing ceil(n / block_size) table entries
always fits when that many blocks are available (free + cached) on its rank, and never fits when
fewer are (a hit can only reduce the need by as much as it pins). This follows from R3, R10, R14.
"""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

BS = 2


def cdiv(a, b):
    return -(-a // b)


def table(seq):
    return [int(x) for x in seq.block_table]


token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=12)


class PoolMachine(RuleBasedStateMachine):
    DP = 1
    NUM_BLOCKS = 14
    EVENTS = False
    EVICTION = "lru"

    def __init__(self):
        super().__init__()
        self.pool = kvpool.BlockManagerPool(
            self.NUM_BLOCKS, BS, dp_size=self.DP, enable_events=self.EVENTS, eviction=self.EVICTION
        )
        assert self.pool.eviction == self.EVICTION
        self.waiting: list = []  # not holding blocks (new or preempted)
        self.running: list = []  # holding blocks
        self.kv: dict[tuple, tuple] = {}  # (rank, block id, offset) -> (extra_key, token prefix)
        self.keys: dict[int, bytes | None] = {}  # id(seq) -> extra_key
        self.next_id = 0

    # ---- helpers -------------------------------------------------------------------------

    def avail(self):
        return [r["num_free_blocks"] + r["num_cached_blocks"] for r in self.pool.stats()["ranks"]]

    def expected_rank(self, seq):
        if seq.dp_rank is not None:
            return seq.dp_rank
        av = self.avail()
        return max(range(len(av)), key=lambda r: (av[r], -r))

    def snap(self, seq):
        return (
            self.pool.stats(),
            len(seq),
            table(seq),
            seq.num_cached_tokens,
            seq.num_computed_tokens,
            seq.dp_rank,
        )

    def write_kv(self, seq, start, end):
        t = table(seq)
        toks = list(seq.token_ids)
        key = self.keys[id(seq)]
        for pos in range(start, end):
            self.kv[(seq.dp_rank, t[pos // BS], pos % BS)] = (key, tuple(toks[: pos + 1]))

    def check_hit(self, seq):
        """R7/R17: the cached tokens' KV is exactly what this sequence would compute."""
        t = table(seq)
        toks = list(seq.token_ids)
        key = self.keys[id(seq)]
        for pos in range(seq.num_cached_tokens):
            got = self.kv.get((seq.dp_rank, t[pos // BS], pos % BS))
            assert got == (key, tuple(toks[: pos + 1])), (
                f"prefix hit handed out wrong KV at position {pos}: {got}"
            )

    # ---- rules ---------------------------------------------------------------------------

    @rule(tokens=token_lists, key=st.sampled_from([None, b"a"]))
    def arrive(self, tokens, key):
        s = kvpool.Sequence(tokens, seq_id=self.next_id, extra_key=key)
        self.next_id += 1
        self.keys[id(s)] = key
        self.waiting.append(s)

    @rule(data=st.data())
    @precondition(lambda self: self.waiting)
    def admit(self, data):
        s = data.draw(st.sampled_from(self.waiting))
        nt = data.draw(st.one_of(st.none(), st.integers(1, len(s))))
        n = len(s) if nt is None else nt
        rank = self.expected_rank(s)
        av = self.avail()[rank]
        before = self.snap(s)
        can = self.pool.can_allocate(s, nt)
        assert self.snap(s) == before, "R15: can_allocate had a side effect"
        if self.EVENTS:
            assert self.pool.drain_events() == [], "R15: can_allocate emitted events"
        ok = self.pool.allocate(s, nt)
        assert ok == can, "R15"
        if cdiv(n, BS) <= av:
            assert ok, f"R14: {cdiv(n, BS)} blocks needed, {av} available on rank {rank}"
        if not ok:
            assert cdiv(n, BS) > av
            assert self.snap(s) == before, "R14: failed allocate changed something"
            return
        self.waiting.remove(s)
        self.running.append(s)
        assert s.dp_rank == rank, "R13"
        c = s.num_cached_tokens
        assert c % BS == 0
        assert c < len(s), "R8: at least one token left to compute"
        assert s.num_computed_tokens == c
        t = table(s)
        assert len(t) >= cdiv(n, BS)
        if n > c:
            assert len(t) == cdiv(n, BS)
        assert 0 not in t and len(set(t)) == len(t)
        assert s.block_table.dtype == np.int32
        self.check_hit(s)

    @rule(data=st.data())
    @precondition(lambda self: self.running)
    def compute(self, data):
        """The engine runs a (chunked) forward step and advances num_computed_tokens (R17)."""
        s = data.draw(st.sampled_from(self.running))
        cap = min(len(s), len(table(s)) * BS)
        c0 = s.num_computed_tokens
        if c0 >= cap:
            return
        c1 = data.draw(st.integers(c0 + 1, cap))
        self.write_kv(s, c0, c1)
        s.num_computed_tokens = c1
        assert s.num_computed_tokens == c1
        if c0 > 0:
            with pytest.raises(ValueError):
                s.num_computed_tokens = c0 - 1
            assert s.num_computed_tokens == c1

    @rule(data=st.data())
    @precondition(lambda self: self.running)
    def grow(self, data):
        """Chunked prefill: allocate again on a sequence that holds blocks (R14)."""
        s = data.draw(st.sampled_from(self.running))
        n = data.draw(st.integers(1, len(s)))
        before = self.snap(s)
        t0 = table(s)
        need = max(0, cdiv(n, BS) - len(t0))
        av = self.avail()[s.dp_rank]
        can = self.pool.can_allocate(s, n)
        assert self.snap(s) == before
        ok = self.pool.allocate(s, n)
        assert ok == can == (need <= av)
        if ok:
            t1 = table(s)
            assert t1[: len(t0)] == t0
            assert len(t1) == max(len(t0), cdiv(n, BS))
            assert s.num_computed_tokens == before[4]
        else:
            assert self.snap(s) == before

    @rule(data=st.data())
    @precondition(lambda self: any(s.num_computed_tokens == len(s) for s in self.running))
    def decode(self, data):
        s = data.draw(st.sampled_from([s for s in self.running if s.num_computed_tokens == len(s)]))
        s.append_token(data.draw(st.integers(0, 2)))
        la = data.draw(st.sampled_from([0, 0, 0, 1, 3]))
        missing = max(0, cdiv(len(s) + la, BS) - len(table(s)))
        av = self.avail()[s.dp_rank]
        before = self.snap(s)
        can = self.pool.can_append(s, la)
        assert self.snap(s) == before, "R16: can_append had a side effect"
        ok = self.pool.may_append(s, la)
        assert ok == can == (missing <= av), "R16"
        if ok:
            assert len(table(s)) == len(before[2]) + missing
            assert table(s)[: len(before[2])] == before[2]
        else:
            assert self.snap(s) == before

    @rule(data=st.data())
    @precondition(lambda self: self.running)
    def cache(self, data):
        s = data.draw(st.sampled_from(self.running))
        st0 = self.pool.stats()
        self.pool.cache(s)
        st1 = self.pool.stats()
        # cache(seq) publishes held blocks; dedup on publish (R9 revised) also switches each
        # computed duplicate to its cached copy and frees the duplicate: free +1, cached -1.
        switches = self.pool.drain_block_switches()
        assert all(seq_id == s.seq_id and old != new for seq_id, old, new in switches)
        n = len(switches)
        assert st1["num_free_blocks"] == st0["num_free_blocks"] + n, "R9: a switch frees one id"
        # the cached copy a switch takes was cache-only (cached -1) or held by another running
        # sequence (used -1): one of the two per switch
        cached_taken = st0["num_cached_blocks"] - st1["num_cached_blocks"]
        held_shared = st0["num_used_blocks"] - st1["num_used_blocks"]
        assert cached_taken >= 0 and held_shared >= 0 and cached_taken + held_shared == n
        for _, old, new in switches:
            assert new in s.block_ids() and old not in s.block_ids()

    @rule(data=st.data(), finish=st.booleans())
    @precondition(lambda self: self.running)
    def release(self, data, finish):
        s = data.draw(st.sampled_from(self.running))
        rank = s.dp_rank
        toks = list(s.token_ids)
        self.pool.deallocate(s)
        self.running.remove(s)
        assert table(s) == [], "R18"
        assert s.num_cached_tokens == 0 and s.num_computed_tokens == 0
        assert s.dp_rank == rank and list(s.token_ids) == toks
        if not finish:
            self.waiting.append(s)  # preempted: recompute later, sticky rank (R13)

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        for r in self.pool.stats()["ranks"]:
            assert r["num_cached_blocks"] == 0

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def used_blocks_are_the_held_ids(self):
        st = self.pool.stats()
        held: dict[int, set] = {}
        for s in self.running:
            held.setdefault(s.dp_rank, set()).update(table(s))
        for r, rs in enumerate(st["ranks"]):
            assert rs["num_used_blocks"] == len(held.get(r, ())), f"R2 rank {r}"
            assert (
                rs["num_free_blocks"] + rs["num_cached_blocks"] + rs["num_used_blocks"]
                == rs["num_total_blocks"]
            )
        for s in self.waiting:
            assert table(s) == []
        # the count properties read the same counters as stats()'s totals (R2, R20)
        counts = (self.pool.num_free_blocks, self.pool.num_cached_blocks, self.pool.num_used_blocks)
        assert counts == (st["num_free_blocks"], st["num_cached_blocks"], st["num_used_blocks"])

    @invariant()
    def exports_match_reference(self):
        seqs = list(self.running)
        bt = self.pool.block_tables(seqs)
        assert bt.dtype == np.int32
        tables = [table(s) for s in seqs]
        width = max((len(t) for t in tables), default=0)
        assert bt.shape == (len(seqs), width)
        assert bt.tolist() == [t + [0] * (width - len(t)) for t in tables]
        ok = [s for s in seqs if len(table(s)) * BS >= len(s)]
        ref = []
        for s in ok:
            t = table(s)
            ref += [t[p // BS] * BS + p % BS for p in range(s.num_computed_tokens, len(s))]
        sm = self.pool.slot_mapping(ok)
        assert sm.dtype == np.int64
        assert sm.tolist() == ref
        short = [s for s in seqs if len(table(s)) * BS < len(s)]
        if short:
            with pytest.raises(ValueError):
                self.pool.slot_mapping(short)

    @invariant()
    def structure_is_sound(self):
        self.pool.check()

    def teardown(self):
        for s in self.running + self.waiting:
            self.pool.deallocate(s)
        self.pool.reset_prefix_cache()
        self.pool.check()
        for r in self.pool.stats()["ranks"]:
            assert r["num_free_blocks"] == r["num_total_blocks"], "every id free at the end"


class PoolMachineDP2(PoolMachine):
    DP = 2
    NUM_BLOCKS = 9


class PoolMachineSlru(PoolMachine):
    """R11a: the same rules and invariants under segmented LRU (check() verifies the segments
    after every step)."""

    EVICTION = "slru"


class PoolMachineGhostSlru(PoolMachine):
    """R11a: the same under SLRU with ghost admission."""

    EVICTION = "ghost_slru"


TestPoolStateful = PoolMachine.TestCase
TestPoolStatefulDP2 = PoolMachineDP2.TestCase
TestPoolStatefulSlru = PoolMachineSlru.TestCase
TestPoolStatefulGhostSlru = PoolMachineGhostSlru.TestCase


# ---------------------------------------------------------------------------------------------
# R15 on thousands of random states: a fast workload driven by one hypothesis-drawn seed
# ---------------------------------------------------------------------------------------------


@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), dp=st.sampled_from([1, 2]), nb=st.integers(4, 24))
def test_r15_can_allocate_equals_allocate_on_random_states(seed, dp, nb):
    """Every step: a random candidate (new, preempted or running; random num_tokens) is asked
    can_allocate, which must change nothing, then allocate, which must answer the same."""
    import random

    rng = random.Random(seed)
    pool = kvpool.BlockManagerPool(nb, BS, dp_size=dp, enable_events=True)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
    waiting, running = [], []
    for _ in range(80):
        r = rng.random()
        if r < 0.4 or not (waiting or running):
            t = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(0, 8))]
            waiting.append(kvpool.Sequence(t, extra_key=rng.choice([None, b"a"])))
        cands = waiting + running
        s = rng.choice(cands)
        nt = rng.choice([None, rng.randint(1, len(s))])
        pool.drain_events()
        st0, tb0, rank0 = pool.stats(), table(s), s.dp_rank
        can = pool.can_allocate(s, nt)
        assert (pool.stats(), table(s), s.dp_rank) == (st0, tb0, rank0), "R15 side effect"
        assert pool.drain_events() == []
        ok = pool.allocate(s, nt)
        assert ok == can, "R15"
        if ok and s in waiting:
            waiting.remove(s)
            running.append(s)
        pool.drain_events()
        # move the workload on
        if running and rng.random() < 0.5:
            x = rng.choice(running)
            cap = min(len(x), len(table(x)) * BS)
            x.num_computed_tokens = rng.randint(x.num_computed_tokens, cap)
            if x.num_computed_tokens == len(x):
                x.append_token(rng.randrange(3))
                pool.may_append(x)
        if running and rng.random() < 0.3:
            x = running.pop(rng.randrange(len(running)))
            pool.deallocate(x)
            if rng.random() < 0.5:
                waiting.append(x)
        if rng.random() < 0.03:
            pool.reset_prefix_cache()
    pool.check()
