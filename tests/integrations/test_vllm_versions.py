"""The version window of kvpool's vLLM drop-in (kvpool.integrations._vllm_versions), without vLLM.

``check_version`` decides what ``import kvpool.integrations.vllm`` accepts: any 0.33.x or 0.34.x
(releases, pre-releases, local builds); anything else is one ImportError naming the supported
range and the version found. The import itself, under each installed version, is tested in
tests/vllm/test_vllm_versions.py (``make test-vllm``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from kvpool.integrations import _vllm_versions as versions

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "version,minor",
    [
        ("0.33.0", (0, 33)),
        ("0.33.2", (0, 33)),
        ("0.34.0", (0, 34)),
        ("0.34.1+cpu", (0, 34)),
        ("0.34.0rc1", (0, 34)),
        ("0.34.1.dev7+g1234abc", (0, 34)),
    ],
)
def test_supported_versions(version, minor):
    assert versions.check_version(version) == minor


@pytest.mark.parametrize("version", ["0.32.1", "0.35.0", "0.35.0rc1", "1.0.0", "0.3.4", "", "dev"])
def test_any_other_version_is_one_import_error_naming_the_range(version):
    with pytest.raises(ImportError) as error:
        versions.check_version(version)
    message = str(error.value)
    assert "vllm>=0.33,<0.35" in message and f"found vllm {version} " in message


def test_the_extra_installs_the_same_range():
    # pip install "kvpool[vllm]" accepts every version the import accepts, and no other
    extras = re.findall(r"^vllm = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.M)
    assert extras == [f'"vllm{versions.SUPPORTED}"']
    assert re.fullmatch(r">=0\.33,<0\.35", versions.SUPPORTED)


def test_token_ids_reads_both_versions_token_lists():
    from array import array

    plain = [5, 6, 7, 8]
    assert versions.token_ids(plain) is plain  # 0.33's lists: as they are
    buffer = array("i", plain)  # 0.34's TokenBuffer is an int32 array.array
    got = versions.token_ids(buffer, 1)
    assert got.dtype == np.int32 and got.tolist() == [6, 7, 8]
    buffer.append(9)  # no buffer export outlives the call (vLLM appends in place)
    assert versions.token_ids(buffer, 4).tolist() == [9]
    assert versions.token_ids(buffer, 5).tolist() == []
    assert versions.token_ids((1, 2, 3), 1) == [2, 3]
