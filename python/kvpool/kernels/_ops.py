"""Public kernel functions: argument checks, casts, grid sizes, then one backend call.

The code below is the same for the ``cupy`` and ``emulated`` backends (the kernels receive the same
arguments and launch geometry); the ``numpy`` backend runs the same checks and then the reference.
"""

from __future__ import annotations

import numpy as np

from kvpool.kernels import _backend, reference

try:
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover - ml_dtypes is a dependency of the kernels extra
    bfloat16 = None

DTYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}
if bfloat16 is not None:
    DTYPES[np.dtype(bfloat16)] = "bf16"
HEAD_DIMS = (64, 128, 256)
GROUP_TILES = (1, 2, 4, 8)  # query heads of one kv head per CTA (template GT)
NUM_WARPS = 4  # warps per attention CTA (template NW)
MAX_GRID_YZ = 65535


# ---------------------------------------------------------------------------- checks
def _array(be, name, a, ndim=None, dtype=None, contiguous=True, host_ok=False):
    if not (be.is_array(a) or (host_ok and isinstance(a, np.ndarray))):
        kind = "CuPy" if be.name == "cupy" else "NumPy"
        raise TypeError(
            f"{name} must be a {kind} array on the {be.name!r} backend, got {type(a).__name__}"
        )
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(a.shape)}")
    if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {a.dtype}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return a


def _float_array(be, name, a, ndim, **kw):
    _array(be, name, a, ndim, **kw)
    if np.dtype(a.dtype) not in DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {a.dtype}")
    return a


def _index(be, name, a, length=None, dtype=np.int32, ndim=1):
    """Integer index array cast to ``dtype`` (int32 by default) in the backend's memory."""
    if not (be.is_array(a) or isinstance(a, np.ndarray)):
        if isinstance(a, (list, tuple)) or np.isscalar(a):
            a = np.asarray(a, dtype=np.int64)
        else:
            raise TypeError(f"{name} must be an integer array, got {type(a).__name__}")
    if a.dtype.kind not in "iu" and not (a.dtype.kind == "f" and a.size == 0):
        raise TypeError(f"{name} must have an integer dtype, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(a.shape)}")
    if length is not None and a.shape[0] != length:
        raise ValueError(f"{name} must have length {length}, got {a.shape[0]}")
    if a.size and np.dtype(dtype) == np.int32 and np.dtype(a.dtype) != np.int32:
        lo, hi = _minmax(be, a)  # the cast must not wrap around
        if lo < -(2**31) or hi >= 2**31:
            raise ValueError(f"{name} has values outside int32")
    return be.asarray(a, dtype)


def _minmax(be, a) -> tuple[int, int]:
    if a.size == 0:
        return 0, -1
    return int(a.min()), int(a.max())  # one device sync on the cupy backend


def _in_range(be, name, a, lo, hi, validate):
    """ValueError unless every value of ``a`` is in [lo, hi)."""
    if validate and a.size:
        mn, mx = _minmax(be, a)
        if mn < lo or mx >= hi:
            bad = mn if mn < lo else mx
            raise ValueError(f"{name} holds {bad}, outside [{lo}, {hi})")


def _scalar(name, x, kind=float):
    """A number (R29: a bool is none); for ``kind=int`` an int, a float is a TypeError too."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    if kind is int and not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    return kind(x)


def _flag(name, x) -> bool:
    """A flag (R29): a bool, Python's or NumPy's; None or anything else is a TypeError."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return bool(x)


def _window(window) -> int:
    if window is None:
        return 0
    w = _scalar("window", window, int)
    if w < 1:
        raise ValueError(f"window must be None or >= 1, got {w}")
    return w


def _aligned16(be, *arrays) -> bool:
    return all(be.ptr(a) % 16 == 0 for a in arrays)


