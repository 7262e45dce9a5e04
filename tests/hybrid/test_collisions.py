"""R7 under forced hash collisions (``debug_hash_bits`` 1..8) over every group and tier.

A hash collision must never hand out another prefix's KV or recurrent state: not in the
full-attention cache, not in the sliding-window group (G5), not through a linear-state
checkpoint (G6), not through the host tier (G7: one offload per key). The random workloads play
the worker with a content shadow: every block id (per group and tier) and every linear-state
slot records which prefix's KV or state the worker wrote into it, transfers and copies move
those records, and after every step each table entry a sequence was handed (hits included) and
its live state must belong to the sequence's own prefix; ``check()`` after every step. Plus one
regression test per finding, in the reproducers' shapes.
"""

from __future__ import annotations

import random

import kvpool
import pytest

BS = 2


class Worker:
    """Plays the engine and the worker over one pool, with a shadow of what each id holds."""

    def __init__(self, pool: kvpool.BlockManagerPool, linear: bool, window: bool) -> None:
        self.pool = pool
        self.linear = linear
        self.window = window
        self.host = isinstance(pool, kvpool.HierarchyBlockManagerPool)
        self.kv: dict[tuple[int, int, int], tuple[int, ...]] = {}  # (group, rank, id) -> prefix
        self.host_kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (rank, host id) -> prefix
        self.state: dict[tuple[int, int], tuple[int, ...]] = {}  # (rank, slot) -> prefix
        self.running: list[kvpool.Sequence] = []
        self.hit_blocks = 0
        self.window_hit_blocks = 0
        self.restores = 0
        self.loaded_blocks = 0

    # --- the worker's side: plans and transfers ---------------------------------------------
    def run_linear_plan(self) -> None:
        if not self.linear:
            return
        plan = self.pool.take_linear_state_plan()
        copies = [
            (plan.restore_dp_rank.tolist(), plan.restore_src.tolist(), plan.restore_dst.tolist()),
            (plan.save_dp_rank.tolist(), plan.save_src.tolist(), plan.save_dst.tolist()),
        ]
        for ranks, srcs, dsts in copies:  # restores (and promotions) first, then saves
            for r, a, b in zip(ranks, srcs, dsts, strict=True):
                self.state[(r, b)] = self.state.get((r, a), ("garbage", r, a))
        self.pool.commit_linear_state_plan(plan)

    def run_transfers(self) -> None:
        if not self.host:
            return
        loads = self.pool.take_load_plans()
        for plan in loads:
            for a, b in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
                self.kv[(0, plan.dp_rank, b)] = self.host_kv.get((plan.dp_rank, a), ("garbage",))
                self.loaded_blocks += 1
        self.pool.complete_loads(loads)
        offloads = self.pool.take_offload_plans()
        for plan in offloads:
            assert len(set(plan.keys)) == len(plan.keys), "G7: one offload per key (R26)"
            for a, b in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
                self.host_kv[(plan.dp_rank, b)] = self.kv.get((0, plan.dp_rank, a), ("garbage",))
        self.pool.complete_offloads(offloads)

    # --- the engine's side -------------------------------------------------------------------
    def admit(self, tokens: list[int]) -> None:
        seq = kvpool.Sequence(tokens)
        if not self.pool.allocate(seq):
            return
        self.run_linear_plan()  # the restore runs before the sequence's first step
        self.run_transfers()  # so do the loads
        self.running.append(seq)
        computed = seq.num_computed_tokens
        self.hit_blocks += computed // BS
        if self.window:
            self.window_hit_blocks += sum(
                1 for b in seq.group_block_table(1).tolist()[: computed // BS] if b
            )
        if self.linear and computed:
            assert seq.linear_state_restore_slot is not None, "R23: a hit restores a checkpoint"
            self.restores += 1

    def compute(self, seq: kvpool.Sequence, n: int) -> None:
        """The worker computes tokens ``num_computed_tokens..n`` of ``seq``."""
        old = seq.num_computed_tokens
        rank = seq.dp_rank
        tokens = seq.token_ids
        if self.linear:
            live = (rank, seq.linear_state_slot)
            if old == 0:
                self.state[live] = ()
            assert self.state.get(live) == tuple(tokens[:old]), (
                "the recurrent state continues its own prefix"
            )
            self.state[live] = tuple(tokens[:n])
        tables = [(0, seq.block_ids())]
        if self.window:
            tables.append((1, seq.group_block_table(1).tolist()))
        for group, table in tables:
            for i in range(old // BS, -(-n // BS)):
                assert table[i], "a computed position has a block"
                self.kv[(group, rank, table[i])] = tuple(tokens[: min(n, (i + 1) * BS)])
        seq.num_computed_tokens = n
        self.pool.cache(seq)
        self.run_linear_plan()

    def release(self, seq: kvpool.Sequence) -> None:
        self.running.remove(seq)
        self.pool.deallocate(seq)
        self.run_linear_plan()
        self.run_transfers()

    def verify(self) -> None:
        """Every full computed table entry (hits included) and every live state holds the
        sequence's own prefix (R7)."""
        self.pool.check()
        for seq in self.running:
            rank = seq.dp_rank
            tokens = seq.token_ids
            full = seq.num_computed_tokens // BS
            tables = [(0, seq.block_ids())]
            if self.window:
                tables.append((1, seq.group_block_table(1).tolist()))
            for group, table in tables:
                for i in range(full):
                    if table[i]:
                        got = self.kv.get((group, rank, table[i]))
                        assert got == tuple(tokens[: (i + 1) * BS]), (
                            f"group {group} entry {i} of {tokens} is block {table[i]} holding {got}"
                        )
            if self.linear and seq.num_computed_tokens:
                got = self.state.get((rank, seq.linear_state_slot))
                assert got == tuple(tokens[: seq.num_computed_tokens]), (
                    f"live state of {tokens}: {got}"
                )


def play(
    pool: kvpool.BlockManagerPool,
    rng: random.Random,
    steps: int,
    linear: bool,
    window: bool,
    resets: bool = True,
) -> Worker:
    w = Worker(pool, linear, window)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(4, 12))] for _ in range(4)]
    finished: list[list[int]] = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.3 or not w.running:
            if finished and rng.random() < 0.3:
                tokens = rng.choice(finished) + [
                    rng.randrange(3) for _ in range(rng.randrange(1, 5))
                ]
            else:
                base = rng.choice(prefixes)
                tokens = base[: rng.randrange(1, len(base) + 1)] + [
                    rng.randrange(3) for _ in range(rng.randrange(1, 6))
                ]
            w.admit(tokens)
        elif r < 0.75:
            seq = rng.choice(w.running)
            if seq.num_computed_tokens < len(seq):
                w.compute(seq, min(len(seq), seq.num_computed_tokens + rng.choice([1, 2, 3, 5])))
            else:
                seq.append_token(rng.randrange(3))
                if not pool.may_append(seq):
                    w.release(seq)
        elif r < 0.97:
            seq = rng.choice(w.running)
            finished.append(seq.token_ids[: seq.num_computed_tokens])
            w.release(seq)
        elif resets:
            pool.reset_prefix_cache()
        w.verify()
    for seq in list(w.running):
        w.release(seq)
    w.verify()
    stats = pool.stats()
    # what the linear-state group holds of the one store (linear_state_blocks: its states and
    # the surplus of slots that went free, until the store asks for it) is all that is used
    assert stats["num_used_blocks"] == stats["num_linear_state_blocks"]
    assert stats["num_free_blocks"] == (
        stats["num_total_blocks"] - stats["num_cached_blocks"] - stats["num_linear_state_blocks"]
    )
    return w


