"""The pools' batch calls (``advance``, ``may_append_all``, ``block_tables`` / ``slot_mapping`` of
many sequences) and kvpool.SequenceBatch, the persistent running batch they read in Rust.

Membership rules of a SequenceBatch (one entry per sequence, insertion order, all-or-nothing
bulk changes); the batch calls doing exactly what the per-sequence calls do (R16, R17), and
giving on a SequenceBatch exactly what they give on a list (R16, R17, R19); exports naming a
sequence twice; bad input changing nothing (R29); threads sharing batches and sequences (R27,
R28)."""

from __future__ import annotations

import random
import threading

import kvpool
import numpy as np
import pytest

BS = 4


def _seqs(n, start=0):
    return [kvpool.Sequence([start + i] * (i % 5 + 1), seq_id=start + i) for i in range(n)]


def test_membership_order_and_views():
    a, b, c = _seqs(3)
    batch = kvpool.SequenceBatch([a, b])
    batch.add(c)
    assert len(batch) == 3 and list(batch) == [a, b, c]
    assert batch.seq_ids.dtype == np.uint64 and batch.seq_ids.tolist() == [0, 1, 2]
    assert a in batch and kvpool.Sequence([1]) not in batch and "a" not in batch
    assert batch[0] is a and batch[2] is c and batch[-1] is c and batch[-3] is a
    with pytest.raises(IndexError, match="index"):
        batch[3]
    with pytest.raises(IndexError, match="index"):
        batch[-4]
    with pytest.raises(TypeError, match="index"):
        batch["0"]
    batch.remove(b)
    assert list(batch) == [a, c], "removal keeps the others' order"
    batch.extend([b])
    assert list(batch) == [a, c, b]
    batch.remove_all([c, a])
    assert list(batch) == [b]
    batch.check()
    batch.clear()
    batch.check()
    assert len(batch) == 0 and list(batch) == [] and repr(batch) == "SequenceBatch(len=0)"
    assert len(kvpool.SequenceBatch()) == 0 and len(kvpool.SequenceBatch(None)) == 0


def test_r29_bad_membership_changes_nothing():
    a, b, c = _seqs(3)
    batch = kvpool.SequenceBatch([a, b])
    with pytest.raises(ValueError, match="seq"):
        batch.add(a)
    with pytest.raises(TypeError, match="seq"):
        batch.add("a")
    with pytest.raises(ValueError, match="seqs"):
        batch.extend([c, a])  # a is already in
    with pytest.raises(ValueError, match="seqs"):
        batch.extend([c, c])  # listed twice
    with pytest.raises(TypeError, match="seqs"):
        batch.extend([c, 3])
    with pytest.raises(TypeError, match="seqs"):
        batch.extend(7)
    with pytest.raises(ValueError, match="seq"):
        batch.remove(c)
    with pytest.raises(ValueError, match="seqs"):
        batch.remove_all([a, c])  # c is not in
    with pytest.raises(ValueError, match="seqs"):
        batch.remove_all([a, a])
    with pytest.raises(TypeError, match="seqs"):
        kvpool.SequenceBatch([a, None])
    assert list(batch) == [a, b], "every failed call left the batch as it was"
    batch.check()


def test_iteration_is_a_snapshot_and_members_stay_alive():
    batch = kvpool.SequenceBatch(_seqs(4))
    seen = []
    for seq in batch:
        batch.remove(seq)  # changing the batch while iterating is safe
        seen.append(seq.seq_id)
    assert seen == [0, 1, 2, 3] and len(batch) == 0
    batch.extend(_seqs(2, start=10))  # only the batch refers to them now
    assert batch.seq_ids.tolist() == [10, 11]
    assert [len(s) for s in batch] == [1, 2]


