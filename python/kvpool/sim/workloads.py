"""Seeded synthetic serving workloads and JSONL traces.

Every generator returns a list of :class:`Request` sorted by arrival (a step index of the
simulated engine). Token ids are ``np.int32`` arrays in ``[0, VOCAB_SIZE)``; prompts are
between ``min_prompt_len`` (64) and ``max_prompt_len`` (8192) tokens. The same ``kind``,
``num_requests``, ``seed`` and options always give the same requests.

Kinds (see docs/simulate.md for what each one models):

- ``system_prompt``: a few long system prompts shared by many requests + a unique user turn.
- ``chat``: multi-turn sessions; turn k+1's prompt is turn k's prompt + its answer + a new
  user message (so the whole previous conversation is a cached prefix).
- ``few_shot``: tasks with a fixed, ordered list of shared examples; a request takes the
  first n examples of its task and a unique question.
- ``rag``: documents with Zipf popularity; a request is a short shared instruction + k
  retrieved documents + a question (shared only while the retrieved order agrees).
- ``random``: unique prompts, no sharing at all (the prefix cache's worst case).
- ``mixed``: a blend of the five above, interleaved by arrival.
- ``agentic``: agent sessions of many turns (a median of 43) with tool-call pauses (log-normal,
  a median of 30 s) between them, 200 sessions at once; each turn resends the whole session.
- ``scan``: a hot set of shared prefixes reused between scans of one-off long documents (a
  batch job), which flush an LRU cache with blocks nobody uses again.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvpool.sim import traces
from kvpool.sim.request import VOCAB_SIZE, Request, Session, TraceError

__all__ = [
    "KINDS",
    "VOCAB_SIZE",
    "Request",
    "TraceError",
    "generate",
    "load_trace",
    "prefix_group_tokens",
    "save_trace",
]

MIN_PROMPT_LEN = 64
MAX_PROMPT_LEN = 8192
KINDS = ("system_prompt", "chat", "few_shot", "rag", "random", "mixed", "agentic", "scan")
# Default blend of "mixed" (fractions of num_requests).
MIXED_WEIGHTS = {"system_prompt": 0.3, "chat": 0.3, "few_shot": 0.15, "rag": 0.15, "random": 0.1}
# Prefix groups of different kinds in "mixed" never collide: kind i uses [i * 10**6, ...).
_GROUP_STRIDE = 1_000_000
_CHUNK = 256  # prefix_group_tokens generates group text in chunks of this many tokens


# --------------------------------------------------------------------------- helpers


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB_SIZE, size=int(n), dtype=np.int32)


def prefix_group_tokens(group: int, length: int, *, seed: int = 0) -> np.ndarray:
    """The first ``length`` tokens of prefix group ``group``'s text.

    Deterministic and prefix-consistent: a longer request of the same group starts with
    exactly the tokens of a shorter one (the text is generated in fixed chunks, each from
    its own seed), so two trace lines with the same ``prefix_group`` share their first
    ``min(prefix_len)`` tokens.
    """
    n_chunks = -(-int(length) // _CHUNK)
    parts = [
        np.random.default_rng([seed, 0x5EED, int(group) & 0xFFFFFFFF, c]).integers(
            0, VOCAB_SIZE, size=_CHUNK, dtype=np.int32
        )
        for c in range(n_chunks)
    ]
    out = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return out[: int(length)]


def _arrivals(rng: np.random.Generator, n: int, rate: float | None) -> np.ndarray:
    """Poisson arrivals with ``rate`` requests per step; all at step 0 if rate is None/inf."""
    if n == 0:
        return np.zeros(0)
    if rate is None or rate <= 0 or math.isinf(rate):
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)) - 0.0


def _lognormal_int(
    rng: np.random.Generator, mean: float, lo: int, hi: int, size: int
) -> np.ndarray:
    """Integers with a log-normal spread (sigma 0.6) around ``mean``, clipped to [lo, hi]."""
    sigma = 0.6
    mu = math.log(max(mean, 1.0)) - sigma * sigma / 2
    x = rng.lognormal(mu, sigma, size=size)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def _fit(prompt: np.ndarray, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """Pad (with fresh tokens) or cut (at the end) a prompt to [lo, hi] tokens."""
    if len(prompt) < lo:
        prompt = np.concatenate([prompt, _tokens(rng, lo - len(prompt))])
    if len(prompt) > hi:
        prompt = prompt[:hi]
    return prompt


# --------------------------------------------------------------------------- generators


def _gen_system_prompt(
    n: int, rng: np.random.Generator, o: dict[str, Any], g0: int
) -> list[Request]:
    num_prompts = int(o.get("num_system_prompts", 4))
    sys_len = int(o.get("system_prompt_len", 1536))
    user_mean = float(o.get("user_len", 256))
    sys_lens = np.clip(_lognormal_int(rng, sys_len, 64, o["max_prompt_len"], num_prompts), 64, None)
    systems = [_tokens(rng, L) for L in sys_lens]
    # Zipf-like popularity: prompt 0 is the most used.
    pop = 1.0 / np.arange(1, num_prompts + 1)
    which = rng.choice(num_prompts, size=n, p=pop / pop.sum())
    user_lens = _lognormal_int(rng, user_mean, 16, 4096, n)
    outs = _lognormal_int(rng, o["output_len"], 1, o["max_output_len"], n)
    arr = _arrivals(rng, n, o["rate"])
    reqs = []
    for i in range(n):
        p = np.concatenate([systems[which[i]], _tokens(rng, user_lens[i])])
        p = _fit(p, o["min_prompt_len"], o["max_prompt_len"], rng)
        reqs.append(Request(i, float(arr[i]), p, int(outs[i]), None, g0 + int(which[i])))
    return reqs


def _gen_chat(n: int, rng: np.random.Generator, o: dict[str, Any], g0: int) -> list[Request]:
    max_turns = int(o.get("turns", 6))
    sys_prompt = _tokens(rng, int(o.get("system_prompt_len", 128)))
    user_mean = float(o.get("user_len", 160))
    think = float(o.get("think_steps", 50.0))  # steps between an answer and the next turn
    rate = o["rate"]
    reqs: list[Request] = []
    session = 0
    t_session = 0.0
    while len(reqs) < n:
        turns = int(rng.integers(1, max_turns + 1))
        history = sys_prompt
        t = t_session
        for _ in range(turns):
            if len(reqs) >= n:
                break
            user = _tokens(rng, _lognormal_int(rng, user_mean, 8, 2048, 1)[0])
            prompt = np.concatenate([history, user])
            if len(prompt) > o["max_prompt_len"]:
                break
            prompt = _fit(prompt, o["min_prompt_len"], o["max_prompt_len"], rng)
            out_len = int(_lognormal_int(rng, o["output_len"], 1, o["max_output_len"], 1)[0])
            answer = _tokens(rng, out_len)
            reqs.append(Request(len(reqs), t, prompt, out_len, None, g0 + session, answer))
            history = np.concatenate([prompt, answer])
            # the next turn comes after the answer is out and the user has read it
            t = t + out_len + float(rng.exponential(think))
        session += 1
        if rate:  # sessions arrive at rate / (mean turns per session): requests at ~rate
            t_session += float(rng.exponential((max_turns + 1) / 2.0 / float(rate)))
    reqs.sort(key=lambda r: (r.arrival, r.request_id))
    for i, r in enumerate(reqs):
        r.request_id = i
    return reqs


def _gen_few_shot(n: int, rng: np.random.Generator, o: dict[str, Any], g0: int) -> list[Request]:
    num_tasks = int(o.get("num_tasks", 8))
    shots = int(o.get("shots", 8))
    ex_mean = float(o.get("example_len", 192))
    header = [_tokens(rng, 48) for _ in range(num_tasks)]
    examples = [
        [_tokens(rng, L) for L in _lognormal_int(rng, ex_mean, 32, 1024, shots)]
        for _ in range(num_tasks)
    ]
    task = rng.integers(0, num_tasks, size=n)
    k = rng.integers(max(1, shots // 2), shots + 1, size=n)
    q_lens = _lognormal_int(rng, 96, 8, 1024, n)
    outs = _lognormal_int(rng, o["output_len"] / 2, 1, o["max_output_len"], n)
    arr = _arrivals(rng, n, o["rate"])
    reqs = []
    for i in range(n):
        t = int(task[i])
        p = np.concatenate([header[t], *examples[t][: int(k[i])], _tokens(rng, q_lens[i])])
        p = _fit(p, o["min_prompt_len"], o["max_prompt_len"], rng)
        reqs.append(Request(i, float(arr[i]), p, int(outs[i]), None, g0 + t))
    return reqs


def _gen_rag(n: int, rng: np.random.Generator, o: dict[str, Any], g0: int) -> list[Request]:
    num_docs = int(o.get("num_docs", 64))
    top_k = int(o.get("top_k", 3))
    doc_mean = float(o.get("doc_len", 768))
    instr = _tokens(rng, 64)
    docs = [_tokens(rng, L) for L in _lognormal_int(rng, doc_mean, 64, 4096, num_docs)]
    pop = 1.0 / np.arange(1, num_docs + 1) ** 1.1
    pop /= pop.sum()
    q_lens = _lognormal_int(rng, 64, 8, 512, n)
    outs = _lognormal_int(rng, o["output_len"], 1, o["max_output_len"], n)
    arr = _arrivals(rng, n, o["rate"])
    reqs = []
    for i in range(n):
        picked = rng.choice(num_docs, size=min(top_k, num_docs), replace=False, p=pop)
        p = np.concatenate([instr, *(docs[d] for d in picked), _tokens(rng, q_lens[i])])
        p = _fit(p, o["min_prompt_len"], o["max_prompt_len"], rng)
        reqs.append(Request(i, float(arr[i]), p, int(outs[i]), None, g0 + int(picked[0])))
    return reqs


def _gen_random(n: int, rng: np.random.Generator, o: dict[str, Any], g0: int) -> list[Request]:
    lens = _lognormal_int(
        rng, float(o.get("prompt_len", 768)), o["min_prompt_len"], o["max_prompt_len"], n
    )
    outs = _lognormal_int(rng, o["output_len"], 1, o["max_output_len"], n)
    arr = _arrivals(rng, n, o["rate"])
    return [Request(i, float(arr[i]), _tokens(rng, lens[i]), int(outs[i])) for i in range(n)]


# Engine step the agentic workload's seconds map to (the simulator's default fixed step time).
_AGENT_STEP_S = 0.02


def _gen_agentic(n: int, rng: np.random.Generator, o: dict[str, Any], g0: int) -> list[Request]:
    """Agent sessions (an agent loop calling tools, as in RFC vLLM #52113's traffic): every turn
    resends the whole session (one system prompt all sessions share, the task, then each turn's
    answer and tool result), turns per session log-normal with a median of ``turns``, the pause
    between a turn's answer and the next turn (the tool call) log-normal with a median of
    ``tool_pause_s`` seconds, ``sessions`` sessions at once (one that ends is replaced). Arrivals
    are in seconds (``arrival_s``); each request carries its :class:`Session` (turn, parent)."""
    median_turns = float(o.get("turns", 43))
    pause = float(o.get("tool_pause_s", 30.0))
    concurrent = int(o.get("sessions", 200))
    if median_turns < 1 or pause < 0 or concurrent < 1:
        raise ValueError("agentic: turns >= 1, tool_pause_s >= 0 and sessions >= 1")
    system = _tokens(rng, int(o.get("system_prompt_len", 1024)))
    task_mean = float(o.get("user_len", 256))
    tool_mean = float(o.get("tool_len", 192))
    reqs: list[Request] = []
    # (next arrival in seconds, session number); a session's state lives in `live`
    live: dict[int, dict[str, Any]] = {}
    queue: list[tuple[float, int]] = []
    started = 0

    def start(t: float) -> None:
        nonlocal started
        turns = max(1, int(round(rng.lognormal(math.log(median_turns), 0.8))))
        task = _tokens(rng, _lognormal_int(rng, task_mean, 16, 4096, 1)[0])
        live[started] = {"turns": turns, "turn": 0, "history": np.concatenate([system, task])}
        queue.append((t, started))
        started += 1

    for _ in range(concurrent):  # the first sessions start within one pause
        start(float(rng.uniform(0.0, max(pause, 1.0))))
    while len(reqs) < n and queue:
        queue.sort()
        t, sid = queue.pop(0)
        st = live[sid]
        prompt = st["history"]
        if st["turn"] > 0:  # the tool's result follows the previous answer
            tool = _tokens(rng, _lognormal_int(rng, tool_mean, 8, 4096, 1)[0])
            prompt = np.concatenate([prompt, tool])
        if len(prompt) > o["max_prompt_len"]:
            del live[sid]
            start(t)
            continue
        prompt = _fit(prompt, o["min_prompt_len"], o["max_prompt_len"], rng)
        out_len = int(_lognormal_int(rng, o["output_len"], 1, o["max_output_len"], 1)[0])
        answer = _tokens(rng, out_len)
        rid = len(reqs)
        session = Session(
            chat_id=rid, parent_chat_id=st.get("last", -1), turn=st["turn"] + 1, type="agent"
        )
        reqs.append(
            Request(rid, t / _AGENT_STEP_S, prompt, out_len, None, g0 + sid, answer, t, session)
        )
        st.update(history=np.concatenate([prompt, answer]), turn=st["turn"] + 1, last=rid)
        if st["turn"] >= st["turns"]:
            del live[sid]
            start(t + float(rng.exponential(max(pause, 1.0))))
        else:  # the answer streams out, then the tool runs
            wait = out_len * _AGENT_STEP_S + float(rng.lognormal(math.log(max(pause, 1e-3)), 1.0))
            queue.append((t + wait, sid))
    reqs.sort(key=lambda r: (r.arrival, r.request_id))
    renumber = {r.request_id: i for i, r in enumerate(reqs)}
    for r in reqs:
        r.request_id = renumber[r.request_id]
        s = r.session
        r.session = Session(renumber[s.chat_id], renumber.get(s.parent_chat_id, -1), s.turn, s.type)
    return reqs


def _gen_scan(n: int, rng: np.random.Generator, o: dict[str, Any], g0: int) -> list[Request]:
    """A hot set reused between scans: ``hot_prompts`` shared prefixes of ``hot_len`` tokens,
    each request one of them (uniformly) and a short question; every ``scan_every`` requests a
    scan of ``scan_len`` one-off documents of ``doc_len`` tokens arrives at once (a batch job),
    whose blocks nobody uses again: the case where LRU evicts the hot set for them."""
    hot = [_tokens(rng, int(o.get("hot_len", 2048))) for _ in range(int(o.get("hot_prompts", 8)))]
    every, scan_len = int(o.get("scan_every", 50)), int(o.get("scan_len", 32))
    doc_len = int(o.get("doc_len", 6144))
    if not hot or every < 1 or scan_len < 0 or doc_len < 1:
        raise ValueError("scan: hot_prompts >= 1, scan_every >= 1, scan_len >= 0, doc_len >= 1")
    arr = _arrivals(rng, n, o["rate"])
    reqs: list[Request] = []
    served = 0
    while len(reqs) < n:
        t = float(arr[len(reqs)])
        if served and served % every == 0:
            for _ in range(min(scan_len, n - len(reqs))):
                doc = _fit(_tokens(rng, doc_len), o["min_prompt_len"], o["max_prompt_len"], rng)
                reqs.append(Request(len(reqs), t, doc, int(o["output_len"])))
        if len(reqs) >= n:
            break
        which = int(rng.integers(len(hot)))
        q = _tokens(rng, _lognormal_int(rng, 64, 8, 512, 1)[0])
        p = _fit(np.concatenate([hot[which], q]), o["min_prompt_len"], o["max_prompt_len"], rng)
        out = int(_lognormal_int(rng, o["output_len"], 1, o["max_output_len"], 1)[0])
        reqs.append(Request(len(reqs), t, p, out, None, g0 + which))
        served += 1
    return reqs


_GENERATORS = {
    "system_prompt": _gen_system_prompt,
    "chat": _gen_chat,
    "few_shot": _gen_few_shot,
    "rag": _gen_rag,
    "random": _gen_random,
    "agentic": _gen_agentic,
    "scan": _gen_scan,
}


def generate(kind: str, num_requests: int, *, seed: int = 0, **options: Any) -> list[Request]:
    """Generate ``num_requests`` requests of workload ``kind`` (one of :data:`KINDS`).

    Common options: ``rate`` (mean arrivals per engine step, Poisson; ``None`` or ``0`` puts
    every request at step 0; default 0.5), ``output_len`` (mean output tokens, default 192),
    ``max_output_len`` (1024), ``min_prompt_len`` (64), ``max_prompt_len`` (8192).
    Per-kind options: system_prompt: ``num_system_prompts``, ``system_prompt_len``,
    ``user_len``; chat: ``turns``, ``system_prompt_len``, ``user_len``, ``think_steps``;
    few_shot: ``num_tasks``, ``shots``, ``example_len``; rag: ``num_docs``, ``top_k``,
    ``doc_len``; random: ``prompt_len``; mixed: ``weights`` (dict kind -> fraction); agentic:
    ``turns`` (the median, 43), ``tool_pause_s`` (the median, 30), ``sessions`` (200),
    ``system_prompt_len``, ``user_len``, ``tool_len`` (its prompts may reach 32768 tokens unless
    ``max_prompt_len`` says otherwise); scan: ``hot_prompts``, ``hot_len``, ``scan_every``,
    ``scan_len``, ``doc_len``.
    Unknown kinds or options raise ValueError.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown workload kind {kind!r}; expected one of {', '.join(KINDS)}")
    num_requests = int(num_requests)
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    o = dict(options)
    known = {
        "rate",
        "output_len",
        "max_output_len",
        "min_prompt_len",
        "max_prompt_len",
        "weights",
        "num_system_prompts",
        "system_prompt_len",
        "user_len",
        "turns",
        "think_steps",
        "num_tasks",
        "shots",
        "example_len",
        "num_docs",
        "top_k",
        "doc_len",
        "prompt_len",
        "tool_pause_s",
        "sessions",
        "tool_len",
        "hot_prompts",
        "hot_len",
        "scan_every",
        "scan_len",
    }
    unknown = sorted(set(o) - known)
    if unknown:
        raise ValueError(f"unknown workload option(s): {', '.join(unknown)}")
    o.setdefault("rate", 0.5)
    o.setdefault("output_len", 192)
    o.setdefault("max_output_len", 1024)
    o.setdefault("min_prompt_len", MIN_PROMPT_LEN)
    o.setdefault("max_prompt_len", 4 * MAX_PROMPT_LEN if kind == "agentic" else MAX_PROMPT_LEN)
    o["min_prompt_len"] = int(o["min_prompt_len"])
    o["max_prompt_len"] = int(o["max_prompt_len"])
    o["max_output_len"] = int(o["max_output_len"])
    if o["min_prompt_len"] < 1 or o["max_prompt_len"] < o["min_prompt_len"]:
        raise ValueError("need 1 <= min_prompt_len <= max_prompt_len")
    if o["max_output_len"] < 1 or float(o["output_len"]) < 1:
        raise ValueError("output_len and max_output_len must be >= 1")
    if o["rate"] is not None and float(o["rate"]) < 0:
        raise ValueError("rate must be >= 0")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, KINDS.index(kind)])
    if kind != "mixed":
        return _GENERATORS[kind](num_requests, rng, o, 0)

    weights = dict(o.pop("weights", None) or MIXED_WEIGHTS)
    if "agentic" in weights:
        raise ValueError("mixed weights: agentic sessions run on their own clock, not in a mix")
    bad = sorted(set(weights) - set(_GENERATORS))
    if bad:
        raise ValueError(f"unknown kind(s) in mixed weights: {', '.join(bad)}")
    kinds = list(weights)
    w = np.array([max(0.0, float(weights[k])) for k in kinds])
    if w.sum() <= 0:
        raise ValueError("mixed weights must have a positive sum")
    counts = np.floor(w / w.sum() * num_requests).astype(int)
    counts[int(np.argmax(w))] += num_requests - int(counts.sum())
    # Each part arrives at its share of the total rate, so the blend has the requested rate.
    reqs: list[Request] = []
    for k, c in zip(kinds, counts, strict=False):
        sub = dict(o)
        if sub["rate"]:
            sub["rate"] = float(sub["rate"]) * c / max(num_requests, 1)
        part_rng = np.random.default_rng(
            [int(seed) & 0xFFFFFFFF, KINDS.index("mixed"), KINDS.index(k)]
        )
        g0 = KINDS.index(k) * _GROUP_STRIDE
        part = _GENERATORS[k](int(c), part_rng, sub, g0)
        reqs.extend(part)
    reqs.sort(
        key=lambda r: (
            r.arrival,
            r.prefix_group if r.prefix_group is not None else -1,
            r.request_id,
        )
    )
    for i, r in enumerate(reqs):
        r.request_id = i
    return reqs


