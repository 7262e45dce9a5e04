"""The ``kvpool`` command: ``kvpool simulate ...``, ``kvpool tour`` and ``kvpool generate ...``.

The side-by-side benchmark against nano-vllm / vLLM-style block managers is not a library command:
it runs from a checkout, ``python benches/compare.py`` (benches/compare/).
"""

from __future__ import annotations

import sys

USAGE = """usage: kvpool {simulate,tour,generate} [options]

commands:
  simulate   replay a serving workload (synthetic, or a Mooncake / Qwen-Bailian trace) through
             a scheduler built on BlockManagerPool and report KV-cache usage, prefix hits,
             preemptions, time in seconds (`kvpool simulate --help`; docs/simulate.md)
  tour       two scenarios (nano-vllm's paged blocks, xLLM's request life) replayed on the
             library, step by step (a minute's read)
  generate   a Hugging Face causal LM (hub id, path, config or tiny-<family>) on prompts from a
             file, its KV in kvpool (needs torch and transformers; docs/engine.md)
"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "simulate":
        from kvpool.sim.cli import main as simulate_main

        return simulate_main(rest)
    if cmd == "tour":
        from kvpool.tour import main as tour_main

        return tour_main(rest)
    if cmd == "generate":
        from kvpool.integrations.transformers.cli import main as generate_main

        return generate_main(rest)
    print(USAGE, end="", file=sys.stderr)
    if cmd == "bench":
        print(
            "kvpool: the comparison with nano-vllm / vLLM runs from a checkout of the repository:"
            " python benches/compare.py --help",
            file=sys.stderr,
        )
    print(
        f"kvpool: error: unknown command {cmd!r} (choose from simulate, tour, generate)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
