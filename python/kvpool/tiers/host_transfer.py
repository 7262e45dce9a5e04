"""Executors that carry out the transfer plans of ``kvpool.HierarchyBlockManagerPool`` (R26).

A plan (``kvpool.TransferPlan``) says: on dp rank ``plan.dp_rank``, copy block ``plan.src[i]``
to block ``plan.dst[i]``, host -> device for a load, device -> host for an offload. An executor
holds, per dp rank, the device caches and the matching host caches: lists of arrays whose first
axis is the block id, e.g. per layer ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (docs/contract.md, K1; host arrays
``[host_num_blocks, block_size, num_kv_heads, head_dim]``, same dtype). Each plan is one
``kvpool.kernels.swap_blocks`` call per cache array (K4).

The engine's step, with ``ex`` an executor and ``pool`` the hierarchy pool::

    ex.run_offloads(pool.take_offload_plans(), pool)   # runs, then complete_offloads
    ex.run_loads(pool.take_load_plans(), pool)         # runs, then complete_loads
    ... forward step ...

Loads and offloads never name the same block, so their order does not matter. Without ``pool``
the ``run_*`` methods only copy; confirm with ``pool.complete_loads(plans)`` yourself.

With a remote tier (``pool.remote``), ``step(pool)`` also runs the remote side through
``kvpool.tiers.remote_transfer.RemoteTransfer``: offloaded host blocks go to the remote tier per
``pool.remote_policy``, fetch plans are fetched, verified and written into host staging blocks
(``complete_fetches``) before the loads run. Executors implement
``kvpool.tiers.remote_transfer.HostBlockIO`` (a block's payload body is the block of every host
cache array, in order, concatenated).

- ``NumpyTransferExecutor``: NumPy arrays on the CPU (synchronous; tests, simulation).
- ``CupyTransferExecutor``: CuPy device caches and pinned host memory (``cupyx.empty_pinned``),
  copies on a CUDA stream; ``run_*`` synchronizes that stream before confirming.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["CupyTransferExecutor", "NumpyTransferExecutor", "TransferExecutor"]


def _per_rank(caches: Any, name: str) -> list[list[Any]]:
    """``caches`` as a list (per rank) of lists of arrays; a flat list of arrays is rank 0."""
    if hasattr(caches, "shape"):
        return [[caches]]
    try:
        items = list(caches)
    except TypeError:
        raise TypeError(
            f"{name}: must be an array, a list of arrays, or a list (per dp rank) "
            f"of lists of arrays, got {type(caches).__name__}"
        ) from None
    if not items:
        raise ValueError(f"{name}: must not be empty")
    if all(hasattr(a, "shape") for a in items):
        return [items]
    out = []
    for r, rank in enumerate(items):
        if hasattr(rank, "shape"):
            raise TypeError(f"{name}: mixes arrays and per-rank lists (entry {r})")
        arrays = list(rank)
        if not arrays or not all(hasattr(a, "shape") for a in arrays):
            raise TypeError(f"{name}[{r}]: must be a non-empty list of arrays")
        out.append(arrays)
    return out


class TransferExecutor:
    """Base of the executors: pairs device and host caches, runs plans with ``swap_blocks``.

    Parameters
    ----------
    device_caches, host_caches : array, list of arrays, or list (per dp rank) of lists of arrays
        Block axis first; ``host_caches[r][i]`` mirrors ``device_caches[r][i]`` (same block
        shape and dtype, its own number of blocks).
    backend : str
        ``kvpool.kernels`` backend of the copies.
    """

    backend = "numpy"

    def __init__(self, device_caches: Any, host_caches: Any, *, backend: str | None = None) -> None:
        self.device = _per_rank(device_caches, "device_caches")
        self.host = _per_rank(host_caches, "host_caches")
        if backend is not None:
            self.backend = backend
        if len(self.device) != len(self.host):
            raise ValueError(
                f"host_caches: {len(self.host)} ranks, device_caches has {len(self.device)}"
            )
        for r, (dev, host) in enumerate(zip(self.device, self.host, strict=True)):
            if len(dev) != len(host):
                raise ValueError(
                    f"host_caches[{r}]: {len(host)} arrays, device_caches[{r}] has {len(dev)}"
                )
            for i, (d, h) in enumerate(zip(dev, host, strict=True)):
                if tuple(d.shape[1:]) != tuple(h.shape[1:]) or d.dtype != h.dtype:
                    raise ValueError(
                        f"host_caches[{r}][{i}]: block shape {tuple(h.shape[1:])} {h.dtype} "
                        f"differs from device_caches[{r}][{i}]: {tuple(d.shape[1:])} {d.dtype}"
                    )

    # ------------------------------------------------------------------ plan execution
    def _rank(self, plan: Any) -> int:
        r = int(plan.dp_rank)
        if not 0 <= r < len(self.device):
            raise ValueError(f"plans: dp_rank {r} has no caches here ({len(self.device)} ranks)")
        return r

    def _copy(self, src_cache: Any, dst_cache: Any, src: np.ndarray, dst: np.ndarray) -> None:
        from kvpool.kernels import swap_blocks

        swap_blocks(src_cache, dst_cache, src, dst, backend=self.backend)

    def _sync(self) -> None:
        """Waits for the copies issued so far (synchronous backends: nothing to do)."""

    def _run(self, plans: Iterable[Any], to_device: bool) -> list[Any]:
        plans = list(plans)
        for p in plans:
            r = self._rank(p)
            src = np.asarray(p.src, dtype=np.int32)
            dst = np.asarray(p.dst, dtype=np.int32)
            if len(src) == 0:
                continue
            for d, h in zip(self.device[r], self.host[r], strict=True):
                if to_device:
                    self._copy(h, d, src, dst)
                else:
                    self._copy(d, h, src, dst)
        self._sync()
        return plans

    def run_loads(self, plans: Iterable[Any], pool: Any = None) -> int:
        """Copies host -> device for every load plan; with ``pool``, then ``complete_loads``.

        Returns
        -------
        int
            Number of blocks copied (per cache array).
        """
        plans = self._run(plans, to_device=True)
        if pool is not None and plans:
            pool.complete_loads(plans)
        return sum(len(p.src) for p in plans)

    def run_offloads(self, plans: Iterable[Any], pool: Any = None) -> int:
        """Copies device -> host for every offload plan; with ``pool``, then ``complete_offloads``.

        Returns
        -------
        int
            Number of blocks copied (per cache array).
        """
        plans = self._run(plans, to_device=False)
        if pool is not None and plans:
            pool.complete_offloads(plans)
        return sum(len(p.src) for p in plans)

    def step(self, pool: Any) -> tuple[int, int]:
        """Takes, runs and confirms the pool's pending offloads, then (with a remote tier) its
        fetches, then its loads.

        Returns
        -------
        (int, int)
            Blocks offloaded and loaded.
        """
        remote = self.remote_transfer(pool)
        plans = pool.take_offload_plans()
        if remote is not None:
            remote.before_host_writes(plans)
        off = self.run_offloads(plans, pool)
        if remote is not None:
            remote.after_offloads(plans)
            remote.run_fetches(pool.take_fetch_plans())
        on = self.run_loads(pool.take_load_plans(), pool)
        return off, on

    def remote_transfer(self, pool: Any) -> Any:
        """The ``kvpool.tiers.remote_transfer.RemoteTransfer`` of ``pool`` over these host caches,
        or None when the pool has no remote tier."""
        if getattr(pool, "remote", None) is None:
            return None
        cached = getattr(self, "_remote", None)
        if cached is None or cached.pool is not pool:
            from kvpool.tiers.remote_transfer import RemoteTransfer

            cached = RemoteTransfer(pool, self)
            self._remote = cached
        return cached

    # ------------------------------------------------------------------ remote_transfer.HostBlockIO
    def host_block_spec(self, rank: int) -> str:
        """Dtype and block shape of every host cache array of ``rank``."""
        from kvpool.tiers.payload import block_spec

        return block_spec(self.host[rank])

    def host_block_nbytes(self, rank: int) -> int:
        """Bytes of one host block of ``rank`` across every cache array (a payload body)."""
        return sum(a[0].nbytes for a in self.host[rank])

    def read_host_blocks(self, rank: int, ids: Sequence[int]) -> list[bytes]:
        """The payload bodies of host blocks ``ids`` of ``rank``."""
        arrays = self.host[rank]
        return [b"".join(np.ascontiguousarray(a[int(i)]).tobytes() for a in arrays) for i in ids]

    def write_host_blocks(self, rank: int, ids: Sequence[int], bodies: Sequence[Any]) -> None:
        """Writes payload bodies (as ``read_host_blocks`` makes them) into host blocks ``ids``."""
        arrays = self.host[rank]
        sizes = [a[0].nbytes for a in arrays]
        if len(ids) != len(bodies):
            raise ValueError(f"bodies: {len(bodies)} bodies for {len(ids)} ids")
        for i, body in zip(ids, bodies, strict=True):
            if len(body) != sum(sizes):
                raise ValueError(
                    f"bodies: {len(body)} bytes, a block of rank {rank} has {sum(sizes)}"
                )
            off = 0
            for a, n in zip(arrays, sizes, strict=True):
                a[int(i)] = np.frombuffer(body, dtype=a.dtype, count=a[0].size, offset=off).reshape(
                    a.shape[1:]
                )
                off += n

    def transfer(self, plans: Sequence[Any], *, to_device: bool) -> None:
        """The simulator's hook (``kvpool.sim``): runs ``plans`` without confirming them."""
        if not isinstance(to_device, (bool, np.bool_)):
            raise TypeError(f"to_device: must be a bool, got {type(to_device).__name__}")  # R29
        self._run(plans, to_device)


