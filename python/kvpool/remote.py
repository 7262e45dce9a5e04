"""Compatibility shim: ``kvpool.remote`` was split into ``kvpool.tiers`` (``base``, ``payload``,
``redis``, ``remote_transfer``) and ``kvpool.index.streams`` (docs/architecture.md)."""

from kvpool.index.streams import (
    PrefixIndex,
    RedisEventPublisher,
    event_from_dict,
    event_to_dict,
    read_events,
)
from kvpool.tiers.base import RemoteTier, RemoteTierError
from kvpool.tiers.payload import (
    block_spec,
    check_mac_key,
    decode_payload,
    encode_payload,
    make_namespace,
    spec_nbytes,
)
from kvpool.tiers.redis import RedisRemoteTier
from kvpool.tiers.remote_transfer import HostBlockIO, RemoteTransfer

__all__ = [
    "HostBlockIO",
    "PrefixIndex",
    "RedisEventPublisher",
    "RedisRemoteTier",
    "RemoteTier",
    "RemoteTierError",
    "RemoteTransfer",
    "block_spec",
    "check_mac_key",
    "decode_payload",
    "encode_payload",
    "event_from_dict",
    "event_to_dict",
    "make_namespace",
    "read_events",
    "spec_nbytes",
]
