"""NumPy reference of every kernel (the ``numpy`` backend): plain loops, float64 accumulation.

Functions take already-validated NumPy arrays (the public functions in ``kvpool.kernels`` check
and cast them first) and follow the same conventions: writes in place, attention fills ``out``.
"""

from __future__ import annotations

import numpy as np


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    nb, bs, h, d = k_cache.shape
    k_cache.reshape(nb * bs, h, d)[slots] = k[keep]
    v_cache.reshape(nb * bs, h, d)[slots] = v[keep]


def copy_rows(arrays, src, dst) -> None:
    """Row src[i] -> row dst[i] (first axis) in every array: copy_blocks and copy_linear_state."""
    for a in arrays:
        a[dst] = a[src]


def swap_blocks(src_cache, dst_cache, src, dst) -> None:
    dst_cache[dst] = src_cache[src]


def _gather(cache, table, positions):
    """Rows [len(positions), Hkv, D] of a paged NHD cache, as float64."""
    bs = cache.shape[1]
    blocks = table[positions // bs]
    return cache[blocks, positions % bs].astype(np.float64)


def attention(q, k, v, scale, mask=None):
    """Dense attention with GQA. q [n, Hq, D], k/v [m, Hkv, D], mask [n, m] (True = attend).

    Returns float64 [n, Hq, D]; a query that sees no key gets zeros.
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qh = q.astype(np.float64).reshape(n, hkv, g, d)
    s = np.einsum("nhgd,mhd->hgnm", qh, k.astype(np.float64)) * scale
    if mask is not None:
        s = np.where(mask[None, None], s, -np.inf)
    mx = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.zeros(s.shape[:-1] + (1,))
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.exp(s - mx)
    den = p.sum(axis=-1, keepdims=True)
    o = np.einsum("hgnm,mhd->nhgd", p / np.where(den > 0, den, 1.0), v.astype(np.float64))
    return o.reshape(n, hq, d)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out, window=None):
    for s in range(q.shape[0]):
        n = int(seq_lens[s])
        lo = max(0, n - window) if window else 0
        pos = np.arange(lo, n)
        k = _gather(k_cache, block_tables[s], pos)
        v = _gather(v_cache, block_tables[s], pos)
        out[s] = attention(q[s : s + 1], k, v, scale)[0].astype(out.dtype)
    return out


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out, causal=True, window=None
):
    for s in range(len(seq_lens)):
        a, b = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        n = int(seq_lens[s])
        if b == a:
            continue
        qpos = np.arange(n - (b - a), n)[:, None]
        kpos = np.arange(n)[None, :]
        mask = np.ones((b - a, n), bool)
        if causal:
            mask &= kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        k = _gather(k_cache, block_tables[s], np.arange(n))
        v = _gather(v_cache, block_tables[s], np.arange(n))
        out[a:b] = attention(q[a:b], k, v, scale, mask).astype(out.dtype)
    return out
