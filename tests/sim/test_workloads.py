"""kvpool.sim.workloads: synthetic generators and JSONL traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kvpool.sim.workloads import (
    KINDS,
    VOCAB_SIZE,
    Request,
    TraceError,
    generate,
    load_trace,
    prefix_group_tokens,
    save_trace,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "traces").glob("*.jsonl"))


@pytest.mark.parametrize("kind", KINDS)
def test_generate_shapes_and_ranges(kind: str) -> None:
    reqs = generate(kind, 300, seed=3)
    assert len(reqs) == 300
    assert [r.request_id for r in reqs] == list(range(300))
    arr = [r.arrival for r in reqs]
    assert arr == sorted(arr) and arr[0] >= 0
    for r in reqs:
        assert isinstance(r, Request)
        p = np.asarray(r.prompt)
        assert 64 <= len(p) <= 8192
        assert p.min() >= 0 and p.max() < VOCAB_SIZE
        assert r.output_len >= 1
        if r.output is not None:
            assert len(r.output) >= r.output_len


@pytest.mark.parametrize("kind", KINDS)
def test_generate_is_deterministic(kind: str) -> None:
    a = generate(kind, 120, seed=5)
    b = generate(kind, 120, seed=5)
    c = generate(kind, 120, seed=6)
    for x, y in zip(a, b, strict=False):
        assert np.array_equal(x.prompt, y.prompt)
        assert (x.arrival, x.output_len, x.prefix_group) == (
            y.arrival,
            y.output_len,
            y.prefix_group,
        )
    assert any(not np.array_equal(x.prompt, y.prompt) for x, y in zip(a, c, strict=False))


@pytest.mark.parametrize("kind", ["system_prompt", "few_shot", "rag", "chat"])
def test_shared_prefix_kinds_share_prefixes(kind: str) -> None:
    reqs = generate(kind, 200, seed=1)
    groups: dict[int, list[np.ndarray]] = {}
    for r in reqs:
        groups.setdefault(r.prefix_group, []).append(np.asarray(r.prompt))
    shared = [g for g in groups.values() if len(g) > 1]
    assert shared
    for g in shared:
        n = min(len(p) for p in g)
        common = min(int(np.argmin(np.append(g[0][:n] == p[:n], False))) for p in g[1:])
        assert common >= 48  # at least a header/system prompt in common


def test_chat_turns_contain_previous_answer() -> None:
    reqs = generate("chat", 200, seed=2)
    by_session: dict[int, list[Request]] = {}
    for r in reqs:
        by_session.setdefault(r.prefix_group, []).append(r)
    multi = [s for s in by_session.values() if len(s) > 1]
    assert multi
    for s in multi:
        s.sort(key=lambda r: r.arrival)
        for a, b in zip(s, s[1:], strict=False):
            prev = np.concatenate([a.prompt, a.output[: a.output_len]])
            assert np.array_equal(np.asarray(b.prompt)[: len(prev)], prev)
            assert b.arrival > a.arrival


def test_generate_options_and_errors() -> None:
    reqs = generate(
        "random", 50, seed=0, rate=0, max_prompt_len=128, output_len=8, max_output_len=16
    )
    assert all(r.arrival == 0 for r in reqs)
    assert all(64 <= len(r.prompt) <= 128 and r.output_len <= 16 for r in reqs)
    assert generate("mixed", 0) == []
    with pytest.raises(ValueError, match="kind"):
        generate("nope", 3)
    with pytest.raises(ValueError, match="option"):
        generate("random", 3, colour="blue")
    with pytest.raises(ValueError):
        generate("random", 3, max_prompt_len=10, min_prompt_len=20)
    mix = generate("mixed", 100, seed=0, weights={"random": 1, "rag": 1})
    assert len(mix) == 100


def test_prefix_group_tokens_prefix_consistent() -> None:
    a = prefix_group_tokens(3, 1000, seed=1)
    b = prefix_group_tokens(3, 300, seed=1)
    assert np.array_equal(a[:300], b)
    assert not np.array_equal(prefix_group_tokens(4, 300, seed=1), b)


def test_trace_roundtrip(tmp_path: Path) -> None:
    reqs = generate("mixed", 40, seed=9)
    reqs[0].extra_key = b"lora-1"
    p = tmp_path / "t.jsonl"
    save_trace(reqs, p)
    back = load_trace(p)
    assert len(back) == len(reqs)
    for x, y in zip(reqs, back, strict=False):
        assert x.request_id == y.request_id and x.arrival == y.arrival
        assert np.array_equal(x.prompt, y.prompt) and x.output_len == y.output_len
        assert x.extra_key == y.extra_key and x.prefix_group == y.prefix_group


def test_trace_compact_form(tmp_path: Path) -> None:
    p = tmp_path / "c.jsonl"
    p.write_text(
        "# comment\n\n"
        '{"time": 0.1, "prompt_len": 300, "prefix_group": 2, "prefix_len": 256, "output_len": 4}\n'
        '{"step": 7, "prompt_len": 280, "prefix_group": 2, "output_len": 2, "extra_key": "x"}\n'
        '{"arrival": 3.5, "prompt_ids": [1, 2, 3], "output_ids": [5, 6]}\n'
    )
    c, a, b = load_trace(p, step_seconds=0.02)  # sorted by arrival: 3.5, 5.0, 7
    assert a.arrival == pytest.approx(5.0) and c.arrival == 3.5 and b.arrival == 7
    assert np.array_equal(np.asarray(a.prompt)[:256], np.asarray(b.prompt)[:256])
    assert not np.array_equal(np.asarray(a.prompt)[256:280], np.asarray(b.prompt)[256:280])
    assert b.extra_key == b"x" and c.output_len == 2 and list(c.prompt) == [1, 2, 3]


@pytest.mark.parametrize(
    "line, msg",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"prompt_len": 10}', "output_len"),
        ('{"output_len": 3}', "missing prompt"),
        ('{"prompt_ids": [1, "a"], "output_len": 3}', "prompt_ids"),
        ('{"prompt_ids": [1], "prompt_len": 3, "output_len": 3}', "not both"),
        ('{"prompt_len": 10, "output_len": 0}', "output_len"),
        ('{"prompt_len": 10, "output_len": 2, "arrival": -1}', "arrival"),
        ('{"prompt_len": 10, "output_len": 2, "prefix_len": 4}', "prefix_group"),
        ('{"prompt_len": 10, "output_len": 2, "colour": 1}', "unknown field"),
        ('{"prompt_len": 10, "output_len": 2, "step": 1, "time": 2}', "only one"),
    ],
)
def test_trace_errors_name_file_and_line(tmp_path: Path, line: str, msg: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt_len": 100, "output_len": 2}\n' + line + "\n")
    with pytest.raises(TraceError, match=msg) as ei:
        load_trace(p)
    assert f"{p}:2" in str(ei.value)


def test_trace_missing_empty_duplicate(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")
    e = tmp_path / "e.jsonl"
    e.write_text("# nothing\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(e)
    d = tmp_path / "d.jsonl"
    d.write_text(
        '{"id": 1, "prompt_len": 9, "output_len": 1}\n{"id": 1, "prompt_len": 9, "output_len": 1}\n'
    )
    with pytest.raises(TraceError, match="duplicate"):
        load_trace(d)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_traces_load(path: Path) -> None:
    reqs = load_trace(path)
    assert len(reqs) >= 20
    assert len({r.prefix_group for r in reqs if r.prefix_group is not None}) >= 2


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 2
    for p in EXAMPLES:
        first = next(ln for ln in p.read_text().splitlines() if ln and not ln.startswith("#"))
        json.loads(first)


def test_agentic_sessions_resend_the_whole_session_after_a_tool_pause() -> None:
    reqs = generate("agentic", 3000, seed=2, sessions=40, turns=20, tool_pause_s=30)
    by_id = {r.request_id: r for r in reqs}
    pauses, last_turn = [], {}
    for r in reqs:
        assert r.arrival_s is not None and r.session.type == "agent"
        assert r.arrival == pytest.approx(r.arrival_s / 0.02)
        last_turn[r.prefix_group] = max(last_turn.get(r.prefix_group, 0), r.session.turn)
        if r.session.parent_chat_id < 0:
            assert r.session.turn == 1
            continue
        parent = by_id[r.session.parent_chat_id]
        assert r.session.turn == parent.session.turn + 1 and r.prefix_group == parent.prefix_group
        before = np.concatenate([np.asarray(parent.prompt), np.asarray(parent.output)])
        assert np.array_equal(np.asarray(r.prompt)[: len(before)], before)  # the whole session
        pauses.append(r.arrival_s - parent.arrival_s - parent.output_len * 0.02)
    assert 20 < float(np.median(pauses)) < 45  # log-normal, median 30 s
    # every session starts with the one system prompt the agents share
    firsts = [np.asarray(r.prompt)[:1024] for r in reqs if r.session.turn == 1]
    assert all(np.array_equal(f, firsts[0]) for f in firsts)
    # at most 40 sessions at once: a session starts only when another one ended
    spans: dict[int, list[float]] = {}
    for r in reqs:
        spans.setdefault(r.prefix_group, []).append(r.arrival_s)
    for t in (r.arrival_s for r in reqs[::50]):
        assert sum(1 for a in spans.values() if a[0] <= t <= a[-1]) <= 40
    assert len(spans) > 40 and max(last_turn.values()) > 20  # sessions ended and were replaced
    with pytest.raises(ValueError, match="agentic"):
        generate("agentic", 10, sessions=0)
    with pytest.raises(ValueError, match="agentic"):
        generate("mixed", 10, weights={"agentic": 1.0})


def test_scan_interleaves_one_off_documents_with_a_hot_set() -> None:
    reqs = generate("scan", 400, seed=1, hot_prompts=4, hot_len=512, scan_every=20, scan_len=10)
    hot = [r for r in reqs if r.prefix_group is not None]
    scans = [r for r in reqs if r.prefix_group is None]
    assert {r.prefix_group for r in hot} == {0, 1, 2, 3}
    assert len(scans) == 10 * (len(hot) // 20) or len(reqs) == 400
    documents = {tuple(np.asarray(r.prompt)[:64]) for r in scans}
    assert len(documents) == len(scans)  # every document is new
    for r in hot:
        first = next(h for h in hot if h.prefix_group == r.prefix_group)
        assert np.array_equal(np.asarray(r.prompt)[:512], np.asarray(first.prompt)[:512])
