"""Scheduler time per step of a nano-vllm-shaped engine loop, side by side in one run:
kvpool's drop-in ``kvpool.integrations.nanovllm.BlockManager`` against the nano-vllm-semantics
reference (benches/compare/nanovllm_reference.py) and, with ``--nanovllm-src`` naming a checkout of
GeeeekExplorer/nano-vllm, nano-vllm's own ``BlockManager`` in the same loop.

Per block size (16 and 256) and memory setting (roomy; pressure: a cache of about half the
reference's peak demand in the roomy run, so that preemptions happen), the same workload runs on
each manager: >= 300 requests of multi-turn conversations over shared system prompts of 500-3,000
tokens (each turn's prompt = the previous prompt + its output + a new message). Scheduler time is
``schedule()`` plus ``postprocess()`` (every block-manager call), the fake model excluded; it is
reported per step type (prefill, decode) as the median step, with the reference's time divided by
kvpool's; the total column sums every step but the slowest 2% (pauses of a shared machine). ``--verify`` reads every attended position of the fake KV tensor back through the tables.

    python benches/engines.py [--quick] [--verify] [--nanovllm-src PATH]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "compare"))

import nanovllm_engine as engine  # noqa: E402
import nanovllm_reference as reference  # noqa: E402
from kvpool.integrations.nanovllm import BlockManager  # noqa: E402


def nanovllm_block_manager(src: Path):
    """nano-vllm's own BlockManager class, without its model stack."""
    package = types.ModuleType("nanovllm")
    package.__path__ = [str(src / "nanovllm")]
    engine_package = types.ModuleType("nanovllm.engine")
    engine_package.__path__ = [str(src / "nanovllm" / "engine")]
    sys.modules.update({"nanovllm": package, "nanovllm.engine": engine_package})
    import nanovllm.engine.block_manager as block_manager

    return block_manager.BlockManager


def used_counter(name: str, bm):
    if name == "kvpool":
        return lambda: bm.pool.stats()["num_used_blocks"]
    return lambda: len(bm.used_block_ids)


def run(name: str, make, workload, num_blocks: int, block_size: int, verify: bool):
    gc.collect()
    bm = make(num_blocks, block_size)
    t0 = time.perf_counter()
    result = engine.run_engine(
        bm,
        workload,
        num_blocks=num_blocks,
        verify=verify,
        used_blocks=used_counter(name, bm),
    )
    result.wall = time.perf_counter() - t0
    if name == "kvpool":
        bm.pool.check()
        result.hit_tokens = bm.pool.stats()["prefix_hit_tokens"]
    return result


def demand_bound(workload, block_size: int) -> int:
    """Blocks of every request resident at once: more than any run can need."""
    total = 0
    for c, turns in enumerate(workload.turns):
        length = len(workload.system_prompts[workload.conversation_prompt[c]])
        for t in range(turns):
            length += len(workload.messages[(c, t)]) + workload.max_tokens[(c, t)]
            total += -(-length // block_size) + 1
    return total


def median_us(times: list[float]) -> float:
    """The median step (robust to the pauses other processes cause on a shared machine)."""
    return 1e6 * statistics.median(times) if times else 0.0


def trimmed_total(times: list[float]) -> float:
    """The sum of the steps without the slowest 2% (a shared machine's scheduler takes ~4 ms
    slices from a few steps of any run), scaled back to every step."""
    if not times:
        return 0.0
    kept = sorted(times)[: max(1, len(times) * 49 // 50)]
    return sum(kept) * len(times) / len(kept)


def ratio(reference_time: float, kvpool_time: float) -> str:
    return f"{reference_time / kvpool_time:.2f}x" if kvpool_time else "-"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small workload (a smoke run)")
    parser.add_argument("--verify", action="store_true", help="read the fake KV back every step")
    parser.add_argument("--nanovllm-src", type=Path, help="a nano-vllm checkout to run beside")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = dict(
        num_conversations=24 if args.quick else 120,
        max_turns=5,
        system_lengths=(500, 3000),
        num_system_prompts=6,
        message_lengths=(20, 200),
        output_lengths=(8, 32) if args.quick else (16, 128),
        concurrency=16 if args.quick else 64,
    )
    workload = engine.make_workload(args.seed, **sizes)
    managers = [("reference", reference.BlockManager), ("kvpool", BlockManager)]
    if args.nanovllm_src:
        managers.insert(1, ("nano-vllm", nanovllm_block_manager(args.nanovllm_src)))
    print(
        f"{workload.num_requests} requests, {workload.num_conversations} conversations, "
        f"system prompts {sizes['system_lengths']}, concurrency {sizes['concurrency']}"
    )
    header = (
        "| block size | memory | blocks | manager | prefill steps | prefill us/step (median) | "
        "decode steps | decode us/step (median) | total s | ref/kvpool prefill | "
        "ref/kvpool decode | ref/kvpool total | preemptions | same schedule as ref |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for block_size in (16, 256):
        # The reference's peak demand with room for every request (untimed): roomy is 1.25x, pressure 0.5x.
        unlimited = run(
            "reference",
            reference.BlockManager,
            workload,
            demand_bound(workload, block_size),
            block_size,
            False,
        )
        peak = unlimited.peak_used_blocks
        for memory in ("roomy", "pressure"):
            results = {}
            blocks = peak * 5 // 4 if memory == "roomy" else max(peak // 2, 1)
            for name, make in managers:
                results[name] = run(name, make, workload, blocks, block_size, args.verify)
            ref = results["reference"]
            for name, r in results.items():
                pre, dec = r.times["prefill"], r.times["decode"]
                total = trimmed_total(pre) + trimmed_total(dec)
                ref_total = trimmed_total(ref.times["prefill"]) + trimmed_total(ref.times["decode"])
                print(
                    f"| {block_size} | {memory} | {blocks} | {name} | {len(pre)} | "
                    f"{median_us(pre):.0f} | {len(dec)} | {median_us(dec):.0f} | {total:.3f} | "
                    f"{ratio(median_us(ref.times['prefill']), median_us(pre))} | "
                    f"{ratio(median_us(ref.times['decode']), median_us(dec))} | "
                    f"{ratio(ref_total, total)} | {r.num_preemptions} | "
                    f"{'yes' if r.schedule == ref.schedule else 'no'} |"
                )
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
