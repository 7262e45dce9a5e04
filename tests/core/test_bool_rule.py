"""R29's "one rule for bools" (and F10, G8) over every public entry point, from ONE table.

A bool is never an integer argument: passing True/False where a count, an id, a rank, a size or
a seed goes is a TypeError naming the argument, and so is a float (1.5 and 2.0 alike: an int is
asked for). A flag must be a bool, Python's or NumPy's: None (no flag documents None as
meaningful), an int, a float or a str is a TypeError naming it.

``TABLE`` below is the single list of those arguments: entry point -> (a call that is valid with
every argument at its default, the integer and flag arguments it takes). The last test scans the
typed signatures (the ``_core.pyi`` stubs, and the annotations of the Python modules in
``SCANNED``) for int and bool parameters and fails when one is missing from the table (or from
``EXEMPT``, each with its reason): a new int or flag argument must join the table.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

import kvpool
import kvpool.kernels as kernels
import numpy as np
import pytest
from kvpool.integrations.nanovllm import BlockManager as NanoBlockManager
from kvpool.remote import RedisEventPublisher, RedisRemoteTier, make_namespace, read_events
from kvpool.router import Router
from kvpool.tiers.memory import MemoryRemoteTier
from kvpool.transfer import NumpyTransferExecutor
from kvpool.xtensor import CudaPageBackend

COUNT = "count"  # an int (a count, an id, a rank, a size, a seed): no bool, no float
FLAG = "flag"  # a bool: no None, no int, no float, no str
OPTIONAL_FLAG = "optional flag"  # a bool, or None for the default: no int, no float, no str

TOKENS = list(range(8))


# --- fixtures the calls build on (each call builds its own objects) ---------------------------


def _pool(**kw):
    return kvpool.BlockManagerPool(16, 4, **kw)


def _seq_in(pool, tokens=TOKENS):
    seq = kvpool.Sequence(list(tokens))
    assert pool.allocate(seq)
    return seq


def _computed(pool):
    seq = _seq_in(pool)
    seq.num_computed_tokens = len(seq)
    return seq


def _hier(**kw):
    return kvpool.HierarchyBlockManagerPool(16, 16, 4, **kw)


def _elastic(**kw):
    return _pool(xtensor={"blocks_per_page": 2, "page_bytes": 1024}, **kw)


def _xtensor(**kw):
    return kvpool.XTensorBlockManager(16, 4, blocks_per_page=2, page_bytes=1024, **kw)


def _linear_cache():
    pool = _pool(linear_state_slots=4)
    return pool.linear_state_cache(0)


def _composite():
    return kvpool.CompositeBlockManager([(16, 4, None), (16, 4, 8)])


def _index_with_events():
    ix = kvpool.KVIndex()
    return ix


def _hashes(n=2, block_size=4):
    return kvpool.KVIndex().hash_blocks(TOKENS[: n * block_size], block_size)


class _Driver:
    """The CUDA driver seam, faked: only what CudaPageBackend's constructor calls."""

    def granularity(self, device):
        return 4096

    def reserve(self, size, alignment):
        return 1 << 30


def _kernel_arrays():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    cache = rng.standard_normal((4, 4, 2, 64)).astype(np.float32)
    return q, cache, cache.copy(), np.array([[1, 2]], dtype=np.int32), np.array([5], dtype=np.int32)


def _decode(**kw):
    q, k, v, bt, lens = _kernel_arrays()
    return kernels.paged_decode_attention(q, k, v, bt, lens, 0.5, **{"backend": "numpy", **kw})


def _prefill(**kw):
    q, k, v, bt, lens = _kernel_arrays()
    return kernels.paged_prefill_attention(
        q, k, v, bt, np.array([0, 1], dtype=np.int32), lens, 0.5, **{"backend": "numpy", **kw}
    )


def _write_kv(**kw):
    q, k, v, _, _ = _kernel_arrays()
    return kernels.write_kv(q, q, k, v, np.array([5], dtype=np.int64), **{"backend": "numpy", **kw})


