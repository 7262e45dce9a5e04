"""``kvpool tour``: two scenarios replayed on the real library, step by step.

1. Paged KV, as nano-vllm's ``BlockManager`` tutorial tells it: block size 4; a request of 11
   tokens takes ``ceil(11 / 4) = 3`` blocks and leaves 1 empty slot; a full one-block request
   appends its 5th token: ``can_append`` checks, ``may_append`` adds one id; releasing both
   restores the free list; then block size 8 beside it, and why the internal fragmentation
   changes.
2. A request's life in xLLM's ``BlockManagerPool`` design: allocate (dp rank, single block, live
   slot, prefix match, new blocks), the worker's block table and slots, the forward, deallocate
   (cache, release, single block and slot back, the partial block to the free list), a second
   request hitting the prefix, and the reference counts falling until an id is free again.

Every number printed is read from the library as the calls run (nothing is hard-coded);
:func:`paged_blocks` and :func:`request_life` return them as ``(rows, facts)`` for tests.
"""

from __future__ import annotations

from typing import Any

import kvpool

__all__ = ["main", "paged_blocks", "request_life"]

Row = tuple[str, str, str]


def _ids(table: Any) -> str:
    return "[" + " ".join(str(int(x)) for x in table) + "]"


def _request(pool: kvpool.BlockManagerPool, block_size: int) -> dict[str, Any]:
    """The paged-blocks experiment at one block size: numbers, and the rows that show them."""
    rows: list[Row] = []
    total = pool.stats()["num_total_blocks"]

    def free() -> int:
        return int(pool.stats()["num_free_blocks"])

    rows.append(("start", f"{total} usable ids (id 0 is padding)", f"free {free()}"))
    a = kvpool.Sequence(list(range(100, 111)), seq_id=1)
    ok = pool.allocate(a)
    a_blocks = int(a.num_blocks)
    slots = a_blocks * block_size
    a_table = [int(x) for x in a.block_table]
    rows.append(
        (
            f"allocate(A): {len(a)} tokens",
            f"{ok}: ceil({len(a)}/{block_size}) = {a.num_blocks} blocks, "
            f"{slots - len(a)} empty slot(s) in the last",
            f"A {_ids(a.block_table)}, free {free()}",
        )
    )
    b = kvpool.Sequence([200, 201, 202, 203], seq_id=2)  # one full block at block size 4
    pool.allocate(b)
    b.num_computed_tokens = len(b)
    rows.append(
        (
            f"allocate(B): {len(b)} tokens",
            f"{b.num_blocks} block, {b.num_blocks * block_size - len(b)} empty",
            f"B {_ids(b.block_table)}, free {free()}",
        )
    )
    b.append_token(299)
    before = b.num_blocks
    rows.append(
        (
            "B.append_token(t)",
            f"len(B) = {len(b)}: the 5th token is appended first (R16)",
            f"B {_ids(b.block_table)} (no slot for it yet)"
            if len(b) > before * block_size
            else f"B {_ids(b.block_table)} (its block has room)",
        )
    )
    can = pool.can_append(b)
    rows.append(
        (
            "can_append(B)",
            f"{can}: the table must hold {len(b)} tokens; "
            + (
                "1 more block, and the free list has one"
                if len(b) > before * block_size
                else "it does already"
            )
            + " (a check, nothing changes)",
            f"free {free()}",
        )
    )
    may = pool.may_append(b)
    added = b.num_blocks - before
    rows.append(
        (
            "may_append(B)",
            f"{may}: {'one id added' if added == 1 else f'{added} ids added'}",
            f"B {_ids(b.block_table)}, free {free()}",
        )
    )
    pool.deallocate(a)
    pool.deallocate(b)
    rows.append(
        (
            "deallocate(A), deallocate(B)",
            "every id back on the free list",
            f"free {free()} of {total}",
        )
    )
    return {
        "rows": rows,
        "a_blocks": a_blocks,
        "a_empty": slots - 11,
        "a_table": a_table,
        "b_added": added,
        "can_append": can,
        "may_append": may,
        "b_len": len(b),
        "free_after": free(),
        "total": total,
    }


def paged_blocks() -> tuple[dict[int, list[Row]], dict[int, Any]]:
    """Paged blocks at block sizes 4 and 8 (prefix cache off, as in nano-vllm's tutorial)."""
    out: dict[int, list[Row]] = {}
    facts: dict[int, Any] = {}
    for bs in (4, 8):
        r = _request(kvpool.BlockManagerPool(16, bs, enable_prefix_cache=False), bs)
        out[bs] = r.pop("rows")
        facts[bs] = r
    return out, facts


