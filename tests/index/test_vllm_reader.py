"""kvpool.vllm_events.VllmEventReader on an unreliable stream: its hash mapping follows exactly
the batches the index applies (G1), a malformed batch is a named ValueError or TypeError that
changes nothing (G9, byte flips of vLLM's own sample), and a randomized comparison of reader and
index with a plain model of what the publisher holds, under lost, duplicated, reordered and
corrupted batches with replay."""

from __future__ import annotations

import copy
import pathlib

import kvpool
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool.vllm_events import VllmEventReader

DATA = pathlib.Path(__file__).parent / "data"
BS = 4
TOKENS = list(range(8))


def batch(events, dp_rank=0):
    return msgpack.packb([0.0, events, dp_rank])


def block_stored(hashes, parent, tokens, medium="GPU"):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": medium,
    }


def block_removed(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


STORED = block_stored([11, 12], None, TOKENS)
OTHER = block_stored([21], None, [9, 9, 9, 9])
REMOVED = block_removed([12])


def mapping(reader):
    return copy.deepcopy((reader.keys, reader.groups))


def state(reader):
    """The reader's mapping and the index's whole image (sources and counters included)."""
    return mapping(reader), reader.index.dump()


# ------------------------------------------------------------------------------------- G1
@pytest.mark.parametrize("via", ["apply", "read"])
def test_g1_a_removal_in_a_dropped_batch_still_resolves_when_replayed(via):
    """G1: batch 3 (a removal) arrives before the lost batch 2: the index drops it (a gap) and
    the reader must keep the mapping, so that the replay of 2 and 3 removes the block."""
    idx = kvpool.KVIndex()
    reader = VllmEventReader(idx)

    def deliver(events, sequence):
        if via == "apply":
            return reader.apply(5, batch(events), sequence=sequence)
        return idx.apply(5, reader.read(5, batch(events), sequence=sequence))

    deliver([STORED], 1)
    before = mapping(reader)
    report = deliver([REMOVED], 3)
    assert report["gaps"] == [{"instance": 5, "dp_rank": 0, "expected": 2, "got": 3}]
    assert mapping(reader) == before, "a dropped batch changes no mapping"
    assert idx.lookup(TOKENS) == [(5, 0, "device", 2, 8)]
    for sequence, events in ((2, [OTHER]), (3, [REMOVED])):
        assert deliver(events, sequence)["applied"] == 1
    assert idx.lookup(TOKENS) == [(5, 0, "device", 1, 4)]
    idx.check()


@pytest.mark.parametrize("via", ["apply", "read"])
def test_g1_a_duplicate_delivery_does_not_forget_a_block_stored_again(via):
    """G1, second form: a redelivered old batch (a duplicate the index skips) must not drop the
    mapping of a block stored again since, or the real removal after it is lost."""
    idx = kvpool.KVIndex()
    reader = VllmEventReader(idx)

    def deliver(events, sequence):
        if via == "apply":
            return reader.apply(1, batch(events), sequence=sequence)
        return idx.apply(1, reader.read(1, batch(events), sequence=sequence))

    deliver([STORED], 1)
    deliver([REMOVED], 2)
    deliver([block_stored([12], 11, TOKENS[4:])], 3)
    before = mapping(reader)
    assert deliver([REMOVED], 2)["duplicates"] == 1
    assert mapping(reader) == before
    deliver([REMOVED], 4)
    assert idx.lookup(TOKENS) == [(1, 0, "device", 1, 4)]
    idx.check()


class Refusing:
    """A KVIndex whose apply refuses every batch (as it would an invalid event)."""

    def __init__(self, index):
        self.inner = index

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply(self, instance, events):
        raise ValueError("events[0].block_hashes: refused")


def test_g1_a_batch_the_index_refuses_changes_no_mapping():
    idx = kvpool.KVIndex()
    reader = VllmEventReader(idx)
    reader.apply(1, batch([STORED]), sequence=1)
    before = state(reader)
    reader.index = Refusing(idx)
    with pytest.raises(ValueError, match="refused"):
        reader.apply(1, batch([REMOVED, OTHER]), sequence=2)
    reader.index = idx
    assert state(reader) == before
    assert reader.apply(1, batch([REMOVED]), sequence=2)["applied"] == 1
    assert idx.lookup(TOKENS) == [(1, 0, "device", 1, 4)]


def test_g1_frames_and_the_last_batch_during_a_stall():
    """The ZMQ frames path; a redelivery of the last batch during a stall is applied (C3) and
    keeps its mapping, a batch past the hole does not."""
    idx = kvpool.KVIndex()
    reader = VllmEventReader(idx)

    def frames(events, sequence):
        return (b"kv-events", sequence.to_bytes(8, "big"), batch(events))

    assert reader.apply_frames(2, frames([STORED], 7))["applied"] == 1
    assert reader.apply_frames(2, frames([REMOVED], 9))["gaps"][0]["expected"] == 8
    assert reader.apply_frames(2, frames([STORED], 7))["applied"] == 1
    assert idx.sources()[0]["stalled"] == 9
    assert idx.apply(2, reader.read_frames(2, frames([OTHER], 8)))["applied"] == 1
    assert reader.apply_frames(2, frames([REMOVED], 9))["applied"] == 1
    assert idx.lookup(TOKENS) == [(2, 0, "device", 1, 4)]
    with pytest.raises(ValueError, match="frames"):
        reader.apply_frames(2, frames([STORED], 10)[:2])
    with pytest.raises(ValueError, match=r"frames\[1\]"):
        reader.apply_frames(2, (b"kv", b"\x01", batch([STORED])))


# ------------------------------------------------------------------------------------- G9
@pytest.mark.parametrize(
    ("event", "error", "field"),
    [
        (
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": [1, 2],
            },
            ValueError,
            r"events\[1\].block_size",
        ),
        (
            {
                "type": "BlockStored",
                "block_size": 2,
                "parent_block_hash": None,
                "token_ids": [1, 2],
            },
            ValueError,
            r"events\[1\].block_hashes",
        ),
        ({"type": "BlockRemoved", "medium": "GPU"}, ValueError, r"events\[1\].block_hashes"),
        ({"type": "BlockStored", "block_hashes": [1], "block_size": "2"}, TypeError, "block_size"),
        ({"type": "BlockStored", "block_hashes": [1], "block_size": 0}, ValueError, "block_size"),
        ({"type": "BlockStored", "block_hashes": [1], "block_size": True}, TypeError, "block_size"),
        ({"type": "BlockStored", "block_hashes": 1, "block_size": 2}, TypeError, "block_hashes"),
        (
            {"type": "BlockStored", "block_hashes": [1.5], "block_size": 2},
            TypeError,
            "block_hashes",
        ),
        (
            {"type": "BlockStored", "block_hashes": [1, 1], "block_size": 2},
            ValueError,
            "own parent",
        ),
        (
            {"type": "BlockStored", "block_hashes": [1], "block_size": 2, "token_ids": [1, -2]},
            ValueError,
            "token_ids",
        ),
        (
            {"type": "BlockStored", "block_hashes": [1], "block_size": 2, "token_ids": "ab"},
            TypeError,
            "token_ids",
        ),
        (
            {"type": "BlockStored", "block_hashes": [1], "block_size": 2, "parent_block_hash": [3]},
            TypeError,
            "parent_block_hash",
        ),
        (
            {"type": "BlockStored", "block_hashes": [1], "block_size": 2, "medium": ["GPU"]},
            TypeError,
            "medium",
        ),
        (
            {"type": "BlockStored", "block_hashes": [1], "block_size": 2, "group_idx": 31},
            ValueError,
            "group_idx",
        ),
        (
            {"type": "BlockStored", "block_hashes": [1], "block_size": 2, "kv_cache_spec_kind": 3},
            TypeError,
            "kv_cache_spec_kind",
        ),
        (
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "block_size": 2,
                "kv_cache_spec_kind": "sliding_window",
                "kv_cache_spec_sliding_window": "8",
            },
            TypeError,
            "kv_cache_spec_sliding_window",
        ),
        (
            {"type": "BlockStored", "block_hashes": [1], "block_size": 2, "extra_keys": 5},
            TypeError,
            "extra_keys",
        ),
        (
            {"type": "BlockStored", "block_hashes": [1], "block_size": 2, "lora_name": 5},
            TypeError,
            "lora_name",
        ),
        ({"type": "BlockRemoved", "block_hashes": [9], "group_idx": -1}, ValueError, "group_idx"),
        ({"type": "Mystery"}, ValueError, r"events\[1\]: unknown"),
        (7, ValueError, r"events\[1\]: not a vLLM KV event"),
    ],
)
def test_g9_a_malformed_event_is_a_named_error_that_changes_nothing(event, error, field):
    idx = kvpool.KVIndex()
    reader = VllmEventReader(idx)
    reader.apply(1, batch([block_stored([9], None, [5, 5, 5, 5])]), sequence=1)
    before = state(reader)
    for call in (reader.apply, reader.read):
        with pytest.raises(error, match=field):
            call(
                1, batch([block_stored([8], 9, [6, 6, 6, 6]), event]), sequence=2
            )  # a good one first
        assert state(reader) == before
    assert idx.sources()[0]["last"] == 1


