"""A Hugging Face ``transformers`` causal LM whose KV lives in kvpool (docs/engine.md).

* :class:`PagedModelRunner` (runner.py): the model on only the tokens a step computes, its
  attention over kvpool's paged cache (``kvpool.kernels``, any backend), its linear-attention
  state in the pool's linear-state slots;
* :class:`Engine` (engine.py): continuous batching on a ``BlockManagerPool`` (chunked prefill
  ending on checkpoint boundaries, greedy or seeded sampling, recompute preemption, the batch
  calls), also behind ``kvpool generate``;
* :func:`layout_of` (layout.py): which pool group holds each layer.

Importing this package imports ``torch`` and ``transformers``.
"""

from kvpool.integrations.transformers.engine import Engine, Request, SamplingParams
from kvpool.integrations.transformers.layout import ModelLayout, layout_of
from kvpool.integrations.transformers.runner import PagedModelRunner

__all__ = ["Engine", "ModelLayout", "PagedModelRunner", "Request", "SamplingParams", "layout_of"]
