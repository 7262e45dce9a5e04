"""The fleet options of ``kvpool simulate`` (``--instances``, ``--router``, ...) and their driver:
every (policy, remote) combination asked for runs on the same workload and lands in one table
(docs/simulate.md, "Fleets")."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvpool.index.router import POLICIES
from kvpool.sim.configure import UsageError, make_config
from kvpool.sim.fleet import run_fleet
from kvpool.sim.request import Request

__all__ = ["add_arguments", "fleet_requested", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The "fleet" option group."""
    f = parser.add_argument_group("fleet (N instances behind a router, docs/simulate.md)")
    f.add_argument(
        "--instances",
        type=int,
        default=None,
        metavar="N",
        help="simulate N instances (one pool each, the configuration above) in one process, "
        "their KV events feeding one kvpool.KVIndex",
    )
    f.add_argument(
        "--router",
        default=None,
        metavar="POLICY[,POLICY...]",
        help="routing policies, compared in one table: round_robin, least_loaded, kv_aware "
        "(default kv_aware)",
    )
    f.add_argument(
        "--load-weight",
        type=float,
        default=1.0,
        help="kv_aware: weight of an instance's outstanding prompt tokens in its cost",
    )
    f.add_argument(
        "--speculative-ttl",
        type=float,
        default=2.0,
        help="seconds a routed request's blocks count as held before events confirm them (0: none)",
    )
    f.add_argument(
        "--per-instance",
        action="store_true",
        help="also print every instance's row (always with one combination)",
    )


def fleet_requested(args: argparse.Namespace) -> bool:
    return args.instances is not None or args.router is not None


def _remotes(spec: str | None) -> list[str | None]:
    """``--remote`` in a fleet: a comma list of none, memory and redis:// URLs."""
    if spec is None:
        return [None]
    out: list[str | None] = []
    for item in (s.strip() for s in spec.split(",")):
        if item in ("none", "local"):
            out.append(None)
        elif item == "memory" or item.startswith(("redis://", "rediss://", "unix://")):
            out.append(item)
        else:
            raise ValueError(f"--remote: expected none, memory or a redis:// URL, got {item!r}")
    return out


def run(
    args: argparse.Namespace, reqs: list[Request], wl: dict[str, Any], console: Any, show: bool
) -> int:
    """Runs every (policy, remote) combination and prints the table (or JSON)."""
    if args.sweep:
        raise UsageError("--sweep and --instances do not combine: give the routers to --router")
    if args.execute or args.plot or args.timeline:
        raise UsageError("--execute, --plot and --timeline are for one instance, not a fleet")
    n = 1 if args.instances is None else args.instances
    if n < 1:
        raise UsageError(f"--instances must be >= 1, got {n}")
    policies = [p.strip() for p in (args.router or "kv_aware").split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise UsageError(
            f"--router: unknown policy {', '.join(bad) or '(none)'}; expected {', '.join(POLICIES)}"
        )
    if not args.load_weight >= 0:
        raise UsageError(f"--load-weight must be >= 0, got {args.load_weight}")
    if not args.speculative_ttl >= 0:
        raise UsageError(f"--speculative-ttl must be >= 0, got {args.speculative_ttl}")
    try:
        remotes = _remotes(args.remote)
    except ValueError as e:
        raise UsageError(str(e)) from None
    one = argparse.Namespace(**vars(args))
    one.remote = None
    cfg, extra = make_config(one, reqs)
    if any(r is not None for r in remotes) and not cfg.host_num_blocks:
        raise UsageError(
            "--remote needs the host tier (--host-blocks N): remote hits land in host blocks"
        )
    results = []
    for remote in remotes:
        for policy in policies:
            if show:
                console.print(
                    f"[dim]simulating {n} instances: {policy}, {remote or 'local caches'}[/dim]"
                )
            results.append(
                run_fleet(
                    cfg,
                    reqs,
                    n,
                    policy,
                    remote=remote,
                    load_weight=args.load_weight,
                    speculative_ttl=args.speculative_ttl or None,
                )
            )
    if args.json:
        print(
            json.dumps(
                {
                    "config": {**vars(cfg), "model_shape": None, **extra, **wl},
                    "fleet": [r.to_json() for r in results],
                },
                indent=2,
                default=str,
            )
        )
        return 0
    console.print(
        comparison_table(results, title=f"kvpool simulate: {n} instances, {_describe(wl)}")
    )
    if args.per_instance or len(results) == 1:
        for r in results:
            console.print(instance_table(r))
    return 0


def _describe(wl: dict[str, Any]) -> str:
    if "trace" in wl:
        return f"trace {wl['trace']}"
    return f"{wl['workload']} workload, {wl['num_requests']} requests"


def comparison_table(results: list[Any], title: str) -> Any:
    """One row per (policy, remote): hit rate, TTFT in seconds, load balance."""
    from rich.table import Table

    t = Table(title=title)
    for col in (
        "router",
        "caches",
        "hit rate",
        "TTFT mean",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "busy max/mean",
        "requests min-max",
        "remote hit blocks",
        "wall",
    ):
        t.add_column(col, justify="left" if col in ("router", "caches") else "right")
    for r in results:
        f = r.fleet
        t.add_row(
            r.policy,
            f"remote:{r.remote}" if r.remote else "local",
            f"{100 * f['hit_rate']:.1f}%",
            f"{f['ttft_s_mean']:.3g} s",
            f"{f['ttft_s_p50']:.3g} s",
            f"{f['ttft_s_p90']:.3g} s",
            f"{f['ttft_s_p99']:.3g} s",
            f"{f['busy_imbalance']:.2f}",
            f"{f['min_requests']}-{f['max_requests']}",
            f"{f['remote_hit_blocks']:,}",
            f"{f['wall_s']:.1f} s",
        )
    return t


def instance_table(r: Any) -> Any:
    """Every instance of one run."""
    from rich.table import Table

    t = Table(title=f"per instance: {r.label}")
    for col in (
        "instance",
        "requests",
        "prompt tokens",
        "hit rate",
        "TTFT mean",
        "TTFT p99",
        "busy",
        "preemptions",
    ):
        t.add_column(col, justify="right")
    for s in r.per_instance:
        t.add_row(
            str(s["instance"]),
            f"{s['routed_requests']:,}",
            f"{s['routed_prompt_tokens']:,}",
            f"{100 * s['first_admission_cached_fraction']:.1f}%",
            f"{s['ttft_s_mean']:.3g} s",
            f"{s['ttft_s_p99']:.3g} s",
            f"{s['busy_s']:.3g} s",
            f"{s['preemptions']:,}",
        )
    return t
