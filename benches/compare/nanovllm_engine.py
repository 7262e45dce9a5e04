"""A nano-vllm-shaped engine loop for tests and benchmarks: sequence, scheduler, a fake model
runner with a KV tensor that is written and read back through the block tables, and a
multi-turn workload with shared system prompts.

Written for this repository from the description of nano-vllm's scheduler (research/peers.md
section 1.5: FIFO prefill first, only the first sequence of a batch chunked, prefill and decode
never mixed, recompute preemption from the back of the running queue, ``hash_blocks`` then
``num_cached_tokens += num_scheduled_tokens`` in postprocess); it is not nano-vllm's code. Any
object with nano-vllm's ``BlockManager`` interface plugs in: ``nanovllm_reference.BlockManager``
or ``kvpool.integrations.nanovllm.BlockManager``.

The fake model computes slots as nano-vllm's model runner does (``block_table[p // bs] * bs +
p % bs`` for the tokens of the step) and writes, per slot, a fingerprint of the sequence's own
prefix; with ``verify`` it reads every position the step attends to back through the table, so
a hit or a table entry holding someone else's KV fails loudly.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
_MASK = (1 << 61) - 1


class EngineSequence:
    """The fields of nano-vllm's ``Sequence`` that its scheduler and block manager read."""

    block_size = 256

    def __init__(self, seq_id: int, token_ids: list[int], max_tokens: int, conv: tuple[int, int]):
        self.seq_id = seq_id
        self.status = WAITING
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.is_prefill = True
        self.block_table: list[int] = []
        self.max_tokens = max_tokens
        self.ignore_eos = True
        self.conv = conv  # (conversation, turn)
        self.extra_key = None  # read by nanovllm_reference
        self._hit_block_ids: list[int] = []

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        bs = self.block_size
        return self.token_ids[i * bs : (i + 1) * bs]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


