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

Invariants: the mapping is the publisher's state after the last batch the index applied for
that source (``apply`` undoes a batch's changes when the index skips, drops or refuses it, so a
replay after a gap resolves every removal); a batch is untrusted input, and one the reader
refuses (ValueError or TypeError naming ``events[i].field``) changes neither mapping nor index.

Media: ``"GPU"`` (or none) is ``device``, ``"CPU"`` is ``host``, anything else (``"STORAGE"``,
connectors' tiers) ``remote``. Group kinds: ``sliding_window`` and ``sliding_window_mla`` are
sliding windows, ``mamba`` a linear state, everything else (full, MLA, sink, chunked local, or
none) full attention, which asks the most of a hit and so never claims one that is not there.

Groups announced up front: vLLM sends nothing for a group that has stored nothing, so an index
that learns groups from stored events takes a hybrid model's instance for a plain one until its
linear-state group commits a checkpoint (and credits hits the instance cannot restore). Given
the model's ``groups`` (as its KV-cache config lists them), the reader puts one ``"group"`` event
per group (device medium) before the first batch it reads of each (instance, dp rank).
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
_MAX_GROUPS = 31  # groups one location of the index holds (kvpool::index::MAX_GROUPS)
_MISSING = object()  # a key a dict did not hold (the undo log)
_ORPHAN = b"kvpool/vllm/orph"  # parent key of a block whose parent the reader never saw


def vllm_extra_key(lora_name: str | None = None, cache_salt: str | None = None) -> bytes | None:
    """The kvpool extra key of a vLLM chain with this LoRA adapter and cache salt (or None)."""
    if lora_name is None and cache_salt is None:
        return None
    return msgpack.packb([lora_name, cache_salt])


def _hash_bytes(h: int | bytes, name: str = "block hash") -> bytes:
    """Canonical bytes of a vLLM hash: bytes as they are, an int as 8 bytes big-endian."""
    if isinstance(h, (bytes, bytearray)):
        return bytes(h)
    if isinstance(h, int) and not isinstance(h, bool):
        return (h & (2**64 - 1)).to_bytes(8, "big")
    raise TypeError(f"{name}: a block hash must be an int or bytes, got {type(h).__name__}")


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


def _group_kind(kind: str | None, window: int | None) -> tuple[str, int | None]:
    if kind in _SLIDING and window:
        return "sliding_window", min(window, 2**32 - 1)  # a wider window covers just as much
    if kind in _LINEAR:
        return "linear_state", None
    return "full_attention", None


class VllmEventReader:
    """Turns vLLM ``KVEventBatch`` messages into ``KVIndex`` events (see the module doc).

    The hash mapping follows the batches the index applies, and only those: ``apply`` and
    ``apply_frames`` keep a batch's mapping changes when the index applied it and undo them
    when it skipped it (a duplicate), dropped it (a gap or a stall) or refused it; ``read``
    and ``read_frames`` keep them when the index would apply a batch of that number now
    (``KVIndex.can_apply``), for a caller that applies each batch it reads before reading the
    next. A batch the reader refuses (ValueError or TypeError naming the field) changes nothing.

    Parameters
    ----------
    index : kvpool.KVIndex
        The index the events are for: its hash seed keys the blocks; ``apply`` feeds it.
    groups : sequence of dict, optional
        The model's KV-cache groups in ``group_idx`` order, each ``{"kind": kv_cache_spec_kind,
        "block_size": int, "sliding_window": int or None}``: announced for every source before
        its first batch (module doc).
    """

    def __init__(self, index: KVIndex, *, groups: Sequence[dict[str, Any]] | None = None) -> None:
        self.index = index
        self.announce = _announcements(groups)
        # sources whose groups went out with a batch the index applied (or would)
        self.announced: dict[tuple[int, int], bool] = {}
        # (instance, dp_rank) -> vLLM hash bytes -> (kvpool key, frozenset of (medium, group))
        self.keys: dict[tuple[int, int], dict[bytes, tuple[bytes, frozenset[tuple[str, int]]]]] = {}
        # (instance, dp_rank, group) -> (group_kind, sliding_window, block_size)
        self.groups: dict[tuple[int, int, int], tuple[str, int | None, int]] = {}
        # the open batch's changes to keys and groups: (dict, key, previous value or _MISSING)
        self._undo: list[tuple[dict[Any, Any], Any, Any]] = []

    # ---------------------------------------------------------------------------- reading
    def read_frames(self, instance: int, frames: Sequence[bytes]) -> list[dict[str, Any]]:
        """Events of the ZMQ frames ``(topic, seq, payload)`` one vLLM publisher sent."""
        return self.read(instance, _payload_of(frames), sequence=_sequence_of(frames))

    def apply_frames(self, instance: int, frames: Sequence[bytes]) -> Mapping[str, Any]:
        """Reads the ZMQ frames ``(topic, seq, payload)`` and applies them (as ``apply``)."""
        return self.apply(instance, _payload_of(frames), sequence=_sequence_of(frames))

    def read(
        self, instance: int, payload: bytes, *, sequence: int | None = None
    ) -> list[dict[str, Any]]:
        """Events of one msgpack ``KVEventBatch`` of ``instance``, numbered ``sequence``.

        Returns dicts of the shape ``KVIndex.apply`` takes; a batch whose events all vanish (a
        removal of blocks never stored) still yields one no-op event carrying its number. The
        mapping changes are kept if the index would apply the batch now (class doc).
        """
        events, dp_rank = self._read(instance, payload, sequence)
        if sequence is None or self.index.can_apply(instance, sequence, dp_rank=dp_rank):
            self._undo.clear()
        else:
            self._rollback()
        return events

    def apply(
        self, instance: int, payload: bytes, *, sequence: int | None = None
    ) -> Mapping[str, Any]:
        """Reads one batch and applies it to the index; returns ``KVIndex.apply``'s report.
        The mapping changes are kept only if the index applied the batch (class doc)."""
        events, _ = self._read(instance, payload, sequence)
        try:
            report = self.index.apply(instance, events)
        except BaseException:
            self._rollback()
            raise
        # One batch is one source and one number: the index applies all of it or none.
        if report["applied"]:
            self._undo.clear()
        else:
            self._rollback()
        return report

    def _read(
        self, instance: int, payload: bytes, sequence: int | None
    ) -> tuple[list[dict[str, Any]], int]:
        """The batch's events and dp rank, its mapping changes made and logged in ``_undo``
        (undone if reading fails)."""
        _check_int(instance, "instance", 2**64 - 1)
        if sequence is not None:
            _check_int(sequence, "sequence", 2**64 - 1)
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload: must be bytes, got {type(payload).__name__}")
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as e:
            raise ValueError(f"payload: not msgpack: {e}") from e
        if (
            not isinstance(batch, (list, tuple))
            or len(batch) < 2
            or not isinstance(batch[1], (list, tuple))
        ):
            raise ValueError("payload: not a vLLM KVEventBatch [ts, events, dp_rank]")
        rank = batch[2] if len(batch) > 2 else None
        dp_rank = 0 if rank is None else _check_int(rank, "payload: data_parallel_rank", 2**32 - 1)
        self._undo.clear()
        out: list[dict[str, Any]] = []
        try:
            for i, raw in enumerate(batch[1]):
                at = f"events[{i}]"
                tag, fields = _event_fields(raw, at)
                if tag == "BlockStored":
                    out.append(self._stored(instance, dp_rank, fields, at))
                elif tag == "BlockRemoved":
                    out.extend(self._removed(instance, dp_rank, fields, at))
                elif tag == "AllBlocksCleared":
                    out.append(self._cleared(instance, dp_rank))
                else:
                    raise ValueError(f"{at}: unknown vLLM KV event type {tag!r}")
        except BaseException:
            self._rollback()
            raise
        if not out:
            out.append({"kind": "removed", "dp_rank": dp_rank, "block_size": 1, "block_hashes": []})
        if self.announce and (instance, dp_rank) not in self.announced:
            self._put(self.announced, (instance, dp_rank), True)
            out[:0] = [dict(event, dp_rank=dp_rank) for event in self.announce]
        for event in out:  # every field on every event, as the pool's (docs/events.md)
            event["sequence"] = sequence
            for key, default in _DEFAULTS:
                event.setdefault(key, default)
        return out, dp_rank

    # ------------------------------------------------------------------ logged changes
    def _put(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        self._undo.append((table, key, table.get(key, _MISSING)))
        table[key] = value

    def _pop(self, table: dict[Any, Any], key: Any) -> None:
        self._undo.append((table, key, table.pop(key)))

    def _rollback(self) -> None:
        while self._undo:
            table, key, old = self._undo.pop()
            if old is _MISSING:
                table.pop(key, None)
            else:
                table[key] = old

    def _source(
        self, instance: int, dp_rank: int
    ) -> dict[bytes, tuple[bytes, frozenset[tuple[str, int]]]]:
        keys = self.keys.get((instance, dp_rank))
        if keys is None:
            keys = {}
            self._put(self.keys, (instance, dp_rank), keys)
        return keys

    # ------------------------------------------------------------------------ event kinds
    def _stored(self, instance: int, dp_rank: int, f: dict[str, Any], at: str) -> dict[str, Any]:
        block_size = _check_int(
            _required(f, "block_size", at), f"{at}.block_size", 2**32 - 1, low=1
        )
        group = _group_of(f, at)
        kind, window = _group_kind(
            _optional_str(f, "kv_cache_spec_kind", at),
            _optional_int(f, "kv_cache_spec_sliding_window", at),
        )
        medium = MEDIA.get(_optional_str(f, "medium", at), "remote")
        hashes = _hashes(_required(f, "block_hashes", at), f"{at}.block_hashes")
        raw_tokens = f.get("token_ids")
        tokens: list[int] = [] if raw_tokens is None else _tokens(raw_tokens, f"{at}.token_ids")
        if len(tokens) != len(hashes) * block_size or f.get("lookahead_token_ids") is not None:
            tokens = []  # not exactly the blocks' tokens: opaque keys
        raw_extras = f.get("extra_keys")
        if raw_extras is not None and not (
            isinstance(raw_extras, (list, tuple))
            and all(x is None or isinstance(x, (list, tuple)) for x in raw_extras)
        ):
            raise TypeError(
                f"{at}.extra_keys: must be a list of lists or None, got {raw_extras!r:.80}"
            )
        extra_keys = list(raw_extras or [])
        extra_keys += [None] * (len(hashes) - len(extra_keys))
        lora = _optional_str(f, "lora_name", at)
        parent_raw = f.get("parent_block_hash")
        self._put(self.groups, (instance, dp_rank, group), (kind, window, block_size))
        keys = self._source(instance, dp_rank)
        root_key: bytes | None = None
        if parent_raw is None:  # a chain's first block: rooted at the LoRA and salt key
            salt = self._salt(extra_keys[0] if hashes else None, lora)
            opaque = salt is False
            root_key = None if salt is False else vllm_extra_key(lora, salt)
            parent: bytes | None = None
        else:
            known = keys.get(_hash_bytes(parent_raw, f"{at}.parent_block_hash"))
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
                entry = (key, frozenset())
            if entry[0] == parent:  # a block its own parent: the index would refuse the batch
                raise ValueError(f"{at}.block_hashes: block {h.hex()} is its own parent")
            self._put(keys, h, (entry[0], entry[1] | {(medium, group)}))
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

    def _removed(
        self, instance: int, dp_rank: int, f: dict[str, Any], at: str
    ) -> list[dict[str, Any]]:
        group = _group_of(f, at)
        medium = MEDIA.get(_optional_str(f, "medium", at), "remote")
        hashes = _hashes(_required(f, "block_hashes", at), f"{at}.block_hashes")
        known = self.groups.get((instance, dp_rank, group))
        if known is None:
            return []  # a group never stored into: nothing of it in the index
        kind, window, block_size = known
        keys = self.keys.get((instance, dp_rank), {})
        out_hashes = []
        for h in hashes:
            entry = keys.get(h)
            if entry is None:
                continue
            out_hashes.append(entry[0])
            presence = entry[1] - {(medium, group)}
            if presence:
                self._put(keys, h, (entry[0], presence))
            else:
                self._pop(keys, h)
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
        for h, (key, presence) in list(keys.items()):
            kept = frozenset(p for p in presence if p[0] != "device")
            if not kept:
                self._pop(keys, h)
            elif kept != presence:
                self._put(keys, h, (key, kept))
        return {"kind": "cleared", "medium": "device", "dp_rank": dp_rank, "block_size": 1}


def _announcements(groups: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The ``"group"`` events of the model's ``groups`` (class doc), checked."""
    if groups is None:
        return []
    if isinstance(groups, (str, bytes, dict)) or not isinstance(groups, (list, tuple)):
        raise TypeError(f"groups: must be a sequence of dicts, got {type(groups).__name__}")
    if len(groups) > _MAX_GROUPS:
        raise ValueError(f"groups: at most {_MAX_GROUPS} groups, got {len(groups)}")
    out = []
    for i, g in enumerate(groups):
        at = f"groups[{i}]"
        if not isinstance(g, dict):
            raise TypeError(f"{at}: must be a dict, got {type(g).__name__}")
        unknown = set(g) - {"kind", "block_size", "sliding_window"}
        if unknown:
            raise ValueError(f"{at}: unknown keys {sorted(unknown)}")
        block_size = _check_int(
            _required(g, "block_size", at), f"{at}.block_size", 2**32 - 1, low=1
        )
        kind, window = _group_kind(
            _optional_str(g, "kind", at), _optional_int(g, "sliding_window", at)
        )
        out.append(
            {
                "kind": "group",
                "medium": "device",
                "group": i,
                "group_kind": kind,
                "sliding_window": window,
                "block_size": block_size,
            }
        )
    return out


# ------------------------------------------------------------------------- field checks
def _check_int(value: Any, name: str, high: int, *, low: int = 0) -> int:
    """``value`` if an int (not a bool) in ``[low, high]``, else TypeError / ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name}: must be in [{low}, {high}], got {value}")
    return value


def _required(f: dict[str, Any], key: str, at: str) -> Any:
    if f.get(key) is None:
        raise ValueError(f"{at}.{key}: missing")
    return f[key]


def _optional_str(f: dict[str, Any], key: str, at: str) -> str | None:
    value = f.get(key)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{at}.{key}: must be a str or None, got {type(value).__name__}")
    return value


def _optional_int(f: dict[str, Any], key: str, at: str) -> int | None:
    value = f.get(key)
    return None if value is None else _check_int(value, f"{at}.{key}", 2**64 - 1)


def _group_of(f: dict[str, Any], at: str) -> int:
    value = f.get("group_idx")
    return 0 if value is None else _check_int(value, f"{at}.group_idx", _MAX_GROUPS - 1)


def _hashes(value: Any, name: str) -> list[bytes]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}: must be a list of block hashes, got {type(value).__name__}")
    return [_hash_bytes(h, name) for h in value]


def _tokens(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}: must be a list of ints or None, got {type(value).__name__}")
    for t in value:
        _check_int(t, name, 2**32 - 1)
    return list(value)


def _event_fields(event: Any, at: str) -> tuple[str, dict[str, Any]]:
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
    raise ValueError(f"{at}: not a vLLM KV event: {event!r:.80}")


def _payload_of(frames: Sequence[bytes]) -> bytes:
    if (
        isinstance(frames, (bytes, str))
        or not isinstance(frames, (list, tuple))
        or len(frames) != 3
    ):
        raise ValueError("frames: expected the 3 ZMQ frames (topic, seq, payload)")
    return frames[2]


def _sequence_of(frames: Sequence[bytes]) -> int:
    seq = frames[1]
    if not isinstance(seq, (bytes, bytearray, memoryview)) or len(seq) != 8:
        raise ValueError("frames[1]: the batch number must be 8 bytes (big-endian)")
    return int.from_bytes(seq, "big")
