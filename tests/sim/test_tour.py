"""``kvpool tour``: the seeds' scenarios on the real library, with the seeds' numbers.

Seed 003: block size 4, 11 tokens -> 3 blocks, 1 empty slot; a full one-block request's 5th token:
can_append True, then may_append adds one id; releasing both restores the free list; block size
8: 2 blocks, 5 empty slots, the 5th token needs no new block. Seed 000 section 10.1: dp rank,
single block, live slot, prefix match, new blocks, deallocate, ref counts falling to the free list.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kvpool
import pytest

pytestmark = pytest.mark.skipif(not hasattr(kvpool, "BlockManagerPool"), reason="pool not built")

from kvpool.tour import paged_blocks, request_life  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_seed_003_numbers() -> None:
    _, facts = paged_blocks()
    four, eight = facts[4], facts[8]
    assert (four["a_blocks"], four["a_empty"]) == (3, 1)  # ceil(11 / 4) = 3, one empty slot
    assert len(four["a_table"]) == 3 and 0 not in four["a_table"]
    assert four["b_len"] == 5 and four["can_append"] and four["may_append"] and four["b_added"] == 1
    assert four["free_after"] == four["total"] == 15  # the free list is whole again
    assert (eight["a_blocks"], eight["a_empty"], eight["b_added"]) == (2, 5, 0)
    assert eight["free_after"] == eight["total"]


def test_seed_000_lifecycle_numbers() -> None:
    _, _, f = request_life()
    s1 = f["s1"]
    assert s1["dp_rank"] == 0 and s1["single_block"] is not None and s1["live_slot"] is not None
    assert s1["cached"] == 0 and len(s1["table"]) == 3  # 10 tokens, block size 4: 3 new blocks
    assert f["slots"] == [s1["table"][p // 4] * 4 + p % 4 for p in range(10)]
    assert f["checkpoint_saves"] == 1
    # released: 2 full blocks cached, the partial one back on the free list, nothing used
    assert f["after_release"] == {"free": 28, "cached": 2, "used": 0, "live": 0}
    s2 = f["s2"]
    assert s2["cached"] == 8 and s2["restore"] is not None and s2["table"][:2] == s1["table"][:2]
    assert f["shared_refs"] == [3, 3] and f["after_a"] == [2, 2]
    assert f["after_b"] == {"free": 5, "cached": 2, "used": 0}
    assert f["after_evict"] == {"evicted": 2, "free": 7}


def test_kvpool_tour_prints_the_tables() -> None:
    env = dict(os.environ, COLUMNS="120")
    for cmd in (
        [sys.executable, "-m", "kvpool", "tour"],
        [sys.executable, str(ROOT / "examples" / "tour.py")],
    ):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
        assert p.returncode == 0, p.stderr
        out = p.stdout
        for needle in (
            "ceil(11/4) = 3 blocks, 1 empty slot",
            "ceil(11/8) = 2 blocks, 5 empty slot",
            "len(B) = 5",
            "can_append(B)",
            "may_append(B)",
            "True: one id added",
            "free 15 of 15",
            "prefix match 8 tokens",
            "ref counts [3, 3]",
            "free 7 of 7",
            "internal fragmentation",
        ):
            assert needle in out, needle
        # the block tables as printed: A 3 ids then 2 ids; B 1 id, then 2 after may_append
        assert re.search(r"A \[\d+ \d+ \d+\], free 12", out) and re.search(
            r"A \[\d+ \d+\], free 13", out
        )
        assert re.search(r"B \[\d+\] \(no slot for it yet\)", out) and re.search(
            r"B \[\d+ \d+\], free 10", out
        )
