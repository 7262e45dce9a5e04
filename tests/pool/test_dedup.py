"""Dedup on publish (R9 revised): a computed duplicate of a cached block switches the
sequence's table entry to the cached copy, frees the duplicate and keeps publishing the chain.

The random workloads keep a shadow of the KV content: a fake worker writes, for every computed
position, a fingerprint of the sequence's own prefix into the block its table names; every hit
and every switched entry must read back the sequence's own prefix.
"""

from __future__ import annotations

import random

import kvpool
import pytest

SYSTEM = list(range(100, 108))  # two blocks of 4


def computed(*seqs) -> None:
    for s in seqs:
        s.num_computed_tokens = len(s)


def fan_out(**options):
    pool = kvpool.BlockManagerPool(64, 4, **options)
    a = kvpool.Sequence(SYSTEM + [1, 2, 3, 4, 9])
    b = kvpool.Sequence(SYSTEM + [5, 6, 7, 8, 9])
    for s in (a, b):
        assert pool.allocate(s)
    computed(a, b)
    for s in (a, b):
        pool.cache(s)
    return pool, a, b


def test_r9_fan_out_example_hits_12_tokens_and_holds_6_blocks():
    pool, a, b = fan_out()
    assert pool.dedup
    assert pool.stats()["num_used_blocks"] == 6, "6 distinct blocks of KV, 6 blocks held"
    assert a.block_ids()[:2] == b.block_ids()[:2]
    switches = pool.drain_block_switches()
    assert [(sid, new) for sid, _, new in switches] == [(b.seq_id, i) for i in a.block_ids()[:2]]
    assert pool.drain_block_switches() == [], "drained"
    c = kvpool.Sequence(SYSTEM + [5, 6, 7, 8, 10, 11])
    assert pool.allocate(c)
    assert c.num_cached_tokens == 12, "B's third block was published past its duplicates"
    assert c.block_ids()[:3] == b.block_ids()[:3]
    pool.check()


def test_r9_dedup_false_keeps_first_writer_wins():
    pool, a, b = fan_out(dedup=False)
    assert not pool.dedup
    assert pool.stats()["num_used_blocks"] == 8
    assert pool.drain_block_switches() == []
    c = kvpool.Sequence(SYSTEM + [5, 6, 7, 8, 10, 11])
    assert pool.allocate(c)
    assert c.num_cached_tokens == 8, "B's chain stops at its first duplicate"
    pool.check()


def test_r9_switched_duplicates_go_back_to_the_free_list():
    pool = kvpool.BlockManagerPool(32, 4)
    a = kvpool.Sequence(SYSTEM + [1])
    b = kvpool.Sequence(SYSTEM + [2])
    pool.allocate(a)
    pool.allocate(b)
    old = b.block_ids()
    free = pool.stats()["num_free_blocks"]
    computed(a, b)
    pool.cache(a)
    pool.cache(b)
    switched = [(old_id, new_id) for _, old_id, new_id in pool.drain_block_switches()]
    assert switched == list(zip(old[:2], a.block_ids()[:2], strict=True))
    assert pool.stats()["num_free_blocks"] == free + 2
    assert b.block_table.tolist() == a.block_ids()[:2] + [old[2]], "the table re-read changed"
    pool.deallocate(b)
    pool.deallocate(a)
    pool.check()


@pytest.mark.parametrize("n", [2, 5])
def test_r9_n_sequences_sharing_a_prompt(n):
    bs, prompt_blocks = 4, 10
    prompt = list(range(1000, 1000 + bs * prompt_blocks))
    pool = kvpool.BlockManagerPool(128, bs)
    seqs = [kvpool.Sequence(prompt + [i]) for i in range(n)]  # parallel sampling: one tail each
    for s in seqs:
        assert pool.allocate(s)
    assert pool.stats()["num_used_blocks"] == n * (prompt_blocks + 1)
    computed(*seqs)
    for s in seqs:
        pool.cache(s)
        pool.check()
    assert pool.stats()["num_used_blocks"] == prompt_blocks + n
    first = seqs[0].block_ids()[:prompt_blocks]
    assert all(s.block_ids()[:prompt_blocks] == first for s in seqs)
    switches = pool.drain_block_switches()
    assert len(switches) == (n - 1) * prompt_blocks
    assert {sid for sid, _, _ in switches} == {s.seq_id for s in seqs[1:]}
    for s in seqs:
        pool.deallocate(s)
    pool.check()