def test_g9_bad_arguments_and_batches_are_named():
    reader = VllmEventReader(kvpool.KVIndex())
    for args, kwargs, error, name in [
        ((-1, batch([])), {}, ValueError, "instance"),
        ((True, batch([])), {}, TypeError, "instance"),
        ((1, batch([])), {"sequence": -1}, ValueError, "sequence"),
        ((1, batch([])), {"sequence": "3"}, TypeError, "sequence"),
        ((1, "payload"), {}, TypeError, "payload"),
        ((1, b"\x93\x00\x90\x00\x00"), {}, ValueError, "payload"),  # trailing bytes
        ((1, msgpack.packb({"ts": 0})), {}, ValueError, "payload"),
        ((1, batch([], dp_rank=-1)), {}, ValueError, "data_parallel_rank"),
        ((1, batch([], dp_rank="0")), {}, TypeError, "data_parallel_rank"),
    ]:
        with pytest.raises(error, match=name):
            reader.apply(*args, **kwargs)
    assert reader.keys == {} and reader.groups == {}


def test_byte_flips_of_vllm_sample_give_a_result_or_a_named_error():
    """Every single-bit flip and every truncation of vLLM 0.33.0's own batch: a result, or a
    ValueError / TypeError that changes neither the reader nor the index (never another
    exception, never a half-applied batch)."""
    data = (DATA / "vllm_kv_event_example.msgpack").read_bytes()
    variants = [data[:n] for n in range(len(data))]
    for pos in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            variants.append(bytes(flipped))
    idx = kvpool.KVIndex()
    reader = VllmEventReader(idx)
    reader.apply(3, data, sequence=1)
    before = state(reader)
    results = errors = 0
    for payload in variants:
        for via in ("apply", "read"):
            try:
                if via == "apply":
                    reader.apply(3, payload, sequence=1)  # the last unit again: applied
                else:
                    idx.apply(3, reader.read(3, payload, sequence=1))
            except (ValueError, TypeError):
                errors += 1
                assert state(reader) == before, payload
            else:
                results += 1
                # an accepted variant changed things: start the next one from the sample again
                idx = kvpool.KVIndex()
                reader = VllmEventReader(idx)
                reader.apply(3, data, sequence=1)
    assert results and errors
    idx.check()