# --------------------------------------------------------------------------- traces


def _as_int_list(x: Any, what: str) -> list[int]:
    if not isinstance(x, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in x
    ):
        raise ValueError(f"{what} must be a list of integers")
    if any(t < 0 or t >= 2**32 for t in x):
        raise ValueError(f"{what} must hold token ids in [0, 2**32)")
    return x


def _parse_line(obj: Any, lineno: int, step_seconds: float, seed: int) -> Request:
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    known = {
        "id",
        "request_id",
        "arrival",
        "step",
        "time",
        "prompt_ids",
        "prompt_len",
        "prefix_group",
        "prefix_len",
        "output_len",
        "output_ids",
        "extra_key",
    }
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")
    rid = obj.get("request_id", obj.get("id", lineno - 1))
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ValueError("request_id must be an integer")
    # arrival: a step index ("arrival" or "step") or seconds ("time")
    n_arr = sum(k in obj for k in ("arrival", "step", "time"))
    if n_arr > 1:
        raise ValueError("give only one of arrival, step, time")
    arrival_s = None
    if "time" in obj:
        arrival = obj["time"]
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool):
            raise ValueError("time must be a number (seconds)")
        arrival_s = float(arrival)
        arrival = float(arrival) / step_seconds
    else:
        arrival = obj.get("arrival", obj.get("step", 0))
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool):
            raise ValueError("arrival/step must be a number (engine step)")
        arrival = float(arrival)
    if not math.isfinite(arrival) or arrival < 0:
        raise ValueError("arrival must be a finite number >= 0")
    out_len = obj.get("output_len")
    output = None
    if "output_ids" in obj:
        output = np.asarray(_as_int_list(obj["output_ids"], "output_ids"), dtype=np.int64)
        if out_len is None:
            out_len = len(output)
    if not isinstance(out_len, int) or isinstance(out_len, bool) or out_len < 1:
        raise ValueError("output_len must be an integer >= 1")
    if output is not None and len(output) < out_len:
        raise ValueError("output_ids has fewer than output_len tokens")
    group = obj.get("prefix_group")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group < 0):
        raise ValueError("prefix_group must be an integer >= 0")
    if "prompt_ids" in obj:
        if "prompt_len" in obj or "prefix_len" in obj:
            raise ValueError("give prompt_ids or prompt_len (+ prefix_group, prefix_len), not both")
        prompt = np.asarray(_as_int_list(obj["prompt_ids"], "prompt_ids"), dtype=np.int64)
    elif "prompt_len" in obj:
        plen = obj["prompt_len"]
        if not isinstance(plen, int) or isinstance(plen, bool) or plen < 1:
            raise ValueError("prompt_len must be an integer >= 1")
        if group is None:
            if "prefix_len" in obj:
                raise ValueError("prefix_len needs a prefix_group")
            prefix_len = 0
        else:
            prefix_len = obj.get("prefix_len", plen)
            if (
                not isinstance(prefix_len, int)
                or isinstance(prefix_len, bool)
                or not 0 <= prefix_len <= plen
            ):
                raise ValueError("prefix_len must be an integer in [0, prompt_len]")
        head = (
            prefix_group_tokens(group, prefix_len, seed=seed)
            if group is not None and prefix_len
            else np.zeros(0, np.int32)
        )
        tail = np.random.default_rng([seed, 0x7A11, rid & 0xFFFFFFFF, lineno]).integers(
            0, VOCAB_SIZE, size=plen - prefix_len, dtype=np.int32
        )
        prompt = np.concatenate([head, tail])
    else:
        raise ValueError("missing prompt: give prompt_ids, or prompt_len")
    if len(prompt) == 0:
        raise ValueError("prompt must not be empty")
    if prompt.dtype != np.int32 and int(prompt.max()) < 2**31:
        prompt = prompt.astype(np.int32)
    if (
        output is not None
        and output.dtype != np.int32
        and (len(output) == 0 or int(output.max()) < 2**31)
    ):
        output = output.astype(np.int32)
    ek = obj.get("extra_key")
    if ek is not None:
        if not isinstance(ek, str):
            raise ValueError("extra_key must be a string")
        ek = ek.encode("utf-8", errors="surrogateescape")
    return Request(rid, arrival, prompt, int(out_len), ek, group, output, arrival_s=arrival_s)