def test_r9_the_batch_step_call_dedups_too():
    pool = kvpool.BlockManagerPool(64, 4)
    a = kvpool.Sequence(SYSTEM + [1])
    b = kvpool.Sequence(SYSTEM + [2])
    batch = kvpool.SequenceBatch([a, b])
    pool.allocate(a)
    pool.allocate(b)
    pool.advance(batch, [7, 8], lookahead=0)  # computed = len, publish, append (R17)
    assert a.block_ids()[:2] == b.block_ids()[:2]
    assert len(pool.drain_block_switches()) == 2
    pool.check()


@pytest.mark.parametrize("options", [{"sliding_window": 8}, {"dp_size": 2}])
def test_r9_dedup_composes_with_other_groups_and_ranks(options):
    pool = kvpool.BlockManagerPool(64, 4, **options)
    seqs = [kvpool.Sequence(SYSTEM + [i, i + 1, i + 2, i + 3, 9]) for i in range(3)]
    for s in seqs:
        assert pool.allocate(s)
    computed(*seqs)
    for s in seqs:
        pool.cache(s)
        pool.check()
    by_rank = {}
    for s in seqs:
        by_rank.setdefault(s.dp_rank, []).append(s)
    for group in by_rank.values():
        assert all(s.block_ids()[:2] == group[0].block_ids()[:2] for s in group)
    for s in seqs:
        pool.deallocate(s)
    pool.check()


def test_r9_no_stored_event_for_a_duplicate():
    pool, a, b = fan_out(enable_events=True)
    stored = [e for e in pool.drain_events() if e.kind == "stored"]
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == len(set(hashes)) == 4, "A's 3 full blocks, then B's third only"
    last = stored[-1]
    assert last.token_ids == [5, 6, 7, 8]
    assert last.parent_hash == stored[0].block_hashes[1], "chained to the shared block"


def test_r9_a_pending_linear_state_plan_defers_the_switch():
    pool = kvpool.BlockManagerPool(64, 4, linear_state_slots=8, checkpoint_interval=4)
    prompt = list(range(200, 216))  # 4 blocks
    a = kvpool.Sequence(prompt + [1])
    b = kvpool.Sequence(prompt + [2])
    pool.allocate(a)
    pool.allocate(b)
    b.num_computed_tokens = 4
    pool.cache(b)  # publishes block 0 and plans a save at boundary 4 (R24)
    computed(a)
    pool.cache(a)  # A holds no plan yet: its block 0 switches to B's
    assert [(sid, new) for sid, _, new in pool.drain_block_switches()] == [
        (a.seq_id, b.block_ids()[0])
    ]
    plan = pool.take_linear_state_plan()
    computed(b)
    pool.cache(b)  # B's save is not confirmed: its duplicates stay private (first writer wins)
    assert pool.drain_block_switches() == []
    assert b.block_ids()[1:4] != a.block_ids()[1:4]
    pool.check()
    pool.commit_linear_state_plan(plan)
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    pool.cache(b)  # nothing pending any more: the switch happens at the next publish
    assert [new for _, _, new in pool.drain_block_switches()] == a.block_ids()[1:4]
    assert b.block_ids()[:4] == a.block_ids()[:4]
    pool.check()


def test_r9_host_tier_composes():
    pool = kvpool.HierarchyBlockManagerPool(32, 64, 4)
    assert pool.dedup
    a = kvpool.Sequence(SYSTEM + [1, 2, 3, 4, 9])
    b = kvpool.Sequence(SYSTEM + [5, 6, 7, 8, 9])
    for s in (a, b):
        pool.allocate(s)
    computed(a, b)
    for s in (a, b):
        pool.cache(s)
    assert pool.stats()["num_used_blocks"] == 6
    assert len(pool.drain_block_switches()) == 2
    pool.deallocate(a)  # offloads A's blocks (pending transfer holds them)
    pool.deallocate(b)
    pool.check()
    c = kvpool.Sequence(SYSTEM + [5, 6, 7, 8, 10, 11])
    assert pool.allocate(c)
    assert c.num_cached_tokens == 12
    pool.check()


