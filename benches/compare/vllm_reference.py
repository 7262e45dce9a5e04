"""A pure-Python block pool that follows vLLM v1's published ``BlockPool`` / ``KVCacheManager``.

This is a reference for benchmarks and cross-checks, written for this repository from the
description of the algorithm (research/vllm.md section 1, vLLM 0.33); it is not vLLM's code.
It covers one full-attention KV-cache group (the "unitary" coordinator), which is what a
plain decoder model uses.

The algorithm:

* ``KVCacheBlock``: ``block_id``, ``ref_cnt``, the block hash (hash bytes + 4-byte big-endian group
  id), and ``prev_free_block`` / ``next_free_block``: the links of an intrusive list.
* ``FreeKVCacheBlockQueue``: a doubly linked list over the preallocated blocks with two sentinel
  nodes; ``popleft`` / ``popleft_n`` / ``remove`` / ``append`` / ``append_n`` / ``prepend_n`` are
  O(1) per block and allocate no Python objects. The queue IS the eviction order: allocation pops
  the head.
* ``BlockPool``: ``cached_block_hash_to_block`` maps a hash to one block or to a dict of blocks
  (identical content may be cached twice; a lookup takes the first). Block 0 is the null block.
  ``get_new_blocks(n)`` pops n blocks and evicts lazily: a popped block that still has a hash loses
  its map entry then (a freed cached block stays findable until it is popped). ``touch`` takes hit
  blocks out of the free queue (``ref_cnt`` 0 -> 1). ``free_blocks(ordered)`` drops the references;
  blocks that reach 0 go back to the queue: unhashed ones to the head (LIFO reuse), hashed ones to
  the tail (LRU by free time). Requests free their blocks in reverse, so a chain's tail is evicted
  before its head.
* Hashes: ``hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))`` with ``hash_fn`` = SHA-256
  over ``pickle`` (vLLM's default, ``"sha256"``) or xxh3-128 over ``pickle`` (``"xxhash"``). A cache
  salt is an extra key of block 0 only. Each request keeps ``block_hashes``, extended by full blocks
  when it is created and whenever a token is appended.
* ``KVCacheManager``: ``get_computed_blocks(request)`` finds the longest cached run, capped at
  ``num_tokens - 1`` tokens (the last token is always computed; a block-aligned prompt whose blocks
  are all cached recomputes its last block); ``allocate_slots(request, num_new_tokens,
  num_new_computed_tokens, new_computed_blocks)`` checks the free count (counting evictable hits),
  touches the hits, takes new blocks and caches the blocks that will be full after this step;
  ``free(request)`` frees in reverse order.

Simplifications (each makes the reference faster than vLLM, never slower): no coordinator or
``KVCacheBlocks`` wrapper objects, no events, metrics, watermark, lookahead, connectors or
hybrid groups; ``__slots__`` everywhere.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterable
from collections.abc import Sequence as _SequenceABC
from typing import Any

try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None  # type: ignore[assignment]

__all__ = [
    "BlockHashToBlockMap",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "Request",
    "get_hash_fn",
    "hash_block_tokens",
]

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def _xxhash128(obj: Any) -> bytes:
    assert _xxhash is not None
    return _xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))


def get_hash_fn(name: str) -> Callable[[Any], bytes]:
    """``"sha256"`` (vLLM's default) or ``"xxhash"`` (needs the xxhash package)."""
    if name == "sha256":
        return _sha256
    if name == "xxhash":
        if _xxhash is None:
            raise ImportError("hash 'xxhash' needs the xxhash package (pip install xxhash)")
        return _xxhash128
    raise ValueError(f"hash_algo must be 'sha256' or 'xxhash', got {name!r}")


def _none_hash(hash_fn: Callable[[Any], bytes]) -> bytes:
    # a fixed root (vLLM uses a fixed seed for the cryptographic hashes; a random one for xxhash,
    # which would only change the values, not the cost)
    return hash_fn("kvpool-reference-none-hash")


def hash_block_tokens(
    hash_fn: Callable[[Any], bytes],
    parent_block_hash: bytes | None,
    curr_block_token_ids: _SequenceABC[int],
    extra_keys: tuple[Any, ...] | None = None,
    *,
    none_hash: bytes,
) -> bytes:
    if not parent_block_hash:
        parent_block_hash = none_hash
    return hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


# ----------------------------------------------------------------------------------------------
# blocks and the free queue


class KVCacheBlock:
    """One physical block with intrusive free-queue links."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "_block_hash",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: bytes | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> bytes | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: bytes) -> None:
        assert self._block_hash is None, "the block already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, linked through the blocks themselves.

    Head = evicted / reused first. Two sentinels give every real node a prev and a next.
    """

    __slots__ = ("num_free_blocks", "fake_free_list_head", "fake_free_list_tail")

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        head = KVCacheBlock(-1)
        tail = KVCacheBlock(-1)
        self.fake_free_list_head = head
        self.fake_free_list_tail = tail
        prev = head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = tail
        tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        head = self.fake_free_list_head
        first = head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            raise ValueError("No free blocks available")
        nxt = first.next_free_block
        head.next_free_block = nxt
        nxt.prev_free_block = head  # type: ignore[union-attr]
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError("No free blocks available")
        head = self.fake_free_list_head
        out = []
        node = head.next_free_block
        for _ in range(n):
            assert node is not None
            out.append(node)
            nxt = node.next_free_block
            node.prev_free_block = node.next_free_block = None
            node = nxt
        head.next_free_block = node
        node.prev_free_block = head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev = block.prev_free_block
        nxt = block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Append in order: ``blocks[0]`` is evicted first among them."""
        if not blocks:
            return
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Insert at the head, in order: ``blocks[0]`` becomes the head (reused first)."""
        if not blocks:
            return
        head = self.fake_free_list_head
        first = head.next_free_block
        assert first is not None
        prev = head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        node = self.fake_free_list_head.next_free_block
        while node is not None and node is not self.fake_free_list_tail:
            out.append(node)
            node = node.next_free_block
        return out


class BlockHashToBlockMap:
    """hash key -> one block, or -> {block_id: block} when identical content is cached twice."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if type(blocks) is KVCacheBlock:
            return blocks
        return next(iter(blocks.values()))  # type: ignore[union-attr]

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif type(blocks) is KVCacheBlock:
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block  # type: ignore[index]

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if type(blocks) is KVCacheBlock:
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        block = blocks.pop(block_id, None)  # type: ignore[union-attr]
        if blocks:
            self._cache[key] = blocks
        return block

    def __len__(self) -> int:
        return len(self._cache)


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> bytes:
    return block_hash + group_id.to_bytes(4, "big", signed=False)


class BlockPool:
    """All blocks, the free queue (eviction order) and the hash -> block map."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()  # block 0
        self.null_block.is_null = True
        self.num_evictions = 0  # for benchmarks

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        cached = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, group_id)
            )
            if block is None:
                return None
            cached.append(block)
        return cached

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int = 0,
    ) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks
        block_hashes = request.block_hashes
        cache_map = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            key = make_block_hash_with_group_id(block_hashes[i], kv_cache_group_id)
            block.block_hash = key
            cache_map.insert(key, block)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            for block in ret:
                self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0
                block.ref_cnt += 1
        else:
            for block in ret:
                assert block.ref_cnt == 0
                block.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        block_hash = block._block_hash
        if block_hash is None:
            return False
        if self.cached_block_hash_to_block.pop(block_hash, block.block_id) is None:
            return False
        block.reset_hash()
        self.num_evictions += 1
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        remove = self.free_block_queue.remove
        for block in blocks:
            # a hit block with ref_cnt 0 is a free (evictable) cached block: take it out
            if block.ref_cnt == 0 and not block.is_null:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Release; the first block of ``ordered_blocks`` is evicted first."""
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if caching and block._block_hash is not None:
                    evict_last.append(block)
                else:
                    evict_first.append(block)
        if evict_first:
            self.free_block_queue.prepend_n(evict_first)  # LIFO reuse of unhashed blocks
        if evict_last:
            self.free_block_queue.append_n(evict_last)  # LRU eviction of cached blocks

    def reset_prefix_cache(self) -> bool:
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_gpu_blocks - 1)


# ----------------------------------------------------------------------------------------------
# requests and the manager


class Request:
    """The fields of vLLM's ``Request`` that the KV-cache manager reads."""

    __slots__ = (
        "request_id",
        "num_prompt_tokens",
        "_all_token_ids",
        "num_computed_tokens",
        "block_hashes",
        "cache_salt",
        "_block_size",
        "_hash_fn",
        "_none_hash",
    )

    def __init__(
        self,
        request_id: str | int,
        prompt_token_ids: Iterable[int],
        *,
        block_size: int,
        hash_fn: Callable[[Any], bytes] | None,
        none_hash: bytes = b"",
        cache_salt: str | bytes | None = None,
    ) -> None:
        self.request_id = request_id
        self._all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self._all_token_ids)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.cache_salt = cache_salt
        self._block_size = block_size
        self._hash_fn = hash_fn
        self._none_hash = none_hash
        if hash_fn is not None:
            self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def update_block_hashes(self) -> None:
        """Extend ``block_hashes`` by the blocks that became full (the request block hasher)."""
        hash_fn = self._hash_fn
        if hash_fn is None:
            return
        bs = self._block_size
        hashes = self.block_hashes
        tokens = self._all_token_ids
        start = len(hashes) * bs
        n = len(tokens)
        parent = hashes[-1] if hashes else None
        while start + bs <= n:
            extra = ("cache_salt", self.cache_salt) if start == 0 and self.cache_salt else None
            parent = hash_block_tokens(
                hash_fn,
                parent,
                tokens[start : start + bs],
                (extra,) if extra else None,
                none_hash=self._none_hash,
            )
            hashes.append(parent)
            start += bs

    def append_output_token_ids(self, token_id: int) -> None:
        self._all_token_ids.append(token_id)
        self.update_block_hashes()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """vLLM-v1-style scheduler API over one ``BlockPool`` and one full-attention group."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.hash_fn = get_hash_fn(hash_algo) if enable_caching else None
        self.none_hash = _none_hash(self.hash_fn) if self.hash_fn is not None else b""
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.kv_cache_group_ids = [0]
        self.req_to_blocks: dict[Any, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[Any, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens hit

    def make_request(
        self, request_id: Any, prompt_token_ids: Iterable[int], *, cache_salt: Any = None
    ) -> Request:
        """A request whose block hasher matches this manager (vLLM builds it in the engine)."""
        return Request(
            request_id,
            prompt_token_ids,
            block_size=self.block_size,
            hash_fn=self.hash_fn,
            none_hash=self.none_hash,
            cache_salt=cache_salt,
        )

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix (not touched yet), capped so that one token is left to compute."""
        if not self.enable_caching:
            return [], 0
        max_cache_hit_length = request.num_tokens - 1
        max_num_blocks = max_cache_hit_length // self.block_size
        get_cached_block = self.block_pool.get_cached_block
        group_ids = self.kv_cache_group_ids
        computed: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            cached = get_cached_block(block_hash, group_ids)
            if cached is None:
                break
            computed.append(cached[0])
        num_computed_tokens = len(computed) * self.block_size
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_computed_tokens
        return computed, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Blocks for ``num_new_tokens`` more tokens, or None if the pool cannot supply them."""
        if num_new_tokens == 0 and not new_computed_blocks:
            raise ValueError("num_new_tokens must be greater than 0")
        if new_computed_blocks is None:
            new_computed_blocks = []
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        num_held = 0 if req_blocks is None else len(req_blocks)
        num_required = _cdiv(num_tokens_need_slot, self.block_size)
        num_new_blocks = max(0, num_required - num_held - len(new_computed_blocks))
        # touching a hit with ref_cnt 0 takes it out of the free queue: count it as taken
        num_evictable_computed = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable_computed += 1
        pool = self.block_pool
        if num_new_blocks + num_evictable_computed > pool.get_num_free_blocks():
            return None
        if req_blocks is None:
            # a new request: its hits are already cached blocks
            req_blocks = self.req_to_blocks[req_id] = []
            self.num_cached_block[req_id] = len(new_computed_blocks)
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            num_full_blocks = num_tokens_to_cache // self.block_size
            num_cached = self.num_cached_block[req_id]
            if num_cached < num_full_blocks:
                pool.cache_full_blocks(
                    request, req_blocks, num_cached, num_full_blocks, self.block_size
                )
                self.num_cached_block[req_id] = num_full_blocks
        return new_blocks

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
