"""NVRTC compile check (K8): every kernel instantiation of kvpool.kernels builds for sm_80
and sm_90 with NVRTC from the pip wheels (no GPU, no driver) and spills no register."""

from __future__ import annotations

import pytest
from kvpool.kernels import _ops

nvrtc = pytest.importorskip("kvpool.kernels.nvrtc_check")
try:
    VERSION = nvrtc.version()
    nvrtc.include_dir()
except nvrtc.NvrtcUnavailable as e:  # pragma: no cover - depends on the environment
    pytest.skip(str(e), allow_module_level=True)

ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module")
def compiled():
    return nvrtc.check_all(ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles(compiled, arch):
    want = {n for names in _ops.kernel_names().values() for n in names}
    assert set(compiled[arch]) == want


@pytest.mark.parametrize("arch", ARCHS)
def test_no_register_spills(compiled, arch):
    spills = {
        k: (i.spill_stores, i.spill_loads)
        for k, i in compiled[arch].items()
        if i.spill_stores or i.spill_loads
    }
    assert not spills, f"{arch} kernels spill registers: {spills}"
    stack = {k: i.stack_frame for k, i in compiled[arch].items() if i.stack_frame}
    assert not stack, f"{arch} kernels use local memory: {stack}"
    assert all(0 < i.registers <= 255 for i in compiled[arch].values())


def test_ptxas_log_parser():
    log = (
        "ptxas info    : Compiling entry function 'write_kv_v16' for 'sm_90'\n"
        "ptxas info    : Function properties for write_kv_v16\n"
        "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 32 registers, used 0 barriers, 1024 bytes smem\x00"
    )
    info = nvrtc.parse_ptxas_log(log)["write_kv_v16"]
    assert (info.registers, info.spill_stores, info.spill_loads, info.stack_frame, info.smem) == (
        32,
        8,
        4,
        16,
        1024,
    )
