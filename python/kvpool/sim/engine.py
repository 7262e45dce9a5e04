"""The continuous-batching scheduler loop of ``kvpool simulate``, built on BlockManagerPool.

One call of :meth:`Simulator.step` is one engine step (one forward pass per dp rank):

1. arrivals whose step has come join the waiting queue (FIFO);
2. running sequences are scheduled oldest first, each taking up to the per-rank token
   budget: a decode step (``may_append``) or the next prefill chunk (``allocate`` with a
   larger ``num_tokens``). When a rank runs out of blocks, the newest running sequence of
   that rank is preempted (``deallocate``, back to the front of the waiting queue: it will
   recompute, re-hitting its own prefix if it is still cached) until the request fits, or
   the request itself is the newest;
3. if nothing was preempted, waiting requests are admitted in order while a rank has
   budget and ``can_allocate`` agrees (the first chunk; prefix hits are free);
4. the (simulated or executed) forward pass; then ``num_computed_tokens`` advances,
   ``cache`` publishes the blocks that became full, a sequence whose computed tokens
   reach its length samples a token (``append_token``) or finishes (``deallocate``).

Scheduler overhead is the wall time of phases 1-3 plus the bookkeeping of phase 4: the
part of an engine step that is the scheduler's, pool calls included, the forward excluded.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpool.sim.workloads import VOCAB_SIZE, Request

__all__ = ["SimConfig", "SimError", "Simulator", "UnavailableError", "run_simulation"]


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
    remote: str | None = None  # redis:// URL of a shared remote tier (needs the host tier)
    hash_seed: int | None = None
    check: bool = False  # test mode: pool.check() and accounting asserts every step
    max_steps: int | None = None
    seed: int = 0

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
        return kw

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


@dataclass
class _Live:
    """Scheduler-side state of one request."""

    req: Request
    seq: Any
    out: np.ndarray  # the tokens it will "sample"
    generated: int = 0
    cap: int = 0  # tokens the block table is known to hold
    boundary: int = 0  # last full-block boundary of the prompt at admission (linear state)
    admitted_step: int = -1
    first_admit_step: int = -1
    first_token_step: int = -1
    finish_step: int = -1
    preemptions: int = 0
    lost: int = 0  # computed tokens dropped by preemptions (recomputed on readmission)
    prompt_len: int = 0


@dataclass
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

    if not hasattr(kvpool, "BlockManagerPool") or not hasattr(kvpool, "Sequence"):
        raise UnavailableError(
            "kvpool.BlockManagerPool is not available in this kvpool build (the compiled core "
            "has no pool yet); rebuild with `make build`")
    return kvpool


def _feature_error(cfg: SimConfig, err: Exception) -> UnavailableError | None:
    msg = str(err)
    for opt, name in (("linear_state", "linear state (--linear-state-slots)"),
                      ("checkpoint_interval", "linear-state checkpoints (--checkpoint-interval)"),
                      ("sliding_window", "sliding window (--sliding-window)"),
                      ("swa_num_blocks", "sliding window (--swa-num-blocks)"),
                      ("hash_seed", "hash_seed"), ("dp_size", "dp ranks (--dp)")):
        if opt in msg:
            return UnavailableError(f"{name} is not available in this kvpool build ({msg})")
    return None


def make_pool(cfg: SimConfig) -> Any:
    kvpool = _import_kvpool()
    kw = cfg.pool_kwargs()
    try:
        if cfg.host_num_blocks:
            cls = getattr(kvpool, "HierarchyBlockManagerPool", None)
            if cls is None:
                raise UnavailableError(
                    "the host tier (--host-blocks, HierarchyBlockManagerPool) is not available in this kvpool build")
            if cfg.remote is not None:
                from kvpool.remote import RedisRemoteTier

                ns = f"kvpool-sim|bs{cfg.block_size}|seed{cfg.hash_seed}"
                kw["remote"] = RedisRemoteTier(cfg.remote, ns, timeout_ms=1000)
            return cls(cfg.num_blocks, cfg.host_num_blocks, cfg.block_size, **kw)
        return kvpool.BlockManagerPool(cfg.num_blocks, cfg.block_size, **kw)
    except TypeError as e:
        fe = _feature_error(cfg, e)
        if fe is not None:
            raise fe from None
        raise SimError(f"the pool rejected the configuration: {e}") from None
    except ValueError as e:
        if "not available" in str(e):
            raise UnavailableError(f"{e} (requested by the simulator options)") from None
        raise SimError(f"the pool rejected the configuration: {e}") from None


def _sample_tokens(req: Request) -> np.ndarray:
    if req.output is not None:
        out = np.asarray(req.output)
        if len(out) >= req.output_len:
            return out[: req.output_len]
    rng = np.random.default_rng([0x0A7, int(req.request_id) & 0xFFFFFFFF])
    return rng.integers(0, VOCAB_SIZE, size=req.output_len, dtype=np.int32)


class Simulator:
    """Replays ``requests`` through a pool configured by ``cfg``; see the module docstring.

    ``executor`` (optional) is called once per step with the list of scheduled
    ``(live, start, end)`` chunks before the computed tokens advance (the data plane);
    ``on_step`` is called after every step with the simulator (progress bars).
    """

    def __init__(self, cfg: SimConfig, requests: Sequence[Request], *, executor: Any = None,
                 on_step: Callable[[Simulator], None] | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.kvpool = _import_kvpool()
        self.pool = make_pool(cfg)
        self.hier = bool(cfg.host_num_blocks)
        self.remote: Any = None
        if cfg.remote is not None:
            from kvpool.remote import RemoteTransfer

            self.remote = RemoteTransfer(self.pool, _SimBlocks())
        self.linear = bool(cfg.linear_state_slots)
        if self.linear and not hasattr(self.pool, "take_linear_state_plan"):
            raise UnavailableError("linear state (take_linear_state_plan) is not available in this kvpool build")
        self.requests = sorted(requests, key=lambda r: (r.arrival, r.request_id))
        self._check_fits()
        self.executor = executor
        self.on_step = on_step
        self.pending: deque[Request] = deque(self.requests)
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.finished: list[_Live] = []
        self.step_no = 0
        self.timeline: list[StepRecord] = []
        self.sched_ns: list[int] = []
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
        self._seq_ids = 0

    # ------------------------------------------------------------------ setup
    def _check_fits(self) -> None:
        cfg = self.cfg
        per_rank = (cfg.num_blocks - 1) * cfg.block_size
        for r in self.requests:
            if r.output_len < 1:
                raise SimError(f"request {r.request_id}: output_len must be >= 1")
            # the last sampled token is never fed back: the KV peaks at prompt + output - 1
            need = len(r.prompt) + r.output_len - 1
            if need > per_rank:
                raise SimError(
                    f"request {r.request_id} needs {need} tokens of KV "
                    f"({math.ceil(need / cfg.block_size)} blocks of {cfg.block_size}) but the whole cache "
                    f"holds {per_rank} tokens per rank ({cfg.num_blocks - 1} usable blocks): raise "
                    f"--num-blocks / --gib or shorten the request")

    def _new_live(self, req: Request) -> _Live:
        prompt = req.prompt
        tokens = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
        seq = self.kvpool.Sequence(tokens, seq_id=int(req.request_id), extra_key=req.extra_key)
        return _Live(req=req, seq=seq, out=_sample_tokens(req), prompt_len=len(tokens))

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

    # ------------------------------------------------------------------ scheduling
    def _preempt_for(self, lv: _Live, rank: int, i: int) -> bool:
        """Preempt the newest running sequence on ``rank``. Returns False if that is ``lv``."""
        running = self.running
        for j in range(len(running) - 1, -1, -1):
            v = running[j]
            if v.seq.dp_rank == rank:
                break
        else:  # pragma: no cover - lv itself is running on rank
            return False
        del running[j]
        v.lost = max(v.lost, v.seq.num_computed_tokens)
        self._release(v)
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

    def step(self) -> None:
        cfg = self.cfg
        pool = self.pool
        bs = cfg.block_size
        t0 = time.perf_counter_ns()
        step = self.step_no
        # 1. arrivals
        pending = self.pending
        while pending and pending[0].arrival <= step:
            self.waiting.append(self._new_live(pending.popleft()))
        budget = [cfg.max_num_batched_tokens] * cfg.dp_size
        scheduled: list[tuple[_Live, int, int]] = []
        preempted = False
        # 2. running, oldest first
        running = self.running
        i = 0
        while i < len(running):
            lv = running[i]
            seq = lv.seq
            rank = seq.dp_rank
            b = budget[rank]
            if b <= 0:
                i += 1
                continue
            computed = seq.num_computed_tokens
            L = len(seq)
            if computed == L - 1 and lv.generated > 0:  # decode
                end = L
                while not pool.may_append(seq):
                    preempted = True
                    if not self._preempt_for(lv, rank, i):
                        end = -1
                        break
                if end < 0:
                    continue  # lv itself was preempted; running[i] is the next one
                lv.cap = max(lv.cap, L)
            else:  # next prefill chunk
                end = self._chunk_end(lv, computed, b)
                if end > lv.cap:
                    ok = True
                    while not pool.allocate(seq, end):
                        preempted = True
                        if not self._preempt_for(lv, rank, i):
                            ok = False
                            break
                    if not ok:
                        continue
                    lv.cap = -(-end // bs) * bs
            budget[rank] -= end - computed
            scheduled.append((lv, computed, end))
            i += 1
        # 3. admission
        if not preempted:
            max_seqs = cfg.max_num_seqs * cfg.dp_size
            waiting = self.waiting
            while waiting and len(running) < max_seqs:
                top = max(budget)
                if top <= 0:
                    break
                lv = waiting[0]
                seq = lv.seq
                L = len(seq)
                first = min(L, top)
                if not pool.can_allocate(seq, first):
                    break
                if not pool.allocate(seq, first):
                    if cfg.check:
                        raise AssertionError("can_allocate said yes but allocate failed (R15)")
                    break
                waiting.popleft()
                if self.hier:
                    self._sync_loads()
                rank = seq.dp_rank
                cached = seq.num_cached_tokens
                self.admissions += 1
                self.admit_tokens += L
                self.admit_cached += cached
                if self.linear and getattr(seq, "linear_state_restore_slot", None) is not None:
                    self.ckpt_restores += 1
                if lv.first_admit_step < 0:
                    lv.first_admit_step = step
                lv.admitted_step = step
                lv.boundary = (len(lv.req.prompt) // bs) * bs
                lv.cap = max(first, (len(seq.block_table)) * bs)
                running.append(lv)
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
        if self.linear:
            plan = pool.take_linear_state_plan()
            self.ckpt_saves += len(plan.save_src)
            if self.executor is not None:
                self.executor.linear_state(plan)
            pool.commit_linear_state_plan(plan)
        t1 = time.perf_counter_ns()
        # 4. forward
        if self.executor is not None and scheduled:
            self.executor.forward(self, scheduled)
        t2 = time.perf_counter_ns()
        batched = 0
        done: list[_Live] = []
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
                lv.generated += 1
                if lv.generated >= lv.req.output_len:
                    lv.finish_step = step
                    done.append(lv)
                else:
                    seq.append_token(int(lv.out[lv.generated - 1]))
        if done:
            dset = {id(x) for x in done}
            self.running = [x for x in self.running if id(x) not in dset]
            for lv in done:
                self._release(lv)
                self.finished.append(lv)
        t3 = time.perf_counter_ns()
        sched = (t1 - t0) + (t3 - t2)
        self.sched_ns.append(sched)
        # metrics (not counted as scheduler overhead)
        st = pool.stats()
        usage = float(st["usage"])
        self.usage_sum += usage
        if usage > self.peak_usage:
            self.peak_usage = usage
        if st["num_used_blocks"] > self.peak_used_blocks:
            self.peak_used_blocks = int(st["num_used_blocks"])
        q = st.get("prefix_query_tokens", 0)
        self.timeline.append(StepRecord(
            step, usage, int(st["num_used_blocks"]), int(st["num_cached_blocks"]), len(self.running),
            len(self.waiting), batched, (st.get("prefix_hit_tokens", 0) / q) if q else 0.0, sched / 1e3))
        if cfg.check:
            self._check(st, scheduled)
        if not scheduled and not self.running and self.waiting and not (pending and pending[0].arrival > step):
            self.stall_steps += 1
            if self.stall_steps > 3:
                lv = self.waiting[0]
                raise SimError(
                    f"request {lv.req.request_id} ({len(lv.seq)} tokens) cannot be admitted into an idle pool "
                    f"(stats: {_brief(st)}): the configuration cannot serve it")
        else:
            self.stall_steps = 0
        self.step_no += 1
        if self.on_step is not None:
            self.on_step(self)

    def _check(self, st: dict[str, Any], scheduled: list[tuple[_Live, int, int]]) -> None:
        self.pool.check()
        total = st["num_free_blocks"] + st["num_cached_blocks"] + st["num_used_blocks"]
        assert total == st["num_total_blocks"], f"R2 broken: {st}"
        assert st["num_total_blocks"] == self.cfg.dp_size * (self.cfg.num_blocks - 1), st
        held = 0
        for lv in self.running:
            seq = lv.seq
            table = seq.block_table
            held += int(np.count_nonzero(table))
            assert seq.num_computed_tokens <= len(seq), "computed > len"
            assert len(table) * self.cfg.block_size >= seq.num_computed_tokens, "table shorter than computed"
            assert seq.dp_rank is not None and 0 <= seq.dp_rank < self.cfg.dp_size
        for lv in self.waiting:
            assert len(lv.seq.block_table) == 0, "a waiting (preempted) sequence still holds blocks"
        if self.cfg.sliding_window is None and not self.hier:
            # shared blocks count once in the pool and once per holder here
            distinct = len({(lv.seq.dp_rank, int(b)) for lv in self.running for b in lv.seq.block_table if b})
            assert distinct == st["num_used_blocks"], f"used blocks {st['num_used_blocks']} != held {distinct}"
        del held, scheduled

    # ------------------------------------------------------------------ driver
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        max_steps = self.cfg.max_steps
        while not self.done():
            if max_steps is not None and self.step_no >= max_steps:
                break
            if not self.running and not self.waiting and self.pending:
                # idle: jump to the next arrival
                nxt = int(math.ceil(self.pending[0].arrival))
                if nxt > self.step_no:
                    self.step_no = nxt
            self.step()
        wall = time.perf_counter() - t0
        if self.cfg.check and self.done():
            st = self.pool.stats()
            assert st["num_used_blocks"] == 0, f"blocks leaked after the run: {st}"
            self.pool.check()
        return SimResult(self.config_dict(), self.summary(wall), self.timeline)

    def config_dict(self) -> dict[str, Any]:
        d = asdict(self.cfg)
        d.pop("check", None)
        d["capacity_tokens_per_rank"] = (self.cfg.num_blocks - 1) * self.cfg.block_size
        return d

    def summary(self, wall: float) -> dict[str, Any]:
        st = self.pool.stats()
        fin = self.finished
        ns = np.asarray(self.sched_ns, dtype=np.float64) / 1e3
        ttft = np.array([lv.first_token_step - lv.req.arrival for lv in fin]) if fin else np.zeros(0)
        e2e = np.array([lv.finish_step - lv.req.arrival + 1 for lv in fin]) if fin else np.zeros(0)
        q = int(st.get("prefix_query_tokens", 0))
        h = int(st.get("prefix_hit_tokens", 0))
        steps = len(self.timeline)
        tl_tokens = sum(r.batched_tokens for r in self.timeline)

        def pct(a: np.ndarray, p: float) -> float:
            return float(np.percentile(a, p)) if len(a) else 0.0

        out: dict[str, Any] = {
            "requests": len(self.requests),
            "finished": len(fin),
            "prompt_tokens": int(sum(len(r.prompt) for r in self.requests)),
            "output_tokens": int(sum(lv.generated for lv in fin)),
            "steps": steps,
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
            "peak_usage": self.peak_usage,
            "mean_usage": self.usage_sum / steps if steps else 0.0,
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
            "ttft_steps_mean": float(ttft.mean()) if len(ttft) else 0.0,
            "ttft_steps_p99": pct(ttft, 99),
            "e2e_steps_mean": float(e2e.mean()) if len(e2e) else 0.0,
            "sched_us_per_step_mean": float(ns.mean()) if len(ns) else 0.0,
            "sched_us_per_step_p50": pct(ns, 50),
            "sched_us_per_step_p99": pct(ns, 99),
            "sched_us_per_request": float(ns.sum() / len(fin)) if fin else 0.0,
            "wall_s": wall,
        }
        return out


class _SimBlocks:
    """``kvpool.remote.HostBlockIO`` of a simulation without KV data: a block's body is a
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
