"""`kvpool simulate` end to end, through a subprocess (`python -m kvpool`).

With ``--remote``, two simulator processes share one real redis-server on loopback
(tests/tiers/redis_helpers.py, never a mock).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kvpool
import pytest
from redis_helpers import RedisServer  # tests/tiers/, on the path through tests/conftest.py

pytestmark = pytest.mark.skipif(not hasattr(kvpool, "BlockManagerPool"), reason="pool not built")

ROOT = Path(__file__).resolve().parents[2]

TRACES = ROOT / "examples" / "traces"
SMALL = ["-n", "40", "--max-prompt-len", "512", "--output-len", "16"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", COLUMNS="120")
    return subprocess.run(
        [sys.executable, "-m", "kvpool", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def assert_clean_failure(p: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    for n in needles:
        assert n in p.stderr, p.stderr


def test_default_run() -> None:
    p = run("simulate", timeout=240)
    assert p.returncode == 0, p.stderr
    for row in (
        "requests",
        "prefix hit rate",
        "peak usage",
        "preemptions",
        "evictions",
        "scheduler overhead",
    ):
        assert row in p.stdout
    assert "5,000 / 5,000" in p.stdout


def test_trace_runs() -> None:
    for trace in sorted(TRACES.glob("*.jsonl")):
        p = run("simulate", "--trace", str(trace), "--check")
        assert p.returncode == 0, p.stderr
        assert "trace" in p.stdout and "prefix hit rate" in p.stdout


def test_json_schema(tmp_path: Path) -> None:
    p = run("simulate", *SMALL, "--json", "--timeline", "--save-trace", str(tmp_path / "w.jsonl"))
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert set(d) >= {"config", "summary", "execute", "timeline"}
    s = d["summary"]
    for key, typ in [
        ("requests", int),
        ("finished", int),
        ("prompt_tokens", int),
        ("output_tokens", int),
        ("prefix_hit_rate", float),
        ("peak_usage", float),
        ("mean_usage", float),
        ("preemptions", int),
        ("evictions", int),
        ("host_loads", int),
        ("host_offloads", int),
        ("checkpoint_hits", int),
        ("sched_us_per_step_mean", float),
        ("steps", int),
    ]:
        assert isinstance(s[key], typ), key
    assert s["finished"] == s["requests"] == 40
    assert d["config"]["num_blocks"] == 6144 and d["config"]["workload"] == "mixed"
    assert d["execute"] is None
    assert len(d["timeline"]) == s["steps"] and {"usage", "running", "waiting", "hit_rate"} <= set(
        d["timeline"][0]
    )
    # the saved workload replays to the same result
    q = run("simulate", "--trace", str(tmp_path / "w.jsonl"), "--json")
    assert q.returncode == 0, q.stderr
    assert json.loads(q.stdout)["summary"]["prefix_hit_tokens"] == s["prefix_hit_tokens"]


def test_plot_writes_png(tmp_path: Path) -> None:
    out = tmp_path / "sim.png"
    p = run("simulate", *SMALL, "--plot", str(out))
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


def test_execute_cpu_backend() -> None:
    p = run(
        "simulate",
        "-w",
        "system_prompt",
        "-n",
        "8",
        "--max-prompt-len",
        "256",
        "--output-len",
        "8",
        "--num-blocks",
        "256",
        "--execute",
        "--backend",
        "numpy",
        "--check-every",
        "4",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    e = json.loads(p.stdout)["execute"]
    assert e["backend"] == "numpy" and e["ok"] and e["checked_sequences"] > 0
    assert e["max_abs_error"] < 1e-3


def test_sweep_table_and_json() -> None:
    p = run("simulate", *SMALL, "--sweep", "num_blocks=300,2000", "--sweep", "block_size=8,32")
    assert p.returncode == 0, p.stderr
    assert "num_blocks=300 block_size=8" in p.stdout and "num_blocks=2000 block_size=32" in p.stdout
    q = run("simulate", *SMALL, "--sweep", "prefix_cache=on,off", "--json")
    d = json.loads(q.stdout)["sweep"]
    assert [x["label"] for x in d] == ["prefix_cache=on", "prefix_cache=off"]
    assert d[1]["summary"]["prefix_hit_tokens"] == 0 < d[0]["summary"]["prefix_hit_tokens"]


def test_capacity_from_model_shape() -> None:
    p = run("simulate", *SMALL, "--gib", "2", "--model", "llama3-8b", "--json")
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)["config"]
    # llama3-8b: 2 (K,V) * 32 layers * 8 heads * 128 dims * 2 bytes * 16 tokens = 2 MiB per block
    assert c["num_blocks"] == 1024 and c["model"]["bytes_per_block"] == 2 << 20


def test_dp_and_no_prefix_cache() -> None:
    p = run("simulate", *SMALL, "--dp", "2", "--no-prefix-cache", "--check", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)["summary"]
    assert s["prefix_hit_tokens"] == 0 and s["finished"] == 40


# ---------------------------------------------------------------- bad input


def test_bad_trace_line(tmp_path: Path) -> None:
    t = tmp_path / "bad.jsonl"
    t.write_text('{"prompt_len": 100, "output_len": 4}\n{"prompt_len": 100, oops}\n')
    assert_clean_failure(run("simulate", "--trace", str(t)), f"{t}:2", "not valid JSON")
    t.write_text('{"prompt_len": 100}\n')
    assert_clean_failure(run("simulate", "--trace", str(t)), f"{t}:1", "output_len")


def test_missing_trace() -> None:
    assert_clean_failure(run("simulate", "--trace", "/no/such/trace.jsonl"), "cannot read trace")


def test_request_longer_than_cache(tmp_path: Path) -> None:
    t = tmp_path / "long.jsonl"
    t.write_text('{"prompt_len": 5000, "output_len": 10}\n')
    assert_clean_failure(
        run("simulate", "--trace", str(t), "--num-blocks", "64"), "request 0 needs 5009 tokens"
    )


def test_impossible_configurations() -> None:
    assert_clean_failure(run("simulate", "--num-blocks", "1", "-n", "2"), "num_blocks")
    assert_clean_failure(run("simulate", "--gib", "1"), "model shape")
    assert_clean_failure(
        run("simulate", "--gib", "1", "--num-blocks", "9", "--model", "llama3-8b"), "not both"
    )
    assert_clean_failure(run("simulate", "--gib", "0.001", "--model", "llama3-70b"), "too small")
    assert_clean_failure(run("simulate", "--checkpoint-interval", "64"), "linear_state_slots")


def test_unknown_options() -> None:
    assert_clean_failure(run("simulate", "--bogus"), "unrecognized arguments")
    assert_clean_failure(run("simulate", "--workload", "nope"), "invalid choice")
    assert_clean_failure(run("simulate", "--num-blocks", "ten"), "expected an integer")
    assert_clean_failure(run("simulate", "--sweep", "colour=1,2"), "unknown key")
    assert_clean_failure(run("simulate", "--sweep", "num_blocks"), "KEY=V1,V2")
    assert_clean_failure(run("frobnicate"), "unknown command")


def test_hybrid_and_host_options_run() -> None:
    """The options for hybrid models and the host tier run end to end."""
    cases = [
        (
            ["--linear-state-slots", "64", "--checkpoint-interval", "64", "-w", "chat"],
            "checkpoint_hits",
        ),
        (["--sliding-window", "256", "-w", "chat"], "prefix_hit_rate"),
        (["--attention-chunk-size", "256", "-w", "chat"], "prefix_hit_rate"),
        (["--host-blocks", "512", "--num-blocks", "128", "-w", "chat"], "host_loads"),
    ]
    for args, key in cases:
        p = run("simulate", *SMALL, *args, "--check", "--json")
        assert p.returncode == 0, p.stderr
        summary = json.loads(p.stdout)["summary"]
        assert summary[key] > 0, (args, summary)


def test_linear_state_in_the_one_store_reports_each_groups_memory() -> None:
    args = [
        "--linear-state-slots",
        "64",
        "--linear-state-blocks",
        "4",
        "--checkpoint-interval",
        "64",
    ]
    p = run("simulate", *SMALL, *args, "-w", "chat", "--check", "--json")
    assert p.returncode == 0, p.stderr
    memory = json.loads(p.stdout)["summary"]["group_memory"]
    assert memory["linear_used_blocks"] >= 4 * memory["linear_state_slots_in_use"] > 0
    p = run("simulate", *SMALL, *args, "-w", "chat")
    assert p.returncode == 0, p.stderr
    assert "memory: linear state" in p.stdout and "memory: full attention" in p.stdout
    p = run("simulate", *SMALL, "--linear-state-blocks", "4")
    assert_clean_failure(p, "linear_state_blocks")


def test_a_configuration_the_pool_rejects_fails_cleanly() -> None:
    # The host tier composes with linear state (tests/sim/test_tier_combinations.py);
    # what the pool rejects is still a clean failure naming the option.
    p = run("simulate", *SMALL, "--host-blocks", "1", "--linear-state-slots", "32")
    assert_clean_failure(p, "host_num_blocks")


def test_help() -> None:
    p = run("simulate", "--help")
    assert p.returncode == 0 and "--sweep" in p.stdout and "--execute" in p.stdout
    p = run("--help")
    assert p.returncode == 0 and "simulate" in p.stdout


def test_two_simulators_share_prefixes_through_a_remote_redis() -> None:
    """The remote tier's promise: "two simulator processes sharing one Redis show the second one hitting prefixes
    the first one computed (reported in its summary)". The second run replays the same workload
    (same seed) after the first exited, so everything it finds remotely was written by the first."""
    server = RedisServer()
    server.start()
    try:
        args = (
            "simulate",
            "-w",
            "chat",
            "-n",
            "30",
            "--max-prompt-len",
            "512",
            "--output-len",
            "16",
            "--host-blocks",
            "256",
            "--num-blocks",
            "128",
            "--remote",
            server.url,
            "--json",
            "--no-progress",
        )
        summaries = []
        for _ in range(2):
            p = run(*args, timeout=120)
            assert p.returncode == 0, p.stderr
            assert "Traceback" not in p.stderr, p.stderr
            summaries.append(json.loads(p.stdout)["summary"])
        import redis

        client = redis.Redis.from_url(server.url, socket_timeout=5)
        try:
            stored = int(client.dbsize())
        finally:
            client.close()
    finally:
        server.stop()
    first, second = summaries
    for s in summaries:
        assert s["finished"] == s["requests"] == 30
        assert s["remote_errors"] == 0 and s["remote_failed_blocks"] == 0
    assert first["remote_hit_blocks"] == first["remote_fetched_blocks"] == 0, (
        "the store starts empty"
    )
    assert first["remote_puts"] > 0 and stored == first["remote_puts"], (
        "write-through of what it computed"
    )
    assert second["remote_hit_blocks"] > 0 and second["remote_fetched_blocks"] > 0, (
        "hits the first's prefixes"
    )
    assert second["remote_puts"] < first["remote_puts"], "blocks already stored are not sent again"
    assert second["admitted_cached_tokens"] > first["admitted_cached_tokens"]
    assert second["prefill_tokens_computed"] < first["prefill_tokens_computed"]


def test_plot_without_matplotlib_is_one_line(tmp_path: Path) -> None:
    """matplotlib is only for --plot: without it the command says how to get it."""
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = dict(os.environ, PYTHONPATH=str(fake.parent), COLUMNS="120")
    p = subprocess.run(
        [sys.executable, "-m", "kvpool", "simulate", "-n", "5", "--plot", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "pip install matplotlib" in p.stderr
    q = subprocess.run(
        [sys.executable, "-m", "kvpool", "simulate", "-n", "5"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert q.returncode == 0 and "5 / 5" in q.stdout, q.stderr
