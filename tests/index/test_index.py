"""kvpool.KVIndex from Python: events as dicts and objects (the
pool's R21 events), the msgpack wire format, vLLM 0.33.0's KV event messages, speculative
entries, gaps, dump/load, bad input, threads, and a randomized comparison with a plain model."""

from __future__ import annotations

import pathlib
import threading

import kvpool
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool.index.vllm_events import VllmEventReader, vllm_extra_key

DATA = pathlib.Path(__file__).parent / "data"
BS = 4


def chain(tokens, block_size=BS, extra_key=None):
    return kvpool.hash_blocks(tokens, block_size, extra_key=extra_key)


def stored(hashes, parent=None, **kw):
    return {"kind": "stored", "block_size": BS, "block_hashes": hashes, "parent_hash": parent, **kw}


def best(rows, instance, medium="device"):
    return max((r[3] for r in rows if r[0] == instance and r[2] == medium), default=0)


def test_every_instance_and_medium_in_one_call():
    idx = kvpool.KVIndex()
    tokens = list(range(32))
    c = chain(tokens)
    idx.apply(1, [stored(c)])
    idx.apply(2, [stored(c[:3]), stored(c[:5], medium="host")])
    rows = idx.lookup(tokens)
    assert sorted(rows) == [(1, 0, "device", 8, 32), (2, 0, "device", 3, 12), (2, 0, "host", 5, 20)]
    assert sorted(idx.lookup(block_hashes=c[:4], block_size=BS)) == [
        (1, 0, "device", 4, 16),
        (2, 0, "device", 3, 12),
        (2, 0, "host", 4, 16),
    ]
    idx.apply(1, [{"kind": "removed", "block_size": BS, "block_hashes": [c[4]]}])
    assert best(idx.lookup(tokens), 1) == 4
    idx.apply(2, [{"kind": "cleared", "block_size": BS, "medium": "host"}])
    assert best(idx.lookup(tokens), 2, "host") == 0 and best(idx.lookup(tokens), 2) == 3
    assert len(idx) == 7 + 3  # entries: a removal in the middle keeps the tail (it is still cached)
    idx.check()


def test_pool_events_are_read_as_objects():
    """R21's kvpool.KVEvent objects (no sequence or medium yet) apply as device events."""
    pool = kvpool.BlockManagerPool(64, BS, enable_events=True)
    tokens = list(range(100, 118))
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    seq.num_computed_tokens = len(tokens)
    pool.cache(seq)
    pool.deallocate(seq)
    events = pool.drain_events()
    assert events and all(isinstance(e, kvpool.KVEvent) for e in events)
    idx = kvpool.KVIndex()
    assert idx.apply(3, events)["applied"] == len(events)
    assert idx.lookup(tokens) == [(3, 0, "device", 4, 16)]
    pool.reset_prefix_cache()
    idx.apply(3, pool.drain_events())
    assert idx.lookup(tokens) == []


def test_bad_events_are_named_errors_and_apply_nothing():
    idx = kvpool.KVIndex()
    c = chain(list(range(8)))
    idx.apply(0, [stored(c[:1], sequence=0)])
    before = idx.dump()
    cases = [
        ({"kind": "evicted", "block_size": BS}, ValueError, r"events\[1\]\.kind"),
        ({"kind": "stored"}, ValueError, r"events\[1\]\.block_size"),
        (stored(["not bytes"]), TypeError, r"events\[1\]\.block_hashes"),
        (stored([b"short"]), ValueError, r"events\[1\]\.block_hashes"),
        (stored(c, medium="disk"), ValueError, r"events\[1\]\.medium"),
        (stored(c, group_kind="sliding_window"), ValueError, r"events\[1\]\.group_kind"),
        (stored(c, token_ids=[1, 2, 3]), ValueError, r"events\[1\]\.token_ids"),
        (stored(c, dp_rank=-1), ValueError, r"events\[1\]\.dp_rank"),
        (stored(c, sequence="x"), TypeError, r"events\[1\]\.sequence"),
        (stored(c, block_size=0), ValueError, r"events\[1\]\.block_size"),
    ]
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            idx.apply(0, [stored(c[1:2], c[0], sequence=1), bad])
        assert idx.dump() == before
    with pytest.raises(TypeError, match="events"):
        idx.apply(0, stored(c))
    with pytest.raises(ValueError, match="instance"):
        idx.apply(-1, [])
    with pytest.raises(ValueError, match="max_entries"):
        kvpool.KVIndex(max_entries=0)
    with pytest.raises(TypeError, match="token_ids"):
        idx.lookup()
    with pytest.raises(ValueError, match="block_size"):
        idx.lookup(block_hashes=c)
    with pytest.raises(ValueError, match="now"):
        idx.insert_speculative(0, list(range(8)), block_size=BS, now=float("nan"), ttl=1.0)
    with pytest.raises(ValueError, match="data"):
        kvpool.KVIndex.load(before[:-1])


