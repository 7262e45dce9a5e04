"""Shared builders for the kernel tests (test_kernels*.py): random paged caches and tables.

Every case is built in NumPy; ``to(xp, ...)`` moves it to CuPy for the GPU tests.
"""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": bfloat16}
# max abs difference between a kernel's output and the reference (both rounded to the dtype)
TOL = {"f32": 2e-5, "f16": 2e-3, "bf16": 1.6e-2}


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def paged(rng, lens, block_size, num_kv_heads, head_dim, dtype, spare=2):
    """Random K/V caches and shuffled block tables (padded with block 0) for sequences of ``lens``.

    Returns (k_cache, v_cache, block_tables int32 [S, max_blocks], seq_lens int32 [S]).
    """
    nblk = [-(-n // block_size) for n in lens]
    max_blocks = max([1, *nblk])
    num_blocks = 1 + sum(nblk) + spare
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    bt = np.zeros((len(lens), max_blocks), np.int32)
    at = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = ids[at : at + n]
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return rand(rng, shape, dtype), rand(rng, shape, dtype), bt, np.array(lens, np.int32)


def close(got, ref, tol):
    got = np.asarray(got).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "non-finite output"
    err = np.abs(got - ref).max() if got.size else 0.0
    assert err <= tol, f"max abs error {err:.3g} > {tol}"


def to(xp, *arrays):
    return tuple(xp.asarray(a) if isinstance(a, np.ndarray) else a for a in arrays)


# (dtype, head_dim, kv heads, group, block_size, seq_lens, num_splits, window)
DECODE = [
    ("f32", 64, 2, 1, 16, [1, 17, 100, 0], None, None),
    ("f32", 128, 2, 4, 8, [5, 33, 70], 3, None),
    ("f32", 256, 1, 8, 1, [9, 40], 2, 7),
    ("f16", 128, 2, 4, 16, [1, 33, 0, 64], None, None),
    ("f16", 64, 1, 8, 32, [65, 3], 4, None),
    ("f16", 256, 2, 2, 8, [30], 2, 5),
    ("f16", 128, 1, 3, 16, [20, 7], None, 10),
    ("bf16", 128, 2, 4, 16, [77, 1], 3, None),
    ("bf16", 64, 4, 1, 1, [13], None, None),
    ("bf16", 256, 1, 4, 32, [50, 0], 2, 16),
    ("bf16", 64, 1, 16, 8, [19], 2, None),
    ("f16", 64, 1, 2, 128, [130, 5], 2, None),
]


def decode_id(c):
    return f"{c[0]}-d{c[1]}-h{c[2]}-g{c[3]}-bs{c[4]}-n{'.'.join(map(str, c[5]))}-p{c[6]}-w{c[7]}"


def decode_case(case, seed=0):
    """(args, kwargs) of paged_decode_attention for a DECODE case, as NumPy arrays."""
    dt, d, hkv, g, bs, lens, splits, window = case
    rng = np.random.default_rng(seed)
    kc, vc, bt, sl = paged(rng, lens, bs, hkv, d, DTYPES[dt])
    q = rand(rng, (len(lens), hkv * g, d), DTYPES[dt])
    return (q, kc, vc, bt, sl, d**-0.5), {"window": window, "num_splits": splits}


# (dtype, head_dim, kv heads, group, block_size, seq_lens, query lens, causal, window)
PREFILL = [
    ("f32", 64, 2, 1, 16, [10, 37], [10, 5], True, None),
    ("f16", 128, 2, 4, 8, [33, 6, 20], [33, 0, 1], True, None),
    ("bf16", 128, 1, 8, 16, [40], [17], True, 9),
    ("f16", 256, 1, 2, 32, [70], [70], True, None),
    ("f32", 128, 2, 2, 1, [21, 9], [4, 9], False, None),
    ("bf16", 64, 1, 3, 4, [26], [26], True, 6),
    ("f32", 256, 1, 4, 8, [19], [7], True, None),
]


def prefill_id(c):
    return (
        f"{c[0]}-d{c[1]}-g{c[3]}-bs{c[4]}-n{'.'.join(map(str, c[5]))}"
        f"-q{'.'.join(map(str, c[6]))}-{'causal' if c[7] else 'full'}-w{c[8]}"
    )


def prefill_case(case, seed=0):
    """Positional args of paged_prefill_attention for a PREFILL case, as NumPy arrays."""
    dt, d, hkv, g, bs, lens, qlens, causal, window = case
    rng = np.random.default_rng(seed)
    kc, vc, bt, sl = paged(rng, lens, bs, hkv, d, DTYPES[dt])
    cu = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    q = rand(rng, (int(cu[-1]), hkv * g, d), DTYPES[dt])
    return (q, kc, vc, bt, cu, sl, d**-0.5, causal, window)
