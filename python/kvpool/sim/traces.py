"""Readers of the public production KV-cache traces: Mooncake (FAST'25) and Qwen-Bailian (ATC'25).

Both formats describe a prompt by ``hash_ids``, one id per block of the trace's block size (512
tokens for Mooncake, 16 for Qwen-Bailian): equal ids mean equal block content. The readers turn
every id into a deterministic block of tokens, so that kvpool's own prefix cache sees exactly the
sharing the trace records. The invariants this module keeps:

- **Equal ids give equal tokens, different ids never do.** Token ``j`` of the block of id ``h`` is
  ``mix31(h * trace_block_size + j)``, where ``mix31`` (a multiply by an odd constant mod
  ``2**31``) is a bijection of ``[0, 2**31)``: the map
  from ``(id, offset)`` to a token is injective, so two blocks share tokens exactly when they share
  an id (no probabilistic collisions; ``kvpool.sim.request.block_tokens``). Prompt tokens lie in
  ``[0, 2**31)``; the tokens the simulator samples for trace requests lie in ``[2**31, 2**32)``
  (``kvpool.sim.sampling``), so a generated token never equals a prompt token and an output block
  never matches a prompt block.
- **Exact sharing at any kvpool block size that divides the trace's.** A kvpool block then lies
  inside one trace block; other block sizes share the trace's common prefix rounded down to a
  multiple of the kvpool block size (a block straddling two trace blocks is shared only when both
  are).
- **The partial last block as the trace says.** ``input_length`` tokens: the last id covers the
  remaining ``input_length - (len(hash_ids) - 1) * trace_block_size`` tokens (the first tokens of
  that id's block, so a partial block is a prefix of the full block with the same id).
- **Memory bounded.** Lines are parsed one at a time; a request keeps its ids (an int32 array),
  never its tokens: :class:`HashedPrompt` expands them when the simulator needs them.
- **Time in seconds.** Mooncake's ``timestamp`` (milliseconds) and Qwen-Bailian's (seconds) become
  ``Request.arrival_s``, seconds since the trace start. Qwen-Bailian's session fields (``chat_id``,
  ``parent_chat_id``, ``turn``, ``type``) are kept in ``Request.session``.

A line that cannot be read raises :class:`~kvpool.sim.request.TraceError` with ``file:line:
reason``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvpool.sim.request import HashedPrompt, Request, Session, TraceError, block_tokens, mix31
from kvpool.sim.sampling import output_base, output_span, output_token, output_tokens

__all__ = [
    "BAILIAN_BLOCK_SIZE",
    "FORMATS",
    "MOONCAKE_BLOCK_SIZE",
    "HashedPrompt",
    "Session",
    "block_tokens",
    "detect_format",
    "mix31",
    "output_base",
    "output_span",
    "output_token",
    "output_tokens",
    "read_production_trace",
]

MOONCAKE_BLOCK_SIZE = 512
BAILIAN_BLOCK_SIZE = 16
FORMATS = ("auto", "kvpool", "mooncake", "bailian")

_MOONCAKE_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids"}
_BAILIAN_FIELDS = {
    "chat_id",
    "parent_chat_id",
    "timestamp",
    "input_length",
    "output_length",
    "type",
    "turn",
    "hash_ids",
}


def detect_format(obj: Any) -> str:
    """``"bailian"``, ``"mooncake"`` or ``"kvpool"`` from the fields of one trace record."""
    if isinstance(obj, dict) and "hash_ids" in obj:
        if {"chat_id", "parent_chat_id", "turn"} & set(obj):
            return "bailian"
        return "mooncake"
    return "kvpool"


def _int(obj: dict[str, Any], key: str, low: int) -> int:
    v = obj[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{key} must be an integer >= {low}, got {v!r}")
    return v


def _parse(obj: Any, fmt: str, block: int) -> tuple[float, HashedPrompt, int, Session | None]:
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    fields = _BAILIAN_FIELDS if fmt == "bailian" else _MOONCAKE_FIELDS
    missing = sorted(fields - set(obj))
    if missing:
        raise ValueError(
            f"missing field(s) {', '.join(missing)} of the {fmt} format "
            f"({', '.join(sorted(fields))})"
        )
    unknown = sorted(set(obj) - fields)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)} for the {fmt} format")
    ts = obj["timestamp"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a finite number >= 0, got {ts!r}")
    arrival_s = float(ts) / 1000.0 if fmt == "mooncake" else float(ts)
    length = _int(obj, "input_length", 1)
    out_len = max(1, _int(obj, "output_length", 0))  # the engine samples at least the first token
    raw = obj["hash_ids"]
    if not isinstance(raw, list) or not raw:
        raise ValueError("hash_ids must be a non-empty list of integers")
    ids = np.asarray(raw)
    if ids.dtype.kind not in "iu":
        raise ValueError("hash_ids must be a list of integers")
    limit = (1 << 31) // block
    if int(ids.min()) < 0 or int(ids.max()) >= limit:
        raise ValueError(
            f"hash_ids must lie in [0, {limit}) for exact expansion at {block} tokens per id"
        )
    need = -(-length // block)
    if len(ids) != need:
        raise ValueError(
            f"input_length {length} needs {need} hash id(s) of {block} tokens, the line has "
            f"{len(ids)}"
        )
    session = None
    if fmt == "bailian":
        kind = obj["type"]
        if not isinstance(kind, str):
            raise ValueError(f"type must be a string, got {kind!r}")
        session = Session(
            _int(obj, "chat_id", 0), _int(obj, "parent_chat_id", -1), _int(obj, "turn", 0), kind
        )
    return arrival_s, HashedPrompt(ids.astype(np.int32), length, block), out_len, session


def _records(path: str, f: Any) -> Iterator[tuple[int, Any]]:
    for lineno, line in enumerate(f, 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            yield lineno, json.loads(s)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def read_production_trace(
    path: str | os.PathLike[str],
    fmt: str = "auto",
    *,
    trace_block_size: int | None = None,
    step_seconds: float = 0.02,
) -> list[Any]:
    """Read a Mooncake or Qwen-Bailian JSONL trace, line by line.

    Parameters
    ----------
    path : str or os.PathLike
        The JSONL file.
    fmt : {"auto", "mooncake", "bailian"}
        ``"auto"`` detects the format from the first record's fields (:func:`detect_format`).
    trace_block_size : int, optional
        Tokens per hash id; default 512 (Mooncake) or 16 (Qwen-Bailian).
    step_seconds : float
        Seconds per engine step, to set ``Request.arrival`` (a step) beside ``arrival_s``.

    Returns
    -------
    list of Request
        Sorted by arrival (ties in file order); ``request_id`` is the record's index in the file,
        ``prompt`` a :class:`HashedPrompt`, ``session`` the Qwen-Bailian fields (else None).

    Raises
    ------
    TraceError
        ``file:line: reason`` for the first line that cannot be read.
    """
    name = os.fspath(path)
    if fmt not in ("auto", "mooncake", "bailian"):
        raise ValueError(f"unknown trace format {fmt!r}")
    reqs: list[Request] = []
    try:
        with open(path, encoding="utf-8") as f:
            block = trace_block_size
            for lineno, obj in _records(name, f):
                if fmt == "auto":
                    fmt = detect_format(obj)
                    if fmt == "kvpool":
                        raise TraceError(
                            f"{name}:{lineno}: not a Mooncake or Qwen-Bailian record (no hash_ids)"
                        )
                if block is None:
                    block = MOONCAKE_BLOCK_SIZE if fmt == "mooncake" else BAILIAN_BLOCK_SIZE
                try:
                    arrival_s, prompt, out_len, session = _parse(obj, fmt, block)
                except ValueError as e:
                    raise TraceError(f"{name}:{lineno}: {e}") from None
                reqs.append(
                    Request(
                        len(reqs),
                        arrival_s / step_seconds,
                        prompt,
                        out_len,
                        arrival_s=arrival_s,
                        session=session,
                    )
                )
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read trace {name}: {e}") from None
    if not reqs:
        raise TraceError(f"{name}: the trace holds no requests")
    reqs.sort(key=lambda r: (r.arrival_s, r.request_id))
    return reqs
