"""The stats dicts and the stubs name the same keys (R20): the bindings build every dict from
the core's one field list per struct (``RankStats``/``HostStats`` visitors), and this
test compares what they build with the TypedDicts of ``_core.pyi``."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpool

STUB = Path(kvpool.__file__).with_name("_core.pyi")


def _typed_dicts() -> dict[str, dict[str, object]]:
    """Keys of every TypedDict of the stub (inherited ones included), with their annotations."""
    tree = ast.parse(STUB.read_text())
    own: dict[str, tuple[list[str], dict[str, object]]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
            fields = {
                n.target.id: ast.unparse(n.annotation)
                for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
            own[node.name] = (bases, fields)

    def keys(name: str) -> dict[str, object]:
        bases, fields = own[name]
        out: dict[str, object] = {}
        for b in bases:
            if b in own:
                out.update(keys(b))
        out.update(fields)
        return out

    return {
        name: keys(name)
        for name in own
        if name.startswith("_") and name.endswith(("Stats", "Counts", "Counters"))
    }


def _check(
    d: dict, typed: dict[str, object], dicts: dict[str, dict[str, object]], where: str
) -> None:
    assert set(d) == set(typed), (where, set(d) ^ set(typed))
    for key, annotation in typed.items():
        inner = str(annotation).split(" | ")[0].replace("list[", "").rstrip("]")
        if inner in dicts and isinstance(d[key], dict):
            _check(d[key], dicts[inner], dicts, f"{where}[{key!r}]")
        elif inner in dicts and isinstance(d[key], list):
            for i, item in enumerate(d[key]):
                _check(item, dicts[inner], dicts, f"{where}[{key!r}][{i}]")


def test_pool_stats_keys_match_the_stub():
    dicts = _typed_dicts()
    for pool in (
        kvpool.BlockManagerPool(16, 4),
        kvpool.BlockManagerPool(16, 4, dp_size=2, sliding_window=8, linear_state_slots=4),
        kvpool.BlockManagerPool(16, 4, dp_size=2, xtensor={"blocks_per_page": 4}),
    ):
        _check(pool.stats(), dicts["_PoolStats"], dicts, "BlockManagerPool.stats()")


def test_hierarchy_stats_keys_match_the_stub():
    dicts = _typed_dicts()
    pool = kvpool.HierarchyBlockManagerPool(16, 8, 4, dp_size=2, sliding_window=8)
    stats = pool.stats()
    typed = {k: v for k, v in dicts["_HierarchyPoolStats"].items() if k != "remote"}
    _check(stats, typed, dicts, "HierarchyBlockManagerPool.stats()")


def test_manager_and_debug_counter_keys_match_the_stub():
    dicts = _typed_dicts()
    _check(kvpool.BlockManager(8, 2).stats(), dicts["_ManagerStats"], dicts, "BlockManager.stats()")
    _check(
        kvpool.ConcurrentBlockManager(8, 2).stats(),
        dicts["_ManagerStats"],
        dicts,
        "ConcurrentBlockManager",
    )
    _check(
        kvpool.BlockManagerPool(8, 2).debug_counters(),
        dicts["_DebugCounters"],
        dicts,
        "debug_counters()",
    )
