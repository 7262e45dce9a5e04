"""The pool on elastic pages (issue 17, ``BlockManagerPool(..., xtensor={...})``, the seed's
``enable_xtensor``): every dp rank's full-attention blocks on an XTensorBlockManager.

Random workloads through the pool, with the batch API, dp ranks, the prefix cache, events and
memory-limit changes under load, calling ``check()`` after every step and asserting the page
rules from the outside: every block a sequence holds lies on a mapped page, the mapped pages are
page 0, the pages with a used or cached block and the spares (exactly, once the cache is empty),
the limit holds unless sequences hold the excess, and every id comes back at the end (R1-R5,
R13-R20, R29)."""

from __future__ import annotations

import random

import kvpool
import pytest

BS = 4
MIB = 1 << 20


def _pool(num_blocks=96, dp_size=2, bpp=4, spare=1, limit=None, **options):
    xtensor = {"blocks_per_page": bpp, "page_bytes": MIB, "spare_pages": spare, "memory_limit": limit}
    return kvpool.BlockManagerPool(num_blocks, BS, dp_size=dp_size, xtensor=xtensor, **options)


def _used_pages(live, rank, bpp):
    pages = {0}
    for seq in live:
        if seq.dp_rank == rank:
            pages |= {int(b) // bpp for b in seq.block_table}
    return pages


def _check_pages(pool, live, bpp, spare, cache_empty=False):
    """The page rules, seen from the outside, after pool.check() (which walks them inside)."""
    pool.check()
    stats = pool.stats()
    total = 0
    for rank in range(pool.dp_size):
        x = stats["ranks"][rank]["xtensor"]
        mapped = set(pool.mapped_page_ids(rank))
        used = _used_pages(live, rank, bpp)
        assert x["mapped_pages"] == len(mapped) and x["mapped_bytes"] == len(mapped) * MIB
        assert used <= mapped, f"rank {rank}: a held block lies on an unmapped page"
        assert len(mapped) >= len(used) + x["spare_pages"]
        if x["mapped_pages"] > x["limit_pages"]:
            assert x["spare_pages"] == 0, "over the limit no spare is kept"
        else:
            assert x["spare_pages"] <= 2 * spare
        if cache_empty or not pool.enable_prefix_cache:
            assert len(mapped) == len(used) + x["spare_pages"], "mapped = held pages + spares"
        total += x["mapped_bytes"]
    assert stats["xtensor"]["mapped_bytes"] == total
    assert stats["xtensor"]["mapped_pages"] == sum(r["xtensor"]["mapped_pages"] for r in stats["ranks"])


def _prompt(rng):
    prefix = [rng.randrange(3)] * (BS * rng.randrange(0, 4))  # a few shared prefixes: cache hits
    return prefix + [rng.randrange(100, 10_000) for _ in range(rng.randrange(1, 13))]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cache", [True, False])
def test_random_workload_keeps_the_page_rules(seed, cache):
    """R1-R5, R13-R18 with page mapping: allocate, batch advance, may_append_all, deallocate and
    limit changes under load, check() after every step; every id back at the end."""
    rng = random.Random(seed)
    bpp, spare = rng.choice([(1, 0), (4, 1), (8, 2)])
    pool = _pool(bpp=bpp, spare=spare, enable_prefix_cache=cache, enable_events=seed % 2 == 0)
    running = kvpool.SequenceBatch()
    live = []
    for _ in range(160):
        action = rng.random()
        if action < 0.35:
            seq = kvpool.Sequence(_prompt(rng))
            can = pool.can_allocate(seq)
            assert pool.allocate(seq) == can, "can_allocate predicts allocate (R15)"
            if can:
                seq.num_computed_tokens = len(seq)
                pool.cache(seq)
                live.append(seq)
                running.add(seq)
        elif action < 0.7 and live:
            failed = pool.advance(running, [rng.randrange(10_000) for _ in running], lookahead=0)
            for i in reversed(failed):
                seq = running[i]
                running.remove(seq)
                live.remove(seq)
                pool.deallocate(seq)
        elif action < 0.8 and live:
            missed = pool.may_append_all(running, lookahead=rng.randrange(0, 6))
            assert all(0 <= i < len(running) for i in missed)
        elif action < 0.92 and live:
            seq = live.pop(rng.randrange(len(live)))
            running.remove(seq)
            pool.deallocate(seq)
        else:
            limit = rng.choice([None, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB])
            before = pool.stats()
            reports = pool.set_memory_limit(limit)
            assert len(reports) == pool.dp_size
            for rank, report in enumerate(reports):
                x = before["ranks"][rank]["xtensor"]
                assert report["held_pages"] <= report["mapped_pages"]
                assert report["excess_bytes"] == max(0, report["mapped_pages"] - report["limit_pages"]) * MIB
                assert report["mapped_pages"] <= x["mapped_pages"] or report["mapped_new_pages"] > 0
        _check_pages(pool, live, bpp, spare)
        pool.drain_events()
    for seq in live:
        pool.deallocate(seq)
    pool.reset_prefix_cache()
    _check_pages(pool, [], bpp, spare, cache_empty=True)
    for rank in pool.stats()["ranks"]:
        assert rank["num_free_blocks"] == rank["num_total_blocks"], "every id came back (R2, R4)"
        assert rank["xtensor"]["mapped_pages"] == 1 + rank["xtensor"]["spare_pages"]


def test_rank_choice_counts_what_the_limit_allows():
    """R13: a new sequence goes to the rank with the most available blocks, and a rank's
    available blocks count only the unmapped pages its limit allows."""
    pool = _pool(num_blocks=64, dp_size=2, bpp=4, spare=0)
    pool.set_memory_limit(2 * MIB, dp_rank=0)  # rank 0: page 0 and one more page
    assert pool.stats()["ranks"][0]["num_free_blocks"] == 63, "free counts every id (R2)"
    seq = kvpool.Sequence(list(range(4 * BS)))
    assert pool.allocate(seq) and seq.dp_rank == 1, "rank 0's limit leaves it fewer blocks"
    small = _pool(num_blocks=64, dp_size=1, bpp=4, spare=0, limit=2 * MIB)
    big = kvpool.Sequence(list(range(8 * BS)))  # 8 blocks: page 0 gives 3, page 1 gives 4
    assert not small.can_allocate(big) and not small.allocate(big)
    fits = kvpool.Sequence(list(range(7 * BS)))
    assert small.can_allocate(fits) and small.allocate(fits)
    assert small.stats()["xtensor"]["mapped_pages"] == 2
    assert not small.can_append(fits, 1), "no page past the limit (R16)"
    small.set_memory_limit(3 * MIB)
    assert small.can_append(fits, 1) and small.may_append(fits, 1)
    small.check()


def test_lowering_the_limit_under_load_returns_memory_as_sequences_finish():
    pool = _pool(num_blocks=128, dp_size=1, bpp=4, spare=1, enable_prefix_cache=True)
    seqs = [kvpool.Sequence([i * 1000 + t for t in range(4 * BS)]) for i in range(6)]
    for seq in seqs:
        assert pool.allocate(seq)
        seq.num_computed_tokens = len(seq)
        pool.cache(seq)
    held = pool.stats()["xtensor"]["mapped_pages"]
    [report] = pool.set_memory_limit(2 * MIB)
    assert report["excess_bytes"] > 0 and report["held_pages"] == held - report["unmapped_pages"]
    pool.check()
    for i, seq in enumerate(seqs):
        pool.deallocate(seq)  # its blocks become cached; the pool reclaims toward the limit
        pool.check()
        x = pool.stats()["xtensor"]
        assert x["mapped_pages"] <= max(2, held - i), "memory comes back as sequences release it"
    assert pool.stats()["xtensor"]["mapped_pages"] <= 2
    assert pool.stats()["num_evictions"] > 0, "cached blocks were evicted page by page"
    [report] = pool.set_memory_limit(None)
    assert report["excess_bytes"] == 0 and report["mapped_new_pages"] == 1, "a spare again"
    pool.check()


def test_prefix_cache_hits_on_elastic_pages_and_events():
    pool = _pool(num_blocks=64, dp_size=1, enable_events=True)
    first = kvpool.Sequence(list(range(8 * BS + 1)))  # blocks 1..8 on pages 0, 1, 2
    assert pool.allocate(first)
    first.num_computed_tokens = len(first)
    pool.deallocate(first)
    stored = [e for e in pool.drain_events() if e.kind == "stored"]
    assert stored, "publication is an event (R21)"
    second = kvpool.Sequence(list(range(8 * BS + 1)))
    assert pool.allocate(second) and second.num_cached_tokens == 8 * BS
    pool.deallocate(second)
    [report] = pool.set_memory_limit(MIB)  # page 0 only: the cached blocks past it are evicted
    assert report["evicted_blocks"] == 5 and report["mapped_pages"] == 1
    removed = [e for e in pool.drain_events() if e.kind == "removed"]
    assert removed, "evictions the limit forces are events (R21)"
    assert pool.stats()["xtensor"]["mapped_pages"] == 1
    pool.check()


def test_options_are_validated_by_name():
    """R29: every bad option names itself and builds nothing."""
    with pytest.raises(TypeError, match="xtensor"):
        kvpool.BlockManagerPool(16, BS, xtensor=4)
    with pytest.raises(TypeError, match="blocks_per_page"):
        kvpool.BlockManagerPool(16, BS, xtensor={})
    with pytest.raises(TypeError, match="unexpected key"):
        kvpool.BlockManagerPool(16, BS, xtensor={"blocks_per_page": 4, "pages": 2})
    with pytest.raises(ValueError, match="xtensor.blocks_per_page"):
        kvpool.BlockManagerPool(16, BS, xtensor={"blocks_per_page": 0})
    with pytest.raises(ValueError, match="xtensor.page_bytes"):
        kvpool.BlockManagerPool(16, BS, xtensor={"blocks_per_page": 4, "page_bytes": 0})
    with pytest.raises(ValueError, match="xtensor.spare_pages"):
        kvpool.BlockManagerPool(16, BS, xtensor={"blocks_per_page": 4, "spare_pages": 5})
    with pytest.raises(ValueError, match="xtensor.memory_limit"):
        kvpool.BlockManagerPool(16, BS, xtensor={"blocks_per_page": 4, "memory_limit": -1})
    with pytest.raises(ValueError, match="xtensor.backend"):
        kvpool.BlockManagerPool(16, BS, xtensor={"blocks_per_page": 4, "backend": "gpu"})
    with pytest.raises(TypeError, match="xtensor"):
        kvpool.HierarchyBlockManagerPool(16, 8, BS, xtensor={"blocks_per_page": 4})
    plain = kvpool.BlockManagerPool(16, BS)
    assert plain.xtensor is None and plain.stats()["xtensor"] is None and plain.mapped_page_ids() == []
    with pytest.raises(ValueError, match="limit"):
        plain.set_memory_limit(MIB)
    pool = _pool(num_blocks=16, dp_size=2)
    assert pool.xtensor == {"blocks_per_page": 4, "page_bytes": MIB, "spare_pages": 1, "memory_limit": None,
                            "backend": "accounting"}
    with pytest.raises(ValueError, match="dp_rank"):
        pool.set_memory_limit(MIB, dp_rank=2)
    with pytest.raises(ValueError, match="limit"):
        pool.set_memory_limit(-1)
    with pytest.raises(ValueError, match="dp_rank"):
        pool.mapped_page_ids(2)
    assert pool.stats()["xtensor"]["limit_pages"] == 8, "nothing changed"


def test_host_backend_resident_memory_follows_the_pool():
    """The host backend through the pool: page memory is committed on use (backend 'host')."""
    pool = kvpool.BlockManagerPool(
        256, BS, xtensor={"blocks_per_page": 16, "page_bytes": 4 * MIB, "spare_pages": 0, "backend": "host"}
    )
    seqs = [kvpool.Sequence([i * 10_000 + t for t in range(16 * BS)]) for i in range(8)]
    for seq in seqs:
        assert pool.allocate(seq)
    assert pool.stats()["xtensor"]["mapped_pages"] >= 8
    for seq in seqs:
        pool.deallocate(seq)
    pool.reset_prefix_cache()
    assert pool.stats()["xtensor"]["mapped_pages"] == 1
    pool.check()
