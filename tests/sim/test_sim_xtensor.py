"""``kvpool simulate --xtensor``: the pool on elastic pages, mapped memory over time,
memory-limit schedules, and their argument errors (R29: each names its argument)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvpool
import pytest
from kvpool.sim import cli, configure
from kvpool.sim.elastic import GIB, default_page_bytes, parse_limit_schedule

pytestmark = pytest.mark.skipif(not hasattr(kvpool, "BlockManagerPool"), reason="pool not built")

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT / "tests" / "sim" / "fixtures" / "mooncake_conversation_300.jsonl"
# llama3-8b at block size 16: 2 MiB per block; a default page (2 MiB x 2 x 32 layers) holds 64 blocks
SMALL = [
    "-n",
    "60",
    "--max-prompt-len",
    "2048",
    "--output-len",
    "24",
    "--model",
    "llama3-8b",
    "--cache-tokens",
    "40k",
    "--no-progress",
]


def simulate(*argv: str):
    args = cli.build_parser().parse_args(list(argv))
    reqs, _ = configure.make_workload(args)
    return configure.run_one(args, reqs, "test")


def test_schedule_syntax():
    assert parse_limit_schedule("0:4, 30:1.5,60:none") == ((0.0, 4.0), (30.0, 1.5), (60.0, None))
    for bad, needle in [
        ("", "at least one"),
        ("30", "T:GIB"),
        ("x:4", "time"),
        ("-1:4", ">= 0"),
        ("5:0", "> 0"),
        ("5:big", "GiB"),
        ("10:4,5:2", "increase"),
        ("5:4,5:2", "increase"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_limit_schedule(bad)


def test_mapped_memory_follows_the_load_and_the_limit():
    """check=True: pool.check() (the page rules) after every step; the schedule squeezes the
    instance mid-run and lifts the limit again; dp ranks."""
    res = simulate(
        *SMALL, "--xtensor", "--dp", "2", "--check", "--memory-limit-schedule", "1:0.5,3:none"
    )
    s = res.summary
    assert s["finished"] == s["requests"] == 60
    assert 0 < s["mapped_gib_mean"] <= s["mapped_gib_peak"] <= s["reserved_gib"]
    assert s["page_maps"] > 2 and s["page_unmaps"] > 0, "pages were mapped on use and given back"
    assert [c["gib"] for c in s["limit_changes"]] == [0.5, None]
    squeezed = [
        r for r in res.timeline if 1.05 <= r.time_s < 3
    ]  # applied at the first step from 1 s
    assert squeezed and all(r.limit_gib == pytest.approx(2 * 0.5, abs=0.13) for r in squeezed)
    after = [r.mapped_gib for r in res.timeline if r.time_s > 1.5 and r.time_s < 3]
    before = max(r.mapped_gib for r in res.timeline if r.time_s < 1)
    assert not after or min(after) <= before, "the squeeze gave memory back"
    lifted = [r for r in res.timeline if r.time_s >= 3.05]
    assert all(r.limit_gib == pytest.approx(s["reserved_gib"]) for r in lifted)
    assert res.config["xtensor"]["blocks_per_page"] == default_page_bytes(32) // (2 << 20) == 64


def test_elastic_pages_change_memory_not_scheduling():
    """With no limit, the pool on elastic pages admits, evicts and hits exactly as the plain one:
    num_available_blocks counts the unmapped range (the pool's accounting is unchanged)."""
    plain = simulate(*SMALL).summary
    elastic = simulate(*SMALL, "--xtensor").summary
    for key in ("prefix_hit_rate", "preemptions", "evictions", "steps", "ttft_s_mean"):
        assert plain[key] == elastic[key], key
    assert "mapped_gib_mean" not in plain
    assert elastic["mapped_gib_mean"] < elastic["mapped_gib_peak"] <= elastic["reserved_gib"], (
        "pages are mapped as the load (and the cache) grows, not up front"
    )


def test_a_tight_limit_trades_hits_for_memory():
    free = simulate(*SMALL, "--xtensor").summary
    tight = simulate(*SMALL, "--xtensor", "--memory-limit-gib", "1").summary
    assert tight["mapped_gib_peak"] <= max(1.0, tight["limit_excess_gib_peak"] + 1.0) + 1e-9
    assert tight["mapped_gib_mean"] < free["mapped_gib_mean"]
    assert tight["evictions"] >= free["evictions"]


def test_request_order_and_the_mooncake_fixture():
    res = simulate(
        "--trace",
        str(MOONCAKE),
        "--order",
        "request",
        "--model",
        "llama3-8b",
        "--cache-tokens",
        "1M",
        "--xtensor",
        "--memory-limit-schedule",
        "100:12",
        "--no-progress",
    )
    s = res.summary
    assert s["finished"] == 300 and 0 < s["mapped_gib_mean"] <= s["mapped_gib_peak"]
    assert s["limit_changes"] and s["limit_changes"][0]["gib"] == 12.0
    assert s["mapped_gib_final"] <= 12.0 + 1e-9, (
        "request order holds nothing at the end: the limit holds"
    )


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", COLUMNS="160")
    return subprocess.run(
        [sys.executable, "-m", "kvpool", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


def test_cli_table_plot_and_sweep(tmp_path: Path):
    png = tmp_path / "elastic.png"
    p = _run(*SMALL, "--xtensor", "--memory-limit-gib", "2", "--plot", str(png))
    assert p.returncode == 0, p.stderr
    assert "mapped memory" in p.stdout and "memory limit" in p.stdout and "2 GiB" in p.stdout
    assert png.stat().st_size > 10_000
    p = _run(*SMALL, "--xtensor", "--sweep", "memory_limit_gib=1,4")
    assert p.returncode == 0, p.stderr
    assert "mapped GiB" in p.stdout and "memory_limit_gib=1" in p.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--page-mib", "4"], "--page-mib go(es) with --xtensor"),
        (["--memory-limit-schedule", "5:1"], "--memory-limit-schedule go(es) with --xtensor"),
        (["--xtensor", "--memory-limit-schedule", "5"], "--memory-limit-schedule: expected T:GIB"),
        (
            ["--xtensor", "--memory-limit-schedule", "9:1,5:1"],
            "--memory-limit-schedule: times must increase",
        ),
        (["--xtensor", "--page-mib", "1"], "--page-mib: a page of 1 MiB holds no block"),
        (["--xtensor", "--memory-limit-gib", "0"], "--memory-limit-gib"),
        (["--xtensor", "--host-blocks", "64"], "host tier"),
    ],
)
def test_bad_arguments_name_themselves(args, needle):
    p = _run(*SMALL, *args)
    assert p.returncode == 2, p.stdout
    assert "Traceback" not in p.stderr and needle in p.stderr, p.stderr


def test_xtensor_needs_a_model_shape():
    p = _run("-n", "5", "--xtensor", "--no-progress")
    assert p.returncode == 2 and "--xtensor sizes pages in bytes" in p.stderr, p.stderr


def test_limit_bytes_per_rank():
    cfg, extra = configure.make_config(
        cli.build_parser().parse_args(SMALL + ["--xtensor", "--memory-limit-gib", "1.5"])
    )
    assert cfg.xtensor["memory_limit"] == int(1.5 * GIB) and extra["xtensor_page_mib"] == 128


def test_a_limit_below_one_request_fails_cleanly():
    p = _run(*SMALL, "--xtensor", "--memory-limit-gib", "0.3")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "cannot be admitted" in p.stderr and "memory limit of 0.25 GiB" in p.stderr, p.stderr
