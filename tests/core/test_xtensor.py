"""kvpool.XTensorBlockManager: elastic KV memory on virtual-memory pages.

The BlockManager protocol (R1-R5, R10, R29), the page rules (mapped pages = page 0, pages holding a
used or cached block, spares), the memory limit, the reservation, page-aware eviction, Python
page backends (a recording fake, MemoryError, exceptions), the host backend's resident memory,
and the CUDA backend's paging logic on a fake driver (on a real GPU where there is one).
"""

from __future__ import annotations

import gc
import os

import kvpool
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvpool.xtensor import CudaPageBackend

MiB = 1 << 20


class RecordingBackend:
    """A page backend in Python: records the mapped set, can refuse maps (capacity) or fail."""

    def __init__(self, num_pages, page_bytes=MiB, capacity=None):
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.capacity = capacity
        self.mapped: set[int] = set()
        self.calls: list[tuple[str, int]] = []
        self.fail: str | None = None  # "map_page" or "unmap_page": raise RuntimeError
        self.manager = None  # set to call back into the manager (must be refused)

    def map_page(self, page):
        self.calls.append(("map_page", page))
        if self.manager is not None:
            self.manager.num_free_blocks  # noqa: B018 (re-entry: RuntimeError)
        if self.fail == "map_page":
            raise RuntimeError("driver gone")
        assert page not in self.mapped, f"page {page} mapped twice"
        if self.capacity is not None and len(self.mapped) >= self.capacity:
            raise MemoryError("device full")
        self.mapped.add(page)

    def unmap_page(self, page):
        self.calls.append(("unmap_page", page))
        if self.fail == "unmap_page":
            raise RuntimeError("driver gone")
        assert page in self.mapped, f"page {page} unmapped while not mapped"
        assert page != 0, "page 0 holds the padding block"
        self.mapped.remove(page)

    @property
    def resident_bytes(self):
        return len(self.mapped) * self.page_bytes


def manager(num_blocks=64, blocks_per_page=8, **kw):
    kw.setdefault("page_bytes", MiB)
    return kvpool.XTensorBlockManager(num_blocks, 4, blocks_per_page=blocks_per_page, **kw)


def toks(n_blocks, salt):
    return [salt * 10_000 + i for i in range(4 * n_blocks)]


def pages(m, blocks):
    return {m.page_of(b.id) for b in blocks}


def assert_page_rules(m, held, backend=None):
    """check(), then the page rules from the outside: the mapped pages are page 0, the pages of
    held or cached blocks, and between spare_pages and 2 * spare_pages spares."""
    m.check()
    mapped = set(m.mapped_page_ids())
    if backend is not None:
        assert backend.mapped == mapped, "the backend and the manager disagree"
    occupied = {0} | {m.page_of(b.id) for b in held} | {m.page_of(i) for i in m.eviction_order()}
    assert occupied <= mapped, f"pages {occupied - mapped} hold blocks but are unmapped"
    spares = len(mapped - occupied)
    if m.reserved_blocks == 0:
        room = max(0, m.limit_pages - len(occupied))
        wanted = min(m.spare_pages, room, spares + m.num_pages - len(mapped))
        refused = m.stats()["num_map_failures"] > 0
        assert (spares >= wanted or refused) and spares <= 2 * m.spare_pages, (spares, wanted)
    if len(mapped) > m.limit_pages:
        assert spares == 0
    assert m.mapped_bytes == len(mapped) * m.page_bytes
    assert m.num_free_blocks + m.num_cached_blocks + m.num_used_blocks == m.num_total_blocks  # R2


# --- the protocol and the page rules --------------------------------------------------------------


def test_construction_maps_page_zero_and_the_spares():
    m = manager(spare_pages=2)
    assert (m.num_pages, m.blocks_per_page, m.page_bytes) == (8, 8, MiB)
    assert m.mapped_page_ids() == [0, 1, 2]
    assert m.num_total_blocks == m.num_free_blocks == m.num_available_blocks == 63  # R1, R2
    assert m.backend == "accounting"
    assert_page_rules(m, [])
    assert "XTensorBlockManager(" in repr(m)


def test_a_single_page_range_works_with_the_default_spare():
    m = kvpool.XTensorBlockManager(8, 4, blocks_per_page=8)
    assert (m.num_pages, m.mapped_pages, m.spare_pages) == (1, 1, 1)
    assert len(m.allocate(7)) == 7
    m.check()


