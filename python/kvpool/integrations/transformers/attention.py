"""The attention function registered with transformers' ``AttentionInterface`` as ``"kvpool"``.

Every attention module of a model calls ``attention_interface(module, query, key, value, mask,
scaling=..., sliding_window=..., ...)`` with the step's new tokens only (the runner passes no HF
cache). This function writes the step's K/V into kvpool's paged cache (``write_kv`` with the
pool's slot mapping of the layer's group) and attends over the group's block tables
(``paged_prefill_attention``, or ``paged_decode_attention`` when every sequence has one query),
on the runner's kernel backend. Which step it serves is a context variable the runner sets
around its forward (:func:`step_scope`); outside one it raises.

The query rows: ``query`` is ``[B, Hq, T, D]``; row-major ``B * T`` tokens are the step's
sequences one after another (``B = 1`` packs several sequences, ``T = 1`` batches decodes,
equal chunks use ``B`` rows), which is exactly ``cu_seqlens_q``'s order.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

NAME = "kvpool"
_STEP: contextvars.ContextVar[Any] = contextvars.ContextVar("kvpool_paged_step", default=None)
_registered = False


def register() -> None:
    """Registers :func:`paged_attention` under :data:`NAME` (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, paged_attention)
        _registered = True


@contextlib.contextmanager
def step_scope(step: Any, config: Any) -> Iterator[None]:
    """Inside: the model's attention layers call :func:`paged_attention` for ``step``."""
    register()
    token = _STEP.set(step)
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
        _STEP.reset(token)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature on kvpool's paged cache (see the module doc)."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError("the 'kvpool' attention runs only inside PagedModelRunner.forward")
    if softcap or kwargs.get("s_aux") is not None:
        raise NotImplementedError("soft-capping and attention sinks are not in kvpool.kernels")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = step.attend(module.layer_idx, query, key, value, float(scaling), sliding_window)
    return out, None
