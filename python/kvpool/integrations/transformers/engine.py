"""``Engine``: continuous batching of a Hugging Face causal LM on a kvpool pool (nano-vllm style).

One :meth:`Engine.step`:

1. **Running sequences, oldest first**, each gets its next chunk within the token budget
   (``max_num_batched_tokens``): one token for a decode, a prefill chunk otherwise. A chunk ends
   on the pool's next checkpoint boundary when it would pass it (``next_checkpoint_boundary``,
   R24: a chunk that passes a boundary saves no checkpoint there). Its table grows with
   ``allocate(seq, num_new_tokens=n)``; when the pool is out of blocks the newest running
   sequence is preempted (recompute: ``deallocate``, back to the front of the queue, its
   prefix hit on re-admission) until it fits, or the sequence itself is.
2. **Admission**, first come first served, while the budget and ``max_num_seqs`` allow:
   ``allocate(seq, num_new_tokens=budget)`` takes the prefix hit (device, host tier) and the
   first chunk's blocks in one chain walk; host loads and the linear-state restore run at once,
   so ``num_computed_tokens`` counts the loaded tokens before the chunk is sized.
3. **Forward** of every scheduled chunk (``PagedModelRunner.forward``).
4. **Bookkeeping**: a sequence whose chunk reached its last token samples one (greedy, or from
   its own seeded generator); those go through the batch call ``pool.advance(seqs, tokens,
   lookahead=0)`` (computed = len, publish, append, room for the next token); partial chunks
   set ``num_computed_tokens`` and ``cache``. Finished sequences are deallocated (their blocks
   stay cached; with a host tier their offload is planned and run). Dedup switches
   (``drain_block_switches(with_group=True)``) are counted; the runner re-reads the tables each
   step, so they need nothing else.

Invariants: a request is in exactly one of ``waiting``, ``running`` or finished; a running
request holds blocks of the pool and ``num_computed_tokens < len``; every plan the pool hands
out is executed before the next forward (the runner); with ``check=True`` ``pool.check()`` holds
after every step.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import torch

import kvpool
from kvpool.integrations.transformers.layout import layout_of
from kvpool.integrations.transformers.runner import PagedModelRunner


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples: greedy at ``temperature=0``, else softmax sampling from a
    generator seeded with ``seed`` (the same tokens whatever the batch)."""

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


