"""Elastic pages (XTensorBlockManager, BlockManagerPool(xtensor=...)) under a page backend that
refuses maps (MemoryError) or fails (any other exception), with handles and sequences dropped
without deallocate and dedup switches feeding the inbox (G3, C6; docs/xtensor.md, "A failing
backend").

* G3: a call that fails after draining the released blocks (try_reserve False; may_append or
  allocate refused by the device) still settles the pages: check() holds after it.
* C6: a backend error is raised only by a call that has done nothing of its own: a failed unmap
  met while settling after a call's work is deferred; the next call that may map, evict or
  allocate retries it first and raises, evicting and allocating nothing, while it still fails.
* Random workloads over both, check() after every step, can_* predicting the action (but for a
  map the device refused during that very call), every id back at the end.
"""

from __future__ import annotations

import gc
import random

import kvpool
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

KIB = 1024


class Book:
    """A page backend object: records the mapped set; `refuse` makes map_page raise MemoryError
    ("no memory now"), `refuse_rate` does so at random; `fail_unmap` makes unmap_page raise."""

    def __init__(self, rng=None, refuse_rate=0.0):
        self.mapped: set[int] = set()
        self.refuse = False
        self.refuse_rate = refuse_rate
        self.rng = rng or random.Random(0)
        self.fail_unmap = False
        self.fail_map = False
        self.refusals = 0

    def map_page(self, page):
        assert page not in self.mapped, f"page {page} mapped twice"
        if self.fail_map:
            raise KeyError(f"driver: map of page {page} failed")
        if self.refuse or (self.refuse_rate and self.rng.random() < self.refuse_rate):
            self.refusals += 1
            raise MemoryError("no memory now")
        self.mapped.add(page)

    def unmap_page(self, page):
        assert page in self.mapped and page != 0, f"page {page} unmapped while not mapped"
        if self.fail_unmap:
            raise RuntimeError(f"driver: unmap of page {page} failed")
        self.mapped.remove(page)


def _pool(num_blocks, books, spare_pages=0, bpp=1, **options):
    xtensor = dict(blocks_per_page=bpp, page_bytes=KIB, spare_pages=spare_pages, backend=books)
    return kvpool.BlockManagerPool(num_blocks, 1, dp_size=len(books), xtensor=xtensor, **options)


def _agree(pool, books):
    pool.check()
    for rank, book in enumerate(books):
        assert book.mapped == set(pool.mapped_page_ids(rank)), "the backend and the pool agree"


# --- G3: a failed call settles the pages it drained ----------------------------------------------


def test_g3_failed_try_reserve_settles_dropped_handles_over_the_limit():
    m = kvpool.XTensorBlockManager(19, 1, blocks_per_page=1, page_bytes=KIB, spare_pages=2)
    held = m.allocate(2)
    m.set_memory_limit(0)
    assert m.mapped_pages == 3, "held blocks stay mapped over the limit"
    del held
    gc.collect()  # dropped without deallocate: the ids wait in the inbox
    assert not m.try_reserve(8)
    assert m.mapped_page_ids() == [0], "the emptied pages unmapped by the failed call"
    assert m.reserved_blocks == 0
    m.check()


def test_g3_may_append_refused_by_the_device_settles_a_dropped_sequence():
    book = Book()
    pool = _pool(12, [book])
    a = kvpool.Sequence([1, 2])
    s = kvpool.Sequence([5])
    assert pool.allocate(a) and pool.allocate(s)
    del a
    gc.collect()
    book.refuse = True
    s.append_token(3)
    assert pool.can_append(s, 2), "the pool counts what the limit allows"
    assert not pool.may_append(s, 2), "the device refused: no room, nothing changed"
    assert s.block_ids() == [3]
    assert pool.mapped_page_ids() == [0, 3], "the dropped sequence's pages unmapped"
    _agree(pool, [book])
    book.refuse = False
    assert pool.may_append(s, 2)
    _agree(pool, [book])


def test_g3_dedup_switch_then_refused_may_append_settles():
    book = Book()
    pool = _pool(8, [book])
    seqs = []
    for prompt in ([1, 0, 2], [1], [1, 0]):
        seq = kvpool.Sequence(prompt)
        assert pool.allocate(seq)
        seq.num_computed_tokens = len(seq)
        pool.cache(seq)  # the second and third switch to the first's cached blocks (R9)
        seqs.append(seq)
    assert len(pool.drain_block_switches()) == 2
    book.refuse = True
    seqs[2].append_token(1)
    assert not pool.may_append(seqs[2], 3)
    _agree(pool, [book])
    assert pool.stats()["xtensor"]["spare_pages"] == 0, "spare_pages=0: no empty page kept"


def test_g3_refused_allocate_settles_the_inbox_on_the_manager():
    book = Book()
    m = kvpool.XTensorBlockManager(
        16, 1, blocks_per_page=2, page_bytes=KIB, spare_pages=0, backend=book
    )
    keep = m.allocate(1)
    dropped = m.allocate(4)
    del dropped
    gc.collect()
    book.refuse = True
    with pytest.raises(kvpool.OutOfBlocksError):
        m.allocate(12)
    m.check()
    assert book.mapped == set(m.mapped_page_ids()) == {0}, "only page 0, which holds `keep`"
    m.deallocate(keep)
    m.check()