def test_allocation_packs_pages_and_a_page_unmaps_when_it_empties():
    m = manager(spare_pages=0)
    a = m.allocate(7)
    assert 0 not in [b.id for b in a], "the padding block is never handed out (R1)"
    assert pages(m, a) == {0} and m.mapped_pages == 1
    b = m.allocate(3)
    assert pages(m, b) == {1} and m.mapped_pages == 2
    m.deallocate(a[:2])
    c = m.allocate(2)
    assert pages(m, c) == {0}, "the fullest page with room first"
    m.deallocate(b)
    assert m.mapped_page_ids() == [0], "page 1 unmapped with its last block"
    assert_page_rules(m, a[2:] + c)
    m.deallocate(a[2:] + c)
    assert m.num_free_blocks == 63


def test_r3_exact_availability_under_a_limit_and_failed_allocation_changes_nothing():
    m = manager(num_blocks=40, memory_limit=3 * MiB)
    assert m.num_available_blocks == 7 + 8 + 8
    before = m.stats()
    with pytest.raises(kvpool.OutOfBlocksError):
        m.allocate(24)
    assert m.stats() == before
    blocks = m.allocate(23)
    assert m.num_available_blocks == 0
    assert_page_rules(m, blocks)
    m.deallocate(blocks)
    assert m.num_available_blocks == 23


def test_cached_blocks_keep_pages_and_lowering_the_limit_reclaims_whole_pages():
    m = manager(num_blocks=80, spare_pages=1)
    held = [m.allocate(7)]  # page 0
    for i in range(6):  # pages 1..6; even ones finish (blocks stay cached)
        blocks = m.allocate(8)
        m.cache(toks(8, i), blocks)
        if i % 2 == 0:
            m.deallocate(blocks)
        else:
            held.append(blocks)
    flat = [b for g in held for b in g]
    assert m.mapped_pages == 8, "cached pages stay mapped, plus a spare"
    assert_page_rules(m, flat)
    report = m.set_memory_limit(2 * MiB)
    assert report["evicted_blocks"] == 24 and report["unmapped_pages"] == 4
    assert m.mapped_page_ids() == [0, 2, 4, 6]
    assert report["excess_bytes"] == 2 * MiB and report["held_pages"] == 4
    assert m.memory_limit == 2 * MiB and m.limit_pages == 2
    assert_page_rules(m, flat)
    for blocks in held:  # as sequences finish, the manager reclaims toward the limit
        m.deallocate(blocks)
        m.check()
    assert m.mapped_pages == 2
    assert m.set_memory_limit(None)["excess_bytes"] == 0
    assert_page_rules(m, [])


def test_evict_takes_whole_pages_first():
    m = manager(num_blocks=40, spare_pages=0)
    a, b, held = m.allocate(7), m.allocate(8), None
    c = m.allocate(3)
    held = m.allocate(5)  # shares page 2 with c
    for i, blocks in enumerate([a, b, c]):
        m.cache(toks(len(blocks), i), blocks)
    for blocks in (b, c, a):
        m.deallocate(blocks)
    assert m.evict(8) == 8
    assert m.mapped_page_ids() == [0, 2], "page 1's memory came back"
    assert m.evict(1) == 1
    assert m.num_cached_blocks == 7 + 2
    assert_page_rules(m, held)


def test_reservation_maps_ahead():
    m = manager(memory_limit=4 * MiB, spare_pages=0)
    assert m.try_reserve(20) and m.reserved_blocks == 20 and m.mapped_pages == 3
    assert not m.try_reserve(12), "beyond the limit: refused, nothing changed"
    assert m.reserved_blocks == 20
    maps = m.stats()["num_page_maps"]
    blocks = m.allocate(20)
    assert m.stats()["num_page_maps"] == maps and m.reserved_blocks == 0
    assert m.try_reserve(3) and m.free_reserved() == 3
    m.deallocate(blocks)
    assert_page_rules(m, [])


def test_a_dropped_handle_frees_its_page_at_the_next_call():
    m = manager(spare_pages=0)
    keep = m.allocate(7)
    extra = m.allocate(2)
    assert m.mapped_pages == 2
    del extra
    gc.collect()
    m.check()
    assert m.trim() == 1 and m.mapped_page_ids() == [0]
    assert_page_rules(m, keep)


