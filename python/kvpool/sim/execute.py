"""``--execute``: run a small random-weight attention stack through the pool's block tables.

Every step, for the tokens the scheduler computes, each layer projects q/k/v, writes k/v
into the paged cache through the pool's slot mapping (``write_kv``) and attends over the
block tables (``paged_decode_attention`` for single-token decodes, ``paged_prefill_attention``
for prefill chunks that extend a cached prefix). Every ``check_every`` steps a few of the
scheduled sequences are recomputed densely (float64, no cache at all, all their tokens from
position 0) and the paged outputs, and the cached K/V, are compared with that reference:
a wrong block id, a bad slot, a prefix hit on the wrong KV or an early-freed block shows up
as a large error.

The kernels are ``kvpool.kernels``'s (``--backend``: cupy on a GPU, the emulated CUDA or the
NumPy reference on a CPU; auto takes cupy when CuPy sees a GPU, else numpy).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

import kvpool.kernels as K
from kvpool.kernels._backend import ENV, gpu_available
from kvpool.sim.config import SimError, UnavailableError

__all__ = ["Executor"]

_EMB_ROWS = 4096


class _Kernels:
    """The three kernels of ``kvpool.kernels`` the stack calls, on one backend, and the array
    module (NumPy or CuPy) its caches live in."""

    def __init__(self, backend: str) -> None:
        if backend == "auto":
            # a replay on a CPU takes the NumPy reference: the emulated CUDA is for checking the
            # kernels themselves and is much slower (--backend emulated still picks it)
            backend = os.environ.get(ENV) or ("cupy" if gpu_available() else "numpy")
        self.xp: Any = np
        if backend == "cupy":
            if not gpu_available():
                raise UnavailableError("--backend cupy needs cupy and a CUDA GPU")
            import cupy

            self.xp = cupy
        self.name = backend
        self.write_kv = K.write_kv
        self.decode = K.paged_decode_attention
        self.prefill = K.paged_prefill_attention
        self.kw: dict[str, Any] = {"backend": backend}


def _dense_attention(q, keys, vals, qpos, scale):  # noqa: ANN001
    """Causal attention of the dense reference (no cache): q [m, qh, hd], keys/vals [n, kvh, hd],
    qpos [m] the query positions; float64, BLAS matmuls (faster here than the kernels' einsum
    reference, kvpool.kernels.reference.attention, on the long prompts the check recomputes)."""
    qh, kvh = q.shape[1], keys.shape[1]
    g = qh // kvh
    qq = np.asarray(q, dtype=np.float64).transpose(1, 0, 2)  # [qh, m, hd]
    kk = np.repeat(np.asarray(keys, dtype=np.float64).transpose(1, 0, 2), g, axis=0)  # [qh, n, hd]
    vv = np.repeat(np.asarray(vals, dtype=np.float64).transpose(1, 0, 2), g, axis=0)
    s = np.matmul(qq, kk.transpose(0, 2, 1)) * scale  # [qh, m, n]
    s[:, np.arange(keys.shape[0])[None, :] > qpos[:, None]] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, vv).transpose(1, 0, 2)  # [m, qh, hd]


def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6)


class Executor:
    def __init__(
        self,
        cfg: Any,
        *,
        backend: str = "auto",
        layers: int = 2,
        heads: str = "4/2",
        head_dim: int = 64,
        check_every: int = 16,
        seed: int = 0,
        tolerance: float = 2e-3,
        max_check_seqs: int = 3,
        max_check_tokens: int = 4096,
    ) -> None:
        try:
            qh, kvh = (int(x) for x in heads.split("/"))
        except ValueError:
            raise SimError(f"--exec-heads wants Q/KV, e.g. 4/2, got {heads!r}") from None
        if qh < 1 or kvh < 1 or qh % kvh:
            raise SimError(
                f"--exec-heads {heads}: query heads must be a positive multiple of KV heads"
            )
        self.cfg = cfg
        self.k = _Kernels(backend)
        self.layers, self.qh, self.kvh, self.hd = layers, qh, kvh, head_dim
        self.d = qh * head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.check_every = check_every
        self.tol = tolerance
        self.max_check_seqs = max_check_seqs
        self.max_check_tokens = max_check_tokens
        rng = np.random.default_rng([seed, 0xE7EC])
        d = self.d
        self.emb = rng.standard_normal((_EMB_ROWS, d)).astype(np.float32)
        self.w = [
            tuple(
                (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)
                for shape in (
                    (d, qh * head_dim),
                    (d, kvh * head_dim),
                    (d, kvh * head_dim),
                    (qh * head_dim, d),
                )
            )
            for _ in range(layers)
        ]
        self.rng = np.random.default_rng([seed, 0xC4EC])
        self.max_err = 0.0
        self.checked_steps = 0
        self.checked_seqs = 0
        self.steps = 0
        self.tokens = 0
        self.notes: list[str] = []
        if cfg.linear_state_slots:
            self.notes.append("linear-state layers are not executed (plans are counted only)")
        if cfg.has_window_groups:
            self.notes.append("only the full-attention group is executed")

    # -------------------------------------------------------------- setup
    def bind(self, sim: Any) -> None:
        xp = self.k.xp
        cfg = self.cfg
        shape = (cfg.num_blocks, cfg.block_size, self.kvh, self.hd)
        self.kc = [
            [xp.zeros(shape, xp.float32) for _ in range(self.layers)] for _ in range(cfg.dp_size)
        ]
        self.vc = [
            [xp.zeros(shape, xp.float32) for _ in range(self.layers)] for _ in range(cfg.dp_size)
        ]
        if cfg.host_num_blocks:
            hshape = (cfg.host_num_blocks, cfg.block_size, self.kvh, self.hd)
            self.hk = [
                [np.zeros(hshape, np.float32) for _ in range(self.layers)]
                for _ in range(cfg.dp_size)
            ]
            self.hv = [
                [np.zeros(hshape, np.float32) for _ in range(self.layers)]
                for _ in range(cfg.dp_size)
            ]
        self.wd = [tuple(xp.asarray(w) for w in ws) for ws in self.w]
        self.pool = sim.pool

    def _embed(self, tokens: np.ndarray, pos: np.ndarray) -> np.ndarray:
        d = self.d
        i = np.arange(d // 2)
        ang = pos[:, None] / (10000.0 ** (2 * i[None, :] / d))
        pe = np.concatenate([np.sin(ang), np.cos(ang)], axis=1)
        return self.emb[np.asarray(tokens) % _EMB_ROWS] + pe.astype(np.float32)

    @staticmethod
    def _tokens(lv: Any, end: int) -> np.ndarray:
        p = np.asarray(lv.req.prompt)
        if end <= len(p):
            return p[:end]
        return np.concatenate([p, np.asarray(lv.out[: end - len(p)], dtype=p.dtype)])

    # -------------------------------------------------------------- hooks from the engine
    def linear_state(self, plan: Any) -> None:
        pass

    def transfer(self, plans: Any, *, to_device: bool) -> None:
        xp = self.k.xp
        for p in plans:
            r = int(p.dp_rank)
            src = np.asarray(p.src, dtype=np.int64)
            dst = np.asarray(p.dst, dtype=np.int64)
            for layer in range(self.layers):
                if to_device:
                    self.kc[r][layer][xp.asarray(dst)] = xp.asarray(self.hk[r][layer][src])
                    self.vc[r][layer][xp.asarray(dst)] = xp.asarray(self.hv[r][layer][src])
                else:
                    self.hk[r][layer][dst] = _host(self.kc[r][layer][xp.asarray(src)])
                    self.hv[r][layer][dst] = _host(self.vc[r][layer][xp.asarray(src)])

    def forward(self, sim: Any, scheduled: list[tuple[Any, int, int]]) -> None:
        self.steps += 1
        by_rank: dict[int, list[tuple[Any, int, int]]] = {}
        for item in scheduled:
            by_rank.setdefault(int(item[0].seq.dp_rank), []).append(item)
        check = (self.steps - 1) % self.check_every == 0
        try:
            for rank, items in by_rank.items():
                self._forward_rank(rank, items, check)
        except (ValueError, TypeError) as e:
            if os.environ.get("KVPOOL_DEBUG"):
                raise
            raise SimError(f"--execute: the {self.k.name} kernels rejected the step: {e}") from None
        if check:
            self.checked_steps += 1

    def _forward_rank(self, rank: int, items: list[tuple[Any, int, int]], check: bool) -> None:
        xp = self.k.xp
        kw = self.k.kw
        bs = self.cfg.block_size
        pool = self.pool
        # decodes first, then prefill chunks (two kernel calls)
        dec = [it for it in items if it[2] - it[1] == 1 and it[1] > 0]
        pre = [it for it in items if not (it[2] - it[1] == 1 and it[1] > 0)]
        order = dec + pre
        seqs = [lv.seq for lv, _, _ in order]
        tables = pool.block_tables(seqs)
        # slots of [start, end): the pool's slot_mapping covers [computed, len); a prefill chunk
        # that stops before len has the rest of its slots computed from its own block table
        slots = []
        for row, (lv, s, e) in enumerate(order):
            if e == len(lv.seq):
                sm = pool.slot_mapping([lv.seq])
            else:
                pos = np.arange(s, e)
                sm = tables[row][pos // bs].astype(np.int64) * bs + pos % bs
            slots.append(np.asarray(sm, dtype=np.int64))
        slot_mapping = np.concatenate(slots)
        toks = np.concatenate([self._tokens(lv, e)[s:e] for lv, s, e in order])
        pos = np.concatenate([np.arange(s, e) for _, s, e in order])
        n_dec = len(dec)
        seq_lens = np.array([e for _, _, e in order], dtype=np.int32)
        cu = np.zeros(len(pre) + 1, dtype=np.int32)
        cu[1:] = np.cumsum([e - s for _, s, e in pre])
        h = xp.asarray(self._embed(toks, pos))
        tables_x = xp.asarray(tables)
        sm_x = xp.asarray(slot_mapping)
        kv_hd = (self.kvh, self.hd)
        for layer, (wq, wk, wv, wo) in enumerate(self.wd):
            q = (h @ wq).reshape(-1, self.qh, self.hd)
            k = (h @ wk).reshape(-1, *kv_hd)
            v = (h @ wv).reshape(-1, *kv_hd)
            kc, vc = self.kc[rank][layer], self.vc[rank][layer]
            self.k.write_kv(xp.ascontiguousarray(k), xp.ascontiguousarray(v), kc, vc, sm_x, **kw)
            out = xp.empty_like(q)
            if n_dec:
                out[:n_dec] = self.k.decode(
                    xp.ascontiguousarray(q[:n_dec]),
                    kc,
                    vc,
                    tables_x[:n_dec],
                    xp.asarray(seq_lens[:n_dec]),
                    self.scale,
                    **kw,
                )
            if pre:
                out[n_dec:] = self.k.prefill(
                    xp.ascontiguousarray(q[n_dec:]),
                    kc,
                    vc,
                    tables_x[n_dec:],
                    xp.asarray(cu),
                    xp.asarray(seq_lens[n_dec:]),
                    self.scale,
                    causal=True,
                    **kw,
                )
            h = h + out.reshape(-1, self.qh * self.hd) @ wo
            h = h / xp.sqrt((h * h).mean(axis=-1, keepdims=True) + 1e-6)
        self.tokens += len(toks)
        if check:
            self._check(rank, order, tables, _host(h))

    # -------------------------------------------------------------- dense reference
    def _dense(self, tokens: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        n = len(tokens)
        h = self._embed(tokens, np.arange(n)).astype(np.float64)
        ks = []
        for wq, wk, wv, wo in self.w:
            q = (h @ wq).reshape(n, self.qh, self.hd)
            k = (h @ wk).reshape(n, self.kvh, self.hd)
            v = (h @ wv).reshape(n, self.kvh, self.hd)
            ks.append(k)
            o = _dense_attention(q, k, v, np.arange(n), self.scale)
            h = h + o.reshape(n, -1) @ wo.astype(np.float64)
            h = _rms(h)
        return h, ks

    def _check(
        self, rank: int, order: list[tuple[Any, int, int]], tables: np.ndarray, h: np.ndarray
    ) -> None:
        offs = np.zeros(len(order) + 1, dtype=np.int64)
        offs[1:] = np.cumsum([e - s for _, s, e in order])
        cand = [i for i, (_, _, e) in enumerate(order) if e <= self.max_check_tokens]
        if not cand:
            return
        # prefer sequences that reuse cached KV (prefix hits, recomputes): that is where a wrong
        # block would hurt; then a random sample
        hits = [i for i in cand if order[i][0].seq.num_cached_tokens > 0]
        rest = [i for i in cand if i not in hits]
        self.rng.shuffle(hits)
        self.rng.shuffle(rest)
        pick = (hits + rest)[: self.max_check_seqs]
        bs = self.cfg.block_size
        for i in pick:
            lv, s, e = order[i]
            ref, ks = self._dense(self._tokens(lv, e))
            err = float(np.abs(ref[s:e] - h[offs[i] : offs[i + 1]]).max())
            # the cached K of the last layer, positions 0..e-1, through the block table
            pos = np.arange(e)
            kc = _host(self.kc[rank][-1])
            cached_k = kc[tables[i][pos // bs], pos % bs]
            err = max(err, float(np.abs(cached_k - ks[-1]).max()))
            self.max_err = max(self.max_err, err)
            self.checked_seqs += 1

    def report(self) -> dict[str, Any]:
        return {
            "backend": self.k.name,
            "layers": self.layers,
            "heads": f"{self.qh}/{self.kvh}",
            "head_dim": self.hd,
            "steps": self.steps,
            "tokens": self.tokens,
            "checked_steps": self.checked_steps,
            "checked_sequences": self.checked_seqs,
            "max_abs_error": self.max_err,
            "tolerance": self.tol,
            "ok": self.max_err <= self.tol,
            "notes": self.notes,
        }


def _host(a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    return a.get()
