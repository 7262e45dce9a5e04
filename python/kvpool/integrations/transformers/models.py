"""Models for the runner: tiny random-weight configs, and loading a model by id, path or config.

``tiny_config(family)`` returns a small config (a few layers, head_dim 64, vocabulary 512) of one
of :data:`FAMILIES`, for tests and for ``kvpool generate`` on a machine without hub access:

* ``qwen3``: full attention with GQA;
* ``llama``: full attention;
* ``gemma3``: Gemma 3 text, local (sliding-window) and global layers;
* ``mistral``: every layer windowed;
* ``qwen3_next``: Gated DeltaNet (linear attention) layers beside gated full attention, MoE.

:func:`load_model` takes ``tiny-<family>``, a ``config.json`` path (random weights), a local
checkpoint directory or a hub id (``random_weights=True``: the hub config only).
"""

from __future__ import annotations

import json
import os
from typing import Any

FAMILIES = ("qwen3", "llama", "gemma3", "mistral", "qwen3_next")

_COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


def tiny_config(family: str, **overrides: Any) -> Any:
    """A tiny config of ``family`` (random weights come from ``from_config``)."""
    import transformers as tf

    kw: dict[str, Any] = dict(_COMMON)
    if family == "qwen3":
        cls, kw = tf.Qwen3Config, {**kw, "num_hidden_layers": 2}
    elif family == "llama":
        cls, kw = tf.LlamaConfig, {**kw, "num_hidden_layers": 2}
    elif family == "mistral":
        cls, kw = tf.MistralConfig, {**kw, "num_hidden_layers": 2, "sliding_window": 24}
    elif family == "gemma3":
        cls = tf.Gemma3TextConfig
        kw = {
            **kw,
            "num_hidden_layers": 3,
            "sliding_window": 24,
            "query_pre_attn_scalar": 64,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        }
    elif family == "qwen3_next":
        cls = tf.Qwen3NextConfig
        kw = {
            **kw,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
        }
    else:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    kw.update(overrides)
    return cls(**kw)


def from_config(config: Any, *, seed: int = 0, dtype: Any = None, device: str = "cpu") -> Any:
    """A causal LM with random weights (seeded) from ``config``, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    return model.to(device).eval()


def load_model(
    spec: str,
    *,
    random_weights: bool = False,
    seed: int = 0,
    dtype: Any = None,
    device: str = "cpu",
) -> tuple[Any, Any]:
    """``(model, tokenizer or None)`` for ``tiny-<family>``, a config.json, a checkpoint
    directory or a hub id (see the module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if spec.startswith("tiny-"):
        return from_config(
            tiny_config(spec[5:].replace("-", "_")), seed=seed, dtype=dtype, device=device
        ), None
    if spec.endswith(".json") and os.path.isfile(spec):
        with open(spec) as f:
            config = AutoConfig.for_model(**json.load(f))
        return from_config(config, seed=seed, dtype=dtype, device=device), None
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except Exception:  # a config without a tokenizer, or no hub access: token ids then
        tokenizer = None
    if random_weights:
        return from_config(
            AutoConfig.from_pretrained(spec), seed=seed, dtype=dtype, device=device
        ), tokenizer
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype or "auto").to(device).eval()
    return model, tokenizer
