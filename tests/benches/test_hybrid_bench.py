"""benches/hybrid_bench.py, kvpool's side: the oracle, the options, and tiny runs on a written
Mooncake-format trace (vLLM's side: tests/vllm/test_hybrid_bench_vllm.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
import hybrid_bench as hb  # noqa: E402


def write_trace(path: Path, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Chats on a few shared system prompts, Mooncake's format: each turn resends the history's
    ids and adds new ones; the last id covers a partial block."""
    rng = np.random.default_rng(seed)
    systems = [[10 * k + j for j in range(int(rng.integers(1, 4)))] for k in range(3)]
    next_id = 1000
    out: list[tuple[list[int], int]] = []
    while len(out) < n:
        ids = list(systems[int(rng.integers(3))])
        for _ in range(int(rng.integers(1, 5))):
            new = int(rng.integers(1, 4))
            ids = ids + list(range(next_id, next_id + new))
            next_id += new
            length = 512 * (len(ids) - 1) + int(rng.integers(1, 513))
            out.append((list(ids), length))
            if len(out) == n:
                break
    with open(path, "w") as f:
        for ids, length in out:
            f.write(
                json.dumps(
                    {"timestamp": 0, "input_length": length, "output_length": 1, "hash_ids": ids}
                )
                + "\n"
            )
    return out


def brute_bound(trace, i: int) -> int:
    """The longest token prefix request i shares with an earlier one, from the tokens."""
    ids, length = trace[i]
    mine = hb.prompt_tokens(np.asarray(ids), length)
    best = 0
    for other_ids, other_len in trace[:i]:
        theirs = hb.prompt_tokens(np.asarray(other_ids), other_len)
        m = min(len(mine), len(theirs))
        diff = np.nonzero(mine[:m] != theirs[:m])[0]
        best = max(best, int(diff[0]) if len(diff) else m)
    return best


