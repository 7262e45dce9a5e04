"""Self-describing KV events (R21): sequence numbers gap-free per pool and dp
rank over every medium, the bounded replay buffer a consumer resyncs from after a gap, device,
host and remote events of a HierarchyBlockManagerPool, and the same form as vLLM's events."""

from __future__ import annotations

import pathlib
import random

import kvpool
import pytest
from kvpool.index.streams import PrefixIndex, event_from_dict, event_to_dict
from kvpool.index.vllm_events import VllmEventReader
from kvpool.tiers.memory import MemoryRemoteTier
from kvpool.tiers.remote_transfer import RemoteTransfer

BS = 4
FIELDS = (
    "sequence",
    "kind",
    "medium",
    "dp_rank",
    "group",
    "group_kind",
    "sliding_window",
    "block_size",
    "extra_key",
    "parent_hash",
    "block_hashes",
    "token_ids",
)
DATA = pathlib.Path(__file__).parents[1] / "index" / "data"


class NoData:
    """``kvpool.tiers.remote_transfer.HostBlockIO`` without KV data (a fixed stand-in body)."""

    def host_block_spec(self, rank):
        return "test:8"

    def read_host_blocks(self, rank, ids):
        return [b"\x00" * 8 for _ in ids]

    def write_host_blocks(self, rank, ids, bodies):
        pass


def serve(pool, tokens, transfer=None, extra_key=None):
    """One request through a pool: allocate (host/remote hits), compute, release, transfers."""
    seq = kvpool.Sequence(tokens, extra_key=extra_key)
    if not pool.allocate(seq):
        return None
    hier = hasattr(pool, "take_load_plans")
    if hier:
        if transfer is not None:
            transfer.run_fetches(pool.take_fetch_plans())
        pool.complete_loads(pool.take_load_plans())
    seq.num_computed_tokens = len(seq)
    pool.cache(seq)
    pool.deallocate(seq)
    if hier:
        plans = pool.take_offload_plans()
        if transfer is not None:
            transfer.before_host_writes(plans)
        pool.complete_offloads(plans)
        if transfer is not None:
            transfer.after_offloads(plans)
    return seq


def random_prompt(rng):
    prefix = rng.randrange(6)
    return [1000 * prefix + i for i in range(rng.randrange(2, 5) * BS)] + [
        rng.randrange(50) for _ in range(rng.randrange(0, 3) * BS + rng.randrange(BS))
    ]


def hierarchy(remote=None, **kw):
    return kvpool.HierarchyBlockManagerPool(10, 12, BS, enable_events=True, remote=remote, **kw)


def test_sequence_numbers_are_gap_free_per_pool_and_rank_over_every_medium():
    rng = random.Random(1)
    tier = MemoryRemoteTier(capacity=40)
    pools = [hierarchy(tier, dp_size=2), hierarchy(tier, dp_size=2)]
    transfers = [RemoteTransfer(p, NoData()) for p in pools]
    seen = [{0: [], 1: []} for _ in pools]
    media = set()
    for step in range(60):
        k = rng.randrange(2)
        serve(pools[k], random_prompt(rng), transfers[k])
        if step == 30:
            pools[k].reset_prefix_cache()
        for p, pool in enumerate(pools):
            for e in pool.drain_events():
                seen[p][e.dp_rank].append(e.sequence)
                media.add(e.medium)
                assert (
                    e.group == 0 and e.group_kind == "full_attention" and e.sliding_window is None
                )
                assert e.block_size == BS
        for pool in pools:
            pool.check()
    assert media == {"device", "host", "remote"}, "every medium's events appear"
    for p, pool in enumerate(pools):
        for rank in (0, 1):
            numbers = seen[p][rank]
            assert numbers == list(range(1, len(numbers) + 1)), (
                "gap-free, from 1, per pool and rank"
            )
            assert pool.last_event_sequence(rank) == len(numbers)
    assert any(seen[0][r] for r in (0, 1)) and any(seen[1][r] for r in (0, 1))


