"""kvpool: a Rust-accelerated KV-cache block manager for LLM serving engines.

The Rust core (``kvpool._core``) provides block handles, free lists, the prefix cache and the
sequence-level pool; ``kvpool.kernels`` holds the GPU data plane; ``kvpool simulate`` is a
serving-workload simulator built on the pool. The rules cited as "R<n>" are those of the
contract (docs/contract.md).
"""

from kvpool._core import (
    DEFAULT_HASH_SEED,
    AllocationPlan,
    Block,
    BlockManager,
    BlockManagerPool,
    CompositeBlockManager,
    ConcurrentBlockManager,
    HierarchyBlockManagerPool,
    InvariantError,
    KVEvent,
    KVPoolError,
    LinearStatePlan,
    LinearStatePrefixCache,
    OutOfBlocksError,
    PrefixCache,
    Sequence,
    SequenceBatch,
    SingleBlockManager,
    SlidingWindowBlockManager,
    TransferPlan,
    __version__,
    hash_blocks,
)

__all__ = [
    "DEFAULT_HASH_SEED",
    "AllocationPlan",
    "Block",
    "BlockManager",
    "BlockManagerPool",
    "CompositeBlockManager",
    "ConcurrentBlockManager",
    "HierarchyBlockManagerPool",
    "InvariantError",
    "KVEvent",
    "KVPoolError",
    "LinearStatePlan",
    "LinearStatePrefixCache",
    "OutOfBlocksError",
    "PrefixCache",
    "Sequence",
    "SequenceBatch",
    "SingleBlockManager",
    "SlidingWindowBlockManager",
    "TransferPlan",
    "__version__",
    "hash_blocks",
]
