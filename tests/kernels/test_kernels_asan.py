"""One AddressSanitizer run of the emulated kernels (K8).

The kernel families are rebuilt with -fsanitize=address and driven in a child Python with libasan
preloaded: every kernel runs once against the reference, then a deliberately undersized buffer
must be reported as a heap-buffer-overflow (proof that the sanitizer is live).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvpool.kernels import _loader

CXX = _loader.compiler()


def _libasan() -> str | None:
    if CXX is None:
        return None
    path = subprocess.run(
        [CXX, "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


LIBASAN = _libasan()
pytestmark = pytest.mark.skipif(LIBASAN is None, reason="needs g++ with libasan")

CLEAN = textwrap.dedent("""
    import numpy as np, sys
    sys.path.insert(0, {tests!r})
    from kernels_helpers import paged, rand, close, TOL
    import kvpool.kernels as K
    rng = np.random.default_rng(0)
    kc, vc, bt, sl = paged(rng, [37, 0, 5], 8, 2, 128, np.float16)
    q = rand(rng, (3, 8, 128), np.float16)
    ref = K.paged_decode_attention(q, kc, vc, bt, sl, 0.1, backend="numpy")
    close(K.paged_decode_attention(q, kc, vc, bt, sl, 0.1, backend="emulated", num_splits=3),
          ref, TOL["f16"])
    close(K.paged_decode_attention(q, kc, vc, bt, sl, 0.1, window=4, backend="emulated"),
          K.paged_decode_attention(q, kc, vc, bt, sl, 0.1, window=4, backend="numpy"), TOL["f16"])
    qp = rand(rng, (9, 8, 128), np.float16)
    args = (qp, kc, vc, bt, [0, 6, 6, 9], sl, 0.1)
    close(K.paged_prefill_attention(*args, backend="emulated"),
          K.paged_prefill_attention(*args, backend="numpy"), TOL["f16"])
    k = rand(rng, (4, 2, 128), np.float16)
    K.write_kv(k, k, kc, vc, np.array([8, 9, -1, kc.shape[0] * 8 - 1]), backend="emulated")
    K.copy_blocks([kc, vc], [1, 2], [6, 7], backend="emulated")
    K.copy_linear_state(rand(rng, (4, 3, 5), np.float32), [1], [2], backend="emulated")
    K.swap_blocks(kc, np.zeros((3,) + kc.shape[1:], np.float16), [1, 2], [0, 2],
                  backend="emulated")
    print("ASAN-CLEAN-OK")
""")

OVERFLOW = textwrap.dedent("""
    import numpy as np
    from kvpool.kernels import _loader
    kern = _loader.emulated_kernel("cache_ops", "copy_rows_v16", True)
    small = np.zeros(64, np.uint8)               # 4 rows of 16 bytes
    ptrs = np.array([small.ctypes.data], np.int64)
    rows = np.array([16], np.int64)
    kern((1, 1, 1), (32,), (ptrs, rows, np.array([4], np.int32), np.array([0], np.int32),
                            np.int64(64)))   # reads row 4: past the end
""")


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        LD_PRELOAD=LIBASAN,
        KVPOOL_EMU_SANITIZE="1",
        ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1",
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900
    )


def test_kernels_under_address_sanitizer():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:  # build the three sanitized libraries in parallel
        list(ex.map(lambda f: _loader.build_emulated(f, sanitize=True), _loader.FAMILIES))
    res = _run(CLEAN.format(tests=str(Path(__file__).parent)))
    assert res.returncode == 0 and "ASAN-CLEAN-OK" in res.stdout, res.stderr[-4000:]
    assert "ERROR: AddressSanitizer" not in res.stderr
    bad = _run(OVERFLOW)
    assert bad.returncode != 0
    assert "heap-buffer-overflow" in bad.stderr, bad.stderr[-4000:]
