"""The workload and the reference check of tests/models (a helper module, imported by name).

``chat_workload`` drives an :class:`~kvpool.integrations.transformers.Engine` through
conversations that share system prompts, each turn a follow-up of the previous one (its prompt
is the whole conversation so far plus new user tokens), submitted when the previous turn
finishes: shared prefixes hit, finished turns leave their blocks cached (and offloaded to a
host tier), the pool is small enough that running sequences are preempted and cached blocks
evicted, and conversations that start in the same step compute the same system prompt twice
(dedup switches).

``check_against_reference`` runs the model's own full forward (no cache, the whole sequence at
once, its default attention) on every finished request and compares every logit the engine
computed, position by position, and every sampled token.
"""

from __future__ import annotations

import torch
from kvpool.integrations.transformers import Engine, SamplingParams

TOLERANCE = 1e-4  # max |engine - reference| / max |reference|, per chunk


def chat_workload(
    engine: Engine,
    *,
    vocab: int,
    num_convs: int = 6,
    turns: int = 3,
    system_len: int = 40,
    num_systems: int = 2,
    seed: int = 0,
    sampled_conv: int | None = 1,
) -> list:
    """Runs the conversations to the end; returns every finished request, in finishing order."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    systems = [rand(system_len) for _ in range(num_systems)]
    history = [systems[i % num_systems] + rand(6 + 2 * i) for i in range(num_convs)]
    turn = [0] * num_convs
    owner: dict[int, int] = {}

    def submit(i: int) -> None:
        max_tokens = 5 + (3 * i + turn[i]) % 6
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if i == sampled_conv:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0.8, seed=100 + turn[i], ignore_eos=True
            )
        req = engine.add_request(history[i], params)
        owner[id(req)] = i

    for i in range(num_convs):
        submit(i)
    finished = []
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 5000, "the engine does not make progress"
        for req in engine.step():
            finished.append(req)
            i = owner[id(req)]
            turn[i] += 1
            if turn[i] < turns:
                history[i] = req.tokens + rand(5 + (i + turn[i]) % 6)
                submit(i)
    return finished


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float()


def check_against_reference(model, requests: list) -> dict:
    """Every recorded chunk's logits and every sampled token against the model's own forward.

    Returns ``worst`` (the largest relative difference), ``chunks`` and ``tokens`` compared.
    Raises AssertionError on a difference above :data:`TOLERANCE` or a different token.
    """
    worst, chunks, tokens = 0.0, 0, 0
    for req in requests:
        ref = reference_logits(model, req.tokens)
        for start, got in req.logits:
            want = ref[start : start + len(got)]
            err = float((got.float() - want).abs().max() / want.abs().max())
            assert err <= TOLERANCE, f"positions {start}..{start + len(got)}: {err:.3e}"
            worst = max(worst, err)
            chunks += 1
        gen = None
        if req.params.temperature > 0:
            gen = torch.Generator().manual_seed(req.params.seed)
        for k, tok in enumerate(req.output):
            row = ref[req.prompt_len - 1 + k]
            if gen is None:
                want_tok = int(torch.argmax(row))
            else:
                probs = torch.softmax(row / req.params.temperature, dim=-1)
                want_tok = int(torch.multinomial(probs, 1, generator=gen))
            assert tok == want_tok, f"request token {k}: {tok} != reference {want_tok}"
            tokens += 1
    return {"worst": worst, "chunks": chunks, "tokens": tokens}
