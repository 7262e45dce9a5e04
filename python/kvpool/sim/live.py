"""``Live``: the scheduler-side state of one request in the simulator.

A request is ``WAITING`` (queued, no blocks), ``PREFILL`` (running, computing its prompt or a
recompute in chunks), ``DECODE`` (running, one token a step, a member of the decode batch,
``kvpool.sim.decode``) or ``DONE``. Its pool ``Sequence`` is made when it first reaches the
head of the waiting queue and dropped when it finishes (a finished request keeps no tokens).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.sim.request import Request
from kvpool.sim.sampling import output_token, output_tokens

__all__ = ["DECODE", "DONE", "PREFILL", "WAITING", "Live"]

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3


class Live:
    """Scheduler-side state of one request (see the module doc)."""

    __slots__ = (
        "admitted_step",
        "arrival_s",
        "arrive_step",
        "boundary",
        "cap",
        "finish_at",
        "finish_s",
        "finish_step",
        "first_admit_step",
        "first_cached",
        "first_token_s",
        "first_token_step",
        "generated",
        "lost",
        "off",
        "preemptions",
        "prompt_len",
        "req",
        "seq",
        "state",
        "_out",
    )

    def __init__(self, req: Request, arrival_s: float, arrive_step: int) -> None:
        self.req = req
        self.seq: Any = None
        self.state = WAITING
        self.generated = 0
        self.cap = 0  # tokens the block table is known to hold (prefill)
        self.boundary = 0  # last full-block boundary of the prompt at admission (linear state)
        self.admitted_step = -1
        self.first_admit_step = -1
        self.first_token_step = -1
        self.finish_step = -1
        self.first_cached = -1  # tokens from the cache at the first admission
        self.preemptions = 0
        self.lost = 0  # computed tokens dropped by preemptions (recomputed on readmission)
        self.prompt_len = req.prompt_len
        self.arrival_s = arrival_s
        self.arrive_step = arrive_step
        self.first_token_s = -1.0
        self.finish_s = -1.0
        self.off = 0  # decoding: the token sampled at step s is number s - off
        self.finish_at = -1  # decoding: the step that samples the last token
        self._out: np.ndarray | None = None

    @property
    def out(self) -> np.ndarray:
        """The tokens this request "samples" (all of them; the executor reads them)."""
        if self._out is None:
            self._out = _sample_tokens(self.req)
        return self._out

    @property
    def rank(self) -> int:
        """The dp rank of its sequence."""
        return int(self.seq.dp_rank)

    def token(self, k: int) -> int:
        """Sampled token number ``k``."""
        out = self.req.output
        if out is not None and k < len(out):
            return int(out[k])
        return output_token(self.req.request_id, k, self.req.hashed)


def _sample_tokens(req: Request) -> np.ndarray:
    if req.output is not None:
        out = np.asarray(req.output)
        if len(out) >= req.output_len:
            return out[: req.output_len]
    return output_tokens(req.request_id, np.arange(req.output_len), trace=req.hashed)
