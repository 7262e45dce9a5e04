"""``kvpool simulate --instances N --router POLICY``: N pools in one process,
their events into one KVIndex, a router per request; small workloads only."""

from __future__ import annotations

import json

import kvpool
import pytest
from kvpool.sim.cli import main
from kvpool.sim.engine import SimConfig, SimError
from kvpool.sim.fleet import run_fleet
from kvpool.sim.workloads import Request, generate

BS = 16


def shared_prefix_workload(n=120, groups=6, seed=0):
    """Requests of ``groups`` long shared prefixes (documents, system prompts) plus a unique tail."""
    import random

    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        g = rng.randrange(groups)
        prompt = [10_000 * (g + 1) + t for t in range(8 * BS)] + [
            rng.randrange(5000) for _ in range(rng.randrange(1, 3 * BS))
        ]
        reqs.append(
            Request(
                request_id=i,
                arrival=0.0,
                prompt=prompt,
                output_len=rng.randrange(2, 12),
                arrival_s=0.01 * i,
            )
        )
    return reqs


def config(**kw):
    base = dict(num_blocks=48, block_size=BS, max_num_batched_tokens=256, max_num_seqs=8)
    base.update(kw)
    return SimConfig(**base)


def assert_complete(res, reqs):
    f = res.fleet
    assert f["finished"] == f["requests"] == len(reqs)
    assert sum(p["routed_requests"] for p in res.per_instance) == len(reqs)
    assert sum(p["finished"] for p in res.per_instance) == len(reqs)
    assert f["output_tokens"] == sum(r.output_len for r in reqs)
    assert 0.0 <= f["hit_rate"] <= 1.0 and f["ttft_s_p50"] <= f["ttft_s_p99"]
    for sim in res.simulators:
        assert sim.pool.stats()["num_used_blocks"] == 0, "no block leaked"
        sim.pool.check()
    res.index.check()


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kv_aware"])
def test_every_policy_serves_every_request_once(policy):
    reqs = shared_prefix_workload(60)
    res = run_fleet(config(check=True), reqs, 3, policy)
    assert_complete(res, reqs)
    if policy == "round_robin":
        counts = [p["routed_requests"] for p in res.per_instance]
        assert max(counts) - min(counts) <= 1


def test_the_index_mirrors_every_instance_device_cache():
    """After the run, the index's device match of a prompt on instance k is the pool's own
    (plan() is side-effect free): the events carried the whole state."""
    reqs = shared_prefix_workload(80)
    res = run_fleet(config(), reqs, 3, "kv_aware", speculative_ttl=None)
    assert_complete(res, reqs)
    for r in reqs[::7]:
        tokens = r.prompt_tokens()
        rows = res.index.lookup(tokens, now=1e9)
        for k, sim in enumerate(res.simulators):
            plan = sim.pool.plan(kvpool.Sequence(tokens))
            pool_hit = plan.device_hit_tokens if plan is not None else 0
            index_hit = max((t for i, _, m, _, t in rows if i == k and m == "device"), default=0)
            # the pool caps a hit below the full prompt (R8): compare whole blocks short of it
            assert min(index_hit, (len(tokens) - 1) // BS * BS) == pool_hit


def test_kv_aware_routing_beats_round_robin_on_shared_prefixes():
    reqs = shared_prefix_workload(120)
    rr = run_fleet(config(), reqs, 4, "round_robin")
    kv = run_fleet(config(), reqs, 4, "kv_aware")
    assert kv.fleet["hit_rate"] > rr.fleet["hit_rate"] + 0.05
    assert kv.fleet["router_predicted_device_tokens"] > 0


def test_a_shared_remote_tier_raises_the_hit_rate_of_local_caches():
    reqs = shared_prefix_workload(120)
    cfg = config(host_num_blocks=16)
    local = run_fleet(cfg, reqs, 4, "round_robin")
    shared = run_fleet(cfg, reqs, 4, "round_robin", remote="memory")
    assert_complete(shared, reqs)
    assert shared.fleet["remote_hit_blocks"] > 0 and local.fleet["remote_hit_blocks"] == 0
    assert shared.fleet["hit_rate"] > local.fleet["hit_rate"]
    assert shared.fleet["remote_stored_blocks"] > 0
    media = {row[2] for row in shared.index.lookup(reqs[0].prompt_tokens(), now=1e9)}
    assert "remote" in media, "the instances' remote-tier events reached the index"


def test_step_clocked_workloads_and_bad_options():
    reqs = generate(
        "mixed", 30, seed=3, rate=1.0, max_prompt_len=256, output_len=8, max_output_len=16
    )
    res = run_fleet(config(num_blocks=64), reqs, 2, "least_loaded")
    assert_complete(res, reqs)
    with pytest.raises(SimError, match="policy"):
        run_fleet(config(), reqs, 2, "random")
    with pytest.raises(SimError, match="host tier"):
        run_fleet(config(), reqs, 2, "kv_aware", remote="memory")
    with pytest.raises(SimError, match="instances"):
        run_fleet(config(), reqs, 0, "kv_aware")
    with pytest.raises(SimError, match="order"):
        run_fleet(config(order="request"), reqs, 2, "kv_aware")


def test_cli_compares_routers_and_caches_in_one_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    argv = [
        "-n",
        "40",
        "--max-prompt-len",
        "256",
        "--output-len",
        "8",
        "--max-output-len",
        "16",
        "--num-blocks",
        "64",
        "--host-blocks",
        "32",
        "--no-progress",
        "--instances",
        "3",
        "--router",
        "round_robin,kv_aware",
        "--remote",
        "none,memory",
    ]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = [(r["policy"], r["remote"]) for r in out["fleet"]]
    assert runs == [
        ("round_robin", None),
        ("kv_aware", None),
        ("round_robin", "memory"),
        ("kv_aware", "memory"),
    ]
    assert all(len(r["per_instance"]) == 3 and r["fleet"]["finished"] == 40 for r in out["fleet"])
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "kv_aware" in table and "remote:memory" in table
    for bad, what in (
        (["--router", "nope"], "--router"),
        (["--instances", "0"], "--instances"),
        (["--remote", "ftp://x"], "--remote"),
        (["--sweep", "num_blocks=64,128"], "--sweep"),
    ):
        assert main(["-n", "5", "--no-progress", "--instances", "2", *bad]) == 2
        assert what in capsys.readouterr().err
    assert main(["-n", "5", "--no-progress", "--instances", "2", "--remote", "memory"]) == 2
    assert "host tier" in capsys.readouterr().err
