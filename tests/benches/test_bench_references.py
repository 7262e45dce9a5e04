"""The pure-Python reference block managers of benches/compare/ (``python benches/compare.py``),
and a tiny compare run. They are benchmark code, not the library: they live in the repository,
outside the wheel, and are imported from there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import kvpool
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches" / "compare"))
import compare  # noqa: E402
import nanovllm_reference as nano  # noqa: E402
import vllm_reference as vref  # noqa: E402
from adapters import export_lists  # noqa: E402

HAS_POOL = hasattr(kvpool, "BlockManagerPool")


# ------------------------------------------------------------------------------------------------
# nano-vllm-style BlockManager


def _nano_prefill(bm: nano.BlockManager, seq: nano.NanoSequence) -> int:
    """Admit + prefill + publish, as the nano-vllm scheduler does; returns hit tokens."""
    n = bm.can_allocate(seq)
    assert n >= 0
    bm.allocate(seq, n)
    seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
    hit = seq.num_cached_tokens
    bm.hash_blocks(seq)
    seq.num_cached_tokens = len(seq)
    return hit


def test_nano_eleven_tokens_take_three_blocks():
    bm = nano.BlockManager(8, 4)
    seq = nano.NanoSequence(range(11), 4)
    assert seq.num_blocks == 3 and seq.last_block_num_tokens == 3
    assert bm.can_allocate(seq) == 0
    bm.allocate(seq, 0)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)


def test_nano_append_fifth_token_needs_a_block():
    bm = nano.BlockManager(2, 4)
    seq = nano.NanoSequence([1, 2, 3, 4], 4)
    _nano_prefill(bm, seq)
    assert len(seq.block_table) == 1
    seq.append_token(5)  # 5 tokens: the fifth's KV goes into a new block
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 0
    seq.num_scheduled_tokens = 1
    bm.hash_blocks(seq)
    seq.num_cached_tokens += 1
    seq.append_token(6)  # 6 tokens: nothing needed, even with no free block
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    # a second sequence at a block boundary cannot append with nothing free
    other = nano.NanoSequence([9, 9, 9, 9, 9], 4)
    assert not bm.can_append(other)


def test_nano_shared_prefix_ref_count():
    bm = nano.BlockManager(16, 4)
    a = nano.NanoSequence(list(range(8)) + [100, 101], 4)
    b = nano.NanoSequence(list(range(8)) + [200, 201, 202], 4)
    assert _nano_prefill(bm, a) == 0
    assert _nano_prefill(bm, b) == 8
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert not set(shared) & set(bm.free_block_ids)
    bm.deallocate(b)
    assert set(shared) <= set(bm.free_block_ids)
    assert bm.num_free_blocks == 16
    # a freed block keeps its content and can be revived
    c = nano.NanoSequence(list(range(8)) + [7], 4)
    assert _nano_prefill(bm, c) == 8
    assert c.block_table[:2] == shared


def test_nano_never_matches_the_last_block_and_checks_tokens():
    bm = nano.BlockManager(16, 4)
    a = nano.NanoSequence(range(8), 4)
    _nano_prefill(bm, a)
    b = nano.NanoSequence(range(8), 4)  # block aligned and fully cached: last block recomputed
    assert _nano_prefill(bm, b) == 4
    # a forged dict entry (a "collision") is refused by the token check
    c = nano.NanoSequence([50, 51, 52, 53, 54], 4)
    h = nano.compute_hash([50, 51, 52, 53])
    bm.hash_to_block_id[h] = a.block_table[0]  # block holding tokens 0..3
    assert bm.can_allocate(c) == 0


def test_nano_freed_tail_is_reused_first_and_evicted():
    bm = nano.BlockManager(4, 4)
    a = nano.NanoSequence(range(12), 4)  # 3 blocks
    _nano_prefill(bm, a)
    table = list(a.block_table)
    bm.deallocate(a)
    # reverse release: the tail goes back first, after the never-used block
    assert list(bm.free_block_ids) == [3, table[2], table[1], table[0]]
    b = nano.NanoSequence([99] * 8, 4)
    _nano_prefill(bm, b)
    assert b.block_table == [3, table[2]]
    assert bm.num_evictions == 1
    # the head of a's chain survived
    bm.deallocate(b)
    c = nano.NanoSequence(list(range(8)) + [5], 4)
    assert _nano_prefill(bm, c) == 8


def test_nano_extra_key_namespaces():
    bm = nano.BlockManager(16, 4)
    a = nano.NanoSequence(range(9), 4, extra_key=b"lora-a")
    _nano_prefill(bm, a)
    assert _nano_prefill(bm, nano.NanoSequence(range(9), 4, extra_key=b"lora-b")) == 0
    assert _nano_prefill(bm, nano.NanoSequence(range(9), 4)) == 0
    assert _nano_prefill(bm, nano.NanoSequence(range(9), 4, extra_key=b"lora-a")) == 8


# ------------------------------------------------------------------------------------------------
# vLLM-v1-style BlockPool / KVCacheManager


def _ids(blocks):
    return [b.block_id for b in blocks]


def test_vllm_free_queue_pointer_ops():
    blocks = [vref.KVCacheBlock(i) for i in range(6)]
    q = vref.FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6
    assert q.popleft().block_id == 0
    assert _ids(q.popleft_n(2)) == [1, 2]
    assert blocks[1].prev_free_block is None and blocks[1].next_free_block is None
    q.remove(blocks[4])
    assert _ids(q.get_all_free_blocks()) == [3, 5]
    q.append_n([blocks[1], blocks[2]])
    q.prepend_n([blocks[0], blocks[4]])
    assert _ids(q.get_all_free_blocks()) == [0, 4, 3, 5, 1, 2]
    assert q.num_free_blocks == 6
    with pytest.raises(RuntimeError):
        q.remove(vref.KVCacheBlock(9))
    q.popleft_n(6)
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()


def _vllm_prefill(kv: vref.KVCacheManager, rid, tokens, salt=None):
    req = kv.make_request(rid, tokens, cache_salt=salt)
    blocks, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, n, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return req, n


def test_vllm_prefill_sharing_and_lru_eviction_order():
    kv = vref.KVCacheManager(11, 16)
    pool = kv.block_pool
    common = list(range(48))
    r0, hit0 = _vllm_prefill(kv, 0, common + [1000 + i for i in range(7)])  # 55 tokens
    assert hit0 == 0 and kv.get_block_ids(r0) == [1, 2, 3, 4]
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 1, 1]
    assert all(pool.blocks[i].block_hash is not None for i in (1, 2, 3))
    assert pool.blocks[4].block_hash is None  # partial block: not cached
    r1, hit1 = _vllm_prefill(kv, 1, common + [2000 + i for i in range(5)])
    assert hit1 == 48 and kv.get_block_ids(r1) == [1, 2, 3, 5]
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]
    kv.free(r0)
    kv.free(r1)
    # unhashed blocks go to the head (LIFO), hashed ones to the tail in reverse (tail first)
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    # a freed cached block is still findable (lazy eviction) ...
    r2, hit2 = _vllm_prefill(kv, 2, common + [1])
    assert hit2 == 48 and kv.get_block_ids(r2)[:3] == [1, 2, 3]
    kv.free(r2)
    assert _ids(pool.free_block_queue.get_all_free_blocks())[-3:] == [3, 2, 1]
    # ... until a miss pops it: a 160-token miss takes all ten blocks in queue order
    r3, hit3 = _vllm_prefill(kv, 3, [7] * 160)
    assert hit3 == 0
    assert kv.get_block_ids(r3)[-3:] == [3, 2, 1]
    assert pool.num_evictions == 3
    assert len(pool.cached_block_hash_to_block) == 10  # r3: ten chained (distinct) hashes
    kv.free(r3)


def test_vllm_touch_takes_hits_out_of_the_free_queue():
    kv = vref.KVCacheManager(8, 4)
    pool = kv.block_pool
    r0, _ = _vllm_prefill(kv, 0, list(range(9)))
    kv.free(r0)
    assert pool.get_num_free_blocks() == 7
    req = kv.make_request(1, list(range(8)) + [42])
    blocks, n = kv.get_computed_blocks(req)
    assert n == 8 and pool.get_num_free_blocks() == 7  # get_computed_blocks does not touch
    kv.allocate_slots(req, req.num_tokens - n, n, blocks)
    assert pool.get_num_free_blocks() == 4
    free_ids = _ids(pool.free_block_queue.get_all_free_blocks())
    assert not set(free_ids) & {b.block_id for b in blocks}


def test_vllm_hit_leaves_one_token_and_salt_namespaces():
    kv = vref.KVCacheManager(16, 4)
    r0, _ = _vllm_prefill(kv, 0, list(range(8)))
    _, hit = _vllm_prefill(kv, 1, list(range(8)))
    assert hit == 4  # block aligned: the last block is recomputed
    _, hit = _vllm_prefill(kv, 2, list(range(9)))
    assert hit == 8
    _vllm_prefill(kv, 3, list(range(9)), salt="s1")
    _, hit = _vllm_prefill(kv, 4, list(range(9)), salt="s2")
    assert hit == 0
    _, hit = _vllm_prefill(kv, 5, list(range(9)), salt="s1")
    assert hit == 8


def test_vllm_decode_appends_and_caches():
    kv = vref.KVCacheManager(8, 4)
    req, _ = _vllm_prefill(kv, 0, [1, 2, 3, 4])
    assert kv.get_block_ids(req) == [1]
    req.append_output_token_ids(5)
    assert kv.allocate_slots(req, 1) is not None
    assert kv.get_block_ids(req) == [1, 2]
    req.num_computed_tokens += 1
    for t in (6, 7, 8):
        req.append_output_token_ids(t)
        kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert len(req.block_hashes) == 2 and kv.num_cached_block[0] == 2
    assert kv.block_pool.blocks[2].block_hash is not None


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_vllm_hash_algos(algo):
    pytest.importorskip("xxhash") if algo == "xxhash" else None
    kv = vref.KVCacheManager(8, 4, hash_algo=algo)
    req = kv.make_request(0, list(range(9)))
    assert len(req.block_hashes) == 2
    assert len(req.block_hashes[0]) == (32 if algo == "sha256" else 16)


# ------------------------------------------------------------------------------------------------
# driver


def test_export_lists_slots():
    tables, slots = export_lists([[3, 5], [7]], [2, 0], [6, 3], 4)
    assert tables.tolist() == [[3, 5], [7, 0]]
    assert slots.tolist() == [14, 15, 20, 21, 28, 29, 30]


def test_references_agree_without_eviction():
    trace = compare.build_trace("mixed", 40, seed=3)
    results = []
    for name in ("nano-vllm-ref", "vllm-v1-ref"):
        adapter = compare.make_adapter(name, 1 << 15, 16)
        results.append(compare.replay(adapter, trace))
    assert all(r.first_eviction_step is None for r in results)
    (check,) = compare.cross_check(results)
    assert check["num_mismatches"] == 0
    assert check["compared_requests"] + check["excluded_same_step"] == 40
    assert check["compared_hit_tokens"] > 0


def test_compare_main_tiny(capsys, tmp_path):
    out = tmp_path / "r.json"
    managers = "kvpool,nano-vllm-ref,vllm-v1-ref" if HAS_POOL else "nano-vllm-ref,vllm-v1-ref"
    rc = compare.main(
        ["--requests", "12", "--managers", managers, "--num-blocks", "4096", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "| manager" in text and "nano-vllm-ref" in text and "vllm-v1-ref" in text
    data = json.loads(out.read_text())
    assert {r["manager"] for r in data["results"]} >= {"nano-vllm-ref", "vllm-v1-ref"}
    assert all(r["us_per_request"] > 0 for r in data["results"])


def test_compare_main_rejects_bad_arguments(capsys):
    assert compare.main(["--requests", "0"]) == 2
    assert compare.main(["--managers", "nope"]) == 2
    assert compare.main(["--requests", "3", "--num-blocks", "8", "--managers", "nano-ref"]) == 2


@pytest.mark.skipif(not HAS_POOL, reason="kvpool.BlockManagerPool not built")
def test_kvpool_agrees_with_references_without_eviction():
    trace = compare.build_trace("mixed", 40, seed=5)
    results = [
        compare.replay(compare.make_adapter(n, 1 << 15, 16), trace)
        for n in ("kvpool", "nano-vllm-ref", "vllm-v1-ref")
    ]
    for check in compare.cross_check(results):
        assert check["num_mismatches"] == 0, check
        assert check["compared_requests"] > 0
    hits = [sum(r.hit_tokens.values()) for r in results]
    assert hits[0] == hits[1] > 0


def test_default_block_counts_match():
    # the usable capacity is the same for every manager
    a = compare.make_adapter("nano-vllm-ref", 64, 16)
    b = compare.make_adapter("vllm-v1-ref", 64, 16)
    assert a.bm.num_free_blocks == b.kv.block_pool.get_num_free_blocks() == 63


@pytest.mark.skipif(not HAS_POOL, reason="kvpool.BlockManagerPool not built")
@pytest.mark.parametrize("workload", ["mixed", "chat"])
def test_kvpool_adapter_batch_follows_the_replay(workload):
    """The kvpool adapter's SequenceBatch mirrors the replay's running list at every step (in
    order), its fused advance reserves every next slot, evictions included; at the end every
    sequence has left the batch and the pool is sound."""
    trace = compare.build_trace(workload, 60, seed=2)
    adapter = compare.make_adapter("kvpool", 512, 16)  # small enough to evict
    adapter.verify_order = True
    result = compare.replay(adapter, trace)
    assert result.num_requests == 60 and result.first_eviction_step is not None
    assert len(adapter.batch) == 0
    adapter.batch.check()
    adapter.pool.check()
    stats = adapter.pool.stats()
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == 511
