"""Remote-tier benchmark: put/get throughput of Llama-8B-shaped KV blocks against a
local Redis, and the scheduler overhead the remote tier adds per request when nothing is found.

Block: 16 tokens x 32 layers x (K, V) x 8 kv heads x 128 head dim x fp16 = 2 MiB per block.
Starts its own redis-server on 127.0.0.1 (or uses ``--url``). Every loop is bounded in count
and time. Usage::

    python benches/remote_bench.py [--blocks 64] [--batch 16] [--requests 300] [--url redis://127.0.0.1:PORT/0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import kvpool
import numpy as np
from kvpool.tiers.payload import decode_payload, encode_payload, make_namespace
from kvpool.tiers.redis import RedisRemoteTier

BS, LAYERS, KVH, HD = 16, 32, 8, 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="redis:// URL on 127.0.0.1 (default: start one)")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per put/get round")
    ap.add_argument("--batch", type=int, default=16, help="blocks per put_many/get_many call")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=300, help="requests for the overhead test")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds, all phases")
    args = ap.parse_args()
    server = None
    url = args.url
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from redis_helpers import RedisServer

        server = RedisServer(extra=["--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru"])
        server.start()
        url = server.url
    if "127.0.0.1" not in url:
        raise SystemExit("--url: only loopback (127.0.0.1) servers are allowed")
    deadline = time.monotonic() + args.time_limit
    try:
        ns = make_namespace(
            "llama-3-8b",
            dtype="float16",
            num_kv_heads=KVH,
            head_dim=HD,
            block_size=BS,
            num_layers=LAYERS,
        )
        tier = RedisRemoteTier(url, ns, timeout_ms=10_000)
        rng = np.random.default_rng(0)
        block = rng.standard_normal((2 * LAYERS, BS, KVH, HD)).astype(np.float16)
        body = block.tobytes()
        spec = ";".join([f"float16:{BS}x{KVH}x{HD}"] * (2 * LAYERS))
        results: dict[str, float] = {"block_bytes": len(body)}
        put_t = get_t = 0.0
        n_done = 0
        for _ in range(args.rounds):
            if time.monotonic() > deadline:
                break
            toks = [int(x) for x in rng.integers(0, 50_000, size=args.blocks * BS)]
            keys = kvpool.hash_blocks(toks, BS)
            for i in range(0, len(keys), args.batch):
                ks = keys[i : i + args.batch]
                t0 = time.perf_counter()
                tier.put_many(ks, [encode_payload(k, spec, body) for k in ks])
                put_t += time.perf_counter() - t0
            for i in range(0, len(keys), args.batch):
                ks = keys[i : i + args.batch]
                t0 = time.perf_counter()
                got = tier.get_many(ks)
                assert all(
                    decode_payload(k, spec, p, len(body)) is not None
                    for k, p in zip(ks, got, strict=True)
                )
                get_t += time.perf_counter() - t0
            tier.delete_many(keys)
            n_done += len(keys)
        mb = n_done * len(body) / 1e6
        results.update(
            put_blocks_per_s=n_done / put_t,
            put_MB_per_s=mb / put_t,
            get_blocks_per_s=n_done / get_t,
            get_MB_per_s=mb / get_t,
            blocks=n_done,
            batch=args.batch,
        )

        # Scheduler overhead when nothing is found: allocate+deallocate of unique 2k-token prompts.
        def run(remote: RedisRemoteTier | None) -> tuple[float, int]:
            pool = kvpool.HierarchyBlockManagerPool(
                4096, 4096, BS, remote=remote, remote_budget_ms=50
            )
            r = random.Random(1)
            t = 0.0
            n = 0
            for _ in range(args.requests):
                if time.monotonic() > deadline:
                    break
                seq = kvpool.Sequence([r.randrange(50_000) for _ in range(2048)])
                t0 = time.perf_counter()
                assert pool.allocate(seq)
                t += time.perf_counter() - t0
                pool.deallocate(seq)
                pool.complete_offloads(pool.take_offload_plans())
                n += 1
            calls = remote.stats()["exists_calls"] if remote is not None else 0
            return t / max(n, 1), calls

        base, _ = run(None)
        remote = RedisRemoteTier(url, ns + "/overhead")
        with_remote, calls = run(remote)
        results.update(
            allocate_us_without_remote=base * 1e6,
            allocate_us_with_remote=with_remote * 1e6,
            remote_overhead_us_per_request=(with_remote - base) * 1e6,
            exists_round_trips_per_request=calls / max(args.requests, 1),
            blocks_asked_per_request=2047 // BS,
        )
        print(json.dumps(results, indent=2))
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
