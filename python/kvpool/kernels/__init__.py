"""kvpool.kernels: the GPU data plane (docs/contract.md, K1-K8).

CUDA C kernels (the ``.cu`` files beside this module) that write K/V into the paged cache, copy and
swap blocks, copy recurrent-state slots and run paged decode / prefill attention over the block
tables and slot mappings that ``kvpool.BlockManagerPool`` hands out.

Three backends share one launch layer (``_ops.py``):

- ``"cupy"``: the kernels compiled by NVRTC through ``cupy.RawModule`` on a GPU; arrays are CuPy.
- ``"emulated"``: the same ``.cu`` compiled for the CPU with g++ and ``csrc/cuda_cpu_shim.h``
  (threads of a block run as fibers), called through ctypes; arrays are NumPy.
- ``"numpy"``: the float64 reference (``kvpool.kernels.reference``); arrays are NumPy.

``backend()`` picks cupy when a GPU is present, else emulated when a C++ compiler is present, else
numpy; ``$KVPOOL_KERNEL_BACKEND`` or the ``backend=`` argument of every function overrides it.
Layout: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD),
float16, bfloat16 (``ml_dtypes.bfloat16`` on NumPy) or float32; block 0 is the padding block.
"""

from kvpool.kernels._backend import BACKENDS, backend
from kvpool.kernels._loader import set_thread_order
from kvpool.kernels._ops import (
    copy_blocks,
    copy_linear_state,
    paged_decode_attention,
    paged_prefill_attention,
    swap_blocks,
    write_kv,
)

__all__ = [
    "BACKENDS",
    "backend",
    "copy_blocks",
    "copy_linear_state",
    "paged_decode_attention",
    "paged_prefill_attention",
    "set_thread_order",
    "swap_blocks",
    "write_kv",
]