def request_life() -> tuple[list[Row], list[Row], dict[str, Any]]:
    """A request's life in the pool (xLLM's design), then the reference counts of shared blocks."""
    bs = 4
    pool = kvpool.BlockManagerPool(16, bs, dp_size=2, linear_state_slots=4)
    facts: dict[str, Any] = {}
    rows: list[Row] = []

    def counts() -> str:
        st = pool.stats()
        return (
            f"free {st['num_free_blocks']}, cached {st['num_cached_blocks']}, "
            f"used {st['num_used_blocks']} (2 ranks); live slots {st['num_live_slots']}"
        )

    s1 = kvpool.Sequence(list(range(10)), seq_id=1)
    rows.append(("request 1 enters", f"Sequence: {len(s1)} tokens, no blocks yet", counts()))
    pool.allocate(s1)
    facts["s1"] = {
        "dp_rank": s1.dp_rank,
        "single_block": s1.single_block_id,
        "live_slot": s1.linear_state_slot,
        "cached": s1.num_cached_tokens,
        "table": [int(x) for x in s1.block_table],
    }
    rows.append(
        (
            "allocate(request 1)",
            f"dp rank {s1.dp_rank} (most available blocks, lowest on ties); single "
            f"block {s1.single_block_id}; live slot {s1.linear_state_slot}; prefix match "
            f"{s1.num_cached_tokens} tokens; {s1.num_blocks} new blocks",
            f"table {_ids(s1.block_table)}",
        )
    )
    slots = pool.slot_mapping([s1])
    rows.append(
        (
            "worker: block_tables, slot_mapping",
            f"slot = id x {bs} + position % {bs}",
            f"{_ids(pool.block_tables([s1])[0])}; slots {_ids(slots)}",
        )
    )
    facts["slots"] = [int(x) for x in slots]
    s1.num_computed_tokens = 8
    pool.cache(s1)
    plan = pool.take_linear_state_plan()
    facts["checkpoint_saves"] = len(plan.save_src)
    pool.commit_linear_state_plan(plan)
    s1.num_computed_tokens = 10
    pool.cache(s1)
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    rows.append(
        (
            "the forward: tokens 0-8, then 8-10",
            f"computed 10; cache() published 2 full blocks; the "
            f"recurrent state saved {facts['checkpoint_saves']} checkpoint at token 8",
            counts(),
        )
    )
    pool.deallocate(s1)
    st = pool.stats()
    facts["after_release"] = {
        "free": st["num_free_blocks"],
        "cached": st["num_cached_blocks"],
        "used": st["num_used_blocks"],
        "live": st["num_live_slots"],
    }
    rows.append(
        (
            "deallocate(request 1)",
            "cache() -> prefix cache; used falls to 0; single block and live slot "
            "back; the partial block 3 has no cache entry: ref count 0, back on the free list",
            counts(),
        )
    )
    s2 = kvpool.Sequence(list(range(8)) + [50, 51, 52], seq_id=2)
    pool.allocate(s2)
    facts["s2"] = {
        "dp_rank": s2.dp_rank,
        "cached": s2.num_cached_tokens,
        "restore": s2.linear_state_restore_slot,
        "table": [int(x) for x in s2.block_table],
    }
    rows.append(
        (
            "allocate(request 2): shares 8 tokens",
            f"dp rank {s2.dp_rank}; prefix match "
            f"{s2.num_cached_tokens} tokens (blocks 1, 2: no recompute); state restored from "
            f"checkpoint slot {s2.linear_state_restore_slot}; "
            f"{s2.num_blocks - s2.num_cached_tokens // bs} new block",
            f"table {_ids(s2.block_table)}",
        )
    )
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    s2.num_computed_tokens = len(s2)
    pool.deallocate(s2)
    pool.check()

    # the reference counts behind it, on the physical allocator (R4, R5)
    bm = kvpool.BlockManager(8, bs)
    toks = list(range(8))
    ref: list[Row] = []
    a = bm.allocate(2)
    ref.append(
        (
            "A = allocate(2)",
            f"ids {[int(x) for x in a]}: ref counts {[x.ref_count for x in a]}",
            f"free {bm.num_free_blocks}, used {bm.num_used_blocks}",
        )
    )
    bm.cache(toks, a)
    ref.append(
        (
            "cache(tokens, A)",
            f"the prefix cache takes a handle: {[x.ref_count for x in a]}",
            f"cached {bm.num_cached_blocks}, used {bm.num_used_blocks}",
        )
    )
    b = bm.allocate_shared(toks)
    facts["shared_refs"] = [x.ref_count for x in b]
    ref.append(
        (
            "B = allocate_shared(tokens)",
            f"a hit: the same ids {[int(x) for x in b]}, ref counts {facts['shared_refs']}",
            f"used {bm.num_used_blocks}",
        )
    )
    bm.deallocate(a)
    facts["after_a"] = [x.ref_count for x in b]
    ref.append(
        (
            "deallocate(A)",
            f"{facts['after_a']}: B still uses them, nothing is freed",
            f"free {bm.num_free_blocks}, used {bm.num_used_blocks}",
        )
    )
    bm.deallocate(b)
    facts["after_b"] = {
        "free": bm.num_free_blocks,
        "cached": bm.num_cached_blocks,
        "used": bm.num_used_blocks,
    }
    ref.append(
        (
            "deallocate(B)",
            "only the prefix cache holds them (ref 1): cached, evictable, not free",
            f"free {bm.num_free_blocks}, cached {bm.num_cached_blocks}, used {bm.num_used_blocks}",
        )
    )
    evicted = bm.evict(2)
    facts["after_evict"] = {"evicted": evicted, "free": bm.num_free_blocks}
    ref.append(
        (
            f"evict({evicted})",
            "the cache drops its handles: ref 0, the ids are back on the free list",
            f"free {bm.num_free_blocks} of {bm.num_total_blocks}",
        )
    )
    bm.check()
    return rows, ref, facts


