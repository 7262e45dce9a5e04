"""Build and load the kernel families: CuPy RawModule on a GPU, g++ + emulation header on a CPU.

Every family is one ``.cu`` file beside this module. Its local ``#include "..."`` lines are inlined
(so CuPy's cache, keyed by source text, sees header changes), then the same text is either handed to
NVRTC through ``cupy.RawModule`` or prefixed with ``csrc/kvpool_emu.h`` and compiled by g++ into a
shared library, cached under ``$KVPOOL_KERNEL_CACHE`` (default ``~/.cache/kvpool/kernels``) in a
folder named by the hash of the source, the flags and the compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
FAMILIES = ("cache_ops", "decode_attention", "prefill_attention")

# Options shared by the cupy backend and the NVRTC compile check.
NVRTC_OPTIONS = ("-std=c++17", "-lineinfo")
EMU_FLAGS = (
    "-std=c++20",
    "-O2",
    "-fno-strict-aliasing",
    "-fPIC",
    "-shared",
    "-w",
    "-U_FORTIFY_SOURCE",
)  # fibers longjmp between stacks: no __longjmp_chk
ASAN_FLAGS = (
    "-std=c++20",
    "-O0",
    "-g",
    "-fno-strict-aliasing",
    "-fPIC",
    "-shared",
    "-w",
    "-fsanitize=address",
    "-fno-omit-frame-pointer",
)

_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)
_lock = threading.Lock()
_launch_lock = threading.Lock()


def source(family: str) -> str:
    """The text of ``<family>.cu`` with its local includes inlined (each once)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}")
    seen: set[str] = set()

    def expand(path: Path) -> str:
        def sub(m: re.Match) -> str:
            name = m.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return expand(HERE / name)

        return _INCLUDE.sub(sub, path.read_text())

    return expand(HERE / f"{family}.cu")


def compiler() -> str | None:
    """The C++ compiler of the emulated backend (``$CXX`` or g++), or None."""
    cxx = os.environ.get("CXX", "g++")
    return shutil.which(cxx)


def cache_dir() -> Path:
    root = os.environ.get("KVPOOL_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kvpool" / "kernels"


@functools.cache
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout


def emulated_source(family: str) -> str:
    return f'#include "kvpool_emu.h"\n{source(family)}'


def build_emulated(family: str, sanitize: bool = False) -> Path:
    """Compile ``family`` for the CPU (once per source hash) and return the library path."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the emulated backend needs a C++20 compiler (g++ or $CXX)")
    flags = ASAN_FLAGS if sanitize else EMU_FLAGS
    src = emulated_source(family)
    shim = "".join((CSRC / f).read_text() for f in ("cuda_cpu_shim.h", "kvpool_emu.h"))
    key = hashlib.sha256(
        "\0".join([src, shim, " ".join(flags), _compiler_version(cxx)]).encode()
    ).hexdigest()[:16]
    out = cache_dir() / key / f"{family}{'_asan' if sanitize else ''}.so"
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home: build under the temp dir
        out = Path(tempfile.gettempdir()) / "kvpool-kernels" / key / out.name
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        cpp = Path(tmp) / f"{family}.cpp"
        cpp.write_text(src)
        lib = Path(tmp) / out.name
        proc = subprocess.run(
            [cxx, *flags, f"-I{CSRC}", str(cpp), "-o", str(lib)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"building the emulated {family} kernels failed:\n{proc.stderr}")
        os.replace(lib, out)  # atomic: concurrent builders agree
    return out


class EmulatedKernel:
    """A kernel of an emulated library, called like a CuPy RawKernel: ``k(grid, block, args)``.

    ``args`` are NumPy arrays (passed by pointer) and NumPy scalars (np.int32, np.int64,
    np.uint64, np.float32), exactly what the cupy backend passes. Their sizes are checked
    against the kernel's C++ signature before the first launch.
    """

    _CT = {
        np.dtype(np.int32): ctypes.c_int32,
        np.dtype(np.int64): ctypes.c_int64,
        np.dtype(np.uint64): ctypes.c_uint64,
        np.dtype(np.float32): ctypes.c_float,
    }

    def __init__(self, lib: ctypes.CDLL, name: str):
        self.name = name
        try:
            self._fn = getattr(lib, f"kvpool_emu_{name}")
            sig = getattr(lib, f"kvpool_emu_sig_{name}")
        except AttributeError:
            raise RuntimeError(f"kernel {name!r} is not in the emulated library") from None
        self._fn.restype = None
        self._fn.argtypes = [
            ctypes.POINTER(ctypes.c_uint),
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        sig.restype = ctypes.c_char_p
        self.arg_sizes = [int(x) for x in sig().decode().split(",") if x]

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        if len(args) != len(self.arg_sizes):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.arg_sizes)}")
        boxed = []
        for i, (a, size) in enumerate(zip(args, self.arg_sizes, strict=True)):
            c: Any
            if isinstance(a, np.ndarray):
                c = ctypes.c_void_p(a.ctypes.data)
            elif isinstance(a, np.generic) and a.dtype in self._CT:
                c = self._CT[a.dtype](a.item())
            else:
                raise TypeError(
                    f"{self.name}: argument {i} has unsupported type {type(a).__name__}"
                )
            if ctypes.sizeof(c) != size:
                raise TypeError(
                    f"{self.name}: argument {i} is {ctypes.sizeof(c)} bytes, "
                    f"the kernel takes {size}"
                )
            boxed.append(c)
        ptrs = (ctypes.c_void_p * max(1, len(boxed)))(*[ctypes.addressof(c) for c in boxed])
        dims = (ctypes.c_uint * 6)(*_dim3(grid), *_dim3(block))
        if 0 in dims:
            return
        with _launch_lock:  # the emulator's grid state is global: one launch at a time
            self._fn(dims, shared_mem, ptrs)


def _dim3(d) -> tuple[int, int, int]:
    d = tuple(int(x) for x in (d if isinstance(d, tuple) else (d,)))
    return (d + (1, 1, 1))[:3]


@functools.cache
def emulated_library(family: str, sanitize: bool = False) -> ctypes.CDLL:
    with _lock:
        return ctypes.CDLL(str(build_emulated(family, sanitize)))


@functools.cache
def emulated_kernel(family: str, name: str, sanitize: bool = False) -> EmulatedKernel:
    return EmulatedKernel(emulated_library(family, sanitize), name)


THREAD_ORDERS = {"forward": 0, "reverse": 1, "random": 2}


def set_thread_order(order: str = "forward", seed: int = 1, sanitize: bool = False) -> None:
    """Schedule order of the emulated threads in every loaded family (exposes missing barriers)."""
    if order not in THREAD_ORDERS:
        raise ValueError(f"order must be one of {sorted(THREAD_ORDERS)}, got {order!r}")
    for family in FAMILIES:
        emulated_library(family, sanitize).kvpool_emu_set_order(
            ctypes.c_int(THREAD_ORDERS[order]), ctypes.c_uint(seed)
        )


@functools.cache
def cupy_module(family: str):
    import cupy

    return cupy.RawModule(code=source(family), options=NVRTC_OPTIONS)


@functools.cache
def cupy_kernel(family: str, name: str):
    return cupy_module(family).get_function(name)
