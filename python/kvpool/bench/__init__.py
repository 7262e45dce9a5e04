"""Benchmarks that need to ship with the package (``kvpool bench``).

* :mod:`kvpool.bench.nanovllm_reference`: a pure-Python block manager following nano-vllm's
  published ``BlockManager`` algorithm (deque free list, chained xxh64, hash -> block id dict,
  token verification).
* :mod:`kvpool.bench.vllm_reference`: a pure-Python ``BlockPool`` / ``KVCacheManager`` following
  vLLM v1's published algorithm (intrusive doubly linked free queue, lazy LRU eviction, SHA-256 or
  xxh3-128 block hashes over pickle).
* :mod:`kvpool.bench.compare`: replays one seeded shared-prefix trace through kvpool and the
  references (and the real packages when importable) and prints one table.

Both references were written for this repository from descriptions of the algorithms; they are
not copies of the projects' code.
"""

__all__ = ["adapters", "compare", "nanovllm_reference", "vllm_reference"]
