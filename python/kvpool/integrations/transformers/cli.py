"""``kvpool generate``: a Hugging Face causal LM served with its KV in kvpool (docs/engine.md).

    kvpool generate MODEL --prompts FILE [options]

MODEL is a hub id, a local checkpoint directory, a ``config.json`` (random weights) or
``tiny-<family>`` (qwen3, llama, gemma3, mistral, qwen3-next: random weights, no download);
``--random-weights`` takes only the config of a hub id or directory. FILE has one prompt per
line: plain text (tokenized by the model's tokenizer; without one, each UTF-8 byte is a token
id), or JSON: a list of token ids, ``{"token_ids": [...]}`` or ``{"prompt": "..."}``. Outputs go
to stdout, one line per prompt (``--json``: one JSON object per prompt); a summary (tokens per
second, prefix hits, preemptions) goes to stderr. ``--check`` compares every computed logit and
every sampled token with the model's own full forward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

USAGE = "kvpool generate MODEL --prompts FILE [options]"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvpool generate", description=__doc__.split("\n\n")[0], usage=USAGE
    )
    p.add_argument("model", help="hub id, checkpoint directory, config.json or tiny-<family>")
    p.add_argument("--prompts", required=True, help="file of prompts, one per line ('-': stdin)")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights from the model's config (no weight download)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="pool blocks (default: room for --max-num-seqs of the longest request)",
    )
    p.add_argument("--host-blocks", type=int, default=0, help="a host tier of this many blocks")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        default=None,
        help="linear-state checkpoints every N tokens (GDN models)",
    )
    p.add_argument("--linear-state-slots", type=int, default=None)
    p.add_argument(
        "--backend",
        choices=("numpy", "emulated", "cupy"),
        default=None,
        help="kvpool.kernels backend (default: cupy with a GPU, else emulated/numpy)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda for cupy)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument(
        "--check", action="store_true", help="compare every logit with the model's own full forward"
    )
    return p.parse_args(argv)


def read_prompts(path: str, tokenizer: Any, vocab: int) -> list[list[int]]:
    f = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    prompts = []
    with f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            item: Any = line
            if line.lstrip()[:1] in "[{":
                try:
                    item = json.loads(line)
                except json.JSONDecodeError:
                    item = line
            if isinstance(item, dict):
                item = item.get("token_ids", item.get("prompt"))
            if isinstance(item, list):
                ids = [int(t) for t in item]
            elif tokenizer is not None:
                ids = tokenizer(str(item))["input_ids"]
            else:
                ids = [b % vocab for b in str(item).encode()]
            if not ids:
                raise SystemExit(f"kvpool generate: an empty prompt in {path}")
            if max(ids) >= vocab or min(ids) < 0:
                raise SystemExit(f"kvpool generate: a token id outside the vocabulary ({vocab})")
            prompts.append(ids)
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        import torch

        from kvpool.integrations.transformers import Engine, SamplingParams
        from kvpool.integrations.transformers.models import load_model
    except ImportError as e:
        print(f"kvpool generate needs torch and transformers ({e})", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if args.backend == "cupy" else "cpu")
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_model(
        args.model, random_weights=args.random_weights, seed=args.seed, dtype=dtype, device=device
    )
    vocab = model.config.get_text_config().vocab_size
    prompts = read_prompts(args.prompts, tokenizer, vocab)
    if not prompts:
        print("kvpool generate: no prompts", file=sys.stderr)
        return 2
    bs = args.block_size
    longest = max(len(p) for p in prompts) + args.max_tokens
    num_blocks = args.num_blocks or args.max_num_seqs * -(-longest // bs) + 1
    eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    engine = Engine(
        model,
        num_blocks=num_blocks,
        block_size=bs,
        host_num_blocks=args.host_blocks,
        linear_state_slots=args.linear_state_slots,
        checkpoint_interval=args.checkpoint_interval,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        backend=args.backend,
        eos_token_id=eos,
        record_logits=args.check,
    )
    reqs = [
        engine.add_request(
            p,
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed + i,
                ignore_eos=args.ignore_eos,
            ),
        )
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - t0
    for i, r in enumerate(reqs):
        text = tokenizer.decode(r.output) if tokenizer is not None else None
        if args.json:
            print(json.dumps({"index": i, "token_ids": r.output, "text": text}))
        else:
            print(text if text is not None else " ".join(map(str, r.output)))
    s = engine.stats()
    out_tokens = sum(len(r.output) for r in reqs)
    print(
        f"kvpool generate: {len(reqs)} prompts, {out_tokens} tokens in {elapsed:.2f} s "
        f"({out_tokens / max(elapsed, 1e-9):.1f} tok/s, {s.get('steps', 0)} steps); prefix hit "
        f"tokens {s['prefix_hit_tokens']}, preemptions {s.get('preemptions', 0)}, dedup "
        f"switches {s.get('switches', 0)}, backend {engine.runner.bridge.backend}",
        file=sys.stderr,
    )
    if args.check:
        worst, same = check(model, reqs)
        print(
            f"kvpool generate: checked against the model's own forward: worst relative logit "
            f"difference {worst:.2e}; greedy tokens equal: {same}",
            file=sys.stderr,
        )
    return 0


def check(model: Any, reqs: list[Any]) -> tuple[float, bool]:
    """The worst relative logit difference, and whether greedy tokens equal the reference's."""
    import torch

    worst, same = 0.0, True
    for r in reqs:
        with torch.inference_mode():
            ref = (
                model(torch.tensor([r.tokens], device=model.device), use_cache=False)
                .logits[0]
                .float()
                .cpu()
            )
        for start, got in r.logits:
            want = ref[start : start + len(got)]
            worst = max(worst, float((got.float() - want).abs().max() / want.abs().max()))
        if r.params.temperature == 0:
            same &= all(
                int(ref[r.prompt_len - 1 + k].argmax()) == t for k, t in enumerate(r.output)
            )
    return worst, same


if __name__ == "__main__":
    sys.exit(main())
