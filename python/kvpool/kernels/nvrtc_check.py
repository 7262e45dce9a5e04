"""Compile every kernel family with NVRTC, no GPU or driver needed, and report registers/spills.

Uses ``libnvrtc`` from the pip wheel ``nvidia-cuda-nvrtc-cu12`` (through ctypes) and the CUDA
headers of ``nvidia-cuda-runtime-cu12``. ``python -m kvpool.kernels.nvrtc_check [sm_80 sm_90]``
prints one line per kernel and exits non-zero if a kernel spills or fails to compile.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvpool.kernels import _loader


class NvrtcUnavailable(RuntimeError):
    pass


@dataclass
class KernelInfo:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    smem: int


def _nvidia_dirs() -> list[Path]:
    dirs = []
    for p in sys.path:
        d = Path(p) / "nvidia"
        if d.is_dir():
            dirs.append(d)
    return dirs


@functools.cache
def _lib() -> ctypes.CDLL:
    cands = []
    for d in _nvidia_dirs():
        cands += sorted(glob.glob(str(d / "cuda_nvrtc" / "lib" / "libnvrtc.so*")))
        cands += sorted(glob.glob(str(d / "cu13" / "lib" / "libnvrtc.so*")))
    cands = [c for c in cands if "builtins" not in c and ".alt." not in c] + ["libnvrtc.so"]
    for c in cands:
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    raise NvrtcUnavailable("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12")


def include_dir() -> str:
    """Directory holding cuda_fp16.h / cuda_bf16.h from the pip wheels."""
    for d in _nvidia_dirs():
        for inc in (d / "cuda_runtime" / "include", d / "cu13" / "include"):
            if (inc / "cuda_fp16.h").exists():
                return str(inc)
    raise NvrtcUnavailable("CUDA headers not found: pip install nvidia-cuda-runtime-cu12")


def version() -> tuple[int, int]:
    lib = _lib()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_family(family: str, arch: str = "sm_90") -> tuple[int, str]:
    """Compile ``family`` to a cubin for ``arch``; returns (cubin bytes, ptxas log)."""
    lib = _lib()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()
    src = _loader.source(family).encode()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            log = _log(lib, prog, "nvrtcGetProgramLog")
            raise RuntimeError(
                f"NVRTC {what} failed for {family} ({arch}): "
                f"{lib.nvrtcGetErrorString(rc).decode()}\n{log}"
            )

    check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), src, f"{family}.cu".encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        opts = [*_loader.NVRTC_OPTIONS, f"-arch={arch}", f"-I{include_dir()}", "-Xptxas=-v"]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        check(lib.nvrtcCompileProgram(prog, len(opts), arr), "nvrtcCompileProgram")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        return size.value, _log(lib, prog, "nvrtcGetProgramLog")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _log(lib, prog, fn: str) -> str:
    size = ctypes.c_size_t()
    if getattr(lib, fn + "Size")(prog, ctypes.byref(size)) != 0:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    getattr(lib, fn)(prog, buf)
    return buf.value.decode(errors="replace")


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_NUM = {
    k: re.compile(p)
    for k, p in {
        "registers": r"Used (\d+) registers",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
        "stack_frame": r"(\d+) bytes stack frame",
        "smem": r"(\d+) bytes smem",
    }.items()
}


def parse_ptxas_log(log: str) -> dict[str, KernelInfo]:
    """Per-kernel registers, spills, stack and static shared memory from ``-Xptxas=-v`` output."""
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in log.replace("\x00", "").splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = m.group(1)
            out[cur] = {k: 0 for k in _NUM}
            continue
        if cur is None:
            continue
        for k, rx in _NUM.items():
            v = rx.search(line)
            if v:
                out[cur][k] = int(v.group(1))
    return {n: KernelInfo(n, **v) for n, v in out.items()}


def check_all(archs=("sm_80", "sm_90")) -> dict[str, dict[str, KernelInfo]]:
    """{arch: {kernel: KernelInfo}} for every family (compiled in parallel threads)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(arch, fam) for arch in archs for fam in _loader.FAMILIES]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        logs = list(pool.map(lambda j: compile_family(j[1], j[0])[1], jobs))
    res: dict[str, dict[str, KernelInfo]] = {arch: {} for arch in archs}
    for (arch, _), log in zip(jobs, logs, strict=True):
        res[arch].update(parse_ptxas_log(log))
    return res


def main(argv: list[str] | None = None) -> int:
    archs = tuple(argv or sys.argv[1:]) or ("sm_80", "sm_90")
    print(f"NVRTC {'.'.join(map(str, version()))}, headers {include_dir()}")
    bad = 0
    for arch, infos in check_all(archs).items():
        for k in sorted(infos):
            i = infos[k]
            flag = ""
            if i.spill_stores or i.spill_loads:
                flag, bad = "  SPILL", bad + 1
            print(
                f"{arch} {k:36s} regs {i.registers:3d}  spill {i.spill_stores}/{i.spill_loads}"
                f"  stack {i.stack_frame}  smem {i.smem}{flag}"
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
