"""The ``kvpool`` command: ``kvpool simulate ...``, ``kvpool tour`` and ``kvpool bench ...``."""

from __future__ import annotations

import sys

USAGE = """usage: kvpool {simulate,tour,bench} [options]

commands:
  simulate   replay a serving workload (synthetic, or a Mooncake / Qwen-Bailian trace) through
             a scheduler built on BlockManagerPool and report KV-cache usage, prefix hits,
             preemptions, time in seconds (`kvpool simulate --help`; docs/simulate.md)
  tour       the seeds' scenarios replayed on the library, step by step (a minute's read)
  bench      side-by-side benchmark against pure-Python peers (`kvpool bench --help`)
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
    if cmd == "bench":
        try:
            from kvpool.bench.compare import main as bench_main
        except ImportError as e:
            print(f"kvpool bench: error: the benchmark is not available ({e})", file=sys.stderr)
            return 1
        rc = bench_main(rest)
        return int(rc or 0)
    print(USAGE, end="", file=sys.stderr)
    print(f"kvpool: error: unknown command {cmd!r} (choose from simulate, tour, bench)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
