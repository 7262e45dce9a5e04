"""``KVCacheManager``: kvpool's pool as vLLM 0.33's and 0.34's KV cache manager.

The class behind ``kvpool.integrations.vllm``, whose module doc states what it keeps and what
it covers; that module checks the vLLM version and puts the manager under vLLM's Scheduler
(``install``, ``Scheduler``); ``_vllm_versions`` has what differs between the versions. Import
``kvpool.integrations.vllm``, not this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm import envs
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from kvpool._core import BlockManagerPool
from kvpool._core import Sequence as PoolSequence
from kvpool.integrations._vllm_check import check_manager
from kvpool.integrations._vllm_events import event_groups, vllm_event
from kvpool.integrations._vllm_groups import group_layout
from kvpool.integrations._vllm_versions import hit_unbounded, reads_cache, token_ids
from kvpool.integrations._vllm_views import (
    GroupBlocks,
    PoolBlocks,
    _BlockPoolView,
    _CoordinatorView,
    _EmptyBlocks,
    _Entry,
    _GroupView,
    _Hit,
)

__all__ = ["KVCacheManager"]

_NO_COPIES: tuple[tuple[()], tuple[()]] = ((), ())  # take_kv_cache_block_copies: nothing to copy


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"kvpool.integrations.vllm.KVCacheManager: {what} is not supported")


class KVCacheManager:
    """vLLM 0.33's and 0.34's ``KVCacheManager`` interface on ``kvpool.BlockManagerPool`` (module
    doc; the differences between the versions: ``_vllm_versions``).

    Parameters
    ----------
    kv_cache_config : vllm.v1.kv_cache_interface.KVCacheConfig
        One full-attention group, alone or beside up to 8 sliding-window groups of one window,
        chunked local attention groups of one chunk or Mamba groups in "align" mode
        (``_vllm_groups.group_layout``), in any order; ``num_blocks`` (null block 0 included)
        becomes the pool's ``num_blocks`` (padding block 0 included), one store for every
        group. Its ``prefix_cache_retention_interval`` must be 0 or None.
    max_model_len : int
        Tables never hold more tokens.
    scheduler_block_size, hash_block_size : int
        Both must equal the group's block size (one group, no DCP): ``hash_block_size`` is
        vLLM's ``prefix_match_unit``, and hits inside a block (partial hash hits) are refused.
    max_in_flight_tokens : int or None
        With window groups, vLLM's admission cap per window group (the window plus these
        tokens) in the whole-sequence gate; None: uncapped.
    num_prefill_lookahead : int or None
        Accepted; prefill lookahead concerns MTP groups.
    enable_caching : bool
        Prefix caching (``enable_prefix_caching``).
    use_eagle : bool
        Must be False (EAGLE trims the hit by one block: not supported).
    num_hash_lookahead_tokens : int
        Must be 0.
    log_stats : bool
        Keep vLLM ``PrefixCacheStats`` for ``make_prefix_cache_stats``.
    enable_kv_cache_events : bool
        Translate the pool's KV events (R21) into vLLM's ``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared`` for ``take_events``.
    dcp_world_size, pcp_world_size : int
        Must be 1.
    metrics_collector : None
        Must be None (vLLM's block residency sampling reads vLLM's own blocks).
    watermark : float
        Fraction of the blocks kept free when admitting while others run (as vLLM).
    enable_mamba_shared_prefix_checkpoint : bool
        Accepted; it concerns EAGLE/MTP siblings, which are not supported.

    Raises
    ------
    NotImplementedError
        The config or an option needs something listed as not covered in the module doc; the
        message names the group kind or the option (``prefix_match_unit`` finer than the block).
    ValueError
        The scheduler block size disagrees, ``prefix_cache_retention_interval`` is positive, or
        ``num_blocks`` is below 2.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        layout = group_layout(kv_cache_config)  # NotImplementedError for other groups
        for name, value, ok in (
            ("use_eagle", use_eagle, not use_eagle),
            (
                "num_hash_lookahead_tokens",
                num_hash_lookahead_tokens,
                num_hash_lookahead_tokens == 0,
            ),
            ("dcp_world_size", dcp_world_size, dcp_world_size == 1),
            ("pcp_world_size", pcp_world_size, pcp_world_size == 1),
            ("metrics_collector", metrics_collector, metrics_collector is None),
        ):
            if not ok:
                raise _unsupported(f"{name}={value!r}")
        block_size = layout.block_size
        if scheduler_block_size != block_size:
            raise ValueError(
                f"scheduler_block_size: must equal the group's block size {block_size}, "
                f"got {scheduler_block_size}"
            )
        if enable_caching and hash_block_size != block_size:
            raise _unsupported(
                f"prefix_match_unit (hash_block_size) {hash_block_size}, not the block size "
                f"{block_size} (partial hash hits inside a block)"
            )
        retention = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
        if retention not in (None, 0):  # (vLLM's own coordinator refuses it for full attention)
            raise ValueError(
                f"prefix_cache_retention_interval: {retention} is not taken; "
                + (
                    "kvpool keeps the window runs by its own retention rule (every published "
                    "run while memory allows, docs/hybrid.md), which 0 and None both mean here"
                    if layout.window_groups
                    else "it has no effect on a full-attention group (every full block is kept)"
                )
                + "; set it to 0 or None"
            )
        num_blocks = kv_cache_config.num_blocks
        if num_blocks < 2:
            raise ValueError(f"kv_cache_config.num_blocks: must be at least 2, got {num_blocks}")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self._no_prefix_cache_stats = PrefixCacheStats()
        self._stats_recorded = False  # prefix_cache_stats holds something since it was taken
        # vLLM's window, chunked or Mamba groups: kvpool's groups 1, 2, ... of the shared store
        windows = layout.pool_options()
        self.pool = BlockManagerPool(
            num_blocks,
            block_size,
            enable_prefix_cache=enable_caching,
            enable_events=enable_kv_cache_events,
            # vLLM's workers only append to a running request's table, so a switched entry
            # would leave one reading a freed block: first writer wins (R9 with dedup off).
            dedup=False,
            **windows,  # type: ignore[arg-type]
        )
        self.layout = layout
        self.num_kv_cache_groups = layout.num_groups
        self._zeroed = layout.zeroed_groups(kv_cache_config)  # (take_new_block_ids)
        self._to_zero: list[int] = []
        self._hybrid = layout.num_groups > 1
        # the computed tokens go to the pool: to publish (R17), and with window groups to slide
        # their tables (prefix caching off too: a window table then stays as small as vLLM's)
        self._publishes = enable_caching or self._hybrid
        # vLLM's admission cap of a window group, in blocks (None: uncapped)
        self._window_cap: int | None = None
        if layout.kind == "state":  # a step takes one block per state group (its state's)
            self._window_cap = 1
        elif self._hybrid and max_in_flight_tokens is not None:
            spec = layout.specs[layout.vllm_groups[1]]
            self._window_cap = spec.max_admission_blocks_per_request(
                max_in_flight_tokens=max_in_flight_tokens, max_model_len=max_model_len
            )
        self.coordinator = _CoordinatorView(
            tuple(_GroupView(spec, block_size) for spec in layout.specs)
        )
        self.block_pool = _BlockPoolView(self.pool)
        self.watermark_blocks = int(watermark * num_blocks)
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self._event_groups = event_groups(layout)
        self.kv_cache_event_metadata = [
            self._event_groups[g][1:] for g in layout.pool_groups
        ]  # vLLM's order
        self.empty_kv_cache_blocks: KVCacheBlocks = _EmptyBlocks(
            tuple(() for _ in range(layout.num_groups))
        )
        self._seqs: dict[str, _Entry] = {}
        # requests whose scheduled tokens fill a block, with the end of those tokens: kept until
        # their full blocks are published (their KV exists then)
        self._unpublished: dict[str, tuple[Request, _Entry, int]] = {}
        self._int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        self._chain_keys: dict[bytes, tuple[str | None, str | None]] = {}
        # Used blocks over usable ones (cached-only blocks count as free, as vLLM's): a plain
        # attribute, which the Scheduler reads every step, set after each allocation or release
        # (nothing else changes which blocks are held).
        self.usage = 0.0
        if enable_kv_cache_events:  # the class's methods (no events) are the cheaper calls
            self.take_events = self._take_vllm_events  # type: ignore[method-assign]
            self.publish_at_step_start()
        if layout.kind == "state":
            # A state group caches the state of a boundary a step ended on only while the pool
            # sees that very step end: publish at every step's start, and before a growth.
            self.publish_at_step_start()

    # ------------------------------------------------------------------------------ requests
    def _extra_key(self, request: Request, record: bool = True) -> bytes | None:
        """Root of the request's hash chain (R6): LoRA adapter, multimodal inputs, cache salt.

        Requests that must not read the cache, or whose prompt is embeddings, get a key of their
        own (they never hit). Multimodal inputs root the whole chain (vLLM keys each block by the
        inputs it overlaps): such requests share blocks only with identical inputs, never more.
        ``record``: remember the key's LoRA name and salt for the KV events (off for the probe).
        """
        unbounded = hit_unbounded(request)
        if (
            unbounded
            and not request.lora_request
            and not request.mm_features
            and not request.cache_salt
            and request.prompt_embeds is None
        ):
            return None  # the common case: the plain chain
        parts: list[Any] = []
        lora = request.lora_request.lora_name if request.lora_request else None
        if lora is not None:
            parts.append(("lora", lora, request.lora_request.lora_path))
        for feature in request.mm_features or ():
            parts.append(("mm", feature.identifier, feature.mm_position.offset))
        if request.cache_salt:
            parts.append(("cache_salt", request.cache_salt))
        if request.prompt_embeds is not None or not unbounded:
            parts.append(("request", request.request_id))
        if not parts:
            return None
        key = repr(tuple(parts)).encode()
        if record and self.enable_kv_cache_events and parts[-1][0] in ("lora", "cache_salt"):
            self._chain_keys[key] = (
                lora,
                request.cache_salt,
            )  # for the events' lora_name, extra_keys
        return key

    def _entry(self, request: Request) -> _Entry:
        """The request's entry, created on first sight, its sequence's tokens brought up to date."""
        entry = self._seqs.get(request.request_id)
        if entry is None:
            # the prompt is a plain list (fast to read); outputs exist after a preemption
            prompt = request.prompt_token_ids
            if prompt is None:  # prompt embeddings: placeholder tokens, never shared (_extra_key)
                prompt = request.all_token_ids[: request.num_prompt_tokens]
            seq = PoolSequence(token_ids(prompt), extra_key=self._extra_key(request))
            entry = self._seqs[request.request_id] = _Entry(seq, len(prompt))
        tokens = request._all_token_ids  # the list behind all_token_ids (0.34: a TokenBuffer)
        if len(tokens) != entry.length:
            self._sync(request, entry, tokens)
        return entry

    @staticmethod
    def _sync(request: Request, entry: _Entry, tokens: list[int]) -> None:
        """Appends the request's new tokens to its sequence (``tokens``: ``_all_token_ids``)."""
        want = len(tokens)
        if want < entry.length:
            raise _unsupported(
                f"request {request.request_id!r} losing tokens ({entry.length} -> {want})"
            )
        if type(tokens) is list:  # vLLM 0.33
            entry.seq.extend_to(tokens)  # reads the new tokens only, no slice
        else:  # vLLM 0.34's TokenBuffer: the new tokens, as one int32 copy
            entry.seq.append_tokens(token_ids(tokens, entry.length))
        entry.length = want

    def _publish(self, request: Request, entry: _Entry, num_computed_tokens: int) -> None:
        """Publish the request's full blocks within ``num_computed_tokens`` (tokens whose KV
        exists, R17), its sequence's tokens brought up to date first (only hashing reads them)."""
        tokens = request._all_token_ids
        if len(tokens) != entry.length:
            self._sync(request, entry, tokens)
        n = num_computed_tokens if num_computed_tokens < entry.capacity else entry.capacity
        if n > entry.length:
            n = entry.length
        if n > entry.computed and self._publishes:
            entry.seq.num_computed_tokens = entry.computed = n
            self.pool.cache(entry.seq)
            if self._hybrid:  # the windows slid: blocks behind them were released
                self._held_blocks_changed()

    # --------------------------------------------------------------------------- the lookup
    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether a prefix-cache lookup runs for this request (and is counted in the stats)."""
        return self.enable_caching and reads_cache(request)

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The prefix hit of a waiting request; no side effect but publishing the blocks whose
        KV exists and that are not published yet (module doc), which the hit may use.

        Returns
        -------
        (KVCacheBlocks, int, int)
            The hit (to hand to ``allocate_slots``), its token count (block-aligned, at most
            ``request.num_tokens - 1``, R8) and the shared-prefix boundary: with Mamba groups
            the full-attention hit where it goes past the hit (the Scheduler then ends a prefill
            chunk there, so that the state of that junction is cached), else 0.
        """
        if max_cache_hit_length is not None and max_cache_hit_length < request.num_tokens - 1:
            raise _unsupported("max_cache_hit_length (aux output connectors)")
        if self._unpublished:  # the lookup sees every block whose KV exists (module doc)
            self._publish_computed()
        entry = self._entry(request)
        if entry.capacity:
            raise ValueError(f"request: {request.request_id!r} already holds blocks")
        plan = self.pool.plan(entry.seq)
        probe = plan
        if probe is None:  # the whole sequence does not fit now: the hit alone, for the budget
            probe = self.pool.plan(entry.seq, 1)
        hit = probe.num_cached_tokens if probe is not None else 0
        junction = 0
        if self.layout.kind == "state" and probe is not None and probe.kv_hit_tokens > hit:
            junction = probe.kv_hit_tokens
        if not hit_unbounded(request):  # (its own chain key never hits anyway, _extra_key)
            hit = junction = 0
        return _Hit(plan, plan is not None, hit, entry.length), hit, junction

    # ----------------------------------------------------------------------- the allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: Iterable[int] = (),
    ) -> KVCacheBlocks | None:
        """Blocks for ``num_new_tokens`` more tokens (plus lookahead slots); None if they cannot
        be had, with nothing changed.

        A waiting request gets its prefix hit (the one ``get_computed_blocks`` reported) and new
        blocks for the first chunk; with ``full_sequence_must_fit`` only if its whole sequence
        fits. A running request grows its table; the blocks a step fills are published once
        their KV exists, before the next lookup (R17, module doc).

        Returns
        -------
        KVCacheBlocks or None
            The newly allocated blocks only (``empty_kv_cache_blocks`` when none), as vLLM.

        Raises
        ------
        ValueError
            No tokens at all, or the hit differs from the one ``get_computed_blocks`` reported.
        NotImplementedError
            ``num_external_computed_tokens`` (KV connectors).
        """
        entry = self._seqs.get(request.request_id)
        if (
            entry is not None
            and num_new_tokens
            and not (num_new_computed_tokens or num_external_computed_tokens)
        ):
            # a running request whose table has room (most decode steps): nothing to call
            # (a request holding no blocks has capacity 0, below any end)
            computed = request.num_computed_tokens
            end = computed + num_new_tokens
            if end + num_lookahead_tokens <= entry.capacity:
                if end // self.block_size > computed // self.block_size:
                    self._unpublished[request.request_id] = (request, entry, end)  # a block fills
                return self.empty_kv_cache_blocks
        if (
            num_new_tokens == 0
            and num_new_computed_tokens == 0
            and num_external_computed_tokens == 0
        ):
            raise ValueError("num_new_tokens: must be > 0 when nothing is computed")
        if num_external_computed_tokens:
            raise _unsupported("num_external_computed_tokens (KV connectors)")
        computed = request.num_computed_tokens + num_new_computed_tokens
        end = computed + num_new_tokens
        need = min(end + num_lookahead_tokens, self.max_model_len)
        if entry is not None and entry.capacity:
            # running (the decode path): tokens are synced only when the pool is called
            if need <= entry.capacity:
                blocks = self.empty_kv_cache_blocks
            else:
                blocks = self._grow(entry, need, request)  # a count only: the tokens can wait
        else:
            entry = self._entry(request)
            blocks = self._admit(
                request,
                entry,
                need,
                num_new_computed_tokens,
                new_computed_blocks,
                full_sequence_must_fit,
                reserved_blocks,
                has_scheduled_reqs,
            )
        bs = self.block_size
        if blocks is not None and end // bs > computed // bs:
            self._unpublished[request.request_id] = (request, entry, end)  # a block fills this step
        return blocks

    def _whole_fits(self, whole: int, hit_tokens: int) -> bool:
        """vLLM's whole-sequence gate with window groups: the full-attention blocks of
        ``whole`` tokens past the hit, and per window group the blocks of ``whole`` tokens up to
        vLLM's admission cap (a window group never holds more at once: its table slides as the
        prefill's KV comes into existence), within the free and evictable blocks."""
        blocks = -(-whole // self.block_size)
        window = blocks if self._window_cap is None else min(blocks, self._window_cap)
        demand = blocks - hit_tokens // self.block_size + self.layout.window_groups * window
        return demand <= self.block_pool.get_num_free_blocks()

    def _grow(self, entry: _Entry, need: int, request: Request) -> KVCacheBlocks | None:
        """The table grown to ``need`` tokens. Either call grows it the same way (the core's
        ``grow(seq, need)``): the sequence may lag behind the request's tokens, which only
        hashing reads."""
        seq, bs = entry.seq, self.block_size
        old = entry.capacity // bs
        if self.layout.kind == "state":  # the state moves on: the step end it left first
            self._publish(
                request, entry, request.num_computed_tokens - request.num_in_flight_tokens
            )
        if need <= entry.length:
            ok = self.pool.allocate(seq, need)
        else:
            ok = self.pool.may_append(seq, need - entry.length)
        if not ok:
            return None
        blocks = -(-need // bs)  # both grow the table to hold `need` tokens
        new: list[int]
        if blocks == old + 1:  # decode: one block, the table's last (set: the table just grew)
            new = [seq.last_block_id]  # type: ignore[list-item]
        else:
            new = seq.block_ids()[old:]
        entry.ids += new  # the mirror grows in place, as vLLM's own table lists do
        entry.capacity = blocks * bs
        self._held_blocks_changed()
        if self._hybrid:
            return self._new_blocks(GroupBlocks(self._group_ids(entry, old)))
        return self._new_blocks(PoolBlocks(new))

    def _new_blocks(self, blocks: KVCacheBlocks) -> KVCacheBlocks:
        """``blocks``, newly allocated; their ids in the groups vLLM zeroes are kept for
        ``take_new_block_ids``."""
        if self._zeroed:
            ids = blocks.get_block_ids()
            for g in self._zeroed:
                self._to_zero.extend(i for i in ids[g] if i)
        return blocks

    def _group_ids(self, entry: _Entry, start: int) -> tuple[list[int], ...]:
        """Each vLLM group's block ids from table entry ``start`` on, in vLLM's order: the full
        table's mirror, the window tables as the pool has them (0 behind the window: vLLM's null
        block, as vLLM's own window tables have it)."""
        seq = entry.seq
        tables = [entry.ids[start:]]
        for g in range(1, self.num_kv_cache_groups):
            tables.append(seq.group_block_table(g)[start:].tolist())
        return tuple(tables[g] for g in self.layout.pool_groups)

    def _admit(
        self,
        request: Request,
        entry: _Entry,
        need: int,
        hit_tokens: int,
        hit: KVCacheBlocks | None,
        must_fit: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> KVCacheBlocks | None:
        if self._unpublished:  # an admission's walk sees every block whose KV exists
            self._publish_computed()  # (publishes nothing right after get_computed_blocks)
        seq, length = entry.seq, entry.length
        fresh = isinstance(hit, _Hit) and hit.seq_len == length  # planned at this length
        if must_fit:  # the whole sequence must fit, not only the first chunk (vLLM's gate)
            whole = min(length, self.max_model_len)
            if self._hybrid:
                fits = self._whole_fits(whole, hit_tokens)
            elif fresh and whole == length:
                fits = hit.fits  # type: ignore[union-attr]
            else:
                fits = self.pool.plan(seq, whole) is not None
            if not fits:
                return None
        watermark = self.watermark_blocks
        if watermark and not (
            has_scheduled_reqs
            and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        ):
            watermark = 0
        if watermark or reserved_blocks:
            wanted = self.pool.plan(seq, min(need, length))
            if wanted is None or (
                wanted.num_new_blocks + watermark + reserved_blocks
                > self.block_pool.get_num_free_blocks()
            ):
                return None
        if need <= length:
            # a plan of the whole sequence is carried out as it is; any other is planned again
            plan = hit.plan if fresh and need == length else None  # type: ignore[union-attr]
            ok = self.pool.allocate(seq, need, plan=plan)
        else:  # lookahead slots past the prompt: allocate, then append, all or nothing
            ok = self.pool.allocate(seq)
            if ok and not self.pool.may_append(seq, need - length):
                self.pool.deallocate(seq)  # publishes nothing: only the hit is computed
                ok = False
        if not ok:
            return None
        self._held_blocks_changed()
        got = seq.num_cached_tokens
        if got != hit_tokens and self.prefix_cache_lookup_enabled(request):
            self.pool.deallocate(seq)
            self._held_blocks_changed()
            raise ValueError(
                f"num_new_computed_tokens: {hit_tokens} is not the hit of "
                f"get_computed_blocks for {request.request_id!r} ({got} tokens now)"
            )
        ids = entry.ids = seq.block_ids()
        bs = self.block_size
        entry.capacity = len(ids) * bs
        entry.computed = got
        if self._hybrid:
            return self._new_blocks(GroupBlocks(self._group_ids(entry, got // bs)))
        return self._new_blocks(PoolBlocks(ids[got // bs :]))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks within ``num_computed_tokens`` (the async Scheduler
        passes tokens whose KV exists, R17)."""
        entry = self._seqs.get(request.request_id)
        if entry is not None and entry.capacity:
            self._publish(request, entry, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Publish what the request computed, then release its blocks (R18); unknown ids: no-op."""
        entry = self._seqs.get(request.request_id)
        if entry is None:
            return
        if entry.capacity:
            computed = request.num_computed_tokens - request.num_in_flight_tokens
            if self.enable_kv_cache_events:
                self._publish(
                    request, entry, computed
                )  # its BlockStored batch before the release's
            elif self.enable_caching and computed > entry.computed:
                # deallocate publishes them itself (R18): one call, the same cache after
                self._entry(request)
                n = min(computed, entry.length, entry.capacity)
                if n > entry.computed:
                    entry.seq.num_computed_tokens = n
            self.pool.deallocate(entry.seq)
            self._held_blocks_changed()
        del self._seqs[request.request_id]
        self._unpublished.pop(request.request_id, None)

    # ------------------------------------------------------------------------------ reading
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """All of the request's blocks (the empty sentinel if it holds none)."""
        entry = self._seqs.get(request_id)
        if entry is None or not entry.capacity:
            return self.empty_kv_cache_blocks
        if self._hybrid:
            return GroupBlocks(self._group_ids(entry, 0))
        return PoolBlocks(entry.ids)  # get_block_ids copies, as vLLM's

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group."""
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """The request's block ids that hold its first ``num_computed_tokens`` tokens."""
        end = -(-num_computed_tokens // self.block_size)
        return tuple(ids[:end] for ids in self.get_block_ids(request_id))

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        """vLLM's ``KVCacheBlocks`` of ``blocks``, the empty sentinel when every group is empty."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request's full blocks whose KV exists (what vLLM counts as cached)."""
        entry = self._seqs.get(request.request_id)
        if entry is None or not self.enable_caching:
            return 0
        computed = min(
            request.num_computed_tokens - request.num_in_flight_tokens,
            request.num_tokens,
            entry.capacity,
        )
        return max(computed, 0) // self.block_size * self.block_size

    def get_num_cached_tokens(self, request: Request) -> int:
        """vLLM 0.34's probe: the tokens ``get_computed_blocks`` would report as the request's
        hit now (0 without a lookup), changing nothing: no allocation, no publication, no LRU
        touch, no stats, no events, no entry for the request (a sequence of its own if it has
        none yet; ``BlockManagerPool.plan`` has no side effect of any kind).

        Blocks whose KV exists are published lazily, before the next lookup (module doc); the
        probe does not publish them, so from its first call on the manager publishes them at
        each step's start instead (as with KV events), and every later probe sees them all
        (kvpool's ``Scheduler`` switches at construction when cache-aware admission is on).
        0.34's Scheduler calls it for cache-aware admission (``cache_aware_admission_window``).
        """
        if not self.prefix_cache_lookup_enabled(request):
            return 0
        if "new_step_starts" not in self.__dict__:
            self.publish_at_step_start()
        if not hit_unbounded(request) or request.prompt_embeds is not None:
            return 0  # a chain of its own: never a hit (_extra_key)
        tokens = request._all_token_ids
        entry = self._seqs.get(request.request_id)
        if entry is not None and not entry.capacity and entry.length == len(tokens):
            seq = entry.seq  # its lookup's sequence, up to date
        else:  # none yet, or it holds blocks: a sequence of its own, dropped after
            seq = PoolSequence(token_ids(tokens), extra_key=self._extra_key(request, False))
        plan = self.pool.plan(seq)
        if plan is None:  # the whole sequence does not fit now: the hit alone
            plan = self.pool.plan(seq, 1)
        return plan.num_cached_tokens if plan is not None else 0

    def publish_at_step_start(self) -> None:
        """Publish the blocks whose KV exists at each step's start (``new_step_starts``), not
        only before the next lookup: what KV events and ``get_num_cached_tokens`` need."""
        self.new_step_starts = self._publish_computed  # type: ignore[method-assign]

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33 (its Scheduler never calls it), gone from 0.34's manager:
        zeros, one per group."""
        return [0] * self.num_kv_cache_groups

    def _held_blocks_changed(self) -> None:
        """Sets ``usage`` from the pool's counters (after an allocation or a release)."""
        self.usage = self.block_pool.get_usage()

    # -------------------------------------------------------------------- per-step no-ops
    def new_step_starts(self) -> None:
        """Nothing: the blocks the last steps filled are published before the next lookup
        (module doc). A manager built with KV events has ``_publish_computed`` here instead,
        so that their ``BlockStored`` events come in the step after their KV."""

    def _publish_computed(self) -> None:
        """Publish the blocks the last steps filled whose KV exists now (R17).

        Runs first thing in ``schedule()`` (``new_step_starts``, with KV events) or at the
        step's first lookup, after ``update_from_output`` of the steps that computed them;
        tokens still in flight wait for a later step."""
        if not self._unpublished:
            return
        waiting: dict[str, tuple[Request, _Entry, int]] = {}
        bs = self.block_size
        for rid, pending in self._unpublished.items():
            request, entry, end = pending
            if entry.capacity:
                self._publish(
                    request, entry, request.num_computed_tokens - request.num_in_flight_tokens
                )
                # scheduled, not computed yet (in flight, or scheduled in the step under way)
                if entry.computed < end - end % bs and self._publishes:
                    waiting[rid] = pending
        self._unpublished = waiting

    def take_new_block_ids(self) -> list[int]:
        """The attention groups' blocks allocated since the last call, for vLLM's workers to
        zero (``needs_kv_cache_zeroing``: Mamba states or several precisions share the ids);
        none otherwise."""
        taken, self._to_zero = self._to_zero, []
        return taken

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[KVCacheBlock]]:
        """Copy-on-write of partial hits: none (hits are whole blocks). The Scheduler reads the
        pair every step and only tests it, so it is one shared pair of empty tuples."""
        return _NO_COPIES  # type: ignore[return-value]

    def take_boundary_state_offloads(self) -> dict[str, list[Any]]:
        """Mamba "align" state offloads: none."""
        return {}

    def finalize_partial_tail_offloads(self, request: Request) -> list[Any]:
        """Partial-tail offloads of producer connectors: none."""
        return []

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Nothing is skipped in full attention."""

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Nothing to zero in full attention."""

    # ---------------------------------------------------------------------- connector-only
    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        raise _unsupported("pop_blocks_for_free (deferred frees of KV connectors)")

    def evict_blocks(self, block_ids: set[int]) -> None:
        raise _unsupported("evict_blocks (KV connectors)")

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        raise _unsupported("truncate_computed_blocks (KV connectors)")

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ):
        raise _unsupported("get_computed_blocks_for_connector (KV connectors)")

    # ---------------------------------------------------------------------- stats and events
    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count an admission's lookup in vLLM's ``PrefixCacheStats``."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0
        )
        self._stats_recorded = True

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call (a fresh object starts); None unless ``log_stats``."""
        if not self.log_stats:
            return None
        if not self._stats_recorded:  # the Scheduler asks every step: no attribute walk
            return self._no_prefix_cache_stats  # nothing recorded: an empty object nobody fills
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        self._stats_recorded = False
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (R12); False, nothing changed, while a request holds blocks."""
        if any(entry.capacity for entry in self._seqs.values()):
            return False
        self.pool.reset_prefix_cache()
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
            self._stats_recorded = True
        return True

    def take_events(self) -> list[Any]:
        """The pool's KV events since the last call as vLLM's events ([] unless enabled)."""
        return []  # a manager built with KV events has _take_vllm_events as its take_events

    def _take_vllm_events(self) -> list[Any]:
        chain_keys, int_hashes, groups = self._chain_keys, self._int_hashes, self._event_groups
        return [
            vllm_event(e, chain_keys, int_hashes, groups[e.group])
            for e in self.pool.drain_events()
            if e.kind != "group"  # (the pool's announcement of its groups: vLLM has none)
        ]

    def check(self) -> None:
        """Walk the pool's structures (R20) and this manager's (``_vllm_check.check_manager``).

        Raises
        ------
        kvpool.InvariantError
            A rule is broken.
        """
        check_manager(self)