def test_wire_format_round_trip_and_documented_shape():
    c = chain(list(range(8)))
    events = [
        stored(
            c,
            sequence=5,
            medium="host",
            dp_rank=1,
            group=1,
            group_kind="sliding_window",
            sliding_window=128,
            extra_key=b"salt",
            token_ids=list(range(8)),
        ),
        {"kind": "removed", "block_size": BS, "block_hashes": [c[1]], "sequence": 6},
        {"kind": "cleared", "block_size": BS, "sequence": 7},
    ]
    data = kvpool.encode_events(events)
    decoded = kvpool.decode_events(data)
    assert decoded[0] == {
        "sequence": 5,
        "kind": "stored",
        "medium": "host",
        "dp_rank": 1,
        "group": 1,
        "group_kind": "sliding_window",
        "sliding_window": 128,
        "block_size": BS,
        "extra_key": b"salt",
        "parent_hash": None,
        "block_hashes": c,
        "token_ids": list(range(8)),
    }
    assert [e["kind"] for e in decoded] == ["stored", "removed", "cleared"]
    assert kvpool.encode_events(decoded) == data
    # The msgpack package writes the documented map by hand; defaults may be left out.
    by_hand = msgpack.packb(
        {
            "version": 1,
            "events": [
                {
                    "sequence": 0,
                    "kind": "stored",
                    "block_size": BS,
                    "block_hashes": c,
                    "future_field": 1,
                }
            ],
        }
    )
    idx = kvpool.KVIndex()
    assert idx.apply_msgpack(9, by_hand)["applied"] == 1
    assert idx.lookup(list(range(8))) == [(9, 0, "device", 2, 8)]
    with pytest.raises(ValueError, match="data"):
        idx.apply_msgpack(9, msgpack.packb({"version": 2, "events": []}))
    with pytest.raises(ValueError, match="data"):
        kvpool.decode_events(b"\xc1")


def test_speculative_entries_lapse_or_are_confirmed():
    idx = kvpool.KVIndex()
    tokens = list(range(24))
    assert idx.insert_speculative(4, tokens, block_size=BS, now=10.0, ttl=2.0) == 6
    assert idx.lookup(tokens, now=11.0) == [(4, 0, "device", 6, 24)]
    assert idx.lookup(tokens, now=12.0) == []
    idx.apply(4, [stored(chain(tokens)[:2])])
    assert idx.stats()["speculative_entries"] == 4
    assert idx.expire(12.0) == 4
    assert idx.lookup(tokens, now=99.0) == [(4, 0, "device", 2, 8)]
    assert (
        idx.insert_speculative(
            4, block_hashes=chain(tokens), block_size=BS, now=20.0, ttl=1.0, dp_rank=1
        )
        == 6
    )
    assert (4, 1, "device", 6, 24) in idx.lookup(tokens, now=20.5)
    idx.check()


def test_gaps_replay_and_resync():
    idx = kvpool.KVIndex()
    c = chain(list(range(24)))
    ev = [stored([c[i]], c[i - 1] if i else None, sequence=i) for i in range(6)]
    assert idx.apply(1, ev[:2])["applied"] == 2
    report = idx.apply(1, ev[3:5])
    assert report["gaps"] == [{"instance": 1, "dp_rank": 0, "expected": 2, "got": 3}]
    assert report["dropped"] == 2
    assert idx.sources() == [{"instance": 1, "dp_rank": 0, "last": 1, "stalled": 3}]
    report = idx.apply(1, ev)  # the replay buffer from the start
    assert (report["applied"], report["duplicates"]) == (5, 1)
    assert best(idx.lookup(list(range(24))), 1) == 6
    assert idx.stats()["stalled_sources"] == 0
    assert idx.resync(1) == 6
    assert idx.sources() == []
    assert idx.remove_instance(1) == 0


