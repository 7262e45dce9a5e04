"""GPU benchmark of kvpool.kernels (the GPU targets of benches/RESULTS.md): achieved bandwidth against a copy ceiling
measured in the same run.

    python benches/kernels_bench.py            # on a machine with a CUDA GPU and cupy

Prints one table: for each kernel and shape the time per call (cold L2: a 256 MiB buffer is
rewritten before every timed call), the bytes it must move, the achieved bandwidth and its ratio
to the device-to-device copy ceiling (PCIe ceiling for swap_blocks). Decode uses bf16, 32 q / 8 kv
heads, head dim 128, block size 16, batches 1/8/64 and contexts 1k/4k/16k; if torch imports, a
torch gather + scaled_dot_product_attention on the same cache runs beside it. On a machine without
a GPU it says so and exits 0. Designed to finish in well under 5 minutes on an H100/H200.
"""

from __future__ import annotations

import sys
import time

import numpy as np

HQ, HKV, D, BS = 32, 8, 128, 16


class Bench:
    """Timing, cache builders and the rows of the table (cupy imported lazily)."""

    def __init__(self):
        import cupy as cp
        import ml_dtypes

        self.cp = cp
        self.flush = cp.empty(256 << 20, np.uint8)
        self.rows: list[tuple] = []
        try:
            self.dt = np.dtype(ml_dtypes.bfloat16)
            cp.zeros(4, self.dt)
            self.dt_name = "bf16"
        except Exception:  # CuPy without bfloat16 arrays
            self.dt, self.dt_name = np.dtype(np.float16), "f16 (no bf16 in this CuPy)"

    def timeit(self, fn, repeat=10, warmup=2) -> float:
        """Mean GPU seconds per call, L2 flushed before each call."""
        cp = self.cp
        for _ in range(warmup):
            fn()
        total = 0.0
        a, b = cp.cuda.Event(), cp.cuda.Event()
        for _ in range(repeat):
            self.flush.fill(1)
            a.record()
            fn()
            b.record()
            b.synchronize()
            total += cp.cuda.get_elapsed_time(a, b) / 1e3
        return total / repeat

    def row(self, name, shape, sec, nbytes, ceiling, note=""):
        bw = nbytes / sec
        self.rows.append(
            (
                name,
                shape,
                f"{sec * 1e6:9.1f}",
                f"{nbytes / 2**20:9.1f}",
                f"{bw / 1e9:8.1f}",
                f"{bw / ceiling:6.1%}",
                note,
            )
        )

    def rand(self, shape):
        """Values in [0.5, 2): bit patterns around 1.0 of bf16 / fp16."""
        one = 0x3F80 if self.dt.name == "bfloat16" else 0x3C00
        bits = self.cp.random.randint(one - 0x80, one + 0x80, size=shape, dtype=np.uint16)
        return bits.view(self.dt)

    def paged(self, batch, ctx, rng):
        nblk = ctx // BS
        nb = batch * nblk + 1
        kc, vc = self.rand((nb, BS, HKV, D)), self.rand((nb, BS, HKV, D))
        bt = rng.permutation(np.arange(1, nb)).astype(np.int32).reshape(batch, nblk)
        return kc, vc, self.cp.asarray(bt), self.cp.full(batch, ctx, np.int32)


