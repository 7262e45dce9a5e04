"""benches/hybrid_bench.py, vLLM's side: every config on a tiny written Mooncake-format trace,
checked (hits within the shared prefix, nothing held after ``free``, a clean reset), with vLLM's
own manager and kvpool's drop-in (``--managers drop-in``: kvpool's Scheduler and manager, the
same calls).

Skipped unless vLLM 0.33.0 or 0.34.0 is installed (``make test-vllm`` runs both).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

try:
    _FOUND = importlib.metadata.version("vllm").split("+")[0]
except importlib.metadata.PackageNotFoundError:
    _FOUND = None
if _FOUND not in ("0.33.0", "0.34.0"):  # the bench measures vLLM's own hybrid manager (issue 33)
    pytest.skip(
        f"needs vLLM 0.33.0 or 0.34.0 (found {_FOUND}): make test-vllm", allow_module_level=True
    )

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT / "benches"))
sys.path.insert(0, str(_ROOT / "tests" / "benches"))
import hybrid_bench as hb  # noqa: E402
from test_hybrid_bench import write_trace  # noqa: E402


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    trace = write_trace(path, 100, seed=5)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert (
            hb.main(
                [
                    "--trace",
                    str(path),
                    "--requests",
                    "100",
                    "--sizes",
                    "100k,10M",
                    "--check",
                    "--check-every",
                    "10",
                    "--json",
                ]
            )
            == 0
        )
    return json.loads(buf.getvalue()), trace


def test_every_config_runs_on_the_resolved_vllm_config(doc):
    d, _ = doc
    got = {(r["config"], r["size"], r["manager"]): r for r in d["results"]}
    for size, tokens in (("100k", 100_000), ("10M", 10_000_000)):
        assert got[("full", size, "vllm")]["vllm_num_blocks"] == tokens // 16
        for name in ("w1024", "w128", "w1024-dense"):
            r = got[(name, size, "vllm")]
            assert (r["vllm_num_blocks"], r["vllm_block_size"], r["vllm_hash_block_size"]) == (
                2 * tokens // 16,
                16,
                16,
            )
        r = got[("ls512", size, "vllm")]
        assert (r["vllm_num_blocks"], r["vllm_block_size"], r["vllm_hash_block_size"]) == (
            2 * tokens // 544,
            544,
            544,
        )
        assert r["chunks_per_request"] > 1  # the Scheduler's Mamba split cut the prefills
        assert got[("w1024", size, "vllm")]["vllm_retention_interval"] == 0
        assert got[("w1024-dense", size, "vllm")]["vllm_retention_interval"] is None
    assert ("ls2048", "10M", "vllm") not in got and ("w1024-dense", "10M", "kvpool") not in got
    # the drop-in takes vLLM's full, window, chunked and Mamba ("align") configs: vLLM's very
    # config (its block count and block size)
    for name in ("full", "w1024", "w128", "w1024-dense", "c8192", "ls512"):
        r, v = got[(name, "10M", "drop-in")], got[(name, "10M", "vllm")]
        assert (r["vllm_num_blocks"], r["vllm_block_size"]) == (
            v["vllm_num_blocks"],
            v["vllm_block_size"],
        )


def test_unbounded_hits(doc):
    d, trace = doc
    got = {(r["config"], r["size"], r["manager"]): r["hit_tokens"] for r in d["results"]}
    oracle = hb.PrefixOracle()
    full = sum(
        (min(oracle.bound_and_add(np.asarray(ids), n), n - 1) // 16) * 16 for ids, n in trace
    )
    # both managers serve every shared full block when nothing is evicted
    assert got[("full", "10M", "vllm")] == got[("full", "10M", "kvpool")] == full > 0
    # keeping every window block, a window hit is the full-attention hit
    assert got[("w1024-dense", "10M", "vllm")] == full
    for name in ("w1024", "w128", "ls512"):
        assert 0 < got[(name, "10M", "vllm")] <= full
        assert got[(name, "100k", "vllm")] <= got[("full", "10M", "vllm")]


def test_the_drop_in_hits_at_least_as_much_as_vllm(doc):
    """Issue 33's binding target on the tiny trace: kvpool's vLLM manager serves at least vLLM's
    own hits in every config and size, and (nothing evicted) every window config serves the
    full-attention hit, which vLLM's sparse window retention does not."""
    d, _ = doc
    got = {(r["config"], r["size"], r["manager"]): r["hit_tokens"] for r in d["results"]}
    for name in ("full", "w1024", "w128", "w1024-dense", "c8192", "ls512"):
        for size in ("100k", "10M"):
            assert got[(name, size, "drop-in")] >= got[(name, size, "vllm")], (name, size)
    for name in ("full", "w1024", "w128", "w1024-dense", "c8192"):
        assert got[(name, "10M", "drop-in")] == got[("full", "10M", "vllm")]
    assert got[("w128", "10M", "drop-in")] > got[("w128", "10M", "vllm")]
    # Mamba: states at the boundaries prefill chunks end on (the Scheduler's), as vLLM's
    assert got[("ls512", "10M", "drop-in")] == got[("ls512", "10M", "vllm")] > 0
