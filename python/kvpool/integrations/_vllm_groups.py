"""vLLM's KV cache groups as kvpool's pool holds them (``kvpool.integrations.vllm``).

vLLM 0.33 and 0.34 split a hybrid model's layers into groups of equal page size, one block
table each, all indexing one set of tensors by block id (block 0 is the null block): gpt-oss
(alternating window 128 and full attention) has one full-attention and one window group,
Gemma 3 (five window layers per full one) six window groups of one window and one
full-attention group (groups of equal layer count: 4 layers each of the 1B model's 26).
Llama 4 (three chunked local attention layers of 8,192 tokens per full one) three chunked
groups beside one full-attention group. kvpool's pool holds them in one block store
(docs/hybrid.md "One block store"): group 0 is full attention, groups 1 to ``window_groups``
the window groups of one ``sliding_window``, every id from the one free list.

Qwen3-Next / Qwen3.5 (Gated DeltaNet layers beside full attention), NemotronH and Jamba have
Mamba groups in "align" mode: the pool's state groups (``state_groups``, docs/hybrid.md "State
groups"), whose tables hold the block of a step's state where vLLM's worker reads and writes
it (the previous step's block, carried until the step is done, and the current one).

Chunked local attention groups are the pool's window groups with ``attention_chunk_size``: a
query at position p reads the tokens from its chunk's start ``p - p % chunk``, so the tables
hold the blocks from there (null entries before, as vLLM's own chunked tables), and a hit at a
boundary needs each chunked group's blocks from that boundary's chunk start only.

``group_layout`` reads a ``KVCacheConfig`` into that mapping, or raises NotImplementedError
naming the group it cannot hold. Import ``kvpool.integrations.vllm``, which checks the vLLM
version first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

try:  # (a circular buffer group's blocks are not zeroed: vLLM's rule)
    from vllm.v1.kv_cache_interface import CircularBufferSpec as _CircularBuffer
except ImportError:  # pragma: no cover
    _CircularBuffer = ()  # type: ignore[assignment,misc]

try:  # (both supported versions have it; a window MLA group is a window group all the same)
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec as _WindowMLA
except ImportError:  # pragma: no cover
    _WindowMLA = SlidingWindowSpec

__all__ = ["MAX_WINDOW_GROUPS", "GroupLayout", "group_layout", "window_of"]

MAX_WINDOW_GROUPS = 8  # the core's limit (``window_groups``)


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"kvpool.integrations.vllm.KVCacheManager: {what} is not supported")


@dataclass(frozen=True)
class GroupLayout:
    """Where each of vLLM's groups lives in kvpool's pool.

    Attributes
    ----------
    pool_groups : tuple of int
        kvpool's group of each vLLM group, in vLLM's order (0: full attention; 1, 2, ...: the
        window groups in vLLM's order).
    sliding_window : int or None
        The window groups' window in tokens (a chunked local attention group's: its chunk);
        None for one full-attention group.
    kind : str
        What the groups beside full attention are: ``"window"`` (sliding windows),
        ``"chunked"`` (chunked local attention, ``sliding_window`` their chunk), ``"state"``
        (Mamba groups in "align" mode), or ``"full"`` (none).
    block_size : int
        Tokens per block, the same in every group.
    specs : tuple
        Each vLLM group's ``kv_cache_spec``, in vLLM's order.
    """

    pool_groups: tuple[int, ...]
    sliding_window: int | None
    kind: str
    block_size: int
    specs: tuple[Any, ...]

    @property
    def num_groups(self) -> int:
        """vLLM's groups (kvpool's too)."""
        return len(self.pool_groups)

    @property
    def window_groups(self) -> int:
        """Groups beside full attention (window, chunked or state groups; 0 for none)."""
        return len(self.pool_groups) - 1

    @property
    def chunked(self) -> bool:
        """The groups beside full attention are chunked local attention groups."""
        return self.kind == "chunked"

    def zeroed_groups(self, kv_cache_config: Any) -> tuple[int, ...]:
        """vLLM's groups whose new blocks its workers zero (``needs_kv_cache_zeroing``: Mamba
        states or several precisions share the ids): the attention groups, in vLLM's order."""
        if not getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
            return ()
        return tuple(
            g
            for g, spec in enumerate(self.specs)
            if isinstance(spec, AttentionSpec) and not isinstance(spec, _CircularBuffer)
        )

    def pool_options(self) -> dict[str, int]:
        """``BlockManagerPool`` options of the groups beside full attention."""
        if self.kind == "state":
            return {"state_groups": self.window_groups}
        if self.sliding_window is None:
            return {}
        name = "attention_chunk_size" if self.chunked else "sliding_window"
        return {name: self.sliding_window, "window_groups": self.window_groups}

    @property
    def vllm_groups(self) -> tuple[int, ...]:
        """vLLM's group of each kvpool group, in kvpool's order (inverse of ``pool_groups``)."""
        inverse = [0] * len(self.pool_groups)
        for vllm_group, pool_group in enumerate(self.pool_groups):
            inverse[pool_group] = vllm_group
        return tuple(inverse)


