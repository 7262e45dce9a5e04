"""kvpool's pool as the KV cache manager under vLLM 0.33's and 0.34's v1 Scheduler.

Supported: vLLM 0.33.x and 0.34.x (``REQUIRED_VLLM``, ``>=0.33,<0.35``); importing this module
with any other version raises one ``ImportError`` naming that range. What differs between the
two, and how the manager meets it: ``kvpool.integrations._vllm_versions``.

``KVCacheManager`` takes the constructor arguments of ``vllm.v1.core.kv_cache_manager.
KVCacheManager`` and serves every method those versions' ``Scheduler`` and ``AsyncScheduler``
call on it; the bookkeeping runs in one ``kvpool.BlockManagerPool``. Install it under the Scheduler
with one line (docs/integrations.md, "vLLM")::

    import kvpool.integrations.vllm as kv; kv.install()      # in the process building the Scheduler

or, for ``vllm serve`` / ``LLM(...)`` (the engine-core process), ``--scheduler-cls
kvpool.integrations.vllm.Scheduler`` (``AsyncScheduler`` with async scheduling).

Invariants this module keeps:

- One kvpool ``Sequence`` per request the Scheduler has looked up or allocated, keyed by
  ``request_id``; its tokens are the request's tokens (synced before every pool call that hashes
  or looks up: ``plan``, an admission, ``cache``, ``deallocate``; a decode step that needs no
  block, or only a new one, syncs nothing; a request never loses tokens). ``free`` drops it, so
  nothing outlives its request.
- Block ids are the pool's ids, which are the ids vLLM's workers index: vLLM's null block 0 is
  kvpool's padding block 0 and never appears in a full-attention table (a window table has it
  behind the window, as vLLM's); ``kv_cache_config.num_blocks`` counts it in both, and every
  group draws from the one store. An id handed out in ``NewRequestData`` or ``new_block_ids``
  stays in the request's table until ``free`` (a window's slid-out entries become null, which
  its worker never reads again): the pool runs first-writer-wins publication (R9,
  ``dedup=False``), so a table only grows, as vLLM's workers assume.
- Blocks are published when their KV exists (R17), and before anything reads the cache:
  ``seq.num_computed_tokens`` follows ``request.num_computed_tokens -
  request.num_in_flight_tokens`` (the Scheduler's count of tokens whose forward pass has
  returned) for every request whose scheduled tokens filled a block, before the next lookup
  (``get_computed_blocks``, an admission), at the async Scheduler's ``cache_blocks`` and at
  ``free``; with KV events on (or once 0.34's probe ``get_num_cached_tokens`` has run), at the
  next ``new_step_starts`` already (``BlockStored`` events then come in the step after the
  KV). KV only comes into existence between steps, so a lookup sees exactly the blocks it
  would see had each been published at its step's start; a decode that fills block after
  block between two lookups publishes them in one call.
  vLLM publishes at allocation instead, so a request admitted in the step that another
  schedules the same prefix shares it in vLLM only (by design; docs/integrations.md).
- ``get_computed_blocks`` changes nothing but that publication (``BlockManagerPool.plan``):
  the Scheduler calls it again every step for a blocked waiting request.
  ``get_num_cached_tokens`` changes nothing at all. ``allocate_slots`` is all or nothing: None
  leaves the pool and the request as they were.

Covered: one full-attention group (``FullAttentionSpec`` and its subclasses, MLA included),
alone or beside up to 8 sliding-window groups of one window (gpt-oss, Gemma 3), chunked local
attention groups of one chunk (Llama 4) or Mamba groups in "align" mode (Qwen3-Next, NemotronH,
Jamba): one block store, ``kvpool.integrations._vllm_groups``; each table has vLLM's shape
(null entries behind a window or chunk start; a Mamba table holds the previous and the current
state block); a hit only where every group serves it; window runs and states kept by kvpool's
retention rule; new attention blocks reported for zeroing where vLLM's workers zero them
(Mamba, mixed precisions), prefix caching on or off, cache salts and LoRA (they root the
hash chain, R6), KV events, prefix cache stats, chunked prefill, decode with lookahead (spec
decode slots), recompute preemption, the async scheduler's ``cache_blocks``, 0.34's
cache-aware admission (its probe).
Requests that must not read the cache, or (0.34) may read only up to a hit limit, get no hit.
Not covered, each a clear ``NotImplementedError`` at construction or call: Mamba groups in
another mode or with speculative or prefill checkpoint blocks, cross-attention groups, several
full-attention groups, groups of several kinds beside full attention, window groups of
different windows or block sizes or with ``extra_retained_tokens``, EAGLE's hit trimming, hash
lookahead, DCP/PCP, KV connectors (external tokens, ``pop_blocks_for_free``, ``evict_blocks``),
``max_cache_hit_length`` (aux output), the KV cache metrics collector, and ``prefix_match_unit``
finer than the block (partial hash hits); ``prefix_cache_retention_interval`` must be 0 or None
(a ``ValueError`` otherwise: full attention keeps every block, and window runs follow kvpool's
retention rule, docs/hybrid.md).
"""

