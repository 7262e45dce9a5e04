"""Which kvpool group holds each layer of a Hugging Face causal LM, read off its config.

A layer is one of three kinds (``config.layer_types``, or derived for models without it):

* ``"full"``: full attention; its K/V live in the pool's group 0 (``block_tables(seqs, 0)``);
* ``"window"``: sliding-window attention of ``window`` tokens; its K/V live in the window group
  (group 1 of a pool built with ``sliding_window=window``, R25);
* ``"linear"``: a linear-attention layer (Gated DeltaNet); its conv and recurrent state live in
  the pool's linear-state slots (R22), one state tensor ``[num_slots, ...]`` per layer and kind.

Invariants: every window layer has the same window (one window group); attention layers share
one K/V shape (``num_kv_heads``, ``head_dim``); group 0 exists even when no layer uses it (a pool
always has it: it owns the prefix chain), and then holds no memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("full", "window", "linear")
_HF_KINDS = {
    "full_attention": "full",
    "sliding_attention": "window",
    "linear_attention": "linear",
}


@dataclass(frozen=True)
class LinearStateShape:
    """Per-sequence shapes of one linear-attention layer's state (without the slot axis)."""

    conv: tuple[int, ...]
    recurrent: tuple[int, ...]


@dataclass(frozen=True)
class ModelLayout:
    """Layer kinds and cache shapes of a model (see the module doc)."""

    kinds: tuple[str, ...]
    num_kv_heads: int
    head_dim: int
    window: int | None = None
    linear: dict[int, LinearStateShape] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.kinds)

    def layers(self, kind: str) -> list[int]:
        """Indices of the layers of ``kind``."""
        return [i for i, k in enumerate(self.kinds) if k == kind]

    @property
    def has_linear(self) -> bool:
        return "linear" in self.kinds

    @property
    def has_window(self) -> bool:
        return "window" in self.kinds

    def group_of(self, layer: int) -> int:
        """The pool group whose block table and slot mapping an attention layer uses."""
        kind = self.kinds[layer]
        if kind == "linear":
            raise ValueError(f"layer {layer} is a linear-attention layer: it has no block table")
        return 1 if kind == "window" else 0

    def pool_options(
        self,
        *,
        linear_state_slots: int | None = None,
        checkpoint_interval: int | None = None,
        swa_num_blocks: int | None = None,
    ) -> dict[str, Any]:
        """The ``BlockManagerPool`` options this model needs: a window group, linear state."""
        opts: dict[str, Any] = {}
        if self.has_window:
            opts["sliding_window"] = self.window
            if swa_num_blocks is not None:
                opts["swa_num_blocks"] = swa_num_blocks
        if self.has_linear:
            if not linear_state_slots:
                raise ValueError(
                    "linear_state_slots: a model with linear-attention layers needs "
                    "linear-state slots (at least 2)"
                )
            opts["linear_state_slots"] = linear_state_slots
            if checkpoint_interval is not None:
                opts["checkpoint_interval"] = checkpoint_interval
        return opts


def layout_of(model: Any) -> ModelLayout:
    """The layout of a ``transformers`` causal LM (``model.config`` and its linear modules)."""
    config = model.config
    config = getattr(config, "text_config", None) or config
    n = config.num_hidden_layers
    window: Any = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        # Mistral-style configs: every layer windowed when sliding_window is set.
        types = ["sliding_attention" if window else "full_attention"] * n
    kinds = []
    for i, t in enumerate(types[:n]):
        if t not in _HF_KINDS:
            raise NotImplementedError(
                f"layer {i} has layer type {t!r}; the paged runner serves {sorted(_HF_KINDS)}"
            )
        kinds.append(_HF_KINDS[t])
    if "window" in kinds and not window:
        raise ValueError("config has sliding_attention layers but no sliding_window")
    if getattr(config, "attn_logit_softcapping", None):
        raise NotImplementedError("attention logit soft-capping is not supported by kvpool.kernels")
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError("bidirectional attention is not a causal LM")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    linear = {i: _linear_shape(model, i) for i, k in enumerate(kinds) if k == "linear"}
    return ModelLayout(
        tuple(kinds),
        int(kv_heads),
        int(head_dim),
        int(window) if "window" in kinds else None,
        linear,
    )


def _linear_shape(model: Any, layer: int) -> LinearStateShape:
    """Conv and recurrent state shapes of a Gated DeltaNet layer (Qwen3-Next's attributes)."""
    module = _linear_module(model, layer)
    try:
        conv = (int(module.conv_dim), int(module.conv_kernel_size))
        rec = (int(module.num_v_heads), int(module.head_k_dim), int(module.head_v_dim))
    except AttributeError as e:
        raise NotImplementedError(
            f"layer {layer}: {type(module).__name__} does not expose the Gated DeltaNet state "
            "shapes (conv_dim, conv_kernel_size, num_v_heads, head_k_dim, head_v_dim)"
        ) from e
    return LinearStateShape(conv, rec)


def _linear_module(model: Any, layer: int) -> Any:
    for module in model.modules():
        if getattr(module, "layer_idx", None) == layer and hasattr(module, "conv1d"):
            return module
    raise NotImplementedError(f"layer {layer}: no linear-attention module with a conv1d found")
