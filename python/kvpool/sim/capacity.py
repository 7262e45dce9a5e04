"""KV-cache sizing: bytes per block for a model shape, blocks that fit a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DTYPE_BYTES", "MODELS", "ModelShape", "blocks_for_budget", "bytes_per_block"]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelShape:
    """The attention shape that sets the KV footprint: K and V of every attention layer."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


# Public architecture numbers (attention layers, KV heads, head dim) of a few common models.
MODELS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(32, 8, 128),
    "llama3-70b": ModelShape(80, 8, 128),
    "mistral-7b": ModelShape(32, 8, 128),
    "qwen2.5-7b": ModelShape(28, 4, 128),
    "qwen2.5-72b": ModelShape(80, 8, 128),
    "qwen3-8b": ModelShape(36, 8, 128),
}


def bytes_per_block(shape: ModelShape, block_size: int) -> int:
    return shape.bytes_per_token() * block_size


def blocks_for_budget(shape: ModelShape, block_size: int, gib: float) -> int:
    """How many blocks (block 0, the padding block, included) fit in ``gib`` GiB per rank."""
    return int(gib * (1 << 30) // bytes_per_block(shape, block_size))
