"""nano-vllm's ``BlockManager`` interface on a kvpool pool: one line swaps it in.

    scheduler.block_manager = kvpool.integrations.nanovllm.BlockManager(num_blocks, block_size)

It works on nano-vllm's own ``Sequence`` objects (any object with ``seq_id``, ``token_ids``,
``num_tokens``, ``num_cached_tokens``, ``num_scheduled_tokens`` and ``block_table``), keeping
nano-vllm's meanings (docs/integrations.md):

* ``seq.block_table`` stays a Python list of ids in ``0..num_blocks-1`` indexing nano-vllm's KV
  tensor: the pool has ``num_blocks + 1`` ids (kvpool reserves id 0 as padding) and every id is
  shifted by -1; the pool has one dp rank (``dp_size=1``, a ``ValueError`` otherwise): its ids
  are the tensor's, where a second rank's range would reuse them;
* ``seq.num_cached_tokens`` stays "tokens whose KV exists" (kvpool's ``num_computed_tokens``);
* ``can_allocate(seq)`` returns the number of cached blocks or -1, with no side effect
  (``pool.plan``); ``allocate(seq, num_cached_blocks)`` carries that plan out;
* ``hash_blocks(seq)`` publishes the blocks the step just filled; with dedup on publish (R9) a
  duplicate's table entry switches to the cached block and ``seq.block_table`` is updated in
  place before the next step reads it.

Each nano-vllm sequence has a private ``kvpool.Sequence`` twin, kept in step lazily: its tokens
are brought up to date only when a call needs the pool (admission, a new block, a full block to
publish), so a decode step that needs no new block makes no call into Rust (one modulo-free
comparison per sequence, as nano-vllm's own check).

Invariants: every id in a ``block_table`` is held by the twin's table at the same position (the
twin's id minus 1); a twin exists from ``can_allocate`` until its sequence is deallocated as
finished; ``twin.num_computed_tokens`` never exceeds ``seq.num_cached_tokens``.
"""

from __future__ import annotations

from typing import Any

import kvpool

__all__ = ["BlockManager"]


