"""kvpool simulate on the production-trace fixtures: request order against an LRU model,
exact sharing at kvpool block sizes, capacity in tokens, the parallel sweep and its figure, time
in seconds, and the batch-API scheduler loop under check mode."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import kvpool
import numpy as np
import pytest
from kvpool.sim.workloads import Request, load_trace

pytestmark = pytest.mark.skipif(not hasattr(kvpool, "BlockManagerPool"), reason="pool not built")

from kvpool.sim.capacity import MODELS  # noqa: E402
from kvpool.sim.engine import SimConfig, run_simulation  # noqa: E402
from kvpool.sim.timing import GPUS, FixedStepTime, Roofline, StepWork, chunk_work  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
MOONCAKE = FIXTURES / "mooncake_conversation_300.jsonl"
BAILIAN = FIXTURES / "bailian_synthetic.jsonl"


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", COLUMNS="160")
    return subprocess.run(
        [sys.executable, "-m", "kvpool", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def lru_model(prompts: list[np.ndarray], capacity_tokens: int, bs: int) -> tuple[int, int]:
    """Hit and looked-up tokens of an LRU cache of full blocks, requests one at a time in order.

    A block is keyed by a digest of its whole prefix. A request looks up its full blocks but the
    last token's (R8: one token is always computed), takes the longest cached run, then needs
    room for all its blocks (the partial one too) while it runs: least recently used blocks go
    until it fits. Released, its full blocks become the newest, deepest first (so the oldest
    block is always a leaf, R10/R11).
    """
    cap = capacity_tokens // bs
    lru: OrderedDict[bytes, None] = OrderedDict()
    hit = query = 0
    for toks in prompts:
        n, raw = len(toks), toks.astype("<u4").tobytes()
        keys, key = [], b""
        for i in range(n // bs):
            key = hashlib.blake2b(key + raw[4 * i * bs : 4 * (i + 1) * bs], digest_size=16).digest()
            keys.append(key)
        look = (n - 1) // bs
        h = 0
        while h < look and keys[h] in lru:
            h += 1
        assert not (n % bs == 0 and h == look and keys[-1] in lru), (
            "a duplicate publication: not modelled"
        )
        hit, query = hit + h * bs, query + look * bs
        for k in keys[:h]:
            del lru[k]  # held while the request runs
        while cap - len(lru) - h < -(-n // bs) - h:
            lru.popitem(last=False)
        for k in reversed(keys):
            lru[k] = None
            lru.move_to_end(k)
    return hit, query


@pytest.mark.parametrize("capacity", [300_000, 1_000_000, 2_000_000])
def test_request_order_equals_an_lru_model(capacity: int) -> None:
    """The issue's acceptance check: --order request on the conversation fixture gives the hit
    rate of a few-line LRU model (blocks in request order, capacity in tokens)."""
    p = run(
        "--trace", str(MOONCAKE), "--order", "request", "--cache-tokens", str(capacity), "--json"
    )
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)["summary"]
    hit, query = lru_model([r.prompt_tokens() for r in load_trace(MOONCAKE)], capacity, 16)
    assert (s["prefix_hit_tokens"], s["prefix_query_tokens"]) == (hit, query)
    assert s["prefix_hit_rate"] == pytest.approx(hit / query)
    assert s["admitted_cached_tokens"] == hit and s["finished"] == 300
    assert s["evictions"] > 0


def _trace_prefix_hits(reqs: list[Request], bs: int) -> int:
    """Hit tokens of an infinite cache, from the trace's ids alone: a request shares with an
    earlier one min(L_a, L_b, (leading equal ids) * 512) tokens; kvpool gets the longest such
    prefix rounded down to its block size, one token always computed (R8)."""
    total = 0
    seen: list[tuple[np.ndarray, int]] = []
    for r in reqs:
        ids, n = r.prompt.hash_ids, r.prompt_len
        best = 0
        for other, m in seen:
            k = min(len(ids), len(other))
            neq = np.flatnonzero(ids[:k] != other[:k])
            equal = int(neq[0]) if len(neq) else k
            best = max(best, min(n, m, equal * 512))
        total += min(best // bs, (n - 1) // bs) * bs
        seen.append((ids, n))
    return total


@pytest.mark.parametrize("bs", [16, 128, 512, 48, 1024])
def test_sharing_is_exact_at_block_sizes_dividing_the_trace_blocks(bs: int) -> None:
    """16, 128, 512 divide Mooncake's 512: kvpool finds exactly the trace's shared prefixes; 48
    and 1024 do not: the shared prefix is rounded down to a multiple of the block size."""
    reqs = load_trace(MOONCAKE)
    cfg = SimConfig(
        num_blocks=sum(-(-r.prompt_len // bs) for r in reqs) + 1,
        block_size=bs,
        order="request",
        check=True,
    )
    summary = run_simulation(cfg, reqs).summary
    assert summary["evictions"] == 0
    assert summary["prefix_hit_tokens"] == _trace_prefix_hits(reqs, bs)


def test_cache_tokens_sizes_the_cache() -> None:
    p = run(
        "--trace",
        str(MOONCAKE),
        "--order",
        "request",
        "--cache-tokens",
        "3M",
        "--block-size",
        "32",
        "--host-cache-tokens",
        "1e6",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)["config"]
    assert c["num_blocks"] == 3_000_000 // 32 + 1 and c["capacity_tokens_per_rank"] == 3_000_000
    assert c["host_num_blocks"] == 1_000_000 // 32 + 1
    q = run("--trace", str(MOONCAKE), "--order", "request", "--cache-tokens", "inf", "--json")
    s = json.loads(q.stdout)["summary"]
    assert s["evictions"] == 0 and s["prefix_hit_tokens"] == _trace_prefix_hits(
        load_trace(MOONCAKE), 16
    )
    for bad, msg in [
        (["--cache-tokens", "1M", "--num-blocks", "99"], "not both"),
        (["--cache-tokens", "lots"], "expected a token count"),
        (["--cache-tokens", "1e5"], "request 97 needs 121212 tokens"),
    ]:
        r = run("--trace", str(MOONCAKE), *bad)
        assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_parallel_sweep_draws_the_capacity_curve(tmp_path: Path) -> None:
    png = tmp_path / "capacity.png"
    p = run(
        "--trace",
        str(MOONCAKE),
        "--order",
        "request",
        "--sweep",
        "cache_tokens=300k,2M,inf",
        "--jobs",
        "2",
        "--plot",
        str(png),
        "--json",
    )
    assert p.returncode == 0, p.stderr
    sweep = json.loads(p.stdout)["sweep"]
    assert [x["label"] for x in sweep] == [
        "cache_tokens=300k",
        "cache_tokens=2M",
        "cache_tokens=inf",
    ]
    rates = [x["summary"]["cached_token_fraction"] for x in sweep]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    assert sweep[-1]["summary"]["evictions"] == 0
    # the same points, run here one by one, give the same numbers (the workers re-read the trace)
    for x in sweep[:2]:
        cap = x["config"]["capacity_tokens_per_rank"]
        hit, _ = lru_model([r.prompt_tokens() for r in load_trace(MOONCAKE)], cap, 16)
        assert x["summary"]["prefix_hit_tokens"] == hit
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # the table form, serving order, and a sweep --plot needs a capacity key
    t = run("--trace", str(BAILIAN), "--sweep", "cache_tokens=20k,inf", "-j", "2")
    assert t.returncode == 0, t.stderr
    assert (
        "cache_tokens=20k" in t.stdout and "cache_tokens=inf" in t.stdout and "TTFT s" in t.stdout
    )
    u = run("--trace", str(BAILIAN), "--sweep", "max_seqs=2,4", "--plot", str(png))
    assert u.returncode == 2 and "capacity" in u.stderr


def test_roofline_by_hand() -> None:
    shape, h200 = MODELS["llama3-8b"], GPUS["h200"]
    r = Roofline(shape, h200, mfu=0.5, mbu=0.8)
    # one decode over a 1,000-token context: memory bound (weights + the KV read once)
    kv = 2 * 32 * 8 * 128 * 2
    w = chunk_work(999, 1000)
    assert (w.tokens, w.attended, w.kv_read) == (1, 1000, 999)
    assert r.seconds(w) == pytest.approx((2 * 8.03e9 + kv * 1000) / (4.8e12 * 0.8))
    # an 8,192-token prefill from scratch: compute bound
    w = chunk_work(0, 8192)
    flops = 2 * 8.03e9 * 8192 + 4 * 32 * 32 * 128 * (8192 * 8193 // 2)
    assert r.seconds(w) == pytest.approx(flops / (989e12 * 0.5))
    assert Roofline(shape, h200, tp=2, mfu=0.5).seconds(w) == pytest.approx(r.seconds(w) / 2)
    assert Roofline(shape, GPUS["a100"], mfu=0.5).seconds(w) > Roofline(
        shape, GPUS["h100"], mfu=0.5
    ).seconds(w)
    assert r.seconds(StepWork()) == 0.0 and FixedStepTime(20).seconds(w) == 0.02
    with pytest.raises(ValueError, match="parameter count"):
        Roofline(shape.__class__(32, 8, 128), h200)
    with pytest.raises(ValueError, match="mfu"):
        Roofline(shape, h200, mfu=1.5)


def test_seconds_follow_the_step_time_model() -> None:
    """One request alone: TTFT is its prefill's roofline time, every later token one decode step."""
    shape = MODELS["llama3-8b"]
    cfg = SimConfig(
        num_blocks=2000, block_size=16, max_num_batched_tokens=8192, gpu="h100", model_shape=shape
    )
    req = Request(0, 0.0, np.arange(3000, dtype=np.int32), 4, arrival_s=5.0)
    s = run_simulation(cfg, [req]).summary
    r = Roofline(shape, GPUS["h100"])
    prefill = r.seconds(chunk_work(0, 3000))
    decodes = [r.seconds(chunk_work(p - 1, p)) for p in (3001, 3002, 3003)]
    assert s["ttft_s_mean"] == pytest.approx(prefill)
    assert s["e2e_s_mean"] == pytest.approx(prefill + sum(decodes))
    assert s["tpot_ms_mean"] == pytest.approx(1e3 * sum(decodes) / 3)
    assert s["sim_time_s"] == pytest.approx(
        5.0 + prefill + sum(decodes)
    )  # the clock starts at the arrival
    # --step-ms: every step the same
    fixed = run_simulation(
        SimConfig(num_blocks=2000, max_num_batched_tokens=4096, step_ms=10.0), [req]
    ).summary
    assert fixed["ttft_s_mean"] == pytest.approx(0.01) and fixed["tbt_ms_mean"] == pytest.approx(
        10.0
    )