class NumpyTransferExecutor(TransferExecutor):
    """Runs plans on NumPy caches (CPU, synchronous).

    Parameters
    ----------
    device_caches, host_caches : numpy arrays (see ``TransferExecutor``)
    backend : {"numpy", "emulated"}
        ``"numpy"`` (default) copies with the reference; ``"emulated"`` runs the CUDA kernel
        compiled for the CPU.
    """

    backend = "numpy"


class CupyTransferExecutor(TransferExecutor):
    """Runs plans on a GPU: CuPy device caches, pinned host caches, one CUDA stream.

    Parameters
    ----------
    device_caches : cupy arrays (see ``TransferExecutor``)
    host_caches : numpy arrays in pinned memory (``CupyTransferExecutor.pinned_like``)
    stream : cupy.cuda.Stream or None
        Stream of the copies; None makes a non-blocking one.
    """

    backend = "cupy"

    def __init__(self, device_caches: Any, host_caches: Any, *, stream: Any = None) -> None:
        super().__init__(device_caches, host_caches)
        import cupy

        self.stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)

    @staticmethod
    def pinned_like(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A zeroed NumPy array in pinned (page-locked, UVA-mapped) host memory."""
        import cupyx

        return cupyx.zeros_pinned(shape, dtype)

    def _copy(self, src_cache: Any, dst_cache: Any, src: np.ndarray, dst: np.ndarray) -> None:
        from kvpool.kernels import swap_blocks

        swap_blocks(src_cache, dst_cache, src, dst, self.stream, backend="cupy")

    def _sync(self) -> None:
        self.stream.synchronize()