def test_cleared_events_carry_every_field():
    pool = hierarchy()
    serve(pool, list(range(3 * BS)))
    pool.drain_events()
    pool.reset_prefix_cache()
    events = pool.drain_events()
    assert {(e.kind, e.medium) for e in events} == {("cleared", "device"), ("cleared", "host")}
    for e in events:
        assert all(hasattr(e, f) for f in FIELDS)
        assert e.block_size == BS and e.dp_rank == 0 and e.parent_hash is None and e.sequence >= 1


def test_a_consumer_that_sees_a_gap_resyncs_from_the_replay_buffer():
    rng = random.Random(2)
    pool = kvpool.BlockManagerPool(12, BS, dp_size=2, enable_events=True, event_replay=64)
    full = kvpool.KVIndex()  # saw everything
    lossy = kvpool.KVIndex()  # lost some batches, then resynced from the replay buffer
    lost = 0
    for step in range(80):
        serve(pool, random_prompt(rng))
        batch = pool.drain_events()
        full.apply(7, batch)
        if step % 9 == 4 and batch:
            lost += 1
            continue  # this batch never arrives
        report = lossy.apply(7, batch)
        for gap in report["gaps"]:
            replay = pool.events_since(gap["dp_rank"], gap["expected"])
            assert replay is not None and replay[0].sequence == gap["expected"]
            after = lossy.apply(7, replay)
            assert after["gaps"] == [], "the replay fills the gap"
        lossy.check()
    assert lost > 0
    for rank in (0, 1):
        replay = pool.events_since(rank, pool.last_event_sequence(rank) + 1)
        assert replay == [], "nothing after the last number"
        lossy.apply(7, pool.events_since(rank, max(1, pool.last_event_sequence(rank) - 3)) or [])
    probe = [1000 * p + i for p in range(6) for i in range(4 * BS)]
    for p in range(6):
        tokens = probe[p * 4 * BS : (p + 1) * 4 * BS]
        assert sorted(lossy.lookup(tokens)) == sorted(full.lookup(tokens))
    assert sorted(s["last"] for s in lossy.sources()) == sorted(s["last"] for s in full.sources())


def test_c5_events_since_zero_is_everything_while_nothing_was_dropped():
    """C5: numbers start at 1, so `events_since(r, 0)` asks what `events_since(r, 1)` asks: every
    event, which the buffer gives while it has dropped none, and None once it has."""
    pool = kvpool.BlockManagerPool(12, BS, enable_events=True, event_replay=4)
    assert pool.events_since(0, 0) == [] == pool.events_since(0, 1)
    serve(pool, list(range(2 * BS)))
    events = pool.drain_events()
    assert 0 < len(events) <= 4
    as_dicts = [event_to_dict(e) for e in events]
    assert [event_to_dict(e) for e in pool.events_since(0, 0)] == as_dicts
    assert [event_to_dict(e) for e in pool.events_since(0, 1)] == as_dicts
    index = kvpool.KVIndex()
    index.apply(0, pool.events_since(0, 0))  # a consumer starting from scratch loses nothing
    assert max(r[3] for r in index.lookup(list(range(2 * BS)))) == 2
    for i in range(1, 9):  # evictions and stores: more than the buffer keeps
        serve(pool, [100 * i + t for t in range(2 * BS)])
    assert pool.last_event_sequence(0) > 4
    assert pool.events_since(0, 0) is None and pool.events_since(0, 1) is None
    assert kvpool.BlockManagerPool(12, BS).events_since(0, 0) == [], "no events: nothing lost"