def ceilings(b: Bench) -> tuple[float, float, float]:
    cp = b.cp
    import cupyx

    src = cp.empty(1 << 30, np.uint8)
    dst = cp.empty_like(src)
    t = b.timeit(lambda: cp.copyto(dst, src))
    d2d = 2 * src.nbytes / t
    b.row("d2d copy (ceiling)", "1 GiB", t, 2 * src.nbytes, d2d)
    pin = cupyx.empty_pinned((256 << 20,), np.uint8)
    dbuf = cp.empty(pin.nbytes, np.uint8)
    rt, stream = cp.cuda.runtime, cp.cuda.get_current_stream()
    t = b.timeit(
        lambda: rt.memcpyAsync(
            pin.ctypes.data, dbuf.data.ptr, pin.nbytes, rt.memcpyDeviceToHost, stream.ptr
        )
    )
    d2h = pin.nbytes / t
    b.row("memcpy D2H (PCIe ceiling)", "256 MiB", t, pin.nbytes, d2h)
    t = b.timeit(
        lambda: rt.memcpyAsync(
            dbuf.data.ptr, pin.ctypes.data, pin.nbytes, rt.memcpyHostToDevice, stream.ptr
        )
    )
    h2d = pin.nbytes / t
    b.row("memcpy H2D (PCIe ceiling)", "256 MiB", t, pin.nbytes, h2d)
    return d2d, d2h, h2d


def copies(b: Bench, d2d: float, d2h: float, h2d: float) -> None:
    import cupyx
    import kvpool.kernels as K

    cp = b.cp
    ntok = 16384
    nb = ntok // BS + 1
    kc, vc = b.rand((nb, BS, HKV, D)), b.rand((nb, BS, HKV, D))
    k, v = b.rand((ntok, HKV, D)), b.rand((ntok, HKV, D))
    slots = cp.asarray(np.random.default_rng(0).permutation(np.arange(BS, nb * BS))[:ntok])
    t = b.timeit(lambda: K.write_kv(k, v, kc, vc, slots, backend="cupy", validate=False))
    b.row("write_kv", f"{ntok} tok x {HKV}x{D}", t, 2 * 2 * k.nbytes, d2d)

    layers, pairs = 16, 512
    caches = [b.rand((2 * pairs + 1, BS, HKV, D)) for _ in range(2 * layers)]
    perm = np.random.default_rng(1).permutation(np.arange(1, 2 * pairs + 1)).astype(np.int32)
    s_ids, d_ids = cp.asarray(perm[:pairs]), cp.asarray(perm[pairs:])
    blk = caches[0][0].nbytes
    t = b.timeit(lambda: K.copy_blocks(caches, s_ids, d_ids, backend="cupy", validate=False))
    b.row("copy_blocks", f"{2 * layers} caches x {pairs} blk", t, 2 * 2 * layers * pairs * blk, d2d)

    state = cp.zeros((2 * 256 + 1, 32, 128, 128), np.float32)  # 2 MiB per slot
    sp = np.random.default_rng(2).permutation(np.arange(1, 513)).astype(np.int32)
    s_sl, d_sl = cp.asarray(sp[:256]), cp.asarray(sp[256:])
    t = b.timeit(lambda: K.copy_linear_state(state, s_sl, d_sl, backend="cupy", validate=False))
    b.row("copy_linear_state", "256 slots x 2 MiB", t, 2 * 256 * state[0].nbytes, d2d)

    nswap = 1024
    host = cupyx.empty_pinned((nswap + 1, BS, HKV, D), b.dt)
    dcache = b.rand((nswap + 1, BS, HKV, D))
    ids = cp.arange(1, nswap + 1, dtype=np.int32)
    t = b.timeit(lambda: K.swap_blocks(dcache, host, ids, ids, backend="cupy", validate=False))
    b.row("swap_blocks D2H", f"{nswap} blk x {blk >> 10} KiB", t, nswap * blk, d2h)
    t = b.timeit(lambda: K.swap_blocks(host, dcache, ids, ids, backend="cupy", validate=False))
    b.row("swap_blocks H2D", f"{nswap} blk x {blk >> 10} KiB", t, nswap * blk, h2d)


