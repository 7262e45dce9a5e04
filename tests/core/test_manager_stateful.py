"""Model-based test of kvpool.BlockManager: R2-R5, R7, R9, R10, R12 against a Python model.

The model knows, for every allocatable id, how many test-held handles point at it and whether the
prefix cache holds it (with which (extra_key, token prefix)). It predicts exactly:
counts (R2), allocate success / OutOfBlocksError (R3), hits (R7), cache() return values (R9),
ref counts (R4), evict() return values, reset (R12).

Which cached blocks an eviction takes depends on LRU details that the contract leaves partly open
(whether releasing a handle or re-inserting an existing entry refreshes recency), so here the
model only checks that each eviction is *valid*: the right number, only blocks held by nothing but
the cache, prefix-closed afterwards (R10). Exact LRU order is covered by unit tests in
test_block_manager.py on scenarios where every reading agrees.
"""

from __future__ import annotations

import gc

import kvpool
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

BS = 2
N = 12  # 11 allocatable ids: small, so eviction and OutOfBlocksError happen often
KEYS = [None, b"ns1"]

token_lists = st.lists(st.integers(0, 2), min_size=0, max_size=4 * BS + 1)


def cdiv(a, b):
    return -(-a // b)


class Group:
    """One "sequence": its tokens, namespace and the handles the test holds for it."""

    def __init__(self, tokens, key, blocks):
        self.tokens = tokens
        self.key = key
        self.blocks = blocks
        self.alive = True
        self.head_released = False  # blocks[i] is then no longer token block i: no cache()


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = kvpool.BlockManager(N, BS)
        self.all_ids = set(range(1, N))
        self.refs: dict[int, int] = {}  # id -> number of live handles held by the test
        self.entries: dict[tuple, int] = {}  # (key, prefix tuple) -> id
        self.entry_of: dict[int, tuple] = {}  # id -> (key, prefix tuple)
        self.groups: list[Group] = []
        self.dead: list[Group] = []
        self._hash_memo: dict[tuple, bytes] = {}

    # ---- model helpers -------------------------------------------------------------------

    def h(self, pk):
        if pk not in self._hash_memo:
            key, prefix = pk
            self._hash_memo[pk] = kvpool.hash_blocks(list(prefix), BS, extra_key=key)[-1]
        return self._hash_memo[pk]

    def pk(self, key, tokens, i):
        return (key, tuple(tokens[: (i + 1) * BS]))

    def used_ids(self):
        return {i for i, r in self.refs.items() if r > 0}

    def cached_state_ids(self):
        return set(self.entry_of) - self.used_ids()

    def evictable_ids(self):
        """Cache-only blocks with no held block below them: evict() can reach all of them,
        leaves first (R10). Equal to the cache-only set unless a test group released the head
        of its chain while keeping the tail."""
        used = self.used_ids()
        held_entries = [pk for pk, i in self.entries.items() if i in used]
        out = set()
        for pk, i in self.entries.items():
            if i in used:
                continue
            key, prefix = pk
            if any(
                k2 == key and len(p2) > len(prefix) and p2[: len(prefix)] == prefix
                for k2, p2 in held_entries
            ):
                continue
            out.add(i)
        return out

    def free_ids(self):
        return self.all_ids - self.used_ids() - set(self.entry_of)

    def expected_hits(self, tokens, key):
        out = []
        for i in range(len(tokens) // BS):
            pk = self.pk(key, tokens, i)
            if pk not in self.entries:
                break
            out.append(self.entries[pk])
        return out

    def snapshot(self):
        bm = self.bm
        return (
            bm.num_free_blocks,
            bm.num_cached_blocks,
            bm.num_used_blocks,
            len(bm.prefix_cache),
            dict(self.entries),
        )

    def drop_entry(self, pk):
        i = self.entries.pop(pk)
        del self.entry_of[i]

    def absorb_evictions(self, expected_count, cached_before):
        """Find the entries the manager evicted, check they were a valid choice (R10)."""
        pc = self.bm.prefix_cache
        gone = [pk for pk in list(self.entries) if not pc.contains(self.h(pk))]
        assert len(gone) == expected_count, (len(gone), expected_count)
        gone_ids = {self.entries[pk] for pk in gone}
        assert gone_ids <= cached_before, "evicted a block held outside the cache"
        for pk in gone:
            self.drop_entry(pk)
        # prefix-closed: every remaining entry's parent is still cached (R10)
        for key, prefix in self.entries:
            if len(prefix) > BS:
                assert (key, prefix[:-BS]) in self.entries, "cached set not prefix-closed"
        return gone_ids

    def hold(self, ids):
        for i in ids:
            self.refs[i] = self.refs.get(i, 0) + 1

    def unhold(self, ids):
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                del self.refs[i]

    # ---- rules ---------------------------------------------------------------------------

    @rule(tokens=token_lists, key=st.sampled_from(KEYS))
    def allocate_group(self, tokens, key):
        bm = self.bm
        exp_hits = self.expected_hits(tokens, key)
        hits = bm.allocate_shared(tokens, extra_key=key)
        assert [b.id for b in hits] == exp_hits, "R7: longest cached prefix"
        self.hold(exp_hits)
        need = cdiv(len(tokens), BS) - len(hits)
        free_before = self.free_ids()
        cached_before = self.evictable_ids()
        if need > len(free_before) + len(cached_before):
            # (R3 says OutOfBlocksError when free + cached < n; between that and free + evictable
            # only a partially released chain can be, and R10 forbids evicting its head.)
            snap = self.snapshot()
            with pytest.raises(kvpool.OutOfBlocksError):
                bm.allocate(need)
            assert self.snapshot() == snap, "R3: failed allocate changed something"
            bm.deallocate(hits)
            self.unhold(exp_hits)
            return
        new = bm.allocate(need)
        assert len(new) == need
        new_ids = [b.id for b in new]
        assert len(set(new_ids)) == need
        assert 0 not in new_ids, "R1: padding block handed out"
        n_evict = max(0, need - len(free_before))
        evicted_now = self.absorb_evictions(n_evict, cached_before)
        assert set(new_ids) <= free_before | evicted_now, "handed out an id that was not available"
        for b in new:
            assert b.ref_count == 1
            assert b.hash is None
        self.hold(new_ids)
        self.groups.append(Group(tokens, key, hits + new))

    @rule(data=st.data())
    @precondition(lambda self: any(not g.head_released for g in self.groups))
    def cache_group(self, data):
        g = data.draw(st.sampled_from([g for g in self.groups if not g.head_released]))
        nblocks = data.draw(st.integers(0, len(g.blocks)))
        ntok = data.draw(st.integers(0, len(g.tokens)))
        tokens = g.tokens[:ntok]
        blocks = g.blocks[:nblocks]
        expected = 0
        for i in range(min(len(tokens) // BS, len(blocks))):
            pk = self.pk(g.key, tokens, i)
            bid = blocks[i].id
            if pk in self.entries:
                if self.entries[pk] == bid:
                    continue
                break  # R9: first writer wins, insertion stops
            assert bid not in self.entry_of, "model: a block cached under two prefixes"
            self.entries[pk] = bid
            self.entry_of[bid] = pk
            expected += 1
        assert self.bm.cache(tokens, blocks, extra_key=g.key) == expected

    @rule(data=st.data(), via_gc=st.booleans())
    @precondition(lambda self: self.groups)
    def release_group(self, data, via_gc):
        g = data.draw(st.sampled_from(self.groups))
        self.groups.remove(g)
        ids = [b.id for b in g.blocks]
        if via_gc:
            g.blocks = None
            gc.collect()
        else:
            self.bm.deallocate(g.blocks)
            self.dead.append(g)
        g.alive = False
        self.unhold(ids)

    @rule(data=st.data())
    @precondition(lambda self: any(len(g.blocks) > 1 and not g.head_released for g in self.groups))
    def release_head_first(self, data):
        """Release a group's handles one deallocate call per block, head first, keeping the last
        handle: the released head blocks that are cached stay cached (held by the cache only)."""
        g = data.draw(
            st.sampled_from([g for g in self.groups if len(g.blocks) > 1 and not g.head_released])
        )
        for b in g.blocks[:-1]:
            self.bm.deallocate([b])
            self.unhold([b.id])
        self.dead.append(Group(g.tokens, g.key, g.blocks[:-1]))
        g.blocks = g.blocks[-1:]
        g.head_released = True

    @rule(data=st.data())
    @precondition(lambda self: any(g.blocks for g in self.dead))
    def double_release_is_rejected(self, data):
        g = data.draw(st.sampled_from([g for g in self.dead if g.blocks]))
        snap = self.snapshot()
        with pytest.raises(ValueError):
            self.bm.deallocate(g.blocks)
        assert self.snapshot() == snap, "R5/R29: double release changed something"

    @rule(data=st.data())
    @precondition(lambda self: any(g.blocks for g in self.dead) and self.groups)
    def mixed_release_is_atomic(self, data):
        """R29: a list with one released handle releases nothing, not even the good ones."""
        dead = data.draw(st.sampled_from([g for g in self.dead if g.blocks]))
        live = data.draw(st.sampled_from(self.groups))
        if not live.blocks:
            return
        snap = self.snapshot()
        with pytest.raises(ValueError):
            self.bm.deallocate(live.blocks + dead.blocks[:1])
        assert self.snapshot() == snap

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        cached_before = self.evictable_ids()
        expected = min(n, len(cached_before))
        assert self.bm.evict(n) == expected
        self.absorb_evictions(expected, cached_before)

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()
        self.entries.clear()
        self.entry_of.clear()

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def counts_match_model(self):
        bm = self.bm
        used = self.used_ids()
        cached = self.cached_state_ids()
        free = self.free_ids()
        assert bm.num_total_blocks == N - 1
        assert bm.num_used_blocks == len(used), "R2 used"
        assert bm.num_cached_blocks == len(cached), "R2 cached"
        assert bm.num_free_blocks == len(free), "R2 free"
        assert bm.num_available_blocks == len(free) + len(cached)

    @invariant()
    def cache_matches_model(self):
        pc = self.bm.prefix_cache
        assert len(pc) == len(self.entries)
        for pk, bid in self.entries.items():
            assert pc.block_id(self.h(pk)) == bid

    @invariant()
    def handles_match_model(self):
        for g in self.groups:
            for b in g.blocks:
                assert b.ref_count == self.refs[b.id] + (1 if b.id in self.entry_of else 0), "R4"
                if b.id in self.entry_of:
                    assert b.hash == self.h(self.entry_of[b.id])

    @invariant()
    def structure_is_sound(self):
        self.bm.check()

    def teardown(self):
        # Releasing everything and resetting the cache returns every id to the free list.
        for g in self.groups:
            self.bm.deallocate(g.blocks)
        self.groups.clear()
        self.bm.reset_prefix_cache()
        gc.collect()
        assert self.bm.num_free_blocks == N - 1
        self.bm.check()


TestManagerStateful = ManagerMachine.TestCase
