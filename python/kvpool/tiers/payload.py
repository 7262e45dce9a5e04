"""What a remote store holds: block keys under a namespace, and payloads that verify.

Part of the remote tier (docs/remote_tier.md); ``kvpool.tiers.redis`` and
``kvpool.tiers.remote_transfer`` use it, and any store can.

Invariants
----------
- **Keys** are the block's chained hash (R6, 16 bytes, as ``kvpool.hash_blocks`` returns)
  under a namespace digest of a user-supplied model/layout identifier (``make_namespace``):
  KV of another model, dtype, head layout, block size or rank layout never shares a key.
  Keys are not hash-tagged, so on Redis Cluster the blocks of one request spread over slots.
- **Payloads** are one block across all layers (K and V) with a header: magic, format version,
  the block spec (dtype and shape of every cache array) and an XXH3-64 checksum over key, spec
  and body. ``decode_payload`` returns None for anything that does not verify against the key
  and the spec the reader expects: a corrupt, truncated, foreign or mis-filed payload is a
  miss, never wrong KV. The checksum catches accidents, not forgeries: anyone who can write
  to the store can compute it. With a per-deployment secret (``mac_key``) payloads carry a
  keyed BLAKE2b tag as well, and a reader holding the key accepts only payloads tagged with
  it (format version 2; docs/remote_tier.md, "What the checksum protects").
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import Any

import xxhash

from kvpool._args import check_int

__all__ = [
    "block_spec",
    "check_mac_key",
    "decode_payload",
    "encode_payload",
    "key_prefix",
    "make_namespace",
    "spec_nbytes",
]

MAGIC = b"KVPB"
FORMAT_VERSION = 1  # checksum only
FORMAT_VERSION_MAC = 2  # checksum, then a keyed BLAKE2b tag after the body
MAC_SIZE = 32
_HEADER = struct.Struct("<4sHHQQ")  # magic, version, spec length, body length, checksum


# ---------------------------------------------------------------------------------- namespace
def make_namespace(
    model: str,
    *,
    dtype: str,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_layers: int,
    layout: str = "tp1:rank0",
    hash_seed: int | None = None,
) -> str:
    """The namespace identifier of a KV layout: blocks are shared only within one.

    Parameters
    ----------
    model : str
        Model name (and revision, if weights differ).
    dtype : str
        KV cache dtype, e.g. ``"float16"``.
    num_kv_heads, head_dim, block_size, num_layers : int
        Cache geometry of this rank.
    layout : str
        Rank layout, e.g. ``"tp2:rank1"`` (tensor-parallel shards hold different heads).
    hash_seed : int or None
        The pool's hash seed (different seeds never share anyway; included for clarity).

    Returns
    -------
    str
    """
    if not isinstance(model, str) or not model:
        raise ValueError("model: must be a non-empty str")
    for name, v in (
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("block_size", block_size),
        ("num_layers", num_layers),
    ):
        check_int(name, v, low=1)
    if hash_seed is not None:
        check_int("hash_seed", hash_seed, low=0)
    return (
        f"{model}|{dtype}|kvh{num_kv_heads}|hd{head_dim}|bs{block_size}|L{num_layers}|"
        f"{layout}|seed{hash_seed}"
    )


def key_prefix(namespace: str) -> bytes:
    """The prefix of every key of ``namespace`` (``make_namespace``'s string) in a store."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("namespace: must be a non-empty str (see make_namespace)")
    return b"kvpool:v1:" + xxhash.xxh3_64_hexdigest(namespace.encode()).encode() + b":"


# ---------------------------------------------------------------------------------- payloads
def block_spec(arrays: Sequence[Any]) -> str:
    """The spec string of one block of ``arrays`` (block axis first): dtype and block shape each."""
    return ";".join(f"{a.dtype}:{'x'.join(str(d) for d in a.shape[1:])}" for a in arrays)


def _checksum(key: bytes, spec: bytes, body: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(spec)
    h.update(body)
    return h.intdigest()


def check_mac_key(mac_key: bytes | None) -> bytes | None:
    """``mac_key`` validated: None, or 16 to 64 bytes of a per-deployment secret."""
    if mac_key is None:
        return None
    if not isinstance(mac_key, bytes | bytearray) or not 16 <= len(mac_key) <= 64:
        raise ValueError("mac_key: must be None or 16 to 64 bytes (a per-deployment secret)")
    return bytes(mac_key)


def _mac(mac_key: bytes, key: bytes, signed: bytes | memoryview) -> bytes:
    """Keyed BLAKE2b-256 of the block key and everything before the tag (header, spec, body)."""
    h = hashlib.blake2b(digest_size=MAC_SIZE, key=mac_key, person=b"kvpool-block")
    h.update(key)
    h.update(signed)
    return h.digest()


def encode_payload(
    key: bytes, spec: str, body: bytes | memoryview, *, mac_key: bytes | None = None
) -> bytes:
    """Header plus ``body`` (one block of every cache array, concatenated) for ``key``.

    With ``mac_key`` (16 to 64 bytes, a per-deployment secret) the payload is format version 2:
    a keyed BLAKE2b tag over the key, header, spec and body follows the body.
    """
    mac_key = check_mac_key(mac_key)
    s = spec.encode()
    version = FORMAT_VERSION if mac_key is None else FORMAT_VERSION_MAC
    out = _HEADER.pack(MAGIC, version, len(s), len(body), _checksum(key, s, body)) + s + bytes(body)
    return out if mac_key is None else out + _mac(mac_key, key, out)


def decode_payload(
    key: bytes,
    spec: str,
    payload: bytes | None,
    body_len: int | None = None,
    *,
    mac_key: bytes | None = None,
) -> memoryview | None:
    """The body of ``payload`` if it verifies for ``key``, ``spec`` (and ``body_len``), else None.

    A reader with ``mac_key`` accepts only payloads tagged with that key (version 2): a payload
    someone without the key wrote (version 1, or a forged tag) is a miss. A reader without a key
    checks the checksum only, of either version.
    """
    if payload is None or len(payload) < _HEADER.size:
        return None
    magic, version, spec_len, blen, checksum = _HEADER.unpack_from(payload)
    s = spec.encode()
    if magic != MAGIC or version not in (FORMAT_VERSION, FORMAT_VERSION_MAC) or spec_len != len(s):
        return None
    if mac_key is not None and version != FORMAT_VERSION_MAC:
        return None
    tag = MAC_SIZE if version == FORMAT_VERSION_MAC else 0
    end = _HEADER.size + spec_len + blen
    if (body_len is not None and blen != body_len) or len(payload) != end + tag:
        return None
    view = memoryview(payload)
    if bytes(view[_HEADER.size : _HEADER.size + spec_len]) != s:
        return None
    body = view[_HEADER.size + spec_len : end]
    if _checksum(key, s, body) != checksum:
        return None
    if mac_key is not None and not hmac.compare_digest(_mac(mac_key, key, view[:end]), view[end:]):
        return None
    return body


def spec_nbytes(spec: str) -> int | None:
    """Bytes of one block body of ``spec`` (``block_spec``'s string); None for an unknown dtype."""
    import numpy as np

    total = 0
    for part in spec.split(";"):
        dtype, _, shape = part.rpartition(":")
        try:
            size = np.dtype(dtype).itemsize
        except TypeError:
            return None
        for d in shape.split("x") if shape else ():
            size *= int(d)
        total += size
    return total
