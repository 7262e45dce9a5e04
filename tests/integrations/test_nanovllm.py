"""kvpool.integrations.nanovllm.BlockManager, the drop-in for nano-vllm's BlockManager.

A scheduler loop with nano-vllm's semantics (benches/compare/nanovllm_engine.py: chunked-prefill
admission, decode, recompute preemption, finish) runs on the drop-in and on the nano-vllm-style
reference; a fake KV tensor is written and read back through ``seq.block_table`` as nano-vllm's
model runner computes slots, so every hit and every table entry must hold the sequence's own KV.
With ``NANOVLLM_SRC`` naming a checkout of GeeeekExplorer/nano-vllm, nano-vllm's real
``Scheduler`` runs on the drop-in too.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
from kvpool.integrations.nanovllm import BlockManager

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches" / "compare"))
import nanovllm_engine as engine  # noqa: E402
import nanovllm_reference as reference  # noqa: E402


def workload(seed=0, **overrides):
    options = dict(
        num_conversations=30,
        max_turns=3,
        system_lengths=(20, 70),
        num_system_prompts=3,
        message_lengths=(3, 25),
        output_lengths=(2, 14),
        concurrency=12,
    )
    options.update(overrides)
    return engine.make_workload(seed, **options)


def all_back(bm: BlockManager) -> None:
    bm.pool.check()
    stats = bm.pool.stats()
    assert stats["num_used_blocks"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == bm.num_blocks
    assert bm._twins == {}, "finished sequences drop their twins"


@pytest.mark.parametrize("block_size", [4, 16])
def test_roomy_schedule_equals_the_reference_and_kv_reads_back(block_size):
    wl = workload()
    ref = reference.BlockManager(5000, block_size)
    expected = engine.run_engine(ref, wl, num_blocks=5000, max_num_batched_tokens=48)
    bm = BlockManager(5000, block_size)
    got = engine.run_engine(bm, wl, num_blocks=5000, max_num_batched_tokens=48)
    assert got.schedule == expected.schedule, "no memory pressure: nano-vllm's own schedule"
    assert got.num_reads == expected.num_reads > 0
    chunked = [s for prefill, s in got.schedule if prefill and any(n < 48 for _, n in s[:1])]
    assert chunked, "the loop exercised chunked prefill"
    all_back(bm)


@pytest.mark.parametrize("seed", range(4))
def test_pressure_preempts_and_every_table_holds_its_own_kv(seed):
    wl = workload(seed, concurrency=16)
    bm = BlockManager(70, 4)
    result = engine.run_engine(bm, wl, num_blocks=70, max_num_batched_tokens=32)
    assert result.num_requests == wl.num_requests
    assert result.num_preemptions > 0, "the cache is small enough to preempt"
    all_back(bm)


def test_can_allocate_has_no_side_effect_and_predicts_allocate():
    bm = BlockManager(8, 4)
    engine.EngineSequence.block_size = 4
    first = engine.EngineSequence(0, list(range(13)), 4, (0, 0))
    assert bm.can_allocate(first) == 0
    bm.allocate(first, 0)
    assert first.block_table == [0, 1, 2, 3] or sorted(first.block_table) == first.block_table
    assert all(0 <= i < 8 for i in first.block_table)
    first.num_scheduled_tokens = 13
    bm.hash_blocks(first)
    first.num_cached_tokens = 13
    bm.deallocate(first)
    before = bm.pool.stats()
    second = engine.EngineSequence(1, list(range(13)) + [99], 4, (0, 1))
    assert bm.can_allocate(second) == 3
    assert bm.pool.stats() == before, "no LRU touch, no block taken, no statistics"
    big = engine.EngineSequence(2, list(range(500, 540)), 4, (1, 0))
    assert bm.can_allocate(big) == -1, "10 blocks do not fit in 8"
    bm.allocate(second, 3)
    assert second.num_cached_tokens == 12
    assert bm.pool.stats()["prefix_hit_tokens"] == 12


def test_every_id_of_the_kv_tensor_is_usable():
    bm = BlockManager(5, 4)
    engine.EngineSequence.block_size = 4
    seq = engine.EngineSequence(0, list(range(20)), 1, (0, 0))
    assert bm.can_allocate(seq) == 0
    bm.allocate(seq, 0)
    assert sorted(seq.block_table) == [0, 1, 2, 3, 4], "id 0 of kvpool is not lost"
    assert bm.can_allocate(engine.EngineSequence(1, [1, 2], 1, (1, 0))) == -1


@pytest.mark.parametrize("dp_size", [2, 3])
def test_dp_ranks_are_rejected_not_mapped_onto_one_tensor(dp_size):
    """G2: every dp rank hands out ids of its own range, and nano-vllm has one KV tensor, so two
    ranks' sequences would share its slots: dp_size other than 1 is a ValueError naming it."""
    with pytest.raises(ValueError, match="dp_size"):
        BlockManager(8, 4, dp_size=dp_size)
    bm = BlockManager(8, 4, dp_size=1)
    engine.EngineSequence.block_size = 4
    a = engine.EngineSequence(0, list(range(100, 110)), 4, (0, 0))
    b = engine.EngineSequence(1, list(range(200, 210)), 4, (1, 0))
    for s in (a, b):
        bm.allocate(s, bm.can_allocate(s))
    assert not set(a.block_table) & set(b.block_table), "unrelated sequences share no KV slot"
    bm.pool.check()