def _is_full(spec: Any) -> bool:
    return (
        isinstance(spec, FullAttentionSpec)
        and not getattr(spec, "sliding_window", None)
        and not getattr(spec, "attention_chunk_size", None)
    )


def window_of(spec: Any) -> int | None:
    """The window kvpool keeps for a group of ``spec``: a sliding window's size, a chunked
    local attention group's chunk (module doc); None for any other group."""
    if isinstance(spec, (SlidingWindowSpec, _WindowMLA)):
        return getattr(spec, "sliding_window", None) or None
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return spec.attention_chunk_size or None
    return None


def _state_group(spec: Any, i: int) -> bool:
    """Whether ``spec`` is a Mamba group kvpool takes (group ``i``): "align" mode, no
    speculative or prefill checkpoint blocks (NotImplementedError naming what else)."""
    if not isinstance(spec, MambaSpec):
        return False
    mode = getattr(spec, "mamba_cache_mode", None)
    if mode != "align":
        raise _unsupported(f"Mamba group {i} in mamba_cache_mode={mode!r} ('align' is)")
    for name in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
        if getattr(spec, name, 0):
            raise _unsupported(f"{name}={getattr(spec, name)} in Mamba group {i}")
    return True


def group_layout(kv_cache_config: Any) -> GroupLayout:
    """kvpool's groups for ``kv_cache_config``'s: one full-attention group and any number (up
    to ``MAX_WINDOW_GROUPS``) of sliding-window or chunked local attention groups of one window
    (or chunk), or of Mamba groups in "align" mode, with one block size.

    Raises
    ------
    NotImplementedError
        Any other group (cross attention, Mamba in another mode or with speculative or
        prefill checkpoint blocks, ...), several full-attention groups, window groups of
        different windows or block sizes, groups of several kinds beside full attention, a
        window group retaining tokens below its window (``extra_retained_tokens``, MTP), or no
        group.
    """
    specs = tuple(group.kv_cache_spec for group in kv_cache_config.kv_cache_groups)
    full = [i for i, spec in enumerate(specs) if _is_full(spec)]
    states = [i for i, spec in enumerate(specs) if i not in full and _state_group(spec, i)]
    windows = [
        i for i, spec in enumerate(specs) if i not in full and i not in states and window_of(spec)
    ]
    for i, spec in enumerate(specs):
        if i not in full and i not in windows and i not in states:
            raise _unsupported(
                f"a {type(spec).__name__} KV cache group (group {i}); full-attention, "
                "sliding-window, chunked local attention and Mamba ('align') groups are"
            )
    if states and windows:
        raise _unsupported("Mamba groups beside sliding-window or chunked groups in one model")
    if len(states) > MAX_WINDOW_GROUPS:
        raise _unsupported(f"{len(states)} Mamba groups; at most {MAX_WINDOW_GROUPS} are")
    if len(full) != 1:
        raise _unsupported(
            f"{len(full)} full-attention KV cache groups among {len(specs)}; exactly one (beside "
            "any sliding-window groups) is"
        )
    if len(windows) > MAX_WINDOW_GROUPS:
        raise _unsupported(f"{len(windows)} sliding-window groups; at most {MAX_WINDOW_GROUPS} are")
    chunked = {isinstance(specs[i], ChunkedLocalAttentionSpec) for i in windows}
    if len(chunked) > 1:
        raise _unsupported("sliding-window and chunked local attention groups in one model")
    window_sizes = sorted({window_of(specs[i]) or 0 for i in windows})  # (each is positive)
    if len(window_sizes) > 1:
        raise _unsupported(f"sliding-window groups of different windows {window_sizes}")
    block_sizes = sorted({spec.block_size for spec in specs})
    if len(block_sizes) > 1:
        raise _unsupported(f"KV cache groups of different block sizes {block_sizes}")
    for i in windows:
        extra = getattr(specs[i], "extra_retained_tokens", 0)
        if extra:
            raise _unsupported(
                f"extra_retained_tokens={extra} in sliding-window group {i} (multi-module MTP)"
            )
    pool_groups = [0] * len(specs)
    for position, i in enumerate(windows or states):
        pool_groups[i] = position + 1
    kind = (
        "state" if states else "chunked" if chunked == {True} else "window" if windows else "full"
    )
    return GroupLayout(
        pool_groups=tuple(pool_groups),
        sliding_window=window_sizes[0] if window_sizes else None,
        kind=kind,
        block_size=block_sizes[0],
        specs=specs,
    )
