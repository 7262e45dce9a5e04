"""One adapter per block manager, so that the comparison drives each through the same replay.

An adapter turns the replay's phases into the manager's own calls, written the way an engine
built on that manager would write them (nano-vllm's scheduler/postprocess, vLLM's scheduler,
kvpool's sequence API). Every phase takes a whole batch, so the replay times one call per phase
and per step; the loop inside a phase holds nothing but manager calls.

Phases of one scheduler step (the replay decides who is in which, identically for everyone):

``admit(items)``          new requests: build the sequence, prefix match, allocate the prompt
``decode_alloc(seqs)``    running requests: room for the token sampled last step
``export(seqs)``          block tables + slot mapping of the batch (timed apart)
``prefill_done(seqs, t)`` after the forward pass: prompt computed, publish full blocks, append t
``decode_done(seqs, t)``  after the forward pass: one more token computed, publish, append t
``post(new, t, dec, u)``  both of the above for one step (an adapter may fuse them)
``free(seqs)``            finished requests
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import nanovllm_reference as _nano
import numpy as np
import vllm_reference as _vllm

__all__ = ["ADAPTERS", "Adapter", "Unavailable", "export_lists", "make_adapter"]


class Unavailable(Exception):
    """The manager cannot run here (package missing, API mismatch): the reason is the message."""


class Adapter:
    name = "?"
    hash_name = "?"
    # managers whose hit semantics match (block granularity, one token left to compute,
    # namespaces honoured) share a tag; hits are cross-checked only within a tag
    semantics = "standard"
    # True when a prompt's full blocks become hittable as soon as they are allocated (vLLM's
    # allocate_slots), False when they are published after the forward step (kvpool, nano-vllm)
    publish_on_allocate = False
    description = ""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size

    def admit(self, items: Sequence[Any]) -> tuple[list[Any], list[int]]:
        raise NotImplementedError

    def decode_alloc(self, seqs: list[Any]) -> None:
        raise NotImplementedError

    def export(self, seqs: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def prefill_done(self, seqs: list[Any], tokens: list[int]) -> None:
        raise NotImplementedError

    def decode_done(self, seqs: list[Any], tokens: list[int]) -> None:
        raise NotImplementedError

    def post(
        self, new: list[Any], new_tokens: list[int], dec: list[Any], dec_tokens: list[int]
    ) -> None:
        """After the forward pass of a step: the prefilled ``new`` sequences, then the decoding
        ``dec`` ones, get their sampled tokens. The running order afterwards is ``dec + new``."""
        if new:
            self.prefill_done(new, new_tokens)
        if dec:
            self.decode_done(dec, dec_tokens)

    def free(self, seqs: list[Any]) -> None:
        raise NotImplementedError

    def num_evictions(self) -> int:
        raise NotImplementedError


def export_lists(
    tables: list[list[int]], starts: list[int], ends: list[int], bs: int
) -> tuple[np.ndarray, np.ndarray]:
    """Block tables padded to the longest + slots of tokens [start, end): Python loops, as the
    pure-Python engines build them."""
    max_len = max((len(t) for t in tables), default=0)
    block_tables = np.array([t + [0] * (max_len - len(t)) for t in tables], dtype=np.int32)
    slots: list[int] = []
    for table, start, end in zip(tables, starts, ends, strict=True):
        for i in range(start // bs, (end + bs - 1) // bs):
            base = table[i] * bs
            lo = max(start, i * bs) - i * bs
            hi = min(end, (i + 1) * bs) - i * bs
            slots.extend(range(base + lo, base + hi))
    return block_tables, np.array(slots, dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# kvpool


class KvpoolAdapter(Adapter):
    name = "kvpool"
    hash_name = "xxh3-128 (Rust)"
    description = "kvpool.BlockManagerPool (Rust core)"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        try:
            import kvpool
        except ImportError as e:  # pragma: no cover
            raise Unavailable(f"import kvpool failed: {e}") from None
        if not hasattr(kvpool, "BlockManagerPool") or not hasattr(kvpool, "Sequence"):
            raise Unavailable("kvpool.BlockManagerPool is not built yet (rebuild kvpool._core)")
        self._Sequence = kvpool.Sequence
        self.pool = kvpool.BlockManagerPool(num_blocks, block_size, enable_prefix_cache=True)
        # The running sequences, kept from step to step in the replay's order (a persistent
        # batch, as vLLM v1's model runner keeps one): a step's calls then read them in Rust
        # with no per-sequence Python work.
        self.batch = kvpool.SequenceBatch()
        # tests set this: check the batch against the replay's list each step (untimed use only)
        self.verify_order = False

    def admit(self, items):
        Seq = self._Sequence
        allocate = self.pool.allocate
        seqs = []
        hits = []
        for it in items:
            tokens = it.prompt_array if it.prompt_array is not None else it.prompt
            seq = Seq(tokens, seq_id=it.rid, extra_key=it.extra_key)
            if not allocate(seq):
                raise RuntimeError(f"kvpool: allocate failed for request {it.rid}")
            seqs.append(seq)
            hits.append(seq.num_cached_tokens)
        return seqs, hits

    def _check_batch(self, seqs):
        if len(self.batch) != len(seqs):
            raise RuntimeError("kvpool adapter: the batch lost track of the running sequences")
        if self.verify_order and self.batch.seq_ids.tolist() != [s.seq_id for s in seqs]:
            raise RuntimeError("kvpool adapter: the batch is not in the replay's order")

    def decode_alloc(self, seqs):
        # Room for the token sampled last step was taken by last step's advance (lookahead=0):
        # nothing is left to do here but check that the batch is the replay's running list.
        self._check_batch(seqs)

    def export(self, seqs):
        return self.pool.block_tables(seqs), self.pool.slot_mapping(seqs)

    def post(self, new, new_tokens, dec, dec_tokens):
        # The prefilled sequences join the batch; then one call for the whole step: computed =
        # len, publish, append the sampled token (R17), and room for it (R16, lookahead=0),
        # which returns the indices of the sequences that got none.
        if not new and not dec:
            return
        if new:
            self.batch.extend(new)
        self._check_batch(dec + new if self.verify_order else range(len(dec) + len(new)))
        if self.pool.advance(self.batch, dec_tokens + new_tokens, lookahead=0):
            raise RuntimeError("kvpool: may_append failed")

    def free(self, seqs):
        self.batch.remove_all(seqs)
        deallocate = self.pool.deallocate
        for seq in seqs:
            deallocate(seq)

    def num_evictions(self):
        return int(self.pool.stats()["num_evictions"])


# ----------------------------------------------------------------------------------------------
# nano-vllm-style reference (this repository) and the real nano-vllm package


class NanoRefAdapter(Adapter):
    name = "nano-vllm-ref"
    hash_name = _nano.HASH_BACKEND
    description = "nanovllm_reference.py (nano-vllm's BlockManager algorithm, pure Python)"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        # nano-vllm has no padding block: give it the same number of usable blocks as the others
        self.bm = _nano.BlockManager(num_blocks - 1, block_size)

    def admit(self, items):
        bm = self.bm
        bs = self.block_size
        Seq = _nano.NanoSequence
        seqs = []
        hits = []
        for it in items:
            seq = Seq(it.prompt, bs, seq_id=it.rid, extra_key=it.extra_key)
            n = bm.can_allocate(seq)
            if n < 0:
                raise RuntimeError(f"nano-vllm-ref: cannot allocate request {it.rid}")
            bm.allocate(seq, n)
            seqs.append(seq)
            hits.append(seq.num_cached_tokens)
        return seqs, hits

    def decode_alloc(self, seqs):
        bm = self.bm
        for seq in seqs:
            if not bm.can_append(seq):
                raise RuntimeError("nano-vllm-ref: cannot append")
            bm.may_append(seq)

    def export(self, seqs):
        return export_lists(
            [s.block_table for s in seqs],
            [s.num_cached_tokens for s in seqs],
            [len(s) for s in seqs],
            self.block_size,
        )

    def prefill_done(self, seqs, tokens):
        hash_blocks = self.bm.hash_blocks
        for seq, t in zip(seqs, tokens, strict=True):
            seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
            hash_blocks(seq)
            seq.num_cached_tokens = len(seq)
            seq.append_token(t)

    def decode_done(self, seqs, tokens):
        hash_blocks = self.bm.hash_blocks
        for seq, t in zip(seqs, tokens, strict=True):
            seq.num_scheduled_tokens = 1
            hash_blocks(seq)
            seq.num_cached_tokens += 1
            seq.append_token(t)

    def free(self, seqs):
        deallocate = self.bm.deallocate
        for seq in seqs:
            deallocate(seq)

    def num_evictions(self):
        return self.bm.num_evictions


class NanoVllmAdapter(Adapter):
    """The real nano-vllm package (``nanovllm``), when importable. Best effort across versions."""

    name = "nano-vllm"
    hash_name = "xxh64"
    semantics = "no-namespace"  # it ignores extra keys: compared only on traces without them
    description = "nanovllm.engine.block_manager.BlockManager (the real package)"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        try:
            from nanovllm.engine.block_manager import BlockManager
            from nanovllm.engine.sequence import Sequence as NSeq
            from nanovllm.sampling_params import SamplingParams
        except Exception as e:  # noqa: BLE001 - any import failure means "not here"
            raise Unavailable(f"nanovllm not importable ({type(e).__name__}: {e})") from None
        NSeq.block_size = block_size
        self._Seq = NSeq
        self._params = SamplingParams()
        self.bm = BlockManager(num_blocks - 1, block_size)
        self._head = hasattr(self.bm, "hash_blocks")  # HEAD: can_allocate -> int, hash_blocks
        try:
            self._alloc_takes_count = len(inspect.signature(self.bm.allocate).parameters) >= 2
        except (TypeError, ValueError):  # pragma: no cover
            self._alloc_takes_count = self._head
        self._evictions = 0
        self._count_evictions()

    def admit(self, items):
        bm = self.bm
        seqs, hits = [], []
        for it in items:
            seq = self._Seq(list(it.prompt), self._params)
            ok = bm.can_allocate(seq)
            if ok is False or (not isinstance(ok, bool) and ok < 0):
                raise RuntimeError(f"nano-vllm: cannot allocate request {it.rid}")
            if self._alloc_takes_count:
                bm.allocate(seq, ok)
            else:
                bm.allocate(seq)
            seqs.append(seq)
            hits.append(seq.num_cached_tokens)
        return seqs, hits

    def decode_alloc(self, seqs):
        bm = self.bm
        for seq in seqs:
            if not bm.can_append(seq):
                raise RuntimeError("nano-vllm: cannot append")
            bm.may_append(seq)

    def export(self, seqs):
        return export_lists(
            [list(s.block_table) for s in seqs],
            [s.num_cached_tokens for s in seqs],
            [len(s) for s in seqs],
            self.block_size,
        )

    def prefill_done(self, seqs, tokens):
        bm = self.bm
        for seq, t in zip(seqs, tokens, strict=True):
            if self._head:
                seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
                bm.hash_blocks(seq)
            seq.num_cached_tokens = len(seq)
            seq.append_token(t)

    def decode_done(self, seqs, tokens):
        bm = self.bm
        for seq, t in zip(seqs, tokens, strict=True):
            if self._head:
                seq.num_scheduled_tokens = 1
                bm.hash_blocks(seq)
            seq.num_cached_tokens += 1
            seq.append_token(t)

    def free(self, seqs):
        for seq in seqs:
            self.bm.deallocate(seq)

    def _count_evictions(self) -> None:
        # wrap _allocate_block: a block that leaves the free deque still carrying a hash is
        # counted as evicted (over-counts revived hits in old versions: the cross-check then
        # just stops earlier)
        bm = self.bm
        orig = bm._allocate_block

        def counting(*args):
            block_id = args[0] if args else bm.free_block_ids[0]
            if bm.blocks[block_id].hash != -1:
                self._evictions += 1
            return orig(*args)

        bm._allocate_block = counting

    def num_evictions(self):
        return self._evictions


# ----------------------------------------------------------------------------------------------
# vLLM-v1-style reference (this repository) and the real vLLM package


class VllmRefAdapter(Adapter):
    name = "vllm-v1-ref"
    publish_on_allocate = True
    hash_algo = "sha256"
    description = "vllm_reference.py (vLLM v1's BlockPool / KVCacheManager algorithm, pure Python)"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        try:
            self.kv = _vllm.KVCacheManager(num_blocks, block_size, hash_algo=self.hash_algo)
        except ImportError as e:
            raise Unavailable(str(e)) from None
        self.hash_name = f"{self.hash_algo} + pickle"

    def admit(self, items):
        kv = self.kv
        make = kv.make_request
        get_computed = kv.get_computed_blocks
        allocate_slots = kv.allocate_slots
        reqs, hits = [], []
        for it in items:
            req = make(it.rid, it.prompt, cache_salt=it.extra_key)
            blocks, n = get_computed(req)
            if allocate_slots(req, req.num_tokens - n, n, blocks) is None:
                raise RuntimeError(f"vllm-v1-ref: cannot allocate request {it.rid}")
            req.num_computed_tokens = n
            reqs.append(req)
            hits.append(n)
        return reqs, hits

    def decode_alloc(self, seqs):
        allocate_slots = self.kv.allocate_slots
        for req in seqs:
            if allocate_slots(req, 1) is None:
                raise RuntimeError("vllm-v1-ref: cannot allocate a decode slot")

    def export(self, seqs):
        r2b = self.kv.req_to_blocks
        return export_lists(
            [[b.block_id for b in r2b[r.request_id]] for r in seqs],
            [r.num_computed_tokens for r in seqs],
            [r.num_tokens for r in seqs],
            self.block_size,
        )

    def prefill_done(self, seqs, tokens):
        for req, t in zip(seqs, tokens, strict=True):
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(t)

    def decode_done(self, seqs, tokens):
        for req, t in zip(seqs, tokens, strict=True):
            req.num_computed_tokens += 1
            req.append_output_token_ids(t)

    def free(self, seqs):
        free = self.kv.free
        for req in seqs:
            free(req)

    def num_evictions(self):
        return self.kv.block_pool.num_evictions


class VllmRefXxhashAdapter(VllmRefAdapter):
    name = "vllm-v1-ref-xxhash"
    hash_algo = "xxhash"


class VllmAdapter(Adapter):
    """The real vLLM package (v1 ``KVCacheManager``), when importable. Best effort across versions."""

    name = "vllm"
    hash_name = "sha256 (vllm)"
    publish_on_allocate = True
    description = "vllm.v1.core.kv_cache_manager.KVCacheManager (the real package)"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        try:
            import torch
            from vllm.sampling_params import SamplingParams
            from vllm.v1.core.kv_cache_manager import KVCacheManager
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
            from vllm.v1.kv_cache_interface import (
                FullAttentionSpec,
                KVCacheConfig,
                KVCacheGroupSpec,
            )
            from vllm.v1.request import Request
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"vllm not importable ({type(e).__name__}: {e})") from None
        try:
            try:
                from vllm.utils.hashing import sha256 as hash_fn
            except ImportError:
                from vllm.utils import sha256 as hash_fn  # older layout
            init_none_hash(hash_fn)
            spec = FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
            )
            config = KVCacheConfig(
                num_blocks=num_blocks,
                kv_cache_tensors=[],
                kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
            )
            params = inspect.signature(KVCacheManager.__init__).parameters
            kwargs: dict[str, Any] = {"max_model_len": 1 << 20, "enable_caching": True}
            if "hash_block_size" in params:
                kwargs["hash_block_size"] = block_size
            if "scheduler_block_size" in params:
                kwargs["scheduler_block_size"] = block_size
            self.kv = KVCacheManager(config, **kwargs)
            self._hasher = get_request_block_hasher(block_size, hash_fn)
            self._Request = Request
            self._params = SamplingParams(max_tokens=1 << 20)
            # count evictions (not exposed by every version) by wrapping the pool's evict hook
            pool = self.kv.block_pool
            orig = pool._maybe_evict_cached_block
            self._evictions = 0

            def counting(block):
                evicted = orig(block)
                if evicted:
                    self._evictions += 1
                return evicted

            pool._maybe_evict_cached_block = counting
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"vllm API not supported here ({type(e).__name__}: {e})") from None

    def _make(self, it):
        kwargs: dict[str, Any] = {
            "request_id": str(it.rid),
            "prompt_token_ids": list(it.prompt),
            "sampling_params": self._params,
            "pooling_params": None,
            "eos_token_id": None,
            "block_hasher": self._hasher,
        }
        params = inspect.signature(self._Request.__init__).parameters
        if "cache_salt" in params and it.extra_key is not None:
            kwargs["cache_salt"] = it.extra_key.decode("utf-8", "surrogateescape")
        kwargs = {k: v for k, v in kwargs.items() if k in params}
        return self._Request(**kwargs)

    def admit(self, items):
        kv = self.kv
        reqs, hits = [], []
        for it in items:
            req = self._make(it)
            out = kv.get_computed_blocks(req)
            blocks, n = out[0], out[1]
            if kv.allocate_slots(req, req.num_tokens - n, n, blocks) is None:
                raise RuntimeError(f"vllm: cannot allocate request {it.rid}")
            req.num_computed_tokens = n
            reqs.append(req)
            hits.append(n)
        return reqs, hits

    def decode_alloc(self, seqs):
        for req in seqs:
            if self.kv.allocate_slots(req, 1) is None:
                raise RuntimeError("vllm: cannot allocate a decode slot")

    def export(self, seqs):
        kv = self.kv
        return export_lists(
            [list(kv.get_block_ids(r.request_id)[0]) for r in seqs],
            [r.num_computed_tokens for r in seqs],
            [r.num_tokens for r in seqs],
            self.block_size,
        )

    # vLLM's Request objects advance exactly as the reference's do.
    prefill_done = VllmRefAdapter.prefill_done
    decode_done = VllmRefAdapter.decode_done

    def free(self, seqs):
        for req in seqs:
            self.kv.free(req)

    def num_evictions(self):
        return self._evictions


ADAPTERS: dict[str, type[Adapter]] = {
    "kvpool": KvpoolAdapter,
    "nano-vllm-ref": NanoRefAdapter,
    "vllm-v1-ref": VllmRefAdapter,
    "vllm-v1-ref-xxhash": VllmRefXxhashAdapter,
    "nano-vllm": NanoVllmAdapter,
    "vllm": VllmAdapter,
}

# short aliases accepted by --managers
ALIASES = {
    "nano": "nano-vllm-ref",
    "nano-ref": "nano-vllm-ref",
    "vllm-ref": "vllm-v1-ref",
    "vllm-ref-xxhash": "vllm-v1-ref-xxhash",
    "vllm-xxhash": "vllm-v1-ref-xxhash",
}


def make_adapter(name: str, num_blocks: int, block_size: int) -> Adapter:
    name = ALIASES.get(name, name)
    if name not in ADAPTERS:
        raise ValueError(f"unknown manager {name!r}; expected one of {', '.join(ADAPTERS)}")
    return ADAPTERS[name](num_blocks, block_size)