def test_bad_counts_name_their_argument():
    """R29 on the drop-in's own ints: a bool or a float is a TypeError naming the argument."""
    for bad in (True, 8.0):
        with pytest.raises(TypeError, match="num_blocks"):
            BlockManager(bad, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    bm = BlockManager(8, 4)
    engine.EngineSequence.block_size = 4
    seq = engine.EngineSequence(0, list(range(6)), 1, (0, 0))
    for bad in (False, 0.0):
        with pytest.raises(TypeError, match="num_cached_blocks"):
            bm.allocate(seq, bad)
    assert seq.block_table == [] and bm.pool.num_used_blocks == 0
    bm.allocate(seq, bm.can_allocate(seq))
    bm.pool.check()


def test_same_step_prefixes_are_deduplicated_in_the_tables():
    bm = BlockManager(32, 4)
    engine.EngineSequence.block_size = 4
    system = list(range(100, 112))
    a = engine.EngineSequence(0, system + [1, 2], 4, (0, 0))
    b = engine.EngineSequence(1, system + [3, 4], 4, (1, 0))
    for s in (a, b):
        bm.allocate(s, bm.can_allocate(s))
    for s in (a, b):
        s.num_scheduled_tokens = len(s)
        bm.hash_blocks(s)
        s.num_cached_tokens = len(s)
    assert a.block_table[:3] == b.block_table[:3]
    assert bm.pool.stats()["num_used_blocks"] == 5
    bm.pool.check()


def test_decode_steps_that_need_no_block_make_no_call_into_rust():
    bm = BlockManager(64, 16)
    engine.EngineSequence.block_size = 16
    seq = engine.EngineSequence(0, list(range(20)), 40, (0, 0))
    bm.allocate(seq, bm.can_allocate(seq))
    seq.num_scheduled_tokens = 20
    bm.hash_blocks(seq)
    seq.num_cached_tokens = 20
    seq.append_token(7)
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    real, bm.pool = bm.pool, Spy()
    twin = bm._twin
    bm._twin = lambda s: calls.append("twin") or twin(s)
    for _ in range(11):  # the KV of tokens 21..31: inside the second block, never full
        assert bm.can_append(seq)
        bm.may_append(seq)
        seq.num_scheduled_tokens = 1
        bm.hash_blocks(seq)
        seq.num_cached_tokens += 1
        seq.append_token(7)
    assert calls == []
    assert bm.can_append(seq)
    bm.may_append(seq)  # 32 tokens: the table holds them
    assert calls == []
    seq.num_scheduled_tokens = 1
    bm.hash_blocks(seq)  # token 32's KV fills the second block: published
    assert "cache" in calls


# ---------------------------------------------------------------------------------------------
# nano-vllm's own Scheduler, when a checkout is at hand
# ---------------------------------------------------------------------------------------------


def import_nanovllm(src: Path):
    """nano-vllm's scheduler and sequence modules without its model stack (torch, transformers)."""
    package = types.ModuleType("nanovllm")
    package.__path__ = [str(src / "nanovllm")]
    engine_package = types.ModuleType("nanovllm.engine")
    engine_package.__path__ = [str(src / "nanovllm" / "engine")]
    config = types.ModuleType("nanovllm.config")
    config.Config = object
    sys.modules.update(
        {"nanovllm": package, "nanovllm.engine": engine_package, "nanovllm.config": config}
    )
    import nanovllm.engine.scheduler as scheduler
    import nanovllm.engine.sequence as sequence
    import nanovllm.sampling_params as sampling

    return scheduler, sequence, sampling


@pytest.mark.skipif("NANOVLLM_SRC" not in os.environ, reason="needs a nano-vllm checkout")
def test_nanovllm_real_scheduler_runs_on_the_drop_in():
    scheduler_module, sequence_module, sampling = import_nanovllm(Path(os.environ["NANOVLLM_SRC"]))
    block_size = 256
    sequence_module.Sequence.block_size = block_size
    config = types.SimpleNamespace(
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        eos=-1,
        kvcache_block_size=block_size,
        num_kvcache_blocks=40,
    )
    schedules = {}
    for name in ("nano", "kvpool"):
        scheduler = scheduler_module.Scheduler(config)
        if name == "kvpool":
            scheduler.block_manager = BlockManager(40, block_size)  # the one-line swap
        model = engine.FakeModel(40, block_size)
        system = list(range(1, 700))
        params = sampling.SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
        seqs = [sequence_module.Sequence(system + [1000 + i] * (i + 1), params) for i in range(12)]
        for i, s in enumerate(seqs):
            s.conv = (i, 0)
            scheduler.add(s)
        steps = []
        while not scheduler.is_finished():
            batch, is_prefill = scheduler.schedule()
            steps.append(
                (is_prefill, [(s.seq_id - seqs[0].seq_id, s.num_scheduled_tokens) for s in batch])
            )
            scheduler.postprocess(batch, model.run(batch, is_prefill), is_prefill)
        schedules[name] = steps
        if name == "kvpool":
            all_back(scheduler.block_manager)
    assert schedules["kvpool"] == schedules["nano"]
