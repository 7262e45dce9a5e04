"""The types every part of the simulator shares: ``Request``, ``TraceError``, trace prompts.

A workload is a list of :class:`Request`: synthetic (``kvpool.sim.workloads``), or read from a
trace (kvpool's JSONL format, ``kvpool.sim.workloads``; Mooncake and Qwen-Bailian,
``kvpool.sim.traces``). A trace prompt given by hash ids is a :class:`HashedPrompt`, whose
tokens are made on demand by :func:`block_tokens`:

- **Equal ids give equal tokens, different ids never do.** Token ``j`` of the block of id ``h``
  is ``mix31(h * trace_block_size + j)``, where ``mix31`` (a multiply by an odd constant mod
  ``2**31``) is a bijection of ``[0, 2**31)``: the map from ``(id, offset)`` to a token is
  injective, so two blocks share tokens exactly when they share an id.
- Prompt tokens of synthetic workloads lie in ``[0, VOCAB_SIZE)``, those of trace prompts in
  ``[0, 2**31)``; ``kvpool.sim.sampling`` keeps the tokens the simulator samples apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "VOCAB_SIZE",
    "HashedPrompt",
    "Request",
    "Session",
    "TraceError",
    "block_tokens",
    "mix31",
]

VOCAB_SIZE = 32000


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Session:
    """The Qwen-Bailian session fields of one request: ``parent_chat_id`` is -1 for a first turn."""

    chat_id: int
    parent_chat_id: int
    turn: int
    type: str


_ODD = 0x2C1B3C6D  # an odd multiplier: x -> x * _ODD mod 2**31 is a bijection of [0, 2**31)


def mix31(x: int) -> int:
    """The bijection of ``[0, 2**31)`` behind :func:`block_tokens`, for one value."""
    return (x * _ODD) & 0x7FFFFFFF


def block_tokens(hash_ids: np.ndarray, length: int, block_size: int) -> np.ndarray:
    """The first ``length`` tokens of the blocks ``hash_ids`` (``block_size`` tokens each).

    Parameters
    ----------
    hash_ids : numpy.ndarray
        Integer ids, shape ``[n]``, each in ``[0, 2**31 // block_size)``.
    length : int
        Tokens to return, ``(n - 1) * block_size < length <= n * block_size``.
    block_size : int
        The trace's tokens per id.

    Returns
    -------
    numpy.ndarray
        int32 of shape ``[length]``, values in ``[0, 2**31)``; token ``i`` is
        ``mix31(hash_ids[i // block_size] * block_size + i % block_size)``, computed as
        ``(id * block_size * odd + offset * odd) mod 2**31`` (uint32 arithmetic wraps mod
        2**32, the mask takes it mod 2**31).
    """
    ids = np.asarray(hash_ids, dtype=np.uint32) * np.uint32((block_size * _ODD) & 0xFFFFFFFF)
    offsets = np.arange(block_size, dtype=np.uint32) * np.uint32(_ODD)
    x = (ids[:, None] + offsets[None, :]).ravel()[:length]
    x &= np.uint32(0x7FFFFFFF)
    return x.view(np.int32)


class HashedPrompt:
    """A prompt given by trace hash ids; ``len()`` is its length, the tokens are made on demand.

    ``tokens()`` (and ``numpy.asarray``) give the int32 tokens of :func:`block_tokens`; nothing is
    kept, so a trace of 145M prompt tokens holds 283k ids, not the tokens.
    """

    __slots__ = ("block_size", "hash_ids", "length")

    def __init__(self, hash_ids: np.ndarray, length: int, block_size: int) -> None:
        self.hash_ids = hash_ids
        self.length = int(length)
        self.block_size = int(block_size)

    def __len__(self) -> int:
        return self.length

    def tokens(self) -> np.ndarray:
        return block_tokens(self.hash_ids, self.length, self.block_size)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        t = self.tokens()
        return t if dtype is None else t.astype(dtype)

    def __repr__(self) -> str:
        return f"HashedPrompt({len(self.hash_ids)} ids x {self.block_size}, {self.length} tokens)"


@dataclass
class Request:
    """One request of a workload.

    ``arrival`` is the engine step at which the request enters the waiting queue (a float:
    it is admitted at the first step >= arrival). ``arrival_s``, when set, is the arrival in
    seconds on the trace's clock: a workload whose requests all have one is replayed on that
    clock (the step-time model advances it), else on the step count. ``prompt`` is a list or an
    array of token ids, or a :class:`HashedPrompt` (trace hash ids expanded on
    demand: use :meth:`prompt_tokens`). ``output`` optionally fixes the tokens the engine
    "samples" (multi-turn chat uses it so that the next turn's prompt contains the answer
    verbatim); when None the simulator draws them from the request id. ``session`` keeps the
    Qwen-Bailian session fields (:class:`Session`).
    """

    request_id: int
    arrival: float
    prompt: Any
    output_len: int
    extra_key: bytes | None = None
    prefix_group: int | None = None
    output: list[int] | np.ndarray | None = field(default=None, repr=False)
    arrival_s: float | None = None
    session: Any = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def hashed(self) -> bool:
        """Whether the prompt is of trace hash ids (its sampled tokens are in the upper range)."""
        return isinstance(self.prompt, HashedPrompt)

    def prompt_tokens(self) -> np.ndarray:
        """The prompt as a 1-D integer array (expanded from hash ids for trace prompts)."""
        p = self.prompt
        if isinstance(p, np.ndarray):
            return p
        if isinstance(p, HashedPrompt):
            return p.tokens()
        return np.asarray(p, dtype=np.int64)