# ------------------------------------------------------------------------ model comparison
DOCS = [[1000 * d + t for t in range(6 * BS)] for d in range(3)]
MEDIA = {"GPU": "device", "CPU": "host"}


def vhash(doc, j):
    return 100 * doc + j + 1  # vLLM's int block hashes (any ints: the reader maps them)


class Publisher:
    """A vLLM instance's KV events: what it holds per medium, each batch's payload, and the
    holdings after each batch (its replay buffer and the model the index is compared with)."""

    def __init__(self):
        self.held = {"GPU": set(), "CPU": set()}
        self.log = {}
        self.snapshots = {}

    def publish(self, op):
        events = []
        kind, doc, n, medium = op
        if kind == "store":
            run = []

            def flush():
                if run:
                    tokens = DOCS[doc][run[0] * BS : (run[-1] + 1) * BS] if medium == "GPU" else []
                    parent = vhash(doc, run[0] - 1) if run[0] else None
                    events.append(
                        block_stored([vhash(doc, j) for j in run], parent, tokens, medium)
                    )
                    run.clear()

            for j in range(n):
                # a CPU copy is an offload of a block on the GPU (vLLM sends it without tokens)
                if (doc, j) in self.held[medium] or (
                    medium == "CPU" and (doc, j) not in self.held["GPU"]
                ):
                    flush()
                    continue
                run.append(j)
                self.held[medium].add((doc, j))
            flush()
        elif kind == "remove":  # the chain's tail from block n, tail first
            gone = [j for j in range(5, n - 1, -1) if (doc, j) in self.held[medium]]
            if gone:
                events.append(block_removed([vhash(doc, j) for j in gone], medium))
                self.held[medium] -= {(doc, j) for j in gone}
        else:
            events.append({"type": "AllBlocksCleared"})
            self.held["GPU"].clear()
        number = len(self.log) + 1
        self.log[number] = batch(events)
        self.snapshots[number] = {m: set(h) for m, h in self.held.items()}
        return number

    @staticmethod
    def lookup(held, tokens):
        rows = []
        for medium, blocks in held.items():
            n = 0
            while n < len(tokens) // BS and (tokens[0] // 1000, n) in blocks:
                n += 1
            if n:
                rows.append((0, 0, MEDIA[medium], n, n * BS))
        return sorted(rows)


