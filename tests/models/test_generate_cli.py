"""``kvpool generate`` (docs/engine.md): a tiny family and a config.json with random weights,
prompts as text (byte fallback without a tokenizer), token-id lists and JSON objects, checked
against the model's own forward (``--check``). Skipped without torch and transformers."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpool.cli import main  # noqa: E402
from kvpool.integrations.transformers.models import tiny_config  # noqa: E402


def write_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(
        "hello paged world\n\n[5, 6, 7, 8, 9, 10, 11, 12, 13]\n"
        '{"prompt": "hello paged world, again"}\n{"token_ids": [1, 2, 3]}\n'
    )
    return str(path)


def test_generate_tiny_family_json_and_check(tmp_path, capsys):
    rc = main(
        [
            "generate",
            "tiny-qwen3",
            "--prompts",
            write_prompts(tmp_path),
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--backend",
            "numpy",
            "--block-size",
            "4",
            "--json",
            "--check",
            "--threads",
            "1",
            "--max-num-seqs",
            "1",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert all(len(r["token_ids"]) == 5 and r["text"] is None for r in rows)
    assert "4 prompts, 20 tokens" in err
    assert "prefix hit tokens 16" in err, (
        "one at a time: the last text prompt hits the first one's 16 bytes"
    )
    assert "greedy tokens equal: True" in err
    worst = float(err.split("worst relative logit difference ")[1].split(";")[0])
    assert worst <= 1e-4


def test_generate_from_a_config_json_with_a_hybrid_model(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_config("qwen3_next").to_dict()))
    rc = main(
        [
            "generate",
            str(config),
            "--prompts",
            write_prompts(tmp_path),
            "--max-tokens",
            "3",
            "--ignore-eos",
            "--backend",
            "numpy",
            "--block-size",
            "4",
            "--checkpoint-interval",
            "8",
            "--check",
            "--threads",
            "1",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert [len(line.split()) for line in out.splitlines()] == [3, 3, 3, 3]
    assert "greedy tokens equal: True" in err


def test_generate_bad_input(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["generate", "tiny-qwen3", "--prompts", str(empty), "--backend", "numpy"]) == 2
    bad = tmp_path / "bad.txt"
    bad.write_text("[1, 2, 100000]\n")
    with pytest.raises(SystemExit, match="vocabulary"):
        main(["generate", "tiny-qwen3", "--prompts", str(bad), "--backend", "numpy"])
    with pytest.raises(SystemExit):
        main(["generate", "tiny-qwen3"])  # --prompts is required
    capsys.readouterr()
