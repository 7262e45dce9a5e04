"""The vLLM versions kvpool's drop-in supports, and what differs between them.

``kvpool.integrations.vllm`` calls ``check_version`` before it imports anything of vLLM's
internals; the manager (``_vllm_manager``) reads the request through the functions below, which
are chosen once, at import, for the installed version. Import ``kvpool.integrations.vllm``, not
this module.

What differs between vLLM 0.33.x and 0.34.x, as the drop-in meets it (read in both versions'
``vllm/v1/core/kv_cache_manager.py``, ``sched/scheduler.py``, ``v1/request.py``,
``kv_cache_utils.py`` and ``config/cache.py``):

- Reading the cache. 0.33 marks a request that must not read the prefix cache with
  ``request.skip_reading_prefix_cache``; 0.34 replaces it with ``request.prefix_cache_hit_limit``
  (None: unbounded; 0: no lookup at all; k > 0: a hit of at most k tokens, for prompt logprobs
  from row k). ``reads_cache`` is vLLM's ``prefix_cache_lookup_enabled`` of each version (a
  lookup runs and is counted in the stats); ``hit_unbounded`` says whether any hit may be
  served. kvpool serves a bounded request (0.34's k > 0) no hit at all, below the bound.
- The probe. 0.34's Scheduler calls ``get_num_cached_tokens`` (cache-aware admission,
  ``--cache-aware-admission-window``); 0.33's never does. The manager has it under both.
- ``get_num_common_prefix_blocks``: deprecated in 0.33 (zeros; its Scheduler no longer calls it),
  dropped from 0.34's manager. The manager keeps it (zeros), harmless under 0.34.
- Token lists. 0.34 keeps ``request.prompt_token_ids`` and ``request._all_token_ids`` in an int32
  ``TokenBuffer`` (an ``array.array``) where 0.33 has plain lists; ``token_ids`` hands them to
  kvpool's ``Sequence`` as int32 numpy copies (one memcpy, no Python int per token), the new
  tokens only on each sync.
- The default block size: 16 in 0.33, 64 in 0.34 (``CacheConfig.DEFAULT_BLOCK_SIZE``). The
  manager takes whatever block size the config carries.
- Mamba's "all" prefix-caching mode: gone in 0.34, and already in 0.33.0 (both releases'
  ``MambaCacheMode`` is ``"align"`` or ``"none"``); the drop-in takes no Mamba group yet under
  either, so it changes nothing here.
- Options both versions have: ``prefix_match_unit`` (the hash block size, hits inside a block;
  vLLM refuses any value but the block size for one group) is refused unless it equals the
  block size; ``prefix_cache_retention_interval`` (sparse sliding-window and Mamba checkpoints)
  is honoured as 0 or None: full attention keeps every full block, and window groups keep their
  runs by kvpool's retention rule (every published run while memory allows, at least what
  either setting keeps until memory runs short); a positive value (periodic checkpoints) is
  refused with a ``ValueError``.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "SUPPORTED",
    "SUPPORTED_MINORS",
    "VLLM_034",
    "check_version",
    "hit_unbounded",
    "reads_cache",
    "token_ids",
    "version_of",
]

SUPPORTED = ">=0.33,<0.35"  # the pip specifier of the ``vllm`` extra (pyproject.toml)
SUPPORTED_MINORS = ((0, 33), (0, 34))
_RELEASE = re.compile(r"(\d+)\.(\d+)")


def version_of(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.34.0``, ``0.34.1+cpu``, ``0.33.0rc1``),
    or None if it has none."""
    match = _RELEASE.match(version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` if kvpool's drop-in supports it (any 0.33.x or 0.34.x
    release, pre-release or local build).

    Raises
    ------
    ImportError
        Any other version: one message naming the supported range and the version found.
    """
    found = version_of(version)
    if found not in SUPPORTED_MINORS:
        raise ImportError(
            f"kvpool.integrations.vllm supports vllm{SUPPORTED} (0.33.x and 0.34.x); found "
            f"vllm {version} (pip install 'kvpool[vllm]' installs a supported version)"
        )
    return found  # type: ignore[return-value]


def _installed() -> tuple[int, int] | None:
    """The installed vLLM's ``(major, minor)``, from its metadata (vLLM is not imported)."""
    from importlib import metadata

    try:
        return version_of(metadata.version("vllm"))
    except metadata.PackageNotFoundError:  # (kvpool.integrations.vllm names a missing vLLM)
        return None


VLLM_034 = _installed() == (0, 34)


def _reads_cache_033(request: Any) -> bool:
    return not request.skip_reading_prefix_cache


def _hit_unbounded_033(request: Any) -> bool:
    return not request.skip_reading_prefix_cache


def _reads_cache_034(request: Any) -> bool:
    return request.prefix_cache_hit_limit != 0


def _hit_unbounded_034(request: Any) -> bool:
    return request.prefix_cache_hit_limit is None


reads_cache: Callable[[Any], bool] = _reads_cache_034 if VLLM_034 else _reads_cache_033
"""Whether a prefix-cache lookup runs for the request (vLLM's ``prefix_cache_lookup_enabled``
without the manager's switch)."""
hit_unbounded: Callable[[Any], bool] = _hit_unbounded_034 if VLLM_034 else _hit_unbounded_033
"""Whether the request may be served any hit (no skip, no hit limit)."""


def token_ids(tokens: Any, start: int = 0) -> Any:
    """A request's tokens from ``start`` on, as kvpool's ``Sequence`` reads them fastest: 0.33's
    plain list as it is (``start`` 0 only: a list is synced with ``extend_to``), 0.34's int32
    ``TokenBuffer`` as an int32 numpy copy (a view would export the buffer and block vLLM's
    appends to it while it lives), anything else as a list."""
    if type(tokens) is list and start == 0:
        return tokens
    if isinstance(tokens, array) and tokens.typecode == "i" and tokens.itemsize == 4:
        if start >= len(tokens):
            return np.empty(0, dtype=np.int32)
        return np.frombuffer(tokens, dtype=np.int32)[start:].copy()
    return list(tokens[start:])
