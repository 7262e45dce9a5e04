"""Drop-in block managers for serving engines, on kvpool's pool.

* :mod:`kvpool.integrations.nanovllm`: ``BlockManager(num_blocks, block_size)``, nano-vllm's
  block-manager interface on nano-vllm's own ``Sequence`` objects (docs/integrations.md).
"""
