"""Torch tensors as the arrays of a ``kvpool.kernels`` backend, without copies.

``numpy`` and ``emulated`` run on NumPy arrays: a CPU tensor is viewed with ``Tensor.numpy()``
(bfloat16 through ``ml_dtypes``); ``cupy`` runs on CuPy arrays: a CUDA tensor is viewed through
DLPack. Views share memory both ways, so the kernels write into the runner's torch caches and
attention outputs come back as tensors without a copy (on the CPU backends, only an output the
backend allocated is wrapped).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool import kernels


class Bridge:
    """Views for one backend (``kvpool.kernels.backend(name)``)."""

    def __init__(self, backend: str | None, device: torch.device):
        self.backend = kernels.backend(backend)
        self.gpu = self.backend == "cupy"
        if self.gpu and device.type != "cuda":
            raise ValueError("backend: 'cupy' needs the model on a CUDA device")
        if not self.gpu and device.type != "cpu":
            raise ValueError(
                f"backend: {self.backend!r} runs on NumPy arrays; the model must be "
                f"on the CPU, got device {device}"
            )
        self.device = device
        if self.gpu:
            import cupy

            self._cp = cupy

    def view(self, t: torch.Tensor) -> Any:
        """The backend array sharing ``t``'s memory (``t`` contiguous where a kernel needs it)."""
        if self.gpu:
            if t.dtype == torch.bfloat16:
                raise TypeError(
                    "bfloat16 caches on the cupy backend are not supported; use float16 or float32"
                )
            return self._cp.from_dlpack(t.detach())
        if t.dtype == torch.bfloat16:
            from ml_dtypes import bfloat16

            return t.detach().view(torch.int16).numpy().view(bfloat16)
        return t.detach().numpy()

    def tensor(self, a: Any) -> torch.Tensor:
        """A tensor sharing the backend array ``a``'s memory."""
        if self.gpu:
            return torch.from_dlpack(a)
        if a.dtype == np.dtype(np.float32) or a.dtype == np.dtype(np.float16):
            return torch.from_numpy(a)
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)

    def index(self, values: Any, dtype=np.int32) -> Any:
        """An index array in the backend's memory (kvpool's exports are NumPy)."""
        a = np.asarray(values, dtype=dtype)
        return self._cp.asarray(a) if self.gpu else a

    def host_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        """A host-tier cache: pinned host memory for cupy (swap_blocks reads it through UVA)."""
        if self.gpu:
            import cupyx

            return cupyx.empty_pinned(shape, dtype=_np_dtype(dtype))
        return np.zeros(shape, dtype=_np_dtype(dtype))


def _np_dtype(dtype: torch.dtype) -> Any:
    if dtype == torch.bfloat16:
        from ml_dtypes import bfloat16

        return bfloat16
    return {torch.float32: np.float32, torch.float16: np.float16}[dtype]
