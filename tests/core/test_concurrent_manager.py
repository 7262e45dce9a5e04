"""kvpool.ConcurrentBlockManager: the same API and behaviour as kvpool.BlockManager (R1-R12,
R29), shareable between Python threads with the GIL released (R27, R28).

Same behaviour: every manager-level test of test_block_manager.py, test_prefix_cache.py and
test_bad_input.py (those that build a ``kvpool.BlockManager`` and no pool or sequence) is
collected here a second time and run with ``kvpool.BlockManager`` replaced by
``kvpool.ConcurrentBlockManager``. The tests below add what is specific to threads.
"""

from __future__ import annotations

import inspect
import random
import sys
import threading
import time

import kvpool
import pytest
import test_bad_input
import test_block_manager
import test_prefix_cache
from conftest import assert_conservation

# ---------------------------------------------------------------------------------------------
# R1-R12, R29: the BlockManager tests, re-run on ConcurrentBlockManager
# ---------------------------------------------------------------------------------------------


def _manager_level(fn) -> bool:
    """A test that builds a BlockManager (directly or through the `bm` / `busy` fixtures) and
    nothing of the sequence level; subprocess tests are left out (a subprocess would not see
    the substitution)."""
    source = inspect.getsource(fn)
    params = inspect.signature(fn).parameters
    uses_manager = "kvpool.BlockManager(" in source or "kvpool.BlockManager," in source
    uses_manager = uses_manager or "bm" in params or "busy" in params
    sequence_level = any(
        word in source for word in ("BlockManagerPool", "Sequence", "SingleBlockManager")
    )
    return uses_manager and not sequence_level and "subprocess" not in source


_REUSED = []
for _module in (test_block_manager, test_prefix_cache, test_bad_input):
    for _name, _fn in vars(_module).items():
        if _name.startswith("test_") and callable(_fn) and _manager_level(_fn):
            # Collected by pytest under a new name, with its parametrize marks.
            globals()[f"test_same_as_block_manager__{_name}"] = _fn
            _REUSED.append(_name)
busy = test_bad_input.busy  # the fixture some of the reused bad-input tests take


@pytest.fixture(autouse=True)
def _concurrent_manager_everywhere(monkeypatch):
    """Every ``kvpool.BlockManager(...)`` in this module's tests (and in the conftest fixtures
    they take) builds a ConcurrentBlockManager."""
    monkeypatch.setattr(kvpool, "BlockManager", kvpool.ConcurrentBlockManager)


def test_reused_tests_cover_the_manager_api():
    assert len(_REUSED) >= 60, _REUSED
    for area in ("r3_", "r4_", "r5_", "r7_", "r9_", "r10_", "r12_", "r29_allocate", "r29_cache"):
        assert any(area in name for name in _REUSED), area


def test_fixture_substitution_is_active(bm):
    assert type(bm) is kvpool.ConcurrentBlockManager


# ---------------------------------------------------------------------------------------------
# API parity
# ---------------------------------------------------------------------------------------------

PUBLIC = sorted(name for name in dir(kvpool.ConcurrentBlockManager) if not name.startswith("_")) + [
    "__repr__"
]


def test_r27_exported():
    assert "ConcurrentBlockManager" in kvpool.__all__
    assert kvpool.ConcurrentBlockManager.__module__ == "kvpool"


def test_r27_same_names_and_signatures_as_block_manager():
    plain = kvpool._core.BlockManager
    conc = kvpool._core.ConcurrentBlockManager
    assert [n for n in dir(plain) if not n.startswith("_")] == [
        n for n in dir(conc) if not n.startswith("_")
    ]
    assert str(inspect.signature(plain)) == str(inspect.signature(conc))
    for name in PUBLIC:
        a, b = getattr(plain, name), getattr(conc, name)
        if callable(a) and not isinstance(a, property):
            assert str(inspect.signature(a)) == str(inspect.signature(b)), name


def test_r4_r29_blocks_of_the_other_manager_kind_are_rejected_by_name():
    plain = kvpool._core.BlockManager(8, 2)
    conc = kvpool.ConcurrentBlockManager(8, 2)
    pb, cb = plain.allocate(1), conc.allocate(1)
    for manager, foreign in ((conc, pb), (plain, cb)):
        with pytest.raises(ValueError, match="blocks"):
            manager.deallocate(foreign)
        with pytest.raises(ValueError, match="blocks"):
            manager.cache([1, 2], foreign)
    assert pb[0].ref_count == 1 and cb[0].ref_count == 1, "nothing was released"
    conc.deallocate(cb)
    assert conc.num_free_blocks == 7
    conc.check()


def test_r27_prefix_cache_view_and_repr():
    bm = kvpool.ConcurrentBlockManager(8, 2)
    blocks = bm.allocate(2)
    assert bm.cache([1, 2, 3, 4], blocks) == 2
    bm.deallocate(blocks)
    view = bm.prefix_cache
    assert len(view) == 2
    assert all(view.contains(h) for h in view.hashes())
    assert bm.eviction_order() == [blocks[1].id, blocks[0].id]
    assert repr(bm).startswith("ConcurrentBlockManager(num_blocks=8")
    assert kvpool.ConcurrentBlockManager(8, 2, enable_prefix_cache=False).prefix_cache is None


# ---------------------------------------------------------------------------------------------
# R28: the GIL is released during long calls
# ---------------------------------------------------------------------------------------------