def _twin_pools(seed, n, *, num_blocks=64, vocab=30, max_len=18, **options):
    """Two identical pools with identical sequences (prompts of 1..max_len-1 tokens below
    vocab, each allocated), for driving one pool one way and the other another way."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]
    out = []
    for _ in range(2):
        pool = kvpool.BlockManagerPool(num_blocks, BS, **options)
        seqs = [kvpool.Sequence(p, seq_id=i) for i, p in enumerate(prompts)]
        for s in seqs:
            assert pool.allocate(s)
        out.append((pool, seqs))
    return out, rng


@pytest.mark.parametrize("seed", range(4))
def test_advance_and_may_append_all_equal_the_per_sequence_calls(seed):
    """R16, R17: the batch calls do exactly what the four calls per sequence do."""
    ((batch, bs), (loop, ls)), rng = _twin_pools(seed, 6, num_blocks=40, vocab=50, max_len=14)
    for _ in range(30):
        tokens = [rng.randrange(50) for _ in bs]
        batch.advance(bs, np.array(tokens, dtype=np.int64))
        failed = batch.may_append_all(bs)
        ok_loop = []
        for s, t in zip(ls, tokens, strict=True):
            s.num_computed_tokens = len(s)
            loop.cache(s)
            s.append_token(t)
            ok_loop.append(loop.may_append(s))
        assert failed == [i for i, ok in enumerate(ok_loop) if not ok]
        for a, b in zip(bs, ls, strict=True):
            assert a.block_table.tolist() == b.block_table.tolist()
            assert a.num_computed_tokens == b.num_computed_tokens and len(a) == len(b)
        assert batch.stats() == loop.stats()
        keep = [i for i, ok in enumerate(ok_loop) if ok]
        for i, ok in enumerate(ok_loop):
            if not ok:
                batch.deallocate(bs[i])
                loop.deallocate(ls[i])
        bs = [bs[i] for i in keep]
        ls = [ls[i] for i in keep]
        batch.check()
        if not bs:
            break


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"sliding_window": 8},
        {"sliding_window": 8, "swa_num_blocks": 64},
        {"linear_state_slots": 24, "checkpoint_interval": 8},
    ],
    ids=["full", "window", "window-own-store", "linear"],
)
def test_r16_r17_r19_batch_calls_equal_list_calls(seed, options):
    """A random decode workload: the batch pool and the list pool stay identical, step by step
    (tables, exports, statistics), with check() after every step; finished and failed
    sequences leave, and every block comes back at the end."""
    ((lp, ls), (bp, bs)), rng = _twin_pools(seed, 8, **options)
    batch = kvpool.SequenceBatch(bs)
    groups = bp.num_groups
    for _ in range(40):
        tokens = [rng.randrange(30) for _ in ls]
        lp.advance(ls, np.array(tokens, dtype=np.int32))
        bp.advance(batch, tokens)
        lookahead = rng.choice([0, 0, 1, 5])
        failed = lp.may_append_all(ls, lookahead=lookahead)
        assert bp.may_append_all(batch, lookahead=lookahead) == failed
        grown = [i for i in range(len(ls)) if i not in failed]  # the others lack their slots
        for g in range(groups):
            assert np.array_equal(lp.block_tables(ls, group=g), bp.block_tables(batch, group=g))
            assert np.array_equal(
                lp.slot_mapping([ls[i] for i in grown], group=g),
                bp.slot_mapping([bs[i] for i in grown], group=g),
            )
        for a, b in zip(ls, bs, strict=True):
            assert a.block_table.tolist() == b.block_table.tolist() and len(a) == len(b)
        assert lp.stats() == bp.stats()
        if "linear_state_slots" in options:  # the saves planned at the same boundaries (R24)
            a, b = lp.take_linear_state_plan(), bp.take_linear_state_plan()
            assert a.save_src.tolist() == b.save_src.tolist()
            assert a.save_dst.tolist() == b.save_dst.tolist()
            lp.commit_linear_state_plan(a)
            bp.commit_linear_state_plan(b)
        leaving = sorted(set(failed) | {i for i in range(len(ls)) if rng.random() < 0.1})
        for i in leaving:
            lp.deallocate(ls[i])
            bp.deallocate(bs[i])
        batch.remove_all([bs[i] for i in leaving])
        ls = [s for i, s in enumerate(ls) if i not in leaving]
        bs = [s for i, s in enumerate(bs) if i not in leaving]
        assert list(batch) == bs
        batch.check()
        lp.check()
        bp.check()
        if not bs:
            break
    for s in bs:
        bp.deallocate(s)
    bp.check()
    stats = bp.stats()
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == 63, "every id came back"


@pytest.fixture
def two_and_a_stranger():
    """A pool holding a (3 tokens) and b (5 tokens), and a sequence it does not hold."""
    pool = kvpool.BlockManagerPool(32, BS)
    a, b = kvpool.Sequence([1, 2, 3]), kvpool.Sequence([4, 5, 6, 7, 8])
    assert pool.allocate(a) and pool.allocate(b)
    return pool, a, b, kvpool.Sequence([9])


def test_r29_advance_bad_input_changes_nothing(two_and_a_stranger):
    pool, a, b, stranger = two_and_a_stranger
    before = (pool.stats(), len(a), len(b), a.num_computed_tokens)
    with pytest.raises(ValueError, match="token_ids"):
        pool.advance([a, b], [1])
    with pytest.raises(ValueError, match="seqs"):
        pool.advance([a, a], [1, 2])
    with pytest.raises(ValueError, match="seqs"):
        pool.advance([a, stranger], [1, 2])  # a is not touched either
    with pytest.raises(TypeError, match="seqs"):
        pool.advance([a, "b"], [1, 2])
    with pytest.raises(ValueError, match="seqs"):
        pool.may_append_all([a, a])
    with pytest.raises(ValueError, match="seqs"):
        pool.may_append_all([stranger])
    with pytest.raises(ValueError, match="lookahead"):
        pool.may_append_all([a], lookahead=-1)
    assert (pool.stats(), len(a), len(b), a.num_computed_tokens) == before
    b.append_token(9)  # 6 tokens: the table (2 blocks of 4) holds them
    b.append_tokens([1, 2, 3])  # 9 tokens: no longer
    with pytest.raises(ValueError, match="may_append first"):
        pool.advance([a, b], [1, 2])
    assert len(a) == 3


def test_r29_batch_calls_with_bad_members_change_nothing(two_and_a_stranger):
    pool, a, b, stranger = two_and_a_stranger
    batch = kvpool.SequenceBatch([a, stranger, b])
    before = (pool.stats(), len(a), len(b), a.num_computed_tokens)
    with pytest.raises(ValueError, match="seqs"):
        pool.advance(batch, [1, 2, 3])
    with pytest.raises(ValueError, match="seqs"):
        pool.may_append_all(batch)
    with pytest.raises(ValueError, match="token_ids"):
        pool.advance(kvpool.SequenceBatch([a, b]), [1])
    assert (pool.stats(), len(a), len(b), a.num_computed_tokens) == before
    batch.remove(stranger)
    pool.advance(batch, [7, 8])
    assert a.token_ids[-1] == 7 and b.token_ids[-1] == 8
    assert pool.may_append_all(batch) == []
    pool.check()


def test_may_append_all_names_the_sequences_without_room():
    """R16: the indices of those that could not grow, the others grown; failures unchanged."""
    pool = kvpool.BlockManagerPool(4, BS, enable_prefix_cache=False)  # 3 usable ids
    seqs = [kvpool.Sequence([i] * 4) for i in range(3)]
    for s in seqs:
        assert pool.allocate(s)
    batch = kvpool.SequenceBatch(seqs)
    assert pool.may_append_all(batch) == []  # 4 tokens fit in one block each
    for s in seqs:
        s.append_token(1)  # 5 tokens: each needs a second block, none is free
    tables = [s.block_table.tolist() for s in seqs]
    assert pool.may_append_all(batch) == [0, 1, 2]
    assert [s.block_table.tolist() for s in seqs] == tables
    pool.deallocate(seqs[1])
    batch.remove(seqs[1])
    # seqs[1]'s block is free again: the first sequence gets it, the second still fails
    assert pool.may_append_all(batch) == [1]
    assert len(seqs[0].block_table) == 2 and len(seqs[2].block_table) == 1
    pool.check()


@pytest.mark.parametrize(
    "make_pool",
    [lambda: kvpool.BlockManagerPool(32, BS), lambda: kvpool.HierarchyBlockManagerPool(32, 16, BS)],
    ids=["pool", "hierarchy"],
)
def test_batch_exports_take_batches_and_repeats(make_pool):
    """R19 on both pools: a SequenceBatch works, and a list naming one sequence twice is locked
    once (it used to deadlock, on each pool in turn)."""
    pool = make_pool()
    s = kvpool.Sequence(list(range(6)))
    assert pool.allocate(s)
    assert pool.block_tables([s, s]).tolist() == [s.block_table.tolist()] * 2
    assert len(pool.slot_mapping([s, s])) == 12
    batch = kvpool.SequenceBatch([s])
    assert pool.block_tables(batch).tolist() == [s.block_table.tolist()]
    assert pool.slot_mapping(batch).tolist() == pool.slot_mapping([s]).tolist()
    pool.deallocate(s)
    pool.check()


def test_r27_r28_threads_share_batches_in_opposite_orders():
    """Threads drive one concurrent pool through batches that hold the same sequences in
    opposite orders (the lock order falls back to addresses: no deadlock), while another
    thread edits a batch; nothing is lost."""
    pool = kvpool.BlockManagerPool(2048, BS, concurrent=True)
    seqs = [kvpool.Sequence([i % 7] * (i % 9 + 1), seq_id=i) for i in range(24)]
    for s in seqs:
        assert pool.allocate(s)
    forward = kvpool.SequenceBatch(seqs)
    backward = kvpool.SequenceBatch(reversed(seqs))
    edited = kvpool.SequenceBatch()
    errors = []

    def exporter(batch):
        try:
            for _ in range(300):
                pool.block_tables(batch)
                try:
                    pool.slot_mapping(batch)
                except ValueError as e:  # caught between the stepper's advance and may_append
                    assert "may_append first" in str(e)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def stepper():
        try:
            for step in range(150):
                pool.advance(forward, [step % 7] * len(forward))
                assert pool.may_append_all(forward) == []
        except Exception as e:  # pragma: no cover
            errors.append(e)

    def editor():
        try:
            for i in range(2000):
                s = seqs[i % len(seqs)]
                if s in edited:
                    edited.remove(s)
                else:
                    edited.add(s)
                list(edited)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [
        threading.Thread(target=stepper),
        threading.Thread(target=exporter, args=(backward,)),
        threading.Thread(target=exporter, args=(edited,)),
        threading.Thread(target=editor),
    ]
    for t in threads:
        t.daemon = True  # a deadlock fails the test below instead of hanging the run
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors
    for b in (forward, backward, edited):
        b.check()
    assert all(len(s) == len(s.token_ids) and s.num_computed_tokens == len(s) - 1 for s in seqs)
    pool.check()
    for s in seqs:
        pool.deallocate(s)
    pool.check()
    assert pool.stats()["num_free_blocks"] + pool.stats()["num_cached_blocks"] == 2047


@pytest.mark.parametrize("seed", range(4))
def test_r16_r17_advance_with_lookahead_is_advance_then_may_append_all(seed):
    """advance(seqs, tokens, lookahead=n) does what advance + may_append_all(seqs, n) do, in one
    call, and returns the same indices of sequences without room (None without lookahead)."""
    ((lp, ls), (bp, bs)), rng = _twin_pools(seed, 8)
    batch = kvpool.SequenceBatch(bs)
    for _ in range(40):
        tokens = [rng.randrange(30) for _ in ls]
        lookahead = rng.choice([0, 0, 2])
        assert lp.advance(ls, tokens) is None
        failed = lp.may_append_all(ls, lookahead=lookahead)
        assert bp.advance(batch, tokens, lookahead=lookahead) == failed
        assert [s.block_table.tolist() for s in ls] == [s.block_table.tolist() for s in bs]
        assert lp.stats() == bp.stats()
        for i in reversed(failed):  # preempt those without room
            lp.deallocate(ls.pop(i))
            assert batch[i] is bs[i]
            bp.deallocate(batch[i])
            batch.remove(bs.pop(i))
        bp.check()
        if not bs:
            break


def test_r29_advance_lookahead_is_checked_first():
    pool = kvpool.BlockManagerPool(16, BS)
    s = kvpool.Sequence([1, 2, 3])
    assert pool.allocate(s)
    before = (pool.stats(), len(s), s.num_computed_tokens)
    with pytest.raises(ValueError, match="lookahead"):
        pool.advance([s], [5], lookahead=-1)
    with pytest.raises(TypeError, match="lookahead"):
        pool.advance([s], [5], lookahead="1")
    assert (pool.stats(), len(s), s.num_computed_tokens) == before
    assert pool.advance([s], [5], lookahead=4) == []  # 4 tokens + 4 ahead: 2 blocks
    assert len(s.block_table) == 2 and len(s) == 4 and s.num_computed_tokens == 3