def test_arrivals_replay_on_the_trace_clock(tmp_path: Path) -> None:
    t = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": ms, "input_length": 700, "output_length": 5, "hash_ids": [i, i + 1]}
        for i, ms in enumerate([0, 0, 40_000, 40_000, 120_500])
    ]
    t.write_text("".join(json.dumps(x) + "\n" for x in lines))
    p = run("--trace", str(t), "--model", "llama3-8b", "--gpu", "h200", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    s = d["summary"]
    assert d["config"]["clock"] == "seconds" and "roofline" in d["config"]["step_time"]
    assert 120.5 < s["sim_time_s"] < 121.0  # the last arrival at 120.5 s, then a few fast steps
    assert s["ttft_s_p99"] < 0.1  # an idle GPU: no queueing
    assert s["output_tokens_per_s"] == pytest.approx(25 / s["sim_time_s"])
    # the kv cache from the GPU: 0.9 of 141 GiB less 16 GB of weights, 128 KiB per token
    assert d["config"]["kv_gib_from_gpu"] == pytest.approx(141 * 0.9 - 2 * 8.03e9 / 2**30)
    for bad, msg in [
        (["--gpu", "h200"], "model shape"),
        (["--tp", "2"], "need --gpu"),
        (["--gpu", "h100", "--model", "llama3-70b"], "do not fit"),
        (["--gpu", "h100", "--model", "llama3-8b", "--step-ms", "5"], "not both"),
    ]:
        q = run("--trace", str(t), *bad)
        assert q.returncode == 2 and msg in q.stderr, q.stderr


def test_serving_the_bailian_fixture_checks_every_step() -> None:
    """The batch-API loop (SequenceBatch, pool.advance) with check mode: sessions, seconds."""
    p = run(
        "--trace",
        str(BAILIAN),
        "--check",
        "--cache-tokens",
        "60k",
        "--max-batched-tokens",
        "1024",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)["summary"]
    assert (
        s["finished"] == 300 and s["sessions"] + s["follow_up_turns"] == 300 and s["max_turn"] == 5
    )
    assert s["follow_up_hit_rate"] > 0.5 and s["output_tokens"] == sum(
        r.output_len for r in load_trace(BAILIAN)
    )
    assert "trace_read_s" in s and s["sim_time_s"] > 0


@pytest.mark.parametrize("dp", [1, 2])
def test_tiny_budget_and_preemption_from_the_decode_batch(dp: int) -> None:
    """A budget of 6 tokens (the decode batch fills it; check mode asserts it never outgrows
    it) and blocks running out (decoders preempted out of the batch), every step checked."""
    from kvpool.sim.workloads import generate

    reqs = generate(
        "random", 40, seed=4, rate=0, max_prompt_len=128, output_len=80, max_output_len=160
    )
    cfg = SimConfig(num_blocks=60, block_size=8, dp_size=dp, max_num_batched_tokens=6, check=True)
    res = run_simulation(cfg, reqs)
    s = res.summary
    assert s["finished"] == 40 and s["output_tokens"] == sum(r.output_len for r in reqs)
    assert s["preemptions"] > 0 and s["recomputed_tokens"] > 0
    assert max(r.batched_tokens for r in res.timeline) <= 6 * dp


def test_request_order_takes_a_window_and_linear_state() -> None:
    """--order request with hybrid groups: a window in the shared store keeps every block that
    slides out while memory lasts, so with room for the whole trace it hits exactly what full
    attention hits; linear state hits only where a checkpoint was saved (the interval's
    multiples and each prompt's last full block), restoring one per hit; check() every request."""
    reqs = load_trace(MOONCAKE)
    blocks = 2 * sum(-(-r.prompt_len // 16) for r in reqs) + 1

    def summary(**kw: object) -> dict:
        cfg = SimConfig(num_blocks=blocks, block_size=16, order="request", check=True, **kw)
        return run_simulation(cfg, reqs).summary

    full = summary()
    window = summary(sliding_window=1024)
    assert window["prefix_hit_tokens"] == full["prefix_hit_tokens"] > 0
    assert window["evictions"] == 0
    memory = window["group_memory"]
    assert memory["window_cached_blocks"] > 0 and memory["window_used_blocks"] == 0
    linear = summary(linear_state_slots=64, checkpoint_interval=512)
    assert 0 < linear["prefix_hit_tokens"] <= full["prefix_hit_tokens"]
    assert linear["checkpoint_hits"] > 0 and linear["checkpoint_saves"] > 0
    assert linear["group_memory"]["linear_state_slots_in_use"] > 0
    # the states in the one store: their blocks are reported beside the KV's
    one = summary(linear_state_slots=4096, checkpoint_interval=512, linear_state_blocks=34)
    assert 0 < one["prefix_hit_tokens"] <= full["prefix_hit_tokens"]
    used = one["group_memory"]["linear_used_blocks"]
    assert used >= 34 * one["group_memory"]["linear_state_slots_in_use"] > 0


def test_malformed_trace_line_stops_the_command(tmp_path: Path) -> None:
    lines = MOONCAKE.read_text().splitlines()[:5]
    lines[3] = lines[3].replace('"hash_ids": [', '"hash_ids": [-1, ')
    t = tmp_path / "bad.jsonl"
    t.write_text("\n".join(lines) + "\n")
    p = run("--trace", str(t))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"kvpool simulate: error: {t}:4: ")
    q = run("--trace", str(MOONCAKE), "--trace-format", "bailian")
    assert q.returncode == 1 and f"{MOONCAKE}:1: missing field(s) chat_id" in q.stderr
    r = run("-n", "5", "--trace-format", "mooncake")
    assert r.returncode == 2 and "go with --trace" in r.stderr


def test_progress_bar_has_an_eta() -> None:
    p = run("--trace", str(BAILIAN), "--progress", "--gpu", "a100", "--model", "qwen2.5-7b")
    assert p.returncode == 0, p.stderr
    assert "eta" in p.stderr and "300/300" in p.stderr and "clock" in p.stderr
