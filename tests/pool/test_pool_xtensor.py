"""The pool on elastic pages (``BlockManagerPool(..., xtensor={...})``, xLLM's
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
    xtensor = {
        "blocks_per_page": bpp,
        "page_bytes": MIB,
        "spare_pages": spare,
        "memory_limit": limit,
    }
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
    assert stats["xtensor"]["mapped_pages"] == sum(
        r["xtensor"]["mapped_pages"] for r in stats["ranks"]
    )


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
                assert (
                    report["excess_bytes"]
                    == max(0, report["mapped_pages"] - report["limit_pages"]) * MIB
                )
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
    assert (
        plain.xtensor is None and plain.stats()["xtensor"] is None and plain.mapped_page_ids() == []
    )
    with pytest.raises(ValueError, match="limit"):
        plain.set_memory_limit(MIB)
    pool = _pool(num_blocks=16, dp_size=2)
    assert pool.xtensor == {
        "blocks_per_page": 4,
        "page_bytes": MIB,
        "spare_pages": 1,
        "memory_limit": None,
        "backend": "accounting",
    }
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
        256,
        BS,
        xtensor={"blocks_per_page": 16, "page_bytes": 4 * MIB, "spare_pages": 0, "backend": "host"},
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


# --- page backend objects, one per dp rank (kvpool.xtensor.CudaPageBackend's protocol) ----------


class PageBook:
    """A Python page backend: records the mapped set, refuses maps past `capacity` (MemoryError),
    raises on demand, and can call back into its pool (which must be refused)."""

    def __init__(self, num_pages, capacity=None):
        self.num_pages = num_pages
        self.page_bytes = MIB
        self.capacity = capacity
        self.mapped = set()
        self.fail = False
        self.pool = None

    def map_page(self, page):
        if self.pool is not None:
            self.pool.stats()  # re-entry: RuntimeError
        if self.fail:
            raise KeyError("driver gone")
        assert page not in self.mapped, f"page {page} mapped twice"
        if self.capacity is not None and len(self.mapped) >= self.capacity:
            raise MemoryError("device full")
        self.mapped.add(page)

    def unmap_page(self, page):
        assert page in self.mapped and page != 0
        self.mapped.remove(page)


def _book_pool(books, num_blocks=96, bpp=4, **options):
    xtensor = {"blocks_per_page": bpp, "spare_pages": 1, "backend": books}
    return kvpool.BlockManagerPool(num_blocks, BS, dp_size=len(books), xtensor=xtensor, **options)


@pytest.mark.parametrize("seed", range(3))
def test_backend_objects_see_exactly_the_mapped_pages(seed):
    rng = random.Random(seed)
    books = [PageBook(24), PageBook(24)]
    pool = _book_pool(books)
    assert pool.xtensor["backend"] == "custom" and pool.xtensor["page_bytes"] == MIB, (
        "page_bytes from the backends"
    )
    running = kvpool.SequenceBatch()
    live = []
    for _ in range(120):
        if rng.random() < 0.4:
            seq = kvpool.Sequence(_prompt(rng))
            if pool.allocate(seq):
                seq.num_computed_tokens = len(seq)
                live.append(seq)
                running.add(seq)
        elif rng.random() < 0.6 and live:
            for i in reversed(
                pool.advance(running, [rng.randrange(10_000) for _ in running], lookahead=0)
            ):
                seq = running[i]
                running.remove(seq)
                live.remove(seq)
                pool.deallocate(seq)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            running.remove(seq)
            pool.deallocate(seq)
        if rng.random() < 0.05:
            pool.set_memory_limit(rng.choice([None, 3 * MIB, 6 * MIB]))
        _check_pages(pool, live, 4, 1)
        for rank, book in enumerate(books):
            assert book.mapped == set(pool.mapped_page_ids(rank)), "the backend and the pool agree"
    for seq in live:
        pool.deallocate(seq)
    pool.reset_prefix_cache()
    for rank, book in enumerate(books):
        assert book.mapped == set(pool.mapped_page_ids(rank)) and 0 in book.mapped
        assert 2 <= len(book.mapped) <= 3, "page 0 and the spare band (1..2) only"


def test_a_refused_map_fails_the_allocation_and_changes_nothing():
    book = PageBook(24, capacity=3)  # page 0, one spare, one more
    pool = _book_pool([book], enable_prefix_cache=False)
    fits = kvpool.Sequence(list(range(11 * BS)))  # 11 blocks: pages 0 (3), 1 (4), 2 (4)
    assert pool.allocate(fits)
    big = kvpool.Sequence(list(range(1000, 1000 + 4 * BS)))
    before = pool.stats()
    assert pool.can_allocate(big), "the pool counts what the limit allows, not what the device has"
    assert not pool.allocate(big), "the device refused the page: no room, nothing changed"
    assert pool.stats()["num_free_blocks"] == before["num_free_blocks"] and not big.is_allocated
    assert pool.stats()["xtensor"]["num_map_failures"] > before["xtensor"]["num_map_failures"]
    pool.check()
    pool.deallocate(fits)
    assert pool.allocate(big), "memory came back"
    pool.check()


def test_backend_exceptions_propagate_and_reentry_is_refused():
    book = PageBook(24)
    pool = _book_pool([book], enable_prefix_cache=False)
    book.fail = True
    with pytest.raises(KeyError, match="driver gone"):
        pool.allocate(kvpool.Sequence(list(range(12 * BS))))
    book.fail = False
    pool.check()
    book.pool = pool
    with pytest.raises(RuntimeError, match="must not call its pool"):
        pool.allocate(kvpool.Sequence(list(range(12 * BS))))
    book.pool = None
    seq = kvpool.Sequence(list(range(12 * BS)))
    assert pool.allocate(seq) and book.mapped == set(pool.mapped_page_ids())
    pool.check()


def test_backend_objects_are_validated_by_name():
    with pytest.raises(ValueError, match="one backend object per dp rank"):
        kvpool.BlockManagerPool(
            16, BS, dp_size=2, xtensor={"blocks_per_page": 4, "backend": [PageBook(24)]}
        )
    with pytest.raises(TypeError, match="map_page"):
        kvpool.BlockManagerPool(16, BS, xtensor={"blocks_per_page": 4, "backend": [object()]})
    small = PageBook(2)
    with pytest.raises(ValueError, match="holds 2 pages"):
        kvpool.BlockManagerPool(16, BS, xtensor={"blocks_per_page": 4, "backend": small})
    odd = PageBook(24)
    odd.blocks_per_page = 8
    with pytest.raises(ValueError, match="xtensor.blocks_per_page"):
        kvpool.BlockManagerPool(16, BS, xtensor={"blocks_per_page": 4, "backend": odd})
    with pytest.raises(ValueError, match="xtensor.page_bytes"):
        kvpool.BlockManagerPool(
            16, BS, xtensor={"blocks_per_page": 4, "page_bytes": 2 * MIB, "backend": PageBook(24)}
        )
    one = PageBook(24)
    kvpool.BlockManagerPool(16, BS, xtensor={"blocks_per_page": 4, "backend": one}).check()
    assert one.mapped == {0, 1}, "a single object for one rank"


def test_threads_share_a_pool_with_backend_objects():
    """A backend runs under the pool's lock and needs the GIL: every wait for the lock releases
    the GIL, so threads calling the pool (some holding the GIL) never deadlock (R27, R28)."""
    import threading

    books = [PageBook(64), PageBook(64)]
    pool = _book_pool(books, num_blocks=256)
    errors = []

    def work(salt):
        try:
            rng = random.Random(salt)
            for _ in range(150):
                seq = kvpool.Sequence(
                    [salt * 100_000 + rng.randrange(50_000) for _ in range(rng.randrange(1, 40))]
                )
                if pool.allocate(seq):
                    pool.stats()
                    pool.deallocate(seq)
                pool.mapped_page_ids(salt % 2)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors
    pool.check()
    for rank, book in enumerate(books):
        assert book.mapped == set(pool.mapped_page_ids(rank))
