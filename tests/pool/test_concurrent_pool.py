"""BlockManagerPool(concurrent=True) shared by many Python threads (R27, R28).

Eight threads hammer one pool with random workloads for a bounded time: each thread owns its
sequences, all share the pool, its prefix cache, its linear-state plans and (through a queue)
the dropping of sequences that were never deallocated, which releases their blocks lock-free
on whichever thread drops them. Afterwards `check()` must pass and every id must be free.
"""

from __future__ import annotations

import queue
import random
import threading
import time

import kvpool
import pytest

BS = 4
THREADS = 8
SECONDS = 1.5


def _worker(pool, seed, prefixes, deadline, graveyard, errors, counts):
    rng = random.Random(seed)
    mine: list[kvpool.Sequence] = []
    ops = 0
    try:
        while time.monotonic() < deadline:
            ops += 1
            r = rng.random()
            if r < 0.25 or not mine:
                tokens = rng.choice(prefixes) + [
                    rng.randrange(5000) for _ in range(rng.randrange(1, 20))
                ]
                seq = kvpool.Sequence(tokens)
                if pool.allocate(seq, rng.choice([None, max(1, len(tokens) // 2)])):
                    mine.append(seq)
            elif r < 0.7:
                seq = rng.choice(mine)
                held = len(seq.block_table) * BS
                prompt_end = seq.num_prompt_tokens // BS * BS
                target = prompt_end if seq.num_computed_tokens < prompt_end else len(seq)
                seq.num_computed_tokens = max(seq.num_computed_tokens, min(target, held))
                pool.cache(seq)
                if seq.num_computed_tokens == len(seq):
                    seq.append_token(rng.randrange(5000))
                if not pool.may_append(seq):
                    mine.remove(seq)
                    pool.deallocate(seq)
            elif r < 0.8:
                seq = mine.pop(rng.randrange(len(mine)))
                if rng.random() < 0.3:
                    graveyard.put(seq)  # dropped on another thread, never deallocated
                else:
                    pool.deallocate(seq)
            elif r < 0.9:
                tables = pool.block_tables(mine)
                assert tables.shape[0] == len(mine)
                for seq in mine:
                    if len(seq) > len(seq.block_table) * BS:
                        break
                else:
                    slots = pool.slot_mapping(mine)
                    assert len(slots) == sum(len(s) - s.num_computed_tokens for s in mine)
            elif r < 0.97:
                plan = pool.take_linear_state_plan()
                pool.commit_linear_state_plan(plan)
            else:
                stats = pool.stats()
                total = stats["num_free_blocks"] + stats["num_cached_blocks"]
                assert total + stats["num_used_blocks"] == stats["num_total_blocks"]
        for seq in mine:
            pool.deallocate(seq)
    except Exception as e:  # noqa: BLE001 - reported by the main thread
        errors.append(e)
    counts.append(ops)


def _reaper(graveyard, stop):
    while not stop.is_set() or not graveyard.empty():
        try:
            seq = graveyard.get(timeout=0.01)
        except queue.Empty:
            continue
        del seq  # the last reference: its handles go back lock-free on this thread


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"dp_size": 2, "linear_state_slots": 24, "checkpoint_interval": 8},
        {"sliding_window": 8, "swa_num_blocks": 48, "linear_state_slots": 24},
    ],
    ids=["plain", "linear-state", "window+linear-state"],
)
def test_r27_r28_eight_threads_hammer_one_concurrent_pool(options):
    pool = kvpool.BlockManagerPool(96, BS, concurrent=True, **options)
    assert pool.concurrent
    rng = random.Random(1)
    prefixes = [[rng.randrange(5000) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    graveyard: queue.Queue = queue.Queue()
    stop = threading.Event()
    errors: list[BaseException] = []
    counts: list[int] = []
    deadline = time.monotonic() + SECONDS
    reaper = threading.Thread(target=_reaper, args=(graveyard, stop))
    reaper.start()
    workers = [
        threading.Thread(
            target=_worker, args=(pool, seed, prefixes, deadline, graveyard, errors, counts)
        )
        for seed in range(THREADS)
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    stop.set()
    reaper.join(timeout=60)
    assert not errors, errors[:3]
    assert len(counts) == THREADS and sum(counts) > THREADS * 50
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    pool.check()
    stats = pool.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_live_slots"] == 0
    assert stats["prefix_hit_tokens"] > 0
    pool.reset_prefix_cache()
    pool.check()
    stats = pool.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "every id back exactly once"
    if stats["window"] is not None:
        assert stats["window"]["num_free_blocks"] == stats["window"]["num_total_blocks"]


def test_r28_a_concurrent_pool_releases_the_gil():
    """While one thread sits in a long pool call, Python code on another thread keeps running."""
    pool = kvpool.BlockManagerPool(1 << 20, 16, concurrent=True)
    seq = kvpool.Sequence(list(range(16 * 4096)))
    assert pool.allocate(seq)
    done = threading.Event()
    ticks = 0

    def spin():
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        before = ticks
        for _ in range(5):
            pool.check()  # walks a million ids with the GIL released
        assert ticks > before
    finally:
        done.set()
        spinner.join()
    pool.deallocate(seq)
