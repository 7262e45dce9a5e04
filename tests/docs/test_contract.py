"""docs/contract.md is the contract the code cites: every rule number cited in the repository
("R16", "K5", or a test named ``test_r16_...``) is defined there, and the rules R1-R29 and K1-K8
are each defined exactly once, with no gap."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "docs" / "contract.md"
SCANNED = ("rust", "python", "tests", "docs", "benches", "examples")
SUFFIXES = {".rs", ".py", ".pyi", ".md", ".cu", ".cuh", ".h", ".toml", ".txt"}
SKIP_PARTS = {"target", "__pycache__", ".venv", "fixtures"}
NUMBERS = {"R": 29, "K": 8}

# a rule is defined by a paragraph that opens with its bold number: "**R16. ...**"
DEFINITION = re.compile(r"^\*\*([RK])(\d+)\.", re.MULTILINE)
# a citation: "R16" as a word (ranges "R22-R25" name both ends)
CITATION = re.compile(r"(?<![A-Za-z0-9_])([RK])(\d+)(?![A-Za-z0-9_])")
# a test or Rust function named after rules: test_r16_r17_..., fn r15_can_allocate_...
NAME = re.compile(r"\b(?:def|fn)\s+(\w+)")
NAME_PART = re.compile(r"(?:^|_)([rk])(\d+)(?=_|$)")


def definitions() -> list[str]:
    return [f"{kind}{n}" for kind, n in DEFINITION.findall(CONTRACT.read_text(encoding="utf-8"))]


def scanned_files() -> list[Path]:
    files = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).parts
            if path.is_file() and path.suffix in SUFFIXES and not SKIP_PARTS & set(rel):
                files.append(path)
    return files


def citations() -> dict[str, set[str]]:
    """Rule number -> the files that cite it."""
    cited: dict[str, set[str]] = {}
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        found = {f"{k}{n}" for k, n in CITATION.findall(text)}
        for name in NAME.findall(text):
            found |= {f"{k.upper()}{n}" for k, n in NAME_PART.findall(name)}
        for rule in found:
            cited.setdefault(rule, set()).add(str(path.relative_to(ROOT)))
    return cited


def test_every_rule_is_defined_once_without_gaps():
    defined = definitions()
    expected = [f"{kind}{n}" for kind, top in NUMBERS.items() for n in range(1, top + 1)]
    assert sorted(defined) == sorted(expected), (
        f"missing {sorted(set(expected) - set(defined))}, "
        f"unexpected {sorted(set(defined) - set(expected))}"
    )
    assert len(defined) == len(set(defined)), "a rule is defined twice"


def test_every_cited_rule_is_in_the_contract():
    defined = set(definitions())
    cited = citations()
    assert len(cited) >= 30, "the scan found almost no citations: is the pattern broken?"
    unknown = {rule: sorted(files) for rule, files in cited.items() if rule not in defined}
    assert not unknown, f"cited but not defined in docs/contract.md: {unknown}"


@pytest.mark.parametrize(
    ("text", "rules"),
    [
        ("see R16 and K5", {"R16", "K5"}),
        ("rules R22-R25", {"R22", "R25"}),
        ("(R7)", {"R7"}),
        ("RR7 R7x xR7 R_7 R7_", set()),
        ("def test_r16_r17_batch():", {"R16", "R17"}),
        ("fn r15_can_allocate() {}", {"R15"}),
        ("def test_error_names_arg():", set()),
    ],
)
def test_the_scan_finds_citations(text, rules):
    found = {f"{k}{n}" for k, n in CITATION.findall(text)}
    for name in NAME.findall(text):
        found |= {f"{k.upper()}{n}" for k, n in NAME_PART.findall(name)}
    assert found == rules