# --- bad input (R29) --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(num_blocks=1), ValueError, "num_blocks"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(blocks_per_page=0), ValueError, "blocks_per_page"),
        (dict(blocks_per_page=1 << 17), ValueError, "blocks_per_page"),
        (dict(blocks_per_page="8"), TypeError, "blocks_per_page"),
        (dict(page_bytes=0), ValueError, "page_bytes"),
        (dict(page_bytes=-1), ValueError, "page_bytes"),
        (dict(spare_pages=9), ValueError, "spare_pages"),
        (dict(spare_pages=-1), ValueError, "spare_pages"),
        (dict(memory_limit=-1), ValueError, "memory_limit"),
        (dict(memory_limit=1.5), TypeError, "memory_limit"),
        (dict(backend="gpu"), ValueError, "backend"),
        (dict(backend=object()), TypeError, "backend"),
        (dict(backend="host", page_bytes=1000), ValueError, "page_bytes"),
        (dict(enable_prefix_cache=1), TypeError, "enable_prefix_cache"),
        (dict(backend=RecordingBackend(8, page_bytes=2 * MiB)), ValueError, "page_bytes"),
        (dict(backend=RecordingBackend(4)), ValueError, "backend"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, name):
    args = dict(num_blocks=64, block_size=4, blocks_per_page=8, page_bytes=MiB)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        kvpool.XTensorBlockManager(args.pop("num_blocks"), args.pop("block_size"), **args)


def test_bad_calls_change_nothing():
    m = manager()
    blocks = m.allocate(3)
    before = m.stats()
    for call, error, name in [
        (lambda: m.allocate(-1), ValueError, "n"),
        (lambda: m.try_reserve(-2), ValueError, "n"),
        (lambda: m.set_memory_limit(-5), ValueError, "limit"),
        (lambda: m.page_of(64), ValueError, "block_id"),
        (lambda: m.is_page_mapped(8), ValueError, "page"),
        (lambda: m.evict("3"), TypeError, "n"),
        (lambda: m.deallocate([blocks[0], blocks[0]]), ValueError, "blocks"),
        (lambda: m.deallocate(kvpool.BlockManager(8, 4).allocate(1)), ValueError, "blocks"),
        (lambda: m.cache([1, 2, 3, 4], [object()]), TypeError, "blocks"),
    ]:
        with pytest.raises(error, match=name):
            call()
        assert m.stats() == before
    m.deallocate(blocks)
    with pytest.raises(ValueError, match="already released"):
        m.deallocate(blocks)
    m.check()


# --- Python backends ------------------------------------------------------------------------------------


def test_a_python_backend_sees_exactly_the_mapped_pages():
    backend = RecordingBackend(8)
    m = manager(backend=backend, spare_pages=1)
    assert m.backend is backend and m.page_bytes == MiB, "page_bytes read off the backend"
    assert backend.mapped == {0, 1}
    blocks = m.allocate(20)
    assert_page_rules(m, blocks, backend)
    m.deallocate(blocks)
    assert_page_rules(m, [], backend)
    assert m.resident_bytes == backend.resident_bytes


def test_memory_error_is_out_of_blocks_and_other_exceptions_propagate():
    backend = RecordingBackend(8, capacity=2)
    m = manager(backend=backend, spare_pages=0)
    blocks = m.allocate(15)
    with pytest.raises(kvpool.OutOfBlocksError):
        m.allocate(1)
    assert not m.try_reserve(1)
    assert m.stats()["num_map_failures"] >= 1
    backend.capacity = None
    backend.fail = "map_page"
    with pytest.raises(RuntimeError, match="driver gone"):
        m.allocate(1)
    assert m.num_used_blocks == 15, "nothing handed out"
    backend.fail = "unmap_page"
    m.deallocate(blocks[7:])  # page 1 empties; its unmap fails: a release never raises (C6)
    assert backend.mapped == set(m.mapped_page_ids()), "the page stayed mapped, pending"
    m.check()
    with pytest.raises(RuntimeError, match="driver gone"):
        m.allocate(1)  # the next call retries first and raises, doing nothing
    assert m.num_used_blocks == 7
    m.check()
    backend.fail = None
    assert m.trim() == 1
    assert_page_rules(m, blocks[:7], backend)


def test_a_backend_calling_its_manager_is_refused():
    backend = RecordingBackend(8)
    m = manager(backend=backend, spare_pages=0)
    backend.manager = m
    with pytest.raises(RuntimeError, match="must not call its manager"):
        m.allocate(10)
    backend.manager = None
    m.check()
    assert m.num_used_blocks == 0


