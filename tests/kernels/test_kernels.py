"""kvpool.kernels through the emulated backend (the .cu kernels on the CPU) against the NumPy
reference (docs/contract.md, K1-K8). Sizes are small: the emulation runs every CUDA thread as a fiber."""

from __future__ import annotations

import kvpool.kernels as K
import numpy as np
import pytest
from kernels_helpers import (
    DECODE,
    DTYPES,
    PREFILL,
    TOL,
    close,
    decode_case,
    decode_id,
    paged,
    prefill_case,
    prefill_id,
    rand,
)
from kvpool.kernels import _loader, _ops

pytestmark = pytest.mark.skipif(_loader.compiler() is None, reason="needs a C++ compiler")
EMU = "emulated"


@pytest.fixture(scope="module", autouse=True)
def _built():
    """Build the three families once, in parallel (each is one g++ run)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        list(ex.map(_loader.build_emulated, _loader.FAMILIES))


@pytest.fixture
def order(request):
    K.set_thread_order(request.param, seed=7)
    yield request.param
    K.set_thread_order("forward")


# ------------------------------------------------------------------------------ write_kv
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("bs", [1, 8, 16, 32])
def test_write_kv(dt, bs):
    rng = np.random.default_rng(bs)
    nb, h, d = 6, 2, 64
    kc = rand(rng, (nb, bs, h, d), DTYPES[dt])
    vc, kc_ref, vc_ref = kc * 2, kc.copy(), kc * 2
    n = min(13, (nb - 1) * bs)
    slots = rng.permutation(np.arange(bs, nb * bs))[:n].astype(np.int64)  # block 0 untouched
    slots[n // 2] = -1
    k, v = rand(rng, (n, h, d), DTYPES[dt]), rand(rng, (n, h, d), DTYPES[dt])
    K.write_kv(k, v, kc, vc, slots, backend=EMU)
    K.write_kv(k, v, kc_ref, vc_ref, slots, backend="numpy")
    assert np.array_equal(kc.view(np.uint8), kc_ref.view(np.uint8))
    assert np.array_equal(vc.view(np.uint8), vc_ref.view(np.uint8))
    assert np.array_equal(kc[slots[0] // bs, slots[0] % bs], k[0])


def test_write_kv_strided_rows_and_empty():
    """k and v as slices of a fused qkv tensor (token stride != row size); 0 tokens is a no-op."""
    rng = np.random.default_rng(1)
    hq, h, d, bs = 4, 2, 128, 16
    qkv = rand(rng, (9, hq + 2 * h, d), np.float16)
    k, v = qkv[:, hq : hq + h], qkv[:, hq + h :]
    kc = np.zeros((3, bs, h, d), np.float16)
    vc = np.zeros_like(kc)
    slots = np.arange(16, 25, dtype=np.int64)
    K.write_kv(k, v, kc, vc, slots, backend=EMU)
    assert np.array_equal(kc[1, :9], k) and np.array_equal(vc[1, :9], v)
    assert not kc[0].any() and not kc[2].any()
    K.write_kv(k[:0], v[:0], kc, vc, slots[:0], backend=EMU)


def test_write_kv_unaligned_rows_use_byte_copies():
    rng = np.random.default_rng(2)
    kc = np.zeros((4, 4, 1, 64), np.float16)
    vc = np.zeros_like(kc)
    base = rand(rng, (5 * 64 + 1,), np.float16)
    k = base[1:].reshape(5, 1, 64)  # 2-byte aligned view
    K.write_kv(k, k, kc, vc, np.array([4, 5, 6, 7, -1]), backend=EMU)
    assert np.array_equal(kc[1, :, 0], k[:4, 0])


# ---------------------------------------------------------------------- copies / swaps
def test_copy_blocks_all_layers_one_launch():
    rng = np.random.default_rng(3)
    caches = [rand(rng, (8, 16, 2, 64), np.float16) for _ in range(4)]
    caches.append(rand(rng, (9, 4, 1, 128), np.float32))  # another shape, more blocks
    caches.append(rng.integers(0, 255, (8, 3), dtype=np.uint8))  # 3-byte rows: byte copies
    refs = [c.copy() for c in caches]
    src, dst = np.array([1, 2, 3]), np.array([5, 7, 4])
    K.copy_blocks(caches, src, dst, backend=EMU)
    K.copy_blocks(refs, src, dst, backend="numpy")
    for c, r in zip(caches, refs, strict=True):
        assert np.array_equal(c, r)
    assert np.array_equal(caches[0][5], caches[0][1]) and np.array_equal(caches[4][4], caches[4][3])


def test_copy_linear_state():
    rng = np.random.default_rng(4)
    conv = rand(rng, (6, 3, 256), np.float16)
    ssm = rand(rng, (6, 4, 32, 32), np.float32)
    ref = [conv.copy(), ssm.copy()]
    K.copy_linear_state([conv, ssm], [2, 5], [1, 3], backend=EMU)
    K.copy_linear_state(ref, [2, 5], [1, 3], backend="numpy")
    assert np.array_equal(conv, ref[0]) and np.array_equal(ssm, ref[1])
    single = rand(rng, (4, 100), np.float32)
    before = single.copy()
    K.copy_linear_state(single, [3], [1], backend=EMU)
    assert np.array_equal(single[1], before[3]) and np.array_equal(
        single[[0, 2, 3]], before[[0, 2, 3]]
    )


@pytest.mark.parametrize(
    "shape,dt", [((16, 2, 64), np.float16), ((1, 1, 3), np.float32), ((32, 8, 128), "bf16")]
)
def test_swap_blocks(shape, dt):
    dt = DTYPES.get(dt, dt)
    rng = np.random.default_rng(5)
    dev = rand(rng, (7, *shape), dt)
    host = rand(rng, (11, *shape), dt)
    host_ref = host.copy()
    K.swap_blocks(dev, host, [1, 2, 6], [10, 3, 4], backend=EMU)  # offload
    K.swap_blocks(dev, host_ref, [1, 2, 6], [10, 3, 4], backend="numpy")
    assert np.array_equal(host, host_ref)
    K.swap_blocks(host, dev, [0, 5], [3, 5], backend=EMU)  # load
    assert np.array_equal(dev[3], host[0]) and np.array_equal(dev[5], host[5])


# ----------------------------------------------------------------------------- decode
def run_decode(case, backend, seed=0):
    args, kw = decode_case(case, seed)
    return (
        K.paged_decode_attention(*args, **kw, backend=backend),
        K.paged_decode_attention(*args, window=kw["window"], backend="numpy"),
    )


@pytest.mark.parametrize("case", DECODE, ids=decode_id)
def test_paged_decode(case):
    got, ref = run_decode(case, EMU)
    close(got, ref, TOL[case[0]])
    if 0 in case[5]:
        assert not np.asarray(got)[case[5].index(0)].astype(np.float32).any()


@pytest.mark.parametrize("order", ["reverse", "random"], indirect=True)
@pytest.mark.parametrize("case", [DECODE[1], DECODE[7]], ids=["f32-split", "bf16-split"])
def test_paged_decode_thread_orders(case, order):
    got, ref = run_decode(case, EMU, seed=3)
    close(got, ref, TOL[case[0]])


def test_paged_decode_default_split_and_out():
    """One long sequence: the heuristic splits it; `out` is written in place and returned."""
    case = ("f16", 64, 1, 1, 16, [600], None, None)
    assert _ops.decode_splits(1, 608, 132)[0] > 1
    rng = np.random.default_rng(9)
    kc, vc, bt, sl = paged(rng, case[5], 16, 1, 64, np.float16)
    q = rand(rng, (1, 1, 64), np.float16)
    out = np.full_like(q, np.nan)
    res = K.paged_decode_attention(q, kc, vc, bt, sl, 0.125, out, backend=EMU)
    assert res is out
    close(out, K.paged_decode_attention(q, kc, vc, bt, sl, 0.125, backend="numpy"), TOL["f16"])


def test_decode_splits():
    assert _ops.decode_splits(1000, 4096, 132) == (1, 4096)  # enough CTAs: no split
    p, part = _ops.decode_splits(8, 4096, 132)
    assert p > 1 and p * part >= 4096 and (p - 1) * part < 4096
    assert _ops.decode_splits(8, 100, 132) == (1, 100)  # short: no split
    assert _ops.decode_splits(1, 0, 132) == (1, 1)
    p, part = _ops.decode_splits(1, 50, 132, num_splits=4)
    assert (p, part) == (4, 16)
    assert _ops.decode_splits(1, 40, 132, num_splits=4) == (3, 16)


# ---------------------------------------------------------------------------- prefill
def run_prefill(case, backend, seed=0):
    args = prefill_case(case, seed)
    return (
        K.paged_prefill_attention(*args, backend=backend),
        K.paged_prefill_attention(*args, backend="numpy"),
    )


@pytest.mark.parametrize("case", PREFILL, ids=prefill_id)
def test_paged_prefill(case):
    got, ref = run_prefill(case, EMU)
    close(got, ref, TOL[case[0]])


@pytest.mark.parametrize("order", ["reverse", "random"], indirect=True)
def test_paged_prefill_thread_orders(order):
    got, ref = run_prefill(PREFILL[1], EMU, seed=5)
    close(got, ref, TOL["f16"])


def test_prefill_last_query_equals_decode():
    """The last query of a full prefill is a decode step over the same cache."""
    rng = np.random.default_rng(11)
    kc, vc, bt, sl = paged(rng, [23], 8, 2, 128, np.float32)
    q = rand(rng, (23, 8, 128), np.float32)
    pre = K.paged_prefill_attention(q, kc, vc, bt, [0, 23], sl, 0.1, backend=EMU)
    dec = K.paged_decode_attention(q[-1:], kc, vc, bt, sl, 0.1, backend=EMU)
    close(pre[-1:], dec, 1e-5)


# ----------------------------------------------------------------------- reference check
def test_reference_decode_matches_naive_loop():
    """The oracle itself, against a token-by-token softmax."""
    rng = np.random.default_rng(12)
    kc, vc, bt, sl = paged(rng, [11], 4, 2, 64, np.float32)
    q = rand(rng, (1, 4, 64), np.float32)
    got = K.paged_decode_attention(q, kc, vc, bt, sl, 0.3, window=6, backend="numpy")
    for h in range(4):
        rows = [(bt[0, t // 4], t % 4) for t in range(5, 11)]
        ks = np.array([kc[b, o, h // 2] for b, o in rows], np.float64)
        vs = np.array([vc[b, o, h // 2] for b, o in rows], np.float64)
        s = ks @ q[0, h].astype(np.float64) * 0.3
        w = np.exp(s - s.max())
        np.testing.assert_allclose(got[0, h], w @ vs / w.sum(), rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------- backend selection
def test_backend_selection(monkeypatch):
    monkeypatch.delenv("KVPOOL_KERNEL_BACKEND", raising=False)
    assert K.backend() in K.BACKENDS
    assert K.backend("numpy") == "numpy"
    monkeypatch.setenv("KVPOOL_KERNEL_BACKEND", "numpy")
    assert K.backend() == "numpy"
    assert K.backend("emulated") == "emulated"
    monkeypatch.setenv("KVPOOL_KERNEL_BACKEND", "tpu")
    with pytest.raises(ValueError, match="backend"):
        K.backend()
    with pytest.raises(ValueError, match="backend"):
        K.copy_blocks([np.zeros((2, 16))], [0], [1], backend="cuda")


def test_auto_backend_without_gpu(monkeypatch):
    from kvpool.kernels import _backend

    monkeypatch.delenv("KVPOOL_KERNEL_BACKEND", raising=False)
    monkeypatch.setattr(_backend, "gpu_available", lambda: False)
    assert K.backend() == "emulated"
    monkeypatch.setattr(_loader, "compiler", lambda: None)
    assert K.backend() == "numpy"


# ------------------------------------------------------------------------- bad input
def _decode_inputs():
    rng = np.random.default_rng(0)
    kc, vc, bt, sl = paged(rng, [5, 9], 4, 2, 64, np.float16)
    return rand(rng, (2, 4, 64), np.float16), kc, vc, bt, sl


@pytest.mark.parametrize("be", [EMU, "numpy"])
def test_bad_input_decode(be):
    q, kc, vc, bt, sl = _decode_inputs()
    dec = K.paged_decode_attention
    bad = [
        (TypeError, "q", lambda: dec(q.astype(np.float32), kc, vc, bt, sl, 1.0, backend=be)),
        (TypeError, "q", lambda: dec(q.tolist(), kc, vc, bt, sl, 1.0, backend=be)),
        (ValueError, "k_cache", lambda: dec(q, kc[0], vc, bt, sl, 1.0, backend=be)),
        (ValueError, "k_cache", lambda: dec(q, kc[:, ::2], vc[:, ::2], bt, sl, 1.0, backend=be)),
        (ValueError, "v_cache", lambda: dec(q, kc, vc[:-1], bt, sl, 1.0, backend=be)),
        (
            ValueError,
            "head_dim",
            lambda: dec(
                q[..., :32].copy(),
                kc[..., :32].copy(),
                vc[..., :32].copy(),
                bt,
                sl,
                1.0,
                backend=be,
            ),
        ),
        (ValueError, "q heads", lambda: dec(q[:, :3].copy(), kc, vc, bt, sl, 1.0, backend=be)),
        (ValueError, "block_tables", lambda: dec(q, kc, vc, bt + 100, sl, 1.0, backend=be)),
        (ValueError, "block_tables", lambda: dec(q, kc, vc, bt[:1], sl, 1.0, backend=be)),
        (ValueError, "seq_lens", lambda: dec(q, kc, vc, bt, sl + 50, 1.0, backend=be)),
        (TypeError, "seq_lens", lambda: dec(q, kc, vc, bt, sl.astype(np.float32), 1.0, backend=be)),
        (ValueError, "seq_lens", lambda: dec(q, kc, vc, bt, sl[None], 1.0, backend=be)),
        (TypeError, "scale", lambda: dec(q, kc, vc, bt, sl, "x", backend=be)),
        (ValueError, "window", lambda: dec(q, kc, vc, bt, sl, 1.0, window=0, backend=be)),
        (ValueError, "out", lambda: dec(q, kc, vc, bt, sl, 1.0, np.empty_like(q[:1]), backend=be)),
        (TypeError, "out", lambda: dec(q, kc, vc, bt, sl, 1.0, q.astype(np.float32), backend=be)),
    ]
    for exc, word, call in bad:
        with pytest.raises(exc, match=word):
            call()
    # padding past a sequence's blocks may hold anything: only used entries are checked
    bt2 = bt.copy()
    bt2[0, -1] = -1
    assert -(-5 // 4) < bt.shape[1]
    dec(q, kc, vc, bt2, sl, 1.0, backend=be)


@pytest.mark.parametrize("be", [EMU, "numpy"])
def test_bad_input_prefill(be):
    q, kc, vc, bt, sl = _decode_inputs()
    pre = K.paged_prefill_attention
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        pre(q, kc, vc, bt, [0, 1], sl, 1.0, backend=be)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        pre(q, kc, vc, bt, [0, 3, 2], sl, 1.0, backend=be)
    with pytest.raises(ValueError, match="more queries"):
        pre(np.concatenate([q] * 4), kc, vc, bt, [0, 6, 8], sl, 1.0, backend=be)


@pytest.mark.parametrize("be", [EMU, "numpy"])
def test_bad_input_copies(be):
    rng = np.random.default_rng(0)
    kc = rand(rng, (4, 4, 1, 64), np.float16)
    k = rand(rng, (2, 1, 64), np.float16)
    with pytest.raises(ValueError, match="slot_mapping"):
        K.write_kv(k, k, kc, kc.copy(), [0, 16], backend=be)
    with pytest.raises(TypeError, match="slot_mapping"):
        K.write_kv(k, k, kc, kc.copy(), np.array([0.0, 1.0]), backend=be)
    with pytest.raises(ValueError, match="slot_mapping"):
        K.write_kv(k, k, kc, kc.copy(), [0], backend=be)
    with pytest.raises(TypeError, match="k"):
        K.write_kv(k.astype(np.float32), k, kc, kc.copy(), [0, 1], backend=be)
    with pytest.raises(ValueError, match="k"):
        K.write_kv(
            k[:, :, ::2], k[:, :, ::2], kc[..., :32].copy(), kc[..., :32].copy(), [0, 1], backend=be
        )
    with pytest.raises(ValueError, match="src"):
        K.copy_blocks([kc], [4], [1], backend=be)
    with pytest.raises(ValueError, match="dst"):
        K.copy_blocks([kc], [1, 2], [3, 3], backend=be)
    with pytest.raises(ValueError, match="overlap"):
        K.copy_blocks([kc], [1, 2], [2, 3], backend=be)
    with pytest.raises(ValueError, match="dst"):
        K.copy_blocks([kc], [1, 2], [3], backend=be)
    with pytest.raises(TypeError, match="caches"):
        K.copy_blocks([], [1], [2], backend=be)
    with pytest.raises(ValueError, match="contiguous"):
        K.copy_blocks([kc[:, ::2]], [1], [2], backend=be)
    with pytest.raises(ValueError, match="dst"):
        K.copy_linear_state(kc, [1], [-1], backend=be)
    with pytest.raises(ValueError, match="dst"):
        K.swap_blocks(kc, np.zeros((2, 4, 1, 64), np.float16), [1], [2], backend=be)
    with pytest.raises(ValueError, match="block shapes"):
        K.swap_blocks(kc, np.zeros((2, 4, 2, 64), np.float16), [1], [1], backend=be)
    with pytest.raises(TypeError, match="dst_cache"):
        K.swap_blocks(kc, np.zeros((8, 4, 1, 64), np.float32), [1], [1], backend=be)


def test_emulated_kernel_checks_argument_sizes():
    kern = _loader.emulated_kernel("cache_ops", "copy_rows_v16")
    assert kern.arg_sizes == [8, 8, 8, 8, 8]
    a = np.zeros(4, np.int64)
    with pytest.raises(TypeError, match="argument 4"):
        kern((1,), (32,), (a, a, a, a, np.int32(1)))
    with pytest.raises(TypeError, match="arguments"):
        kern((1,), (32,), (a, a))