def test_g4_c3_the_last_unit_during_a_stall_is_applied_and_the_stall_stays():
    """C3: an event numbered `last` during a stall is applied (it is older than the hole), and
    only `last + 1` ends the stall (G4: a redelivery cleared it, the gap was reported twice)."""
    idx = kvpool.KVIndex()
    c = chain(list(range(24)))
    ev = [stored([c[i]], c[i - 1] if i else None, sequence=i) for i in range(6)]
    idx.apply(1, ev[:2])  # last = 1
    assert idx.apply(1, ev[4:5])["gaps"] == [{"instance": 1, "dp_rank": 0, "expected": 2, "got": 4}]
    assert idx.can_apply(1, 1) and idx.can_apply(1, 2)
    assert not idx.can_apply(1, 0) and not idx.can_apply(1, 5) and idx.can_apply(1, 0, dp_rank=1)
    # unit 1 again, with more of it: applied (its content counts), the stall stays
    more = {
        "kind": "stored",
        "block_size": BS,
        "block_hashes": c[:2],
        "medium": "host",
        "sequence": 1,
    }
    report = idx.apply(1, [ev[1], more])
    assert (report["applied"], report["gaps"]) == (2, [])
    assert (1, 0, "host", 2, 8) in idx.lookup(list(range(24)))
    assert idx.sources() == [{"instance": 1, "dp_rank": 0, "last": 1, "stalled": 4}]
    assert idx.stats()["stalled_sources"] == 1
    report = idx.apply(1, ev[5:6])
    assert (report["dropped"], report["gaps"]) == (1, []), "the same gap is not reported again"
    idx.apply(1, ev[2:])  # the replay from `expected`
    assert idx.sources() == [{"instance": 1, "dp_rank": 0, "last": 5, "stalled": None}]
    assert best(idx.lookup(list(range(24))), 1) == 6
    with pytest.raises(ValueError, match="sequence"):
        idx.can_apply(1, -1)
    with pytest.raises(TypeError, match="instance"):
        idx.can_apply("1", 1)
    idx.check()


def test_c4_apply_msgpack_is_strict():
    """C4: the wire format has one encoding (up to integer widths and key order): bin keys, str
    for bin, bin for a list, arrays for maps, repeated keys and trailing bytes are refused,
    naming `data`, and the index is unchanged. Unknown keys stay ignored."""
    c = chain(list(range(8)))
    event = {
        "sequence": 0,
        "kind": "stored",
        "block_size": BS,
        "block_hashes": c,
        "token_ids": list(range(8)),
    }
    idx = kvpool.KVIndex()
    assert (
        idx.apply_msgpack(
            1,
            msgpack.packb(
                {"version": 1, "events": [dict(event, later=[1, b"x"])]},
            ),
        )["applied"]
        == 1
    )
    before = idx.dump()
    text_hash = "0123456789abcdef"
    bad = {
        "bin keys": msgpack.packb({b"version": 1, b"events": []}),
        "a bin key in an event": msgpack.packb(
            {"version": 1, "events": [{b"kind": "stored", "block_size": BS, "block_hashes": c}]}
        ),
        "a bin enum": msgpack.packb({"version": 1, "events": [dict(event, kind=b"stored")]}),
        "a str hash": msgpack.packb(
            {
                "version": 1,
                "events": [dict(event, block_hashes=[text_hash], token_ids=list(range(4)))],
            }
        ),
        "a str parent": msgpack.packb(
            {
                "version": 1,
                "events": [
                    dict(event, block_hashes=c[1:], parent_hash=text_hash, token_ids=list(range(4)))
                ],
            }
        ),
        "a str extra key": msgpack.packb({"version": 1, "events": [dict(event, extra_key="salt")]}),
        "bin token ids": msgpack.packb(
            {"version": 1, "events": [dict(event, token_ids=bytes(range(8)))]}
        ),
        "a float": msgpack.packb({"version": 1, "events": [dict(event, block_size=4.0)]}),
        "a bool": msgpack.packb({"version": 1, "events": [dict(event, dp_rank=False)]}),
        "a batch as an array": msgpack.packb([1, [event]]),
        "an event as an array": msgpack.packb({"version": 1, "events": [list(event.values())]}),
        "trailing bytes": msgpack.packb({"version": 1, "events": [event]}) + b"\xc0",
        "a repeated key": b"\x83\xa7version\x01\xa6events\x90\xa7version\x01",
    }
    for what, data in bad.items():
        with pytest.raises(ValueError, match="data") as e:
            idx.apply_msgpack(1, data)
        with pytest.raises(ValueError, match="data"):
            kvpool.decode_events(data)
        assert idx.dump() == before, what
        assert "not a kvpool event batch" in str(e.value), what
    idx.check()


