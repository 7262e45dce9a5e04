"""``PagedModelRunner``: a Hugging Face causal LM whose KV lives entirely in a kvpool pool.

The runner owns the model's caches, sized by the pool, and runs the model on only the tokens a
step computes (explicit ``position_ids``, no HF cache). Inside each attention layer the
``"kvpool"`` attention function (attention.py) writes the step's K/V into the paged cache and
attends over the pool's block tables:

* full-attention layers: ``[num_blocks, block_size, kv_heads, head_dim]`` K and V per layer,
  addressed by group 0's tables and slots; a host tier (``HierarchyBlockManagerPool``) has the
  same arrays on the host, and the pool's load / offload plans move blocks with ``swap_blocks``;
* sliding-window layers: the same per layer with the window group's ids (group 1);
* linear-attention layers (Gated DeltaNet): a conv and a recurrent state tensor
  ``[num_slots, ...]`` per layer; each sequence's row is ``seq.linear_state_slot``; the pool's
  linear-state plan (zeros, restores, saves) runs with ``copy_linear_state``.

:meth:`PagedModelRunner.forward` computes one step: ``chunks[i]`` are the next tokens of
``seqs[i]`` from its ``num_computed_tokens`` (the pool must already hold them in its tables).
Attention-only models run the whole step in one packed forward (batch 1, sequences one after
another). Models with linear layers run one forward per chunk length (rows of a batch): a
recurrent state cannot be packed across sequences, and padding would change it.

Every kernel call goes through ``kvpool.kernels`` with ``backend=`` (numpy, emulated, cupy): the
same code serves a CPU test and a GPU run. The runner never changes the pool's bookkeeping
(``num_computed_tokens``, ``cache``); the engine does (engine.py).

Invariants: caches are allocated once and never move (the kernel views stay valid); block 0 and
slot 0 are padding; every plan taken from the pool is executed and confirmed before the next
forward (R24, R26).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch

import kvpool
from kvpool import kernels
from kvpool.integrations.transformers.arrays import Bridge
from kvpool.integrations.transformers.attention import step_scope
from kvpool.integrations.transformers.layout import ModelLayout, layout_of
from kvpool.integrations.transformers.state import SlotStateCache


class _Step:
    """What the attention layers of one forward need: tables, slots, lengths per group."""

    def __init__(self, runner: PagedModelRunner, seqs: list[Any], counts: list[int]):
        self.runner = runner
        br = runner.bridge
        pool = runner.pool
        self.tables: dict[int, Any] = {}
        self.slots: dict[int, Any] = {}
        for group in runner.groups:
            self.tables[group] = br.index(pool.block_tables(seqs, group))
            self.slots[group] = br.index(
                pool.slot_mapping(seqs, group, num_tokens=counts), np.int64
            )
        starts = np.array([s.num_computed_tokens for s in seqs], np.int64)
        self.seq_lens = br.index(starts + np.asarray(counts))
        self.cu = br.index(np.concatenate([[0], np.cumsum(counts)]))
        self.decode = all(n == 1 for n in counts)

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        r = self.runner
        group = r.layout.group_of(layer)
        window = r.layout.window if group == 1 else None
        if sliding_window != window:
            raise ValueError(
                f"layer {layer} attends with sliding_window={sliding_window}, the "
                f"layout says {window}"
            )
        b, hq, t, d = query.shape
        hkv = key.shape[1]
        t0 = time.perf_counter()
        q = query.transpose(1, 2).reshape(b * t, hq, d).contiguous()
        k = key.transpose(1, 2).reshape(b * t, hkv, d).contiguous().to(r.dtype)
        v = value.transpose(1, 2).reshape(b * t, hkv, d).contiguous().to(r.dtype)
        kc, vc = r.kv_views[layer]
        br, be = r.bridge, r.bridge.backend
        kernels.write_kv(
            br.view(k), br.view(v), kc, vc, self.slots[group], backend=be, validate=r.validate
        )
        qa = br.view(q.to(r.dtype))
        if self.decode:
            out = kernels.paged_decode_attention(
                qa,
                kc,
                vc,
                self.tables[group],
                self.seq_lens,
                scaling,
                window=window,
                backend=be,
                validate=r.validate,
            )
        else:
            out = kernels.paged_prefill_attention(
                qa,
                kc,
                vc,
                self.tables[group],
                self.cu,
                self.seq_lens,
                scaling,
                causal=True,
                window=window,
                backend=be,
                validate=r.validate,
            )
        r.timers["attention"] += time.perf_counter() - t0
        return br.tensor(out).to(query.dtype).reshape(b, t, hq, d)


class PagedModelRunner:
    """A ``transformers`` causal LM over a kvpool pool's paged cache (see the module doc).

    Parameters
    ----------
    model : a ``*ForCausalLM`` (Qwen3, Llama, Mistral, Gemma 3 text, Qwen3-Next, ...), in eval
        mode, on the CPU for the ``numpy`` / ``emulated`` backends or on CUDA for ``cupy``.
    pool : a ``kvpool.BlockManagerPool`` (or ``HierarchyBlockManagerPool``) built with the
        options of ``layout_of(model).pool_options(...)``: its window group, linear state.
    backend : a ``kvpool.kernels`` backend; default ``kvpool.kernels.backend()``.
    validate : the kernels' range checks (a device sync each on cupy).
    """

    def __init__(
        self,
        model: Any,
        pool: kvpool.BlockManagerPool | kvpool.HierarchyBlockManagerPool,
        *,
        backend: str | None = None,
        validate: bool = True,
    ):
        self.model = model.eval()
        self.pool = pool
        self.layout: ModelLayout = layout_of(model)
        self.validate = validate
        param = next(model.parameters())
        self.dtype = param.dtype
        self.device = param.device
        self.bridge = Bridge(backend, self.device)
        self.timers: dict[str, float] = defaultdict(float)
        self._check_pool()
        lay, bs = self.layout, pool.block_size
        self.groups = sorted(
            {lay.group_of(i) for i in range(lay.num_layers) if lay.kinds[i] != "linear"}
        )
        blocks = {0: pool.num_blocks}
        if lay.has_window:
            window = pool.stats()["window"]
            assert window is not None  # a window layout's pool has a window group
            blocks[1] = window["num_total_blocks"] + 1
        shape = (bs, lay.num_kv_heads, lay.head_dim)
        # K/V caches per attention layer: torch tensors, and the backend's views of them.
        self.kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, kind in enumerate(lay.kinds):
            if kind != "linear":
                n = blocks[lay.group_of(i)]
                self.kv_caches[i] = tuple(
                    torch.zeros((n, *shape), dtype=self.dtype, device=self.device) for _ in range(2)
                )
        self.kv_views = {
            i: (self.bridge.view(k), self.bridge.view(v)) for i, (k, v) in self.kv_caches.items()
        }
        # The host tier: full-attention blocks only (docs/host_tier.md).
        self.host_caches: dict[int, tuple[Any, Any]] = {}
        host_blocks = getattr(pool, "host_num_blocks", None)
        if host_blocks:
            for i in lay.layers("full"):
                self.host_caches[i] = tuple(
                    self.bridge.host_cache((host_blocks, *shape), self.dtype) for _ in range(2)
                )
        # Linear-state slots: conv in the model's dtype, the recurrent state in float32 (the
        # delta rule runs in float32 and returns it so).
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        if lay.has_linear:
            slots = pool.linear_state_cache(0).num_slots
            for i, st in lay.linear.items():
                self.conv[i] = torch.zeros((slots, *st.conv), dtype=self.dtype, device=self.device)
                self.recurrent[i] = torch.zeros(
                    (slots, *st.recurrent), dtype=torch.float32, device=self.device
                )
        self._state_views = [self.bridge.view(t) for t in self.conv.values()] + [
            self.bridge.view(t) for t in self.recurrent.values()
        ]
        self.counters: dict[str, int] = defaultdict(int)

    def _check_pool(self) -> None:
        lay, pool = self.layout, self.pool
        if pool.dp_size != 1:
            raise ValueError("pool: the paged runner serves one dp rank (dp_size=1)")
        if lay.has_window != (pool.num_groups == 2):
            raise ValueError(
                f"pool: the model {'has' if lay.has_window else 'has no'} "
                "sliding-window layers; build the pool with pool_options()"
            )
        if lay.has_linear:
            try:
                pool.linear_state_cache(0)
            except ValueError as e:
                raise ValueError(
                    "pool: the model has linear-attention layers; build the pool "
                    "with linear_state_slots (pool_options())"
                ) from e

    # ------------------------------------------------------------------------------ plans
    def run_plans(self) -> None:
        """Executes and confirms every plan the pool holds: offloads, loads (R26), then the
        linear-state plan (R24: zeros, restores, saves)."""
        t0 = time.perf_counter()
        pool, be = self.pool, self.bridge.backend
        if self.host_caches:
            assert isinstance(pool, kvpool.HierarchyBlockManagerPool)  # host caches: a host tier
            offloads = pool.take_offload_plans()
            for plan in offloads:
                self._swap(plan, to_host=True)
                self.counters["offloaded_blocks"] += len(plan.src)
            if offloads:
                pool.complete_offloads(offloads)
            loads = pool.take_load_plans()
            for plan in loads:
                self._swap(plan, to_host=False)
                self.counters["loaded_blocks"] += len(plan.src)
            if loads:
                pool.complete_loads(loads)
        if self.layout.has_linear:
            linear = pool.take_linear_state_plan()
            if len(linear.zero_slots):
                zero = torch.as_tensor(linear.zero_slots, dtype=torch.long, device=self.device)
                for t in (*self.conv.values(), *self.recurrent.values()):
                    t[zero] = 0
                self.counters["zeroed_slots"] += len(linear.zero_slots)
            if len(linear.restore_src):
                kernels.copy_linear_state(
                    self._state_views,
                    self.bridge.index(linear.restore_src),
                    self.bridge.index(linear.restore_dst),
                    backend=be,
                )
                self.counters["restores"] += len(linear.restore_src)
            if len(linear.save_src):
                kernels.copy_linear_state(
                    self._state_views,
                    self.bridge.index(linear.save_src),
                    self.bridge.index(linear.save_dst),
                    backend=be,
                )
                self.counters["saves"] += len(linear.save_src)
            pool.commit_linear_state_plan(linear)
        self.timers["plans"] += time.perf_counter() - t0

    def _swap(self, plan: Any, to_host: bool) -> None:
        src, dst = self.bridge.index(plan.src), self.bridge.index(plan.dst)
        for layer, host in self.host_caches.items():
            for dev, h in zip(self.kv_views[layer], host, strict=True):
                a, b = (dev, h) if to_host else (h, dev)
                kernels.swap_blocks(a, b, src, dst, backend=self.bridge.backend)
        if self.bridge.gpu:
            self.bridge._cp.cuda.get_current_stream().synchronize()  # before confirming

    # ------------------------------------------------------------------------------ forward
    def forward(
        self, seqs: list[Any], chunks: list[list[int]], *, all_logits: bool = False
    ) -> list[torch.Tensor]:
        """Computes ``chunks[i]``, the next tokens of ``seqs[i]`` from its
        ``num_computed_tokens`` (their slots must be in its tables); returns, per sequence, the
        logits of the chunk's last token (``[vocab]``), or of every token (``[n, vocab]``).

        Runs the pool's pending plans first. Does not advance ``num_computed_tokens``.
        """
        if len(seqs) != len(chunks):
            raise ValueError(f"chunks: {len(chunks)} chunks for {len(seqs)} sequences")
        if any(len(c) == 0 for c in chunks):
            raise ValueError("chunks: every chunk needs at least one token")
        self.run_plans()
        out: list[torch.Tensor | None] = [None] * len(seqs)
        if not seqs:
            return []
        if not self.layout.has_linear:
            for i, lg in enumerate(self._forward(seqs, chunks, packed=True, all_logits=all_logits)):
                out[i] = lg
        else:
            by_len: dict[int, list[int]] = defaultdict(list)
            for i, c in enumerate(chunks):
                by_len[len(c)].append(i)
            for idx in by_len.values():
                logits = self._forward(
                    [seqs[i] for i in idx],
                    [chunks[i] for i in idx],
                    packed=False,
                    all_logits=all_logits,
                )
                for i, lg in zip(idx, logits, strict=True):
                    out[i] = lg
        self.counters["forwards"] += 1
        self.counters["tokens"] += sum(len(c) for c in chunks)
        return out  # type: ignore[return-value]

    def _forward(
        self, seqs: list[Any], chunks: list[list[int]], *, packed: bool, all_logits: bool
    ) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        counts = [len(c) for c in chunks]
        starts = [s.num_computed_tokens for s in seqs]
        dev = self.device
        if packed:
            ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=dev)[None]
            pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
            pos = pos.to(dev)[None]
            ends = np.cumsum(counts)
            keep: Any = 0 if all_logits else torch.as_tensor(ends - 1, device=dev)
        else:
            ids = torch.tensor(chunks, dtype=torch.long, device=dev)
            pos = (torch.tensor(starts)[:, None] + torch.arange(counts[0])[None]).to(dev)
            keep = 0 if all_logits else 1
        step = _Step(self, seqs, counts)
        cache = None
        if self.layout.has_linear:
            slots = torch.tensor([s.linear_state_slot for s in seqs], dtype=torch.long, device=dev)
            cache = SlotStateCache(self.conv, self.recurrent, slots)
        self.timers["prepare"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        with torch.inference_mode(), step_scope(step, self.model.config):
            logits = self.model(
                input_ids=ids,
                position_ids=pos,
                past_key_values=cache,
                use_cache=False,
                logits_to_keep=keep,
            ).logits
        if cache is not None:
            cache.scatter()
        self.timers["forward"] += time.perf_counter() - t1
        if packed:
            rows = logits[0]
            if not all_logits:
                return list(rows)
            bounds = np.concatenate([[0], np.cumsum(counts)])
            return [rows[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        return [row if all_logits else row[-1] for row in logits]