def test_a_buffer_that_no_longer_reaches_back_answers_none_and_the_consumer_resyncs():
    pool = kvpool.BlockManagerPool(12, BS, enable_events=True, event_replay=2)
    for i in range(6):
        serve(pool, [100 * i + t for t in range(2 * BS)])
    events = pool.drain_events()
    last = pool.last_event_sequence(0)
    assert len(events) == last > 3
    assert pool.events_since(0, 1) is None, "evicted from the bounded buffer"
    assert [e.sequence for e in pool.events_since(0, last - 1)] == [last - 1, last]
    with pytest.raises(ValueError, match="sequence"):
        pool.events_since(0, last + 2)
    with pytest.raises(ValueError, match="dp_rank"):
        pool.events_since(1, 1)
    index = kvpool.KVIndex()
    index.apply(0, events[:1])
    report = index.apply(0, events[3:])
    assert report["gaps"] and pool.events_since(0, report["gaps"][0]["expected"]) is None
    index.resync(0, 0)  # drop the source, start afresh from what comes next
    serve(pool, list(range(900, 900 + 2 * BS)))
    assert index.apply(0, pool.drain_events())["gaps"] == []
    assert max(r[3] for r in index.lookup(list(range(900, 900 + 2 * BS)))) == 2
    off = kvpool.BlockManagerPool(12, BS)
    assert off.events_since(0, 1) == [] and off.last_event_sequence(0) == 0
    assert (
        kvpool.BlockManagerPool(12, BS, enable_events=True, event_replay=0).events_since(0, 1) == []
    )


def test_every_medium_reaches_the_index_and_the_redis_form():
    tier = MemoryRemoteTier()
    writer = hierarchy(tier)
    serve(writer, list(range(4 * BS)), RemoteTransfer(writer, NoData()))
    events = writer.drain_events()
    assert {e.medium for e in events} == {"device", "host", "remote"}
    remote = [e for e in events if e.medium == "remote"]
    assert remote[0].kind == "stored" and remote[0].parent_hash is None
    assert list(remote[0].token_ids) == list(range(4 * BS)), "tokens from the host cache"
    index = kvpool.KVIndex()
    index.apply(3, events)
    rows = {(r[2], r[4]) for r in index.lookup(list(range(4 * BS)))}
    assert rows == {("device", 16), ("host", 16), ("remote", 16)}
    # the Redis Streams form round-trips into the same index state
    again = kvpool.KVIndex()
    again.apply(3, [event_from_dict(event_to_dict(e)) for e in events])
    assert sorted(again.lookup(list(range(4 * BS)))) == sorted(index.lookup(list(range(4 * BS))))
    small = PrefixIndex()
    for e in events:
        small.apply("a", event_to_dict(e))
    assert small.best_holder(kvpool.hash_blocks(list(range(4 * BS)), BS)) == (("a", 0), 4)
    # a remote block found missing (evicted from the tier) is a "removed" event of the reader
    reader = hierarchy(tier)
    keys = kvpool.hash_blocks(list(range(4 * BS)), BS)
    seq = kvpool.Sequence(list(range(4 * BS)) + [7])
    assert reader.allocate(seq)  # the lookup saw all four blocks on the tier
    tier.delete_many(keys[2:])  # gone before the fetch
    RemoteTransfer(reader, NoData()).run_fetches(reader.take_fetch_plans())
    removed = [e for e in reader.drain_events() if e.medium == "remote"]
    assert {e.kind for e in removed} == {"removed"}
    assert [h for e in removed for h in e.block_hashes] == keys[2:], (
        "blocks the reader never held: one event each"
    )
    reader.complete_loads(reader.take_load_plans())
    assert seq.num_cached_tokens == 2 * BS, "the chain stops at the first missing block"


