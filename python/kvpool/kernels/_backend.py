"""The three backends of kvpool.kernels (K8) and how one is chosen."""

from __future__ import annotations

import functools
import os

import numpy as np

from kvpool.kernels import _loader

BACKENDS = ("cupy", "emulated", "numpy")
ENV = "KVPOOL_KERNEL_BACKEND"
# Streaming multiprocessors assumed by the emulated backend's split heuristic (an H200 has 132),
# so that CPU runs take the same launch decisions as the GPU the kernels are tuned for.
EMULATED_NUM_SMS = 132


@functools.cache
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def backend(name: str | None = None) -> str:
    """Name of the backend a call with ``backend=name`` uses.

    ``name`` if given, else ``$KVPOOL_KERNEL_BACKEND``, else ``"cupy"`` when CuPy sees a GPU,
    ``"emulated"`` when a C++ compiler is present, ``"numpy"`` otherwise.
    """
    if name is None:
        name = os.environ.get(ENV) or None
        if name is None:
            if gpu_available():
                return "cupy"
            return "emulated" if _loader.compiler() else "numpy"
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


class Backend:
    """What the launch code needs from a backend: arrays, kernels, device facts."""

    name: str
    xp = np
    num_sms = EMULATED_NUM_SMS

    def is_array(self, a) -> bool:
        return isinstance(a, np.ndarray)

    def asarray(self, a, dtype):
        return np.ascontiguousarray(a, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def ptr(self, a) -> int:
        return a.ctypes.data

    def kernel(self, family: str, name: str):
        raise NotImplementedError


class NumpyBackend(Backend):
    name = "numpy"


class EmulatedBackend(Backend):
    name = "emulated"

    def __init__(self, sanitize: bool = False):
        self.sanitize = sanitize

    def kernel(self, family, name):
        return _loader.emulated_kernel(family, name, self.sanitize)


class CupyBackend(Backend):
    name = "cupy"

    def __init__(self):
        import cupy

        self.xp = cupy
        self.num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

    def is_array(self, a) -> bool:
        return isinstance(a, self.xp.ndarray)

    def asarray(self, a, dtype):
        return self.xp.ascontiguousarray(self.xp.asarray(a, dtype=dtype))

    def to_host(self, a) -> np.ndarray:
        return self.xp.asnumpy(a) if isinstance(a, self.xp.ndarray) else np.asarray(a)

    def ptr(self, a) -> int:
        return a.data.ptr if isinstance(a, self.xp.ndarray) else host_device_pointer(a)

    def kernel(self, family, name):
        return _loader.cupy_kernel(family, name)


def host_device_pointer(a: np.ndarray) -> int:
    """Device address of a NumPy array in pinned host memory (UVA); ValueError if not pinned."""
    from cupy.cuda import runtime

    try:
        attr = runtime.pointerGetAttributes(a.ctypes.data)
        kind = getattr(attr, "type", getattr(attr, "memoryType", None))
    except Exception:
        kind = None
    if kind != getattr(runtime, "memoryTypeHost", 1):  # cudaMemoryTypeHost
        raise ValueError("a NumPy cache must live in pinned host memory (cupyx.empty_pinned)")
    return attr.devicePointer


@functools.cache
def _get(name: str, sanitize: bool) -> Backend:
    if name == "cupy":
        return CupyBackend()
    if name == "emulated":
        return EmulatedBackend(sanitize)
    return NumpyBackend()


def get(name: str | None = None) -> Backend:
    sanitize = os.environ.get("KVPOOL_EMU_SANITIZE", "") not in ("", "0")
    return _get(backend(name), sanitize)