# --- host backend: resident memory follows the load --------------------------------------------


def resident_bytes_of_process():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_host_backend_resident_memory_falls_when_the_load_falls():
    m = kvpool.XTensorBlockManager(
        64 * 64, 16, blocks_per_page=64, page_bytes=2 * MiB, backend="host"
    )
    assert m.resident_bytes == 2 * 2 * MiB, "page 0 and the spare"
    idle = resident_bytes_of_process()
    load = m.allocate(48 * 64)  # 48 pages: 96 MiB
    busy = resident_bytes_of_process()
    assert m.resident_bytes == m.mapped_bytes >= 48 * 2 * MiB
    assert busy - idle >= 80 * MiB, f"the mapped pages are resident: +{(busy - idle) / MiB:.0f} MiB"
    m.deallocate(load)
    after = resident_bytes_of_process()
    assert m.resident_bytes == m.mapped_bytes <= 3 * 2 * MiB
    assert busy - after >= 80 * MiB, (
        f"freed pages left the process: -{(busy - after) / MiB:.0f} MiB"
    )
    m.check()


# --- random workloads -------------------------------------------------------------------------------


class XTensorMachine(RuleBasedStateMachine):
    """Random workloads with check() and the page rules after every step."""

    def __init__(self):
        super().__init__()
        self.backend = RecordingBackend(10)
        self.m = kvpool.XTensorBlockManager(
            37, 2, blocks_per_page=4, page_bytes=MiB, spare_pages=1, backend=self.backend
        )
        self.groups: list[tuple[list[int], list]] = []
        self.salt = 0

    def held(self):
        return [b for _, blocks in self.groups for b in blocks]

    @rule(n=st.integers(0, 9), family=st.integers(0, 2), shared=st.integers(0, 4))
    def allocate(self, n, family, shared):
        self.salt += 1
        available = self.m.num_available_blocks
        try:
            blocks = self.m.allocate(n)
        except kvpool.OutOfBlocksError:
            assert n > available or self.m.stats()["num_map_failures"] > 0
            return
        assert len(blocks) == n <= available
        tokens = [
            family * 100 + i if i < 2 * shared else self.salt * 1000 + i for i in range(2 * n)
        ]
        self.groups.append((tokens, blocks))

    @rule(family=st.integers(0, 2), shared=st.integers(1, 4))
    def allocate_shared(self, family, shared):
        tokens = [family * 100 + i for i in range(2 * shared)]
        blocks = self.m.allocate_shared(tokens)
        self.groups.append((tokens[: 2 * len(blocks)], blocks))

    @precondition(lambda self: self.groups)
    @rule(i=st.integers(0, 100))
    def cache(self, i):
        tokens, blocks = self.groups[i % len(self.groups)]
        self.m.cache(tokens, blocks)

    @precondition(lambda self: self.groups)
    @rule(i=st.integers(0, 100), stray=st.booleans())
    def release(self, i, stray):
        _, blocks = self.groups.pop(i % len(self.groups))
        if stray:
            del blocks
            gc.collect()
            self.m.trim()
        else:
            self.m.deallocate(blocks)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        cached = self.m.num_cached_blocks
        assert self.m.evict(n) <= min(n, cached)

    @rule(pages=st.none() | st.integers(0, 10))
    def set_limit(self, pages):
        report = self.m.set_memory_limit(None if pages is None else pages * MiB)
        assert report["mapped_pages"] == self.m.mapped_pages
        assert report["excess_bytes"] == max(0, self.m.mapped_pages - self.m.limit_pages) * MiB

    @rule(n=st.integers(0, 10))
    def reserve(self, n):
        before = self.m.reserved_blocks
        ok = self.m.try_reserve(n)
        assert self.m.reserved_blocks == before + n * ok

    @rule()
    def free_reserved(self):
        self.m.free_reserved()
        assert self.m.reserved_blocks == 0

    @rule(capacity=st.none() | st.integers(1, 10))
    def device_capacity(self, capacity):
        self.backend.capacity = capacity

    @rule()
    def reset(self):
        self.m.reset_prefix_cache()

    @invariant()
    def page_rules(self):
        held = self.held()
        if self.m.stats()["num_map_failures"] == 0:
            assert_page_rules(self.m, held, self.backend)
        else:
            self.m.check()
            assert self.backend.mapped == set(self.m.mapped_page_ids())
        assert self.m.num_used_blocks == len({b.id for b in held})

    def teardown(self):
        self.backend.capacity = None
        for _, blocks in self.groups:
            self.m.deallocate(blocks)
        self.m.free_reserved()
        self.m.reset_prefix_cache()
        self.m.set_memory_limit(None)
        assert self.m.num_free_blocks == self.m.num_total_blocks, "every id back"
        assert self.m.num_available_blocks == self.m.num_total_blocks
        self.m.check()


