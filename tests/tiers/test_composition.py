"""One pool: the host tier composes with every feature (R13-R26).

Random workloads with ``check()`` after every step and every id back at the end: host tier x dp
ranks x the batch API (``SequenceBatch``, ``advance``, ``may_append_all``), with linear state
and a sliding window; the host tier with ``concurrent=True`` under eight threads. Plus the
subclass relation: a ``HierarchyBlockManagerPool`` is a ``BlockManagerPool``.
"""

from __future__ import annotations

import random
import threading
import time

import kvpool
import pytest

BS = 4


def test_a_hierarchy_pool_is_a_block_manager_pool():
    pool = kvpool.HierarchyBlockManagerPool(
        32, 16, BS, dp_size=2, linear_state_slots=8, sliding_window=8
    )
    assert isinstance(pool, kvpool.BlockManagerPool)
    for name in (
        "advance",
        "may_append_all",
        "plan",
        "allocate_shared",
        "linear_state_cache",
        "take_linear_state_plan",
        "drain_events",
        "num_groups",
    ):
        assert hasattr(pool, name), name
    assert pool.num_groups == 2 and pool.dp_size == 2 and pool.host_num_blocks == 16
    assert pool.linear_state_cache(1).num_slots == 8
    stats = pool.stats()
    assert stats["host"]["num_total_blocks"] == 30
    # with a host tier the window group keeps a store of its own by default
    assert stats["window"]["num_total_blocks"] == 62
    shared = kvpool.HierarchyBlockManagerPool(32, 16, BS, sliding_window=8, shared_blocks=True)
    assert shared.stats()["window"] is None
    assert [[g["group"] for g in r["shared"]] for r in shared.memory()] == [[0, 1]]
    assert [r["host"]["num_total_blocks"] for r in stats["ranks"]] == [15, 15]
    plain = kvpool.BlockManagerPool(32, BS)
    assert plain.stats()["host"] is None, "R20: host only with a host tier"


def _all_back(pool, options):
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    pool.complete_loads(pool.take_load_plans())
    pool.complete_offloads(pool.take_offload_plans())
    pool.reset_prefix_cache()
    pool.check()
    stats = pool.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "every device id back"
    assert stats["host"]["num_free_blocks"] == stats["host"]["num_total_blocks"], (
        "every host id back"
    )
    assert stats["num_live_slots"] == 0 and stats["num_pending_checkpoints"] == 0
    if stats["window"] is not None:
        assert stats["window"]["num_free_blocks"] == stats["window"]["num_total_blocks"]
    if options.get("linear_state_slots"):
        free = (options["linear_state_slots"] - 1) * options.get("dp_size", 1)
        assert stats["num_free_linear_state_slots"] == free, "every slot back"
    assert stats["num_free_single_blocks"] == stats["num_total_blocks"], "every single block back"


def _engine_loop(pool, rng, steps, options, prefixes):
    """A small engine: admit with plan(), prefill chunks, decode the batch with advance(), run
    every transfer and linear-state plan, release; check() after every step."""
    batch = kvpool.SequenceBatch()
    prefilling: list[kvpool.Sequence] = []
    finished: list[list[int]] = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.3:
            if finished and rng.random() < 0.5:
                tokens = rng.choice(finished) + [
                    rng.randrange(9000) for _ in range(rng.randrange(1, 6))
                ]
            else:
                tokens = rng.choice(prefixes) + [
                    rng.randrange(9000) for _ in range(rng.randrange(1, 12))
                ]
            seq = kvpool.Sequence(tokens)
            plan = pool.plan(seq)
            assert pool.can_allocate(seq) == (plan is not None), "R15"
            if plan is not None:
                assert pool.allocate(seq, plan=plan), "R15: the plan's answer"
                prefilling.append(seq)
        elif r < 0.55 and prefilling:
            seq = rng.choice(prefilling)
            loads = pool.take_load_plans()
            pool.complete_loads(loads)  # the engine loads before the step that needs them
            n = min(len(seq), seq.num_computed_tokens + rng.choice([4, 8, 13]))
            seq.num_computed_tokens = n
            pool.cache(seq)
            if n == len(seq):
                seq.append_token(rng.randrange(9000))
                prefilling.remove(seq)
                if pool.may_append(seq):
                    batch.add(seq)
                else:
                    pool.deallocate(seq)
        elif r < 0.8 and len(batch):
            # One decode step of the whole batch, then room for the next token.
            failed = pool.advance(
                batch, [rng.randrange(9000) for _ in range(len(batch))], lookahead=0
            )
            for seq in [batch[i] for i in failed]:
                batch.remove(seq)
                pool.deallocate(seq)
            assert pool.may_append_all(batch) == []
        elif r < 0.9:
            done = list(batch) if rng.random() < 0.3 else [s for s in batch if rng.random() < 0.3]
            batch.remove_all(done)
            for seq in done:
                finished.append(seq.token_ids)
                pool.deallocate(seq)
            pool.complete_offloads(pool.take_offload_plans())
        else:
            pool.commit_linear_state_plan(pool.take_linear_state_plan())
        pool.check()
        batch.check()
    for seq in list(batch) + prefilling:
        pool.deallocate(seq)
    batch.clear()


