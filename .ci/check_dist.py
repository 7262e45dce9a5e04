"""Check what `make wheel` put in dist/: one manylinux abi3 wheel holding only the library, and
the sdist it can be rebuilt from.

    python .ci/check_dist.py dist            # the wheel and the sdist
    python .ci/check_dist.py DIR --wheel     # only a wheel (one built from the sdist)

The wheel's tag must be ``cp3X-abi3-manylinux_*`` (maturin's manylinux compliance check passed:
a plain ``linux_x86_64`` tag means it did not), and every file in it must belong to the
``kvpool`` package or its dist-info, with nothing from ``benches/``, ``tests/`` or a
``kvpool/bench`` package, and no bytecode. Exits 1 naming each problem.
"""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from pathlib import Path

WHEEL_NAME = re.compile(
    r"^kvpool-(?P<version>[^-]+)-cp3\d+-abi3-(?P<platform>manylinux(?:2014|_\d+_\d+)_(?:x86_64|aarch64))\.whl$"
)
# what the package is: the Python sources, the extension module, the stubs, the kernel sources
LIBRARY = re.compile(
    r"^kvpool/(?:[\w/]+\.(?:py|pyi|cu|cuh|h)|py\.typed|_core\.abi3\.so)$|^kvpool-[^/]+\.dist-info/"
)
# what the sdist needs to build the wheel again
SDIST_NEEDS = (
    "pyproject.toml",
    "Cargo.toml",
    "Cargo.lock",
    "rust/kvpool/src/lib.rs",
    "rust/kvpool-py/src/lib.rs",
    "python/kvpool/__init__.py",
    "python/kvpool/_core.pyi",
)


def check_wheel(path: Path) -> list[str]:
    problems = []
    match = WHEEL_NAME.match(path.name)
    if match is None:
        problems.append(
            f"{path.name}: not a cp3X-abi3-manylinux wheel (the compliance check failed?)"
        )
    names = zipfile.ZipFile(path).namelist()
    for name in names:
        if name.endswith("/"):
            continue  # a folder entry
        if not LIBRARY.match(name) or "/bench/" in name or "__pycache__" in name:
            problems.append(f"{path.name}: {name} is not library code")
    if "kvpool/_core.abi3.so" not in names:
        problems.append(f"{path.name}: no kvpool/_core.abi3.so")
    return problems


def check_sdist(path: Path) -> list[str]:
    with tarfile.open(path) as tar:
        top = path.name.removesuffix(".tar.gz")
        names = {m.name.removeprefix(top + "/") for m in tar.getmembers()}
    return [f"{path.name}: {need} is missing" for need in SDIST_NEEDS if need not in names]


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    wheels = sorted(folder.glob("kvpool-*.whl"))
    problems = [] if len(wheels) == 1 else [f"{folder}: {len(wheels)} kvpool wheels, expected 1"]
    for wheel in wheels:
        problems += check_wheel(wheel)
    if "--wheel" not in argv[1:]:
        sdists = sorted(folder.glob("kvpool-*.tar.gz"))
        if len(sdists) != 1:
            problems.append(f"{folder}: {len(sdists)} kvpool sdists, expected 1")
        for sdist in sdists:
            problems += check_sdist(sdist)
    for problem in problems:
        print(f"check_dist: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_dist: OK: {', '.join(p.name for p in sorted(folder.glob('kvpool-*')))}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