def _first_record(path: str | os.PathLike[str]) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                s = line.strip()
                if s and not s.startswith("#"):
                    try:
                        return json.loads(s)
                    except json.JSONDecodeError:
                        return None
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read trace {os.fspath(path)}: {e}") from None
    return None


def load_trace(
    path: str | os.PathLike[str],
    *,
    step_seconds: float = 0.02,
    seed: int = 0,
    fmt: str = "auto",
    trace_block_size: int | None = None,
) -> list[Request]:
    """Read a JSONL trace (formats: docs/simulate.md). Returns requests sorted by arrival.

    ``fmt`` is ``"kvpool"`` (this package's format), ``"mooncake"``, ``"bailian"`` (the public
    production traces, :mod:`kvpool.sim.traces`) or ``"auto"``: detected from the first
    record's fields. Blank lines and lines starting with ``#`` are skipped. ``time`` (seconds)
    sets ``arrival_s`` and, with ``step_seconds`` per engine step, ``arrival``. Raises
    :class:`TraceError` naming the file and line for anything it cannot read.
    """
    if step_seconds <= 0:
        raise ValueError("step_seconds must be > 0")
    if fmt not in traces.FORMATS:
        raise ValueError(
            f"unknown trace format {fmt!r}; expected one of {', '.join(traces.FORMATS)}"
        )
    if fmt == "auto":
        fmt = traces.detect_format(_first_record(path))
    if fmt != "kvpool":
        return traces.read_production_trace(
            path, fmt, trace_block_size=trace_block_size, step_seconds=step_seconds
        )
    if trace_block_size is not None:
        raise ValueError("trace_block_size applies to the Mooncake and Qwen-Bailian formats only")
    try:
        with open(path, encoding="utf-8") as f:
            return _read_kvpool(path, f, step_seconds, seed)
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read trace {os.fspath(path)}: {e}") from None


