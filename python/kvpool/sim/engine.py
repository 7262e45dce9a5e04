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

``order="request"`` replaces the loop by the paper-style analysis (``kvpool.sim.request_order``):
requests one at a time in arrival order, each prompt allocated whole (prefix match), computed and
released; no batching, no decode.

The decode batch is ``kvpool.sim.decode.DecodeBatch``; a run's summary is
``kvpool.sim.summary``'s; the configuration and the pool it makes are ``kvpool.sim.config``'s.

Scheduler overhead is the wall time of phases 1-4 plus the bookkeeping of phase 5: the part
of an engine step that is the scheduler's, pool calls included, the forward excluded.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import kvpool
from kvpool.sim.config import ORDERS, SimConfig, SimError, UnavailableError, check_fits, make_pool
from kvpool.sim.decode import DecodeBatch
from kvpool.sim.elastic import GIB, MappedMemory
from kvpool.sim.live import DECODE, DONE, PREFILL, WAITING, Live
from kvpool.sim.request import Request
from kvpool.sim.request_order import run_request_order
from kvpool.sim.summary import SimResult, StepRecord, summarize
from kvpool.sim.timing import StepWork

__all__ = [
    "ORDERS",
    "SimConfig",
    "SimError",
    "SimResult",
    "Simulator",
    "StepRecord",
    "UnavailableError",
    "arrival_seconds",
    "check_fits",
    "run_simulation",
]

Chunk = tuple[Live, int, int]  # a prefill chunk scheduled this step: (request, start, end)


def arrival_seconds(req: Request) -> float:
    """``req.arrival_s`` on the seconds clock, where every request has one."""
    return float(req.arrival_s)  # type: ignore[arg-type]


