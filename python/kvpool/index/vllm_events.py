"""Reading vLLM's KV event messages into ``kvpool.KVIndex`` events.

vLLM 0.33.0 publishes each ``KVEventBatch`` as the ZMQ frames ``(topic, seq, payload)``: ``seq``
is the batch's number (8 bytes, big-endian, per publisher, i.e. per dp rank) and ``payload``
the msgpack array ``[ts, events, data_parallel_rank]``, each event a map tagged by ``"type"``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; older releases encoded events as
arrays ``[tag, field, ...]``, read as well). :class:`VllmEventReader` turns a batch into event
dicts of the index's shape (docs/events.md), every event carrying the batch's number as its
``sequence`` (a batch is one publication unit), so that ``KVIndex.apply`` detects lost batches.

vLLM's block hashes (64-bit ints by default, or bytes) are not kvpool's, so the reader maps
them into the index's key space, remembering the mapping per (instance, dp rank):

- a stored block whose tokens the event carries, hashed without lookahead tokens and with no
  multimodal or embedding extra keys, gets kvpool's chained hash (R6, the index's seed) of those
  tokens under its parent's kvpool key; a chain's first block is rooted at
  ``vllm_extra_key(lora_name, cache_salt)``. Such blocks match ``KVIndex.lookup(token_ids,
  extra_key=vllm_extra_key(...))`` from a router that has only the prompt;
- any other block (no tokens, multimodal content, lookahead hashing, a parent the reader never
  saw) gets an opaque key: kvpool's hash of a marker word and the vLLM hash's bytes under the
  parent's key. It matches nothing a token lookup computes, never a wrong prefix;
- ``BlockRemoved`` (hashes only) and tokenless stores (CPU offload) resolve through the mapping;
  a mapping is dropped when its block is gone from every medium and group.

Media: ``"GPU"`` (or none) is ``device``, ``"CPU"`` is ``host``, anything else (``"STORAGE"``,
connectors' tiers) ``remote``. Group kinds: ``sliding_window`` and ``sliding_window_mla`` are
sliding windows, ``mamba`` a linear state, everything else (full, MLA, sink, chunked local, or
none) full attention, which asks the most of a hit and so never claims one that is not there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import msgpack

from kvpool._core import KVIndex

__all__ = ["VllmEventReader", "vllm_extra_key", "MEDIA"]

MEDIA = {None: "device", "GPU": "device", "CPU": "host"}
_SLIDING = {"sliding_window", "sliding_window_mla"}
_LINEAR = {"mamba"}
# Field order of the array form (tagged array_like structs of older vLLM releases).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_MARKER = 0xFFFF_FFFF  # no token id: opaque keys never collide with token blocks
_ORPHAN = b"kvpool/vllm/orph"  # parent key of a block whose parent the reader never saw


def vllm_extra_key(lora_name: str | None = None, cache_salt: str | None = None) -> bytes | None:
    """The kvpool extra key of a vLLM chain with this LoRA adapter and cache salt (or None)."""
    if lora_name is None and cache_salt is None:
        return None
    return msgpack.packb([lora_name, cache_salt])


def _hash_bytes(h: int | bytes) -> bytes:
    """Canonical bytes of a vLLM hash: bytes as they are, an int as 8 bytes big-endian."""
    if isinstance(h, (bytes, bytearray)):
        return bytes(h)
    if isinstance(h, int) and not isinstance(h, bool):
        return (h & (2**64 - 1)).to_bytes(8, "big")
    raise TypeError(f"block hash: must be an int or bytes, got {type(h).__name__}")


# the fields an event leaves out, with their defaults (docs/events.md)
_DEFAULTS: tuple[tuple[str, Any], ...] = (
    ("medium", "device"),
    ("dp_rank", 0),
    ("group", 0),
    ("group_kind", "full_attention"),
    ("sliding_window", None),
    ("extra_key", None),
    ("parent_hash", None),
    ("block_hashes", []),
    ("token_ids", None),
)


def _event_fields(event: Any) -> tuple[str, dict[str, Any]]:
    """(type, fields) of a decoded event, map or array form."""
    if isinstance(event, dict):
        return str(event.get("type")), event
    if isinstance(event, (list, tuple)) and event:
        tag = str(event[0])
        names = (
            _STORED_FIELDS
            if tag == "BlockStored"
            else _REMOVED_FIELDS
            if tag == "BlockRemoved"
            else ()
        )
        return tag, dict(zip(names, event[1:], strict=False))  # trailing defaults may be left out
    raise ValueError(f"event: not a vLLM KV event: {event!r}")


def _group_kind(kind: str | None, window: int | None) -> tuple[str, int | None]:
    if kind in _SLIDING and window:
        return "sliding_window", int(window)
    if kind in _LINEAR:
        return "linear_state", None
    return "full_attention", None


class VllmEventReader:
    """Turns vLLM ``KVEventBatch`` messages into ``KVIndex`` events (see the module doc).

    Parameters
    ----------
    index : kvpool.KVIndex
        The index the events are for: its hash seed keys the blocks; ``apply`` feeds it.
    """

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        # (instance, dp_rank) -> vLLM hash bytes -> [kvpool key, {(medium, group), ...}]
        self.keys: dict[tuple[int, int], dict[bytes, list[Any]]] = {}
        # (instance, dp_rank, group) -> (group_kind, sliding_window, block_size)
        self.groups: dict[tuple[int, int, int], tuple[str, int | None, int]] = {}

    # ---------------------------------------------------------------------------- reading
    def read_frames(self, instance: int, frames: Sequence[bytes]) -> list[dict[str, Any]]:
        """Events of the ZMQ frames ``(topic, seq, payload)`` one vLLM publisher sent."""
        if len(frames) != 3:
            raise ValueError(f"frames: expected (topic, seq, payload), got {len(frames)} frames")
        return self.read(instance, frames[2], sequence=int.from_bytes(frames[1], "big"))

    def read(
        self, instance: int, payload: bytes, *, sequence: int | None = None
    ) -> list[dict[str, Any]]:
        """Events of one msgpack ``KVEventBatch`` of ``instance``, numbered ``sequence``.

        Returns dicts of the shape ``KVIndex.apply`` takes; a batch whose events all vanish (a
        removal of blocks never stored) still yields one no-op event carrying its number.
        """
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as e:
            raise ValueError(f"payload: not msgpack: {e}") from e
        if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], list):
            raise ValueError("payload: not a vLLM KVEventBatch [ts, events, dp_rank]")
        dp_rank = int(batch[2]) if len(batch) > 2 and batch[2] is not None else 0
        out: list[dict[str, Any]] = []
        for raw in batch[1]:
            tag, fields = _event_fields(raw)
            if tag == "BlockStored":
                out.append(self._stored(instance, dp_rank, fields))
            elif tag == "BlockRemoved":
                out.extend(self._removed(instance, dp_rank, fields))
            elif tag == "AllBlocksCleared":
                out.append(self._cleared(instance, dp_rank))
            else:
                raise ValueError(f"event: unknown vLLM KV event type {tag!r}")
        if not out:
            out.append({"kind": "removed", "dp_rank": dp_rank, "block_size": 1, "block_hashes": []})
        for event in out:  # every field on every event, as the pool's (docs/events.md)
            event["sequence"] = sequence
            for key, default in _DEFAULTS:
                event.setdefault(key, default)
        return out

    def apply(
        self, instance: int, payload: bytes, *, sequence: int | None = None
    ) -> Mapping[str, Any]:
        """Reads one batch and applies it to the index; returns ``KVIndex.apply``'s report."""
        return self.index.apply(instance, self.read(instance, payload, sequence=sequence))

    # ------------------------------------------------------------------------ event kinds
    def _stored(self, instance: int, dp_rank: int, f: dict[str, Any]) -> dict[str, Any]:
        block_size = int(f["block_size"])
        group = int(f.get("group_idx") or 0)
        kind, window = _group_kind(
            f.get("kv_cache_spec_kind"), f.get("kv_cache_spec_sliding_window")
        )
        medium = MEDIA.get(f.get("medium"), "remote")
        self.groups[(instance, dp_rank, group)] = (kind, window, block_size)
        keys = self.keys.setdefault((instance, dp_rank), {})
        hashes = [_hash_bytes(h) for h in f["block_hashes"]]
        tokens: list[int] = list(f.get("token_ids") or [])
        if len(tokens) != len(hashes) * block_size or f.get("lookahead_token_ids") is not None:
            tokens = []  # not exactly the blocks' tokens: opaque keys
        extra_keys = list(f.get("extra_keys") or [])
        extra_keys += [None] * (len(hashes) - len(extra_keys))
        lora = f.get("lora_name")
        parent_raw = f.get("parent_block_hash")
        root_key: bytes | None = None
        if parent_raw is None:  # a chain's first block: rooted at the LoRA and salt key
            salt = self._salt(extra_keys[0] if hashes else None, lora)
            opaque = salt is False
            root_key = None if salt is False else vllm_extra_key(lora, salt)
            parent: bytes | None = None
        else:
            known = keys.get(_hash_bytes(parent_raw))
            opaque = known is None
            parent = _ORPHAN if known is None else known[0]
        first_parent = parent
        out_hashes = []
        for i, h in enumerate(hashes):
            entry = keys.get(h)
            if entry is None:
                opaque = (
                    opaque or not tokens or (i > 0 and self._salt(extra_keys[i], lora) is not None)
                )
                if opaque:
                    key = self._opaque(h, parent)
                else:
                    block = tokens[i * block_size : (i + 1) * block_size]
                    key = self.index.hash_blocks(
                        block, block_size, parent_hash=parent, extra_key=root_key
                    )[0]
                entry = keys[h] = [key, set()]
            entry[1].add((medium, group))
            out_hashes.append(entry[0])
            parent = entry[0]
        return {
            "kind": "stored",
            "medium": medium,
            "dp_rank": dp_rank,
            "group": group,
            "group_kind": kind,
            "sliding_window": window,
            "block_size": block_size,
            "extra_key": root_key,
            "parent_hash": first_parent,
            "block_hashes": out_hashes,
            "token_ids": tokens or None,
        }

    @staticmethod
    def _salt(extras: Iterable[Any] | None, lora: str | None) -> str | None | Literal[False]:
        """The cache salt among a block's extra keys: None if none, False if they hold
        anything a token chain cannot express (multimodal identifiers, embedding digests)."""
        items = list(extras or [])
        if lora is not None and items and items[0] == lora:
            items = items[1:]
        if not items:
            return None
        if len(items) == 1 and isinstance(items[0], str):
            return items[0]
        return False

    def _opaque(self, h: bytes, parent: bytes | None) -> bytes:
        padded = h + b"\0" * (-len(h) % 4)
        words = [_MARKER, len(h)] + [
            int.from_bytes(padded[i : i + 4], "big") for i in range(0, len(padded), 4)
        ]
        return self.index.hash_blocks(words, len(words), parent_hash=parent or _ORPHAN)[0]

    def _removed(self, instance: int, dp_rank: int, f: dict[str, Any]) -> list[dict[str, Any]]:
        group = int(f.get("group_idx") or 0)
        known = self.groups.get((instance, dp_rank, group))
        if known is None:
            return []  # a group never stored into: nothing of it in the index
        kind, window, block_size = known
        medium = MEDIA.get(f.get("medium"), "remote")
        keys = self.keys.get((instance, dp_rank), {})
        out_hashes = []
        for h in (_hash_bytes(x) for x in f["block_hashes"]):
            entry = keys.get(h)
            if entry is None:
                continue
            out_hashes.append(entry[0])
            entry[1].discard((medium, group))
            if not entry[1]:
                del keys[h]
        if not out_hashes:
            return []
        return [
            {
                "kind": "removed",
                "medium": medium,
                "dp_rank": dp_rank,
                "group": group,
                "group_kind": kind,
                "sliding_window": window,
                "block_size": block_size,
                "block_hashes": out_hashes,
            }
        ]

    def _cleared(self, instance: int, dp_rank: int) -> dict[str, Any]:
        keys = self.keys.get((instance, dp_rank), {})
        for h in list(keys):
            presence = keys[h][1]
            presence -= {p for p in presence if p[0] == "device"}
            if not presence:
                del keys[h]
        return {"kind": "cleared", "medium": "device", "dp_rank": dp_rank, "block_size": 1}