def test_r28_check_releases_the_gil():
    """While one thread runs check() on a 2M-block manager (~15 ms of Rust work per call), the
    main thread keeps running Python code in the middle half of each call. With the GIL held it
    could run only at the edges (one switch interval, set to 1 ms here, after the call starts or
    before the caller reads the clock again), never in the middle: a SingleBlockManager, whose
    check() keeps the GIL, shows no tick there."""
    bm = kvpool.ConcurrentBlockManager(1 << 21, 1, enable_prefix_cache=False)
    windows: list[tuple[float, float]] = []
    stop = threading.Event()

    def checker():
        for _ in range(5):
            start = time.perf_counter()
            bm.check()
            windows.append((start, time.perf_counter()))
        stop.set()

    ticks: list[float] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        t = threading.Thread(target=checker)
        t.start()
        while not stop.is_set():
            ticks.append(time.perf_counter())
        t.join()
    finally:
        sys.setswitchinterval(interval)
    middle = [(a + (b - a) / 4, b - (b - a) / 4) for a, b in windows]
    inside = sum(1 for x in ticks for lo, hi in middle if lo < x < hi)
    assert inside, f"no Python ran in the middle of {len(windows)} check() calls: GIL held"


# ---------------------------------------------------------------------------------------------
# R2-R5, R10, R27, R28: 8 Python threads hammering one manager
# ---------------------------------------------------------------------------------------------

BLOCK_SIZE = 4


def _prompt(chain: int, blocks: int) -> list[int]:
    """Chains share their first block; chains with the same chain // 2 their second too."""
    out = []
    for i in range(blocks):
        owner = 0 if i == 0 else (1 + chain // 2 if i == 1 else 100 + chain)
        out += [owner, i, 7, 9]
    return out


def _digest(tokens: list[int], i: int) -> int:
    """The simulated KV of block i: a function of the whole prefix up to it."""
    return hash(tuple(tokens[: (i + 1) * BLOCK_SIZE]))


def test_r27_r28_eight_threads_stress_then_every_id_free():
    num_blocks = 96
    bm = kvpool.ConcurrentBlockManager(num_blocks, BLOCK_SIZE)
    kv: dict[int, int] = {}  # block id -> simulated KV content (dict ops are atomic)
    mailbox: list[list[kvpool.Block]] = []  # groups released by another thread
    mailbox_lock = threading.Lock()
    errors: list[BaseException] = []
    stats = {"ops": 0, "hits": 0, "oob": 0}
    deadline = time.monotonic() + 2.0

    def request(rng: random.Random) -> list[kvpool.Block] | None:
        tokens = _prompt(rng.randrange(8), 1 + rng.randrange(6))
        n = len(tokens) // BLOCK_SIZE
        blocks = bm.allocate_shared(tokens)
        for i, b in enumerate(blocks):
            # Held, so never evicted and reused under us (R10): its KV is this prefix's.
            assert b.ref_count >= 1
            assert kv[b.id] == _digest(tokens, i), f"block {b.id} carries another prefix's KV"
        stats["hits"] += len(blocks)
        try:
            fresh = bm.allocate(n - len(blocks))
        except kvpool.OutOfBlocksError:
            stats["oob"] += 1
            bm.deallocate(blocks)
            return None
        assert len(fresh) == n - len(blocks), "partial allocation (R3)"
        for k, b in enumerate(fresh):
            assert b.id != 0 and b.ref_count == 1, "fresh block shared or padding (R1, R4)"
            kv[b.id] = _digest(tokens, len(blocks) + k)
        blocks += fresh
        bm.cache(tokens, blocks)
        return blocks

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[list[kvpool.Block]] = []
        try:
            while time.monotonic() < deadline:
                op = rng.randrange(100)
                if op < 40 and len(held) < 3:
                    got = request(rng)
                    if got is not None:
                        held.append(got)
                elif op < 60 and held:
                    bm.deallocate(held.pop(rng.randrange(len(held))))
                elif op < 70 and held:
                    with mailbox_lock:
                        mailbox.append(held.pop(rng.randrange(len(held))))
                elif op < 78:
                    with mailbox_lock:
                        group = mailbox.pop() if mailbox else None
                    if group is not None:
                        if rng.randrange(2):
                            bm.deallocate(group)
                        else:
                            del group  # dropped without deallocate: the Block objects go (R4)
                elif op < 88:
                    n = 1 + rng.randrange(16)
                    try:
                        blocks = bm.allocate(n)
                    except kvpool.OutOfBlocksError:
                        stats["oob"] += 1
                    else:
                        assert len(blocks) == n, "partial allocation (R3)"
                        assert all(b.ref_count == 1 for b in blocks)
                        bm.deallocate(blocks)
                elif op < 97:
                    bm.evict(1 + rng.randrange(4))
                elif op < 98:
                    bm.reset_prefix_cache()
                else:
                    c = bm.stats()
                    assert (
                        c["num_free_blocks"] + c["num_cached_blocks"] + c["num_used_blocks"]
                        == c["num_total_blocks"]
                    )
                stats["ops"] += 1
            for group in held:
                bm.deallocate(group)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for group in mailbox:
        bm.deallocate(group)
    mailbox.clear()
    assert stats["ops"] > 1000, stats
    assert stats["hits"] > 0, stats
    # Quiescent: exact accounting (R2), nothing used, every id free exactly once.
    bm.check()
    assert_conservation(bm)
    assert bm.num_used_blocks == 0
    assert bm.stats()["num_evictions"] > 0, "no eviction: the test lost its point"
    bm.reset_prefix_cache()
    bm.check()
    assert bm.num_free_blocks == num_blocks - 1
    everything = bm.allocate(num_blocks - 1)
    assert sorted(b.id for b in everything) == list(range(1, num_blocks))
    with pytest.raises(kvpool.OutOfBlocksError):
        bm.allocate(1)
    bm.deallocate(everything)
    bm.check()