# --- C6: a failing unmap ----------------------------------------------------------------------------


def test_c6_failed_unmap_is_deferred_then_raised_before_any_eviction():
    book = Book()
    m = kvpool.XTensorBlockManager(
        33, 1, blocks_per_page=2, page_bytes=KIB, spare_pages=0, backend=book
    )
    tokens = list(range(8))
    blocks = m.allocate(8)
    m.cache(tokens, blocks)
    m.deallocate(blocks)
    assert m.num_cached_blocks == 8 and m.mapped_pages == 5
    book.fail_unmap = True
    report = m.set_memory_limit(3 * KIB)  # evicts a page; its unmap fails: deferred, no raise
    assert report["excess_bytes"] > 0 and report["held_pages"] == 0
    cached = m.num_cached_blocks
    m.check()
    for call in (
        lambda: m.allocate(1),
        lambda: m.try_reserve(1),
        lambda: m.evict(1),
        m.trim,
        m.reset_prefix_cache,
        lambda: m.set_memory_limit(None),
    ):
        with pytest.raises(RuntimeError, match="unmap of page"):
            call()
        assert m.num_cached_blocks == cached, "a call that raises evicted nothing"
        assert m.num_used_blocks == 0 and m.reserved_blocks == 0
        assert m.limit_pages == 3
        m.check()
    book.fail_unmap = False
    m.allocate(1)  # retried first, then reclaims toward the limit
    m.check()
    assert m.mapped_pages <= 3 and book.mapped == set(m.mapped_page_ids())


def test_c6_in_the_pool_a_release_never_raises_and_the_next_allocation_raises_first():
    book = Book()
    pool = _pool(16, [book], bpp=2)
    a = kvpool.Sequence(list(range(6)))
    assert pool.allocate(a)
    a.num_computed_tokens = 6
    pool.cache(a)
    book.fail_unmap = True
    pool.deallocate(a)  # releases; the pages stay cached, nothing to unmap yet
    pool.set_memory_limit(2 * KIB)  # evicts a page, its unmap fails: deferred
    _agree(pool, [book])
    cached = pool.num_cached_blocks
    b = kvpool.Sequence(list(range(100, 110)))
    with pytest.raises(RuntimeError, match="unmap of page"):
        pool.allocate(b)
    assert not b.is_allocated and pool.num_cached_blocks == cached, "raised: nothing done"
    _agree(pool, [book])
    book.fail_unmap = False
    c = kvpool.Sequence(list(range(200, 202)))
    assert pool.allocate(c)
    _agree(pool, [book])
    pool.deallocate(c)
    _agree(pool, [book])


def test_c6_the_calls_own_failure_is_raised_though_a_later_one_is_deferred():
    """A map that fails in the allocation's own work is raised (nothing done), even when the
    settling after it meets a failing unmap too (that one is deferred, not raised instead)."""
    book = Book()
    pool = _pool(16, [book])
    a = kvpool.Sequence([1, 2])
    assert pool.allocate(a)
    del a  # dropped: its two pages empty at the next call's drain, beyond spare_pages=0
    book.fail_map = book.fail_unmap = True
    b = kvpool.Sequence(list(range(10, 14)))
    with pytest.raises(KeyError, match="map of page"):
        pool.allocate(b)
    assert not b.is_allocated and pool.num_used_blocks == 0
    _agree(pool, [book])
    book.fail_map = book.fail_unmap = False
    assert pool.allocate(b)
    _agree(pool, [book])


# --- random workloads -------------------------------------------------------------------------------