def test_oracle_is_the_longest_shared_prefix(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", 80, seed=3)
    oracle = hb.PrefixOracle()
    for i, (ids, length) in enumerate(trace):
        assert oracle.bound_and_add(np.asarray(ids), length) == brute_bound(trace, i), i


def test_tokens_of_a_hash_id():
    toks = hb.prompt_tokens(np.asarray([0, 7]), 515)
    assert toks[:3].tolist() == [0, 1, 2] and toks[512:].tolist() == [
        7 * 512,
        7 * 512 + 1,
        7 * 512 + 2,
    ]


def test_sizes_and_expressions():
    assert hb.parse_size("1M") == 1_000_000 and hb.parse_size("16M") == 16_000_000
    assert hb.parse_size("2.5k") == 2500 and hb.size_label(4_000_000) == "4M"
    assert hb.eval_expr("2*C//BS + (PAGE % 7)", {"C": 160, "BS": 16, "PAGE": 544}) == 20 + 544 % 7
    for bad in ("__import__('os')", "C.real", "[1]", "X"):
        with pytest.raises(ValueError, match="option expression"):
            hb.eval_expr(bad, {"C": 1})


def test_options_scope_by_kind_and_name():
    opts = {
        "enable_events": True,
        "window": {"num_blocks": "=2*C//BS", "swa_num_blocks": None},
        "w128": {"sliding_window": 256},
        "linear": {"linear_state_slots": "=C//PAGE//2"},
    }
    c = 1_000_000
    assert hb.kvpool_kwargs(hb.CONFIGS["full"], c, opts) == {
        "num_blocks": 62500,
        "enable_events": True,
    }
    assert hb.kvpool_kwargs(hb.CONFIGS["w1024"], c, opts) == {
        "num_blocks": 125000,
        "sliding_window": 1024,
        "enable_events": True,
    }
    assert hb.kvpool_kwargs(hb.CONFIGS["w128"], c, opts)["sliding_window"] == 256
    # by default the window shares one store of 2C/16 blocks; the "split" preset gives each group
    # its own C/16
    assert hb.kvpool_kwargs(hb.CONFIGS["w1024"], c, {}) == {
        "num_blocks": 125000,
        "sliding_window": 1024,
    }
    assert hb.kvpool_kwargs(hb.CONFIGS["w1024"], c, hb.PRESETS["split"]) == {
        "num_blocks": 62500,
        "sliding_window": 1024,
        "swa_num_blocks": 62500,
    }
    assert hb.kvpool_kwargs(hb.CONFIGS["ls512"], c, opts)["linear_state_slots"] == c // 544 // 2
    # linear state: one store of 2C/16 blocks, a state taking 34 of them; "linear-split" gives the
    # slots a store of their own beside C/16 blocks
    assert hb.kvpool_kwargs(hb.CONFIGS["ls512"], c, {}) == {
        "num_blocks": 125000,
        "linear_state_slots": 2 * c // 544,
        "linear_state_blocks": 34,
        "checkpoint_interval": 512,
    }
    assert hb.kvpool_kwargs(hb.CONFIGS["ls512"], c, hb.PRESETS["linear-split"]) == {
        "num_blocks": 62500,
        "linear_state_slots": c // 544,
        "checkpoint_interval": 512,
    }
    # a config with no kvpool counterpart runs kvpool only when the options name it
    assert not hb.runs_on(hb.CONFIGS["w1024-dense"], "kvpool", opts)
    assert hb.runs_on(hb.CONFIGS["w1024-dense"], "kvpool", {"w1024-dense": {}})
    assert not hb.runs_on(hb.CONFIGS["ls2048"], "vllm", opts)


def run(argv, capsys) -> dict:
    assert hb.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_kvpool_runs_checked_and_full_attention_matches_the_oracle(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    trace = write_trace(path, 120, seed=1)
    doc = run(
        [
            "--trace",
            str(path),
            "--managers",
            "kvpool",
            "--requests",
            "120",
            "--sizes",
            "20k,10M",
            "--check",
            "--check-every",
            "7",
        ],
        capsys,
    )
    got = {(r["config"], r["size"]): r for r in doc["results"]}
    assert set(got) == {
        (c, s)
        for c in ("full", "w1024", "w128", "c8192", "ls512", "ls2048")
        for s in ("20k", "10M")
    }
    assert all(r["checks"] >= 120 // 7 for r in doc["results"])
    # an unbounded full-attention cache serves exactly the shared full blocks (last token recomputed)
    oracle = hb.PrefixOracle()
    want = sum(
        (min(oracle.bound_and_add(np.asarray(ids), n), n - 1) // 16) * 16 for ids, n in trace
    )
    assert got[("full", "10M")]["hit_tokens"] == want > 0
    assert got[("full", "20k")]["hit_tokens"] < want
    for name in (
        "w1024",
        "w128",
        "c8192",
        "ls512",
        "ls2048",
    ):  # a hybrid never serves more than full attention
        assert 0 < got[(name, "10M")]["hit_tokens"] <= want
    assert got[("ls512", "10M")]["kvpool_kwargs"] == {
        "num_blocks": 1_250_000,
        "linear_state_slots": 2 * 10_000_000 // 544,
        "linear_state_blocks": 34,
        "checkpoint_interval": 512,
    }
    # the tables render from the JSON document
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    assert hb.main(["--render", str(tmp_path / "doc.json")]) == 0
    table = capsys.readouterr().out
    assert "| full attention only |" in table and "## " + str(path) + ", cache 10M tokens" in table


def test_kvpool_jobs_in_processes_give_the_same_hits(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, 60, seed=2)
    argv = [
        "--trace",
        str(path),
        "--managers",
        "kvpool",
        "--requests",
        "60",
        "--sizes",
        "30k",
        "--configs",
        "full,ls2048",
    ]
    one = run(argv, capsys)
    two = run([*argv, "--jobs", "2"], capsys)
    assert [r["hit_tokens"] for r in one["results"]] == [r["hit_tokens"] for r in two["results"]]


def test_bad_options_fail_before_any_run(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, 5)
    with pytest.raises(SystemExit):
        hb.main(
            [
                "--trace",
                str(path),
                "--managers",
                "kvpool",
                "--kvpool-options",
                '{"no_such_option": 1}',
            ]
        )
    assert "no_such_option" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        hb.main(["--trace", str(path), "--configs", "full,w64"])