def test_record_remote_events_validates_and_groups_chains():
    pool = hierarchy()
    hs = kvpool.hash_blocks(list(range(3 * BS)), BS)
    # blocks neither tier knows: no parent to link them, one event each, no tokens
    assert pool.record_remote_events(0, "stored", hs) == 3
    unknown = pool.drain_events()
    assert [(len(e.block_hashes), e.parent_hash, list(e.token_ids)) for e in unknown] == [
        (1, None, [])
    ] * 3
    # blocks the host holds: one event per chain, parent and tokens from the host cache
    serve(pool, list(range(3 * BS)))
    pool.drain_events()
    assert pool.record_remote_events(0, "stored", hs[1:]) == 1
    (known,) = pool.drain_events()
    assert known.medium == "remote" and known.block_hashes == hs[1:] and known.parent_hash == hs[0]
    assert list(known.token_ids) == list(range(BS, 3 * BS))
    assert pool.record_remote_events(0, "removed", hs[2:] + hs[:1]) == 2
    assert [e.block_hashes for e in pool.drain_events()] == [hs[2:], hs[:1]]
    with pytest.raises(ValueError, match="kind"):
        pool.record_remote_events(0, "cleared", hs)
    with pytest.raises(ValueError, match="dp_rank"):
        pool.record_remote_events(1, "stored", hs)
    with pytest.raises(ValueError, match="block_hashes"):
        pool.record_remote_events(0, "stored", [b"short"])
    with pytest.raises(TypeError, match="block_hashes"):
        pool.record_remote_events(0, "stored", b"x" * 16)
    assert pool.drain_events() == [], "a rejected call records nothing"
    assert kvpool.HierarchyBlockManagerPool(10, 12, BS).record_remote_events(0, "stored", hs) == 0


def test_vllm_messages_read_into_the_same_form():
    """vLLM 0.33.0's msgpack batch and the pool's events give the index the same fields."""
    reader = VllmEventReader(kvpool.KVIndex())
    events = reader.read(5, (DATA / "vllm_kv_event_example.msgpack").read_bytes(), sequence=9)
    assert events
    for e in events:
        assert set(FIELDS) <= set(e), f"vLLM event lacks {set(FIELDS) - set(e)}"
        assert e["sequence"] == 9
    pool = hierarchy()
    serve(pool, list(range(2 * BS)))
    for e in pool.drain_events():
        assert all(hasattr(e, f) for f in FIELDS)
        d = event_to_dict(e)
        assert set(FIELDS) <= set(d)


def test_pool_events_travel_in_the_msgpack_wire_format():
    """docs/events.md's wire format carries every field of the pool's events, every medium."""
    pool = hierarchy()
    serve(pool, list(range(3 * BS)))
    events = pool.drain_events()
    data = kvpool.encode_events(events)
    decoded = kvpool.decode_events(data)
    assert [(d["sequence"], d["medium"], d["kind"]) for d in decoded] == [
        (e.sequence, e.medium, e.kind) for e in events
    ]
    assert {d["medium"] for d in decoded} == {"device", "host"}
    for d, e in zip(decoded, events, strict=True):
        assert d["block_hashes"] == list(e.block_hashes) and d["block_size"] == e.block_size
        assert d["group_kind"] == e.group_kind and d["dp_rank"] == e.dp_rank
    index = kvpool.KVIndex()
    assert index.apply_msgpack(0, data)["applied"] == len(events)
    assert sorted(index.lookup(list(range(3 * BS)))) == [
        (0, 0, "device", 3, 12),
        (0, 0, "host", 3, 12),
    ]


def test_an_index_fed_the_events_agrees_with_the_pool_after_every_step():
    """Random requests through a two-rank hierarchy pool (device evictions, host offloads and
    host evictions): after every step, the index's device and host matches of a probe prompt on
    each rank are what the pool's side-effect-free plan finds there."""
    rng = random.Random(4)
    pool = kvpool.HierarchyBlockManagerPool(10, 8, BS, dp_size=2, enable_events=True)
    index = kvpool.KVIndex()
    probes = [[1000 * p + i for i in range(4 * BS)] + [1] for p in range(6)]
    compared = host_hits = 0
    for _ in range(50):
        held = serve(pool, random_prompt(rng))
        assert held is not None
        assert index.apply(0, pool.drain_events())["gaps"] == []
        pool.check()
        index.check()
        for tokens in probes:
            rows = index.lookup(tokens)
            plan = pool.plan(kvpool.Sequence(tokens))
            assert plan is not None
            rank = plan.dp_rank
            device = max((t for _, r, m, _, t in rows if r == rank and m == "device"), default=0)
            host = max((t for _, r, m, _, t in rows if r == rank and m == "host"), default=0)
            assert plan.device_hit_tokens == device
            # the host hit continues the device match in the host cache (prefix-closed, R10)
            assert plan.device_hit_tokens + plan.host_hit_tokens == max(device, host)
            compared += plan.device_hit_tokens
            host_hits += plan.host_hit_tokens
    assert compared > 0 and host_hits > 0


