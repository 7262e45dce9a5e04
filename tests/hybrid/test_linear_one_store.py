"""Linear state in the one store (docs/hybrid.md "Linear state in the one store"; R22, R23).

With ``linear_state_blocks=k`` every slot in use (live, pending, committed) holds ``k`` blocks of
the full-attention group's store, so memory flows between the KV and the states: what the states
do not use the KV takes, and a checkpoint competes with the KV by recency. The random workloads
with a content shadow over this store are in test_collisions.py and test_shared_store.py; these
are the rules one at a time.
"""

from __future__ import annotations

import kvpool
import pytest

BS = 4


def prefill(pool: kvpool.BlockManagerPool, tokens: list[int]) -> kvpool.Sequence:
    """Admits ``tokens`` and computes them in chunks that end where the pool saves checkpoints,
    running each step's plan."""
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    while seq.num_computed_tokens < len(seq):
        end = pool.next_checkpoint_boundary(seq) or len(seq)
        seq.num_computed_tokens = end
        pool.cache(seq)
        pool.commit_linear_state_plan(pool.take_linear_state_plan())
    return seq


def test_states_take_blocks_of_the_store_and_give_them_back():
    pool = kvpool.BlockManagerPool(
        64, BS, linear_state_slots=16, linear_state_blocks=3, checkpoint_interval=8, block_bytes=100
    )
    seq = prefill(pool, list(range(20)))
    stats = pool.stats()
    # the live state and the checkpoints at 8, 16 and 20 (the prompt's last block boundary)
    in_use = stats["num_live_slots"] + stats["num_committed_checkpoints"]
    assert (stats["num_live_slots"], stats["num_committed_checkpoints"]) == (1, 3)
    assert stats["num_linear_state_blocks"] == 3 * in_use
    assert stats["num_used_blocks"] == seq.num_blocks + 3 * in_use
    assert stats["memory"] == {
        "free_bytes": 100 * stats["num_free_blocks"],
        "cached_bytes": 100 * stats["num_cached_blocks"],
        "kv_bytes": 100 * seq.num_blocks,
        "state_bytes": 100 * 3 * in_use,
    }
    memory = pool.memory()[0]
    assert memory["block_bytes"] == 100
    assert {"group": 1, "cached_blocks": 0, "used_blocks": 12} in memory["shared"]
    pool.deallocate(seq)
    pool.reset_prefix_cache()  # drops the checkpoints and the KV: every block comes back
    pool.check()
    assert pool.stats()["num_linear_state_blocks"] == 0
    assert pool.num_free_blocks == 63


def test_the_kv_takes_what_the_states_do_not_use():
    """The same store of 48 blocks: full attention alone could take 47; with states in the one
    store a prompt of 47 blocks less its state still fits, while a separate slot store leaves the
    KV its own 47 blocks only."""
    pool = kvpool.BlockManagerPool(48, BS, linear_state_slots=8, linear_state_blocks=5)
    assert pool.can_allocate(kvpool.Sequence(list(range((47 - 5) * BS))))
    assert not pool.can_allocate(kvpool.Sequence(list(range((47 - 5) * BS + 1))))
    # the checkpoints give their blocks back to a prompt that needs them (R15: can_* predicts)
    pool = kvpool.BlockManagerPool(
        48, BS, linear_state_slots=8, linear_state_blocks=5, checkpoint_interval=8
    )
    for base in (1000, 2000):
        pool.deallocate(prefill(pool, list(range(base, base + 24))))
    assert pool.stats()["num_committed_checkpoints"] > 0
    big = kvpool.Sequence(list(range(5000, 5000 + (47 - 5) * BS)))
    assert pool.can_allocate(big) and pool.allocate(big)
    assert pool.stats()["num_committed_checkpoints"] == 0
    pool.check()


def test_a_checkpoint_and_the_kv_go_by_recency():
    """Under pressure the store evicts whichever was used longest ago: an old conversation's
    checkpoint goes before a newer conversation's KV."""
    pool = kvpool.BlockManagerPool(
        40, BS, linear_state_slots=8, linear_state_blocks=4, checkpoint_interval=8
    )
    old = prefill(pool, list(range(100, 116)))
    pool.deallocate(old)
    new = prefill(pool, list(range(200, 216)))
    pool.deallocate(new)
    # a third prompt needs more than the free blocks: the old chain and its checkpoints go first
    third = prefill(pool, list(range(300, 324)))
    pool.deallocate(third)
    again = kvpool.Sequence(list(range(200, 216)) + [7])
    assert pool.allocate(again)
    assert again.num_cached_tokens == 16
    assert again.linear_state_restore_slot is not None
    pool.deallocate(again)
    first = kvpool.Sequence(list(range(100, 116)) + [7])
    assert pool.allocate(first) and first.num_cached_tokens == 0
    pool.deallocate(first)
    pool.check()


def test_r23_a_junction_checkpoint_outlives_the_intermediate_ones():
    """The kept list: a junction's checkpoint (where a prompt left the cached tree past the
    restored checkpoint) and a restored one are evicted after every plain (intermediate) one.
    Plain LRU would evict both here: the later saves are newer."""
    pool = kvpool.BlockManagerPool(256, BS, linear_state_slots=5, checkpoint_interval=8)
    system = list(range(16))
    pool.deallocate(prefill(pool, system + list(range(100, 108))))  # saves 8, 16, 24
    # shares 20 tokens of KV; restores 16; saves its junction 20 (kept), then 24, 32, 40, 48
    second = prefill(pool, system + list(range(100, 104)) + list(range(200, 228)))
    assert second.num_cached_tokens == 16
    pool.deallocate(second)
    third = kvpool.Sequence(system + list(range(100, 104)) + [7])
    assert pool.allocate(third)
    assert third.num_cached_tokens == 20 and third.linear_state_restore_slot is not None
    pool.deallocate(third)
    restored = kvpool.Sequence(system + [7])
    assert pool.allocate(restored) and restored.num_cached_tokens == 16
    pool.deallocate(restored)
    pool.check()


def test_the_api_cannot_take_slots_of_the_one_store():
    pool = kvpool.BlockManagerPool(32, BS, linear_state_slots=4, linear_state_blocks=2)
    cache = pool.linear_state_cache(0)
    with pytest.raises(ValueError, match="linear_state_blocks"):
        cache.acquire_live_slot()
    assert cache.reserve_checkpoint(b"\x01" * 16) is None
    pool.check()


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"linear_state_blocks": 2}, "linear_state_blocks"),  # no slots
        ({"linear_state_slots": 4, "linear_state_blocks": 32}, "linear_state_blocks"),
        ({"linear_state_slots": 4, "linear_state_blocks": -1}, "linear_state_blocks"),
        ({"linear_state_slots": 4, "block_bytes": -1}, "block_bytes"),
    ],
)
def test_r29_one_store_bad_input(options, name):
    with pytest.raises((ValueError, OverflowError), match=name):
        kvpool.BlockManagerPool(32, BS, **options)
    with pytest.raises(TypeError, match="linear_state_blocks"):
        kvpool.BlockManagerPool(32, BS, linear_state_slots=4, linear_state_blocks="2")
    with pytest.raises(ValueError, match="linear_state_blocks"):
        kvpool.BlockManagerPool(
            32, BS, linear_state_slots=4, linear_state_blocks=2, xtensor={"blocks_per_page": 4}
        )
