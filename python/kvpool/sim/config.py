"""The simulator's configuration (``SimConfig``), its errors, and the pool a configuration makes.

``SimConfig`` is plain data: the cache (blocks, block size, dp ranks, host and remote tiers,
linear state, sliding window, elastic pages), the scheduler's budgets, the step-time model and
the test mode. ``validate`` raises :class:`SimError` naming the first impossible setting;
``make_pool`` builds the pool it describes; ``check_fits`` names the first request the cache
cannot hold alone. ``kvpool.sim.configure`` builds a ``SimConfig`` from ``kvpool simulate``'s
arguments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import kvpool
from kvpool.sim.capacity import ModelShape
from kvpool.sim.request import Request
from kvpool.sim.timing import GPUS, FixedStepTime, Roofline
from kvpool.tiers.memory import MemoryRemoteTier

__all__ = ["ORDERS", "SimConfig", "SimError", "UnavailableError", "check_fits", "make_pool"]

ORDERS = ("serving", "request")


class SimError(Exception):
    """An impossible configuration or workload (reported to the user, no traceback)."""


class UnavailableError(SimError):
    """A feature the options ask for is not in this kvpool build."""


# The pool's eviction policies (``BlockManagerPool(eviction=...)``, docs/eviction.md), and every
# value of ``--eviction``: those and the offline bound.
POOL_EVICTIONS = ("lru", "slru", "ghost_slru")
EVICTIONS = (*POOL_EVICTIONS, "optimal")


@dataclass
class SimConfig:
    num_blocks: int = 8192
    block_size: int = 16
    dp_size: int = 1
    enable_prefix_cache: bool = True
    max_num_batched_tokens: int = 2048  # per rank per step
    max_num_seqs: int = 256  # per rank
    linear_state_slots: int = 0
    linear_state_blocks: int = 0  # a state's blocks of the one store (0: slots of their own)
    checkpoint_interval: int | None = None
    linear_state_match: str = "deepest"
    sliding_window: int | None = None
    # chunked local attention groups (Llama 4) of this chunk, in place of sliding_window
    attention_chunk_size: int | None = None
    swa_num_blocks: int | None = None
    host_num_blocks: int = 0
    remote: str | None = (
        None  # redis:// URL of a shared remote tier, or "memory" (needs the host tier)
    )
    enable_events: bool = False  # the pool records KV events (the fleet simulation feeds a KVIndex)
    hash_seed: int | None = None
    check: bool = False  # test mode: pool.check() and accounting asserts every step
    max_steps: int | None = None
    seed: int = 0
    order: str = "serving"  # or "request": one request at a time, prompts only
    # a pool policy of POOL_EVICTIONS, or "optimal": the offline bound in request order
    # (sim/optimal.py)
    eviction: str = "lru"
    protected_percent: int | None = None  # SLRU's protected segment (the pool's default: 20)
    # session hints: retain every finished turn of a session this many seconds (docs/sessions.md)
    retain_ttl_s: float | None = None
    step_ms: float = 20.0  # the fixed step time (and an idle step of a step-clocked workload)
    gpu: str | None = None  # a key of timing.GPUS: the roofline step time (needs model_shape)
    tp: int = 1  # GPUs per rank (ideal tensor parallelism)
    mfu: float = 0.5
    mbu: float = 0.8
    model_shape: ModelShape | None = None
    # elastic pages (--xtensor): the pool's xtensor= dict, and (seconds, GiB per rank or None) limit
    # changes
    xtensor: dict[str, Any] | None = None
    memory_limit_schedule: tuple[tuple[float, float | None], ...] = ()

    @property
    def has_window_groups(self) -> bool:
        """Whether the pool has window groups (a sliding window or chunked local attention)."""
        return self.sliding_window is not None or self.attention_chunk_size is not None

    def pool_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "dp_size": self.dp_size,
            "enable_prefix_cache": self.enable_prefix_cache,
        }
        if self.linear_state_slots:
            kw["linear_state_slots"] = self.linear_state_slots
            if self.checkpoint_interval is not None:
                kw["checkpoint_interval"] = self.checkpoint_interval
            kw["linear_state_match"] = self.linear_state_match
            if self.linear_state_blocks:
                kw["linear_state_blocks"] = self.linear_state_blocks
        if self.sliding_window is not None:
            kw["sliding_window"] = self.sliding_window
            if self.swa_num_blocks is not None:
                kw["swa_num_blocks"] = self.swa_num_blocks
        if self.attention_chunk_size is not None:
            kw["attention_chunk_size"] = self.attention_chunk_size
        if self.hash_seed is not None:
            kw["hash_seed"] = self.hash_seed
        if self.xtensor is not None:
            kw["xtensor"] = dict(self.xtensor)
        if self.enable_events:
            kw["enable_events"] = True
        if self.eviction in POOL_EVICTIONS and self.eviction != "lru":
            kw["eviction"] = self.eviction
            if self.protected_percent is not None:
                kw["protected_percent"] = self.protected_percent
        return kw

    def step_timer(self) -> FixedStepTime | Roofline:
        """The step-time model: the roofline with ``gpu``, else ``step_ms`` per step."""
        if self.gpu is None:
            return FixedStepTime(self.step_ms)
        if self.model_shape is None:
            raise SimError(
                "the roofline step time (--gpu) needs a model shape (--model, or "
                "--layers/--kv-heads/--head-dim with --heads and --params)"
            )
        try:
            return Roofline(
                self.model_shape, GPUS[self.gpu], tp=self.tp, mfu=self.mfu, mbu=self.mbu
            )
        except ValueError as e:
            raise SimError(str(e)) from None

    def validate(self) -> None:
        if self.num_blocks < 2:
            raise SimError(
                f"num_blocks must be >= 2 (block 0 is the padding block), got {self.num_blocks}"
            )
        if self.block_size < 1:
            raise SimError(f"block_size must be >= 1, got {self.block_size}")
        if self.dp_size < 1:
            raise SimError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.max_num_batched_tokens < 1:
            raise SimError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise SimError("max_num_seqs must be >= 1")
        if self.linear_state_slots < 0:
            raise SimError("linear_state_slots must be >= 0")
        if self.retain_ttl_s is not None and not self.retain_ttl_s >= 0:
            raise SimError("retain_ttl_s must be >= 0")
        if self.linear_state_blocks and not self.linear_state_slots:
            raise SimError("linear_state_blocks needs linear_state_slots > 0")
        if self.checkpoint_interval is not None:
            if not self.linear_state_slots:
                raise SimError("checkpoint_interval needs linear_state_slots > 0")
            if self.checkpoint_interval < 1 or self.checkpoint_interval % self.block_size:
                raise SimError(
                    "checkpoint_interval must be a positive multiple of block_size "
                    f"({self.block_size}), got {self.checkpoint_interval}"
                )
        if self.linear_state_match not in ("deepest", "contiguous"):
            raise SimError("linear_state_match must be 'deepest' or 'contiguous'")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise SimError("sliding_window must be >= 1")
        if self.swa_num_blocks is not None and self.sliding_window is None:
            raise SimError("swa_num_blocks needs sliding_window")
        if self.attention_chunk_size is not None:
            if self.sliding_window is not None:
                raise SimError("attention_chunk_size is not with sliding_window")
            if self.attention_chunk_size < 1 or self.attention_chunk_size % self.block_size:
                raise SimError(
                    "attention_chunk_size must be a positive multiple of block_size "
                    f"({self.block_size}), got {self.attention_chunk_size}"
                )
        if self.host_num_blocks < 0:
            raise SimError("host_num_blocks must be >= 0")
        if self.remote is not None and not self.host_num_blocks:
            raise SimError(
                "--remote needs the host tier (--host-blocks N): remote hits land in host blocks"
            )
        if self.order not in ORDERS:
            raise SimError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if not self.step_ms > 0:
            raise SimError(f"step_ms must be > 0, got {self.step_ms}")
        if self.memory_limit_schedule and self.xtensor is None:
            raise SimError("a memory-limit schedule needs elastic pages (--xtensor)")
        if self.xtensor is not None and self.host_num_blocks:
            raise SimError("--xtensor does not combine with a host tier (--host-blocks)")
        if self.gpu is not None and self.gpu not in GPUS:
            raise SimError(f"unknown gpu {self.gpu!r}; expected one of {', '.join(GPUS)}")
        self.step_timer()


def make_pool(cfg: SimConfig, remote_tier: Any = None) -> Any:
    """The pool of ``cfg``: a ``HierarchyBlockManagerPool`` with a host tier (which composes with
    dp ranks, linear state and sliding windows: docs/host_tier.md), else a ``BlockManagerPool``.
    ``remote_tier`` (a ``kvpool.tiers.base.RemoteTier``) replaces the one ``cfg.remote`` names (the
    fleet simulation shares one among its instances)."""
    kw = cfg.pool_kwargs()
    try:
        if cfg.host_num_blocks:
            if remote_tier is not None:
                kw["remote"] = remote_tier
            elif cfg.remote == "memory":
                kw["remote"] = MemoryRemoteTier()
            elif cfg.remote is not None:
                from kvpool.tiers.redis import RedisRemoteTier  # redis-py, xxhash: kvpool[remote]

                ns = f"kvpool-sim|bs{cfg.block_size}|seed{cfg.hash_seed}"
                kw["remote"] = RedisRemoteTier(cfg.remote, ns, timeout_ms=1000)
            return kvpool.HierarchyBlockManagerPool(
                cfg.num_blocks, cfg.host_num_blocks, cfg.block_size, **kw
            )
        return kvpool.BlockManagerPool(cfg.num_blocks, cfg.block_size, **kw)
    except (TypeError, ValueError) as e:
        raise SimError(f"the pool rejected the configuration: {e}") from None


def check_fits(cfg: SimConfig, requests: Sequence[Request]) -> None:
    """SimError naming the first request that the cache of ``cfg`` cannot hold alone."""
    per_rank = (cfg.num_blocks - 1) * cfg.block_size
    for r in requests:
        if r.output_len < 1:
            raise SimError(f"request {r.request_id}: output_len must be >= 1")
        # the last sampled token is never fed back: the KV peaks at prompt + output - 1
        need = r.prompt_len + (r.output_len - 1 if cfg.order == "serving" else 0)
        if need > per_rank:
            raise SimError(
                f"request {r.request_id} needs {need} tokens of KV "
                f"({math.ceil(need / cfg.block_size)} blocks of {cfg.block_size}) but the whole "
                f"cache holds {per_rank} tokens per rank ({cfg.num_blocks - 1} usable blocks): "
                f"raise --num-blocks / --cache-tokens / --gib or shorten the request"
            )
