"""Tokens per second of kvpool's paged runner against transformers' own ``generate`` (CPU).

    .venv-vllm/bin/python benches/runner_bench.py [--sizes tiny,small] [--repeats 3]

The shared-prefix workload: ``--batch`` prompts of one ``--system``-token system prompt plus a
``--user``-token question each, ``--new`` greedy tokens per prompt, all submitted at once, on a
random-weight Qwen3 config (``tiny``: the tests' 2 layers, hidden 128; ``small``: 4 layers,
hidden 512, 8 query / 4 KV heads, head_dim 64, vocabulary 8192). Both sides run on the CPU with
one torch thread, float32:

* ``hf generate``: ``model.generate`` on the left-padded batch with its default cache
  (``DynamicCache``), sdpa attention;
* ``kvpool <backend>``: ``kvpool.integrations.transformers.Engine`` (continuous batching, its
  attention on ``kvpool.kernels`` with the ``numpy`` or ``emulated`` backend), cold (the batch
  arrives at once: every prompt computes the system prompt in the first step, dedup then keeps
  one copy) and warm (``prefix cached``: an earlier batch with other questions left the system
  prompt in the prefix cache; generate has no cache across calls, so its time is the same).

Reported: wall time (median of ``--repeats``, after a warm-up), output tokens per second, the
ratio to ``hf generate``, whether the greedy tokens equal generate's, and where the runner's
time goes: model layers outside attention, attention (``write_kv`` + paged attention, kernel
calls and their array views), plans, and the engine's scheduling (pool calls and Python).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from kvpool.integrations.transformers import Engine, SamplingParams
from kvpool.integrations.transformers.models import from_config, tiny_config

SIZES = {
    "tiny": {},
    "small": dict(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
    ),
}


def workload(vocab: int, batch: int, system: int, user: int, seed: int = 0) -> list[list[int]]:
    """One system prompt (always the same) and ``batch`` questions (``seed`` picks them)."""
    sys_prompt = torch.randint(3, vocab, (system,), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1000 + seed)
    return [
        sys_prompt.tolist() + torch.randint(3, vocab, (user,), generator=g).tolist()
        for _ in range(batch)
    ]


def hf_generate(model, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    n = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), n), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate wants for decoder-only models
        ids[i, n - len(p) :] = torch.tensor(p)
        mask[i, n - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return time.perf_counter() - t0, out[:, n:].tolist()


def kvpool_generate(
    model, prompts: list[list[int]], new: int, backend: str, warm: list[list[int]] | None = None
) -> tuple[float, list[list[int]], dict]:
    bs = 16
    longest = max(len(p) for p in prompts) + new
    engine = Engine(
        model,
        num_blocks=2 * len(prompts) * -(-longest // bs) + 1,
        block_size=bs,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        backend=backend,
    )
    if warm:
        engine.generate(warm, SamplingParams(max_tokens=1, ignore_eos=True))
        engine.runner.timers.clear()
        engine.timers.clear()
    hits_before = engine.stats()["prefix_hit_tokens"]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
    wall = time.perf_counter() - t0
    r, e = engine.runner.timers, engine.timers
    split = {
        "layers": r["forward"] - r["attention"],
        "attention": r["attention"],
        "plans+prepare": r["plans"] + r["prepare"],
        "schedule": e["schedule"],
        "hit_tokens": engine.stats()["prefix_hit_tokens"] - hits_before,
    }
    return wall, outs, split


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--backends", default="numpy,emulated")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--user", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"batch {args.batch} x ({args.system} shared + {args.user}) tokens, {args.new} new "
        f"each, float32, {args.threads} torch thread(s), median of {args.repeats}\n"
    )
    print(
        "| model | engine | wall s | output tok/s | vs hf generate | same tokens | layers s "
        "| attention s | plans s | schedule s |"
    )
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        model = from_config(tiny_config("qwen3", **SIZES[size]), seed=0)
        prompts = workload(model.config.vocab_size, args.batch, args.system, args.user)
        toks = args.batch * args.new
        hf_generate(model, prompts[:2], 2)  # warm-up
        runs = [hf_generate(model, prompts, args.new) for _ in range(args.repeats)]
        hf_wall = statistics.median(w for w, _ in runs)
        ref = runs[0][1]
        print(
            f"| {size} | hf generate (DynamicCache, sdpa) | {hf_wall:.2f} | {toks / hf_wall:.0f} "
            f"| 1.00x | - | | | | |"
        )
        others = workload(model.config.vocab_size, args.batch, args.system, args.user, seed=1)
        for backend, warm in [(b, w) for b in args.backends.split(",") for w in (False, True)]:
            kvpool_generate(model, prompts[:2], 2, backend)  # warm-up (emulated: compiles once)
            res = [
                kvpool_generate(model, prompts, args.new, backend, others if warm else None)
                for _ in range(args.repeats)
            ]
            wall, outs, split = sorted(res, key=lambda r: r[0])[len(res) // 2]
            name = f"kvpool {backend}" + (
                f", prefix cached ({split['hit_tokens']} hit)" if warm else ""
            )
            print(
                f"| {size} | {name} | {wall:.2f} | {toks / wall:.0f} | "
                f"{hf_wall / wall:.2f}x | {outs == ref} | {split['layers']:.2f} | "
                f"{split['attention']:.2f} | {split['plans+prepare']:.2f} | "
                f"{split['schedule']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