def _threads_for(nvec: int, cap: int = 256) -> int:
    return int(min(cap, max(32, -(-nvec // 32) * 32)))


# ---------------------------------------------------------------------------- K2
def write_kv(k, v, k_cache, v_cache, slot_mapping, *, backend=None, validate=True):
    """Write the K/V rows of new tokens into the paged cache (K2), in place.

    Parameters
    ----------
    k, v : array [num_tokens, num_kv_heads, head_dim], dtype of the cache. Each token's row must
        be contiguous; the token stride is free (slices of a fused qkv tensor are fine).
    k_cache, v_cache : array [num_blocks, block_size, num_kv_heads, head_dim] (NHD),
        float16 / bfloat16 / float32, C-contiguous.
    slot_mapping : integer array [num_tokens] (int64, as ``BlockManagerPool.slot_mapping``
        returns it): slot = block_id * block_size + offset; slot < 0 is padding and is skipped.
    backend : "cupy", "emulated" or "numpy"; default ``kvpool.kernels.backend()``.
    validate : check that every slot is < num_blocks * block_size (one device sync on cupy).
    """
    validate = _flag("validate", validate)
    be = _backend.get(backend)
    _float_array(be, "k_cache", k_cache, 4)
    _array(be, "v_cache", v_cache, 4, dtype=k_cache.dtype)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    nb, bs, h, d = k_cache.shape
    for name, x in (("k", k), ("v", v)):
        _array(be, name, x, 3, dtype=k_cache.dtype, contiguous=False)
        if tuple(x.shape[1:]) != (h, d):
            raise ValueError(f"{name} must have shape [num_tokens, {h}, {d}], got {tuple(x.shape)}")
        isz = x.dtype.itemsize
        if x.shape[0] and (x.strides[2] != isz or x.strides[1] != d * isz or x.strides[0] < 0):
            raise ValueError(
                f"{name}: each token's [num_kv_heads, head_dim] row must be contiguous"
            )
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens, v has {v.shape[0]}")
    n = k.shape[0]
    slots = _index(be, "slot_mapping", slot_mapping, n, dtype=np.int64)
    _in_range(be, "slot_mapping", slots, -(2**62), nb * bs, validate)
    if n == 0:
        return
    if be.name == "numpy":
        return reference.write_kv(k, v, k_cache, v_cache, slots)
    row = h * d * k_cache.dtype.itemsize
    vec16 = (
        row % 16 == 0
        and k.strides[0] % 16 == 0
        and v.strides[0] % 16 == 0
        and _aligned16(be, k, v, k_cache, v_cache)
    )
    vec = 16 if vec16 else 1
    kern = be.kernel("cache_ops", f"write_kv_v{vec}")
    kern(
        (n,),
        (_threads_for(row // vec),),
        (
            k,
            v,
            k_cache,
            v_cache,
            slots,
            np.int64(row),
            np.int64(k.strides[0]),
            np.int64(v.strides[0]),
        ),
    )


# ---------------------------------------------------------------------------- K3 / K7
def _copy_rows(be, what, arrays, src, dst, validate):
    if be.is_array(arrays) or isinstance(arrays, np.ndarray):
        arrays = [arrays]
    if not isinstance(arrays, (list, tuple)) or not arrays:
        raise TypeError(f"{what} must be an array or a non-empty list of arrays")
    for i, a in enumerate(arrays):
        _array(be, f"{what}[{i}]", a, None)
        if a.ndim < 1:
            raise ValueError(f"{what}[{i}] must have at least one dimension")
    rows = min(a.shape[0] for a in arrays)
    src = _index(be, "src", src)
    dst = _index(be, "dst", dst, src.shape[0])
    n = src.shape[0]
    _in_range(be, "src", src, 0, rows, validate)
    _in_range(be, "dst", dst, 0, rows, validate)
    if validate and n:
        s, t = be.to_host(src), be.to_host(dst)
        if len(np.unique(t)) != n:
            raise ValueError("dst holds the same id twice")
        if np.intersect1d(s, t).size:
            raise ValueError("dst and src overlap: copies in one launch have no order")
    if n == 0:
        return
    if be.name == "numpy":
        return reference.copy_rows(arrays, be.to_host(src), be.to_host(dst))
    row_bytes = np.array([a.nbytes // a.shape[0] if a.shape[0] else 0 for a in arrays], np.int64)
    vec = 16 if (row_bytes % 16 == 0).all() and _aligned16(be, *arrays) else 1
    if len(arrays) > MAX_GRID_YZ:
        raise ValueError(f"{what}: at most {MAX_GRID_YZ} arrays per call")
    nvec = int(row_bytes.max()) // vec
    threads = _threads_for(nvec)
    chunk = threads * 8  # vectors per CTA; long rows spread over grid.z
    chunks = max(1, -(-nvec // chunk))
    ptrs = be.asarray(np.array([be.ptr(a) for a in arrays], np.int64), np.int64)
    row_bytes = be.asarray(row_bytes, np.int64)
    be.kernel("cache_ops", f"copy_rows_v{vec}")(
        (n, len(arrays), chunks), (threads,), (ptrs, row_bytes, src, dst, np.int64(chunk))
    )


def copy_blocks(caches, src, dst, *, backend=None, validate=True):
    """Copy block ``src[i]`` to block ``dst[i]`` in every cache, in one launch (K3).

    Parameters
    ----------
    caches : array or list of arrays [num_blocks, ...] (e.g. the K and V cache of every layer),
        C-contiguous, any dtype; a block is one row of the first axis.
    src, dst : integer arrays [n] (cast to int32). ``dst`` must not repeat an id nor hold an id
        of ``src`` (the copies of one launch have no order).
    validate : check ids against the smallest ``num_blocks`` and the rules above (one sync).
    """
    validate = _flag("validate", validate)
    be = _backend.get(backend)
    _copy_rows(be, "caches", caches, src, dst, validate)


def copy_linear_state(state, src_slots, dst_slots, *, backend=None, validate=True):
    """Copy recurrent-state slot ``src_slots[i]`` to ``dst_slots[i]`` (K7), in place.

    Executes the checkpoint save / restore plans of ``BlockManagerPool.take_linear_state_plan``.

    Parameters
    ----------
    state : array or list of arrays [num_slots, ...] (e.g. conv and SSM state of every layer),
        C-contiguous, any dtype; a slot is one row of the first axis.
    src_slots, dst_slots : integer arrays [n] (cast to int32); same rules as ``copy_blocks``.
    """
    validate = _flag("validate", validate)
    be = _backend.get(backend)
    _copy_rows(be, "state", state, src_slots, dst_slots, validate)


# ---------------------------------------------------------------------------- K4
def swap_blocks(src_cache, dst_cache, src, dst, stream=None, *, backend=None, validate=True):
    """Copy block ``src[i]`` of ``src_cache`` to block ``dst[i]`` of ``dst_cache`` (K4).

    Executes the load / offload plans of ``HierarchyBlockManagerPool`` (R26) in one launch. On the
    cupy backend one side is typically a NumPy array in pinned host memory
    (``cupyx.empty_pinned``), read or written by the kernel through UVA, asynchronously on
    ``stream`` (default: the current stream); the caller synchronizes before reusing it.

    Parameters
    ----------
    src_cache, dst_cache : arrays [num_blocks_src, ...] and [num_blocks_dst, ...] with the same
        block shape and dtype, C-contiguous.
    src, dst : integer arrays [n] (cast to int32), ids in the respective cache.
    stream : a ``cupy.cuda.Stream`` (cupy backend); ignored by the synchronous CPU backends.
    """
    validate = _flag("validate", validate)
    be = _backend.get(backend)
    if be.name == "cupy" and stream is not None:
        with stream:  # index uploads, checks and the launch all go on `stream`
            return _swap_blocks(be, src_cache, dst_cache, src, dst, validate)
    return _swap_blocks(be, src_cache, dst_cache, src, dst, validate)


def _swap_blocks(be, src_cache, dst_cache, src, dst, validate):
    _array(be, "src_cache", src_cache, None, host_ok=True)
    _array(be, "dst_cache", dst_cache, None, dtype=src_cache.dtype, host_ok=True)
    if src_cache.ndim < 1 or tuple(src_cache.shape[1:]) != tuple(dst_cache.shape[1:]):
        raise ValueError(
            f"block shapes differ: src_cache {tuple(src_cache.shape)}, "
            f"dst_cache {tuple(dst_cache.shape)}"
        )
    src = _index(be, "src", src)
    dst = _index(be, "dst", dst, src.shape[0])
    _in_range(be, "src", src, 0, src_cache.shape[0], validate)
    _in_range(be, "dst", dst, 0, dst_cache.shape[0], validate)
    if validate and src.shape[0] and len(np.unique(be.to_host(dst))) != src.shape[0]:
        raise ValueError("dst holds the same id twice")
    n = src.shape[0]
    if n == 0:
        return
    if be.name == "numpy":
        return reference.swap_blocks(src_cache, dst_cache, be.to_host(src), be.to_host(dst))
    block = int(np.prod(src_cache.shape[1:], dtype=np.int64)) * src_cache.dtype.itemsize
    sp, dp = be.ptr(src_cache), be.ptr(dst_cache)
    vec = 16 if block % 16 == 0 and sp % 16 == 0 and dp % 16 == 0 else 1
    nvec = block // vec
    threads = _threads_for(nvec)
    chunk = threads * 8
    args = (np.uint64(sp), np.uint64(dp), src, dst, np.int64(block), np.int64(chunk))
    grid = (n, max(1, -(-nvec // chunk)))
    be.kernel("cache_ops", f"swap_blocks_v{vec}")(grid, (threads,), args)


# ---------------------------------------------------------------------------- K5 / K6
def _attention_args(be, q, k_cache, v_cache, block_tables, seq_lens, scale, window, validate):
    _float_array(be, "k_cache", k_cache, 4)
    _array(be, "v_cache", v_cache, 4, dtype=k_cache.dtype)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    nb, bs, hkv, d = k_cache.shape
    _array(be, "q", q, 3, dtype=k_cache.dtype)
    if q.shape[2] != d:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {d}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {d}")
    if q.shape[1] % hkv or q.shape[1] == 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({hkv})")
    seq_lens = _index(be, "seq_lens", seq_lens)
    s = seq_lens.shape[0]
    bt = _index(be, "block_tables", block_tables, s, ndim=2)
    max_blocks = bt.shape[1]
    _in_range(be, "seq_lens", seq_lens, 0, max_blocks * bs + 1, validate)
    if validate and bt.size:
        # only the entries that hold tokens must be valid block ids
        used = be.xp.arange(max_blocks)[None, :] < -(-seq_lens[:, None] // bs)
        _in_range(be, "block_tables", bt[used], 0, nb, True)
    scale = _scalar("scale", scale)
    return bt, seq_lens, nb, bs, hkv, d, np.float32(scale), _window(window)


def _out(be, out, shape, dtype):
    if out is None:
        return be.xp.empty(shape, dtype=dtype)
    _array(be, "out", out, len(shape), dtype=dtype)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    return out


def _group_tile(group: int) -> tuple[int, int]:
    """(GT, tiles): the smallest instantiated tile holding the group, and tiles per kv head."""
    gt = next((g for g in GROUP_TILES if g >= group), GROUP_TILES[-1])
    return gt, -(-group // gt)


def decode_splits(num_ctas: int, max_len: int, num_sms: int, num_splits=None) -> tuple[int, int]:
    """(num_splits, part_size) for split-KV decode.

    Without a request, split only when the (sequence, kv head, tile) CTAs fill less than two waves
    of the GPU, into parts of at least 256 tokens; parts are multiples of 16 tokens.
    """
    if max_len <= 0:
        return 1, 1
    if num_splits is None:
        target = 2 * num_sms
        num_splits = 1 if num_ctas >= target else min(-(-target // num_ctas), -(-max_len // 256))
    num_splits = _scalar("num_splits", num_splits, int)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_splits = min(num_splits, MAX_GRID_YZ)
    if num_splits == 1:
        return 1, max_len
    part = -(-max_len // num_splits)
    part = -(-part // 16) * 16
    return -(-max_len // part), part


def paged_decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    out=None,
    window=None,
    *,
    backend=None,
    num_splits=None,
    validate=True,
):
    """Decode attention of one query token per sequence over the paged cache (K5).

    Parameters
    ----------
    q : array [num_seqs, num_q_heads, head_dim], dtype of the cache; head_dim 64, 128 or 256;
        num_q_heads a multiple of num_kv_heads (GQA: the group shares one read of K/V).
    k_cache, v_cache : array [num_blocks, block_size, num_kv_heads, head_dim] (NHD).
    block_tables : integer array [num_seqs, max_blocks] (int32; ``BlockManagerPool.block_tables``).
    seq_lens : integer array [num_seqs]: tokens of each sequence in the cache, the query's own
        included (its position is seq_lens[i] - 1); 0 gives a zero output.
    scale : softmax scale, usually head_dim ** -0.5.
    out : optional array like q, written in place; allocated (dtype of q) if None.
    window : sliding window w: the query at position p attends to keys at positions > p - w.
    num_splits : split-KV parts per sequence (default: a heuristic on the GPU's SM count); parts
        are merged with their log-sum-exp.
    validate : check seq_lens and the used block-table entries (one device sync on cupy).

    Returns
    -------
    out : array [num_seqs, num_q_heads, head_dim], dtype of q.
    """
    validate = _flag("validate", validate)
    if num_splits is not None and _scalar("num_splits", num_splits, int) < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    be = _backend.get(backend)
    bt, lens, nb, bs, hkv, d, scale, w = _attention_args(
        be, q, k_cache, v_cache, block_tables, seq_lens, scale, window, validate
    )
    s, hq = q.shape[0], q.shape[1]
    if s != lens.shape[0]:
        raise ValueError(f"q has {s} sequences, seq_lens has {lens.shape[0]}")
    out = _out(be, out, q.shape, q.dtype)
    if s == 0:
        return out
    if be.name == "numpy":
        return reference.paged_decode_attention(
            q, k_cache, v_cache, bt, lens, float(scale), out, w or None
        )
    if s > MAX_GRID_YZ:
        raise ValueError(f"at most {MAX_GRID_YZ} sequences per call")
    group = hq // hkv
    gt, tiles = _group_tile(group)
    # bound of the keys one query sees, from shapes only (no device sync, graph friendly)
    max_len = bt.shape[1] * bs if not w else min(w, bt.shape[1] * bs)
    p, part = decode_splits(s * hkv * tiles, max_len, be.num_sms, num_splits)
    dt = DTYPES[np.dtype(q.dtype)]
    if p > 1:
        o_part = be.xp.empty((s, hq, p, d), np.float32)
        lse = be.xp.empty((s, hq, p), np.float32)
    else:
        o_part = lse = be.xp.empty((1,), np.float32)  # not touched
    smem = (NUM_WARPS * gt * d + 2 * NUM_WARPS * gt) * 4
    be.kernel("decode_attention", f"paged_decode_{dt}_d{d}_g{gt}")(
        (hkv * tiles, s, p),
        (NUM_WARPS * 32,),
        (
            q,
            k_cache,
            v_cache,
            bt,
            lens,
            out,
            o_part,
            lse,
            np.int32(hkv),
            np.int32(group),
            np.int32(bs),
            np.int32(bt.shape[1]),
            np.int32(part),
            np.int32(w),
            scale,
        ),
        shared_mem=smem,
    )
    if p > 1:
        be.kernel("decode_attention", f"merge_splits_{dt}")(
            (s * hq,), (d,), (o_part, lse, out, np.int32(p), np.int32(d))
        )
    return out


def prefill_kv_tile(head_dim: int, itemsize: int) -> int:
    """Tokens per shared-memory K/V tile of the prefill kernel (PrefillTile<T, D>::KT)."""
    return min(64, 16384 // (head_dim * itemsize))


def paged_prefill_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    seq_lens,
    scale,
    causal=True,
    window=None,
    *,
    backend=None,
    out=None,
    validate=True,
):
    """Prefill / extend attention of query chunks over cached prefixes (K6).

    Sequence i's queries are its LAST ``cu_seqlens_q[i+1] - cu_seqlens_q[i]`` positions; their
    K/V, and those of every earlier position, are already in the cache (write_kv first).

    Parameters
    ----------
    q : array [total_q, num_q_heads, head_dim], the queries of all sequences, concatenated.
    k_cache, v_cache : array [num_blocks, block_size, num_kv_heads, head_dim] (NHD).
    block_tables : integer array [num_seqs, max_blocks] (int32).
    cu_seqlens_q : integer array [num_seqs + 1]: 0, then running totals of query counts.
    seq_lens : integer array [num_seqs]: all tokens of each sequence (cached prefix + queries).
    scale : softmax scale.
    causal : position p attends to keys at positions <= p (else to the whole sequence).
    window : sliding window w: keys at positions > p - w.
    out : optional array like q, written in place; allocated (dtype of q) if None.

    Returns
    -------
    out : array [total_q, num_q_heads, head_dim], dtype of q.
    """
    validate, causal = _flag("validate", validate), _flag("causal", causal)
    be = _backend.get(backend)
    bt, lens, nb, bs, hkv, d, scale, w = _attention_args(
        be, q, k_cache, v_cache, block_tables, seq_lens, scale, window, validate
    )
    s, hq = lens.shape[0], q.shape[1]
    cu = _index(be, "cu_seqlens_q", cu_seqlens_q, s + 1)
    cu_h = be.to_host(cu)  # the grid needs the longest chunk (one sync on cupy)
    q_lens = np.diff(cu_h)
    if cu_h[0] != 0 or (q_lens < 0).any() or cu_h[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must rise from 0 to total_q = {q.shape[0]}")
    if validate and s and (q_lens > be.to_host(lens)).any():
        raise ValueError("a sequence has more queries (cu_seqlens_q) than tokens (seq_lens)")
    out = _out(be, out, q.shape, q.dtype)
    if q.shape[0] == 0:
        return out
    if be.name == "numpy":
        return reference.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            bt,
            cu_h,
            be.to_host(lens),
            float(scale),
            out,
            bool(causal),
            w or None,
        )
    group = hq // hkv
    gt, tiles = _group_tile(group)
    if s > MAX_GRID_YZ or hkv * tiles > MAX_GRID_YZ:
        raise ValueError(f"at most {MAX_GRID_YZ} sequences and kv-head tiles per call")
    dt = DTYPES[np.dtype(q.dtype)]
    kt = prefill_kv_tile(d, q.dtype.itemsize)
    be.kernel("prefill_attention", f"paged_prefill_{dt}_d{d}_g{gt}")(
        (-(-int(q_lens.max()) // NUM_WARPS), s, hkv * tiles),
        (NUM_WARPS * 32,),
        (
            q,
            k_cache,
            v_cache,
            bt,
            cu,
            lens,
            out,
            np.int32(hkv),
            np.int32(group),
            np.int32(bs),
            np.int32(bt.shape[1]),
            np.int32(bool(causal)),
            np.int32(w),
            scale,
        ),
        shared_mem=2 * kt * d * q.dtype.itemsize,
    )
    return out


def kernel_names() -> dict[str, list[str]]:
    """Every kernel the launch code can request, by family (for the NVRTC check)."""
    dts = sorted(set(DTYPES.values()))
    return {
        "cache_ops": [
            f"{k}_v{v}" for k in ("write_kv", "copy_rows", "swap_blocks") for v in (1, 16)
        ],
        "decode_attention": [
            f"paged_decode_{t}_d{d}_g{g}" for t in dts for d in HEAD_DIMS for g in GROUP_TILES
        ]
        + [f"merge_splits_{t}" for t in dts],
        "prefill_attention": [
            f"paged_prefill_{t}_d{d}_g{g}" for t in dts for d in HEAD_DIMS for g in GROUP_TILES
        ],
    }