def test_dump_load_round_trip():
    idx = kvpool.KVIndex(max_entries=1000, hash_seed=7)
    tokens = list(range(40))
    idx.apply(2, [stored(idx.hash_blocks(tokens, BS), sequence=3)])
    idx.insert_speculative(5, tokens, block_size=BS, now=0.0, ttl=5.0)
    data = idx.dump()
    loaded = kvpool.KVIndex.load(data)
    loaded.check()
    assert loaded.dump() == data
    assert sorted(loaded.lookup(tokens, now=1.0)) == sorted(idx.lookup(tokens, now=1.0))
    assert loaded.stats() == idx.stats()
    assert loaded.sources() == idx.sources()
    small = kvpool.KVIndex.load(data, max_entries=3)
    assert len(small) <= 3
    # The hash seed is part of the index: lookups hash tokens with it.
    assert idx.hash_blocks(tokens, BS) == kvpool.hash_blocks(tokens, BS, hash_seed=7)
    assert (
        idx.hash_blocks(tokens[BS:], BS, parent_hash=idx.hash_blocks(tokens, BS)[0])
        == idx.hash_blocks(tokens, BS)[1:]
    )


def test_reads_run_beside_the_writer_in_threads():
    """The GIL is released in apply and lookup; readers see whole batches."""
    idx = kvpool.KVIndex()
    tokens = list(range(4 * 64))
    c = chain(tokens)
    errors: list[str] = []
    done = threading.Event()

    def reader():
        while not done.is_set():
            for instance, _, _, blocks, _ in idx.lookup(tokens):
                if blocks not in (instance + 1, 64):  # the states each batch leaves
                    errors.append(f"{instance}: {blocks}")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for round_ in range(200):
        for i in range(8):
            if round_ % 2:
                idx.apply(i, [stored(c[: i + 1])])
            else:
                idx.apply(
                    i,
                    [
                        stored(c[i + 1 :], c[i]),
                        {"kind": "removed", "block_size": BS, "block_hashes": c[i + 1 :]},
                        stored(c[i + 1 :], c[i]),
                    ],
                )
    done.set()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    idx.check()


# ------------------------------------------------------------------------------ vLLM events
def test_vllm_0_33_event_batch_is_read_into_the_same_form():
    """tests/data/vllm_kv_event_example.msgpack: a KVEventBatch vLLM 0.33.0's KVCacheManager
    produced (block size 4: request A with cache salt stores 2 blocks, B evicts them tail
    first and stores 4, then reset_prefix_cache), encoded as its ZmqEventPublisher does."""
    payload = (DATA / "vllm_kv_event_example.msgpack").read_bytes()
    idx = kvpool.KVIndex()
    reader = VllmEventReader(idx)
    events = reader.read(7, payload, sequence=41)
    assert [e["kind"] for e in events] == ["stored", "removed", "removed", "stored", "cleared"]
    assert all(e["sequence"] == 41 for e in events)
    a, b = list(range(11, 19)), list(range(21, 37))
    salt = vllm_extra_key(cache_salt="tenant-1")
    assert events[0]["block_hashes"] == idx.hash_blocks(a, 4, extra_key=salt)
    assert events[3]["block_hashes"] == idx.hash_blocks(b, 4)
    # Step by step: A's chain is found by its tokens under the salt key, not without it.
    idx.apply(7, events[:1])
    assert idx.lookup(a, extra_key=salt) == [(7, 0, "device", 2, 8)]
    assert idx.lookup(a) == []
    idx.apply(7, events[1:4])
    assert idx.lookup(a, extra_key=salt) == []
    assert idx.lookup(b) == [(7, 0, "device", 4, 16)]
    idx.apply(7, events[4:])
    assert idx.lookup(b) == []
    assert reader.keys[(7, 0)] == {}
    # Through the ZMQ frames, with the batch number as the unit's sequence: a lost batch is a gap.
    idx2 = kvpool.KVIndex()
    reader2 = VllmEventReader(idx2)
    idx2.apply(7, reader2.read_frames(7, (b"kv", (5).to_bytes(8, "big"), payload)))
    report = idx2.apply(7, reader2.read_frames(7, (b"kv", (7).to_bytes(8, "big"), payload)))
    assert report["gaps"] == [{"instance": 7, "dp_rank": 0, "expected": 6, "got": 7}]


