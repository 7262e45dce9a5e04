"""benches/engines.py runs: a quick smoke run of the nano-vllm-shaped loop on the
drop-in and the reference, with the schedule equal to the reference's when roomy."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
import engines  # noqa: E402


def test_quick_run_prints_every_row_and_the_roomy_schedule_matches(capsys):
    assert engines.main(["--quick", "--verify"]) == 0
    rows = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 16 ") or line.startswith("| 256 ")
    ]
    assert len(rows) == 8, "2 block sizes x 2 memory settings x 2 managers"
    kvpool_roomy = [r for r in rows if "| roomy |" in r and "| kvpool |" in r]
    assert all(r.rstrip().endswith("| yes |") for r in kvpool_roomy)
