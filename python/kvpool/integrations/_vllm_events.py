"""The pool's KV events (R21) as vLLM's, for ``KVCacheManager.take_events``.

``BlockStored`` (hashes as the low 64 bits of kvpool's 128-bit hashes, or the bytes when
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; parent chaining, tokens, ``lora_name``, the cache
salt in ``extra_keys``), ``BlockRemoved`` and ``AllBlocksCleared``, the same types in vLLM 0.33
and 0.34. Each event names vLLM's group (``group_idx``) and, when stored, its kind and window
(``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, as vLLM's manager annotates them).
Import ``kvpool.integrations.vllm``, which checks the vLLM version first.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvpool._core import KVEvent

__all__ = ["KIND", "MEDIUM", "EventGroup", "event_groups", "vllm_event"]

MEDIUM = "GPU"
KIND = "full_attention"

EventGroup = tuple[int, str, "int | None"]
"""vLLM's group index, its spec's kind and sliding window, of one kvpool group."""


def event_groups(layout: Any) -> list[EventGroup]:
    """Each kvpool group's ``EventGroup``, in kvpool's order (``layout``: a ``GroupLayout``)."""
    return [
        (
            i,
            get_kv_cache_spec_kind(layout.specs[i]).value,
            get_kv_cache_spec_sliding_window(layout.specs[i]),
        )
        for i in layout.vllm_groups
    ]


def _external_hash(h: bytes, int_hashes: bool) -> int | bytes:
    # vLLM publishes the low 64 bits of a hash as an int by default
    return int.from_bytes(h[8:], "big") if int_hashes else h


def vllm_event(
    event: KVEvent,
    chain_keys: dict[bytes, tuple[str | None, str | None]],
    int_hashes: bool,
    group: EventGroup = (0, KIND, None),
) -> Any:
    """vLLM's event for one pool event; ``chain_keys``: each recorded chain key's LoRA name and
    cache salt (``KVCacheManager._extra_key``); ``group``: the event's group as vLLM names it."""
    group_idx, kind, window = group
    if event.kind == "cleared":
        return AllBlocksCleared()
    hashes = [_external_hash(h, int_hashes) for h in event.block_hashes]
    if event.kind == "removed":
        return BlockRemoved(block_hashes=hashes, medium=MEDIUM, group_idx=group_idx)
    lora, salt = chain_keys.get(event.extra_key, (None, None)) if event.extra_key else (None, None)
    extra_keys = None
    if lora is not None or salt:
        first = event.parent_hash is None
        extra_keys = [
            tuple([lora] if lora is not None else [])
            + ((salt,) if salt and first and i == 0 else ())
            or None
            for i in range(len(hashes))
        ]
    parent = None if event.parent_hash is None else _external_hash(event.parent_hash, int_hashes)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=event.token_ids,
        block_size=event.block_size,
        lora_id=None,
        medium=MEDIUM,
        lora_name=lora,
        extra_keys=extra_keys,
        group_idx=group_idx,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )
