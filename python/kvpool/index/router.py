"""Routing requests across instances: ``round_robin``, ``least_loaded`` and ``kv_aware``.

``kv_aware`` asks a ``kvpool.KVIndex`` (fed by the instances' KV events) for the request's
matched prefix on every instance and medium in one call, and picks the instance of least cost,
an estimate of the time to first token in token units::

    cost(i) = uncached(i) + load_weight * load(i)
    uncached(i) = prompt_tokens - (w_device * d + w_host * (h - d) + w_remote * (r - h))

where ``d``, ``h``, ``r`` are the prompt tokens instance ``i`` holds on its device, on device or
host, and on any medium (nested prefixes: ``d <= h <= r``), ``w_*`` the share of a token's
prefill a hit on that medium saves (``medium_weights``), and ``load(i)`` the prompt tokens of the
requests routed to ``i`` and not yet finished. With ``shared_remote`` a remote tier is one store
shared by the fleet: its prefix counts for every instance. Ties go to the lowest instance. On a
hybrid instance (a linear-state group) the index's rows are the depth a hit restores (its deepest
checkpoint); with ``recompute_weight`` > 0 the device KV it holds past that depth (``kv - d``
tokens) counts too, each token saving that share of its prefill (it must be recomputed from the
checkpoint; the share says what that saves), in place of the host and remote terms when it saves
more than they do. The routed request's chain is then inserted into the index as speculative
entries (TTL ``speculative_ttl`` on the caller's clock), so that a burst of requests sharing a
prefix follows the first one before its instance's stored events arrive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool._core import KVIndex

__all__ = ["POLICIES", "MEDIUM_WEIGHTS", "Decision", "Router"]

POLICIES = ("round_robin", "least_loaded", "kv_aware")
MEDIUM_WEIGHTS = {"device": 1.0, "host": 0.8, "remote": 0.5}
TokenIds = Sequence[int] | np.ndarray  # a prompt's token ids


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _instance_ids(instances: Any) -> list[int]:
    """``instances`` as a list of ids: ``range(n)`` for a count, else the ids given (ints)."""
    if _is_int(instances):
        return list(range(int(instances)))
    if isinstance(instances, (str, bytes)) or not hasattr(instances, "__iter__"):
        raise TypeError(f"instances: must be an int or a sequence of int ids, got {instances!r}")
    ids = list(instances)
    if not all(_is_int(i) for i in ids):
        raise TypeError(f"instances: the ids must be ints, got {instances!r}")
    return [int(i) for i in ids]


@dataclass(frozen=True)
class Decision:
    """Where a request went, and why.

    ``cached_tokens`` maps each medium to the prompt tokens the chosen instance holds there
    (nested prefixes, as in the module doc); ``cost`` is the policy's cost of the choice
    (``kv_aware``; the load for ``least_loaded``; 0 for ``round_robin``).
    """

    request_id: Any
    instance: int
    cost: float
    prompt_tokens: int
    cached_tokens: dict[str, int] = field(default_factory=dict)


class Router:
    """Routes requests to ``instances`` by ``policy``.

    Parameters
    ----------
    instances : int or sequence of int
        The instance ids (``n`` means ``range(n)``); ids are those of the index's events.
    policy : str
        ``"round_robin"``, ``"least_loaded"`` or ``"kv_aware"``.
    index : kvpool.KVIndex, optional
        Required by ``kv_aware``; with it every policy inserts speculative entries.
    block_size : int
        Tokens per block of the instances' pools (for speculative entries).
    medium_weights : dict, optional
        Share of a token's prefill saved by a hit per medium (default ``MEDIUM_WEIGHTS``).
    load_weight : float
        Weight of an instance's outstanding prompt tokens in the cost.
    shared_remote : bool
        Whether the remote medium is one store shared by the fleet.
    speculative_ttl : float or None
        TTL of the speculative entries (None: none are inserted).
    recompute_weight : float
        Share of a token's prefill saved by device KV held past a hybrid instance's deepest
        checkpoint (module doc); 0 counts those tokens as uncached.
    """

    def __init__(
        self,
        instances: int | Sequence[int],
        policy: str = "kv_aware",
        *,
        index: KVIndex | None = None,
        block_size: int = 16,
        medium_weights: dict[str, float] | None = None,
        load_weight: float = 1.0,
        shared_remote: bool = True,
        speculative_ttl: float | None = 2.0,
        recompute_weight: float = 0.0,
    ) -> None:
        # R29: a bool is no count or id, a flag is a bool (a TypeError naming the argument)
        ids = _instance_ids(instances)
        if isinstance(block_size, (bool, np.bool_)) or not isinstance(
            block_size, (int, np.integer)
        ):
            raise TypeError(f"block_size: must be an int, got {type(block_size).__name__}")
        if not isinstance(shared_remote, (bool, np.bool_)):
            raise TypeError(f"shared_remote: must be a bool, got {type(shared_remote).__name__}")
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(
                f"instances: must be distinct ids >= 0, at least one, got {instances!r}"
            )
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {policy!r}")
        if policy == "kv_aware" and index is None:
            raise ValueError("index: kv_aware needs a KVIndex")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size!r}")
        weights = dict(MEDIUM_WEIGHTS, **(medium_weights or {}))
        if set(weights) != set(MEDIUM_WEIGHTS) or not all(
            0.0 <= w <= 1.0 for w in weights.values()
        ):
            raise ValueError(
                f"medium_weights: device/host/remote in [0, 1], got {medium_weights!r}"
            )
        if not load_weight >= 0.0:
            raise ValueError(f"load_weight: must be >= 0, got {load_weight!r}")
        if speculative_ttl is not None and not speculative_ttl > 0.0:
            raise ValueError(f"speculative_ttl: must be > 0 or None, got {speculative_ttl!r}")
        if not isinstance(recompute_weight, (int, float, np.integer, np.floating)):
            raise TypeError(
                f"recompute_weight: must be a number, got {type(recompute_weight).__name__}"
            )
        if isinstance(recompute_weight, (bool, np.bool_)) or not 0.0 <= recompute_weight <= 1.0:
            raise ValueError(f"recompute_weight: must be in [0, 1], got {recompute_weight!r}")
        self.instances = ids
        self.position = {i: k for k, i in enumerate(ids)}
        self.policy = policy
        self.index = index
        self.block_size = block_size
        self.medium_weights = weights
        self.load_weight = float(load_weight)
        self.shared_remote = shared_remote
        self.speculative_ttl = speculative_ttl
        self.recompute_weight = float(recompute_weight)
        self.load = np.zeros(len(ids), dtype=np.float64)  # outstanding prompt tokens
        self.active: dict[Any, tuple[int, int]] = {}  # request id -> (position, tokens)
        self._next = 0  # round robin: the next turn
        self._auto = 0  # the next request id given when the caller gives none

    # ------------------------------------------------------------------------------ cost
    def cached(
        self, token_ids: TokenIds, *, extra_key: bytes | str | None = None, now: float = 0.0
    ) -> np.ndarray:
        """Prompt tokens each instance holds per medium: float64 ``[len(instances), 3]``
        (device, device-or-host, any medium: nested prefixes)."""
        return self._cached(token_ids, extra_key, now)[0]

    def _cached(
        self, token_ids: TokenIds, extra_key: bytes | str | None, now: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """``cached``'s array, and per instance the device KV tokens held past the depth a hit
        restores (counted only with ``recompute_weight``)."""
        out = np.zeros((len(self.instances), 3), dtype=np.float64)
        past = np.zeros(len(self.instances), dtype=np.float64)
        if self.index is None:
            return out, past
        remote = 0.0
        depths = self.recompute_weight > 0.0
        for row in self.index.lookup(token_ids, extra_key=extra_key, now=now, depths=depths):
            instance, _rank, medium, _blocks, tokens = row[:5]
            k = self.position.get(instance)
            if len(row) == 7 and k is not None and medium == "device":  # depths=True rows
                past[k] = max(past[k], row[-1] - tokens)
            if medium == "remote" and self.shared_remote:
                remote = max(remote, tokens)
            if k is None:
                continue
            column = {"device": 0, "host": 1, "remote": 2}[medium]
            out[k, column] = max(out[k, column], tokens)
        out[:, 1] = np.maximum(out[:, 1], out[:, 0])
        out[:, 2] = np.maximum(np.maximum(out[:, 2], out[:, 1]), remote)
        return out, past

    def costs(
        self, token_ids: TokenIds, *, extra_key: bytes | str | None = None, now: float = 0.0
    ) -> np.ndarray:
        """``kv_aware``'s cost of each instance (float64 ``[len(instances)]``)."""
        return self._costs(len(token_ids), *self._cached(token_ids, extra_key, now))

    def _costs(self, prompt: int, cached: np.ndarray, past: np.ndarray) -> np.ndarray:
        w = self.medium_weights
        d, h, r = cached[:, 0], cached[:, 1], cached[:, 2]
        beyond = np.maximum(
            w["host"] * (h - d) + w["remote"] * (r - h), self.recompute_weight * past
        )
        saved = w["device"] * d + beyond
        return (prompt - saved) + self.load_weight * self.load

    # ----------------------------------------------------------------------------- route
    def route(
        self,
        token_ids: TokenIds,
        *,
        extra_key: bytes | str | None = None,
        now: float = 0.0,
        request_id: Any = None,
    ) -> Decision:
        """Picks an instance for a request of ``token_ids`` arriving at ``now``; it counts in
        that instance's load until ``finish(request_id)``. A rejected request (a ValueError or
        TypeError) changes nothing: no round-robin turn, no id, no load, no speculative entry."""
        prompt = len(token_ids)
        auto = request_id is None
        request_id = self._auto if auto else request_id
        if request_id in self.active:
            raise ValueError(f"request_id: {request_id!r} is already routed")
        cached = None
        if self.policy == "round_robin":
            k, cost = self._next % len(self.instances), 0.0
        elif self.policy == "least_loaded":
            k = int(np.argmin(self.load))
            cost = float(self.load[k])
        else:
            cached, past = self._cached(token_ids, extra_key, now)
            costs = self._costs(prompt, cached, past)
            k = int(np.argmin(costs))
            cost = float(costs[k])
        instance = self.instances[k]
        if (
            self.index is not None
            and self.speculative_ttl is not None
            and prompt >= self.block_size
        ):
            # the one step that may still refuse the request (its tokens): before any change
            self.index.insert_speculative(
                instance,
                token_ids,
                block_size=self.block_size,
                now=now,
                ttl=self.speculative_ttl,
                extra_key=extra_key,
            )
        if self.policy == "round_robin":
            self._next += 1
        if auto:
            self._auto += 1
        self.load[k] += prompt
        self.active[request_id] = (k, prompt)
        held = (
            {}
            if cached is None
            else dict(zip(("device", "host", "remote"), (int(x) for x in cached[k]), strict=True))
        )
        return Decision(request_id, instance, cost, prompt, held)

    def finish(self, request_id: Any) -> None:
        """The request left its instance: its tokens no longer count in that instance's load."""
        try:
            k, tokens = self.active.pop(request_id)
        except KeyError:
            raise ValueError(f"request_id: {request_id!r} is not routed") from None
        self.load[k] -= tokens