def _copy_blocks(**kw):
    _, k, v, _, _ = _kernel_arrays()
    src, dst = np.array([1], dtype=np.int32), np.array([2], dtype=np.int32)
    return kernels.copy_blocks([k, v], src, dst, **{"backend": "numpy", **kw})


def _copy_linear_state(**kw):
    state = np.zeros((4, 3), dtype=np.float32)
    slots = np.array([1], dtype=np.int32), np.array([2], dtype=np.int32)
    return kernels.copy_linear_state(state, *slots, **{"backend": "numpy", **kw})


def _swap_blocks(**kw):
    _, k, v, _, _ = _kernel_arrays()
    src, dst = np.array([1], dtype=np.int32), np.array([2], dtype=np.int32)
    return kernels.swap_blocks(k, v, src, dst, **{"backend": "numpy", **kw})


def _with(defaults: dict, call: Callable) -> Callable:
    """A call taking keyword overrides of `defaults`."""
    return lambda **kw: call(**{**defaults, **kw})


# The pool options of both pool classes: one list (they share their option extractor).
POOL_OPTIONS = {
    "dp_size": COUNT,
    "enable_prefix_cache": FLAG,
    "num_single_blocks": COUNT,
    "linear_state_slots": COUNT,
    "checkpoint_interval": COUNT,
    "linear_state_blocks": COUNT,
    "block_bytes": COUNT,
    "concurrent": FLAG,
    "enable_events": FLAG,
    "event_replay": COUNT,
    "hash_seed": COUNT,
    "sliding_window": COUNT,
    "attention_chunk_size": COUNT,
    "window_groups": COUNT,
    "state_groups": COUNT,
    "swa_num_blocks": COUNT,
    "debug_hash_bits": COUNT,
    "dedup": FLAG,
    "retention_tokens": COUNT,
    "shared_blocks": OPTIONAL_FLAG,
    "protected_percent": COUNT,
}
MANAGER_ARGS = {
    "num_blocks": COUNT,
    "block_size": COUNT,
    "enable_prefix_cache": FLAG,
    "hash_seed": COUNT,
    "debug_hash_bits": COUNT,
}