def test_linear_state_checkpoints_are_group_1_events_and_the_index_trims_as_the_pool():
    """R22-R24 with events: committed checkpoints are stored events of group 1
    (``linear_state``), evicted ones removed events; the index then credits an instance with a
    prefix only up to a checkpointed boundary, exactly as the pool's deepest-checkpoint rule."""
    rng = random.Random(6)
    pool = kvpool.BlockManagerPool(
        40, BS, linear_state_slots=5, checkpoint_interval=2 * BS, enable_events=True
    )
    index = kvpool.KVIndex()
    kv_only = kvpool.KVIndex()  # the same events without group 1: full attention alone
    prompts = [[1000 * p + i for i in range(5 * BS + 2)] for p in range(5)]
    kinds = set()
    trimmed = 0
    for _ in range(25):
        tokens = prompts[rng.randrange(len(prompts))]
        seq = kvpool.Sequence(tokens)
        assert pool.allocate(seq)
        for n in range(seq.num_computed_tokens + 2 * BS, len(tokens) + 2 * BS, 2 * BS):
            seq.num_computed_tokens = min(n, len(tokens))
            pool.cache(seq)
            pool.commit_linear_state_plan(pool.take_linear_state_plan())
        pool.deallocate(seq)
        events = pool.drain_events()
        kinds |= {(e.group, e.group_kind, e.kind) for e in events}
        assert all(len(e.block_hashes) == 1 for e in events if e.group == 1 and e.kind != "group")
        assert index.apply(0, events)["gaps"] == []
        # unnumbered: the stream without group 1 has gaps by design (a numbered one would stall)
        kv_only.apply(
            0,
            [
                {**event_from_dict(event_to_dict(e)), "sequence": None}
                for e in events
                if e.group == 0
            ],
        )
        pool.check()
        for probe in prompts:
            plan = pool.plan(kvpool.Sequence(probe))
            assert plan is not None
            held = max((t for _, _, m, _, t in index.lookup(probe) if m == "device"), default=0)
            assert held == plan.num_cached_tokens, (
                "the index trims to a checkpoint as the pool does"
            )
            kv = max((t for _, _, m, _, t in kv_only.lookup(probe) if m == "device"), default=0)
            trimmed += kv > held
    assert (1, "linear_state", "stored") in kinds and (1, "linear_state", "removed") in kinds
    assert trimmed > 0, "some KV hits were trimmed to a checkpoint"


def window_prompt(rng):
    prefix = rng.randrange(4)
    return [1000 * prefix + i for i in range(rng.randrange(1, 7) * BS)] + [
        rng.randrange(50) for _ in range(rng.randrange(0, 3) * BS + rng.randrange(BS))
    ]


def small_index_blocks(small, holder, tokens):
    """Blocks the small PrefixIndex credits ``holder`` with for ``tokens`` (every group)."""
    chain = [bytes(h).hex() for h in kvpool.hash_blocks(tokens, BS)]
    held = small.by_holder.get(holder, set())
    n = next((i for i, h in enumerate(chain) if h not in held), len(chain))
    return small.admits(holder, chain, n)


