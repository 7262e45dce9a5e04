"""How long an engine step takes: a fixed time, or a roofline of the model on a GPU.

The simulator asks once per step for each dp rank's work (:class:`StepWork`: tokens computed,
the attention they do, the KV they read) and advances its clock by the slowest rank's time
(ranks step in lockstep). The roofline (:class:`Roofline`) takes the larger of

- compute: ``2 * params`` FLOPs per token (the linear layers) plus ``4 * layers * heads *
  head_dim`` FLOPs per (query token, attended position) pair (``Q K^T`` and ``P V``), over
  ``tp * peak_flops * mfu``;
- memory: the weights (``2 * params`` bytes, bf16) once per step plus the KV read (every
  position before each chunk) and written (the new tokens), at
  ``ModelShape.bytes_per_token()``, over ``tp * memory_bandwidth * mbu``.

``tp`` GPUs per rank are counted as ideal tensor parallelism (peak and bandwidth times ``tp``,
no communication). A step that computes nothing takes no time.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.sim.capacity import ModelShape

__all__ = ["GPUS", "FixedStepTime", "GpuSpec", "Roofline", "StepWork", "chunk_work"]


@dataclass(frozen=True)
class GpuSpec:
    """Dense BF16 tensor-core peak (FLOP/s), HBM bandwidth (bytes/s) and memory (GiB) of one GPU."""

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_gib: float


# Vendor datasheet numbers (SXM parts, dense BF16, no sparsity).
GPUS: dict[str, GpuSpec] = {
    "a100": GpuSpec("A100-SXM4-80GB", 312e12, 2.039e12, 80),
    "h100": GpuSpec("H100-SXM5-80GB", 989e12, 3.35e12, 80),
    "h200": GpuSpec("H200-SXM-141GB", 989e12, 4.8e12, 141),
}


@dataclass
class StepWork:
    """One rank's work in one step: sums over its scheduled chunks.

    ``tokens``: tokens computed; ``attended``: (query token, key position) pairs, causal;
    ``kv_read``: cached positions read (the context before each chunk).
    """

    tokens: int = 0
    attended: int = 0
    kv_read: int = 0

    def add(self, start: int, end: int) -> None:
        """A chunk computing positions ``[start, end)`` of one sequence."""
        self.tokens += end - start
        self.attended += (end * (end + 1) - start * (start + 1)) // 2
        self.kv_read += start


def chunk_work(start: int, end: int) -> StepWork:
    w = StepWork()
    w.add(start, end)
    return w


class FixedStepTime:
    """Every step takes ``step_ms`` milliseconds (the ``--step-ms`` model)."""

    name = "fixed"

    def __init__(self, step_ms: float) -> None:
        if not step_ms > 0:
            raise ValueError(f"step_ms must be > 0, got {step_ms}")
        self.step_s = step_ms / 1000.0

    def seconds(self, work: StepWork) -> float:
        return self.step_s if work.tokens else 0.0

    def seconds_of(self, tokens: int, attended: int, kv_read: int) -> float:
        return self.step_s if tokens else 0.0

    def describe(self) -> str:
        return f"fixed {self.step_s * 1e3:g} ms per step"


class Roofline:
    """A roofline step time of ``shape`` on ``tp`` GPUs ``gpu`` (see the module docstring).

    Parameters
    ----------
    shape : ModelShape
        Needs ``params`` (parameter count) and ``heads`` (query heads).
    gpu : GpuSpec
    tp : int
        GPUs per rank.
    mfu : float
        Fraction of the peak FLOP/s reached, in (0, 1].
    mbu : float
        Fraction of the memory bandwidth reached, in (0, 1].
    """

    name = "roofline"

    def __init__(
        self, shape: ModelShape, gpu: GpuSpec, *, tp: int = 1, mfu: float = 0.5, mbu: float = 0.8
    ) -> None:
        if shape.params is None or shape.heads is None:
            raise ValueError(
                "the roofline needs the model's parameter count and query heads "
                "(--model, or --params and --heads)"
            )
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        for name, v in (("mfu", mfu), ("mbu", mbu)):
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        self.shape, self.gpu, self.tp, self.mfu, self.mbu = shape, gpu, tp, mfu, mbu
        self.params = shape.params
        self.flops_per_token = 2.0 * shape.params
        self.flops_per_pair = 4.0 * shape.layers * shape.heads * shape.head_dim
        self.weight_bytes = 2.0 * shape.params
        self.kv_bytes_per_token = float(shape.bytes_per_token())
        self.flops_per_s = tp * gpu.peak_flops * mfu
        self.bytes_per_s = tp * gpu.memory_bandwidth * mbu

    def seconds(self, work: StepWork) -> float:
        return self.seconds_of(work.tokens, work.attended, work.kv_read)

    def seconds_of(self, tokens: int, attended: int, kv_read: int) -> float:
        """Seconds of a step computing ``tokens`` tokens over ``attended`` (query, key) pairs,
        reading ``kv_read`` cached positions (see :class:`StepWork`)."""
        if not tokens:
            return 0.0
        compute = (
            self.flops_per_token * tokens + self.flops_per_pair * attended
        ) / self.flops_per_s
        memory = (
            self.weight_bytes + self.kv_bytes_per_token * (kv_read + tokens)
        ) / self.bytes_per_s
        return compute if compute > memory else memory

    def describe(self) -> str:
        tp = f"{self.tp} x " if self.tp > 1 else ""
        return (
            f"roofline, {tp}{self.gpu.name}, {self.params / 1e9:.1f}B params, "
            f"MFU {self.mfu:g}, MBU {self.mbu:g}"
        )