def _prompt(rng, prefixes):
    base = rng.choice(prefixes)
    return base[: rng.randrange(1, len(base) + 1)] + [
        rng.randrange(500, 600) for _ in range(rng.randrange(0, 3))
    ]


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**32 - 1),
    dp_size=st.sampled_from([1, 2]),
    spare=st.sampled_from([0, 1]),
    bpp=st.sampled_from([1, 2, 3]),
)
def test_pool_random_workload_with_refusals_drops_and_switches(seed, dp_size, spare, bpp):
    rng = random.Random(seed)
    books = [Book(random.Random(seed + r), refuse_rate=0.0) for r in range(dp_size)]
    pool = _pool(24, books, spare_pages=spare, bpp=bpp)
    prefixes = [[rng.randrange(100) for _ in range(6)] for _ in range(3)]
    live: list[kvpool.Sequence] = []
    for _ in range(60):
        seq = batch = None  # no stray reference keeps a dropped sequence alive
        for book in books:
            book.refuse_rate = rng.choice([0.0, 0.0, 0.3, 1.0])
        failures = pool.stats()["xtensor"]["num_map_failures"]
        op = rng.random()
        if op < 0.3:
            seq = kvpool.Sequence(_prompt(rng, prefixes))
            can = pool.can_allocate(seq)
            ok = pool.allocate(seq)
            refused = pool.stats()["xtensor"]["num_map_failures"] > failures
            assert ok == can or (can and not ok and refused), "can_allocate predicts allocate (R15)"
            if ok:
                live.append(seq)
        elif op < 0.5 and live:
            # compute every token and publish: duplicates switch to the cached blocks (R9)
            batch = rng.sample(live, min(len(live), 3))
            for seq in batch:
                seq.num_computed_tokens = len(seq)
                pool.cache(seq)
            pool.drain_block_switches()
        elif op < 0.7 and live:
            seq = rng.choice(live)
            seq.append_token(rng.randrange(600, 700))
            lookahead = rng.randrange(0, 3)
            can = pool.can_append(seq, lookahead)
            ok = pool.may_append(seq, lookahead)
            refused = pool.stats()["xtensor"]["num_map_failures"] > failures
            assert ok == can or (can and not ok and refused), "can_append predicts may_append (R16)"
            if not ok:
                live.remove(seq)
                pool.deallocate(seq)
        elif op < 0.82 and live:
            pool.deallocate(live.pop(rng.randrange(len(live))))
        elif op < 0.94 and live:
            live.pop(rng.randrange(len(live)))  # dropped without deallocate (R4): refcount 0
        else:
            pool.set_memory_limit(rng.choice([None, 4 * KIB, 8 * KIB]))
        _agree(pool, books)
    for book in books:
        book.refuse_rate = 0.0
    for seq in live:
        pool.deallocate(seq)
    live.clear()
    seq = batch = None
    gc.collect()
    pool.reset_prefix_cache()
    pool.set_memory_limit(None)
    _agree(pool, books)
    stats = pool.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_cached_blocks"] == 0
    assert stats["num_free_blocks"] == dp_size * 23, "every id back"
    for book in books:
        assert 1 + spare <= len(book.mapped) <= 1 + 2 * spare, "page 0 and the spare band"


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**32 - 1), spare=st.sampled_from([0, 1, 2]), bpp=st.sampled_from([1, 2, 4])
)
def test_manager_random_workload_with_refusals_and_dropped_handles(seed, spare, bpp):
    rng = random.Random(seed)
    book = Book(random.Random(seed))
    m = kvpool.XTensorBlockManager(
        40, 2, blocks_per_page=bpp, page_bytes=KIB, spare_pages=spare, backend=book
    )
    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]
    held: list[list[kvpool.Block]] = []
    for _ in range(60):
        hit = fresh = blocks = None  # no stray reference keeps dropped handles alive
        book.refuse_rate = rng.choice([0.0, 0.0, 0.3, 1.0])
        failures = m.stats()["num_map_failures"]
        op = rng.random()
        if op < 0.3:
            tokens = _prompt(rng, prefixes)
            hit = m.allocate_shared(tokens)
            n = -(-len(tokens) // 2) - len(hit)
            available = m.num_available_blocks
            try:
                fresh = m.allocate(n)
            except kvpool.OutOfBlocksError:
                refused = m.stats()["num_map_failures"] > failures
                assert n > available or refused, "num_available_blocks predicts allocate (R3)"
                m.deallocate(hit)
            else:
                assert n <= available
                blocks = hit + fresh
                m.cache(tokens, blocks)
                held.append(blocks)
        elif op < 0.5 and held:
            m.deallocate(held.pop(rng.randrange(len(held))))
        elif op < 0.65 and held:
            held.pop(rng.randrange(len(held)))  # dropped without deallocate (R4): refcount 0
        elif op < 0.8:
            reserved = m.reserved_blocks
            free = m.num_free_blocks
            stats = m.stats()
            # Over the limit (an unmap a refused backend deferred): any call settles toward it,
            # evicting cached blocks and cutting the reservation if it must (docs/xtensor.md).
            over = (
                stats["memory_limit"] is not None and stats["mapped_bytes"] > stats["memory_limit"]
            )
            if not m.try_reserve(rng.randrange(1, 6)):
                assert m.reserved_blocks <= reserved, "False: nothing taken"
                if not over:
                    assert m.reserved_blocks == reserved and m.num_free_blocks >= free, (
                        "False: nothing taken"
                    )
            elif rng.random() < 0.5:
                m.free_reserved()
        elif op < 0.9:
            m.evict(rng.randrange(0, 4))
        else:
            m.set_memory_limit(rng.choice([None, 3 * KIB, 6 * KIB]))
        m.check()
        assert book.mapped == set(m.mapped_page_ids())
    book.refuse_rate = 0.0
    for blocks in held:
        m.deallocate(blocks)
    held.clear()
    hit = fresh = blocks = None
    gc.collect()
    m.free_reserved()
    m.reset_prefix_cache()
    m.set_memory_limit(None)
    m.check()
    assert m.num_used_blocks == 0 and m.num_cached_blocks == 0 and m.num_free_blocks == 39
    assert book.mapped == set(m.mapped_page_ids())
    assert 1 + spare <= len(book.mapped) <= 1 + 2 * spare, "page 0 and the spare band"