@pytest.mark.parametrize("window", [1, 5, 8, 13])
def test_sliding_window_group_events_follow_what_the_pool_can_hit(window):
    """R21, R25: a pool with a sliding-window group records stored events of
    its published window blocks (group 1, ``sliding_window``, every field) and removed events
    once they stop being findable (slid out, evicted, last handle dropped without deallocate),
    numbered gap-free with the rest of the rank's stream; after every step of a random workload,
    an index fed the events (``KVIndex`` and the small ``PrefixIndex``) credits each probe with
    exactly the device hit the pool's side-effect-free plan finds: full attention and window."""
    rng = random.Random(window)
    pool = kvpool.BlockManagerPool(
        48, BS, sliding_window=window, swa_num_blocks=16, dp_size=2, enable_events=True
    )
    index, kv_only, small = kvpool.KVIndex(), kvpool.KVIndex(), PrefixIndex()
    seen = {0: [], 1: []}
    kinds = set()
    live = []
    probes = [[1000 * p + i for i in range(6 * BS)] + [1] for p in range(4)]
    compared = trimmed = 0
    for step in range(120):
        r = rng.random()
        if r < 0.35 or not live:
            seq = kvpool.Sequence(window_prompt(rng))
            if pool.allocate(seq):
                live.append(seq)
        elif r < 0.7:
            seq = live[rng.randrange(len(live))]
            seq.num_computed_tokens = len(seq)
            pool.cache(seq)
            seq.append_token(rng.randrange(50))
            if not pool.may_append(seq):
                live.remove(seq)
                pool.deallocate(seq)
        elif r < 0.85:
            pool.deallocate(live.pop(rng.randrange(len(live))))
        elif r < 0.95:
            live.pop(rng.randrange(len(live)))  # dropped without deallocate: lock-free (R27)
        else:
            pool.reset_prefix_cache()
        events = pool.drain_events()
        for e in events:
            seen[e.dp_rank].append(e.sequence)
            assert (
                all(hasattr(e, f) for f in FIELDS) and e.block_size == BS and e.medium == "device"
            )
            if e.kind == "group":  # the rank's groups, announced before its other events
                continue
            if e.group == 1:
                assert (e.group_kind, e.sliding_window) == ("sliding_window", window)
                assert e.kind in ("stored", "removed") and e.block_hashes
                kinds.add(e.kind)
                if e.kind == "stored":
                    assert len(e.token_ids) == BS * len(e.block_hashes)
            else:
                assert (e.group, e.group_kind, e.sliding_window) == (0, "full_attention", None)
        assert index.apply(0, events)["gaps"] == []
        # the same without group 1, unnumbered (the filtered stream has gaps by design)
        kv_only.apply(
            0,
            [
                {**event_from_dict(event_to_dict(e)), "sequence": None}
                for e in events
                if e.group == 0
            ],
        )
        for e in events:
            small.apply("a", event_to_dict(e))
        pool.check()
        index.check()
        for tokens in probes:
            plan = pool.plan(kvpool.Sequence(tokens))
            if plan is None:
                continue
            rank = plan.dp_rank
            rows = [t for _, r, m, _, t in index.lookup(tokens) if r == rank and m == "device"]
            assert max(rows, default=0) == plan.num_cached_tokens, f"step {step}"
            assert small_index_blocks(small, ("a", rank), tokens) * BS == plan.num_cached_tokens
            kv = max(
                (t for _, r, m, _, t in kv_only.lookup(tokens) if r == rank and m == "device"),
                default=0,
            )
            compared += plan.num_cached_tokens
            trimmed += kv > plan.num_cached_tokens
    for rank, numbers in seen.items():
        assert numbers == list(range(1, len(numbers) + 1)), "gap-free, from 1, per rank"
        assert pool.last_event_sequence(rank) == len(numbers)
    assert kinds == {"stored", "removed"}
    assert compared > 0, "some probes hit"
    # a window of one token needs no block before the boundary: it never trims a hit
    assert (trimmed > 0) == (window > 1), "full attention alone claims hits the window cannot serve"