def vllm_batch(events, dp_rank=None):
    return msgpack.packb([1.0, events, dp_rank])


def test_vllm_media_groups_tokenless_and_multimodal_blocks():
    idx = kvpool.KVIndex()
    reader = VllmEventReader(idx)
    tokens = list(range(16))
    h = [101, 102, 103, 104]
    gpu = {
        "type": "BlockStored",
        "block_hashes": h,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    swa = dict(
        gpu, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=5
    )
    # CPU offload: tokenless, in the older array form; resolves through the GPU mapping.
    cpu = ["BlockStored", h[:2], None, [], 4, None, "CPU", None]
    reader.apply(3, vllm_batch([gpu, swa, cpu], dp_rank=1), sequence=0)
    rows = sorted(idx.lookup(tokens))
    assert rows == [(3, 1, "device", 4, 16), (3, 1, "host", 2, 8)]
    # The window group dropping its old blocks keeps the hit (a 5-token window needs block 3).
    reader.apply(
        3,
        vllm_batch(
            [{"type": "BlockRemoved", "block_hashes": [101, 102], "medium": "GPU", "group_idx": 1}],
            dp_rank=1,
        ),
        sequence=1,
    )
    assert (3, 1, "device", 4, 16) in idx.lookup(tokens)
    # The full group losing block 2 caps a hit at 2 blocks, which needs window block 1: gone,
    # so no device hit at all (not a false 2-block hit).
    reader.apply(
        3,
        vllm_batch(
            [{"type": "BlockRemoved", "block_hashes": [103], "medium": "GPU", "group_idx": 0}],
            dp_rank=1,
        ),
        sequence=2,
    )
    assert idx.lookup(tokens) == [(3, 1, "host", 2, 8)]
    # A removal of blocks never stored still carries its batch's number (no false gap later).
    report = reader.apply(
        3,
        vllm_batch(
            [{"type": "BlockRemoved", "block_hashes": [999], "medium": "GPU", "group_idx": 0}],
            dp_rank=1,
        ),
        sequence=3,
    )
    assert report["applied"] == 1 and idx.sources()[0]["last"] == 3
    # Multimodal extra keys: an opaque key that token lookups never match.
    mm = dict(gpu, block_hashes=[b"\x01" * 32], token_ids=tokens[:4], extra_keys=[[["img-9", 0]]])
    events = reader.read(4, vllm_batch([mm]))
    assert events[0]["block_hashes"][0] != idx.hash_blocks(tokens[:4], 4)[0]
    idx.apply(4, events)
    assert all(r[0] != 4 for r in idx.lookup(tokens))
    with pytest.raises(ValueError, match="payload"):
        reader.read(1, b"\xc1")
    with pytest.raises(ValueError, match="event"):
        reader.read(1, vllm_batch([{"type": "Mystery"}]))
    idx.check()


# ------------------------------------------------------------------------------- randomized
ops = st.lists(
    st.tuples(
        st.sampled_from(["stored", "removed", "cleared"]),
        st.integers(0, 3),
        st.sampled_from(["device", "host", "remote"]),
        st.integers(0, 2),
        st.integers(0, 7),
        st.integers(1, 8),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_lookups_match_a_dict_of_sets_model(steps):
    docs = [list(range(32)), list(range(16)) + list(range(900, 916)), list(range(500, 532))]
    chains = [chain(d) for d in docs]
    idx = kvpool.KVIndex()
    model: dict[tuple[int, str], set[bytes]] = {}
    for kind, instance, medium, doc, start, length in steps:
        c = chains[doc]
        part = c[start : start + length]
        held = model.setdefault((instance, medium), set())
        if kind == "stored":
            idx.apply(instance, [stored(part, c[start - 1] if start else None, medium=medium)])
            held.update(part)
        elif kind == "removed":
            idx.apply(
                instance,
                [{"kind": "removed", "block_size": BS, "medium": medium, "block_hashes": part}],
            )
            held.difference_update(part)
        else:
            idx.apply(instance, [{"kind": "cleared", "block_size": BS, "medium": medium}])
            held.clear()
        for d, c in zip(docs, chains, strict=True):
            want = []
            for (i, m), s in model.items():
                n = next((k for k, h in enumerate(c) if h not in s), len(c))
                if n:
                    want.append((i, 0, m, n, n * BS))
            assert sorted(idx.lookup(d)) == sorted(want)
    idx.check()


def test_groups_announced_up_front_and_depths():
    """Groups announced up front (a "group" event) stop the over-credit of a hybrid location whose
    linear-state group committed nothing yet; ``lookup(depths=True)`` rows carry the depth a hit
    restores and the KV depth (docs/events.md, contract "groups announced up front")."""
    idx = kvpool.KVIndex()
    tokens = list(range(32))
    c = chain(tokens)
    groups = [
        {"kind": "group", "block_size": BS, "group": 0},
        {"kind": "group", "block_size": BS, "group": 1, "group_kind": "linear_state"},
    ]
    idx.apply(1, groups + [stored(c)])
    idx.apply(2, [stored(c)])  # the same stores, no announcement: a plain location
    assert best(idx.lookup(tokens), 1) == 0, "no checkpoint: no hit"
    assert best(idx.lookup(tokens), 2) == 8, "without the announcement: credited"
    rows = {r[0]: r for r in idx.lookup(tokens, depths=True)}
    assert rows[1] == (1, 0, "device", 0, 0, 8, 32) and rows[2] == (2, 0, "device", 8, 32, 8, 32)
    checkpoint = {
        "kind": "stored",
        "block_size": BS,
        "group": 1,
        "group_kind": "linear_state",
        "parent_hash": c[4],
        "block_hashes": [c[5]],
    }
    idx.apply(1, [checkpoint])
    rows = {r[0]: r for r in idx.lookup(tokens, depths=True)}
    assert rows[1] == (1, 0, "device", 6, 24, 8, 32)
    assert (1, 0, "device", 6, 24) in idx.lookup(tokens), "the default rows are unchanged"
    with pytest.raises(ValueError, match=r"events\[0\].block_hashes"):
        idx.apply(1, [{"kind": "group", "block_size": BS, "block_hashes": [c[0]]}])
    with pytest.raises(TypeError, match="depths"):
        idx.lookup(tokens, depths=1)
    idx.check()


def test_several_writers_from_threads():
    """``KVIndex(writers=n)``: threads applying the batches of the instances of their writers
    (``writer_of``) at once end with the state one writer reaches; lookups meanwhile never fail."""
    n = 3
    idx, one = kvpool.KVIndex(writers=n), kvpool.KVIndex()
    assert idx.stats()["writers"] == n and one.stats()["writers"] == 1
    docs = [[1000 * d + i for i in range(32)] for d in range(6)]
    batches = {
        i: [[stored(chain(docs[(i + k) % 6])[: 2 + (i * k) % 7])] for k in range(20)]
        for i in range(24)
    }
    assert {idx.writer_of(i) for i in batches} == set(range(n))
    stop = threading.Event()
    errors = []

    def read():
        while not stop.is_set():
            try:
                idx.lookup(docs[0])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

    def write(w):
        for k in range(20):
            for i, mine in batches.items():
                if idx.writer_of(i) == w:
                    idx.apply(i, mine[k])

    reader = threading.Thread(target=read)
    reader.start()
    threads = [threading.Thread(target=write, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    reader.join()
    assert not errors
    for k in range(20):
        for i, mine in batches.items():
            one.apply(i, mine[k])
    for d in docs:
        assert sorted(idx.lookup(d)) == sorted(one.lookup(d))
    assert idx.stats()["entries"] == one.stats()["entries"]
    idx.check()
    assert kvpool.KVIndex.load(idx.dump()).stats()["writers"] == n
    with pytest.raises(ValueError, match="writers"):
        kvpool.KVIndex(writers=0)
    with pytest.raises(ValueError, match="max_entries"):
        kvpool.KVIndex(writers=4, max_entries=3)