TestXTensorStateful = XTensorMachine.TestCase


# --- the CUDA backend on a fake driver --------------------------------------------------------------


class FakeDriver:
    """The eight VMM calls with the driver's rules checked: mappings inside the reservation,
    aligned to the granularity, never overlapping; access set on mapped memory only; a handle
    released once, after its unmap."""

    GRANULARITY = 2 * MiB

    def __init__(self, capacity=None):
        self.capacity = capacity  # physical allocations the device can hold
        self.reservations: dict[int, int] = {}
        self.handles: dict[int, int] = {}  # handle -> size (created, not released)
        self.mappings: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self.accessible: set[int] = set()
        self.next_address, self.next_handle = 1 << 40, 1

    def granularity(self, device):
        return self.GRANULARITY

    def reserve(self, size, alignment):
        assert size % self.GRANULARITY == 0 and alignment == self.GRANULARITY
        address, self.next_address = self.next_address, self.next_address + size + self.GRANULARITY
        self.reservations[address] = size
        return address

    def free_address(self, address, size):
        assert self.reservations.pop(address) == size
        assert not any(address <= a < address + size for a in self.mappings), "still mapped"

    def create(self, size, device):
        assert size % self.GRANULARITY == 0
        if self.capacity is not None and len(self.handles) >= self.capacity:
            raise MemoryError("cuMemCreate: the device is out of memory")
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.handles[handle] = size
        return handle

    def map(self, address, size, handle):
        assert self.handles[handle] == size and address % self.GRANULARITY == 0
        assert any(a <= address and address + size <= a + s for a, s in self.reservations.items())
        assert all(address + size <= a or a + s <= address for a, (s, _) in self.mappings.items())
        self.mappings[address] = (size, handle)

    def set_access(self, address, size, device):
        assert self.mappings[address][0] == size
        self.accessible.add(address)

    def unmap(self, address, size):
        assert self.mappings.pop(address)[0] == size
        self.accessible.discard(address)

    def release(self, handle):
        assert all(h != handle for _, h in self.mappings.values()), "released while mapped"
        del self.handles[handle]


def cuda_backend(driver, num_blocks=256, **kw):
    # 16 tokens * 8 heads * 128 dims * 2 bytes = 32 KiB per block: 64 blocks fill 2 MiB.
    return CudaPageBackend(num_blocks, 16, 8, 128, num_layers=2, driver=driver, **kw)


def test_cuda_backend_pages_every_tensor_and_the_manager_drives_it():
    driver = FakeDriver()
    backend = cuda_backend(driver)
    assert backend.blocks_per_page == 64 and backend.num_pages == 4
    assert backend.page_bytes == 4 * 2 * MiB, "one 2 MiB allocation per tensor (2 layers, K and V)"
    m = kvpool.XTensorBlockManager(
        256, 16, blocks_per_page=backend.blocks_per_page, backend=backend
    )
    assert m.page_bytes == backend.page_bytes
    assert backend.mapped_pages() == [0, 1] and len(driver.mappings) == 2 * 4
    assert driver.accessible == set(driver.mappings), "access set on every mapped range"
    blocks = m.allocate(150)
    assert backend.mapped_pages() == m.mapped_page_ids() == [0, 1, 2, 3]
    assert m.resident_bytes == 4 * backend.page_bytes
    k, v = backend.tensor_address(1, "k"), backend.tensor_address(1, "v")
    assert v - k == backend.tensor_bytes and (k - backend.base) % driver.GRANULARITY == 0
    m.deallocate(blocks)
    assert backend.mapped_pages() == m.mapped_page_ids()
    assert len(driver.mappings) == len(driver.handles) == 4 * len(m.mapped_page_ids())
    m.check()
    del m
    backend.close()
    assert not driver.mappings and not driver.handles and not driver.reservations