def _table(title: str, rows: list[Row], columns: tuple[str, str, str]) -> Any:
    from rich.table import Table

    t = Table(title=title, title_justify="left", show_lines=True)
    t.add_column(columns[0], style="bold")
    t.add_column(columns[1])
    t.add_column(columns[2], style="cyan")
    for r in rows:
        t.add_row(*r)
    return t


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    if argv:
        print("usage: kvpool tour   (no options: prints the two scenarios)")
        return 0 if argv[0] in ("-h", "--help") else 2
    console = Console()
    tables, facts = paged_blocks()
    console.rule(
        "[bold]Paged KV blocks, after nano-vllm's tutorial (BlockManagerPool, prefix cache off)"
    )
    console.print(_table("block size 4", tables[4], ("call", "what the library says", "state")))
    f4, f8 = facts[4], facts[8]
    console.print(
        _table(
            "block size 8, the same calls", tables[8], ("call", "what the library says", "state")
        )
    )
    from rich.table import Table

    cmp = Table(title="why the internal fragmentation changes", title_justify="left")
    for c in ("block size", "A: blocks", "A: empty slots", "B's 5th token", "free after release"):
        cmp.add_column(c, justify="right")
    for bs, f in ((4, f4), (8, f8)):
        cmp.add_row(
            str(bs),
            str(f["a_blocks"]),
            str(f["a_empty"]),
            "a new block (+1 id)" if f["b_added"] else "fits its block",
            f"{f['free_after']} / {f['total']}",
        )
    console.print(cmp)
    console.print(
        "The empty slots are internal fragmentation: ceil(L / block_size) * block_size - L, always "
        "less than one block and only in a request's last block. Bigger blocks waste more of it "
        f"({f4['a_empty']} slot at 4, {f8['a_empty']} at 8 for 11 tokens) and share prefixes only "
        "in whole blocks; smaller ones mean longer block tables and more appends that need a new "
        "id. The table maps logical pages to any physical ids: they need not be contiguous.\n"
    )
    rows, ref, _ = request_life()
    console.rule(
        "[bold]A request's life in BlockManagerPool, after xLLM's design (2 dp ranks, linear state)"
    )
    console.print(
        _table(
            "allocate -> forward -> deallocate -> a prefix hit",
            rows,
            ("step", "what happens", "state"),
        )
    )
    console.print(
        _table(
            "reference counts (BlockManager, the physical level)",
            ref,
            ("call", "ref counts", "state"),
        )
    )
    console.print(
        "deallocate != free: an id returns to the free list only when its last handle goes, and "
        "the prefix cache holds one until eviction (R4, R5). "
        "Next: docs/simulate.md, `kvpool simulate`."
    )
    return 0
