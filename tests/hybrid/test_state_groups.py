"""State groups (``state_groups``, vLLM's Mamba "align" mode; docs/hybrid.md "State groups"):
a recurrent state per block of the one store. The test plays vLLM's worker
(``vllm/v1/worker/mamba_utils.py::preprocess_mamba``): before each step it copies the state
from the block of the previous step's last token (a new sequence: of its hit's last token) to
the block of this step's last token, then writes the state after the step there. Every state
it reads must be the state of exactly its sequence's prefix at that position (a hit's too),
and nothing is lost: check() after every step, the plan (R15) and ``can_append`` (R16)
predict their actions, every id comes back."""

from __future__ import annotations

import random

import kvpool
import pytest

BS = 4


class StateWorker:
    """The state each block id of each state group holds: the prefix (tokens) it is the state
    after; and each running sequence's block of its last step (vLLM's ``mamba_state_idx``)."""

    def __init__(self, groups: int) -> None:
        self.groups = groups  # state groups: 1..groups
        self.state: dict[tuple[int, int], tuple[int, ...]] = {}
        self.last: dict[int, int] = {}

    def step(self, seq: kvpool.Sequence, upto: int) -> int:
        """Runs the step computing tokens [num_computed, upto): the copy, then the new state.
        Returns how many states it read and checked."""
        c, tokens = seq.num_computed_tokens, seq.token_ids
        prev = self.last.get(seq.seq_id, (c - 1) // BS)  # a new sequence: its hit's last block
        curr = -(-upto // BS) - 1
        checked = 0
        for g in range(1, self.groups + 1):
            table = seq.group_block_table(g).tolist()
            assert table[curr], f"group {g}: no block for the step's state at entry {curr}"
            if prev >= 0:
                assert table[prev], f"group {g}: the state to copy (entry {prev}) was released"
                got = self.state.get((g, table[prev]))
                assert got == tuple(tokens[:c]), (
                    f"group {g}: entry {prev} (block {table[prev]}) holds another state"
                )
                checked += 1
                self.state[(g, table[curr])] = got  # the copy (a no-op when prev == curr)
            self.state[(g, table[curr])] = tuple(tokens[:upto])
        self.last[seq.seq_id] = curr
        seq.num_computed_tokens = upto
        return checked

    def forget(self, seq: kvpool.Sequence) -> None:
        self.last.pop(seq.seq_id, None)


def _aligned_end(seq: kvpool.Sequence, budget: int, start: int | None = None) -> int:
    """vLLM's ``_mamba_block_aligned_split``: a prefill chunk ends on a block boundary, or at
    the prompt's end."""
    c = seq.num_computed_tokens if start is None else start
    n = len(seq)
    end = min(n, c + budget)
    if end < n:
        end = max(end // BS * BS, min(n, (c // BS + 1) * BS))
    return end


def _workload(seed: int, steps: int, groups: int = 1, **options) -> dict[str, int]:
    rng = random.Random(seed)
    num_blocks = options.pop("num_blocks", 48)
    pool = kvpool.BlockManagerPool(num_blocks, BS, state_groups=groups, **options)
    worker = StateWorker(groups)
    systems = [[rng.randrange(5) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    history: list[list[int]] = []
    running: list[kvpool.Sequence] = []
    seen = {"hits": 0, "checked": 0, "preemptions": 0}

    def fresh() -> kvpool.Sequence:
        base = list(rng.choice(history if history and rng.random() < 0.5 else systems))
        return kvpool.Sequence(base + [rng.randrange(5) for _ in range(rng.randrange(1, 9))])

    def release(seq: kvpool.Sequence) -> None:
        running.remove(seq)
        worker.forget(seq)
        if seq.num_computed_tokens >= BS:
            history.append(seq.token_ids[: seq.num_computed_tokens])
        pool.deallocate(seq)

    for _ in range(steps):
        op = rng.random()
        if op < 0.3 or not running:
            # as vLLM's Scheduler: the table holds the first step's tokens (the state's block
            # is the table's last entry), the hit first
            seq = fresh()
            probe = pool.plan(seq, 1)
            hit = probe.num_cached_tokens if probe is not None else 0
            upto = _aligned_end(seq, rng.choice([1, 3, 8, 64]), start=hit)
            plan = pool.plan(seq, upto)
            ok = pool.allocate(seq, upto)
            assert ok == (plan is not None), "R15: the plan answers what allocate does"
            if ok:
                assert seq.num_cached_tokens == hit, "the hit does not depend on the chunk"
                if seq.num_cached_tokens:
                    seen["hits"] += 1
                running.append(seq)
                seen["checked"] += worker.step(seq, upto)  # the step it was admitted for
                pool.cache(seq)
        elif op < 0.85:
            seq = rng.choice(running)
            if seq.num_computed_tokens < len(seq):
                upto = _aligned_end(seq, rng.choice([1, 3, 8, 64]))
                if -(-upto // BS) > seq.num_blocks:  # the step's state block is a new entry
                    can = pool.can_allocate(seq, upto)
                    assert pool.allocate(seq, upto) == can, "R15: can_allocate predicts"
                    if not can:
                        release(seq)
                        seen["preemptions"] += 1
                        pool.check()
                        continue
                seen["checked"] += worker.step(seq, upto)
                pool.cache(seq)
            else:
                seq.append_token(rng.randrange(5))
                can = pool.can_append(seq)
                assert pool.may_append(seq) == can, "R16: can_append predicts"
                if can:
                    seen["checked"] += worker.step(seq, len(seq))
                    pool.cache(seq)
                else:
                    release(seq)  # a recompute preemption
                    seen["preemptions"] += 1
        elif op < 0.97:
            release(rng.choice(running))
        else:
            pool.reset_prefix_cache()
        pool.check()
    for seq in list(running):
        release(seq)
    pool.reset_prefix_cache()
    pool.check()
    stats = pool.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_cached_blocks"] == 0, "every id came back"
    return seen


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize(
    ("groups", "options"),
    [
        (1, {}),
        (3, {"num_blocks": 64}),
        (1, {"num_blocks": 20}),
        (2, {"debug_hash_bits": 3, "dedup": False}),
        (1, {"retention_tokens": 0, "eviction": "slru"}),
    ],
    ids=["one", "three", "tight", "collisions-no-dedup", "no-retention-slru"],
)
def test_state_workload_reads_only_its_own_states(seed, groups, options):
    seen = _workload(seed, 300, groups, **dict(options))
    assert seen["checked"] > 0


def test_the_workloads_hit_and_preempt():
    totals = {"hits": 0, "checked": 0, "preemptions": 0}
    for seed in range(10):
        for options in ({}, {"num_blocks": 20}):
            for key, value in _workload(seed, 300, 1, **options).items():
                totals[key] += value
    assert all(totals.values()), totals


def test_a_step_moves_the_state_and_a_boundary_state_is_cached():
    pool = kvpool.BlockManagerPool(64, BS, state_groups=1)
    worker = StateWorker(1)
    prompt = list(range(100, 111))  # 11 tokens: blocks 0-1 full, 2 partial
    seq = kvpool.Sequence(prompt)
    assert pool.allocate(seq, 8)
    assert seq.group_block_table(1).tolist() == [0, seq.group_block_table(1).tolist()[1]]
    worker.step(seq, 8)
    pool.cache(seq)  # the step ended on boundary 8: block 1 holds that state, and is cached
    assert pool.allocate(seq, 11)
    table = seq.group_block_table(1).tolist()
    assert table[0] == 0 and table[1] and table[2], "the carried source and the new block"
    worker.step(seq, 11)
    pool.cache(seq)
    table = seq.group_block_table(1).tolist()
    assert table[:2] == [0, 0] and table[2], "the step is done: the carry went"
    assert pool.stats()["num_cached_blocks"] >= 1
    pool.deallocate(seq)
    pool.check()
    # a new prompt sharing 9 tokens hits at 8, where the state was cached
    twin = kvpool.Sequence(prompt[:9] + [7, 7, 7])
    assert pool.allocate(twin)
    assert twin.num_cached_tokens == 8
    assert worker.step(twin, len(twin)) == 1  # read the cached state at 8
    pool.cache(twin)
    pool.deallocate(twin)
    pool.check()


def test_a_boundary_a_step_ran_through_is_never_cached():
    """A block whose end boundary fell inside a step holds no state of that boundary: no hit
    there (vLLM #43090's wrong outputs), while full attention has the KV."""
    pool = kvpool.BlockManagerPool(64, BS, state_groups=1)
    worker = StateWorker(1)
    prompt = list(range(200, 213))
    seq = kvpool.Sequence(prompt)
    assert pool.allocate(seq)
    worker.step(seq, 13)  # one step through boundaries 4, 8 and 12
    pool.cache(seq)
    pool.deallocate(seq)
    plan = pool.plan(kvpool.Sequence(prompt[:12] + [1, 2]))
    assert plan.kv_hit_tokens == 12 and plan.num_cached_tokens == 0
    assert plan.miss_group == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"state_groups": 9}, "state_groups: must be at most 8"),
        ({"state_groups": 1, "sliding_window": 8}, "state_groups: is not with"),
        ({"state_groups": 1, "attention_chunk_size": 8}, "state_groups: is not with"),
        ({"state_groups": 1, "window_groups": 2}, "state_groups: is not with"),
        ({"state_groups": 1, "shared_blocks": False}, "state_groups: needs the shared store"),
    ],
)
def test_bad_state_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        kvpool.BlockManagerPool(16, BS, **options)
