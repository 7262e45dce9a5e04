"""kvpool.index.router: round_robin, least_loaded and kv_aware on KVIndex, with speculative entries."""

from __future__ import annotations

import kvpool
import numpy as np
import pytest
from kvpool.index.router import Router

BS = 4


def prompt(doc, n=32):
    return [doc * 1000 + i for i in range(n)]


def store(idx, instance, tokens, medium="device", n=None):
    hashes = kvpool.hash_blocks(tokens, BS)[:n]
    idx.apply(
        instance, [{"kind": "stored", "block_size": BS, "block_hashes": hashes, "medium": medium}]
    )


def test_round_robin_cycles():
    r = Router([5, 6, 7], "round_robin")
    assert [r.route(prompt(0)).instance for _ in range(7)] == [5, 6, 7, 5, 6, 7, 5]


def test_least_loaded_balances_outstanding_tokens():
    r = Router(3, "least_loaded")
    a = r.route(prompt(0, 100), request_id="a")
    b = r.route(prompt(1, 10), request_id="b")
    c = r.route(prompt(2, 10), request_id="c")
    assert (a.instance, b.instance, c.instance) == (0, 1, 2)
    assert r.route(prompt(3, 10)).instance == 1  # 10 < 100, ties to the lowest
    r.finish("a")
    assert r.route(prompt(4, 10)).instance == 0
    assert r.load.tolist() == [10.0, 20.0, 10.0]
    with pytest.raises(ValueError, match="request_id"):
        r.finish("a")
    with pytest.raises(ValueError, match="request_id"):
        r.route(prompt(0), request_id="b")


def test_kv_aware_follows_the_cached_prefix_until_load_outweighs_it():
    idx = kvpool.KVIndex()
    r = Router(3, "kv_aware", index=idx, block_size=BS, speculative_ttl=None)
    p = prompt(7)
    store(idx, 2, p, n=6)  # 24 of 32 tokens on instance 2's device
    d = r.route(p, request_id=1)
    assert d.instance == 2 and d.cached_tokens == {"device": 24, "host": 24, "remote": 24}
    assert d.cost == pytest.approx(32 - 24)
    assert r.costs(p).tolist() == pytest.approx([32.0, 32.0, 8.0 + 32.0])
    # Instance 2 now has 32 outstanding tokens: 8 + 32 > 32, so the next copy goes elsewhere.
    assert r.route(p, request_id=2).instance == 0
    # A lower load weight keeps it on the cache.
    r2 = Router(3, "kv_aware", index=idx, block_size=BS, speculative_ttl=None, load_weight=0.1)
    r2.route(p)
    assert r2.route(p).instance == 2


def test_kv_aware_weighs_media():
    idx = kvpool.KVIndex()
    p = prompt(3)
    store(idx, 0, p, medium="host")  # 32 on host: saves 0.8 each
    store(idx, 1, p, medium="device", n=6)  # 24 on device: saves 1.0 each
    r = Router(2, "kv_aware", index=idx, block_size=BS, speculative_ttl=None)
    assert r.costs(p).tolist() == pytest.approx([32 - 0.8 * 32, 32 - 24.0])
    assert r.route(p).instance == 0  # 6.4 < 8
    r = Router(
        2, "kv_aware", index=idx, block_size=BS, speculative_ttl=None, medium_weights={"host": 0.5}
    )
    assert r.route(p).instance == 1  # 16 > 8
    # A shared remote tier counts for every instance; a private one only for its own.
    store(idx, 1, p, medium="remote")
    shared = Router(3, "kv_aware", index=idx, block_size=BS, speculative_ttl=None)
    assert shared.cached(p)[2].tolist() == [0.0, 0.0, 32.0]
    private = Router(
        3, "kv_aware", index=idx, block_size=BS, speculative_ttl=None, shared_remote=False
    )
    assert private.cached(p)[2].tolist() == [0.0, 0.0, 0.0]


def test_speculative_entries_keep_a_burst_together_until_they_lapse():
    idx = kvpool.KVIndex()
    r = Router(4, "kv_aware", index=idx, block_size=BS, speculative_ttl=1.0, load_weight=0.0)
    p = prompt(9)
    first = r.route(p, now=0.0)
    # No event yet, but the prediction sends the same prefix to the same instance.
    assert all(r.route(p, now=0.1 * k).instance == first.instance for k in range(1, 5))
    assert r.cached(p, now=0.5)[first.instance, 0] == 32
    # Without confirmation the entries lapse; a stored event would have made them real.
    assert r.cached(p, now=1.5)[first.instance, 0] == 0
    store(idx, first.instance, p)
    assert r.cached(p, now=9.0)[first.instance, 0] == 32
    assert idx.stats()["speculative_inserted"] > 0