@pytest.mark.parametrize(
    "options",
    [
        {"dp_size": 2},
        {"dp_size": 3, "linear_state_slots": 12, "checkpoint_interval": 8},
        {"dp_size": 2, "sliding_window": 8, "swa_num_blocks": 64},
        {
            "dp_size": 2,
            "sliding_window": 8,
            "swa_num_blocks": 64,
            "linear_state_slots": 12,
            "checkpoint_interval": 8,
            "enable_events": True,
        },
    ],
    ids=["dp", "dp+linear", "dp+window", "dp+window+linear+events"],
)
@pytest.mark.parametrize("seed", range(4))
def test_random_host_tier_dp_ranks_and_the_batch_api(options, seed):
    rng = random.Random(seed)
    pool = kvpool.HierarchyBlockManagerPool(40, 48, BS, **options)
    prefixes = [[rng.randrange(9000) for _ in range(rng.randrange(8, 24))] for _ in range(3)]
    _engine_loop(pool, rng, 400, options, prefixes)
    stats = pool.stats()
    assert stats["host"]["num_offloaded_blocks"] > 0
    _all_back(pool, options)


def _worker(pool, seed, prefixes, deadline, errors, counts):
    rng = random.Random(seed)
    mine: list[kvpool.Sequence] = []
    ops = 0
    try:
        while time.monotonic() < deadline:
            ops += 1
            r = rng.random()
            if r < 0.3 or not mine:
                seq = kvpool.Sequence(
                    rng.choice(prefixes)
                    + [rng.randrange(5000) for _ in range(rng.randrange(1, 12))]
                )
                plan = pool.plan(seq)
                if plan is not None and pool.allocate(seq, plan=plan):
                    mine.append(seq)
            elif r < 0.65:
                seq = rng.choice(mine)
                pool.complete_loads(pool.take_load_plans())
                held = len(seq.block_table) * BS
                seq.num_computed_tokens = max(seq.num_computed_tokens, min(len(seq), held))
                pool.cache(seq)
                if seq.num_computed_tokens == len(seq):
                    seq.append_token(rng.randrange(5000))
                if not pool.may_append(seq):
                    mine.remove(seq)
                    pool.deallocate(seq)
            elif r < 0.85:
                pool.deallocate(mine.pop(rng.randrange(len(mine))))
                pool.complete_offloads(pool.take_offload_plans())
            else:
                pool.commit_linear_state_plan(pool.take_linear_state_plan())
            pool.check()  # exact at any moment: every change holds the pool's lock
        for seq in mine:
            pool.deallocate(seq)
    except Exception as e:  # noqa: BLE001 - reported by the main thread
        errors.append(e)
    counts.append(ops)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"dp_size": 2, "linear_state_slots": 24, "checkpoint_interval": 8},
        {"sliding_window": 8, "swa_num_blocks": 96},
    ],
    ids=["plain", "dp+linear", "window"],
)
def test_r27_r28_a_concurrent_hierarchy_pool_under_eight_threads(options):
    pool = kvpool.HierarchyBlockManagerPool(96, 64, BS, concurrent=True, **options)
    assert pool.concurrent
    rng = random.Random(3)
    prefixes = [[rng.randrange(5000) for _ in range(rng.randrange(8, 24))] for _ in range(4)]
    errors: list[BaseException] = []
    counts: list[int] = []
    deadline = time.monotonic() + 1.5
    threads = [
        threading.Thread(target=_worker, args=(pool, s, prefixes, deadline, errors, counts))
        for s in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:3]
    assert len(counts) == 8 and sum(counts) > 8 * 20
    _all_back(pool, options)