from __future__ import annotations

import sys
from typing import Any

from kvpool.integrations._vllm_versions import SUPPORTED, check_version

try:
    import vllm
except ImportError as error:  # vLLM missing (or broken): one error naming what is needed
    raise ImportError(
        f"kvpool.integrations.vllm needs vllm{SUPPORTED} (pip install "
        f"'kvpool[vllm]'); importing vllm failed: {error}"
    ) from error
VLLM_VERSION = check_version(vllm.__version__)  # (major, minor); any other: one ImportError
REQUIRED_VLLM = SUPPORTED  # the supported range, as pip reads it (the ``vllm`` extra)

import vllm.v1.core.sched.scheduler as _sched_module  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvpool.integrations._vllm_manager import KVCacheManager  # noqa: E402
from kvpool.integrations._vllm_views import GroupBlocks, PoolBlocks  # noqa: E402

__all__ = [
    "REQUIRED_VLLM",
    "VLLM_VERSION",
    "KVCacheManager",
    "GroupBlocks",
    "PoolBlocks",
    "Scheduler",
    "AsyncScheduler",
    "install",
]


# ------------------------------------------------------------------------------ installing
def install() -> None:
    """Make every vLLM ``Scheduler`` built from now on in this process use kvpool's manager."""
    _sched_module.KVCacheManager = KVCacheManager  # type: ignore[attr-defined]


def _no_block_hashes(request: Request) -> list[Any]:
    """vLLM's per-request block hashes under kvpool's manager: none (kvpool hashes itself, R6)."""
    return []


_vllm_request_block_hasher: Any = None  # vLLM's own factory, once _skip_unused_hashing replaced it


def _request_block_hasher(*args: Any, **kwargs: Any) -> Any:
    """The engine core's factory of request block hashers, as kvpool's ``Scheduler`` installs it.

    vLLM's ``EngineCore.__init__`` builds its Scheduler, then its hasher with this function
    (``vllm.v1.engine.core.get_request_block_hasher``), and every request's blocks are hashed
    with it as the request arrives (sha256 by default). Under kvpool's manager nothing reads
    those hashes unless a KV connector does, so an engine core whose Scheduler is kvpool's and
    has no connector gets a hasher that hashes nothing; any other caller gets vLLM's own.
    """
    engine = sys._getframe(1).f_locals.get(
        "self"
    )  # the EngineCore being built, if that is the caller
    scheduler = getattr(engine, "scheduler", None)
    if isinstance(scheduler, Scheduler) and scheduler.get_kv_connector() is None:
        return _no_block_hashes
    return _vllm_request_block_hasher(*args, **kwargs)


def _skip_unused_hashing() -> None:
    """Route the engine core's hasher factory through ``_request_block_hasher`` (idempotent)."""
    global _vllm_request_block_hasher
    import vllm.v1.engine.core as engine_core

    if engine_core.get_request_block_hasher is not _request_block_hasher:
        _vllm_request_block_hasher = engine_core.get_request_block_hasher
        engine_core.get_request_block_hasher = _request_block_hasher  # type: ignore[assignment]


class Scheduler(_VllmScheduler):
    """vLLM's ``Scheduler`` on kvpool's manager: ``--scheduler-cls
    kvpool.integrations.vllm.Scheduler``.

    Also spares the engine core vLLM's own block hashing of every request, which nothing reads
    under kvpool's manager (kvpool hashes the tokens itself): the engine core that builds this
    Scheduler without a KV connector gives its requests no vLLM block hashes
    (``_request_block_hasher``); with a connector, vLLM hashes as usual.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        saved = _sched_module.KVCacheManager  # type: ignore[attr-defined]
        _sched_module.KVCacheManager = KVCacheManager  # type: ignore[attr-defined]
        try:
            super().__init__(*args, **kwargs)
        finally:
            _sched_module.KVCacheManager = saved  # type: ignore[attr-defined]
        if getattr(self, "cache_aware_window", 0):  # vLLM 0.34's cache-aware admission probes
            self.kv_cache_manager.publish_at_step_start()  # (get_num_cached_tokens' doc)
        _skip_unused_hashing()


class AsyncScheduler(_VllmAsyncScheduler, Scheduler):
    """vLLM's ``AsyncScheduler`` on kvpool's manager (``--scheduler-cls`` with async scheduling)."""
