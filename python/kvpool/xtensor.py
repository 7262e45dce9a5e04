"""Elastic KV memory on CUDA virtual memory: the GPU page backend of ``kvpool.XTensorBlockManager``.

The KV cache is the NHD layout of docs/contract.md's K1, one ``[num_blocks, block_size,
num_kv_heads, head_dim]`` tensor for K and one for V per layer. :class:`CudaPageBackend` reserves a
virtual range for each of those ``2 * num_layers`` tensors (``cuMemAddressReserve``) and backs page
``p`` (blocks ``p * blocks_per_page ..``) with one physical allocation per tensor only while the
manager needs it (``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``; ``cuMemUnmap`` +
``cuMemRelease`` to give it back). The tensors are CuPy arrays over the reserved ranges, so
``kvpool.kernels`` work on them unchanged; only blocks of mapped pages may be touched, which is what
the manager guarantees for every block it hands out (and for the padding block 0).

The driver is reached through ``ctypes`` on ``libcuda`` (:class:`CudaDriver`); any object with the
same eight methods can stand in for it (the tests use a fake one, so the paging logic is tested
without a GPU). A page the device has no memory for raises ``MemoryError``, which the manager
turns into ``OutOfBlocksError`` (allocation) or ``False`` (``try_reserve``).

>>> backend = CudaPageBackend(4096, 16, num_kv_heads=8, head_dim=128, num_layers=32)
>>> manager = kvpool.XTensorBlockManager(4096, 16, blocks_per_page=backend.blocks_per_page,
...                                      backend=backend)
>>> k0, v0 = backend.kv_cache(0)        # cupy arrays [4096, 16, 8, 128]
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Protocol

import numpy as np

__all__ = ["CudaDriver", "CudaError", "CudaPageBackend", "Driver"]

CUDA_ERROR_OUT_OF_MEMORY = 2
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_ACCESS_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_MINIMUM = 0  # CU_MEM_ALLOC_GRANULARITY_MINIMUM


class CudaError(RuntimeError):
    """A CUDA driver call failed (other than for lack of memory, which is ``MemoryError``)."""

    def __init__(self, call: str, code: int, message: str = ""):
        super().__init__(f"{call} failed with CUDA error {code}{': ' + message if message else ''}")
        self.call = call
        self.code = code


class Driver(Protocol):
    """The virtual-memory calls :class:`CudaPageBackend` needs (addresses and handles are ints)."""

    def granularity(self, device: int) -> int: ...
    def reserve(self, size: int, alignment: int) -> int: ...
    def free_address(self, address: int, size: int) -> None: ...
    def create(self, size: int, device: int) -> int: ...
    def map(self, address: int, size: int, handle: int) -> None: ...
    def set_access(self, address: int, size: int, device: int) -> None: ...
    def unmap(self, address: int, size: int) -> None: ...
    def release(self, handle: int) -> None: ...


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaDriver:
    """The CUDA driver's virtual-memory management through ``ctypes`` (``libcuda.so.1``).

    Makes the device's primary context current (the one CuPy's runtime calls use), so the
    arrays of :class:`CudaPageBackend` and CuPy's own allocations live in the same context.
    """

    def __init__(self, device: int = 0, library: str = "libcuda.so.1"):
        self._cuda = ctypes.CDLL(library)
        self._check("cuInit", self._cuda.cuInit(0))
        handle = ctypes.c_int()
        self._check("cuDeviceGet", self._cuda.cuDeviceGet(ctypes.byref(handle), device))
        context = ctypes.c_void_p()
        self._check(
            "cuDevicePrimaryCtxRetain",
            self._cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle),
        )
        self._check("cuCtxSetCurrent", self._cuda.cuCtxSetCurrent(context))
        u64, size_t = ctypes.c_ulonglong, ctypes.c_size_t
        for name, args in {
            "cuMemGetAllocationGranularity": [
                ctypes.POINTER(size_t),
                ctypes.c_void_p,
                ctypes.c_int,
            ],
            "cuMemAddressReserve": [ctypes.POINTER(u64), size_t, size_t, u64, u64],
            "cuMemAddressFree": [u64, size_t],
            "cuMemCreate": [ctypes.POINTER(u64), size_t, ctypes.c_void_p, u64],
            "cuMemMap": [u64, size_t, size_t, u64, u64],
            "cuMemSetAccess": [u64, size_t, ctypes.c_void_p, size_t],
            "cuMemUnmap": [u64, size_t],
            "cuMemRelease": [u64],
        }.items():
            function = getattr(self._cuda, name)
            function.argtypes, function.restype = args, ctypes.c_int

    def _check(self, call: str, code: int) -> None:
        if code == 0:
            return
        if code == CUDA_ERROR_OUT_OF_MEMORY:
            raise MemoryError(f"{call}: the device is out of memory")
        text = ctypes.c_char_p()
        self._cuda.cuGetErrorString(code, ctypes.byref(text))
        raise CudaError(call, code, (text.value or b"").decode())

    @staticmethod
    def _prop(device: int) -> _AllocationProp:
        return _AllocationProp(
            type=_ALLOCATION_PINNED, location=_Location(_LOCATION_DEVICE, device)
        )

    def granularity(self, device: int) -> int:
        out, prop = ctypes.c_size_t(), self._prop(device)
        self._check(
            "cuMemGetAllocationGranularity",
            self._cuda.cuMemGetAllocationGranularity(
                ctypes.byref(out), ctypes.byref(prop), _GRANULARITY_MINIMUM
            ),
        )
        return out.value

    def reserve(self, size: int, alignment: int) -> int:
        out = ctypes.c_ulonglong()
        self._check(
            "cuMemAddressReserve",
            self._cuda.cuMemAddressReserve(ctypes.byref(out), size, alignment, 0, 0),
        )
        return out.value

    def free_address(self, address: int, size: int) -> None:
        self._check("cuMemAddressFree", self._cuda.cuMemAddressFree(address, size))

    def create(self, size: int, device: int) -> int:
        out, prop = ctypes.c_ulonglong(), self._prop(device)
        self._check(
            "cuMemCreate", self._cuda.cuMemCreate(ctypes.byref(out), size, ctypes.byref(prop), 0)
        )
        return out.value

    def map(self, address: int, size: int, handle: int) -> None:
        self._check("cuMemMap", self._cuda.cuMemMap(address, size, 0, handle, 0))

    def set_access(self, address: int, size: int, device: int) -> None:
        desc = _AccessDesc(location=_Location(_LOCATION_DEVICE, device), flags=_ACCESS_READ_WRITE)
        self._check(
            "cuMemSetAccess", self._cuda.cuMemSetAccess(address, size, ctypes.byref(desc), 1)
        )

    def unmap(self, address: int, size: int) -> None:
        self._check("cuMemUnmap", self._cuda.cuMemUnmap(address, size))

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", self._cuda.cuMemRelease(handle))


class CudaPageBackend:
    """KV tensors on CUDA virtual memory, mapped page by page (module doc).

    Parameters
    ----------
    num_blocks, block_size : the manager's (block 0, the padding block, included).
    num_kv_heads, head_dim : the KV layout, docs/contract.md's K1.
    num_layers : layers; each has a K and a V tensor.
    dtype : element type (``"float16"``, ``"bfloat16"``, ``"float32"`` or a NumPy dtype).
    blocks_per_page : blocks per page; default the fewest whose bytes per tensor are a multiple
        of the device's allocation granularity (2 MiB on current GPUs). Given, it must be such a
        number.
    device : CUDA device ordinal.
    driver : a :class:`Driver`; default :class:`CudaDriver` for ``device``.

    Attributes
    ----------
    blocks_per_page, num_pages : the paging (pass ``blocks_per_page`` to the manager).
    page_bytes : physical bytes one page costs, all tensors (the manager reads it).
    tensor_page_bytes : bytes of one page in one tensor (a multiple of the granularity).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_layers: int = 1,
        dtype: Any = "float16",
        blocks_per_page: int | None = None,
        device: int = 0,
        driver: Driver | None = None,
    ):
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_layers", num_layers),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name}: must be at least 1, got {value}")
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"device: must be an int, got {type(device).__name__}")
        self.dtype = _dtype(dtype)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.num_layers = num_kv_heads, head_dim, num_layers
        self.device = device
        self.driver: Driver = driver if driver is not None else CudaDriver(device)
        self.block_bytes = block_size * num_kv_heads * head_dim * self.dtype.itemsize
        granularity = self.driver.granularity(device)
        fewest = granularity // math.gcd(granularity, self.block_bytes)
        if blocks_per_page is None:
            blocks_per_page = fewest
        elif isinstance(blocks_per_page, bool) or not isinstance(blocks_per_page, int):
            raise TypeError(
                f"blocks_per_page: must be an int, got {type(blocks_per_page).__name__}"
            )
        elif blocks_per_page < 1 or blocks_per_page % fewest:
            raise ValueError(
                f"blocks_per_page: must be a positive multiple of {fewest} (pages of "
                f"{self.block_bytes}-byte blocks must fill whole {granularity}-byte allocations), "
                f"got {blocks_per_page}"
            )
        self.blocks_per_page = blocks_per_page
        self.num_pages = -(-num_blocks // blocks_per_page)
        self.tensor_page_bytes = blocks_per_page * self.block_bytes
        self.num_tensors = 2 * num_layers
        self.page_bytes = self.tensor_page_bytes * self.num_tensors
        self.tensor_bytes = self.num_pages * self.tensor_page_bytes
        self.reserved_bytes = self.tensor_bytes * self.num_tensors
        self.base = self.driver.reserve(self.reserved_bytes, granularity)
        self._handles: dict[int, list[int]] = {}  # mapped page -> its allocation per tensor
        self._closed = False

    # --- the PageBackend protocol (called by the manager, with the GIL) ------------------------

    def _address(self, tensor: int, page: int) -> int:
        return self.base + tensor * self.tensor_bytes + page * self.tensor_page_bytes

    def map_page(self, page: int) -> None:
        """Backs ``page`` of every tensor with device memory; ``MemoryError`` if there is none."""
        if self._closed:
            raise RuntimeError("CudaPageBackend is closed")
        if not 0 <= page < self.num_pages or page in self._handles:
            raise ValueError(f"page: {page} is out of range or already mapped")
        size, done = self.tensor_page_bytes, []
        try:
            for tensor in range(self.num_tensors):
                handle = self.driver.create(size, self.device)
                try:
                    self.driver.map(self._address(tensor, page), size, handle)
                except BaseException:
                    self.driver.release(handle)
                    raise
                done.append(handle)
                self.driver.set_access(self._address(tensor, page), size, self.device)
        except BaseException:
            for tensor, handle in reversed(list(enumerate(done))):  # nothing changed
                self.driver.unmap(self._address(tensor, page), size)
                self.driver.release(handle)
            raise
        self._handles[page] = done

    def unmap_page(self, page: int) -> None:
        """Returns ``page``'s device memory (every block on it is free)."""
        handles = self._handles.get(page)
        if handles is None:
            raise ValueError(f"page: {page} is not mapped")
        for tensor, handle in enumerate(handles):
            self.driver.unmap(self._address(tensor, page), self.tensor_page_bytes)
            self.driver.release(handle)
        del self._handles[page]

    @property
    def resident_bytes(self) -> int:
        """Device memory mapped now."""
        return len(self._handles) * self.page_bytes

    def mapped_pages(self) -> list[int]:
        """The mapped pages, ascending."""
        return sorted(self._handles)

    # --- the KV tensors --------------------------------------------------------------------------

    def tensor_address(self, layer: int, which: str) -> int:
        """Device address of layer ``layer``'s ``"k"`` or ``"v"`` tensor."""
        if not 0 <= layer < self.num_layers or which not in ("k", "v"):
            raise ValueError(f"layer/which: no tensor {which!r} of layer {layer}")
        return self._address(2 * layer + (which == "v"), 0)

    def kv_cache(self, layer: int):
        """``(k_cache, v_cache)`` of ``layer``: CuPy arrays ``[num_blocks, block_size,
        num_kv_heads, head_dim]`` over the reserved ranges (only mapped pages may be touched)."""
        import cupy

        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        arrays = []
        for which in ("k", "v"):
            memory = cupy.cuda.UnownedMemory(
                self.tensor_address(layer, which), self.tensor_bytes, self, self.device
            )
            arrays.append(cupy.ndarray(shape, self.dtype, cupy.cuda.MemoryPointer(memory, 0)))
        return arrays[0], arrays[1]

    def close(self) -> None:
        """Unmaps every page and frees the reservation (the manager must be gone or idle)."""
        if self._closed:
            return
        for page in list(self._handles):
            self.unmap_page(page)
        self.driver.free_address(self.base, self.reserved_bytes)
        self._closed = True

    def __repr__(self) -> str:
        return (
            f"CudaPageBackend(num_pages={self.num_pages}, blocks_per_page={self.blocks_per_page}, "
            f"page_bytes={self.page_bytes}, mapped={len(self._handles)})"
        )


def _dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"dtype: {e}") from None
