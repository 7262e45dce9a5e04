"""The continuous-batching scheduler loop of ``kvpool simulate``, built on BlockManagerPool.

One call of :meth:`Simulator.step` is one engine step (one forward pass per dp rank):

1. arrivals whose time has come join the waiting queue (FIFO): on the trace's clock in seconds
   when every request has ``arrival_s``, else on the step count;
2. decodes first: every decoding sequence takes one token of its rank's budget (they never
   outnumber it: a sequence joins the decode batch only through a prefill chunk that fit in the
   budget, one token at least). A decoder that got no room for its token when it advanced
   takes it now (``may_append``); when a rank runs out of blocks, the newest running sequence
   of that rank is preempted (``deallocate``, back to the front of the waiting queue: it will
   recompute, re-hitting its own prefix if it is still cached) until the room is there, or
   the sequence itself is the newest;
3. prefill chunks of running sequences, oldest first, take what is left of the budget
   (``allocate`` with a larger ``num_tokens``; preempting as above);
4. if nothing was preempted, waiting requests are admitted in order while a rank has budget
   and ``plan`` finds room (the first chunk; prefix hits are free), then ``allocate`` carries
   the plan out (one walk of the prefix chain per tier);
5. the (simulated or executed) forward pass, timed by the step-time model
   (:mod:`kvpool.sim.timing`); then prefill chunks advance ``num_computed_tokens`` and
   ``cache`` the blocks that became full, finished sequences are released (``deallocate``),
   and the decode batch advances in one call: ``pool.advance(batch, tokens, lookahead=0)``
   (computed tokens, publication, the sampled token, its slot) on a ``SequenceBatch`` kept
   from step to step. A sequence whose prefill reaches its length samples its first token and
   joins the batch.

Invariants the loop keeps (asserted every step by ``check=True``): every running sequence is
in exactly one of the decode batch and the prefill list; the decode batch's members hold
blocks for all their tokens but at most the ones in ``need_room``; waiting sequences hold no
blocks; the blocks running sequences hold are exactly the pool's used blocks.

``order="request"`` replaces the loop by the paper-style analysis: requests one at a time in
arrival order, each prompt allocated whole (prefix match), computed and released; no batching,
no decode.

Scheduler overhead is the wall time of phases 1-4 plus the bookkeeping of phase 5: the part
of an engine step that is the scheduler's, pool calls included, the forward excluded.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpool.sim.capacity import ModelShape
from kvpool.sim.elastic import GIB, MappedMemory
from kvpool.sim.timing import GPUS, FixedStepTime, Roofline, StepWork, chunk_work
from kvpool.sim.traces import output_base, output_span, output_token, output_tokens
from kvpool.sim.workloads import Request

__all__ = ["ORDERS", "SimConfig", "SimError", "Simulator", "UnavailableError", "check_fits", "run_simulation"]

ORDERS = ("serving", "request")


class SimError(Exception):
    """An impossible configuration or workload (reported to the user, no traceback)."""


class UnavailableError(SimError):
    """A feature the options ask for is not in this kvpool build."""


@dataclass
class SimConfig:
    num_blocks: int = 8192
    block_size: int = 16
    dp_size: int = 1
    enable_prefix_cache: bool = True
    max_num_batched_tokens: int = 2048  # per rank per step
    max_num_seqs: int = 256  # per rank
    linear_state_slots: int = 0
    checkpoint_interval: int | None = None
    linear_state_match: str = "deepest"
    sliding_window: int | None = None
    swa_num_blocks: int | None = None
    host_num_blocks: int = 0
    remote: str | None = None  # redis:// URL of a shared remote tier, or "memory" (needs the host tier)
    enable_events: bool = False  # the pool records KV events (the fleet simulation feeds a KVIndex)
    hash_seed: int | None = None
    check: bool = False  # test mode: pool.check() and accounting asserts every step
    max_steps: int | None = None
    seed: int = 0
    order: str = "serving"  # or "request": one request at a time, prompts only
    step_ms: float = 20.0  # the fixed step time (and an idle step of a step-clocked workload)
    gpu: str | None = None  # a key of timing.GPUS: the roofline step time (needs model_shape)
    tp: int = 1  # GPUs per rank (ideal tensor parallelism)
    mfu: float = 0.5
    mbu: float = 0.8
    model_shape: ModelShape | None = None
    # elastic pages (--xtensor): the pool's xtensor= dict, and (seconds, GiB per rank or None) limit changes
    xtensor: dict[str, Any] | None = None
    memory_limit_schedule: tuple[tuple[float, float | None], ...] = ()

    def pool_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"dp_size": self.dp_size, "enable_prefix_cache": self.enable_prefix_cache}
        if self.linear_state_slots:
            kw["linear_state_slots"] = self.linear_state_slots
            if self.checkpoint_interval is not None:
                kw["checkpoint_interval"] = self.checkpoint_interval
            kw["linear_state_match"] = self.linear_state_match
        if self.sliding_window is not None:
            kw["sliding_window"] = self.sliding_window
            if self.swa_num_blocks is not None:
                kw["swa_num_blocks"] = self.swa_num_blocks
        if self.hash_seed is not None:
            kw["hash_seed"] = self.hash_seed
        if self.xtensor is not None:
            kw["xtensor"] = dict(self.xtensor)
        if self.enable_events:
            kw["enable_events"] = True
        return kw

    def step_timer(self) -> FixedStepTime | Roofline:
        """The step-time model: the roofline with ``gpu``, else ``step_ms`` per step."""
        if self.gpu is None:
            return FixedStepTime(self.step_ms)
        if self.model_shape is None:
            raise SimError("the roofline step time (--gpu) needs a model shape (--model, or --layers/--kv-heads/"
                           "--head-dim with --heads and --params)")
        try:
            return Roofline(self.model_shape, GPUS[self.gpu], tp=self.tp, mfu=self.mfu, mbu=self.mbu)
        except ValueError as e:
            raise SimError(str(e)) from None

    def validate(self) -> None:
        if self.num_blocks < 2:
            raise SimError(f"num_blocks must be >= 2 (block 0 is the padding block), got {self.num_blocks}")
        if self.block_size < 1:
            raise SimError(f"block_size must be >= 1, got {self.block_size}")
        if self.dp_size < 1:
            raise SimError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.max_num_batched_tokens < 1:
            raise SimError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise SimError("max_num_seqs must be >= 1")
        if self.linear_state_slots < 0:
            raise SimError("linear_state_slots must be >= 0")
        if self.checkpoint_interval is not None:
            if not self.linear_state_slots:
                raise SimError("checkpoint_interval needs linear_state_slots > 0")
            if self.checkpoint_interval < 1 or self.checkpoint_interval % self.block_size:
                raise SimError(
                    f"checkpoint_interval must be a positive multiple of block_size ({self.block_size}), "
                    f"got {self.checkpoint_interval}")
        if self.linear_state_match not in ("deepest", "contiguous"):
            raise SimError("linear_state_match must be 'deepest' or 'contiguous'")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise SimError("sliding_window must be >= 1")
        if self.swa_num_blocks is not None and self.sliding_window is None:
            raise SimError("swa_num_blocks needs sliding_window")
        if self.host_num_blocks < 0:
            raise SimError("host_num_blocks must be >= 0")
        if self.remote is not None and not self.host_num_blocks:
            raise SimError("--remote needs the host tier (--host-blocks N): remote hits land in host blocks")
        if self.order not in ORDERS:
            raise SimError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.order == "request" and (self.linear_state_slots or self.sliding_window is not None):
            raise SimError("--order request replays prompts through the prefix cache only: it takes no linear "
                           "state or sliding window")
        if not self.step_ms > 0:
            raise SimError(f"step_ms must be > 0, got {self.step_ms}")
        if self.memory_limit_schedule and self.xtensor is None:
            raise SimError("a memory-limit schedule needs elastic pages (--xtensor)")
        if self.xtensor is not None and self.host_num_blocks:
            raise SimError("--xtensor does not combine with a host tier (--host-blocks)")
        if self.gpu is not None and self.gpu not in GPUS:
            raise SimError(f"unknown gpu {self.gpu!r}; expected one of {', '.join(GPUS)}")
        self.step_timer()


# _Live.state
WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3
# columns of Simulator.dec_cols, one row per decode-batch member: at step s a member samples
# token number k = s - _OFF, which is _LOW + (_SHIFT + s) % _SPAN (traces.output_tokens, with
# _SHIFT = base - off)
_OFF, _PLEN, _RANK, _SHIFT, _LOW, _SPAN = range(6)


class _Live:
    """Scheduler-side state of one request. ``seq`` is made when the request first reaches the
    head of the waiting queue and dropped when it finishes (a finished request keeps no tokens)."""

    __slots__ = ("admitted_step", "arrival_s", "arrive_step", "boundary", "cap", "finish_at", "finish_s",
                 "finish_step", "first_admit_step", "first_cached", "first_token_s", "first_token_step",
                 "generated", "lost", "off", "preemptions", "prompt_len", "req", "seq", "state", "_out")

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

    def token(self, k: int) -> int:
        """Sampled token number ``k``."""
        out = self.req.output
        if out is not None and k < len(out):
            return int(out[k])
        return output_token(self.req.request_id, k, self.req.hashed)


@dataclass(slots=True)
class StepRecord:
    step: int
    usage: float
    used_blocks: int
    cached_blocks: int
    running: int
    waiting: int
    batched_tokens: int
    hit_rate: float
    sched_us: float
    time_s: float = 0.0  # the simulated clock at the end of the step
    step_s: float = 0.0  # the step's duration (step-time model)
    mapped_gib: float = 0.0  # --xtensor: memory mapped at the end of the step, all ranks
    limit_gib: float = 0.0  # --xtensor: what the limits allow, all ranks


@dataclass
class SimResult:
    config: dict[str, Any]
    summary: dict[str, Any]
    timeline: list[StepRecord] = field(default_factory=list)
    execute: dict[str, Any] | None = None

    def to_json(self, *, timeline: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"config": self.config, "summary": self.summary, "execute": self.execute}
        if timeline:
            d["timeline"] = [asdict(r) for r in self.timeline]
        return d


def _import_kvpool() -> Any:
    import kvpool

    return kvpool


def make_pool(cfg: SimConfig, remote_tier: Any = None) -> Any:
    """The pool of ``cfg``: a ``HierarchyBlockManagerPool`` with a host tier (which composes with
    dp ranks, linear state and sliding windows: docs/host_tier.md), else a ``BlockManagerPool``.
    ``remote_tier`` (a ``kvpool.tiers.base.RemoteTier``) replaces the one ``cfg.remote`` names (the
    fleet simulation shares one among its instances)."""
    kvpool = _import_kvpool()
    kw = cfg.pool_kwargs()
    try:
        if cfg.host_num_blocks:
            if remote_tier is not None:
                kw["remote"] = remote_tier
            elif cfg.remote == "memory":
                from kvpool.tiers.memory import MemoryRemoteTier

                kw["remote"] = MemoryRemoteTier()
            elif cfg.remote is not None:
                from kvpool.tiers.redis import RedisRemoteTier

                ns = f"kvpool-sim|bs{cfg.block_size}|seed{cfg.hash_seed}"
                kw["remote"] = RedisRemoteTier(cfg.remote, ns, timeout_ms=1000)
            return kvpool.HierarchyBlockManagerPool(cfg.num_blocks, cfg.host_num_blocks, cfg.block_size, **kw)
        return kvpool.BlockManagerPool(cfg.num_blocks, cfg.block_size, **kw)
    except (TypeError, ValueError) as e:
        raise SimError(f"the pool rejected the configuration: {e}") from None


def check_fits(cfg: SimConfig, requests: Sequence[Request]) -> None:
    """SimError naming the first request that the cache of ``cfg`` cannot hold alone."""
    per_rank = (cfg.num_blocks - 1) * cfg.block_size
    for r in requests:
        if r.output_len < 1:
            raise SimError(f"request {r.request_id}: output_len must be >= 1")
        # the last sampled token is never fed back: the KV peaks at prompt + output - 1
        need = r.prompt_len + (r.output_len - 1 if cfg.order == "serving" else 0)
        if need > per_rank:
            raise SimError(
                f"request {r.request_id} needs {need} tokens of KV "
                f"({math.ceil(need / cfg.block_size)} blocks of {cfg.block_size}) but the whole cache "
                f"holds {per_rank} tokens per rank ({cfg.num_blocks - 1} usable blocks): raise "
                f"--num-blocks / --cache-tokens / --gib or shorten the request")


def _sample_tokens(req: Request) -> np.ndarray:
    if req.output is not None:
        out = np.asarray(req.output)
        if len(out) >= req.output_len:
            return out[: req.output_len]
    return output_tokens(req.request_id, np.arange(req.output_len), trace=req.hashed)


def _rank_of(lv: _Live) -> int:
    return int(lv.seq.dp_rank)


class Simulator:
    """Replays ``requests`` through a pool configured by ``cfg``; see the module docstring.

    ``executor`` (optional) is called once per step with the list of scheduled
    ``(live, start, end)`` chunks before the computed tokens advance (the data plane);
    ``on_step`` is called after every step with the simulator (progress bars).
    """

    def __init__(self, cfg: SimConfig, requests: Sequence[Request], *, executor: Any = None,
                 on_step: Callable[[Simulator], None] | None = None, remote_tier: Any = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.kvpool = _import_kvpool()
        self.timer = cfg.step_timer()
        self.pool = make_pool(cfg, remote_tier)
        self.mapped: MappedMemory | None = None
        if cfg.xtensor is not None:
            self.mapped = MappedMemory(self.pool, cfg.memory_limit_schedule)
        self.hier = bool(cfg.host_num_blocks)
        self.remote: Any = None
        if cfg.remote is not None:
            from kvpool.tiers.remote_transfer import RemoteTransfer

            self.remote = RemoteTransfer(self.pool, _SimBlocks())
        self.linear = bool(cfg.linear_state_slots)
        self.requests = sorted(requests, key=lambda r: (r.arrival, r.request_id))
        # the trace's clock when every request has one, else the step count
        self.seconds_clock = bool(self.requests) and all(r.arrival_s is not None for r in self.requests)
        if self.seconds_clock:
            self.requests.sort(key=lambda r: (r.arrival_s, r.request_id))
        self._check_fits()
        self.executor = executor
        self.on_step = on_step
        self.pending: deque[Request] = deque(self.requests)
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []  # admission order (the newest is preempted first)
        self.prefilling: list[_Live] = []  # running, in prefill; admission order
        # the decode batch: members in batch order, one row of dec_cols each (_RID, _OFF, ...)
        self.batch = self.kvpool.SequenceBatch()
        self.dec: list[_Live] = []
        self.dec_cols = np.zeros((0, 6), dtype=np.int64)
        self.dec_tok: list[tuple[int, int, int]] = []  # (_SHIFT, _LOW, _SPAN) of each member, as ints
        self.dec_fixed = 0  # members whose sampled tokens are fixed by the workload (req.output)
        # per rank: members, and the sum of prompt_len - off (a member's length is that + step)
        self.dec_count = [0] * cfg.dp_size
        self.dec_len_sum = [0] * cfg.dp_size
        # members by (prompt_len - off) % block_size: at step s the members of residue -s fill a
        # block (it is published, and their next token needs a new one): only then can a pure
        # decode step change the pool's counts
        self.dec_residue = [0] * cfg.block_size
        self.finishing: dict[int, list[_Live]] = {}  # step -> members that sample their last token then
        self._stats: dict[str, Any] | None = None  # the pool's stats, while nothing changed them
        self.need_room: list[_Live] = []  # members that advanced but got no slot for their token
        self.finished: list[_Live] = []
        self.step_no = 0
        self.now_s = 0.0
        self.busy_s = 0.0
        self.timeline: list[StepRecord] = []
        self.sched_ns: list[int] = []
        self.step_s: list[float] = []
        self.step_decodes: list[int] = []
        self.preemptions = 0
        self.admissions = 0
        self.admit_tokens = 0  # tokens of sequences at admission (re-admissions included)
        self.admit_cached = 0  # of which came from the prefix cache (or host tier)
        self.prefill_tokens = 0  # prompt/recompute tokens computed
        self.decode_tokens = 0
        self.recompute_tokens = 0
        self.host_loads = 0
        self.host_offloads = 0
        self.ckpt_restores = 0
        self.ckpt_saves = 0
        self.peak_usage = 0.0
        self.peak_used_blocks = 0
        self.usage_sum = 0.0
        self.stall_steps = 0
        self.trace_read_s: float | None = None  # set by the caller that read the trace

    # ------------------------------------------------------------------ setup
    def _check_fits(self) -> None:
        check_fits(self.cfg, self.requests)

    def _make_seq(self, lv: _Live) -> Any:
        req = lv.req
        lv.seq = self.kvpool.Sequence(req.prompt_tokens(), seq_id=int(req.request_id), extra_key=req.extra_key)
        return lv.seq

    # ------------------------------------------------------------------ tiers / plans
    def _sync_loads(self) -> None:
        if self.remote is not None:
            self.remote.run_fetches(self.pool.take_fetch_plans())
        plans = self.pool.take_load_plans()
        if plans:
            if self.executor is not None:
                self.executor.transfer(plans, to_device=True)
            self.host_loads += sum(len(p.src) for p in plans)
            self.pool.complete_loads(plans)

    def _sync_offloads(self) -> None:
        plans = self.pool.take_offload_plans()
        if plans:
            if self.executor is not None:
                self.executor.transfer(plans, to_device=False)
            self.host_offloads += sum(len(p.src) for p in plans)
            if self.remote is not None:
                self.remote.before_host_writes(plans)
            self.pool.complete_offloads(plans)
            if self.remote is not None:
                self.remote.after_offloads(plans)

    def _remote_summary(self) -> dict[str, Any]:
        if self.remote is None:
            return {}
        r = self.pool.stats()["remote"]
        return {"remote_hit_blocks": int(r["hit_blocks"]), "remote_fetched_blocks": int(r["fetched_blocks"]),
                "remote_failed_blocks": int(r["failed_fetch_blocks"]), "remote_puts": int(r.get("puts", 0)),
                "remote_errors": int(r.get("errors", 0)) + int(r.get("timeouts", 0))}

    def _release(self, lv: _Live) -> None:
        self.pool.deallocate(lv.seq)
        lv.cap = 0
        if self.hier:
            self._sync_offloads()

    # ------------------------------------------------------------------ the decode batch
    def _join_decode(self, lv: _Live, step: int) -> None:
        """``lv`` sampled token ``generated - 1`` (appended) and decodes from step ``step + 1``."""
        lv.state = DECODE
        lv.off = step + 1 - lv.generated
        lv.finish_at = lv.req.output_len - 1 + lv.off
        self.finishing.setdefault(lv.finish_at, []).append(lv)
        rank = _rank_of(lv)
        self.batch.add(lv.seq)
        self.dec.append(lv)
        low, span = output_span(lv.req.hashed)
        base = int(output_base(lv.req.request_id)[0])
        row = np.array([[lv.off, lv.prompt_len, rank, base - lv.off, low, span]], dtype=np.int64)
        self.dec_cols = np.concatenate([self.dec_cols, row])
        self.dec_tok.append((base - lv.off, low, span))
        self._account(lv, rank, 1)
        if lv.req.output is not None:
            self.dec_fixed += 1

    def _account(self, lv: _Live, rank: int, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) ``lv`` from the per-rank sums and the residue counts."""
        self.dec_count[rank] += sign
        self.dec_len_sum[rank] += sign * (lv.prompt_len - lv.off)
        self.dec_residue[(lv.prompt_len - lv.off) % self.cfg.block_size] += sign

    def _leave_decode(self, members: list[_Live], step: int) -> None:
        """Take ``members`` out of the decode batch; ``generated`` counts what they sampled before ``step``."""
        for lv in members:
            lv.state = WAITING  # not DECODE any more (the caller sets the next state)
            lv.generated = step - lv.off
            self._account(lv, _rank_of(lv), -1)
            if lv.req.output is not None:
                self.dec_fixed -= 1
        keep = [lv.state == DECODE for lv in self.dec]
        self.batch.remove_all([lv.seq for lv in members])
        self.dec = [lv for lv, k in zip(self.dec, keep, strict=True) if k]
        self.dec_tok = [t for t, k in zip(self.dec_tok, keep, strict=True) if k]
        self.dec_cols = self.dec_cols[np.array(keep, dtype=bool)]

    def _decode_tokens(self, step: int) -> Any:
        """The tokens the members sample at ``step``, in batch order (a list of int for a small
        batch: cheaper than NumPy there; else an int64 array)."""
        if len(self.dec) <= 64:
            tok: Any = [low + (shift + step) % span for shift, low, span in self.dec_tok]
        else:
            cols = self.dec_cols
            tok = cols[:, _LOW] + (cols[:, _SHIFT] + step) % cols[:, _SPAN]
        if self.dec_fixed:
            for i, lv in enumerate(self.dec):
                if lv.req.output is not None:
                    tok[i] = lv.token(step - lv.off)
        return tok

    def _advance_each(self, seqs: list[Any], tokens: np.ndarray) -> list[int]:
        """What ``pool.advance(seqs, tokens, lookahead=0)`` does, one call per sequence (the
        hierarchy pool has no batch step)."""
        pool = self.pool
        bs = self.cfg.block_size
        failed = []
        for i, seq in enumerate(seqs):
            start = seq.num_computed_tokens
            end = len(seq)
            seq.num_computed_tokens = end
            if end // bs > start // bs or self.linear:
                pool.cache(seq)
            seq.append_token(int(tokens[i]))
            if not pool.may_append(seq):
                failed.append(i)
        return failed

    # ------------------------------------------------------------------ scheduling
    def _preempt_for(self, lv: _Live, rank: int, step: int) -> bool:
        """Preempt the newest running sequence on ``rank``. Returns False if that is ``lv``."""
        running = self.running
        for j in range(len(running) - 1, -1, -1):
            v = running[j]
            if v.seq.dp_rank == rank:
                break
        else:  # pragma: no cover - lv itself is running on rank
            return False
        del running[j]
        if v.state == DECODE:
            self._leave_decode([v], step)
        else:
            self.prefilling.remove(v)
        v.lost = max(v.lost, v.seq.num_computed_tokens)
        self._release(v)
        v.state = WAITING
        v.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(v)
        return v is not lv

    def _chunk_end(self, lv: _Live, computed: int, budget: int) -> int:
        L = len(lv.seq)
        end = min(L, computed + budget)
        if self.linear and end < L:
            # end a prefill chunk where a checkpoint can be saved (R24): the next
            # multiple of checkpoint_interval, or the last full block of the prompt
            cuts = []
            ci = self.cfg.checkpoint_interval
            if ci:
                cuts.append((computed // ci + 1) * ci)
            if lv.boundary > computed:
                cuts.append(lv.boundary)
            cuts = [c for c in cuts if computed < c < end]
            if cuts:
                end = min(cuts)
        return end

    def _arrivals(self, step: int) -> None:
        pending = self.pending
        if self.seconds_clock:
            now = self.now_s
            while pending and pending[0].arrival_s <= now:
                r = pending.popleft()
                self.waiting.append(_Live(r, float(r.arrival_s), step))
        else:
            while pending and pending[0].arrival <= step:
                self.waiting.append(_Live(pending.popleft(), self.now_s, step))

    def step(self) -> None:
        cfg = self.cfg
        pool = self.pool
        bs = cfg.block_size
        B = cfg.max_num_batched_tokens
        t0 = time.perf_counter_ns()
        step = self.step_no
        # 1. arrivals
        pending = self.pending
        if pending and (pending[0].arrival_s <= self.now_s if self.seconds_clock else pending[0].arrival <= step):
            self._arrivals(step)
        preempted = False
        # whether a pool call other than the decode batch's advance ran (the counts may have changed)
        touched = self.hier or self.linear
        if self.mapped is not None and self.mapped.due(self.now_s):
            touched = self.mapped.apply_due(self.now_s) or touched  # a co-located tenant squeezes (or frees) memory
        # 2. decodes: room for those that advanced without it, then one token of budget each
        if self.need_room:
            touched = True
            for lv in self.need_room:
                if lv.state != DECODE:
                    continue  # preempted meanwhile
                rank = _rank_of(lv)
                while not pool.may_append(lv.seq):
                    preempted = True
                    if not self._preempt_for(lv, rank, step):
                        break
            self.need_room = []
        # 3. prefill chunks, oldest first
        scheduled: list[tuple[_Live, int, int]] = []
        if self.prefilling or self.waiting:
            touched = True
            budget = [B - min(c, B) for c in self.dec_count]
            for lv in list(self.prefilling):
                if lv.state != PREFILL:
                    continue  # preempted by an older one
                seq = lv.seq
                rank = _rank_of(lv)
                b = budget[rank]
                if b <= 0:
                    continue
                computed = seq.num_computed_tokens
                end = self._chunk_end(lv, computed, b)
                if end > lv.cap:
                    ok = True
                    while not pool.allocate(seq, end):
                        preempted = True
                        if not self._preempt_for(lv, rank, step):
                            ok = False
                            break
                    if not ok:
                        continue
                    lv.cap = -(-end // bs) * bs
                budget[rank] -= end - computed
                scheduled.append((lv, computed, end))
            # 4. admission
            if not preempted and self.waiting:
                self._admit(step, budget, scheduled)
        if self.linear:
            plan = pool.take_linear_state_plan()
            self.ckpt_saves += len(plan.save_src)
            if self.executor is not None:
                self.executor.linear_state(plan)
            pool.commit_linear_state_plan(plan)
        # a member whose computed tokens reach a block boundary publishes it and needs a new block
        crossing = self.dec_residue[-step % bs] > 0
        t1 = time.perf_counter_ns()
        # 5. the forward pass
        if self.executor is not None:
            items = [(lv, len(lv.seq) - 1, len(lv.seq)) for lv in self.dec] + scheduled
            if items:
                self.executor.forward(self, items)
        dt, n_decoded = self._step_time(step, scheduled)
        t2 = time.perf_counter_ns()
        end_s = self.now_s + dt
        if scheduled or self.finishing.get(step):
            touched = True
            batched = self._after_forward(step, scheduled, end_s)
        else:  # the common step: every member decodes, none finishes
            batched = n_decoded
            self.decode_tokens += n_decoded
            if n_decoded:
                failed = pool.advance(self.batch, self._decode_tokens(step), lookahead=0) if not self.hier else \
                    self._advance_each(list(self.batch), self._decode_tokens(step))
                if failed:
                    self.need_room.extend(self.dec[i] for i in failed)
        t3 = time.perf_counter_ns()
        sched = (t1 - t0) + (t3 - t2)
        self.sched_ns.append(sched)
        self.now_s = end_s
        self.busy_s += dt
        self.step_s.append(dt)
        self.step_decodes.append(n_decoded)
        # metrics (not counted as scheduler overhead)
        st = self._stats
        if touched or crossing or st is None or cfg.check:
            st = self._stats = pool.stats()
        usage = float(st["usage"])
        self.usage_sum += usage
        if usage > self.peak_usage:
            self.peak_usage = usage
        used = int(st["num_used_blocks"])
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
        q = st.get("prefix_query_tokens", 0)
        mapped_gib = limit_gib = 0.0
        if self.mapped is not None:
            self.mapped.record(st, end_s)
            mapped_gib, limit_gib = self.mapped.now_bytes / GIB, self.mapped.limit_bytes / GIB
        self.timeline.append(StepRecord(
            step, usage, used, int(st["num_cached_blocks"]), len(self.running), len(self.waiting), batched,
            (st.get("prefix_hit_tokens", 0) / q) if q else 0.0, sched / 1e3, end_s, dt, mapped_gib, limit_gib))
        if cfg.check:
            self._check(st)
        if not batched and not self.running and self.waiting and not self._arrival_ahead(step):
            self.stall_steps += 1
            if self.stall_steps > 3:
                lv = self.waiting[0]
                limit = ""
                if self.mapped is not None:
                    limit = f", a memory limit of {self.mapped.limit_bytes / GIB:g} GiB over all ranks"
                raise SimError(
                    f"request {lv.req.request_id} ({lv.prompt_len + lv.generated} tokens) cannot be admitted "
                    f"into an idle pool (stats: {_brief(st)}{limit}): the configuration cannot serve it")
        else:
            self.stall_steps = 0
        self.step_no += 1
        if self.on_step is not None:
            self.on_step(self)

    def _arrival_ahead(self, step: int) -> bool:
        if not self.pending:
            return False
        if self.seconds_clock:
            return self.pending[0].arrival_s > self.now_s
        return self.pending[0].arrival > step

    def _admit(self, step: int, budget: list[int], scheduled: list[tuple[_Live, int, int]]) -> None:
        cfg = self.cfg
        pool = self.pool
        bs = cfg.block_size
        max_seqs = cfg.max_num_seqs * cfg.dp_size
        waiting = self.waiting
        running = self.running
        while waiting and len(running) < max_seqs:
            top = max(budget)
            if top <= 0:
                break
            lv = waiting[0]
            seq = lv.seq if lv.seq is not None else self._make_seq(lv)
            L = len(seq)
            first = min(L, top)
            # Plan once (one walk of the chain per tier), then allocate with the plan.
            plan = pool.plan(seq, first)
            if plan is None:
                break
            if not pool.allocate(seq, first, plan=plan):
                if cfg.check:
                    raise AssertionError("plan said yes but allocate failed (R15)")
                break
            waiting.popleft()
            if self.hier:
                self._sync_loads()
            rank = _rank_of(lv)
            cached = seq.num_cached_tokens
            self.admissions += 1
            self.admit_tokens += L
            self.admit_cached += cached
            if self.linear and seq.linear_state_restore_slot is not None:
                self.ckpt_restores += 1
            if lv.first_admit_step < 0:
                lv.first_admit_step = step
                lv.first_cached = cached
            lv.admitted_step = step
            lv.boundary = (lv.prompt_len // bs) * bs
            lv.cap = max(first, seq.num_blocks * bs)
            lv.state = PREFILL
            running.append(lv)
            self.prefilling.append(lv)
            computed = seq.num_computed_tokens
            b = budget[rank]
            if b <= 0 or computed >= L:
                continue
            end = self._chunk_end(lv, computed, b)
            if end > lv.cap:
                if pool.allocate(seq, end):
                    lv.cap = -(-end // bs) * bs
                else:
                    end = min(end, lv.cap)
            if end > computed:
                budget[rank] -= end - computed
                scheduled.append((lv, computed, end))

    def _step_time(self, step: int, scheduled: list[tuple[_Live, int, int]]) -> tuple[float, int]:
        """Seconds of this step (the slowest rank) and the number of decodes in it."""
        dp = self.cfg.dp_size
        # a member decodes position len - 1 (len = prompt_len + step - off) and reads what precedes it
        if dp == 1 and not scheduled:
            c = self.dec_count[0]
            t = self.dec_len_sum[0] + c * step
            return self.timer.seconds_of(c, t, t - c), c
        work = [StepWork() for _ in range(dp)]
        for r, w in enumerate(work):
            c = self.dec_count[r]
            if c:
                t = self.dec_len_sum[r] + c * step
                w.tokens, w.attended, w.kv_read = c, t, t - c
        for lv, start, end in scheduled:
            work[lv.seq.dp_rank].add(start, end)
        seconds = self.timer.seconds
        return (seconds(work[0]) if dp == 1 else max(seconds(w) for w in work)), len(self.dec)

    def _after_forward(self, step: int, scheduled: list[tuple[_Live, int, int]], end_s: float) -> int:
        pool = self.pool
        bs = self.cfg.block_size
        batched = 0
        done: list[_Live] = []
        joining: list[_Live] = []
        # prefill chunks: computed tokens, publication, the first sampled token
        for lv, start, end in scheduled:
            seq = lv.seq
            seq.num_computed_tokens = end
            batched += end - start
            # classify the computed tokens: recomputed (lost to a preemption), prompt, output
            rec = max(0, min(end, lv.lost) - start)
            lo = max(start, lv.lost)
            pre = max(0, min(end, lv.prompt_len) - lo) if end > lo else 0
            self.recompute_tokens += rec
            self.prefill_tokens += pre
            self.decode_tokens += end - start - rec - pre
            if end // bs > start // bs or self.linear:
                pool.cache(seq)
            if end == len(seq):
                if lv.first_token_step < 0:
                    lv.first_token_step = step
                    lv.first_token_s = end_s
                lv.generated += 1
                self.prefilling.remove(lv)
                if lv.generated >= lv.req.output_len:
                    done.append(lv)
                else:
                    joining.append(lv)
        # decoders: those sampling their last token finish, the others advance in one call
        n_dec = len(self.dec)
        if n_dec:
            batched += n_dec
            self.decode_tokens += n_dec
            # entries left by preempted members are stale (their finish_at moved on): skip them
            fin = list({id(lv): lv for lv in self.finishing.pop(step, ())
                        if lv.state == DECODE and lv.finish_at == step}.values())
            if fin:
                self._leave_decode(fin, step + 1)
                for lv in fin:
                    lv.seq.num_computed_tokens = len(lv.seq)
                done.extend(fin)
        if done:
            dset = {id(x) for x in done}
            self.running = [x for x in self.running if id(x) not in dset]
            for lv in done:
                lv.finish_step = step
                lv.finish_s = end_s
                lv.state = DONE
                self._release(lv)
                lv.seq = None
                self.finished.append(lv)
        if n_dec and self.dec:  # every member decoded: the batch advances in one call
            tokens = self._decode_tokens(step)
            failed = self._advance_each(list(self.batch), tokens) if self.hier else pool.advance(
                self.batch, tokens, lookahead=0)
            if failed:
                self.need_room.extend(self.dec[i] for i in failed)
        for lv in joining:
            lv.seq.append_token(lv.token(lv.generated - 1))
            if not pool.may_append(lv.seq):
                self.need_room.append(lv)
            self._join_decode(lv, step)
        return batched

    def _check(self, st: dict[str, Any]) -> None:
        self.pool.check()
        cfg = self.cfg
        total = st["num_free_blocks"] + st["num_cached_blocks"] + st["num_used_blocks"]
        assert total == st["num_total_blocks"], f"R2 broken: {st}"
        assert st["num_total_blocks"] == cfg.dp_size * (cfg.num_blocks - 1), st
        # every running sequence is in exactly one of the decode batch and the prefill list
        self.batch.check()
        assert len(self.batch) == len(self.dec) == len(self.dec_cols), "decode batch and its rows disagree"
        assert self.dec_tok == [tuple(int(x) for x in r[[_SHIFT, _LOW, _SPAN]]) for r in self.dec_cols]
        assert [int(x) for x in self.batch.seq_ids] == [int(lv.req.request_id) for lv in self.dec]
        states = {id(lv): lv.state for lv in self.running}
        assert len(states) == len(self.running) == len(self.dec) + len(self.prefilling), "running lists disagree"
        assert all(states.get(id(lv)) == DECODE for lv in self.dec)
        assert all(states.get(id(lv)) == PREFILL for lv in self.prefilling)
        assert self.dec_fixed == sum(1 for lv in self.dec if lv.req.output is not None)
        residues = [0] * cfg.block_size
        for lv in self.dec:
            residues[(lv.prompt_len - lv.off) % cfg.block_size] += 1
        assert residues == self.dec_residue, "residue counts drifted"
        for lv in self.dec:
            assert lv in self.finishing.get(lv.finish_at, ()), "a member is missing from the finishing index"
        for r in range(cfg.dp_size):
            # decoders joined only through prefill chunks that fit the budget: never more than it
            assert self.dec_count[r] <= cfg.max_num_batched_tokens, "more decoders than the token budget"
            mine = self.dec_cols[self.dec_cols[:, _RANK] == r]
            assert self.dec_count[r] == len(mine), "per-rank decode count drifted"
            assert self.dec_len_sum[r] == int((mine[:, _PLEN] - mine[:, _OFF]).sum()), "per-rank length sum drifted"
        rooms = {id(lv) for lv in self.need_room}
        for i, lv in enumerate(self.dec):
            seq = lv.seq
            g = self.step_no + 1 - lv.off
            assert len(seq) == lv.prompt_len + g and self.dec_cols[i, _OFF] == lv.off, "decode position drifted"
            assert seq.num_computed_tokens == len(seq) - 1, "a decoder must have exactly one token to compute"
            if id(lv) not in rooms:
                assert len(seq.block_table) * cfg.block_size >= len(seq), "a decoder lacks the slot of its token"
        for lv in self.running:
            seq = lv.seq
            assert seq.num_computed_tokens <= len(seq), "computed > len"
            assert len(seq.block_table) * cfg.block_size >= seq.num_computed_tokens, "table shorter than computed"
            assert seq.dp_rank is not None and 0 <= seq.dp_rank < cfg.dp_size
        for lv in self.waiting:
            assert lv.seq is None or len(lv.seq.block_table) == 0, "a waiting (preempted) sequence still holds blocks"
        if cfg.sliding_window is None and not self.hier:
            # shared blocks count once in the pool and once per holder here
            distinct = len({(lv.seq.dp_rank, int(b)) for lv in self.running for b in lv.seq.block_table if b})
            assert distinct == st["num_used_blocks"], f"used blocks {st['num_used_blocks']} != held {distinct}"

    # ------------------------------------------------------------------ driver
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def run(self) -> SimResult:
        if self.cfg.order == "request":
            return self.run_request_order()
        t0 = time.perf_counter()
        max_steps = self.cfg.max_steps
        while not self.done():
            if max_steps is not None and self.step_no >= max_steps:
                break
            if not self.running and not self.waiting and self.pending:
                # idle: jump to the next arrival
                if self.seconds_clock:
                    self.now_s = max(self.now_s, float(self.pending[0].arrival_s))
                else:
                    nxt = int(math.ceil(self.pending[0].arrival))
                    if nxt > self.step_no:
                        self.now_s += (nxt - self.step_no) * self.cfg.step_ms / 1000.0
                        self.step_no = nxt
            self.step()
        wall = time.perf_counter() - t0
        if self.cfg.check and self.done():
            st = self.pool.stats()
            assert st["num_used_blocks"] == 0, f"blocks leaked after the run: {st}"
            self.pool.check()
        return SimResult(self.config_dict(), self.summary(wall), self.timeline)

    def run_request_order(self) -> SimResult:
        """The paper-style analysis: each request's prompt alone, in arrival order.

        Per request: ``allocate`` the whole prompt (the prefix match), mark it computed,
        ``deallocate`` (publishes its full blocks, releases the rest). The step-time model gives
        the prefill time of the tokens not found in the cache; nothing is decoded.
        """
        t0 = time.perf_counter()
        pool = self.pool
        timer = self.timer
        max_steps = self.cfg.max_steps
        for i, req in enumerate(self.requests):
            if max_steps is not None and i >= max_steps:
                break
            self.pending.popleft()
            lv = _Live(req, float(req.arrival_s) if req.arrival_s is not None else 0.0, i)
            self.now_s = max(self.now_s, lv.arrival_s)
            if self.mapped is not None:
                self.mapped.apply_due(self.now_s)
            seq = self._make_seq(lv)
            if not pool.allocate(seq):
                limit = " under the memory limit" if self.mapped is not None else ""
                raise SimError(f"request {req.request_id} ({len(seq)} tokens) does not fit the cache{limit}")
            if self.hier:
                self._sync_loads()
            L = len(seq)
            cached = seq.num_cached_tokens
            self.admissions += 1
            self.admit_tokens += L
            self.admit_cached += cached
            self.prefill_tokens += L - cached
            lv.first_cached = cached
            seq.num_computed_tokens = L
            dt = timer.seconds(chunk_work(cached, L))
            self.busy_s += dt
            self.step_s.append(dt)
            st = pool.stats()
            used = int(st["num_used_blocks"])
            self.peak_used_blocks = max(self.peak_used_blocks, used)
            usage = float(st["usage"])
            self.peak_usage = max(self.peak_usage, usage)
            self.usage_sum += usage
            self._release(lv)
            if self.mapped is not None:
                self.mapped.record(pool.stats(), lv.arrival_s + dt)
            lv.seq = None
            lv.state = DONE
            lv.first_token_step = lv.finish_step = i
            lv.first_token_s = lv.finish_s = lv.arrival_s + dt
            self.finished.append(lv)
            self.step_no = i + 1
            if self.on_step is not None:
                self.on_step(self)
        self.now_s = max((lv.finish_s for lv in self.finished), default=self.now_s)
        wall = time.perf_counter() - t0
        if self.cfg.check:
            st = pool.stats()
            assert st["num_used_blocks"] == 0, f"blocks leaked after the run: {st}"
            pool.check()
        return SimResult(self.config_dict(), self.summary(wall), self.timeline)

    def config_dict(self) -> dict[str, Any]:
        d = asdict(self.cfg)
        d.pop("check", None)
        d.pop("model_shape", None)
        d["capacity_tokens_per_rank"] = (self.cfg.num_blocks - 1) * self.cfg.block_size
        d["step_time"] = self.timer.describe()
        d["clock"] = "seconds" if self.seconds_clock else "steps"
        return d

    def summary(self, wall: float) -> dict[str, Any]:
        st = self.pool.stats()
        fin = self.finished
        request_order = self.cfg.order == "request"
        ns = np.asarray(self.sched_ns, dtype=np.float64) / 1e3
        arr_step = np.array([lv.arrive_step if self.seconds_clock else lv.req.arrival for lv in fin], dtype=np.float64)
        ttft = np.array([lv.first_token_step for lv in fin], dtype=np.float64) - arr_step
        e2e = np.array([lv.finish_step for lv in fin], dtype=np.float64) - arr_step + 1
        arr_s = np.array([lv.arrival_s for lv in fin], dtype=np.float64)
        ttft_s = np.array([lv.first_token_s for lv in fin], dtype=np.float64) - arr_s
        e2e_s = np.array([lv.finish_s for lv in fin], dtype=np.float64) - arr_s
        multi = [lv for lv in fin if lv.generated > 1]
        tpot = np.array([(lv.finish_s - lv.first_token_s) / (lv.generated - 1) for lv in multi], dtype=np.float64)
        # time between tokens over every decoded token: each step's duration, once per decode in it
        step_s = np.asarray(self.step_s, dtype=np.float64)
        dec_w = np.asarray(self.step_decodes, dtype=np.float64)
        q = int(st.get("prefix_query_tokens", 0))
        h = int(st.get("prefix_hit_tokens", 0))
        steps = len(self.timeline)
        tl_tokens = sum(r.batched_tokens for r in self.timeline)
        span = self.now_s - (min(arr_s) if len(arr_s) else 0.0)
        out_tokens = int(sum(lv.generated for lv in fin))
        # prompt tokens from the cache at each request's first admission (no preemption re-hits)
        first = np.array([max(lv.first_cached, 0) for lv in fin], dtype=np.float64)
        plen = np.array([lv.prompt_len for lv in fin], dtype=np.float64)
        computed = self.prefill_tokens + self.decode_tokens + self.recompute_tokens

        def pct(a: np.ndarray, p: float) -> float:
            return float(np.percentile(a, p)) if len(a) else 0.0

        def mean(a: np.ndarray) -> float:
            return float(a.mean()) if len(a) else 0.0

        out: dict[str, Any] = {
            "requests": len(self.requests),
            "finished": len(fin),
            "prompt_tokens": int(sum(r.prompt_len for r in self.requests)),
            "output_tokens": out_tokens,
            "steps": steps if not request_order else len(fin),
            "prefill_tokens_computed": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "recomputed_tokens": self.recompute_tokens,
            "mean_batched_tokens": tl_tokens / steps if steps else 0.0,
            "mean_running": float(np.mean([r.running for r in self.timeline])) if steps else 0.0,
            "prefix_query_tokens": q,
            "prefix_hit_tokens": h,
            "prefix_hit_rate": h / q if q else 0.0,
            "admitted_tokens": self.admit_tokens,
            "admitted_cached_tokens": self.admit_cached,
            "cached_token_fraction": self.admit_cached / self.admit_tokens if self.admit_tokens else 0.0,
            "first_admission_cached_fraction": float(first.sum() / plen.sum()) if len(fin) else 0.0,
            "mean_request_cached_fraction": float((first / plen).mean()) if len(fin) else 0.0,
            "peak_usage": self.peak_usage,
            "mean_usage": self.usage_sum / max(steps if not request_order else len(fin), 1),
            "peak_used_blocks": self.peak_used_blocks,
            "num_total_blocks": int(st["num_total_blocks"]),
            "preemptions": self.preemptions,
            "preempted_requests": sum(1 for lv in fin if lv.preemptions) + sum(
                1 for lv in list(self.running) + list(self.waiting) if lv.preemptions),
            "evictions": int(st.get("num_evictions", 0)),
            "host_loads": self.host_loads,
            "host_offloads": self.host_offloads,
            **self._remote_summary(),
            "checkpoint_hits": self.ckpt_restores,
            "checkpoint_saves": self.ckpt_saves,
            "ttft_steps_mean": mean(ttft),
            "ttft_steps_p99": pct(ttft, 99),
            "e2e_steps_mean": mean(e2e),
            # time in seconds (the step-time model)
            "sim_time_s": float(self.now_s),
            "busy_s": float(self.busy_s),
            "ttft_s_mean": mean(ttft_s),
            "ttft_s_p50": pct(ttft_s, 50),
            "ttft_s_p99": pct(ttft_s, 99),
            "tpot_ms_mean": 1e3 * mean(tpot),
            "tbt_ms_mean": 1e3 * float((step_s * dec_w).sum() / dec_w.sum()) if dec_w.sum() else 0.0,
            "tbt_ms_p99": 1e3 * _weighted_percentile(step_s, dec_w, 99),
            "e2e_s_mean": mean(e2e_s),
            "output_tokens_per_s": out_tokens / span if span > 0 else 0.0,
            "computed_tokens_per_s": computed / self.busy_s if self.busy_s > 0 else 0.0,
            "prefill_s_mean": float(step_s.mean()) if request_order and len(step_s) else 0.0,
            "sched_us_per_step_mean": mean(ns),
            "sched_us_per_step_p50": pct(ns, 50),
            "sched_us_per_step_p99": pct(ns, 99),
            "sched_us_per_request": float(ns.sum() / len(fin)) if fin else 0.0,
            "wall_s": wall,
        }
        if self.trace_read_s is not None:
            out["trace_read_s"] = self.trace_read_s
        if self.mapped is not None:
            out.update(self.mapped.summary(st, self.now_s))
        sessions = [lv for lv in fin if lv.req.session is not None]
        if sessions:
            first = [lv for lv in sessions if lv.req.session.parent_chat_id < 0]
            follow = [lv for lv in sessions if lv.req.session.parent_chat_id >= 0]

            def hit(group: list[_Live]) -> float:
                n = sum(lv.prompt_len for lv in group)
                return sum(max(lv.first_cached, 0) for lv in group) / n if n else 0.0

            out.update({"sessions": len(first), "follow_up_turns": len(follow),
                        "max_turn": max(lv.req.session.turn for lv in sessions),
                        "first_turn_hit_rate": hit(first), "follow_up_hit_rate": hit(follow)})
        return out


def _weighted_percentile(values: np.ndarray, weights: np.ndarray, p: float) -> float:
    """The ``p``-th percentile of ``values`` each counted ``weights`` times (0 if none)."""
    if not len(values) or not weights.sum():
        return 0.0
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    i = int(np.searchsorted(cum, p / 100.0 * cum[-1], side="left"))
    return float(values[order][min(i, len(values) - 1)])


class _SimBlocks:
    """``kvpool.tiers.remote_transfer.HostBlockIO`` of a simulation without KV data: a block's body is a
    fixed 64-byte stand-in (the header and checksum are still real and verified)."""

    def host_block_spec(self, rank: int) -> str:
        return "sim:64"

    def read_host_blocks(self, rank: int, ids: Sequence[int]) -> list[bytes]:
        return [b"\x00" * 64 for _ in ids]

    def write_host_blocks(self, rank: int, ids: Sequence[int], bodies: Sequence[Any]) -> None:
        pass


def _brief(st: dict[str, Any]) -> str:
    return ", ".join(f"{k}={st[k]}" for k in ("num_total_blocks", "num_free_blocks", "num_cached_blocks",
                                               "num_used_blocks") if k in st)


def run_simulation(cfg: SimConfig, requests: Sequence[Request], **kw: Any) -> SimResult:
    return Simulator(cfg, requests, **kw).run()