class BlockManager:
    """nano-vllm's ``BlockManager(num_blocks, block_size)`` on a ``kvpool.BlockManagerPool``.

    Parameters
    ----------
    num_blocks : int
        Blocks of nano-vllm's KV tensor (ids ``0..num_blocks-1``).
    block_size : int
        Tokens per block (nano-vllm's ``kvcache_block_size``).
    **options
        Passed to ``kvpool.BlockManagerPool`` (``dedup``, ``enable_events``, ``hash_seed``, ...).
        ``dp_size`` must be 1: nano-vllm has one KV tensor per engine, and a pool's dp ranks
        each have their own id range, which the tensor cannot tell apart (run one drop-in per
        engine process for data parallelism).

    Raises
    ------
    TypeError
        ``num_blocks`` is not an int (a bool is not one, R29).
    ValueError
        ``num_blocks < 1``, or ``dp_size`` is not 1; the pool's own errors for the rest.
    """

    def __init__(self, num_blocks: int, block_size: int, **options: Any) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks: must be an int, got {type(num_blocks).__name__}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = kvpool.BlockManagerPool(num_blocks + 1, block_size, **options)
        if self.pool.dp_size != 1:
            # Every rank hands out ids 1..num_blocks of its own range: on nano-vllm's one tensor
            # two ranks' sequences would share slots (one overwriting the other's KV).
            raise ValueError(
                f"dp_size: must be 1 (nano-vllm has one KV tensor, the pool's ranks would share "
                f"its ids), got {self.pool.dp_size}"
            )
        self._twins: dict[int, kvpool.Sequence] = {}
        self._plans: dict[int, kvpool.AllocationPlan] = {}

    # -- the twin -------------------------------------------------------------------------------

    def _twin(self, seq) -> kvpool.Sequence:
        """The sequence's kvpool twin, with every token of ``seq``."""
        twin = self._twins.get(seq.seq_id)
        if twin is None:
            twin = kvpool.Sequence(seq.token_ids, seq_id=seq.seq_id)
            self._twins[seq.seq_id] = twin
        elif len(twin) < seq.num_tokens:
            twin.append_tokens(seq.token_ids[len(twin) :])
        return twin

    def _read_table(self, seq, twin: kvpool.Sequence) -> None:
        seq.block_table[:] = [i - 1 for i in twin.block_ids()]

    # -- nano-vllm's interface ----------------------------------------------------------------

    def can_allocate(self, seq) -> int:
        """Cached blocks an allocation of ``seq`` would reuse, or -1 if it cannot be had.

        No side effect on the pool (R15): the plan is kept for ``allocate``.
        """
        plan = self.pool.plan(self._twin(seq))
        if plan is None:
            self._plans.pop(seq.seq_id, None)
            return -1
        self._plans[seq.seq_id] = plan
        return plan.num_cached_blocks

    def allocate(self, seq, num_cached_blocks: int) -> None:
        """Blocks for every token of ``seq`` after reusing ``num_cached_blocks`` cached ones."""
        if isinstance(num_cached_blocks, bool) or not isinstance(num_cached_blocks, int):
            raise TypeError(
                f"num_cached_blocks: must be an int, got {type(num_cached_blocks).__name__}"
            )
        if seq.block_table:
            raise ValueError(f"seq: sequence {seq.seq_id} already has a block table")
        twin = self._twin(seq)
        if not self.pool.allocate(twin, plan=self._plans.pop(seq.seq_id, None)):
            raise kvpool.OutOfBlocksError(
                f"seq: no room for sequence {seq.seq_id} (call can_allocate first)"
            )
        if twin.num_cached_tokens != num_cached_blocks * self.block_size:
            self.pool.deallocate(twin)
            raise ValueError(
                f"num_cached_blocks: {num_cached_blocks} for sequence {seq.seq_id}, but the cache "
                f"holds {twin.num_cached_tokens // self.block_size} now (call can_allocate "
                "right before allocate)"
            )
        seq.block_table.extend(i - 1 for i in twin.block_ids())
        seq.num_cached_tokens = twin.num_cached_tokens

    def deallocate(self, seq) -> None:
        """Releases ``seq``'s blocks (its published blocks stay cached) and resets it."""
        twin = self._twins.get(seq.seq_id)
        if twin is not None:
            self.pool.deallocate(twin)
            if getattr(seq, "is_finished", False):
                del self._twins[seq.seq_id]
        self._plans.pop(seq.seq_id, None)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq) -> bool:
        """Whether the block the next step writes into can be had (nano-vllm: ``len(seq)``
        counts the token sampled last step)."""
        if seq.num_tokens <= len(seq.block_table) * self.block_size:
            return True  # the table holds it: no call into Rust
        return self.pool.can_append(self._twin(seq))

    def may_append(self, seq) -> None:
        """Takes that block (if the table does not hold the token yet)."""
        if seq.num_tokens <= len(seq.block_table) * self.block_size:
            return
        twin = self._twin(seq)
        if not self.pool.may_append(twin):
            raise kvpool.OutOfBlocksError(
                f"seq: no free block for sequence {seq.seq_id} (call can_append first)"
            )
        seq.block_table.append(twin.last_block_id - 1)  # type: ignore[operator]  # may_append gave it one

    def hash_blocks(self, seq) -> None:
        """Publishes the blocks the step just filled (before ``num_cached_tokens`` advances)."""
        bs = self.block_size
        cached = seq.num_cached_tokens
        done = cached + seq.num_scheduled_tokens
        if cached // bs == done // bs:
            return  # no block became full: no call into Rust
        twin = self._twin(seq)
        twin.num_computed_tokens = done
        self.pool.cache(twin)
        if self.pool.drain_block_switches():  # dedup on publish switched some entries (R9)
            self._read_table(seq, twin)