class Scheduler:
    """nano-vllm's scheduling policy over any block manager with its interface."""

    def __init__(self, block_manager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_manager.block_size
        self.waiting: deque[EngineSequence] = deque()
        self.running: deque[EngineSequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: EngineSequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def _schedule_prefill(self) -> list[EngineSequence]:
        bm, bs = self.block_manager, self.block_size
        batch: list[EngineSequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(batch) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            fresh = not seq.block_table
            if fresh:
                cached_blocks = bm.can_allocate(seq)
                if cached_blocks < 0:
                    break
                todo = seq.num_tokens - cached_blocks * bs
            else:  # a chunked prefill continues
                todo = seq.num_tokens - seq.num_cached_tokens
            if batch and todo > budget:
                break  # only the batch's first sequence may be chunked
            if fresh:
                bm.allocate(seq, cached_blocks)
            seq.num_scheduled_tokens = min(todo, budget)
            budget -= seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            batch.append(seq)
        return batch

    def _schedule_decode(self) -> list[EngineSequence]:
        bm = self.block_manager
        batch: list[EngineSequence] = []
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            preempted_self = False
            while not bm.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    preempted_self = True
                    break
            if preempted_self:
                continue
            seq.num_scheduled_tokens = 1
            seq.is_prefill = False
            bm.may_append(seq)
            batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch

    def schedule(self) -> tuple[list[EngineSequence], bool]:
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        batch = self._schedule_decode()
        assert batch, "nothing to run"
        return batch, False

    def preempt(self, seq: EngineSequence) -> None:
        self.num_preemptions += 1
        seq.status = WAITING
        seq.is_prefill = True
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs, token_ids, is_prefill: bool) -> list[EngineSequence]:
        """Publishes, advances and appends; returns the sequences that finished."""
        finished = []
        for seq, token in zip(seqs, token_ids, strict=True):
            self.block_manager.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if is_prefill and seq.num_cached_tokens < seq.num_tokens:
                continue  # a partial chunk samples nothing
            seq.append_token(token)
            if seq.num_completion_tokens == seq.max_tokens:
                seq.status = FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished


class FakeModel:
    """A KV tensor ``[num_blocks * block_size]`` of prefix fingerprints, written and read back
    through the block tables as nano-vllm's model runner computes slots."""

    def __init__(self, num_blocks: int, block_size: int, *, verify: bool = True):
        self.block_size = block_size
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.verify = verify
        self.fingerprints: dict[int, np.ndarray] = {}
        self.num_reads = 0

    def _fingerprint(self, seq: EngineSequence) -> np.ndarray:
        fp = self.fingerprints.get(seq.seq_id)
        if fp is None or len(fp) < seq.num_tokens:
            out, h = [], 7 if fp is None or len(fp) == 0 else int(fp[-1])
            start = 0 if fp is None else len(fp)
            for t in seq.token_ids[start:]:
                h = (h * 1_000_003 + t + 1) & _MASK
                out.append(h)
            new = np.array(out, dtype=np.int64)
            fp = new if fp is None else np.concatenate([fp, new])
            self.fingerprints[seq.seq_id] = fp
        return fp

    def _slots(self, table: list[int], positions: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return np.asarray(table, dtype=np.int64)[positions // bs] * bs + positions % bs

    def run(self, seqs: list[EngineSequence], is_prefill: bool) -> list[int]:
        tokens = []
        for seq in seqs:
            if is_prefill:
                start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            else:
                start, end = seq.num_tokens - 1, seq.num_tokens
            fp = self._fingerprint(seq)
            self.kv[self._slots(seq.block_table, np.arange(start, end))] = fp[start:end]
            if self.verify:
                positions = np.arange(end)
                got = self.kv[self._slots(seq.block_table, positions)]
                self.num_reads += end
                bad = np.nonzero(got != fp[:end])[0]
                if len(bad):
                    raise AssertionError(
                        f"sequence {seq.seq_id} reads another prefix's KV at position {bad[0]}"
                    )
            conv, turn = seq.conv
            tokens.append(1000 + (conv * 7919 + turn * 104_729 + seq.num_tokens) % 30_000)
        return tokens


@dataclass
class Workload:
    """Conversations over shared system prompts; each turn's prompt is the previous prompt, its
    output and a new message."""

    num_conversations: int
    turns: list[int]
    system_prompts: list[list[int]]
    conversation_prompt: list[int]  # index of each conversation's system prompt
    messages: dict[tuple[int, int], list[int]]
    max_tokens: dict[tuple[int, int], int]
    concurrency: int

    @property
    def num_requests(self) -> int:
        return sum(self.turns)


def make_workload(
    seed: int,
    *,
    num_conversations: int,
    max_turns: int,
    system_lengths: tuple[int, int],
    num_system_prompts: int,
    message_lengths: tuple[int, int],
    output_lengths: tuple[int, int],
    concurrency: int,
) -> Workload:
    rng = random.Random(seed)
    systems = [
        [rng.randrange(1, 30_000) for _ in range(rng.randint(*system_lengths))]
        for _ in range(num_system_prompts)
    ]
    turns = [rng.randint(1, max_turns) for _ in range(num_conversations)]
    messages, max_tokens = {}, {}
    for c, n in enumerate(turns):
        for t in range(n):
            messages[(c, t)] = [
                rng.randrange(1, 30_000) for _ in range(rng.randint(*message_lengths))
            ]
            max_tokens[(c, t)] = rng.randint(*output_lengths)
    return Workload(
        num_conversations=num_conversations,
        turns=turns,
        system_prompts=systems,
        conversation_prompt=[rng.randrange(num_system_prompts) for _ in range(num_conversations)],
        messages=messages,
        max_tokens=max_tokens,
        concurrency=concurrency,
    )


@dataclass
class RunResult:
    """What a run measured: scheduler time per step type (seconds), the schedule, counters."""

    times: dict[str, list[float]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    schedule: list[tuple[bool, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    num_preemptions: int = 0
    num_requests: int = 0
    num_reads: int = 0
    peak_used_blocks: int = 0


def run_engine(
    block_manager,
    workload: Workload,
    *,
    num_blocks: int,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 16384,
    verify: bool = True,
    used_blocks=None,
    record_schedule: bool = True,
    max_steps: int = 1_000_000,
) -> RunResult:
    """Runs the workload to the end; scheduler time is ``schedule`` plus ``postprocess`` (the
    block manager's calls included, the fake model excluded)."""
    EngineSequence.block_size = block_manager.block_size
    scheduler = Scheduler(
        block_manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    model = FakeModel(num_blocks, block_manager.block_size, verify=verify)
    result = RunResult()
    next_id = 0

    def start(conv: int, turn: int, history: list[int]) -> None:
        nonlocal next_id
        prompt = history + workload.messages[(conv, turn)]
        scheduler.add(
            EngineSequence(next_id, prompt, workload.max_tokens[(conv, turn)], (conv, turn))
        )
        next_id += 1
        result.num_requests += 1

    pending = deque(range(workload.num_conversations))
    active = 0
    while active < workload.concurrency and pending:
        c = pending.popleft()
        start(c, 0, list(workload.system_prompts[workload.conversation_prompt[c]]))
        active += 1
    clock = time.perf_counter
    for _ in range(max_steps):
        if scheduler.is_finished():
            break
        t0 = clock()
        seqs, is_prefill = scheduler.schedule()
        t1 = clock()
        if record_schedule:
            result.schedule.append(
                (is_prefill, tuple((s.seq_id, s.num_scheduled_tokens) for s in seqs))
            )
        token_ids = model.run(seqs, is_prefill)
        t2 = clock()
        finished = scheduler.postprocess(seqs, token_ids, is_prefill)
        t3 = clock()
        result.times["prefill" if is_prefill else "decode"].append((t1 - t0) + (t3 - t2))
        if used_blocks is not None:
            result.peak_used_blocks = max(result.peak_used_blocks, used_blocks())
        for seq in finished:  # the next turn of the conversation, or the next conversation
            conv, turn = seq.conv
            if turn + 1 < workload.turns[conv]:
                start(conv, turn + 1, seq.token_ids)
            elif pending:
                c = pending.popleft()
                start(c, 0, list(workload.system_prompts[workload.conversation_prompt[c]]))
    else:
        raise RuntimeError("the run did not finish")
    result.num_preemptions = scheduler.num_preemptions
    result.num_reads = model.num_reads
    return result
