"""``DecodeBatch``: the simulator's decoding sequences, advanced in one pool call per step.

The members are kept in a ``kvpool.SequenceBatch`` (the pool's batch step, ``pool.advance``) and,
in the same order, as ``Live`` objects and as rows of ``cols`` (one row per member): at step
``s`` a member samples its token number ``k = s - off``, which is
``low + (shift + s) % span`` with ``shift = base - off`` (``kvpool.sim.sampling``), so a step's
tokens are one vectorized expression. Per dp rank the batch keeps the member count and the sum
of ``prompt_len - off`` (a member's length is that plus the step): the step-time model reads
them without walking the members.

Invariants (``check``): the three member lists agree; the per-rank sums and the residue counts
(members by ``(prompt_len - off) % block_size``) match the members; every member is indexed
under the step that samples its last token (``finishing``); no rank has more members than the
token budget (a sequence joins only through a prefill chunk that fit in it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kvpool
from kvpool.sim.live import DECODE, WAITING, Live
from kvpool.sim.sampling import output_base, output_span

__all__ = ["DecodeBatch"]

# columns of DecodeBatch.cols, one row per member (see the module doc)
OFF, PLEN, RANK, SHIFT, LOW, SPAN = range(6)


class DecodeBatch:
    """The decode batch of one simulator: ``dp_size`` ranks, blocks of ``block_size`` tokens."""

    def __init__(self, dp_size: int, block_size: int) -> None:
        self.block_size = block_size
        self.batch = kvpool.SequenceBatch()
        self.members: list[Live] = []
        self.cols = np.zeros((0, 6), dtype=np.int64)
        self.tok: list[tuple[int, int, int]] = []  # (SHIFT, LOW, SPAN) of each member, as ints
        self.fixed = 0  # members whose sampled tokens are fixed by the workload (req.output)
        # per rank: members, and the sum of prompt_len - off (a member's length is that + step)
        self.count = [0] * dp_size
        self.len_sum = [0] * dp_size
        # members by (prompt_len - off) % block_size: at step s the members of residue -s fill a
        # block (it is published, and their next token needs a new one): only then can a pure
        # decode step change the pool's counts
        self.residue = [0] * block_size
        self.finishing: dict[
            int, list[Live]
        ] = {}  # step -> members that sample their last token then

    def __len__(self) -> int:
        return len(self.members)

    def crossing(self, step: int) -> bool:
        """Whether a member's computed tokens reach a block boundary at ``step`` (it publishes
        the block and needs a new one)."""
        return self.residue[-step % self.block_size] > 0

    def join(self, lv: Live, step: int) -> None:
        """``lv`` sampled token ``generated - 1`` (appended) and decodes from step ``step + 1``."""
        lv.state = DECODE
        lv.off = step + 1 - lv.generated
        lv.finish_at = lv.req.output_len - 1 + lv.off
        self.finishing.setdefault(lv.finish_at, []).append(lv)
        rank = lv.rank
        self.batch.add(lv.seq)
        self.members.append(lv)
        low, span = output_span(lv.req.hashed)
        base = int(output_base(lv.req.request_id)[0])
        row = np.array([[lv.off, lv.prompt_len, rank, base - lv.off, low, span]], dtype=np.int64)
        self.cols = np.concatenate([self.cols, row])
        self.tok.append((base - lv.off, low, span))
        self._account(lv, rank, 1)
        if lv.req.output is not None:
            self.fixed += 1

    def _account(self, lv: Live, rank: int, sign: int) -> None:
        """Add (``sign`` 1) or remove (-1) ``lv`` from the per-rank sums and the residue counts."""
        self.count[rank] += sign
        self.len_sum[rank] += sign * (lv.prompt_len - lv.off)
        self.residue[(lv.prompt_len - lv.off) % self.block_size] += sign

    def leave(self, members: list[Live], step: int) -> None:
        """Take ``members`` out; ``generated`` counts what they sampled before ``step``."""
        for lv in members:
            lv.state = WAITING  # not DECODE any more (the caller sets the next state)
            lv.generated = step - lv.off
            self._account(lv, lv.rank, -1)
            if lv.req.output is not None:
                self.fixed -= 1
        keep = [lv.state == DECODE for lv in self.members]
        self.batch.remove_all([lv.seq for lv in members])
        self.members = [lv for lv, k in zip(self.members, keep, strict=True) if k]
        self.tok = [t for t, k in zip(self.tok, keep, strict=True) if k]
        self.cols = self.cols[np.array(keep, dtype=bool)]

    def finishing_at(self, step: int) -> list[Live]:
        """The members that sample their last token at ``step``, taken out of the index; entries
        left by preempted members are stale (their ``finish_at`` moved on) and skipped."""
        return list(
            {
                id(lv): lv
                for lv in self.finishing.pop(step, ())
                if lv.state == DECODE and lv.finish_at == step
            }.values()
        )

    def tokens(self, step: int) -> Any:
        """The tokens the members sample at ``step``, in batch order (a list of int for a small
        batch: cheaper than NumPy there; else an int64 array)."""
        if len(self.members) <= 64:
            tok: Any = [low + (shift + step) % span for shift, low, span in self.tok]
        else:
            cols = self.cols
            tok = cols[:, LOW] + (cols[:, SHIFT] + step) % cols[:, SPAN]
        if self.fixed:
            for i, lv in enumerate(self.members):
                if lv.req.output is not None:
                    tok[i] = lv.token(step - lv.off)
        return tok

    def advance(self, pool: Any, step: int) -> list[Live]:
        """Every member computed its token and samples the next one: one ``pool.advance`` call
        (computed tokens, publication, the sampled token, its slot). Returns the members that
        got no slot for their token (they need room before the next step)."""
        failed = pool.advance(self.batch, self.tokens(step), lookahead=0)
        return [self.members[i] for i in failed] if failed else []

    def check(self, step_no: int, need_room: list[Live], max_batched_tokens: int) -> None:
        """Asserts the module doc's invariants, and each member's position at ``step_no``."""
        self.batch.check()
        assert len(self.batch) == len(self.members) == len(self.cols), (
            "decode batch and its rows disagree"
        )
        assert self.tok == [tuple(int(x) for x in r[[SHIFT, LOW, SPAN]]) for r in self.cols]
        assert [int(x) for x in self.batch.seq_ids] == [
            int(lv.req.request_id) for lv in self.members
        ]
        assert self.fixed == sum(1 for lv in self.members if lv.req.output is not None)
        residues = [0] * self.block_size
        for lv in self.members:
            residues[(lv.prompt_len - lv.off) % self.block_size] += 1
        assert residues == self.residue, "residue counts drifted"
        for lv in self.members:
            assert lv in self.finishing.get(lv.finish_at, ()), (
                "a member is missing from the finishing index"
            )
        for r in range(len(self.count)):
            # decoders joined only through prefill chunks that fit the budget: never more than it
            assert self.count[r] <= max_batched_tokens, "more decoders than the token budget"
            mine = self.cols[self.cols[:, RANK] == r]
            assert self.count[r] == len(mine), "per-rank decode count drifted"
            assert self.len_sum[r] == int((mine[:, PLEN] - mine[:, OFF]).sum()), (
                "per-rank length sum drifted"
            )
        rooms = {id(lv) for lv in need_room}
        for i, lv in enumerate(self.members):
            seq = lv.seq
            g = step_no + 1 - lv.off
            assert len(seq) == lv.prompt_len + g and self.cols[i, OFF] == lv.off, (
                "decode position drifted"
            )
            assert seq.num_computed_tokens == len(seq) - 1, (
                "a decoder must have exactly one token to compute"
            )
            if id(lv) not in rooms:
                assert len(seq.block_table) * self.block_size >= len(seq), (
                    "a decoder lacks the slot of its token"
                )
