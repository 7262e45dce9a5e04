"""Batch calls of BlockManagerPool: advance / may_append_all (one call per step for a batch) and
batch exports naming a sequence twice."""

from __future__ import annotations

import random

import kvpool
import numpy as np
import pytest

BS = 4


def _pair(n_seqs: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(n_seqs)]
    pools, seqs = [], []
    for _ in range(2):
        pool = kvpool.BlockManagerPool(40, BS)
        ss = [kvpool.Sequence(p, seq_id=i) for i, p in enumerate(prompts)]
        for s in ss:
            assert pool.allocate(s)
        pools.append(pool)
        seqs.append(ss)
    return pools, seqs, rng


@pytest.mark.parametrize("seed", range(4))
def test_advance_and_may_append_all_equal_the_per_sequence_calls(seed):
    """R16, R17: the batch calls do exactly what the four calls per sequence do."""
    (batch, loop), (bs, ls), rng = _pair(6, seed)
    for _ in range(30):
        tokens = [rng.randrange(50) for _ in bs]
        batch.advance(bs, np.array(tokens, dtype=np.int64))
        failed = batch.may_append_all(bs)
        ok_loop = []
        for s, t in zip(ls, tokens, strict=True):
            s.num_computed_tokens = len(s)
            loop.cache(s)
            s.append_token(t)
            ok_loop.append(loop.may_append(s))
        assert failed == [i for i, ok in enumerate(ok_loop) if not ok]
        for a, b in zip(bs, ls, strict=True):
            assert a.block_table.tolist() == b.block_table.tolist()
            assert a.num_computed_tokens == b.num_computed_tokens and len(a) == len(b)
        assert batch.stats() == loop.stats()
        keep = [i for i, ok in enumerate(ok_loop) if ok]
        for i, ok in enumerate(ok_loop):
            if not ok:
                batch.deallocate(bs[i])
                loop.deallocate(ls[i])
        bs = [bs[i] for i in keep]
        ls = [ls[i] for i in keep]
        batch.check()
        if not bs:
            break


def test_r29_advance_bad_input_changes_nothing():
    pool = kvpool.BlockManagerPool(32, BS)
    a, b = kvpool.Sequence([1, 2, 3]), kvpool.Sequence([4, 5, 6, 7, 8])
    assert pool.allocate(a) and pool.allocate(b)
    stranger = kvpool.Sequence([9])
    before = (pool.stats(), len(a), len(b), a.num_computed_tokens)
    with pytest.raises(ValueError, match="token_ids"):
        pool.advance([a, b], [1])
    with pytest.raises(ValueError, match="seqs"):
        pool.advance([a, a], [1, 2])
    with pytest.raises(ValueError, match="seqs"):
        pool.advance([a, stranger], [1, 2])  # a is not touched either
    with pytest.raises(TypeError, match="seqs"):
        pool.advance([a, "b"], [1, 2])
    with pytest.raises(ValueError, match="seqs"):
        pool.may_append_all([a, a])
    with pytest.raises(ValueError, match="seqs"):
        pool.may_append_all([stranger])
    with pytest.raises(ValueError, match="lookahead"):
        pool.may_append_all([a], lookahead=-1)
    assert (pool.stats(), len(a), len(b), a.num_computed_tokens) == before
    b.append_token(9)  # 6 tokens: the table (2 blocks of 4) holds them
    b.append_tokens([1, 2, 3])  # 9 tokens: no longer
    with pytest.raises(ValueError, match="may_append first"):
        pool.advance([a, b], [1, 2])
    assert len(a) == 3


def test_batch_exports_may_name_a_sequence_twice():
    """A list naming one sequence twice is locked once (it used to deadlock)."""
    pool = kvpool.BlockManagerPool(32, BS)
    s = kvpool.Sequence(list(range(6)))
    assert pool.allocate(s)
    tables = pool.block_tables([s, s])
    assert tables.tolist() == [s.block_table.tolist()] * 2
    assert len(pool.slot_mapping([s, s])) == 12