class Simulator:
    """Replays ``requests`` through a pool configured by ``cfg``; see the module docstring.

    ``executor`` (optional) is called once per step with the list of scheduled
    ``(live, start, end)`` chunks before the computed tokens advance (the data plane);
    ``on_step`` is called after every step with the simulator (progress bars).
    """

    def __init__(
        self,
        cfg: SimConfig,
        requests: Sequence[Request],
        *,
        executor: Any = None,
        on_step: Callable[[Simulator], None] | None = None,
        remote_tier: Any = None,
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.timer = cfg.step_timer()
        self.pool = make_pool(cfg, remote_tier)
        self.mapped: MappedMemory | None = None
        if cfg.xtensor is not None:
            self.mapped = MappedMemory(self.pool, cfg.memory_limit_schedule)
        self.hier = bool(cfg.host_num_blocks)
        self.remote: Any = None
        if cfg.remote is not None:
            from kvpool.tiers.remote_transfer import RemoteTransfer  # xxhash: kvpool[remote]

            self.remote = RemoteTransfer(self.pool, _SimBlocks())
        self.linear = bool(cfg.linear_state_slots)
        self.requests = sorted(requests, key=lambda r: (r.arrival, r.request_id))
        # the trace's clock when every request has one, else the step count
        self.seconds_clock = bool(self.requests) and all(
            r.arrival_s is not None for r in self.requests
        )
        if self.seconds_clock:
            self.requests.sort(key=lambda r: (r.arrival_s, r.request_id))
        check_fits(self.cfg, self.requests)
        self.executor = executor
        self.on_step = on_step
        self.pending: deque[Request] = deque(self.requests)
        self.waiting: deque[Live] = deque()
        self.running: list[Live] = []  # admission order (the newest is preempted first)
        self.prefilling: list[Live] = []  # running, in prefill; admission order
        self.decode = DecodeBatch(cfg.dp_size, cfg.block_size)  # running, decoding
        self._stats: dict[str, Any] | None = None  # the pool's stats, while nothing changed them
        self.need_room: list[Live] = []  # members that advanced but got no slot for their token
        self.finished: list[Live] = []
        self.step_no = 0
        self.now_s = 0.0
        # session hints (retain_ttl_s): the finished turn's chat id -> its sequence id
        self.hints: dict[int, int] = {}
        self.retained = 0
        self.retain_refused = 0
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

    def make_seq(self, lv: Live) -> Any:
        """The pool sequence of ``lv``'s request (kept in ``lv.seq``)."""
        req = lv.req
        lv.seq = kvpool.Sequence(
            req.prompt_tokens(), seq_id=int(req.request_id), extra_key=req.extra_key
        )
        return lv.seq

    # ------------------------------------------------------------------ tiers / plans
    def sync_loads(self) -> None:
        """Runs the remote fetches and the host loads the last allocation planned."""
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

    def _retain(self, lv: Live, now_s: float) -> None:
        """A finished turn of a session: a session hint keeps its prefix until the next turn
        arrives or ``retain_ttl_s`` runs out (docs/sessions.md)."""
        ttl = self.cfg.retain_ttl_s
        if ttl is None or lv.req.session is None:
            return
        if self.pool.retain(lv.seq, ttl, now_s):
            self.hints[lv.req.session.chat_id] = lv.seq.seq_id
            self.retained += 1
        else:
            self.retain_refused += 1

    def release(self, lv: Live) -> None:
        """Deallocates ``lv``'s sequence (and runs the offloads that planned)."""
        self.pool.deallocate(lv.seq)
        lv.cap = 0
        if self.hier:
            self._sync_offloads()

    # ------------------------------------------------------------------ scheduling
    def _preempt_for(self, lv: Live, rank: int, step: int) -> bool:
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
            self.decode.leave([v], step)
        else:
            self.prefilling.remove(v)
        v.lost = max(v.lost, v.seq.num_computed_tokens)
        self.release(v)
        v.state = WAITING
        v.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(v)
        return v is not lv

    def _chunk_end(self, lv: Live, computed: int, budget: int) -> int:
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
            while pending and arrival_seconds(pending[0]) <= now:
                r = pending.popleft()
                self.waiting.append(Live(r, arrival_seconds(r), step))
        else:
            while pending and pending[0].arrival <= step:
                self.waiting.append(Live(pending.popleft(), self.now_s, step))

    def step(self) -> None:
        """One engine step: the module doc's phases 1 to 5, then the step's metrics."""
        t0 = time.perf_counter_ns()
        step = self.step_no
        # 1. arrivals
        pending = self.pending
        if pending and (
            arrival_seconds(pending[0]) <= self.now_s
            if self.seconds_clock
            else pending[0].arrival <= step
        ):
            self._arrivals(step)
        preempted = False
        # whether a pool call other than the decode batch's advance ran (the counts may change)
        touched = self.linear
        if self.hints:
            self.pool.expire_retained(self.now_s)
        if self.mapped is not None and self.mapped.due(self.now_s):
            # a co-located tenant squeezes (or frees) memory
            touched = self.mapped.apply_due(self.now_s) or touched
        # 2. decodes: room for those that advanced without it (their budget is taken in 3)
        if self.need_room:
            touched = True
            preempted = self._make_room(step)
        # 3. prefill chunks, oldest first; 4. admission
        scheduled: list[Chunk] = []
        if self.prefilling or self.waiting:
            touched = True
            self._schedule(step, preempted, scheduled)
        if self.linear:
            self._linear_state_plan()
        crossing = self.decode.crossing(step)
        t1 = time.perf_counter_ns()
        # 5. the forward pass
        if self.executor is not None:
            items = [(lv, len(lv.seq) - 1, len(lv.seq)) for lv in self.decode.members] + scheduled
            if items:
                self.executor.forward(self, items)
        dt, n_decoded = self._step_time(step, scheduled)
        t2 = time.perf_counter_ns()
        end_s = self.now_s + dt
        if scheduled or self.decode.finishing.get(step):
            touched = True
            batched = self._after_forward(step, scheduled, end_s)
        else:  # the common step: every member decodes, none finishes
            batched = n_decoded
            self.decode_tokens += n_decoded
            if n_decoded:
                self.need_room.extend(self.decode.advance(self.pool, step))
        t3 = time.perf_counter_ns()
        sched = (t1 - t0) + (t3 - t2)
        self.sched_ns.append(sched)
        self.now_s = end_s
        self.busy_s += dt
        self.step_s.append(dt)
        self.step_decodes.append(n_decoded)
        self._record(step, touched or crossing, batched, sched, dt, end_s)
        self.step_no += 1
        if self.on_step is not None:
            self.on_step(self)

    def _make_room(self, step: int) -> bool:
        """A slot for every member that advanced without one, preempting the newest sequence
        of its rank while there is none. Returns whether anything was preempted."""
        preempted = False
        for lv in self.need_room:
            if lv.state != DECODE:
                continue  # preempted meanwhile
            rank = lv.rank
            while not self.pool.may_append(lv.seq):
                preempted = True
                if not self._preempt_for(lv, rank, step):
                    break
        self.need_room = []
        return preempted

    def _schedule(self, step: int, preempted: bool, scheduled: list[Chunk]) -> None:
        """Prefill chunks of running sequences, oldest first, in what the decodes leave of each
        rank's budget (preempting for room); then, if nothing was preempted, admissions."""
        pool = self.pool
        bs = self.cfg.block_size
        B = self.cfg.max_num_batched_tokens
        budget = [B - min(c, B) for c in self.decode.count]
        for lv in list(self.prefilling):
            if lv.state != PREFILL:
                continue  # preempted by an older one
            seq = lv.seq
            rank = lv.rank
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
        if not preempted and self.waiting:
            self._admit(step, budget, scheduled)

    def _linear_state_plan(self) -> None:
        """The checkpoint saves of the step (R24): the executor copies them, the pool commits."""
        plan = self.pool.take_linear_state_plan()
        self.ckpt_saves += len(plan.save_src)
        if self.executor is not None:
            self.executor.linear_state(plan)
        self.pool.commit_linear_state_plan(plan)

    def _record(
        self, step: int, changed: bool, batched: int, sched: int, dt: float, end_s: float
    ) -> None:
        """The step's metrics (not counted as scheduler overhead), the test-mode checks, and the
        stall guard. ``changed``: the pool's counts may have changed since the last stats."""
        cfg = self.cfg
        st = self._stats
        if changed or st is None or cfg.check:
            st = self._stats = self.pool.stats()
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
        self.timeline.append(
            StepRecord(
                step,
                usage,
                used,
                int(st["num_cached_blocks"]),
                len(self.running),
                len(self.waiting),
                batched,
                (st.get("prefix_hit_tokens", 0) / q) if q else 0.0,
                sched / 1e3,
                end_s,
                dt,
                mapped_gib,
                limit_gib,
            )
        )
        if cfg.check:
            self._check(st)
        if not batched and not self.running and self.waiting and not self._arrival_ahead(step):
            self.stall_steps += 1
            if self.stall_steps > 3:
                lv = self.waiting[0]
                limit = ""
                if self.mapped is not None:
                    limit = (
                        f", a memory limit of {self.mapped.limit_bytes / GIB:g} GiB over all ranks"
                    )
                raise SimError(
                    f"request {lv.req.request_id} ({lv.prompt_len + lv.generated} tokens) cannot "
                    f"be admitted into an idle pool (stats: {_brief(st)}{limit}): the "
                    "configuration cannot serve it"
                )
        else:
            self.stall_steps = 0

    def _arrival_ahead(self, step: int) -> bool:
        if not self.pending:
            return False
        if self.seconds_clock:
            return arrival_seconds(self.pending[0]) > self.now_s
        return self.pending[0].arrival > step

    def _admit(self, step: int, budget: list[int], scheduled: list[Chunk]) -> None:
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
            seq = lv.seq if lv.seq is not None else self.make_seq(lv)
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
            if self.hints and lv.req.session is not None:  # the session came back
                hint = self.hints.pop(lv.req.session.parent_chat_id, None)
                if hint is not None:
                    pool.release_retained(hint)
            if self.hier:
                self.sync_loads()
            rank = lv.rank
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

    def _step_time(self, step: int, scheduled: list[Chunk]) -> tuple[float, int]:
        """Seconds of this step (the slowest rank) and the number of decodes in it."""
        dp = self.cfg.dp_size
        # a member decodes position len - 1 (len = prompt_len + step - off), reads what precedes it
        if dp == 1 and not scheduled:
            c = self.decode.count[0]
            t = self.decode.len_sum[0] + c * step
            return self.timer.seconds_of(c, t, t - c), c
        work = [StepWork() for _ in range(dp)]
        for r, w in enumerate(work):
            c = self.decode.count[r]
            if c:
                t = self.decode.len_sum[r] + c * step
                w.tokens, w.attended, w.kv_read = c, t, t - c
        for lv, start, end in scheduled:
            work[lv.seq.dp_rank].add(start, end)
        seconds = self.timer.seconds
        return (seconds(work[0]) if dp == 1 else max(seconds(w) for w in work)), len(self.decode)

    def _after_forward(self, step: int, scheduled: list[Chunk], end_s: float) -> int:
        pool = self.pool
        bs = self.cfg.block_size
        batched = 0
        done: list[Live] = []
        joining: list[Live] = []
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
        n_dec = len(self.decode)
        if n_dec:
            batched += n_dec
            self.decode_tokens += n_dec
            # entries left by preempted members are stale (their finish_at moved on): skip them
            fin = self.decode.finishing_at(step)
            if fin:
                self.decode.leave(fin, step + 1)
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
                self._retain(lv, end_s)
                self.release(lv)
                lv.seq = None
                self.finished.append(lv)
        if n_dec and len(self.decode):  # every member decoded: the batch advances in one call
            self.need_room.extend(self.decode.advance(pool, step))
        for lv in joining:
            lv.seq.append_token(lv.token(lv.generated - 1))
            if not pool.may_append(lv.seq):
                self.need_room.append(lv)
            self.decode.join(lv, step)
        return batched

    def _check(self, st: dict[str, Any]) -> None:
        self.pool.check()
        cfg = self.cfg
        total = st["num_free_blocks"] + st["num_cached_blocks"] + st["num_used_blocks"]
        assert total == st["num_total_blocks"], f"R2 broken: {st}"
        assert st["num_total_blocks"] == cfg.dp_size * (cfg.num_blocks - 1), st
        # every running sequence is in exactly one of the decode batch and the prefill list
        dec = self.decode.members
        states = {id(lv): lv.state for lv in self.running}
        assert len(states) == len(self.running) == len(dec) + len(self.prefilling), (
            "running lists disagree"
        )
        assert all(states.get(id(lv)) == DECODE for lv in dec)
        assert all(states.get(id(lv)) == PREFILL for lv in self.prefilling)
        self.decode.check(self.step_no, self.need_room, cfg.max_num_batched_tokens)
        for lv in self.running:
            seq = lv.seq
            assert seq.num_computed_tokens <= len(seq), "computed > len"
            assert len(seq.block_table) * cfg.block_size >= seq.num_computed_tokens, (
                "table shorter than computed"
            )
            assert seq.dp_rank is not None and 0 <= seq.dp_rank < cfg.dp_size
        for lv in self.waiting:
            assert lv.seq is None or len(lv.seq.block_table) == 0, (
                "a waiting (preempted) sequence still holds blocks"
            )
        if not cfg.has_window_groups and not self.hier:
            # shared blocks count once in the pool and once per holder here
            distinct = len(
                {(lv.seq.dp_rank, int(b)) for lv in self.running for b in lv.seq.block_table if b}
            )
            # the linear-state group's blocks of the one store are used by no table
            used = st["num_used_blocks"] - st["num_linear_state_blocks"]
            assert distinct == used, f"used blocks {used} != held {distinct}"

    # ------------------------------------------------------------------ driver
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def run(self) -> SimResult:
        if self.cfg.order == "request":
            return run_request_order(self)
        t0 = time.perf_counter()
        max_steps = self.cfg.max_steps
        while not self.done():
            if max_steps is not None and self.step_no >= max_steps:
                break
            if not self.running and not self.waiting and self.pending:
                # idle: jump to the next arrival
                if self.seconds_clock:
                    self.now_s = max(self.now_s, arrival_seconds(self.pending[0]))
                else:
                    nxt = int(math.ceil(self.pending[0].arrival))
                    if nxt > self.step_no:
                        self.now_s += (nxt - self.step_no) * self.cfg.step_ms / 1000.0
                        self.step_no = nxt
            self.step()
        wall = time.perf_counter() - t0
        if self.cfg.check and self.done():
            st = self.pool.stats()
            # the linear-state group's blocks of the one store are all a finished run holds
            held = st["num_used_blocks"] - st["num_linear_state_blocks"]
            assert held == 0, f"blocks leaked after the run: {st}"
            self.pool.check()
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
        """The run's summary (``kvpool.sim.summary.summarize``)."""
        return summarize(self, wall)


class _SimBlocks:
    """``kvpool.tiers.remote_transfer.HostBlockIO`` of a simulation without KV data: a block's body
    is a fixed 64-byte stand-in (the header and checksum are still real and verified)."""

    def host_block_spec(self, rank: int) -> str:
        return "sim:64"

    def read_host_blocks(self, rank: int, ids: Sequence[int]) -> list[bytes]:
        return [b"\x00" * 64 for _ in ids]

    def write_host_blocks(self, rank: int, ids: Sequence[int], bodies: Sequence[Any]) -> None:
        pass


def _brief(st: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={st[k]}"
        for k in ("num_total_blocks", "num_free_blocks", "num_cached_blocks", "num_used_blocks")
        if k in st
    )


def run_simulation(cfg: SimConfig, requests: Sequence[Request], **kw: Any) -> SimResult:
    return Simulator(cfg, requests, **kw).run()
