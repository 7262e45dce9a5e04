"""End to end: the pool's slot_mapping and block_tables drive write_kv and paged attention, and the
result equals dense attention over the same K/V (R19 + K2, K5, K6)."""

from __future__ import annotations

import kvpool
import kvpool.kernels as K
import numpy as np
import pytest
from kernels_helpers import TOL
from kvpool.kernels import _loader, reference

if not hasattr(kvpool, "BlockManagerPool"):
    pytest.skip("kvpool.BlockManagerPool is not there yet", allow_module_level=True)

BACKENDS = ["numpy"] + (["emulated"] if _loader.compiler() else [])
HKV, G, D, BS, VOCAB = 2, 4, 64, 4, 50
RNG = np.random.default_rng(0)
EMB_K = RNG.standard_normal((VOCAB, HKV, D))
EMB_V = RNG.standard_normal((VOCAB, HKV, D))
POS = RNG.standard_normal((256, HKV, D)) * 0.5


def kv_of(tokens, start=0):
    """K/V of tokens at positions start.. (a function of token and position, like a real model,
    so sequences sharing a prefix share its K/V)."""
    t = np.asarray(tokens)
    pos = np.arange(start, start + len(t))
    return ((EMB_K[t] + POS[pos]).astype(np.float16), (EMB_V[t] - POS[pos]).astype(np.float16))


def dense(q, tokens, causal_from=None):
    """Reference attention over a sequence's whole K/V (float64)."""
    k, v = kv_of(tokens)
    n = len(tokens)
    mask = None
    if causal_from is not None:
        qpos = np.arange(causal_from, n)[:, None]
        mask = np.arange(n)[None, :] <= qpos
    return reference.attention(q, k, v, D**-0.5, mask)


@pytest.mark.parametrize("be", BACKENDS)
def test_pool_write_kv_then_decode_equals_dense(be):
    pool = kvpool.BlockManagerPool(64, BS)
    prompts = [RNG.integers(0, VOCAB, n).tolist() for n in (7, 13, 1, 20)]
    seqs = [kvpool.Sequence(p) for p in prompts]
    assert all(pool.allocate(s) for s in seqs)
    kc = np.zeros((64, BS, HKV, D), np.float16)
    vc = np.zeros_like(kc)

    # prefill: write every prompt token through the pool's slot mapping
    slots = pool.slot_mapping(seqs)
    assert slots.dtype == np.int64 and len(slots) == sum(map(len, prompts))
    k, v = zip(*(kv_of(p) for p in prompts), strict=True)
    K.write_kv(np.concatenate(k), np.concatenate(v), kc, vc, slots, backend=be)
    for s in seqs:
        s.num_computed_tokens = len(s)

    # prefill attention over the pool's tables equals causal dense attention
    bt = pool.block_tables(seqs)
    assert bt.dtype == np.int32
    lens = np.array([len(s) for s in seqs], np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    qp = RNG.standard_normal((int(cu[-1]), HKV * G, D)).astype(np.float16)
    got = K.paged_prefill_attention(qp, kc, vc, bt, cu, lens, D**-0.5, backend=be)
    for i, p in enumerate(prompts):
        want = dense(qp[cu[i] : cu[i + 1]], p, causal_from=0)
        np.testing.assert_allclose(got[cu[i] : cu[i + 1]].astype(np.float64), want, atol=TOL["f16"])

    # three decode steps: append a token, may_append, write its K/V, attend
    for _ in range(3):
        new = RNG.integers(0, VOCAB, len(seqs))
        for s, t, p in zip(seqs, new, prompts, strict=True):
            s.append_token(int(t))
            p.append(int(t))
            assert pool.may_append(s)
        slots = pool.slot_mapping(seqs)
        assert len(slots) == len(seqs)
        k, v = zip(*(kv_of(p[-1:], len(p) - 1) for p in prompts), strict=True)
        K.write_kv(np.concatenate(k), np.concatenate(v), kc, vc, slots, backend=be)
        for s in seqs:
            s.num_computed_tokens = len(s)
        q = RNG.standard_normal((len(seqs), HKV * G, D)).astype(np.float16)
        lens = np.array([len(s) for s in seqs], np.int32)
        out = K.paged_decode_attention(
            q, kc, vc, pool.block_tables(seqs), lens, D**-0.5, backend=be, num_splits=2
        )
        for i, p in enumerate(prompts):
            np.testing.assert_allclose(
                out[i].astype(np.float64), dense(q[i : i + 1], p)[0], atol=TOL["f16"]
            )


@pytest.mark.parametrize("be", BACKENDS)
def test_shared_prefix_blocks_serve_both_sequences(be):
    """B re-uses A's cached prefix blocks: only B's new tokens are written, yet B's decode output
    equals dense attention over B's full K/V."""
    pool = kvpool.BlockManagerPool(32, BS)
    kc = np.zeros((32, BS, HKV, D), np.float16)
    vc = np.zeros_like(kc)
    prefix = RNG.integers(0, VOCAB, 12).tolist()
    a = kvpool.Sequence(prefix + [1, 2, 3])
    assert pool.allocate(a)
    k, v = kv_of(a.token_ids)
    K.write_kv(k, v, kc, vc, pool.slot_mapping([a]), backend=be)
    a.num_computed_tokens = len(a)
    pool.cache(a)

    b_tokens = prefix + [7, 8, 9, 10, 11]
    b = kvpool.Sequence(b_tokens)
    assert pool.allocate(b)
    assert b.num_computed_tokens == b.num_cached_tokens == 12
    assert list(b.block_table[:3]) == list(a.block_table[:3])  # shared physical blocks
    slots = pool.slot_mapping([b])
    assert len(slots) == len(b_tokens) - 12
    k, v = kv_of(b_tokens[12:], 12)
    K.write_kv(k, v, kc, vc, slots, backend=be)
    b.num_computed_tokens = len(b)

    q = RNG.standard_normal((2, HKV * G, D)).astype(np.float16)
    lens = np.array([len(a), len(b)], np.int32)
    out = K.paged_decode_attention(q, kc, vc, pool.block_tables([a, b]), lens, D**-0.5, backend=be)
    np.testing.assert_allclose(
        out[0].astype(np.float64), dense(q[:1], a.token_ids)[0], atol=TOL["f16"]
    )
    np.testing.assert_allclose(
        out[1].astype(np.float64), dense(q[1:], b_tokens)[0], atol=TOL["f16"]
    )
