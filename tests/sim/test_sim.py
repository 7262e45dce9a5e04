"""The scheduler loop of kvpool simulate: accounting checked with pool.check() every step."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from kvpool.sim.workloads import Request, generate

pytestmark = pytest.mark.skipif(not hasattr(kvpool, "BlockManagerPool"), reason="pool not built")

from kvpool.sim.engine import SimConfig, SimError, Simulator, run_simulation  # noqa: E402


def _small(kind: str, n: int, seed: int = 0, **kw) -> list[Request]:
    opts = dict(max_prompt_len=512, output_len=24, max_output_len=64, rate=0.5)
    opts.update(kw)
    return generate(kind, n, seed=seed, **opts)


def _assert_complete(res, reqs) -> None:
    s = res.summary
    assert s["finished"] == len(reqs)
    assert s["output_tokens"] == sum(r.output_len for r in reqs)
    # every computed token is a prompt token, an output token fed back, or a recompute
    fed_back = sum(r.output_len - 1 for r in reqs)
    assert (
        s["prefill_tokens_computed"] + s["admitted_cached_tokens"] - s["recomputed_tokens"]
        <= s["admitted_tokens"]
    )
    assert s["decode_tokens"] <= fed_back
    assert 0.0 <= s["prefix_hit_rate"] <= 1.0
    assert 0.0 <= s["mean_usage"] <= s["peak_usage"] <= 1.0


@pytest.mark.parametrize("kind", ["mixed", "chat", "random", "few_shot"])
def test_check_mode_every_step(kind: str) -> None:
    reqs = _small(kind, 60, seed=1)
    res = run_simulation(SimConfig(num_blocks=512, block_size=16, check=True), reqs)
    _assert_complete(res, reqs)


def test_pressure_preempts_and_recovers() -> None:
    reqs = _small("system_prompt", 80, seed=2, rate=0)
    res = run_simulation(
        SimConfig(num_blocks=160, block_size=8, max_num_batched_tokens=256, check=True), reqs
    )
    _assert_complete(res, reqs)
    s = res.summary
    assert s["preemptions"] > 0 and s["recomputed_tokens"] > 0
    assert s["peak_usage"] == pytest.approx(1.0, abs=0.05)
    assert s["evictions"] > 0


def test_prefix_cache_on_vs_off() -> None:
    reqs = _small("system_prompt", 50, seed=3)
    on = run_simulation(SimConfig(num_blocks=1024, check=True), reqs).summary
    off = run_simulation(
        SimConfig(num_blocks=1024, enable_prefix_cache=False, check=True), reqs
    ).summary
    assert on["prefix_hit_rate"] > 0.3
    assert off["prefix_hit_tokens"] == 0 and off["admitted_cached_tokens"] == 0
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]


def test_dp_ranks_and_budgets() -> None:
    reqs = _small("mixed", 60, seed=4)
    res = run_simulation(SimConfig(num_blocks=256, dp_size=2, max_num_seqs=8, check=True), reqs)
    _assert_complete(res, reqs)
    assert res.summary["num_total_blocks"] == 2 * 255
    assert max(r.running for r in res.timeline) <= 16
    assert max(r.batched_tokens for r in res.timeline) <= 2 * 2048


def test_chunked_prefill_respects_budget() -> None:
    reqs = _small("random", 20, seed=5, max_prompt_len=2000, rate=0)
    res = run_simulation(SimConfig(num_blocks=2048, max_num_batched_tokens=128, check=True), reqs)
    _assert_complete(res, reqs)
    assert max(r.batched_tokens for r in res.timeline) <= 128


def test_deterministic() -> None:
    reqs = _small("mixed", 40, seed=6)
    a = run_simulation(SimConfig(num_blocks=300), reqs).summary
    b = run_simulation(SimConfig(num_blocks=300), reqs).summary
    for k in ("steps", "preemptions", "prefix_hit_tokens", "evictions", "recomputed_tokens"):
        assert a[k] == b[k]


def test_multi_turn_output_hits() -> None:
    # the next turn's prompt contains the previous answer: its decoded blocks are hits too
    reqs = _small("chat", 60, seed=7, max_prompt_len=2048)
    s = run_simulation(SimConfig(num_blocks=2048, check=True), reqs).summary
    assert s["prefix_hit_rate"] > 0.3


def test_request_longer_than_cache() -> None:
    reqs = [Request(0, 0.0, np.arange(100, dtype=np.int32), 200)]
    with pytest.raises(SimError, match="needs 299 tokens"):
        Simulator(SimConfig(num_blocks=16, block_size=16), reqs)


def test_exact_fit_request() -> None:
    # prompt + output - 1 == capacity: fits (the last sampled token is never fed back)
    reqs = [Request(0, 0.0, np.arange(100, dtype=np.int32), 61)]
    res = run_simulation(SimConfig(num_blocks=11, block_size=16, check=True), reqs)
    assert res.summary["finished"] == 1 and res.summary["peak_used_blocks"] == 10


@pytest.mark.parametrize(
    "options",
    [
        {"linear_state_slots": 64, "checkpoint_interval": 64},
        {"linear_state_slots": 64, "linear_state_match": "contiguous", "checkpoint_interval": 16},
        {"sliding_window": 128, "swa_num_blocks": 256},
        {"sliding_window": 64, "linear_state_slots": 64, "checkpoint_interval": 32, "dp_size": 2},
        {"attention_chunk_size": 128},
        {"attention_chunk_size": 64, "dp_size": 2},
    ],
)
def test_hybrid_models_check_every_step(options) -> None:
    """Hybrid models in the scheduler loop: pool.check() after every step, every request finishes."""
    options = dict(options)
    dp = options.pop("dp_size", 1)
    reqs = _small("chat", 40, seed=3)
    res = run_simulation(
        SimConfig(num_blocks=512, block_size=16, dp_size=dp, check=True, **options), reqs
    )
    _assert_complete(res, reqs)
    s = res.summary
    if "linear_state_match" not in options:  # contiguous needs a checkpoint at every block
        assert s["prefix_hit_rate"] > 0
        if options.get("linear_state_slots"):
            assert s["checkpoint_hits"] > 0


def test_bad_config() -> None:
    with pytest.raises(SimError):
        Simulator(SimConfig(num_blocks=1), [])
    with pytest.raises(SimError, match="multiple of block_size"):
        Simulator(SimConfig(linear_state_slots=4, checkpoint_interval=10), [])
    with pytest.raises(SimError, match="attention_chunk_size must be a positive multiple"):
        Simulator(SimConfig(attention_chunk_size=24), [])
    with pytest.raises(SimError, match="attention_chunk_size is not with sliding_window"):
        Simulator(SimConfig(attention_chunk_size=32, sliding_window=32), [])


def test_execute_numpy_backend() -> None:
    from kvpool.sim.execute import Executor

    reqs = _small("system_prompt", 10, seed=8, max_prompt_len=200, output_len=6, max_output_len=12)
    cfg = SimConfig(num_blocks=128, block_size=16, check=True)
    ex = Executor(cfg, backend="numpy", check_every=2)
    sim = Simulator(cfg, reqs, executor=ex)
    ex.bind(sim)
    sim.run()
    rep = ex.report()
    assert rep["ok"] and rep["checked_sequences"] > 0 and rep["max_abs_error"] < 1e-3


def test_execute_detects_wrong_kv() -> None:
    # corrupt one cached block: the dense comparison must notice
    from kvpool.sim.execute import Executor

    reqs = _small(
        "system_prompt", 6, seed=9, max_prompt_len=200, output_len=4, max_output_len=8, rate=0
    )
    cfg = SimConfig(num_blocks=128, block_size=16)
    ex = Executor(cfg, backend="numpy", check_every=1)
    sim = Simulator(cfg, reqs, executor=ex)
    ex.bind(sim)
    sim.step()
    for layer in range(ex.layers):
        ex.kc[0][layer][1:] += 1.0
    sim.run()
    assert not ex.report()["ok"]
