"""The Mooncake and Qwen-Bailian trace readers (kvpool.sim.traces).

Fixtures (tests/sim/fixtures/README.md): the first 300 requests of Mooncake's conversation trace
(Apache-2.0, verbatim) and a synthetic trace in the public Qwen-Bailian schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kvpool.sim.traces import (
    BAILIAN_BLOCK_SIZE,
    MOONCAKE_BLOCK_SIZE,
    HashedPrompt,
    Session,
    block_tokens,
    detect_format,
    mix31,
    output_tokens,
    read_production_trace,
)
from kvpool.sim.workloads import TraceError, load_trace

FIXTURES = Path(__file__).parent / "fixtures"
MOONCAKE = FIXTURES / "mooncake_conversation_300.jsonl"
BAILIAN = FIXTURES / "bailian_synthetic.jsonl"


def _raw(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_formats_are_detected_from_fields() -> None:
    assert detect_format(_raw(MOONCAKE)[0]) == "mooncake"
    assert detect_format(_raw(BAILIAN)[0]) == "bailian"
    assert detect_format({"prompt_len": 10, "output_len": 2}) == "kvpool"
    assert (
        detect_format({"hash_ids": [1], "timestamp": 0, "input_length": 3, "output_length": 1})
        == "mooncake"
    )
    m, b = load_trace(MOONCAKE), load_trace(BAILIAN)
    assert all(isinstance(r.prompt, HashedPrompt) for r in m + b)
    assert {r.prompt.block_size for r in m} == {MOONCAKE_BLOCK_SIZE}
    assert {r.prompt.block_size for r in b} == {BAILIAN_BLOCK_SIZE}
    assert all(r.session is None for r in m) and all(isinstance(r.session, Session) for r in b)
    # forcing a format: the fields must then be that format's
    with pytest.raises(TraceError, match=rf"{MOONCAKE}:1: missing field\(s\) chat_id"):
        load_trace(MOONCAKE, fmt="bailian")
    with pytest.raises(TraceError, match=rf"{BAILIAN}:1: unknown field\(s\) chat_id"):
        load_trace(BAILIAN, fmt="mooncake")
    with pytest.raises(TraceError, match=":1: unknown field"):
        load_trace(MOONCAKE, fmt="kvpool")


def test_hash_ids_expand_to_exact_tokens() -> None:
    ids = np.array([7, 3, 7, 0, 4_194_303])  # 4_194_303 = 2**31 // 512 - 1, the largest id
    t = block_tokens(ids, 5 * 512, 512).reshape(5, 512)
    assert t.dtype == np.int32 and t.min() >= 0
    assert np.array_equal(t[0], t[2])  # equal ids, equal tokens
    assert (
        not np.intersect1d(t[0], t[1]).size and not np.intersect1d(t[1], t[3]).size
    )  # never shared
    assert all(int(t[i, j]) == mix31(int(ids[i]) * 512 + j) for i in range(5) for j in (0, 1, 511))
    # the map (id, offset) -> token is injective: every token of 2,000 ids x 512 is distinct
    many = block_tokens(np.arange(2000), 2000 * 512, 512)
    assert len(np.unique(many)) == len(many)
    # sampled tokens of trace requests lie above every prompt token
    out = output_tokens(5, np.arange(1000), trace=True)
    assert out.min() >= 2**31 and out.max() < 2**32 and len(np.unique(out)) == 1000


def test_partial_last_block_and_lengths() -> None:
    raw = _raw(MOONCAKE)
    reqs = {r.request_id: r for r in load_trace(MOONCAKE)}
    for i, line in enumerate(raw):
        r = reqs[i]
        assert r.prompt_len == line["input_length"] and r.output_len == line["output_length"]
        assert np.array_equal(r.prompt.hash_ids, line["hash_ids"])
        toks = r.prompt_tokens()
        assert len(toks) == line["input_length"]
        n = len(line["hash_ids"])
        tail = line["input_length"] - (n - 1) * 512
        assert 0 < tail <= 512
        # the partial block is the first `tail` tokens of its id's block
        full = block_tokens(np.array(line["hash_ids"][-1:]), 512, 512)
        assert np.array_equal(toks[(n - 1) * 512 :], full[:tail])
    # two requests sharing their first k ids share exactly k * 512 tokens
    a, b = reqs[0], reqs[1]
    k = next(
        i
        for i, (x, y) in enumerate(zip(a.prompt.hash_ids, b.prompt.hash_ids, strict=False))
        if x != y
    )
    ta, tb = a.prompt_tokens(), b.prompt_tokens()
    assert np.array_equal(ta[: k * 512], tb[: k * 512]) and ta[k * 512] != tb[k * 512]


def test_timestamps_become_seconds() -> None:
    raw = _raw(MOONCAKE)
    reqs = load_trace(MOONCAKE, step_seconds=0.05)
    by_id = {r.request_id: r for r in reqs}
    for i, line in enumerate(raw):
        assert by_id[i].arrival_s == pytest.approx(line["timestamp"] / 1000.0)  # milliseconds
        assert by_id[i].arrival == pytest.approx(line["timestamp"] / 1000.0 / 0.05)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    braw = _raw(BAILIAN)
    b = {r.session.chat_id: r for r in load_trace(BAILIAN)}
    for line in braw:
        assert b[line["chat_id"]].arrival_s == pytest.approx(line["timestamp"])  # seconds already


def test_bailian_sessions_are_kept() -> None:
    raw = {line["chat_id"]: line for line in _raw(BAILIAN)}
    reqs = load_trace(BAILIAN)
    by_chat = {r.session.chat_id: r for r in reqs}
    assert len(by_chat) == len(reqs) == 300
    follow = [r for r in reqs if r.session.parent_chat_id >= 0]
    assert follow and any(r.session.parent_chat_id < 0 for r in reqs)
    for r in reqs:
        line = raw[r.session.chat_id]
        assert (r.session.parent_chat_id, r.session.turn, r.session.type) == (
            line["parent_chat_id"],
            line["turn"],
            line["type"],
        )
    for r in follow:
        parent = by_chat[r.session.parent_chat_id]
        assert parent.arrival_s <= r.arrival_s and r.session.turn == parent.session.turn + 1
        # the follow-up repeats the parent's full input blocks: their tokens are shared
        shared = parent.prompt_len // 16 * 16
        assert np.array_equal(r.prompt_tokens()[:shared], parent.prompt_tokens()[:shared])


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{oops", "not valid JSON"),
        ("[1, 2]", "a line must be a JSON object"),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1}',
            r"missing field\(s\) hash_ids",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
            r"input_length 600 needs 2 hash id\(s\) of 512 tokens, the line has 1",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}',
            r"input_length 600 needs 2 hash id\(s\) of 512 tokens, the line has 3",
        ),
        (
            '{"timestamp": -1, "input_length": 6, "output_length": 1, "hash_ids": [1]}',
            "timestamp must be",
        ),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
            "input_length must be",
        ),
        (
            '{"timestamp": 0, "input_length": 6, "output_length": 1.5, "hash_ids": [1]}',
            "output_length must be",
        ),
        (
            '{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": ["a"]}',
            "hash_ids must be a list of integers",
        ),
        (
            '{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [-3]}',
            r"hash_ids must lie in \[0, 4194304\)",
        ),
        (
            '{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": []}',
            "hash_ids must be a non-empty list",
        ),
        (
            '{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1], "x": 1}',
            "unknown field",
        ),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    good = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}'
    t = tmp_path / "t.jsonl"
    t.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TraceError, match=rf"^{t}:3: {reason}"):
        read_production_trace(t, "mooncake")


def test_bailian_field_errors(tmp_path: Path) -> None:
    base = {
        "chat_id": 1,
        "parent_chat_id": -1,
        "timestamp": 1.5,
        "input_length": 20,
        "output_length": 2,
        "type": "text",
        "turn": 1,
        "hash_ids": [4, 5],
    }
    t = tmp_path / "b.jsonl"
    for key, value, reason in [
        ("type", 3, "type must be a string"),
        ("parent_chat_id", -2, "parent_chat_id must"),
        ("turn", "2", "turn must be"),
        ("hash_ids", [4], "input_length 20 needs 2 hash id"),
    ]:
        t.write_text(json.dumps(base) + "\n" + json.dumps({**base, key: value}) + "\n")
        with pytest.raises(TraceError, match=rf"{t}:2: {reason}"):
            load_trace(t)
    t.write_text(json.dumps(base) + "\n")
    (r,) = load_trace(t, trace_block_size=10)  # another block size: 20 tokens, 2 ids of 10
    assert r.prompt_len == 20 and r.prompt.block_size == 10


def test_empty_and_missing(tmp_path: Path) -> None:
    t = tmp_path / "e.jsonl"
    t.write_text("\n# a comment\n")
    with pytest.raises(TraceError, match="holds no requests"):
        read_production_trace(t)
    with pytest.raises(TraceError, match="cannot read trace"):
        read_production_trace(tmp_path / "nope.jsonl")


def test_trace_loads_in_bounded_memory() -> None:
    """A request keeps its ids (int32), never its tokens."""
    reqs = load_trace(MOONCAKE)
    ids_bytes = sum(r.prompt.hash_ids.nbytes for r in reqs)
    tokens = sum(r.prompt_len for r in reqs)
    assert ids_bytes * 100 < tokens * 4  # 4.3M tokens held as 33 KB of ids
    assert all(r.prompt.hash_ids.dtype == np.int32 for r in reqs)