def torch_decode(b: Bench, q, kc, vc, bt, ctx):
    """A torch gather + SDPA on the same cache, or None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except Exception:
        return None
    tdt = torch.bfloat16 if b.dt.name == "bfloat16" else torch.float16
    tq, tk, tv = (torch.as_tensor(x.view(np.uint16), device="cuda").view(tdt) for x in (q, kc, vc))
    tb = torch.as_tensor(bt, device="cuda").long()
    batch = q.shape[0]

    def run():
        kk = tk[tb].reshape(batch, ctx, HKV, D).transpose(1, 2)
        vv = tv[tb].reshape(batch, ctx, HKV, D).transpose(1, 2)
        return F.scaled_dot_product_attention(
            tq[:, :, None], kk, vv, scale=D**-0.5, enable_gqa=True
        )[:, :, 0]

    return run, (lambda out: torch.as_tensor(out.view(np.uint16), device="cuda").view(tdt))


def decode(b: Bench, d2d: float) -> None:
    import kvpool.kernels as K

    cp = b.cp
    rng = np.random.default_rng(3)
    for batch in (1, 8, 64):
        for ctx in (1024, 4096, 16384):
            kc, vc, bt, lens = b.paged(batch, ctx, rng)
            q = b.rand((batch, HQ, D))
            out = cp.empty_like(q)
            t = b.timeit(
                lambda q=q, kc=kc, vc=vc, bt=bt, lens=lens, out=out: K.paged_decode_attention(
                    q, kc, vc, bt, lens, D**-0.5, out, backend="cupy", validate=False
                )
            )
            kv_bytes = 2 * batch * ctx * HKV * D * b.dt.itemsize
            note = ""
            ref = torch_decode(b, q, kc, vc, bt, ctx)
            if ref is not None:
                run, as_torch = ref
                tt = b.timeit(run, repeat=5)
                diff = (as_torch(out).float() - run().float()).abs().max().item()
                note = (
                    f"torch gather+SDPA {tt * 1e6:.0f} us ({kv_bytes / tt / 1e9:.0f} GB/s), "
                    f"max|diff| {diff:.1e}"
                )
            b.row("paged_decode", f"b{batch} ctx{ctx // 1024}k {b.dt_name}", t, kv_bytes, d2d, note)
            del kc, vc, ref
            cp.get_default_memory_pool().free_all_blocks()


def prefill(b: Bench, d2d: float) -> None:
    import kvpool.kernels as K

    cp = b.cp
    batch, prefix, chunk = 4, 2048, 1024
    kc, vc, bt, lens = b.paged(batch, prefix + chunk, np.random.default_rng(4))
    cu = cp.arange(0, (batch + 1) * chunk, chunk, dtype=np.int32)
    q = b.rand((batch * chunk, HQ, D))
    out = cp.empty_like(q)
    t = b.timeit(
        lambda: K.paged_prefill_attention(
            q, kc, vc, bt, cu, lens, D**-0.5, out=out, backend="cupy", validate=False
        ),
        repeat=5,
    )
    flops = 4 * batch * HQ * D * chunk * (prefix + chunk / 2)
    b.row(
        "paged_prefill",
        f"b{batch} {prefix}+{chunk} {b.dt_name}",
        t,
        2 * batch * (prefix + chunk) * HKV * D * b.dt.itemsize,
        d2d,
        f"{flops / t / 1e12:.1f} TFLOP/s (CUDA cores)",
    )


def main() -> int:
    from kvpool.kernels import _backend

    if not _backend.gpu_available():
        print("kernels_bench: needs a CUDA GPU and cupy (none found); nothing to measure.")
        return 0
    t0 = time.time()
    b = Bench()
    props = b.cp.cuda.runtime.getDeviceProperties(b.cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    d2d, d2h, h2d = ceilings(b)
    copies(b, d2d, d2h, h2d)
    decode(b, d2d)
    prefill(b, d2d)
    head = ("kernel", "shape", "time us", "MiB", "GB/s", "ratio", "note")
    widths = [max(len(str(r[i])) for r in [head, *b.rows]) for i in range(len(head))]
    print(f"kvpool kernels on {name} (ratio: to the d2d copy ceiling; swap: to PCIe memcpy)")
    for r in [head, *b.rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