# entry point (as the stubs or the module name it) -> (valid call with keyword overrides, args)
TABLE: dict[str, tuple[Callable, dict[str, str]]] = {
    # --- the physical managers
    "BlockManager.__new__": (
        _with({"num_blocks": 8, "block_size": 4}, kvpool.BlockManager),
        MANAGER_ARGS,
    ),
    "BlockManager.allocate": (
        _with({"n": 1}, lambda **kw: kvpool.BlockManager(8, 4).allocate(**kw)),
        {"n": COUNT},
    ),
    "BlockManager.evict": (
        _with({"n": 1}, lambda **kw: kvpool.BlockManager(8, 4).evict(**kw)),
        {"n": COUNT},
    ),
    "ConcurrentBlockManager.__new__": (
        _with({"num_blocks": 8, "block_size": 4}, kvpool.ConcurrentBlockManager),
        MANAGER_ARGS,
    ),
    "ConcurrentBlockManager.allocate": (
        _with({"n": 1}, lambda **kw: kvpool.ConcurrentBlockManager(8, 4).allocate(**kw)),
        {"n": COUNT},
    ),
    "ConcurrentBlockManager.evict": (
        _with({"n": 1}, lambda **kw: kvpool.ConcurrentBlockManager(8, 4).evict(**kw)),
        {"n": COUNT},
    ),
    "SingleBlockManager.__new__": (
        _with({"num_slots": 8}, kvpool.SingleBlockManager),
        {"num_slots": COUNT},
    ),
    "SingleBlockManager.allocate": (
        _with({"n": 1}, lambda **kw: kvpool.SingleBlockManager(8).allocate(**kw)),
        {"n": COUNT},
    ),
    "SingleBlockManager.evict": (
        _with({"n": 1}, lambda **kw: kvpool.SingleBlockManager(8).evict(**kw)),
        {"n": COUNT},
    ),
    "hash_blocks": (
        _with({"token_ids": TOKENS, "block_size": 4}, kvpool.hash_blocks),
        {"block_size": COUNT, "hash_seed": COUNT},
    ),
    "SlidingWindowBlockManager.__new__": (
        _with({"num_blocks": 8, "block_size": 4, "window": 8}, kvpool.SlidingWindowBlockManager),
        {"num_blocks": COUNT, "block_size": COUNT, "window": COUNT},
    ),
    "SlidingWindowBlockManager.first_needed_block": (
        _with(
            {"num_computed_tokens": 9},
            lambda **kw: kvpool.SlidingWindowBlockManager(8, 4, 8).first_needed_block(**kw),
        ),
        {"num_computed_tokens": COUNT},
    ),
    "SlidingWindowBlockManager.allocate": (
        _with({"n": 1}, lambda **kw: kvpool.SlidingWindowBlockManager(8, 4, 8).allocate(**kw)),
        {"n": COUNT},
    ),
    "CompositeBlockManager.block_size": (
        _with({"group": 1}, lambda **kw: _composite().block_size(**kw)),
        {"group": COUNT},
    ),
    "CompositeBlockManager.window": (
        _with({"group": 1}, lambda **kw: _composite().window(**kw)),
        {"group": COUNT},
    ),
    "CompositeBlockManager.counts": (
        _with({"group": 1}, lambda **kw: _composite().counts(**kw)),
        {"group": COUNT},
    ),
    "CompositeBlockManager.allocate": (
        _with({"group": 0, "n": 1}, lambda **kw: _composite().allocate(**kw)),
        {"group": COUNT, "n": COUNT},
    ),
    "LinearStatePrefixCache.__new__": (
        _with({"num_slots": 4}, kvpool.LinearStatePrefixCache),
        {"num_slots": COUNT},
    ),
    "LinearStatePrefixCache.release_live_slot": (
        lambda **kw: (lambda c: c.release_live_slot(**{"slot": c.acquire_live_slot(), **kw}))(
            kvpool.LinearStatePrefixCache(4)
        ),
        {"slot": COUNT},
    ),
    "LinearStatePrefixCache.promote": (
        lambda **kw: (
            lambda c: c.promote(
                **{"live_slot": c.acquire_live_slot(), "prefix_hash": b"x" * 16, **kw}
            )
        )(kvpool.LinearStatePrefixCache(4)),
        {"live_slot": COUNT},
    ),
    "LinearStatePrefixCache.evict": (
        _with({"n": 1}, lambda **kw: kvpool.LinearStatePrefixCache(4).evict(**kw)),
        {"n": COUNT},
    ),
    "XTensorBlockManager.__new__": (
        _with(
            {"num_blocks": 16, "block_size": 4, "blocks_per_page": 2, "page_bytes": 1024},
            kvpool.XTensorBlockManager,
        ),
        {
            "num_blocks": COUNT,
            "block_size": COUNT,
            "blocks_per_page": COUNT,
            "page_bytes": COUNT,
            "spare_pages": COUNT,
            "memory_limit": COUNT,
            "enable_prefix_cache": FLAG,
            "hash_seed": COUNT,
            "debug_hash_bits": COUNT,
        },
    ),
    "XTensorBlockManager.allocate": (
        _with({"n": 1}, lambda **kw: _xtensor().allocate(**kw)),
        {"n": COUNT},
    ),
    "XTensorBlockManager.evict": (
        _with({"n": 1}, lambda **kw: _xtensor().evict(**kw)),
        {"n": COUNT},
    ),
    "XTensorBlockManager.try_reserve": (
        _with({"n": 1}, lambda **kw: _xtensor().try_reserve(**kw)),
        {"n": COUNT},
    ),
    "XTensorBlockManager.set_memory_limit": (
        _with({"limit": 4096}, lambda **kw: _xtensor().set_memory_limit(**kw)),
        {"limit": COUNT},
    ),
    "XTensorBlockManager.page_of": (
        _with({"block_id": 3}, lambda **kw: _xtensor().page_of(**kw)),
        {"block_id": COUNT},
    ),
    "XTensorBlockManager.is_page_mapped": (
        _with({"page": 1}, lambda **kw: _xtensor().is_page_mapped(**kw)),
        {"page": COUNT},
    ),
    # --- sequences
    "Sequence.__new__": (_with({"token_ids": TOKENS}, kvpool.Sequence), {"seq_id": COUNT}),
    "Sequence.group_block_table": (
        _with({"group": 0}, lambda **kw: _seq_in(_pool()).group_block_table(**kw)),
        {"group": COUNT},
    ),
    "Sequence.block_id": (
        _with({"i": 0}, lambda **kw: _seq_in(_pool()).block_id(**kw)),
        {"i": COUNT},
    ),
    "Sequence.append_token": (
        _with({"token": 7}, lambda **kw: kvpool.Sequence(TOKENS).append_token(**kw)),
        {"token": COUNT},
    ),
    "SequenceBatch.__getitem__": (
        lambda index=0: kvpool.SequenceBatch([kvpool.Sequence(TOKENS)])[index],
        {"index": COUNT},
    ),
    "Sequence.num_computed_tokens": (
        lambda value=3: setattr(_seq_in(_pool()), "num_computed_tokens", value),
        {"value": COUNT},
    ),
    # --- the pools
    "BlockManagerPool.__new__": (
        _with({"num_blocks": 16, "block_size": 4}, kvpool.BlockManagerPool),
        {"num_blocks": COUNT, "block_size": COUNT, **POOL_OPTIONS},
    ),
    "BlockManagerPool.can_allocate": (
        lambda **kw: _pool().can_allocate(kvpool.Sequence(TOKENS), **kw),
        {"num_tokens": COUNT, "num_new_tokens": COUNT},
    ),
    "BlockManagerPool.plan": (
        lambda **kw: _pool().plan(kvpool.Sequence(TOKENS), **kw),
        {"num_tokens": COUNT, "num_new_tokens": COUNT},
    ),
    "BlockManagerPool.allocate": (
        lambda **kw: _pool().allocate(kvpool.Sequence(TOKENS), **kw),
        {"num_tokens": COUNT, "num_new_tokens": COUNT},
    ),
    "BlockManagerPool.release_retained": (
        _with({"seq": 1}, lambda **kw: _pool().release_retained(**kw)),
        {"seq": COUNT},
    ),
    "BlockManagerPool.drain_block_switches": (
        lambda **kw: _pool().drain_block_switches(**kw),
        {"with_group": FLAG},
    ),
    "BlockManagerPool.can_append": (
        lambda **kw: (lambda p: p.can_append(_seq_in(p), **kw))(_pool()),
        {"lookahead": COUNT},
    ),
    "BlockManagerPool.may_append": (
        lambda **kw: (lambda p: p.may_append(_seq_in(p), **kw))(_pool()),
        {"lookahead": COUNT},
    ),
    "BlockManagerPool.block_tables": (
        lambda **kw: (lambda p: p.block_tables([_seq_in(p)], **kw))(_pool()),
        {"group": COUNT, "pad": COUNT},
    ),
    "BlockManagerPool.slot_mapping": (
        lambda **kw: (lambda p: p.slot_mapping([_seq_in(p)], **kw))(_pool()),
        {"group": COUNT},
    ),
    "BlockManagerPool.advance": (
        lambda **kw: (lambda p: p.advance([_seq_in(p)], [9], **kw))(_pool()),
        {"lookahead": COUNT},
    ),
    "BlockManagerPool.may_append_all": (
        lambda **kw: (lambda p: p.may_append_all([_seq_in(p)], **kw))(_pool()),
        {"lookahead": COUNT},
    ),
    "BlockManagerPool.last_event_sequence": (
        _with({"dp_rank": 0}, lambda **kw: _pool(enable_events=True).last_event_sequence(**kw)),
        {"dp_rank": COUNT},
    ),
    "BlockManagerPool.events_since": (
        _with(
            {"dp_rank": 0, "sequence": 1}, lambda **kw: _pool(enable_events=True).events_since(**kw)
        ),
        {"dp_rank": COUNT, "sequence": COUNT},
    ),
    "BlockManagerPool.record_remote_events": (
        _with(
            {"dp_rank": 0, "kind": "stored", "block_hashes": []},
            lambda **kw: _pool(enable_events=True).record_remote_events(**kw),
        ),
        {"dp_rank": COUNT},
    ),
    "BlockManagerPool.set_memory_limit": (
        _with({"limit": 4096}, lambda **kw: _elastic().set_memory_limit(**kw)),
        {"limit": COUNT, "dp_rank": COUNT},
    ),
    "BlockManagerPool.mapped_page_ids": (
        _with({"dp_rank": 0}, lambda **kw: _elastic().mapped_page_ids(**kw)),
        {"dp_rank": COUNT},
    ),
    "BlockManagerPool.linear_state_cache": (
        _with({"dp_rank": 0}, lambda **kw: _pool(linear_state_slots=4).linear_state_cache(**kw)),
        {"dp_rank": COUNT},
    ),
    "HierarchyBlockManagerPool.__new__": (
        _with(
            {"num_blocks": 16, "host_num_blocks": 16, "block_size": 4},
            kvpool.HierarchyBlockManagerPool,
        ),
        {"num_blocks": COUNT, "host_num_blocks": COUNT, "block_size": COUNT, **POOL_OPTIONS},
    ),
    "HierarchyBlockManagerPool.allocate": (
        lambda **kw: _hier().allocate(kvpool.Sequence(TOKENS), **kw),
        {"num_tokens": COUNT, "num_new_tokens": COUNT},
    ),
    "HierarchyBlockManagerPool.remote_query": (
        lambda **kw: _hier().remote_query(kvpool.Sequence(TOKENS), **kw),
        {"num_tokens": COUNT},
    ),
    "HierarchyBlockManagerPool.allocate_with_remote": (
        lambda **kw: _hier().allocate_with_remote(kvpool.Sequence(TOKENS), **kw),
        {"num_tokens": COUNT},
    ),
    # --- the index
    "KVIndex.__new__": (
        kvpool.KVIndex,
        {"max_entries": COUNT, "hash_seed": COUNT, "writers": COUNT},
    ),
    "KVIndex.apply": (
        _with({"instance": 1, "events": []}, lambda **kw: kvpool.KVIndex().apply(**kw)),
        {"instance": COUNT},
    ),
    "KVIndex.apply_msgpack": (
        _with(
            {"instance": 1, "data": kvpool.encode_events([])},
            lambda **kw: kvpool.KVIndex().apply_msgpack(**kw),
        ),
        {"instance": COUNT},
    ),
    "KVIndex.lookup": (
        lambda **kw: kvpool.KVIndex().lookup(**{"block_hashes": _hashes(), "block_size": 4, **kw}),
        {"block_size": COUNT, "depths": FLAG},
    ),
    "KVIndex.writer_of": (
        _with({"instance": 1}, lambda **kw: kvpool.KVIndex().writer_of(**kw)),
        {"instance": COUNT},
    ),
    "KVIndex.insert_speculative": (
        _with(
            {"instance": 1, "token_ids": TOKENS, "block_size": 4, "now": 0.0, "ttl": 1.0},
            lambda **kw: kvpool.KVIndex().insert_speculative(**kw),
        ),
        {"instance": COUNT, "block_size": COUNT, "dp_rank": COUNT},
    ),
    "KVIndex.hash_blocks": (
        _with(
            {"token_ids": TOKENS, "block_size": 4}, lambda **kw: kvpool.KVIndex().hash_blocks(**kw)
        ),
        {"block_size": COUNT},
    ),
    "KVIndex.resync": (
        _with({"instance": 1}, lambda **kw: kvpool.KVIndex().resync(**kw)),
        {"instance": COUNT, "dp_rank": COUNT},
    ),
    "KVIndex.can_apply": (
        _with({"instance": 1, "sequence": 1}, lambda **kw: kvpool.KVIndex().can_apply(**kw)),
        {"instance": COUNT, "sequence": COUNT, "dp_rank": COUNT},
    ),
    "KVIndex.remove_instance": (
        _with({"instance": 1}, lambda **kw: kvpool.KVIndex().remove_instance(**kw)),
        {"instance": COUNT},
    ),
    "KVIndex.load": (
        _with({"data": kvpool.KVIndex().dump()}, kvpool.KVIndex.load),
        {"max_entries": COUNT},
    ),
    # --- the Python modules
    "kvpool.index.router.Router.__init__": (
        _with({"instances": 2, "policy": "round_robin"}, Router),
        {"instances": COUNT, "block_size": COUNT, "shared_remote": FLAG},
    ),
    "kvpool.integrations.nanovllm.BlockManager.__init__": (
        _with({"num_blocks": 8, "block_size": 4}, NanoBlockManager),
        {"num_blocks": COUNT, "block_size": COUNT},
    ),
    "kvpool.integrations.nanovllm.BlockManager.allocate": (
        lambda num_cached_blocks=0: (lambda bm, s: bm.allocate(s, num_cached_blocks))(
            NanoBlockManager(8, 4), _NanoSeq()
        ),
        {"num_cached_blocks": COUNT},
    ),
    "kvpool.tiers.memory.MemoryRemoteTier.__init__": (MemoryRemoteTier, {"capacity": COUNT}),
    "kvpool.tiers.payload.make_namespace": (
        _with(
            {
                "model": "m",
                "dtype": "float16",
                "num_kv_heads": 1,
                "head_dim": 8,
                "block_size": 4,
                "num_layers": 1,
            },
            make_namespace,
        ),
        {
            "num_kv_heads": COUNT,
            "head_dim": COUNT,
            "block_size": COUNT,
            "num_layers": COUNT,
            "hash_seed": COUNT,
        },
    ),
    # no connection is made by these calls (redis-py connects on the first command)
    "kvpool.tiers.redis.RedisRemoteTier.__init__": (
        _with({"url": "redis://127.0.0.1:1", "namespace": "ns"}, RedisRemoteTier),
        {"cluster": FLAG, "ttl_s": COUNT},
    ),
    "kvpool.index.streams.RedisEventPublisher.__init__": (
        _with({"url": "redis://127.0.0.1:1", "instance_id": "a"}, RedisEventPublisher),
        {"maxlen": COUNT},
    ),
    "kvpool.index.streams.read_events": (
        _with({"url": "redis://127.0.0.1:1", "max_entries": 0}, read_events),
        {"count": COUNT, "max_entries": COUNT},
    ),
    "kvpool.tiers.host_transfer.TransferExecutor.transfer": (
        _with(
            {"plans": [], "to_device": True},
            lambda **kw: NumpyTransferExecutor(np.zeros((2, 4)), np.zeros((2, 4))).transfer(**kw),
        ),
        {"to_device": FLAG},
    ),
    "kvpool.xtensor.CudaPageBackend.__init__": (
        _with(
            {
                "num_blocks": 8,
                "block_size": 4,
                "num_kv_heads": 1,
                "head_dim": 8,
                "driver": _Driver(),
            },
            CudaPageBackend,
        ),
        {
            "num_blocks": COUNT,
            "block_size": COUNT,
            "num_kv_heads": COUNT,
            "head_dim": COUNT,
            "num_layers": COUNT,
            "blocks_per_page": COUNT,
            "device": COUNT,
        },
    ),
    "kvpool.kernels.paged_decode_attention": (
        _decode,
        {"window": COUNT, "num_splits": COUNT, "validate": FLAG},
    ),
    "kvpool.kernels.paged_prefill_attention": (
        _prefill,
        {"window": COUNT, "causal": FLAG, "validate": FLAG},
    ),
    "kvpool.kernels.write_kv": (_write_kv, {"validate": FLAG}),
    "kvpool.kernels.copy_blocks": (_copy_blocks, {"validate": FLAG}),
    "kvpool.kernels.copy_linear_state": (_copy_linear_state, {"validate": FLAG}),
    "kvpool.kernels.swap_blocks": (_swap_blocks, {"validate": FLAG}),
}


