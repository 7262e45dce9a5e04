"""The shared remote KV tier and KV events on Redis Streams, against a real
redis-server on 127.0.0.1 started by the fixtures (never a mock; tests/tiers/redis_helpers.py).

Covers: payload round trip through the tier (and bit-identical KV device -> host -> remote ->
host -> device between two pools); namespace isolation; corrupt, truncated, foreign and
mis-filed payloads are misses, never wrong KV; one existence round trip per request; a server
killed mid-run (misses, counted errors, no exception reaching the scheduler, check() passes,
every id free after cleanup); a hung server bounded by the budget; both write policies; two
pools in two processes sharing the tier; the event stream replaying into the index the pool's
own events imply; bad arguments naming themselves (R29). The key tests run again on a 3-node
Redis Cluster (``cluster=True``): round trip over keys of several slots, namespaces, corrupt
payloads, a pool's one-lookup allocate fetching bit-identical KV, and a node killed mid-run.
Every loop is bounded in count and time.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import kvpool
import numpy as np
import pytest
from kvpool.index.streams import PrefixIndex, RedisEventPublisher, event_to_dict, read_events
from kvpool.tiers.host_transfer import NumpyTransferExecutor
from kvpool.tiers.payload import block_spec, decode_payload, encode_payload, make_namespace
from kvpool.tiers.redis import RedisRemoteTier
from redis_helpers import (  # noqa: F401  (the fixtures are used by name)
    RedisClusterServers,
    RedisServer,
    redis_cluster_fixture,
    redis_cluster_servers_fixture,
)

BS = 4
LAYERS = 2
SHAPE = (BS, 2, 8)  # block_size, kv heads, head dim
NS = make_namespace(
    "test-model", dtype="float16", num_kv_heads=2, head_dim=8, block_size=BS, num_layers=LAYERS
)


@pytest.fixture
def server():
    srv = RedisServer()
    srv.start()
    yield srv
    srv.stop()


def kv_of(tokens: list[int], layer: int, kind: int) -> np.ndarray:
    """Deterministic "KV" of a block's tokens (what any instance would compute)."""
    t = np.asarray(tokens, dtype=np.float32).reshape(BS, 1, 1)
    base = t * 0.25 + layer * 3 + kind * 7 + np.arange(8, dtype=np.float32).reshape(1, 1, 8) * 0.5
    return np.broadcast_to(base, SHAPE).astype(np.float16)