def test_cuda_backend_out_of_memory_rolls_back_the_page():
    driver = FakeDriver(capacity=4 * 2 + 3)  # two pages and three tensors of a third
    backend = cuda_backend(driver)
    m = kvpool.XTensorBlockManager(256, 16, blocks_per_page=64, backend=backend, spare_pages=0)
    blocks = m.allocate(127)  # pages 0 and 1
    with pytest.raises(kvpool.OutOfBlocksError):
        m.allocate(1)
    assert len(driver.handles) == 8, "the half-made page was given back"
    assert backend.mapped_pages() == [0, 1]
    m.deallocate(blocks)
    m.check()


def test_cuda_backends_drive_the_pool_one_per_rank():
    """BlockManagerPool(..., xtensor={"backend": [CudaPageBackend per rank]}): each rank's device
    maps exactly its rank's pages (the pool option)."""
    drivers = [FakeDriver(), FakeDriver()]
    backends = [cuda_backend(d) for d in drivers]
    pool = kvpool.BlockManagerPool(
        256, 16, dp_size=2, xtensor={"blocks_per_page": 64, "backend": backends}
    )
    assert pool.xtensor["page_bytes"] == backends[0].page_bytes, "page_bytes from the backends"
    seqs = [kvpool.Sequence([i * 10_000 + t for t in range(16 * 70)]) for i in range(2)]
    for seq in seqs:
        assert pool.allocate(seq)
    assert {seq.dp_rank for seq in seqs} == {0, 1}
    for rank, (backend, driver) in enumerate(zip(backends, drivers, strict=True)):
        assert backend.mapped_pages() == pool.mapped_page_ids(rank)
        assert len(driver.mappings) == 4 * len(backend.mapped_pages()) and driver.accessible == set(
            driver.mappings
        )
    pool.set_memory_limit(2 * backends[0].page_bytes)
    for seq in seqs:
        pool.deallocate(seq)
    pool.check()
    for rank, backend in enumerate(backends):
        assert (
            backend.mapped_pages() == pool.mapped_page_ids(rank)
            and len(backend.mapped_pages()) <= 2
        )


def test_cuda_backend_validates_its_layout():
    with pytest.raises(ValueError, match="blocks_per_page"):
        cuda_backend(FakeDriver(), blocks_per_page=48)
    with pytest.raises(ValueError, match="head_dim"):
        CudaPageBackend(64, 16, 8, 0, driver=FakeDriver())
    with pytest.raises(TypeError, match="num_layers"):
        CudaPageBackend(64, 16, 8, 128, num_layers=2.0, driver=FakeDriver())
    backend = cuda_backend(FakeDriver(), blocks_per_page=128)
    assert backend.num_pages == 2
    with pytest.raises(ValueError, match="blocks_per_page"):
        kvpool.XTensorBlockManager(256, 16, blocks_per_page=64, backend=backend)


def _gpu():
    from kvpool.kernels import _backend

    return _backend.gpu_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU and cupy")
def test_cuda_backend_on_a_gpu_kernels_write_into_mapped_pages():
    import cupy as cp
    import kvpool.kernels as K

    backend = CudaPageBackend(512, 16, 8, 128, num_layers=2)
    m = kvpool.XTensorBlockManager(
        512, 16, blocks_per_page=backend.blocks_per_page, backend=backend
    )
    free_before = cp.cuda.runtime.memGetInfo()[0]
    blocks = m.allocate(300)
    assert cp.cuda.runtime.memGetInfo()[0] < free_before, "pages took device memory"
    k_cache, v_cache = backend.kv_cache(1)
    slots = np.array([b.id * 16 + 3 for b in blocks], dtype=np.int64)
    k = cp.random.standard_normal((len(blocks), 8, 128)).astype(cp.float16)
    K.write_kv(k, -k, k_cache, v_cache, cp.asarray(slots), backend="cupy")
    ids = cp.asarray([b.id for b in blocks])
    assert bool(cp.all(k_cache[ids, 3] == k)) and bool(cp.all(v_cache[ids, 3] == -k))
    mapped_free = cp.cuda.runtime.memGetInfo()[0]
    m.deallocate(blocks)
    cp.cuda.Device().synchronize()
    assert cp.cuda.runtime.memGetInfo()[0] > mapped_free, "unmapped pages went back to the device"
    m.check()
    del k_cache, v_cache, m
    backend.close()
