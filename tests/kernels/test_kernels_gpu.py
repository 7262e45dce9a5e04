"""The same kernels on a GPU (backend "cupy") against the NumPy reference. Skipped without a GPU."""

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
    to,
)
from kvpool.kernels import _backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _backend.gpu_available(), reason="needs a CUDA GPU and cupy"),
]
GPU = "cupy"


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.mark.parametrize("case", DECODE, ids=decode_id)
def test_paged_decode_gpu(cp, case):
    args, kw = decode_case(case)
    ref = K.paged_decode_attention(*args, window=kw["window"], backend="numpy")
    got = K.paged_decode_attention(*to(cp, *args), **kw, backend=GPU)
    close(cp.asnumpy(got), ref, TOL[case[0]])


@pytest.mark.parametrize("case", PREFILL, ids=prefill_id)
def test_paged_prefill_gpu(cp, case):
    args = prefill_case(case)
    ref = K.paged_prefill_attention(*args, backend="numpy")
    got = K.paged_prefill_attention(*to(cp, *args), backend=GPU)
    close(cp.asnumpy(got), ref, TOL[case[0]])


def test_paged_decode_gpu_long_default_split(cp):
    rng = np.random.default_rng(1)
    lens = [4000, 1, 0, 777]
    kc, vc, bt, sl = paged(rng, lens, 16, 8, 128, DTYPES["bf16"])
    q = rand(rng, (4, 32, 128), DTYPES["bf16"])
    ref = K.paged_decode_attention(q, kc, vc, bt, sl, 128**-0.5, backend="numpy")
    got = K.paged_decode_attention(*to(cp, q, kc, vc, bt, sl), 128**-0.5, backend=GPU)
    close(cp.asnumpy(got), ref, TOL["bf16"])


@pytest.mark.parametrize("dt", DTYPES)
def test_write_kv_and_copy_blocks_gpu(cp, dt):
    rng = np.random.default_rng(2)
    kc = rand(rng, (9, 16, 2, 128), DTYPES[dt])
    vc = rand(rng, (9, 16, 2, 128), DTYPES[dt])
    k, v = rand(rng, (20, 2, 128), DTYPES[dt]), rand(rng, (20, 2, 128), DTYPES[dt])
    slots = rng.permutation(np.arange(16, 9 * 16))[:20].astype(np.int64)
    slots[3] = -1
    gk, gv = to(cp, kc, vc)
    K.write_kv(*to(cp, k, v), gk, gv, cp.asarray(slots), backend=GPU)
    K.write_kv(k, v, kc, vc, slots, backend="numpy")
    K.copy_blocks([gk, gv], [1, 2], [7, 8], backend=GPU)
    K.copy_blocks([kc, vc], [1, 2], [7, 8], backend="numpy")
    assert np.array_equal(cp.asnumpy(gk).view(np.uint8), kc.view(np.uint8))
    assert np.array_equal(cp.asnumpy(gv).view(np.uint8), vc.view(np.uint8))


def test_swap_blocks_pinned_host_gpu(cp):
    import cupyx

    rng = np.random.default_rng(3)
    dev = cp.asarray(rand(rng, (8, 16, 2, 128), np.float16))
    host = cupyx.zeros_pinned((6, 16, 2, 128), np.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    K.swap_blocks(dev, host, np.array([1, 5]), np.array([2, 4]), stream, backend=GPU)  # offload
    stream.synchronize()
    d = cp.asnumpy(dev)
    assert np.array_equal(host[2], d[1]) and np.array_equal(host[4], d[5])
    host[0] = 1.5
    K.swap_blocks(host, dev, [0], [3], stream, backend=GPU)  # load
    stream.synchronize()
    assert (cp.asnumpy(dev[3]) == 1.5).all()
    with pytest.raises(ValueError, match="pinned"):
        K.swap_blocks(dev, np.zeros((6, 16, 2, 128), np.float16), [1], [1], backend=GPU)


def test_copy_linear_state_gpu(cp):
    st = cp.arange(5 * 3 * 64, dtype=cp.float32).reshape(5, 3, 64)
    want = cp.asnumpy(st)
    want[[1, 4]] = want[[2, 3]]
    K.copy_linear_state(st, [2, 3], [1, 4], backend=GPU)
    assert np.array_equal(cp.asnumpy(st), want)


def test_gpu_rejects_numpy_arrays(cp):
    rng = np.random.default_rng(4)
    kc, vc, bt, sl = paged(rng, [5], 4, 1, 64, np.float16)
    q = rand(rng, (1, 1, 64), np.float16)
    with pytest.raises(TypeError, match="k_cache"):
        K.paged_decode_attention(cp.asarray(q), kc, vc, bt, sl, 1.0, backend=GPU)
