"""Elastic KV memory in the simulator (``kvpool simulate --xtensor``, docs/xtensor.md).

The pool runs with ``xtensor=`` (every rank's blocks on virtual-memory pages, accounting backend):
its cache size is the virtual range, and only the pages holding used or cached blocks (plus the
spares) cost memory. :class:`MappedMemory` follows that memory over simulated time and applies a
memory-limit schedule, as a co-located second model squeezing the instance would.

Page sizes: a page is one physical allocation per K and V tensor of every layer, so by default it
is ``2 MiB x 2 x layers`` (CUDA's 2 MiB granularity per tensor, as ``kvpool.xtensor`` and
kvcached map it); ``--page-mib`` sets the whole page's size instead. ``blocks_per_page`` is how
many blocks of the model's shape fit in it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "GIB",
    "MIB",
    "MappedMemory",
    "default_page_bytes",
    "parse_limit_schedule",
    "xtensor_option",
]

MIB = 1 << 20
GIB = 1 << 30
# CUDA's virtual-memory allocation granularity: one page of one K or V tensor of one layer
GRANULARITY = 2 * MIB
NO_LIMIT = ("none", "off", "inf")


def default_page_bytes(layers: int) -> int:
    """One 2 MiB allocation per K and V tensor of every layer."""
    return GRANULARITY * 2 * layers


def xtensor_option(
    bytes_per_block: int, page_bytes: int, memory_limit_gib: float | None, spare_pages: int = 1
) -> dict[str, Any]:
    """The pool's ``xtensor=`` dict; ValueError if a page holds no block."""
    blocks_per_page = page_bytes // bytes_per_block
    if blocks_per_page < 1:
        raise ValueError(
            f"a page of {page_bytes / MIB:g} MiB holds no block of {bytes_per_block / MIB:g} MiB"
        )
    limit = None if memory_limit_gib is None else int(memory_limit_gib * GIB)
    return {
        "blocks_per_page": int(blocks_per_page),
        "page_bytes": int(page_bytes),
        "spare_pages": spare_pages,
        "memory_limit": limit,
        "backend": "accounting",
    }


def parse_limit_schedule(text: str) -> tuple[tuple[float, float | None], ...]:
    """``T:GIB,T:GIB,...`` -> ``((seconds, gib or None), ...)``: at simulated second ``T`` the limit
    per rank becomes ``GIB`` GiB (``none``: no limit). Times strictly increasing, >= 0."""
    out: list[tuple[float, float | None]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        when, sep, value = part.partition(":")
        if not sep:
            raise ValueError(f"expected T:GIB (simulated seconds : GiB per rank), got {part!r}")
        try:
            t = float(when)
        except ValueError:
            raise ValueError(
                f"expected a time in seconds before ':', got {when!r} in {part!r}"
            ) from None
        if not t >= 0 or t == float("inf"):
            raise ValueError(f"times must be finite and >= 0, got {when!r}")
        if value.strip().lower() in NO_LIMIT:
            gib: float | None = None
        else:
            try:
                gib = float(value)
            except ValueError:
                raise ValueError(
                    f"expected GiB (or none) after ':', got {value!r} in {part!r}"
                ) from None
            if not gib > 0 or gib == float("inf"):
                raise ValueError(f"limits must be > 0 GiB (or none), got {value!r}")
        if out and t <= out[-1][0]:
            raise ValueError(f"times must increase: {t:g} after {out[-1][0]:g}")
        out.append((t, gib))
    if not out:
        raise ValueError("expected at least one T:GIB")
    return tuple(out)


class MappedMemory:
    """Mapped memory of a pool on elastic pages over simulated time, and its limit schedule.

    ``record(stats, now_s)`` after each step (or request) takes the pool's ``stats()["xtensor"]``;
    the mean is over simulated time (the memory mapped at the end of a step holds until the next
    record), the peak over records.
    """

    def __init__(self, pool: Any, schedule: tuple[tuple[float, float | None], ...] = ()) -> None:
        self.pool = pool
        self.schedule = list(schedule)
        x = pool.stats()["xtensor"]
        self.now_bytes = int(x["mapped_bytes"])
        self.limit_bytes = int(x["limit_bytes"])
        self.range_bytes = int(x["num_pages"]) * int(pool.xtensor["page_bytes"])
        self.peak_bytes = self.now_bytes
        self.area = 0.0  # byte-seconds
        self.t = 0.0
        self.changes: list[dict[str, Any]] = []
        self.peak_excess_bytes = 0

    def due(self, now_s: float) -> bool:
        return bool(self.schedule) and self.schedule[0][0] <= now_s

    def apply_due(self, now_s: float) -> bool:
        """Applies the limits whose time has come; whether any was."""
        applied = False
        while self.due(now_s):
            at, gib = self.schedule.pop(0)
            reports = self.pool.set_memory_limit(None if gib is None else int(gib * GIB))
            excess = sum(r["excess_bytes"] for r in reports)
            self.peak_excess_bytes = max(self.peak_excess_bytes, excess)
            self.changes.append(
                {
                    "at_s": at,
                    "applied_s": now_s,
                    "gib": gib,
                    "evicted_blocks": sum(r["evicted_blocks"] for r in reports),
                    "unmapped_pages": sum(r["unmapped_pages"] for r in reports),
                    "excess_gib": excess / GIB,
                }
            )
            applied = True
        return applied

    def record(self, stats: dict[str, Any], now_s: float) -> None:
        x = stats["xtensor"]
        self.area += self.now_bytes * max(0.0, now_s - self.t)
        self.t = max(self.t, now_s)
        self.now_bytes = int(x["mapped_bytes"])
        self.limit_bytes = int(x["limit_bytes"])
        self.peak_bytes = max(self.peak_bytes, self.now_bytes)

    def summary(self, stats: dict[str, Any], now_s: float) -> dict[str, Any]:
        area = self.area + self.now_bytes * max(0.0, now_s - self.t)
        x = stats["xtensor"]
        return {
            "mapped_gib_mean": (area / now_s if now_s > 0 else self.now_bytes) / GIB,
            "mapped_gib_peak": self.peak_bytes / GIB,
            "mapped_gib_final": int(x["mapped_bytes"]) / GIB,
            "reserved_gib": self.range_bytes / GIB,
            "page_maps": int(x["num_page_maps"]),
            "page_unmaps": int(x["num_page_unmaps"]),
            "map_failures": int(x["num_map_failures"]),
            "limit_changes": self.changes,
            "limit_excess_gib_peak": self.peak_excess_bytes / GIB,
        }
