"""Real models on kvpool: ``kvpool.integrations.transformers`` checked against each model's own
full forward (docs/engine.md).

Three tiny random-weight families (a few layers, head_dim 64, built from a config, no
download): Qwen3 (full attention, GQA), Gemma 3 text (local sliding-window and global layers:
groups 0 and 1) and Qwen3-Next (Gated DeltaNet layers beside gated full attention: linear-state
slots). Each runs ``models_harness.chat_workload`` (shared system prompts, multi-turn
follow-ups, greedy and seeded sampling) through ``Engine`` on a pool small enough to force
prefix hits, evictions, recompute preemptions, dedup switches, host-tier loads and (Qwen3-Next)
checkpoint restores; every test asserts it exercised each of them, checks ``pool.check()``
after every step, and compares every logit the engine computed and every sampled token with
the model's own no-cache forward (relative difference at most ``TOLERANCE`` = 1e-4). A
negative control adds 1e-3 to one cached K block and must fail that tolerance.

torch and transformers come with the vLLM venv (``make test-models``); without them the module
is skipped. The ``numpy`` kernel backend runs in CI; the ``emulated`` variants (the kernels'
CUDA sources compiled for the CPU) are marked slow and run outside ``.ci/run``
(``make test-models-slow``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpool.integrations.transformers import Engine, SamplingParams  # noqa: E402
from kvpool.integrations.transformers.models import from_config, tiny_config  # noqa: E402
from models_harness import TOLERANCE, chat_workload, check_against_reference  # noqa: E402

torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and immune to a busy machine

# Engine options per family: pools small enough to preempt and evict (every count asserted).
CONFIGS = {
    "qwen3": dict(num_blocks=28),
    "gemma3": dict(num_blocks=32, swa_num_blocks=28),
    "qwen3_next": dict(num_blocks=32, linear_state_slots=24, checkpoint_interval=16),
}
MORE = {"llama": dict(num_blocks=28), "mistral": dict(num_blocks=28, swa_num_blocks=28)}
COMMON = dict(block_size=8, host_num_blocks=96, max_num_seqs=6, max_num_batched_tokens=64)
_models: dict[str, object] = {}

# The worst relative difference per family, printed at the end (pytest -s) for docs/engine.md.
WORST: dict[str, float] = {}


def model_of(family: str):
    if family not in _models:
        _models[family] = from_config(tiny_config(family), seed=0)
    return _models[family]


def run_family(family: str, backend: str) -> tuple[Engine, dict]:
    model = model_of(family)
    engine = Engine(
        model,
        backend=backend,
        record_logits=True,
        check=True,
        **COMMON,
        **{**CONFIGS, **MORE}[family],
    )
    requests = chat_workload(engine, vocab=model.config.vocab_size)
    result = check_against_reference(model, requests)
    stats = engine.stats()
    assert len(requests) == 18
    assert any(r.params.temperature > 0 for r in requests), "seeded sampling ran"
    return engine, {**stats, **result}


def assert_exercised(family: str, s: dict) -> None:
    """The counts each test asserts: the workload reached every path it is meant to."""
    assert s["prefix_hit_tokens"] > 0, "prefix hits"
    assert s["evictions"] > 0, "evictions"
    assert s["preemptions"] > 0, "recompute preemptions"
    assert s["switches"] > 0, "dedup switches"
    assert s["host_loaded_blocks"] > 0 and s["host_offloaded_blocks"] > 0, "host tier"
    if family == "gemma3":
        assert s["window_releases"] > 0, "window slides"
    if family == "qwen3_next":
        assert s["linear_state_hits"] > 0 and s["runner_restores"] > 0, "checkpoint restores"
        assert s["runner_saves"] > 0 and s["runner_zeroed_slots"] > 0, "saves and zeroed slots"


@pytest.mark.parametrize("family", list(CONFIGS))
def test_model_matches_its_own_forward_numpy(family):
    engine, s = run_family(family, "numpy")
    assert_exercised(family, s)
    assert s["worst"] <= TOLERANCE and s["chunks"] > 100 and s["tokens"] > 100
    WORST[family] = s["worst"]
    print(
        f"\n{family} (numpy): worst relative logit difference {s['worst']:.2e} over "
        f"{s['chunks']} chunks, {s['tokens']} tokens; counts: "
        + ", ".join(
            f"{k}={s[k]}"
            for k in (
                "prefix_hit_tokens",
                "evictions",
                "preemptions",
                "switches",
                "host_loaded_blocks",
                "linear_state_hits",
                "window_releases",
            )
            if k in s
        )
    )


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_more_families_match_their_own_forward(family):
    """Llama (full attention) and Mistral (every layer windowed: group 0 holds no memory)."""
    _, s = run_family(family, "numpy")
    assert s["prefix_hit_tokens"] > 0 and s["preemptions"] > 0 and s["switches"] > 0
    if family == "mistral":
        assert s["window_releases"] > 0
    WORST[family] = s["worst"]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CONFIGS))
def test_model_matches_its_own_forward_emulated(family):
    engine, s = run_family(family, "emulated")
    assert_exercised(family, s)
    print(f"\n{family} (emulated): worst {s['worst']:.2e}")


def test_negative_control_a_perturbed_cached_block_fails_the_tolerance():
    """Adding 1e-3 to one cached K block of the shared system prompt makes the next turn's
    logits miss the reference by more than the tolerance: the check sees the cache's content."""
    model = model_of("qwen3")
    engine = Engine(
        model,
        backend="numpy",
        record_logits=True,
        num_blocks=64,
        block_size=8,
        max_num_batched_tokens=64,
    )
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 512, (40,), generator=g).tolist()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = engine.add_request(system + [7, 8, 9], params)
    engine.step()
    block = first.block_id(1)  # tokens 8..15 of the system prompt, cached when `first` ends
    while engine.has_unfinished():
        engine.step()
    check_against_reference(model, [first])  # clean
    for perturb in (False, True):
        if perturb:
            k_cache, _ = engine.runner.kv_caches[0]
            k_cache[block] += 1e-3
        req = engine.add_request(system + [10, 11, 12 + perturb], params)
        while engine.has_unfinished():
            engine.step()
        assert req.num_hit_tokens == 40, "the next turn hits the system prompt"
        if perturb:
            with pytest.raises(AssertionError, match="positions"):
                check_against_reference(model, [req])
        else:
            check_against_reference(model, [req])