CONFIGS = {
    "full": {},
    "full+no_dedup": {"dedup": False},
    "window": {"sliding_window": 3, "swa_num_blocks": 48},
    # one block store: window blocks attach to the verified full-attention entries
    "window+shared": {"sliding_window": 3},
    "window+linear+shared": {
        "sliding_window": 4,
        "linear_state_slots": 8,
        "checkpoint_interval": 2,
    },
    "linear": {"linear_state_slots": 8, "checkpoint_interval": 2},
    # linear state in the one store: a state takes 2 blocks of the full-attention store
    "linear+one_store": {
        "linear_state_slots": 8,
        "checkpoint_interval": 2,
        "linear_state_blocks": 2,
    },
    "window+linear+one_store": {
        "sliding_window": 4,
        "linear_state_slots": 8,
        "checkpoint_interval": 2,
        "linear_state_blocks": 2,
    },
    "linear+one_store+promote": {
        "linear_state_slots": 10,
        "checkpoint_interval": 2,
        "linear_state_save": "promote",
        "linear_state_blocks": 2,
    },
    "linear+contiguous+promote": {
        "linear_state_slots": 10,
        "checkpoint_interval": 2,  # contiguous: a checkpoint at every block
        "linear_state_match": "contiguous",
        "linear_state_save": "promote",
    },
    "window+linear": {
        "sliding_window": 4,
        "swa_num_blocks": 48,
        "linear_state_slots": 8,
        "checkpoint_interval": 2,
    },
    "window+linear+no_dedup": {
        "sliding_window": 3,
        "swa_num_blocks": 48,
        "linear_state_slots": 8,
        "checkpoint_interval": 2,
        "dedup": False,
    },
}
HOST_CONFIGS = {
    "host": {},
    "host+on_evict": {"offload_policy": "on_evict"},
    "host+window": {"sliding_window": 3, "swa_num_blocks": 48},
    "host+linear": {"linear_state_slots": 8, "checkpoint_interval": 2},
    "host+window+linear+one_store+dp2": {
        "dp_size": 2,
        "sliding_window": 4,
        "shared_blocks": True,
        "linear_state_slots": 8,
        "checkpoint_interval": 2,
        "linear_state_blocks": 2,
    },
    "host+window+linear+dp2": {
        "dp_size": 2,
        "sliding_window": 4,
        "swa_num_blocks": 48,
        "linear_state_slots": 8,
        "checkpoint_interval": 2,
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_r7_random_collisions_never_hand_out_another_prefixs_kv_or_state(name):
    options = CONFIGS[name]
    hits = 0
    for bits in range(1, 9):
        rng = random.Random(bits)
        pool = kvpool.BlockManagerPool(28, BS, debug_hash_bits=bits, **options)
        hits += play(
            pool, rng, 250, "linear_state_slots" in options, "sliding_window" in options
        ).hit_blocks
    assert hits > 0, "the workloads share prefixes"


@pytest.mark.parametrize("name", sorted(HOST_CONFIGS))
def test_r7_random_collisions_through_the_host_tier(name):
    options = HOST_CONFIGS[name]
    hits = 0
    for bits in range(1, 9):
        rng = random.Random(100 + bits)
        pool = kvpool.HierarchyBlockManagerPool(20, 24, BS, debug_hash_bits=bits, **options)
        hits += play(
            pool, rng, 250, "linear_state_slots" in options, "sliding_window" in options
        ).hit_blocks
    assert hits > 0, "the workloads share prefixes"


@pytest.mark.parametrize(
    ("options", "kinds"),
    [
        ({"sliding_window": 4, "swa_num_blocks": 48}, ("window_hit_blocks", "loaded_blocks")),
        ({"linear_state_slots": 8, "checkpoint_interval": 2}, ("restores", "loaded_blocks")),
        (
            {
                "sliding_window": 4,
                "swa_num_blocks": 48,
                "linear_state_slots": 8,
                "checkpoint_interval": 2,
            },
            ("window_hit_blocks", "restores"),
        ),
        (
            {
                "sliding_window": 4,
                "shared_blocks": True,
                "linear_state_slots": 8,
                "checkpoint_interval": 2,
                "linear_state_blocks": 2,
            },
            ("window_hit_blocks", "restores"),
        ),
    ],
    ids=["window", "linear", "window+linear", "window+linear+one_store"],
)
def test_r7_the_random_workloads_reach_every_kind_of_hit(options, kinds):
    """Not vacuous: with full-width hashes the same workloads hit through the window group, the
    checkpoints and the host tier (where the anchors travel with the KV)."""
    totals = dict.fromkeys(kinds, 0)
    for seed in range(4):
        pool = kvpool.HierarchyBlockManagerPool(20, 24, BS, **options)
        w = play(
            pool,
            random.Random(seed),
            300,
            "linear_state_slots" in options,
            "sliding_window" in options,
        )
        for kind in kinds:
            totals[kind] += getattr(w, kind)
    assert all(totals.values()), totals


# --- regressions, in the reproducers' shapes ---------------------------------------------------


def test_g5_the_window_group_verifies_the_chain_not_only_the_block():
    """repro_window_collision.py: with 3-bit hashes B = C + [9] got a full-attention hit on C's
    blocks, and its window entry 2 was A's block of another prefix (same truncated hash, same
    block tokens). Window blocks are now anchored to the full-attention entry of their position
    and a hit takes one only where the query's verified walk reaches that entry."""
    p = kvpool.BlockManagerPool(
        32, 1, sliding_window=2, swa_num_blocks=32, debug_hash_bits=3, enable_events=True
    )
    w = Worker(p, linear=False, window=True)
    a, c = [0, 0, 0, 1], [1, 0, 1, 1]
    for tokens in (a, c):
        w.admit(tokens)
        w.compute(w.running[-1], len(tokens))
    w.admit(c + [9])
    w.verify()
    for event in p.drain_events():
        if event.kind == "stored" and event.parent_hash is not None:
            assert event.parent_hash not in event.block_hashes, "no block is its own parent"
    # The same shapes with full-width hashes: B shares C's window blocks.
    q = kvpool.BlockManagerPool(32, 1, sliding_window=2, swa_num_blocks=32)
    v = Worker(q, linear=False, window=True)
    for tokens in (a, c):
        v.admit(tokens)
        v.compute(v.running[-1], len(tokens))
    v.admit(c + [9])
    v.verify()
    b, c_seq = v.running[-1], v.running[1]
    assert b.num_cached_tokens == 4
    assert (
        b.group_block_table(1).tolist()[:4]
        == [0, 0, 0, c_seq.group_block_table(1).tolist()[3]]
        != [0] * 4
    )


def test_g6_a_checkpoint_restores_only_the_prefix_it_ends():
    """repro_linear_collision.py: with 3-bit hashes B = [1, 0, 1, 8] got C's KV (token-verified)
    and A's checkpoint of [2, 0, 1] (same truncated hash as [1, 0, 1]). A checkpoint now records
    the full-attention entry its boundary ends at and serves only a walk that reaches it."""
    p = kvpool.BlockManagerPool(
        32, 1, linear_state_slots=8, checkpoint_interval=1, debug_hash_bits=3
    )
    w = Worker(p, linear=True, window=False)
    w.admit([2, 0, 1, 7])
    a = w.running[-1]
    for n in range(1, 4):
        w.compute(a, n)
    w.release(a)
    c = kvpool.Sequence([1, 0, 1, 7])
    assert p.allocate(c)
    w.run_linear_plan()
    for n in range(1, 4):
        c.num_computed_tokens = n
        p.cache(c)
    p.take_linear_state_plan()  # C's saves are taken and never confirmed: not matchable
    p.deallocate(c)
    w.admit([1, 0, 1, 8])
    w.verify()
    b = w.running[-1]
    assert b.num_cached_tokens == 0 and b.linear_state_restore_slot is None
    # A's prefix is served only from checkpoints of its own prefix (C's colliding saves
    # replaced some of A's: the last save under a hash wins).
    w.admit([2, 0, 1, 9])
    w.verify()


def test_g7_one_offload_per_key():
    """repro_host_collision.py: a 2-token sequence whose two chain hashes collide under 1-bit
    hashes was planned as one offload with both blocks under one key; check() raised. The chain
    now stops at a key already planned (or held on host for another chain)."""
    p = kvpool.HierarchyBlockManagerPool(16, 16, 1, debug_hash_bits=1)
    s = kvpool.Sequence([2, 1])
    assert p.allocate(s)
    s.num_computed_tokens = 2
    p.deallocate(s)
    p.check()
    plans = p.take_offload_plans()
    keys = [k for plan in plans for k in plan.keys]
    assert len(keys) == len(set(keys)) == 1
    p.check()
    p.complete_offloads(plans)
    p.check()
    assert p.stats()["host"]["num_cached_blocks"] == 1
