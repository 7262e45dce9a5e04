"""The Python package's shape, as rust/kvpool/tests/structure.rs checks the core's: no import
circle among the modules of python/kvpool, no file over 800 lines, compatibility shims that only
re-export, and a compiled extension that never imports the package (docs/architecture.md).

The import graph is read from the sources (``ast``), every import statement counted wherever it
stands (inside a function too): ``import a.b`` and ``from a.b import name`` are edges to ``a.b``;
``from a import b`` is an edge to the submodule ``a.b`` when there is one. Importing ``a.b.c``
also runs the ``__init__`` of every package above it, so the edge goes to each of those packages
as well, but for the packages that enclose the importer (they are already being imported when it
runs). A package's node is its ``__init__``: what it re-exports are the package's edges.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "kvpool"
MAX_LINES = 800
# old import paths kept working by re-exports (docs/architecture.md), with their new homes; the
# shims are exempt from the graph
NEW_HOMES = {
    "kvpool.remote": [
        "kvpool.index.streams",
        "kvpool.tiers.base",
        "kvpool.tiers.payload",
        "kvpool.tiers.redis",
        "kvpool.tiers.remote_transfer",
    ],
    "kvpool.router": ["kvpool.index.router"],
    "kvpool.transfer": ["kvpool.tiers.host_transfer"],
    "kvpool.vllm_events": ["kvpool.index.vllm_events"],
    "kvpool.tiers.remote": ["kvpool.tiers.lookup"],
}
SHIMS = set(NEW_HOMES)
SHIM_MAX_LINES = 40


def modules(root: Path, stubs: bool = False) -> dict[str, Path]:
    """Dotted name -> file of every module under ``root`` (a package directory); with ``stubs``,
    the compiled ones too (a ``.pyi`` stub beside no ``.py``: ``kvpool._core``)."""
    out = {}
    for path in sorted([*root.rglob("*.py"), *(root.rglob("*.pyi") if stubs else ())]):
        if path.suffix == ".pyi" and path.with_suffix(".py").exists():
            continue
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _enclosing(name: str) -> list[str]:
    """The packages above ``name``: ``a.b.c`` -> ``a``, ``a.b``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imported(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (file ``path``) imports (see the module doc)."""
    known = set(known)
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, up level - 1
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else base)
    enclosing = set(_enclosing(name))
    edges = {t for t in targets if t in known and t != name}
    for target in targets:  # the packages an import runs first, but those running already
        edges.update(
            p for p in _enclosing(target) if p in known and p not in enclosing and p != name
        )
    return edges


def graph(root: Path, exempt: Iterable[str] = ()) -> dict[str, set[str]]:
    """The import graph of the package at ``root``, without the ``exempt`` modules."""
    known = modules(root, stubs=True)
    exempt = set(exempt)
    return {
        name: imported(name, path, known) - exempt
        for name, path in modules(root).items()
        if name not in exempt
    }


def find_circle(g: dict[str, set[str]]) -> list[str] | None:
    """A circle in ``g``, as its nodes (the first repeated at the end), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if state.get(node) == 2:
            return None
        if state.get(node) == 1:
            return [*path[path.index(node) :], node]
        state[node] = 1
        path.append(node)
        for nxt in sorted(g.get(node, ())):
            circle = visit(nxt)
            if circle is not None:
                return circle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(g):
        circle = visit(node)
        if circle is not None:
            return circle
    return None


def oversized(root: Path, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """Every ``.py`` file under ``root`` over ``limit`` lines (``_core.pyi``, a stub, is not one)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out.append((str(path.relative_to(root.parent)), lines))
    return out


# ---------------------------------------------------------------------------------- the package
def test_no_import_circle_among_the_packages_modules():
    g = graph(PACKAGE, SHIMS)
    assert "kvpool.sim.engine" in g and "kvpool.sim.decode" in g["kvpool.sim.engine"], g
    assert "kvpool.tiers.hierarchy" in g["kvpool"], g["kvpool"]
    circle = find_circle(g)
    assert circle is None, "import circle in python/kvpool: " + " -> ".join(circle or ())


def test_no_file_over_800_lines():
    assert oversized(PACKAGE) == []


def test_the_shims_only_re_export():
    found = modules(PACKAGE)
    assert SHIMS <= set(found), SHIMS - set(found)
    for name in SHIMS:
        path = found[name]
        assert len(path.read_text().splitlines()) <= SHIM_MAX_LINES, name
        for stmt in ast.parse(path.read_text()).body:
            docstring = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            all_list = isinstance(stmt, ast.Assign) and [
                t.id for t in stmt.targets if isinstance(t, ast.Name)
            ] == ["__all__"]
            assert docstring or all_list or isinstance(stmt, ast.ImportFrom), (
                f"{name}: {ast.dump(stmt)[:80]}"
            )
    # nothing of the package imports a shim: every module uses the new homes
    known = modules(PACKAGE, stubs=True)
    for name, path in found.items():
        if name not in SHIMS:
            assert not imported(name, path, known) & SHIMS, f"{name} imports a compatibility shim"


def test_the_old_import_paths_give_the_same_objects():
    """Each shim re-exports, under the old path, the very objects of the new homes."""
    import importlib

    for name, homes in sorted(NEW_HOMES.items()):
        shim = importlib.import_module(name)
        modules = [importlib.import_module(home) for home in homes]
        assert shim.__all__, name
        for attr in shim.__all__:
            assert any(getattr(m, attr, None) is getattr(shim, attr) for m in modules), (name, attr)
    import kvpool
    import kvpool.tiers.hierarchy

    assert kvpool.HierarchyBlockManagerPool is kvpool.tiers.hierarchy.HierarchyBlockManagerPool


def test_the_compiled_extension_never_imports_the_package():
    """Every walk goes Python -> bindings -> core: no binding file imports a Python module."""
    sources = sorted((ROOT / "rust" / "kvpool-py" / "src").glob("*.rs"))
    assert len(sources) > 5
    for path in sources:
        code = "\n".join(line.split("//")[0] for line in path.read_text().splitlines())
        assert ".import(" not in code and "PyModule::import" not in code, path.name


# ---------------------------------------------------------------------------------- the checks
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_circle_finder_finds_circles_through_function_imports(tmp_path):
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg.b import x\n",
            "b.py": "x = 1\n",
            "c.py": "def f():\n    from pkg import a  # a submodule: an edge to pkg.a\n",
            "d.py": "from pkg._ext import f\nfrom pkg import _ext\n",
            "_ext.pyi": "def f() -> None: ...\n",
        },
    )
    g = graph(root)
    assert g == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": set(),
        "pkg.c": {"pkg.a"},
        "pkg.d": {"pkg._ext"},
    }
    assert find_circle(g) is None
    (root / "b.py").write_text("def g():\n    import pkg.c\n")
    assert find_circle(graph(root)) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert find_circle(graph(root, exempt={"pkg.c"})) is None


def test_a_packages_re_exports_are_its_edges(tmp_path):
    root = _package(
        tmp_path,
        {
            "__init__.py": "from pkg.sub.m import M\n",
            "sub/__init__.py": "from pkg.sub.n import N\n",
            "sub/m.py": "M = 1\n",
            "sub/n.py": "import pkg\nN = 2\n",
        },
    )
    g = graph(root)
    # pkg imports pkg.sub.m, which runs pkg.sub's __init__ first: pkg -> pkg.sub -> pkg.sub.n -> pkg
    assert g["pkg"] == {"pkg.sub", "pkg.sub.m"} and g["pkg.sub"] == {"pkg.sub.n"}, g
    assert g["pkg.sub.n"] == {"pkg"}, g  # an explicit import of an enclosing package is an edge
    assert find_circle(g) == ["pkg", "pkg.sub", "pkg.sub.n", "pkg"]


def test_oversized_files_are_found(tmp_path):
    root = _package(
        tmp_path, {"__init__.py": "", "small.py": "x = 1\n" * 10, "big.py": "x = 1\n" * 801}
    )
    (root / "_core.pyi").write_text("x: int\n" * 5000)
    assert oversized(root) == [("pkg/big.py", 801)]
