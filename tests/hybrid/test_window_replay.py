"""A serving replay shaped like a real-model run on a sliding-window model (Gemma 3 text, window
24, tight memory), without the model: under memory pressure the eviction order must not undo the
hybrid hit (docs/hybrid.md "One block store"). Separate stores (79 ids per group, window blocks
freed as they slide out) served 316 of the 1,520 hit tokens the full-attention group alone could
have served in that run; here they serve about a third. One store of the same memory (158 ids)
with window retention and hit-point-aware eviction serves 92% over these five seeds (87% over
20 seeds; 81% over 20 before a junction kept its mark after its branches were evicted and the
runs only the head protects went first among the kept ones); the rest is lost when six running
sequences need every id and the kept runs go last.

The shape: 16 conversations of 1-3 turns, each follow-up resending the whole previous
conversation; 85% start with one of 3 system prompts of 21/38/52 tokens; block size 4, 79 usable
ids, window 24, prefill chunks of 16, 40 tokens per step, at most 6 running sequences, 8-24
decoded tokens per request; recompute preemption when a decode step finds no block."""

from __future__ import annotations

import collections
import random

import kvpool

BS, WINDOW, CHUNK, BUDGET, MAX_RUNNING = 4, 24, 16, 40, 6


def conversations(seed: int) -> list[dict]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 500) for _ in range(n)] for n in (21, 38, 52)]
    out = []
    for c in range(16):
        start = list(rng.choice(systems)) if rng.random() < 0.85 else []
        turns = rng.randint(1, 3)
        users = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 20))] for _ in range(turns)]
        decode = [rng.randint(8, 24) for _ in range(turns)]
        out.append({"id": c, "start": start, "users": users, "decode": decode, "rng": rng.random()})
    return out


def replay(pool: kvpool.BlockManagerPool, seed: int = 0) -> dict[str, int]:
    """Serves the conversations (continuous batching, chunked prefill, recompute preemption);
    returns the hit tokens the pool served and the ones its full-attention cache held."""
    rng = random.Random(seed + 1)
    waiting: collections.deque = collections.deque()
    for conv in conversations(seed):
        waiting.append((conv, 0, conv["start"] + conv["users"][0]))
    running: list[tuple[kvpool.Sequence, dict, int, int]] = []  # seq, conv, turn, prompt len
    counts = {"hit": 0, "kv_hit": 0, "preemptions": 0, "requests": 0}
    steps = 0
    while waiting or running:
        steps += 1
        assert steps < 10_000, "the replay does not finish"
        budget = BUDGET
        # decode steps first, preempting the newest on a full pool
        for entry in list(running):
            seq, conv, turn, plen = entry
            if entry not in running or seq.num_computed_tokens < plen:
                continue
            seq.append_token(rng.randrange(3, 500))
            while not pool.may_append(seq) and running:
                victim = running.pop()  # the newest
                pool.deallocate(victim[0])
                waiting.appendleft((victim[1], victim[2], victim[0].token_ids[: victim[3]]))
                counts["preemptions"] += 1
                if victim is entry:
                    break
            if entry not in running:
                continue
            seq.num_computed_tokens = len(seq)
            pool.cache(seq)
            budget -= 1
            if len(seq) - plen >= conv["decode"][turn]:
                running.remove(entry)
                pool.deallocate(seq)
                if turn + 1 < len(conv["users"]):
                    waiting.append((conv, turn + 1, seq.token_ids + conv["users"][turn + 1]))
        # prefill chunks of the running, then admissions
        for seq, _conv, _turn, plen in running:
            if seq.num_computed_tokens < plen and budget > 0:
                n = min(CHUNK, plen - seq.num_computed_tokens, budget)
                if pool.allocate(seq, seq.num_computed_tokens + n):
                    seq.num_computed_tokens += n
                    pool.cache(seq)
                    budget -= n
        while waiting and len(running) < MAX_RUNNING and budget > 0:
            conv, turn, prompt = waiting[0]
            seq = kvpool.Sequence(prompt)
            plan = pool.plan(seq)
            if plan is None:
                break
            n = min(len(prompt), plan.num_cached_tokens + min(CHUNK, budget))
            if not pool.allocate(seq, n):
                break
            waiting.popleft()
            counts["hit"] += seq.num_cached_tokens
            counts["kv_hit"] += plan.kv_hit_tokens
            counts["requests"] += 1
            seq.num_computed_tokens = n
            pool.cache(seq)
            budget -= n - seq.num_cached_tokens
            running.append((seq, conv, turn, len(prompt)))
        pool.check()
    assert pool.stats()["num_used_blocks"] == 0
    return counts


def test_the_hit_points_survive_the_eviction_order():
    shared = {"hit": 0, "kv_hit": 0}
    separate = {"hit": 0, "kv_hit": 0}
    for seed in range(5):
        one = replay(kvpool.BlockManagerPool(159, BS, sliding_window=WINDOW), seed)  # 158 ids
        two = replay(
            kvpool.BlockManagerPool(80, BS, sliding_window=WINDOW, swa_num_blocks=80), seed
        )
        assert one["requests"] >= 16 and one["kv_hit"] > 0
        for totals, counts in ((shared, one), (separate, two)):
            for key in totals:
                totals[key] += counts[key]
    assert shared["hit"] >= 0.9 * shared["kv_hit"], shared  # 3,860 of 4,200
    assert shared["hit"] >= 2 * separate["hit"], (shared, separate)
