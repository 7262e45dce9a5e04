"""Shared fixtures and helpers for the kvpool test-suite.

The suite is grouped by area, in plain folders (no packages): ``core/`` (the physical block
managers, the prefix cache, bad input, reliability), ``pool/`` (the sequence-level pool, its
batch calls, events, threads), ``hybrid/`` (linear state, sliding window, composite groups),
``tiers/`` (host and remote tiers), ``index/`` (the KV index over events, routing), ``kernels/`` (the data plane), ``sim/`` (``kvpool simulate``,
workloads, traces, the tour), ``benches/`` (the benchmark references of benches/compare/) and
``docs/`` (the contract). ``python -m pytest -q`` from the root runs them all.

Helper modules live beside the area that owns them and import by name from any area: this
file's helpers (``from conftest import toks``), ``tiers/redis_helpers.py`` and
``kernels/kernels_helpers.py`` (their folders are put on ``sys.path`` below). Test module names
are unique across folders.

Rules are cited as in docs/contract.md ("R7"). Hypothesis profiles live here:

* ``ci``  (default): bounded example counts, no deadline; the whole suite stays well under a
  minute on two cores.
* ``dev``: many more examples for local soak runs (``HYPOTHESIS_PROFILE=dev pytest``).
"""

from __future__ import annotations

import gc
import os
import re
import sys
from pathlib import Path

import kvpool
import pytest
from hypothesis import HealthCheck, settings

TESTS = Path(__file__).resolve().parent
for _folder in (TESTS, TESTS / "tiers", TESTS / "kernels"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    stateful_step_count=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=1000,
    deadline=None,
    stateful_step_count=100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

BLOCK_COUNT_KEYS = ("num_total_blocks", "num_free_blocks", "num_cached_blocks", "num_used_blocks")


def toks(n: int, start: int = 0) -> list[int]:
    """n distinct-ish token ids starting at `start` (deterministic)."""
    return list(range(start, start + n))


def bm_counts(bm) -> dict:
    """Every block count a BlockManager exposes, as a dict (for before/after comparisons)."""
    d = {k: getattr(bm, k) for k in BLOCK_COUNT_KEYS}
    d["num_available_blocks"] = bm.num_available_blocks
    return d


def assert_conservation(bm) -> None:
    """R2: free + cached + used == total, available == free + cached."""
    c = bm_counts(bm)
    assert (
        c["num_free_blocks"] + c["num_cached_blocks"] + c["num_used_blocks"]
        == c["num_total_blocks"]
    ), c
    assert c["num_available_blocks"] == c["num_free_blocks"] + c["num_cached_blocks"], c
    for k, v in c.items():
        assert v >= 0, (k, c)


def bm_snapshot(bm) -> dict:
    """Counts, statistics and the prefix-cache size: everything observable without side effects."""
    snap = bm_counts(bm)
    snap["stats"] = bm.stats()
    pc = bm.prefix_cache
    if pc is not None:
        snap["pc_len"] = len(pc)
        snap["pc_query"] = pc.query_tokens
        snap["pc_hit"] = pc.hit_tokens
    return snap


def seq_snapshot(seq) -> dict:
    return {
        "len": len(seq),
        "tokens": list(seq.token_ids),
        "table": [int(x) for x in seq.block_table],
        "cached": seq.num_cached_tokens,
        "computed": seq.num_computed_tokens,
        "dp_rank": seq.dp_rank,
    }


def pool_snapshot(pool) -> dict:
    return pool.stats()


def release_gc() -> None:
    gc.collect()


def assert_names_arg(exc: BaseException, arg: str) -> None:
    """R29: a ValueError / TypeError names the argument it is about."""
    msg = str(exc)
    assert re.search(r"(?<![A-Za-z0-9_])" + re.escape(arg) + r"(?![A-Za-z0-9_])", msg), (
        f"error message does not name {arg!r}: {type(exc).__name__}: {msg!r}"
    )


def raises_bad_arg(arg: str, fn, *args, int_range: bool = False, **kwargs):
    """Call fn and require a ValueError/TypeError naming `arg` (R29).

    With int_range=True an OverflowError (any message) is also accepted: the argument is an
    integer out of the range of the underlying type.
    """
    accepted: tuple = (ValueError, TypeError)
    if int_range:
        accepted = (ValueError, TypeError, OverflowError)
    with pytest.raises(accepted) as ei:
        fn(*args, **kwargs)
    if not isinstance(ei.value, OverflowError):
        assert_names_arg(ei.value, arg)
    return ei.value


def slow_slot_mapping(seqs, block_size: int) -> list[int]:
    """Reference for R19 slot_mapping (seed 9.5): slots of tokens [computed, len) of each seq."""
    out: list[int] = []
    for s in seqs:
        table = [int(x) for x in s.block_table]
        for pos in range(s.num_computed_tokens, len(s)):
            out.append(table[pos // block_size] * block_size + pos % block_size)
    return out


def slow_block_tables(seqs) -> list[list[int]]:
    """Reference for R19 block_tables: rows padded with 0 to the longest table."""
    tables = [[int(x) for x in s.block_table] for s in seqs]
    width = max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture
def bm():
    """BlockManager(16 blocks, block_size 4): 15 allocatable ids."""
    return kvpool.BlockManager(16, 4)


@pytest.fixture
def pool():
    return kvpool.BlockManagerPool(16, 4)