class Request(kvpool.Sequence):
    """A prompt, its sampling parameters and its output: a ``kvpool.Sequence`` the pool holds."""

    def __init__(self, token_ids: Any, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.tokens: list[int] = [int(t) for t in token_ids]
        self.prompt_len = len(self.tokens)
        self.output: list[int] = []
        self.finished = False
        self.num_preemptions = 0
        self.num_hit_tokens = 0  # the prefix hit (every tier) of its last admission
        self.generator = None
        if self.params.temperature > 0:
            self.generator = torch.Generator().manual_seed(
                self.params.seed if self.params.seed is not None else 0
            )
        # (first position, logits [n, vocab]) of every computed chunk, with record_logits
        self.logits: list[tuple[int, torch.Tensor]] = []


class Engine:
    """A ``transformers`` causal LM served from a kvpool pool (see the module doc).

    Parameters
    ----------
    model : the causal LM (eval mode; CPU for the numpy / emulated backends, CUDA for cupy).
    num_blocks : block ids of the pool (full-attention group), padding block included.
    block_size : tokens per block.
    host_num_blocks : a host tier of this many blocks (``HierarchyBlockManagerPool``); 0: none.
    swa_num_blocks : ids of the sliding-window group (default ``num_blocks``).
    linear_state_slots, checkpoint_interval : linear-state slots and their checkpoint interval
        (models with linear-attention layers; defaults ``4 * max_num_seqs + 1`` and none).
    max_num_seqs, max_num_batched_tokens : the running set and the tokens of one step.
    backend : the ``kvpool.kernels`` backend (numpy, emulated, cupy).
    eos_token_id : ends a request unless its ``ignore_eos``.
    record_logits : keep the logits of every computed token in ``request.logits`` (tests).
    check : ``pool.check()`` after every step (tests).
    validate : the kernels' range checks (each a device sync on cupy: off in a hot loop).
    pool_options : further ``BlockManagerPool`` options (``dedup``, ``enable_prefix_cache``, ...).
    """

    def __init__(
        self,
        model: Any,
        *,
        num_blocks: int,
        block_size: int = 16,
        host_num_blocks: int = 0,
        swa_num_blocks: int | None = None,
        linear_state_slots: int | None = None,
        checkpoint_interval: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        backend: str | None = None,
        eos_token_id: int | None = None,
        record_logits: bool = False,
        check: bool = False,
        validate: bool = True,
        pool_options: dict[str, Any] | None = None,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        layout = layout_of(model)
        opts = layout.pool_options(
            linear_state_slots=linear_state_slots or 4 * max_num_seqs + 1,
            checkpoint_interval=checkpoint_interval,
            swa_num_blocks=swa_num_blocks,
        )
        opts.update(pool_options or {})
        if host_num_blocks:
            pool: kvpool.BlockManagerPool = kvpool.HierarchyBlockManagerPool(
                num_blocks, host_num_blocks, block_size, **opts
            )
        else:
            pool = kvpool.BlockManagerPool(num_blocks, block_size, **opts)
        self.pool = pool
        self.runner = PagedModelRunner(model, pool, backend=backend, validate=validate)
        # the most tokens one request can ever hold: every full-attention block
        self._capacity = block_size * pool.stats()["num_total_blocks"]
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_id = eos_token_id
        self.record_logits = record_logits
        self.check = check
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters: dict[str, int] = defaultdict(int)
        self.timers: dict[str, float] = defaultdict(float)

    # ------------------------------------------------------------------------------ requests
    def add_request(self, token_ids: Any, params: SamplingParams | None = None) -> Request:
        """Queues a prompt; returns its :class:`Request` (``output`` fills as it runs)."""
        req = Request(token_ids, params)
        if not req.tokens:
            raise ValueError("token_ids: a prompt needs at least one token")
        if len(req.tokens) + req.params.max_tokens > self._capacity:
            raise ValueError(
                f"token_ids: {len(req.tokens)} tokens plus max_tokens "
                f"{req.params.max_tokens} do not fit in the pool ({self._capacity} "
                "tokens): it would be preempted forever"
            )
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(
        self, prompts: list[Any], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """The batch API: every prompt's output tokens, in order."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} for {len(prompts)} prompts")
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while self.has_unfinished():
            self.step()
        return [r.output for r in reqs]

    # ------------------------------------------------------------------------------ step
    def step(self) -> list[Request]:
        """One scheduling step and one forward; returns the requests that finished."""
        t0 = time.perf_counter()
        sched = self._schedule()
        t1 = time.perf_counter()
        if not sched:
            if self.waiting and not self.running:
                req = self.waiting[0]
                raise RuntimeError(
                    f"request of {len(req)} tokens can never be admitted: the "
                    "pool is too small for it"
                )
            return []
        seqs = [r for r, _ in sched]
        chunks = [r.tokens[r.num_computed_tokens : r.num_computed_tokens + n] for r, n in sched]
        logits = self.runner.forward(seqs, chunks, all_logits=self.record_logits)
        t2 = time.perf_counter()
        finished = self._postprocess(sched, logits)
        self.timers["schedule"] += (t1 - t0) + (time.perf_counter() - t2)
        self.timers["step"] += time.perf_counter() - t0
        self.counters["steps"] += 1
        if self.check:
            self.pool.check()
        return finished

    def _chunk(self, req: Request, budget: int) -> int:
        """The next chunk: within the budget, ending on the next checkpoint boundary (R24)."""
        c = req.num_computed_tokens
        n = min(budget, len(req.tokens) - c)
        boundary = self.pool.next_checkpoint_boundary(req)
        if boundary is not None and boundary < c + n:
            n = boundary - c
        return n

    def _schedule(self) -> list[tuple[Request, int]]:
        budget = self.max_num_batched_tokens
        sched: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            while not self.pool.allocate(req, num_new_tokens=n):  # grows the table (R14)
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                sched.append((req, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.pool.allocate(req, num_new_tokens=budget):
                break
            self.waiting.popleft()
            self.running.append(req)
            self.runner.run_plans()  # host loads count in num_computed_tokens once complete
            self.counters["admissions"] += 1
            req.num_hit_tokens = req.num_computed_tokens
            self.counters["hit_tokens"] += req.num_hit_tokens
            n = self._chunk(req, budget)
            sched.append((req, n))
            budget -= n
        return sched

    def _preempt(self, req: Request) -> None:
        self.pool.deallocate(req)
        self.running.remove(req)
        self.waiting.appendleft(req)
        req.num_preemptions += 1
        self.counters["preemptions"] += 1
        self.runner.run_plans()  # a pending offload holds the released blocks (R26)

    def _sample(self, req: Request, logits: torch.Tensor) -> int:
        if req.generator is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / req.params.temperature, dim=-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=req.generator))

    def _postprocess(
        self, sched: list[tuple[Request, int]], logits: list[torch.Tensor]
    ) -> list[Request]:
        done: list[Request] = []
        tokens: list[int] = []
        for (req, n), lg in zip(sched, logits, strict=True):
            start = req.num_computed_tokens
            if self.record_logits:
                req.logits.append((start, lg.detach().cpu()))
                lg = lg[-1]
            if start + n == len(req.tokens):
                done.append(req)
                tokens.append(self._sample(req, lg))
                self.counters["decode_tokens" if n == 1 else "prefill_tokens"] += n
            else:
                req.num_computed_tokens = start + n
                self.pool.cache(req)  # R17: publish what the step computed; may plan a save
                self.counters["prefill_tokens"] += n
        if done:
            # computed = len, publish, append the token, room for the next one (R16, R17)
            self.pool.advance(done, tokens, lookahead=0)
        finished: list[Request] = []
        for req, tok in zip(done, tokens, strict=True):
            req.tokens.append(tok)
            req.output.append(tok)
            p = req.params
            if (
                len(req.output) >= p.max_tokens
                or tok in p.stop_token_ids
                or (not p.ignore_eos and tok == self.eos_token_id)
            ):
                req.finished = True
                self.running.remove(req)
                self.pool.deallocate(req)
                finished.append(req)
        self.counters["switches"] += len(self.pool.drain_block_switches(with_group=True))
        if finished:
            self.runner.run_plans()  # offloads of the released blocks (host tier)
        return finished

    def stats(self) -> dict[str, Any]:
        """The engine's counters, the runner's, and the pool's statistics that matter here."""
        s = self.pool.stats()
        out: dict[str, Any] = dict(self.counters)
        out.update({f"runner_{k}": v for k, v in self.runner.counters.items()})
        out.update(
            prefix_hit_tokens=s["prefix_hit_tokens"],
            evictions=s["num_evictions"],
            linear_state_hits=s["linear_state_hits"],
            checkpoint_commits=s["num_checkpoint_commits"],
        )
        window, host = s.get("window"), s.get("host")
        if window:
            out["window_releases"] = window["num_releases"]
        if host:
            out["host_loaded_blocks"] = host["num_loaded_blocks"]
            out["host_offloaded_blocks"] = host["num_offloaded_blocks"]
        return out
