"""kvpool: a Rust-accelerated KV-cache block manager for LLM serving engines.

The Rust core (``kvpool._core``) provides block handles, free lists, the prefix cache and the
sequence-level pool; ``kvpool.kernels`` holds the GPU data plane; ``kvpool simulate`` is a
serving-workload simulator built on the pool; ``kvpool.tiers`` holds the tiers below the device
(``HierarchyBlockManagerPool`` adds the remote tier to the core's host tier), ``kvpool.index``
the router side. docs/architecture.md maps the package. The rules cited as "R<n>" are those of
the contract (docs/contract.md).
"""

from kvpool._core import (
    DEFAULT_HASH_SEED,
    AllocationPlan,
    Block,
    BlockManager,
    BlockManagerPool,
    CompositeBlockManager,
    ConcurrentBlockManager,
    InvariantError,
    KVEvent,
    KVIndex,
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
    XTensorBlockManager,
    __version__,
    decode_events,
    encode_events,
    hash_blocks,
)
from kvpool.index import router
from kvpool.tiers.hierarchy import HierarchyBlockManagerPool

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
    "KVIndex",
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
    "XTensorBlockManager",
    "__version__",
    "decode_events",
    "encode_events",
    "hash_blocks",
    "router",
]