def corrupt(payload, how):
    if how == 0:
        return payload[:-1]
    if how == 1:
        return b"\xc1" + payload
    if how == 2:  # a BlockStored without its block size
        return batch([{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}])
    return batch([block_stored([7, 7], None, [])])  # a block its own parent


publish_op = st.tuples(
    st.sampled_from(["store", "store", "remove", "clear"]),
    st.integers(0, 2),
    st.integers(0, 6),
    st.sampled_from(["GPU", "GPU", "CPU"]),
)
publish = st.tuples(
    st.just("publish"),
    publish_op,
    st.sampled_from(["sent", "sent", "sent", "lost", "corrupt"]),
    st.integers(0, 3),
)
deliver = st.tuples(st.just("deliver"), st.integers(0, 15))
action = st.one_of(
    publish,
    deliver,
    publish,
    deliver,
    st.tuples(st.just("redeliver"), st.integers(0, 63)),
    st.tuples(st.just("replay")),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(action, min_size=8, max_size=60), st.booleans())
def test_reader_and_index_match_the_publisher_under_loss_duplicates_reordering_and_replay(
    actions, via_read
):
    """After each step the index holds exactly what the publisher held after batch `last` (the
    source's last applied number), and the reader's mapping is the one a reader fed batches
    1..last in order has; after the final replay, both match the publisher's final state."""
    pub = Publisher()
    idx = kvpool.KVIndex()
    reader = VllmEventReader(idx)
    reference = VllmEventReader(kvpool.KVIndex())  # fed every batch once, in order
    mappings = {}
    in_flight = []
    pending = []  # gaps reported and not replayed yet

    def deliver(payload, number):
        try:
            if via_read:
                report = idx.apply(0, reader.read(0, payload, sequence=number))
            else:
                report = reader.apply(0, payload, sequence=number)
        except (ValueError, TypeError):
            return  # a corrupted batch: nothing changed; its number shows as a gap later
        pending.extend(gap["expected"] for gap in report["gaps"])

    def replay(start):
        for number in range(start, len(pub.log) + 1):
            deliver(pub.log[number], number)

    def publish(op):
        number = pub.publish(op)
        reference.apply(0, pub.log[number], sequence=number)
        mappings[number] = copy.deepcopy(reference.keys)
        return number

    deliver(pub.log[publish(("clear", 0, 0, "GPU"))], 1)  # the consumer starts with the stream
    for step in actions:
        if step[0] == "publish":
            number = publish(step[1])
            if step[2] == "sent":
                in_flight.append((pub.log[number], number))
            elif step[2] == "corrupt":
                in_flight.append((corrupt(pub.log[number], step[3]), number))
        elif step[0] == "deliver" and in_flight:
            deliver(*in_flight.pop(step[1] % len(in_flight)))  # any order
        elif step[0] == "redeliver":
            number = 1 + step[1] % len(pub.log)
            deliver(pub.log[number], number)
        elif step[0] == "replay" and pending:
            replay(pending.pop(0))
        idx.check()
        (source,) = idx.sources()
        last = source["last"]
        for doc in DOCS:
            assert sorted(idx.lookup(doc)) == Publisher.lookup(pub.snapshots[last], doc), (
                last,
                doc,
            )
        assert reader.keys == mappings[last]
        assert source["stalled"] is None or pending, "a stall always has its gap reported"
    replay(idx.sources()[0]["last"] + 1)  # the tail nobody saw a gap for
    (source,) = idx.sources()
    assert source == {"instance": 0, "dp_rank": 0, "last": len(pub.log), "stalled": None}
    for doc in DOCS:
        assert sorted(idx.lookup(doc)) == Publisher.lookup(pub.held, doc)
    assert reader.keys == reference.keys
    idx.check()


