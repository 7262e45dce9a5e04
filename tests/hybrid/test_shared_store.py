"""One block store for a pool's groups (R25, docs/hybrid.md "One block store"): the window group
draws its ids from the full-attention group's free list and publishes by attaching its blocks to
the prefix tree; slid-out window blocks stay cached; eviction ranks what no hit point can use
first. Random workloads with a KV-content shadow of every group (the test plays the worker and
records which prefix's KV each id holds), check() after every step and the questions predicting
the actions (R15, R16); collisions forced with debug_hash_bits (R7)."""

from __future__ import annotations

import random

import kvpool
import pytest

BS = 4


class Worker:
    """The KV each block id of each group holds: the prefix (as a tuple of tokens) whose last
    full block it is, written when the sequence computes that block."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.host: dict[int, tuple[int, ...]] = {}

    def transfers(self, pool) -> None:
        """Runs and confirms the pool's plans: the linear-state copies (R24; their content is
        the concern of tests/hybrid's linear-state shadows) and the host tier's transfers (R26):
        offloads copy device blocks to host blocks, loads copy them back into the
        full-attention group's device blocks."""
        pool.commit_linear_state_plan(pool.take_linear_state_plan())
        if not isinstance(pool, kvpool.HierarchyBlockManagerPool):
            return
        offloads = pool.take_offload_plans()
        for plan in offloads:
            for src, dst in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
                self.host[dst] = self.kv[(0, src)]
        pool.complete_offloads(offloads)
        loads = pool.take_load_plans()
        for plan in loads:
            for src, dst in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
                self.kv[(0, dst)] = self.host[src]
        pool.complete_loads(loads)

    @staticmethod
    def tables(seq: kvpool.Sequence, groups: int) -> list[list[int]]:
        return [seq.group_block_table(g).tolist() for g in range(groups)]

    def compute(self, seq: kvpool.Sequence, upto: int, groups: int) -> None:
        """The forward step computing tokens [num_computed, upto)."""
        start = seq.num_computed_tokens
        tokens = seq.token_ids
        for g, table in enumerate(self.tables(seq, groups)):
            for i in range(start // BS, upto // BS):
                if table[i]:
                    self.kv[(g, table[i])] = tuple(tokens[: (i + 1) * BS])
        seq.num_computed_tokens = upto

    def verify(
        self, seq: kvpool.Sequence, groups: int, window: int | None, upto: int, chunk: int = 0
    ) -> int:
        """Every entry a query at `upto` reads holds this sequence's prefix (a window group's
        from `upto - window + 1`, a chunked group's from its chunk's start); returns how many
        entries were checked."""
        tokens = seq.token_ids
        checked = 0
        for g, table in enumerate(self.tables(seq, groups)):
            if g == 0 or (window is None and not chunk):
                first = 0
            elif chunk:
                first = upto // chunk * chunk // BS
            else:
                first = max(0, upto - window + 1) // BS
            for i in range(first, upto // BS):
                assert table[i], f"group {g} entry {i} released but needed at {upto}"
                got = self.kv.get((g, table[i]))
                assert got == tuple(tokens[: (i + 1) * BS]), (
                    f"group {g} entry {i} (block {table[i]}) holds another prefix's KV (R7)"
                )
                checked += 1
        return checked


def _workload(seed: int, steps: int, **options) -> dict[str, int]:
    rng = random.Random(seed)
    window = options.get("sliding_window")
    attention_chunk = options.get("attention_chunk_size", 0)
    num_blocks = options.pop("num_blocks", 40)
    host = options.pop("host_num_blocks", None)
    if host is None:
        pool = kvpool.BlockManagerPool(num_blocks, BS, **options)
    else:
        pool = kvpool.HierarchyBlockManagerPool(num_blocks, host, BS, **options)
    groups = pool.num_groups
    worker = Worker()
    systems = [[rng.randrange(6) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    history: list[list[int]] = []
    running: list[kvpool.Sequence] = []
    seen = {"hits": 0, "checked": 0, "evictions": 0, "preemptions": 0}

    def fresh() -> kvpool.Sequence:
        if history and rng.random() < 0.4:  # a next turn resends a previous conversation
            base = list(rng.choice(history))
        else:
            base = list(rng.choice(systems))
        return kvpool.Sequence(base + [rng.randrange(6) for _ in range(rng.randrange(1, 9))])

    for _ in range(steps):
        op = rng.random()
        if op < 0.3 or not running:
            seq = fresh()
            chunk = rng.choice([None, len(seq), rng.randrange(1, len(seq) + 1)])
            plan = pool.plan(seq, chunk)
            ok = pool.allocate(seq, chunk, plan=plan if rng.random() < 0.5 else None)
            assert ok == (plan is not None), "R15: the plan answers what allocate does"
            if ok:
                worker.transfers(pool)  # loads run before the step that needs them
                hit = seq.num_cached_tokens
                if hit:
                    seen["hits"] += 1
                    seen["checked"] += worker.verify(seq, groups, window, hit, attention_chunk)
                running.append(seq)
        elif op < 0.75:
            seq = rng.choice(running)
            held = seq.num_blocks * BS
            if seq.num_computed_tokens < len(seq):
                worker.compute(seq, min(len(seq), held), groups)
                pool.cache(seq)
                worker.transfers(pool)
                seen["checked"] += worker.verify(
                    seq, groups, window, seq.num_computed_tokens, attention_chunk
                )
            else:
                seq.append_token(rng.randrange(6))
                lookahead = rng.choice([0, 0, 2])
                can = pool.can_append(seq, lookahead)
                assert pool.may_append(seq, lookahead) == can, "R16: can_append predicts"
                if not can:
                    pool.deallocate(seq)  # a recompute preemption
                    worker.transfers(pool)
                    running.remove(seq)
                    seen["preemptions"] += 1
            if seq in running and seq.num_computed_tokens < len(seq) and rng.random() < 0.5:
                n = min(len(seq), seq.num_computed_tokens + rng.randrange(1, 9))
                if pool.can_allocate(seq, n):
                    assert pool.allocate(seq, n)
        elif op < 0.93:
            seq = rng.choice(running)
            running.remove(seq)
            if seq.num_computed_tokens >= 4:
                history.append(seq.token_ids[: seq.num_computed_tokens])
            if rng.random() < 0.2:
                del seq  # dropped without deallocate: its handles go lock-free (R4)
            else:
                pool.deallocate(seq)
                worker.transfers(pool)
        elif op < 0.95:
            pool.reset_prefix_cache()
        pool.check()
    for seq in running:
        pool.deallocate(seq)
    running.clear()
    worker.transfers(pool)
    pool.reset_prefix_cache()
    pool.check()
    stats = pool.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_cached_blocks"] == 0, "every id came back"
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    seen["evictions"] = stats["num_evictions"]
    return seen


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 8},
        {"sliding_window": 6, "num_blocks": 24},
        {"sliding_window": 8, "debug_hash_bits": 3},
        {"sliding_window": 8, "dedup": False},
        {"sliding_window": 8, "linear_state_slots": 12, "checkpoint_interval": 8},
        {"sliding_window": 8, "retention_tokens": 0, "num_blocks": 28},
        {"sliding_window": 8, "shared_blocks": True, "host_num_blocks": 24, "num_blocks": 30},
        {
            "sliding_window": 8,
            "shared_blocks": True,
            "host_num_blocks": 24,
            "linear_state_slots": 10,
            "checkpoint_interval": 8,
            "debug_hash_bits": 4,
        },
        # linear state in the one store too: a state takes 3 blocks of it
        {
            "sliding_window": 8,
            "linear_state_slots": 12,
            "checkpoint_interval": 8,
            "linear_state_blocks": 3,
        },
        {
            "sliding_window": 8,
            "shared_blocks": True,
            "host_num_blocks": 24,
            "num_blocks": 36,
            "linear_state_slots": 10,
            "checkpoint_interval": 4,
            "linear_state_blocks": 2,
            "linear_state_save": "promote",
        },
        {"sliding_window": 8, "window_groups": 3, "num_blocks": 48},
        {"sliding_window": 8, "window_groups": 2, "dedup": False, "debug_hash_bits": 4},
        {"attention_chunk_size": 8},
        {"attention_chunk_size": 12, "window_groups": 3, "num_blocks": 48, "retention_tokens": 0},
        {"attention_chunk_size": 8, "dedup": False, "debug_hash_bits": 3, "num_blocks": 28},
        {"attention_chunk_size": 8, "shared_blocks": True, "host_num_blocks": 24, "num_blocks": 30},
    ],
    ids=[
        "window",
        "tight",
        "collisions",
        "no-dedup",
        "with-linear",
        "no-retention",
        "host",
        "host-linear-collisions",
        "linear-one-store",
        "host-linear-one-store-promote",
        "window-groups",
        "window-groups-no-dedup-collisions",
        "chunked",
        "chunked-groups-no-retention",
        "chunked-no-dedup-collisions-tight",
        "chunked-host",
    ],
)
def test_shared_store_workload_keeps_every_rule(seed, options):
    seen = _workload(seed, 260, **options)
    assert seen["checked"] > 0


def test_the_workloads_exercise_hits_evictions_and_preemptions():
    totals = {"hits": 0, "evictions": 0, "preemptions": 0}
    for seed in range(8):
        for options in ({"sliding_window": 8}, {"sliding_window": 6, "num_blocks": 24}):
            seen = _workload(seed, 260, **options)
            for key in totals:
                totals[key] += seen[key]
    assert all(v > 0 for v in totals.values()), totals


def test_ids_are_one_space_and_the_window_group_draws_from_it():
    pool = kvpool.BlockManagerPool(9, BS, sliding_window=8)
    seq = kvpool.Sequence(list(range(16)))
    assert pool.allocate(seq)  # 4 full-attention + 4 window blocks: 8 of the 8 ids
    ids = seq.group_block_table(0).tolist() + seq.group_block_table(1).tolist()
    assert sorted(ids) == list(range(1, 9)), "both groups draw from one free list"
    assert not pool.can_allocate(kvpool.Sequence([99]))
    memory = pool.memory()[0]
    assert memory["free_blocks"] == 0
    assert [(g["group"], g["used_blocks"]) for g in memory["shared"]] == [(0, 4), (1, 4)]
    pool.deallocate(seq)
    pool.check()


def test_slid_out_window_blocks_stay_cached_and_serve_a_later_hit():
    """Window retention: blocks that slide out stay cached (evictable), so a prompt that shares
    a prefix ending in the middle of an earlier one's chain hits there (a separate store frees
    them at once, and misses)."""
    shared = kvpool.BlockManagerPool(64, BS, sliding_window=8)
    own = kvpool.BlockManagerPool(64, BS, sliding_window=8, swa_num_blocks=64)
    first = list(range(40))
    second = first[:20] + [77] * 9
    hits = []
    for pool in (shared, own):
        a = kvpool.Sequence(first)
        assert pool.allocate(a)
        a.num_computed_tokens = len(first)
        pool.cache(a)
        pool.deallocate(a)
        plan = pool.plan(kvpool.Sequence(second))
        hits.append((plan.num_cached_tokens, plan.miss_reason))
        pool.check()
    assert hits[0] == (20, "no_shared_prefix"), "hit where the prompts diverge"
    assert hits[1] == (0, "window_blocks_gone"), "the separate store freed the run"


def test_eviction_takes_what_no_hit_point_can_use_first():
    """Under pressure the low-value blocks go first: window blocks off every kept boundary and
    leaves that are no hit point. The end of a released conversation (its hit point for the
    next turn) survives a stream of unrelated prompts that a plain LRU would let evict it."""
    pool = kvpool.BlockManagerPool(60, BS, sliding_window=8, retention_tokens=8)
    turn = list(range(100, 140))
    seq = kvpool.Sequence(turn)
    assert pool.allocate(seq)
    seq.num_computed_tokens = len(turn)
    pool.deallocate(seq)
    for k in range(6):  # unrelated one-off prompts, released after the conversation
        other = kvpool.Sequence([k * 1000 + t for t in range(12)])
        assert pool.allocate(other)
        other.num_computed_tokens = 12
        pool.deallocate(other)
        pool.check()
    plan = pool.plan(kvpool.Sequence(turn + [5, 6, 7]))
    assert plan.num_cached_tokens == len(turn), "the conversation's end is still a hit point"


def test_why_no_hit_per_group_in_plan_and_stats():
    pool = kvpool.BlockManagerPool(30, BS, sliding_window=8)
    short = kvpool.Sequence([1, 2, 3])
    assert pool.plan(short).miss_reason == "shorter_than_block"
    assert pool.plan(short).miss_group == 0
    a = kvpool.Sequence(list(range(24)))
    assert pool.plan(a).miss_reason == "no_shared_prefix"
    assert pool.allocate(a)
    a.num_computed_tokens = 24
    pool.deallocate(a)
    full = kvpool.Sequence(list(range(24)) + [1])
    assert pool.plan(full).miss_reason is None and pool.plan(full).num_cached_tokens == 24
    # flood the store: the chain is evicted
    for k in range(4):
        b = kvpool.Sequence([500 + 50 * k + t for t in range(24)])
        assert pool.allocate(b)
        b.num_computed_tokens = 24
        pool.deallocate(b)
    plan = pool.plan(kvpool.Sequence(list(range(24)) + [1]))
    assert (plan.miss_group, plan.miss_reason) == (0, "evicted")
    misses = pool.stats()["misses"]
    assert misses["no_shared_prefix"] >= 1 and set(misses) == {
        "shorter_than_block",
        "no_shared_prefix",
        "evicted",
        "window_blocks_gone",
        "no_checkpoint",
    }


@pytest.mark.parametrize("bad", [True, 1.5, "2", -1])
def test_bad_shared_options_are_rejected(bad):
    with pytest.raises((TypeError, ValueError, OverflowError), match="retention_tokens"):
        kvpool.BlockManagerPool(16, BS, sliding_window=8, retention_tokens=bad)


def test_shared_blocks_conflicts_are_named():
    with pytest.raises(ValueError, match="swa_num_blocks"):
        kvpool.BlockManagerPool(16, BS, sliding_window=8, swa_num_blocks=16, shared_blocks=True)
    with pytest.raises(ValueError, match="shared_blocks"):
        kvpool.BlockManagerPool(16, BS, shared_blocks=True)
    with pytest.raises(TypeError, match="shared_blocks"):
        kvpool.BlockManagerPool(16, BS, sliding_window=8, shared_blocks=1)


@pytest.mark.parametrize("computed", range(9, 21))
@pytest.mark.parametrize("store", ["shared", "own"])
def test_r25_the_next_turn_hits_where_full_attention_does(computed, store):
    """The kept window tail is never one block short (../shared/hybrid/repro_window_tail_short.py):
    a turn that computed C tokens (its last sampled token has no KV yet) is deallocated; the next
    turn resends it plus new tokens and hits as much as full attention alone, for every
    C % block_size (window 8, block size 4), in one store and in a window store of its own."""
    turn1 = list(range(1, computed + 2))
    turn2 = turn1 + [900 + i for i in range(6)]
    hits = []
    for window in (8, None):
        own = {"swa_num_blocks": 64} if store == "own" and window else {}
        pool = kvpool.BlockManagerPool(64, 4, sliding_window=window, **own)
        first = kvpool.Sequence(turn1[:computed])
        assert pool.allocate(first)
        first.num_computed_tokens = computed
        pool.cache(first)
        first.append_token(turn1[computed])
        pool.deallocate(first)
        hits.append(pool.plan(kvpool.Sequence(turn2)).num_cached_tokens)
        pool.check()
    assert hits[0] == hits[1] > 0


def test_a_shared_prefix_run_outlives_a_running_sequences_own():
    """Retention under pressure (docs/contract.md, R10 with one store): two conversations
    branched after a system prompt S (a junction), a third runs on S and grows until only
    protected window blocks are left to evict. Its own slid-out blocks, which only the head rule
    protects, go before S's run, even after the branches that made S a junction were evicted:
    the next request on S still hits at S's boundary. (Before this rule the oldest went first,
    S's run, and the next request on S hit nothing.)"""
    window, prompt = 8, list(range(100, 116))  # S: 4 blocks
    pool = kvpool.BlockManagerPool(20, BS, sliding_window=window)

    def serve(tokens: list[int]) -> None:
        seq = kvpool.Sequence(tokens)
        assert pool.allocate(seq)
        seq.num_computed_tokens = len(tokens)
        pool.cache(seq)
        pool.deallocate(seq)

    serve(prompt + list(range(200, 208)))
    serve(prompt + list(range(300, 308)))
    running = kvpool.Sequence(prompt + list(range(400, 416)))
    assert pool.allocate(running) and running.num_cached_tokens == 16
    running.num_computed_tokens = len(running)
    pool.cache(running)
    evicted = pool.stats()["num_evictions"]
    for i in range(24):
        running.append_token(1000 + i)
        assert pool.may_append(running)
        running.num_computed_tokens = len(running)
        pool.cache(running)
        pool.check()
    assert pool.stats()["num_evictions"] > evicted + 4, "the branches and window blocks went"
    pool.deallocate(running)
    probe = pool.plan(kvpool.Sequence(prompt + [7] * 5))
    assert probe is not None and probe.kv_hit_tokens == 16
    assert probe.num_cached_tokens == 16, "S's run was kept"
    pool.check()


@pytest.mark.parametrize("window_groups", [1, 3])
def test_a_duplicates_window_runs_are_attached_to_the_cached_originals(window_groups):
    """First writer wins (R9, dedup off, as under vLLM): B computed P again beside A, so B's
    full-attention publication stops at P while it runs and publishes the rest at its release.
    B's window blocks after P are attached when their nodes are cached (at the release, not
    skipped for good while B runs), so the next turn hits all of B's prompt in every group."""
    pool = kvpool.BlockManagerPool(
        96, BS, sliding_window=8, window_groups=window_groups, dedup=False
    )
    assert pool.num_groups == 1 + window_groups
    p, q = list(range(1, 17)), list(range(100, 132))  # 4 and 8 blocks
    a, b = kvpool.Sequence(p + [999]), kvpool.Sequence(p + q + [998])
    assert pool.allocate(a) and pool.allocate(b)  # both from scratch: nothing is cached yet
    for seq in (a, b):
        seq.num_computed_tokens = len(seq)
        pool.cache(seq)  # a publishes P; b's P is a duplicate: its publication stops there
    assert pool.plan(kvpool.Sequence(p + q + [5])).kv_hit_tokens == len(p)
    pool.deallocate(a)
    pool.deallocate(b)  # publishes the rest of b's chain, and its window run at the end of Q
    pool.check()
    plan = pool.plan(kvpool.Sequence(p + q + [5, 6, 7]))
    assert (plan.num_cached_tokens, plan.kv_hit_tokens) == (len(p + q), len(p + q))
