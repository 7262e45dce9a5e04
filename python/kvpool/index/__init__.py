"""The router side: which instance holds which prefix (the core's index is rust/kvpool/src/index).

The modules, each one job (docs/architecture.md):

- ``router``: ``Router``, the routing policies on a ``kvpool.KVIndex`` (``kvpool.router``);
- ``vllm_events``: ``VllmEventReader``, vLLM's KV event messages as index events (msgpack:
  ``kvpool[events]``);
- ``streams``: KV events on Redis Streams (``RedisEventPublisher``, ``read_events``) and
  ``PrefixIndex``, a small router view built from them.

This package imports nothing itself: ``import kvpool`` loads ``router``, the others load when
imported.
"""
