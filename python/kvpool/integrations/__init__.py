"""Drop-in KV cache managers for serving engines, built on ``kvpool.BlockManagerPool``.

Each engine has its own module, imported on its own (it imports that engine): see
docs/integrations.md.
"""
