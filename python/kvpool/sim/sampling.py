"""The tokens the simulator "samples": a fixed function of the request id and the position.

Token ``k`` of request ``r`` is ``low + (output_base(r) + k) % span`` (:func:`output_span`):
cheap to make for a whole batch at every step, different between requests (their bases
differ). Synthetic requests sample in ``[0, VOCAB_SIZE)``; trace requests (prompts of hash ids,
``Request.hashed``) in ``[2**31, 2**32)``, so a generated token never equals a trace prompt token
and an output block never matches a prompt block.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.sim.request import VOCAB_SIZE

__all__ = ["output_base", "output_span", "output_token", "output_tokens"]


def _lowbias32(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def output_base(request_id: int | np.ndarray) -> np.ndarray:
    """A request's output seed: ``lowbias32`` of its id (int64, the shape of ``request_id``)."""
    ids = np.atleast_1d(np.asarray(request_id, dtype=np.int64)).ravel()
    return np.array([_lowbias32(int(r)) for r in ids], dtype=np.int64).reshape(
        np.shape(request_id) or (1,)
    )


def output_token(request_id: int, k: int, trace: bool) -> int:
    """Token ``k`` of :func:`output_tokens` for one request, in plain Python."""
    low, span = output_span(trace)
    return low + (_lowbias32(int(request_id)) + k) % span


def output_span(trace: bool | np.ndarray) -> tuple[Any, Any]:
    """``(low, span)`` of the sampled tokens: ``[2**31, 2**32)`` for trace requests, else
    ``[0, VOCAB_SIZE)``."""
    if isinstance(trace, np.ndarray):
        return np.where(trace, 1 << 31, 0), np.where(trace, 1 << 31, VOCAB_SIZE)
    return (1 << 31, 1 << 31) if trace else (0, VOCAB_SIZE)


def output_tokens(
    request_id: int | np.ndarray, positions: np.ndarray, *, trace: bool | np.ndarray
) -> np.ndarray:
    """The tokens the simulator "samples": a fixed function of the request id and the position.

    Token ``k`` of request ``r`` is ``low + (output_base(r) + k) % span`` (:func:`output_span`):
    cheap to make for a whole batch at every step, different between requests (their bases
    differ), and never equal to a trace prompt token when ``trace`` (the upper half of the ids).
    Vectorized over ``request_id``/``trace`` arrays shaped like ``positions``; int64 out.
    """
    low, span = output_span(trace)
    return low + (output_base(request_id) + np.asarray(positions, dtype=np.int64)) % span