def test_bad_arguments_are_named():
    idx = kvpool.KVIndex()
    for kwargs, name in [
        ({"instances": 0}, "instances"),
        ({"instances": [1, 1]}, "instances"),
        ({"instances": 2, "policy": "random"}, "policy"),
        ({"instances": 2, "policy": "kv_aware"}, "index"),
        ({"instances": 2, "index": idx, "block_size": 0}, "block_size"),
        ({"instances": 2, "index": idx, "medium_weights": {"disk": 1.0}}, "medium_weights"),
        ({"instances": 2, "index": idx, "medium_weights": {"host": 2.0}}, "medium_weights"),
        ({"instances": 2, "index": idx, "load_weight": -1.0}, "load_weight"),
        ({"instances": 2, "index": idx, "speculative_ttl": 0.0}, "speculative_ttl"),
    ]:
        with pytest.raises(ValueError, match=name):
            Router(**kwargs)
    assert isinstance(Router(2, index=idx).load, np.ndarray)
    assert kvpool.router.POLICIES == ("round_robin", "least_loaded", "kv_aware")


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kv_aware"])
def test_g10_a_rejected_request_changes_nothing(policy):
    """G10 (R29): a request the router refuses (bad token ids, a taken id) takes no round-robin
    turn, no automatic id, no load and leaves no speculative entry."""
    idx = kvpool.KVIndex()
    r = Router(3, policy, index=idx, block_size=BS)
    first = r.route(prompt(0))
    state = (r._next, r._auto, r.load.tolist(), dict(r.active), idx.stats()["speculative_entries"])
    for bad, error in [
        ([1, 2, 3, -1, 5, 6, 7, 8], ValueError),
        ([1, 2, 3, "x", 5, 6, 7, 8], TypeError),
    ]:
        with pytest.raises(error, match="token_ids"):
            r.route(bad)
    with pytest.raises(ValueError, match="request_id"):
        r.route(prompt(1), request_id=first.request_id)
    assert (
        r._next,
        r._auto,
        r.load.tolist(),
        dict(r.active),
        idx.stats()["speculative_entries"],
    ) == state
    second = r.route(prompt(1))
    assert second.request_id == first.request_id + 1
    if policy == "round_robin":
        assert (first.instance, second.instance) == (0, 1), "no instance skipped"


def test_recompute_weight_costs_kv_past_the_checkpoint():
    """A hybrid instance's row is the depth a hit restores (its deepest checkpoint); with
    ``recompute_weight`` the device KV it holds past it saves that share of each token
    (docs/events.md, kvpool.router)."""
    idx = kvpool.KVIndex()
    tokens = prompt(0)
    hashes = kvpool.hash_blocks(tokens, BS)
    groups = [
        {"kind": "group", "block_size": BS, "group": 0},
        {"kind": "group", "block_size": BS, "group": 1, "group_kind": "linear_state"},
    ]
    idx.apply(
        0, groups + [{"kind": "stored", "block_size": BS, "block_hashes": hashes}]
    )  # 8 blocks, no checkpoint
    store(idx, 1, tokens, n=2)  # a plain instance holding 2 blocks
    plain = Router(2, "kv_aware", index=idx, block_size=BS, speculative_ttl=None)
    assert plain.costs(tokens).tolist() == [32.0, 24.0], (
        "no checkpoint: instance 0 restores nothing"
    )
    assert plain.route(tokens).instance == 1
    weighted = Router(
        2, "kv_aware", index=idx, block_size=BS, speculative_ttl=None, recompute_weight=0.5
    )
    assert weighted.costs(tokens).tolist() == [16.0, 24.0], (
        "32 KV tokens past the checkpoint at half"
    )
    assert weighted.route(tokens).instance == 0
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ValueError, match="recompute_weight"):
            Router(2, "kv_aware", index=idx, recompute_weight=bad)
    for bad in ("0.5", None):
        with pytest.raises(TypeError, match="recompute_weight"):
            Router(2, "kv_aware", index=idx, recompute_weight=bad)
