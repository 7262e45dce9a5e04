"""Drop-in block managers for serving engines, on kvpool's pool.

Each engine has its own module, imported on its own (it imports that engine, if any):

* :mod:`kvpool.integrations.nanovllm`: ``BlockManager(num_blocks, block_size)``, nano-vllm's
  block-manager interface on nano-vllm's own ``Sequence`` objects;
* :mod:`kvpool.integrations.vllm`: ``KVCacheManager``, vLLM's KV cache manager (0.33.x, 0.34.x)
  under its real Scheduler (``kvpool.integrations.vllm.install()``).

docs/integrations.md shows the swap for each.
"""
