"""Linear-attention state from kvpool's slots, in the shape transformers' Gated DeltaNet reads.

Qwen3-Next's ``Qwen3NextGatedDeltaNet.forward`` reads and writes its conv and recurrent state
through the cache object it is given (``has_previous_state``, ``update_conv_state``,
``update_recurrent_state``, ``layers[i].conv_states[0]`` / ``.recurrent_states[0]``; the
single-token path updates ``conv_states[0]`` in place). :class:`SlotStateCache` is that object
for one forward: each batch row's state is gathered from the runner's slot tensors
(``[num_slots, ...]`` per layer, indexed by ``seq.linear_state_slot``) before the forward and
scattered back after it (:meth:`SlotStateCache.scatter`).

A fresh sequence's slot holds zeros (the pool's ``zero_slots`` plan, which the runner executes),
so every row has a "previous state": the conv over ``cat(zeros, x)`` and a zero initial
recurrent state equal the model's own no-cache path. Attention layers' ``update`` returns K/V
unchanged: their K/V go to the paged cache inside the attention function.
"""

from __future__ import annotations

from typing import Any

import torch


class _LinearLayer:
    """One layer's state rows for the current forward (transformers' attribute names)."""

    record_past = False

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv_states = {0: conv}
        self.recurrent_states = {0: recurrent}
        self.has_previous_state = {0: True}


class SlotStateCache:
    """The duck-typed ``transformers`` cache of one forward over linear-state slots."""

    is_compileable = False

    def __init__(
        self, conv: dict[int, torch.Tensor], recurrent: dict[int, torch.Tensor], slots: torch.Tensor
    ):
        self._conv, self._recurrent, self._slots = conv, recurrent, slots
        self.layers = {
            layer: _LinearLayer(conv[layer][slots], recurrent[layer][slots]) for layer in conv
        }

    def has_previous_state(
        self, layer_idx: int | None = None, state_idx: int | None = None
    ) -> bool:
        return True

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        layer = self.layers[layer_idx]
        old = layer.conv_states[0]
        full = torch.cat([old.to(conv_states.dtype), conv_states], dim=-1)
        layer.conv_states[0] = full[..., -old.shape[-1] :].contiguous()
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.layers[layer_idx].recurrent_states[0] = recurrent_states
        return recurrent_states

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states  # paged attention writes them (attention.py)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("the paged runner passes explicit position_ids")

    def scatter(self) -> None:
        """Writes every row's new state back into its slot."""
        for layer, state in self.layers.items():
            self._conv[layer][self._slots] = state.conv_states[0].to(self._conv[layer].dtype)
            self._recurrent[layer][self._slots] = state.recurrent_states[0].to(
                self._recurrent[layer].dtype
            )