def test_shared_window_store_events_follow_the_attachments():
    """One block store (R25, docs/hybrid.md): a window block is "stored" when it is attached to
    its node (one event per run) and stays findable after it slides out or its sequence goes
    (kept, evictable); it is "removed" only when it is evicted or its node is; a reset's device
    "cleared" covers the group. After every drain the index agrees with what a hit can find."""
    pool = kvpool.BlockManagerPool(12, BS, sliding_window=8, enable_events=True)
    tokens = list(range(4 * BS + 1))
    hashes = kvpool.hash_blocks(tokens, BS, extra_key=b"k")
    seq = kvpool.Sequence(tokens, extra_key=b"k")
    assert pool.allocate(seq)
    seq.num_computed_tokens = 4 * BS
    pool.cache(seq)
    window = [e for e in pool.drain_events() if e.group == 1]
    assert [(e.kind, e.group_kind, e.sliding_window) for e in window[:1]] == [
        ("group", "sliding_window", 8)
    ], "the group is announced first"
    window = window[1:]
    assert [(e.kind, e.block_hashes, e.parent_hash, e.extra_key) for e in window] == [
        ("stored", hashes, None, b"k")
    ], "one event for the run, nothing removed by the slide"
    assert window[0].group_kind == "sliding_window" and window[0].sliding_window == 8
    del seq  # the blocks stay cached: nothing is removed
    assert [e for e in pool.drain_events() if e.group == 1] == []
    # a new chain takes every id: the old chain and its window blocks are evicted
    other = kvpool.Sequence([100 + t for t in tokens])
    assert pool.allocate(other)
    removed = [e for e in pool.drain_events() if e.group == 1]
    assert removed and all(e.kind == "removed" for e in removed)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes)
    other.num_computed_tokens = 4 * BS
    pool.deallocate(other)
    pool.drain_events()
    pool.reset_prefix_cache()
    events = pool.drain_events()
    assert [(e.kind, e.group) for e in events] == [("cleared", 0)], "one cleared covers every group"
    pool.check()


def test_window_removal_after_a_lock_free_drop_and_the_reset_clears_the_group():
    # a window group with a store of its own: slid-out blocks are freed at once
    pool = kvpool.BlockManagerPool(32, BS, sliding_window=8, swa_num_blocks=32, enable_events=True)
    tokens = list(range(4 * BS + 1))
    seq = kvpool.Sequence(tokens, extra_key=b"k")
    assert pool.allocate(seq)
    seq.num_computed_tokens = 4 * BS
    pool.cache(seq)
    stored = [e for e in pool.drain_events() if e.group == 1 and e.kind != "group"]
    hashes = kvpool.hash_blocks(tokens, BS, extra_key=b"k")
    assert [e.kind for e in stored] == ["stored", "removed"]
    assert (
        stored[0].block_hashes == hashes
        and stored[0].parent_hash is None
        and stored[0].extra_key == b"k"
    )
    assert stored[1].block_hashes == hashes[:2], "slid out of the window"
    del seq  # its last handles drop where the pool does not see it
    removed = [e for e in pool.drain_events() if e.group == 1]
    assert [(e.kind, e.block_hashes, e.extra_key) for e in removed] == [
        ("removed", hashes[2:], b"k")
    ]
    again = kvpool.Sequence(tokens, extra_key=b"k")
    assert pool.allocate(again)
    again.num_computed_tokens = 4 * BS
    pool.deallocate(again)  # keeps the window tail
    assert [e.kind for e in pool.drain_events() if e.group == 1] == ["stored", "removed"]
    pool.reset_prefix_cache()
    events = pool.drain_events()
    assert [(e.kind, e.group) for e in events] == [("cleared", 0)], "one cleared covers every group"
    index = kvpool.KVIndex()
    index.apply(0, events)
    assert index.lookup(tokens) == []
    pool.check()