class _NanoSeq:
    """The fields of nano-vllm's Sequence the drop-in reads."""

    def __init__(self):
        self.seq_id, self.token_ids, self.num_tokens = 0, list(range(6)), 6
        self.num_cached_tokens, self.num_scheduled_tokens, self.block_table = 0, 0, []


# Int or bool parameters of scanned signatures that are not user arguments, with the reason.
EXEMPT = {
    "kvpool.integrations._vllm_manager.KVCacheManager.*": "vLLM's KVCacheManager interface: vLLM's Scheduler "
    "passes its own ints and flags, and the drop-in keeps vLLM's signatures",
    "kvpool.xtensor.Driver.*": "the CUDA driver seam (addresses and handles from the driver)",
    "kvpool.xtensor.CudaDriver.*": "the ctypes CUDA driver (addresses and handles from the driver)",
    "kvpool.xtensor.CudaError.__init__": "an exception carrying the driver's error code",
    "kvpool.xtensor.CudaPageBackend.map_page": "the PageBackend protocol: the manager passes its pages",
    "kvpool.xtensor.CudaPageBackend.unmap_page": "the PageBackend protocol: the manager passes its pages",
    "kvpool.xtensor.CudaPageBackend.tensor_address": "needs a mapped device range",
    "kvpool.xtensor.CudaPageBackend.kv_cache": "needs CuPy and a device",
    "kvpool.tiers.base.RemoteTier.note": "a tier's own statistics counter (called by the tier)",
    "kvpool.tiers.remote_transfer.HostBlockIO.*": "the protocol RemoteTransfer calls with the pool's ranks",
    "kvpool.tiers.host_transfer.TransferExecutor.host_block_spec": "HostBlockIO: RemoteTransfer passes the pool's ranks",
    "kvpool.tiers.host_transfer.TransferExecutor.host_block_nbytes": "HostBlockIO: RemoteTransfer passes the pool's ranks",
    "kvpool.tiers.host_transfer.TransferExecutor.read_host_blocks": "HostBlockIO: RemoteTransfer passes the pool's ranks",
    "kvpool.tiers.host_transfer.TransferExecutor.write_host_blocks": "HostBlockIO: RemoteTransfer passes the pool's ranks",
    "kvpool.index.streams.PrefixIndex.admits": "the write-behind admission's own query",
    "kvpool.tiers.payload.decode_payload": "the wire codec: body_len is the length the reply carries",
}

