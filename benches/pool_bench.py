"""Microbenchmarks of the Python API of ``kvpool.BlockManagerPool``.

    python benches/pool_bench.py [--iterations N] [--json PATH] [--no-references]

Reports microseconds per call (best of ``--repeat`` rounds, each the mean of ``--iterations``):

* ``cycle miss``: ``Sequence(2048 tokens)`` (an int32 array for kvpool, a list for the
  references) + ``allocate`` + mark computed + ``cache`` +
  ``deallocate``, block size 16, prefix caching on, a new prompt every time (128 blocks hashed,
  inserted; once the pool is full every allocation evicts 128 cached blocks);
* ``cycle hit``: the same with one prompt over and over (127 blocks hit, one recomputed: R8);
* ``block_tables`` / ``slot_mapping`` for a batch of 256 sequences of 64-4096 tokens, in decode
  state (one slot per sequence) and in prefill state (every token of the prompt);
* ``Sequence(...)``: building kvpool's sequence from a list and from an int32 array.

The pure-Python references of ``benches/compare/`` (nano-vllm-style, vLLM-v1-style) run the same
cycles through their own APIs, and the batch export as the Python loops those engines use, for
scale. Nothing here is a pass/fail test; see benches/RESULTS.md for recorded numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import kvpool
import numpy as np

# the references and the machine line live with the side-by-side comparison (benches/compare/)
sys.path.insert(0, str(Path(__file__).resolve().parent / "compare"))
import nanovllm_reference as nano  # noqa: E402
import vllm_reference as vref  # noqa: E402
from adapters import export_lists  # noqa: E402
from compare import machine_description  # noqa: E402

BLOCK_SIZE = 16
PROMPT_LEN = 2048
BATCH = 256


def bench(fn: Callable[[], object], iterations: int, repeat: int) -> float:
    """Best-of-``repeat`` mean microseconds per call of ``fn``."""
    best = float("inf")
    perf = time.perf_counter_ns
    for _ in range(repeat):
        gc.collect()
        t0 = perf()
        for _ in range(iterations):
            fn()
        best = min(best, (perf() - t0) / iterations / 1e3)
    return best


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 32000, size=PROMPT_LEN).tolist() for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# cycles: allocate + cache + deallocate of one 2048-token request


def kvpool_cycle(num_blocks: int, pool_prompts: list[list[int]]) -> Callable[[], object]:
    pool = kvpool.BlockManagerPool(num_blocks, BLOCK_SIZE, enable_prefix_cache=True)
    Seq = kvpool.Sequence
    state = {"i": 0}
    n = len(pool_prompts)

    arrays = [np.asarray(t, dtype=np.int32) for t in pool_prompts]  # kvpool reads arrays best

    def cycle() -> None:
        tokens = arrays[state["i"] % n]
        state["i"] += 1
        seq = Seq(tokens)
        if not pool.allocate(seq):
            raise RuntimeError("allocate failed")
        seq.num_computed_tokens = len(seq)
        pool.cache(seq)
        pool.deallocate(seq)

    return cycle


def nano_cycle(num_blocks: int, pool_prompts: list[list[int]]) -> Callable[[], object]:
    bm = nano.BlockManager(num_blocks - 1, BLOCK_SIZE)
    state = {"i": 0}
    n = len(pool_prompts)

    def cycle() -> None:
        seq = nano.NanoSequence(pool_prompts[state["i"] % n], BLOCK_SIZE)
        state["i"] += 1
        k = bm.can_allocate(seq)
        if k < 0:
            raise RuntimeError("allocate failed")
        bm.allocate(seq, k)
        seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
        bm.hash_blocks(seq)
        seq.num_cached_tokens = len(seq)
        bm.deallocate(seq)

    return cycle


def vllm_cycle(num_blocks: int, pool_prompts: list[list[int]]) -> Callable[[], object]:
    kv = vref.KVCacheManager(num_blocks, BLOCK_SIZE)
    state = {"i": 0}
    n = len(pool_prompts)

    def cycle() -> None:
        i = state["i"]
        state["i"] += 1
        req = kv.make_request(i, pool_prompts[i % n])
        blocks, k = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - k, k, blocks) is None:
            raise RuntimeError("allocate failed")
        req.num_computed_tokens = req.num_tokens
        kv.free(req)

    return cycle


# ------------------------------------------------------------------------------------------------
# batch export


def batch_lengths(seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(64, 4097, size=BATCH).tolist()


def kvpool_batch(decode: bool):
    lens = batch_lengths()
    total = sum(-(-n // BLOCK_SIZE) for n in lens) + 1
    pool = kvpool.BlockManagerPool(total + 16, BLOCK_SIZE, enable_prefix_cache=False)
    rng = np.random.default_rng(2)
    seqs = []
    for n in lens:
        seq = kvpool.Sequence(rng.integers(0, 32000, size=n).tolist())
        assert pool.allocate(seq)
        if decode:
            seq.num_computed_tokens = n - 1
        seqs.append(seq)
    return (lambda: pool.block_tables(seqs)), (lambda: pool.slot_mapping(seqs)), sum(lens)


def kvpool_step(mode: str, steps: int):
    """One decode step of a running batch of BATCH sequences (prefix caching on): every
    sequence gets its sampled token, is marked computed and published, and gets room for the
    token. ``mode``: "loop" (four calls per sequence), "list" (advance + may_append_all on a
    list), "batch" (the same on a SequenceBatch), "fused" (advance(batch, t, lookahead=0))."""
    lens = batch_lengths()
    total = sum(-(-(n + steps) // BLOCK_SIZE) for n in lens) + 1
    pool = kvpool.BlockManagerPool(total + 16, BLOCK_SIZE)
    rng = np.random.default_rng(3)
    seqs = []
    for n in lens:
        seq = kvpool.Sequence(rng.integers(0, 32000, size=n, dtype=np.int32))
        assert pool.allocate(seq)
        seqs.append(seq)
    batch = kvpool.SequenceBatch(seqs)
    tokens = rng.integers(0, 32000, size=BATCH).tolist()

    def loop() -> None:
        for seq, t in zip(seqs, tokens, strict=True):
            seq.num_computed_tokens = len(seq)
            pool.cache(seq)
            seq.append_token(t)
            pool.may_append(seq)

    steps_by_mode = {
        "loop": loop,
        "list": lambda: (pool.advance(seqs, tokens), pool.may_append_all(seqs)),
        "batch": lambda: (pool.advance(batch, tokens), pool.may_append_all(batch)),
        "fused": lambda: pool.advance(batch, tokens, lookahead=0),
    }
    return steps_by_mode[mode]


def python_batch(decode: bool):
    """Block tables as lists (what the pure-Python managers hold), exported with Python loops."""
    lens = batch_lengths()
    tables, start = [], []
    next_id = 1
    for n in lens:
        nb = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_id, next_id + nb)))
        next_id += nb
        start.append(n - 1 if decode else 0)

    def bt():
        return export_lists(tables, lens, lens, BLOCK_SIZE)[0]

    def sm():
        return export_lists(tables, start, lens, BLOCK_SIZE)[1]

    return bt, sm, sum(lens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=200, help="calls per round (default 200)")
    p.add_argument("--repeat", type=int, default=5, help="rounds; the best is kept (default 5)")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=4096,
        help="pool size for the cycles (default 4096: the miss cycle evicts)",
    )
    p.add_argument("--no-references", action="store_true", help="kvpool only")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    it, rep = args.iterations, args.repeat
    has_pool = hasattr(kvpool, "BlockManagerPool")
    if not has_pool:
        print("kvpool.BlockManagerPool is not built yet: only the references run", flush=True)
    results: dict[str, dict[str, float]] = {}

    miss_prompts = prompts(
        max(it * rep // 4, 64), seed=0
    )  # reused only after the pool evicted them
    hit_prompts = prompts(1, seed=7)
    makers = {}
    if has_pool:
        makers["kvpool"] = kvpool_cycle
    if not args.no_references:
        makers["nano-vllm-ref"] = nano_cycle
        makers["vllm-v1-ref"] = vllm_cycle
    for name, make in makers.items():
        row = results.setdefault(name, {})
        # the references are ~1000x slower: fewer iterations keep the run short
        n_it = it if name == "kvpool" else max(it // 20, 5)
        cyc = make(args.num_blocks, miss_prompts)
        for _ in range(
            args.num_blocks // (PROMPT_LEN // BLOCK_SIZE) + 2
        ):  # fill: evict from then on
            cyc()
        row["cycle miss (evicting)"] = bench(cyc, n_it, rep)
        cyc = make(args.num_blocks, hit_prompts)
        cyc()
        row["cycle hit"] = bench(cyc, n_it, rep)
        print(f"  {name}: cycles done", flush=True)

    if has_pool:
        lst = hit_prompts[0]
        arr = np.asarray(lst, dtype=np.int32)
        row = results.setdefault("kvpool", {})
        row[f"Sequence({PROMPT_LEN} tokens, list)"] = bench(lambda: kvpool.Sequence(lst), it, rep)
        row[f"Sequence({PROMPT_LEN} tokens, int32 array)"] = bench(
            lambda: kvpool.Sequence(arr), it, rep
        )

    for decode in (True, False):
        state = "decode" if decode else "prefill"
        if has_pool:
            bt, sm, _ = kvpool_batch(decode)
            row = results.setdefault("kvpool", {})
            row[f"block_tables x{BATCH} ({state})"] = bench(bt, it, rep)
            row[f"slot_mapping x{BATCH} ({state})"] = bench(
                sm, it if decode else max(it // 10, 5), rep
            )
        if not args.no_references:
            bt, sm, _ = python_batch(decode)
            row = results.setdefault("python loop", {})
            row[f"block_tables x{BATCH} ({state})"] = bench(bt, max(it // 10, 5), rep)
            row[f"slot_mapping x{BATCH} ({state})"] = bench(sm, max(it // 20, 3), rep)

    if has_pool:
        row = results.setdefault("kvpool", {})
        for mode, label in (
            ("loop", "per-sequence calls"),
            ("list", "advance + may_append_all, list"),
            ("batch", "advance + may_append_all, SequenceBatch"),
            ("fused", "advance(lookahead=0), SequenceBatch"),
        ):
            n_it = max(it // 10, 5) if mode == "loop" else it
            step = kvpool_step(mode, n_it * rep + 1)
            row[f"decode step x{BATCH}: {label}"] = bench(step, n_it, rep)

    ops = []
    for row in results.values():
        for k in row:
            if k not in ops:
                ops.append(k)
    names = list(results)
    width = max(len(o) for o in ops)
    print()
    print(
        f"block size {BLOCK_SIZE}, prompt {PROMPT_LEN} tokens, batch {BATCH}; microseconds per call"
    )
    print("| operation".ljust(width + 2) + " | " + " | ".join(n.rjust(13) for n in names) + " |")
    print("|" + "-" * (width + 2) + "|" + "|".join("-" * 14 + ":" for _ in names) + "|")
    for o in ops:
        cells = [f"{results[n][o]:.2f}" if o in results[n] else "-" for n in names]
        print(f"| {o.ljust(width)} | " + " | ".join(c.rjust(13) for c in cells) + " |")
    machine = machine_description()
    print(f"machine: {machine}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": machine, "us_per_call": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
