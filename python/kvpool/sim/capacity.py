"""KV-cache sizing: bytes per block for a model shape, blocks that fit a memory budget.

A :class:`ModelShape` is the attention shape that sets the KV footprint (layers, KV heads, head
dim, dtype); ``heads`` (query heads) and ``params`` (parameter count) are optional and needed only
by the step-time roofline (:mod:`kvpool.sim.timing`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DTYPE_BYTES", "MODELS", "ModelShape", "blocks_for_budget", "bytes_per_block"]

DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class ModelShape:
    """The attention shape that sets the KV footprint: K and V of every attention layer."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    heads: int | None = None  # query heads (the roofline's attention FLOPs)
    params: float | None = None  # parameter count (the roofline's linear FLOPs and weight bytes)

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


# Public architecture numbers (attention layers, KV heads, head dim, query heads, parameters) of a
# few common models, from their released configs.
MODELS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(32, 8, 128, heads=32, params=8.03e9),
    "llama3-70b": ModelShape(80, 8, 128, heads=64, params=70.6e9),
    "mistral-7b": ModelShape(32, 8, 128, heads=32, params=7.24e9),
    "qwen2.5-7b": ModelShape(28, 4, 128, heads=28, params=7.62e9),
    "qwen2.5-72b": ModelShape(80, 8, 128, heads=64, params=72.7e9),
    "qwen3-8b": ModelShape(36, 8, 128, heads=32, params=8.19e9),
}


def bytes_per_block(shape: ModelShape, block_size: int) -> int:
    return shape.bytes_per_token() * block_size


def blocks_for_budget(shape: ModelShape, block_size: int, gib: float) -> int:
    """How many blocks (block 0, the padding block, included) fit in ``gib`` GiB per rank."""
    return int(gib * (1 << 30) // bytes_per_block(shape, block_size))