SCANNED = [
    "kvpool.index.router",
    "kvpool.index.streams",
    "kvpool.integrations.nanovllm",
    "kvpool.integrations._vllm_manager",
    "kvpool.tiers.base",
    "kvpool.tiers.host_transfer",
    "kvpool.tiers.memory",
    "kvpool.tiers.payload",
    "kvpool.tiers.redis",
    "kvpool.tiers.remote_transfer",
    "kvpool.xtensor",
]


# A property setter's value is named by the property in messages.
SETTERS = {("Sequence.num_computed_tokens", "value"): "num_computed_tokens"}


def _rows(kind):
    return [
        pytest.param(entry, name, id=f"{entry}:{name}")
        for entry, (_, args) in TABLE.items()
        for name, k in args.items()
        if k == kind
    ]


def _names(name: str) -> str:
    """A pattern finding `name` as a word in a message (`n`, not the n of "an int")."""
    return rf"(?<![\w.]){re.escape(name)}(?![\w])"


@pytest.mark.parametrize("entry", list(TABLE))
def test_every_table_call_is_valid_with_its_defaults(entry):
    call, _ = TABLE[entry]
    call()


@pytest.mark.parametrize(("entry", "name"), _rows(COUNT))
def test_a_bool_or_a_float_is_never_an_integer_argument(entry, name):
    call, _ = TABLE[entry]
    for bad in (True, False, 1.5, 2.0, np.float64(3.0)):
        with pytest.raises(TypeError, match=_names(SETTERS.get((entry, name), name))):
            call(**{name: bad})