def _read_kvpool(
    path: str | os.PathLike[str], lines: Iterable[str], step_seconds: float, seed: int
) -> list[Request]:
    reqs: list[Request] = []
    seen: set[int] = set()
    for lineno, line in enumerate(lines, 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise TraceError(f"{os.fspath(path)}:{lineno}: not valid JSON ({e.msg})") from None
        try:
            r = _parse_line(obj, lineno, step_seconds, seed)
        except ValueError as e:
            raise TraceError(f"{os.fspath(path)}:{lineno}: {e}") from None
        if r.request_id in seen:
            raise TraceError(f"{os.fspath(path)}:{lineno}: duplicate request_id {r.request_id}")
        seen.add(r.request_id)
        reqs.append(r)
    if not reqs:
        raise TraceError(f"{os.fspath(path)}: the trace holds no requests")
    reqs.sort(key=lambda r: (r.arrival, r.request_id))
    return reqs


def _to_list(x: Sequence[int] | np.ndarray) -> list[int]:
    return x.tolist() if isinstance(x, np.ndarray) else [int(t) for t in x]


def save_trace(requests: Iterable[Request], path: str | os.PathLike[str]) -> None:
    """Write requests as JSONL with explicit token ids (``load_trace`` reads it back exactly)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            obj: dict[str, Any] = {
                "request_id": int(r.request_id),
                "arrival": float(r.arrival),
                "prompt_ids": _to_list(r.prompt_tokens()),
                "output_len": int(r.output_len),
            }
            if r.prefix_group is not None:
                obj["prefix_group"] = int(r.prefix_group)
            if r.extra_key is not None:
                obj["extra_key"] = r.extra_key.decode("utf-8", errors="surrogateescape")
            if r.output is not None:
                obj["output_ids"] = _to_list(r.output)
            if r.arrival_s is not None:
                obj["time"] = float(r.arrival_s)
                del obj["arrival"]
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")