# ---------------------------------------------------------------------------------------------
# random workloads with a shadow of KV content
# ---------------------------------------------------------------------------------------------


def fingerprints(tokens: list[int]) -> list[int]:
    """fp[p] identifies the prefix tokens[: p + 1] (a rolling hash)."""
    out, h = [], 7
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
        out.append(h)
    return out


class Shadow:
    """The KV tensors: (dp rank, block id) -> per-slot fingerprint, written as a worker would."""

    def __init__(self, bs: int):
        self.bs = bs
        self.kv: dict[tuple[int, int], list[int | None]] = {}

    def write(self, seq, start: int, end: int) -> None:
        fp = fingerprints(seq.token_ids)
        for p in range(start, end):
            key = (seq.dp_rank, seq.block_id(p // self.bs))
            row = self.kv.setdefault(key, [None] * self.bs)
            row[p % self.bs] = fp[p]

    def verify(self, seq, end: int, what: str) -> None:
        fp = fingerprints(seq.token_ids)
        for p in range(end):
            row = self.kv.get((seq.dp_rank, seq.block_id(p // self.bs)), [None] * self.bs)
            got = row[p % self.bs]
            assert got == fp[p], f"{what}: seq {seq.seq_id} position {p} reads another prefix"


@pytest.mark.parametrize("seed", range(12))
def test_r9_random_workload_every_hit_and_switch_holds_own_prefix(seed):
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    pool = kvpool.BlockManagerPool(rng.randint(12, 40), bs, dp_size=rng.choice([1, 2]))
    shadow = Shadow(bs)
    prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    running: list[kvpool.Sequence] = []
    waiting: list[kvpool.Sequence] = []
    num_switches = 0
    for _ in range(150):
        op = rng.random()
        if op < 0.3 or not running:
            if waiting and rng.random() < 0.5:
                seq = waiting.pop(rng.randrange(len(waiting)))
            else:
                base = rng.choice(prompts)
                seq = kvpool.Sequence(base + [rng.randrange(50) for _ in range(rng.randint(0, 6))])
            n = rng.randint(1, len(seq)) if rng.random() < 0.3 else None
            if pool.allocate(seq, n):
                shadow.verify(seq, seq.num_cached_tokens, "hit")
                running.append(seq)
            else:
                waiting.append(seq)
        elif op < 0.75:  # a step: the worker computes some tokens of a few sequences
            batch = rng.sample(running, rng.randint(1, len(running)))
            for seq in batch:
                start = seq.num_computed_tokens
                end = min(len(seq), seq.num_blocks * bs, start + rng.randint(1, 2 * bs))
                shadow.write(seq, start, end)
                seq.num_computed_tokens = end
            for seq in batch:
                pool.cache(seq)
            for sid, old, new in (switches := pool.drain_block_switches()):
                owner = next(s for s in running if s.seq_id == sid)
                assert new in owner.block_ids() and old not in owner.block_ids()
            num_switches += len(switches)
            for seq in running:
                shadow.verify(seq, seq.num_computed_tokens, "after publish")
        elif op < 0.9:  # decode: append a token to a fully computed sequence, take its slot
            seq = rng.choice(running)
            if seq.num_computed_tokens == len(seq):
                seq.append_token(rng.randrange(50))
            if not pool.may_append(seq):
                pool.deallocate(seq)  # preempt by recompute
                running.remove(seq)
                waiting.append(seq)
        else:
            seq = running.pop(rng.randrange(len(running)))
            pool.deallocate(seq)
            waiting.append(seq)
        pool.check()
    for seq in running:
        pool.deallocate(seq)
    pool.check()
    assert num_switches > 0, "the workload exercises dedup"