@pytest.mark.parametrize(("entry", "name"), _rows(FLAG))
def test_a_flag_is_a_bool(entry, name):
    call, _ = TABLE[entry]
    for bad in (None, 1, 0, 1.0, "yes"):
        with pytest.raises(TypeError, match=_names(name)):
            call(**{name: bad})
    for good in (True, False, np.bool_(True)):
        call(**{name: good})


# Arguments an optional flag needs beside it to be valid (a shared store needs a window group).
BESIDE = {
    ("BlockManagerPool.__new__", "shared_blocks"): {"sliding_window": 8},
    ("HierarchyBlockManagerPool.__new__", "shared_blocks"): {"sliding_window": 8},
}


@pytest.mark.parametrize(("entry", "name"), _rows(OPTIONAL_FLAG))
def test_an_optional_flag_is_a_bool_or_none(entry, name):
    call, _ = TABLE[entry]
    beside = BESIDE.get((entry, name), {})
    for bad in (1, 0, 1.0, "yes"):
        with pytest.raises(TypeError, match=_names(name)):
            call(**beside, **{name: bad})
    for good in (True, False, np.bool_(True), None):
        call(**beside, **{name: good})


# --- the table covers every typed int and bool parameter -----------------------------------------


def _is_int_or_bool(annotation: ast.expr | None) -> bool:
    """Whether an annotation is int or bool, alone or in a union (`int | None`)."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Name):
        return annotation.id in ("int", "bool", "SupportsIndex")
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _is_int_or_bool(annotation.left) or _is_int_or_bool(annotation.right)
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _is_int_or_bool(ast.parse(annotation.value, mode="eval").body)
    return False


def _typed_params(tree: ast.Module, prefix: str, public_only: bool) -> set[tuple[str, str]]:
    found = set()

    def walk(nodes, qual):
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                if not (public_only and node.name.startswith("_")):
                    walk(node.body, qual + node.name + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (
                    public_only
                    and node.name.startswith("_")
                    and node.name not in ("__init__", "__new__")
                ):
                    continue
                a = node.args
                for p in a.posonlyargs + a.args + a.kwonlyargs:
                    if p.arg not in ("self", "cls") and _is_int_or_bool(p.annotation):
                        found.add((qual + node.name, p.arg))

    walk(tree.body, prefix)
    return found


def _exempt(entry: str) -> bool:
    return any(
        entry == key or (key.endswith(".*") and entry.startswith(key[:-1])) for key in EXEMPT
    )


def test_the_table_lists_every_int_and_bool_parameter_of_the_typed_api():
    stubs = Path(kvpool.__file__).with_name("_core.pyi")
    found = _typed_params(ast.parse(stubs.read_text()), "", public_only=False)
    for name in SCANNED:
        source = Path(importlib.util.find_spec(name).origin).read_text()  # no import (vllm)
        found |= _typed_params(ast.parse(source), name + ".", public_only=True)
    listed = {(entry, name) for entry, (_, args) in TABLE.items() for name in args}
    missing = sorted((e, n) for e, n in found - listed if not _exempt(e))
    assert not missing, (
        f"int/bool parameters missing from TABLE (add them, or to EXEMPT): {missing}"
    )
    assert len(found) > 100, "the scan found almost nothing: is the stub parser broken?"
    stale = sorted((e, n) for e, n in listed - found if not e.startswith("kvpool.kernels."))
    assert not stale, f"TABLE lists parameters the signatures do not have: {stale}"