def test_the_reader_announces_the_models_groups():
    """``VllmEventReader(index, groups=...)`` puts one "group" event per model group before the
    first batch of each source (kept only if the index applies that batch), so a hybrid model's
    instance is not credited before its linear-state group commits a checkpoint."""
    idx = kvpool.KVIndex()
    groups = [{"kind": "full_attention", "block_size": BS}, {"kind": "mamba", "block_size": BS}]
    reader = VllmEventReader(idx, groups=groups)
    events = reader.read(7, batch([STORED]), sequence=5)
    assert [(e["kind"], e["group"], e["group_kind"], e["sequence"]) for e in events[:2]] == [
        ("group", 0, "full_attention", 5),
        ("group", 1, "linear_state", 5),
    ]
    assert events[2]["kind"] == "stored"
    # read() kept the announcement (the index would apply number 5): apply that batch itself
    idx.apply(7, events)
    assert idx.lookup(TOKENS) == [], "no checkpoint: no hit"
    assert [r[3:] for r in idx.lookup(TOKENS, depths=True)] == [(0, 0, 2, 8)]
    again = reader.read(7, batch([OTHER]), sequence=6)
    assert all(e["kind"] != "group" for e in again), "once per source"
    # a batch the index skips (a duplicate) does not count as announced
    fresh = VllmEventReader(kvpool.KVIndex(), groups=groups)
    fresh.index.apply(3, [{"kind": "removed", "block_size": BS, "sequence": 9}])
    fresh.apply(3, batch([STORED]), sequence=8)  # a duplicate: skipped, announcement undone
    assert fresh.announced == {}
    assert fresh.read(3, batch([STORED]), sequence=9)[0]["kind"] == "group"
    plain = VllmEventReader(kvpool.KVIndex())
    assert all(e["kind"] != "group" for e in plain.read(1, batch([STORED]), sequence=0))
    for bad, error in [
        ("full_attention", TypeError),
        ([{"kind": "mamba"}], ValueError),
        ([{"block_size": BS, "window": 3}], ValueError),
        ([[BS]], TypeError),
    ]:
        with pytest.raises(error, match="groups"):
            VllmEventReader(idx, groups=bad)
