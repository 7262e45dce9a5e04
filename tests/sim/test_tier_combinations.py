"""`kvpool simulate` with the host tier combined with linear state and sliding windows (the
pools compose, so the simulator accepts every combination and reports host loads, offloads
and checkpoint hits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvpool.sim import generate
from kvpool.sim.engine import SimConfig, Simulator

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["-n", "60", "--max-prompt-len", "512", "--output-len", "16", "-w", "chat"]


def simulate(*args: str) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", COLUMNS="120")
    p = subprocess.run(
        [sys.executable, "-m", "kvpool", "simulate", *SMALL, *args, "--check", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["summary"]


def test_host_tier_with_linear_state_runs_and_reports_loads_offloads_and_checkpoint_hits():
    s = simulate(
        "--num-blocks",
        "128",
        "--host-blocks",
        "512",
        "--linear-state-slots",
        "64",
        "--checkpoint-interval",
        "64",
    )
    assert s["host_loads"] > 0 and s["host_offloads"] > 0 and s["checkpoint_hits"] > 0, s


def test_host_tier_with_a_sliding_window_runs_and_reports_loads_and_offloads():
    s = simulate("--num-blocks", "128", "--host-blocks", "512", "--sliding-window", "64")
    assert s["host_loads"] > 0 and s["host_offloads"] > 0, s


def test_the_text_report_names_the_tier_rows():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", COLUMNS="160")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpool",
            "simulate",
            *SMALL,
            "--num-blocks",
            "128",
            "--host-blocks",
            "512",
            "--linear-state-slots",
            "64",
            "--checkpoint-interval",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    for row in ("host loads", "host offloads", "checkpoint hits"):
        assert row in p.stdout, p.stdout


@pytest.mark.parametrize(
    "options",
    [
        {"linear_state_slots": 32, "checkpoint_interval": 32, "dp_size": 2},
        {"sliding_window": 64, "swa_num_blocks": 256, "dp_size": 2},
        {"sliding_window": 64, "linear_state_slots": 32, "checkpoint_interval": 32},
    ],
    ids=["dp+linear", "dp+window", "window+linear"],
)
def test_every_combination_with_the_host_tier_keeps_the_simulator_checks(options):
    cfg = SimConfig(num_blocks=96, block_size=16, host_num_blocks=384, check=True, **options)
    requests = generate("chat", 40, seed=3, max_prompt_len=512, output_len=16)
    summary = Simulator(cfg, requests).run().summary
    assert summary["host_offloads"] > 0, summary