class Engine:
    """A pool plus NumPy caches (K and V per layer) and an executor: a minimal serving instance."""

    def __init__(
        self, tier, *, num_blocks=32, host_blocks=32, policy="write_through", budget_ms=200.0, **kw
    ) -> None:
        self.pool = kvpool.HierarchyBlockManagerPool(
            num_blocks,
            host_blocks,
            BS,
            remote=tier,
            remote_policy=policy,
            remote_budget_ms=budget_ms,
            **kw,
        )
        self.dev = [np.zeros((num_blocks, *SHAPE), np.float16) for _ in range(2 * LAYERS)]
        self.host = [np.zeros((host_blocks, *SHAPE), np.float16) for _ in range(2 * LAYERS)]
        self.ex = NumpyTransferExecutor(self.dev, self.host)

    def compute(self, seq) -> None:
        """Writes the KV of every not-yet-computed full block of seq and marks it computed."""
        table = [int(b) for b in seq.block_table]
        toks = list(seq.token_ids)
        for i in range(seq.num_computed_tokens // BS, len(seq) // BS):
            for a, arr in enumerate(self.dev):
                arr[table[i]] = kv_of(toks[i * BS : (i + 1) * BS], a // 2, a % 2)
        seq.num_computed_tokens = len(seq)

    def verify(self, seq) -> None:
        """Every cached block of seq holds exactly the KV of its tokens (no wrong KV ever)."""
        table = [int(b) for b in seq.block_table]
        toks = list(seq.token_ids)
        for i in range(seq.num_cached_tokens // BS):
            for a, arr in enumerate(self.dev):
                np.testing.assert_array_equal(
                    arr[table[i]], kv_of(toks[i * BS : (i + 1) * BS], a // 2, a % 2)
                )

    def serve(self, tokens: list[int]) -> int:
        """One request: allocate (remote lookup), transfers, compute, release. Returns cached tokens."""
        seq = kvpool.Sequence(tokens)
        assert self.pool.allocate(seq)
        self.ex.step(self.pool)
        self.verify(seq)
        cached = seq.num_cached_tokens
        self.compute(seq)
        self.pool.deallocate(seq)
        self.ex.step(self.pool)
        return cached

    def cleanup(self) -> None:
        self.ex.step(self.pool)
        self.pool.check()
        self.pool.reset_prefix_cache()
        st = self.pool.stats()
        assert st["num_free_blocks"] == st["num_total_blocks"]
        assert st["host"]["num_free_blocks"] == st["host"]["num_total_blocks"]


def prompt(seed: int, n_blocks: int, shared: int = 0) -> list[int]:
    rng = random.Random(seed)
    head = list(range(1000, 1000 + shared * BS))
    return head + [rng.randrange(50_000) for _ in range((n_blocks - shared) * BS)] + [1]


# ------------------------------------------------------------------------------ the tier itself
def test_payload_round_trip_through_redis(server):
    tier = RedisRemoteTier(server.url, NS)
    arrays = [
        np.random.default_rng(i).standard_normal((3, *SHAPE)).astype(np.float16) for i in range(4)
    ]
    spec = block_spec(arrays)
    keys = kvpool.hash_blocks(list(range(3 * BS)), BS)
    bodies = [b"".join(a[i].tobytes() for a in arrays) for i in range(3)]
    assert tier.exists_many(keys) == [False] * 3
    tier.put_many(keys, [encode_payload(k, spec, b) for k, b in zip(keys, bodies, strict=True)])
    assert tier.exists_many(keys) == [True] * 3
    got = tier.get_many(keys)
    for k, b, p in zip(keys, bodies, got, strict=True):
        assert bytes(decode_payload(k, spec, p, len(b))) == b
    st = tier.stats()
    assert (
        st["puts"] == 3
        and st["get_hits"] == 3
        and st["bytes_in"] == st["bytes_out"] > 3 * len(bodies[0])
    )
    assert tier.delete_many(keys) == 3
    assert tier.get_many(keys) == [None] * 3
    assert tier.exists_many([]) == [] and tier.get_many([]) == []


def test_namespace_isolation(server):
    a = RedisRemoteTier(server.url, NS)
    other = make_namespace(
        "test-model", dtype="bfloat16", num_kv_heads=2, head_dim=8, block_size=BS, num_layers=LAYERS
    )
    assert other != NS
    b = RedisRemoteTier(server.url, other)
    keys = kvpool.hash_blocks(list(range(2 * BS)), BS)
    a.put_many(keys, [b"x" * 40, b"y" * 40])
    assert a.exists_many(keys) == [True, True]
    assert b.exists_many(keys) == [False, False], "another layout never sees these blocks"
    assert b.get_many(keys) == [None, None]
    # Through pools: an instance of another namespace computes everything itself.
    ea, eb = Engine(a), Engine(b)
    p = prompt(1, 4)
    ea.serve(p)
    assert eb.serve(p) == 0
    assert Engine(RedisRemoteTier(server.url, NS)).serve(p) == 4 * BS
    for e in (ea, eb):
        e.cleanup()


def test_corrupt_payloads_are_misses_never_wrong_kv(server):
    tier = RedisRemoteTier(server.url, NS)
    keys = kvpool.hash_blocks(list(range(2 * BS)), BS)
    spec = "float16:4x2x8"
    good = encode_payload(keys[0], spec, b"\x01" * 64)
    assert decode_payload(keys[0], spec, good) is not None
    flipped = bytearray(good)
    flipped[-1] ^= 1
    assert decode_payload(keys[0], spec, bytes(flipped)) is None, "checksum"
    assert decode_payload(keys[0], spec, good[:-3]) is None, "truncated"
    assert decode_payload(keys[1], spec, good) is None, "filed under another key"
    assert decode_payload(keys[0], "bfloat16:4x2x8", good) is None, "foreign layout"
    assert decode_payload(keys[0], spec, b"garbage") is None
    assert decode_payload(keys[0], spec, None) is None

    # Through pools: instance A writes 4 blocks; block 2's payload is then corrupted in Redis.
    ea = Engine(tier)
    p = prompt(2, 4)
    ea.serve(p)
    chain = kvpool.hash_blocks(p, BS)
    raw = tier.get_many([chain[2]])[0]
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 0xFF
    tier.put_many([chain[2]], [bytes(bad)])
    eb = Engine(tier)
    assert eb.serve(p) == 2 * BS, "the chain stops at the corrupt block; blocks 0-1 still hit"
    st = eb.pool.stats()["remote"]
    assert st["corrupt"] >= 1 and st["fetched_blocks"] == 2 and st["failed_fetch_blocks"] == 2
    ea.cleanup()
    eb.cleanup()


# ------------------------------------------------------------------------------ pool integration
def test_remote_hits_round_trip_bit_identical_and_one_lookup_per_request(server):
    tier = RedisRemoteTier(server.url, NS)
    ea, eb = Engine(tier), Engine(RedisRemoteTier(server.url, NS))
    prompts = [prompt(10 + i, 3 + i % 4, shared=2) for i in range(6)]
    for p in prompts:
        ea.serve(p)
    assert tier.stats()["puts"] > 0
    before = eb.pool.remote.stats()["exists_calls"]
    hits = [eb.serve(p) for p in prompts]  # serve() verifies every cached block's KV
    assert hits[0] == (len(prompts[0]) - 1) // BS * BS
    st = eb.pool.stats()["remote"]
    # One existence round trip per request (not per block); write-through adds one per offload
    # batch (it skips blocks already stored).
    assert st["lookups"] == len(prompts)
    assert st["lookup_keys"] > len(prompts)
    assert eb.pool.remote.stats()["exists_calls"] - before <= 2 * len(prompts)
    assert st["fetched_blocks"] > 0 and st["errors"] == 0 and st["lookup_failures"] == 0
    ea.cleanup()
    eb.cleanup()


def test_on_host_evict_policy_sends_blocks_only_when_their_host_block_is_reused(server):
    tier = RedisRemoteTier(server.url, NS)
    ea = Engine(tier, host_blocks=5, policy="on_host_evict")
    first = prompt(20, 4)
    ea.serve(first)
    assert tier.stats()["puts"] == 0, "nothing sent while the blocks stay on host"
    ea.serve(prompt(21, 4))  # evicts first's host blocks: they are sent before being overwritten
    chain = kvpool.hash_blocks(first, BS)
    assert tier.exists_many(chain[:4]) == [True] * 4
    eb = Engine(RedisRemoteTier(server.url, NS))
    assert eb.serve(first) == 4 * BS
    ea.ex.remote_transfer(ea.pool).flush()
    assert tier.exists_many(kvpool.hash_blocks(prompt(21, 4), BS)[:4]) == [True] * 4
    ea.cleanup()
    eb.cleanup()


def test_server_killed_mid_run_degrades_to_misses_and_leaks_nothing(server):
    tier = RedisRemoteTier(server.url, NS, timeout_ms=200, retry_interval_ms=50)
    e = Engine(tier)
    rng = random.Random(3)
    deadline = time.monotonic() + 60
    n = 0
    for i in range(60):
        assert time.monotonic() < deadline
        p = prompt(rng.randrange(6), 2 + rng.randrange(4), shared=1)
        # Hold a few sequences across the kill so fetches and writes fail in flight.
        seq = kvpool.Sequence(p)
        assert e.pool.allocate(seq)
        if i == 24:
            server.kill()  # after the lookup: this request's fetch and write fail
        e.ex.step(e.pool)
        e.verify(seq)
        e.compute(seq)
        e.pool.deallocate(seq)
        e.ex.step(e.pool)
        e.pool.check()
        n += 1
        if i % 7 == 0:
            e.pool.reset_prefix_cache()  # force remote lookups
    assert n == 60
    st = e.pool.stats()["remote"]
    assert st["errors"] + st["timeouts"] >= 1
    assert st["lookup_failures"] + st["skipped"] >= 1
    e.cleanup()


def test_hung_server_costs_at_most_the_budget(server):
    tier = RedisRemoteTier(server.url, NS, retry_interval_ms=10_000)
    e = Engine(tier, budget_ms=100.0)
    p = prompt(30, 4)
    e.serve(p)  # connects while the server is alive
    e.pool.reset_prefix_cache()
    server.pause()
    try:
        seq = kvpool.Sequence(p)
        t0 = time.monotonic()
        assert e.pool.allocate(seq)
        took = time.monotonic() - t0
        assert took < 0.1 + 0.4, f"lookup blocked the scheduler for {took:.3f} s"
        assert seq.num_cached_tokens == 0
        st = e.pool.stats()["remote"]
        assert st["timeouts"] == 1 and st["lookup_failures"] == 1 and st["lookups_over_budget"] <= 1
        t0 = time.monotonic()
        seq2 = kvpool.Sequence(prompt(31, 4))
        assert e.pool.allocate(seq2)
        assert time.monotonic() - t0 < 0.05, "marked down: later lookups fail fast"
        e.compute(seq)
        e.compute(seq2)
        e.pool.deallocate(seq)
        e.pool.deallocate(seq2)
        plans = e.pool.take_offload_plans()
        e.ex.run_offloads(plans, e.pool)
    finally:
        server.resume()
    e.cleanup()


_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_remote import Engine, prompt
    from kvpool.tiers.redis import RedisRemoteTier
    e = Engine(RedisRemoteTier({url!r}, {ns!r}))
    for i in range(4):
        e.serve(prompt(40 + i, 5))
    e.cleanup()
    print("wrote", e.pool.remote.stats()["puts"])
""")


def test_two_pools_in_two_processes_share_the_tier(server):
    code = _WRITER.format(tests=str(Path(__file__).parent), url=server.url, ns=NS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "20"
    e = Engine(RedisRemoteTier(server.url, NS))
    for i in range(4):
        assert e.serve(prompt(40 + i, 5)) == 5 * BS, "computed by the other process"
    assert e.pool.stats()["remote"]["fetched_blocks"] == 20
    e.cleanup()


# ------------------------------------------------------------------------------ KV events
def test_event_stream_replays_into_the_index_the_pool_events_imply(server):
    e = Engine(RedisRemoteTier(server.url, NS), num_blocks=12, enable_events=True)
    pub = RedisEventPublisher(server.url, "instance-a", stream="kv:test", maxlen=10_000)
    expected = PrefixIndex()
    rng = random.Random(5)
    for _ in range(30):
        e.serve(prompt(rng.randrange(8), 2 + rng.randrange(3), shared=1))
        events = e.pool.drain_events()
        for ev in events:
            expected.apply("instance-a", event_to_dict(ev))
        pub.publish(events)
    e.pool.reset_prefix_cache()
    events = e.pool.drain_events()
    for ev in events:
        expected.apply("instance-a", event_to_dict(ev))
    pub.publish(events)
    index, last = read_events(server.url, stream="kv:test", count=7)
    assert index.snapshot() == expected.snapshot()
    # Continuing from the last id reads nothing new; a second instance shows up separately.
    pub_b = RedisEventPublisher(server.url, "instance-b", stream="kv:test")
    p = prompt(99, 3)
    e2 = Engine(None, enable_events=True)
    seq = kvpool.Sequence(p)
    assert e2.pool.allocate(seq)
    e2.compute(seq)
    e2.pool.deallocate(seq)
    pub_b.publish(e2.pool.drain_events())
    index, _ = read_events(server.url, stream="kv:test", index=index, last_id=last)
    holder, n = index.best_holder(kvpool.hash_blocks(p, BS))
    assert holder == ("instance-b", 0) and n == 3
    assert pub.errors == 0 and pub.published > 0


def test_the_stream_carries_every_field_into_a_kv_index(server):
    """The published events are self-describing (sequence, medium, group, ...), and
    read_events feeds a kvpool.KVIndex with them: device and host media, numbered per rank."""
    e = Engine(RedisRemoteTier(server.url, NS), num_blocks=12, enable_events=True)
    pub = RedisEventPublisher(server.url, "instance-a", stream="kv:fields", maxlen=10_000)
    rng = random.Random(8)
    for _ in range(10):
        e.serve(prompt(rng.randrange(4), 2 + rng.randrange(3), shared=1))
        pub.publish(e.pool.drain_events())
    direct = kvpool.KVIndex()
    again = kvpool.KVIndex()
    direct.apply(0, e.pool.events_since(0, 1))  # the pool's replay buffer still holds them all
    ids: dict[str, int] = {}
    read_events(server.url, stream="kv:fields", kv_index=again, instance_ids=ids)
    assert ids == {"instance-a": 0}
    assert again.sources() == direct.sources() and again.sources()[0]["last"] > 0
    probe = prompt(0, 4, shared=1)
    assert sorted(again.lookup(probe)) == sorted(direct.lookup(probe))
    assert {row[2] for row in again.lookup(probe)} >= {"device", "host"}


# ------------------------------------------------------------------------------ Redis Cluster
# The remote tier works "with a single Redis/Valkey server and with Redis Cluster". Keys are not
# hash-tagged, so one request's blocks spread over the slots of every node; the tier's multi-key
# calls (pipelined EXISTS / SET / DEL, MGET) must be split per node by redis-py.
def cluster_tier(cluster, namespace: str = NS, **kw) -> RedisRemoteTier:
    return RedisRemoteTier(cluster.url, namespace, cluster=True, **kw)


def test_cluster_payload_round_trip_over_several_slots(redis_cluster):
    tier = cluster_tier(redis_cluster)
    n = 24
    arrays = [
        np.random.default_rng(i).standard_normal((n, *SHAPE)).astype(np.float16) for i in range(4)
    ]
    spec = block_spec(arrays)
    keys = kvpool.hash_blocks(list(range(n * BS)), BS)
    assert len(redis_cluster.slot_owners([tier.prefix + k for k in keys])) == 3, (
        "keys on every node"
    )
    bodies = [b"".join(a[i].tobytes() for a in arrays) for i in range(n)]
    assert tier.exists_many(keys) == [False] * n
    tier.put_many(keys, [encode_payload(k, spec, b) for k, b in zip(keys, bodies, strict=True)])
    assert tier.exists_many(keys) == [True] * n
    # Order is kept across nodes: every payload comes back under its own key.
    mixed = keys[::-1] + kvpool.hash_blocks(list(range(10_000, 10_000 + 2 * BS)), BS)
    got = tier.get_many(mixed)
    assert got[n:] == [None, None]
    for k, p in zip(mixed[:n], got[:n], strict=True):
        assert bytes(decode_payload(k, spec, p, len(bodies[0]))) == bodies[keys.index(k)]
    st = tier.stats()
    assert (
        st["puts"] == n
        and st["get_hits"] == n
        and st["bytes_in"] == st["bytes_out"] > n * len(bodies[0])
    )
    assert st["errors"] == st["timeouts"] == 0
    assert tier.delete_many(keys) == n
    assert tier.get_many(keys) == [None] * n and tier.exists_many(keys) == [False] * n
    assert tier.exists_many([]) == [] and tier.get_many([]) == []
    tier.close()


def test_cluster_namespace_isolation(redis_cluster):
    a = cluster_tier(redis_cluster)
    other = make_namespace(
        "test-model",
        dtype="float16",
        num_kv_heads=2,
        head_dim=8,
        block_size=BS,
        num_layers=LAYERS,
        layout="tp2:rank1",
    )
    b = cluster_tier(redis_cluster, other)
    keys = kvpool.hash_blocks(list(range(6 * BS)), BS)
    a.put_many(keys, [bytes([i]) * 40 for i in range(6)])
    assert a.exists_many(keys) == [True] * 6
    assert b.exists_many(keys) == [False] * 6, "another layout never sees these blocks"
    assert b.get_many(keys) == [None] * 6
    ea, eb = Engine(a), Engine(b)
    p = prompt(51, 5)
    ea.serve(p)
    assert eb.serve(p) == 0
    assert Engine(cluster_tier(redis_cluster)).serve(p) == 5 * BS
    for e in (ea, eb):
        e.cleanup()


def test_cluster_corrupt_payload_is_a_miss_never_wrong_kv(redis_cluster):
    tier = cluster_tier(redis_cluster)
    ea = Engine(tier)
    p = prompt(52, 5)
    ea.serve(p)
    chain = kvpool.hash_blocks(p, BS)
    assert len(redis_cluster.slot_owners([tier.prefix + k for k in chain[:5]])) >= 2
    raw = tier.get_many([chain[3]])[0]
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 0xFF
    tier.put_many([chain[3]], [bytes(bad)])
    eb = Engine(cluster_tier(redis_cluster))
    assert eb.serve(p) == 3 * BS, "the chain stops at the corrupt block; blocks 0-2 still hit"
    st = eb.pool.stats()["remote"]
    assert st["corrupt"] == 1 and st["fetched_blocks"] == 3 and st["failed_fetch_blocks"] == 2
    assert st["errors"] == 0
    ea.cleanup()
    eb.cleanup()


def test_cluster_pool_allocate_one_lookup_fetches_bit_identical_kv(redis_cluster):
    ea = Engine(cluster_tier(redis_cluster))
    p = prompt(53, 8)
    ea.serve(p)
    chain = kvpool.hash_blocks(p, BS)
    tier = cluster_tier(redis_cluster)
    assert tier.exists_many(chain[:8]) == [True] * 8, "written through by the first instance"
    assert len(redis_cluster.slot_owners([tier.prefix + k for k in chain[:8]])) >= 2
    eb = Engine(tier)
    seq = kvpool.Sequence(p)
    before = tier.stats()["exists_calls"]
    assert eb.pool.allocate(seq)
    assert tier.stats()["exists_calls"] - before == 1, "one existence round trip for the request"
    st = eb.pool.stats()["remote"]
    assert st["lookups"] == 1 and st["lookup_keys"] == 8 and st["lookup_failures"] == 0
    eb.ex.step(eb.pool)  # remote -> host fetch, then host -> device load
    assert seq.num_cached_tokens == 8 * BS
    eb.verify(seq)  # bit-identical to the KV the first instance computed
    st = eb.pool.stats()["remote"]
    assert st["fetched_blocks"] == 8 and st["failed_fetch_blocks"] == 0 and st["errors"] == 0
    assert tier.stats()["get_calls"] == 1
    eb.compute(seq)
    eb.pool.deallocate(seq)
    ea.cleanup()
    eb.cleanup()


def test_cluster_node_killed_mid_run_degrades_to_misses_and_leaks_nothing():
    """A server killed mid-run, on a cluster: one of three masters dies (no replicas,
    so its slots are gone); requests keep being served, failures are counted misses, and no
    exception reaches the scheduler. Its own cluster: the module's one stays whole."""
    cluster = RedisClusterServers()
    cluster.start()
    try:
        tier = cluster_tier(cluster, timeout_ms=200, retry_interval_ms=50)
        e = Engine(tier)
        rng = random.Random(7)
        deadline = time.monotonic() + 60
        for i in range(40):
            assert time.monotonic() < deadline
            seq = kvpool.Sequence(prompt(rng.randrange(6), 3 + rng.randrange(4), shared=1))
            assert e.pool.allocate(seq)
            if i == 16:
                cluster.nodes[1].kill()  # after the lookup: this request's fetch and write fail
            e.ex.step(e.pool)
            e.verify(seq)
            e.compute(seq)
            e.pool.deallocate(seq)
            e.ex.step(e.pool)
            e.pool.check()
            if i % 5 == 0:
                e.pool.reset_prefix_cache()  # force remote lookups
        st = e.pool.stats()["remote"]
        assert st["fetched_blocks"] > 0, "hits before the kill"
        assert st["errors"] + st["timeouts"] >= 1
        assert st["lookup_failures"] + st["skipped"] >= 1
        e.cleanup()
    finally:
        cluster.stop()
    assert all(node.proc is None for node in cluster.nodes)


# ------------------------------------------------------------------------------ bad input
def test_bad_arguments_name_themselves(server):
    tier = RedisRemoteTier(server.url, NS)
    with pytest.raises(ValueError, match="^remote_policy"):
        kvpool.HierarchyBlockManagerPool(8, 8, BS, remote=tier, remote_policy="never")
    with pytest.raises(ValueError, match="^remote_budget_ms"):
        kvpool.HierarchyBlockManagerPool(8, 8, BS, remote=tier, remote_budget_ms=0)
    with pytest.raises(TypeError, match="^remote"):
        kvpool.HierarchyBlockManagerPool(8, 8, BS, remote=object())
    with pytest.raises(ValueError, match="^url"):
        RedisRemoteTier("http://127.0.0.1:1", NS)
    with pytest.raises(ValueError, match="^namespace"):
        RedisRemoteTier(server.url, "")
    with pytest.raises(ValueError, match="^keys"):
        tier.exists_many([b"short"])
    with pytest.raises(ValueError, match="^num_kv_heads"):
        make_namespace("m", dtype="float16", num_kv_heads=0, head_dim=8, block_size=4, num_layers=1)
    pool = kvpool.HierarchyBlockManagerPool(8, 8, BS, remote=tier)
    assert (
        pool.remote is tier
        and pool.remote_policy == "write_through"
        and pool.remote_budget_ms == 50.0
    )
    seq = kvpool.Sequence(list(range(3 * BS + 1)))
    # Nothing stored remotely: no fetch plans; a wrong-shaped report is refused.
    assert pool.allocate(seq) and pool.take_fetch_plans() == []
    with pytest.raises(TypeError, match="^plans"):
        pool.complete_fetches([1])
